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
concatenated [content | RoPE] (K + R), the shared RoPE key copied to every head.
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

from ops.blockwise import max_joined_scores
from ops.collectives import varying_like
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


def splash_attention(q_nope_BTHK, q_rope_BTHR, k_nope_BSHK, k_rope_BSR, v_BSHK, q_pos_T, scale, block, cp_axis=None,
                     segments=None):
    """(causal softmax(scale (q_nope . k_nope + q_rope . k_rope)) v: out [B, T, H, K], each
    head's largest scaled score [H], float32). Queries and keys are the same T positions,
    or (cp_axis given) this cp rank's chunks at global positions q_pos_T against every
    rank's tokens gathered rank-major (context_parallel.gathered_positions).
    `block`, cut to T (under cp to a chunk), must divide it and be a multiple of
    SPLASH_LANES (utils.validate_model). Under tp each device passes its own heads: the
    kernel is made for the local head count. segments: packed rows' document ids (queries
    [B, T], keys [B, S] in sequence order), or None. The largest scores are the kernel's
    operands' (blockwise.max_joined_scores), read under stop_gradient."""
    B, T, H, K = q_nope_BTHK.shape
    S, R = k_nope_BSHK.shape[1], q_rope_BTHR.shape[-1]
    q_BHTW = (jnp.concatenate([q_nope_BTHK, q_rope_BTHR], axis=-1) * scale).astype(q_nope_BTHK.dtype).transpose(0, 2, 1, 3)
    k_rope_BSHR = jnp.broadcast_to(k_rope_BSR[:, :, None, :], k_rope_BSR.shape[:2] + (H, R)).astype(k_nope_BSHK.dtype)
    k_BHSW = jnp.concatenate([k_nope_BSHK, k_rope_BSHR], axis=-1).transpose(0, 2, 1, 3)
    v_BHSK = v_BSHK.transpose(0, 2, 1, 3)
    interpret = interpret_kernels()
    kernel_segments = None if segments is None else splash_kernel.SegmentIds(*segments)
    if cp_axis is None:
        out_BHTK = causal_attention(S, H, splash_block(block, S), interpret)(q_BHTW, k_BHSW, v_BHSK, kernel_segments)
    else:
        cp = jax.lax.axis_size(cp_axis)
        in_order_S = np.argsort(gathered_positions(S, cp))  # the gathered keys back in sequence order
        k_BHSW, v_BHSK = k_BHSW[:, :, in_order_S], v_BHSK[:, :, in_order_S]
        kernels = [causal_attention(S, H, splash_block(block, S // (2 * cp)), interpret, cp, rank) for rank in range(cp)]
        out_BHTK = jax.lax.switch(jax.lax.axis_index(cp_axis), kernels, q_BHTW, k_BHSW, v_BHSK, kernel_segments)
    max_logit_H = max_joined_scores(*jax.lax.stop_gradient((q_BHTW, k_BHSW)), q_pos_T, jnp.arange(S),
                                    splash_block(block, T), segments)
    return out_BHTK.transpose(0, 2, 1, 3), max_logit_H
