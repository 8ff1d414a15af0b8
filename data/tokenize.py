"""Tokenize a text corpus into token shards + manifest.json (the format dataset.py reads).

    python data/tokenize.py --input 'corpus/*.jsonl' --out DIR [--encoding cl100k_base]
    python data/tokenize.py --hf_dataset NAME --out DIR       (needs `datasets` + network)
    python data/tokenize.py --hf_dataset parquet --hf_data_files 'dump/*.parquet' --out DIR
    python data/tokenize.py ... --out gs://bucket/prefix --ray auto    (on a Ray cluster)

Documents: a .jsonl file holds one per line (its --text_field); any other file is one
document; .gz files are read decompressed; directories are searched for files. Every
document is followed by the end-of-text token. The first documents, until they hold
--val_tokens tokens, form the val split; the rest is train. Each split is cut into shards
of --shard_tokens tokens (its last shard shorter). Worker processes do the encoding.

Resumable: shards are written atomically, and after each one progress.json records where
the token stream stands (document index, offset into that document) and which documents
every finished shard holds. Rerunning the same command after an interruption continues
from there and writes exactly what an uninterrupted run would have. manifest.json is
written last.

With --ray ADDRESS (a running cluster's address, `auto` for the one this machine is part
of, `local` to start one in this process) Ray tasks spread over the cluster do the
encoding and the writing instead (data/tokenize_ray.py), to the same bytes; --out may then
be gs://bucket/prefix. Start a cluster on a pod with ./launcher.sh ... --ray-start.
"""

import os
import sys

if __name__ == "__main__" and not __package__:
    # Run as a file: its folder comes first on the path, where the repo's modules do not
    # import and this file shadows the standard library's `tokenize`. Run it again as the
    # module data.tokenize, the repo's root on the path.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    os.execve(sys.executable, [sys.executable, "-m", "data.tokenize", *sys.argv[1:]], {**os.environ, "PYTHONPATH": path})

import argparse
import collections
import glob
import gzip
import itertools
import json
import multiprocessing
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
from tqdm import tqdm

import dataset  # noqa: E402

PROGRESS = "progress.json"
DOCS_PER_TASK = 64              # documents per message to a worker: amortizes the pickling
TASKS_IN_FLIGHT_PER_WORKER = 2  # keeps workers busy while bounding memory on any corpus size
# 100M tokens = 200 MB (uint16) or 400 MB (uint32) per shard: few files, each download large
# enough to run at full speed yet small enough to prefetch while the previous one is read.
SHARD_TOKENS = 100_000_000
# 10M held-out tokens: plenty for a low-noise validation loss.
VAL_TOKENS = 10_000_000
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")


# ---- Documents

def expand_inputs(patterns: list[str]) -> list[str]:
    """Globs and directories -> a sorted list of files (the document order)."""
    files = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern, recursive=True))
        if not matches:
            raise FileNotFoundError(f"--input {pattern!r} matches no file")
        for match in matches:
            if os.path.isdir(match):
                files += sorted(str(p) for p in Path(match).rglob("*") if p.is_file())
            else:
                files.append(match)
    return files


def iter_file_documents(files: list[str], text_field: str) -> Iterator[str]:
    for path in files:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            if not path.endswith(JSONL_SUFFIXES):
                yield f.read()
                continue
            for line_number, line in enumerate(f, 1):
                if line.strip():
                    yield _text_of(json.loads(line), text_field, where=f"{path}:{line_number}")


def hf_documents(name: str, config: str | None, split: str, text_field: str,
                 data_files: list[str] | None = None) -> Iterator[str]:
    """Stream a Hugging Face dataset (from the hub, or a builder such as "parquet" or "json"
    over data_files); opened here, so that a failure comes before any output."""
    try:
        import datasets
    except ImportError:
        raise SystemExit("--hf_dataset needs the Hugging Face `datasets` package "
                         "(pip install datasets) and network access to huggingface.co") from None
    import huggingface_hub
    # no retry chatter or logged errors before the one-line error
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    huggingface_hub.logging.set_verbosity(huggingface_hub.logging.CRITICAL)
    try:
        stream = datasets.load_dataset(name, config, split=split, streaming=True, data_files=data_files)
    except (OSError, ConnectionError, ValueError) as e:
        why = " ".join(str(e).split()).rstrip(".")
        if data_files:
            raise SystemExit(f"error: could not load {name!r} from {data_files}: {why}") from e
        raise SystemExit(f"error: could not stream {name!r} from the Hugging Face hub: {why}. Without "
                         "network access, export it to JSONL or parquet elsewhere and pass --input "
                         "or --hf_dataset parquet --hf_data_files.") from e
    return _stream_texts(stream, name, text_field)


def _stream_texts(stream, name: str, text_field: str) -> Iterator[str]:
    records = enumerate(stream)
    while True:
        try:
            i, record = next(records)
        except StopIteration:
            return
        except (OSError, ValueError) as e:  # e.g. a file that is not parquet, a dropped connection
            raise SystemExit(f"error: reading {name!r}: {' '.join(str(e).split())}") from None
        yield _text_of(record, text_field, where=f"{name} record {i}")


def count_file_documents(files: list[str]) -> int:
    """How many documents iter_file_documents will yield (for the progress bar's ETA):
    one quick pass over the files, far cheaper than encoding them."""
    count = 0
    for path in files:
        if not path.endswith(JSONL_SUFFIXES):
            count += 1
            continue
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            count += sum(1 for line in f if line.strip())
    return count


def _text_of(record: dict, text_field: str, where: str) -> str:
    if not isinstance(record.get(text_field), str):
        raise ValueError(f"{where}: no string field {text_field!r} (fields: {list(record)}); "
                         "choose the field with --text_field")
    return record[text_field]


# ---- Encoding in worker processes

_worker_tokenizer = None


def _init_worker(tokenizer: dataset.Tokenizer) -> None:
    global _worker_tokenizer  # one tokenizer per worker process, sent once
    _worker_tokenizer = tokenizer


def _encode_documents(texts: list[str]) -> list[np.ndarray]:
    eot = _worker_tokenizer.eot_id
    return [np.array(_worker_tokenizer.encode(text) + [eot], dtype=np.uint32) for text in texts]


def encode_in_workers(documents: Iterable[str], tokenizer: dataset.Tokenizer,
                      workers: int) -> Iterator[np.ndarray]:
    """Each document's tokens + end-of-text, in document order, encoded by `workers` processes."""
    chunks = iter(lambda: list(itertools.islice(documents, DOCS_PER_TASK)), [])
    with multiprocessing.Pool(workers, initializer=_init_worker, initargs=(tokenizer,)) as pool:
        in_flight = collections.deque()
        for texts in chunks:
            in_flight.append(pool.apply_async(_encode_documents, (texts,)))
            if len(in_flight) >= TASKS_IN_FLIGHT_PER_WORKER * workers:
                yield from in_flight.popleft().get()
        while in_flight:
            yield from in_flight.popleft().get()


# ---- Progress record and shard cutting

def load_progress(out_dir: str, settings: dict) -> dict:
    path = os.path.join(out_dir, PROGRESS)
    if not os.path.exists(path):
        if os.path.exists(os.path.join(out_dir, dataset.MANIFEST)):
            raise SystemExit(f"{out_dir} already holds a data directory made elsewhere "
                             f"(no {PROGRESS}); choose another --out")
        return {"settings": settings, "split": "val", "next_doc": 0, "next_offset": 0,
                "splits": {"val": [], "train": []}, "done": False}
    with open(path) as f:
        progress = json.load(f)
    if progress["settings"] != settings:
        raise SystemExit(f"{out_dir} holds a run with other settings:\n  {progress['settings']}\n"
                         f"this run:\n  {settings}\nRerun with the same flags, or use a new --out.")
    return progress


def save_progress(out_dir: str, progress: dict) -> None:
    path = os.path.join(out_dir, PROGRESS)
    with open(f"{path}.tmp", "w") as f:
        json.dump(progress, f, indent=1)
    os.replace(f"{path}.tmp", path)  # atomic: a kill leaves the old record or the new one


class ShardCutter:
    """Cuts the token stream into fixed-size shards; after each shard, records the restart point.

    The restart point (document, offset) is where the next shard's first token comes from.
    Tokens after it are only in memory, so an interrupted run loses nothing by redoing them.
    """

    def __init__(self, out_dir: str, tokenizer: dataset.Tokenizer, shard_tokens: int, progress: dict):
        self.out_dir, self.tokenizer, self.shard_tokens = out_dir, tokenizer, shard_tokens
        self.progress = progress
        self.pieces, self.buffered = [], 0

    def add(self, doc: int, tokens: np.ndarray, offset: int) -> None:
        """Append document `doc`'s tokens from `offset` on, writing every shard that fills."""
        while offset < len(tokens):
            take = min(self.shard_tokens - self.buffered, len(tokens) - offset)
            self.pieces.append(tokens[offset:offset + take])
            self.buffered += take
            offset += take
            if self.buffered == self.shard_tokens:
                self.flush(end=(doc, offset) if offset < len(tokens) else (doc + 1, 0))

    def split_tokens(self) -> int:
        """Tokens of the current split so far, written or buffered."""
        split = self.progress["split"]
        return sum(entry["tokens"] for entry in self.progress["splits"][split]) + self.buffered

    def flush(self, end: tuple[int, int], next_split: str | None = None) -> None:
        """Write the buffered tokens as a shard (if any) and record progress in one step."""
        split = self.progress["split"]
        shards = self.progress["splits"][split]
        if self.buffered:
            entry = dataset.write_shard(self.out_dir, f"{split}_{len(shards):06d}.npy",
                                        np.concatenate(self.pieces), self.tokenizer.vocab_size)
            entry["start"] = [self.progress["next_doc"], self.progress["next_offset"]]
            entry["end"] = list(end)
            shards.append(entry)
        self.progress["next_doc"], self.progress["next_offset"] = end
        self.progress["split"] = next_split or split
        save_progress(self.out_dir, self.progress)
        self.pieces, self.buffered = [], 0


def tokenize_corpus(documents: Iterable[str], out_dir: str, tokenizer: dataset.Tokenizer,
                    settings: dict, shard_tokens: int, val_tokens: int, workers: int) -> dict:
    """Tokenize `documents` into out_dir, resuming a previous run there; return the manifest.

    `documents` must yield the same documents in the same order on every run; `settings`
    (flags, input files) must match the interrupted run's.
    """
    if shard_tokens <= 0 or val_tokens <= 0:
        raise ValueError("--shard_tokens and --val_tokens must be positive")
    os.makedirs(out_dir, exist_ok=True)
    progress = load_progress(out_dir, settings)
    if progress["done"]:
        print(f"{out_dir} is already complete")
        with open(os.path.join(out_dir, dataset.MANIFEST)) as f:
            return json.load(f)
    cutter = ShardCutter(out_dir, tokenizer, shard_tokens, progress)
    start_doc, start_offset = progress["next_doc"], progress["next_offset"]
    done_tokens = sum(e["tokens"] for shards in progress["splits"].values() for e in shards)
    remaining = itertools.islice(iter(documents), start_doc, None)
    bar = tqdm(unit="tok", unit_scale=True, initial=done_tokens, desc="tokenizing")
    end_doc = start_doc  # one past the last document read
    for doc, tokens in enumerate(encode_in_workers(remaining, tokenizer, workers), start=start_doc):
        offset = start_offset if doc == start_doc else 0
        cutter.add(doc, tokens, offset)
        bar.update(len(tokens) - offset)
        end_doc = doc + 1
        if progress["split"] == "val" and cutter.split_tokens() >= val_tokens:
            cutter.flush(end=(end_doc, 0), next_split="train")
    bar.close()
    if progress["split"] == "val":
        raise SystemExit(f"the corpus has only {cutter.split_tokens()} tokens, all of them taken "
                         f"for val (--val_tokens={val_tokens}); lower --val_tokens or add text")
    cutter.flush(end=(end_doc, 0))
    if not progress["splits"]["train"]:
        raise SystemExit("no documents left for train after val; lower --val_tokens or add text")
    manifest = dataset.write_manifest(out_dir, progress["splits"], tokenizer.name, tokenizer.vocab_size,
                                      tokenizer.eot_id, source=settings)
    progress["done"] = True
    save_progress(out_dir, progress)
    return manifest


# -----------------------------------------------------------------------------

def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", default=[], help="files, globs or directories")
    parser.add_argument("--hf_dataset", default="", help="Hugging Face dataset name (streamed), or a "
                        "builder such as parquet or json with --hf_data_files")
    parser.add_argument("--hf_config", default=None)
    parser.add_argument("--hf_split", default="train")
    parser.add_argument("--hf_data_files", nargs="+", default=[], help="local files for --hf_dataset")
    parser.add_argument("--text_field", default="text", help="JSON field holding the text")
    parser.add_argument("--out", required=True, help="output data directory (gs://bucket/prefix with --ray)")
    parser.add_argument("--encoding", default="cl100k_base", help="tiktoken encoding name, or 'bytes'")
    parser.add_argument("--encoding_file", default="", help="local .tiktoken rank file (offline)")
    parser.add_argument("--shard_tokens", type=int, default=SHARD_TOKENS)
    parser.add_argument("--val_tokens", type=int, default=VAL_TOKENS,
                        help="the first documents, until they hold this many tokens, form val")
    parser.add_argument("--workers", type=int, default=os.cpu_count(),
                        help="processes (or, with --ray local, the local cluster's CPUs)")
    parser.add_argument("--ray", default="", metavar="ADDRESS",
                        help="tokenize on a Ray cluster: HOST:PORT, auto (the one this machine is in) "
                             "or local (start one here)")
    parser.add_argument("--docs_per_task", type=int, default=256,
                        help="with --ray: documents per Ray task (does not change the output)")
    args = parser.parse_args()
    if bool(args.input) == bool(args.hf_dataset):
        parser.error("give exactly one of --input and --hf_dataset")
    if args.hf_data_files and not args.hf_dataset:
        parser.error("--hf_data_files goes with --hf_dataset (e.g. --hf_dataset parquet)")
    if args.out.startswith("gs://") and not args.ray:
        parser.error("--out gs://... needs --ray (--ray local on one machine), or tokenize to a "
                     "directory and upload it with data/upload_gcs.py")

    tokenizer = dataset.get_tokenizer(args.encoding, args.encoding_file)
    total_docs = None
    try:
        data_files = expand_inputs(args.hf_data_files) if args.hf_data_files else None
    except FileNotFoundError as e:
        raise SystemExit(f"error: {str(e).replace('--input', '--hf_data_files', 1)}") from None
    if args.hf_dataset:
        documents = hf_documents(args.hf_dataset, args.hf_config, args.hf_split, args.text_field, data_files)
        source = {"hf_dataset": args.hf_dataset, "hf_config": args.hf_config, "hf_split": args.hf_split}
        if data_files:
            source["hf_data_files"] = data_files
    else:
        try:
            files = expand_inputs(args.input)
        except FileNotFoundError as e:
            raise SystemExit(f"error: {e}") from None
        documents = iter_file_documents(files, args.text_field)
        source = {"inputs": files}
        total_docs = count_file_documents(files) if args.ray else None
    settings = {**source, "text_field": args.text_field, "tokenizer": tokenizer.name,
                "vocab_size": tokenizer.vocab_size, "shard_tokens": args.shard_tokens,
                "val_tokens": args.val_tokens}
    if args.ray:
        from data import tokenize_ray  # imported only with --ray: it imports ray, a heavy optional dependency
        try:
            manifest = tokenize_ray.tokenize_corpus(documents, args.out, tokenizer, settings, args.shard_tokens,
                                                    args.val_tokens, args.ray, max(1, args.workers), total_docs,
                                                    args.docs_per_task)
        except tokenize_ray.TokenizeError as e:
            raise SystemExit(f"error: {e}") from None
    else:
        manifest = tokenize_corpus(documents, args.out, tokenizer, settings,
                                   args.shard_tokens, args.val_tokens, max(1, args.workers))
    for split, shards in manifest["splits"].items():
        print(f"{split}: {sum(e['tokens'] for e in shards):,} tokens in {len(shards)} shards")


if __name__ == "__main__":
    main()
