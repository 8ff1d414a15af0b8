"""LoRA (Hu et al. 2021, https://arxiv.org/abs/2106.09685): low-rank adapters beside frozen base weights, imported only
with --train.lora_rank.

A target weight W (its fan-in dims I, fan-out dims O, leading batch dims: the stacked blocks' N, a routed expert's E)
gets A [.., I, r] (random) and B [.., r, O] (zeros); the model runs on W + (alpha / r) A @ B. The delta is applied at
the weight level, so model.py and every executor run unchanged on the merged weights: the executor's gradient of a
merged weight, pulled back through the merge (jax.vjp), gives the adapters' gradients (the merge is linear in each of
A and B, so this is the gradient of (x @ A) @ B). The base is never updated: the optimizer (AdamW, no weight decay,
which would pull B back to the base model) holds the adapters only, and the router biases stay as they are.

The train state's params are the base tree plus params["lora"] = {"a": .., "b": ..}, each a tree of the target
weights under their own paths and names, so the weight table's row and `is_stacked` still apply. Sharding: A is laid
out as W's batch and fan-in dims (its r whole), B as W's batch and fan-out dims; so on every device the local
A @ B is exactly the local shard of the delta, and shard_map's transpose sums the adapters' gradients over the axes
that split the other factor (check_vma), with no collective written here.
"""

import math

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from model import router_biases
from parallel import objectives, optimizers, steps
from parallel import step_core as core
from parallel.mesh import batch_spec, named, specs_of
from parallel.weights import init_params, is_stacked, row, weight_layout, weight_name
from utils import ConfigError

ATTENTION = ("wq_down_DQ", "wq_up_QHK", "wq_rope_QHR", "wq_DHK", "wq_rope_DHR", "wkv_down_DA", "wk_rope_DR",
             "wk_up_AHK", "wv_up_AHK", "wo_HKD")  # every matrix of MLA
EXPERTS = ("w_gate_DF", "w_up_DF", "w_down_FD", "w_gate_EDF", "w_up_EDF", "w_down_EFD")  # dense, shared and routed FFNs
TARGETS = {"attention": ATTENTION, "experts": EXPERTS, "all": ATTENTION + EXPERTS}  # --train.lora_targets -> weights
DEFAULT_TARGETS = "attention"  # as the LoRA paper (its best budget went to the attention projections)


def check_config(cfg):
    """One-line errors for a LoRA config that cannot run."""
    t = cfg.train
    if t.lora_rank <= 0:
        raise ConfigError(f"--train.lora_rank must be > 0 for LoRA (got {t.lora_rank}); "
                          f"use 0 and no --train.lora_targets to train every weight")
    if (t.lora_targets or DEFAULT_TARGETS) not in TARGETS:
        raise ConfigError(f"--train.lora_targets must be one of {', '.join(TARGETS)}, got {t.lora_targets!r}")
    if t.lora_alpha <= 0:
        raise ConfigError(f"--train.lora_alpha must be > 0, got {t.lora_alpha}")
    if t.objective == "dpo":
        raise ConfigError("--train.objective dpo does not train LoRA adapters here: use --train.objective lm or sft with --train.lora_rank")
    if t.qk_clip > 0:
        raise ConfigError("--train.qk_clip rescales the base weights, which LoRA freezes: use --train.qk_clip 0 with --train.lora_rank")


def targets(train_cfg):
    return TARGETS[train_cfg.lora_targets or DEFAULT_TARGETS]


def scale(train_cfg):
    return train_cfg.lora_alpha / train_cfg.lora_rank


# ---- Adapter shapes and layout


def _key(k):
    return k.key if hasattr(k, "key") else str(k.idx)


def target_leaves(base, train_cfg):
    """[(key path as a tuple of str, path, weight)] of the base weights that get adapters."""
    names = targets(train_cfg)
    return [(tuple(_key(k) for k in path), path, w) for path, w in jax.tree_util.tree_flatten_with_path(base)[0]
            if weight_name(path) in names]


def split_dims(path, ndim):
    """(batch, fan-in, fan-out) dim counts of a target weight."""
    w = row(weight_name(path))
    batch = int(is_stacked(path)) + int(w.routed)
    return batch, w.fan_in, ndim - batch - w.fan_in


def adapter_shapes(path, shape, rank):
    """(A's shape, B's shape) of a weight of `shape`."""
    batch, fan_in, _ = split_dims(path, len(shape))
    lead, ins, outs = shape[:batch], shape[batch:batch + fan_in], shape[batch + fan_in:]
    return (*lead, *ins, rank), (*lead, rank, *outs)


def adapter_specs(path, ndim, expert_parallel):
    """(A's spec, B's spec): W's layout on their dims (weights.weight_layout), r whole."""
    dims = weight_layout(weight_name(path), is_stacked(path), expert_parallel)[0]
    batch, fan_in, _ = split_dims(path, ndim)
    return P(*dims[:batch + fan_in], None), P(*dims[:batch], None, *dims[batch + fan_in:])


def nest(items):
    """{(k1, k2, ..): leaf} -> nested dicts."""
    tree = {}
    for keys, leaf in items.items():
        node = tree
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = leaf
    return tree


def flat(tree):
    return {tuple(_key(k) for k in path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def adapter_layout(base, train_cfg, expert_parallel):
    """[(key path, A's shape, A's spec, B's shape, B's spec, fan-in size)] for the targets of `base` (arrays or shape
    structs), in the base tree's order."""
    layout = []
    for keys, path, w in target_leaves(base, train_cfg):
        (a_shape, b_shape), (a_spec, b_spec) = adapter_shapes(path, w.shape, train_cfg.lora_rank), adapter_specs(path, w.ndim, expert_parallel)
        batch, fan_in, _ = split_dims(path, w.ndim)
        layout.append((keys, a_shape, a_spec, b_shape, b_spec, math.prod(w.shape[batch:batch + fan_in])))
    return layout


def init_adapters(base, cfg, mesh):
    """{"a": .., "b": ..}: A ~ N(0, 1 / fan-in) (each target its own key: the same values on every mesh), B = 0, in
    their shards."""
    layout = adapter_layout(base, cfg.train, cfg.mesh.expert_parallel)
    specs = {"a": nest({e[0]: e[2] for e in layout}), "b": nest({e[0]: e[4] for e in layout})}

    def create():
        keys = jax.random.split(jax.random.key(cfg.run.seed + 1), len(layout))
        a = {keys_path: jax.random.normal(keys[i], a_shape, jnp.float32) / math.sqrt(fan_in)
             for i, (keys_path, a_shape, _, _, _, fan_in) in enumerate(layout)}
        b = {e[0]: jnp.zeros(e[3], jnp.float32) for e in layout}
        return {"a": nest(a), "b": nest(b)}

    return jax.jit(create, out_shardings=named(mesh, specs))()


# ---- The merge: W + (alpha / r) A @ B, on whole arrays or on local shards alike


def delta(path, ndim, a, b):
    """A @ B over r, shaped as the weight of `ndim` dims (einsum letters: batch, fan-in, z = r, fan-out)."""
    batch, fan_in, _ = split_dims(path, ndim)
    lead, ins, outs = "abcdefgh"[:batch], "abcdefgh"[batch:batch + fan_in], "abcdefgh"[batch + fan_in:ndim]
    return jnp.einsum(f"{lead}{ins}z,{lead}z{outs}->{lead}{ins}{outs}", a, b, precision=jax.lax.Precision.HIGHEST)


def frozen(params):
    """The base weights of a LoRA train state (all of a plain one)."""
    return {k: v for k, v in params.items() if k != "lora"}


def merged(params, train_cfg):
    """The weights the model runs on: each target W + (alpha / r) A @ B, in W's dtype; B = 0 gives W bit for bit.
    What export writes and serving runs (a plain params tree, as the model's)."""
    if "lora" not in params:
        return params
    a, b, s = flat(params["lora"]["a"]), flat(params["lora"]["b"]), scale(train_cfg)

    def add(path, w):
        keys = tuple(_key(k) for k in path)
        return (w + s * delta(path, w.ndim, a[keys], b[keys])).astype(w.dtype) if keys in a else w
    return jax.tree_util.tree_map_with_path(add, frozen(params))


# ---- The train state and step


def make_optimizer(train_cfg):
    """AdamW on the adapters, on the run's schedule; no weight decay (it would pull B back to the base model)."""
    return optax.adamw(optimizers.lr_schedule(train_cfg), b1=train_cfg.beta1, b2=train_cfg.beta2, weight_decay=0.0)


def init_train_state(cfg, mesh):
    """As steps.init_train_state: (graphdef, base params + params["lora"], the adapters' optimizer, its state)."""
    check_config(cfg)
    graphdef, base = init_params(cfg.model, mesh, cfg.mesh.expert_parallel, cfg.run.seed)
    adapters = init_adapters(base, cfg, mesh)
    optimizer = make_optimizer(cfg.train)
    return graphdef, dict(base, lora=adapters), optimizer, optimizers.init_opt_state(optimizer, adapters, mesh)


def update_adapters(adapters, opt_state, grads, cfg, optimizer, specs):
    """Clip the adapters' gradients to their global norm and step the optimizer: (adapters, opt_state, grad_norm)."""
    grad_norm = core.global_grad_norm(grads, specs)
    if cfg.train.grad_clip > 0:
        clip = jnp.minimum(1.0, cfg.train.grad_clip / (grad_norm + 1e-6))
        grads = jax.tree.map(lambda g: g * clip, grads)
    updates, opt_state = optimizer.update(grads, opt_state, adapters)
    return optax.apply_updates(adapters, updates), opt_state, grad_norm


def make_train_step(graphdef, cfg, mesh, optimizer, params, opt_state):
    """As steps.make_train_step, over a LoRA train state: the executor differentiates the merged weights, the merge's
    pullback gives the adapters' gradients, the optimizer steps the adapters alone. The base (router biases too) is
    returned as it came."""
    grads_of = steps.executor_of(cfg)
    param_specs, opt_specs = specs_of(params), specs_of(opt_state)

    def step_fn(params, opt_state, tokens_bT1, step):
        on_slice = core.per_slice(params)  # (as steps.make_train_step: the gradient crosses slices once, below)
        base = frozen(on_slice)
        weights, pullback = jax.vjp(lambda adapters: merged(dict(base, lora=adapters), cfg.train), on_slice["lora"])
        (_, metrics), grads = grads_of.value_and_grad(weights, tokens_bT1, graphdef, cfg, core.dropout_rng(cfg, step))
        if cfg.train.objective != "lm":
            metrics, grads = objectives.per_target(metrics, grads, tokens_bT1, cfg)
        grads = core.reduce_over_slices(pullback(grads)[0], jnp.dtype(cfg.model.grad_reduce_dtype))
        adapters, opt_state, grad_norm = update_adapters(params["lora"], opt_state, grads, cfg, optimizer, param_specs["lora"])
        metrics = dict(metrics, grad_norm=grad_norm)
        if core.balancing(cfg.model):  # reported, not moved: the base is frozen
            metrics["router_bias_NLE"] = router_biases(params["blocks"], cfg.model.block_pattern)
        return dict(params, lora=adapters), opt_state, metrics

    metric_specs = core.metric_specs(cfg) if grads_of.MANUAL else P()
    sharded = steps.partition(step_fn, grads_of.MANUAL, mesh, in_specs=(param_specs, opt_specs, batch_spec(), P()),
                              out_specs=(param_specs, opt_specs, metric_specs))
    return jax.jit(sharded, donate_argnums=(0, 1))
