"""The planner's compute on a TPU as the TPU compiler's clock would time it
(planning/compute_clock.py): a matmul at its roofline, the kinds of work adding up to the
compute the plan prints and following the layout, the assumed efficiency where there is
no compiler to learn from or --efficiency says. Against the compiled steps themselves:
tests/test_tpu_compile.py (slow)."""

import re

import pytest

from planning import compute_clock, costs
from planning.activations import local_sizes
from test_planner import run_cli
from utils import parse_args

V4 = costs.HARDWARE["tpu-v4"]
# moe1b at dp 32 on a v4-64, AdamW (Muon's Newton-Schulz is added to the compute beside the kinds)
DP32 = ["--preset", "moe1b", "--mesh.dp", "32", "--mesh.pp", "1", "--mesh.tp", "1", "--train.optimizer", "adamw"]


def test_a_matmul_takes_its_flops_or_its_bytes_whichever_is_longer():
    assert compute_clock.roofline_s(8192, 8192, 8192, 2, V4) == pytest.approx(2 * 8192 ** 3 / V4.peak_flops)
    # 8 rows against an 8192 x 8192 weight: the weight's bytes bound it, 35x its FLOPs' time
    assert compute_clock.roofline_s(8, 8192, 8192, 2, V4) == pytest.approx(2 * (2 * 8 * 8192 + 8192 ** 2) / V4.hbm_bw)
    assert compute_clock.roofline_s(8, 8192, 8192, 2, V4, batch=3) == pytest.approx(3 * compute_clock.roofline_s(8, 8192, 8192, 2, V4))


def test_on_a_tpu_the_compute_is_its_kinds_of_work_and_elsewhere_assumed():
    cfg = parse_args(DP32 + ["--train.microbatches", "8", "--model.remat", "none"])
    p = costs.plan(cfg, 0, "tpu-v4")
    compute = sum(p["compute_kinds"].values())
    assert p["times"]["compute"] == pytest.approx(compute, rel=1e-12)
    layers = compute - compute_clock.update_seconds(V4, p["memory"]["params"] + p["memory"]["optimizer"])  # (the update: 4 ms)
    assert p["efficiency"] == pytest.approx(p["times"]["executed_flops"] / (32 * V4.peak_flops * layers), rel=1e-12)
    assert 0.1 < p["efficiency"] < 0.5  # (0.23: half of moe1b's step outside its matmuls, on the compiler's clock)
    for given in (costs.plan(cfg, 0, "tpu-v4", efficiency=0.5), costs.plan(cfg, 0, "h100")):
        assert given["compute_kinds"] is None and given["efficiency"] == 0.5
        assert given["times"]["compute"] == pytest.approx(given["times"]["executed_flops"] / (32 * given["peak_flops"] * 0.5))
    assert re.search(r"compute as the TPU compiler would time it \(planning/compute_clock\.py\): \d+% of 275TFLOP/s",
                     run_cli(*DP32, "--hardware", "tpu-v4"))
    assert "compute at an assumed 50% of 275TFLOP/s" in run_cli(*DP32, "--hardware", "tpu-v4", "--efficiency", "0.5")


def kinds(*flags):
    return costs.plan(parse_args(DP32 + list(flags)), 0, "tpu-v4")["compute_kinds"]


def test_the_kinds_follow_the_layout():
    """remat block runs the matmuls' and splash's forwards again; block_dots splash's
    alone; more microbatches add their float32 gradient sums (gathered once: the blocks'
    whole) to the matmul fusions, and shrink each matmul towards its bytes."""
    none, block, dots = (kinds("--train.microbatches", "1", "--model.remat", remat) for remat in ("none", "block", "block_dots"))
    assert block["matmul fusions"] == pytest.approx(none["matmul fusions"] * 4 / 3)
    assert dots["matmul fusions"] == none["matmul fusions"] and dots["kernels"] == block["kernels"] > none["kernels"]
    cfg = parse_args(DP32 + ["--train.microbatches", "1", "--model.remat", "none"])
    s = local_sizes(cfg, {"dp": 32, "cp": 1, "pp": 1, "tp": 1})
    W = s.K + s.R  # splash: 48 attention layers (8 blocks of 6), the causal 3 of 2 x 2 blocks of 512, 5W + 4K MACs a pair
    pairs = s.b * s.H * 1024 * 1024 * 3 / 4
    assert none["kernels"] * V4.peak_flops == pytest.approx(48 * 2 * pairs * (5 * W + 4 * s.K))
    eight = kinds("--train.microbatches", "8", "--model.remat", "none")
    assert eight["kernels"] == pytest.approx(none["kernels"])  # the same tokens in 8 pieces
    assert eight["matmul fusions"] > none["matmul fusions"]  # the sums' adds, and 1,024-row matmuls nearer their bytes
    # gathered once, each microbatch after the first adds into the blocks' whole float32 sums (4 bytes a weight, moe1b's
    # blocks 0.93B weights), read with the gradient and written: 7 x 3 x 3.7 GB at 1.2 TB/s; FSDP's shards are 1/32 of it
    shards = kinds("--train.microbatches", "8", "--model.remat", "none", "--train.gather_once", "false")
    assert 0.06 < eight["matmul fusions"] - shards["matmul fusions"] < 0.07
