"""The optimizer: the learning-rate schedule, AdamW, and Muon for weights split over a mesh.

Muon (Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/) is momentum SGD
whose update for each weight matrix is orthogonalized, U V^T of the momentum's
U S V^T, by a few Newton-Schulz iterations: every direction of the matrix moves by
the same amount, where Adam's steps follow the few directions with the largest
gradients. On the default run it reaches val loss 1.524 in 1000 steps where AdamW
reached 1.604 in 1200, in the same wall time (docs/benchmarks.md). AdamW still trains what is not
a matrix (`--train.optimizer muon`): the embedding, norm scales and routers.

Muon's update is scaled to an RMS of 0.2 per element (0.2 sqrt(max(fan_in, fan_out)),
Liu et al. 2025, https://arxiv.org/abs/2502.16982), about what AdamW's updates have,
so the two share one learning rate and one weight decay.

Orthogonalizing is not elementwise: it needs the whole matrix. Inside the sharded
train step each device holds shards (FSDP over dp, heads or hidden units over tp) of
a batch of matrices (the stacked blocks N over pp, the experts E over dp with expert
parallelism: those dims stay split). The devices that share a batch's shards (its
group: the mesh axes that split its matrix dims) divide the matrices among
themselves: each matrix has one owner, an all_to_all sends it the shards, it
orthogonalizes the whole matrix, and the inverse all_to_all sends every device its
shard of the update (owner_orthogonal; the modded-nanogpt speedrun's Muon likewise
gives each matrix to one rank). So the Newton-Schulz FLOPs per device fall by the
group size, and no device holds more than its shard's worth of matrices (plus
padding). Weights of one shape and layout are pooled into one batch first, so that
there are enough matrices to go round (orthogonal_updates).
The step, which knows the layout, passes it to the update:
`optimizer.update(grads, state, params, param_specs=...)` (steps.make_train_step).
Clipping is done before the optimizer, by hand in the train step (it needs a
mesh-wide norm).
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
    """(batch dims, fan-in dims, fan-out dims) of a weight: tuples of dim indices. E.g.
    the experts' w_gate_EDF is E matrices of D x F, the attention output wo_HKD one
    (H K) x D (weights.WEIGHTS: routed, fan_in)."""
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
    """The manual mesh axes (of size > 1) that split each matrix dim of a weight's local
    shard, in the spec's order: ((axes of matrix dim 0), ...)."""
    batch_dims, in_dims, out_dims = matrix_dims(path, ndim)
    if any(size > 1 for size in manual.values()) and spec is None:
        raise ValueError("Muon inside shard_map needs the params' PartitionSpecs: "
                         "optimizer.update(grads, state, params, param_specs=parallel.specs_of(params))")
    return tuple(tuple(a for a in axes_of(spec[d] if spec is not None else None) if manual.get(a, 1) > 1)
                 for d in in_dims + out_dims)


def owner_orthogonal(x_BM, n_in, dim_axes, manual):
    """Distributed Muon on a batch of matrices [B, *local matrix dims] that the devices of
    a group (the mesh axes in dim_axes) hold in shards, every device the same B.

    Each matrix gets one owner: the batch is padded to a multiple of the group size S
    (zero matrices, whose update is zero) and owner j takes matrices [j k, (j+1) k).
    all_to_all sends every shard to its matrix's owner, which then holds k whole
    matrices, orthogonalizes them, and the inverse all_to_all (the same one: row s goes
    to device s) sends each device its shards of the updates. Why all_to_all: each
    byte of momentum crosses the network once each way, 2 (S-1)/S of the local shard
    in all, and no device holds more than the size of its shard plus the padding;
    gathering to every device (as before) moved (S-1) times the shard, held S times it
    and repeated the Newton-Schulz FLOPs S times; gathering to owners and broadcasting
    back moves as much as all_gather. The owners split the FLOPs S ways when S divides B
    (scale_by_muon pools the weights of one shape and layout into one batch for that)."""
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
    """How orthogonal_updates batches the matrices: leaves {key: (path, local shape,
    spec)}, manual {axis: size} -> (keys of the weights whose matrices are whole here,
    {(local matrix shape, fan-in dims, axes splitting each matrix dim): keys}). The
    planner counts Muon's work and traffic off the same pools."""
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
    """The Muon update of every weight from its momentum: {key: (path, momentum)}
    (local shards inside shard_map, whose storage layouts are specs[key]; whole
    arrays outside) -> {key: update}.

    Weights whose matrices are split over the mesh are pooled by (local matrix shape,
    the axes that split each matrix dim): the blocks of a stack, the layers of a block
    and weights of one shape (w_gate, w_up) become one batch, so that there are
    enough matrices to give every device of the group its share (owner_orthogonal)."""
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
    """optax transform: Nesterov momentum (`beta`), then each matrix's update
    orthogonalized and scaled to RMS 0.2 (learning rate and weight decay come after,
    in make_optimizer). Its update takes the params' PartitionSpecs (`param_specs`, a
    tree like the params'), needed when it runs on shards inside shard_map; None when
    it runs on whole (global) arrays."""
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
