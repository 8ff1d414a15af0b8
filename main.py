"""Train (or sample from, or export) the MoE transformer over an n-dimensional device mesh.

    python main.py                                  # Shakespeare, bytes, small MoE, CPU
    python main.py --run.cpu_devices 8 --mesh.dp 2 --mesh.pp 2 --mesh.tp 2 --train.microbatches 2
    python main.py --mode sample --sample.prompt "JULIET:"
    python main.py --mode export                   # slim bfloat16 params in <run_dir>/export
    python main.py --mode export_hf                # a Hugging Face directory in <run_dir>/hf
    python main.py --mode eval                     # restore, print val_loss=... (any mesh)
    python main.py --mode serve                    # OpenAI-compatible completions + a web page

Reads top to bottom as a run does: parse the flags, set up the devices, then for --mode train (the default) the
training loop: the mesh, the data, init or resume, compile, the steps with evaluations and checkpoints, samples and
plots. The other modes live in serving/ and are imported only when asked for. Nothing imports this file.
"""

import dataclasses
import functools
import json
import math
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dataset import open_data, resolve_vocab
from parallel import steps
from parallel.mesh import check_config_fits_mesh, describe_mesh, global_batch, make_mesh, memory_summary, process_rows
from parallel.optimizers import lr_schedule
from parallel.rules import formula_bubble
from parallel.weights import weight_name
from runtime import checkpoint, dtype_probe, flops, goodput, progress
from runtime.devices import align_processes, is_main_process, say, setup_devices, stop_now
from runtime.metrics import MetricsLog, read_metrics, truncate_metrics
from runtime.plots import plot_run
from runtime.preemption import PREEMPTED_EXIT_CODE, Preemption
from runtime.sampling import samples_from_params
from utils import ConfigError, config_to_dict, kernels_for, parse_args, run_dir_of

RESTART_REASON_ENV = "MESHFORMER_RESTART_REASON"  # launcher.sh --watch: why it started the run again


def main(argv):
    try:
        cfg = parse_args(argv)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    several_processes = setup_devices(cfg)
    try:
        cfg = dtype_probe.resolve_dtype(cfg)  # --model.dtype auto: decided once, here; the run's config.json keeps it
        cfg = kernels_for(cfg, jax.default_backend())  # --model.attention / moe_kernel auto, as --model.dtype
        run_mode(cfg)
    except (ConfigError, FileNotFoundError) as e:  # a missing data directory or shard names itself and what to give
        sys.exit(f"error: {e}")
    except Exception as e:
        if not several_processes:
            raise
        # An error in one process leaves the others stuck in a collective: stop now, so
        # that they in turn see the connection close and stop too.
        traceback.print_exc()
        stop_now(f"error: process {jax.process_index()} of {jax.process_count()} stopped on {type(e).__name__} above. "
                 "If it reports a closed or reset connection or a read timeout, another process died or its host became unreachable: "
                 "see that process's log. Start all processes again to resume from the last checkpoint.")


def run_mode(cfg):
    """--mode train here; the others from serving/, imported only then."""
    if cfg.mode == "train":
        train(cfg)
    elif cfg.mode == "serve":
        from serving import serve
        serve.serve_run(cfg)
    else:
        from serving import modes
        modes.MODES[cfg.mode](cfg)


# ---- Training: what travels together


@dataclasses.dataclass
class Run:
    """A training run's handles, made once by train()."""
    cfg: object  # utils.Config, with the vocabulary resolved
    mesh: jax.sharding.Mesh
    data: object  # dataset.TokenData
    rows: object  # the global batch rows this process reads (parallel/mesh.process_rows)
    manager: object  # the checkpoint manager (runtime/checkpoint.py)
    clock: goodput.PhaseClock  # where the wall time goes
    preemption: Preemption
    reporter: "Reporter" = None
    local: object = None  # the local checkpoint tier (runtime/local_tier.py), with --train.local_checkpoint_every
    tasks: object = None  # --eval.tasks' harness tasks (runtime/harness.py): params -> {eval/<task>/<metric>: score}


@dataclasses.dataclass
class TrainState:
    """What a step updates, and where the run stands."""
    params: dict
    opt_state: object
    step: int  # steps done
    wandb_id: str | None = None  # the wandb run this one continues


def train(cfg):
    """Train the run `cfg` names (resuming it if it has checkpoints); returns its directory. On SIGTERM or SIGINT
    every process saves at the same step and exits with preemption.PREEMPTED_EXIT_CODE (stop_preempted)."""
    clock = goodput.PhaseClock()  # from this process's start: where the wall time goes
    run_dir = run_dir_of(cfg)
    cfg, hf_source = checkpoint.open_init_from(cfg)  # hf:DIR: the model is the one in that directory
    os.makedirs(run_dir, exist_ok=True)
    with Preemption() as preemption:
        mesh = make_mesh(cfg.mesh)
        if cfg.train.objective != "lm":  # (only sft and dpo import conversations and the chat templates)
            data = __import__("data.preferences").preferences.open_objective_data(cfg, jax.process_index())
        elif cfg.data.mixture:
            from data.mixture import open_mixture  # (only a mixture imports the mixing)
            data = open_mixture(cfg, jax.process_index())
        else:
            data = open_data(cfg.data.source, cfg.data.cache_dir, cfg.data.cache_max_gb, jax.process_index())
        cfg = resolve_vocab(cfg, data)
        check_config_fits_mesh(cfg, mesh)
        if cfg.model.quant != "none" and (note := quant_note(cfg, mesh)):
            print(note, flush=True)
        describe_model(cfg, mesh)
        graphdef, optimizer, state, manager, local = init_or_resume(cfg, mesh, run_dir, hf_source)
        run = Run(cfg, mesh, data, process_rows(mesh, cfg.train.batch_size), manager, clock, preemption, local=local)
        if cfg.eval.tasks:  # (only a run with tasks imports the harness, and lm-eval)
            run.tasks = __import__("runtime.harness").harness.TaskEval(cfg, mesh, run.rows, state.params)
        log = start_log(cfg, run_dir, state, clock)
        first_batch = train_batch(run, state.step)
        with clock.phase("compile"):
            train_step = compile_train_step(cfg, mesh, graphdef, optimizer, state, first_batch)
        eval_step = steps.make_eval_step(graphdef, cfg, mesh, state.params)
        align_processes("compiled", cfg.dist.timeout_s)  # the first step sets up its collectives
        run.reporter = Reporter(cfg, log, state.step, manager, mesh, data)
        start_step = state.step
        stopped = train_loop(run, state, train_step, eval_step, first_batch)
        run.reporter.progress.close()
        data.close()
        if stopped:
            stop_preempted(state.step, preemption, manager, log)
    clock.switch("other")
    # Every process, not only 0: each one should have read only its own rows.
    print(f"process {jax.process_index()} loaded rows: {data.rows_loaded}", flush=True)
    if cfg.sample.num_samples and cfg.train.steps > start_step:
        write_samples(cfg, run_dir, state.params, graphdef, log)
    log.write(clock.row(cfg.train.steps, "end"))
    log.close()
    if cfg.log.plots and is_main_process():
        plot_run(run_dir)
    say(goodput.summary(clock.totals(), restarts=log.restarts, devices=clock.device_totals()))
    return run_dir


# ---- The steps of train(), in order


def quant_note(cfg, mesh):
    from ops import quant  # (only a quantized run imports the quantized kernels)
    return quant.check_chip(cfg.model.quant, mesh.devices.flat[0])


def describe_model(cfg, mesh):
    say(describe_mesh(mesh))
    total, active = flops.count_params(cfg.model)
    bubble = formula_bubble(cfg.train.pipeline, mesh.shape['pp'], cfg.train.microbatches, cfg.train.virtual_stages)
    say(f"model: {flops.human(total)} params, {flops.human(active)} active per token; "
        f"pipeline {cfg.train.pipeline}, bubble {bubble:.0%}")


def init_or_resume(cfg, mesh, run_dir, hf_source):
    """(graphdef, optimizer, TrainState, checkpoint manager, local tier or None): fresh state, then the run's latest checkpoint
    in either tier (or --train.resume_step's), or else --train.init_from's params (`hf_source`: hf:DIR)."""
    init_from = hf_source or cfg.train.init_from
    if init_from:
        checkpoint.find_params_source(init_from)  # a wrong path fails before anything compiles
    graphdef, params, optimizer, opt_state = steps.init_train_state(cfg, mesh)
    state = TrainState(params, opt_state, 0)
    align_processes("before_restore", cfg.dist.timeout_s)  # (the manager's first collective follows)
    manager = checkpoint.checkpoint_manager(run_dir, cfg.train.keep_checkpoints, log=say)
    resume_step = None if cfg.train.resume_step < 0 else cfg.train.resume_step
    local = None
    if cfg.train.local_checkpoint_every:
        from runtime.local_tier import LocalTier  # (only a run with the local tier imports it)
        local = LocalTier(cfg, run_dir)
    restored = local and local.restore(params, opt_state, manager.latest_step(), log=say)
    restored = restored or checkpoint.restore_checkpoint(manager, params, opt_state, cfg.model, resume_step, cfg.run.seed,
                                                         log=say, train_cfg=cfg.train, data_cfg=cfg.data)
    if restored is not None:
        params, opt_state, meta = restored
        state = TrainState(params, opt_state, meta["step"], meta.get("wandb_id"))
        persistent = local.persistent_line(state.step, manager.directory) if local else f"resumed from {run_dir}/checkpoints/{state.step}"
        say(meta.get("resumed_from", persistent)
            + (" (--train.init_from ignored: this run already has checkpoints)" if cfg.train.init_from else ""))
        if hf_source is not None:
            hf_source.close()
    elif cfg.train.init_from:
        base = {k: v for k, v in params.items() if k != "lora"}  # (LoRA's adapters start fresh)
        state.params = dict(params, **checkpoint.restore_params(init_from, base, cfg.model, log=say))
        say(f"initialised params from {cfg.train.init_from} (fresh optimizer)")
    return graphdef, optimizer, state, manager, local


def start_log(cfg, run_dir, state, clock):
    """config.json, metrics.jsonl cut back to the checkpoint, and the MetricsLog appending to
    it. A resume logs a `restart` row: why ($RESTART_REASON_ENV), the steps redone, the time lost."""
    start_step, restart = state.step, None
    if is_main_process():
        old_rows = read_metrics(run_dir) if start_step and os.path.exists(os.path.join(run_dir, "metrics.jsonl")) else []
        truncate_metrics(run_dir, start_step)
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump(config_to_dict(cfg), f, indent=2)
        stopped = [r for r in old_rows if r.get("event") == "preempted" and r["step"] == start_step]
        reason = os.environ.get(RESTART_REASON_ENV) or (f"preempted at step {start_step}" if stopped else "started again")
        restart = clock.resume(old_rows, start_step, reason)
    log = MetricsLog(run_dir, cfg, enabled=is_main_process(), wandb_id=state.wandb_id)
    log.restarts = restart["restart"] if restart else 0
    if restart:
        log.write(restart)
        say(f"restart {restart['restart']} ({reason}): {restart['steps_redone']} step(s) to redo, "
            f"{restart['redone_s'] + restart['down_s']:.1f}s lost ({restart['redone_s']:.1f}s of steps redone, "
            f"{restart['down_s']:.1f}s down)")
    return log


def train_batch(run, step):
    """The global batch of `step`, of which this process reads its rows."""
    cfg = run.cfg
    tokens = run.data.batch("train", step, cfg.train.batch_size, cfg.model.seq_len, cfg.run.seed, run.rows)
    return global_batch(run.mesh, tokens, cfg.train.batch_size)


def compile_train_step(cfg, mesh, graphdef, optimizer, state, first_batch):
    """The train step, compiled ahead of the loop, with what device 0 will hold."""
    train_step = steps.make_train_step(graphdef, cfg, mesh, optimizer, state.params, state.opt_state)
    t0 = time.perf_counter()
    compiled = train_step.lower(state.params, state.opt_state, first_batch, jnp.asarray(state.step)).compile()
    memory = memory_summary(state.params, state.opt_state, compiled, mesh.devices.flat[0])
    human = flops.human
    say(f"compiled train step in {time.perf_counter() - t0:.1f}s; device 0 holds params {human(memory['params_bytes'])}B, "
        f"optimizer {human(memory['opt_bytes'])}B, step temporaries {human(memory['temp_bytes'])}B")
    if cfg.log.show_sharding and is_main_process():
        show_sharding(first_batch, state.params)
    return compiled


def train_loop(run, state, train_step, eval_step, first_batch):
    """Steps state.step..train.steps with evals and checkpoints, updating `state`; True when it stopped on a
    preemption notice (at state.step). Step s's metrics are read after step s+1 is dispatched, so the host never makes
    the devices wait (a checkpoint or an eval reads the pending step first: only a finite loss is saved). Every phase
    is charged to the run's clock (runtime/goodput.py)."""
    cfg, clock, reporter = run.cfg, run.clock, run.reporter
    clock.switch("train")
    for step in range(state.step, cfg.train.steps):
        with clock.phase("data"):
            batch = first_batch if step == state.step else train_batch(run, step)
        state.params, state.opt_state, metrics = train_step(state.params, state.opt_state, batch, jnp.asarray(step))
        clock.watch.dispatched(metrics["loss"])
        reporter.flush()  # the previous step's metrics
        done = step + 1  # steps completed; what metrics.jsonl and checkpoints call "step"
        reporter.expect(done, metrics)
        # Every process asks at every step (JAX's sync point needs it); the last step saves anyway.
        stop = run.preemption.should_stop(done) and done < cfg.train.steps
        if done % cfg.train.eval_every == 0 or done == cfg.train.steps:
            reporter.flush()
            with clock.phase("eval"):
                evaluate = functools.partial(steps.evaluate, eval_step, state.params, cfg=cfg, mesh=run.mesh, rows=run.rows)
                vals = run.data.evaluate(evaluate) if cfg.data.mixture else {"val_loss": evaluate(run.data)}
                vals.update(run.tasks(state.params) if run.tasks else {})
            reporter.log.write(dict(step=done, **vals))
            if is_main_process():
                reporter.progress.write(f"step {done}: val_loss {vals['val_loss']:.4f}")
            reporter.restart_clock()
        if done % cfg.train.checkpoint_every == 0 or done == cfg.train.steps or stop:
            reporter.flush()
            with clock.phase("checkpoint"):
                save_checkpoint(run, state, done, wait=stop)
            reporter.log.write(clock.row(done, "preempted" if stop else "checkpoint"))
            reporter.restart_clock()
        elif run.local and done % cfg.train.local_checkpoint_every == 0:
            reporter.flush()  # (only a finite loss is saved)
            run.local.save(run, state, done)
            reporter.restart_clock()
        if stop:
            clock.watch.close()
            state.step = done
            return True
    reporter.flush()
    clock.watch.close()
    with clock.phase("checkpoint"):
        run.manager.wait_until_finished()
    state.step = cfg.train.steps
    return False


def save_checkpoint(run, state, step, wait):
    """Checkpoint `step` (asynchronously; with `wait`, synchronously: the process may be
    gone soon). The wandb run id travels in the checkpoint, so a resume continues the same
    wandb run (kept even through a stretch trained without --log.wandb)."""
    cfg = run.cfg
    meta = dict(seed=cfg.run.seed, data_position=step, config=config_to_dict(cfg),
                wandb_id=run.reporter.log.wandb_id or state.wandb_id)
    checkpoint.save_checkpoint(run.manager, step, state.params, state.opt_state, meta)
    if wait:
        run.manager.wait_until_finished()


def stop_preempted(step, preemption, manager, log):
    """After the preemption checkpoint: one line on every process, then the exit code
    that means "preempted, resume me" (a launcher with --watch starts the run again)."""
    log.close()
    print(f"preempted: {preemption.why()}; saved checkpoint step {step} in {manager.directory}/{step}; exiting with "
          f"code {PREEMPTED_EXIT_CODE} (run the same command again to resume from step {step})", flush=True)
    raise SystemExit(PREEMPTED_EXIT_CODE)


def write_samples(cfg, run_dir, params, graphdef, log):
    """--sample.num_samples samples of the trained model: samples.txt, wandb, the terminal."""
    samples = samples_from_params(cfg, params, graphdef, cfg.sample.num_samples)
    if is_main_process():
        with open(os.path.join(run_dir, "samples.txt"), "a") as f:
            for s in samples:
                f.write(f"--- step {cfg.train.steps}, prompt {cfg.sample.prompt!r}\n{s}\n")
        log.log_samples(cfg.train.steps, samples)
        say("sample:\n" + samples[0])


# ---- Reading metrics on the host


class Reporter:
    """Reads finished steps' metrics on the host: progress bar, metrics.jsonl, wandb;
    stops the run loudly on a non-finite loss."""

    def __init__(self, cfg, log, start_step, manager, mesh, data):
        self.cfg, self.log, self.manager, self.data = cfg, log, manager, data
        self.progress = progress.make_progress(cfg.train.steps, start_step, cfg.log.every, cfg.log.progress and is_main_process())
        self.schedule = lr_schedule(cfg.train)
        self.tokens_per_step = cfg.train.batch_size * cfg.model.seq_len
        self.flops_per_step = flops.flops_per_token(cfg.model) * self.tokens_per_step
        self.peak_flops = flops.measure_peak_flops(jnp.dtype(cfg.model.dtype)) * mesh.devices.size
        self.pending = None  # (step, device metrics, its lr on the device or None) not yet read
        self.restart_clock()

    def expect(self, step, metrics):
        """Step `step` was dispatched; flush() reads `metrics` later. A logged step's lr
        is dispatched now, behind that step: evaluated when the row is written, the
        schedule's ops would queue behind the next step and the host would wait for it."""
        logged = step % self.cfg.log.every == 0 or step == self.cfg.train.steps
        self.pending = (step, metrics, self.schedule(step - 1) if logged else None)

    def restart_clock(self):
        """Time spent outside training steps (eval, compile) is not charged to a step."""
        self.last_time = time.perf_counter()

    def flush(self):
        if self.pending is None:
            return
        step, metrics, lr = self.pending
        self.pending = None
        if lr is not None:  # a logged step: every metric; else the loss alone
            metrics, lr = jax.device_get((metrics, lr))
        loss = float(metrics["loss"])
        if not math.isfinite(loss):
            self.manager.wait_until_finished()
            self.progress.close()
            raise SystemExit(f"error: non-finite loss {loss} at step {step}; stopping. The last good checkpoint is kept in "
                             f"{self.manager.directory}: lower --train.lr or --train.grad_clip, then rerun to resume")
        now = time.perf_counter()
        elapsed = max(now - self.last_time, 1e-9)
        self.last_time = now
        tokens_per_sec = self.tokens_per_step / elapsed
        mfu = self.flops_per_step / elapsed / self.peak_flops
        self.progress.update(1)
        self.progress.set_postfix(loss=f"{loss:.3f}", tok_s=flops.human(tokens_per_sec), mfu=f"{mfu:.1%}", refresh=False)
        if lr is not None:
            stats = metrics["stats_N"]
            load_NE = stats["tokens_per_expert"] / np.maximum(stats["tokens_per_expert"].sum(-1, keepdims=True), 1)
            assigned = max(int(np.sum(stats["tokens_per_expert"])), 1)
            row = dict(step=step, loss=loss, lr=float(lr), grad_norm=float(metrics["grad_norm"]),
                       tokens_per_sec=tokens_per_sec, mfu=mfu, aux_loss=float(metrics["aux_loss"]),
                       dropped_frac=float(np.sum(stats["dropped"])) / assigned, expert_load=load_NE.round(4),
                       max_logit=float(metrics["max_logit"]),  # the attention's largest logit (parallel/step_core.loss_and_metrics)
                       max_logit_layer=np.asarray(metrics["max_logit_NLH"]).max(-1).reshape(-1).round(4))  # per layer, block-major
            moe_NE = load_NE[load_NE.sum(-1) > 0]
            if len(moe_NE):  # imbalance: the busiest expert's share over the uniform one, mean over MoE blocks
                row["load_max_over_mean"] = round(float(np.mean(moe_NE.max(-1) * moe_NE.shape[-1])), 4)
            for extra in ("seq_aux_loss", "mtp_loss", "dpo_margin", "dpo_accuracy"):  # with --model.seq_aux_loss_weight / mtp_depth, dpo
                if extra in metrics:
                    row[extra] = float(metrics[extra])
            if "router_bias_NLE" in metrics:  # [MoE layer (block-major), expert]
                bias_NLE = np.asarray(metrics["router_bias_NLE"])
                row["router_bias"] = bias_NLE.reshape(-1, bias_NLE.shape[-1]).round(6)
            row.update(self.data.train_row(step) if self.cfg.data.mixture else {})  # tokens/<name>: data/mixture.py
            row["time"] = round(time.time(), 3)  # wall clock: goodput's last sign of life if the run dies
            self.log.write(row)


def show_sharding(batch, params):
    """Draw how the batch and one weight of each kind are laid out over the devices
    (for stacked or expert weights, the trailing 2-D slice of block 0 / expert 0)."""
    print("batch [B, T+1]:")
    jax.debug.visualize_array_sharding(batch)
    seen = set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = weight_name(path)
        if name in seen or leaf.ndim < 2:
            continue
        seen.add(name)
        spec = tuple(leaf.sharding.spec) + (None,) * (leaf.ndim - len(leaf.sharding.spec))
        print(f"{name} {leaf.shape} spec {leaf.sharding.spec}; its last two dims (a cell lists the devices holding that part):")
        jax.debug.visualize_sharding(leaf.shape[-2:], NamedSharding(leaf.sharding.mesh, P(*spec[-2:])))


if __name__ == "__main__":
    main(sys.argv[1:])
