"""The token-shard reader (local directory or gs://bucket/prefix); tokenizers and the
shard format (manifest.json + uint16/uint32 `.npy` shards, docs/data.md) are in
data/shards.py. Shards are read as memory maps.

Each shard is cut into windows of seq_len + 1 tokens (a last partial one is unused). Row r
of step s is global sample s * batch_size + r, placed by seeded permutations per epoch
(see "Batch order" below): it depends only on (seed, step, batch_size, seq_len, the data),
never on the mesh or the process, so the state to resume is just `step`. The eval set is
fixed: windows spread evenly over the val split, in shard order.
"""

import collections
import fcntl
import functools
import json
import logging
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import numpy as np

from data import shakespeare  # the only embedded source so far

# data/shards.py sits below this module and data/; its names are offered here, the one place to import data things from.
from data.shards import (  # noqa: F401
    BYTE_EOT_ID,
    CUSTOM_SPLIT_PATTERN,
    EOT_TEXT,
    FORMAT_VERSION,
    MANIFEST,
    Tokenizer,
    check_token_range,
    file_sha256,
    get_tokenizer,
    shard_dtype,
    validate_manifest,
    write_manifest,
    write_shard,
)
from utils import apply_overrides

log = logging.getLogger(__name__)

EMBEDDED_SOURCES = ("shakespeare",)

# GCS downloads retry transient errors this many times, waiting GCS_BACKOFF_S * 2**attempt (~30 s in all).
GCS_RETRIES = 6
GCS_BACKOFF_S = float(os.environ.get("MESHFORMER_GCS_BACKOFF_S", "0.5"))  # tests shorten it

MAX_OPEN_SHARDS = 8  # memory maps kept open per TokenData: closing older ones lets evicted cache files leave the disk


# -----------------------------------------------------------------------------
# Shard stores: where a shard's bytes come from. Both hand back a verified local file.

class ShardError(RuntimeError):
    """A shard is missing, truncated or corrupt."""


def verify_shard_file(path: str, entry: dict, where: str) -> None:
    if file_sha256(path) != entry["sha256"]:
        raise ShardError(
            f"checksum mismatch for {where}: the file is truncated or corrupt (sha256 differs "
            "from the manifest). Delete it and copy or re-create the data directory.")


def open_shard_file(path: str, entry: dict, dtype: str, where: str) -> np.ndarray:
    """Memory-map a verified shard and check it holds what the manifest says."""
    try:
        tokens = np.load(path, mmap_mode="r")
    except (ValueError, OSError) as e:
        raise ShardError(f"cannot read shard {where}: {e}. Re-create the data directory.") from e
    if tokens.dtype != np.dtype(dtype) or tokens.shape != (entry["tokens"],):
        raise ShardError(f"shard {where} holds {tokens.dtype}{list(tokens.shape)}, the manifest "
                         f"says {dtype}[{entry['tokens']}]. Re-create the data directory.")
    return tokens


class LocalShards:
    """Shards in a local directory, each verified against its checksum when first opened."""

    def __init__(self, root: str):
        self.root = root
        self._verified = set()

    def read_manifest(self) -> str:
        path = os.path.join(self.root, MANIFEST)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{path} is missing: {self.root} is not a prepared data directory. Build one "
                "with data/tokenize.py (or data/shakespeare.py), or use --data.source=shakespeare.")
        with open(path) as f:
            return f.read()

    def open(self, entry: dict, dtype: str) -> np.ndarray:
        path = os.path.join(self.root, entry["file"])
        if not os.path.isfile(path):
            raise ShardError(f"shard {path} listed in {MANIFEST} is missing. Copy it back "
                             "or re-create the data directory.")
        if path not in self._verified:
            verify_shard_file(path, entry, where=path)
            self._verified.add(path)
        return open_shard_file(path, entry, dtype, where=path)

    def prefetch(self, entry: dict) -> None:
        pass  # local files are already at hand

    def close(self) -> None:
        pass


def with_retries(action, what: str, transient: tuple, retries: int, backoff_s: float):
    """Run action(); on a transient error wait backoff_s * 2**attempt and try again."""
    for attempt in range(retries + 1):
        try:
            return action()
        except transient as e:
            if attempt == retries:
                raise RuntimeError(f"{what} failed after {retries + 1} tries: {e!r}") from e
            delay = backoff_s * 2**attempt
            log.warning("%s: %r; retrying in %.2fs", what, e, delay)
            time.sleep(delay)


def gcs_transient_errors() -> tuple:
    """Errors worth retrying: overload/5xx answers, dropped or cut-off connections, bad bytes."""
    import requests
    import urllib3
    from google.api_core import exceptions as api
    from google.cloud.storage.exceptions import DataCorruption
    return (api.TooManyRequests, api.InternalServerError, api.BadGateway,
            api.ServiceUnavailable, api.GatewayTimeout, requests.ConnectionError,
            requests.Timeout, requests.exceptions.ChunkedEncodingError, urllib3.exceptions.HTTPError,
            ConnectionError, TimeoutError, DataCorruption, ShardError)


def gcs_client():
    """A google-cloud-storage client (it honours STORAGE_EMULATOR_HOST)."""
    from google.auth.exceptions import DefaultCredentialsError
    from google.cloud import storage
    try:
        return storage.Client()
    except DefaultCredentialsError as e:
        raise RuntimeError(
            "no Google Cloud credentials for gs:// data: run `gcloud auth application-default "
            "login` (or run on a VM with a service account), or set STORAGE_EMULATOR_HOST to "
            "use an emulator") from e


def split_gcs_url(url: str) -> tuple[str, str]:
    """gs://bucket/some/prefix -> ("bucket", "some/prefix")."""
    bucket, _, prefix = url.removeprefix("gs://").partition("/")
    if not bucket:
        raise ValueError(f"{url!r} is not of the form gs://bucket/prefix")
    return bucket, prefix.strip("/")


class GcsShards:
    """Shards in gs://bucket/prefix, copied on first use into a size-bounded local cache.
    Downloads run on one background thread (prefetch overlaps reading; the client never
    leaves it); files enter the cache only once their sha256 matches (temp file + rename,
    safe to share between processes); the least recently opened are evicted."""

    def __init__(self, url: str, cache_dir: str, cache_max_bytes: float):
        from google.api_core.exceptions import NotFound  # imported here: only gs:// needs it
        self.url = url.rstrip("/")
        bucket, self.prefix = split_gcs_url(url)
        self.cache_root = os.path.join(cache_dir, "gcs")
        self.local_dir = os.path.join(self.cache_root, bucket, self.prefix)
        self.cache_max_bytes = cache_max_bytes
        self._bucket = gcs_client().bucket(bucket)
        self._not_found = NotFound
        self._transient = gcs_transient_errors()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gcs-download")
        self._fetches = {}  # file name -> Future of its verified local path

    def _download(self, file_name: str, read):
        """One try at read(blob), with the client's own retries off (ours are clearer)."""
        blob = self._bucket.blob(f"{self.prefix}/{file_name}" if self.prefix else file_name)
        try:
            return read(blob)
        except self._not_found as e:
            raise FileNotFoundError(
                f"{self.url}/{file_name} does not exist. Upload the data directory with "
                f"data/upload_gcs.py DIR {self.url}") from e

    def read_manifest(self) -> str:
        action = functools.partial(self._download, MANIFEST, lambda blob: blob.download_as_bytes(retry=None))
        data = self._pool.submit(with_retries, action, f"download {self.url}/{MANIFEST}",
                                 self._transient, GCS_RETRIES, GCS_BACKOFF_S).result()
        return data.decode("utf-8")

    def _fetch_verified(self, entry: dict) -> str:
        """(background thread) A cached, checksum-verified copy of the shard: its path."""
        path = os.path.join(self.local_dir, entry["file"])
        if os.path.isfile(path):
            try:
                verify_shard_file(path, entry, where=path)
                return path
            except ShardError:
                log.warning("cached %s is corrupt; downloading it again", path)
        os.makedirs(self.local_dir, exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"

        def download_and_verify():
            self._download(entry["file"], lambda blob: blob.download_to_filename(tmp, retry=None))
            verify_shard_file(tmp, entry, where=f"{self.url}/{entry['file']} (downloaded)")

        try:
            with_retries(download_and_verify, f"download {self.url}/{entry['file']}",
                         self._transient, GCS_RETRIES, GCS_BACKOFF_S)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
        os.replace(tmp, path)
        evict_least_recently_used(self.cache_root, self.cache_max_bytes, keep=path)
        return path

    def _fetch(self, entry: dict):
        """The download of this shard: in flight, done, or (if none, or it failed) started now."""
        fetch = self._fetches.get(entry["file"])
        if fetch is None or (fetch.done() and fetch.exception()):
            fetch = self._fetches[entry["file"]] = self._pool.submit(self._fetch_verified, entry)
        return fetch

    def prefetch(self, entry: dict) -> None:
        self._fetch(entry)

    def open(self, entry: dict, dtype: str) -> np.ndarray:
        path = self._fetch(entry).result()
        if not os.path.isfile(path):  # evicted since, by us or another process: fetch again
            del self._fetches[entry["file"]]
            path = self._fetch(entry).result()
        os.utime(path)  # mark as recently used for eviction
        return open_shard_file(path, entry, dtype, where=path)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def evict_least_recently_used(cache_root: str, max_bytes: float, keep: str) -> None:
    """Delete the oldest files under cache_root until it fits in max_bytes (never `keep`);
    another process's memory maps stay readable after deletion (POSIX)."""
    files = []
    for folder, _, names in os.walk(cache_root):
        for name in names:
            if ".tmp" in name:
                continue  # a download in progress, maybe another process's
            path = os.path.join(folder, name)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue  # removed meanwhile by another process
            files.append((st.st_mtime, st.st_size, path))
    total = sum(size for _, size, _ in files)
    for _, size, path in sorted(files):
        if total <= max_bytes:
            break
        if path == keep:
            continue
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        total -= size


# -----------------------------------------------------------------------------
# Batch order: pure functions of the seed, the epoch and the windows in each shard
#
# An epoch visits every window once: shuffled shards, taken SHARDS_PER_ROUND at a time (a
# round), whose windows are pooled and shuffled together. A batch mixes many shards, yet
# only one round's shards (and the next, prefetched) need be on disk: a gs:// corpus
# streams through a bounded cache (docs/benchmarks.md).

SHARDS_PER_ROUND = MAX_OPEN_SHARDS


@functools.lru_cache(maxsize=16)
def _epoch_rounds(seed: int, epoch: int, windows_per_shard: tuple[int, ...]):
    """The rounds of one epoch: each round's shards, and where each round ends in the epoch."""
    order = np.random.default_rng([seed, epoch, 0]).permutation(len(windows_per_shard))
    rounds = tuple(tuple(int(s) for s in order[i:i + SHARDS_PER_ROUND]) for i in range(0, len(order), SHARDS_PER_ROUND))
    ends = np.cumsum([sum(windows_per_shard[s] for s in shards) for shards in rounds])
    return rounds, ends


@functools.lru_cache(maxsize=4)
def _round_order(seed: int, epoch: int, round_index: int, round_windows: tuple[int, ...]) -> tuple:
    """The pooled windows of one round, shuffled: (shard position in the round, window) arrays."""
    owner = np.repeat(np.arange(len(round_windows)), round_windows)
    window = np.arange(len(owner)) - np.repeat(np.cumsum(round_windows) - round_windows, round_windows)
    order = np.random.default_rng([seed, epoch, 1, round_index]).permutation(len(owner))
    return owner[order], window[order]


def _round_of(seed: int, windows_per_shard: tuple[int, ...], sample: int):
    """(epoch, round index, position inside the round) of a global sample index."""
    epoch, position = divmod(sample, sum(windows_per_shard))
    rounds, ends = _epoch_rounds(seed, epoch, windows_per_shard)
    k = int(np.searchsorted(ends, position, side="right"))  # skips rounds with no window
    return epoch, rounds, k, position - (int(ends[k - 1]) if k else 0)


def locate_window(seed: int, windows_per_shard: tuple[int, ...], sample: int) -> tuple[int, int]:
    """Global sample index (step * batch_size + row) -> (shard, window inside that shard)."""
    epoch, rounds, k, within = _round_of(seed, windows_per_shard, sample)
    shards = rounds[k]
    owner, window = _round_order(seed, epoch, k, tuple(windows_per_shard[s] for s in shards))
    return shards[int(owner[within])], int(window[within])


def next_round_shards(seed: int, windows_per_shard: tuple[int, ...], sample: int) -> tuple[int, ...]:
    """The shards of the round after the one holding `sample` (maybe in the next epoch)."""
    epoch, rounds, k, _ = _round_of(seed, windows_per_shard, sample)
    if k + 1 < len(rounds):
        return rounds[k + 1]
    return _epoch_rounds(seed, epoch + 1, windows_per_shard)[0][0]


# -----------------------------------------------------------------------------
# TokenData: deterministic global batches, read a row subset at a time

class TokenData:
    """The token shards of one data directory, read as deterministic global batches."""

    def __init__(self, manifest: dict, store, where: str):
        validate_manifest(manifest, where)
        self.manifest = manifest
        self.vocab_size = int(manifest["vocab_size"])
        self.tokenizer_name = manifest["tokenizer"]
        self.rows_loaded = 0  # rows materialised so far, whatever the split
        self._store = store
        self._open = collections.OrderedDict()  # (split, shard) -> memmap, most recent last

    def windows_per_shard(self, split: str, seq_len: int) -> tuple[int, ...]:
        """Windows of seq_len + 1 tokens in each shard of `split`; their sum is one epoch."""
        if split not in self.manifest["splits"]:
            raise ValueError(f"no split {split!r}; the manifest has {list(self.manifest['splits'])}")
        shards = self.manifest["splits"][split]
        counts = tuple(entry["tokens"] // (seq_len + 1) for entry in shards)
        if sum(counts) == 0:
            raise ValueError(f"the {split} split has no window of seq_len + 1 = {seq_len + 1} "
                             f"tokens (its largest shard holds {max(e['tokens'] for e in shards)}): "
                             "lower seq_len or add data")
        return counts

    def batch(self, split: str, step: int, batch_size: int, seq_len: int, seed: int,
              rows: range | None = None) -> np.ndarray:
        """Rows `rows` (default: all) of the global batch for `step`: int32 [len(rows), seq_len + 1]."""
        if step < 0 or seed < 0:
            raise ValueError(f"step ({step}) and seed ({seed}) must be >= 0")
        rows = _check_rows(rows, batch_size)
        counts = self.windows_per_shard(split, seq_len)
        first = step * batch_size
        windows = [locate_window(seed, counts, first + row) for row in rows]
        out = self._read_windows(split, windows, seq_len + 1)
        if len(rows):  # the next round's shards download in the background (gs://)
            for upcoming in next_round_shards(seed, counts, first + max(rows)):
                self._store.prefetch(self.manifest["splits"][split][upcoming])
        return out

    def eval_batches(self, n_batches: int, batch_size: int, seq_len: int,
                     rows: range | None = None) -> Iterator[np.ndarray]:
        """The fixed eval set: n_batches batches of windows spread evenly over the val split."""
        rows = _check_rows(rows, batch_size)
        counts = self.windows_per_shard("val", seq_len)
        needed = n_batches * batch_size
        if needed > sum(counts):
            raise ValueError(f"the val split holds {sum(counts)} windows of {seq_len + 1} tokens, "
                             f"but {n_batches} eval batches x {batch_size} rows need {needed}: "
                             "evaluate fewer batches or hold out more val data")
        stride = sum(counts) // needed
        shard_starts = np.cumsum((0,) + counts)  # index of each shard's first window

        def locate(index: int) -> tuple[int, int]:
            shard = int(np.searchsorted(shard_starts, index, side="right")) - 1
            return shard, index - int(shard_starts[shard])

        def batches():
            for b in range(n_batches):
                windows = [locate((b * batch_size + row) * stride) for row in rows]
                yield self._read_windows("val", windows, seq_len + 1)

        return batches()

    def _read_windows(self, split: str, windows: list[tuple[int, int]], length: int) -> np.ndarray:
        out = np.empty((len(windows), length), np.int32)
        for i, (shard, window) in enumerate(windows):
            out[i] = self._shard(split, shard)[window * length:(window + 1) * length]
            self.rows_loaded += 1
            if out[i].max() >= self.vocab_size:
                file = self.manifest["splits"][split][shard]["file"]
                check_token_range(out[i], self.vocab_size, where=f"shard {file}")
        return out

    def _shard(self, split: str, index: int) -> np.ndarray:
        key = (split, index)
        if key in self._open:
            self._open.move_to_end(key)
        else:
            entry = self.manifest["splits"][split][index]
            self._open[key] = self._store.open(entry, self.manifest["dtype"])
            if len(self._open) > MAX_OPEN_SHARDS:
                self._open.popitem(last=False)
        return self._open[key]

    def close(self) -> None:
        self._open.clear()
        self._store.close()


def _check_rows(rows: range | None, batch_size: int) -> range:
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if rows is None:
        return range(batch_size)
    if len(rows) and (min(rows) < 0 or max(rows) >= batch_size):
        raise ValueError(f"rows {rows} fall outside the global batch range(0, {batch_size})")
    return rows


# -----------------------------------------------------------------------------
# Entry points for main.py

def open_data(source: str, cache_dir: str, cache_max_gb: float = 20.0,
              process_index: int = 0) -> TokenData:
    """source: an embedded name ("shakespeare"), a local data directory, or gs://bucket/prefix.
    cache_dir holds prepared embedded data and the gs:// shard cache (at most cache_max_gb);
    process_index only keeps one-off messages from repeating."""
    if source in EMBEDDED_SOURCES:
        source = prepare_embedded(source, cache_dir, process_index)
    if source.startswith("gs://"):
        store = GcsShards(source, cache_dir, cache_max_bytes=cache_max_gb * 1e9)
    elif os.path.isdir(source):
        store = LocalShards(source)
    else:
        raise FileNotFoundError(f"data source {source!r} is neither an embedded dataset "
                                f"{EMBEDDED_SOURCES}, an existing directory, nor gs://bucket/prefix")
    try:
        manifest = json.loads(store.read_manifest())
        return TokenData(manifest, store, where=source)
    except BaseException:
        store.close()
        raise


def prepare_embedded(name: str, cache_dir: str, process_index: int = 0) -> str:
    """Prepare an embedded dataset once into <cache_dir>/<name>/ and return that directory.
    Safe for concurrent processes: one prepares under a lock (temp dir + rename), the others reuse it."""
    out = os.path.join(cache_dir, name)
    if os.path.isfile(os.path.join(out, MANIFEST)):
        return out
    os.makedirs(cache_dir, exist_ok=True)
    with open(f"{out}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if os.path.isfile(os.path.join(out, MANIFEST)):
            return out  # another process prepared it while we waited
        if os.path.exists(out):
            raise RuntimeError(f"{out} exists but has no {MANIFEST}; delete it so that "
                               f"{name} can be prepared again")
        for folder in os.listdir(cache_dir):  # left behind by a run that crashed mid-way
            if folder.startswith(f"{name}.tmp"):
                shutil.rmtree(os.path.join(cache_dir, folder))
        tmp = tempfile.mkdtemp(prefix=f"{name}.tmp", dir=cache_dir)
        counts = shakespeare.prepare(tmp)
        os.rename(tmp, out)
        if process_index == 0:
            print(f"prepared {name} into {out}: {counts} tokens")
    return out


def check_tokenizer(data: TokenData, model_vocab_size: int, tokenizer_name: str) -> None:
    """Raise ValueError unless the data was tokenized with `tokenizer_name` and the model's
    vocabulary is at least the data's (larger, padded, is fine)."""
    if data.tokenizer_name != tokenizer_name:
        raise ValueError(
            f"the data was tokenized with {data.tokenizer_name!r} but the model is configured "
            f"for {tokenizer_name!r}: set the tokenizer to {data.tokenizer_name!r} or point the "
            f"data source at shards made with {tokenizer_name!r} (data/tokenize.py --encoding).")
    if model_vocab_size < data.vocab_size:
        raise ValueError(
            f"the data's vocabulary has {data.vocab_size} ids but the model only "
            f"{model_vocab_size}: set the model's vocab size to at least {data.vocab_size}.")


def resolve_vocab(cfg, data):
    """cfg with the model's vocabulary taken from the data's manifest, unless set explicitly
    (then checked against it)."""
    check_tokenizer(data, cfg.model.vocab_size or data.vocab_size, cfg.data.tokenizer)
    if cfg.model.vocab_size == 0:
        cfg = apply_overrides(cfg, {"model": {"vocab_size": data.vocab_size}})
    return cfg
