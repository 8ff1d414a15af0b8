"""Orbax checkpoints: exact resume, restore onto any mesh, slim exports.

A checkpoint (<run_dir>/checkpoints/<step>/) holds three items:
  params     float32 weights            (restored straight into the new mesh's shardings)
  opt_state  AdamW moments and count
  meta       JSON: step, data position, seed, resolved config, wandb run id
Orbax writes each checkpoint into a temporary directory and renames it when complete,
so a crash mid-write leaves nothing that restore would pick up. Saving is
asynchronous: training continues while the arrays are written.

A slim export (<dir>/params + <dir>/config.json) is params only, in bfloat16: about a
sixth of a full checkpoint (2 bytes per weight instead of 4 + 4 + 4), for sampling and
fine-tuning (GPT-J's "slim" weights).
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from utils import ConfigError


def checkpoint_manager(run_dir, keep, primary_host=0):
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True, create=True)
    return ocp.CheckpointManager(os.path.abspath(os.path.join(run_dir, "checkpoints")), options=options,
                                 item_names=("params", "opt_state", "meta"))


def save_checkpoint(manager, step, params, opt_state, meta):
    """Start an asynchronous save of `step` (the number of completed optimizer steps)."""
    manager.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
        meta=ocp.args.JsonSave(dict(meta, step=step))))


def abstract_like(tree):
    """Shapes, dtypes and target shardings: restore writes each shard where it belongs,
    whatever mesh the checkpoint was written on."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def check_model_config(saved_model_cfg, model_cfg, where):
    """A checkpoint only fits the model it was written for; name what differs."""
    current = {k: v for k, v in vars(model_cfg).items()}
    # Fields that change the computation but not the weights may differ.
    free = {"dropout", "dtype", "remat", "capacity_factor", "aux_loss_weight", "routing_group"}
    diffs = [f"{k}: checkpoint {saved_model_cfg.get(k)!r} vs now {v!r}" for k, v in current.items()
             if k not in free and k in saved_model_cfg and saved_model_cfg[k] != v]
    if diffs:
        raise ConfigError(f"the checkpoint in {where} was written for another model ({'; '.join(diffs)}); "
                          f"use the same --model.* flags, or another --run.name")


def restore_checkpoint(manager, params, opt_state, model_cfg, step=None, log=print):
    """Restore (params, opt_state, meta) into the shardings of the given trees.

    `step` None = the latest. A checkpoint that fails to read (truncated, corrupt) is
    reported and the previous complete one is tried instead.
    """
    steps = sorted(manager.all_steps(), reverse=True)
    if step is not None:
        if step not in steps:
            raise ConfigError(f"no checkpoint at step {step} in {manager.directory}; available: {sorted(steps)}")
        steps = [s for s in steps if s <= step]
    for s in steps:
        meta = manager.restore(s, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        check_model_config(meta["config"]["model"], model_cfg, manager.directory)
        try:
            restored = manager.restore(s, args=ocp.args.Composite(
                params=ocp.args.StandardRestore(abstract_like(params)),
                opt_state=ocp.args.StandardRestore(abstract_like(opt_state))))
        except Exception as e:  # a damaged checkpoint: fall back, loudly
            log(f"WARNING: checkpoint step {s} in {manager.directory} could not be read ({type(e).__name__}: {e}); "
                f"trying the previous one")
            continue
        return restored["params"], restored["opt_state"], meta
    if steps:
        raise ConfigError(f"no readable checkpoint in {manager.directory}; delete it or use another --run.name")
    return None


def read_meta(run_dir, step=None):
    """The meta item of a run's latest (or given) checkpoint, without a manager."""
    manager = checkpoint_manager(run_dir, keep=None)
    steps = manager.all_steps()
    if not steps:
        return None
    return manager.restore(step if step is not None else max(steps), args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]


def restore_params(path, params, model_cfg):
    """Params only, from a slim export dir, a run dir, or its checkpoints/ dir, into
    the shardings of `params` (float32). For sampling and fine-tuning."""
    path = os.path.abspath(path)
    if not os.path.exists(path):
        raise ConfigError(f"{path} does not exist: give a run directory, its checkpoints/ directory, or a slim export")
    if os.path.exists(os.path.join(path, "params")) and os.path.exists(os.path.join(path, "config.json")) and not os.path.isdir(os.path.join(path, "checkpoints")):
        with open(os.path.join(path, "config.json")) as f:
            check_model_config(json.load(f)["model"], model_cfg, path)
        target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.bfloat16, sharding=a.sharding), params)
        restored = ocp.StandardCheckpointer().restore(os.path.join(path, "params"), target)
        return jax.tree.map(lambda a: a.astype(jnp.float32), restored)
    run_dir = os.path.dirname(path) if os.path.basename(path) == "checkpoints" else path
    manager = checkpoint_manager(run_dir, keep=None)
    for s in sorted(manager.all_steps(), reverse=True):
        meta = manager.restore(s, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        check_model_config(meta["config"]["model"], model_cfg, path)
        return manager.restore(s, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract_like(params))))["params"]
    raise ConfigError(f"no checkpoint found in {path}")


def export_slim(params, config_dict, out_dir):
    """Write params in bfloat16 + config.json: the small artefact to share."""
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.join(out_dir, "params"), jax.tree.map(lambda a: a.astype(jnp.bfloat16), params))
    checkpointer.wait_until_finished()
    if jax.process_index() == 0:
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(config_dict, f, indent=2)
    return out_dir


def directory_bytes(path):
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)
