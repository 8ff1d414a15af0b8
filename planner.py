"""Plan a run before paying for it: per-device memory, step time and whether it fits.

    python planner.py --preset moe1b --hardware tpu-v5p
    python planner.py --preset moe1b --hardware h200 --mesh.dp 1 --mesh.pp 1 --mesh.tp 1
    python planner.py --preset moe1b --hardware tpu-v5e --devices 64 --mesh.dp -1 --model.remat none

Nothing is allocated and no device is needed: parameter shapes come from
`nnx.eval_shape`, the storage layout from `parallel.param_specs` (the same sharding
table the train step uses), and the mesh shape is arithmetic (`--mesh.dp -1` takes the
rest of `--devices N`). Takes every main.py flag, plus:

    --hardware NAME   one of the HARDWARE table below (default tpu-v5p)
    --devices N       devices in the run (needed with --mesh.dp -1)
    --efficiency X    assumed fraction of peak FLOP/s the matmuls reach (default 0.5)
    --json PATH       also write the plan as JSON
    --tpu TYPE        compile the real train and eval steps for that TPU slice (gcloud's
                      accelerator type, below) with the TPU compiler, on this CPU, and print
                      its per-device bytes beside the estimate, whether it fits the chip's
                      HBM, and the compiled program's collectives. Needs libtpu
                      (requirements-test.txt). Sets --hardware and --devices. Last line:
                      tpu_bytes_per_device=<int> planner_bytes_per_device=<int> fits=<true|false>

    python planner.py --table [--presets P,...] [--pods T,...] [--json PATH]
                      the README's table: every preset compiled for the pods people use
                      (TABLE_MESHES below), the TPU compiler's bytes beside the planner's

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

import json
import math
import sys
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import AbstractMesh

import optimizers
import parallel as par
import pipeline
import tpu_compile
import weights
from devices import skip_tpu_probe_without_tpu
from flops import count_params, flops_per_token, human, measure_peak_flops
from moe import expert_capacity
from model import abstract_model, abstract_params, padded_vocab  # noqa: F401  (abstract_model: the tests call it here)
from utils import PRESETS, Config, ConfigError, apply_overrides, parse_args

F32 = 4  # bytes: master weights, optimizer moments, softmax/norm internals, logits
GiB = 2**30

# ----------------------------------------------------------------------------
# Hardware profiles. Peak = dense bf16 matmul FLOP/s per device; memory = HBM per
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


HARDWARE = {
    "tpu-v4": Hardware("TPU v4", 275e12, 32 * GiB, ring_bw=100 * GB, p2p_bw=50 * GB),
    "tpu-v5e": Hardware("TPU v5e", 197e12, 16 * GiB, ring_bw=100 * GB, p2p_bw=50 * GB),
    "tpu-v5p": Hardware("TPU v5p", 459e12, 95 * GiB, ring_bw=200 * GB, p2p_bw=100 * GB),
    "tpu-v6e": Hardware("TPU v6e", 918e12, 32 * GiB, ring_bw=224 * GB, p2p_bw=112 * GB),
    "h100": Hardware("H100 SXM", 989e12, 80 * GiB, ring_bw=450 * GB, p2p_bw=450 * GB, node_size=8, cross_node_bw=50 * GB),
    "h200": Hardware("H200 SXM", 989e12, 141 * GiB, ring_bw=450 * GB, p2p_bw=450 * GB, node_size=8, cross_node_bw=50 * GB),
    "cpu": Hardware("CPU (this machine, 2 cores)", 0.0, 24 * GiB, ring_bw=10 * GB, p2p_bw=10 * GB),
}
DEFAULT_EFFICIENCY = 0.5  # large dense transformer training commonly reaches 40-60% MFU


def cpu_peak_flops():
    """FLOP/s of a float32 matmul on this machine (flops.measure_peak_flops)."""
    return measure_peak_flops(jax.numpy.float32, size=1024)


# ----------------------------------------------------------------------------
# Shapes and the storage layout (no arrays)


def abstract_mesh(shape):
    return AbstractMesh(tuple(shape), par.AXES)


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
    return tuple(dim // math.prod(mesh_shape[a] for a in par.axes_of(spec[i] if i < len(spec) else None))
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
        dims = par.weight_layout(par.weight_name(path), par.is_stacked(path), expert_parallel)[0]
        total += shard_bytes(leaf.shape, size, dims, mesh_shape, tiled)
    return total


def gathered_bytes(tree, expert_parallel, mesh_shape, itemsize, one_block, tiled=False):
    """Per-device bytes of weights after the FSDP all-gather (gather_for_use): still split
    over their compute axes (tp, experts over dp), whole along the storage-only axes.
    one_block: a block's weights (the stacked N dim sliced away)."""
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        dims, fsdp_axes, _ = par.weight_layout(par.weight_name(path), par.is_stacked(path), expert_parallel)
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
        dims, fsdp_axes, _ = par.weight_layout(par.weight_name(path), par.is_stacked(path), expert_parallel)
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


# ----------------------------------------------------------------------------
# Activations: what the backward pass keeps, from the model's tensors (model.py).
#
# Per token of one microbatch, per layer, on one device (heads, FFN and expert hidden
# units already divided by tp); c = bytes of the compute dtype. These are the residuals
# JAX saves for the backward pass (jax.ad_checkpoint.print_saved_residuals lists them),
# grouped by where they come from; they matched its list on the tiny and moe1b shapes.
# Approximated:
#   - index, mask and per-row statistics tensors (a few bytes per token) roughly;
#   - the causal mask and -inf fill broadcast to [b, H, T, T], which JAX hoists out of
#     the loops once per microbatch shape, not at all (a few % of one block);
#   - the GELU dense FFN, dropless MoE (ragged_dot) and dropout masks are sized by
#     analogy, not checked against a compiled step;
#   - what XLA adds or saves on top (fusion, buffer reuse, loop copies) is the two-phase
#     peak in activation_bytes, calibrated on CPU.


@dataclass(frozen=True)
class Local:
    """Per-device sizes of one microbatch."""
    b: int  # sequences per microbatch per device
    T: int
    D: int
    H: int  # heads on this device (n_heads / tp)
    K: int
    R: int
    Q: int
    A: int
    F: int  # dense FFN hidden units on this device
    Fe: int  # hidden units per expert on this device
    Fs: int  # shared-expert hidden units on this device
    E: int  # routed experts
    X: int  # top_k
    S: int  # tokens per routing group
    C: int  # slots per expert per group
    V: int  # vocabulary rows on this device
    c: int  # compute dtype bytes


def norm_bytes(width):
    """RMSNorm keeps its input in float32, the normalised float32 value and two per-row
    statistics."""
    return 2 * width * F32 + 2 * F32


def attention_bytes(s):
    """MLAttention.__call__, per token."""
    return (norm_bytes(s.D) + 3 * s.D * s.c  # attn_norm; its output, kept by each of the 3 down-projections
            + norm_bytes(s.Q) + s.Q * s.c  # q latent: q_norm internals, q_BTQ
            + norm_bytes(s.A) + s.A * s.c  # kv latent: kv_norm internals, kv_BSA
            + 2 * s.H * s.K * s.c + s.H * s.R * s.c + s.R * s.c  # q_nope, k_nope, q_rope, k_rope
            + s.H * s.T * (F32 + s.c) + 2 * s.H * F32  # scores_BHTS (float32), probs (compute dtype), softmax max/sum
            + 2 * s.H * s.K * s.c)  # v_BSHK, out_BTHK


def swiglu_bytes(s, F):
    """DenseFFN (SwiGLU), per token: its input twice (two up-projections) and six F-wide
    tensors (gate, up, silu and its pieces, the product)."""
    return 2 * s.D * s.c + 6 * F * s.c


def dense_ffn_bytes(s, activation):
    hidden = 6 * s.F if activation == "swiglu" else 2 * s.F  # gelu: up_BTF and its gelu input
    return norm_bytes(s.D) + (2 if activation == "swiglu" else 1) * s.D * s.c + hidden * s.c


def moe_bytes(s, n_shared):
    """MoE.__call__ with capacity, per token. The expert buffers hold G*E*C slots for
    G*S tokens: E*C/S slots per token, each a D-wide input and six Fe-wide hidden
    tensors (the same SwiGLU pieces as a dense FFN)."""
    slots = s.E * s.C / s.S
    router = s.D * F32 + 2 * s.E * F32 + s.X * (4 + F32) + 6 * F32  # float32 input, logits/probs, top-k, stats
    buffers = slots * (s.D * s.c + 6 * s.Fe * s.c + 4)  # x_GECD, expert hidden, token_for_slot
    combine = s.X * (s.D * s.c + 1 + 4 + s.c)  # gathered expert outputs per choice, kept mask, slot, gate
    shared = swiglu_bytes(s, s.Fs) if n_shared else 0
    return norm_bytes(s.D) + router + buffers + combine + shared


def layer_bytes(s, kind, m):
    ffn = moe_bytes(s, m.n_shared) if kind == "M" else dense_ffn_bytes(s, m.ffn_activation)
    return attention_bytes(s) + ffn


def matmul_output_bytes(s, kind, m, itemsize=F32):
    """What remat block_dots keeps of a layer, per token: every matmul's output, in
    float32 (layers.project accumulates in float32 and casts after; on TPU the cast is
    fused into the matmul: itemsize = the compute dtype's)."""
    attention = (s.Q + s.H * s.K + s.H * s.R + s.A + s.R + 2 * s.H * s.K  # down, up and RoPE projections
                 + 2 * s.H * s.T + s.H * s.K + s.D)  # two score products, probs x values, output projection
    if kind == "M":
        ffn = s.E + s.E * s.C / s.S * (2 * s.Fe + s.D) + (2 * s.Fs + s.D if m.n_shared else 0)  # router, experts, shared
    else:
        ffn = (2 * s.F if m.ffn_activation == "swiglu" else s.F) + s.D
    return (attention + ffn) * itemsize


def local_sizes(cfg, mesh_shape, compute_bytes=None):
    m, t = cfg.model, cfg.train
    dp, tp = mesh_shape["dp"], mesh_shape["tp"]
    S = min(m.routing_group or m.seq_len, m.seq_len)
    C = expert_capacity(S, m.top_k, m.n_experts, m.capacity_factor) if m.capacity_factor > 0 else math.ceil(S * m.top_k / m.n_experts)
    return Local(b=t.batch_size // (dp * t.microbatches), T=m.seq_len, D=m.d_model, H=m.n_heads // tp, K=m.head_dim,
                 R=m.rope_dim, Q=m.q_latent, A=m.kv_latent, F=m.d_ff // tp, Fe=m.d_expert // tp,
                 Fs=m.n_shared * m.d_expert // tp, E=m.n_experts, X=m.top_k, S=S, C=C,
                 V=padded_vocab(m.vocab_size, m.vocab_multiple) // tp,
                 c=compute_bytes or (2 if m.dtype == "bfloat16" else 4))


def pipeline_loops(cfg, pp):
    """(ticks, blocks per stage): GPipe's loop runs M + pp - 1 ticks, and at every tick
    each stage loops over its n_blocks / pp blocks."""
    return cfg.train.microbatches + pp - 1, cfg.model.n_blocks // pp


# Fraction of one block's intermediates that the backward pass of a block holds at
# once on top of what was saved: the cotangents of the block's tensors, freed as the
# backward pass walks back through its layers. Measured on CPU (XLA memory_analysis,
# tests/test_planner.py): 0.5-0.85 for remat none; with remat block the recomputed
# block's own intermediates are that working set (counted as 1 block).
BACKWARD_WORKING_FRACTION = 0.75
# A block recomputed by remat on a split mesh, as a fraction of the per-layer sums
# below: measured 0.83-0.84 on CPU for moe1b's DDDDDM blocks on every split mesh tried
# (scaled down, remat block: 1x2x1, 2x2x2, 4x1x2, at 4 and 8 sequences per device),
# 0.99-1.01 on one device. A fit, not a mechanism. tiny's one-layer MoE blocks agree
# either way (remat block on 2x2x2 and 4x1x2: 0.965 and 1.015 with it, 1.026 and 1.097
# with 1.0; tests/test_planner.py).
SPLIT_MESH_RECOMPUTE_FRACTION = 0.85


# XLA:TPU fuses a block's elementwise work (norms and their float32 copies, SwiGLU's
# pieces, softmax, RoPE) into the matmuls around it, so a block recomputed for its
# backward pass holds at once little more than its matmul outputs in the compute dtype:
# the largest buffers at the peak of the compiled step (the live-range dump of
# --xla_dump_to) are dot and convolution fusions. With this, the planner's temporaries
# are 0.91-0.95 of the compiler's live ones on the scaled-down moe1b (v4-64 8x2x2, v5p-64
# 8x1x4 with expert parallelism; tests/test_tpu_compile.py), where the per-layer sums
# calibrated on XLA:CPU gave 1.5-1.6.
def recomputed_block_bytes(cfg, mesh_shape, s, fused):
    """Bytes a block recomputed by remat holds at once in its backward pass."""
    m = cfg.model
    tokens = s.b * s.T
    if fused:
        return tokens * sum(matmul_output_bytes(s, kind, m, itemsize=s.c) for kind in m.block_pattern)
    per_block = tokens * sum(layer_bytes(s, kind, m) for kind in m.block_pattern)
    return SPLIT_MESH_RECOMPUTE_FRACTION * per_block if math.prod(mesh_shape.values()) > 1 else per_block


def activation_bytes(cfg, mesh_shape, compute_bytes=None, fused=False):
    """{component: bytes} of activations at the peak of the train step, per device.

    GPipe here runs M + pp - 1 ticks and every stage computes at every tick (bubble
    ticks on zeros), so the backward pass keeps M + pp - 1 ticks' worth:
      remat none: every intermediate of every local block, per tick;
      remat block_dots: every matmul output of every local block, per tick;
      remat layer / block: each local layer's / block's input per tick;
      remat stage: the stage's input per tick.
    On top of that, the peak is the larger of two phases, which never overlap:
      loss: float32 logits [b, T, V/tp] of one microbatch and their gradient
        (parallel.last_stage_loss_sums recomputes them per microbatch);
      block backward: remat block and layer recompute one block (its intermediates; XLA
        recomputes all of a block's layers together), stage all of a tick's blocks;
        remat none and block_dots work through one block's cotangents
        (BACKWARD_WORKING_FRACTION of a block).
        With both loops real (ticks > 1 and several local blocks), remat none also
        holds one tick's intermediates twice: the inner loop over blocks writes them
        into its own stacked buffer, which is then copied into the per-tick stack.
    """
    if cfg.train.pipeline != "gpipe":
        return scheduled_activation_bytes(cfg, mesh_shape, compute_bytes, fused)
    m, t = cfg.model, cfg.train
    pp = mesh_shape["pp"]
    s = local_sizes(cfg, mesh_shape, compute_bytes)
    ticks, blocks_here = pipeline_loops(cfg, pp)
    tokens = s.b * s.T  # per microbatch
    per_block = tokens * sum(layer_bytes(s, kind, m) for kind in m.block_pattern)
    x_bytes = tokens * s.D * s.c  # one microbatch's residual stream
    out = {}
    if m.remat in ("none", "block_dots"):
        kept = per_block if m.remat == "none" else tokens * sum(matmul_output_bytes(s, kind, m) for kind in m.block_pattern)
        out[f"saved: every local block's {'intermediates' if m.remat == 'none' else 'matmul outputs'}, every tick"] = ticks * blocks_here * kept
        block_phase = BACKWARD_WORKING_FRACTION * per_block
        if ticks > 1 and blocks_here > 1:
            block_phase += blocks_here * kept
    else:
        recomputed_block = recomputed_block_bytes(cfg, mesh_shape, s, fused)
        if m.remat == "stage":  # one tick's blocks recomputed, then walked back through
            out["saved: the stage's input, every tick"] = ticks * x_bytes
            block_phase = (blocks_here + BACKWARD_WORKING_FRACTION) * per_block if blocks_here > 1 else recomputed_block
        elif m.remat == "layer":
            # XLA (measured on CPU) recomputes all layers of a block before their backward
            # pass rather than one at a time, so the working set is still a whole block.
            out["saved: every local layer's input, every tick"] = ticks * blocks_here * len(m.block_pattern) * x_bytes
            block_phase = recomputed_block
        else:  # block
            out["saved: every local block's input, every tick"] = ticks * blocks_here * x_bytes
            block_phase = recomputed_block
    out["pipeline buffers (embedded inputs, stage outputs)"] = (t.microbatches + ticks) * x_bytes
    rows = tokens  # the loss takes one microbatch at a time
    loss_phase = 2 * rows * s.V * F32 + rows * (norm_bytes(s.D) + s.D * s.c)
    phases = {"loss: float32 logits + their gradient": loss_phase,
              "backward through one " + ("stage" if m.remat == "stage" else "block")
        + (" (+ a copy of one tick's)" if m.remat in ("none", "block_dots") and ticks > 1 and blocks_here > 1 else ""): block_phase}
    peak = max(phases, key=phases.get)
    out["peak of two phases: " + peak] = phases[peak]
    return out, phases


# ----------------------------------------------------------------------------
# The hand-written schedules (--train.pipeline 1f1b | interleaved, pipeline.py)


def schedule_of(cfg, pp):
    return pipeline.schedule(cfg.train.pipeline, pp, cfg.train.microbatches, cfg.train.virtual_stages)


def scheduled_activation_bytes(cfg, mesh_shape, compute_bytes=None, fused=False):
    """{component: bytes} of activations at the peak, per device, for 1f1b and
    interleaved: the ring of saved block inputs (a slot per microbatch-chunk in
    flight: pp for 1f1b, whatever GPipe's M), the ring of incoming gradients, and the
    larger of two phases: the loss of one microbatch, or the backward tick of one
    block (recomputed from its input, as remat block does; remat stage: a chunk)."""
    m = cfg.model
    pp = mesh_shape["pp"]
    sched = schedule_of(cfg, pp)
    s = local_sizes(cfg, mesh_shape, compute_bytes)
    tokens = s.b * s.T
    x_bytes = tokens * s.D * s.c
    per_block = tokens * sum(layer_bytes(s, kind, m) for kind in m.block_pattern)
    blocks_per_chunk = m.n_blocks // (pp * sched.virtual_stages)
    saved_per_slot = 1 if m.remat == "stage" else blocks_per_chunk
    out = {f"saved: {'each chunk' if m.remat == 'stage' else 'each block'}'s input, {sched.res_slots} slots in flight (+1 spare)":
           (sched.res_slots + 1) * saved_per_slot * x_bytes,
           f"incoming gradients, {sched.grad_slots} slots (+1 spare), and the tick's sends and receipts": (sched.grad_slots + 5) * x_bytes}
    recomputed_block = recomputed_block_bytes(cfg, mesh_shape, s, fused)
    block_phase = blocks_per_chunk * per_block if m.remat == "stage" else recomputed_block
    loss_phase = 2 * tokens * s.V * F32 + tokens * (norm_bytes(s.D) + s.D * s.c)
    phases = {"loss: float32 logits + their gradient": loss_phase,
              "backward tick of one " + ("chunk" if m.remat == "stage" else "block") + " (recomputed)": block_phase}
    peak = max(phases, key=phases.get)
    out["peak of two phases: " + peak] = phases[peak]
    return out, phases


# Cost of a backward tick in forward passes of the same chunk: the backward itself (2)
# and the forward it recomputes from the saved input (1).
BACKWARD_TICK_COST = 3


def scheduled_bubble_factor(cfg, pp):
    """Lockstep time of the table over the useful work, minus one. All stages wait for
    each other at every tick (the ppermutes), so a tick lasts as long as its slowest
    op: a tick where one stage runs a backward costs a backward for all of them."""
    sched = schedule_of(cfg, pp)
    cost = np.array([0, 1, BACKWARD_TICK_COST])[sched.table[..., 0]]  # [ticks, pp]
    useful = cfg.train.microbatches * sched.virtual_stages * (1 + BACKWARD_TICK_COST)
    return float(cost.max(axis=1).sum()) / useful - 1


# ----------------------------------------------------------------------------
# Step time


def collective_bw(hw, mesh_shape, axes):
    """Bandwidth of a collective over `axes`: on a GPU cluster, an axis group that
    fits in one NVLink node uses NVLink, else InfiniBand. The mesh is (dp, pp, tp),
    tp innermost: the devices of a group along axis a are `stride(a)` apart."""
    if not hw.node_size:
        return hw.ring_bw
    order = ("dp", "pp", "tp")
    for a in axes:
        inner = math.prod(mesh_shape[x] for x in order[order.index(a):])  # span of one group along a
        if inner > hw.node_size and mesh_shape[a] > 1:
            return hw.cross_node_bw
    return hw.ring_bw


# Remat policies that run the whole forward again in the backward pass (block_dots
# recomputes only elementwise work), and those that keep the gathered weights of
# every local block instead of gathering again (the gather sits outside a layer's
# checkpoint; stage re-gathers while it recomputes, and so do block and block_dots).
RECOMPUTE_FORWARD = ("layer", "block", "stage")
KEEP_GATHERED = ("none", "layer")


def step_time(cfg, mesh_shape, hw, peak, efficiency, params):
    """{name: seconds}. Compute at `efficiency` of peak; each collective at its bandwidth
    with no overlap (the serial sum is an upper bound, max(compute, comm) a lower one)."""
    m, t = cfg.model, cfg.train
    dp, pp, tp = mesh_shape["dp"], mesh_shape["pp"], mesh_shape["tp"]
    n_devices = dp * pp * tp
    s = local_sizes(cfg, mesh_shape)
    ticks, blocks_here = pipeline_loops(cfg, pp)
    tokens_per_step = t.batch_size * m.seq_len
    model_flops = flops_per_token(m) * tokens_per_step
    # What the devices execute beyond the model FLOPs: the remat forward again (+1/3),
    # and empty expert slots (buffers hold capacity_factor x top_k slots per token).
    routed_per_layer = 3 * m.d_model * m.d_expert * m.top_k
    n_moe = m.n_blocks * m.block_pattern.count("M")
    slot_factor = (s.E * s.C / s.S) / m.top_k if m.capacity_factor > 0 else 1.0
    executed = model_flops + 6 * routed_per_layer * n_moe * tokens_per_step * (slot_factor - 1)
    if m.remat in RECOMPUTE_FORWARD or t.pipeline != "gpipe":  # (the hand-written backward always recomputes)
        executed *= 4 / 3
    compute = executed / (n_devices * peak * efficiency)
    bubble = compute * (pp - 1) / t.microbatches  # = a fraction (pp-1)/(M+pp-1) of the pipelined compute
    if t.pipeline != "gpipe":
        bubble = compute * scheduled_bubble_factor(cfg, pp)

    c = s.c
    blocks = {k: v for k, v in params.items() if k == "blocks"}
    top = {k: v for k, v in params.items() if k != "blocks"}
    ep = cfg.mesh.expert_parallel
    # FSDP: every tick gathers every local block (and the backward pass reduce-scatters
    # its gradient, the same bytes); under remat the recompute gathers again. The
    # embedding and final norm are gathered once per step.
    passes = 2 if m.remat in KEEP_GATHERED else 3
    comm = {}
    per_block = fsdp_traffic(blocks, ep, mesh_shape, c, one_block=True)
    for axes, nbytes in per_block.items():
        key = "fsdp all-gather/reduce-scatter over " + "+".join(axes)
        seconds = passes * ticks * blocks_here * nbytes / collective_bw(hw, mesh_shape, axes)
        comm[key] = comm.get(key, 0) + seconds
    for axes, nbytes in fsdp_traffic(top, ep, mesh_shape, c, one_block=False).items():
        key = "fsdp all-gather/reduce-scatter over " + "+".join(axes)
        comm[key] = comm.get(key, 0) + 2 * nbytes / collective_bw(hw, mesh_shape, axes)
    x_bytes = s.b * s.T * s.D * c
    layers_here = blocks_here * len(m.block_pattern)
    if tp > 1:  # 2 all-reduces per layer forward (attention out, FFN out), 2 backward (their inputs), 2 more under remat
        all_reduce = 2 * (tp - 1) / tp * x_bytes
        per_layer = 4 if m.remat == "none" else 6
        comm["tp all-reduce of activations"] = ticks * layers_here * per_layer * all_reduce / collective_bw(hw, mesh_shape, ("tp",))
    if pp > 1:  # one microbatch activation to the next stage per tick, and its gradient back
        comm["pp ppermute of activations"] = 2 * ticks * x_bytes / hw.p2p_bw
    if ep and dp > 1:  # x_GECD out and y_GECD back, forward and backward (and recompute)
        buffer = s.b * s.T / s.S * s.E * s.C * s.D * c
        moe_here = m.n_blocks // pp * m.block_pattern.count("M")
        per_layer = 4 if m.remat == "none" else 6
        comm["ep all-to-all of expert buffers"] = ticks * moe_here * per_layer * buffer * (dp - 1) / dp / collective_bw(hw, mesh_shape, ("dp",))
    return dict(compute=compute, bubble=bubble, model_flops=model_flops, executed_flops=executed), comm


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
    specs = par.param_specs(params, expert_parallel)
    leaves = {}
    for (path, leaf), spec in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                                  jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, par.P))):
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


# ----------------------------------------------------------------------------
# The plan


def plan_config(cfg):
    if cfg.model.vocab_size == 0:  # the byte tokenizer of the embedded default
        cfg = apply_overrides(cfg, {"model": {"vocab_size": 257}})
    return cfg


# Data-center network bandwidth per TPU chip, between slices (--mesh.slices): an
# assumption, not a measurement here. The scaling book ("How to Scale Your Model", its
# TPU chapter) gives ~6.25 GB/s per chip (a host's ~25 GB/s NICs over its 4 chips);
# summaries of it say 6-12 GB/s. 10-30x below one ICI ring's ring_bw above.
DCN_BW_PER_CHIP = 6.25 * GB


def plan(cfg, devices, hw_name, efficiency=DEFAULT_EFFICIENCY, peak=None):
    """Everything the planner prints, as a dict (bytes, seconds)."""
    if hw_name not in HARDWARE:
        raise ValueError(f"unknown --hardware {hw_name!r}; choose one of {', '.join(HARDWARE)}")
    if cfg.mesh.slices > 1:
        return plan_across_slices(cfg, devices, hw_name, efficiency, peak)
    hw = HARDWARE[hw_name]
    cfg = plan_config(cfg)
    if cfg.mesh.dp == -1 and not devices:
        raise ConfigError("--mesh.dp -1 takes the devices left by pp and tp: say how many with --devices N")
    if cfg.mesh.cp > 1:
        raise ConfigError("planner.py does not count --mesh.cp yet (its activations, latent gathers and attention FLOPs): "
                          "plan with --mesh.cp 1")
    n_devices = devices or cfg.mesh.dp * cfg.mesh.pp * cfg.mesh.tp
    shape = par.resolve_mesh_shape(cfg.mesh, n_devices)
    mesh = abstract_mesh(shape)
    mesh_shape = dict(mesh.shape)
    par.check_config_fits_mesh(cfg, mesh)
    params = abstract_params(cfg.model)
    par.check_divisible(params, par.param_specs(params, cfg.mesh.expert_parallel), mesh)

    ep = cfg.mesh.expert_parallel
    c = 2 if cfg.model.dtype == "bfloat16" else 4
    opt_state = jax.eval_shape(optimizers.make_optimizer(cfg.train).init, params)
    tiled = hw_name.startswith("tpu")  # TPU memory pads arrays to whole tiles (tpu_tiled_bytes)
    memory = dict(params=layout_bytes(params, ep, mesh_shape, tiled=tiled),
                  optimizer=layout_bytes(opt_state, ep, mesh_shape, tiled=tiled))
    memory["gradients"] = layout_bytes(params, ep, mesh_shape, itemsize=F32, tiled=tiled)
    blocks = {"blocks": params["blocks"]}
    top = {k: v for k, v in params.items() if k != "blocks"}
    one_block = gathered_bytes(blocks, ep, mesh_shape, c, one_block=True, tiled=tiled)
    # remat none and layer keep every local block's gathered weights for the backward
    # pass, and stage holds them all while it recomputes a tick; block and block_dots
    # gather one block at a time (again in the backward pass).
    ticks, blocks_here = pipeline_loops(cfg, mesh_shape["pp"])
    n_gathered = blocks_here if cfg.model.remat in ("none", "layer", "stage") else 1
    # The embedding and final norm come out of their gather in the gradient-reduction
    # dtype (float32 by default), so that their gradient accumulates over microbatches
    # in it (parallel.gather_for_use).
    top_bytes = max(c, 4 if cfg.model.grad_reduce_dtype == "float32" else 2)
    memory["gathered weights"] = n_gathered * one_block + gathered_bytes(top, ep, mesh_shape, top_bytes, one_block=False, tiled=tiled)
    fsdp = fsdp_traffic(params, ep, mesh_shape, c, one_block=False)
    if not fsdp and c == F32:  # nothing to gather or cast: the weights in use are the params themselves
        memory["gathered weights"] = 0
    # XLA:CPU has no bfloat16 arithmetic: it computes in float32, and the intermediates
    # it keeps are float32 (measured: a bfloat16 step's temp bytes equal float32's).
    activations, phases = activation_bytes(cfg, mesh_shape, compute_bytes=F32 if hw_name == "cpu" else None, fused=tiled)
    activations = {name: int(value) for name, value in activations.items()}
    memory["activations"] = sum(activations.values())
    # The gradient of one block's gathered weights, whole along the FSDP axes, exists
    # until its reduce-scatter hands each device its shard (none without FSDP).
    if fsdp:
        memory["gathered gradient of one block"] = one_block
    # With both loops real (pipeline ticks > 1, several local blocks), the backward pass
    # of a tick writes its blocks' gradients into a stack of their own, which is then
    # added to the running sum over ticks: two copies of the blocks' gradients.
    if cfg.train.pipeline != "gpipe":  # a backward tick's gradient of one chunk, added to the step's sum
        chunk_grad_bytes = layout_bytes(blocks, ep, mesh_shape, itemsize=F32, tiled=tiled) // schedule_of(cfg, mesh_shape["pp"]).virtual_stages
        memory["a backward tick's gradient of one chunk"] = chunk_grad_bytes
        # the embedding's and final norm's gradient, gathered, summed over the step in float32
        # (the sum, and a forward and a backward tick's contributions)
        memory["gradient of the gathered embedding (float32, 3 copies)"] = 3 * gathered_bytes(top, ep, mesh_shape, F32, one_block=False, tiled=tiled)
    elif ticks > 1 and blocks_here > 1:
        memory["this tick's gradient of the stage's blocks"] = layout_bytes(blocks, ep, mesh_shape, itemsize=F32, tiled=tiled)
    temp = sum(v for k, v in memory.items() if k not in ("params", "optimizer"))  # all that the step allocates
    muon = muon_cost(params, ep, mesh_shape, tiled) if cfg.train.optimizer == "muon" else None
    if muon:  # after the backward pass, beside the gradients alone: the step's peak is the larger of the two
        memory["Muon update of the largest pool (float32; after the backward pass, not added)"] = muon["working_set"]
        temp = max(temp, memory["gradients"] + muon["working_set"])
    total_bytes = memory["params"] + memory["optimizer"] + temp

    if hw_name == "cpu":
        peak = peak or cpu_peak_flops() / n_devices  # fake devices share the cores the matmul used
        available = hw.memory_bytes / n_devices  # fake devices share the machine's RAM
    else:
        peak = peak or hw.peak_flops
        available = hw.memory_bytes
    times, comm = step_time(cfg, mesh_shape, hw, peak, efficiency, params)
    if muon:  # Newton-Schulz in float32 (assumed at the same efficiency), and its all-to-alls
        times["optimizer_flops"] = muon["flops"]
        times["compute"] += muon["flops"] / (peak * efficiency)
        for axes, nbytes in muon["traffic"].items():
            comm[f"muon all-to-all of momentum and updates over {axes}"] = nbytes / collective_bw(hw, mesh_shape, tuple(axes.split("+")))
    total_params, active_params = count_params(cfg.model)
    serial = times["compute"] + times["bubble"] + sum(comm.values())
    overlapped = max(times["compute"] + times["bubble"], sum(comm.values()))
    return dict(
        preset=cfg.preset, hardware=hw.name, devices=n_devices, mesh=mesh_shape, dtype=cfg.model.dtype,
        remat=cfg.model.remat, microbatches=cfg.train.microbatches, expert_parallel=ep,
        params_total=total_params, params_active=active_params,
        memory=memory, activations=activations, temp_bytes=temp, total_bytes=total_bytes,
        batch_bytes=array_bytes((cfg.train.batch_size // shape[0], cfg.model.seq_len + 1), 4, tiled),  # int32 tokens, not in the total
        loss_phase_bytes=int(next(v for k, v in phases.items() if k.startswith("loss"))), gpu=bool(hw.node_size),
        available_bytes=available, fits=total_bytes <= available,
        peak_flops=peak, efficiency=efficiency, times=times, comm=comm,
        pipeline=cfg.train.pipeline, bubble_fraction=schedule_of(cfg, mesh_shape["pp"]).bubble(),
        step_s_serial=serial, step_s_overlapped=overlapped,
        tokens_per_sec=cfg.train.batch_size * cfg.model.seq_len / serial)


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
    params = abstract_params(plan_config(cfg).model)
    trained = jax.tree_util.tree_map_with_path(lambda path, w: w if weights.is_trained(weights.weight_name(path)) else None, params)
    reduce_bytes = 2 if cfg.model.grad_reduce_dtype == "bfloat16" else F32
    gradient_bytes = layout_bytes(trained, cfg.mesh.expert_parallel, p["mesh"], itemsize=reduce_bytes)
    dcn_s = 2 * (S - 1) / S * gradient_bytes / DCN_BW_PER_CHIP
    comm = dict(p["comm"], **{f"slice all-reduce of gradient shards ({gradient_bytes / 2**20:.1f} MiB, DCN at "
                               f"{DCN_BW_PER_CHIP / GB:g} GB/s per chip, assumed)": dcn_s})
    serial = p["step_s_serial"] + dcn_s
    return dict(p, preset=cfg.preset, devices=p["devices"] * S, mesh=dict(slice=S, **p["mesh"]), comm=comm,
                slice_gradient_bytes=gradient_bytes, step_s_serial=serial,
                step_s_overlapped=max(p["step_s_overlapped"], sum(comm.values())),
                tokens_per_sec=cfg.train.batch_size * cfg.model.seq_len / serial)


def suggestions(cfg, devices, hw_name, efficiency, peak):
    """Nearby configs on the same devices that fit: [(flags, plan)], those that keep the
    global batch first, then by memory."""
    m, t, mesh = cfg.model, cfg.train, cfg.mesh
    n = devices or mesh.dp * mesh.pp * mesh.tp
    dp, pp, tp = (n // (mesh.pp * mesh.tp) if mesh.dp == -1 else mesh.dp), mesh.pp, mesh.tp
    same_batch = {}
    if m.remat == "none":
        same_batch["--model.remat block"] = {"model": {"remat": "block"}}
    if m.dtype == "float32":
        same_batch["--model.dtype bfloat16"] = {"model": {"dtype": "bfloat16"}}
    smaller_batch = {}
    for factor in (2, 4, 8):
        if dp % factor == 0:
            same_batch[f"--mesh.dp {dp // factor} --mesh.tp {tp * factor}"] = {"mesh": {"dp": dp // factor, "tp": tp * factor}}
            microbatches = max(t.microbatches, 2 * pp * factor)
            same_batch[f"--mesh.dp {dp // factor} --mesh.pp {pp * factor} --train.microbatches {microbatches}"] = {
                "mesh": {"dp": dp // factor, "pp": pp * factor}, "train": {"microbatches": microbatches}}
        smaller = {"train": {"batch_size": t.batch_size // factor}}
        if m.remat == "none":
            smaller["model"] = {"remat": "block"}
        smaller_batch[f"--train.batch_size {t.batch_size // factor}" + (" --model.remat block" if m.remat == "none" else "")] = smaller
    fitting = []
    for rank, tries in enumerate((same_batch, smaller_batch)):
        for flags, overrides in tries.items():
            try:
                p = plan(apply_overrides(cfg, overrides), devices, hw_name, efficiency, peak)
            except (ConfigError, ValueError, ZeroDivisionError):
                continue  # that mesh does not divide the model or the batch
            if p["fits"]:
                fitting.append((rank, p["total_bytes"], flags, p))
    return [(flags, p) for _, _, flags, p in sorted(fitting, key=lambda x: x[:2])]


# ----------------------------------------------------------------------------
# Printing


def memory_unit(n):
    """(name, bytes) of the unit that shows n best: one unit for a whole table."""
    return next((name, size) for name, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)) if n >= size / 10)


def seconds(s):
    return f"{s * 1e3:9.1f} ms" if s < 10 else f"{s:9.1f} s "


def report(p):
    mesh, mem, t = p["mesh"], p["memory"], p["times"]
    slices = f"slices={mesh['slice']} x " if mesh.get("slice", 1) > 1 else ""
    head = [f"{p['preset']} on {p['devices']} x {p['hardware']}: mesh {slices}dp={mesh['dp']} pp={mesh['pp']} tp={mesh['tp']}"
            f"{' (expert parallel)' if p['expert_parallel'] else ''}, {p['dtype']}, remat {p['remat']}, "
            f"{p['microbatches']} microbatches",
            f"params: {human(p['params_total'])} total, {human(p['params_active'])} active per token"]
    unit, size = memory_unit(p["total_bytes"])

    def mem_str(n):
        return f"{n / size:9.2f} {unit}"

    rows = [("memory per device", "")]
    rows += [("  " + key, mem_str(value)) for key, value in mem.items() if key != "activations"]
    rows.append(("  activations", mem_str(mem["activations"])))
    rows += [("    " + name, mem_str(value)) for name, value in p["activations"].items()]
    rows += [("  total", mem_str(p["total_bytes"]) + f"   of {p['available_bytes'] / GiB:.2f} GiB"), ("", "")]
    rows.append((f"step time (compute at an assumed {p['efficiency']:.0%} of {human(p['peak_flops'])}FLOP/s per device)", ""))
    rows.append((f"  compute: {human(t['executed_flops'])}FLOP executed ({human(t['model_flops'])}FLOP model)"
                 + (f" + Muon's Newton-Schulz {human(t['optimizer_flops'])}FLOP per device" if "optimizer_flops" in t else ""),
                 seconds(t["compute"])))
    if p["mesh"]["pp"] > 1:
        rows.append((f"  pipeline bubble ({p['pipeline']}: {p['bubble_fraction']:.1%} of the table idle)", seconds(t["bubble"])))
    rows += [("  " + name, seconds(value)) for name, value in p["comm"].items()]
    rows.append(("  step, communication not overlapped", seconds(p["step_s_serial"]) + f"   ({p['tokens_per_sec']:,.0f} tokens/s)"))
    rows.append(("  step, communication fully overlapped", seconds(p["step_s_overlapped"])))
    width = max(len(label) for label, value in rows if value) + 2
    lines = head + [""] + [f"{label:<{width}}{value}".rstrip() for label, value in rows] + [""]
    need, have = p["total_bytes"] / GiB, p["available_bytes"] / GiB
    lines.append(f"fits: {need:.2f} GiB needed per device, {have:.2f} available" if p["fits"] else
                 f"will not fit: {need:.2f} GiB needed per device, {have:.2f} available")
    if p["loss_phase_bytes"] > p["total_bytes"] / 4:
        lines.append(f"note: {p['loss_phase_bytes'] / GiB:.2f} GiB of it is the loss: float32 logits of one microbatch "
                     "([batch/(dp x microbatches), T, V/tp], parallel.last_stage_loss_sums); more microbatches shrink it")
    if p["gpu"]:
        lines.append("note: JAX preallocates 75% of GPU memory; XLA_PYTHON_CLIENT_MEM_FRACTION=.95 lets it use more")
    return lines


def split_planner_flags(argv):
    """Pull out the planner's own flags; the rest are main.py's config flags."""
    own, rest, i = {"hardware": "tpu-v5p", "devices": "0", "efficiency": str(DEFAULT_EFFICIENCY), "json": "", "tpu": ""}, [], 0
    while i < len(argv):
        name = argv[i][2:].split("=", 1)[0] if argv[i].startswith("--") else None
        if name in own:
            if "=" in argv[i]:
                own[name] = argv[i].split("=", 1)[1]
            elif i + 1 < len(argv):
                own[name], i = argv[i + 1], i + 1
            else:
                raise ValueError(f"--{name} needs a value")
        else:
            rest.append(argv[i])
        i += 1
    return own, rest


def tpu_check(cfg, tpu_name, p):
    """Compile the train and eval steps for a TPU slice (tpu_compile.py); print the
    compiler's bytes beside the plan's, the collectives, and the contract's last line."""
    pod = tpu_compile.pod_type(tpu_name)
    mesh = par.make_mesh(cfg.mesh, tpu_compile.pod_devices(tpu_name, cfg.mesh.slices))
    compiled = tpu_compile.compile_steps(plan_config(cfg), mesh)
    tpu = tpu_compile.memory_bytes(compiled["train"])
    hbm = HARDWARE[pod.hardware].memory_bytes
    lines = [""] + tpu_compile.memory_report(p, tpu, hbm, pod, compiled["seconds"], compiled["log"]["train"]) + [""]
    for name in ("train", "eval"):
        lines += tpu_compile.collectives_report(tpu_compile.collectives(compiled[name].as_text(), tuple(mesh.shape.values())),
                                                f"{name} step") + [""]
    fits = tpu_compile.fits(tpu, compiled["log"]["train"], hbm)
    lines.append(f"tpu_bytes_per_device={tpu['total']} planner_bytes_per_device={p['total_bytes']} fits={str(fits).lower()}")
    return lines


# ----------------------------------------------------------------------------
# docs/pods.md's table: every preset on the pods people use, planner beside compiler
#
#     python planner.py --table [--presets shakespeare,tiny,moe1b] [--pods v4-8,v4-64,...]

# preset -> pod -> mesh flags (dp, pp, tp, microbatches)
TABLE_MESHES = {
    "shakespeare": {"v4-8": (4, 1, 1, 1), "v4-64": (16, 1, 2, 1), "v5p-64": (16, 1, 2, 1), "v5litepod-16": (16, 1, 1, 1),
                    "v6e-16": (16, 1, 1, 1)},
    "tiny": {"v4-8": (4, 1, 1, 1), "v4-64": (8, 2, 2, 2), "v5p-64": (8, 2, 2, 2), "v5litepod-16": (4, 2, 2, 2),
             "v6e-16": (4, 2, 2, 2)},
    "deepseek_v3": {"v4-8": (4, 1, 1, 1), "v4-64": (16, 1, 2, 1), "v5p-64": (16, 1, 2, 1), "v5litepod-16": (16, 1, 1, 1),
                    "v6e-16": (16, 1, 1, 1)},
    "moe1b": {"v4-8": (1, 2, 2, 4), "v4-64": (8, 2, 2, 4), "v5p-64": (8, 2, 2, 4), "v5litepod-16": (4, 2, 2, 4),
              "v6e-16": (4, 2, 2, 4)},
}


def table_row(preset, pod_name):
    dp, pp, tp, microbatches = TABLE_MESHES[preset][pod_name]
    cfg = plan_config(apply_overrides(apply_overrides(Config(), PRESETS[preset]), {
        "mesh": dict(dp=dp, pp=pp, tp=tp), "train": dict(microbatches=microbatches)}))
    pod = tpu_compile.pod_type(pod_name)
    mesh = par.make_mesh(cfg.mesh, tpu_compile.pod_devices(pod_name))
    compiled = tpu_compile.compile_steps(cfg, mesh, eval_step=False)
    tpu = tpu_compile.memory_bytes(compiled["train"])
    planned = plan(cfg, 0, pod.hardware)
    hbm = HARDWARE[pod.hardware].memory_bytes
    return dict(preset=preset, pod=pod_name, mesh=f"{dp}x{pp}x{tp}", microbatches=microbatches, tpu_bytes=tpu["total"],
                planner_bytes=planned["total_bytes"], fits=tpu_compile.fits(tpu, compiled["log"]["train"], hbm),
                compile_s=compiled["seconds"]["train"],
                tpu=tpu, planner_temp_bytes=planned["temp_bytes"], log=compiled["log"]["train"])


def print_pod_table(argv):
    """`python planner.py --table [--presets P,...] [--pods T,...] [--json PATH]`."""
    args = dict(zip(argv[::2], argv[1::2]))
    presets = args.get("--presets", ",".join(TABLE_MESHES)).split(",")
    pods = args.get("--pods", "v4-8,v4-64,v5p-64,v5litepod-16,v6e-16").split(",")
    print("| preset | pod | dp x pp x tp, microbatches | TPU compiler MiB/device (live) | planner MiB/device | planner / TPU (live) "
          "| fits | train step compile s |")
    print("|---|---|---|---|---|---|---|---|")
    for preset in presets:
        for pod_name in pods:
            r = table_row(preset, pod_name)
            tpu_mib, planner_mib = r["tpu_bytes"] / 2**20, r["planner_bytes"] / 2**20
            tpu_col, ratio_col = f"{tpu_mib:.1f}", f"{planner_mib / tpu_mib:.2f}"
            if r["log"]:  # the total with the live temporaries, the planner's model of them
                live_mib = tpu_compile.live_total(r["tpu"], r["log"]) / 2**20
                tpu_col, ratio_col = f"{tpu_mib:.1f} ({live_mib:.1f})", f"{ratio_col} ({planner_mib / live_mib:.2f})"
            print(f"| {preset} | {pod_name} | {r['mesh'].replace('x', ' x ')}, {r['microbatches']} | {tpu_col} | {planner_mib:.1f} | "
                  f"{ratio_col} | {'yes' if r['fits'] else 'no'} | {r['compile_s']:.0f} |", flush=True)
            if "--json" in args:
                with open(args["--json"], "a") as f:
                    f.write(json.dumps(r) + "\n")


def main(argv):
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        print("--tpu TYPE, known types:\n  " + " ".join(tpu_compile.POD_TYPES))
        print("main.py's flags (python main.py --help) are accepted too.")
        return
    skip_tpu_probe_without_tpu()
    if argv[:1] == ["--table"]:
        return print_pod_table(argv[1:])
    try:
        own, rest = split_planner_flags(argv)
        cfg = parse_args(rest)
        devices, efficiency = int(own["devices"]), float(own["efficiency"])
        if own["tpu"]:
            pod = tpu_compile.pod_type(own["tpu"])
            own["hardware"], devices = pod.hardware, pod.chips * cfg.mesh.slices
        p = plan(cfg, devices, own["hardware"], efficiency)
        tpu_lines = tpu_check(cfg, own["tpu"], p) if own["tpu"] else []
    except (ConfigError, ValueError) as e:
        sys.exit(f"error: {e}")
    print("\n".join(report(p)))
    if not p["fits"] and not tpu_lines:
        fitting = suggestions(cfg, devices, own["hardware"], efficiency, p["peak_flops"])
        if fitting:
            print("try (on the same devices, these fit):")
            for flags, q in fitting[:5]:
                print(f"  {flags:<64} {q['total_bytes'] / GiB:7.2f} GiB per device, step ~{q['step_s_serial']:.3g} s")
        else:
            print("try: more devices (--devices / --mesh.dp), a smaller --train.batch_size or a smaller model")
    if own["json"]:
        with open(own["json"], "w") as f:
            json.dump(p, f, indent=2)
    if tpu_lines:
        print("\n".join(tpu_lines))


if __name__ == "__main__":
    main(sys.argv[1:])
