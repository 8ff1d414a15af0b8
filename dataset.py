"""The token-shard reader (local directory or gs://bucket/prefix, read as memory maps); tokenizers and the shard format
(manifest.json + uint16/uint32 `.npy` shards, docs/data.md) are in data/shards.py. Each shard is cut into windows of
seq_len + 1 tokens (a last partial one is unused). Row r of step s is global sample s * batch_size + r, placed by seeded
permutations per epoch ("Batch order" below): it depends only on (seed, step, batch_size, seq_len, the data), never on the
mesh or the process, so the state to resume is just `step`. The eval set is fixed: windows spread evenly over the val split."""

import collections
import fcntl
import functools
import importlib
import json
import logging
import os
import shutil
import tempfile
from typing import Iterator

import numpy as np

from data import shakespeare  # the default; data/python_code.py (`code`) is imported when asked for

# data/shards.py sits below this module and data/; its names are offered here, the one place to import data things from.
from data.shards import (BYTE_EOT_ID, CUSTOM_SPLIT_PATTERN, EOT_TEXT, FORMAT_VERSION, MANIFEST, ShardError, Tokenizer,  # noqa: F401
                         check_token_range, file_sha256, get_tokenizer, open_shard_file, shard_dtype, validate_manifest,
                         verify_shard_file, write_manifest, write_shard)
from utils import ConfigError, apply_overrides

log = logging.getLogger(__name__)

EMBEDDED_SOURCES = ("shakespeare", "code")

MAX_OPEN_SHARDS = 8  # memory maps kept open per TokenData: closing older ones lets evicted cache files leave the disk


# ---- Shard stores: where a shard's bytes come from (gs://: data/gcs_shards.py). Both hand back a verified local file.

class LocalShards:
    """Shards in a local directory, each verified against its checksum when first opened."""

    def __init__(self, root: str):
        self.root = root
        self._verified = set()

    def read_manifest(self) -> str:
        path = os.path.join(self.root, MANIFEST)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing: {self.root} is not a prepared data directory. Build one with "
                                    "data/tokenize.py (or data/shakespeare.py), or use --data.source=shakespeare.")
        with open(path) as f:
            return f.read()

    def open(self, entry: dict, dtype: str) -> np.ndarray:
        path = os.path.join(self.root, entry["file"])
        if not os.path.isfile(path):
            raise ShardError(f"shard {path} listed in {MANIFEST} is missing. Copy it back or re-create the data directory.")
        if path not in self._verified:
            verify_shard_file(path, entry, where=path)
            self._verified.add(path)
        return open_shard_file(path, entry, dtype, where=path)

    def prefetch(self, entry: dict) -> None:
        pass  # local files are already at hand

    def close(self) -> None:
        pass


# ---- Batch order: pure functions of the seed, the epoch and the windows in each shard. An epoch visits every window once:
# shuffled shards, SHARDS_PER_ROUND at a time (a round), their windows pooled and shuffled. A batch mixes many shards, yet only
# one round's shards (and the next, prefetched) need be on disk: a gs:// corpus streams through a bounded cache.

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


# ---- TokenData: deterministic global batches, read a row subset at a time

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
            raise ValueError(f"the {split} split has no window of seq_len + 1 = {seq_len + 1} tokens (its largest shard holds "
                             f"{max(e['tokens'] for e in shards)}): lower seq_len or add data")
        return counts

    def batch(self, split: str, step: int, batch_size: int, seq_len: int, seed: int, rows: range | None = None) -> np.ndarray:
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

    def eval_batches(self, n_batches: int, batch_size: int, seq_len: int, rows: range | None = None) -> Iterator[np.ndarray]:
        """The fixed eval set: n_batches batches of windows spread evenly over the val split."""
        rows = _check_rows(rows, batch_size)
        counts = self.windows_per_shard("val", seq_len)
        needed = n_batches * batch_size
        if needed > sum(counts):
            raise ValueError(f"the val split holds {sum(counts)} windows of {seq_len + 1} tokens, but {n_batches} eval batches x "
                             f"{batch_size} rows need {needed}: evaluate fewer batches or hold out more val data")
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


# ---- Entry points for main.py

def open_data(source: str, cache_dir: str, cache_max_gb: float = 20.0, process_index: int = 0) -> TokenData:
    """source: an embedded name ("shakespeare", "code"), a local data directory, or gs://bucket/prefix. cache_dir holds prepared
    embedded data and the gs:// shard cache (at most cache_max_gb); process_index only keeps one-off messages from repeating."""
    if source in EMBEDDED_SOURCES:
        source = prepare_embedded(source, cache_dir, process_index)
    if source.startswith("gs://"):
        from data.gcs_shards import GcsShards  # (only a gs:// source imports the Cloud Storage client)
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
            raise RuntimeError(f"{out} exists but has no {MANIFEST}; delete it so that {name} can be prepared again")
        for folder in os.listdir(cache_dir):  # left behind by a run that crashed mid-way
            if folder.startswith(f"{name}.tmp"):
                shutil.rmtree(os.path.join(cache_dir, folder))
        tmp = tempfile.mkdtemp(prefix=f"{name}.tmp", dir=cache_dir)
        counts = (shakespeare if name == "shakespeare" else importlib.import_module("data.python_code")).prepare(tmp)
        os.rename(tmp, out)
        if process_index == 0:
            print(f"prepared {name} into {out}: {counts} tokens")
    return out


def check_tokenizer(data: TokenData, model_vocab_size: int, tokenizer_name: str) -> None:
    """ConfigError (one line: the flag to change) unless `tokenizer_name` made the data and the model's vocabulary holds its."""
    if data.tokenizer_name != tokenizer_name:
        raise ConfigError(f"the data was tokenized with {data.tokenizer_name!r} but --data.tokenizer is {tokenizer_name!r}: "
                          f"pass --data.tokenizer {data.tokenizer_name} or point --data.source at shards made with "
                          f"{tokenizer_name!r} (data/tokenize.py --encoding)")
    if model_vocab_size < data.vocab_size:
        raise ConfigError(f"the data's vocabulary has {data.vocab_size} ids but --model.vocab_size is {model_vocab_size}: "
                          f"pass --model.vocab_size {data.vocab_size} or more (or 0: the data's)")


def resolve_vocab(cfg, data):
    """cfg with the model's vocabulary taken from the data's manifest, unless set explicitly (then checked against it)."""
    check_tokenizer(data, cfg.model.vocab_size or data.vocab_size, cfg.data.tokenizer)
    if cfg.model.vocab_size == 0:
        cfg = apply_overrides(cfg, {"model": {"vocab_size": data.vocab_size}})
    return cfg
