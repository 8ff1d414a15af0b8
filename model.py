"""The model: a Mixture-of-Experts transformer with Multi-head Latent Attention.

Read bottom-up: RMSNorm and RoPE, then MLA attention (with its latent KV cache), the
dense FFN, the router and experts that make an MoE layer, the Block, and last the
Transformer that stacks Blocks.

Every layer is written for the *local* shard of its weights: the number of heads,
hidden units or experts is read off the weight shapes, so the same code runs on one
device (full weights) and inside `jax.shard_map` (a tensor-parallel slice). The only
collectives here are the tensor-parallel ones, named by `tp_axis` (None = one device,
no collectives); FSDP, pipeline and data parallelism live in parallel.py.

Shape legend (suffixes of names):
  B batch          T time (queries)    S time (keys) or tokens in a routing group
  D model width    H heads             K head dim (content part)   R head dim (RoPE part)
  Q query latent   A key/value latent (the only thing the KV cache stores, with R)
  F hidden units   E experts           C expert capacity   G routing groups
  V vocabulary     N blocks            X top-k choices    L MoE layers of one block
  P expert groups (group-limited routing)
"""

import dataclasses
import functools
import math
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
from flax import nnx

# ----------------------------------------------------------------------------
# The config this model reads (a section of utils.Config: --model.<field> on the
# command line). It lives beside the model so that model.py stands alone.


def option(default, help):
    """A config field with its one-line explanation (shown by --help)."""
    return field(default=default, metadata={"help": help})


# --model.remat values: model.apply_blocks applies layer / block / block_dots,
# the executors apply stage (around all of a pipeline stage's blocks).
REMAT_POLICIES = ("none", "layer", "block", "block_dots", "stage")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = option(0, "vocabulary size; 0 = take it from the data's manifest")
    vocab_multiple: int = option(128, "pad the vocabulary to a multiple of this (tp splits it)")
    seq_len: int = option(128, "tokens per training sequence (T)")
    d_model: int = option(128, "model width (D)")
    n_heads: int = option(4, "attention heads (H)")
    head_dim: int = option(32, "per-head dim of queries/keys/values, content part (K)")
    rope_dim: int = option(16, "per-head dim of the decoupled RoPE query/key part (R)")
    q_latent: int = option(64, "MLA query latent width (Q)")
    kv_latent: int = option(32, "MLA key/value latent width (A); with R, all the KV cache stores")
    rope_theta: float = option(10000.0, "RoPE base")
    embed_row_norm: float = option(2.0, "norm of the tied embedding's rows at init (std = this / sqrt(D)); "
                                        "the untrained output logits are at most this (model.py)")
    n_blocks: int = option(2, "blocks (N); the pipeline splits blocks over pp")
    block_pattern: str = option("DM", "layers of one block: D = dense FFN, M = MoE FFN")
    d_ff: int = option(512, "hidden units of dense FFN layers (F)")
    ffn_activation: str = option("swiglu", "dense FFN activation: swiglu | gelu")
    n_experts: int = option(8, "routed experts per MoE layer (E)")
    n_shared: int = option(1, "shared experts per MoE layer (see every token)")
    top_k: int = option(2, "routed experts per token")
    d_expert: int = option(128, "hidden units per expert")
    capacity_factor: float = option(1.5, "expert capacity = factor x group tokens x top_k / experts; 0 = dropless")
    router_score: str = option("softmax", "router scores: softmax | sigmoid")
    routing_group: int = option(0, "tokens per routing group (capacity is per group); 0 = seq_len")
    aux_loss_weight: float = option(0.01, "weight of the load-balance loss (Switch)")
    router_bias_rate: float = option(0.0, "aux-loss-free balancing (DeepSeek-V3): after every step each expert's selection bias "
                                          "moves by this towards uniform load; 0 = off (V3 used 0.001)")
    seq_aux_loss_weight: float = option(0.0, "weight of DeepSeek-V3's sequence-wise balance loss (V3 used 0.0001)")
    n_groups: int = option(1, "group-limited routing: split the experts into this many groups (HF n_group); 1 = off")
    topk_groups: int = option(1, "group-limited routing: each token picks experts in its best this-many groups (HF topk_group)")
    routed_scale: float = option(1.0, "multiply the routed experts' output by this (DeepSeek-V3 routed_scaling_factor)")
    final_norm_folded: bool = option(False, "the final norm's scale holds the logits' 1/sqrt(D) (set by --train.init_from hf:, "
                                            "which keeps HF's norm weight bit for bit); false = logits of final_norm(x) / sqrt(D)")
    mtp_depth: int = option(0, "multi-token prediction (DeepSeek-V3): extra blocks predicting tokens 2..depth+1 ahead, "
                               "trained with the rest, ignored by sampling and eval; 0 = off")
    mtp_loss_weight: float = option(0.3, "weight of the MTP loss (mean over depths; V3 used 0.3, later 0.1)")
    dropout: float = option(0.0, "dropout on residual branches")
    dtype: str = option("bfloat16", "compute dtype: float32 | bfloat16 (weights, Adam and softmax/norms stay float32)")
    grad_reduce_dtype: str = option("float32", "dtype of the gradient reductions (FSDP reduce-scatters, psums of replicated "
                                               "weights): float32 | bfloat16 (halves their bytes, loses precision)")
    attention: str = option("matmul", "attention kernel: matmul (softmax of explicit scores; fastest on CPU) | "
                                      "dot_product_attention (jax.nn's, cuDNN flash attention on GPU)")
    remat: str = option("none", "rematerialisation, what the backward pass recomputes: none | layer (each layer from its input) | "
                                "block (each block from its input) | block_dots (each block, keeping its matmul outputs) | "
                                "stage (all of a pipeline stage's blocks, per microbatch, from the stage input)")
    unroll_blocks: bool = option(True, "unroll the loop over blocks (faster here); false = lax.scan (compile time flat in depth)")


# ----------------------------------------------------------------------------
# Building blocks

# Softmax and norms run in float32 whatever the compute dtype: they are cheap and
# bfloat16 would lose the small differences between large logits.
ACC_DTYPE = jnp.float32


def init_normal(rngs, shape, fan_in, scale=1.0):
    """Weights ~ N(0, scale^2 / fan_in): keeps activations at unit scale at any width."""
    return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32) * (scale / math.sqrt(fan_in)))


def residual_scale(cfg):
    """Output projections of residual branches start small, 1/sqrt(2 x layers) (GPT-2),
    so the residual stream does not grow with depth. (Not zero: a zero projection
    would give every weight before it a zero gradient at step 0.)"""
    return 1.0 / math.sqrt(2 * cfg.n_blocks * len(cfg.block_pattern))


def project(x, w, n_in=1):
    """Contract x's last `n_in` dims with w's first `n_in` dims: x [..., I] @ w [I, O...].

    The leading dims of x are flattened into one row dim before the matmul. Why: XLA:CPU
    computes the weight gradient of a matmul whose rows span two dims (B and T) about 3x
    slower than the same product with one row dim (a SwiGLU FFN on [16, 128, 128] with
    F = 512, forward + backward: 48.6 ms vs 14.9 ms). The product accumulates in float32,
    which for bfloat16 inputs is both more accurate and, on CPU, the fast path (363 vs
    161 GFLOP/s at 2048^3), and comes back in x's dtype.
    """
    lead, inner = x.shape[:x.ndim - n_in], x.shape[x.ndim - n_in:]
    rows_NI = x.reshape(-1, math.prod(inner))
    w_IO = w.reshape(math.prod(inner), -1).astype(x.dtype)
    y_NO = jnp.dot(rows_NI, w_IO, preferred_element_type=ACC_DTYPE).astype(x.dtype)
    return y_NO.reshape(*lead, *w.shape[n_in:])


def is_auto_axis(axis):
    """Is `axis` a mesh axis that the compiler partitions (jit under auto axes, as in
    executor_auto.py) rather than one that shard_map makes manual?"""
    mesh = jax.sharding.get_abstract_mesh()
    return dict(zip(mesh.axis_names, mesh.axis_types)).get(axis) == jax.sharding.AxisType.Auto


def live_axes(axes):
    """The mesh axes among `axes` (None, a name or a tuple of names) that a collective
    must cross here: those shard_map made manual with more than one device. An axis of
    size 1 holds everything already, yet XLA:CPU keeps a psum over it as an all-reduce
    that copies its operand (on one device the default step ran 32 of them, 19 MB).
    Skipping one is exact only when nothing is typed as varying over that axis: the
    steps give shard_map specs without size-1 axes (parallel.live_spec), so values are
    invariant over those and need no collective to become so."""
    mesh = jax.sharding.get_abstract_mesh()
    if axes is None or mesh.empty:
        return ()
    sizes = {name: size for name, size, kind in zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types)
             if kind == jax.sharding.AxisType.Manual}
    return tuple(a for a in ((axes,) if isinstance(axes, str) else axes) if sizes.get(a, 1) > 1)


def psum_if(x, axes):
    """Sum over mesh axes inside shard_map, only those with more than one device
    (live_axes); on one device (axes None or all of size 1) a no-op."""
    axes = live_axes(axes)
    return jax.lax.psum(x, axes) if axes else x


def pmax_if(x, axes):
    axes = live_axes(axes)
    return jax.lax.pmax(x, axes) if axes else x


def axis_index(axis):
    """This device's index along a mesh axis; 0 (a constant, not varying) on one device."""
    return jax.lax.axis_index(axis) if live_axes(axis) else 0


# ----------------------------------------------------------------------------
# Small pieces


class RMSNorm(nnx.Module):
    def __init__(self, dim, eps=1e-6):
        self.scale_D = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x_BTD):
        x = x_BTD.astype(ACC_DTYPE)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return (x * self.scale_D[...].astype(ACC_DTYPE)).astype(x_BTD.dtype)


def rope_angles(positions_BT, rope_dim, theta):
    """Rotation angles [B, T, R/2] for rotary embeddings (Su et al. 2021).

    Computed once per forward and applied to queries *and* keys, so the two can never
    use different frequencies; the score then depends only on relative position.
    """
    inv_freq = theta ** (-jnp.arange(0, rope_dim, 2, dtype=jnp.float32) / rope_dim)
    return positions_BT.astype(jnp.float32)[..., None] * inv_freq


def apply_rope(x_BTxR, angles_BTR2):
    """Rotate pairs (x[2i], x[2i+1]) by angle[i]; x may have a head axis before R."""
    if x_BTxR.ndim == 4:  # [B, T, H, R]: the same angle for every head
        angles_BTR2 = angles_BTR2[:, :, None, :]
    cos, sin = jnp.cos(angles_BTR2), jnp.sin(angles_BTR2)
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
        self.wq_down_DQ = init_normal(rngs, (D, Q), D)
        self.q_norm = RMSNorm(Q)
        self.wq_up_QHK = init_normal(rngs, (Q, H, K), Q)
        self.wq_rope_QHR = init_normal(rngs, (Q, H, R), Q)
        self.wkv_down_DA = init_normal(rngs, (D, A), D)
        self.kv_norm = RMSNorm(A)
        self.wk_rope_DR = init_normal(rngs, (D, R), D)
        self.wk_up_AHK = init_normal(rngs, (A, H, K), A)
        self.wv_up_AHK = init_normal(rngs, (A, H, K), A)
        self.wo_HKD = init_normal(rngs, (H, K, D), H * K, residual_scale(cfg))
        self.softmax_scale = 1.0 / math.sqrt(K + R)
        self.implementation = cfg.attention

    def queries(self, x_BTD, angles):
        q_BTQ = self.q_norm(project(x_BTD, self.wq_down_DQ[...]))
        q_nope_BTHK = project(q_BTQ, self.wq_up_QHK[...])
        q_rope_BTHR = apply_rope(project(q_BTQ, self.wq_rope_QHR[...]), angles)
        return q_nope_BTHK, q_rope_BTHR

    def latents(self, x_BTD, angles):
        """What the cache stores: the normalised KV latent and the shared RoPE key."""
        kv_BTA = self.kv_norm(project(x_BTD, self.wkv_down_DA[...]))
        k_rope_BTR = apply_rope(project(x_BTD, self.wk_rope_DR[...]), angles)
        return kv_BTA, k_rope_BTR

    def __call__(self, x_BTD, angles, tp_axis=None):
        """Causal self-attention over a whole sequence (training and eval)."""
        B, T, _ = x_BTD.shape
        q_nope_BTHK, q_rope_BTHR = self.queries(x_BTD, angles)
        kv_BSA, k_rope_BSR = self.latents(x_BTD, angles)
        k_nope_BSHK = project(kv_BSA, self.wk_up_AHK[...])
        v_BSHK = project(kv_BSA, self.wv_up_AHK[...])
        if self.implementation == "dot_product_attention":
            out_BTHK = self.fused_attention(q_nope_BTHK, q_rope_BTHR, k_nope_BSHK, k_rope_BSR, v_BSHK)
        else:
            # Heads-major layout, so each product is a batch of plain 2-D matmuls (on
            # this CPU the forward runs 2x faster than with einsums over [B, T, H, K]).
            q_nope_BHTK, v_BHSK = q_nope_BTHK.transpose(0, 2, 1, 3), v_BSHK.transpose(0, 2, 1, 3)
            scores_BHTS = jnp.matmul(q_nope_BHTK, k_nope_BSHK.transpose(0, 2, 3, 1), preferred_element_type=ACC_DTYPE)
            # The RoPE key is shared by every head: rows (h, t) of one sequence meet the same keys.
            q_rope_BNR = q_rope_BTHR.transpose(0, 2, 1, 3).reshape(B, -1, q_rope_BTHR.shape[-1])
            scores_BHTS += jnp.matmul(q_rope_BNR, k_rope_BSR.transpose(0, 2, 1), preferred_element_type=ACC_DTYPE).reshape(scores_BHTS.shape)
            causal_TS = jnp.tril(jnp.ones((T, T), bool))
            scores_BHTS = jnp.where(causal_TS, scores_BHTS * self.softmax_scale, -jnp.inf)
            probs_BHTS = jax.nn.softmax(scores_BHTS, axis=-1).astype(x_BTD.dtype)
            out_BTHK = jnp.matmul(probs_BHTS, v_BHSK, preferred_element_type=ACC_DTYPE).astype(x_BTD.dtype).transpose(0, 2, 1, 3)
        # Tensor parallel: each device holds H/tp heads, so this is a partial sum over
        # heads; the psum (an all-reduce over `tp`) completes it (Megatron, row-parallel).
        return psum_if(project(out_BTHK, self.wo_HKD[...], n_in=2), tp_axis)

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
        y_BTD = project(out_BTHK, self.wo_HKD[...], n_in=2)
        return y_BTD, (kv_cache_BSA, rope_cache_BSR)


def write_at(cache_BSX, new_BTX, start):
    """cache[b, start_b : start_b + T] = new[b], with start a scalar or one per row [B]."""
    new_BTX = new_BTX.astype(cache_BSX.dtype)
    if jnp.ndim(start) == 0:
        return jax.lax.dynamic_update_slice_in_dim(cache_BSX, new_BTX, start, 1)
    return jax.vmap(lambda c_SX, n_TX, s: jax.lax.dynamic_update_slice_in_dim(c_SX, n_TX, s, 0))(cache_BSX, new_BTX, start)


# ----------------------------------------------------------------------------
# Feed-forward: dense (SwiGLU or GELU), and the experts of an MoE layer


class DenseFFN(nnx.Module):
    """SwiGLU (Shazeer 2020) or GELU MLP. Under tensor parallelism F is split: the up
    projections are column-parallel and the down projection row-parallel, so one psum
    at the end completes the output."""

    def __init__(self, d_model, d_hidden, activation, rngs, out_scale):
        self.activation = activation
        if activation == "swiglu":
            self.w_gate_DF = init_normal(rngs, (d_model, d_hidden), d_model)
        self.w_up_DF = init_normal(rngs, (d_model, d_hidden), d_model)
        self.w_down_FD = init_normal(rngs, (d_hidden, d_model), d_hidden, out_scale)

    def __call__(self, x_BTD):  # partial sum over F when F is split: caller psums
        up_BTF = project(x_BTD, self.w_up_DF[...])
        if self.activation == "swiglu":
            hidden_BTF = jax.nn.silu(project(x_BTD, self.w_gate_DF[...])) * up_BTF
        else:
            hidden_BTF = jax.nn.gelu(up_BTF)
        return project(hidden_BTF, self.w_down_FD[...])


class RouterBias(nnx.Variable):
    """A per-expert bias added to the routing scores for the top-k *selection* only
    (DeepSeek-V3's aux-loss-free balancing, arXiv:2412.19437 section 2.1.2). Train state
    but not a trained weight: no gradient reaches it (it only picks indices) and the
    optimizer leaves it alone; `balanced_bias` moves it after every step."""


def limit_to_top_groups(choice_SE, n_groups, topk_groups):
    """Group-limited routing (DeepSeek-V2 section 2.1.3, V3's node-limited routing):
    experts are split into n_groups contiguous groups; each token keeps only the
    experts of its topk_groups best groups, a group's score being the sum of its two
    highest (biased) scores (V3; HF's DeepseekV3TopkRouter does the same). The other
    experts get -inf, so the top-k that follows picks inside the kept groups.

    With expert parallelism, device d of dp holds experts [d E/dp, (d+1) E/dp): when
    n_groups = dp a group is one device's experts, so a token's choices land on at
    most topk_groups devices. (Our all_to_all still moves fixed-size capacity buffers
    to every device, so here that bounds where tokens go, not the bytes sent.)
    """
    S, E = choice_SE.shape
    by_group_SPE = choice_SE.reshape(S, n_groups, E // n_groups)
    group_score_SP = jnp.sum(jax.lax.top_k(by_group_SPE, 2)[0], axis=-1)
    _, top_groups_SX = jax.lax.top_k(group_score_SP, topk_groups)
    kept_SP = jnp.any(jnp.arange(n_groups)[None, :, None] == top_groups_SX[:, None, :], axis=-1)
    return jnp.where(jnp.repeat(kept_SP, E // n_groups, axis=1), choice_SE, -jnp.inf)


def top_k_routing(x_SD, router_DE, top_k, score, bias_E=None, n_groups=1, topk_groups=1, routed_scale=1.0):
    """Router: each token picks its top_k experts; gates are normalised to sum to 1.

    Returns gates_SX, experts_SX (int) and probs_SE (normalised scores, for the
    load-balance loss). With top_k = 1 the gate is the raw score (Switch Transformer). Routing runs in float32: a tie broken differently in bfloat16
    would send a token elsewhere.
    DeepSeek-V3 options: bias_E shifts the scores that *select* experts, while the
    gates come from the unbiased scores; n_groups > 1 limits each token to its
    topk_groups best expert groups; routed_scale multiplies the gates (V3's
    routed_scaling_factor), i.e. the routed experts' output.
    """
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
    if top_k == 1:  # (normalising one score would make every gate 1: no gradient for the router)
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
    """blocks (a pure dict of stacked block params) with every MoE layer's
    router_bias_E moved by `balanced_bias`; MoE layer l of a block is the l-th "M" of
    its pattern."""
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
    """Give every (token, choice) a slot in its expert's buffer, or drop it.

    Priority is token order (then choice order within a token): a token competes for a
    slot only with the tokens before it, so what is dropped at position t never depends
    on later tokens and the model stays causal. (Choice-major priority, all first
    choices before any second choice, would let a later token's first choice evict an
    earlier token's second choice: the future would leak into the past.)
    Done by a stable sort: O(S*X log(S*X)), no [S, E, C] one-hot.
    Returns slot_SX (e * capacity + position; n_experts * capacity when dropped),
    kept_SX and tokens_per_expert_E (demand before dropping).
    """
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
    """Switch Transformer auxiliary loss, E * sum_e f_e * P_e (arXiv:2101.03961 eq. 4).

    f_e is the fraction of the group's top-k assignments that chose expert e, P_e the
    mean router probability. Both are 1/E under perfectly uniform routing, where the
    loss takes its minimum value of 1.
    """
    S, E = probs_SE.shape
    fraction_E = tokens_per_expert_E.astype(ACC_DTYPE) / (S * top_k)
    return E * jnp.sum(fraction_E * jnp.mean(probs_SE, axis=0))


def sequence_balance_loss(probs_BTE, experts_BTX, n_experts):
    """DeepSeek-V3's sequence-wise balance loss (eq. 17-20), summed over sequences:
    the Switch formula above with f and P taken over each whole sequence. (With the
    default --model.routing_group, one group per sequence, it is the same number as
    the Switch loss; it differs when routing groups are shorter.)"""
    tokens_per_expert_BE = jax.vmap(lambda e: jnp.zeros((n_experts,), jnp.int32).at[e.reshape(-1)].add(1))(experts_BTX)
    return jnp.sum(jax.vmap(load_balance_loss, (0, 0, None))(probs_BTE, tokens_per_expert_BE, experts_BTX.shape[-1]))


class MoE(nnx.Module):
    """Shared experts (see every token) + top-k routed experts (DeepSeekMoE).

    Tokens are routed in groups of `group_size` consecutive tokens of one sequence.
    Capacity and dropping are decided per group, and groups never straddle sequences,
    so which tokens are dropped does not depend on how the batch is split over
    devices.
    """

    def __init__(self, cfg, rngs):
        D, E, F = cfg.d_model, cfg.n_experts, cfg.d_expert
        self.top_k, self.score = cfg.top_k, cfg.router_score
        self.capacity_factor = cfg.capacity_factor
        self.group_size = cfg.routing_group or cfg.seq_len
        self.router_DE = init_normal(rngs, (D, E), D)
        self.router_bias_E = RouterBias(jnp.zeros((E,), jnp.float32)) if cfg.router_bias_rate > 0 else None
        self.n_groups, self.topk_groups, self.routed_scale = cfg.n_groups, cfg.topk_groups, cfg.routed_scale
        self.sequence_loss = cfg.seq_aux_loss_weight > 0
        self.w_gate_EDF = init_normal(rngs, (E, D, F), D)
        self.w_up_EDF = init_normal(rngs, (E, D, F), D)
        self.w_down_EFD = init_normal(rngs, (E, F, D), F, residual_scale(cfg))
        self.shared = DenseFFN(D, cfg.n_shared * F, "swiglu", rngs, residual_scale(cfg)) if cfg.n_shared else None

    def route(self, x_GSD):
        """top_k_routing of each group: (gates_GSX, experts_GSX, probs_GSE)."""
        bias_E = None if self.router_bias_E is None else self.router_bias_E[...]
        route = functools.partial(top_k_routing, top_k=self.top_k, score=self.score, bias_E=bias_E, n_groups=self.n_groups,
                                  topk_groups=self.topk_groups, routed_scale=self.routed_scale)
        return jax.vmap(route, (0, None))(x_GSD, self.router_DE[...])

    def expert_ffn(self, x_GECD):
        """SwiGLU of each local expert on its buffer of tokens.

        Each expert's slots of all groups become one row dim N = G x C, so every matmul is
        a batch (over E) of plain 2-D products (see `project` for why that is faster)."""
        G, E, C, D = x_GECD.shape
        x_END = x_GECD.transpose(1, 0, 2, 3).reshape(E, G * C, D)

        def expert_matmul(x_ENI, w_EIO):
            return jnp.einsum("eni,eio->eno", x_ENI, w_EIO.astype(x_ENI.dtype), preferred_element_type=ACC_DTYPE).astype(x_ENI.dtype)

        hidden_ENF = jax.nn.silu(expert_matmul(x_END, self.w_gate_EDF[...])) * expert_matmul(x_END, self.w_up_EDF[...])
        y_END = expert_matmul(hidden_ENF, self.w_down_EFD[...])
        return y_END.reshape(E, G, C, D).transpose(1, 0, 2, 3)

    def routed_with_capacity(self, x_GSD, gates_GSX, experts_GSX, n_experts, ep_axis):
        G, S, D = x_GSD.shape
        capacity = expert_capacity(S, self.top_k, n_experts, self.capacity_factor)
        slot_GSX, kept_GSX, tokens_per_expert_GE = jax.vmap(assign_slots, (0, None, None))(experts_GSX, n_experts, capacity)

        def fill_slots(x_SD, slot_SX):  # gather tokens into [E*C] slots; empty slots read a zero row
            token_for_slot = jnp.full((n_experts * capacity,), S, jnp.int32)
            token_for_slot = token_for_slot.at[slot_SX].set(jnp.broadcast_to(jnp.arange(S)[:, None], slot_SX.shape), mode="drop")
            return jnp.concatenate([x_SD, jnp.zeros((1, D), x_SD.dtype)])[token_for_slot]

        x_GECD = jax.vmap(fill_slots)(x_GSD, slot_GSX).reshape(G, n_experts, capacity, D)
        if ep_axis is None or not (is_auto_axis(ep_axis) or live_axes(ep_axis)):  # one expert group: nothing to send
            y_GECD = self.expert_ffn(x_GECD)
        elif is_auto_axis(ep_axis):
            # Automatic sharding (executor_auto.py): only say that each expert's slots
            # should sit where the expert lives (experts over ep_axis, every group);
            # the compiler inserts the dispatch there and back.
            by_expert = jax.sharding.PartitionSpec(None, ep_axis)
            x_GECD = jax.lax.with_sharding_constraint(x_GECD, by_expert)
            y_GECD = jax.lax.with_sharding_constraint(self.expert_ffn(x_GECD), by_expert)
        else:
            # Expert parallelism: this device holds E/dp experts. all_to_all sends each
            # expert's slots to the device that owns it (split E, stack groups), the
            # experts run, and the inverse all_to_all brings the results home.
            x_GECD = jax.lax.all_to_all(x_GECD, ep_axis, split_axis=1, concat_axis=0, tiled=True)
            y_GECD = self.expert_ffn(x_GECD)
            y_GECD = jax.lax.all_to_all(y_GECD, ep_axis, split_axis=0, concat_axis=1, tiled=True)

        def combine(y_ECD, slot_SX, gates_SX, kept_SX):  # each token sums its k expert outputs
            y_slots = jnp.concatenate([y_ECD.reshape(-1, D), jnp.zeros((1, D), y_ECD.dtype)])
            weights_SX = jnp.where(kept_SX, gates_SX, 0.0).astype(y_ECD.dtype)
            return jnp.einsum("sxd,sx->sd", y_slots[slot_SX], weights_SX)

        y_GSD = jax.vmap(combine)(y_GECD, slot_GSX, gates_GSX, kept_GSX)
        dropped = jnp.sum(~kept_GSX)
        return y_GSD, tokens_per_expert_GE, dropped

    def routed_dropless(self, x_GSD, gates_GSX, experts_GSX, n_experts):
        """No capacity: sort all (token, choice) pairs by expert and run a grouped
        matmul (jax.lax.ragged_dot) over the contiguous runs of each expert."""
        G, S, D = x_GSD.shape
        X = self.top_k
        experts_N = experts_GSX.reshape(-1)
        order = jnp.argsort(experts_N, stable=True)
        token_of_pair = jnp.arange(G * S * X) // X
        x_ND = x_GSD.reshape(G * S, D)[token_of_pair[order]]
        tokens_per_expert_E = jnp.zeros((n_experts,), jnp.int32).at[experts_N].add(1)
        gate = jax.lax.ragged_dot(x_ND, self.w_gate_EDF[...], tokens_per_expert_E)
        up = jax.lax.ragged_dot(x_ND, self.w_up_EDF[...], tokens_per_expert_E)
        y_ND = jax.lax.ragged_dot(jax.nn.silu(gate) * up, self.w_down_EFD[...], tokens_per_expert_E)
        y_pairs = jnp.zeros_like(y_ND).at[order].set(y_ND).reshape(G, S, X, D)
        y_GSD = jnp.einsum("gsxd,gsx->gsd", y_pairs, gates_GSX.astype(y_pairs.dtype))
        tokens_per_expert_GE = jax.vmap(lambda e: jnp.zeros((n_experts,), jnp.int32).at[e.reshape(-1)].add(1))(experts_GSX)
        return y_GSD, tokens_per_expert_GE, jnp.zeros((), jnp.int32)

    def __call__(self, x_BTD, tp_axis=None, ep_axis=None):
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
            y_GSD, tokens_per_expert_GE, dropped = self.routed_with_capacity(x_GSD, gates_GSX, experts_GSX, n_experts, ep_axis)
        else:
            y_GSD, tokens_per_expert_GE, dropped = self.routed_dropless(x_GSD, gates_GSX, experts_GSX, n_experts)
        y_BTD = y_GSD.reshape(B, T, D)
        if self.shared is not None:
            y_BTD = y_BTD + self.shared(x_BTD)
        aux_G = jax.vmap(load_balance_loss, (0, 0, None))(probs_GSE, tokens_per_expert_GE, self.top_k)
        stats = dict(aux_loss_sum=jnp.sum(aux_G), tokens_per_expert=jnp.sum(tokens_per_expert_GE, 0),
                     dropped=dropped, groups=jnp.asarray(x_GSD.shape[0], jnp.int32))
        if self.sequence_loss:
            stats["seq_aux_loss_sum"] = sequence_balance_loss(probs_GSE.reshape(B, T, n_experts), experts_GSX.reshape(B, T, -1), n_experts)
        return y_BTD, stats

    def decode(self, x_BTD):
        """Inference: every token gets all of its top-k experts (no capacity)."""
        B, T, D = x_BTD.shape
        x_GSD = x_BTD.reshape(B * T, 1, D)
        gates_GSX, experts_GSX, _ = self.route(x_GSD)
        y_GSD, _, _ = self.routed_dropless(x_GSD, gates_GSX, experts_GSX, self.router_DE[...].shape[1])
        y_BTD = y_GSD.reshape(B, T, D)
        return y_BTD + self.shared(x_BTD) if self.shared is not None else y_BTD


# ----------------------------------------------------------------------------
# Block: a short pattern of layers, e.g. "DDDDDM" = five dense layers, then one MoE.


def fold_in_rows(keys_B, data):
    """fold_in for a batch of keys, one per sequence: the dropout keys of a row are
    derived from (seed, step, global row) by step_core.dropout_rows, then from the block,
    the layer and the branch here. So a mask never depends on the mesh or the pipeline
    schedule, only on what it masks."""
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
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = MLAttention(cfg, rngs)
        self.ffn_norm = RMSNorm(cfg.d_model)
        self.ffn = MoE(cfg, rngs) if kind == "M" else DenseFFN(cfg.d_model, cfg.d_ff, cfg.ffn_activation, rngs, residual_scale(cfg))
        self.dropout = cfg.dropout

    def drop(self, x_BTD, keys_B):
        """Dropout on a residual branch's output. The mask of row b is drawn from its own
        key over the whole [T, D] of that row: every tp device holds the same residual
        stream and the same keys, so it draws the same mask (no tp-varying rng)."""
        if self.dropout == 0 or keys_B is None:
            return x_BTD
        keep_BTD = jax.vmap(lambda key: jax.random.bernoulli(key, 1 - self.dropout, x_BTD.shape[1:]))(keys_B)
        return jnp.where(keep_BTD, x_BTD / (1 - self.dropout), 0).astype(x_BTD.dtype)

    def __call__(self, x_BTD, angles, tp_axis=None, ep_axis=None, rng=None):
        """rng: dropout keys, one per batch row [B] (see fold_in_rows), or None = no dropout."""
        rngs = (fold_in_rows(rng, 0), fold_in_rows(rng, 1)) if rng is not None else (None, None)
        x_BTD = x_BTD + self.drop(self.attn(self.attn_norm(x_BTD), angles, tp_axis), rngs[0])
        h_BTD = self.ffn_norm(x_BTD)
        if self.kind == "M":
            y_BTD, stats = self.ffn(h_BTD, tp_axis, ep_axis)
        else:
            y_BTD, stats = self.ffn(h_BTD), None
        return x_BTD + self.drop(psum_if(y_BTD, tp_axis), rngs[1]), stats


class Block(nnx.Module):
    def __init__(self, cfg, rngs):
        self.layers = nnx.List([Layer(cfg, kind, rngs) for kind in cfg.block_pattern])
        self.n_experts = cfg.n_experts
        self.sequence_loss = cfg.seq_aux_loss_weight > 0 and "M" in cfg.block_pattern
        self.balancing = cfg.router_bias_rate > 0 and "M" in cfg.block_pattern

    def __call__(self, x_BTD, angles, tp_axis=None, ep_axis=None, rng=None, remat_layers=False):
        """Returns x_BTD and the MoE statistics of this block's MoE layers, summed
        (with bias balancing also each MoE layer's own tokens_per_expert_LE).
        remat_layers: keep only each layer's input for the backward pass."""
        stats, tokens_per_expert_LE = empty_moe_stats(self.n_experts, self.sequence_loss), []
        run_layer = lambda layer, x_BTD, rng: layer(x_BTD, angles, tp_axis, ep_axis, rng)  # noqa: E731
        if remat_layers:
            run_layer = nnx.remat(run_layer)
        for i, layer in enumerate(self.layers):
            x_BTD, layer_stats = run_layer(layer, x_BTD, None if rng is None else fold_in_rows(rng, i))
            if layer_stats is not None:
                stats = jax.tree.map(jnp.add, stats, layer_stats)
                tokens_per_expert_LE.append(layer_stats["tokens_per_expert"])
        if self.balancing:
            stats["tokens_per_expert_LE"] = jnp.stack(tokens_per_expert_LE)
        return x_BTD, stats

    def decode(self, x_BTD, angles, caches, start):
        new_caches = []
        for layer, cache in zip(self.layers, caches):
            y_BTD, cache = layer.attn.decode(layer.attn_norm(x_BTD), angles, cache, start)
            x_BTD = x_BTD + y_BTD
            h_BTD = layer.ffn_norm(x_BTD)
            x_BTD = x_BTD + (layer.ffn.decode(h_BTD) if layer.kind == "M" else layer.ffn(h_BTD))
            new_caches.append(cache)
        return x_BTD, new_caches


# ----------------------------------------------------------------------------
# Multi-token prediction (DeepSeek-V3, arXiv:2412.19437 section 2.2)


class MTPModule(nnx.Module):
    """Depth k of sequential multi-token prediction: at position i it combines the
    previous depth's hidden state h^{k-1}_i with the embedding of token i+k,
    h'_i = W_h RMSNorm(h^{k-1}_i) + W_e RMSNorm(Emb(t_{i+k})) (V3's M_k [.; .], split in
    two D x D halves), runs one extra block, and predicts token i+k+1 through the shared
    embedding and output layer (with its own final norm). The embedding and head are
    the main model's. The block is the model's block pattern with dense FFNs only (V3's
    has an MoE layer): its routing would need its own balancing, and it is thrown away
    after training anyway (sampling and eval ignore it)."""

    def __init__(self, cfg, rngs):
        D = cfg.d_model
        self.hidden_norm = RMSNorm(D)
        self.embed_norm = RMSNorm(D)
        self.w_hidden_DD = init_normal(rngs, (D, D), 2 * D)
        self.w_embed_DD = init_normal(rngs, (D, D), 2 * D)
        self.block = Block(dataclasses.replace(cfg, block_pattern="D" * len(cfg.block_pattern)), rngs)
        self.final_norm = RMSNorm(D)

    def __call__(self, h_BTD, next_embed_BTD, angles, tp_axis=None, rng=None):
        x_BTD = (project(self.hidden_norm(h_BTD), self.w_hidden_DD[...])
                 + project(self.embed_norm(next_embed_BTD.astype(h_BTD.dtype)), self.w_embed_DD[...]))
        return self.block(x_BTD, angles, tp_axis, None, rng)[0]


MTP_RNG_SALT = 2**31 - 1  # dropout keys of the MTP blocks: each row's key folded with salt + depth, apart from the blocks' own


# ----------------------------------------------------------------------------
# The Transformer: embedding, N stacked Blocks, final norm, tied output layer.


def padded_vocab(vocab_size, multiple):
    """The embedding is split over `tp` by vocabulary rows, so it is padded to a fixed
    multiple (the same on every mesh, so that every mesh trains the same model)."""
    return multiple * math.ceil(vocab_size / multiple)


class Transformer(nnx.Module):
    def __init__(self, cfg, rngs):
        self.cfg = cfg
        V = padded_vocab(cfg.vocab_size, cfg.vocab_multiple)
        # Tied embedding: rows are token vectors in, and the output layer out. A logit
        # is at most its row's norm (see `logits`), so rows of norm `embed_row_norm`
        # (2 by default, std 2/sqrt(D)) keep the untrained model near a uniform guess
        # while letting it express confident predictions early: the AdamW default of the time (lr 3e-3)
        # reached val loss 1.646 at step 1000 with norm 1, 1.622 with norm 2, 1.623 with 4 (docs/benchmarks.md).
        # With unit-variance rows (norm sqrt(D)) the stream at the last layer was still
        # mostly the input token's own row, whose logit is then ~sqrt(D) (10 at D = 128):
        # the untrained model predicted "the next token is this one" and started at loss
        # 10.15 instead of ln(384) = 5.95.
        self.embed_VD = init_normal(rngs, (V, cfg.d_model), cfg.d_model, cfg.embed_row_norm)

        @nnx.split_rngs(splits=cfg.n_blocks)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs):
            return Block(cfg, rngs)

        self.blocks = make_blocks(rngs)  # every weight has a leading axis N (blocks)
        self.final_norm = RMSNorm(cfg.d_model)
        # Made last, so the weights above are the same with or without MTP.
        self.mtp = nnx.List([MTPModule(cfg, rngs) for _ in range(cfg.mtp_depth)]) if cfg.mtp_depth else None

    def embed(self, tokens_BT, tp_axis=None):
        """Vocab-parallel lookup: each tp device holds rows [offset, offset + V/tp) and
        contributes the rows it has (zeros elsewhere); a psum assembles the vectors."""
        table_VD = self.embed_VD[...]
        offset = axis_index(tp_axis) * table_VD.shape[0]
        local_BT = tokens_BT - offset
        mine_BT = (local_BT >= 0) & (local_BT < table_VD.shape[0])
        x_BTD = jnp.where(mine_BT[..., None], table_VD[jnp.clip(local_BT, 0, table_VD.shape[0] - 1)], 0)
        return psum_if(x_BTD, tp_axis)

    def logits(self, x_BTD, norm=None):
        """Output layer of the tied embedding (the local vocabulary rows under tp).
        `norm`: the final norm to apply (an MTP depth has its own)."""
        # Scaled by 1/sqrt(D): the normed x has norm sqrt(D), so a logit is the row's
        # norm (embed_row_norm at init) times cos(x, row): ~N(0, norm^2/D) at init.
        # A model imported from Hugging Face (final_norm_folded) has that factor in its
        # final norm's scale, HF's weight as it was: x 1/sqrt(D) does not round-trip.
        if norm is None and self.cfg.final_norm_folded:
            x_BTD = self.final_norm(x_BTD)
        else:
            x_BTD = (norm or self.final_norm)(x_BTD) / math.sqrt(x_BTD.shape[-1])
        # (in x's dtype: the sharded step hands the table over in float32, parallel.gather_for_use)
        return jnp.einsum("btd,vd->btv", x_BTD, self.embed_VD[...].astype(x_BTD.dtype), preferred_element_type=ACC_DTYPE)

    def loss_sum(self, x_BTD, targets_BT, tp_axis=None, norm=None, mask_BT=None):
        """Summed token cross-entropy with vocab-parallel logits [B, T, V/tp] (over the
        positions where mask_BT is true, when given).

        The full-vocabulary logits are never gathered: the max and the sum of exps are
        reduced over `tp` (pmax, psum), and the target logit is read by the one device
        whose vocabulary slice holds it (psum of a masked value).
        """
        logits_BTV = self.logits(x_BTD, norm)
        V_local = logits_BTV.shape[-1]
        offset = axis_index(tp_axis) * V_local
        max_BT = jax.lax.stop_gradient(jnp.max(logits_BTV, axis=-1))
        max_BT = pmax_if(max_BT, tp_axis)
        sum_exp_BT = psum_if(jnp.sum(jnp.exp(logits_BTV - max_BT[..., None]), axis=-1), tp_axis)
        local_BT = targets_BT - offset
        mine_BT = (local_BT >= 0) & (local_BT < V_local)
        picked_BT = jnp.take_along_axis(logits_BTV, jnp.clip(local_BT, 0, V_local - 1)[..., None], -1)[..., 0]
        target_logit_BT = psum_if(jnp.where(mine_BT, picked_BT, 0.0), tp_axis)
        ce_BT = jnp.log(sum_exp_BT) + max_BT - target_logit_BT
        return jnp.sum(ce_BT if mask_BT is None else jnp.where(mask_BT, ce_BT, 0.0))

    def mtp_loss_sum(self, h_BTD, tokens_BT1, angles, tp_axis=None, keys_B=None):
        """Summed cross-entropy of every MTP depth, given the main model's last hidden
        state h_BTD (before the final norm) of inputs tokens_BT1[:, :-1].

        Depth k at position i predicts token i+k+1, so positions i >= T-k have no
        target inside the window: they still run (fixed shapes; causal attention keeps
        them out of the earlier positions) with a padding token, and are masked out.
        """
        B, T1 = tokens_BT1.shape
        T = T1 - 1
        total = jnp.zeros((), jnp.float32)
        for k, module in enumerate(self.mtp, start=1):
            shifted_BT1 = jnp.pad(tokens_BT1[:, k:], ((0, 0), (0, k)))  # token i+k at position i
            depth_keys_B = None if keys_B is None else fold_in_rows(keys_B, MTP_RNG_SALT + k)
            h_BTD = module(h_BTD, self.embed(shifted_BT1[:, :T], tp_axis), angles, tp_axis, depth_keys_B)
            valid_BT = jnp.broadcast_to(jnp.arange(T) < T - k, (B, T))
            total += self.loss_sum(h_BTD, shifted_BT1[:, 1:], tp_axis, norm=module.final_norm, mask_BT=valid_BT)
        return total

    def __call__(self, tokens_BT, start=0, return_hidden=False):
        """Plain single-device forward: logits [B, T, V] and MoE statistics per block
        (and the last hidden state before the final norm, which MTP starts from).

        The reference that every sharded and pipelined layout is tested against.
        """
        x_BTD = self.embed(tokens_BT)
        angles = rope_angles(start + jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape), self.cfg.rope_dim, self.cfg.rope_theta)
        x_BTD, stats_N = apply_blocks(self.blocks, x_BTD, angles, unroll=self.cfg.unroll_blocks)
        return (self.logits(x_BTD), stats_N) + ((x_BTD,) if return_hidden else ())


def apply_blocks(blocks, x_BTD, angles, tp_axis=None, ep_axis=None, rng=None, remat="none", prepare=None, unroll=False,
                 first_block=0):
    """Run stacked blocks in order with lax.scan (one compiled body whatever N is).

    rng: dropout keys, one per row of x [B] (None = no dropout); each block folds in its
    index in the whole model, first_block + i (a pipeline stage holds blocks from
    first_block on), so its masks are the same whichever stage runs it.

    `blocks` is a Block whose weights carry a leading axis N. `prepare` maps one
    block's weights just before use (cast to the compute dtype; under FSDP, all-gather).
    `remat` (--model.remat) says what the backward pass keeps and what it recomputes;
    "stage" is applied around all of a stage's blocks by the executors, so
    here it keeps everything, like "none".
    Returns x and the MoE statistics of each block, stacked on a leading axis N.
    """
    block_def, block_state = nnx.split(blocks)

    def body(x_BTD, state_and_index):
        state, index = state_and_index
        if prepare is not None:
            if remat in ("block", "block_dots"):
                # Tie the weights to this block's input, so that the gather stays in
                # the loop and the backward pass regathers each block. Without the tie,
                # inside the pipeline's loop over ticks, JAX hoists the gather of every
                # block out of both loops (it depends only on loop-invariant weights)
                # and keeps all of them; tiny on 4x1x2: 685 KB of temporaries -> 519 KB.
                # Without remat, hoisting is what we want: one gather, not one per tick.
                state = jax.lax.optimization_barrier((state, x_BTD))[0]
            state = prepare(state)
        block_rng = None if rng is None else fold_in_rows(rng, first_block + index)
        return nnx.merge(block_def, state)(x_BTD, angles, tp_axis, ep_axis, block_rng, remat_layers=remat == "layer")

    if remat == "block":  # keep only each block's input; recompute its insides in the backward pass
        body = jax.checkpoint(body)
    elif remat == "block_dots":  # keep every matmul output; recompute norms, activations, softmax
        body = jax.checkpoint(body, policy=jax.checkpoint_policies.dots_saveable)
    n_blocks = jax.tree.leaves(block_state)[0].shape[0]
    # Unrolled, XLA sees every block at once (on this CPU the backward pass of a rolled
    # loop ran 2x slower, and a plain Python loop over blocks 10% slower than this);
    # rolled, the compile time does not grow with depth.
    return jax.lax.scan(body, x_BTD, (block_state, jnp.arange(n_blocks)), unroll=n_blocks if unroll else 1)


# ----------------------------------------------------------------------------
# Decoding with the latent KV cache


def init_cache(cfg, batch, max_len, dtype=jnp.float32):
    """Per block and layer: (kv latent [N, B, S, A], RoPE key [N, B, S, R])."""
    shape = (cfg.n_blocks, batch, max_len)
    return [(jnp.zeros(shape + (cfg.kv_latent,), dtype), jnp.zeros(shape + (cfg.rope_dim,), dtype)) for _ in cfg.block_pattern]


def decode_step(model, tokens_BT, cache, start):
    """Logits for tokens at positions start..start+T-1 given the cache of earlier ones.

    Used with T = prompt length once (prefill), then T = 1 per new token. `start` is a
    scalar, or one position per row [B] (serve.py's slots).
    """
    cfg = model.cfg
    x_BTD = model.embed(tokens_BT)
    positions_BT = jnp.broadcast_to(jnp.reshape(start, (-1, 1)) + jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)
    angles = rope_angles(positions_BT, cfg.rope_dim, cfg.rope_theta)
    block_def, block_state = nnx.split(model.blocks)

    def body(x_BTD, state_and_cache):
        state, block_cache = state_and_cache
        x_BTD, block_cache = nnx.merge(block_def, state).decode(x_BTD, angles, block_cache, start)
        return x_BTD, block_cache

    x_BTD, cache = jax.lax.scan(body, x_BTD, (block_state, cache))
    return model.logits(x_BTD), cache


# ----------------------------------------------------------------------------
# The model as shapes only (no arrays): for planning, compiling for other machines,
# and counting parameters


def abstract_model(model_cfg):
    """(graphdef, params) with params as ShapeDtypeStructs: exactly the tree that
    parallel.init_params creates, without creating it."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(model_cfg, nnx.Rngs(0))))
    return graphdef, state.to_pure_dict()


def abstract_params(model_cfg):
    return abstract_model(model_cfg)[1]
