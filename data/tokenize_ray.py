"""Tokenize on a Ray cluster: the same shards as data/tokenize.py's process pool, byte for byte.

    python data/tokenize.py --input ... --out DIR|gs://bucket/prefix --ray ADDRESS|auto|local

The driver reads the documents in order (local files, or a Hugging Face dataset streamed
through `datasets`) and hands out batches of DOCS_PER_TASK documents to `encode_batch`
tasks. Each task returns two objects: the batch's token counts (small: the driver fetches
them) and its tokens (left in the object store). Knowing every document's length, in
document order, the driver cuts the token stream exactly as the process pool does
(ShardPlanner) and sends each shard's slices of batches to a `write_shard` task, which
writes the .npy file (or uploads it to gs://) where the tokens are. So a shard's bytes
depend only on the documents, the tokenizer and the flags: never on which worker encoded
what or which task finished first.

Resumable: progress.json (same format as the process pool's) records, in shard order,
every shard whose write has finished; a rerun after a killed driver continues from the
last one (shards written beyond it are written again with identical bytes, or on gs://
skipped when the object already holds them). A killed worker node costs nothing but
time: Ray retries its tasks and rebuilds lost batches from their lineage. manifest.json
is written last.
"""

import base64
import collections
import dataclasses
import hashlib
import io
import itertools
import json
import os
import resource
import socket
import tempfile
import time
from pathlib import Path
from typing import Iterable

import numpy as np
import ray
from tqdm import tqdm

import dataset
from data import gcs_shards

REPO = Path(__file__).resolve().parent.parent
PROGRESS = "progress.json"
# Documents per task (--docs_per_task): large enough that Ray's per-task overhead (~1 ms)
# is small next to the encoding (~0.1 s for 256 documents of a few KB), small enough to
# spread a few-MB corpus over every worker. It does not change the output.
DOCS_PER_TASK = 256
TASKS_IN_FLIGHT_PER_CPU = 2  # keeps every CPU busy while bounding the object store's use
TASK_RETRIES = 5             # a task on a node that dies is run again elsewhere
# Variables the workers need to reach Cloud Storage: Ray workers inherit the environment
# of `ray start`, not the driver's, so they are passed along explicitly.
FORWARDED_ENV = ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT",
                 "MESHFORMER_GCS_BACKOFF_S")
# Not shipped to the workers with the code (runtime_env working_dir): outputs and caches.
CODE_EXCLUDES = [".git", "data_cache", "runs", "wandb", "public", "__pycache__", "*.npy", ".pytest_cache"]


class TokenizeError(Exception):
    """A user error: printed as one line, `error: ...`, by data/tokenize.py."""


# ---- Where the output goes: a local directory or gs://bucket/prefix

class LocalOut:
    def __init__(self, path: str):
        self.path = os.path.abspath(path)  # workers do not run in the driver's directory
        self.is_local = True

    def read_text(self, name: str) -> str | None:
        path = os.path.join(self.path, name)
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return f.read()

    def write_text(self, name: str, text: str) -> None:
        os.makedirs(self.path, exist_ok=True)
        path = os.path.join(self.path, name)
        with open(f"{path}.tmp", "w") as f:
            f.write(text)
        os.replace(f"{path}.tmp", path)  # atomic: a kill leaves the old file or the new one

    def write_shard(self, name: str, tokens: np.ndarray, vocab_size: int) -> dict:
        os.makedirs(self.path, exist_ok=True)
        return dataset.write_shard(self.path, name, tokens, vocab_size)

    def remove_stale_temp_files(self) -> None:
        """Half-written shards of a killed run (dataset.write_shard's temp files)."""
        for path in Path(self.path).glob("*.npy.tmp*"):
            path.unlink(missing_ok=True)


class GcsOut:
    """gs://bucket/prefix. Each object appears whole or not at all (a Cloud Storage upload
    is atomic), so a shard never shows half-written."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.bucket_name, self.prefix = gcs_shards.split_gcs_url(url)
        self.is_local = False
        self._bucket = None

    def __getstate__(self):  # sent to workers: each makes its own client
        return {**self.__dict__, "_bucket": None}

    def bucket(self):
        if self._bucket is None:
            self._bucket = gcs_shards.gcs_client().bucket(self.bucket_name)
        return self._bucket

    def _blob(self, name: str):
        return self.bucket().blob(f"{self.prefix}/{name}" if self.prefix else name)

    def _retry(self, action, what: str):
        return gcs_shards.with_retries(action, f"{what} {self.url}", gcs_shards.gcs_transient_errors(),
                                    gcs_shards.GCS_RETRIES, gcs_shards.GCS_BACKOFF_S)

    def read_text(self, name: str) -> str | None:
        from google.api_core.exceptions import NotFound
        blob = self._blob(name)
        try:
            return self._retry(lambda: blob.download_as_bytes(retry=None), f"download {name} from").decode()
        except NotFound:
            return None

    def write_text(self, name: str, text: str) -> None:
        blob = self._blob(name)
        self._retry(lambda: blob.upload_from_string(text.encode(), retry=None), f"upload {name} to")

    def write_shard(self, name: str, tokens: np.ndarray, vocab_size: int) -> dict:
        """The bytes dataset.write_shard would write; uploaded unless the object holds them."""
        dataset.check_token_range(tokens, vocab_size, where=name)
        buffer = io.BytesIO()
        np.save(buffer, tokens.astype(dataset.shard_dtype(vocab_size)))
        data = buffer.getvalue()
        md5 = base64.b64encode(hashlib.md5(data).digest()).decode()
        object_name = f"{self.prefix}/{name}" if self.prefix else name
        there = self._retry(lambda: self.bucket().get_blob(object_name, retry=None), f"look up {name} in")
        if there is None or there.md5_hash != md5:  # else: complete from an earlier run
            blob = self._blob(name)
            self._retry(lambda: blob.upload_from_string(data, retry=None), f"upload {name} to")
        return {"file": name, "tokens": int(tokens.size), "sha256": hashlib.sha256(data).hexdigest()}


def open_out(out: str) -> LocalOut | GcsOut:
    return GcsOut(out) if out.startswith("gs://") else LocalOut(out)


def load_progress(out: LocalOut | GcsOut, settings: dict) -> dict:
    """The progress record in `out` (the process pool's format), or a fresh one."""
    text = out.read_text(PROGRESS)
    if text is None:
        if out.read_text(dataset.MANIFEST) is not None:
            raise TokenizeError(f"{out_name(out)} already holds a data directory made elsewhere "
                                f"(no {PROGRESS}); choose another --out")
        return {"settings": settings, "split": "val", "next_doc": 0, "next_offset": 0,
                "splits": {"val": [], "train": []}, "done": False}
    progress = json.loads(text)
    if progress["settings"] != settings:
        differ = sorted(k for k in settings.keys() | progress["settings"].keys()
                        if settings.get(k) != progress["settings"].get(k))
        raise TokenizeError(f"{out_name(out)} holds a run with other settings (differing: "
                            f"{', '.join(differ)}); rerun with the same flags, or use a new --out")
    return progress


def save_progress(out: LocalOut | GcsOut, progress: dict) -> None:
    out.write_text(PROGRESS, json.dumps(progress, indent=1))


def out_name(out: LocalOut | GcsOut) -> str:
    return out.path if out.is_local else out.url


# ---- Tasks

_tokenizers = {}  # one deserialized tokenizer per worker process (a BPE takes a while to build)


@ray.remote(num_returns=2, max_retries=TASK_RETRIES)
def encode_batch(tokenizer_box: list, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(token count of each document, all their tokens): every document + end-of-text."""
    (ref,) = tokenizer_box  # boxed, so that Ray hands over the reference, not the value
    if ref.hex() not in _tokenizers:
        _tokenizers[ref.hex()] = ray.get(ref)
    tokenizer = _tokenizers[ref.hex()]
    docs = [np.array(tokenizer.encode(text) + [tokenizer.eot_id], dtype=np.uint32) for text in texts]
    return np.array([len(d) for d in docs], dtype=np.int64), np.concatenate(docs)


@ray.remote(max_retries=TASK_RETRIES)
def write_shard(out: LocalOut | GcsOut, name: str, vocab_size: int, slices: list, *batches) -> dict:
    """Concatenate slices (lo, hi) of the given batches' tokens and write them as one shard."""
    tokens = np.concatenate([batch[lo:hi] for batch, (lo, hi) in zip(batches, slices)])
    return out.write_shard(name, tokens, vocab_size)


# ---- Cutting the token stream into shards, from document lengths alone

@dataclasses.dataclass
class ShardPlan:
    """One step of data/tokenize.py's ShardCutter.flush: a shard (or, with file None, only
    a new restart point and split), with the token slices of the batches it is made of."""
    split: str
    file: str | None
    pieces: list  # [(tokens ObjectRef, lo, hi)]
    start: tuple[int, int]
    end: tuple[int, int]
    next_split: str


class ShardPlanner:
    """Cuts exactly where ShardCutter and tokenize_corpus cut: shards of shard_tokens within
    a split, and val ends after the first document that takes it to val_tokens."""

    def __init__(self, progress: dict, shard_tokens: int, val_tokens: int):
        self.shard_tokens, self.val_tokens = shard_tokens, val_tokens
        self.split = progress["split"]
        self.shard_counts = {split: len(shards) for split, shards in progress["splits"].items()}
        self.in_split = sum(e["tokens"] for e in progress["splits"][self.split])  # flushed tokens
        self.restart = (progress["next_doc"], progress["next_offset"])
        self.end_doc = progress["next_doc"]  # one past the last document seen
        self.pieces, self.buffered = [], 0

    def add_batch(self, tokens_ref, first_doc: int, lengths: np.ndarray, first_offset: int) -> list[ShardPlan]:
        """Documents first_doc.. with these token counts; the first one from first_offset on."""
        plans, base = [], 0
        for i, n in enumerate(map(int, lengths)):
            doc, offset = first_doc + i, first_offset if i == 0 else 0
            while offset < n:
                take = min(self.shard_tokens - self.buffered, n - offset)
                self._append(tokens_ref, base + offset, base + offset + take)
                offset += take
                if self.buffered == self.shard_tokens:
                    plans.append(self.flush(end=(doc, offset) if offset < n else (doc + 1, 0)))
            base += n
            self.end_doc = doc + 1
            if self.split == "val" and self.in_split + self.buffered >= self.val_tokens:
                plans.append(self.flush(end=(self.end_doc, 0), next_split="train"))
        return plans

    def _append(self, tokens_ref, lo: int, hi: int) -> None:
        if self.pieces and self.pieces[-1][0] == tokens_ref and self.pieces[-1][2] == lo:
            self.pieces[-1] = (tokens_ref, self.pieces[-1][1], hi)  # contiguous: one slice
        else:
            self.pieces.append((tokens_ref, lo, hi))
        self.buffered += hi - lo

    def flush(self, end: tuple[int, int], next_split: str | None = None) -> ShardPlan:
        file = None
        if self.buffered:
            file = f"{self.split}_{self.shard_counts[self.split]:06d}.npy"
            self.shard_counts[self.split] += 1
        plan = ShardPlan(self.split, file, self.pieces, self.restart, end, next_split or self.split)
        self.in_split = 0 if plan.next_split != self.split else self.in_split + self.buffered
        self.split, self.restart = plan.next_split, end
        self.pieces, self.buffered = [], 0
        return plan

    def finish(self) -> ShardPlan:
        if self.split == "val":
            raise TokenizeError(f"the corpus has only {self.in_split + self.buffered} tokens, all of "
                                f"them taken for val (--val_tokens={self.val_tokens}); lower "
                                "--val_tokens or add text")
        return self.flush(end=(self.end_doc, 0))


# ---- The cluster

def connect(address: str, workers: int) -> None:
    """Join the cluster at `address` ("auto": the one running here; "local": start one in
    this process with `workers` CPUs), shipping this repo's code to its workers."""
    if address not in ("auto", "local"):
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host or "127.0.0.1", int(port)), timeout=5).close()
        except (OSError, ValueError) as e:
            # checked first: ray.init would retry an unreachable address for minutes
            raise TokenizeError(f"cannot reach a Ray cluster at --ray {address} ({e}); start one "
                                "with ./launcher.sh ... --ray-start, or use --ray local") from None
    runtime_env = {"working_dir": str(REPO), "excludes": CODE_EXCLUDES,
                   "env_vars": {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}}
    kwargs = {"runtime_env": runtime_env, "log_to_driver": True, "logging_level": "ERROR"}
    if address == "local":
        kwargs.update(num_cpus=workers, include_dashboard=False, _node_ip_address="127.0.0.1")
    else:
        kwargs.update(address=address)
    try:
        ray.init(**kwargs)
    except ConnectionError as e:
        raise TokenizeError(f"--ray {address}: {' '.join(str(e).split())}") from None


def local_node_affinity():
    """Writes to a local --out go to the driver's node: on a multi-host cluster the other
    hosts' disks are not the driver's."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


# ---- The driver

def tokenize_corpus(documents: Iterable[str], out_url: str, tokenizer: dataset.Tokenizer,
                    settings: dict, shard_tokens: int, val_tokens: int, address: str,
                    workers: int = 1, total_docs: int | None = None, docs_per_task: int = DOCS_PER_TASK) -> dict:
    """data/tokenize.py's tokenize_corpus on a Ray cluster; returns the manifest.

    `documents` must yield the same documents in the same order on every run.
    """
    if shard_tokens <= 0 or val_tokens <= 0 or docs_per_task <= 0:
        raise TokenizeError("--shard_tokens, --val_tokens and --docs_per_task must be positive")
    out = open_out(out_url)
    progress = load_progress(out, settings)
    if progress["done"]:
        print(f"{out_name(out)} is already complete")
        return json.loads(out.read_text(dataset.MANIFEST))
    if out.is_local:
        out.remove_stale_temp_files()
    connect(address, workers)
    try:
        run_tasks(documents, out, tokenizer, progress, shard_tokens, val_tokens, total_docs, docs_per_task)
    finally:
        ray.shutdown()
    if not progress["splits"]["train"]:
        raise TokenizeError("no documents left for train after val; lower --val_tokens or add text")
    with tempfile.TemporaryDirectory() as tmp:  # the manifest's bytes exactly as the pool writes them
        manifest = dataset.write_manifest(tmp, progress["splits"], tokenizer.name, tokenizer.vocab_size,
                                          tokenizer.eot_id, source=settings)
        out.write_text(dataset.MANIFEST, Path(tmp, dataset.MANIFEST).read_text())
    progress["done"] = True
    save_progress(out, progress)
    return manifest


def run_tasks(documents: Iterable[str], out, tokenizer: dataset.Tokenizer, progress: dict,
              shard_tokens: int, val_tokens: int, total_docs: int | None, docs_per_task: int) -> None:
    """Encode and write every shard after progress's restart point, committing in order."""
    cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
    max_in_flight = TASKS_IN_FLIGHT_PER_CPU * cpus
    tokenizer_ref = ray.put(tokenizer)
    write_options = {} if not out.is_local else {"scheduling_strategy": local_node_affinity()}
    planner = ShardPlanner(progress, shard_tokens, val_tokens)
    start_doc, start_offset = progress["next_doc"], progress["next_offset"]
    remaining = itertools.islice(iter(documents), start_doc, None)
    batches = iter(lambda: list(itertools.islice(remaining, docs_per_task)), [])
    encodes = collections.deque()  # (first document, ref of its lengths, ref of its tokens), in order
    writes = collections.deque()   # (ShardPlan, ref of its manifest entry or None), in order
    bar = ProgressBar(progress, total_docs)
    next_doc = start_doc

    def submit(plan: ShardPlan) -> None:
        ref = None
        if plan.file:
            slices = [(lo, hi) for _, lo, hi in plan.pieces]
            ref = write_shard.options(**write_options).remote(
                out, plan.file, tokenizer.vocab_size, slices, *[r for r, _, _ in plan.pieces])
        writes.append((plan, ref))

    def commit(block_while_more_than: int) -> None:
        """Record finished writes at the head of the queue, as ShardCutter.flush does."""
        while writes:
            plan, ref = writes[0]
            if ref is not None and len(writes) <= block_while_more_than and not ray.wait([ref], timeout=0)[0]:
                return
            writes.popleft()
            if ref is not None:
                entry = ray.get(ref)
                entry["start"], entry["end"] = list(plan.start), list(plan.end)
                progress["splits"][plan.split].append(entry)
            progress["next_doc"], progress["next_offset"] = plan.end
            progress["split"] = plan.next_split
            save_progress(out, progress)

    for texts in itertools.chain(batches, [None]):
        if texts is not None:
            lengths_ref, tokens_ref = encode_batch.remote([tokenizer_ref], texts)
            encodes.append((next_doc, lengths_ref, tokens_ref))
            next_doc += len(texts)
        while encodes and (texts is None or len(encodes) >= max_in_flight):
            first_doc, lengths_ref, tokens_ref = encodes.popleft()
            lengths = ray.get(lengths_ref)
            offset = start_offset if first_doc == start_doc else 0
            for plan in planner.add_batch(tokens_ref, first_doc, lengths, offset):
                submit(plan)
            bar.update(len(lengths), int(lengths.sum()) - offset)
            commit(block_while_more_than=max_in_flight)
    submit(planner.finish())
    commit(block_while_more_than=0)
    bar.close()


class ProgressBar:
    """Documents (with an ETA when their number is known), tokens and tokens/s."""

    def __init__(self, progress: dict, total_docs: int | None):
        self.tokens = sum(e["tokens"] for shards in progress["splits"].values() for e in shards)
        self.start_tokens, self.t0 = self.tokens, time.monotonic()
        self.bar = tqdm(total=total_docs, initial=progress["next_doc"], unit="doc", desc="tokenizing (ray)",
                        dynamic_ncols=True)

    def update(self, docs: int, tokens: int) -> None:
        self.tokens += tokens
        rate = (self.tokens - self.start_tokens) / max(time.monotonic() - self.t0, 1e-9)
        self.bar.set_postfix_str(f"{self.tokens:,} tok, {rate:,.0f} tok/s", refresh=False)
        self.bar.update(docs)

    def close(self) -> None:
        self.bar.close()
        seconds = time.monotonic() - self.t0
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"ray: {self.tokens - self.start_tokens:,} tokens in {seconds:.1f}s = "
              f"{(self.tokens - self.start_tokens) / max(seconds, 1e-9):,.0f} tokens/s; "
              f"driver peak memory {peak_mb:,.0f} MB")
