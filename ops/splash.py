"""Splash attention (--model.attention splash): causal MLA attention through the Pallas
TPU kernel that ships with JAX (jax.experimental.pallas.ops.tpu.splash_attention), as
MaxText and Levanter run it. Shape legend: model.py's docstring.

The kernel is FlashAttention's online softmax over blocks of queries and keys written
for the TPU: it keeps no [T, S] scores for the backward pass (only the log-sum-exp per
query), and the causal mask is known when the kernel is made, so the blocks above the
diagonal are skipped rather than computed and masked (half the score FLOPs at long T).
Off the TPU the same kernel runs in Pallas' interpret mode (plain XLA ops, slow): that
is how the tests on CPU run it.

MLA's score is q_nope . k_nope per head plus q_rope . k_rope with the RoPE key shared by
every head. The kernel takes one query/key head dim, so queries and keys are
concatenated [content | RoPE] (K + R), the shared RoPE key copied to every head:
projected_attention projects them straight into that layout (below).
Values keep their own width K: the kernel takes a value head dim of its own, so they
are neither padded nor split. The kernel applies no softmax scale: it is multiplied
into the queries.

Under context parallelism (ops/context_parallel.py) a rank's queries are its two chunks
and the keys every rank's tokens, gathered rank-major: the keys are put back in sequence
order, and the kernel's causal mask is given the queries' global positions (its
q_sequence, compared in the kernel with each key's index), so the blocks no query of a
chunk can see are skipped as above. The skipped blocks differ from rank to rank and the
kernel is made for one pattern, so each rank's kernel is made once and lax.switch on
the cp rank picks it (cp kernels in the program, one run per call).

Packed rows (ops/packing.py) hand the kernel its segment ids: each query's document and
each key's, in sequence order; it masks the keys of other documents within the blocks it
visits.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash_kernel
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

from ops.blockwise import max_causal_scores, max_joined_scores
from ops.collectives import psum, varying_like
from ops.context_parallel import chunk_positions, gathered_positions
from ops.kernel_calls import interpret_kernels, unchecked

# The kernel's lane width: its key blocks must be multiples of it (utils.validate_model).
SPLASH_LANES = splash_kernel.NUM_LANES


def splash_block(block, T):
    """The kernel's query and key block: --model.attention_block, cut to T."""
    return min(block, T)


@functools.cache
def causal_attention(T, H, block, interpret, cp=1, rank=0):
    """Splash attention over rows [B, H, Tq, W] of queries and [B, H, T, W] of keys,
    [B, H, T, K] of values (keys in sequence order), causal, blocks of `block` in the
    forward and both backward kernels: a function (q, k, v) -> out [B, H, Tq, K], made
    once per shape (making the kernel reads the mask block by block on the host). The
    queries are the whole sequence (Tq = T) or, with cp > 1, cp rank `rank`'s two chunks.

    Why not the kernel object itself: its outputs come out of pallas_call typed as the
    same on every device, which shard_map's type check (check_vma, parallel/steps.py)
    refuses inside the step, and a pcast to "varying" after it would transpose to a psum
    of the cotangents. So the kernel's own forward and backward (its custom_vjp's two
    halves, private to the pinned JAX) run with the check off (blockwise.
    unchecked: a nested shard_map with check_vma=False), and this function's
    custom_vjp types the outputs as varying like its inputs, as they are.
    """
    sizes = splash_kernel.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                                     block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                                     block_q_dq=block, block_kv_dq=block)
    q_pos_T = chunk_positions(T, cp, rank, np) if cp > 1 else np.arange(T)
    causal = splash_mask.CausalMask((len(q_pos_T), T))
    causal.q_sequence = q_pos_T.astype(np.int32)  # each query row's position, the keys' being their index
    mask = splash_mask.MultiHeadMask([causal] * H)
    with jax.ensure_compile_time_eval():  # concrete mask arrays, not the tracers of the trace that first asks (cached)
        kernel = splash_kernel.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)
    # (as the kernel's call does: the partial mask blocks with their leading dims in one)
    infos = [info if info is None or info.partial_mask_blocks is None else
             info._replace(partial_mask_blocks=info.partial_mask_blocks.reshape(-1, block, block))
             for info in (kernel.fwd_mask_info, kernel.dq_mask_info, kernel.dkv_mask_info)]
    options = {name: kernel.kwargs[name] for name in ("save_residuals", "mask_value", "is_mqa", "block_sizes",
                                                      "residual_checkpoint_name", "mask_function",
                                                      "attn_logits_soft_cap", "interpret")}

    def forward_row(q_HTW, k_HTW, v_HTK, segments):
        out_HTK, residuals = splash_kernel._splash_attention_fwd(*infos, q_HTW, k_HTW, v_HTK, segments, None, **options)
        return out_HTK, residuals[6]  # and the log-sum-exp per query

    def backward_row(q_HTW, k_HTW, v_HTK, segments, out_HTK, lse_HT, d_out_HTK):
        residuals = (q_HTW, k_HTW, v_HTK, segments, None, out_HTK, lse_HT, infos[1], infos[2])
        return splash_kernel._splash_attention_bwd(*options.values(), residuals, d_out_HTK)[3:6]

    @jax.custom_vjp
    def attention(q_BHTW, k_BHTW, v_BHTK, segments=None):
        """segments: a SegmentIds of [B, Tq] and [B, T] document ids (packed rows), or None."""
        return attention_forward(q_BHTW, k_BHTW, v_BHTK, segments)[0]

    def attention_forward(q_BHTW, k_BHTW, v_BHTK, segments=None):
        out_BHTK, lse_BHT = unchecked(jax.vmap(forward_row), q_BHTW, k_BHTW, v_BHTK, segments)
        out_BHTK = varying_like(out_BHTK, q_BHTW, k_BHTW, v_BHTK)
        return out_BHTK, (q_BHTW, k_BHTW, v_BHTK, segments, out_BHTK, lse_BHT)

    def attention_backward(residuals, d_out_BHTK):
        grads = unchecked(jax.vmap(backward_row), *residuals, d_out_BHTK)
        return (*(varying_like(g, x) for g, x in zip(grads, residuals[:3])), None)

    attention.defvjp(attention_forward, attention_backward)
    return attention


def splash_attention(q_nope_BTHK, q_rope_BTHR, k_nope_BSHK, k_rope_BSR, v_BSHK, q_pos_T, scale, block, chunks=None,
                     segments_bT=None):
    """(causal softmax(scale (q_nope . k_nope + q_rope . k_rope)) v: out [B, T, H, K], each
    head's largest scaled score [H], float32), from projections in the model's [B, T, H, *]
    layout (--model.quant's path: projected_attention's otherwise). Queries and keys are
    the same T positions, or (chunks: context parallelism's SequenceChunks) this cp rank's
    chunks at global positions q_pos_T against every rank's tokens gathered rank-major
    (context_parallel.gathered_positions). `block`, cut to T (under cp to a chunk), must
    divide it and be a multiple of SPLASH_LANES (utils.validate_model). Under tp each
    device passes its own heads: the kernel is made for the local head count.
    segments_bT: packed rows' document ids [B, S] in sequence order, or None."""
    H, R = q_nope_BTHK.shape[2], q_rope_BTHR.shape[-1]
    q_BHTW = (jnp.concatenate([q_nope_BTHK, q_rope_BTHR], axis=-1) * scale).astype(q_nope_BTHK.dtype).transpose(0, 2, 1, 3)
    k_rope_BSHR = jnp.broadcast_to(k_rope_BSR[:, :, None, :], k_rope_BSR.shape[:2] + (H, R)).astype(k_nope_BSHK.dtype)
    k_BHSW = jnp.concatenate([k_nope_BSHK, k_rope_BSHR], axis=-1).transpose(0, 2, 1, 3)
    out_BHTK, max_logit_H = heads_major_attention(q_BHTW, k_BHSW, v_BSHK.transpose(0, 2, 1, 3), q_pos_T, block, chunks, segments_bT)
    return out_BHTK.transpose(0, 2, 1, 3), max_logit_H


def heads_major_attention(q_BHTW, k_BHSW, v_BHSK, q_pos_T, block, chunks=None, segments_bT=None):
    """The kernel on its own layout: (out [B, H, T, K], each head's largest score [H],
    float32), queries already scaled; arguments as splash_attention's. The largest scores
    are the kernel's operands' (blockwise.max_joined_scores; max_causal_scores without cp
    or packed rows), read under stop_gradient."""
    H, T, S = q_BHTW.shape[1], q_BHTW.shape[2], k_BHSW.shape[2]
    interpret, cp_axis = interpret_kernels(), None if chunks is None else chunks.axis
    segments = None if segments_bT is None else (segments_bT[:, q_pos_T], segments_bT)  # the queries' and the keys' documents
    kernel_segments = None if segments is None else splash_kernel.SegmentIds(*segments)
    if cp_axis is None:
        out_BHTK = causal_attention(S, H, splash_block(block, S), interpret)(q_BHTW, k_BHSW, v_BHSK, kernel_segments)
    else:
        cp = jax.lax.axis_size(cp_axis)
        in_order_S = np.argsort(gathered_positions(S, cp))  # the gathered keys back in sequence order
        k_BHSW, v_BHSK = k_BHSW[:, :, in_order_S], v_BHSK[:, :, in_order_S]
        kernels = [causal_attention(S, H, splash_block(block, S // (2 * cp)), interpret, cp, rank) for rank in range(cp)]
        out_BHTK = jax.lax.switch(jax.lax.axis_index(cp_axis), kernels, q_BHTW, k_BHSW, v_BHSK, kernel_segments)
    q_BHTW, k_BHSW = jax.lax.stop_gradient((q_BHTW, k_BHSW))
    if cp_axis is None and segments is None:
        return out_BHTK, max_causal_scores(q_BHTW, k_BHSW, splash_block(block, T))
    return out_BHTK, max_joined_scores(q_BHTW, k_BHSW, q_pos_T, jnp.arange(S), splash_block(block, T), segments)


# ---- MLA's operands projected into the kernel's layout
# The kernel takes [B, H, T, K + R] queries and keys. Projected in the model's [B, T, H, *]
# layout, split into content and RoPE parts, they are concatenated, broadcast and
# transposed on the way in, and the backward undoes each step: on a TPU those relayouts
# of 64-lane halves cost more than the projections (docs/pods.md). Here every operand
# comes out of one matmul that writes the kernel's layout:
# - queries: one projection by [content | RoPE] weights [Q, H, K + R], and each lane's
#   rotation partner (x_2i+1 for lane 2i, x_2i for lane 2i+1) by a permutation matmul on
#   the heads' lanes (exact: one product by 1 per lane; a second projection by
#   pair-swapped weights costs Q / (K + R) times its FLOPs, 11x at DeepSeek-V2-Lite's
#   full-rank queries): the rotation is then elementwise, lanes < K at angle 0
#   (unrotated), with the softmax scale folded in;
# - keys: [latent | RoPE key] [B, S, A + R] times [[W_uk, 0], [0, I]] [A + R, H, K + R],
#   the identity copying the shared RoPE key into every head (exactly: one product by 1
#   per lane), its backward summing the heads' RoPE gradients in the same matmul;
# - values and the output projection: einsums over the head-major axes.


def rope_lane_tables(angles_BTR2, rope_scale, K):
    """(own, partner) [B, 1, T, K + R]: each lane's coefficient of itself and of its pair
    partner (lane 2i: cos, -sin; lane 2i+1: cos, sin), lanes < K at angle 0 (1 and 0):
    the products and sums of model.apply_rope."""
    cos, sin = jnp.cos(angles_BTR2) * rope_scale, jnp.sin(angles_BTR2) * rope_scale
    content = [(0, 0)] * (cos.ndim - 1) + [(K // 2, 0)]
    cos, sin = jnp.pad(cos, content, constant_values=1.0), jnp.pad(sin, content)
    return [jnp.stack(pair, axis=-1).reshape(cos.shape[:-1] + (-1,))[:, None] for pair in ((cos, cos), (-sin, sin))]


def into_heads(x_BTI, w_IHW):
    """x [B, T, I] @ w [I, H, W] -> [B, H, T, W], accumulated in float32, in x's dtype."""
    return jnp.einsum("bti,ihw->bhtw", x_BTI, w_IHW.astype(x_BTI.dtype), preferred_element_type=jnp.float32).astype(x_BTI.dtype)


def projected_attention(attn, x_BTD, angles, chunks=None, segments_bT=None, tp=None):
    """model.MLAttention.with_max_logits through the kernel (--model.attention splash, no
    --model.quant), from x [B, T, D] through the output projection and its psum over the
    tp axis: (y [B, T, D], each local head's largest scaled score [H], float32). chunks:
    context parallelism's SequenceChunks (angles then this rank's), or None; segments_bT:
    packed rows' document ids [B, T], or None. The matmul attention's result up to the
    order of float32 sums (tests/test_splash_attention.py)."""
    if attn.full_rank_queries:
        source_BTQ, w_content, w_rope = x_BTD, attn.wq_DHK[...], attn.wq_rope_DHR[...]
    else:
        source_BTQ = attn.q_norm(attn.project(x_BTD, attn.wq_down_DQ[...]))
        w_content, w_rope = attn.wq_up_QHK[...], attn.wq_rope_QHR[...]
    K, W = w_content.shape[-1], w_content.shape[-1] + w_rope.shape[-1]
    w_QHW = jnp.concatenate([w_content, w_rope], axis=-1)
    q_BHTW = into_heads(source_BTQ, w_QHW)
    partner_BHTW = jnp.matmul(q_BHTW, jnp.eye(W, dtype=q_BHTW.dtype)[np.arange(W) ^ 1], preferred_element_type=jnp.float32)
    q_BHTW = q_BHTW.astype(jnp.float32)
    own_B1TW, partners_B1TW = rope_lane_tables(angles, attn.rope_scale, K)
    q_BHTW = ((q_BHTW * own_B1TW + partner_BHTW * partners_B1TW) * attn.softmax_scale).astype(x_BTD.dtype)

    kv_BSA, k_rope_BSR = attn.latents(x_BTD, angles)
    q_pos_T = jnp.arange(x_BTD.shape[1])
    if chunks is not None:  # the latent crosses cp, not keys and values
        (kv_BSA, k_rope_BSR), q_pos_T = chunks.gather(kv_BSA, k_rope_BSR), chunks.q_pos_T
    w_up_AHK = attn.wk_up_AHK[...]
    (A, H, _), R = w_up_AHK.shape, k_rope_BSR.shape[-1]
    w_k_XHW = jnp.concatenate([jnp.concatenate([w_up_AHK, jnp.zeros((A, H, R), w_up_AHK.dtype)], axis=-1),
                               jnp.broadcast_to(jnp.eye(W, dtype=w_up_AHK.dtype)[K:, None, :], (R, H, W))], axis=0)
    k_BHSW = into_heads(jnp.concatenate([kv_BSA, k_rope_BSR.astype(kv_BSA.dtype)], axis=-1), w_k_XHW)
    v_BHSK = into_heads(kv_BSA, attn.wv_up_AHK[...])
    out_BHTK, max_logit_H = heads_major_attention(q_BHTW, k_BHSW, v_BHSK, q_pos_T, attn.block, chunks, segments_bT)
    w_HKD = attn.wo_HKD[...].astype(out_BHTK.dtype)
    y_BTD = jnp.einsum("bhtk,hkd->btd", out_BHTK, w_HKD, preferred_element_type=jnp.float32).astype(x_BTD.dtype)
    return psum(y_BTD, tp), max_logit_H
