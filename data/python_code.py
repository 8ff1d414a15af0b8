"""The embedded code corpus `code`: the Python standard library's own `.py` files, as byte tokens.

The files are those of the running interpreter's standard library (sysconfig's "stdlib" path), so the corpus is the same
on every machine with the same Python version and differs between versions; the manifest records which (Python 3.11.7:
393 files, 7.9 MB, 7.4M train and 0.45M val tokens). Left out: tests (test/, tests/, idle_test/), the GUI and demo packages
(idlelib, tkinter, turtledemo), generated tables (pydoc_data, encodings), the deprecated lib2to3 and distutils, and
installed packages (site-packages). The rest, sorted by path, is taken until MAX_BYTES. Each file becomes a `# <path>`
line and its text, followed by the end-of-text token; files whose path hashes to 0 modulo VAL_EVERY (about 5%) are held
out as the validation split.

    python data/python_code.py --out DIR
"""

import os
import sys

if __name__ == "__main__" and not __package__:
    # Run as a file, data/ leads the path and the repo's modules do not import: rerun as a module from the root.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    os.execve(sys.executable, [sys.executable, "-m", "data.python_code", *sys.argv[1:]], {**os.environ, "PYTHONPATH": path})

import argparse
import platform
import sysconfig
import zlib
from pathlib import Path


from data import shards

LEFT_OUT = frozenset({"test", "tests", "idle_test", "idlelib", "tkinter", "turtledemo", "pydoc_data", "encodings", "lib2to3",
                      "distutils", "site-packages", "dist-packages", "__pycache__"})
MAX_BYTES = 8_000_000  # about Shakespeare's size, so that neither corpus dwarfs the other on disk or in an epoch
VAL_EVERY = 20  # crc32(path) % VAL_EVERY == 0: held out (a hash, so a file's split does not move when others come or go)
SHARD_TOKENS = 1_000_000  # several shards per split, as for shakespeare


def library_files() -> list[tuple[str, Path]]:
    """(path relative to the library, file) of the corpus's files, in order, within MAX_BYTES."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = sorted((p.relative_to(root).as_posix(), p) for p in root.rglob("*.py")
                   if not LEFT_OUT & set(p.relative_to(root).parts[:-1]))
    files, total = [], 0
    for name, path in found:
        size = path.stat().st_size
        if total + size > MAX_BYTES:
            break
        files.append((name, path))
        total += size
    if not files:
        raise FileNotFoundError(f"no .py files under {root}: this Python has no standard library sources to read")
    return files


def prepare(out_dir: str) -> dict[str, int]:
    """Write the train/val byte-token shards and manifest into out_dir; tokens per split."""
    files = library_files()
    texts = {split: [f"# {name}\n" + path.read_text(encoding="utf-8", errors="replace") for name, path in files
                     if (zlib.crc32(name.encode()) % VAL_EVERY == 0) == (split == "val")] for split in ("train", "val")}
    return shards.write_byte_corpus(out_dir, texts, SHARD_TOKENS,
                                    source=f"Python {platform.python_version()} standard library ({len(files)} .py files)")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory to write shards + manifest.json into")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for split, n in prepare(args.out).items():
        print(f"{split}: {n:,} tokens")


if __name__ == "__main__":
    main()
