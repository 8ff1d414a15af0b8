"""The modes that load a finished (or running) run: --mode sample, eval, export,
export_hf, and the server's loading (serving/serve.py). main.py trains one.

Every process runs these; only process 0 prints (say) and writes shared files.
"""

import functools
import json
import os
import shutil

import jax
import orbax.checkpoint as ocp

from dataset import get_tokenizer, open_data
from parallel import steps
from parallel.mesh import check_config_fits_mesh, make_mesh, process_rows
from parallel.weights import init_params
from runtime import checkpoint
from runtime.devices import is_main_process, say
from runtime.flops import human
from runtime.sampling import host_params, samples_from_params
from utils import ConfigError, apply_overrides, config_from_dict, config_to_dict, run_dir_of


def load_run_params(cfg, devices=None, check=None):
    """The run's saved config and latest params, on the current mesh (over `devices`,
    default all), or the model of --train.init_from hf:DIR. `check(cfg)` runs on the
    resolved config, before any init."""
    run_dir = run_dir_of(cfg)
    config_path = os.path.join(run_dir, "config.json")
    cfg, hf_source = checkpoint.open_init_from(cfg)  # hf:DIR: the model is the one in that directory
    if hf_source is None:
        if not os.path.exists(config_path):
            raise ConfigError(f"no run at {run_dir} (missing config.json): train first, or pass --run.name/--run.out_dir")
        with open(config_path) as f:
            saved = config_from_dict(json.load(f))
        lora = {k: v for k, v in vars(saved.train).items() if k.startswith("lora_")}  # a LoRA run's adapters are merged below
        cfg = apply_overrides(cfg, {"model": vars(saved.model), "data": vars(saved.data), "train": lora})
    if check is not None:
        check(cfg)
    mesh = make_mesh(cfg.mesh, devices)
    source = hf_source or cfg.train.init_from or run_dir
    if hf_source is None and cfg.train.lora_rank and not cfg.train.init_from:  # a LoRA run: base + adapters, merged
        from parallel import lora
        graphdef, params, _, _ = lora.init_train_state(cfg, mesh)
        return cfg, graphdef, lora.merged(checkpoint.restore_params(source, params, cfg.model), cfg.train)
    graphdef, params = init_params(cfg.model, mesh, cfg.mesh.expert_parallel, cfg.run.seed)
    return cfg, graphdef, checkpoint.restore_params(source, params, cfg.model)


def sample_run(cfg):
    """--mode sample: one sample of the --sample.* settings, printed."""
    cfg, graphdef, params = load_run_params(cfg)
    print(samples_from_params(cfg, params, graphdef, 1)[0])


def export_slim(params, config_dict, out_dir):
    """Write params in bfloat16 (untrained state in float32: checkpoint.slim_dtypes) + config.json: the small
    artefact to share, restored by checkpoint.restore_params."""
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    checkpointer = ocp.StandardCheckpointer()
    slim = jax.tree.map(lambda a, dtype: a.astype(dtype), params, checkpoint.slim_dtypes(params))
    checkpointer.save(os.path.join(out_dir, "params"), slim)
    checkpointer.wait_until_finished()
    if jax.process_index() == 0:
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(config_dict, f, indent=2)
    return out_dir


def directory_bytes(path):
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def export_run(cfg):
    cfg, graphdef, params = load_run_params(cfg)
    out = export_slim(params, config_to_dict(cfg), os.path.join(run_dir_of(cfg), "export"))
    say(f"slim export (bfloat16 params + config.json): {out}, {human(directory_bytes(out))}B")


def export_hf_run(cfg):
    """<run_dir>/hf: the run's latest params as a Hugging Face directory (hf/convert.py)."""
    from hf import config as hf_config
    from hf import convert

    cfg, graphdef, params = load_run_params(cfg, check=lambda cfg: hf_config.check_exportable(cfg.model))
    host = host_params(params)
    out = os.path.join(run_dir_of(cfg), "hf")
    if is_main_process():
        tokenizer = get_tokenizer(cfg.data.tokenizer, cfg.data.encoding_file)
        convert.write_hf_dir(out, host, cfg.model, tokenizer, cfg.export.dtype)
        model_type, architecture = hf_config.architecture_of(cfg.model)
        remote = " with its modeling code: load it with trust_remote_code=True" if model_type == "meshformer" else ""
        say(f"Hugging Face export ({architecture}, {cfg.export.dtype}): {out}, "
            f"{human(directory_bytes(out))}B{remote}")


def eval_run(cfg):
    """Validation loss of the run's latest params on the current mesh: what training's
    eval would print, on any mesh (the reshard check). A run trained on --data.mixture
    prints one val_loss/<name>= line per source, as its eval rows, then the mixture's val_loss=."""
    cfg, graphdef, params = load_run_params(cfg)
    mesh = make_mesh(cfg.mesh)
    check_config_fits_mesh(cfg, mesh)
    if cfg.data.mixture:
        from data.mixture import open_mixture
        data = open_mixture(cfg, jax.process_index())
    else:
        data = open_data(cfg.data.source, cfg.data.cache_dir, cfg.data.cache_max_gb, jax.process_index())
    eval_step = steps.make_eval_step(graphdef, cfg, mesh, params)
    evaluate = functools.partial(steps.evaluate, eval_step, params, cfg=cfg, mesh=mesh, rows=process_rows(mesh, cfg.train.batch_size))
    vals = data.evaluate(evaluate) if cfg.data.mixture else {"val_loss": evaluate(data)}
    data.close()
    say("\n".join(f"{key}={value!r}" for key, value in sorted(vals.items(), key=lambda kv: kv[0] == "val_loss")))


MODES = {"sample": sample_run, "eval": eval_run, "export": export_run, "export_hf": export_hf_run}  # --mode -> its function
