"""A run and what is done with it: its directory, its state built or restored on a
mesh, evaluation, and the modes that load a finished (or running) run: --mode sample,
eval, export, export_hf (and serve.py's loading). train.py trains one.

Every process runs these; only process 0 prints (say) and writes shared files.
"""

import json
import os

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

import checkpoint
from hf import hf_config
from hf import hf_interop
import optimizers
import parallel as par
from step import train_steps
from dataset import check_tokenizer, get_tokenizer, open_data
from flops import human
from sampling import generate
from utils import ConfigError, apply_overrides, config_from_dict, config_to_dict


def is_main_process():
    return jax.process_index() == 0


def say(*args):
    if is_main_process():
        print(*args, flush=True)


def run_dir_of(cfg):
    return os.path.join(cfg.run.out_dir, cfg.run.name)


def resolve_vocab(cfg, data):
    """The model's vocabulary comes from the data's manifest unless set explicitly."""
    check_tokenizer(data, cfg.model.vocab_size or data.vocab_size, cfg.data.tokenizer)
    if cfg.model.vocab_size == 0:
        cfg = apply_overrides(cfg, {"model": {"vocab_size": data.vocab_size}})
    return cfg


def describe_mesh(mesh):
    """Which device holds which (dp, pp, tp) coordinate (and cp, slice when they are
    more than 1), and which process owns it."""
    shown = par.shown_shape(mesh)
    lines = [f"mesh {shown} over {mesh.devices.size} devices, {jax.process_count()} process(es)"]
    for coords in np.ndindex(mesh.devices.shape):
        device, at = mesh.devices[coords], dict(zip(mesh.axis_names, coords))
        lines.append(f"  device {device.id:>3} (process {device.process_index}): " + " ".join(f"{a}={at[a]}" for a in shown))
    return "\n".join(lines)


# ----------------------------------------------------------------------------
# Named steps


def build_state(cfg, mesh):
    """Fresh params (same values on every mesh) and optimizer state, in their shards."""
    graphdef, params = par.init_params(cfg.model, mesh, cfg.mesh.expert_parallel, cfg.run.seed)
    optimizer = optimizers.make_optimizer(cfg.train)
    opt_state = optimizers.init_opt_state(optimizer, params, mesh)
    return graphdef, params, optimizer, opt_state


def evaluate(eval_step, params, data, cfg, mesh, rows):
    """Mean validation cross-entropy over a fixed set of batches."""
    losses = [eval_step(params, par.global_batch(mesh, batch, cfg.train.batch_size))
              for batch in data.eval_batches(cfg.train.eval_batches, cfg.train.batch_size, cfg.model.seq_len, rows=rows)]
    return float(np.mean(jax.device_get(losses)))


def host_params(params):
    """All weights on every process as plain arrays (for sampling on one device)."""
    return jax.tree.map(np.asarray, multihost_utils.process_allgather(params, tiled=True))


def samples_from_params(cfg, params, graphdef, n):
    """n samples of the --sample.* settings, seeds --sample.seed, +1, ...: the texts
    `--mode sample` prints for those seeds."""
    tokenizer = get_tokenizer(cfg.data.tokenizer, cfg.data.encoding_file)
    model = nnx.merge(graphdef, host_params(params))
    s = cfg.sample
    return [generate(model, tokenizer, s.prompt, s.max_tokens, s.temperature, s.top_k, s.seed + i,
                     frequency_penalty=s.frequency_penalty, presence_penalty=s.presence_penalty) for i in range(n)]


# ----------------------------------------------------------------------------
# Sampling, evaluation and export from a finished (or running) run


def load_run_params(cfg, devices=None, check=None):
    """The run's saved config and latest params, on the current mesh (over `devices`,
    default all), or the model of --train.init_from hf:DIR. `check(cfg)` runs on the
    resolved config, before any init."""
    run_dir = run_dir_of(cfg)
    config_path = os.path.join(run_dir, "config.json")
    cfg, hf_source = hf_interop.open_init_from(cfg)  # hf:DIR: the model is the one in that directory
    if hf_source is None:
        if not os.path.exists(config_path):
            raise ConfigError(f"no run at {run_dir} (missing config.json): train first, or pass --run.name/--run.out_dir")
        with open(config_path) as f:
            saved = config_from_dict(json.load(f))
        cfg = apply_overrides(cfg, {"model": vars(saved.model), "data": vars(saved.data)})
    if check is not None:
        check(cfg)
    mesh = par.make_mesh(cfg.mesh, devices)
    graphdef, params = par.init_params(cfg.model, mesh, cfg.mesh.expert_parallel, cfg.run.seed)
    source = hf_source or cfg.train.init_from or run_dir
    return cfg, graphdef, checkpoint.restore_params(source, params, cfg.model)


def sample_from_run(cfg):
    cfg, graphdef, params = load_run_params(cfg)
    return samples_from_params(cfg, params, graphdef, 1)[0]


def export_run(cfg):
    cfg, graphdef, params = load_run_params(cfg)
    out = checkpoint.export_slim(params, config_to_dict(cfg), os.path.join(run_dir_of(cfg), "export"))
    say(f"slim export (bfloat16 params + config.json): {out}, {human(checkpoint.directory_bytes(out))}B")


def export_hf_run(cfg):
    """<run_dir>/hf: the run's latest params as a Hugging Face directory (hf_interop.py)."""
    cfg, graphdef, params = load_run_params(cfg, check=lambda cfg: hf_config.check_exportable(cfg.model))
    host = host_params(params)
    out = os.path.join(run_dir_of(cfg), "hf")
    if is_main_process():
        tokenizer = get_tokenizer(cfg.data.tokenizer, cfg.data.encoding_file)
        hf_interop.write_hf_dir(out, host, cfg.model, tokenizer, cfg.export.dtype)
        model_type, architecture = hf_config.architecture_of(cfg.model)
        remote = " with its modeling code: load it with trust_remote_code=True" if model_type == "meshformer" else ""
        say(f"Hugging Face export ({architecture}, {cfg.export.dtype}): {out}, "
            f"{human(checkpoint.directory_bytes(out))}B{remote}")


def eval_run(cfg):
    """Validation loss of the run's latest params on the current mesh: what training's
    eval would print, on any mesh (the reshard check)."""
    cfg, graphdef, params = load_run_params(cfg)
    mesh = par.make_mesh(cfg.mesh)
    par.check_config_fits_mesh(cfg, mesh)
    data = open_data(cfg.data.source, cfg.data.cache_dir, cfg.data.cache_max_gb, jax.process_index())
    eval_step = train_steps.make_eval_step(graphdef, cfg, mesh, params)
    val = evaluate(eval_step, params, data, cfg, mesh, par.process_rows(mesh, cfg.train.batch_size))
    say(f"val_loss={val!r}")
