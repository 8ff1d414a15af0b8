"""The real TPU compiler, on this CPU (libtpu, requirements-test.txt): every preset's
mesh is valid on the pods people use, the train step compiles for them, fits their
HBM, emits the collectives that parallel/mesh.py says it does, and the planner's bytes are
within 15% of the compiler's. The devices are the pod slices' own (jax.experimental.
topologies: real chip coordinates and process indices); nothing runs on them.
"""

import math
import os

import jax
import numpy as np
import pytest

from model import abstract_model, abstract_params
from parallel.fsdp import gather_packed, gather_weight, unpack_packed
from parallel.mesh import batch_spec, make_mesh, process_rows
from parallel.steps import make_train_step
from parallel.weights import WEIGHTS, weight_name
from planning import cli, costs, hlo_reader, tpu_compile
from utils import DP, PP, PRESETS, TP, Config, MeshConfig, apply_overrides

pytest.importorskip("libtpu")

# (pod, mesh shapes): every preset mesh and the layouts people try on each slice.
POD_MESHES = {
    "v4-8": [(4, 1, 1), (2, 1, 2), (1, 2, 2), (1, 1, 4), (2, 2, 1)],
    "v4-64": [(8, 2, 2), (32, 1, 1), (16, 1, 2), (4, 2, 4), (8, 4, 1), (2, 2, 8), (1, 2, 16)],
    "v5p-64": [(8, 2, 2), (32, 1, 1), (4, 2, 4), (16, 2, 1)],
    "v5litepod-16": [(4, 2, 2), (16, 1, 1), (8, 1, 2), (4, 1, 4), (2, 8, 1)],
    "v6e-16": [(4, 2, 2), (16, 1, 1), (8, 1, 2), (2, 2, 4), (8, 2, 1)],
}


@pytest.fixture(scope="module")
def devices_of():
    cache = {}

    def get(pod):
        if pod not in cache:
            cache[pod] = tpu_compile.pod_devices(pod)
        return cache[pod]
    return get


def chips_per_host(devices):
    return max(sum(d.process_index == p for d in devices) for p in {d.process_index for d in devices})


def test_loading_the_tpu_compiler_leaves_the_environment_of_later_processes_alone():
    """pod_devices sets libtpu's environment (TPU_WORKER_HOSTNAMES, ...) only while libtpu
    loads: left set, it would make every main.py this process starts afterwards take
    itself for a TPU pod worker and wait for a coordinator (devices.setup_devices)."""
    before = dict(os.environ)
    assert len(tpu_compile.pod_devices("v4-8")) == 4
    assert {k: v for k, v in os.environ.items() if k.startswith("TPU_")} == {k: v for k, v in before.items() if k.startswith("TPU_")}


# ---- The mesh and each process's rows


def test_jax_make_mesh_cannot_map_the_reference_mesh(devices_of):
    """Why make_mesh does more than call jax.make_mesh: the reference 1B run's mesh
    (dp8 x pp2 x tp2 on a v4-64) has no assignment there."""
    with pytest.raises(NotImplementedError):
        jax.make_mesh((8, 2, 2), (DP, PP, TP), devices=devices_of("v4-64"))


@pytest.mark.parametrize("pod, shape", [(pod, shape) for pod, shapes in POD_MESHES.items() for shape in shapes],
                         ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else x)
def test_make_mesh_and_process_rows_on_real_topologies(devices_of, pod, shape):
    """Every device once; tp groups on as few hosts as possible (one, when tp fits in a
    host); each host's devices in as few dp rows as possible; and each process's rows
    (from the topology's real process indices) are exactly the rows of the dp rows its
    devices sit in."""
    devices = devices_of(pod)
    mesh = make_mesh(MeshConfig(*shape), devices)
    dp, pp, tp = shape
    assert mesh.devices.shape == (1, dp, 1, pp, tp)  # one slice, no cp
    grid = mesh.devices[0, :, 0]
    assert grid.shape == shape and sorted(d.id for d in grid.flat) == sorted(d.id for d in devices)
    per_host = chips_per_host(devices)
    for i in range(dp):
        for j in range(pp):
            assert len({d.process_index for d in grid[i, j]}) == math.ceil(tp / per_host)
    batch = 4 * dp
    rows_per_dp = batch // dp
    for process in sorted({d.process_index for d in devices}):
        dp_rows = sorted({i for i in range(dp) for d in grid[i].flat if d.process_index == process})
        assert len(dp_rows) == math.ceil(per_host / (pp * tp))
        expected = [r for i in dp_rows for r in range(i * rows_per_dp, (i + 1) * rows_per_dp)]
        assert list(process_rows(mesh, batch, process)) == expected


# ---- Compiled steps: collectives, fits, the planner's bytes
#
# moe1b scaled down keeps its structure (MLA with 64-wide heads, DDDDDM blocks with 2
# shared + top-2 of 8 routed experts, bfloat16, remat block, 4 microbatches).
#
# What the compiler's bytes are made of (libtpu's log, tpu_compile.compiler_log_memory):
# memory_analysis()'s temporaries are the live ones plus twice the holes between them
# (every HBM buffer starts at a multiple of 16 KiB; nested loops leave gaps). On these
# small steps the holes are most of it (tiny: 4-5 MiB of holes around 0.07-0.18 MiB of
# live HBM temporaries; scaled-down moe1b: 19-38 MiB around 24-26 MiB), so the planner,
# which models live bytes, is compared with the live temporaries: those in HBM plus
# those the compiler placed in v4's CMEM or v5p/v6e's VMEM (measured 0.95 on v4-64 8x2x2,
# 0.93 on v5p-64 8x1x4 with expert parallelism; 1.48-1.52 before the planner modelled
# XLA:TPU's fusion, planner_activations.recomputed_block_bytes). The full moe1b (slow) is held to
# 15% of memory_analysis itself too (0.89 on v4-64, 0.90 on v5p-64).
# tiny's temporaries cannot be held to 15%: the compiler keeps almost all of them in
# CMEM/VMEM, whose log gives the region reserved (1.5-5.8 MiB), not what is live in it;
# the planner's lie between the live HBM bytes and those plus the whole region.

# (matmul attention, as these checks were made: --model.attention auto is splash on a TPU
# at T = 256, test_splash_attention_compiles_to_the_splash_kernels below; the blocks
# scanned, as the preset had them then: the planner's bytes do not tell the two apart,
# and the scan compiles in less time)
SMALL_MOE1B = dict(vocab_size=8192, seq_len=256, d_model=256, n_heads=4, head_dim=64, rope_dim=64, q_latent=128,
                   kv_latent=128, n_blocks=2, d_ff=1024, d_expert=256, n_experts=8, attention="matmul", unroll_blocks=False)
# The real-checkpoint presets at the same widths (their full-rank queries kept) and a
# smaller vocabulary, every other option of theirs kept: the dense first layer, the untied
# head, 6 of 8 experts by sigmoid (moonlight) or softmax (V2-Lite) scores, YaRN (V2-Lite).
SMALL_REAL = dict({k: v for k, v in SMALL_MOE1B.items() if k != "q_latent"}, vocab_size=2048)
PLANNER_TOLERANCE = 0.15
OVERLAP_OVERESTIMATE = 0.30  # test_cp8_at_32k_tokens_...: the planner over the async schedule's live bytes

# name: (preset, pod, mesh, expert parallel)
CASES = {
    "tiny-v4-8-2x1x2": ("tiny", "v4-8", (2, 1, 2), False),
    "tiny-v6e-16-8x1x2": ("tiny", "v6e-16", (8, 1, 2), False),
    "moe-v4-64-8x2x2": ("moe1b-small", "v4-64", (8, 2, 2), False),
    "moe-v5p-64-8x1x4-ep": ("moe1b-small", "v5p-64", (8, 1, 4), True),
    "tiny-v5litepod-16-4x2x2": ("tiny", "v5litepod-16", (4, 2, 2), False),
}
SLOW_CASES = {  # (v5p-64 8x2x2 compiles alike: planner.py --table, docs/planning.md)
    "moe1b-v4-64-8x2x2": ("moe1b", "v4-64", (8, 2, 2), False),
    # (moonlight and deepseek_v2_lite at full size on v4-64 8x2x2: train steps compile in 230-260 s here, their
    # output in docs/planning.md; moonlight scaled down: test_planner_tpu_prints_the_compiler_beside_the_planner)
}
# the cases that compile a 1B-shaped (if narrow) model: slow, ~50-75 s each; of tiny's, v4-8 in the fast
# selection (the v6e and v5e topologies, and pp under the TPU compiler, ~15 s each: slow)
CASE_NAMES = [pytest.param(name, marks=[] if name == "tiny-v4-8-2x1x2" else [pytest.mark.slow]) for name in CASES]


def case_config(preset, shape, expert_parallel, overrides=None, **model):
    cfg = apply_overrides(Config(), PRESETS[preset.split("-")[0]])
    dp, pp, tp = shape
    train = {}
    if preset == "tiny":
        model = dict(dict(vocab_size=256, dtype="bfloat16"), **model)
        train = dict(microbatches=max(pp, 1))
    elif preset == "moe1b-small":
        model = dict(SMALL_MOE1B, **model)
        train = dict(batch_size=64, microbatches=4)
    cfg = apply_overrides(cfg, {"model": model, "train": train,
                                "mesh": dict(dp=dp, pp=pp, tp=tp, expert_parallel=expert_parallel)})
    return apply_overrides(cfg, overrides or {})


def compile_case(devices_of, preset, pod, shape, expert_parallel, eval_step=True, overrides=None, **model):
    """{"plan", "tpu" (memory), "collectives", "hbm", ...} of the compiled train step
    (and the eval step's collectives)."""
    cfg = case_config(preset, shape, expert_parallel, overrides, **model)
    mesh = make_mesh(cfg.mesh, devices_of(pod))
    hardware = tpu_compile.pod_type(pod).hardware
    compiled = tpu_compile.compile_steps(cfg, mesh, eval_step, hardware)
    params = abstract_params(cfg.model)
    gathered = {k: v for k, v in params.items() if k != "final_norm"}  # (norm scales are not FSDP-split)
    if expert_parallel:  # each rank's experts' gradients come back by the all-to-all: nothing to reduce over dp
        gathered = jax.tree_util.tree_map_with_path(lambda path, w: None if WEIGHTS[weight_name(path)].routed else w, gathered)
    hlo = compiled["train"].as_text()
    return dict(plan=costs.plan(cfg, 0, hardware), tpu=tpu_compile.memory_bytes(compiled["train"]), log=compiled["log"]["train"], hlo=hlo,
                collectives=hlo_reader.collectives(hlo, shape), ops=hlo_reader.collective_ops(hlo, shape),
                dot_flops=hlo_reader.dot_flops(hlo),
                busiest_bytes=hlo_reader.busiest_collective_bytes(hlo, shape),
                eval_collectives=hlo_reader.collectives(compiled["eval"].as_text(), shape) if eval_step else None,
                fsdp_gradient_bytes=costs.gathered_bytes(gathered, expert_parallel, dict(zip((DP, PP, TP), shape), cp=1), 4, False),
                hbm=costs.HARDWARE[hardware].memory_bytes, seconds=compiled["seconds"], muon=cfg.train.optimizer == "muon",
                prefix=cfg.model.first_dense > 0)


@pytest.fixture(scope="module")
def compiled_cases(devices_of):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = compile_case(devices_of, *CASES[name])
        return cache[name]
    return get


def kinds_over(collectives):
    """{kind: set of "over" entries} for ops that move data (a ppermute with no pairs,
    pp = 1, moves none)."""
    out = {}
    for (kind, dtype, over), row in collectives.items():
        if row["bytes"] and over != "-":
            out.setdefault(kind, set()).add(over)
    return out


def gradient_reduction_bytes(collectives, expert_parallel=False):
    """{dtype: bytes} of reductions spanning dp: the FSDP reduce-scatters of the
    gradients (all-to-alls: fsdp.scatter_by_all_to_all) and the loss and norm psums.
    The all-to-alls include Muon's float32 ones, if any (a lower bound stays one); under
    expert parallelism only the float32 ones count (the dispatch's are activations)."""
    out = {}
    for (kind, dtype, over), row in collectives.items():
        gradient_all_to_all = kind == "all-to-all" and (dtype == "f32" or not expert_parallel)
        if (kind == "all-reduce" or gradient_all_to_all) and "dp" in over:
            out[dtype] = out.get(dtype, 0) + row["bytes"]
    return out


def check_collectives(case, shape, expert_parallel):
    """What parallel/mesh.py says runs where: FSDP all-gathers over (axes with) dp and
    reduces every weight's gradient over them, in float32 and none in bfloat16; TP
    all-reduces over tp; the pipeline ppermutes over pp; expert parallelism all-to-alls
    over dp, Muon over the axes of its matrices' shards."""
    dp, pp, tp = shape
    kinds = kinds_over(case["collectives"])
    assert any("dp" in over for over in kinds["all-gather"])
    reduced = gradient_reduction_bytes(case["collectives"], expert_parallel)
    assert reduced.get("f32", 0) >= case["fsdp_gradient_bytes"] and "bf16" not in reduced, reduced
    assert ("tp" in kinds.get("all-reduce", set())) == (tp > 1)
    assert ("collective-permute" in kinds) == (pp > 1)
    if pp > 1:
        assert kinds["collective-permute"] == {"pp"}
    # all-to-alls: the FSDP gradients' reduce-scatters over the axes their weights are
    # gathered over (fsdp.scatter_by_all_to_all), expert parallelism's dispatch over
    # dp, and Muon's (moe1b's optimizer) momentum shards to each matrix's owner and back,
    # over the axes that split the matrix (optimizers.owner_orthogonal); nothing else
    # moves data all-to-all
    all_to_all = kinds.get("all-to-all", set())
    allowed = (kinds["all-gather"] | ({"dp"} if expert_parallel else set())
               | ({"dp", "tp", "dp+tp"} if case["muon"] else set()))
    if case["muon"] and case.get("prefix"):  # the dense prefix's weights: not stacked, so split over pp too
        allowed |= {"pp", "dp+pp", "pp+tp", "dp+pp+tp"}
    assert all_to_all <= allowed and ("dp" in all_to_all) >= expert_parallel and bool(all_to_all) >= case["muon"], all_to_all


@pytest.mark.parametrize("name", CASE_NAMES)
def test_planner_arguments_are_the_compilers_to_the_byte(compiled_cases, name):
    """Params, AdamW state and the batch, tiled as TPU memory tiles them (planner.
    tpu_tiled_bytes): the compiler's argument bytes exactly, from tiny's 8-wide dims
    (padded up to 16x) to the scaled-down moe1b's."""
    case = compiled_cases(name)
    mem = case["plan"]["memory"]
    assert mem["params"] + mem["optimizer"] + case["plan"]["batch_bytes"] == case["tpu"]["arguments"]


@pytest.mark.parametrize("name", CASE_NAMES)
def test_compilers_temporaries_are_the_live_ones_plus_twice_the_holes(compiled_cases, name):
    """What memory_analysis() reports, from libtpu's log of the same compile (printed to
    3 digits: within 0.5%)."""
    case = compiled_cases(name)
    log = case["log"]
    assert log is not None, "libtpu logged no memory summary (loaded before tpu_compile.pod_devices turned its log on?)"
    expected = log["hbm live temporaries"] + 2 * log["hbm fragmentation"]
    assert abs(case["tpu"]["temporaries"] / expected - 1) < 0.005


@pytest.mark.parametrize("name", CASE_NAMES)
def test_planner_against_the_compilers_live_bytes(compiled_cases, name):
    """Scaled-down moe1b: within 15% of the compiler's total with its live temporaries.
    tiny: between the live HBM temporaries and those plus the CMEM/VMEM region (see
    above: what is live in that region is not logged)."""
    preset = CASES[name][0]
    case, plan = compiled_cases(name), compiled_cases(name)["plan"]
    live = tpu_compile.live_temporaries(case["log"])
    if preset == "tiny":
        assert case["log"]["hbm live temporaries"] <= plan["temp_bytes"] <= live
    else:
        live_total = tpu_compile.live_total(case["tpu"], case["log"])
        assert abs(plan["total_bytes"] / live_total - 1) <= PLANNER_TOLERANCE, (plan["total_bytes"], live_total)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_step_compiles_fits_and_emits_the_intended_collectives(compiled_cases, name):
    preset, pod, shape, expert_parallel = CASES[name]
    case = compiled_cases(name)
    assert tpu_compile.fits(case["tpu"], case["log"], case["hbm"])
    check_collectives(case, shape, expert_parallel)
    eval_reductions = {(kind, dtype) for (kind, dtype, over) in case["eval_collectives"] if "dp" in over}
    assert not eval_reductions & {("all-to-all", "f32"), ("reduce-scatter", "f32")}, eval_reductions  # no gradients in eval


@pytest.mark.slow
def test_gather_once_reduce_scatters_the_gradients_over_dp(devices_of):
    """dp 32 on a v4-64 (a 2x4x4 group of chips), the blocks gathered once per step: the
    float32 gradients leave the step reduce-scattered over dp, each device receiving
    only its shard (fsdp.scatter_by_all_to_all: an all-to-all and a local sum). The
    float32 all-reduces over dp left are the losses' sums and the replicated norm
    scales' gradients (n_blocks x d_model each at most), never a whole FSDP gradient:
    libtpu lowers a psum_scatter over this group to an all-reduce of all of it (at
    94f5ce4 20 of them, the embedding's f32[8192, 256] the largest). ~2-3 min here."""
    case = compile_case(devices_of, "moe1b-small", "v4-64", (32, 1, 1), False, eval_step=False,
                        overrides=dict(train=dict(gather_once="true", microbatches=2), model=dict(remat="none")))
    assert case["plan"]["gather_once"]
    m = SMALL_MOE1B
    all_reduced = [(dtype, nbytes) for op in case["ops"] if op.kind == "all-reduce" and op.over == "dp"
                   for dtype, nbytes in op.arrays if dtype == "f32"]
    assert all_reduced and max(nbytes for _, nbytes in all_reduced) <= m["n_blocks"] * m["d_model"] * 4, all_reduced
    assert sum(nbytes for _, nbytes in all_reduced) < 0.01 * case["fsdp_gradient_bytes"], all_reduced
    scattered = case["collectives"].get(("all-to-all", "f32", "dp"), {}).get("bytes", 0)
    assert scattered >= case["fsdp_gradient_bytes"], (scattered, case["fsdp_gradient_bytes"])
    assert tpu_compile.fits(case["tpu"], case["log"], case["hbm"])


@pytest.mark.slow
def test_bfloat16_gradient_reduction_is_what_the_flag_says(devices_of):
    """--model.grad_reduce_dtype bfloat16 (half the bytes) reduces the gradients in
    bfloat16; the float32 default reduces none in bfloat16 (check_collectives)."""
    case = compile_case(devices_of, "tiny", "v4-8", (2, 1, 2), False, eval_step=False, grad_reduce_dtype="bfloat16")
    reduced = gradient_reduction_bytes(case["collectives"])
    assert reduced.get("bf16", 0) >= 0.4 * case["fsdp_gradient_bytes"] and reduced["bf16"] > reduced.get("f32", 0), reduced


def test_embedding_gradient_accumulates_in_float32_over_microbatches():
    """The tied embedding is gathered once per step and used by every microbatch's
    loss; the loop over microbatches carries its gradient in float32 (a bfloat16 carry
    rounds at every microbatch). Read off the train step's jaxpr on 8 CPU devices."""
    cfg = apply_overrides(case_config("tiny", (2, 2, 2), False), {"train": dict(microbatches=4)})
    mesh = make_mesh(cfg.mesh, jax.devices()[:8])
    optimizer, params, opt_state = tpu_compile.abstract_state(cfg, mesh)
    step = make_train_step(abstract_model(cfg.model)[0], cfg, mesh, optimizer, params, opt_state)
    tokens = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.seq_len + 1), np.int32,
                                  sharding=jax.sharding.NamedSharding(mesh, batch_spec()))
    jaxpr = jax.make_jaxpr(step)(params, opt_state, tokens, np.int32(0))
    embed_shape = (params["embed_VD"].shape[0] // 2, params["embed_VD"].shape[1])  # V/tp x D
    carries = [aval for aval in scan_carries(jaxpr.jaxpr) if tuple(aval.shape) == embed_shape]
    assert carries and {str(aval.dtype) for aval in carries} == {"float32"}


def scan_carries(jaxpr):
    """Avals of every scan's carry, in jaxpr and the jaxprs inside it."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            body = eqn.params["jaxpr"].jaxpr
            n_consts, n_carry = eqn.params["num_consts"], eqn.params["num_carry"]
            yield from (v.aval for v in body.invars[n_consts:n_consts + n_carry])
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from scan_carries(inner)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_CASES))
def test_full_moe1b_compiles_fits_and_the_planner_is_within_15_percent(devices_of, name):
    """The reference mesh of the 1B result (each train step compiles in ~75 s on 2 idle cores):
    within 15% of memory_analysis's total (planner 3.06 GiB, compiler 3.45 on v4-64). Against
    libtpu's live temporaries (2.38 GiB) the planner is high, its backward through one block
    the peak, so only the safe side is asserted there. The planner's compute (compute_clock,
    fitted on dp 32 with splash, no pipeline) is 0.53 of the step's on the compiler's clock
    here (929 against 1739 ms): it does not count matmul attention's work on the [T, T]
    scores nor the pipeline's, so this asserts that gap does not grow (docs/planning.md)."""
    preset, pod, shape, expert_parallel = SLOW_CASES[name]
    # (matmul attention, as these figures were measured: with splash, auto's choice on a TPU,
    # the compiler holds 3.51 GiB here and the planner says 2.81, 20% low: docs/pods.md; the
    # blocks scanned: unrolled, the preset's default since 36c05b4, memory_analysis says
    # 3.84 GiB, counting 0.7 GiB of holes between buffers twice, which the planner does not model)
    case = compile_case(devices_of, preset, pod, shape, expert_parallel, eval_step=False, attention="matmul", unroll_blocks=False)
    assert tpu_compile.fits(case["tpu"], case["log"], case["hbm"])
    check_collectives(case, shape, expert_parallel)
    assert abs(case["plan"]["total_bytes"] / case["tpu"]["total"] - 1) <= PLANNER_TOLERANCE
    assert case["plan"]["total_bytes"] >= tpu_compile.live_total(case["tpu"], case["log"]), "the planner says less than the compiler keeps live"
    hw, t = costs.HARDWARE[tpu_compile.pod_type(pod).hardware], case["plan"]["times"]
    clock_s = sum(op.step_seconds for op in hlo_reader.timed_ops(case["hlo"], hlo_reader.Chip(hw.clock_hz, hw.peak_flops, hw.hbm_bw)))
    assert 0.45 <= (t["compute"] + t["bubble"] + t["head"]) / clock_s <= 1.25


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["moonlight"])  # (deepseek_v2_lite scaled down is the same program but for
# its softmax scores and YaRN, neither of which moves a byte: its full size in docs/planning.md)
def test_planner_tpu_prints_the_compiler_beside_the_planner(preset, tmp_path):
    """`planner.py --preset moonlight --tpu v4-64 --hlo-out F`, scaled down in
    width, depth, experts and vocabulary: the real train and eval steps compile, fit, and
    the compiler's bytes print beside the planner's, the arguments (params, optimizer
    state, batch: the untied head and the dense first layer among them) equal to the byte;
    the collectives table has the pipeline's sends over pp and Muon's all-to-alls; the
    step on the compiler's clock is F's estimated cycles over their runs at v4's clock,
    told apart by the model's parts."""
    import io
    import re
    from contextlib import redirect_stdout

    from planning import report
    out, hlo_path = io.StringIO(), tmp_path / "train.hlo"
    with redirect_stdout(out):
        cli.main(["--preset", preset, "--tpu", "v4-64", "--hlo-out", str(hlo_path),
                  *[f"--model.{k}={v}" for k, v in SMALL_REAL.items()]])
    text = out.getvalue()
    arguments = re.search(r"^arguments \(params \+ optimizer \+ batch\) +([0-9.]+) GiB +([0-9.]+) GiB +1\.00$", text, re.M)
    assert arguments and arguments.group(1) == arguments.group(2), text
    assert re.search(r"^fits: [0-9.]+ GiB per device \+ the runtime's 1\.25 GiB of 32 GiB HBM$", text, re.M), text
    for row in (r"total as allocated \(the holes counted once\) +[0-9.]+ GiB +[0-9.]+ GiB", r"collective-permute +bf16 +pp ",
                r"all-to-all +f32 +dp\+tp ", r"collectives of the eval step"):
        assert re.search(row, text), row
    last = re.fullmatch(r"tpu_bytes_per_device=(\d+) planner_bytes_per_device=(\d+) fits=true "
                        r"collective_bytes=(\d+) exposed_bytes=(\d+) "
                        r"dot_flops_per_device=(\d+) planner_dot_flops_per_device=(\d+) "
                        r"low_precision_dot_flops_per_device=0 "
                        r"compiler_step_ms=([0-9.e+-]+) compiler_compute_ms=([0-9.e+-]+)", text.splitlines()[-1])
    assert last and int(last.group(1)) > 0 and int(last.group(2)) > 0, text.splitlines()[-1]
    assert 0 < int(last.group(4)) <= int(last.group(3)), text.splitlines()[-1]
    assert int(last.group(5)) > 0 and int(last.group(6)) > 0, text.splitlines()[-1]
    assert "the compiled train step's schedule (per step, per device)" in text
    assert re.search(r"^    elementwise +[0-9.]+ ms +[0-9.]+ ms   \(other fusions, copies and transposes, other ops\)$", text, re.M)
    v4 = costs.HARDWARE["tpu-v4"]
    ops = hlo_reader.timed_ops(hlo_path.read_text(), hlo_reader.Chip(1.05e9, v4.peak_flops, v4.hbm_bw))
    cycles_ms = sum(op.step_seconds for op in ops) * 1e3
    assert cycles_ms > 0 and float(last.group(8)) == pytest.approx(cycles_ms, rel=0.02)
    assert float(last.group(7)) >= float(last.group(8))
    parts = {op.op_name and hlo_reader.model_part(op.op_name, report.MODEL_PARTS) for op in ops}
    assert {"attention", "router", "moe_experts", "rms_norm", "loss_heads", "optimizer"} <= parts, parts


# ---- What the compiled schedule overlaps (hlo_reader.overlap) and the dot FLOPs it runs


def compile_ppermute_beside_a_matmul(independent):
    """A 4-chip program that sends a [1024, 1024] bf16 shard to the next chip (2 MiB) and
    runs a [1024, 1024] @ [1024, 1024] matmul: one that does not need what was sent
    (the compiler may run it between the send's start and done), or one that does."""
    from jax import shard_map
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    mesh = Mesh(np.array(tpu_compile.pod_devices("v4-8")).reshape(4), ("tp",))
    ring = [(i, (i + 1) % 4) for i in range(4)]

    def f(w, a, b):
        sent = jax.lax.ppermute(w, "tp", ring)
        return sent.sum() + (a @ b).sum() if independent else (sent @ b).sum()
    step = jax.jit(shard_map(f, mesh=mesh, in_specs=(P("tp"), P(), P()), out_specs=P(), check_vma=False))
    args = [jax.ShapeDtypeStruct(shape, jax.numpy.bfloat16, sharding=NamedSharding(mesh, spec))
            for shape, spec in (((4096, 1024), P("tp")), ((1024, 1024), P()), ((1024, 1024), P()))]
    with tpu_compile.captured_stderr():
        return step.lower(*args).compile().as_text()


SENT_BYTES = 1024 * 1024 * 2
MATMUL_FLOPS = 2 * 1024 ** 3


@pytest.mark.parametrize("independent", [True, False])
def test_overlap_of_a_compiled_send_beside_a_matmul(independent):
    """The matmul that does not need the sent shard is scheduled between the send's
    start and done (overlapped); the one that needs it runs after (exposed)."""
    hlo = compile_ppermute_beside_a_matmul(independent)
    found = hlo_reader.overlap(hlo, (4,))
    hidden = SENT_BYTES if independent else 0
    assert (found["overlapped"], found["exposed"]) == (hidden, SENT_BYTES - hidden)
    assert hlo_reader.dot_flops(hlo) == MATMUL_FLOPS  # XLA:TPU writes the matmul as a convolution


# FSDP's gathers in a scan of matmuls, compiled for a v4-8 with the overlap flags
# (devices.TPU_OVERLAP_FLAGS, which pod_devices gives libtpu): 4 layers of [1024, 1024]
# bf16 weights split over 4 chips, each gathered (2 MiB) before its matmul.
SCAN_LAYERS, SCAN_WIDTH = 4, 1024
LAYER_BYTES = SCAN_WIDTH * SCAN_WIDTH * 2


def compile_on_v4_8(fn, out_spec):
    """The optimized HLO of fn(w_LDD, x_BD) under shard_map over a v4-8's 4 chips ("dp"),
    4 layers of [1024, 1024] bf16 weights split over dp on their rows, x's rows over dp."""
    from jax import shard_map
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    mesh = Mesh(np.array(tpu_compile.pod_devices("v4-8")).reshape(4), ("dp",))
    step = jax.jit(shard_map(fn, mesh=mesh, in_specs=(P(None, "dp"), P("dp")), out_specs=out_spec, check_vma=False))
    bf16 = jax.numpy.bfloat16
    args = [jax.ShapeDtypeStruct((SCAN_LAYERS, SCAN_WIDTH, SCAN_WIDTH), bf16, sharding=NamedSharding(mesh, P(None, "dp"))),
            jax.ShapeDtypeStruct((256, SCAN_WIDTH), bf16, sharding=NamedSharding(mesh, P("dp")))]
    with tpu_compile.captured_stderr():
        return step.lower(*args).compile().as_text()


def plain_gather(w_shard):
    return jax.lax.all_gather(w_shard, "dp", axis=0, tiled=True)  # (its transpose: psum_scatter)


def compile_fsdp_scan(prefetch):
    """The HLO of a scan over 4 layers, h = tanh(h @ W_l), W_l gathered from its
    shards: with prefetch, layer l+1's gather is issued beside layer l's matmul (the
    first one before the loop); without, each layer's matmul needs the gather just
    issued, and nothing else runs beside it."""
    def f(w_LDD, x_BD):
        if prefetch:
            def layer(carry, w_next):
                h, w = carry
                return (jax.numpy.tanh(h @ w), plain_gather(w_next)), None
            (h, w), _ = jax.lax.scan(layer, (x_BD, plain_gather(w_LDD[0])), w_LDD[1:])
            h = jax.numpy.tanh(h @ w)
        else:
            h, _ = jax.lax.scan(lambda h, w_shard: (jax.numpy.tanh(h @ plain_gather(w_shard)), None), x_BD, w_LDD)
        return h.sum()
    return compile_on_v4_8(f, jax.sharding.PartitionSpec())


@pytest.mark.parametrize("prefetch", [True, False])
def test_overlap_of_fsdp_gathers_in_a_compiled_scan(prefetch):
    """Prefetched, the compiler splits each in-loop gather into an async collective
    fusion whose steps run inside the matmul's fusion: 3 layers overlapped, the first
    gather (before the loop, nothing to hide behind) exposed. Not prefetched, all 4
    exposed. Either way every gather counts once: 4 layers' bytes."""
    hlo = compile_fsdp_scan(prefetch)
    found = hlo_reader.overlap(hlo, (4,))
    hidden = (SCAN_LAYERS - 1) * LAYER_BYTES if prefetch else 0
    assert (found["overlapped"], found["exposed"]) == (hidden, SCAN_LAYERS * LAYER_BYTES - hidden)
    assert ("AsyncCollectiveStart" in hlo and "calls=%async_collective_fusion" in hlo) == prefetch


def compile_fsdp_scan_gradient(reduce_scatter):
    """The HLO of the gradient of the same 4-layer scan (no prefetch), each layer's
    weights gathered by the model's FSDP gather (parallel.gather_weight, bf16): its
    transpose reduces each layer's gradient by an all-to-all and a local sum; or, with
    reduce_scatter, that transpose put back to jax.lax.psum_scatter."""
    bf16 = jax.numpy.bfloat16

    def gather(w_shard):
        return plain_gather(w_shard) if reduce_scatter else gather_weight(w_shard, ("dp",), 0, bf16, bf16, bf16)

    def loss(w_LDD, x_BD):
        h, _ = jax.lax.scan(lambda h, w_shard: (jax.numpy.tanh(h @ gather(w_shard)), None), x_BD, w_LDD)
        return jax.lax.psum(h.astype(jax.numpy.float32).sum(), "dp")
    return compile_on_v4_8(jax.grad(loss), jax.sharding.PartitionSpec(None, "dp"))


@pytest.mark.parametrize("reduce_scatter", [False, True])
def test_fsdp_gradient_all_to_alls_overlap_the_backward_matmuls(reduce_scatter):
    """Why every FSDP gradient is an all-to-all (fsdp.scatter_by_all_to_all): each
    layer's gradient all-to-all runs beside the same layer's other backward matmul (the
    input's gradient), all 4 layers' bytes overlapped; as a reduce-scatter, the compiler
    runs none of it beside a matmul."""
    found = hlo_reader.overlap(compile_fsdp_scan_gradient(reduce_scatter), (4,))
    reduced = {kind: sides for (kind, _), sides in found["by kind"].items() if kind in ("all-to-all", "reduce-scatter")}
    kind = "reduce-scatter" if reduce_scatter else "all-to-all"
    hidden = 0 if reduce_scatter else SCAN_LAYERS * LAYER_BYTES
    assert reduced == {kind: {"overlapped": hidden, "exposed": SCAN_LAYERS * LAYER_BYTES - hidden}}, reduced


@pytest.mark.parametrize("packed", [True, False])
def test_one_collective_per_loop_step_overlaps_so_a_block_gathers_packed(packed):
    """Why apply_blocks's prefetch packs a block's weights into one all-gather: in a
    scan over 4 layers of 4 [1024, 1024] bf16 weights each, the next layer's weights
    gathered beside this layer's matmuls, the compiled schedule hides one all-gather
    of each loop step: gathered one by one, 1 of the 4 (6 of 32 MiB, 3 steps); packed
    (fsdp.gather_packed, cut out in the next step by unpack_packed), all 3 steps'
    (24 MiB; the first layer's, before the loop, waits)."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    n, k = 4, 4
    bf16, f32 = jax.numpy.bfloat16, jax.numpy.float32
    if packed:
        fetch = lambda w_kDD: gather_packed(list(w_kDD), ("dp",), bf16, f32)  # noqa: E731
        unpack = lambda buf: unpack_packed(buf, n, [((SCAN_WIDTH // n, SCAN_WIDTH), 0)] * k)  # noqa: E731
    else:
        fetch, unpack = (lambda w_kDD: [plain_gather(w) for w in w_kDD]), (lambda ws: ws)

    def f(w_LkDD, x_BD):
        def layer(carry, w_next):
            h, fetched = carry
            for w in unpack(fetched):
                h = jax.numpy.tanh(h @ w)
            return (h, fetch(w_next)), None
        (h, fetched), _ = jax.lax.scan(layer, (x_BD, fetch(w_LkDD[0])), w_LkDD[1:])
        for w in unpack(fetched):
            h = jax.numpy.tanh(h @ w)
        return h.sum()
    mesh = Mesh(np.array(tpu_compile.pod_devices("v4-8")).reshape(n), ("dp",))
    step = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(None, None, "dp"), P("dp")), out_specs=P(), check_vma=False))
    args = [jax.ShapeDtypeStruct((SCAN_LAYERS, k, SCAN_WIDTH, SCAN_WIDTH), bf16, sharding=NamedSharding(mesh, P(None, None, "dp"))),
            jax.ShapeDtypeStruct((256, SCAN_WIDTH), bf16, sharding=NamedSharding(mesh, P("dp")))]
    with tpu_compile.captured_stderr():
        hlo = step.lower(*args).compile().as_text()
    (found,) = [sides for (kind, _), sides in hlo_reader.overlap(hlo, (n,))["by kind"].items() if kind == "all-gather"]
    hidden_layers = (SCAN_LAYERS - 1) * (k if packed else 1)
    assert found == {"overlapped": hidden_layers * LAYER_BYTES, "exposed": SCAN_LAYERS * k * LAYER_BYTES - hidden_layers * LAYER_BYTES}


@pytest.mark.slow
@pytest.mark.parametrize("prefetch", [True, False])
def test_prefetched_block_gathers_overlap_the_blocks_matmuls(devices_of, monkeypatch, prefetch):
    """The scaled-down moe1b with 4 blocks, dp 4 on a v4-8, one microbatch, remat none:
    apply_blocks fetches block i + 1's weights, packed into one all-gather
    (fsdp.fetch_for_use), beside block i, and the compiled schedule runs every
    fetch in the loop under the matmuls (the first block's, before it, and the
    embedding's wait): over 60% of the gathered bytes (70% with the last block
    peeled, which fetched one block less). Without the prefetch (each of a block's
    weights gathered just before its matmul needs it), 0. ~1-2 min each here."""
    if not prefetch:
        from parallel import fsdp
        monkeypatch.setattr(fsdp, "prefetches_gathers", lambda cfg, passes: False)
    case = compile_case(devices_of, "moe1b-small", "v4-8", (4, 1, 1), False, eval_step=False,
                        overrides=dict(train=dict(microbatches=1), model=dict(remat="none", n_blocks=4)))
    gathers = hlo_reader.overlap(case["hlo"], (4, 1, 1))["by kind"][("all-gather", "dp")]
    share = gathers["overlapped"] / (gathers["overlapped"] + gathers["exposed"])
    assert (share > 0.6) if prefetch else share == 0, gathers


# A scheduled module by hand: a loop of 3 trips whose body sends 4 KiB while a fused
# matmul runs (overlapped) or before it (exposed), and a plain all-gather (exposed).
LOOP_HLO = """HloModule m, is_scheduled=true

%matmul (p0: bf16[64,128], p1: bf16[128,256]) -> bf16[64,256] {
  %p0 = bf16[64,128]{1,0} parameter(0)
  %p1 = bf16[128,256]{1,0} parameter(1)
  ROOT %convolution.1 = bf16[64,256]{1,0} convolution(%p0, %p1), dim_labels=bf_io->bf
}

%body (t: (s32[], f32[1024], bf16[64,128], bf16[128,256])) -> (s32[], f32[1024], bf16[64,128], bf16[128,256]) {
  %t = (s32[], f32[1024]{0}, bf16[64,128]{1,0}, bf16[128,256]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[1024]{0} get-tuple-element(%t), index=1
  %a = bf16[64,128]{1,0} get-tuple-element(%t), index=2
  %b = bf16[128,256]{1,0} get-tuple-element(%t), index=3
  %collective-permute-start = (f32[1024]{0}, f32[1024]{0}, u32[], u32[]) collective-permute-start(%x), channel_id=1, source_target_pairs={{0,1},{1,0}}
  FIRST
  %collective-permute-done = f32[1024]{0} collective-permute-done(%collective-permute-start)
  SECOND
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], f32[1024]{0}, bf16[64,128]{1,0}, bf16[128,256]{1,0}) tuple(%next, %collective-permute-done, %a, %b)
}

%cond (t: (s32[], f32[1024], bf16[64,128], bf16[128,256])) -> pred[] {
  %t = (s32[], f32[1024]{0}, bf16[64,128]{1,0}, bf16[128,256]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: f32[1024], a: bf16[64,128], b: bf16[128,256]) -> (s32[], f32[1024], bf16[64,128], bf16[128,256]) {
  %x = f32[1024]{0} parameter(0)
  %a = bf16[64,128]{1,0} parameter(1)
  %b = bf16[128,256]{1,0} parameter(2)
  %all-gather = f32[2048]{0} all-gather(%x), channel_id=2, replica_groups={{0,1}}, dimensions={0}
  %zero = s32[] constant(0)
  %init = (s32[], f32[1024]{0}, bf16[64,128]{1,0}, bf16[128,256]{1,0}) tuple(%zero, %x, %a, %b)
  ROOT %while = (s32[], f32[1024]{0}, bf16[64,128]{1,0}, bf16[128,256]{1,0}) while(%init), condition=%cond, body=%body
}
"""
FUSED_MATMUL = "%fusion = bf16[64,256]{1,0} fusion(%a, %b), kind=kOutput, calls=%matmul"


@pytest.mark.parametrize("convolution, operand_dims, flops", [
    # tiny's float32 step on v4-8 2x1x2: a weight's gradient over 128 tokens as a window of 4 over a dim of 1,
    # padded 3 each side: one tap of each output lands on the input (counted as 4, the step read 1.5x bf16's)
    ("f32[16,4,8]{2,0,1} convolution(%a, %b), window={size=4 pad=3_3 rhs_reversal=1}, dim_labels=fb0_0oi->b0f",
     dict(a=[128, 16, 1], b=[4, 8, 128]), 2 * 16 * 4 * 8 * 128),
    # a batched matmul over 8 as a window on the dilated input: one tap of 8
    ("f32[8,64,256]{2,1,0} convolution(%a, %b), window={size=8 stride=7 lhs_dilate=8}, dim_labels=0bf_0io->0bf",
     dict(a=[8, 64, 128], b=[8, 128, 256]), 2 * 8 * 64 * 256 * 128),
    ("f32[2,3,8]{2,1,0} convolution(%a, %b), window={size=3}, dim_labels=b0f_0io->b0f",  # a real convolution: 3 taps
     dict(a=[2, 5, 16], b=[3, 16, 8]), 2 * 2 * 3 * 8 * 16 * 3),
], ids=["padded-window", "dilated-window", "convolution"])
def test_dot_flops_count_the_window_taps_that_land_on_the_input(convolution, operand_dims, flops):
    line = f"  %c = {convolution}"
    m = hlo_reader.INSTRUCTION.match(line)
    assert hlo_reader.matmul_flops(line, m.group(1), m.group(3), operand_dims) == flops


# A Pallas kernel's custom call carries its metadata over several lines, one of them
# starting with "}}" (splash attention's, as libtpu prints it)
KERNEL_THEN_MATMUL = """HloModule m, is_scheduled=true

ENTRY %main (a: bf16[64,128], b: bf16[128,256]) -> bf16[64,256] {
  %a = bf16[64,128]{1,0} parameter(0)
  %b = bf16[128,256]{1,0} parameter(1)
  %kernel = f32[8]{0} custom-call(%a), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"xprof_metadata":"{\\"block_q\\": 128}"
}}, metadata={op_name="splash_mha_fwd/pallas_call"}
  ROOT %d = bf16[64,256]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


def test_an_instruction_over_several_lines_does_not_end_its_computation():
    """The lines after a kernel's metadata still count: before, its "}}" line closed the
    computation, and the full moe1b step with splash at T = 8192 read 1/10 of its dot FLOPs."""
    comps, entry = hlo_reader.split_computations(KERNEL_THEN_MATMUL)
    assert [line.split(" = ")[0].strip() for line in comps[entry]] == ["%a", "%b", "%kernel", "ROOT %d"]
    assert hlo_reader.dot_flops(KERNEL_THEN_MATMUL) == 2 * 64 * 128 * 256


def test_kernels_names_each_pallas_call_and_nothing_else():
    """Two calls of one kernel (one over several lines), another kernel, and a custom call
    that is not a Pallas kernel: {name: calls}, the ".N" suffix dropped."""
    hlo = KERNEL_THEN_MATMUL.replace("%kernel = ", "%splash_mha_fwd_residuals.2 = ").replace(
        "  ROOT %d", '  %splash_mha_fwd_residuals.7 = f32[8]{0} custom-call(%a), custom_call_target="tpu_custom_call"\n'
        '  %gmm = f32[8]{0} custom-call(%a), custom_call_target="tpu_custom_call"\n'
        '  %sharding = bf16[64,128]{1,0} custom-call(%a), custom_call_target="Sharding"\n  ROOT %d')
    assert hlo_reader.kernels(hlo) == {"splash_mha_fwd_residuals": 2, "gmm": 1}
    assert hlo_reader.kernels(KERNEL_THEN_MATMUL.replace(' custom_call_target="tpu_custom_call",', "")) == {}


@pytest.mark.parametrize("matmul_between", [True, False])
def test_overlap_parser_on_a_scheduled_loop(matmul_between):
    """Bytes per step: the loop's send 3 x 4 KiB, overlapped only when the matmul sits
    between its start and done; the all-gather (8 KiB, not async) always exposed."""
    hlo = LOOP_HLO.replace("FIRST" if matmul_between else "SECOND", FUSED_MATMUL).replace("FIRST", "").replace("SECOND", "")
    found = hlo_reader.overlap(hlo, (2,))
    sent = 3 * 4096
    assert found["overlapped"] == (sent if matmul_between else 0)
    assert found["exposed"] == 8192 + (0 if matmul_between else sent)
    assert hlo_reader.dot_flops(hlo) == 3 * 2 * 64 * 256 * 128


# ---- The planner's time model against the compiled step: the dot FLOPs each device runs
# (hlo_reader.dot_flops: loops by their trips, a cond at its costliest branch) and the
# bytes of its collectives (busiest_collective_bytes), per step.
#
# Found against these and fixed in the planner: the gradients are reduced in float32
# (the time model had counted them in bfloat16: half the bytes); the backward pass's
# tp all-reduces are float32 too, and the vocab-split embedding's output is all-reduced;
# the output layer runs on the last stage only (the other stages wait); the hand-written
# schedules gather a chunk's weights twice on every tick of their table (2 (M + pp - 1)
# ticks for 1f1b, not GPipe's M + pp - 1), whatever the stage runs; interleaved moves the
# chunks and their gradients once per step.

# Not held here: tiny on v5litepod-16 4x2x2 (GPipe, as in CASES): dot FLOPs 0.93 of the
# compiler's, but there the compiler all-gathers 5.7x the planner's bytes over dp
# (2.7 MB against 0.48; the same layout on v4-16 gathers exactly the planner's), not
# explained yet.
# name: (preset, pod, mesh, expert parallel, overrides); three are CASES above
TIME_CASES = {
    "tiny-v4-8-2x1x2": ("tiny", "v4-8", (2, 1, 2), False, None),
    "tiny-v4-16-2x2x2": ("tiny", "v4-16", (2, 2, 2), False, None),
    "moe-v4-64-8x2x2": ("moe1b-small", "v4-64", (8, 2, 2), False, None),
    "moe-v5p-64-8x1x4-ep": ("moe1b-small", "v5p-64", (8, 1, 4), True, None),
    "tiny-v5p-16-2x2x2-1f1b": ("tiny", "v5p-16", (2, 2, 2), False, dict(train=dict(pipeline="1f1b", microbatches=4))),
    "tiny-v4-16-1x4x2-interleaved": ("tiny", "v4-16", (1, 4, 2), False, dict(train=dict(pipeline="interleaved", microbatches=4))),
    "tiny-v5p-16-4x1x2-auto": ("tiny", "v5p-16", (4, 1, 2), False, dict(mesh=dict(sharding="auto"))),
}
TIME_TOLERANCE = 0.10
# Where the planner's collective bytes are further off, and why (measured ratio):
#   auto 0.81: the compiler's partitioner picks its own tensor-parallel collectives
#     (2.3x the planner's tp all-reduce bytes, all in bfloat16) and all-reduces the
#     gradients over dp instead of reduce-scattering them.
# (interleaved: 0.91, within TIME_TOLERANCE; its tp all-reduces are 0.79 of the
# compiler's, whose ticks carry more than the layers' inside their conds.)
BYTES_TOLERANCE = {"tiny-v5p-16-4x1x2-auto": 0.20}


@pytest.fixture(scope="module")
def time_cases(compiled_cases, devices_of):
    cache = {}

    def get(name):
        if name in CASES:
            return compiled_cases(name)
        if name not in cache:
            preset, pod, shape, ep, overrides = TIME_CASES[name]
            cache[name] = compile_case(devices_of, preset, pod, shape, ep, eval_step=False, overrides=overrides)
        return cache[name]
    return get


@pytest.mark.parametrize("name", [pytest.param(name, marks=[] if name == "tiny-v4-8-2x1x2"
                                               else [pytest.mark.slow]) for name in TIME_CASES])
def test_planner_dot_flops_and_collective_bytes_are_the_compilers(time_cases, name):
    case = time_cases(name)
    planned = case["plan"]["times"]
    assert planned["device_flops"] == pytest.approx(case["dot_flops"], rel=TIME_TOLERANCE)
    compiled_bytes = sum(case["busiest_bytes"].values())
    assert sum(planned["collective_bytes"].values()) == pytest.approx(compiled_bytes, rel=BYTES_TOLERANCE.get(name, TIME_TOLERANCE))
    # the planner's all-gathers are over the axes the compiled step's are (the report's rows pair up; its small
    # reduce-scatters the compiler may make all-reduces)
    gathers = {key for key, nbytes in planned["collective_bytes"].items() if nbytes and key.startswith("all-gather")}
    assert gathers <= set(case["busiest_bytes"]), (gathers, case["busiest_bytes"])


@pytest.mark.slow
def test_tpu_search_compiles_the_top_layout_and_prints_the_compilers_figures_beside_the_planners():
    """planner.py --tpu v4-64 --search on the scaled-down moe1b: the best layout is
    compiled; its block says whether the compiler fits it, the compiler's bytes, dot FLOPs
    and collectives beside the planner's, what of the communication the schedule
    overlaps and its step on the compiler's clock; the last line names a layout the
    compiler did not reject."""
    import io
    import re
    from contextlib import redirect_stdout
    model_flags = [f"--model.{k}={v}" for k, v in SMALL_MOE1B.items()]
    out = io.StringIO()
    with redirect_stdout(out):
        cli.main(["--preset", "moe1b", "--tpu", "v4-64", "--search", "--compile", "1", "--top", "3",
                      "--train.batch_size", "64", *model_flags])
    text = out.getvalue()
    block = text[text.index("the top 1 compiled for v4-64"):]
    assert re.search(r"compiled in \d+ s: fits \(", block), block
    for row in ("bytes per device", "dot FLOPs per device (lockstep)", "collectives, all",
                "the compiled schedule overlaps", "step on the compiler clock"):
        assert row in block, row
    last = re.fullmatch(r'best_step_ms=[0-9.e+-]+ preset_step_ms=[0-9.e+-]+ best_flags="([^"]+)"', text.splitlines()[-1])
    first = re.search(r"^rank 1: (.*)$", block, re.M).group(1)
    assert last and last.group(1) == first


# ---- Context parallelism at a long sequence: moe1b's structure at 32K tokens, cp 8
#
# Each sequence of 32,768 tokens in 16 chunks of 2,048, each of the 8 cp ranks holding 2;
# routing groups of 1,024 tokens (within a chunk), blockwise attention (matmul attention
# would hold [b, H, 4096, 32768] float32 scores per layer); dp 4 x cp 8 x tp 2 on a
# v5p-128 (64 chips), 4 sequences per step (one row per device). The full moe1b compiled
# in docs/planning.md ("Long sequences"); here its widths scaled down (SMALL_MOE1B: 2 blocks,
# 4 heads) so the train step compiles in 100 s. Measured: planner / compiler 0.97 of the
# live total, 0.88 of memory_analysis; with 4 rows per device (16 sequences) 0.93 and
# 0.77, and the latent's gradient all-reduced instead of reduce-scattered.
LONG_CP = dict(seq_len=32768, routing_group=1024, attention="blockwise", attention_block=512)


@pytest.mark.slow
def test_cp8_at_32k_tokens_gathers_the_latent_over_cp_fits_and_the_planner_is_within_15_percent(devices_of):
    """The compiled step fits a v5p; its all-gathers over cp are attention's latent
    gathers, each [b, T, A + R] in bfloat16 (never keys or values [b, T, H, K]), and
    their bytes, forward and backward (a reduce-scatter of the latent's gradient), are
    the planner's to the byte; the planner's total is at most 15% under and 30% over the
    compiler's with its live temporaries (the overlap flags' schedule: see below)."""
    cfg = apply_overrides(Config(), PRESETS["moe1b"])
    cfg = apply_overrides(cfg, {"model": dict(SMALL_MOE1B, **LONG_CP),
                                "mesh": dict(dp=4, cp=8, pp=1, tp=2), "train": dict(batch_size=4, microbatches=1)})
    pod = tpu_compile.pod_type("v5p-128")
    mesh = make_mesh(cfg.mesh, devices_of("v5p-128"))
    compiled = tpu_compile.compile_steps(cfg, mesh, eval_step=False, hardware=pod.hardware)
    plan = costs.plan(cfg, 0, pod.hardware)
    tpu = tpu_compile.memory_bytes(compiled["train"])
    assert tpu_compile.fits(tpu, compiled["log"]["train"], costs.HARDWARE[pod.hardware].memory_bytes)
    live_total = tpu_compile.live_total(tpu, compiled["log"]["train"])
    # The planner models blocking collectives. With devices.TPU_OVERLAP_FLAGS (what a pod
    # runs, and what tpu_compile loads libtpu with) the compiler's live total here is 345 MB
    # against the planner's 424 MB (1.23x over); with the flags off, 0.97x. Until the
    # planner models the async schedule's buffers (issue "overlap"), it may over-estimate
    # by OVERLAP_OVERESTIMATE, never under-estimate by more than PLANNER_TOLERANCE.
    assert -PLANNER_TOLERANCE <= plan["total_bytes"] / live_total - 1 <= OVERLAP_OVERESTIMATE, (plan["total_bytes"], live_total)
    m, b = cfg.model, cfg.train.batch_size // cfg.mesh.dp
    latent = b * m.seq_len * (m.kv_latent + m.rope_dim) * 2
    over_cp = [op for op in hlo_reader.collective_ops(compiled["train"].as_text(), tuple(mesh.shape.values())) if op.over == "cp"]
    gathers = [op for op in over_cp if op.kind == "all-gather"]
    assert gathers and all(op.arrays == (("bf16", latent),) for op in gathers), gathers
    table = hlo_reader.collectives(compiled["train"].as_text(), tuple(mesh.shape.values()))
    planned = plan["times"]["collective_bytes"]
    assert table[("all-gather", "bf16", "cp")]["bytes"] == planned["all-gather over cp"]
    assert table[("reduce-scatter", "bf16", "cp")]["bytes"] == planned["reduce-scatter over cp"]


# ---- The Pallas kernels in the TPU compiler's program: compiled for a TPU slice from this
# CPU host they are Mosaic custom calls, not interpret mode's loops.


@pytest.mark.slow
def test_dropless_gmm_compiles_to_megablox_kernels_whose_tiles_the_planner_counts(devices_of):
    """tiny dropless on v4-8 2x1x2 with --model.moe_kernel gmm: the step holds megablox's
    gmm and tgmm kernels, and the compiled dot FLOPs (the kernels' row tiles included:
    256 rows of 8 experts run 2 + 7 tiles of 128) are the planner's within 10%, the
    kernels' time on the compiler's clock the planner's within 1%."""
    case = compile_case(devices_of, "tiny", "v4-8", (2, 1, 2), False, eval_step=False, capacity_factor=0.0, moe_kernel="gmm")
    hlo = case["hlo"]
    assert {name.split("_jit_")[-1].strip("_") for name in hlo_reader.kernels(hlo)} == {"gmm", "tgmm"}  # vmap_jit_gmm__
    assert case["plan"]["times"]["device_flops"] == pytest.approx(case["dot_flops"], rel=TIME_TOLERANCE)
    assert hlo_reader.low_precision_dot_flops(hlo) == 0  # bfloat16 kernels (they were counted as 8-bit once)
    # the planner times the kernels as the compiler's clock does: their own cost estimates (compute_clock.gmm_seconds)
    v4 = costs.HARDWARE["tpu-v4"]
    kernels_s = sum(op.step_seconds for op in hlo_reader.timed_ops(hlo, hlo_reader.Chip(v4.clock_hz, v4.peak_flops, v4.hbm_bw))
                    if op.kind == "kernels")
    assert case["plan"]["compute_kinds"]["kernels"] == pytest.approx(kernels_s, rel=0.01)


@pytest.mark.slow
def test_splash_attention_compiles_to_the_splash_kernels(devices_of):
    """tiny at T = 256 with --model.attention splash on v4-8 2x1x2: the forward, dq and
    dkv kernels are custom calls in the step (no [T, T] scores left to the compiler)."""
    case = compile_case(devices_of, "tiny", "v4-8", (2, 1, 2), False, eval_step=False, seq_len=256, attention="splash",
                        attention_block=128)
    assert set(hlo_reader.kernels(case["hlo"])) == {"splash_mha_fwd_residuals", "splash_mha_dq_no_residuals",
                                                      "splash_mha_dkv_no_residuals"}
    # The clock counts their FLOPs from their shapes: per device 8 rows, 4 heads, 3 of 2 x 2
    # blocks of 128, in each of the 8 layers the forward twice (remat block), dq and dkv.
    B, H, W, K = 8, 4, 8 + 8, 8
    pairs = B * H * 256 * 256 * 3 / 4
    assert hlo_reader.dot_flops(case["hlo"], "splash_mha") == 8 * 2 * pairs * (2 * (W + K) + (2 * W + K) + (2 * W + 2 * K))
