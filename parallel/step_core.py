"""The step core: what every executor shares, and nothing about schedules.

A train step is  tokens -> (loss, metrics, grads) -> update;  the middle arrow is the
executor's (parallel/gpipe.py, accumulate.py, one_f_one_b.py, auto.py). The rest is here:

  prologue   a device's microbatches, RoPE angles and dropout keys (per global row)
  loss       per-device sums (cross-entropy, balance losses, MTP) -> global mean loss and
             metrics; sum_cotangents: its derivatives, for hand-written backwards
  update     global gradient norm, clipping, the optimizer, QK-clip, router biases

Reductions (psum, pmean, pmax) run over shard_map's manual axes; under the automatic
executor none is manual and they are identities, so both sharding modes share them.
"""

import dataclasses

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from model import balance_router_biases, kernel, rope_angles, router_biases
from ops.collectives import Axes, axis_index, live_axes, pmax, pmean, psum, vary, zeros_of
from ops.context_parallel import SequenceChunks, chunk_positions, gathered_positions
from parallel.mesh import axes_of
from parallel.weights import is_trained, weight_name
from utils import BATCH_AXES, CP, DP, PP, SLICE, TP

# ---- The axes the model's layers reduce over, and running a function on some stages only


def layer_axes(cfg):
    """The mesh axes the model's collectives run over inside the shard_map step: heads,
    hidden units and vocabulary over tp; experts over dp with expert parallelism."""
    return Axes(tp=TP, ep=DP if cfg.mesh.expert_parallel else None)


def when(pred, fn, *args):
    """fn(*args) where pred holds; zeros of the same types elsewhere, computing nothing. A Python bool pred takes no
    cond: XLA:CPU inlines a constant-predicate cond, whose collectives then clash with the step's ("Id can't be larger
    than the number of participating threads")."""
    if isinstance(pred, bool):
        return fn(*args) if pred else zeros_of(jax.eval_shape(fn, *args))
    avals = jax.eval_shape(fn, *args)
    return jax.lax.cond(pred, fn, lambda *_: zeros_of(avals), *args)


# ---- MoE and attention statistics, combined over microbatches and ticks: sums, but max_logit_LH
# by a max, whose "nothing yet" is -inf (a head's largest logit may be negative).

MAX_STATS = ("max_logit_LH",)


def is_max_stat(path):
    return any(getattr(k, "key", None) in MAX_STATS for k in path)


def empty_stats(avals):
    """Statistics that add nothing (zeros; -inf for the maxima), typed as avals."""
    return jax.tree_util.tree_map_with_path(lambda path, z: z - jnp.inf if is_max_stat(path) else z, zeros_of(avals))


def mask_stats(stats, valid):
    """stats where valid holds, else statistics that add nothing."""
    return jax.tree_util.tree_map_with_path(
        lambda path, s: jnp.where(valid, s, -jnp.inf if is_max_stat(path) else jnp.zeros_like(s)), stats)


def add_stats(acc, new):
    return jax.tree_util.tree_map_with_path(lambda path, a, n: jnp.maximum(a, n) if is_max_stat(path) else a + n, acc, new)


def add_stats_at(acc_V, new, v, valid):
    """acc_V[v] combined with new, where valid holds (acc_V as it is elsewhere)."""
    def add(path, a_V, n):
        return a_V.at[v].max(jnp.where(valid, n, -jnp.inf)) if is_max_stat(path) else a_V.at[v].add(n)
    return jax.tree_util.tree_map_with_path(add, acc_V, new)


def total_stats(stats_X):
    """The statistics stacked on a leading axis (microbatches, ticks), combined over it."""
    return jax.tree_util.tree_map_with_path(lambda path, s: jnp.max(s, axis=0) if is_max_stat(path) else jnp.sum(s, axis=0), stats_X)


# ---- Prologue: microbatches, RoPE angles, dropout keys


@dataclasses.dataclass(frozen=True)
class Microbatches:
    tokens_MbT1: jax.Array  # M microbatches of b rows, inputs and targets (T + 1 tokens, whole rows)
    angles: jax.Array | SequenceChunks  # RoPE angles of positions 0..T-1; under cp, of this rank's chunks (sft: per microbatch)
    keys_Mb: jax.Array | None  # dropout keys of each row, or None without dropout
    positions_T: jax.Array | None = None  # under cp: the global positions of this rank's tokens [2L]

    @property
    def local_len(self):
        """Tokens per row on this device: T, or under cp this rank's 2L."""
        return self.tokens_MbT1.shape[-1] - 1 if self.positions_T is None else self.positions_T.shape[0]

    def angles_of(self, m):
        """What microbatch m's layers take where RoPE angles go: `angles`, or its packed rows' own (ops/packing.py)."""
        return self.angles if getattr(self.angles, "segments_bT", None) is None else kernel("packing").of_microbatch(self.angles, m)


def split_microbatches(tokens_bT1, cfg, rng, first_row, strided=False):
    """This device's rows (global rows first_row, first_row + 1, ...) as M Microbatches:
    microbatch m holds rows [m b, (m + 1) b), or if strided (the automatic executor's, split
    over dp as the batch) rows m, m + M, ... A row's dropout key depends on its index alone."""
    M = cfg.train.microbatches
    B, T1 = tokens_bT1.shape
    b = B // M
    if strided:
        tokens_MbT1 = tokens_bT1.reshape(b, M, T1).swapaxes(0, 1)
        keys_Mb = None if rng is None else dropout_rows(rng, first_row, B).reshape(b, M).swapaxes(0, 1)
    else:
        tokens_MbT1 = tokens_bT1.reshape(M, b, T1)
        keys_Mb = None if rng is None else dropout_rows(rng, first_row, B).reshape(M, b)
    m, cp = cfg.model, cfg.mesh.cp
    if cp > 1:  # context parallel: this rank's two chunks of every row (ops/context_parallel.py)
        all_positions_T = jnp.asarray(gathered_positions(T1 - 1, cp))
        if live_axes(CP):
            positions_T, whole = chunk_positions(T1 - 1, cp, axis_index(CP)), None
        else:  # the automatic executor: every rank's chunks in rank order, the sequence dim split over cp
            positions_T, whole = all_positions_T, P(BATCH_AXES, None, None)
        angles = SequenceChunks(rope_angles(positions_T[None, :], m), positions_T, all_positions_T, CP, whole)
    else:
        angles, positions_T = rope_angles(jnp.arange(T1 - 1)[None, :], m), None
    if cfg.train.objective == "sft":  # packed rows (ops/packing.py): each document at its own positions, seeing only itself
        angles = kernel("packing").packed_views(tokens_MbT1, lambda p: rope_angles(p, m), angles)
    return Microbatches(tokens_MbT1, angles, keys_Mb, positions_T)


def dropout_rng(cfg, step):
    """The step's dropout key from (seed, step), alike on every device (None without dropout); masks come per global
    row (dropout_rows), then per block, layer and branch, so every mesh and executor takes the same steps. No
    per-tp-rank keys: dropout masks only the residual stream, which tp devices hold whole."""
    if cfg.model.dropout == 0:
        return None
    return jax.random.fold_in(jax.random.key(cfg.run.seed), step)


def first_row(rows_per_device):
    """The global index of this device's first row (rows over (slice, dp), slice-major)."""
    return (axis_index(SLICE) * jax.lax.axis_size(DP) + axis_index(DP)) * rows_per_device


def dropout_rows(rng, first_row, n_rows):
    """Keys [n_rows] for global batch rows first_row, first_row + 1, ...: each device
    derives only the keys of the rows it holds."""
    return jax.vmap(jax.random.fold_in, (None, 0))(rng, first_row + jnp.arange(n_rows))


# ---- Across slices: one gradient all-reduce per step


def per_slice(params):
    """params typed as varying over slice, at the step's start (outside the executor); a
    no-op with one slice. Else autodiff would psum a block's gradient over slice where it is
    used, once per layer and on whole gathered weights; so each slice reduce-scatters within
    itself and reduce_over_slices sums the shards across slices once (MaxText's DCN DP)."""
    return jax.tree.map(lambda w: vary(w, (SLICE,)), params)


def reduce_over_slices(grads, reduce_dtype):
    """Gradient shards summed over slice (one all-reduce per step, the only bulk traffic
    across slices) in --model.grad_reduce_dtype; untrained weights' gradients are zeros."""
    if not live_axes((SLICE,)):
        return grads

    def reduce(path, g):
        if not is_trained(weight_name(path)):
            return jnp.zeros(g.shape, g.dtype)  # (typed invariant over slice, like the weight it updates)
        return jax.lax.psum(g.astype(reduce_dtype), SLICE).astype(g.dtype)
    return jax.tree_util.tree_map_with_path(reduce, grads)


# ---- Loss and metrics


# The axes that split a step's tokens: rows over (slice, dp), each sequence over cp.
TOKEN_AXES = BATCH_AXES + (CP,)


def n_moe_layers(m_cfg):
    return m_cfg.n_blocks * m_cfg.block_pattern.count("M")


def loss_and_metrics(ce_sum, stats_N, cfg, mtp_sum=None):
    """(loss, metrics) from this device's summed cross-entropy, its stage's per-block MoE
    statistics and summed MTP cross-entropy; the same (mesh-invariant) on every device."""
    m_cfg, t_cfg = cfg.model, cfg.train
    n_tokens = t_cfg.batch_size * m_cfg.seq_len
    ce = psum(ce_sum, TOKEN_AXES + (PP,)) / n_tokens
    # Max over the token axes; heads stay split over tp, blocks over pp (metric_specs).
    max_logit_NLH = pmax(stats_N.pop("max_logit_LH"), TOKEN_AXES)
    # Routing statistics agree over tp but are typed as varying there (the router came from
    # an all_gather): pmean/pmax say so; pmean's 1/tp of the aux gradient sums back to one.
    aux_sum_N = stats_N.pop("aux_loss_sum")
    seq_aux_sum_N = stats_N.pop("seq_aux_loss_sum", None)  # with --model.seq_aux_loss_weight
    n_moe = n_moe_layers(m_cfg)
    mean_over_mesh = lambda sum_N, count: pmean(psum(jnp.sum(sum_N), TOKEN_AXES + (PP,)), (TP,)) / count  # noqa: E731
    aux = jnp.zeros((), jnp.float32)
    if n_moe:  # (a dense model's all-zero statistics are not reduced: XLA:CPU aborts on that all-reduce)
        stats_N = jax.tree.map(lambda s: pmax(psum(s, TOKEN_AXES), (TP,)), stats_N)
        groups_per_layer = n_tokens // (m_cfg.routing_group or m_cfg.seq_len)
        aux = mean_over_mesh(aux_sum_N, groups_per_layer * n_moe)
    loss = ce + m_cfg.aux_loss_weight * aux
    metrics = dict(loss=ce, aux_loss=aux, stats_N=stats_N, max_logit_NLH=max_logit_NLH,
                   max_logit=pmax(jnp.max(max_logit_NLH), (PP, TP)))
    if seq_aux_sum_N is not None:  # DeepSeek-V3's sequence-wise balance loss: mean over sequences and MoE layers
        metrics["seq_aux_loss"] = mean_over_mesh(seq_aux_sum_N, t_cfg.batch_size * n_moe)
        loss = loss + m_cfg.seq_aux_loss_weight * metrics["seq_aux_loss"]
    if m_cfg.mtp_depth:  # V3: lambda / depth x sum over depths of each depth's loss, each divided by all T positions
        metrics["mtp_loss"] = psum(mtp_sum, TOKEN_AXES + (PP,)) / (n_tokens * m_cfg.mtp_depth)
        loss = loss + m_cfg.mtp_loss_weight * metrics["mtp_loss"]
    return loss, metrics


def balance_sums(stats):
    """(load-balance sum, sequence-wise sum or zeros) of a block's, chunk's or stack's MoE
    statistics: what the blocks' backward seeds with sum_cotangents' aux and seq_aux."""
    aux = stats["aux_loss_sum"]
    return aux, stats.get("seq_aux_loss_sum", jnp.zeros_like(aux))


def sum_cotangents(cfg, tp):
    """d loss / d (one device's sums), for a backward written by hand: loss_and_metrics is linear in the sums, so these
    are constants. The 1/tp of the two balance losses is loss_and_metrics' pmean over tp. Keys: ce, aux, seq_aux, mtp."""
    m, t = cfg.model, cfg.train
    n_tokens = t.batch_size * m.seq_len
    n_moe = n_moe_layers(m)
    groups = n_tokens // (m.routing_group or m.seq_len)
    return dict(ce=1.0 / n_tokens,
                aux=m.aux_loss_weight / (groups * n_moe * tp) if n_moe else 0.0,
                seq_aux=m.seq_aux_loss_weight / (t.batch_size * n_moe * tp) if n_moe else 0.0,
                mtp=m.mtp_loss_weight / (n_tokens * m.mtp_depth) if m.mtp_depth else 0.0)


def metric_specs(cfg):
    """A shard_map step's metric out_specs: scalars replicated, per-block statistics over
    pp, max_logit_NLH also over tp."""
    m = cfg.model
    specs = dict(loss=P(), aux_loss=P(), grad_norm=P(), stats_N=P(PP), max_logit=P(), max_logit_NLH=P(PP, None, TP))
    if balancing(m):
        specs["router_bias_NLE"] = P(PP)
    if m.seq_aux_loss_weight > 0 and "M" in m.block_pattern:
        specs["seq_aux_loss"] = P()
    if m.mtp_depth:
        specs["mtp_loss"] = P()
    return specs


# ---- The update


def balancing(m_cfg):
    return m_cfg.router_bias_rate > 0 and "M" in m_cfg.block_pattern


def global_grad_norm(grads, specs):
    """sqrt(sum of squares) over the mesh, each shard's sum psummed over only the axes that
    split its weight, so a replicated gradient (alike on every replica) counts once."""
    total = jnp.zeros((), jnp.float32)
    for g, spec in zip(jax.tree.leaves(grads), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))):
        axes = tuple(a for entry in spec for a in axes_of(entry))
        total += psum(jnp.sum(jnp.square(g.astype(jnp.float32))), axes)
    return jnp.sqrt(total)


@jax.named_scope("optimizer")
def apply_gradients(params, opt_state, grads, metrics, cfg, optimizer, param_specs):
    """Clip to the global norm, run the optimizer on the local shards (laid out as `param_specs`), QK-clip, move the
    router biases by the step's load. Returns (params, opt_state, metrics with grad_norm and router biases)."""
    grad_norm = global_grad_norm(grads, param_specs)
    clip = cfg.train.grad_clip
    if clip > 0:
        scale = jnp.minimum(1.0, clip / (grad_norm + 1e-6))
        grads = jax.tree.map(lambda g: g * scale, grads)
    updates, opt_state = optimizer.update(grads, opt_state, params, param_specs=param_specs)
    new_params = optax.apply_updates(params, updates)
    if cfg.train.qk_clip > 0:
        new_params = qk_clip(new_params, metrics["max_logit_NLH"], cfg.train.qk_clip)
    metrics = dict(metrics, grad_norm=grad_norm)
    m_cfg = cfg.model
    if balancing(m_cfg):
        # Outside the optimizer (which leaves the bias as is), by the step's global load:
        # alike on every device and mesh.
        blocks = balance_router_biases(new_params["blocks"], metrics["stats_N"]["tokens_per_expert_LE"],
                                       m_cfg.router_bias_rate, m_cfg.block_pattern)
        new_params = dict(new_params, blocks=blocks)
        metrics["router_bias_NLE"] = router_biases(blocks, m_cfg.block_pattern)
    return new_params, opt_state, metrics


# ---- QK-clip (Kimi K2's MuonClip, arXiv:2507.20534 section 2.1)


def qk_clip(params, max_logit_NLH, tau):
    """After the update: each head whose largest logit of the step (max_logit_NLH, per block, layer and head) exceeded
    tau has its logits scaled by gamma = tau / max_logit; other heads stay bit for bit. As in K2: the per-head content
    weights wq_up_QHK (wq_DHK) and wk_up_AHK by sqrt(gamma) each, the rotary query wq_rope_QHR (wq_rope_DHR) by gamma;
    the shared rotary key, down-projections and norms untouched (they move every head). Not the dense prefix nor MTP.
    Works on local shards or global arrays; no state."""
    gamma_NLH = jnp.where(max_logit_NLH > tau, tau / max_logit_NLH, 1.0)
    layers = dict(params["blocks"]["layers"])
    for i, layer in layers.items():
        layers[i] = dict(layer, attn=clip_heads(layer["attn"], gamma_NLH[:, i]))
    return dict(params, blocks=dict(params["blocks"], layers=layers))


def clip_heads(attn, gamma_NH):
    """One stacked attention layer's weights [N, ..., H, ...] with head h of block n scaled
    as qk_clip says (gamma_NH[n, h])."""
    root_NH = jnp.sqrt(gamma_NH)
    factors = {"wk_up_AHK": root_NH, "wq_up_QHK": root_NH, "wq_DHK": root_NH, "wq_rope_QHR": gamma_NH, "wq_rope_DHR": gamma_NH}

    def scale(name, w_NXHY):
        if name not in factors:
            return w_NXHY
        return (w_NXHY * factors[name][:, None, :, None]).astype(w_NXHY.dtype)
    return {name: scale(name, w) for name, w in attn.items()}
