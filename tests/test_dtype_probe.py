"""--model.dtype auto (runtime/dtype_probe.py): the probe timing tiny shapes for real, each
dtype's time taken in that dtype and kept under its name, the cache it writes; the
decision from measured matmul times, both outcomes forced through the probe's cache (so
that neither depends on this machine's speed), the choice written into config.json and
kept by a resume."""

import json
import os

import numpy as np
import pytest

from planning import costs
from runtime import dtype_probe
from test_main import data_cache, main_py  # noqa: F401  (data_cache: a fixture)
from utils import parse_args


@pytest.mark.parametrize("seconds, dtype, why", [
    ({"bfloat16": 1.5, "float32": 1.0}, "float32", "float32 matmuls 1.5x faster than bfloat16 here"),
    ({"bfloat16": 1.0, "float32": 2.0}, "bfloat16", "bfloat16 matmuls 2x faster than float32 here"),
    ({"bfloat16": 1.1, "float32": 1.0}, "bfloat16", "float32 matmuls only 1.1x faster than bfloat16 here, below the 1.2x"),
    ({"bfloat16": 1.0, "float32": 1.0}, "bfloat16", "bfloat16 matmuls 1x faster"),
])
def test_float32_is_chosen_only_when_its_matmuls_are_clearly_faster(seconds, dtype, why):
    chosen, reason = dtype_probe.choose(seconds)
    assert chosen == dtype and reason.startswith(why), reason


TINY_SHAPES = [(64, 16, 32), (64, 32, 8)]  # (rows, in, out)


def test_the_probe_times_tiny_shapes_in_each_dtype_and_caches_the_times(tmp_path, monkeypatch):
    """An empty cache: the probe runs the matmuls (in the dtype it names them by: the
    activations and their gradients in it, the weights' gradients float32), writes both
    times under the machine's key, and the next call reads them back."""
    for name, (fn, args) in dtype_probe.probe_calls(TINY_SHAPES).items():
        y, dx, dw, *_ = fn(*args)
        assert (y.dtype, dx.dtype, dw.dtype) == (np.dtype(name), np.dtype(name), np.dtype("float32")), name
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    seconds, cached = dtype_probe.probed_seconds(TINY_SHAPES)
    assert not cached and sorted(seconds) == sorted(dtype_probe.DTYPES) and all(0 < s < 10 for s in seconds.values()), seconds
    with open(tmp_path / "meshformer" / "dtype_probe.json") as f:
        assert json.load(f) == {dtype_probe.probe_key(TINY_SHAPES): seconds}
    assert dtype_probe.probed_seconds(TINY_SHAPES) == (seconds, True)


def test_each_time_is_kept_under_the_name_of_the_call_it_timed():
    """fastest_calls over real probe calls of very different sizes (~1000x the FLOPs),
    each dtype's name given the large one in turn: the large call's time is the one
    under its name."""
    small, large = dtype_probe.probe_calls([(64, 8, 8)]), dtype_probe.probe_calls([(256, 512, 512)])
    for slow in dtype_probe.DTYPES:
        calls = {name: (large if name == slow else small)[name] for name in dtype_probe.DTYPES}
        seconds = dtype_probe.fastest_calls(calls, repeats=3)
        fast = [name for name in dtype_probe.DTYPES if name != slow][0]
        assert seconds[slow] > 5 * seconds[fast], (slow, seconds)


def test_auto_is_the_laptop_default_and_bfloat16_for_accelerators():
    assert parse_args([]).model.dtype == "auto"
    assert parse_args(["--preset", "moe1b"]).model.dtype == "bfloat16"  # accelerator presets say so themselves
    assert parse_args(["--preset", "tiny"]).model.dtype == "float32"
    # the planner sizes the default for a TPU as bfloat16 (2-byte gathered weights), without a probe
    assert costs.plan(parse_args(["--mesh.dp", "1"]), 1, "tpu-v4")["dtype"] == "bfloat16"


def force_probe(cache_home, cfg, bfloat16_s, float32_s):
    """Write this machine's probe result for cfg's shapes into a cache under cache_home:
    the run reads it as a measurement it made before."""
    path = os.path.join(cache_home, "meshformer", "dtype_probe.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    key = dtype_probe.probe_key(dtype_probe.matmul_shapes(cfg.model, cfg.train))
    with open(path, "w") as f:
        json.dump({key: {"bfloat16": bfloat16_s, "float32": float32_s}}, f)


def dtype_lines(stdout):
    return [line for line in stdout.splitlines() if line.startswith("dtype: ")]


@pytest.mark.slow  # three main.py runs of the tiny preset
def test_each_outcome_lands_in_config_json_and_a_resume_keeps_it(tmp_path, data_cache):
    steps = ["--model.dtype", "auto", "--train.decay_steps", "4", "--train.eval_every", "1000", "--train.checkpoint_every", "2"]
    cfg = parse_args(["--preset", "tiny", *steps])
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    force_probe(tmp_path / "cache", cfg, bfloat16_s=2.0, float32_s=1.0)
    first = main_py([*steps, "--train.steps", "2", "--run.name", "a"], tmp_path, data_cache, env=env)
    assert dtype_lines(first.stdout) == [f"dtype: float32 (auto: float32 matmuls 2x faster than bfloat16 here, probe cached in "
                                         f"{tmp_path}/cache/meshformer/dtype_probe.json)"]
    config = tmp_path / "a" / "config.json"
    assert json.loads(config.read_text())["model"]["dtype"] == "float32"

    # The machine's probe now says bfloat16 (another machine, or a faster library): the
    # run goes on in the float32 it started in, and a new run takes bfloat16.
    force_probe(tmp_path / "cache", cfg, bfloat16_s=1.0, float32_s=2.0)
    resumed = main_py([*steps, "--train.steps", "4", "--run.name", "a"], tmp_path, data_cache, env=env)
    assert "resumed from" in resumed.stdout
    assert dtype_lines(resumed.stdout) == [f"dtype: float32 (auto: kept from {tmp_path}/a/config.json: a run computes in one dtype)"]
    assert json.loads(config.read_text())["model"]["dtype"] == "float32"
    fresh = main_py([*steps, "--train.steps", "2", "--run.name", "b"], tmp_path, data_cache, env=env)
    assert dtype_lines(fresh.stdout)[0].startswith("dtype: bfloat16 (auto: bfloat16 matmuls 2x faster than float32 here")
    assert json.loads((tmp_path / "b" / "config.json").read_text())["model"]["dtype"] == "bfloat16"
