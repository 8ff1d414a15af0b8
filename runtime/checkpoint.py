"""Orbax checkpoints: exact resume, restore onto any mesh, slim exports. <run_dir>/checkpoints/<step>/ holds params
(float32), opt_state and meta (JSON: step, data position, seed, resolved config, wandb run id, each array's `fingerprint`).
Saves are asynchronous and atomic (temp dir, then rename). A checkpoint that fails to read or to match its fingerprint
(Orbax restores a flipped byte silently) is reported and the previous one used. A slim export (<dir>/params + config.json)
is params in bfloat16, untrained state (router biases) in float32: their 0.001 steps are below bfloat16's resolution near 1."""

import json
import logging
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from model import has_router_bias
from parallel.weights import is_trained, weight_name
from utils import HF_PREFIX, ConfigError

ITEMS = ("params", "opt_state", "meta")
TMP_MARK = ".orbax-checkpoint-tmp"  # Orbax writes <step><TMP_MARK>-<time> and renames it to <step> once complete


def warn(message):
    """Default report of a damaged checkpoint: stderr, so that sampled text on stdout stays clean."""
    if jax.process_index() == 0:
        print(message, file=sys.stderr, flush=True)

# ---- Saving


def checkpoint_manager(run_dir, keep, log=None):
    """The training run's manager: async writes, keeps the `keep` latest, deletes (naming them to `log`) interrupted writes' temp dirs."""
    directory = os.path.join(run_dir, "checkpoints")
    partial = sorted(n for n in os.listdir(directory) if TMP_MARK in n) if os.path.isdir(directory) else []
    for name in partial if log else []:
        log(f"skipping the partial checkpoint {os.path.join(directory, name)} (a write cut short; removed)")
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True, create=True, cleanup_tmp_directories=True)
    return ocp.CheckpointManager(os.path.abspath(os.path.join(run_dir, "checkpoints")), options=options, item_names=ITEMS)


def reader(run_dir):
    """A read-only manager (sampling, export, fine-tuning): safe on a run still training."""
    options = ocp.CheckpointManagerOptions(read_only=True, create=False)
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)  # Orbax warns "directory is read only": that is the point here
    try:
        return ocp.CheckpointManager(os.path.abspath(os.path.join(run_dir, "checkpoints")), options=options, item_names=ITEMS)
    finally:
        absl_logger.setLevel(level)


def _leaf_fingerprint(x):
    """sum of (element bits) x (2 x flat index + 1) mod 2^32: the odd multiplier catches any
    flipped bit, and an integer sum is the same in any order, so on any mesh."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32) if x.dtype.itemsize == 4 else x.astype(jnp.uint32)
    index, stride = jnp.zeros(x.shape, jnp.uint32), 1
    for dim in reversed(range(x.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, x.shape, dim) * jnp.uint32(stride % 2**32)
        stride *= x.shape[dim]
    return jnp.sum(bits * (index * jnp.uint32(2) + jnp.uint32(1)), dtype=jnp.uint32)


_fingerprints = jax.jit(lambda tree: jax.tree.map(_leaf_fingerprint, tree))


def fingerprint(tree):
    """{leaf path: uint32} of a (sharded) tree, computed where the shards live."""
    values = jax.device_get(_fingerprints(tree))
    return {jax.tree_util.keystr(path): int(v) for path, v in jax.tree_util.tree_flatten_with_path(values)[0]}


def save_checkpoint(manager, step, params, opt_state, meta):
    """Start an asynchronous save of `step` (completed optimizer steps); returns once the arrays are off the devices (may be donated)."""
    meta = dict(meta, step=step, fingerprint=fingerprint(dict(params=params, opt_state=opt_state)))
    manager.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state), meta=ocp.args.JsonSave(meta)))


# ---- Restoring


def abstract_like(tree, dtype=None):
    """Shapes, dtypes and target shardings, so restore places shards on the current mesh."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, dtype or a.dtype, sharding=a.sharding), tree)


def check_model_config(saved_model_cfg, model_cfg, where):
    """A checkpoint only fits the model it was written for; name what differs."""
    current = {k: v for k, v in vars(model_cfg).items()}
    # Fields that change the computation but not the weights may differ.
    free = {"dropout", "dtype", "remat", "moe_kernel", "attention", "attention_block", "unroll_blocks", "capacity_factor",
            "aux_loss_weight", "routing_group", "router_bias_rate", "router_bias", "seq_aux_loss_weight", "mtp_loss_weight"}
    diffs = [f"--model.{k}: checkpoint {saved_model_cfg.get(k)!r} vs now {v!r}" for k, v in current.items()
             if k not in free and k in saved_model_cfg and saved_model_cfg[k] != v]
    # The rate may change, but a bias exists only when it is > 0 or --model.router_bias.
    saved_bias = saved_model_cfg.get("router_bias_rate", 0) > 0 or saved_model_cfg.get("router_bias", False)
    if saved_bias != has_router_bias(model_cfg):
        diffs.append(f"--model.router_bias_rate: checkpoint {saved_model_cfg.get('router_bias_rate', 0)!r} vs now "
                     f"{model_cfg.router_bias_rate!r} (router biases exist only when it is > 0 or --model.router_bias is set; "
                     f"router_bias: checkpoint {saved_model_cfg.get('router_bias', False)!r} vs now {model_cfg.router_bias!r})")
    if diffs:
        raise ConfigError(f"the checkpoint in {where} was written for another model ({'; '.join(diffs)}); "
                          f"use the same --model.* flags, or another --run.name")


def schedule_of(train):
    """(lr, warmup, cosine decay end, final ratio): every step's learning rate. train: a TrainConfig or its dict."""
    t = train if isinstance(train, dict) else vars(train)
    return dict(lr=t["lr"], warmup_steps=t["warmup_steps"], decay_steps=t["decay_steps"] or t["steps"], min_lr_ratio=t["min_lr_ratio"])


def check_resume_config(saved_train, train_cfg, where):
    """Raise ConfigError for a resume with another batch size, learning-rate schedule or optimizer, naming the flags that keep the run whole."""
    if saved_train["batch_size"] != train_cfg.batch_size:
        raise ConfigError(f"the checkpoint in {where} was trained with --train.batch_size {saved_train['batch_size']}, "
                          f"not {train_cfg.batch_size}: a step's data position is step x batch size, so resuming with "
                          f"another batch size would skip or repeat data. Resume with --train.batch_size "
                          f"{saved_train['batch_size']}, or start another --run.name (--train.init_from this run keeps its weights)")
    saved_optimizer = saved_train.get("optimizer", "adamw")  # checkpoints from before Muon: AdamW
    if saved_optimizer != train_cfg.optimizer:
        raise ConfigError(f"the checkpoint in {where} was trained with --train.optimizer {saved_optimizer}, not "
                          f"{train_cfg.optimizer}: its optimizer state is {saved_optimizer}'s. Resume with --train.optimizer "
                          f"{saved_optimizer}, or start another --run.name (--train.init_from this run keeps its weights)")
    saved, now = schedule_of(saved_train), schedule_of(train_cfg)
    if saved != now:
        diffs = "; ".join(f"{k}: checkpoint {saved[k]!r} vs now {now[k]!r}" for k in saved if saved[k] != now[k])
        hint = (f" To train longer on the same schedule, pass --train.decay_steps {saved['decay_steps']} (after it the "
                f"learning rate stays at its final value)." if saved["decay_steps"] != now["decay_steps"] else "")
        raise ConfigError(f"the checkpoint in {where} follows another learning-rate schedule ({diffs}, decay_steps 0 "
                          f"meaning --train.steps): resuming would change the learning rate of steps already planned.{hint} "
                          f"Otherwise resume with the same --train.lr/warmup_steps/decay_steps/min_lr_ratio/steps, "
                          f"or start another --run.name")


# Settings a resume may change (it says which): they shape the steps to come; moments stay valid under other betas, decay, clipping.
RESUMABLE_CHANGES = (("train", "muon_momentum"), ("train", "weight_decay"), ("train", "beta1"), ("train", "beta2"),
                     ("train", "grad_clip"), ("data", "source"), ("data", "mixture"))


def changed_settings(saved_config, train_cfg, data_cfg=None):
    """'--train.weight_decay 0.1 -> 0.05, ...': the RESUMABLE_CHANGES that differ from those the checkpoint's config records ('' if none)."""
    now = {"train": train_cfg, "data": data_cfg}
    changes = [f"--{section}.{field} {saved_config[section][field]!r} -> {getattr(now[section], field)!r}"
               for section, field in RESUMABLE_CHANGES
               if now[section] is not None and field in saved_config.get(section, {})
               and saved_config[section][field] != getattr(now[section], field)]
    return ", ".join(changes)


def check_fingerprint(expected, tree, what):
    """Raise if restored arrays differ from what was saved (a damaged file)."""
    if expected is None:  # written before fingerprints existed
        return
    got = fingerprint(tree)
    bad = [k for k in expected if got.get(k) != expected[k]]
    if bad or set(got) != set(expected):
        raise ValueError(f"{what}: {len(bad)} array(s) do not match the fingerprint saved with them, e.g. {bad[:3]}")


def all_processes_agree(ok):
    """Every process must pick the same checkpoint: one that failed anywhere fails everywhere."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.asarray(ok))))


def set_aside(manager, steps, suffix, log):
    """Rename checkpoint dirs out of Orbax's sight (<step>.<suffix>), keeping files, so later saves of those steps neither skip nor collide."""
    if not steps:
        return
    if jax.process_index() == 0:
        for s in steps:
            source = os.path.join(str(manager.directory), str(s))
            target, n = f"{source}.{suffix}", 1
            while os.path.exists(target):
                target, n = f"{source}.{suffix}{n}", n + 1
            os.rename(source, target)
            log(f"moved checkpoint step {s} aside to {target} (delete it when no longer wanted)")
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("checkpoints set aside")
    manager.reload()


def restore_checkpoint(manager, params, opt_state, model_cfg, step=None, seed=None, log=warn, train_cfg=None, data_cfg=None):
    """(params, opt_state, meta) restored into the given trees' shardings; None without a checkpoint; `step` None = the latest.
    One that fails to read or match its fingerprint is moved aside (<step>.unreadable) and the previous one tried; later ones
    are moved aside (<step>.superseded). Raises ConfigError for another model or seed, for what check_resume_config refuses
    (with train_cfg), or when none is readable; logs the RESUMABLE_CHANGES (the data source too, with data_cfg)."""
    steps = sorted(manager.all_steps(), reverse=True)
    if step is not None:
        if step not in steps:
            raise ConfigError(f"no checkpoint at step {step} in {manager.directory}; available: {sorted(steps)}")
    later = [s for s in steps if step is not None and s > step]
    unreadable = []
    for s in [s for s in steps if step is None or s <= step]:
        error = RuntimeError("it failed on another process")
        try:
            meta = manager.restore(s, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
            saved_model = meta["config"]["model"]
        except Exception as e:
            meta, error = None, e
        if meta is not None:  # a readable checkpoint for another model or seed is the user's mistake: stop
            check_model_config(saved_model, model_cfg, manager.directory)
            if seed is not None and meta.get("seed", seed) != seed:
                raise ConfigError(f"the checkpoint in {manager.directory} was written with --run.seed {meta['seed']}, "
                                  f"not {seed}: the seed fixes the data order, so resume with --run.seed {meta['seed']} "
                                  f"or start another --run.name")
            if train_cfg is not None and "train" in meta["config"]:
                check_resume_config(meta["config"]["train"], train_cfg, manager.directory)
            try:
                restored = manager.restore(s, args=ocp.args.Composite(
                    params=ocp.args.StandardRestore(abstract_like(params)),
                    opt_state=ocp.args.StandardRestore(abstract_like(opt_state))))
                check_fingerprint(meta.get("fingerprint"), dict(params=restored["params"], opt_state=restored["opt_state"]), f"checkpoint step {s}")
            except Exception as e:
                meta, error = None, e
        if all_processes_agree(meta is not None):
            set_aside(manager, unreadable, "unreadable", log)
            set_aside(manager, later, "superseded", log)
            changes = train_cfg is not None and changed_settings(meta["config"], train_cfg, data_cfg)
            if changes:
                log(f"resuming step {s} with changed settings: {changes} (the saved optimizer state carries over; "
                    f"the steps from here use the new values)")
            return restored["params"], restored["opt_state"], meta
        log(f"WARNING: checkpoint step {s} in {manager.directory} could not be restored "
            f"({type(error).__name__}: {str(error)[:500]}); falling back to the previous checkpoint")
        unreadable.append(s)
    if steps:
        raise ConfigError(f"no readable checkpoint in {manager.directory} (tried steps {unreadable}); "
                          f"move that directory away or use another --run.name")
    return None


def open_init_from(cfg):
    """For `--train.init_from hf:DIR`: (cfg with that model, the opened source for restore_params), else (cfg, None); only then imports hf/."""
    if not cfg.train.init_from.startswith(HF_PREFIX):
        return cfg, None
    from hf import convert
    return convert.open_init_from(cfg)


def find_params_source(path):
    """('export', dir), ('run', run_dir) or, for open_init_from's source, ('hf', source); ConfigError for a path that is none of these."""
    if not isinstance(path, str):
        return "hf", path
    path = os.path.abspath(path)
    if not os.path.exists(path):
        raise ConfigError(f"{path} does not exist: give a run directory, its checkpoints/ directory, "
                          f"or a slim export (<run_dir>/export, from --mode export)")
    if os.path.isdir(os.path.join(path, "params")) and os.path.isfile(os.path.join(path, "config.json")):
        return "export", path
    run_dir = os.path.dirname(path) if os.path.basename(path) == "checkpoints" else path
    if not os.path.isdir(os.path.join(run_dir, "checkpoints")) or not reader(run_dir).all_steps():
        raise ConfigError(f"no checkpoint found in {path}: give a run directory that has checkpoints/<step>/, "
                          f"or a slim export (a directory with params/ and config.json)")
    return "run", run_dir


def restore_params(path, params, model_cfg, log=warn):
    """Params only (float32, in `params`' shardings) from a slim export, a run dir, its checkpoints/ or an opened hf:DIR.
    Reads only: a damaged checkpoint is reported and the previous one used, nothing is moved."""
    kind, path = find_params_source(path)
    if kind == "hf":
        return path.load(params, model_cfg, log)
    if kind == "export":
        with open(os.path.join(path, "config.json")) as f:
            check_model_config(json.load(f)["model"], model_cfg, path)
        abstract = jax.tree.map(lambda a, dtype: jax.ShapeDtypeStruct(a.shape, dtype, sharding=a.sharding), params, slim_dtypes(params))
        restored = ocp.StandardCheckpointer().restore(os.path.join(path, "params"), abstract)
        return jax.tree.map(lambda a: a.astype(jnp.float32), restored)
    manager = reader(path)
    for s in sorted(manager.all_steps(), reverse=True):
        ok, error = False, RuntimeError("it failed on another process")
        try:
            meta = manager.restore(s, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:
            ok, error = False, e
        else:
            check_model_config(meta["config"]["model"], model_cfg, path)
            try:
                restored = manager.restore(s, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract_like(params))))["params"]
                expected = meta.get("fingerprint")
                check_fingerprint(expected and {k: v for k, v in expected.items() if k.startswith("['params']")},
                                  dict(params=restored), f"checkpoint step {s}")
                ok = True
            except Exception as e:
                ok, error = False, e
        if all_processes_agree(ok):
            return restored
        log(f"WARNING: checkpoint step {s} in {path} could not be restored ({type(error).__name__}: {str(error)[:500]}); trying the previous one")
    raise ConfigError(f"no readable checkpoint in {path}")


# ---- Slim export (written by serving/modes.py's --mode export, restored by restore_params)


def slim_dtypes(params):
    """The dtype of each leaf in a slim export: bfloat16, but float32 for untrained state."""
    return jax.tree_util.tree_map_with_path(lambda path, a: jnp.bfloat16 if is_trained(weight_name(path)) else jnp.float32, params)
