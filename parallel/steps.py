"""The train and eval steps: one step, whichever executor computes its gradients.

    step(params, opt_state, tokens, step) =
        executor.value_and_grad   -> (loss, metrics), grads     (the schedule's part)
        step_core.apply_gradients -> clip, optimizer, router biases (everyone's part)

The config picks the executor (rules.executor_name, asked by the planner too); only it is
imported:

    --mesh.sharding manual, pp = 1, gpipe, microbatches > 1  accumulate.py (shard_map, a vjp per microbatch)
    --mesh.sharding manual, --train.pipeline gpipe        gpipe.py      (shard_map, autodiff)
    --mesh.sharding manual, --train.pipeline 1f1b         one_f_one_b.py (shard_map, hand-written backward)
    --mesh.sharding manual, --train.pipeline interleaved  one_f_one_b.py
    --mesh.sharding auto (pp = 1)                          auto.py       (jit partitions a one-device program)

Manual: one jax.shard_map, every collective written out; auto: jax.sharding.auto_axes, the compiler partitions. Both
keep the same storage shardings in and out, so params, optimizer state and checkpoints are interchangeable. A weight
replicated over an axis gets its gradient summed over it by shard_map's transpose (check_vma), with no code here.
"""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from model import Transformer
from parallel import optimizers, rules
from parallel import step_core as core
from parallel.mesh import batch_spec, global_batch, live_spec, named, specs_of
from parallel.weights import init_params
from utils import apply_overrides

EXECUTORS = {"auto": "auto", rules.ACCUMULATE: "accumulate", "gpipe": "gpipe", "1f1b": "one_f_one_b"}  # name -> module


def executor(name):
    """The executor module `name` (rules.executor_name), imported when first asked for."""
    return importlib.import_module(f"parallel.{EXECUTORS[name]}")


def executor_of(cfg):
    """The module that computes (loss, metrics, grads) under this config (rules.executor_name)."""
    return executor(rules.executor_name(cfg, cfg.mesh.pp))


def init_train_state(cfg, mesh):
    """Fresh params (same values on every mesh) and optimizer state, in their shards:
    (graphdef, params, optimizer, opt_state)."""
    if cfg.train.lora_rank or cfg.train.lora_targets:  # (only LoRA imports the adapters)
        return importlib.import_module("parallel.lora").init_train_state(cfg, mesh)
    graphdef, params = init_params(cfg.model, mesh, cfg.mesh.expert_parallel, cfg.run.seed)
    optimizer = optimizers.make_optimizer(cfg.train)
    opt_state = optimizers.init_opt_state(optimizer, params, mesh)
    return graphdef, params, optimizer, opt_state


def partition(fn, manual, mesh, in_specs, out_specs):
    """fn as one program over the mesh: a shard_map (manual), or a global program that
    the compiler partitions (its outputs in out_specs' shardings)."""
    if manual:
        # in_specs without size-1 axes (live_spec), so no collective runs over them; the
        # reshard to match moves nothing (same layout); outputs keep out_specs.
        live = live_spec(in_specs, mesh)
        sharded = jax.shard_map(fn, mesh=mesh, in_specs=live, out_specs=out_specs)

        @functools.wraps(fn)  # jit names the program after fn (profiles, HLO dumps)
        def on_live_axes(*args):
            return sharded(*jax.reshard(args, named(mesh, live)))
        return on_live_axes
    return jax.sharding.auto_axes(fn, out_sharding=named(mesh, out_specs))


def make_train_step(graphdef, cfg, mesh, optimizer, params, opt_state):
    """One jitted function over the mesh: loss, grads, clip, the optimizer, the router
    biases. Donates the old params and optimizer state (updated in place). DPO's: parallel/dpo.py."""
    if cfg.train.objective == "dpo":
        return importlib.import_module("parallel.dpo").make_dpo_step(graphdef, cfg, mesh, optimizer, params, opt_state)
    if cfg.train.lora_rank or cfg.train.lora_targets:  # (params holds params["lora"])
        return importlib.import_module("parallel.lora").make_train_step(graphdef, cfg, mesh, optimizer, params, opt_state)
    grads_of = executor_of(cfg)
    param_specs, opt_specs = specs_of(params), specs_of(opt_state)

    def step_fn(params, opt_state, tokens_bT1, step):
        rng = core.dropout_rng(cfg, step)
        # per_slice / reduce_over_slices: the gradient crosses slices once, here, not per layer
        (_, metrics), grads = grads_of.value_and_grad(core.per_slice(params), tokens_bT1, graphdef, cfg, rng)
        if cfg.train.objective != "lm":  # sft: a mean over the trained targets only
            metrics, grads = importlib.import_module("parallel.objectives").per_target(metrics, grads, tokens_bT1, cfg)
        grads = core.reduce_over_slices(grads, jnp.dtype(cfg.model.grad_reduce_dtype))
        # the layout of these shards, for the optimizers that need whole matrices (Muon)
        return core.apply_gradients(params, opt_state, grads, metrics, cfg, optimizer, param_specs)

    metric_specs = core.metric_specs(cfg) if grads_of.MANUAL else P()  # (auto: every metric replicated)
    sharded = partition(step_fn, grads_of.MANUAL, mesh, in_specs=(param_specs, opt_specs, batch_spec(), P()),
                        out_specs=(param_specs, opt_specs, metric_specs))
    return jax.jit(sharded, donate_argnums=(0, 1))


def eval_model_config(cfg):
    """The config evaluation measures: training's with --train.eval_capacity_factor (0 =
    dropless, as sampling, so val_loss counts no dropped token). Expert parallelism keeps
    fixed-size buffers: there dropless is factor E / top_k, room for every token."""
    m = cfg.model
    factor = cfg.train.eval_capacity_factor
    if factor == 0 and cfg.mesh.expert_parallel:
        factor = m.n_experts / m.top_k
    return apply_overrides(cfg, {"model": {"capacity_factor": factor}})


def make_eval_step(graphdef, cfg, mesh, params):
    """Jitted: mean validation cross-entropy of one batch (dropout off, eval_model_config's
    capacity), by GPipe's forward under shard_map. graphdef: training's; the eval one (the
    capacity is static) is built anew over the same params."""
    cfg = eval_model_config(cfg)
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model, nnx.Rngs(0))))[0]
    forward = executor("auto" if cfg.mesh.sharding == "auto" else "gpipe")

    def eval_fn(params, tokens_bT1):
        params = importlib.import_module("parallel.lora").merged(params, cfg.train) if "lora" in params else params
        loss = forward.loss(params, tokens_bT1, graphdef, cfg, None)[1]["loss"]
        return loss if cfg.train.objective == "lm" else loss * importlib.import_module("parallel.objectives").target_scale(tokens_bT1, cfg)

    return jax.jit(partition(eval_fn, forward.MANUAL, mesh, in_specs=(specs_of(params), batch_spec()), out_specs=P()))


def evaluate(eval_step, params, data, cfg, mesh, rows):
    """Mean validation cross-entropy over a fixed set of batches (this process reads `rows`)."""
    losses = [eval_step(params, global_batch(mesh, batch, cfg.train.batch_size))
              for batch in data.eval_batches(cfg.train.eval_batches, cfg.train.batch_size, cfg.model.seq_len, rows=rows)]
    return float(np.mean(jax.device_get(losses)))
