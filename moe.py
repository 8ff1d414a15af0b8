"""The Mixture-of-Experts layer (DeepSeekMoE): the router (softmax or sigmoid scores,
group-limited top-k, the aux-loss-free selection bias), expert capacity per routing
group, the load-balance losses, and dispatch to the experts (on one device, or with
expert parallelism over a mesh axis). Shape legend: model.py's docstring.
"""

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental.pallas.ops.tpu.megablox import ops as megablox_ops

import quant
from blockwise_attention import interpret_kernels, unchecked, varying_like
from layers import ACC_DTYPE, DenseFFN, init_normal, is_auto_axis, live_axes, residual_scale

MOE_KERNELS = ("auto", "ragged_dot", "gmm")
GMM_ROW_TILE = 128  # megablox's default m tile; the sorted (token, choice) rows are padded to a multiple of it
GMM_LANE_TILE = 128  # its k and n tiles where D and F allow (a TPU block is a multiple of 128 lanes or a whole dim)

# ----------------------------------------------------------------------------
# Routing


class RouterBias(nnx.Variable):
    """A per-expert bias added to the routing scores for the top-k *selection* only
    (DeepSeek-V3's aux-loss-free balancing, arXiv:2412.19437 section 2.1.2). Train state
    but not a trained weight: no gradient reaches it (it only picks indices) and the
    optimizer leaves it alone; `balanced_bias` moves it after every step."""


def has_router_bias(cfg):
    """The MoE layers hold router_bias_E: trained by balancing (router_bias_rate > 0), or
    frozen as imported (router_bias, e.g. DeepSeek-V3's e_score_correction_bias)."""
    return cfg.router_bias_rate > 0 or cfg.router_bias


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


def top_k_routing(x_SD, router_DE, top_k, score, bias_E=None, n_groups=1, topk_groups=1, routed_scale=1.0, norm_topk=True):
    """Router: each token picks its top_k experts; gates are normalised to sum to 1
    (norm_topk; false: the gates are the raw top-k scores, DeepSeek-V2's).

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


def sequence_balance_loss(probs_BTE, experts_BTX, n_experts, seq_axis=None):
    """DeepSeek-V3's sequence-wise balance loss (eq. 17-20), summed over sequences:
    the Switch formula above with f and P taken over each whole sequence. (With the
    default --model.routing_group, one group per sequence, it is the same number as
    the Switch loss; it differs when routing groups are shorter.)
    seq_axis: the cp axis when this device holds chunks of each sequence (the loss is
    not a sum over tokens, so the counts and probabilities are summed over cp first);
    every cp rank returns 1/cp of the loss, so the step's sum over cp counts it once."""
    tokens_per_expert_BE = jax.vmap(lambda e: jnp.zeros((n_experts,), jnp.int32).at[e.reshape(-1)].add(1))(experts_BTX)
    if live_axes(seq_axis):
        T, cp = probs_BTE.shape[1], jax.lax.axis_size(seq_axis)
        tokens_per_expert_BE = jax.lax.psum(tokens_per_expert_BE, seq_axis)
        mean_probs_BE = jax.lax.psum(jnp.sum(probs_BTE.astype(ACC_DTYPE), axis=1), seq_axis) / (T * cp)
        fraction_BE = tokens_per_expert_BE.astype(ACC_DTYPE) / (T * cp * experts_BTX.shape[-1])
        loss = jnp.sum(n_experts * jnp.sum(fraction_BE * mean_probs_BE, axis=-1)) / cp
        return jax.lax.pcast(loss, seq_axis, to="varying")  # (the same on every rank: typed as a per-rank share)
    return jnp.sum(jax.vmap(load_balance_loss, (0, 0, None))(probs_BTE, tokens_per_expert_BE, experts_BTX.shape[-1]))


# ----------------------------------------------------------------------------
# Grouped matmuls of the dropless experts


def resolve_moe_kernel(kernel):
    """The grouped matmul `--model.moe_kernel` names: auto is gmm on a TPU (megablox
    skips the tiles of other experts), ragged_dot elsewhere (CPU and GPU keep XLA's op)."""
    if kernel == "auto":
        return "gmm" if jax.default_backend() == "tpu" else "ragged_dot"
    return kernel


def gmm_tiling(m_padded, k, n):
    """(tm, tk, tn) for megablox.gmm of [m, k] rows by [E, k, n] weights: a TPU block is a
    multiple of 128 lanes or a whole dim, so k and n are tiled by 128 where they divide
    by it and whole otherwise."""
    def lanes(d):
        return GMM_LANE_TILE if d % GMM_LANE_TILE == 0 else d
    return min(GMM_ROW_TILE, m_padded), lanes(k), lanes(n)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def typed_gmm(x_PI, w_EIO, sizes_E, tiling, interpret):
    """megablox's gmm with its backward (gmm for the input's gradient, tgmm for the
    weights', as megablox.ops does), each result typed as varying over what x_PI and
    w_EIO vary over. Inside a shard_map both arrive with the same varying axes
    (`grouped_matmul` casts them first), so no cotangent needs a psum here."""
    return gmm_forward(x_PI, w_EIO, sizes_E, tiling, interpret)


def gmm_forward(x_PI, w_EIO, sizes_E, tiling, interpret):
    kernel = functools.partial(megablox_ops.backend.gmm, preferred_element_type=x_PI.dtype, tiling=tiling, interpret=interpret)
    return varying_like(unchecked(kernel, x_PI, w_EIO, sizes_E), x_PI, w_EIO)


def typed_gmm_fwd(x_PI, w_EIO, sizes_E, tiling, interpret):
    return gmm_forward(x_PI, w_EIO, sizes_E, tiling, interpret), (x_PI, w_EIO, sizes_E)


def typed_gmm_bwd(tiling, interpret, residuals, dy_PO):
    x_PI, w_EIO, sizes_E = residuals
    kernels = megablox_ops.backend
    tm, tk, tn = tiling
    dx_kernel = functools.partial(kernels.gmm, preferred_element_type=x_PI.dtype, tiling=(tm, tn, tk), transpose_rhs=True,
                                  interpret=interpret)  # (dy [P, O] by the weights transposed: O is its contracted dim)
    dw_kernel = functools.partial(kernels.tgmm, preferred_element_type=w_EIO.dtype, tiling=tiling,
                                  num_actual_groups=w_EIO.shape[0], interpret=interpret)
    dx_PI = unchecked(dx_kernel, dy_PO, w_EIO, sizes_E)
    dw_EIO = unchecked(dw_kernel, x_PI.swapaxes(0, 1), dy_PO, sizes_E)
    return varying_like(dx_PI, x_PI), varying_like(dw_EIO, w_EIO), None


typed_gmm.defvjp(typed_gmm_fwd, typed_gmm_bwd)


def grouped_matmul(kernel, x_NI, w_EIO, tokens_per_expert_E):
    """Rows of x_NI (sorted by expert, the runs of tokens_per_expert_E first, any rest
    after them) times their expert's weights; the rest's rows are 0.

    gmm pads the rows to a multiple of its row tile and runs in interpret mode off TPU.
    The kernel leaves rows past the experts' runs unwritten (in both directions), so they
    are selected away on the way out and on the way back, never multiplied."""
    if kernel == "ragged_dot":
        return jax.lax.ragged_dot(x_NI, w_EIO, tokens_per_expert_E)
    N, n_in = x_NI.shape
    padded = -N % min(GMM_ROW_TILE, N)
    written_P1 = (jnp.arange(N + padded) < jnp.sum(tokens_per_expert_E))[:, None]
    x_PI = jnp.where(written_P1, jnp.pad(x_NI, ((0, padded), (0, 0))), 0)
    w_EIO = w_EIO.astype(x_NI.dtype)
    # One varying type for both (the casts' transposes sum the gradients of whatever is replicated).
    x_PI, w_EIO = varying_like(x_PI, w_EIO), varying_like(w_EIO, x_PI)
    tiling = gmm_tiling(N + padded, n_in, w_EIO.shape[2])
    y_PO = typed_gmm(x_PI, w_EIO, tokens_per_expert_E.astype(jnp.int32), tiling, interpret_kernels())
    return jnp.where(written_P1, y_PO, 0)[:N]


def quantized_expert_matmuls(x_ENI, w_EIO, quant_mode, row_tile, tp_axis, tp_splits):
    """A batch (over E) of quant.quantized_dot, each expert with its own scales; dw's row
    tiles are one routing group's slots. tp_splits: "out" (gate, up) or "in" (down)."""
    axes = dict(in_axis=live_axes(tp_axis) if tp_splits == "in" else (), out_axis=live_axes(tp_axis) if tp_splits == "out" else ())
    x_ENI, w_EIO = quant.same_varying(x_ENI, w_EIO.astype(x_ENI.dtype))
    dot = lambda x_NI, w_IO: quant.quantized_dot(x_NI, w_IO, quant_mode, axes["in_axis"], axes["out_axis"], row_tile)  # noqa: E731
    return jax.vmap(dot)(x_ENI, w_EIO)


def quantized_grouped_matmul(x_NI, w_EIO, tokens_per_expert_E, quant_mode, tp_axis, tp_splits):
    """grouped_matmul's ragged_dot through quant.quantized_ragged_dot."""
    in_axis, out_axis = (live_axes(tp_axis), ()) if tp_splits == "in" else ((), live_axes(tp_axis))
    x_NI, w_EIO = quant.same_varying(x_NI, w_EIO.astype(x_NI.dtype))
    return quant.quantized_ragged_dot(x_NI, w_EIO, tokens_per_expert_E, quant_mode, in_axis, out_axis)


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
        self.moe_kernel = resolve_moe_kernel(cfg.moe_kernel)
        self.quant_mode = cfg.quant  # (quantized dropless experts run ragged_dot: utils refuses gmm with quant)
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

    def route(self, x_GSD):
        """top_k_routing of each group: (gates_GSX, experts_GSX, probs_GSE)."""
        bias_E = None if self.router_bias_E is None else self.router_bias_E[...]
        route = functools.partial(top_k_routing, top_k=self.top_k, score=self.score, bias_E=bias_E, n_groups=self.n_groups,
                                  topk_groups=self.topk_groups, routed_scale=self.routed_scale, norm_topk=self.norm_topk)
        return jax.vmap(route, (0, None))(x_GSD, self.router_DE[...])

    def expert_ffn(self, x_GECD, tp_axis=None):
        """SwiGLU of each local expert on its buffer of tokens.

        Each expert's slots of all groups become one row dim N = G x C, so every matmul is
        a batch (over E) of plain 2-D products (see `project` for why that is faster)."""
        G, E, C, D = x_GECD.shape
        x_END = x_GECD.transpose(1, 0, 2, 3).reshape(E, G * C, D)

        def expert_matmul(x_ENI, w_EIO, tp_splits):
            if self.quant_mode != "none":
                return quantized_expert_matmuls(x_ENI, w_EIO, self.quant_mode, C, tp_axis, tp_splits)
            return jnp.einsum("eni,eio->eno", x_ENI, w_EIO.astype(x_ENI.dtype), preferred_element_type=ACC_DTYPE).astype(x_ENI.dtype)

        hidden_ENF = jax.nn.silu(expert_matmul(x_END, self.w_gate_EDF[...], "out")) * expert_matmul(x_END, self.w_up_EDF[...], "out")
        y_END = expert_matmul(hidden_ENF, self.w_down_EFD[...], "in")
        return y_END.reshape(E, G, C, D).transpose(1, 0, 2, 3)

    def routed_with_capacity(self, x_GSD, gates_GSX, experts_GSX, n_experts, ep_axis, tp_axis=None):
        G, S, D = x_GSD.shape
        capacity = expert_capacity(S, self.top_k, n_experts, self.capacity_factor)
        slot_GSX, kept_GSX, tokens_per_expert_GE = jax.vmap(assign_slots, (0, None, None))(experts_GSX, n_experts, capacity)

        def fill_slots(x_SD, slot_SX):  # gather tokens into [E*C] slots; empty slots read a zero row
            token_for_slot = jnp.full((n_experts * capacity,), S, jnp.int32)
            token_for_slot = token_for_slot.at[slot_SX].set(jnp.broadcast_to(jnp.arange(S)[:, None], slot_SX.shape), mode="drop")
            return jnp.concatenate([x_SD, jnp.zeros((1, D), x_SD.dtype)])[token_for_slot]

        x_GECD = jax.vmap(fill_slots)(x_GSD, slot_GSX).reshape(G, n_experts, capacity, D)
        if ep_axis is None or not (is_auto_axis(ep_axis) or live_axes(ep_axis)):  # one expert group: nothing to send
            y_GECD = self.expert_ffn(x_GECD, tp_axis)
        elif is_auto_axis(ep_axis):
            # Automatic sharding (executor_auto.py): only say that each expert's slots
            # should sit where the expert lives (experts over ep_axis, every group);
            # the compiler inserts the dispatch there and back.
            by_expert = jax.sharding.PartitionSpec(None, ep_axis)
            x_GECD = jax.lax.with_sharding_constraint(x_GECD, by_expert)
            y_GECD = jax.lax.with_sharding_constraint(self.expert_ffn(x_GECD, tp_axis), by_expert)
        else:
            # Expert parallelism: this device holds E/dp experts. all_to_all sends each
            # expert's slots to the device that owns it (split E, stack groups), the
            # experts run, and the inverse all_to_all brings the results home.
            x_GECD = jax.lax.all_to_all(x_GECD, ep_axis, split_axis=1, concat_axis=0, tiled=True)
            y_GECD = self.expert_ffn(x_GECD, tp_axis)
            y_GECD = jax.lax.all_to_all(y_GECD, ep_axis, split_axis=0, concat_axis=1, tiled=True)

        def combine(y_ECD, slot_SX, gates_SX, kept_SX):  # each token sums its k expert outputs
            y_slots = jnp.concatenate([y_ECD.reshape(-1, D), jnp.zeros((1, D), y_ECD.dtype)])
            weights_SX = jnp.where(kept_SX, gates_SX, 0.0).astype(y_ECD.dtype)
            return jnp.einsum("sxd,sx->sd", y_slots[slot_SX], weights_SX)

        y_GSD = jax.vmap(combine)(y_GECD, slot_GSX, gates_GSX, kept_GSX)
        dropped = jnp.sum(~kept_GSX)
        return y_GSD, tokens_per_expert_GE, dropped

    def routed_dropless(self, x_GSD, gates_GSX, experts_GSX, n_experts, ep_axis=None, tp_axis=None, kernel=None):
        """No capacity: sort all (token, choice) pairs by expert and run a grouped
        matmul (`grouped_matmul`: ragged_dot or megablox gmm) over the contiguous runs
        of each expert.

        With expert parallelism (this device holds E/ep experts) every device gathers the
        ep devices' groups, runs the pairs of its own experts (the others' sort after them
        and come out 0), and a psum_scatter hands each device its groups' sums: no fixed
        buffers and nothing dropped, for an all-gather of ep x the tokens. kernel: the
        grouped matmul's (default: the layer's --model.moe_kernel)."""
        tokens_per_expert_GE = jax.vmap(lambda e: jnp.zeros((n_experts,), jnp.int32).at[e.reshape(-1)].add(1))(experts_GSX)
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
        def matmul(x_NI, w_EIO, tp_splits):
            if self.quant_mode != "none":
                return quantized_grouped_matmul(x_NI, w_EIO, tokens_per_expert_E, self.quant_mode, tp_axis, tp_splits)
            return grouped_matmul(kernel or self.moe_kernel, x_NI, w_EIO, tokens_per_expert_E=tokens_per_expert_E)

        gate, up = matmul(x_ND, self.w_gate_EDF[...], tp_splits="out"), matmul(x_ND, self.w_up_EDF[...], tp_splits="out")
        y_ND = matmul(jax.nn.silu(gate) * up, self.w_down_EFD[...], tp_splits="in")
        y_pairs = jnp.zeros_like(y_ND).at[order].set(y_ND).reshape(G, S, X, D)
        y_GSD = jnp.einsum("gsxd,gsx->gsd", y_pairs, gates_GSX.astype(y_pairs.dtype))
        if expert_parallel:
            y_GSD = jax.lax.psum_scatter(y_GSD, ep_axis, scatter_dimension=0, tiled=True)
        return y_GSD, tokens_per_expert_GE, jnp.zeros((), jnp.int32)

    def __call__(self, x_BTD, tp_axis=None, ep_axis=None, seq_axis=None):
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
            y_GSD, tokens_per_expert_GE, dropped = self.routed_with_capacity(x_GSD, gates_GSX, experts_GSX, n_experts, ep_axis, tp_axis)
        else:
            y_GSD, tokens_per_expert_GE, dropped = self.routed_dropless(x_GSD, gates_GSX, experts_GSX, n_experts, ep_axis, tp_axis)
        y_BTD = y_GSD.reshape(B, T, D)
        if self.shared is not None:
            y_BTD = y_BTD + self.shared(x_BTD, tp_axis)
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
        y_GSD, _, _ = self.routed_dropless(x_GSD, gates_GSX, experts_GSX, self.router_DE[...].shape[1], kernel="ragged_dot")
        y_BTD = y_GSD.reshape(B, T, D)
        return y_BTD + self.shared(x_BTD) if self.shared is not None else y_BTD
