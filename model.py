"""The model: a Mixture-of-Experts transformer with Multi-head Latent Attention (DeepSeek-V2/V3: MLA, shared + routed
experts, V3 routing, multi-token prediction), configured by utils.ModelConfig. Read top to bottom: the pieces, RoPE,
MLA attention, routing and the MoE layer, Layer and Block, MTP, the Transformer, the loop over the blocks, decoding.

Every layer is written for the *local* shard of its weights (heads, hidden units and experts are read off the weight
shapes), so the same code runs on one device and inside `jax.shard_map`. Its only collectives are tensor- and
expert-parallel, over the axes one small value names (ops/collectives.Axes; by default one device, none). FSDP, the
pipeline and data parallelism are applied from outside (parallel/): a block gets its weights through apply_blocks's
`loop`. Named scopes mark the parts planner.py --tpu times.

Shape legend (suffixes of names):
  B batch          T time (queries)    S time (keys) or tokens in a routing group
  D model width    H heads             K head dim (content part)   R head dim (RoPE part)
  Q query latent   A key/value latent (the only thing the KV cache stores, with R)
  F hidden units   E experts           C expert capacity   G routing groups
  V vocabulary     N blocks            X top-k choices    L MoE layers of one block
  P expert groups (group-limited routing)   M microbatches   b rows of one microbatch
"""

import dataclasses
import functools
import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ops.collectives import ONE_DEVICE, axis_index, is_auto_axis, live_axes, pmax, psum, split_by_the_compiler
from ops.context_parallel import SequenceChunks, held_positions, local_inputs, local_targets, sequence_axis, token_positions, tokens_at
from utils import CP, SEGMENT_START

# Softmax, norms and routing run in float32 whatever the compute dtype: they are cheap,
# and bfloat16 would lose the small differences between large logits.
ACC_DTYPE = jnp.float32


def kernel(name):
    """The ops/ module of a kernel a flag selects (blockwise, splash, quant, gmm; packing for sft),
    imported when first used: a run imports only the kernels its config selects."""
    return importlib.import_module(f"ops.{name}")


# ---- Pieces: init, projection, RMSNorm, the dense FFN


def init_normal(rngs, shape, fan_in, scale=1.0):
    """Weights ~ N(0, scale^2 / fan_in): keeps activations at unit scale at any width."""
    return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32) * (scale / math.sqrt(fan_in)))


def residual_scale(cfg):
    """Output projections of residual branches start small, 1/sqrt(2 x layers) (GPT-2), so the residual stream does
    not grow with depth. (Not zero: a zero projection would give every weight before it a zero gradient at step 0.)
    The dense prefix's layers count too."""
    return 1.0 / math.sqrt(2 * (cfg.n_blocks * len(cfg.block_pattern) + cfg.first_dense))


def project(x, w, n_in=1, quant_mode="none", in_axis=None, out_axis=None):
    """x [..., I] @ w [I, O...] over x's last `n_in` dims, accumulated in float32, in x's
    dtype; x's leading dims flattened into one row dim (XLA:CPU's weight gradient is 3x
    slower otherwise: docs/benchmarks.md). quant_mode int8 / fp8: 8-bit operands
    (ops/quant.py), in_axis / out_axis the mesh axis (tp) splitting I / O, for mesh-invariant scales."""
    lead, inner = x.shape[:x.ndim - n_in], x.shape[x.ndim - n_in:]
    w_IO = w.reshape(math.prod(inner), -1).astype(x.dtype)
    if quant_mode != "none":
        rows_NI, w_IO = kernel("quant").same_varying(x.reshape(math.prod(lead), w_IO.shape[0]), w_IO)
        row_tile = lead[-1] if len(lead) > 1 else rows_NI.shape[0]  # dw's row tiles: one sequence each, which no split cuts
        y_NO = kernel("quant").quantized_dot(rows_NI, w_IO, quant_mode, live_axes(in_axis), live_axes(out_axis), row_tile)
        return y_NO.reshape(*lead, *w.shape[n_in:])
    if split_by_the_compiler(CP):
        # The automatic executor splits T over cp: flattened [B, T] rows are not a layout its
        # partitioner keeps (it would gather x over cp), so the rows stay apart.
        y_xO = jnp.tensordot(x.reshape(*lead, -1), w_IO, axes=1, preferred_element_type=ACC_DTYPE).astype(x.dtype)
        return y_xO.reshape(*lead, *w.shape[n_in:])
    rows_NI = x.reshape(-1, math.prod(inner))
    y_NO = jnp.dot(rows_NI, w_IO, preferred_element_type=ACC_DTYPE).astype(x.dtype)
    return y_NO.reshape(*lead, *w.shape[n_in:])


class RMSNorm(nnx.Module):
    def __init__(self, dim, eps=1e-6):
        self.scale_D = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    @jax.named_scope("rms_norm")
    def __call__(self, x_BTD):
        x = x_BTD.astype(ACC_DTYPE)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return (x * self.scale_D[...].astype(ACC_DTYPE)).astype(x_BTD.dtype)


class DenseFFN(nnx.Module):
    """SwiGLU (Shazeer 2020) or GELU MLP. Under tensor parallelism F is split: the up projections are column-parallel
    and the down projection row-parallel, so one psum at the end (the caller's) completes the output."""

    def __init__(self, d_model, d_hidden, activation, rngs, out_scale, quant_mode="none"):
        self.activation, self.quant_mode = activation, quant_mode
        if activation == "swiglu":
            self.w_gate_DF = init_normal(rngs, (d_model, d_hidden), d_model)
        self.w_up_DF = init_normal(rngs, (d_model, d_hidden), d_model)
        self.w_down_FD = init_normal(rngs, (d_hidden, d_model), d_hidden, out_scale)

    @jax.named_scope("dense_ffn")
    def __call__(self, x_BTD, axes=ONE_DEVICE):  # a partial sum over F when F is split
        column, row = dict(quant_mode=self.quant_mode, out_axis=axes.tp), dict(quant_mode=self.quant_mode, in_axis=axes.tp)
        up_BTF = project(x_BTD, self.w_up_DF[...], **column)
        if self.activation == "swiglu":
            hidden_BTF = jax.nn.silu(project(x_BTD, self.w_gate_DF[...], **column)) * up_BTF
        else:
            hidden_BTF = jax.nn.gelu(up_BTF)
        return project(hidden_BTF, self.w_down_FD[...], **row)


# ---- Rotary position embeddings


def rope_angles(positions_BT, cfg):
    """Rotation angles [B, T, R/2] for rotary embeddings (Su et al. 2021) at cfg.rope_scaling's
    frequencies: the one place angles are made, for queries and keys alike."""
    return positions_BT.astype(jnp.float32)[..., None] * rope_frequencies(cfg)


def rope_frequencies(cfg):
    """Inverse frequencies [R/2] of the RoPE pairs: theta^(-2i/R), or YaRN's."""
    if cfg.rope_scaling == "yarn":
        return jnp.asarray(yarn_frequencies(cfg), jnp.float32)
    return cfg.rope_theta ** (-jnp.arange(0, cfg.rope_dim, 2, dtype=jnp.float32) / cfg.rope_dim)


# YaRN (Peng et al. 2023, arXiv:2309.00071), as DeepSeek-V2/V3 and transformers define it: on rope_factor x the
# trained context, pairs turning fewer than beta_slow times over it are interpolated (frequency / factor), pairs
# turning more than beta_fast times keep theirs, those between ramp linearly; queries' and keys' RoPE parts are scaled
# by yarn_attention_factor, the softmax by yarn_mscale(factor, mscale_all_dim)^2.


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
    """Rotate pairs (x[2i], x[2i+1]) by angle[i]; x may have a head axis before R. scale:
    yarn_attention_factor, on cos and sin (as transformers applies it). Each lane computes
    x_even * (cos | sin) + x_odd * (-sin | cos), its partner from a permutation matmul: no
    strided slices and stacks (relayouts a TPU pays more for than the rotation: docs/pods.md)."""
    cos, sin = jnp.cos(angles_BTR2) * scale, jnp.sin(angles_BTR2) * scale
    even_BTR, odd_BTR = (jnp.stack(pair, axis=-1).reshape(cos.shape[:-1] + (-1,)) for pair in ((cos, sin), (-sin, cos)))
    if x_BTxR.ndim == 4:  # [B, T, H, R]: the same angle for every head
        even_BTR, odd_BTR = even_BTR[:, :, None, :], odd_BTR[:, :, None, :]
    R, x = x_BTxR.shape[-1], x_BTxR.astype(jnp.float32)
    partner = jnp.matmul(x_BTxR, jnp.eye(R, dtype=x_BTxR.dtype)[jnp.arange(R) ^ 1], preferred_element_type=jnp.float32)
    x_even, x_odd = jnp.where(jnp.arange(R) % 2 == 0, x, partner), jnp.where(jnp.arange(R) % 2 == 1, x, partner)
    return (x_even * even_BTR + x_odd * odd_BTR).astype(x_BTxR.dtype)


# ---- Multi-head Latent Attention (DeepSeek-V2, arXiv:2405.04434, section 2.1)
# Keys and values are up-projected from a small latent c_kv [A]; a separate RoPE key [R] is shared by
# all heads ("decoupled RoPE": a rotation cannot be folded into the latent's up-projection). So the
# KV cache holds A + R numbers per token instead of 2 * H * K.


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
        # (auto undecided, as off a TPU: main.py decides it for its platform, utils.kernels_for)
        self.implementation, self.block = "matmul" if cfg.attention == "auto" else cfg.attention, cfg.attention_block
        self.quant_mode = cfg.quant

    def project(self, x, w, n_in=1, in_axis=None, out_axis=None):
        """`project` under --model.quant; in_axis / out_axis: the tp axis when heads
        (split over tp) are w's input (wo) or output (the up-projections)."""
        return project(x, w, n_in, self.quant_mode, in_axis, out_axis)

    def core_matmul(self, a, b):
        """a @ b of attention's own (scores, values) in float32: 8-bit operands under
        --model.quant (quant.quantized_matmul)."""
        if self.quant_mode != "none":
            quant = kernel("quant")
            return quant.quantized_matmul(*quant.same_varying(a, b), self.quant_mode)
        return jnp.matmul(a, b, preferred_element_type=ACC_DTYPE)

    def queries(self, x_BTD, angles, axes=ONE_DEVICE):
        if self.full_rank_queries:
            q_nope_BTHK = self.project(x_BTD, self.wq_DHK[...], out_axis=axes.tp)
            q_rope_BTHR = self.project(x_BTD, self.wq_rope_DHR[...], out_axis=axes.tp)
        else:
            q_BTQ = self.q_norm(self.project(x_BTD, self.wq_down_DQ[...]))
            q_nope_BTHK = self.project(q_BTQ, self.wq_up_QHK[...], out_axis=axes.tp)
            q_rope_BTHR = self.project(q_BTQ, self.wq_rope_QHR[...], out_axis=axes.tp)
        return q_nope_BTHK, apply_rope(q_rope_BTHR, angles, self.rope_scale)

    def latents(self, x_BTD, angles):
        """What the cache stores: the normalised KV latent and the shared RoPE key."""
        kv_BTA = self.kv_norm(self.project(x_BTD, self.wkv_down_DA[...]))
        k_rope_BTR = apply_rope(self.project(x_BTD, self.wk_rope_DR[...]), angles, self.rope_scale)
        return kv_BTA, k_rope_BTR

    def __call__(self, x_BTD, angles, axes=ONE_DEVICE):
        """Causal self-attention over a whole sequence (training and eval), or over this
        rank's chunks of it (angles a SequenceChunks: ops/context_parallel.py)."""
        return self.with_max_logits(x_BTD, angles, axes)[0]

    @jax.named_scope("attention")
    def with_max_logits(self, x_BTD, angles, axes=ONE_DEVICE):
        """(the attention's output, each local head's largest logit [H], float32): a score after the softmax scale,
        over this device's queries and every visible key, read off the forward's scores under stop_gradient (QK-clip's
        input; the step reduces it over the mesh)."""
        B, T, _ = x_BTD.shape
        segments_bT = getattr(angles, "segments_bT", None)  # packed rows: a query sees its own document (ops/packing.py)
        chunks, angles = angles if isinstance(angles, SequenceChunks) else None, getattr(angles, "angles", angles)
        if self.implementation == "splash" and self.quant_mode == "none":  # operands projected in the kernel's layout
            return kernel("splash").projected_attention(self, x_BTD, angles, chunks, segments_bT, axes.tp)
        q_nope_BTHK, q_rope_BTHR = self.queries(x_BTD, angles, axes)
        kv_BSA, k_rope_BSR = self.latents(x_BTD, angles)
        q_pos_T = k_pos_S = jnp.arange(T)
        if chunks is not None:  # the latent crosses cp, not keys and values: they are made here
            (kv_BSA, k_rope_BSR), q_pos_T, k_pos_S = chunks.gather(kv_BSA, k_rope_BSR), chunks.q_pos_T, chunks.k_pos_S
        k_nope_BSHK = self.project(kv_BSA, self.wk_up_AHK[...], out_axis=axes.tp)
        v_BSHK = self.project(kv_BSA, self.wv_up_AHK[...], out_axis=axes.tp)
        if self.implementation == "blockwise":
            out_BTHK, max_logit_H = kernel("blockwise").blockwise_attention_and_max_logits(
                q_nope_BTHK, q_rope_BTHR, k_nope_BSHK, k_rope_BSR, v_BSHK, q_pos_T, k_pos_S, self.softmax_scale, self.block, segments_bT)
        elif self.implementation == "splash":  # under --model.quant (the max logits: the forward's score FLOPs again)
            out_BTHK, max_logit_H = kernel("splash").splash_attention(q_nope_BTHK, q_rope_BTHR, k_nope_BSHK, k_rope_BSR, v_BSHK, q_pos_T,
                                                                      self.softmax_scale, self.block, chunks, segments_bT)
        elif self.implementation == "dot_product_attention":
            out_BTHK = self.fused_attention(q_nope_BTHK, q_rope_BTHR, k_nope_BSHK, k_rope_BSR, v_BSHK, segments_bT)
            # The fused kernel keeps its scores to itself: they are taken again, a block of
            # queries at a time (the forward's score FLOPs once more, no [T, S] buffer).
            max_logit_H = kernel("blockwise").max_logits(*jax.lax.stop_gradient((q_nope_BTHK, q_rope_BTHR, k_nope_BSHK, k_rope_BSR)),
                                                         q_pos_T, k_pos_S, self.softmax_scale, self.block, segments_bT)
        else:
            # Checkpointed: the backward takes the [T, S] scores again, not kept per layer (docs/pods.md)
            @jax.checkpoint
            def scores_to_out(q_nope_BTHK, q_rope_BTHR, k_nope_BSHK, k_rope_BSR, v_BSHK):
                # Heads-major layout: each product a batch of plain 2-D matmuls (2x faster on CPU
                # than einsums over [B, T, H, K]: docs/benchmarks.md).
                q_nope_BHTK, v_BHSK = q_nope_BTHK.transpose(0, 2, 1, 3), v_BSHK.transpose(0, 2, 1, 3)
                scores_BHTS = self.core_matmul(q_nope_BHTK, k_nope_BSHK.transpose(0, 2, 3, 1))
                # The RoPE key is shared by every head: rows (h, t) of one sequence meet the same keys.
                q_rope_BNR = q_rope_BTHR.transpose(0, 2, 1, 3).reshape(B, -1, q_rope_BTHR.shape[-1])
                scores_BHTS += self.core_matmul(q_rope_BNR, k_rope_BSR.transpose(0, 2, 1)).reshape(scores_BHTS.shape)
                visible = jnp.tril(jnp.ones((T, T), bool)) if chunks is None else k_pos_S[None, :] <= q_pos_T[:, None]  # [T, S]
                if segments_bT is not None:  # [b, 1, T, S]
                    visible = kernel("packing").document_mask(q_pos_T, k_pos_S, segments_bT)[:, None]
                scores_BHTS = jnp.where(visible, scores_BHTS * self.softmax_scale, -jnp.inf)
                probs_BHTS = jax.nn.softmax(scores_BHTS, axis=-1).astype(x_BTD.dtype)
                out_BTHK = self.core_matmul(probs_BHTS, v_BHSK).astype(x_BTD.dtype).transpose(0, 2, 1, 3)
                return out_BTHK, jnp.max(jax.lax.stop_gradient(scores_BHTS), axis=(0, 2, 3))
            out_BTHK, max_logit_H = scores_to_out(q_nope_BTHK, q_rope_BTHR, k_nope_BSHK, k_rope_BSR, v_BSHK)
        # Tensor parallel: each device holds H/tp heads, so this is a partial sum over
        # heads; the psum (an all-reduce over `tp`) completes it (Megatron, row-parallel).
        return psum(self.project(out_BTHK, self.wo_HKD[...], 2, in_axis=axes.tp), axes.tp), max_logit_H.astype(jnp.float32)

    def fused_attention(self, q_nope_BTHK, q_rope_BTHR, k_nope_BSHK, k_rope_BSR, v_BSHK, segments_bT=None):
        """jax.nn.dot_product_attention (cuDNN flash attention on GPUs that have it): one head
        dim for all, so queries and keys carry [content | RoPE] (the RoPE key copied to every
        head) and values are zero-padded from K to K + R, cut off again."""
        H, K, R = v_BSHK.shape[2], v_BSHK.shape[3], q_rope_BTHR.shape[3]
        q_BTHW = jnp.concatenate([q_nope_BTHK, q_rope_BTHR], axis=-1)
        k_rope_BSHR = jnp.broadcast_to(k_rope_BSR[:, :, None, :], k_rope_BSR.shape[:2] + (H, R))
        k_BSHW = jnp.concatenate([k_nope_BSHK, k_rope_BSHR], axis=-1)
        v_BSHW = jnp.pad(v_BSHK, ((0, 0), (0, 0), (0, 0), (0, R)))
        same_document_B1TS = None if segments_bT is None else (segments_bT[:, :, None] == segments_bT[:, None, :])[:, None]
        out_BTHW = jax.nn.dot_product_attention(q_BTHW, k_BSHW, v_BSHW, mask=same_document_B1TS, scale=self.softmax_scale, is_causal=True)
        return out_BTHW[..., :K]

    def decode(self, x_BTD, angles, cache, start):
        """Attend T new tokens at positions start..start+T-1 to the latent cache (kv_BSA, k_rope_BSR), S its fixed
        length. The key up-projection is absorbed into the query (q . W_uk c = (W_uk^T q) . c): scores are taken
        against the latent. `start`: one position for all rows, or one per row [B] (the server's slots)."""
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


# ---- Routing


class RouterBias(nnx.Variable):
    """A per-expert bias added to the routing scores for the top-k *selection* only (DeepSeek-V3's aux-loss-free
    balancing, arXiv:2412.19437 section 2.1.2). Train state but not a trained weight: no gradient reaches it (it only
    picks indices) and the optimizer leaves it alone; `balanced_bias` moves it after every step."""


def has_router_bias(cfg):
    """The MoE layers hold router_bias_E: trained by balancing (router_bias_rate > 0), or
    frozen as imported (router_bias, e.g. DeepSeek-V3's e_score_correction_bias)."""
    return cfg.router_bias_rate > 0 or cfg.router_bias


def limit_to_top_groups(choice_SE, n_groups, topk_groups):
    """Group-limited routing (DeepSeek-V2 section 2.1.3, V3's node-limited routing): each token keeps only the experts
    of its topk_groups best of n_groups contiguous groups (a group's score: the sum of its two highest biased scores, as
    V3 and transformers), the others -inf. With n_groups = dp under expert parallelism a group is one device's experts."""
    S, E = choice_SE.shape
    by_group_SPE = choice_SE.reshape(S, n_groups, E // n_groups)
    group_score_SP = jnp.sum(jax.lax.top_k(by_group_SPE, 2)[0], axis=-1)
    _, top_groups_SX = jax.lax.top_k(group_score_SP, topk_groups)
    kept_SP = jnp.any(jnp.arange(n_groups)[None, :, None] == top_groups_SX[:, None, :], axis=-1)
    return jnp.where(jnp.repeat(kept_SP, E // n_groups, axis=1), choice_SE, -jnp.inf)


def top_k_routing(x_SD, router_DE, top_k, score, bias_E=None, n_groups=1, topk_groups=1, routed_scale=1.0, norm_topk=True):
    """Router: (gates_SX, experts_SX, probs_SE) for each token's top_k experts. Gates sum to 1 (norm_topk; else the
    raw scores, V2's; with top_k = 1 the raw score, Switch's), times routed_scale; probs_SE (normalised scores) feed
    the load-balance loss. bias_E shifts only the scores that select (V3); n_groups > 1 limits the choice to
    topk_groups groups. In float32: a tie broken differently in bfloat16 would send a token elsewhere."""
    logits_SE = jnp.dot(x_SD.astype(ACC_DTYPE), router_DE.astype(ACC_DTYPE))
    if score == "softmax":
        scores_SE = jax.nn.softmax(logits_SE, axis=-1)
    else:  # sigmoid (DeepSeek-V3): independent affinities, normalised afterwards
        scores_SE = jax.nn.sigmoid(logits_SE)
    probs_SE = scores_SE / jnp.sum(scores_SE, axis=-1, keepdims=True)
    # Selection only picks indices, so no gradient flows through it.
    choice_SE = jax.lax.stop_gradient(scores_SE if bias_E is None else scores_SE + bias_E.astype(ACC_DTYPE))
    if n_groups > 1:
        choice_SE = limit_to_top_groups(choice_SE, n_groups, topk_groups)
    _, experts_SX = jax.lax.top_k(choice_SE, top_k)
    top_scores_SX = jnp.take_along_axis(scores_SE, experts_SX, axis=-1)
    if top_k == 1 or not norm_topk:  # (with k = 1 normalising would make every gate 1: no gradient for the router)
        return top_scores_SX * routed_scale, experts_SX, probs_SE
    gates_SX = top_scores_SX / jnp.sum(top_scores_SX, axis=-1, keepdims=True)
    return gates_SX * routed_scale, experts_SX, probs_SE


def balanced_bias(bias_NE, tokens_per_expert_NE, rate):
    """One step of aux-loss-free balancing (DeepSeek-V3 section 2.1.2):
    bias_e += rate * sign(mean load - load_e). An overloaded expert's bias falls, an
    underloaded one's rises, one at mean load keeps it. The load is the step's global
    count of assignments (before capacity drops), so every device and mesh computes
    the same bias."""
    load_NE = tokens_per_expert_NE.astype(jnp.float32)
    return bias_NE + rate * jnp.sign(jnp.mean(load_NE, axis=-1, keepdims=True) - load_NE)


def balance_router_biases(blocks, tokens_per_expert_NLE, rate, block_pattern):
    """blocks (a pure dict of stacked block params) with every MoE layer's router_bias_E moved by `balanced_bias`; MoE
    layer l of a block is the l-th "M" of its pattern."""
    layers = dict(blocks["layers"])
    for moe_layer, i in enumerate(i for i, kind in enumerate(block_pattern) if kind == "M"):
        ffn = dict(layers[i]["ffn"])
        ffn["router_bias_E"] = balanced_bias(ffn["router_bias_E"], tokens_per_expert_NLE[:, moe_layer], rate)
        layers[i] = dict(layers[i], ffn=ffn)
    return dict(blocks, layers=layers)


def router_biases(blocks, block_pattern):
    """[N, L, E]: the router bias of every MoE layer (for logging)."""
    return jnp.stack([blocks["layers"][i]["ffn"]["router_bias_E"] for i, kind in enumerate(block_pattern) if kind == "M"], axis=1)


def expert_capacity(group_size, top_k, n_experts, capacity_factor):
    """Slots per expert per routing group: factor x tokens x k / experts (GShard).

    The k matters: a group makes tokens x k assignments, so without it the expected
    load of an expert would exceed its capacity whenever k > 1.
    """
    return max(1, math.ceil(capacity_factor * group_size * top_k / n_experts))


def assign_slots(experts_SX, n_experts, capacity):
    """Give every (token, choice) a slot in its expert's buffer, or drop it: (slot_SX, e * capacity + position or
    n_experts * capacity when dropped; kept_SX; tokens_per_expert_E, the demand). Priority is token order, so a drop
    at position t never depends on later tokens: the model stays causal (choice-major priority would leak the future).
    A stable sort: no [S, E, C] one-hot."""
    S, X = experts_SX.shape
    experts_N = experts_SX.reshape(-1)  # token-major order
    order = jnp.argsort(experts_N, stable=True)
    tokens_per_expert_E = jnp.zeros((n_experts,), jnp.int32).at[experts_N].add(1)
    first_index_E = jnp.cumsum(tokens_per_expert_E) - tokens_per_expert_E
    position_sorted = jnp.arange(S * X) - first_index_E[experts_N[order]]
    position_SX = jnp.zeros((S * X,), jnp.int32).at[order].set(position_sorted).reshape(S, X)
    kept_SX = position_SX < capacity
    slot_SX = jnp.where(kept_SX, experts_SX * capacity + position_SX, n_experts * capacity)
    return slot_SX, kept_SX, tokens_per_expert_E


def load_balance_loss(probs_SE, tokens_per_expert_E, top_k):
    """Switch Transformer auxiliary loss, E * sum_e f_e * P_e (arXiv:2101.03961 eq. 4): f_e
    the share of the group's assignments to expert e, P_e its mean probability; 1 at uniform."""
    S, E = probs_SE.shape
    fraction_E = tokens_per_expert_E.astype(ACC_DTYPE) / (S * top_k)
    return E * jnp.sum(fraction_E * jnp.mean(probs_SE, axis=0))


def sequence_balance_loss(probs_BTE, experts_BTX, n_experts, seq_axis=None):
    """DeepSeek-V3's sequence-wise balance loss (eq. 17-20), summed over sequences: the Switch
    formula over each whole sequence. seq_axis: the cp axis when this device holds chunks
    (counts and probabilities summed over cp first; each rank returns 1/cp of the loss)."""
    tokens_per_expert_BE = jax.vmap(lambda e: jnp.zeros((n_experts,), jnp.int32).at[e.reshape(-1)].add(1))(experts_BTX)
    if live_axes(seq_axis):
        T, cp = probs_BTE.shape[1], jax.lax.axis_size(seq_axis)
        tokens_per_expert_BE = jax.lax.psum(tokens_per_expert_BE, seq_axis)
        mean_probs_BE = jax.lax.psum(jnp.sum(probs_BTE.astype(ACC_DTYPE), axis=1), seq_axis) / (T * cp)
        fraction_BE = tokens_per_expert_BE.astype(ACC_DTYPE) / (T * cp * experts_BTX.shape[-1])
        loss = jnp.sum(n_experts * jnp.sum(fraction_BE * mean_probs_BE, axis=-1)) / cp
        return jax.lax.pcast(loss, seq_axis, to="varying")  # (the same on every rank: typed as a per-rank share)
    return jnp.sum(jax.vmap(load_balance_loss, (0, 0, None))(probs_BTE, tokens_per_expert_BE, experts_BTX.shape[-1]))



def resolve_moe_kernel(choice):
    """The grouped matmul `--model.moe_kernel` names: auto is gmm on a TPU (megablox
    skips the tiles of other experts), ragged_dot elsewhere (CPU and GPU keep XLA's op)."""
    if choice == "auto":
        return "gmm" if jax.default_backend() == "tpu" else "ragged_dot"
    return choice


class MoE(nnx.Module):
    """Shared experts (see every token) + top-k routed experts (DeepSeekMoE). Tokens are
    routed in groups of `group_size` consecutive tokens of one sequence, capacity decided per
    group: what is dropped does not depend on how the batch is split over devices."""

    def __init__(self, cfg, rngs):
        D, E, F = cfg.d_model, cfg.n_experts, cfg.d_expert
        self.top_k, self.score = cfg.top_k, cfg.router_score
        self.capacity_factor = cfg.capacity_factor
        self.moe_kernel = resolve_moe_kernel(cfg.moe_kernel)
        self.quant_mode = cfg.quant  # (quantized dropless experts run ragged_dot: utils.validate_model refuses gmm with quant)
        self.group_size = cfg.routing_group or cfg.seq_len
        self.router_DE = init_normal(rngs, (D, E), D)
        self.router_bias_E = RouterBias(jnp.zeros((E,), jnp.float32)) if has_router_bias(cfg) else None
        self.n_groups, self.topk_groups, self.routed_scale = cfg.n_groups, cfg.topk_groups, cfg.routed_scale
        self.norm_topk = cfg.norm_topk
        self.sequence_loss = cfg.seq_aux_loss_weight > 0
        self.w_gate_EDF = init_normal(rngs, (E, D, F), D)
        self.w_up_EDF = init_normal(rngs, (E, D, F), D)
        self.w_down_EFD = init_normal(rngs, (E, F, D), F, residual_scale(cfg))
        self.shared = DenseFFN(D, cfg.n_shared * F, "swiglu", rngs, residual_scale(cfg), cfg.quant) if cfg.n_shared else None

    @jax.named_scope("router")
    def route(self, x_GSD):
        """top_k_routing of each group: (gates_GSX, experts_GSX, probs_GSE)."""
        bias_E = None if self.router_bias_E is None else self.router_bias_E[...]
        route = functools.partial(top_k_routing, top_k=self.top_k, score=self.score, bias_E=bias_E, n_groups=self.n_groups,
                                  topk_groups=self.topk_groups, routed_scale=self.routed_scale, norm_topk=self.norm_topk)
        return jax.vmap(route, (0, None))(x_GSD, self.router_DE[...])

    @jax.named_scope("moe_experts")
    def expert_ffn(self, x_GECD, axes=ONE_DEVICE):
        """SwiGLU of each local expert on its buffer of tokens.

        Each expert's slots of all groups become one row dim N = G x C, so every matmul is
        a batch (over E) of plain 2-D products (see `project` for why)."""
        G, E, C, D = x_GECD.shape
        x_END = x_GECD.transpose(1, 0, 2, 3).reshape(E, G * C, D)

        def expert_matmul(x_ENI, w_EIO, tp_splits):
            if self.quant_mode != "none":
                return kernel("quant").quantized_expert_matmuls(x_ENI, w_EIO, self.quant_mode, C, axes.tp, tp_splits)
            return jnp.einsum("eni,eio->eno", x_ENI, w_EIO.astype(x_ENI.dtype), preferred_element_type=ACC_DTYPE).astype(x_ENI.dtype)

        hidden_ENF = jax.nn.silu(expert_matmul(x_END, self.w_gate_EDF[...], "out")) * expert_matmul(x_END, self.w_up_EDF[...], "out")
        y_END = expert_matmul(hidden_ENF, self.w_down_EFD[...], "in")
        return y_END.reshape(E, G, C, D).transpose(1, 0, 2, 3)

    @jax.named_scope("moe_dispatch_combine")
    def routed_with_capacity(self, x_GSD, gates_GSX, experts_GSX, n_experts, axes=ONE_DEVICE):
        G, S, D = x_GSD.shape
        capacity = expert_capacity(S, self.top_k, n_experts, self.capacity_factor)
        slot_GSX, kept_GSX, tokens_per_expert_GE = jax.vmap(assign_slots, (0, None, None))(experts_GSX, n_experts, capacity)

        def fill_slots(x_SD, slot_SX):  # gather tokens into [E*C] slots; empty slots read a zero row
            token_for_slot = jnp.full((n_experts * capacity,), S, jnp.int32)
            token_for_slot = token_for_slot.at[slot_SX].set(jnp.broadcast_to(jnp.arange(S)[:, None], slot_SX.shape), mode="drop")
            return jnp.concatenate([x_SD, jnp.zeros((1, D), x_SD.dtype)])[token_for_slot]

        x_GECD = jax.vmap(fill_slots)(x_GSD, slot_GSX).reshape(G, n_experts, capacity, D)
        ep_axis = axes.ep
        if ep_axis is None or not (is_auto_axis(ep_axis) or live_axes(ep_axis)):  # one expert group: nothing to send
            y_GECD = self.expert_ffn(x_GECD, axes)
        elif is_auto_axis(ep_axis):
            # Automatic sharding (parallel/auto.py): only say that each expert's slots should sit where the expert
            # lives (experts over ep_axis, every group); the compiler inserts the dispatch there and back.
            by_expert = jax.sharding.PartitionSpec(None, ep_axis)
            x_GECD = jax.lax.with_sharding_constraint(x_GECD, by_expert)
            y_GECD = jax.lax.with_sharding_constraint(self.expert_ffn(x_GECD, axes), by_expert)
        else:
            # Expert parallelism: this device holds E/dp experts. all_to_all sends each
            # expert's slots to the device that owns it (split E, stack groups), the
            # experts run, and the inverse all_to_all brings the results home.
            x_GECD = jax.lax.all_to_all(x_GECD, ep_axis, split_axis=1, concat_axis=0, tiled=True)
            y_GECD = self.expert_ffn(x_GECD, axes)
            y_GECD = jax.lax.all_to_all(y_GECD, ep_axis, split_axis=0, concat_axis=1, tiled=True)

        def combine(y_ECD, slot_SX, gates_SX, kept_SX):  # each token sums its k expert outputs
            y_slots = jnp.concatenate([y_ECD.reshape(-1, D), jnp.zeros((1, D), y_ECD.dtype)])
            weights_SX = jnp.where(kept_SX, gates_SX, 0.0).astype(y_ECD.dtype)
            return jnp.einsum("sxd,sx->sd", y_slots[slot_SX], weights_SX)

        y_GSD = jax.vmap(combine)(y_GECD, slot_GSX, gates_GSX, kept_GSX)
        dropped = jnp.sum(~kept_GSX)
        return y_GSD, tokens_per_expert_GE, dropped

    @jax.named_scope("moe_dispatch_combine")
    def routed_dropless(self, x_GSD, gates_GSX, experts_GSX, n_experts, axes=ONE_DEVICE, grouped_kernel=None):
        """No capacity: all (token, choice) pairs sorted by expert, a grouped matmul (grouped_kernel: ragged_dot or
        megablox gmm; default --model.moe_kernel) over each expert's run. Under expert parallelism every device
        gathers the ep devices' groups, runs its own experts' pairs (the others' come out 0) and a psum_scatter hands
        each device its groups' sums: nothing dropped, for an all-gather of ep x the tokens."""
        tokens_per_expert_GE = jax.vmap(lambda e: jnp.zeros((n_experts,), jnp.int32).at[e.reshape(-1)].add(1))(experts_GSX)
        ep_axis = axes.ep
        expert_parallel = ep_axis is not None and not is_auto_axis(ep_axis) and bool(live_axes(ep_axis))
        if expert_parallel:
            x_GSD, gates_GSX, experts_GSX = (jax.lax.all_gather(a, ep_axis, axis=0, tiled=True) for a in (x_GSD, gates_GSX, experts_GSX))
        G, S, D = x_GSD.shape
        X, n_local = self.top_k, self.w_gate_EDF[...].shape[0]
        local_N = experts_GSX.reshape(-1) - (jax.lax.axis_index(ep_axis) * n_local if expert_parallel else 0)
        local_N = jnp.where((local_N >= 0) & (local_N < n_local), local_N, n_local)  # n_local: another device's expert
        order = jnp.argsort(local_N, stable=True)
        token_of_pair = jnp.arange(G * S * X) // X
        x_ND = x_GSD.reshape(G * S, D)[token_of_pair[order]]
        tokens_per_expert_E = jnp.zeros((n_local + 1,), jnp.int32).at[local_N].add(1)[:n_local]

        @jax.named_scope("moe_experts")
        def matmul(x_NI, w_EIO, tp_splits):
            if self.quant_mode != "none":
                return kernel("quant").quantized_grouped_matmul(x_NI, w_EIO, tokens_per_expert_E, self.quant_mode, axes.tp, tp_splits)
            if (grouped_kernel or self.moe_kernel) == "gmm":  # megablox (ops/gmm.py)
                return kernel("gmm").grouped_matmul(x_NI, w_EIO, tokens_per_expert_E)
            return jax.lax.ragged_dot(x_NI, w_EIO, tokens_per_expert_E)

        gate, up = matmul(x_ND, self.w_gate_EDF[...], tp_splits="out"), matmul(x_ND, self.w_up_EDF[...], tp_splits="out")
        y_ND = matmul(jax.nn.silu(gate) * up, self.w_down_EFD[...], tp_splits="in")
        y_pairs = jnp.zeros_like(y_ND).at[order].set(y_ND).reshape(G, S, X, D)
        y_GSD = jnp.einsum("gsxd,gsx->gsd", y_pairs, gates_GSX.astype(y_pairs.dtype))
        if expert_parallel:
            y_GSD = jax.lax.psum_scatter(y_GSD, ep_axis, scatter_dimension=0, tiled=True)
        return y_GSD, tokens_per_expert_GE, jnp.zeros((), jnp.int32)

    def __call__(self, x_BTD, axes=ONE_DEVICE, seq_axis=None):
        """Returns y_BTD (a partial sum over tp) and routing statistics summed over
        this call's groups: aux_loss_sum, tokens_per_expert_E, dropped, groups."""
        B, T, D = x_BTD.shape
        n_experts = self.router_DE[...].shape[1]
        group = min(self.group_size, T)
        if T % group:
            raise ValueError(f"routing groups of {group} tokens must divide the sequence length {T}: "
                             f"a group must never straddle two sequences (set --model.routing_group)")
        x_GSD = x_BTD.reshape(B * T // group, group, D)
        gates_GSX, experts_GSX, probs_GSE = self.route(x_GSD)
        if self.capacity_factor > 0:
            y_GSD, tokens_per_expert_GE, dropped = self.routed_with_capacity(x_GSD, gates_GSX, experts_GSX, n_experts, axes)
        else:
            y_GSD, tokens_per_expert_GE, dropped = self.routed_dropless(x_GSD, gates_GSX, experts_GSX, n_experts, axes)
        y_BTD = y_GSD.reshape(B, T, D)
        if self.shared is not None:
            y_BTD = y_BTD + self.shared(x_BTD, axes)
        aux_G = jax.vmap(load_balance_loss, (0, 0, None))(probs_GSE, tokens_per_expert_GE, self.top_k)
        stats = dict(aux_loss_sum=jnp.sum(aux_G), tokens_per_expert=jnp.sum(tokens_per_expert_GE, 0),
                     dropped=dropped, groups=jnp.asarray(x_GSD.shape[0], jnp.int32))
        if self.sequence_loss:
            stats["seq_aux_loss_sum"] = sequence_balance_loss(probs_GSE.reshape(B, T, n_experts), experts_GSX.reshape(B, T, -1), n_experts,
                                                             seq_axis)
        return y_BTD, stats

    def decode(self, x_BTD):
        """Inference: every token gets all of its top-k experts (no capacity)."""
        B, T, D = x_BTD.shape
        x_GSD = x_BTD.reshape(B * T, 1, D)
        gates_GSX, experts_GSX, _ = self.route(x_GSD)
        # (ragged_dot: decoding runs outside the step's shard_map, where a Pallas kernel is not partitioned)
        y_GSD, _, _ = self.routed_dropless(x_GSD, gates_GSX, experts_GSX, self.router_DE[...].shape[1], grouped_kernel="ragged_dot")
        y_BTD = y_GSD.reshape(B, T, D)
        return y_BTD + self.shared(x_BTD) if self.shared is not None else y_BTD
# ---- Layer and Block: a short pattern of layers, e.g. "DDDDDM" = five dense layers, then one MoE.


def fold_in_rows(keys_B, data):
    """fold_in for a batch of keys, one per sequence: the dropout keys of a row are derived from (seed, step, global
    row) by parallel/step_core.dropout_rows, then from the block, the layer and the branch here. So a mask never
    depends on the mesh or the pipeline schedule, only on what it masks."""
    return jax.vmap(jax.random.fold_in, (0, None))(keys_B, data)


def empty_moe_stats(n_experts, sequence_loss=False):
    z = jnp.zeros((), jnp.float32)
    stats = dict(aux_loss_sum=z, tokens_per_expert=jnp.zeros((n_experts,), jnp.int32),
                 dropped=jnp.zeros((), jnp.int32), groups=jnp.zeros((), jnp.int32))
    if sequence_loss:
        stats["seq_aux_loss_sum"] = z
    return stats


class Layer(nnx.Module):
    """Pre-norm residual layer: x + attn(norm(x)), then x + ffn(norm(x))."""

    def __init__(self, cfg, kind, rngs):
        self.kind = kind
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = MLAttention(cfg, rngs)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = MoE(cfg, rngs) if kind == "M" else DenseFFN(cfg.d_model, cfg.d_ff, cfg.ffn_activation, rngs, residual_scale(cfg), cfg.quant)
        self.dropout = cfg.dropout

    def drop(self, x_BTD, keys_B, positions_T):
        """Dropout on a residual branch's output. The mask of row b at global position t is drawn from fold_in(key of
        row b, t): every tp device holds the same residual stream and the same keys, so it draws the same mask, and a
        position's mask is the same on whichever cp rank holds it."""
        if self.dropout == 0 or keys_B is None:
            return x_BTD
        draw_D = lambda key, t: jax.random.bernoulli(jax.random.fold_in(key, t), 1 - self.dropout, x_BTD.shape[-1:])  # noqa: E731
        keep_BTD = jax.vmap(lambda key: jax.vmap(draw_D, (None, 0))(key, positions_T))(keys_B)
        return jnp.where(keep_BTD, x_BTD / (1 - self.dropout), 0).astype(x_BTD.dtype)

    def __call__(self, x_BTD, angles, axes=ONE_DEVICE, rng=None):
        """(x, MoE statistics or None, each local head's largest attention logit [H]).
        rng: dropout keys, one per batch row [B] (see fold_in_rows), or None = no dropout."""
        rngs = (fold_in_rows(rng, 0), fold_in_rows(rng, 1)) if rng is not None else (None, None)
        positions_T = token_positions(angles, x_BTD.shape[1])
        attn_BTD, max_logit_H = self.attn.with_max_logits(self.attn_norm(x_BTD), angles, axes)
        x_BTD = x_BTD + self.drop(attn_BTD, rngs[0], positions_T)
        h_BTD = self.ffn_norm(x_BTD)
        if self.kind == "M":
            y_BTD, stats = self.ffn(h_BTD, axes, sequence_axis(angles))
        else:
            y_BTD, stats = self.ffn(h_BTD, axes), None
        return x_BTD + self.drop(psum(y_BTD, axes.tp), rngs[1], positions_T), stats, max_logit_H

    def decode(self, x_BTD, angles, cache, start):
        """The layer on T new tokens given the latent cache of earlier ones (decode_step)."""
        y_BTD, cache = self.attn.decode(self.attn_norm(x_BTD), angles, cache, start)
        x_BTD = x_BTD + y_BTD
        h_BTD = self.ffn_norm(x_BTD)
        return x_BTD + (self.ffn.decode(h_BTD) if self.kind == "M" else self.ffn(h_BTD)), cache


class Block(nnx.Module):
    def __init__(self, cfg, rngs):
        self.layers = nnx.List([Layer(cfg, kind, rngs) for kind in cfg.block_pattern])
        self.n_experts = cfg.n_experts
        self.sequence_loss = cfg.seq_aux_loss_weight > 0 and "M" in cfg.block_pattern
        self.balancing = cfg.router_bias_rate > 0 and "M" in cfg.block_pattern  # (a frozen bias needs no loads)

    def __call__(self, x_BTD, angles, axes=ONE_DEVICE, rng=None, remat_layers=False):
        """Returns x_BTD and the MoE statistics of this block's MoE layers, summed (with bias balancing also each MoE
        layer's own tokens_per_expert_LE), with max_logit_LH: each layer's largest attention logit per local head (a
        max, not a sum, wherever statistics are combined: parallel/step_core.add_stats). remat_layers: keep only each
        layer's input for the backward pass."""
        stats, tokens_per_expert_LE, max_logit_LH = empty_moe_stats(self.n_experts, self.sequence_loss), [], []
        run_layer = lambda layer, x_BTD, rng: layer(x_BTD, angles, axes, rng)  # noqa: E731
        if remat_layers:
            run_layer = nnx.remat(run_layer)
        for i, layer in enumerate(self.layers):
            x_BTD, layer_stats, max_logit_H = run_layer(layer, x_BTD, None if rng is None else fold_in_rows(rng, i))
            max_logit_LH.append(max_logit_H)
            if layer_stats is not None:
                stats = jax.tree.map(jnp.add, stats, layer_stats)
                tokens_per_expert_LE.append(layer_stats["tokens_per_expert"])
        if self.balancing:
            stats["tokens_per_expert_LE"] = jnp.stack(tokens_per_expert_LE)
        stats["max_logit_LH"] = jnp.stack(max_logit_LH)
        return x_BTD, stats

    def decode(self, x_BTD, angles, caches, start):
        new_caches = []
        for layer, cache in zip(self.layers, caches):
            x_BTD, cache = layer.decode(x_BTD, angles, cache, start)
            new_caches.append(cache)
        return x_BTD, new_caches


# ---- Multi-token prediction (DeepSeek-V3, arXiv:2412.19437 section 2.2)


class MTPModule(nnx.Module):
    """Depth k of sequential multi-token prediction: h'_i = W_h RMSNorm(h^{k-1}_i) + W_e RMSNorm(Emb(t_{i+k})) (V3's
    M_k in two D x D halves), one extra block, and token i+k+1 predicted through the shared output layer with its own
    final norm. The block has dense FFNs only (V3's has an MoE, whose routing would need its own balancing; MTP is
    dropped after training)."""

    def __init__(self, cfg, rngs):
        D = cfg.d_model
        self.hidden_norm = RMSNorm(D, cfg.norm_eps)
        self.embed_norm = RMSNorm(D, cfg.norm_eps)
        self.w_hidden_DD = init_normal(rngs, (D, D), 2 * D)
        self.w_embed_DD = init_normal(rngs, (D, D), 2 * D)
        self.block = Block(dataclasses.replace(cfg, block_pattern="D" * len(cfg.block_pattern)), rngs)
        self.final_norm = RMSNorm(D, cfg.norm_eps)

    def __call__(self, h_BTD, next_embed_BTD, angles, axes=ONE_DEVICE, rng=None):
        x_BTD = (project(self.hidden_norm(h_BTD), self.w_hidden_DD[...])
                 + project(self.embed_norm(next_embed_BTD.astype(h_BTD.dtype)), self.w_embed_DD[...]))
        return self.block(x_BTD, angles, axes, rng)[0]  # (dense layers: no expert axis used)


MTP_RNG_SALT = 2**31 - 1  # dropout keys of the MTP blocks: each row's key folded with salt + depth, apart from the blocks' own
PREFIX_RNG_SALT = 2**30  # dropout keys of the dense prefix: salt + layer, apart from the blocks' (0..N-1) and MTP's


# ---- The Transformer: embedding, dense prefix, N stacked Blocks, final norm, output layer (tied or not).


def padded_vocab(vocab_size, multiple):
    """The embedding is split over `tp` by vocabulary rows, so it is padded to a fixed
    multiple (the same on every mesh, so that every mesh trains the same model)."""
    return multiple * math.ceil(vocab_size / multiple)


def unmasked(tokens):
    """Token ids of rows storing a skipped target as ~id < 0, a document's first token with SEGMENT_START (ops/packing.py)."""
    return jnp.maximum(tokens, ~tokens) & (SEGMENT_START - 1)


class Transformer(nnx.Module):
    def __init__(self, cfg, rngs):
        self.cfg = cfg
        V = padded_vocab(cfg.vocab_size, cfg.vocab_multiple)
        # Tied embedding: rows are token vectors in, and the output layer out. A logit is at
        # most its row's norm (see `logits`): rows of norm embed_row_norm keep the untrained
        # model near a uniform guess (how 2 was chosen: docs/benchmarks.md).
        self.embed_VD = init_normal(rngs, (V, cfg.d_model), cfg.d_model, cfg.embed_row_norm)

        @nnx.split_rngs(splits=cfg.n_blocks)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs):
            return Block(cfg, rngs)

        self.blocks = make_blocks(rngs)  # every weight has a leading axis N (blocks)
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        # Made last, so the weights above are the same with or without MTP.
        self.mtp = nnx.List([MTPModule(cfg, rngs) for _ in range(cfg.mtp_depth)]) if cfg.mtp_depth else None
        if not cfg.tie_embeddings:
            # A separate output layer (DeepSeek's lm_head), made after everything else so that
            # every other weight is the tied model's; its rows start as the tied rows do.
            self.head_VD = init_normal(rngs, (V, cfg.d_model), cfg.d_model, cfg.embed_row_norm)
        # The dense prefix (DeepSeek's first_k_dense_replace layers), made after MTP and the head
        # for the same reason. Not stacked (no N dim): it runs on the first pipeline stage only.
        self.prefix = nnx.List([Layer(cfg, "D", rngs) for _ in range(cfg.first_dense)]) if cfg.first_dense else None

    @jax.named_scope("embedding")
    def embed(self, tokens_BT, axes=ONE_DEVICE):
        """Vocab-parallel lookup: each tp device holds rows [offset, offset + V/tp) and
        contributes the rows it has (zeros elsewhere); a psum assembles the vectors."""
        table_VD = self.embed_VD[...]
        offset = axis_index(axes.tp) * table_VD.shape[0]
        local_BT = tokens_BT - offset
        mine_BT = (local_BT >= 0) & (local_BT < table_VD.shape[0])
        x_BTD = jnp.where(mine_BT[..., None], table_VD[jnp.clip(local_BT, 0, table_VD.shape[0] - 1)], 0)
        return psum(x_BTD, axes.tp)

    def run_prefix(self, x_BTD, angles, axes=ONE_DEVICE, keys_B=None, remat="none"):
        """The dense prefix on the embedded x_BTD (a no-op without one). Layer i's dropout
        keys are each row's key folded with PREFIX_RNG_SALT + i. remat: what the backward
        pass keeps of each prefix layer, as apply_blocks keeps of a block."""
        for i, layer in enumerate(self.prefix or ()):
            layer_def, layer_state = nnx.split(layer)  # (a pure function of the weights: callable under any jax transform)

            def run(state, x_BTD, keys_B):
                return nnx.merge(layer_def, state)(x_BTD, angles, axes, keys_B)[0]
            x_BTD = remat_block(run, remat, prefix=True)(layer_state, x_BTD,
                                                         None if keys_B is None else fold_in_rows(keys_B, PREFIX_RNG_SALT + i))
        return x_BTD

    def embed_and_prefix(self, tokens_BT1, angles, axes=ONE_DEVICE, keys_B=None, remat="none", stream=None):
        """What the first pipeline stage does to rows of tokens [B, T + 1] (inputs and targets): this device's inputs
        (under cp, its chunks') embedded, in the compute dtype, through the dense prefix. `stream`: a layout
        constraint on the residual stream (parallel/auto.py's), applied after each part."""
        stream = stream or (lambda x: x)
        x_BTD = stream(self.embed(local_inputs(unmasked(tokens_BT1), held_positions(angles)), axes).astype(self.cfg.dtype))
        return x_BTD if self.prefix is None else stream(self.run_prefix(x_BTD, angles, axes, keys_B, remat))

    def logits(self, x_BTD, norm=None):
        """Output layer: the tied embedding, or the separate head (the local vocabulary rows under tp, either way:
        vocab-parallel logits). `norm`: the final norm to apply (an MTP depth has its own)."""
        # Scaled by 1/sqrt(D): the normed x has norm sqrt(D), so a logit is the row's norm (embed_row_norm at init)
        # times cos(x, row): ~N(0, norm^2/D) at init. A model imported from Hugging Face (final_norm_folded) has that
        # factor in its final norm's scale, HF's weight as it was: x 1/sqrt(D) does not round-trip.
        if norm is None and self.cfg.final_norm_folded:
            x_BTD = self.final_norm(x_BTD)
        else:
            x_BTD = (norm or self.final_norm)(x_BTD) / math.sqrt(x_BTD.shape[-1])
        # (in x's dtype: the sharded step hands the table over in float32, parallel/fsdp.gather_top)
        table_VD = self.embed_VD[...] if self.cfg.tie_embeddings else self.head_VD[...]
        return jnp.einsum("btd,vd->btv", x_BTD, table_VD.astype(x_BTD.dtype), preferred_element_type=ACC_DTYPE)

    def loss_sum(self, x_BTD, targets_BT, axes=ONE_DEVICE, norm=None, mask_BT=None):
        """Summed token cross-entropy (where mask_BT holds) with vocab-parallel logits
        [B, T, V/tp], never gathered: the max and the sum of exps are reduced over tp, the
        target logit read by the device whose vocabulary slice holds it."""
        logits_BTV = self.logits(x_BTD, norm)
        V_local = logits_BTV.shape[-1]
        offset = axis_index(axes.tp) * V_local
        max_BT = jax.lax.stop_gradient(jnp.max(logits_BTV, axis=-1))
        max_BT = pmax(max_BT, axes.tp)
        sum_exp_BT = psum(jnp.sum(jnp.exp(logits_BTV - max_BT[..., None]), axis=-1), axes.tp)
        # The target logit by a compare with each column, not a gather: its gradient is then elementwise, where a
        # gather's is a scatter into the [B, T, V] cotangent (on a TPU a relayout of it per step: docs/pods.md).
        target_BTV = jnp.arange(V_local) == (targets_BT - offset)[..., None]  # no column where another device holds it
        target_logit_BT = psum(jnp.sum(jnp.where(target_BTV, logits_BTV, 0.0), axis=-1), axes.tp)
        ce_BT = jnp.log(sum_exp_BT) + max_BT - target_logit_BT
        return jnp.sum(ce_BT if mask_BT is None else jnp.where(mask_BT, ce_BT, 0.0))

    def mtp_loss_sum(self, h_BTD, tokens_BT1, angles, axes=ONE_DEVICE, keys_B=None):
        """Summed cross-entropy of every MTP depth from the main model's last hidden state h_BTD (before the final
        norm) of inputs tokens_BT1[:, :-1]. Depth k at position i predicts token i+k+1; positions i >= T-k run on
        padding and are masked out. Under cp h_BTD holds this rank's chunks and tokens_BT1 whole rows (targets read
        across a chunk's end)."""
        B, T1 = tokens_BT1.shape
        T = T1 - 1
        positions_T = token_positions(angles, T)
        chunk_positions_T = held_positions(angles)  # (None: whole rows, read by slices)
        padded_BT = jnp.pad(tokens_BT1, ((0, 0), (0, len(self.mtp))))
        total = jnp.zeros((), jnp.float32)
        for k, module in enumerate(self.mtp, start=1):
            depth_keys_B = None if keys_B is None else fold_in_rows(keys_B, MTP_RNG_SALT + k)
            h_BTD = module(h_BTD, self.embed(unmasked(tokens_at(padded_BT, chunk_positions_T, k, T)), axes), angles, axes,
                           depth_keys_B)  # token i+k at i
            valid_BT = jnp.broadcast_to(positions_T < T - k, (B, positions_T.shape[0]))
            if getattr(angles, "segments_bT", None) is not None:  # packed rows: no target in the next document
                valid_BT &= kernel("packing").targets_in_document(tokens_BT1, chunk_positions_T, k)
            targets_BT = tokens_at(padded_BT, chunk_positions_T, k + 1, T)
            total += self.loss_sum(h_BTD, unmasked(targets_BT), axes, norm=module.final_norm, mask_BT=valid_BT & (targets_BT >= 0))
        return total

    @jax.named_scope("loss_heads")
    def head_sums(self, y_BTD, tokens_BT1, angles, axes=ONE_DEVICE, keys_B=None):
        """What the last pipeline stage does to the blocks' output y_BTD of rows tokens_BT1
        [B, T + 1]: (summed cross-entropy of the next tokens, summed MTP cross-entropy over
        its depths; 0 without MTP). Every executor's loss head."""
        targets_BT = local_targets(tokens_BT1, held_positions(angles))  # (a target < 0 is skipped: unmasked)
        ce = self.loss_sum(y_BTD, unmasked(targets_BT), axes, mask_BT=targets_BT >= 0)
        if self.mtp is None:
            return ce, jnp.zeros((), jnp.float32)
        return ce, self.mtp_loss_sum(y_BTD, tokens_BT1, angles, axes, keys_B)

    def __call__(self, tokens_BT, start=0, return_hidden=False):
        """Plain single-device forward: logits [B, T, V] and MoE statistics per block
        (and the last hidden state before the final norm, which MTP starts from).

        The reference that every sharded and pipelined layout is tested against.
        """
        x_BTD = self.embed(tokens_BT)
        angles = rope_angles(start + jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape), self.cfg)
        x_BTD = self.run_prefix(x_BTD, angles)
        x_BTD, stats_N = apply_blocks(self.blocks, x_BTD, angles, unroll=self.cfg.unroll_blocks)
        return (self.logits(x_BTD), stats_N) + ((x_BTD,) if return_hidden else ())


# ---- Running the stacked blocks


def remat_block(fn, remat, prefix=False):
    """fn with what its backward pass keeps set by --model.remat: block, each call's input (its insides recomputed);
    block_dots, its matmul outputs; none, layer and stage, everything (layer is applied inside the block, stage by the
    executors around all of a stage's blocks). prefix: fn is a dense prefix layer, which keeps its input under layer
    and stage too."""
    if remat == "block" or prefix and remat in ("layer", "stage"):
        return jax.checkpoint(fn)
    if remat == "block_dots":
        return jax.checkpoint(fn, policy=jax.checkpoint_policies.dots_saveable)
    return fn


def scan_blocks(run_block, block_state, x_BTD, remat, unroll):
    """The blocks in order with lax.scan (one compiled body whatever N is), each block's weights used as they are
    stored. run_block(x, weights, index) -> (x, stats). Unrolled, XLA sees every block at once (faster on CPU:
    docs/benchmarks.md); rolled, the compile time does not grow with depth."""
    body = remat_block(lambda x_BTD, state_and_index: run_block(x_BTD, *state_and_index), remat)
    n_blocks = jax.tree.leaves(block_state)[0].shape[0]
    return jax.lax.scan(body, x_BTD, (block_state, jnp.arange(n_blocks)), unroll=n_blocks if unroll else 1)


def apply_blocks(blocks, x_BTD, angles, axes=ONE_DEVICE, rng=None, remat="none", unroll=False, first_block=0, loop=scan_blocks):
    """Run stacked blocks (a Block whose weights carry a leading axis N) in order: (x, each
    block's MoE statistics stacked on N). rng: dropout keys per row [B], folded with each
    block's index in the whole model (first_block + i), so masks do not depend on the stage.
    remat: --model.remat (remat_block). loop(run_block, block_state, x_BTD, remat, unroll):
    how the blocks get their weights; scan_blocks uses them as stored, parallel/fsdp.py's
    loops gather or prefetch each block's FSDP shards just before use."""
    block_def, block_state = nnx.split(blocks)

    def run_block(x_BTD, weights, index):  # (one block's weights, ready to use)
        block_rng = None if rng is None else fold_in_rows(rng, first_block + index)
        return nnx.merge(block_def, weights)(x_BTD, angles, axes, block_rng, remat_layers=remat == "layer")

    return loop(run_block, block_state, x_BTD, remat, unroll)


# ---- Decoding with the latent KV cache


def init_cache(cfg, batch, max_len, dtype=jnp.float32):
    """Per layer of the dense prefix, then per layer of the block pattern: (kv latent [N, B, S, A], RoPE key [N, B, S,
    R]), N = 1 for a prefix layer (so every entry has the same layout: rows are dim 1, positions dim 2)."""
    def entry(n):
        shape = (n, batch, max_len)
        return jnp.zeros(shape + (cfg.kv_latent,), dtype), jnp.zeros(shape + (cfg.rope_dim,), dtype)
    return [entry(1) for _ in range(cfg.first_dense)] + [entry(cfg.n_blocks) for _ in cfg.block_pattern]


def decode_step(model, tokens_BT, cache, start):
    """Logits for tokens at positions start..start+T-1 given the cache of earlier ones.

    Used with T = prompt length once (prefill), then T = 1 per new token. `start` is a
    scalar, or one position per row [B] (the server's slots).
    """
    cfg = model.cfg
    x_BTD = model.embed(tokens_BT)
    positions_BT = jnp.broadcast_to(jnp.reshape(start, (-1, 1)) + jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)
    angles = rope_angles(positions_BT, cfg)
    prefix_cache, cache = list(cache[:cfg.first_dense]), list(cache[cfg.first_dense:])
    for i, layer in enumerate(model.prefix or ()):
        x_BTD, (kv_BSA, rope_BSR) = layer.decode(x_BTD, angles, jax.tree.map(lambda c: c[0], prefix_cache[i]), start)
        prefix_cache[i] = (kv_BSA[None], rope_BSR[None])
    block_def, block_state = nnx.split(model.blocks)

    def body(x_BTD, state_and_cache):
        state, block_cache = state_and_cache
        x_BTD, block_cache = nnx.merge(block_def, state).decode(x_BTD, angles, block_cache, start)
        return x_BTD, block_cache

    x_BTD, cache = jax.lax.scan(body, x_BTD, (block_state, cache))
    return model.logits(x_BTD), prefix_cache + cache


# ---- The model as shapes only (no arrays): for planning, compiling for other machines, counting parameters


def abstract_model(model_cfg):
    """(graphdef, params) with params as ShapeDtypeStructs: exactly the tree that
    parallel/weights.init_params creates, without creating it."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(model_cfg, nnx.Rngs(0))))
    return graphdef, state.to_pure_dict()


def abstract_params(model_cfg):
    return abstract_model(model_cfg)[1]
