"""--data.mixture (data/mixture.py) and the embedded `code` corpus: a mixture's batches are the same on any mesh and any
number of processes, its tokens per source follow the weights (stages switching at their step), bad mixtures fail in one
line, and a run without a mixture reads exactly what it read before mixtures existed."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import dataset
from data import mixture as mixing
from parallel.mesh import global_batch, make_mesh, process_rows
from utils import ConfigError, MeshConfig, parse_args

REPO = Path(__file__).resolve().parent.parent
SEQ = 15  # windows of 16 tokens
# Synthetic sources whose every token names its source: source i holds BASE * i + arange(n).
BASE, SIZES = 100_000, {"a": 90_000, "b": 60_000, "c": 70_000}
VOCAB = 400_000


def write_source(folder: Path, index: int, tokens: int, tokenizer="synthetic", vocab_size=VOCAB) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    splits = {"train": [dataset.write_shard(str(folder), f"train_{k}.npy", BASE * index + np.arange(k * tokens // 3, (k + 1) * tokens // 3),
                                            vocab_size) for k in range(3)],
              "val": [dataset.write_shard(str(folder), "val_0.npy", BASE * index + 99_000 + np.arange(900), vocab_size)]}
    dataset.write_manifest(str(folder), splits, tokenizer, vocab_size, eot_id=vocab_size - 1)
    return str(folder)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    return {name: write_source(root / name, i + 1, n) for i, (name, n) in enumerate(SIZES.items())}


def config(spec, cache_dir, batch_size=8, seq_len=SEQ, *flags):
    return parse_args(["--data.mixture", spec, "--data.cache_dir", str(cache_dir), "--train.batch_size", str(batch_size),
                       "--model.seq_len", str(seq_len), *flags])


def source_of(tokens_BT):
    """Which synthetic source (index from 1) each row came from, by its first token."""
    return tokens_BT[:, 0] // BASE


# ---- Batches: the same on every mesh and process count, and after a restart


@pytest.fixture(scope="module")
def embedded_cache(tmp_path_factory):
    """shakespeare and code prepared once for this module."""
    cache = tmp_path_factory.mktemp("data_cache")
    for name in ("shakespeare", "code"):
        dataset.prepare_embedded(name, str(cache))
    return cache


MIX, MIX_BATCH, MIX_SEQ, MIX_STEPS = "shakespeare:0.7,code:0.3", 16, 32, 21


def batches_on(mesh, cfg):
    """Steps 0..MIX_STEPS-1 of the mixture as global arrays on `mesh` (this process reading its rows), back on the host."""
    data = mixing.open_mixture(cfg)
    rows = process_rows(mesh, MIX_BATCH)
    out = [np.asarray(global_batch(mesh, data.batch("train", s, MIX_BATCH, MIX_SEQ, cfg.run.seed, rows), MIX_BATCH))
           for s in range(MIX_STEPS)]
    data.close()
    return np.stack(out)


def test_a_mixtures_batches_are_the_same_on_one_and_eight_devices(embedded_cache):
    cfg = config(MIX, embedded_cache, MIX_BATCH, MIX_SEQ)
    one = batches_on(make_mesh(cfg.mesh, jax.devices()[:1]), cfg)
    eight = batches_on(make_mesh(MeshConfig(dp=2, pp=2, tp=2)), cfg)
    assert one.shape == (MIX_STEPS, MIX_BATCH, MIX_SEQ + 1)
    np.testing.assert_array_equal(one, eight)
    assert len({row.tobytes() for row in one.reshape(-1, MIX_SEQ + 1)}) == MIX_STEPS * MIX_BATCH  # no window twice
    # both sources are in there: code rows hold far more newlines followed by spaces (indentation) than verse does
    indented = [(row[:-1] == ord("\n")) & (row[1:] == ord(" ")) for row in one.reshape(-1, MIX_SEQ + 1)]
    assert 0 < sum(map(np.any, indented)) < MIX_STEPS * MIX_BATCH


def test_a_fresh_reader_gives_any_step_as_one_that_read_up_to_it(sources, tmp_path):
    """A restart needs only the step: a reader opened at step 13 gives the batches of one that read steps 0..12 first."""
    cfg = config(f"{sources['a']}:0.6,{sources['b']}:0.4", tmp_path)
    straight = mixing.open_mixture(cfg)
    before = [straight.batch("train", s, 8, SEQ, 0) for s in range(20)]
    resumed = mixing.open_mixture(cfg)
    for s in range(13, 20):
        np.testing.assert_array_equal(resumed.batch("train", s, 8, SEQ, 0, range(2, 6)), before[s][2:6])


def test_two_processes_read_the_mixture_one_process_reads(embedded_cache, tmp_path):
    """2 processes x 4 devices, each reading only its rows, assemble the same global batches as one process."""
    from test_multiprocess import free_port  # (the shared helper; importing it starts nothing)

    worker = REPO / "tests" / "mixture_worker.py"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES", "PJRT_NPROC")}
    env["PYTHONPATH"] = str(REPO)
    procs = [subprocess.Popen([sys.executable, str(worker), str(tmp_path / f"p{i}.npy"), "--data.mixture", MIX,
                               "--data.cache_dir", str(embedded_cache), "--train.batch_size", str(MIX_BATCH),
                               "--model.seq_len", str(MIX_SEQ), "--run.cpu_devices", "4", "--mesh.dp", "2", "--mesh.pp", "2", "--mesh.tp", "2",
                               "--dist.coordinator", f"127.0.0.1:{port}", "--dist.num_processes", "2", "--dist.process_id", str(i)],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    cfg = config(MIX, embedded_cache, MIX_BATCH, MIX_SEQ)
    one = batches_on(make_mesh(cfg.mesh, jax.devices()[:1]), cfg)
    for i in range(2):
        np.testing.assert_array_equal(np.load(tmp_path / f"p{i}.npy"), one)
        assert f"rows_loaded={MIX_STEPS * MIX_BATCH // 2}" in outputs[i], outputs[i]  # each process read half the rows


@pytest.mark.slow
def test_a_mixture_run_resumed_at_step_13_repeats_its_losses_and_tokens(embedded_cache, tmp_path):
    """Trained to step 20 with a checkpoint at 13, then again from 13 (--train.resume_step): steps 14..20 give the same
    losses, tokens per source and per-source val losses, bit for bit."""
    cmd = [sys.executable, "main.py", "--preset", "tiny", "--data.mixture", MIX, "--data.cache_dir", str(embedded_cache),
           "--train.steps", "20", "--train.checkpoint_every", "13", "--train.eval_every", "10", "--train.eval_batches", "1",
           "--log.every", "1", "--sample.num_samples", "0", "--log.plots", "false", "--log.progress", "false",
           "--run.out_dir", str(tmp_path), "--run.name", "mix"]
    metrics = tmp_path / "mix" / "metrics.jsonl"

    def run_rows(*extra):
        done = subprocess.run(cmd + list(extra), cwd=REPO, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return [{k: v for k, v in row.items() if k in ("step", "loss", "val_loss") or "/" in k}
                for row in map(json.loads, metrics.read_text().splitlines()) if "loss" in row or "val_loss" in row]

    straight = run_rows()
    resumed = run_rows("--train.resume_step", "13")
    assert [r for r in straight if r["step"] > 13] == [r for r in resumed if r["step"] > 13]
    assert {"tokens/shakespeare", "tokens/code"} <= set(resumed[-2]) and "val_loss/code" in resumed[-1]


# ---- Tokens per source follow the weights, and the stages


def rows_per_source(data, steps, batch_size=8):
    """Rows of each synthetic source in the batches of `steps`, counted from the tokens read."""
    picked = np.concatenate([source_of(data.batch("train", s, batch_size, SEQ, 5)) for s in steps])
    return {name: int(np.sum(picked == i + 1)) for i, name in enumerate(SIZES)}


def test_tokens_per_source_follow_the_weights_over_1000_steps(sources, tmp_path):
    cfg = config(f"{sources['a']}:0.7,{sources['b']}:0.2,{sources['c']}:0.1", tmp_path)
    data = mixing.open_mixture(cfg)
    seen = rows_per_source(data, range(1000))
    total = sum(seen.values())
    for name, weight in (("a", 0.7), ("b", 0.2), ("c", 0.1)):
        assert abs(seen[name] / total - weight) <= 0.02 * weight, seen
    # the train row's tokens/<name> (closed form) is what the batches held
    assert data.train_row(1000) == {f"tokens/{name}": n * SEQ for name, n in seen.items()}


def test_stages_switch_their_weights_at_their_step(sources, tmp_path):
    spec = {"sources": {"a": sources["a"], "b": sources["b"], "c": sources["c"]}, "weights": {"a": 3, "b": 1},
            "stages": [{"step": 400, "weights": {"a": 0.2, "b": 0.5, "c": 0.3}}]}
    path = tmp_path / "mix.json"
    path.write_text(json.dumps(spec))
    data = mixing.open_mixture(config(str(path), tmp_path))
    first, second = rows_per_source(data, range(400)), rows_per_source(data, range(400, 1000))
    assert first["c"] == 0 and second["c"] > 0
    assert np.any(source_of(data.batch("train", 400, 8, SEQ, 5)) == 3) or np.any(source_of(data.batch("train", 401, 8, SEQ, 5)) == 3)
    for counts, weights in ((first, {"a": 0.75, "b": 0.25, "c": 0}), (second, {"a": 0.2, "b": 0.5, "c": 0.3})):
        total = sum(counts.values())
        for name, weight in weights.items():
            assert abs(counts[name] / total - weight) <= 0.02 * weight, (counts, weights)
    # a source keeps its place across the switch: its windows in the second stage are new ones (no repeat within an epoch)
    rows = np.concatenate([data.batch("train", s, 8, SEQ, 5) for s in range(1000)])
    a_rows = rows[source_of(rows) == 1]
    assert len({r.tobytes() for r in a_rows}) == len(a_rows)
    assert data.train_row(1000)["tokens/c"] == second["c"] * SEQ


def test_eval_reports_each_source_and_their_weighted_mean(sources, tmp_path):
    data = mixing.open_mixture(config(f"{sources['a']}:0.25,{sources['b']}:0.75", tmp_path))
    row = data.evaluate(lambda part: float(next(part.eval_batches(1, 8, SEQ))[0, 0] // BASE))  # "loss" = the source's index
    assert row == {"val_loss": 0.25 * 1 + 0.75 * 2, "val_loss/a": 1.0, "val_loss/b": 2.0}


# ---- Bad mixtures: one line each, saying what to change


@pytest.fixture(scope="module")
def odd_sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("odd")
    return {"tokenizer": write_source(root / "other_tokenizer", 1, 3000, tokenizer="gpt2"),
            "vocab": write_source(root / "other_vocab", 1, 3000, vocab_size=VOCAB + 1)}


@pytest.mark.parametrize("spec, says", [
    ("{a}:0.5,{b}:-0.5", "weights are numbers >= 0"),
    ("{a}:0.5,/no/such/dir:0.5", "neither an embedded dataset"),
    ("{a}:0.5,{tokenizer}:0.5", "one tokenizer"),
    ("{a}:0.5,{vocab}:0.5", "one tokenizer"),
    ("{a}:0,{b}:0", "at least one source a positive weight"),
    ("{a}:0.5,{a}:0.5", "names a source twice"),
    ("{a}0.5", "is not NAME:WEIGHT"),
    ("{a}:lots", "weights are numbers >= 0"),
    ("/no/such/mix.json", "no file"),
])
def test_bad_mixtures_fail_in_one_line(spec, says, sources, odd_sources, tmp_path):
    spec = spec.format(**sources, **odd_sources)
    with pytest.raises(ConfigError) as error:
        mixing.open_mixture(config(spec, tmp_path))
    assert says in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_main_py_stops_a_bad_mixture_in_one_line(tmp_path):
    run = subprocess.run([sys.executable, "main.py", "--data.mixture", "shakespeare:0.7,code:-0.3", "--run.out_dir", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and run.stderr.strip().splitlines() == [
        "error: --data.mixture: the weight of 'code' is '-0.3'; weights are numbers >= 0"], run.stderr[-2000:]


# ---- Without a mixture, nothing changes


# sha256 of the default config's train batches 0..2 and first eval batch (shakespeare, batch 16, seq_len 128, seed 0), as
# the tree before mixtures (ea80d93) read them.
DEFAULT_DIGEST = "3f46de934b2a781f379563dcb684ee6e1c9add59d4129bb52759cc28675f7a4f"


def test_the_default_data_reads_what_it_read_before_mixtures(embedded_cache):
    cfg = parse_args([])
    data = dataset.open_data(cfg.data.source, str(embedded_cache))
    digest = hashlib.sha256()
    for step in range(3):
        digest.update(data.batch("train", step, cfg.train.batch_size, cfg.model.seq_len, cfg.run.seed).tobytes())
    digest.update(next(data.eval_batches(1, cfg.train.batch_size, cfg.model.seq_len)).tobytes())
    assert digest.hexdigest() == DEFAULT_DIGEST


def test_the_code_corpus_is_the_standard_librarys_python(embedded_cache):
    manifest = json.loads((embedded_cache / "code" / "manifest.json").read_text())
    assert manifest["source"].startswith("Python ") and manifest["tokenizer"] == "bytes"
    data = dataset.open_data("code", str(embedded_cache))
    text = bytes(next(data.eval_batches(1, 64, 255)).reshape(-1).clip(0, 255).astype(np.uint8)).decode("utf-8", "replace")
    assert "def " in text and "import " in text
    assert data.windows_per_shard("val", 255) and sum(data.windows_per_shard("train", 255)) > 10 * sum(data.windows_per_shard("val", 255))


@pytest.mark.slow
def test_mode_eval_of_a_mixture_run_prints_each_sources_val_loss_as_its_eval_rows(embedded_cache, tmp_path):
    """--mode eval on a run trained on a mixture: one val_loss/<name>= line per source, then the mixture's val_loss=, the
    numbers of the run's last eval row (the same params, eval set and mesh)."""
    flags = ["--preset", "tiny", "--data.mixture", MIX, "--data.cache_dir", str(embedded_cache), "--train.steps", "4",
             "--train.eval_every", "4", "--train.eval_batches", "1", "--model.dtype", "float32", "--sample.num_samples", "0",
             "--log.plots", "false", "--log.progress", "false", "--run.out_dir", str(tmp_path), "--run.name", "mix"]
    for mode in ("train", "eval"):
        done = subprocess.run([sys.executable, "main.py", *flags, "--mode", mode], cwd=REPO, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    printed = dict(line.split("=", 1) for line in done.stdout.strip().splitlines()[-3:])
    (row,) = [row for row in map(json.loads, (tmp_path / "mix" / "metrics.jsonl").read_text().splitlines()) if "val_loss" in row]
    assert list(printed) == ["val_loss/shakespeare", "val_loss/code", "val_loss"]  # val_loss= stays the last line
    assert {k: float(v) for k, v in printed.items()} == pytest.approx({k: row[k] for k in printed}, rel=1e-6)
    assert abs(row["val_loss/shakespeare"] - row["val_loss/code"]) > 0.01  # two sources, two numbers
