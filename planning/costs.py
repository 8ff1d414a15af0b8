"""The planner's model of a train step on a layout: bytes, FLOPs and seconds per device.

planner.py is the command line (planning/search.py ranks layouts, planning/report.py
prints). Nothing is allocated and no device is needed: parameter shapes come from
`nnx.eval_shape`, the storage layout from `weights.param_specs` (the same sharding
table the train step uses), and the mesh shape is arithmetic.

Memory per device:
  params       float32 master weights, this device's storage shard (exact)
  optimizer    its state: AdamW mu + nu, or Muon's momentum for the matrices (float32 shards); step counts (exact)
  gradients    float32 gradient shards, alive from the backward pass to the update
  gathered     weights all-gathered for use in the compute dtype (FSDP)
  activations  what the backward pass keeps, by remat policy (the formula below)
The first two are exact (tests/test_planner.py checks them against the real arrays);
the rest are a model of what XLA keeps live at the peak, checked against the
compiled step's memory_analysis() at small sizes.
"""

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

import jax
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from model import abstract_params
from ops.gmm import GMM_ROW_TILE
from parallel import optimizers, rules
from parallel.mesh import axes_of, check_config_fits_mesh, resolve_mesh_shape
from parallel.weights import check_divisible, is_stacked, is_trained, param_specs, weight_layout, weight_name
from planning.compute_clock import RECOMPUTE_FORWARD, step_efficiency, update_seconds
from planning.activations import (
    BACKWARD_TICK_COST,
    F32,
    HALF_TICK_COST,
    SPLIT_BACKWARD,
    accumulates,
    activation_bytes,
    local_sizes,
    pipeline_loops,
    schedule_of,
    scheduled_bubble_factor,
)
from runtime import dtype_probe
from runtime.flops import count_params, flops_per_token, measure_peak_flops, part_flops_per_token, stage_flops
from utils import AXES, CP, ConfigError, apply_overrides, context_parallel_checks, kernels_for

GiB = 2**30

# ---- Hardware profiles. Peak = dense bf16 matmul FLOP/s per device; memory = HBM per
# device. Interconnect figures are approximate, from public spec sheets:
#   TPU: the Cloud TPU pages give v5p 4800 Gb/s of ICI per chip (1200 GB/s counted both
#     ways) over 6 links (3-D torus) and v5e 1600 Gb/s over 4 links (2-D torus): 100 and
#     50 GB/s per link each way (v6e: 3584 Gb/s over 4 links, 112 GB/s); v4 has 6 links of about 50 GB/s (the TPU v4 paper; the
#     JAX scaling book quotes 45 / 90 / 45 GB/s per link for v4 / v5p / v5e). A
#     collective along one mesh axis runs as a bidirectional ring on one torus axis and
#     receives over 2 links: ring_bw = 2 links; a ppermute uses 1 link: p2p_bw.
#   H100 / H200 SXM: NVLink 4 is 900 GB/s bidirectional per GPU, i.e. 450 GB/s each way
#     through the NVSwitch, inside a node of 8 GPUs; between nodes one 400 Gb/s
#     InfiniBand NIC per GPU (DGX/HGX H100 with ConnectX-7): 50 GB/s.
#   cpu: fake devices of this machine share its RAM and its cores; "communication" is a
#     memory copy, nominally 10 GB/s. The peak is measured (a timed float32 matmul, as
#     main.py does) and shared by the fake devices.
GB = 1e9


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # FLOP/s per device, dense bf16 (cpu: measured)
    memory_bytes: float  # per device
    ring_bw: float  # bytes/s a device receives in a ring collective along one mesh axis
    p2p_bw: float  # bytes/s one way to one neighbour (pipeline ppermute)
    node_size: int = 0  # devices per NVLink domain; 0 = one interconnect for the whole slice
    cross_node_bw: float = 0.0  # bytes/s per device between nodes
    clock_hz: float = 0.0  # TPU: the TensorCore clock, the unit of the compiler's estimated_cycles
    hbm_bw: float = 0.0  # bytes/s of HBM per device (a Pallas kernel's roofline)


# TPU clocks: the bf16 peak over 2 FLOPs per cycle of each MXU cell, the MXUs as the Cloud
# TPU system-architecture pages give them: v4 2 TensorCores x 4 MXUs of 128x128 (275 TFLOP/s:
# 1.05 GHz, the TPU v4 paper's clock), v5e 1 x 4 of 128x128 (197: 1.5 GHz), v5p 2 x 4 of
# 128x128 (459: 1.75 GHz). v6e (918): its page says 2 MXUs of 256x256 (3.5 GHz), but the
# compiler estimates an 8192^3 bf16 matmul at 369K FLOPs per cycle, more than 2 such MXUs
# do (262K); with 4 (Google's "4.7x v5e per chip": 4x the MXU area at 1.75/1.5 the clock)
# it is 1.75 GHz. The same matmul's estimate is 88-93% of these peaks on v4, v5e and v5p.
# HBM: 1200, 819, 2765 and 1638 GB/s on the same pages.
HARDWARE = {
    "tpu-v4": Hardware("TPU v4", 275e12, 32 * GiB, ring_bw=100 * GB, p2p_bw=50 * GB, clock_hz=1.05e9, hbm_bw=1200 * GB),
    "tpu-v5e": Hardware("TPU v5e", 197e12, 16 * GiB, ring_bw=100 * GB, p2p_bw=50 * GB, clock_hz=1.5e9, hbm_bw=819 * GB),
    "tpu-v5p": Hardware("TPU v5p", 459e12, 95 * GiB, ring_bw=200 * GB, p2p_bw=100 * GB, clock_hz=1.75e9, hbm_bw=2765 * GB),
    "tpu-v6e": Hardware("TPU v6e", 918e12, 32 * GiB, ring_bw=224 * GB, p2p_bw=112 * GB, clock_hz=1.75e9, hbm_bw=1638 * GB),
    "h100": Hardware("H100 SXM", 989e12, 80 * GiB, ring_bw=450 * GB, p2p_bw=450 * GB, node_size=8, cross_node_bw=50 * GB),
    "h200": Hardware("H200 SXM", 989e12, 141 * GiB, ring_bw=450 * GB, p2p_bw=450 * GB, node_size=8, cross_node_bw=50 * GB),
    "cpu": Hardware("CPU (this machine, 2 cores)", 0.0, 24 * GiB, ring_bw=10 * GB, p2p_bw=10 * GB),
}
# Low-precision matmul peaks per device (dense, op/s; --model.quant), published beside the bf16
# ones above: Cloud TPU's system-architecture pages give int8 at 275 (v4: no faster than its
# bf16), 394 (v5e), 918 (v5p) and 1836 (v6e) TOPS and no fp8 for them (Ironwood, v7, is the
# first with fp8: 4614 TFLOP/s); NVIDIA's H100 / H200 SXM datasheets give 1979 TFLOP/s fp8 and
# 1979 TOPS int8 without sparsity (2x their 989 bf16).
LOW_PRECISION_PEAKS = {
    "tpu-v4": {"int8": 275e12}, "tpu-v5e": {"int8": 394e12}, "tpu-v5p": {"int8": 918e12}, "tpu-v6e": {"int8": 1836e12},
    "h100": {"int8": 1979e12, "fp8": 1979e12}, "h200": {"int8": 1979e12, "fp8": 1979e12},
}
# The weights whose matmuls --model.quant runs in 8 bits (ops/quant.py; the router, the output
# layer and MTP's projections stay in --model.dtype), and beside them the scores and values
# of --model.attention matmul (quantized_share)
QUANTIZED_WEIGHTS = ("wq_down_DQ", "wq_up_QHK", "wq_rope_QHR", "wq_DHK", "wq_rope_DHR", "wkv_down_DA", "wk_rope_DR", "wk_up_AHK",
                     "wv_up_AHK", "wo_HKD", "w_gate_DF", "w_up_DF", "w_down_FD", "w_gate_EDF", "w_up_EDF", "w_down_EFD")
DEFAULT_EFFICIENCY = 0.5  # large dense transformer training commonly reaches 40-60% MFU


def cpu_peak_flops():
    """FLOP/s of a float32 matmul on this machine (flops.measure_peak_flops)."""
    return measure_peak_flops(jax.numpy.float32, size=1024)


# ---- Shapes and the storage layout (no arrays)


def abstract_mesh(shape):
    return AbstractMesh(tuple(shape), AXES)


# The search (planning/search.py) plans hundreds of layouts of one model: its shapes are
# traced once. They do not depend on the remat policy, the batch or the schedule.
@lru_cache(maxsize=8)
def model_shapes(model_cfg):
    """abstract_params of this model, once."""
    return abstract_params(model_cfg)


def shape_keys(cfg):
    """(model, train) configs with what does not change any shape taken out."""
    return (dataclasses.replace(cfg.model, remat="none"),
            dataclasses.replace(cfg.train, batch_size=1, microbatches=1, pipeline="gpipe", virtual_stages=1))


@lru_cache(maxsize=8)
def model_params_count(model_cfg):
    """flops.count_params, once: (total, active per token)."""
    return count_params(model_cfg)


@lru_cache(maxsize=8)
def model_flops_per_token(model_cfg):
    """flops.flops_per_token, once."""
    return flops_per_token(model_cfg)


@lru_cache(maxsize=8)
def model_part_flops(model_cfg):
    """flops.part_flops_per_token, once (each call builds the model's shapes: the search
    spent 245 of its 250 s here before)."""
    return part_flops_per_token(model_cfg)


@lru_cache(maxsize=8)
def optimizer_shapes(model_cfg, train_cfg):
    """The optimizer state's ShapeDtypeStructs, once per model and optimizer."""
    return jax.eval_shape(optimizers.make_optimizer(train_cfg).init, model_shapes(model_cfg))


# TPU memory is tiled (the layouts in the TPU compiler's optimized HLO, e.g.
# f32[8,16,8]{1,2,0:T(8,128)}): an array's two minor dims are padded to whole tiles of
# 8 sublanes x 128 lanes (a second-minor dim under 8 gets a 4-, 2- or 1-row tile), a
# 1-D array to 512 bytes, a scalar to 512 bytes. The compiler picks which dims are
# minor (the layout {1,2,0} above puts the 16 on the lanes), so of the orders that
# exist the least padded is taken. Exact for every argument of the tiny and the
# scaled-down moe1b steps (tests/test_tpu_compile.py); negligible at moe1b's widths
# (multiples of 128), 2-8x at tiny's 8- to 32-wide dims.
TPU_LANES, TPU_SUBLANES, TPU_VECTOR_BYTES = 128, 8, 512


def tpu_tiled_bytes(shape, itemsize):
    """Bytes of an array of this shape in TPU memory."""
    if len(shape) < 2:
        return -(-math.prod(shape) * itemsize // TPU_VECTOR_BYTES) * TPU_VECTOR_BYTES
    best = None
    for minor in range(len(shape)):
        for second in range(len(shape)):
            if second == minor:
                continue
            rows = min(TPU_SUBLANES, 1 << (shape[second] - 1).bit_length())  # the tile's sublanes
            rest = math.prod(d for i, d in enumerate(shape) if i not in (minor, second))
            size = rest * -(-shape[second] // rows) * rows * -(-shape[minor] // TPU_LANES) * TPU_LANES
            best = size if best is None else min(best, size)
    return best * itemsize


def array_bytes(shape, itemsize, tiled=False):
    """Bytes of an array (tiled: in TPU memory)."""
    return tpu_tiled_bytes(shape, itemsize) if tiled else math.prod(shape) * itemsize


def shard_shape(shape, spec, mesh_shape):
    """One device's shard of an array laid out by `spec`."""
    return tuple(dim // math.prod(mesh_shape[a] for a in axes_of(spec[i] if i < len(spec) else None))
                 for i, dim in enumerate(shape))


def shard_bytes(shape, itemsize, spec, mesh_shape, tiled=False):
    """Bytes of one device's shard of an array laid out by `spec` (tiled: in TPU memory)."""
    return array_bytes(shard_shape(shape, spec, mesh_shape), itemsize, tiled)


def layout_bytes(tree, expert_parallel, mesh_shape, itemsize=None, tiled=False):
    """Per-device bytes of a params-shaped tree (params, or AdamW's mu / nu), each leaf
    laid out by the sharding table. Scalars (optimizer step counts) are replicated."""
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        size = itemsize or leaf.dtype.itemsize
        if not leaf.shape:
            total += array_bytes((), size, tiled)
            continue
        dims = weight_layout(weight_name(path), is_stacked(path), expert_parallel)[0]
        total += shard_bytes(leaf.shape, size, dims, mesh_shape, tiled)
    return total


def gathered_bytes(tree, expert_parallel, mesh_shape, itemsize, one_block, tiled=False):
    """Per-device bytes of weights after the FSDP all-gather (gather_for_use): still split
    over their compute axes (tp, experts over dp), whole along the storage-only axes.
    one_block: a block's weights (the stacked N dim sliced away)."""
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        dims, fsdp_axes, _ = weight_layout(weight_name(path), is_stacked(path), expert_parallel)
        shape = leaf.shape[1:] if one_block else leaf.shape
        dims = dims[1:] if one_block else dims
        compute_dims = tuple(None if d == fsdp_axes and fsdp_axes else d for d in dims)
        total += shard_bytes(shape, itemsize, compute_dims, mesh_shape, tiled)
    return total


def fsdp_traffic(tree, expert_parallel, mesh_shape, itemsize, one_block):
    """{fsdp axes: bytes one device receives} to all-gather these weights once: a ring
    all-gather over n devices brings each device the (n-1)/n it lacks."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        dims, fsdp_axes, _ = weight_layout(weight_name(path), is_stacked(path), expert_parallel)
        if not fsdp_axes:
            continue
        n = math.prod(mesh_shape[a] for a in fsdp_axes)
        if n == 1:
            continue
        shape = leaf.shape[1:] if one_block else leaf.shape
        dims = dims[1:] if one_block else dims
        full = shard_bytes(shape, itemsize, tuple(None if d == fsdp_axes else d for d in dims), mesh_shape)
        out[fsdp_axes] = out.get(fsdp_axes, 0) + full * (n - 1) / n
    return out



# ---- Step time


def collective_bw(hw, mesh_shape, axes):
    """Bandwidth of a collective over `axes`: on a GPU cluster, an axis group that
    fits in one NVLink node uses NVLink, else InfiniBand. The mesh is (dp, cp, pp, tp),
    tp innermost: the devices of a group along axis a are `stride(a)` apart."""
    if not hw.node_size:
        return hw.ring_bw
    order = AXES
    for a in axes:
        inner = math.prod(mesh_shape[x] for x in order[order.index(a):])  # span of one group along a
        if inner > hw.node_size and mesh_shape[a] > 1:
            return hw.cross_node_bw
    return hw.ring_bw


# Remat policies that keep the gathered weights of every local block instead of
# gathering again (the gather sits outside a layer's checkpoint; stage re-gathers while
# it recomputes, and so do block and block_dots); those that run the whole forward again
# in the backward pass: compute_clock.RECOMPUTE_FORWARD.
KEEP_GATHERED = ("none", "layer")


def attention_layers(m):
    """Attention layers of the model: the blocks', the dense prefix's and the MTP modules'."""
    return (m.n_blocks + m.mtp_depth) * len(m.block_pattern) + m.first_dense


def gmm_tile_factor(m, s):
    """Executed over routed FLOPs of the dropless experts: 1 under ragged_dot; under
    --model.moe_kernel gmm, megablox's grid runs whole row tiles of GMM_ROW_TILE, and a
    tile holding the boundary of two experts' runs once for each: per call about
    (rows / tile + experts - 1) tiles for rows / tile of work (hlo_reader's
    grouped_matmul_flops reads the same bound off the compiled program)."""
    if m.moe_kernel != "gmm":
        return 1.0
    row_tiles = math.ceil(s.b * s.T * s.X / GMM_ROW_TILE)
    return (row_tiles + s.E - 1) / row_tiles


def executed_flops(cfg, s, tp, cp=1):
    """(model FLOPs, executed FLOPs) per step, all devices together. What the devices
    execute beyond the model FLOPs: the remat forward again (+1/3), empty expert slots
    (buffers hold capacity_factor x top_k slots per token), the projections every tp
    rank runs whole, and the keys and values every cp rank makes of the whole sequence."""
    m, t = cfg.model, cfg.train
    tokens_per_step = t.batch_size * m.seq_len
    model_flops = model_flops_per_token(shape_keys(cfg)[0]) * tokens_per_step
    routed_per_layer = 3 * m.d_model * m.d_expert * m.top_k
    n_moe = m.n_blocks * m.block_pattern.count("M")
    slot_factor = (s.E * s.C / s.S) / m.top_k if m.capacity_factor > 0 else gmm_tile_factor(m, s)
    executed = model_flops + 6 * routed_per_layer * n_moe * tokens_per_step * (slot_factor - 1)
    # MLA's down-projections (to the q and kv latents, and the shared RoPE key) and the
    # router are whole on every tp rank, so each of the tp ranks runs them (found against
    # the compiled scaled-down moe1b on 8x1x4: 0.85 of its dot FLOPs without this).
    n_layers = m.n_blocks * len(m.block_pattern) + m.first_dense
    whole_per_token = 2 * m.d_model * (n_layers * (m.q_latent + m.kv_latent + m.rope_dim) + n_moe * m.n_experts)
    executed += (tp - 1) * 3 * whole_per_token * tokens_per_step
    # Under cp every rank up-projects the keys and values of the whole sequence from the
    # gathered latent (ops/context_parallel.py): cp - 1 more times than the model does.
    executed += (cp - 1) * 3 * 2 * 2 * m.kv_latent * m.n_heads * m.head_dim * attention_layers(m) * tokens_per_step
    executed -= splash_skipped_flops(m, tokens_per_step)
    if m.remat in RECOMPUTE_FORWARD or t.pipeline != "gpipe":  # (the hand-written backward always recomputes)
        executed *= 4 / 3
    return model_flops, executed


def splash_skipped_flops(m, tokens_per_step):
    """The attention FLOPs (forward and backward, of the model's T x T per layer) that
    splash attention does not run: of n x n key blocks per sequence (n = T / block) its
    causal mask leaves n (n + 1) / 2 (context parallelism moves them between ranks, it
    does not change their number). 0 for the other kernels."""
    if m.attention != "splash":
        return 0.0
    n = m.seq_len // min(m.attention_block, m.seq_len)
    attention = 3 * 2 * m.seq_len * m.n_heads * (2 * m.head_dim + m.rope_dim) * attention_layers(m) * tokens_per_step
    return attention * (1 - (n + 1) / (2 * n))


def step_time(cfg, mesh_shape, hw, peak, efficiency, store, once=False):
    """{name: seconds}. Compute at `efficiency` of peak; each collective at its bandwidth
    with no overlap (the serial sum is an upper bound, max(compute, comm) a lower one).
    `once`: the blocks are gathered once per step (gathers_once)."""
    m, t = cfg.model, cfg.train
    dp, cp, pp, tp = (mesh_shape[a] for a in AXES)
    n_devices = dp * cp * pp * tp
    s = local_sizes(cfg, mesh_shape)
    model_flops, executed = executed_flops(cfg, s, tp, cp)
    tokens_per_step = t.batch_size * m.seq_len
    # The output layer runs on the last stage only, after the pipeline's ticks
    # (parallel.last_stage_loss_sums), with the other stages waiting: its matmul is split
    # over dp x cp x tp, not pp. (Recomputed per microbatch under every remat: 4 forwards.)
    head = 4 * 2 * s.V * tp * m.d_model * tokens_per_step
    body = executed - min(head, executed) if pp > 1 else executed
    compute = body / (n_devices * peak * efficiency)
    bubble = compute * (pp - 1) / t.microbatches  # = a fraction (pp-1)/(M+pp-1) of the pipelined compute
    if t.pipeline != "gpipe":
        bubble = compute * scheduled_bubble_factor(cfg, pp)
    head_s = (executed - body) / (dp * cp * tp * peak * efficiency)  # (0 without a pipeline: it is in the compute)
    # The dense prefix runs on stage 0 alone while the other stages wait (GPipe: every
    # microbatch's before the loop; 1f1b: inside stage 0's first-chunk ticks, which
    # every stage waits for): its share of the compute takes pp times as long.
    model_key = shape_keys(cfg)[0]
    imbalance = (compute * (pp - 1) * model_part_flops(model_key)["prefix"] / model_flops_per_token(model_key)
                 if m.first_dense else 0.0)

    # The hand-written schedules run len(table) ticks of one chunk each, and every
    # compiled tick gathers the chunk's weights for a forward and again for a backward,
    # whichever op the stage runs (the gathers sit outside the tick's cond, in the TPU
    # compiler's HLO): 3 passes per tick under every remat policy.
    ticks, blocks_per_tick = pipeline_loops(cfg, pp)
    if t.pipeline != "gpipe":
        sched = schedule_of(cfg, pp)
        ticks, blocks_per_tick = len(sched.table), m.n_blocks // (pp * sched.virtual_stages)
    comm, buffers = collectives(cfg, mesh_shape, hw, store, s, ticks, blocks_per_tick, once)
    # What one device's matmul units run per step, stages in lockstep: its share of the
    # executed FLOPs, stretched by the ticks where the table leaves it idle (GPipe's
    # bubble ticks compute on zeros; the hand-written schedules' ticks last their
    # costliest stage).
    device_flops = (compute + bubble + head_s) * peak * efficiency
    if t.pipeline != "gpipe":
        # The compiled program's count (hlo_reader.dot_flops, a cond at its costliest
        # branch): a tick is a cond for the forward and one for the backward, so every
        # tick counts a forward of a chunk, a backward (recompute + vjp: 3 forwards) and,
        # in the forward's, the head and its gradient (3 forwards of the output layer).
        # An upper bound on what a device runs (the step time above counts the table).
        # zb1 / zbv: three conds a tick, the forward's, B's and W's (HALF_TICK_COST each).
        forward = body / n_devices / (4 * t.microbatches * sched.virtual_stages)
        head_forward = 2 * s.V * m.d_model * s.b * s.T
        backward = 2 * HALF_TICK_COST if t.pipeline in SPLIT_BACKWARD else BACKWARD_TICK_COST
        device_flops = ticks * ((1 + backward) * forward + 3 * head_forward)
    return dict(compute=compute, bubble=bubble, head=head_s, prefix_imbalance=imbalance, model_flops=model_flops, executed_flops=executed,
                device_flops=device_flops, collective_bytes=buffers), comm


def collectives(cfg, mesh_shape, hw, store, s, ticks, blocks_per_tick, once=False):
    """({name: seconds}, {"kind over axes": buffer bytes}) per device per step: FSDP's
    gathers and reduce-scatters, tp's all-reduces, pp's ppermutes, EP's all-to-alls.
    `ticks` x `blocks_per_tick`: how many times the pipeline loop runs a block; `once`:
    the blocks are gathered (and their gradient reduce-scattered) once per step."""
    m, t = cfg.model, cfg.train
    dp, tp, pp = mesh_shape["dp"], mesh_shape["tp"], mesh_shape["pp"]
    c = s.c
    ep = cfg.mesh.expert_parallel
    # FSDP: every tick gathers every local block (and the backward pass reduce-scatters
    # its gradient, the same bytes); under remat the recompute gathers again. The
    # embedding and final norm are gathered once per step.
    passes = 2 if m.remat in KEEP_GATHERED and t.pipeline == "gpipe" else 4 if t.pipeline in SPLIT_BACKWARD else 3  # (W gathers again)
    comm = {}
    # The same collectives' buffers as the TPU compiler's optimized HLO counts them
    # (hlo_reader.collectives): an all-gather's output, the rest their output; per
    # device per step, by "kind over axes". tests/test_tpu_compile.py compares the two.
    buffers = {}

    def add_buffer(kind, axes, nbytes):
        key = f"{kind} over {'+'.join(a for a in axes if mesh_shape[a] > 1)}"  # (as the compiler's groups span them)
        buffers[key] = buffers.get(key, 0) + nbytes

    # The gradients are reduce-scattered as an all-to-all and a local sum
    # (fsdp.scatter_by_all_to_all): the same bytes, another op.
    gradient_reduction = "all-to-all"

    # The gradients are reduced in --model.grad_reduce_dtype (float32 by default): twice
    # the gathered bytes in bfloat16.
    reduced = (F32 if m.grad_reduce_dtype == "float32" else 2) / c
    gathers = (1, 1) if once else (passes - 1, ticks)  # (all-gathers of a block per loop pass, loop passes)
    for axes, nbytes in store["block_traffic"].items():
        key = "fsdp all-gather/reduce-scatter over " + "+".join(axes)
        per_pass, n_passes = gathers
        seconds = (per_pass + reduced) * n_passes * blocks_per_tick * nbytes / collective_bw(hw, mesh_shape, axes)
        comm[key] = comm.get(key, 0) + seconds
        whole = nbytes * math.prod(mesh_shape[a] for a in axes) / (math.prod(mesh_shape[a] for a in axes) - 1)
        add_buffer("all-gather", axes, per_pass * n_passes * blocks_per_tick * whole)
        add_buffer(gradient_reduction, axes, reduced * n_passes * blocks_per_tick * whole)
    for axes, nbytes in store["top_traffic"].items():
        key = "fsdp all-gather/reduce-scatter over " + "+".join(axes)
        comm[key] = comm.get(key, 0) + (1 + reduced) * nbytes / collective_bw(hw, mesh_shape, axes)
        whole = nbytes * math.prod(mesh_shape[a] for a in axes) / (math.prod(mesh_shape[a] for a in axes) - 1)
        add_buffer("all-gather", axes, whole)
        add_buffer(gradient_reduction, axes, reduced * whole)
    x_bytes = s.b * s.T * s.D * c
    layers_here = blocks_per_tick * len(m.block_pattern)
    if tp > 1:
        # Per layer 2 all-reduces forward (attention out, FFN out), 2 more under remat,
        # and 2 backward (their inputs' cotangents, in float32: the TPU compiler's HLO);
        # the vocab-split embedding's output once per step, forward and backward.
        forward = 2 if m.remat == "none" and t.pipeline == "gpipe" else 4
        per_layer = forward * x_bytes + 2 * x_bytes * F32 // c
        embedding = t.microbatches * x_bytes * (1 + F32 // c)
        buffer_bytes = (ticks * layers_here + t.microbatches * m.first_dense) * per_layer + embedding  # (prefix: stage 0, every microbatch)
        comm["tp all-reduce of activations"] = 2 * (tp - 1) / tp * buffer_bytes / collective_bw(hw, mesh_shape, ("tp",))
        add_buffer("all-reduce", ("tp",), buffer_bytes)
    if pp > 1:  # one microbatch activation to the next stage per tick, and its gradient back (zbv: both ways, 4)
        sends = 4 if t.pipeline == "zbv" else 2
        comm["pp ppermute of activations"] = sends * ticks * x_bytes / hw.p2p_bw
        add_buffer("collective-permute", ("pp",), sends * ticks * x_bytes)
    if t.pipeline in ("interleaved", "zbv"):  # each chunk to the stage that runs it and its gradient back, once per step
        # (V x V ppermutes of a chunk's float32 storage shard each way: one_f_one_b.move_chunks)
        moved = 2 * schedule_of(cfg, pp).virtual_stages * store["block_params_untiled"]
        comm["pp ppermute of the chunks and their gradients"] = moved / hw.p2p_bw
        add_buffer("collective-permute", ("pp",), moved)
    if ep and dp > 1:  # x_GECD out and y_GECD back, forward and backward (and recompute)
        buffer = s.b * s.T / s.S * s.E * s.C * s.D * c
        moe_here = blocks_per_tick * m.block_pattern.count("M")
        per_layer = 4 if m.remat == "none" and t.pipeline == "gpipe" else 6
        comm["ep all-to-all of expert buffers"] = ticks * moe_here * per_layer * buffer * (dp - 1) / dp / collective_bw(hw, mesh_shape, ("dp",))
        add_buffer("all-to-all", ("dp",), ticks * moe_here * per_layer * buffer)
    if mesh_shape["cp"] > 1:
        latent_gathers(cfg, mesh_shape, hw, s, ticks * layers_here, comm, add_buffer)
    return comm, buffers


def latent_gathers(cfg, mesh_shape, hw, s, block_layers, comm, add_buffer):
    """Context parallelism's collectives (ops/context_parallel.py), into comm and the
    buffers: per attention layer one all-gather over cp of the latent and RoPE key of
    one microbatch, [b, T, A + R] in the compute dtype, and in the backward pass one
    reduce-scatter of its gradient (the same bytes); remat recomputes the layer and
    gathers again. block_layers: attention layers the pipeline loop runs per step; the
    MTP modules' run once per microbatch on the last stage, their loss recomputed in
    the backward pass when there are several microbatches."""
    m, t, cp = cfg.model, cfg.train, mesh_shape["cp"]
    latent = s.b * s.Tk * (s.A + s.R) * s.c
    block_gathers = 1 if m.remat == "none" else 2
    mtp_layers, mtp_gathers = t.microbatches * m.mtp_depth * len(m.block_pattern), 1 if t.microbatches == 1 else 2
    gathers = block_gathers * block_layers + mtp_gathers * mtp_layers
    scatters = block_layers + mtp_layers
    # With several rows per microbatch the TPU compiler writes the gradient's reduce-scatter
    # (over T, not the major dim) as an all-reduce of the whole [b, T, A + R], each rank then
    # keeping its chunks: measured on v5p-128 at b = 4, the full moe1b and scaled down; at
    # b = 1 it reduce-scatters, as XLA:CPU always does.
    backward = "all-reduce" if hw.name.startswith("TPU") and s.b > 1 else "reduce-scatter"
    add_buffer("all-gather", ("cp",), gathers * latent)
    add_buffer(backward, ("cp",), scatters * latent)
    # a ring over cp brings each device the (cp - 1) / cp of the latent it lacks (and
    # takes its gradient's away; an all-reduce moves twice that)
    ring = (cp - 1) / cp * latent / collective_bw(hw, mesh_shape, ("cp",))
    comm[f"cp all-gather/{backward} of the MLA latent"] = (gathers + scatters * (2 if backward == "all-reduce" else 1)) * ring


def newton_schulz_flops(fan_in, fan_out):
    """optimizers.orthogonalize on one matrix: per step x x^T, gram @ gram and (.) @ x
    over the smaller side s and the larger g: 4 s^2 g + 2 s^3."""
    s, g = sorted((fan_in, fan_out))
    return optimizers.NEWTON_SCHULZ_STEPS * (4 * s * s * g + 2 * s ** 3)


def muon_cost(params, expert_parallel, mesh_shape, tiled=False):
    """Muon's update per device per step, off the pools optimizers.orthogonal_updates
    makes (every mesh axis manual, as in the train step): Newton-Schulz FLOPs, the
    all-to-all bytes one device sends and receives by mesh axes ({axes: bytes}: the
    momentum to the owners and the updates back, 2 (S-1)/S of a pool each), and the
    working set of the largest pool (float32: the pooled momentum, the owners' whole
    matrices, the update coming back, and the Newton-Schulz iterate with its two Gram
    products)."""
    specs = param_specs(params, expert_parallel)
    leaves = {}
    for (path, leaf), spec in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                                  jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))):
        if optimizers.is_matrix(path):
            leaves[jax.tree_util.keystr(path)] = (path, shard_shape(leaf.shape, spec, mesh_shape), spec)
    whole, pools = optimizers.muon_pools(leaves, dict(mesh_shape))
    flops, traffic, working_set = 0, {}, 0
    for key in whole:  # orthogonalized where they lie, as on one device
        path, shape, _ = leaves[key]
        batch, fan_in, fan_out = (math.prod(shape[d] for d in dims) for dims in optimizers.matrix_dims(path, len(shape)))
        flops += batch * newton_schulz_flops(fan_in, fan_out)
        s, g = sorted((fan_in, fan_out))
        working_set = max(working_set, F32 * batch * (3 * s * g + 2 * s * s))
    for (local, n_in, dim_axes), keys in pools.items():
        group = tuple(a for a in mesh_shape if any(a in axes for axes in dim_axes))
        S = math.prod(mesh_shape[a] for a in group)
        B = sum(math.prod(leaves[key][1]) // math.prod(local) for key in keys)
        k = -(-B // S)
        full = [n * math.prod(mesh_shape[a] for a in axes) for n, axes in zip(local, dim_axes)]
        fan_in, fan_out = math.prod(full[:n_in]), math.prod(full[n_in:])
        flops += k * newton_schulz_flops(fan_in, fan_out)
        pool = F32 * S * k * math.prod(local)  # padded to S k matrices' shards (= k whole matrices)
        name = "+".join(group)
        traffic[name] = traffic.get(name, 0) + 2 * pool * (S - 1) // S
        s, g = sorted((fan_in, fan_out))
        working_set = max(working_set, 3 * pool + F32 * k * (2 * s * g + 2 * s * s))
    return dict(flops=flops, traffic=traffic, working_set=working_set)


# ---- The plan


def gathers_once(cfg, pp, hw_name, store):
    """Does executor_accumulate gather the blocks once per step? The step's rule
    (parallel/rules.gathers_once), asked with every block's gathered weights and their
    float32 gradient and the chip's HBM (the executor asks jax, which reports a little
    less; CPU reports none). No: another executor, or no FSDP (nothing to gather)."""
    if not accumulates(cfg, pp) or not store["fsdp"]:
        return False
    held = cfg.model.n_blocks * store["one_block"] * (store["c"] + F32) / store["c"]
    return rules.gathers_once(cfg, held, None if hw_name == "cpu" else HARDWARE[hw_name].memory_bytes)



def lora_optimizer_bytes(params, train_key, expert_parallel, mesh_shape, tiled):
    """--train.lora_rank: AdamW's mu and nu (float32) of the adapters only, one device's shards (parallel/lora.py lays
    them out as their base weights); the frozen base has no optimizer state."""
    from parallel import lora  # (only a LoRA plan imports the adapters)
    counts = 2 * array_bytes((), 4, tiled)  # Adam's and the schedule's step counts
    return counts + sum(2 * shard_bytes(shape, F32, spec, mesh_shape, tiled)
                        for _, *adapters, _ in lora.adapter_layout(params, train_key, expert_parallel)
                        for shape, spec in (adapters[:2], adapters[2:]))


@lru_cache(maxsize=4096)
def storage(model_key, train_key, mesh_items, expert_parallel, tiled):
    """What a layout's bytes and FSDP traffic take from its mesh alone, once per mesh (the
    search varies schedule, microbatches and remat over each): per-device bytes of the
    params, optimizer state and gradients, of one block's and the embedding's gathered
    weights, the all-gather traffic, Muon's cost; or the ConfigError that says the mesh
    does not divide the weights (kept, so that it is not worked out again)."""
    mesh_shape = dict(mesh_items)
    params = model_shapes(model_key)
    try:
        check_divisible(params, param_specs(params, expert_parallel), abstract_mesh(mesh_shape.values()))
    except ConfigError as e:
        return e
    ep, c = expert_parallel, 2 if model_key.dtype == "bfloat16" else 4
    blocks = {"blocks": params["blocks"]}
    top = {k: v for k, v in params.items() if k != "blocks"}
    # The embedding and final norm come out of their gather in the gradient-reduction
    # dtype (float32 by default), so that their gradient accumulates over microbatches
    # in it (fsdp.gather_for_use).
    top_bytes = max(c, 4 if model_key.grad_reduce_dtype == "float32" else 2)
    return dict(
        c=c, params=layout_bytes(params, ep, mesh_shape, tiled=tiled),
        optimizer=(lora_optimizer_bytes(params, train_key, ep, mesh_shape, tiled) if train_key.lora_rank else
                   layout_bytes(optimizer_shapes(model_key, train_key), ep, mesh_shape, tiled=tiled)),
        gradients=layout_bytes(params, ep, mesh_shape, itemsize=F32, tiled=tiled),
        block_gradients=layout_bytes(blocks, ep, mesh_shape, itemsize=F32, tiled=tiled),
        block_params_untiled=layout_bytes(blocks, ep, mesh_shape),
        one_block=gathered_bytes(blocks, ep, mesh_shape, c, one_block=True, tiled=tiled),
        top_gathered=gathered_bytes(top, ep, mesh_shape, top_bytes, one_block=False, tiled=tiled),
        top_gathered_f32=gathered_bytes(top, ep, mesh_shape, F32, one_block=False, tiled=tiled),
        fsdp=bool(fsdp_traffic(params, ep, mesh_shape, c, one_block=False)),
        block_traffic=fsdp_traffic(blocks, ep, mesh_shape, c, one_block=True),
        top_traffic=fsdp_traffic(top, ep, mesh_shape, c, one_block=False),
        muon=muon_cost(params, ep, mesh_shape, tiled) if train_key.optimizer == "muon" and not train_key.lora_rank else None)


def plan_config(cfg):
    cfg = dtype_probe.for_accelerator(cfg)  # --model.dtype auto is bfloat16 on the accelerators planned for
    if cfg.model.vocab_size == 0:  # the byte tokenizer of the embedded default
        cfg = apply_overrides(cfg, {"model": {"vocab_size": 257}})
    return cfg


# Data-center network bandwidth per TPU chip, between slices (--mesh.slices): an
# assumption, not a measurement here. The scaling book ("How to Scale Your Model", its
# TPU chapter) gives ~6.25 GB/s per chip (a host's ~25 GB/s NICs over its 4 chips);
# summaries of it say 6-12 GB/s. 10-30x below one ICI ring's ring_bw above.
DCN_BW_PER_CHIP = 6.25 * GB


def memory_bytes(cfg, mesh_shape, store, hw_name, once=False):
    """(memory {name: bytes} of one device, its activations {name: bytes}, the
    activations' phases): the params, optimizer state and gradients, the gathered
    weights, the activations and each executor's gradient buffers. `once`: the
    accumulation executor gathers the blocks once per step (gathers_once)."""
    tiled = hw_name.startswith("tpu")
    pp = mesh_shape["pp"]
    memory = dict(params=store["params"], optimizer=store["optimizer"], gradients=store["gradients"])
    # remat none and layer keep every local block's gathered weights for the backward
    # pass, and stage holds them all while it recomputes a tick; block and block_dots
    # gather one block at a time (again in the backward pass).
    ticks, blocks_here = pipeline_loops(cfg, pp)
    n_gathered = blocks_here if cfg.model.remat in ("none", "layer", "stage") else 1
    memory["gathered weights"] = n_gathered * store["one_block"] + store["top_gathered"]
    if not store["fsdp"] and store["c"] == F32:  # nothing to gather or cast: the weights in use are the params themselves
        memory["gathered weights"] = 0
    # XLA:CPU has no bfloat16 arithmetic: it computes in float32, and the intermediates
    # it keeps are float32 (measured: a bfloat16 step's temp bytes equal float32's).
    compiler = "tpu" if tiled else "cpu" if hw_name == "cpu" else "gpu"
    activations, phases = activation_bytes(cfg, mesh_shape, compute_bytes=F32 if compiler == "cpu" else None, compiler=compiler)
    activations = {name: int(value) for name, value in activations.items()}
    memory["activations"] = sum(activations.values())
    # The gradient of one block's gathered weights, whole along the FSDP axes, exists
    # until its reduce-scatter hands each device its shard (none without FSDP).
    if store["fsdp"]:
        memory["gathered gradient of one block"] = store["one_block"]
    # With both loops real (pipeline ticks > 1, several local blocks), the backward pass
    # of a tick writes its blocks' gradients into a stack of their own, which is then
    # added to the running sum over ticks: two copies of the blocks' gradients.
    if cfg.train.pipeline != "gpipe":  # a backward tick's gradient of one chunk, added to the step's sum
        memory["a backward tick's gradient of one chunk"] = store["block_gradients"] // schedule_of(cfg, pp).virtual_stages
        # the embedding's and final norm's gradient, gathered, summed over the step in float32
        # (the sum, and a forward and a backward tick's contributions)
        memory["gradient of the gathered embedding (float32, 3 copies)"] = 3 * store["top_gathered_f32"]
    elif ticks > 1 and blocks_here > 1:
        memory["this tick's gradient of the stage's blocks"] = store["block_gradients"]
    if once:  # every block's weights gathered for the whole step, and their gradient summed whole in float32
        memory["gathered weights"] = cfg.model.n_blocks * store["one_block"] + store["top_gathered"]
        memory.pop("gathered gradient of one block", None)
        memory["gradient of the gathered blocks (float32, summed over microbatches)"] = (
            cfg.model.n_blocks * store["one_block"] * F32 // store["c"])
    if accumulates(cfg, pp):  # executor_accumulate: the gathered embedding's (and head's) gradient, summed over the
        # microbatches in float32 and reduce-scattered once per step (tests/test_tpu_compile.py's 8x1x4 EP case: without
        # this the planner was 0.81 of the compiler's live bytes)
        memory["gradient of the gathered embedding (float32, summed over microbatches)"] = store["top_gathered_f32"]
    return memory, activations, phases


@lru_cache(maxsize=8)
def quantized_share(model_cfg):
    """The share of flops_per_token that --model.quant runs in 8 bits: the forward and
    backward matmuls of QUANTIZED_WEIGHTS (routed experts at top_k / n_experts), and under
    --model.attention matmul attention's scores and values (counted as flops_per_token does)."""
    m = model_cfg
    quantized = 0.0
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params(m))[0]:
        name = weight_name(path)
        if name in QUANTIZED_WEIGHTS:
            quantized += 2 * math.prod(leaf.shape) * (m.top_k / m.n_experts if name.endswith(("EDF", "EFD")) else 1)
    if m.attention == "matmul":
        n_layers = m.n_blocks * len(m.block_pattern) + m.first_dense
        quantized += n_layers * 2 * m.seq_len * m.n_heads * (2 * m.head_dim + m.rope_dim)
    return 3 * quantized / model_flops_per_token(m)


def quantized_peak(cfg, hw_name, peak):
    """The peak a step runs at under --model.quant: its quantized share of the FLOPs at the
    chip's LOW_PRECISION_PEAKS, the rest at `peak` (a harmonic mean: time adds up). Without
    quant, or on a chip without a figure (cpu), `peak`."""
    low = LOW_PRECISION_PEAKS.get(hw_name, {}).get(cfg.model.quant)
    if low is None:
        return peak
    share = quantized_share(shape_keys(cfg)[0])
    return 1 / (share / low + (1 - share) / peak)


def compiler_efficiency(cfg, mesh_shape, hw, store, once):
    """compute_clock.step_efficiency of this layout (share of the peak, seconds by kind):
    its executed FLOPs and the float32 gradient sums its microbatches add into
    (accumulation: the blocks' whole sums when they are gathered once, else the shards)."""
    _, executed = executed_flops(cfg, local_sizes(cfg, mesh_shape), mesh_shape["tp"], mesh_shape.get("cp", 1))
    summed = 0
    if accumulates(cfg, mesh_shape["pp"]) and cfg.train.microbatches > 1:
        summed = cfg.model.n_blocks * store["one_block"] * F32 / store["c"] if once else store["gradients"]
    return step_efficiency(cfg, mesh_shape, hw, executed, summed)


def platform_of(hw_name):
    """jax's platform name of a --hardware entry: tpu, gpu or cpu."""
    return "tpu" if hw_name.startswith("tpu") else "cpu" if hw_name == "cpu" else "gpu"


def plan(cfg, devices, hw_name, efficiency=None, peak=None):
    """Everything the planner prints, as a dict (bytes, seconds). efficiency: the share of
    the peak the compute runs at; None: on a TPU compute_clock's model of the compiler's
    clock for this layout, elsewhere DEFAULT_EFFICIENCY."""
    if hw_name not in HARDWARE:
        raise ValueError(f"unknown --hardware {hw_name!r}; choose one of {', '.join(HARDWARE)}")
    for ok, message in context_parallel_checks(cfg):  # (what --mesh.cp needs: main.py's own checks)
        if not ok:
            raise ConfigError(message)
    if cfg.train.objective == "dpo":
        from parallel.dpo import check_dpo  # (only a DPO plan imports it)
        check_dpo(cfg)  # pp 1, one microbatch: other layouts drop out of a search
    cfg = kernels_for(cfg, platform_of(hw_name))  # --model.attention / moe_kernel auto as on those chips (tpu_compile's too)
    if cfg.mesh.slices > 1:
        return plan_across_slices(cfg, devices, hw_name, efficiency, peak)
    hw = HARDWARE[hw_name]
    cfg = plan_config(cfg)
    if cfg.mesh.dp == -1 and not devices:
        raise ConfigError("--mesh.dp -1 takes the devices left by cp, pp and tp: say how many with --devices N")
    n_devices = devices or cfg.mesh.dp * cfg.mesh.cp * cfg.mesh.pp * cfg.mesh.tp
    shape = resolve_mesh_shape(cfg.mesh, n_devices)
    mesh = abstract_mesh(shape)
    mesh_shape = dict(mesh.shape)
    check_config_fits_mesh(cfg, mesh)
    model_key, train_key = shape_keys(cfg)
    tiled = hw_name.startswith("tpu")  # TPU memory pads arrays to whole tiles (tpu_tiled_bytes)
    store = storage(model_key, train_key, tuple(mesh_shape.items()), cfg.mesh.expert_parallel, tiled)
    if isinstance(store, ConfigError):
        raise store
    once = gathers_once(cfg, mesh_shape["pp"], hw_name, store)
    memory, activations, phases = memory_bytes(cfg, mesh_shape, store, hw_name, once)
    if cfg.train.objective == "dpo":  # the frozen reference: the initial params, in their storage shardings (parallel/dpo.py)
        memory["reference params"] = store["params"]
    held = ("params", "optimizer", "reference params")  # what lives between steps
    temp = sum(v for k, v in memory.items() if k not in held)  # all that the step allocates
    muon = store["muon"] if cfg.train.optimizer == "muon" else None
    if muon:  # after the backward pass, beside the gradients alone: the step's peak is the larger of the two
        memory["Muon update of the largest pool (float32; after the backward pass, not added)"] = muon["working_set"]
        temp = max(temp, memory["gradients"] + muon["working_set"])
    total_bytes = sum(memory.get(k, 0) for k in held) + temp

    if hw_name == "cpu":
        peak = peak or cpu_peak_flops() / n_devices  # fake devices share the cores the matmul used
        available = hw.memory_bytes / n_devices  # fake devices share the machine's RAM
    else:
        peak = peak or quantized_peak(cfg, hw_name, hw.peak_flops)
        available = hw.memory_bytes
    compute_kinds = None  # a TPU's compute as its compiler would time it (compute_clock), unless --efficiency says
    if efficiency is None:
        efficiency, compute_kinds = compiler_efficiency(cfg, mesh_shape, hw, store, once) if hw.clock_hz else (DEFAULT_EFFICIENCY, None)
    times, comm = step_time(cfg, mesh_shape, hw, peak, efficiency, store, once)
    if cfg.train.objective == "dpo":  # the reference's forward over every row: a third of the model's forward + backward
        reference = times["model_flops"] / 3
        times["reference_flops"] = reference
        times["executed_flops"] += reference
        times["device_flops"] += reference / n_devices
        times["compute"] += reference / (n_devices * peak * efficiency)
    add_update(times, comm, compute_kinds, muon, store, hw, mesh_shape, peak, efficiency)
    total_params, active_params = model_params_count(shape_keys(cfg)[0])
    pipelined = times["compute"] + times["bubble"] + times["head"] + times["prefix_imbalance"]
    serial = pipelined + sum(comm.values())
    overlapped = max(pipelined, sum(comm.values()))
    exposed, predicted = exposed_communication(cfg, comm, pipelined, once)
    return dict(
        preset=cfg.preset, hardware=hw.name, devices=n_devices, mesh={a: n for a, n in mesh_shape.items() if a != CP or n > 1},
        dtype=cfg.model.dtype,
        remat=cfg.model.remat, microbatches=cfg.train.microbatches, expert_parallel=cfg.mesh.expert_parallel,
        params_total=total_params, params_active=active_params,
        memory=memory, activations=activations, temp_bytes=temp, total_bytes=total_bytes,
        batch_bytes=array_bytes((cfg.train.batch_size // mesh_shape["dp"], cfg.model.seq_len + 1), 4, tiled),  # int32 tokens, not in the total
        loss_phase_bytes=int(next(v for k, v in phases.items() if k.startswith("loss"))), gpu=bool(hw.node_size),
        available_bytes=available, fits=total_bytes <= available,
        peak_flops=peak, efficiency=efficiency, compute_kinds=compute_kinds, times=times, comm=comm,
        pipeline=cfg.train.pipeline, bubble_fraction=schedule_of(cfg, mesh_shape["pp"]).bubble(), gather_once=once,
        stage_flops_per_token=stage_flops(model_part_flops(model_key), mesh_shape["pp"]),
        step_s_serial=serial, step_s_overlapped=overlapped, comm_exposed=exposed, step_s_predicted=predicted,
        tokens_per_sec=cfg.train.batch_size * cfg.model.seq_len / serial)


def add_update(times, comm, compute_kinds, muon, store, hw, mesh_shape, peak, efficiency):
    """Add to a plan's times and comm what the update runs after the layers: on the
    compiler's clock (compute_kinds given) its pass over the params and optimizer state;
    Muon's Newton-Schulz in float32 (at the layers' efficiency) and its all-to-alls."""
    if compute_kinds:
        update = update_seconds(hw, store["params"] + store["optimizer"])
        compute_kinds["elementwise"] += update
        times["compute"] += update
    if muon:
        times["optimizer_flops"] = muon["flops"]
        times["compute"] += muon["flops"] / (peak * efficiency)
        times["device_flops"] += muon["flops"]
        for axes, nbytes in muon["traffic"].items():
            comm[f"muon all-to-all of momentum and updates over {axes}"] = nbytes / collective_bw(hw, mesh_shape, tuple(axes.split("+")))
            S = math.prod(mesh_shape[a] for a in axes.split("+"))
            key = f"all-to-all over {axes}"
            times["collective_bytes"][key] = times["collective_bytes"].get(key, 0) + nbytes * S / (S - 1)


def exposed_communication(cfg, comm, pipelined, once):
    """({name: seconds left exposed}, seconds of the step): the planner's model of what the
    compiled step (devices.TPU_OVERLAP_FLAGS) hides behind what, from the serial
    figures `comm` ({name: seconds}, step_time's) and the `pipelined` compute.

      FSDP per block (per microbatch, per tick): the next block's all-gather and this
        block's reduce-scatter run under the matmuls of the blocks around them; the
        first block's gather waits, and the rest only where it outlasts the compute.
      FSDP once per step (`once`): every gather before the first microbatch, every
        reduce-scatter after the last; nothing to hide behind (executor_accumulate).
      Muon's all-to-alls: under the Newton-Schulz matmuls of the other matrices.
      tp's activation all-reduces, pp's ppermutes, EP's dispatch all-to-alls, cp's
        latent gathers, the slices' all-reduce: between two matmuls that need them, or
        with no work beside them; exposed."""
    n_blocks = max(1, cfg.model.n_blocks)
    fsdp = sum(v for k, v in comm.items() if k.startswith("fsdp"))
    muon = sum(v for k, v in comm.items() if k.startswith("muon"))
    exposed = {k: v for k, v in comm.items() if not k.startswith(("fsdp", "muon"))}
    if fsdp:
        exposed["fsdp, not hidden"] = fsdp if once else max(fsdp / n_blocks, fsdp - pipelined)
    if muon:
        exposed["muon, not hidden"] = max(0.0, muon - pipelined)
    return exposed, pipelined + sum(exposed.values())


def plan_across_slices(cfg, devices, hw_name, efficiency, peak):
    """--mesh.slices S: every slice runs the one-slice step on batch / S rows (weights
    replicated per slice, so per-device memory is one slice's), plus one all-reduce of
    the gradient shards over the S slices per step (step_core.reduce_over_slices), over
    the data-center network: a ring moves 2 (S - 1) / S of the shard bytes per device."""
    S = cfg.mesh.slices
    if cfg.train.batch_size % S or (devices and devices % S):
        raise ConfigError(f"--mesh.slices ({S}) must divide --train.batch_size ({cfg.train.batch_size}) and the devices ({devices})")
    one = apply_overrides(cfg, {"mesh": {"slices": 1}, "train": {"batch_size": cfg.train.batch_size // S}})
    p = plan(one, devices // S, hw_name, efficiency, peak)
    params = model_shapes(shape_keys(plan_config(cfg))[0])
    trained = jax.tree_util.tree_map_with_path(lambda path, w: w if is_trained(weight_name(path)) else None, params)
    reduce_bytes = 2 if cfg.model.grad_reduce_dtype == "bfloat16" else F32
    gradient_bytes = layout_bytes(trained, cfg.mesh.expert_parallel, dict(p["mesh"], cp=p["mesh"].get("cp", 1)), itemsize=reduce_bytes)
    dcn_s = 2 * (S - 1) / S * gradient_bytes / DCN_BW_PER_CHIP
    comm = dict(p["comm"], **{f"slice all-reduce of gradient shards ({gradient_bytes / 2**20:.1f} MiB, DCN at "
                               f"{DCN_BW_PER_CHIP / GB:g} GB/s per chip, assumed)": dcn_s})
    serial = p["step_s_serial"] + dcn_s
    return dict(p, preset=cfg.preset, devices=p["devices"] * S, mesh=dict(slice=S, **p["mesh"]), comm=comm,
                slice_gradient_bytes=gradient_bytes, step_s_serial=serial,
                step_s_overlapped=max(p["step_s_overlapped"], sum(comm.values())), step_s_predicted=p["step_s_predicted"] + dcn_s,
                tokens_per_sec=cfg.train.batch_size * cfg.model.seq_len / serial)
