"""A data directory's format: the tokenizer its manifest names (bytes or tiktoken), its `.npy` token shards and
manifest.json (docs/data.md). The scripts in data/ write with these and dataset.py reads with them: this sits below both."""

import hashlib
import json
import os

import numpy as np
import tiktoken
from tiktoken_ext import openai_public

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
EOT_TEXT = "<|endoftext|>"


# ---- Tokenizers

BYTE_EOT_ID = 256  # after the 256 byte values


class Tokenizer:
    """Text <-> token ids: raw UTF-8 bytes (+ end-of-text id 256) or a tiktoken encoding."""

    def __init__(self, name: str, encoding: tiktoken.Encoding | None = None):
        self.name = name
        self._encoding = encoding
        if encoding is None:
            self.vocab_size, self.eot_id = BYTE_EOT_ID + 1, BYTE_EOT_ID
        else:
            if EOT_TEXT not in encoding.special_tokens_set:
                raise ValueError(f"tiktoken encoding {encoding.name!r} has no {EOT_TEXT} token to separate documents; add it to its special_tokens")
            self.vocab_size, self.eot_id = encoding.n_vocab, encoding.eot_token

    def encode(self, text: str) -> list[int]:
        # Ordinary encoding: text spelling "<|endoftext|>" stays text; callers append eot_id.
        if self._encoding is None:
            return list(text.encode("utf-8"))
        return self._encoding.encode_ordinary(text)

    def decode(self, ids) -> str:
        """Ids outside the vocabulary (a model with a padded vocabulary can sample them) show as U+FFFD, the replacement character."""
        pieces, run = [], []
        for i in map(int, ids):
            if 0 <= i < self.vocab_size:
                run.append(i)
            else:
                pieces += [self._decode_known(run), "\ufffd"]
                run = []
        pieces.append(self._decode_known(run))
        return "".join(pieces)

    def _decode_known(self, ids: list[int]) -> str:
        if self._encoding is None:
            return _decode_bytes(ids)
        return self._encoding.decode(ids)


def _decode_bytes(ids: list[int]) -> str:
    """Byte ids -> text; end-of-text ids become "<|endoftext|>" so boundaries stay visible."""
    pieces, current = [], []
    for i in ids:
        if i == BYTE_EOT_ID:
            pieces.append(bytes(current).decode("utf-8", errors="replace"))
            current = []
        else:
            current.append(i)
    pieces.append(bytes(current).decode("utf-8", errors="replace"))
    return EOT_TEXT.join(pieces)


# tiktoken's own split patterns and special tokens (tiktoken_ext/openai_public.py, 0.14): a local rank file needs no download.
CL100K_PATTERN = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
_O200K_PATTERN = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
_TIKTOKEN_LAYOUTS = {
    "gpt2": (openai_public.r50k_pat_str, {EOT_TEXT: 50256}),
    "r50k_base": (openai_public.r50k_pat_str, {EOT_TEXT: 50256}),
    "p50k_base": (openai_public.r50k_pat_str, {EOT_TEXT: 50256}),
    "cl100k_base": (CL100K_PATTERN, {EOT_TEXT: 100257, "<|fim_prefix|>": 100258, "<|fim_middle|>": 100259, "<|fim_suffix|>": 100260,
                                      "<|endofprompt|>": 100276}),
    "o200k_base": (_O200K_PATTERN, {EOT_TEXT: 199999, "<|endofprompt|>": 200018}),
}
CUSTOM_SPLIT_PATTERN = CL100K_PATTERN  # for rank files of names tiktoken does not know


def get_tokenizer(name: str | tiktoken.Encoding, encoding_file: str = "") -> Tokenizer:
    """"bytes", a tiktoken encoding name, or a caller-built tiktoken.Encoding. encoding_file: a .tiktoken rank file used instead
    of a download (that encoding's own, for tiktoken's names; other names get cl100k_base's split pattern and <|endoftext|> after the last rank)."""
    if isinstance(name, tiktoken.Encoding):
        return Tokenizer(name.name, name)
    if name == "bytes":
        return Tokenizer("bytes")
    if encoding_file:
        return Tokenizer(name, _encoding_from_file(name, encoding_file))
    if name not in tiktoken.list_encoding_names():
        raise ValueError(f"unknown tokenizer {name!r}: use 'bytes', one of tiktoken's "
                         f"{tiktoken.list_encoding_names()}, or pass encoding_file=<.tiktoken file>")
    try:
        return Tokenizer(name, tiktoken.get_encoding(name))
    except OSError as e:  # requests' errors are OSErrors: no network, DNS, HTTP failure
        raise RuntimeError(f"tiktoken could not download the {name!r} encoding file ({type(e).__name__}). Either give the path "
                           f"of a copy of {name}.tiktoken as encoding_file (flags --data.encoding_file in main.py, --encoding_file in "
                           "data/tokenize.py), or set TIKTOKEN_CACHE_DIR to a directory holding tiktoken's cache from a machine with "
                           "network (by default it caches in /tmp/data-gym-cache).") from e


def _encoding_from_file(name: str, path: str) -> tiktoken.Encoding:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"encoding_file {path} does not exist")
    ranks = tiktoken.load.load_tiktoken_bpe(path)
    pattern, specials = _TIKTOKEN_LAYOUTS.get(name, (CUSTOM_SPLIT_PATTERN, {EOT_TEXT: max(ranks.values()) + 1}))
    if max(ranks.values()) >= min(specials.values()):
        raise ValueError(f"{path} has ranks up to {max(ranks.values())}, which collide with "
                         f"{name}'s special tokens: is it really the {name} rank file?")
    return tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)


# ---- Writing shards and the manifest (used by the scripts in data/)

def shard_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def check_token_range(tokens: np.ndarray, vocab_size: int, where: str) -> None:
    """Raise unless every id is in [0, vocab_size): a narrower shard dtype would wrap it."""
    if tokens.size == 0:
        return
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"{where}: token id {bad} is outside the vocabulary [0, {vocab_size}). The tokenizer and the "
                         "vocab_size disagree; re-tokenize with the tokenizer named in the manifest.")


def write_shard(out_dir: str, file_name: str, tokens, vocab_size: int) -> dict:
    """Write one .npy shard atomically (temp file + rename); return its manifest entry."""
    tokens = np.asarray(tokens)
    check_token_range(tokens, vocab_size, where=file_name)
    path = os.path.join(out_dir, file_name)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        np.save(f, tokens.astype(shard_dtype(vocab_size)))
    os.replace(tmp, path)
    return {"file": file_name, "tokens": int(tokens.size), "sha256": file_sha256(path)}


def write_manifest(out_dir: str, splits: dict, tokenizer_name: str, vocab_size: int, eot_id: int, **extra) -> dict:
    """Write manifest.json atomically, last, once every shard it lists is in place."""
    manifest = {"format": FORMAT_VERSION, "tokenizer": tokenizer_name, "vocab_size": vocab_size,
                "eot_id": eot_id, "dtype": shard_dtype(vocab_size).name, "splits": splits, **extra}
    validate_manifest(manifest, where=out_dir)
    path = os.path.join(out_dir, MANIFEST)
    with open(f"{path}.tmp{os.getpid()}", "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(f"{path}.tmp{os.getpid()}", path)
    return manifest


def write_byte_corpus(out_dir: str, texts_by_split: dict, shard_tokens: int, **manifest_extra) -> dict[str, int]:
    """An embedded corpus's texts (per split) as byte-token shards of shard_tokens each, one end-of-text after every
    text, and its manifest; the tokens per split."""
    tokenizer, splits, counts = get_tokenizer("bytes"), {}, {}
    for split, texts in texts_by_split.items():
        tokens = np.concatenate([tokenizer.encode(text) + [tokenizer.eot_id] for text in texts])
        splits[split] = [write_shard(out_dir, f"{split}_{i:06d}.npy", tokens[start:start + shard_tokens], tokenizer.vocab_size)
                         for i, start in enumerate(range(0, len(tokens), shard_tokens))]
        counts[split] = len(tokens)
    write_manifest(out_dir, splits, tokenizer.name, tokenizer.vocab_size, tokenizer.eot_id, **manifest_extra)
    return counts


def validate_manifest(manifest: dict, where: str) -> None:
    for key in ("tokenizer", "vocab_size", "dtype", "splits"):
        if key not in manifest:
            raise ValueError(f"{where}/{MANIFEST} has no {key!r} field; rebuild the data directory with the scripts in data/")
    for split in ("train", "val"):
        if not manifest["splits"].get(split):
            raise ValueError(f"{where}/{MANIFEST} has no {split!r} split (or it lists no shards). Training needs both train "
                             "and val; re-run data/tokenize.py (it holds out --val_tokens for val).")
    expected = shard_dtype(manifest["vocab_size"]).name
    if manifest["dtype"] != expected:
        raise ValueError(f"{where}/{MANIFEST}: dtype {manifest['dtype']} does not suit vocab_size {manifest['vocab_size']} (expected {expected})")


class ShardError(RuntimeError):
    """A shard is missing, truncated or corrupt."""


def verify_shard_file(path: str, entry: dict, where: str) -> None:
    if file_sha256(path) != entry["sha256"]:
        raise ShardError(f"checksum mismatch for {where}: the file is truncated or corrupt (sha256 differs from the manifest). "
                         "Delete it and copy or re-create the data directory.")


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
