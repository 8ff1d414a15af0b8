"""The model: a Mixture-of-Experts transformer with Multi-head Latent Attention.

Read bottom-up: the pieces (layers.py: init, projection, RMSNorm, the dense FFN),
attention (attention.py: RoPE and MLA with its latent KV cache), the MoE layer (moe.py:
router, capacity, experts), then here the Layer, the Block, multi-token prediction, and
last the Transformer: embedding, an optional dense prefix of Layers (DeepSeek's first
k dense layers), the stacked Blocks, the output layer.

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
import math
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
from flax import nnx

from attention import MLAttention, rope_angles
from context_parallel import sequence_axis, token_positions, tokens_at
from layers import ACC_DTYPE, DenseFFN, RMSNorm, axis_index, init_normal, pmax_if, project, psum_if, residual_scale
from moe import MoE

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
    q_latent: int = option(64, "MLA query latent width (Q); 0 = full-rank queries from x, no latent (HF q_lora_rank null)")
    kv_latent: int = option(32, "MLA key/value latent width (A); with R, all the KV cache stores")
    rope_theta: float = option(10000.0, "RoPE base")
    rope_scaling: str = option("none", "RoPE frequency scaling: none | yarn (DeepSeek-V2/V3's long-context YaRN, attention.py)")
    rope_factor: float = option(1.0, "yarn: context extension factor (HF rope_scaling.factor)")
    rope_original_len: int = option(4096, "yarn: the context the RoPE was trained on (HF original_max_position_embeddings)")
    yarn_beta_fast: float = option(32.0, "yarn: pairs turning more often than this over the original context keep their frequency")
    yarn_beta_slow: float = option(1.0, "yarn: pairs turning less often than this are interpolated (frequency / factor)")
    yarn_mscale: float = option(1.0, "yarn: mscale (with yarn_mscale_all_dim, the RoPE parts' factor is their mscale ratio)")
    yarn_mscale_all_dim: float = option(0.0, "yarn: mscale_all_dim; non-zero: the softmax scale x mscale(factor, this)^2")
    norm_eps: float = option(1e-6, "eps of the RMSNorms of the residual stream (HF rms_norm_eps; the latent norms keep 1e-6)")
    tie_embeddings: bool = option(True, "the output layer is the input embedding; false = a separate head (HF lm_head)")
    embed_row_norm: float = option(2.0, "norm of the embedding's (and an untied head's) rows at init (std = this / sqrt(D)); "
                                        "the untrained output logits are at most this (model.py)")
    n_blocks: int = option(2, "blocks (N); the pipeline splits blocks over pp")
    first_dense: int = option(0, "dense layers before the blocks (HF first_k_dense_replace): each a full layer (MLA attention "
                                 "+ dense FFN of d_ff hidden units), run on the first pipeline stage beside the embedding")
    block_pattern: str = option("DM", "layers of one block: D = dense FFN, M = MoE FFN")
    d_ff: int = option(512, "hidden units of dense FFN layers (F)")
    ffn_activation: str = option("swiglu", "dense FFN activation: swiglu | gelu")
    n_experts: int = option(8, "routed experts per MoE layer (E)")
    n_shared: int = option(1, "shared experts per MoE layer (see every token)")
    top_k: int = option(2, "routed experts per token")
    d_expert: int = option(128, "hidden units per expert")
    capacity_factor: float = option(1.5, "expert capacity = factor x group tokens x top_k / experts; 0 = dropless")
    moe_kernel: str = option("auto", "grouped matmul of the dropless routed experts (--model.capacity_factor 0): ragged_dot "
                                     "(jax.lax.ragged_dot) | gmm (Pallas megablox, interpret mode off TPU) | "
                                     "auto = gmm on TPU (ragged_dot under --mesh.sharding auto), ragged_dot elsewhere")
    router_score: str = option("softmax", "router scores: softmax | sigmoid")
    routing_group: int = option(0, "tokens per routing group (capacity is per group); 0 = seq_len")
    aux_loss_weight: float = option(0.01, "weight of the load-balance loss (Switch)")
    router_bias_rate: float = option(0.0, "aux-loss-free balancing (DeepSeek-V3): after every step each expert's selection bias "
                                          "moves by this towards uniform load; 0 = off (V3 used 0.001)")
    router_bias: bool = option(False, "a per-expert router selection bias exists even at --model.router_bias_rate 0, where it "
                                      "stays frozen; --train.init_from hf: sets it for a DeepSeek-V3 checkpoint (e_score_correction_bias)")
    seq_aux_loss_weight: float = option(0.0, "weight of DeepSeek-V3's sequence-wise balance loss (V3 used 0.0001)")
    n_groups: int = option(1, "group-limited routing: split the experts into this many groups (HF n_group); 1 = off")
    topk_groups: int = option(1, "group-limited routing: each token picks experts in its best this-many groups (HF topk_group)")
    routed_scale: float = option(1.0, "multiply the routed experts' output by this (DeepSeek-V3 routed_scaling_factor)")
    norm_topk: bool = option(True, "renormalise the routed gates over the top k (HF norm_topk_prob); false = raw scores "
                                   "(DeepSeek-V2-Lite)")
    final_norm_folded: bool = option(False, "the final norm's scale holds the logits' 1/sqrt(D) (set by --train.init_from hf:, "
                                            "which keeps HF's norm weight bit for bit); false = logits of final_norm(x) / sqrt(D)")
    mtp_depth: int = option(0, "multi-token prediction (DeepSeek-V3): extra blocks predicting tokens 2..depth+1 ahead, "
                               "trained with the rest, ignored by sampling and eval; 0 = off")
    mtp_loss_weight: float = option(0.3, "weight of the MTP loss (mean over depths; V3 used 0.3, later 0.1)")
    dropout: float = option(0.0, "dropout on residual branches")
    dtype: str = option("auto", "compute dtype: float32 | bfloat16 | auto (the faster here: bfloat16 on TPU/GPU, on CPU a "
                                "timed probe of the model's matmuls, dtype_probe.py); weights, Adam and softmax/norms stay float32")
    quant: str = option("none", "quantized training of the weight matmuls (attention projections, experts, dense FFN) "
                                "and of --model.attention matmul's scores and values (forward and backward, quant.py): "
                                "none | int8 (TPU v5e/v5p/v6e: 2x bf16's peak) | fp8 (e4m3/e5m2; H100/H200, TPU v7). The router "
                                "(a tie decides where tokens go), embedding, output layer (the logits' precision is the loss's), "
                                "norms and the fused attention kernels stay in --model.dtype / float32")
    grad_reduce_dtype: str = option("float32", "dtype of the gradient reductions (FSDP reduce-scatters, psums of replicated "
                                               "weights): float32 | bfloat16 (halves their bytes, loses precision)")
    attention: str = option("matmul", "attention kernel: matmul (softmax of explicit scores; fastest on CPU) | "
                                      "dot_product_attention (jax.nn's, cuDNN flash attention on GPU) | blockwise (online softmax over "
                                      "key blocks: memory linear in seq_len; blockwise_attention.py) | splash (the Pallas TPU kernel, causal "
                                      "blocks skipped; interpret mode off the TPU, slow; splash_attention.py)")
    attention_block: int = option(512, "blockwise and splash attention: queries and keys per block (must divide seq_len, or "
                                       "exceed it; splash: a multiple of 128 once cut to seq_len)")
    remat: str = option("none", "rematerialisation, what the backward pass recomputes: none | layer (each layer from its input) | "
                                "block (each block from its input) | block_dots (each block, keeping its matmul outputs) | "
                                "stage (all of a pipeline stage's blocks, per microbatch, from the stage input)")
    unroll_blocks: bool = option(True, "unroll the loop over blocks (faster here); false = lax.scan (compile time flat in depth)")


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
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = MLAttention(cfg, rngs)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = MoE(cfg, rngs) if kind == "M" else DenseFFN(cfg.d_model, cfg.d_ff, cfg.ffn_activation, rngs, residual_scale(cfg),
                                                                         cfg.quant)
        self.dropout = cfg.dropout

    def drop(self, x_BTD, keys_B, positions_T):
        """Dropout on a residual branch's output. The mask of row b at global position t
        is drawn from fold_in(key of row b, t): every tp device holds the same residual
        stream and the same keys, so it draws the same mask (no tp-varying rng), and a
        position's mask is the same on whichever cp rank holds it (context_parallel.py)."""
        if self.dropout == 0 or keys_B is None:
            return x_BTD
        draw_D = lambda key, t: jax.random.bernoulli(jax.random.fold_in(key, t), 1 - self.dropout, x_BTD.shape[-1:])  # noqa: E731
        keep_BTD = jax.vmap(lambda key: jax.vmap(draw_D, (None, 0))(key, positions_T))(keys_B)
        return jnp.where(keep_BTD, x_BTD / (1 - self.dropout), 0).astype(x_BTD.dtype)

    def __call__(self, x_BTD, angles, tp_axis=None, ep_axis=None, rng=None):
        """(x, MoE statistics or None, each local head's largest attention logit [H]).
        rng: dropout keys, one per batch row [B] (see fold_in_rows), or None = no dropout."""
        rngs = (fold_in_rows(rng, 0), fold_in_rows(rng, 1)) if rng is not None else (None, None)
        positions_T = token_positions(angles, x_BTD.shape[1])
        attn_BTD, max_logit_H = self.attn.with_max_logits(self.attn_norm(x_BTD), angles, tp_axis)
        x_BTD = x_BTD + self.drop(attn_BTD, rngs[0], positions_T)
        h_BTD = self.ffn_norm(x_BTD)
        if self.kind == "M":
            y_BTD, stats = self.ffn(h_BTD, tp_axis, ep_axis, sequence_axis(angles))
        else:
            y_BTD, stats = self.ffn(h_BTD, tp_axis), None
        return x_BTD + self.drop(psum_if(y_BTD, tp_axis), rngs[1], positions_T), stats, max_logit_H

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

    def __call__(self, x_BTD, angles, tp_axis=None, ep_axis=None, rng=None, remat_layers=False):
        """Returns x_BTD and the MoE statistics of this block's MoE layers, summed
        (with bias balancing also each MoE layer's own tokens_per_expert_LE), with
        max_logit_LH: each layer's largest attention logit per local head (a max, not a
        sum, wherever statistics are combined: step_core.add_stats).
        remat_layers: keep only each layer's input for the backward pass."""
        stats, tokens_per_expert_LE, max_logit_LH = empty_moe_stats(self.n_experts, self.sequence_loss), [], []
        run_layer = lambda layer, x_BTD, rng: layer(x_BTD, angles, tp_axis, ep_axis, rng)  # noqa: E731
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
        self.hidden_norm = RMSNorm(D, cfg.norm_eps)
        self.embed_norm = RMSNorm(D, cfg.norm_eps)
        self.w_hidden_DD = init_normal(rngs, (D, D), 2 * D)
        self.w_embed_DD = init_normal(rngs, (D, D), 2 * D)
        self.block = Block(dataclasses.replace(cfg, block_pattern="D" * len(cfg.block_pattern)), rngs)
        self.final_norm = RMSNorm(D, cfg.norm_eps)

    def __call__(self, h_BTD, next_embed_BTD, angles, tp_axis=None, rng=None):
        x_BTD = (project(self.hidden_norm(h_BTD), self.w_hidden_DD[...])
                 + project(self.embed_norm(next_embed_BTD.astype(h_BTD.dtype)), self.w_embed_DD[...]))
        return self.block(x_BTD, angles, tp_axis, None, rng)[0]


MTP_RNG_SALT = 2**31 - 1  # dropout keys of the MTP blocks: each row's key folded with salt + depth, apart from the blocks' own
PREFIX_RNG_SALT = 2**30  # dropout keys of the dense prefix: salt + layer, apart from the blocks' (0..N-1) and MTP's


# ----------------------------------------------------------------------------
# The Transformer: embedding, dense prefix, N stacked Blocks, final norm, output layer (tied or not).


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
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        # Made last, so the weights above are the same with or without MTP.
        self.mtp = nnx.List([MTPModule(cfg, rngs) for _ in range(cfg.mtp_depth)]) if cfg.mtp_depth else None
        if not cfg.tie_embeddings:
            # A separate output layer (DeepSeek's lm_head), made after everything else so
            # that every other weight is the one the tied model would have. Its rows play
            # the output role of the tied rows, whose std embed_row_norm / sqrt(D) was
            # chosen for that role (a logit is its row's norm x cos, see `logits`), so they
            # start the same: the untrained model again guesses near uniformly.
            self.head_VD = init_normal(rngs, (V, cfg.d_model), cfg.d_model, cfg.embed_row_norm)
        # The dense prefix (DeepSeek's first_k_dense_replace layers), made after MTP and the head
        # for the same reason. Not stacked (no N dim): it runs on the first pipeline stage only.
        self.prefix = nnx.List([Layer(cfg, "D", rngs) for _ in range(cfg.first_dense)]) if cfg.first_dense else None

    def embed(self, tokens_BT, tp_axis=None):
        """Vocab-parallel lookup: each tp device holds rows [offset, offset + V/tp) and
        contributes the rows it has (zeros elsewhere); a psum assembles the vectors."""
        table_VD = self.embed_VD[...]
        offset = axis_index(tp_axis) * table_VD.shape[0]
        local_BT = tokens_BT - offset
        mine_BT = (local_BT >= 0) & (local_BT < table_VD.shape[0])
        x_BTD = jnp.where(mine_BT[..., None], table_VD[jnp.clip(local_BT, 0, table_VD.shape[0] - 1)], 0)
        return psum_if(x_BTD, tp_axis)

    def run_prefix(self, x_BTD, angles, tp_axis=None, keys_B=None, remat="none"):
        """The dense prefix on the embedded x_BTD (a no-op without one). Layer i's dropout
        keys are each row's key folded with PREFIX_RNG_SALT + i. remat: what the backward
        pass keeps of each prefix layer, as apply_blocks keeps of a block (each layer's
        input; with block_dots its matmul outputs)."""
        for i, layer in enumerate(self.prefix or ()):
            layer_def, layer_state = nnx.split(layer)  # (a pure function of the weights: callable under any jax transform)

            def run(state, x_BTD, keys_B):
                return nnx.merge(layer_def, state)(x_BTD, angles, tp_axis, None, keys_B)[0]
            if remat in ("layer", "block", "stage"):
                run = jax.checkpoint(run)
            elif remat == "block_dots":
                run = jax.checkpoint(run, policy=jax.checkpoint_policies.dots_saveable)
            x_BTD = run(layer_state, x_BTD, None if keys_B is None else fold_in_rows(keys_B, PREFIX_RNG_SALT + i))
        return x_BTD

    def logits(self, x_BTD, norm=None):
        """Output layer: the tied embedding, or the separate head (the local vocabulary
        rows under tp, either way: vocab-parallel logits).
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
        table_VD = self.embed_VD[...] if self.cfg.tie_embeddings else self.head_VD[...]
        return jnp.einsum("btd,vd->btv", x_BTD, table_VD.astype(x_BTD.dtype), preferred_element_type=ACC_DTYPE)

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
        Under context parallelism (angles a SequenceChunks) h_BTD holds this rank's
        chunks and tokens_BT1 the whole rows: the tokens i+k, i+k+1 of a position near a
        chunk's end are read across the boundary, so the targets are one device's.
        """
        B, T1 = tokens_BT1.shape
        T = T1 - 1
        positions_T = token_positions(angles, T)
        chunk_positions_T = positions_T if sequence_axis(angles) else None  # (None: whole rows, read by slices)
        padded_BT = jnp.pad(tokens_BT1, ((0, 0), (0, len(self.mtp))))
        total = jnp.zeros((), jnp.float32)
        for k, module in enumerate(self.mtp, start=1):
            depth_keys_B = None if keys_B is None else fold_in_rows(keys_B, MTP_RNG_SALT + k)
            h_BTD = module(h_BTD, self.embed(tokens_at(padded_BT, chunk_positions_T, k, T), tp_axis), angles, tp_axis,
                           depth_keys_B)  # token i+k at i
            valid_BT = jnp.broadcast_to(positions_T < T - k, (B, positions_T.shape[0]))
            total += self.loss_sum(h_BTD, tokens_at(padded_BT, chunk_positions_T, k + 1, T), tp_axis, norm=module.final_norm,
                                   mask_BT=valid_BT)
        return total

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


def apply_blocks(blocks, x_BTD, angles, tp_axis=None, ep_axis=None, rng=None, remat="none", prepare=None, unroll=False,
                 first_block=0, prefetch=None):
    """Run stacked blocks in order with lax.scan (one compiled body whatever N is).

    rng: dropout keys, one per row of x [B] (None = no dropout); each block folds in its
    index in the whole model, first_block + i (a pipeline stage holds blocks from
    first_block on), so its masks are the same whichever stage runs it.

    `blocks` is a Block whose weights carry a leading axis N. `prepare` maps one
    block's weights just before use (cast to the compute dtype; under FSDP, all-gather).
    prefetch (remat "none", "layer" or "stage"): prepare in two parts, weights ->
    (fetched arrays, unpack), as parallel.fetch_for_use: block i + 1 is fetched beside
    block i's work and unpacked in the next step, so that its FSDP all-gather runs
    under block i's matmuls, and in the backward pass each block's gradient reduction
    under the next one's (apply_prefetching; the executors give it where the gathers
    cross devices and this runs once per microbatch: step_core.prefetches_gathers).
    `remat` (--model.remat) says what the backward pass keeps and what it recomputes;
    "stage" is applied around all of a stage's blocks by the executors, so
    here it keeps everything, like "none".
    Returns x and the MoE statistics of each block, stacked on a leading axis N.
    """
    block_def, block_state = nnx.split(blocks)

    def run_block(x_BTD, state, index):  # (state: the block's weights, ready to use)
        block_rng = None if rng is None else fold_in_rows(rng, first_block + index)
        return nnx.merge(block_def, state)(x_BTD, angles, tp_axis, ep_axis, block_rng, remat_layers=remat == "layer")

    if prefetch is not None:
        assert remat in ("none", "layer", "stage"), remat  # (remat block would keep every carried block for its backward)
        return apply_prefetching(block_state, x_BTD, prefetch, run_block, unroll)

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
        return run_block(x_BTD, state, index)

    if remat == "block":  # keep only each block's input; recompute its insides in the backward pass
        body = jax.checkpoint(body)
    elif remat == "block_dots":  # keep every matmul output; recompute norms, activations, softmax
        body = jax.checkpoint(body, policy=jax.checkpoint_policies.dots_saveable)
    n_blocks = jax.tree.leaves(block_state)[0].shape[0]
    # Unrolled, XLA sees every block at once (on this CPU the backward pass of a rolled
    # loop ran 2x slower, and a plain Python loop over blocks 10% slower than this);
    # rolled, the compile time does not grow with depth.
    return jax.lax.scan(body, x_BTD, (block_state, jnp.arange(n_blocks)), unroll=n_blocks if unroll else 1)


def apply_prefetching(block_state, x_BTD, fetch, run, unroll):
    """apply_blocks with block i + 1's weights fetched beside block i: a scan over the
    blocks whose carry holds the next block's fetched arrays, unpacked where they are
    used; the last step fetches block 0 again, unused (one block's gather and a zero
    gradient's reduction more per pass: peeling the last block out of the loop instead
    held the loop's and the peeled block's temporaries at once, 2.3x on XLA:CPU).
    run(x, weights, index) runs one block. Returns (x, statistics stacked on N)."""
    n_blocks = jax.tree.leaves(block_state)[0].shape[0]

    def fetch_beside(state, x_BTD):
        # Tied to the running block's input: else the compiler splits the loop in two, the
        # fetches alone in the first (nothing to run beside) and the blocks in the second.
        # (Tied the same way before the loop too, so that the carry keeps its types.)
        return fetch(jax.lax.optimization_barrier((state, x_BTD))[0])

    fetched, unpack = fetch_beside(jax.tree.map(lambda w: w[0], block_state), x_BTD)

    def body(carry, next_state_and_index):
        x_BTD, fetched = carry
        next_state, index = next_state_and_index
        next_fetched, _ = fetch_beside(next_state, x_BTD)
        x_BTD, stats = run(x_BTD, unpack(fetched), index)
        return (x_BTD, next_fetched), stats

    next_states = jax.tree.map(lambda w: jnp.roll(w, -1, axis=0), block_state)  # step i fetches block i + 1 (mod N)
    (x_BTD, _), stats_N = jax.lax.scan(body, (x_BTD, fetched), (next_states, jnp.arange(n_blocks)),
                                       unroll=n_blocks if unroll else 1)
    return x_BTD, stats_N


# ----------------------------------------------------------------------------
# Decoding with the latent KV cache


def init_cache(cfg, batch, max_len, dtype=jnp.float32):
    """Per layer of the dense prefix, then per layer of the block pattern: (kv latent
    [N, B, S, A], RoPE key [N, B, S, R]), N = 1 for a prefix layer (so every entry has
    the same layout: rows are dim 1, positions dim 2)."""
    def entry(n):
        shape = (n, batch, max_len)
        return jnp.zeros(shape + (cfg.kv_latent,), dtype), jnp.zeros(shape + (cfg.rope_dim,), dtype)
    return [entry(1) for _ in range(cfg.first_dense)] + [entry(cfg.n_blocks) for _ in cfg.block_pattern]


def decode_step(model, tokens_BT, cache, start):
    """Logits for tokens at positions start..start+T-1 given the cache of earlier ones.

    Used with T = prompt length once (prefill), then T = 1 per new token. `start` is a
    scalar, or one position per row [B] (serve.py's slots).
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
