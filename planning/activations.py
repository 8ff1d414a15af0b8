"""The planner's model of activations: what the backward pass of a train step keeps
per device, by remat policy and pipeline schedule (planning/costs.py adds the weights,
gradients and optimizer state, and the step time).

Shapes only, no arrays: the per-token tensors of model.py's layers on one device, and
the tables of the hand-written schedules (parallel/schedules.py).
"""

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from model import expert_capacity, padded_vocab
from parallel import rules
from parallel import schedules as pipeline
from utils import SPLASH_LANES

F32 = 4  # bytes of float32: master weights, optimizer moments, softmax/norm internals, logits (planner_model too)


# ---- Activations: what the backward pass keeps, from the model's tensors (model.py).
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
    T: int  # tokens of a sequence on this device: all of them, or under cp its 2 chunks (T / cp)
    Tk: int  # keys each query meets: the whole sequence (under cp gathered over it)
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
    block: int = 0  # blockwise attention's block (0: matmul attention, all scores at once)
    splash: bool = False  # splash attention (ops/splash.py): its scores stay inside the kernel


def norm_bytes(width):
    """RMSNorm keeps its input in float32, the normalised float32 value and two per-row
    statistics."""
    return 2 * width * F32 + 2 * F32


def attention_bytes(s):
    """MLAttention.__call__, per token of this device. Under cp the keys' side (the
    gathered latent, k_nope, the RoPE key, v) is the whole sequence's: kv = cp of it per
    token here (ops/context_parallel.py)."""
    kv = s.Tk // s.T
    latent_q = norm_bytes(s.Q) + s.Q * s.c if s.Q else s.D * s.c  # q_norm internals, q_BTQ; full-rank: a 4th user of x
    # matmul: none of its scores (under jax.checkpoint the backward takes them again: model.py);
    # blockwise keeps only the log-sum-exp (float32) of each query and head: its blocks live inside its loops
    scores = 0 if not s.block else s.H * F32
    if s.splash:
        scores = splash_residual_bytes(s)
    return (norm_bytes(s.D) + 3 * s.D * s.c  # attn_norm; its output, kept by each of the 3 down-projections
            + latent_q
            + norm_bytes(s.A) + s.A * s.c * kv  # kv latent: kv_norm internals, kv_BSA (under cp: gathered)
            + s.H * s.K * s.c + s.H * s.K * s.c * kv + s.H * s.R * s.c + s.R * s.c * kv  # q_nope, k_nope, q_rope, k_rope
            + scores
            + s.H * s.K * s.c * kv + s.H * s.K * s.c)  # v_BSHK, out_BTHK


def splash_residual_bytes(s):
    """What splash attention keeps per token of this device beyond attention_bytes' own:
    no [T, S] scores; the log-sum-exp of each query and head (float32, which the kernel
    writes across its 128 lanes: [B, H, T, 128] in the compiled step) and the kernel's
    [nope | rope] queries and keys (the shared RoPE key copied to every head; under cp
    the keys of the whole sequence)."""
    return s.H * SPLASH_LANES * F32 + s.H * (s.K + s.R) * s.c * (1 + s.Tk // s.T)


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
    """What remat block_dots keeps of a layer, per token: every matmul's output (matmul
    attention's score products too: the compiled step keeps them under its checkpoint), in
    float32 (model.project accumulates in float32 and casts after; on TPU the cast is
    fused into the matmul: itemsize = the compute dtype's)."""
    kv = s.Tk // s.T  # under cp: keys and values up-projected from the whole sequence's latent
    scores = 2 * s.H * s.Tk if not (s.block or s.splash) else 0  # blockwise: one block of them at a time, inside its loops
    attention = (s.Q + s.H * s.K + s.H * s.R + s.A + s.R + 2 * s.H * s.K * kv  # down, up and RoPE projections
                 + scores + s.H * s.K + s.D)  # two score products, probs x values, output projection
    if kind == "M":
        ffn = s.E + s.E * s.C / s.S * (2 * s.Fe + s.D) + (2 * s.Fs + s.D if m.n_shared else 0)  # router, experts, shared
    else:
        ffn = (2 * s.F if m.ffn_activation == "swiglu" else s.F) + s.D
    return (attention + ffn) * itemsize


def local_sizes(cfg, mesh_shape, compute_bytes=None):
    m, t = cfg.model, cfg.train
    dp, tp, cp = mesh_shape["dp"], mesh_shape["tp"], mesh_shape.get("cp", 1)
    S = min(m.routing_group or m.seq_len, m.seq_len)
    C = expert_capacity(S, m.top_k, m.n_experts, m.capacity_factor) if m.capacity_factor > 0 else math.ceil(S * m.top_k / m.n_experts)
    T = m.seq_len // cp  # everything per token runs on this rank's 2 chunks (ops/context_parallel.py)
    return Local(b=t.batch_size // (dp * t.microbatches), T=T, Tk=m.seq_len, D=m.d_model, H=m.n_heads // tp, K=m.head_dim,
                 R=m.rope_dim, Q=m.q_latent, A=m.kv_latent, F=m.d_ff // tp, Fe=m.d_expert // tp,
                 Fs=m.n_shared * m.d_expert // tp, E=m.n_experts, X=m.top_k, S=S, C=C,
                 V=padded_vocab(m.vocab_size, m.vocab_multiple) // tp,
                 c=compute_bytes or (2 if m.dtype == "bfloat16" else 4),
                 block=min(m.attention_block, T) if m.attention == "blockwise" else 0, splash=m.attention == "splash")


def accumulates(cfg, pp):
    """Does the step run executor_accumulate on `pp` stages? (The step's rule, asked.)"""
    return rules.executor_name(cfg, pp) == rules.ACCUMULATE


def pipeline_loops(cfg, pp):
    """(ticks, blocks per stage): GPipe's loop runs M + pp - 1 ticks, and at every tick
    each stage loops over its n_blocks / pp blocks."""
    return cfg.train.microbatches + pp - 1, cfg.model.n_blocks // pp


# Fraction of one block's intermediates that the backward pass of a block holds at
# once on top of what was saved: the cotangents of the block's tensors, freed as the
# backward pass walks back through its model. Measured on CPU (XLA memory_analysis,
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


# Blockwise attention (ops/blockwise.py) on TPU, per token of this device, with kv =
# cp keys per token: what the live-range dump of the compiled step (T = 32768, cp 8, v5p)
# holds at the peak of a recomputed block's backward pass beside the matmul outputs (the
# key blocks of every layer, 96 MiB each for the full moe1b, are its largest buffers).
def blockwise_keys_bytes(s):
    """Each attention layer's keys and values copied into key blocks [S/block, B, H, s, K]
    (and the RoPE key's), kept from the recomputed forward for its backward."""
    return (2 * s.H * s.K + s.R) * s.c * s.Tk // s.T


def blockwise_backward_bytes(s):
    """One layer's hand-written backward: the keys' and values' gradients of every key
    block stacked in float32, and every query block's gradient carried in float32."""
    return (2 * s.H * s.K + s.R) * F32 * s.Tk // s.T + s.H * (s.K + s.R) * F32


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
        layers = len(m.block_pattern)
        return tokens * (sum(matmul_output_bytes(s, kind, m, itemsize=s.c) for kind in m.block_pattern)
                         + (layers * blockwise_keys_bytes(s) + blockwise_backward_bytes(s) if s.block else 0))
    per_block = tokens * sum(layer_bytes(s, kind, m) for kind in m.block_pattern)
    return SPLIT_MESH_RECOMPUTE_FRACTION * per_block if math.prod(mesh_shape.values()) > 1 else per_block


# The float32 [rows, V/tp] arrays each compiler holds at the loss's peak. The TPU compiler
# recomputes the logits inside the fusion that writes their gradient (moe1b's step at dp 8 x
# pp 2 x tp 2 on a v4-64 holds one [8, 1024, 50176]). XLA:CPU holds three: the logits' exps,
# and their gradient twice, the loss's elementwise gradient fused into each of the output
# layer's matmuls, once transposed for its weights'. XLA:GPU: the logits and their gradient
# (not measured here).
LOSS_ARRAYS = {"tpu": (1, "float32 logits' gradient (the logits fused into it)"), "cpu": (3, "float32 exps + their gradient, twice"),
               "gpu": (2, "float32 logits + their gradient")}


def loss_phase(s, rows, compiler):
    """{name: bytes} of the loss of one microbatch of `rows` tokens: `compiler`'s LOSS_ARRAYS float32
    [rows, V/tp] arrays of the logits and their gradient, and the normed input."""
    count, what = LOSS_ARRAYS[compiler]
    return {f"loss: {what}": count * rows * s.V * F32 + rows * (norm_bytes(s.D) + s.D * s.c)}


def activation_bytes(cfg, mesh_shape, compute_bytes=None, compiler="cpu"):
    """{component: bytes} of activations at the peak of the train step, per device.

    GPipe here runs M + pp - 1 ticks and every stage computes at every tick (bubble
    ticks on zeros), so the backward pass keeps M + pp - 1 ticks' worth:
      remat none: every intermediate of every local block, per tick;
      remat block_dots: every matmul output of every local block, per tick;
      remat layer / block: each local layer's / block's input per tick;
      remat stage: the stage's input per tick.
    On top of that, the peak is the larger of two phases, which never overlap:
      loss: float32 logits [b, T, V/tp] of one microbatch and their gradient
        (parallel.last_stage_loss_sums recomputes them per microbatch), as many
        float32 [b, T, V/tp] arrays as `compiler` keeps (LOSS_ARRAYS);
      block backward: remat block and layer recompute one block (its intermediates; XLA
        recomputes all of a block's layers together), stage all of a tick's blocks;
        remat none and block_dots work through one block's cotangents
        (BACKWARD_WORKING_FRACTION of a block).
        With both loops real (ticks > 1 and several local blocks), remat none also
        holds one tick's intermediates twice: the inner loop over blocks writes them
        into its own stacked buffer, which is then copied into the per-tick stack.
    """
    if cfg.train.pipeline != "gpipe":
        return scheduled_activation_bytes(cfg, mesh_shape, compute_bytes, compiler)
    m, t = cfg.model, cfg.train
    pp = mesh_shape["pp"]
    s = local_sizes(cfg, mesh_shape, compute_bytes)
    ticks, blocks_here = pipeline_loops(cfg, pp)
    # Accumulation (parallel/accumulate.py: pp = 1, M > 1) runs each microbatch's forward
    # and backward before the next: one microbatch's activations are alive, as at M = 1.
    held = 1 if accumulates(cfg, pp) else t.microbatches
    if accumulates(cfg, pp):
        ticks = 1
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
        recomputed_block = recomputed_block_bytes(cfg, mesh_shape, s, fused=compiler == "tpu")
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
    out["pipeline buffers (embedded inputs, stage outputs)"] = (held + ticks) * x_bytes
    if m.first_dense:  # stage 0 runs every microbatch through the prefix before the loop; kept as a block's layers are
        kept = {"none": layer_bytes(s, "D", m), "block_dots": matmul_output_bytes(s, "D", m)}.get(m.remat, s.D * s.c)
        out[f"dense prefix (stage 0): {m.first_dense} layer(s), every microbatch"] = held * m.first_dense * tokens * kept
    rows = tokens  # the loss takes one microbatch at a time
    phases = {**loss_phase(s, rows, compiler),
              "backward through one " + ("stage" if m.remat == "stage" else "block")
        + (" (+ a copy of one tick's)" if m.remat in ("none", "block_dots") and ticks > 1 and blocks_here > 1 else ""): block_phase}
    peak = max(phases, key=phases.get)
    out["peak of two phases: " + peak] = phases[peak]
    return out, phases


# ---- The hand-written schedules (--train.pipeline 1f1b | interleaved, parallel/schedules.py)


def schedule_of(cfg, pp):
    return cached_schedule(cfg.train.pipeline, pp, cfg.train.microbatches, cfg.train.virtual_stages)


@lru_cache(maxsize=1024)
def cached_schedule(kind, pp, microbatches, virtual_stages):
    """pipeline.schedule, once per (kind, pp, M, V): the search asks for each many times."""
    return pipeline.schedule(kind, pp, microbatches, virtual_stages)


def scheduled_activation_bytes(cfg, mesh_shape, compute_bytes=None, compiler="cpu"):
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
    if sched.kind in SPLIT_BACKWARD:  # zb1 / zbv: B keeps each block's output gradient for W (the executor's gys ring)
        out[f"zero bubble: each block's output gradient from B until W, {sched.res_slots} slots"] = sched.res_slots * blocks_per_chunk * x_bytes
    recomputed_block = recomputed_block_bytes(cfg, mesh_shape, s, fused=compiler == "tpu")
    block_phase = blocks_per_chunk * per_block if m.remat == "stage" else recomputed_block
    phases = {**loss_phase(s, tokens, compiler),
              "backward tick of one " + ("chunk" if m.remat == "stage" else "block") + " (recomputed)": block_phase}
    if m.first_dense:  # stage 0's first backward tick also recomputes the dense prefix and walks back through it
        phases["backward tick of the dense prefix (recomputed)"] = block_phase + tokens * m.first_dense * layer_bytes(s, "D", m)
    peak = max(phases, key=phases.get)
    out["peak of two phases: " + peak] = phases[peak]
    return out, phases


# Cost of a backward tick in forward passes of the same chunk: the backward itself (2)
# and the forward it recomputes from the saved input (1).
BACKWARD_TICK_COST = 3
# zb1 / zbv split it: B (the input gradient) and W (the weights') each recompute the
# forward from the stash and run their half of the vjp, 2 forwards each: W's extra work
# is the recompute done again (1 forward of the chunk per microbatch).
SPLIT_BACKWARD = ("zb1", "zbv")
HALF_TICK_COST = (BACKWARD_TICK_COST - 2) + 1


def scheduled_bubble_factor(cfg, pp):
    """Lockstep time of the table over the useful work, minus one. All stages wait for
    each other at every tick (the ppermutes), so a tick lasts as long as its slowest
    op: a tick where one stage runs a backward costs a backward for all of them."""
    sched = schedule_of(cfg, pp)
    # zb1 / zbv: B and W, each HALF_TICK_COST (their sum above a whole backward: W's recompute)
    halves = HALF_TICK_COST if sched.kind in SPLIT_BACKWARD else BACKWARD_TICK_COST
    cost = np.array([0, 1, halves, halves])[sched.table[..., 0]]  # [ticks, pp]
    useful = cfg.train.microbatches * sched.virtual_stages * (1 + BACKWARD_TICK_COST)
    return float(cost.max(axis=1).sum()) / useful - 1
