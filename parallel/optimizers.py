"""The optimizer: the learning-rate schedule, AdamW, and Muon for weights split over a mesh.

Muon (Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/) is momentum SGD whose update for each weight
matrix is orthogonalized (U V^T of the momentum's U S V^T, by Newton-Schulz), so every direction moves alike; it beats
AdamW on the default run (docs/benchmarks.md). AdamW still trains what is no matrix: embedding, norm scales, routers.
Muon's update has RMS 0.2 per element (Liu et al. 2025, https://arxiv.org/abs/2502.16982), about AdamW's, so both
share one learning rate and weight decay.

Orthogonalizing needs whole matrices, and each device holds shards of a batch of them.
The devices sharing a batch (the axes splitting its matrix dims) divide its matrices:
each matrix's owner gets its shards by all_to_all, orthogonalizes it, and sends back
each device's shard of the update (owner_orthogonal, as modded-nanogpt's Muon), so the
FLOPs per device fall by the group size. The step passes the layout:
`optimizer.update(grads, state, params, param_specs=...)`. Clipping happens before, in
the train step (it needs a mesh-wide norm).
"""

import itertools
import math
from collections import defaultdict

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from parallel.mesh import axes_of
from parallel.weights import is_stacked, row, weight_name

# Jordan's quintic: the coefficients maximize the slope at 0, so that 5 steps bring
# every singular value into about [0.7, 1.2], not exactly 1 (which does not hurt).
NEWTON_SCHULZ_COEFFS = (3.4445, -4.7750, 2.0315)
NEWTON_SCHULZ_STEPS = 5
UPDATE_RMS = 0.2


def is_matrix(path):
    """Muon trains it (weights.WEIGHTS' muon flag); AdamW the rest."""
    return row(weight_name(path)).muon


def matrix_dims(path, ndim):
    """(batch dims, fan-in dims, fan-out dims) of a weight, as tuples of dim indices:
    w_gate_EDF is E matrices of D x F, wo_HKD one (H K) x D."""
    batch, fan_in = row(weight_name(path)).muon_dims
    batch += is_stacked(path)  # the stacked blocks' leading N
    return tuple(range(batch)), tuple(range(batch, batch + fan_in)), tuple(range(batch + fan_in, ndim))


def orthogonalize(x_BIO, eps=1e-7):
    """Newton-Schulz on each [I, O] matrix of the batch: ~ U V^T of x = U S V^T, in float32."""
    a, b, c = NEWTON_SCHULZ_COEFFS
    tall = x_BIO.shape[-2] > x_BIO.shape[-1]
    x = x_BIO.mT if tall else x_BIO  # iterate on the smaller Gram matrix x x^T
    with jax.named_scope("newton_schulz"):  # (the optimized HLO's op names say which dots are these)
        x = x / (jnp.linalg.norm(x, axis=(-2, -1), keepdims=True) + eps)  # singular values <= 1
        for _ in range(NEWTON_SCHULZ_STEPS):
            gram = x @ x.mT
            x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def manual_axis_sizes():
    """{axis: size} of the mesh axes that shard_map made manual here ({} outside it)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return {}
    return {name: size for name, size, kind in zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types)
            if kind == jax.sharding.AxisType.Manual}


def scaled_orthogonal(x_BM, n_in):
    """Orthogonalized matrices [B, *matrix dims] (the first n_in fan-in), scaled to RMS 0.2."""
    B, *dims = x_BM.shape
    fan_in, fan_out = math.prod(dims[:n_in]), math.prod(dims[n_in:])
    update = orthogonalize(x_BM.reshape(B, fan_in, fan_out)) * (UPDATE_RMS * math.sqrt(max(fan_in, fan_out)))
    return update.reshape(x_BM.shape)


def split_axes(path, ndim, spec, manual):
    """((manual axes of size > 1 splitting matrix dim 0, in spec order), ...) of a weight's
    local shard; raises when a manual axis is > 1 and `spec` is None."""
    batch_dims, in_dims, out_dims = matrix_dims(path, ndim)
    if any(size > 1 for size in manual.values()) and spec is None:
        raise ValueError("Muon inside shard_map needs the params' PartitionSpecs: "
                         "optimizer.update(grads, state, params, param_specs=parallel.specs_of(params))")
    return tuple(tuple(a for a in axes_of(spec[d] if spec is not None else None) if manual.get(a, 1) > 1)
                 for d in in_dims + out_dims)


def owner_orthogonal(x_BM, n_in, dim_axes, manual):
    """scaled_orthogonal of a batch [B, *local matrix dims] that the group (the axes in dim_axes) holds in shards,
    every device the same B.

    The batch is padded with zero matrices to S k (S: group size); owner j takes matrices [j k, (j+1) k): an
    all_to_all brings it their shards, it orthogonalizes them, and the same all_to_all returns each device its shards
    of the updates. So each byte crosses once each way (2 (S-1)/S of the shard) and no device holds more than its
    shard plus padding; gathering to every device would move (S-1)x, hold Sx and repeat the FLOPs Sx."""
    group = tuple(a for a in manual if any(a in axes for axes in dim_axes))  # in mesh order
    if not group:
        return scaled_orthogonal(x_BM, n_in)
    sizes = [manual[a] for a in group]
    S, (B, *local) = math.prod(sizes), x_BM.shape
    k = -(-B // S)
    x = jnp.pad(x_BM, [(0, S * k - B)] + [(0, 0)] * len(local)).reshape(S, k, *local)
    # row s of the result: the shard that device s of the group holds of my k matrices
    x = jax.lax.all_to_all(x, group, 0, 0, tiled=True).reshape(*sizes, k, *local)
    # to whole matrices: each matrix dim is (its axes' block indices, in the spec's order) x local
    G = len(group)
    perm = [G] + [p for j, axes in enumerate(dim_axes) for p in [group.index(a) for a in axes] + [G + 1 + j]]
    whole_shape = [k] + [n * math.prod(manual[a] for a in axes) for n, axes in zip(local, dim_axes)]
    update = scaled_orthogonal(x.transpose(perm).reshape(whole_shape), n_in)
    update = update.reshape([x.shape[p] for p in perm]).transpose(tuple(perm.index(i) for i in range(len(perm))))
    update = jax.lax.all_to_all(update.reshape(S, k, *local), group, 0, 0, tiled=True)
    return update.reshape(S * k, *local)[:B]


def muon_pools(leaves, manual):
    """orthogonal_updates' batches (the planner counts off them too): leaves {key: (path,
    local shape, spec)}, manual {axis: size} -> (keys whose matrices are whole here,
    {(local matrix shape, fan-in dims, axes splitting each matrix dim): keys})."""
    whole, pools = [], defaultdict(list)
    for key, (path, shape, spec) in leaves.items():
        batch_dims, in_dims, _ = matrix_dims(path, len(shape))
        dim_axes = split_axes(path, len(shape), spec, manual)
        if any(dim_axes):
            pools[(tuple(shape[len(batch_dims):]), len(in_dims), dim_axes)].append(key)
        else:
            whole.append(key)
    return whole, dict(pools)


def orthogonal_updates(momenta, specs):
    """{key: (path, momentum)} -> {key: Muon update}; momenta are local shards laid out as
    specs[key] inside shard_map, whole arrays outside. Split matrices of one local shape
    and split are pooled into one batch, so every device of a group gets its share."""
    manual = manual_axis_sizes()
    whole, pools = muon_pools({key: (path, m.shape, specs.get(key)) for key, (path, m) in momenta.items()}, manual)
    updates = {}
    for key in whole:  # every matrix whole on this device: no one to share with
        path, m = momenta[key]
        batch_dims, in_dims, _ = matrix_dims(path, m.ndim)
        B = math.prod(m.shape[d] for d in batch_dims)
        updates[key] = scaled_orthogonal(m.reshape(B, *m.shape[len(batch_dims):]), len(in_dims)).reshape(m.shape)
    for (local, n_in, dim_axes), keys in pools.items():
        counts = [momenta[key][1].size // math.prod(local) for key in keys]
        x_BM = jnp.concatenate([momenta[key][1].reshape(n, *local) for key, n in zip(keys, counts)])
        update_BM = owner_orthogonal(x_BM, n_in, dim_axes, manual)
        for key, part in zip(keys, jnp.split(update_BM, list(itertools.accumulate(counts))[:-1])):
            updates[key] = part.reshape(momenta[key][1].shape)
    return updates


def scale_by_muon(beta):
    """optax transform: Nesterov momentum (`beta`), each matrix's update orthogonalized at
    RMS 0.2 (lr and decay follow in make_optimizer). update takes `param_specs` (a tree
    like the params') on shards inside shard_map; None on global arrays."""
    ema = lambda m, g: beta * m + (1 - beta) * g  # noqa: E731

    def init(params):
        return jax.tree.map(jnp.zeros_like, params)  # the momentum, in the params' shardings

    def update(grads, momentum, params=None, param_specs=None):
        del params
        specs = {} if param_specs is None else {
            jax.tree_util.keystr(path): spec
            for path, spec in jax.tree_util.tree_flatten_with_path(param_specs, is_leaf=lambda x: isinstance(x, P))[0]}
        momentum = jax.tree.map(ema, momentum, grads)
        nesterov = jax.tree.map(ema, momentum, grads)  # Nesterov: one more step ahead
        flat, treedef = jax.tree_util.tree_flatten_with_path(nesterov)
        keys = [jax.tree_util.keystr(path) for path, _ in flat]
        updates = orthogonal_updates({key: leaf for key, leaf in zip(keys, flat)}, specs)
        return jax.tree.unflatten(treedef, [updates[key] for key in keys]), momentum

    return optax.GradientTransformationExtraArgs(init, update)


def lr_schedule(train_cfg):
    decay = train_cfg.decay_steps or train_cfg.steps
    # Warmup starts at lr / warmup_steps rather than 0, so that step 0 already learns.
    return optax.warmup_cosine_decay_schedule(
        train_cfg.lr / max(train_cfg.warmup_steps, 1), train_cfg.lr, max(train_cfg.warmup_steps, 1), max(decay, train_cfg.warmup_steps + 1),
        end_value=train_cfg.lr * train_cfg.min_lr_ratio)


def make_optimizer(train_cfg):
    """--train.optimizer on float32 master weights: adamw, or muon (Muon on the weights
    weights.WEIGHTS marks muon, AdamW on the rest). Weight decay where the table says
    (not on norm scales, nor on what the optimizer does not train)."""
    schedule = lr_schedule(train_cfg)
    decay_mask = lambda params: jax.tree_util.tree_map_with_path(lambda p, _: row(weight_name(p)).trained and row(weight_name(p)).decay, params)  # noqa: E731
    adamw = optax.adamw(schedule, b1=train_cfg.beta1, b2=train_cfg.beta2, weight_decay=train_cfg.weight_decay, mask=decay_mask)
    if train_cfg.optimizer == "adamw":
        return adamw
    muon = optax.chain(scale_by_muon(train_cfg.muon_momentum),
                       optax.add_decayed_weights(train_cfg.weight_decay),
                       optax.scale_by_learning_rate(schedule))
    labels = lambda params: jax.tree_util.tree_map_with_path(lambda p, _: "muon" if is_matrix(p) else "adamw", params)  # noqa: E731
    return optax.partition({"muon": muon, "adamw": adamw}, labels)


def init_opt_state(optimizer, params, mesh):
    """Optimizer state born with the params' shardings (zeros_like keeps them)."""
    with jax.set_mesh(mesh):
        return jax.jit(optimizer.init)(params)
