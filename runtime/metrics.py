"""Run metrics: <run_dir>/metrics.jsonl, one JSON object per row, and its wandb mirror. Rows: train (`loss`, ..., `time`),
eval (`val_loss`) and runtime/goodput.py's `event` rows (`checkpoint`, `preempted`, `end` carry `goodput` totals; `restart`
says why and what was lost). main.py writes them (MetricsLog) and, on resume, drops those after the checkpoint
(truncate_metrics); read_metrics reads them back."""

import dataclasses
import json
import os

import numpy as np

from utils import ConfigError


class MetricsLog:
    """Appends rows to <run_dir>/metrics.jsonl and, with --log.wandb, to wandb (wandb_row). `wandb_id` (from the checkpoint's
    meta) continues that wandb run: online, wandb ignores the steps a resume repeats (bit for bit); offline, each start writes
    its own offline-run-*-<id> directory for `wandb sync`."""

    def __init__(self, run_dir, cfg, enabled=True, wandb_id=None):
        self.enabled, self.wandb = enabled, None
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.tokens_per_step = cfg.train.batch_size * cfg.model.seq_len
        self.prompt = cfg.sample.prompt
        if enabled and cfg.log.wandb:
            self.wandb = start_wandb(run_dir, cfg, wandb_id)

    @property
    def wandb_id(self):
        return self.wandb.id if self.wandb else None

    def write(self, row):
        if not self.enabled:
            return
        row = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in row.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb:
            self.wandb.log(wandb_row(row, self.tokens_per_step), step=wandb_step(row))

    def log_samples(self, step, samples):
        if self.wandb:
            import wandb

            table = wandb.Table(columns=["step", "prompt", "text"], data=[[step, self.prompt, s] for s in samples])
            self.wandb.log({"samples": table}, step=step)

    def close(self):
        if self.wandb:
            self.wandb.finish()


def start_wandb(run_dir, cfg, wandb_id):
    """A wandb run in <run_dir>/wandb holding the resolved config; `wandb_id` continues that run (WANDB_MODE=offline: no network)."""
    import wandb

    try:
        run = wandb.init(project=cfg.log.wandb_project, name=cfg.run.name, dir=run_dir, config=dataclasses.asdict(cfg), id=wandb_id, resume="allow")
    except wandb.errors.Error as e:
        raise ConfigError(f"--log.wandb: wandb could not start ({type(e).__name__}: {e}). Log in with `wandb login` "
                          "(or set WANDB_API_KEY), or set WANDB_MODE=offline and upload later with "
                          f"`wandb sync {os.path.join(run_dir, 'wandb', 'offline-run-*')}`") from e
    run.define_metric("val_loss", summary="min")
    print(f"wandb: {'continuing' if wandb_id else 'new'} run {run.id} ({'offline' if run.offline else 'online'}) in {run.dir}", flush=True)
    return run


def wandb_step(row):
    """wandb's step for a row: a restart row takes its checkpoint's step + 1, since online wandb drops a step that does not increase."""
    return row["step"] + 1 if row.get("event") == "restart" else row["step"]


def wandb_row(row, tokens_per_step):
    """One metrics.jsonl row as flat wandb keys: expert_load/block{n}/expert{e} (MoE blocks
    only), `tokens` (step x tokens per step) to chart against, and no `step` (wandb's x axis)."""
    flat = {"tokens": wandb_step(row) * tokens_per_step}
    for key, value in row.items():
        if key == "expert_load":
            for n, load_E in enumerate(value):
                if any(load_E):
                    flat.update({f"expert_load/block{n}/expert{e}": x for e, x in enumerate(load_E)})
        elif isinstance(value, list):
            flat.update({f"{key}/" + "/".join(map(str, i)): x for i, x in np.ndenumerate(np.asarray(value))})
        elif isinstance(value, dict):  # goodput rows: seconds per phase
            flat.update({f"{key}/{k}": x for k, x in value.items()})
        elif key not in ("step", "time") and not isinstance(value, str):  # wandb keeps its own clock; rows of a step share it
            flat[key] = value
    return flat


def read_metrics(run_dir):
    """The rows of <run_dir>/metrics.jsonl; a cut-short last line (a kill mid-write) is skipped, a damaged one raises ValueError."""
    path = os.path.join(run_dir, "metrics.jsonl")
    with open(path) as f:
        lines = f.readlines()
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines) and not line.endswith("\n"):
                break
            raise ValueError(f"{path}, line {number} is not JSON: {line[:80]!r}") from None
    return rows


def truncate_metrics(run_dir, after_step):
    """On resume, drop rows logged after the checkpoint (no step twice); rewrites a copy and renames it, so a kill loses nothing."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return
    rows = read_metrics(run_dir)
    with open(path + ".tmp", "w") as f:
        for row in rows:
            if row["step"] <= after_step:
                f.write(json.dumps(row) + "\n")
    os.replace(path + ".tmp", path)
