"""Attention: rotary position embeddings (optionally YaRN-scaled) and Multi-head Latent
Attention (MLA) with its latent KV cache. Shape legend: model.py's docstring.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import quant
from blockwise_attention import blockwise_attention_and_max_logits, max_logits
from context_parallel import SequenceChunks
from layers import ACC_DTYPE, RMSNorm, init_normal, project, psum_if, residual_scale
from splash_attention import splash_attention

# ----------------------------------------------------------------------------
# Rotary position embeddings


def rope_angles(positions_BT, cfg):
    """Rotation angles [B, T, R/2] for rotary embeddings (Su et al. 2021), with the
    frequencies of cfg.rope_scaling (rope_frequencies).

    The only place angles are made: the step's prologue, the plain forward and decoding
    all call it, and it is applied to queries *and* keys, so the two can never use
    different frequencies; the score then depends only on relative position.
    """
    return positions_BT.astype(jnp.float32)[..., None] * rope_frequencies(cfg)


def rope_frequencies(cfg):
    """Inverse frequencies [R/2] of the RoPE pairs: theta^(-2i/R), or YaRN's."""
    if cfg.rope_scaling == "yarn":
        return jnp.asarray(yarn_frequencies(cfg), jnp.float32)
    return cfg.rope_theta ** (-jnp.arange(0, cfg.rope_dim, 2, dtype=jnp.float32) / cfg.rope_dim)


# YaRN (Peng et al. 2023, arXiv:2309.00071), as DeepSeek-V2/V3 and transformers
# (modeling_rope_utils._compute_yarn_parameters) define it. A model trained on
# rope_original_len positions runs on rope_factor x as many: pairs that turn fewer
# than beta_slow times over the original context are interpolated (frequency /
# factor: positions squeezed back into the range they were trained on), pairs that
# turn more than beta_fast times keep their frequency (they only ever saw relative
# offsets, which do not change), and the pairs between ramp linearly from one to the
# other. Two scale corrections come with it: the RoPE part of queries and keys is
# multiplied by yarn_attention_factor (transformers multiplies cos and sin), and the
# softmax scale by yarn_mscale(factor, mscale_all_dim)^2 (attention_softmax_scale).


def yarn_mscale(factor, mscale=1.0):
    """YaRN's attention temperature, 0.1 mscale ln(factor) + 1 (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_frequencies(cfg):
    """YaRN's inverse frequencies [R/2] (numpy float64, cast by the caller)."""
    R, base = cfg.rope_dim, cfg.rope_theta

    def pair_turning(rotations):  # the (fractional) pair index that turns `rotations` times over the original context
        return R * math.log(cfg.rope_original_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    # transformers' default truncate=True: the ramp's ends are whole pairs
    low = max(math.floor(pair_turning(cfg.yarn_beta_fast)), 0)
    high = min(math.ceil(pair_turning(cfg.yarn_beta_slow)), R - 1)
    if low == high:
        high += 0.001  # (transformers': no division by zero)
    interpolated_R2 = np.clip((np.arange(R // 2) - low) / (high - low), 0, 1)  # 0: keep the frequency, 1: divide it by factor
    inv_freq_R2 = 1.0 / base ** (np.arange(0, R, 2) / R)
    return inv_freq_R2 / cfg.rope_factor * interpolated_R2 + inv_freq_R2 * (1 - interpolated_R2)


def yarn_attention_factor(cfg):
    """What multiplies the rotated RoPE parts of queries and keys (1 without YaRN):
    transformers' attention_factor, mscale(factor, mscale) / mscale(factor, mscale_all_dim)
    when both are set (DeepSeek-V3: 1 / 1, so 1), else mscale(factor)."""
    if cfg.rope_scaling != "yarn":
        return 1.0
    if cfg.yarn_mscale and cfg.yarn_mscale_all_dim:
        return yarn_mscale(cfg.rope_factor, cfg.yarn_mscale) / yarn_mscale(cfg.rope_factor, cfg.yarn_mscale_all_dim)
    return yarn_mscale(cfg.rope_factor)


def attention_softmax_scale(cfg):
    """1/sqrt(K + R), times mscale(factor, mscale_all_dim)^2 under YaRN with
    mscale_all_dim set (DeepSeek's correction: longer contexts want sharper softmaxes)."""
    scale = 1.0 / math.sqrt(cfg.head_dim + cfg.rope_dim)
    if cfg.rope_scaling == "yarn" and cfg.yarn_mscale_all_dim:
        scale *= yarn_mscale(cfg.rope_factor, cfg.yarn_mscale_all_dim) ** 2
    return scale


def apply_rope(x_BTxR, angles_BTR2, scale=1.0):
    """Rotate pairs (x[2i], x[2i+1]) by angle[i]; x may have a head axis before R.
    scale: yarn_attention_factor, on cos and sin (as transformers applies it)."""
    if x_BTxR.ndim == 4:  # [B, T, H, R]: the same angle for every head
        angles_BTR2 = angles_BTR2[:, :, None, :]
    cos, sin = jnp.cos(angles_BTR2), jnp.sin(angles_BTR2)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    x = x_BTxR.astype(jnp.float32)
    x_even, x_odd = x[..., 0::2], x[..., 1::2]
    rotated = jnp.stack([x_even * cos - x_odd * sin, x_even * sin + x_odd * cos], axis=-1)
    return rotated.reshape(x.shape).astype(x_BTxR.dtype)


# ----------------------------------------------------------------------------
# Multi-head Latent Attention (DeepSeek-V2, arXiv:2405.04434, section 2.1)
#
# Keys and values are up-projected from a small latent c_kv [A]; a separate RoPE key
# [R] is shared by all heads ("decoupled RoPE"), because a rotation cannot be folded
# into the latent's up-projection. The KV cache therefore holds only A + R numbers per
# token instead of 2 * H * K.


class MLAttention(nnx.Module):
    def __init__(self, cfg, rngs):
        D, H, K, R, Q, A = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.rope_dim, cfg.q_latent, cfg.kv_latent
        self.full_rank_queries = Q == 0
        # The latent norms keep eps 1e-6 whatever --model.norm_eps says: DeepSeek's
        # q_a_layernorm / kv_a_layernorm (and transformers') ignore rms_norm_eps.
        if Q:  # queries through their own latent (DeepSeek-V3)
            self.wq_down_DQ = init_normal(rngs, (D, Q), D)
            self.q_norm = RMSNorm(Q)
            self.wq_up_QHK = init_normal(rngs, (Q, H, K), Q)
            self.wq_rope_QHR = init_normal(rngs, (Q, H, R), Q)
        else:  # full-rank queries straight from x (DeepSeek-V2-Lite, Moonlight: q_lora_rank null)
            self.wq_DHK = init_normal(rngs, (D, H, K), D)
            self.wq_rope_DHR = init_normal(rngs, (D, H, R), D)
        self.wkv_down_DA = init_normal(rngs, (D, A), D)
        self.kv_norm = RMSNorm(A)
        self.wk_rope_DR = init_normal(rngs, (D, R), D)
        self.wk_up_AHK = init_normal(rngs, (A, H, K), A)
        self.wv_up_AHK = init_normal(rngs, (A, H, K), A)
        self.wo_HKD = init_normal(rngs, (H, K, D), H * K, residual_scale(cfg))
        self.softmax_scale = attention_softmax_scale(cfg)
        self.rope_scale = yarn_attention_factor(cfg)
        self.implementation, self.block = cfg.attention, cfg.attention_block
        self.quant_mode = cfg.quant

    def project(self, x, w, n_in=1, in_axis=None, out_axis=None):
        """layers.project under --model.quant; in_axis / out_axis: the tp axis when heads
        (split over tp) are w's input (wo) or output (the up-projections)."""
        return project(x, w, n_in, self.quant_mode, in_axis, out_axis)

    def core_matmul(self, a, b):
        """a @ b of attention's own (scores, values) in float32: 8-bit operands under
        --model.quant (quant.quantized_matmul)."""
        if self.quant_mode != "none":
            return quant.quantized_matmul(*quant.same_varying(a, b), self.quant_mode)
        return jnp.matmul(a, b, preferred_element_type=ACC_DTYPE)

    def queries(self, x_BTD, angles, tp_axis=None):
        if self.full_rank_queries:
            q_nope_BTHK = self.project(x_BTD, self.wq_DHK[...], out_axis=tp_axis)
            q_rope_BTHR = self.project(x_BTD, self.wq_rope_DHR[...], out_axis=tp_axis)
        else:
            q_BTQ = self.q_norm(self.project(x_BTD, self.wq_down_DQ[...]))
            q_nope_BTHK = self.project(q_BTQ, self.wq_up_QHK[...], out_axis=tp_axis)
            q_rope_BTHR = self.project(q_BTQ, self.wq_rope_QHR[...], out_axis=tp_axis)
        return q_nope_BTHK, apply_rope(q_rope_BTHR, angles, self.rope_scale)

    def latents(self, x_BTD, angles):
        """What the cache stores: the normalised KV latent and the shared RoPE key."""
        kv_BTA = self.kv_norm(self.project(x_BTD, self.wkv_down_DA[...]))
        k_rope_BTR = apply_rope(self.project(x_BTD, self.wk_rope_DR[...]), angles, self.rope_scale)
        return kv_BTA, k_rope_BTR

    def __call__(self, x_BTD, angles, tp_axis=None):
        """Causal self-attention over a whole sequence (training and eval), or over this
        rank's chunks of it (angles a SequenceChunks: context_parallel.py)."""
        return self.with_max_logits(x_BTD, angles, tp_axis)[0]

    def with_max_logits(self, x_BTD, angles, tp_axis=None):
        """(the attention's output, each local head's largest logit [H], float32).

        A logit is a query-key score after the softmax scale, before the softmax; the max
        runs over this device's rows and queries (under cp: its chunks' queries against
        the gathered keys) and every visible key. It is read off the scores the forward
        computes anyway (stop_gradient: it changes neither the output nor a gradient);
        the step reduces it over the mesh (step_core.loss_and_metrics) and QK-clip reads it.
        """
        B, T, _ = x_BTD.shape
        chunks, angles = (angles, angles.angles) if isinstance(angles, SequenceChunks) else (None, angles)
        q_nope_BTHK, q_rope_BTHR = self.queries(x_BTD, angles, tp_axis)
        kv_BSA, k_rope_BSR = self.latents(x_BTD, angles)
        q_pos_T = k_pos_S = jnp.arange(T)
        if chunks is not None:  # the latent crosses cp, not keys and values: they are made here
            (kv_BSA, k_rope_BSR), q_pos_T, k_pos_S = chunks.gather(kv_BSA, k_rope_BSR), chunks.q_pos_T, chunks.k_pos_S
        k_nope_BSHK = self.project(kv_BSA, self.wk_up_AHK[...], out_axis=tp_axis)
        v_BSHK = self.project(kv_BSA, self.wv_up_AHK[...], out_axis=tp_axis)
        if self.implementation == "blockwise":
            out_BTHK, max_logit_H = blockwise_attention_and_max_logits(
                q_nope_BTHK, q_rope_BTHR, k_nope_BSHK, k_rope_BSR, v_BSHK, q_pos_T, k_pos_S, self.softmax_scale, self.block)
        elif self.implementation in ("dot_product_attention", "splash"):
            if self.implementation == "splash":
                out_BTHK = splash_attention(q_nope_BTHK, q_rope_BTHR, k_nope_BSHK, k_rope_BSR, v_BSHK, self.softmax_scale, self.block,
                                            None if chunks is None else chunks.axis)
            else:
                out_BTHK = self.fused_attention(q_nope_BTHK, q_rope_BTHR, k_nope_BSHK, k_rope_BSR, v_BSHK)
            # The fused kernels keep their scores to themselves: they are taken again, a block of
            # queries at a time (the forward's score FLOPs once more, no [T, S] buffer).
            max_logit_H = max_logits(*jax.lax.stop_gradient((q_nope_BTHK, q_rope_BTHR, k_nope_BSHK, k_rope_BSR)),
                                     q_pos_T, k_pos_S, self.softmax_scale, self.block)
        else:
            # Heads-major layout, so each product is a batch of plain 2-D matmuls (on
            # this CPU the forward runs 2x faster than with einsums over [B, T, H, K]).
            q_nope_BHTK, v_BHSK = q_nope_BTHK.transpose(0, 2, 1, 3), v_BSHK.transpose(0, 2, 1, 3)
            scores_BHTS = self.core_matmul(q_nope_BHTK, k_nope_BSHK.transpose(0, 2, 3, 1))
            # The RoPE key is shared by every head: rows (h, t) of one sequence meet the same keys.
            q_rope_BNR = q_rope_BTHR.transpose(0, 2, 1, 3).reshape(B, -1, q_rope_BTHR.shape[-1])
            scores_BHTS += self.core_matmul(q_rope_BNR, k_rope_BSR.transpose(0, 2, 1)).reshape(scores_BHTS.shape)
            causal_TS = jnp.tril(jnp.ones((T, T), bool)) if chunks is None else k_pos_S[None, :] <= q_pos_T[:, None]
            scores_BHTS = jnp.where(causal_TS, scores_BHTS * self.softmax_scale, -jnp.inf)
            max_logit_H = jnp.max(jax.lax.stop_gradient(scores_BHTS), axis=(0, 2, 3))
            probs_BHTS = jax.nn.softmax(scores_BHTS, axis=-1).astype(x_BTD.dtype)
            out_BTHK = self.core_matmul(probs_BHTS, v_BHSK).astype(x_BTD.dtype).transpose(0, 2, 1, 3)
        # Tensor parallel: each device holds H/tp heads, so this is a partial sum over
        # heads; the psum (an all-reduce over `tp`) completes it (Megatron, row-parallel).
        return psum_if(self.project(out_BTHK, self.wo_HKD[...], 2, in_axis=tp_axis), tp_axis), max_logit_H.astype(jnp.float32)

    def fused_attention(self, q_nope_BTHK, q_rope_BTHR, k_nope_BSHK, k_rope_BSR, v_BSHK):
        """jax.nn.dot_product_attention (cuDNN flash attention on GPUs that have it).

        It wants one head dim for queries, keys and values, so queries and keys carry
        [content | RoPE] parts (the shared RoPE key copied to every head) and values are
        zero-padded from K to K + R; the padding is cut off again.
        """
        H, K, R = v_BSHK.shape[2], v_BSHK.shape[3], q_rope_BTHR.shape[3]
        q_BTHW = jnp.concatenate([q_nope_BTHK, q_rope_BTHR], axis=-1)
        k_rope_BSHR = jnp.broadcast_to(k_rope_BSR[:, :, None, :], k_rope_BSR.shape[:2] + (H, R))
        k_BSHW = jnp.concatenate([k_nope_BSHK, k_rope_BSHR], axis=-1)
        v_BSHW = jnp.pad(v_BSHK, ((0, 0), (0, 0), (0, 0), (0, R)))
        out_BTHW = jax.nn.dot_product_attention(q_BTHW, k_BSHW, v_BSHW, scale=self.softmax_scale, is_causal=True)
        return out_BTHW[..., :K]

    def decode(self, x_BTD, angles, cache, start):
        """Attend T new tokens at positions start..start+T-1 to the latent cache.

        The key up-projection is absorbed into the query (q . W_uk c = (W_uk^T q) . c),
        so keys are never materialised: scores are taken against the cached latent.
        cache = (kv_BSA, k_rope_BSR) with S the fixed maximum length, so one compiled
        step serves every position. `start` is one position for all rows (a scalar),
        or one per row [B]: a server's slots each sit at their own length.
        """
        kv_cache_BSA, rope_cache_BSR = cache
        q_nope_BTHK, q_rope_BTHR = self.queries(x_BTD, angles)
        kv_BTA, k_rope_BTR = self.latents(x_BTD, angles)
        kv_cache_BSA = write_at(kv_cache_BSA, kv_BTA, start)
        rope_cache_BSR = write_at(rope_cache_BSR, k_rope_BTR, start)
        q_latent_BTHA = jnp.einsum("bthk,ahk->btha", q_nope_BTHK, self.wk_up_AHK[...])
        scores_BHTS = jnp.einsum("btha,bsa->bhts", q_latent_BTHA, kv_cache_BSA, preferred_element_type=ACC_DTYPE)
        scores_BHTS += jnp.einsum("bthr,bsr->bhts", q_rope_BTHR, rope_cache_BSR, preferred_element_type=ACC_DTYPE)
        T, S = x_BTD.shape[1], kv_cache_BSA.shape[1]
        positions_BT = jnp.reshape(start, (-1, 1)) + jnp.arange(T)  # [1, T] for a scalar start
        visible_B1TS = (jnp.arange(S) <= positions_BT[:, :, None])[:, None]
        scores_BHTS = jnp.where(visible_B1TS, scores_BHTS * self.softmax_scale, -jnp.inf)
        probs_BHTS = jax.nn.softmax(scores_BHTS, axis=-1).astype(x_BTD.dtype)
        context_BTHA = jnp.einsum("bhts,bsa->btha", probs_BHTS, kv_cache_BSA)
        out_BTHK = jnp.einsum("btha,ahk->bthk", context_BTHA, self.wv_up_AHK[...])  # per head: not a plain projection
        y_BTD = self.project(out_BTHK, self.wo_HKD[...], 2)
        return y_BTD, (kv_cache_BSA, rope_cache_BSR)


def write_at(cache_BSX, new_BTX, start):
    """cache[b, start_b : start_b + T] = new[b], with start a scalar or one per row [B]."""
    new_BTX = new_BTX.astype(cache_BSX.dtype)
    if jnp.ndim(start) == 0:
        return jax.lax.dynamic_update_slice_in_dim(cache_BSX, new_BTX, start, 1)
    return jax.vmap(lambda c_SX, n_TX, s: jax.lax.dynamic_update_slice_in_dim(c_SX, n_TX, s, 0))(cache_BSX, new_BTX, start)
