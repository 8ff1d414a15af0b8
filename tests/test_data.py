"""Data pipeline: batch determinism and row slicing, the embedded Shakespeare default,
clear errors on bad data, and tiktoken tokenization into shards (with resume)."""

import base64
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tiktoken

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # import the repo's modules wherever pytest runs from

import dataset  # noqa: E402
from data import shakespeare  # noqa: E402
from data import tokenize as tokenize_script  # noqa: E402
from utils import ConfigError  # noqa: E402

# A synthetic data set whose every token is distinct, so a window is known by its first
# token: shard i holds BASES[i] + arange(SIZES[i]). The 10-token shard has no window.
VOCAB = 100_000  # > 2**16, so shards are uint32
TRAIN_SIZES = (5000, 3001, 7777, 10)
BASES = (0, 20_000, 40_000, 60_000)
SEQ = 15  # windows of 16 tokens
VAL_BASE = 80_000


def write_dataset(out_dir: Path, vocab_size=VOCAB, val=True) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    train = [dataset.write_shard(str(out_dir), f"train_{i}.npy", base + np.arange(n), vocab_size)
             for i, (base, n) in enumerate(zip(BASES, TRAIN_SIZES))]
    splits = {"train": train}
    if val:
        splits["val"] = [dataset.write_shard(str(out_dir), "val_0.npy", VAL_BASE + np.arange(4000), vocab_size)]
    if val:
        dataset.write_manifest(str(out_dir), splits, "synthetic", vocab_size, eot_id=vocab_size - 1)
    else:
        manifest = {"format": 1, "tokenizer": "synthetic", "vocab_size": vocab_size,
                    "dtype": dataset.shard_dtype(vocab_size).name, "splits": splits}
        (out_dir / "manifest.json").write_text(json.dumps(manifest))
    return out_dir


@pytest.fixture
def synthetic(tmp_path):
    return write_dataset(tmp_path / "synthetic")


def open_local(path) -> dataset.TokenData:
    return dataset.open_data(str(path), cache_dir=str(Path(path).parent / "cache"))


# ---- Batches

def test_rows_read_in_pieces_concatenate_to_the_full_batch(synthetic):
    data = open_local(synthetic)
    full = data.batch("train", step=3, batch_size=8, seq_len=SEQ, seed=7)
    assert full.shape == (8, SEQ + 1) and full.dtype == np.int32
    for pieces in (1, 2, 4, 8):
        size = 8 // pieces
        fresh = open_local(synthetic)  # as each process would: its own reader
        parts = [fresh.batch("train", 3, 8, SEQ, 7, rows=range(i, i + size)) for i in range(0, 8, size)]
        np.testing.assert_array_equal(np.concatenate(parts), full)
    # every row is a run of consecutive tokens, so targets are inputs shifted by one
    np.testing.assert_array_equal(np.diff(full, axis=1), 1)


def test_rows_loaded_counts_only_the_rows_asked_for(synthetic):
    data = open_local(synthetic)
    data.batch("train", 0, 8, SEQ, seed=0, rows=range(2, 5))
    assert data.rows_loaded == 3
    data.batch("train", 1, 8, SEQ, seed=0, rows=range(6, 8))
    assert data.rows_loaded == 5
    list(data.eval_batches(2, 4, SEQ, rows=range(1, 2)))
    assert data.rows_loaded == 7


def test_steps_and_seeds_give_different_rows_and_two_readers_agree(synthetic):
    a, b = open_local(synthetic), open_local(synthetic)
    step0 = a.batch("train", 0, 8, SEQ, seed=1)
    np.testing.assert_array_equal(step0, b.batch("train", 0, 8, SEQ, seed=1))
    step1 = a.batch("train", 1, 8, SEQ, seed=1)
    assert not set(step0[:, 0]) & set(step1[:, 0])  # within an epoch no window repeats
    assert not np.array_equal(step0, a.batch("train", 0, 8, SEQ, seed=2))


def first_tokens_of_two_epochs(data, batch=5, seed=3):
    counts = [n // (SEQ + 1) for n in TRAIN_SIZES]
    epoch = sum(counts)  # 985 windows; batch 5 divides it: 197 steps per epoch
    firsts = np.concatenate([data.batch("train", s, batch, SEQ, seed=seed)[:, 0] for s in range(2 * epoch // batch)])
    expected = {base + w * (SEQ + 1) for base, n in zip(BASES, counts) for w in range(n)}
    return firsts[:epoch], firsts[epoch:], expected


def test_one_epoch_visits_every_window_once_then_reshuffles(synthetic):
    first_epoch, second_epoch, expected = first_tokens_of_two_epochs(open_local(synthetic))
    assert set(first_epoch) == expected and len(set(first_epoch)) == len(first_epoch)
    assert set(second_epoch) == expected
    assert not np.array_equal(first_epoch, second_epoch)  # a fresh permutation


def test_batches_sample_every_shard_at_once(synthetic):
    """With no more shards than a round holds, every batch is drawn from the whole split:
    the first 100 windows hold each shard about in proportion to its windows (the old
    shard-by-shard walk drew them all from one shard)."""
    first_epoch, _, _ = first_tokens_of_two_epochs(open_local(synthetic))
    shard_of = np.searchsorted(BASES, first_epoch[:100], side="right") - 1
    share = np.bincount(shard_of, minlength=4) / 100
    expected_share = np.array([n // (SEQ + 1) for n in TRAIN_SIZES]) / 985  # 0.32 0.19 0.49 0
    np.testing.assert_allclose(share, expected_share, atol=0.15)
    assert np.count_nonzero(np.diff(shard_of)) > 30  # interleaved, not in runs


def test_rounds_pool_a_bounded_set_of_shards(synthetic, monkeypatch):
    """With more shards than a round holds, an epoch is a sequence of rounds; each round's
    windows come only from its own shards, pooled and shuffled, and the shards of the next
    round are the ones prefetched."""
    monkeypatch.setattr(dataset, "SHARDS_PER_ROUND", 2)
    dataset._epoch_rounds.cache_clear(), dataset._round_order.cache_clear()
    try:
        data = open_local(synthetic)
        first_epoch, second_epoch, expected = first_tokens_of_two_epochs(data)
        assert set(first_epoch) == expected and len(set(first_epoch)) == len(first_epoch)
        counts = tuple(n // (SEQ + 1) for n in TRAIN_SIZES)
        rounds, ends = dataset._epoch_rounds(3, 0, counts)
        assert sorted(s for r in rounds for s in r) == [0, 1, 2, 3] and all(len(r) == 2 for r in rounds)
        shard_of = np.searchsorted(BASES, first_epoch, side="right") - 1
        starts = np.concatenate([[0], ends[:-1]])
        for shards, start, end in zip(rounds, starts, ends):
            assert set(shard_of[start:end]) == {s for s in shards if counts[s]}
        assert dataset.next_round_shards(3, counts, 0) == rounds[1]
        assert dataset.next_round_shards(3, counts, int(ends[-1]) - 1) == dataset._epoch_rounds(3, 1, counts)[0][0]
    finally:
        dataset._epoch_rounds.cache_clear(), dataset._round_order.cache_clear()


def test_eval_batches_are_fixed_and_spread_over_the_val_split(synthetic):
    data = open_local(synthetic)
    first = list(data.eval_batches(3, 4, SEQ))
    again = list(open_local(synthetic).eval_batches(3, 4, SEQ))
    assert len(first) == 3
    for x, y in zip(first, again):
        np.testing.assert_array_equal(x, y)
    starts = np.concatenate([b[:, 0] for b in first]) - VAL_BASE
    assert starts[0] == 0 and starts[-1] > 3000  # spread over all 250 windows, not the first 12
    by_row = [list(data.eval_batches(3, 4, SEQ, rows=range(r, r + 1))) for r in range(4)]
    for b in range(3):
        np.testing.assert_array_equal(np.concatenate([batches[b] for batches in by_row]), first[b])
    with pytest.raises(ValueError, match="val split holds 250 windows"):
        data.eval_batches(100, 4, SEQ)


def test_rows_outside_the_batch_are_refused(synthetic):
    with pytest.raises(ValueError, match="outside the global batch"):
        open_local(synthetic).batch("train", 0, 8, SEQ, 0, rows=range(6, 10))


# ---- Clear errors

def test_truncated_shard_is_reported(synthetic):
    path = synthetic / "train_2.npy"
    path.write_bytes(path.read_bytes()[:1000])
    data = open_local(synthetic)
    with pytest.raises(dataset.ShardError, match="train_2.npy.*truncated or corrupt"):
        for step in range(200):  # until a row comes from that shard
            data.batch("train", step, 8, SEQ, seed=0)


def test_flipped_byte_is_a_checksum_mismatch(synthetic):
    path = synthetic / "val_0.npy"
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(dataset.ShardError, match="checksum mismatch.*val_0.npy"):
        list(open_local(synthetic).eval_batches(1, 4, SEQ))


def test_missing_shard_and_missing_manifest_are_reported(synthetic):
    (synthetic / "val_0.npy").unlink()
    with pytest.raises(dataset.ShardError, match="val_0.npy listed in manifest.json is missing"):
        list(open_local(synthetic).eval_batches(1, 4, SEQ))
    (synthetic / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match="not a prepared data directory"):
        open_local(synthetic)
    with pytest.raises(FileNotFoundError, match="neither an embedded dataset"):
        dataset.open_data(str(synthetic / "nowhere"), str(synthetic))


def test_manifest_without_val_split_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no 'val' split"):
        open_local(write_dataset(tmp_path / "noval", val=False))


def test_token_ids_outside_the_vocabulary_are_refused(tmp_path, synthetic):
    # at write time: 70_000 does not fit a 65_536-id vocabulary (a uint16 shard would wrap it)
    with pytest.raises(ValueError, match="token id 70000 is outside the vocabulary"):
        dataset.write_shard(str(tmp_path), "bad.npy", np.array([1, 70_000]), vocab_size=65_536)
    assert not (tmp_path / "bad.npy").exists()
    # at read time: a manifest that claims a smaller vocabulary than the shards use
    manifest = json.loads((synthetic / "manifest.json").read_text())
    manifest["vocab_size"] = 70_000
    (synthetic / "manifest.json").write_text(json.dumps(manifest))
    data = open_local(synthetic)
    with pytest.raises(ValueError, match="shard val_0.npy: token id 8\\d{4} is outside the vocabulary"):
        list(data.eval_batches(1, 4, SEQ))


def test_check_tokenizer(synthetic):
    data = open_local(synthetic)
    dataset.check_tokenizer(data, VOCAB, "synthetic")
    dataset.check_tokenizer(data, VOCAB + 96, "synthetic")  # a padded model vocabulary is fine
    with pytest.raises(ConfigError, match="tokenized with 'synthetic' but --data.tokenizer is 'bytes': pass --data.tokenizer synthetic"):
        dataset.check_tokenizer(data, VOCAB, "bytes")
    with pytest.raises(ConfigError, match="--model.vocab_size is 257: pass --model.vocab_size 100000 or more"):
        dataset.check_tokenizer(data, 257, "synthetic")


def test_a_tokenizer_mismatch_is_one_line_that_names_the_flag(synthetic, tmp_path):
    """Shards made by another tokenizer than --data.tokenizer's: main.py prints the one line, no traceback."""
    run = subprocess.run([sys.executable, "main.py", "--data.source", str(synthetic), "--run.out_dir", str(tmp_path / "runs")],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines() == ["error: the data was tokenized with 'synthetic' but --data.tokenizer is 'bytes': pass "
                                               "--data.tokenizer synthetic or point --data.source at shards made with 'bytes' "
                                               "(data/tokenize.py --encoding)"]


# ---- The embedded default

@pytest.fixture(scope="module")
def shakespeare_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    dataset.open_data("shakespeare", str(cache))
    return cache


def test_shakespeare_is_prepared_once_with_train_and_val(shakespeare_cache):
    folder = shakespeare_cache / "shakespeare"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["tokenizer"] == "bytes" and manifest["vocab_size"] == 257
    tokens = {split: sum(e["tokens"] for e in shards) for split, shards in manifest["splits"].items()}
    assert tokens["train"] > 4_000_000 and 0.05 < tokens["val"] / sum(tokens.values()) < 0.10
    stamp = (folder / "manifest.json").stat().st_mtime_ns
    data = dataset.open_data("shakespeare", str(shakespeare_cache))  # reused, not prepared again
    assert (folder / "manifest.json").stat().st_mtime_ns == stamp

    bytes_tokenizer = dataset.get_tokenizer("bytes")
    val_text = bytes_tokenizer.decode(np.load(folder / manifest["splits"]["val"][0]["file"]))
    assert val_text.startswith("JULIUS CAESAR\n\nFLAVIUS:\nHence! home, you idle creatures get you home:")
    assert "<|endoftext|>THE TEMPEST" in val_text
    train_text = "".join(bytes_tokenizer.decode(np.load(folder / e["file"])) for e in manifest["splits"]["train"])
    assert "HAMLET:\nTo be, or not to be: that is the question:" in train_text
    assert not set("*_#[]\\") & set(train_text)  # no markdown left
    row = bytes_tokenizer.decode(data.batch("train", 0, 4, 128, seed=0)[0])
    assert row in train_text


def test_markdown_to_text_drops_markup():
    markdown = ("# Hamlet\n\n## ACT I\n\n### SCENE I. Elsinore.\n\n_Enter BERNARDO and\nFRANCISCO_\n\n"
                "**BERNARDO**  \nWho's there?  \n_\\[Aside]_  \nNay\\--answer me.\n")
    assert shakespeare.markdown_to_text(markdown) == "HAMLET\n\nBERNARDO:\nWho's there?\nNay--answer me.\n"


def test_processes_preparing_at_once_share_one_copy(tmp_path):
    script = (f"import sys; sys.path.insert(0, {str(REPO)!r}); import dataset; "
              f"dataset.open_data('shakespeare', {str(tmp_path)!r})")
    procs = [subprocess.Popen([sys.executable, "-c", script]) for _ in range(3)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    assert sorted(os.listdir(tmp_path)) == ["shakespeare", "shakespeare.lock"]


# ---- Tokenizers and data/tokenize.py

MERGES = [b"th", b"he", b"the", b" the", b"in", b"an", b"er", b"on", b" a", b"nd", b" and", b"ou"]


def tiny_ranks() -> dict[bytes, int]:
    ranks = {bytes([i]): i for i in range(256)}
    for merge in MERGES:
        ranks[merge] = len(ranks)
    return ranks


def tiny_encoding() -> tiktoken.Encoding:
    """A real BPE: the 256 byte tokens plus a few merges, and an end-of-text token."""
    return tiktoken.Encoding("tiny_bpe", pat_str=dataset.CUSTOM_SPLIT_PATTERN, mergeable_ranks=tiny_ranks(),
                             special_tokens={"<|endoftext|>": len(tiny_ranks())})


def write_rank_file(path: Path) -> Path:
    """tiny_ranks() as a .tiktoken file: base64 token, rank per line."""
    path.write_text("".join(f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in tiny_ranks().items()))
    return path


def test_tokenizers_round_trip(tmp_path):
    text = "Then the king and the queen—and thou, then? <|endoftext|>"
    bytes_tokenizer = dataset.get_tokenizer("bytes")
    assert (bytes_tokenizer.vocab_size, bytes_tokenizer.eot_id) == (257, 256)
    assert bytes_tokenizer.decode(bytes_tokenizer.encode(text) + [256]) == text + "<|endoftext|>"
    assert bytes_tokenizer.decode([72, 300, 105]) == "H\ufffdi"  # 300: only a padded model has it

    tiny = dataset.get_tokenizer(tiny_encoding())
    assert (tiny.name, tiny.vocab_size, tiny.eot_id) == ("tiny_bpe", 269, 268)
    ids = tiny.encode(text)
    assert tiny.decode(ids) == text and len(ids) < len(text.encode()) and max(ids) < 268
    from_file = dataset.get_tokenizer("tiny_bpe", str(write_rank_file(tmp_path / "t.tiktoken")))
    assert from_file.encode(text) == ids and from_file.eot_id == 268


def test_unavailable_tiktoken_encoding_says_how_to_provide_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # nothing cached: it must download
    try:
        tokenizer = dataset.get_tokenizer("cl100k_base")
    except RuntimeError as e:
        assert "encoding_file" in str(e) and "TIKTOKEN_CACHE_DIR" in str(e)
    else:  # this machine has network access
        assert tokenizer.vocab_size == 100277 and tokenizer.eot_id == 100257
    with pytest.raises(ValueError, match="unknown tokenizer 'nope'"):
        dataset.get_tokenizer("nope")


def write_corpus(folder: Path, n_docs: int) -> list[str]:
    rng = np.random.default_rng(0)
    words = np.array("the king and queen then thou art in an honour none other sound a".split())
    docs = [" ".join(rng.choice(words, rng.integers(5, 300))) + f" #{i}" for i in range(n_docs)]
    folder.mkdir()
    half = n_docs // 2  # two files: one JSONL, one with a document per file
    (folder / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:half]))
    for i, doc in enumerate(docs[half:half + 3]):
        (folder / f"b{i}.txt").write_text(doc)
    return docs[:half + 3]


def test_tokenize_to_shards_to_batches(tmp_path):
    docs = write_corpus(tmp_path / "corpus", 200)
    tokenizer = dataset.get_tokenizer(tiny_encoding())
    files = tokenize_script.expand_inputs([str(tmp_path / "corpus")])
    assert [Path(f).name for f in files] == ["a.jsonl", "b0.txt", "b1.txt", "b2.txt"]
    settings = {"inputs": files, "test": True}
    manifest = tokenize_script.tokenize_corpus(
        tokenize_script.iter_file_documents(files, "text"), str(tmp_path / "out"), tokenizer,
        settings, shard_tokens=5000, val_tokens=3000, workers=2)
    assert manifest["tokenizer"] == "tiny_bpe" and manifest["dtype"] == "uint16"
    # the shards, concatenated, are exactly every document encoded + end-of-text, in order
    expected = np.concatenate([tokenizer.encode(d) + [tokenizer.eot_id] for d in docs])
    stream = np.concatenate([np.load(tmp_path / "out" / e["file"]) for split in ("val", "train")
                             for e in manifest["splits"][split]])
    np.testing.assert_array_equal(stream, expected)
    val_tokens = sum(e["tokens"] for e in manifest["splits"]["val"])
    assert 3000 <= val_tokens < 3000 + 2000 and manifest["splits"]["val"][-1]["end"][1] == 0
    assert all(e["tokens"] == 5000 for e in manifest["splits"]["train"][:-1])

    data = open_local(tmp_path / "out")
    dataset.check_tokenizer(data, tokenizer.vocab_size, "tiny_bpe")
    text = tokenizer.decode(data.batch("train", 2, 4, 64, seed=0)[1])
    assert text in tokenizer.decode(expected)

    def rerun(settings):
        return tokenize_script.tokenize_corpus(
            tokenize_script.iter_file_documents(files, "text"), str(tmp_path / "out"), tokenizer,
            settings, shard_tokens=5000, val_tokens=3000, workers=2)
    assert rerun(settings) == manifest  # a finished directory is left as it is
    with pytest.raises(SystemExit, match="holds a run with other settings"):
        rerun({**settings, "test": False})


def test_hf_dataset_without_the_datasets_package_or_network_fails_clearly(tmp_path):
    # HF_HUB_OFFLINE: the same failure, at once (with no network but the hub reachable in
    # name only, datasets retries for ~25 s first)
    result = subprocess.run([sys.executable, str(REPO / "data" / "tokenize.py"), "--hf_dataset",
                             "roneneldan/TinyStories", "--encoding", "bytes", "--out", str(tmp_path / "out")],
                            capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert result.returncode != 0
    assert "pip install datasets" in result.stderr or "Without network access" in result.stderr


def run_tokenize_script(corpus: Path, out: Path, rank_file: Path, **popen):
    return subprocess.Popen(
        [sys.executable, str(REPO / "data" / "tokenize.py"), "--input", str(corpus), "--out", str(out),
         "--encoding", "tiny_bpe", "--encoding_file", str(rank_file), "--shard_tokens", "4000",
         "--val_tokens", "20000", "--workers", "2"],
        stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL, **popen)


def shard_digests(out: Path) -> dict:
    manifest = json.loads((out / "manifest.json").read_text())
    return {e["file"]: (e["tokens"], e["start"], e["end"], hashlib.sha256((out / e["file"]).read_bytes()).hexdigest())
            for shards in manifest["splits"].values() for e in shards}


def test_killed_tokenization_resumes_to_the_same_shards(tmp_path):
    write_corpus(tmp_path / "corpus", 6000)
    rank_file = write_rank_file(tmp_path / "tiny.tiktoken")
    assert run_tokenize_script(tmp_path / "corpus", tmp_path / "whole", rank_file).wait(timeout=120) == 0

    # SIGKILL the script (and its workers) once a few train shards are on disk
    out = tmp_path / "resumed"
    proc = run_tokenize_script(tmp_path / "corpus", out, rank_file, start_new_session=True)
    progress = out / "progress.json"
    def train_shards_done():
        return len(json.loads(progress.read_text())["splits"]["train"]) if progress.exists() else 0
    while proc.poll() is None and train_shards_done() < 3:
        time.sleep(0.002)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "manifest.json").exists(), "the corpus was done before the kill: make it larger"
    finished = json.loads(progress.read_text())["splits"]["train"]
    assert len(finished) >= 3

    assert run_tokenize_script(tmp_path / "corpus", out, rank_file).wait(timeout=120) == 0
    assert shard_digests(out) == shard_digests(tmp_path / "whole")
