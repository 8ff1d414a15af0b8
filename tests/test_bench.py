"""bench.py as outside scripts use it: the last line, the --json figures and how they
relate, and the --profile table. (Tests never judge a speed; they check the arithmetic.)"""

import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench_py(tmp_path, *args):
    cmd = [sys.executable, os.path.join(REPO, "bench.py"), "--preset", "tiny", "--steps", "3", "--warmup", "1",
           "--run.compile_cache", "", "--json", str(tmp_path / "bench.json"), *args]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(tmp_path / "bench.json") as f:
        return result.stdout, json.load(f)


@pytest.mark.parametrize("mesh", [(1, 1, 1), pytest.param((2, 2, 2), marks=pytest.mark.slow)], ids=["1x1x1", "2x2x2"])
def test_figures_are_consistent_and_the_last_line_is_machine_readable(tmp_path, mesh):
    dp, pp, tp = mesh
    stdout, figures = bench_py(tmp_path, "--run.cpu_devices", str(dp * pp * tp), "--mesh.dp", str(dp), "--mesh.pp", str(pp),
                               "--mesh.tp", str(tp), "--train.microbatches", str(pp))
    last = stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"tokens_per_sec=([0-9.]+) mfu=([0-9.]+)", last)
    assert match, last
    assert float(match[1]) == pytest.approx(figures["tokens_per_sec"], rel=1e-3)
    assert float(match[2]) == pytest.approx(figures["mfu"], abs=1e-4)
    assert figures["mesh"] == dict(dp=dp, pp=pp, tp=tp) and figures["devices"] == dp * pp * tp
    assert figures["tokens_per_step"] == 16 * 16  # the tiny preset: 16 sequences of 16 tokens
    assert figures["tokens_per_sec"] == pytest.approx(figures["tokens_per_step"] / figures["step_s"])
    # MFU = model FLOPs per step / (step time x devices x peak)
    mfu = figures["model_tflops_per_step"] / (figures["step_s"] * figures["devices"] * figures["peak_tflops_per_device"])
    assert figures["mfu"] == pytest.approx(mfu)
    assert 0 < figures["mfu"] < 1
    assert figures["bubble"] == pytest.approx((pp - 1) / (pp + pp - 1))  # microbatches = pp
    # the run's wall time (the README's estimate): tiny's 100 steps and 2 evaluations of 2 batches
    assert figures["run_estimate_s"] == pytest.approx(figures["compile_s"] + figures["step_s"] * (100 + 4 / 3) + 30)
    for key in ("params_bytes", "opt_bytes", "temp_bytes"):
        assert figures[key] > 0, key
    assert figures["opt_bytes"] == pytest.approx(2 * figures["params_bytes"], rel=1e-3)  # AdamW: two float32 moments per weight
    # The collectives of the compiled step (hlo_reader.collective_table), printed too
    collectives = figures["collectives"]
    assert figures["sharding"] == "manual"
    if mesh == (2, 2, 2):  # FSDP gathers over dp, the pipeline's ppermute along pp, Megatron's psums over tp
        assert {"all-gather over dp", "collective-permute over pp", "all-reduce over tp"} <= set(collectives), collectives
    else:
        assert set(collectives) <= {"all-reduce over none", "collective-permute over none"}, collectives  # one device
    for name, c in collectives.items():
        assert re.search(rf"{re.escape(name)}:\s+{c['count']}x", stdout), name


@pytest.mark.slow
def test_profile_prints_device_time_by_op_kind(tmp_path):
    stdout, _ = bench_py(tmp_path, "--profile", str(tmp_path / "trace"))
    table = stdout[stdout.index("device time per step by XLA op kind"):].splitlines()[1:]
    rows = [re.match(r"\s+([0-9.]+) ms\s+([0-9.]+)%\s+(\d+)x\s+(\S+)", line) for line in table]
    rows = [r for r in rows if r]
    assert len(rows) >= 5
    shares = [float(r[2]) for r in rows]
    assert shares == sorted(shares, reverse=True) and sum(shares) <= 100.5
    kinds = {r[4] for r in rows}
    assert any("fusion" in k or k.startswith("dot") for k in kinds), kinds
