"""Train (or sample from, or export) the MoE transformer over a 3-D device mesh.

    python main.py                                  # Shakespeare, bytes, small MoE, CPU
    python main.py --run.cpu_devices 8 --mesh.dp 2 --mesh.pp 2 --mesh.tp 2 --train.microbatches 2
    python main.py --mode sample --sample.prompt "JULIET:"
    python main.py --mode export                   # slim bfloat16 params in <run_dir>/export
    python main.py --mode export_hf                # a Hugging Face directory in <run_dir>/hf
    python main.py --mode eval                     # restore, print val_loss=... (any mesh)
    python main.py --mode serve                    # OpenAI-compatible completions + a web page (serve.py)

Reads top to bottom: config, devices, mesh, data, init or resume, compile, the loop
(eval, checkpoints, logs), samples.
"""

import functools
import json
import math
import os
import sys
import threading
import time
import traceback

# ----------------------------------------------------------------------------
# Config and devices (before JAX starts: fake CPU devices and collectives are set then)


def skip_tpu_probe_without_tpu():
    """Keep CPU runs quiet where libtpu is installed but no TPU is attached.

    libtpu is a test and tooling dependency (planner.py --tpu compiles for TPU pods on
    a CPU). Installed, it makes JAX try a TPU backend at start-up on any machine, and
    libtpu then prints warnings about metadata it cannot find (and takes a lock file
    that concurrent processes fight over). Where the machine shows no TPU chip and no
    GPU (JAX's own PCI and /dev checks) and nobody chose a platform (JAX_PLATFORMS),
    ask for the CPU backend only. A TPU VM or a GPU machine is left as it is.
    Must run before JAX starts its backend."""
    import jax
    from jax._src import hardware_utils  # the checks JAX itself uses to suggest plugins

    if os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms:
        return
    if (hardware_utils.num_available_tpu_chips_and_device_id()[0] or hardware_utils.has_visible_nvidia_gpu()
            or hardware_utils.num_available_amd_gpus(stop_at=1)):
        return
    jax.config.update("jax_platforms", "cpu")


def use_fake_cpu_devices(n_devices, timeout_s=600):
    """Split the CPU into `n_devices` fake devices, set up so that collectives between
    them cannot hang. Must run before JAX starts its backend.

    XLA:CPU runs each device's program on a shared thread pool sized max(cores,
    devices). A device blocked in a collective holds a thread, and the step may hand
    its next collective to another pool thread: with one thread per device (any
    machine with fewer cores than fake devices) every thread can end up waiting in a
    different collective and the step deadlocks. Measured on 2 cores, dp2 x pp2 x tp2:
    8 threads hung 7 runs of 9, 16 threads none of 33, and ran 1.2-1.4x faster than 32.
    PJRT_NPROC (or NPROC) already in the environment wins.

    Fake devices are threads sharing the cores, so on a loaded machine one can reach
    a collective long after the others. XLA:CPU aborts the process when a collective
    has waited 40 s; give a slow thread `timeout_s` instead (a value in XLA_FLAGS wins)."""
    import jax

    skip_tpu_probe_without_tpu()
    jax.config.update("jax_num_cpu_devices", n_devices)
    if "PJRT_NPROC" not in os.environ and "NPROC" not in os.environ:
        os.environ["PJRT_NPROC"] = str(max(os.cpu_count() or 1, 2 * n_devices))
    flag = "--xla_cpu_collective_call_terminate_timeout_seconds"
    flags = os.environ.get("XLA_FLAGS", "")
    if flag not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {flag}={timeout_s}".strip()


def setup_devices(cfg):
    """Fake CPU devices and multi-process init; must run before JAX touches a device.
    Returns whether this is one process of several."""
    import jax

    skip_tpu_probe_without_tpu()
    if cfg.run.cpu_devices:
        use_fake_cpu_devices(cfg.run.cpu_devices)
    if cfg.run.compile_cache:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(cfg.run.compile_cache))
    d = cfg.dist
    if d.coordinator:
        if not 0 <= d.process_id < d.num_processes:
            sys.exit(f"error: --dist.process_id {d.process_id} must be in 0..{d.num_processes - 1} "
                     f"(--dist.num_processes {d.num_processes}); give every process the same count and its own id")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        where = dict(coordinator_address=d.coordinator, num_processes=d.num_processes, process_id=d.process_id)
    elif os.environ.get("TPU_WORKER_HOSTNAMES") or os.environ.get("SLURM_JOB_ID") and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        where = {}  # TPU pods and SLURM: JAX finds the cluster itself
    else:
        return False
    # A process that dies is noticed by JAX's coordination service: after
    # heartbeat_timeout_seconds without news it stops every other process (a C++
    # abort naming the silent task). A peer that never shows up at all gets our own,
    # plainer message, shortly before JAX's connect timeout would fire.
    never_met = threading.Timer(d.timeout_s, stop_now, [
        f"error: not all processes reached the coordinator {d.coordinator or '(auto-detected)'} within {d.timeout_s}s "
        "(--dist.timeout_s). Start every process with the same --dist.coordinator and --dist.num_processes and its "
        "own --dist.process_id, and check that the coordinator's host and port can be reached from every host."])
    never_met.daemon = True
    never_met.start()
    try:
        jax.distributed.initialize(**where, initialization_timeout=d.timeout_s + CONNECT_GRACE_S,
                                   heartbeat_timeout_seconds=d.timeout_s)
    finally:
        never_met.cancel()
    return True


CONNECT_GRACE_S = 10  # JAX's own connect timeout fires this long after ours, so ours is the one seen


def stop_now(message):
    """Exit at once, from any thread, skipping exit handlers: JAX's would first wait
    (up to the heartbeat timeout) for processes that are gone."""
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


def main(argv):
    from utils import ConfigError, parse_args

    try:
        cfg = parse_args(argv)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    several_processes = setup_devices(cfg)
    try:
        if cfg.mode == "train":
            train(cfg)
        elif cfg.mode == "sample":
            print(sample_from_run(cfg))
        elif cfg.mode == "export":
            export_run(cfg)
        elif cfg.mode == "eval":
            eval_run(cfg)
        elif cfg.mode == "export_hf":
            export_hf_run(cfg)
        elif cfg.mode == "serve":
            from serve import serve_run

            serve_run(cfg)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    except Exception as e:
        if not several_processes:
            raise
        # An error in one process leaves the others stuck in a collective: stop now, so
        # that they in turn see the connection close and stop too (gloo on CPU raises
        # "Connection closed by peer", or "Read timeout" when the dead peer's socket was
        # mid-transfer; elsewhere JAX's heartbeat timeout stops them).
        traceback.print_exc()
        stop_now(f"error: process {jax.process_index()} of {jax.process_count()} stopped on {type(e).__name__} above. "
                 "If it reports a closed or reset connection or a read timeout, another process died or its host became unreachable: "
                 "see that process's log. Start all processes again to resume from the last checkpoint.")


# ----------------------------------------------------------------------------
# Importing JAX is fine here: its backend starts on first use, after setup_devices.

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import checkpoint  # noqa: E402
import hf_interop  # noqa: E402
import optimizers  # noqa: E402
import parallel as par  # noqa: E402
import train_steps  # noqa: E402
from dataset import get_tokenizer, open_data, check_tokenizer  # noqa: E402
from model import decode_step, init_cache  # noqa: E402
from metrics import MetricsLog, truncate_metrics  # noqa: E402
from utils import ConfigError, apply_overrides, config_from_dict, config_to_dict, count_params, flops_per_token, human  # noqa: E402


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


def measure_peak_flops(dtype, size=1024, repeats=5):
    """FLOP/s of a large square matmul on one device: the denominator of MFU, measured
    on this machine in this run so that MFU is a ratio, not a guess. Accumulating in
    float32 is the fast path for bfloat16 (on this CPU 363 vs 161 GFLOP/s at 2048^3).
    The fastest of `repeats` timed products: a neighbour's burst on a shared machine
    slows a single timing, never speeds it up."""
    a = jnp.ones((size, size), dtype)
    matmul = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
    matmul(a, a).block_until_ready()
    fastest_s = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, a).block_until_ready()
        fastest_s = min(fastest_s, time.perf_counter() - start)
    return 2 * size**3 / fastest_s


def describe_mesh(mesh):
    """Which device holds which (dp, pp, tp) coordinate, and which process owns it."""
    lines = [f"mesh {dict(mesh.shape)} over {mesh.devices.size} devices, {jax.process_count()} process(es)"]
    for coords in np.ndindex(mesh.devices.shape):
        device = mesh.devices[coords]
        lines.append(f"  device {device.id:>3} (process {device.process_index}): dp={coords[0]} pp={coords[1]} tp={coords[2]}")
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
    from jax.experimental import multihost_utils

    return jax.tree.map(np.asarray, multihost_utils.process_allgather(params, tiled=True))


@functools.partial(jax.jit, static_argnums=0)
def decode_jit(graphdef, state, tokens_BT, cache, start):
    """decode_step, compiled once for the prompt length and once for single tokens."""
    return decode_step(nnx.merge(graphdef, state), tokens_BT, cache, start)


def generate(model, tokenizer, prompt, max_tokens, temperature, top_k, seed):
    """Continue `prompt` with the latent KV cache: a prefill, then one token per step.

    The model only ever saw positions < seq_len, so the cache holds one training window;
    when it is full, generation restarts from the last half window (a fresh prefill),
    as nanoGPT crops its context. Shapes are fixed, so each step compiles once.
    """
    window = model.cfg.seq_len
    graphdef, state = nnx.split(model)

    def prefill(ids):
        cache = init_cache(model.cfg, 1, window)
        return decode_jit(graphdef, state, jnp.asarray([ids]), cache, 0) + (len(ids),)

    tokens = tokenizer.encode(prompt) or [tokenizer.eot_id]
    logits, cache, position = prefill(tokens[-window:])
    key, vocab, n_prompt = jax.random.key(seed), model.cfg.vocab_size, len(tokens)
    for _ in range(max_tokens):
        last_V = logits[0, -1, :vocab]  # padded vocabulary entries are never sampled
        if temperature == 0:
            token = int(jnp.argmax(last_V))
        else:
            key, sub = jax.random.split(key)
            scaled = last_V / temperature
            if top_k:
                kth = jnp.sort(scaled)[-min(top_k, vocab)]
                scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
            token = int(jax.random.categorical(sub, scaled))
        tokens.append(token)
        if position == window:
            logits, cache, position = prefill(tokens[-(window // 2):])
        else:
            logits, cache = decode_jit(graphdef, state, jnp.asarray([[token]]), cache, position)
            position += 1
    return prompt + tokenizer.decode(tokens[n_prompt:])


def samples_from_params(cfg, params, graphdef, n):
    tokenizer = get_tokenizer(cfg.data.tokenizer, cfg.data.encoding_file)
    model = nnx.merge(graphdef, host_params(params))
    s = cfg.sample
    return [generate(model, tokenizer, s.prompt, s.max_tokens, s.temperature, s.top_k, s.seed + i) for i in range(n)]


# ----------------------------------------------------------------------------
# Training


def train(cfg):
    run_dir = run_dir_of(cfg)
    if hf_interop.hf_dir(cfg.train.init_from):  # the model is the one in that directory
        cfg = hf_interop.adopt_hf_config(cfg, hf_interop.hf_dir(cfg.train.init_from))
    os.makedirs(run_dir, exist_ok=True)
    mesh = par.make_mesh(cfg.mesh)
    data = open_data(cfg.data.source, cfg.data.cache_dir, cfg.data.cache_max_gb, jax.process_index())
    cfg = resolve_vocab(cfg, data)
    par.check_config_fits_mesh(cfg, mesh)
    say(describe_mesh(mesh))
    total, active = count_params(cfg.model)
    say(f"model: {human(total)} params, {human(active)} active per token; "
        f"pipeline {cfg.train.pipeline}, bubble {par.bubble_fraction(mesh.shape['pp'], cfg.train.microbatches, cfg.train.pipeline, cfg.train.virtual_stages):.0%}")

    # --- init or resume -----------------------------------------------------
    if cfg.train.init_from:
        checkpoint.find_params_source(cfg.train.init_from)  # a wrong path fails before anything compiles
    graphdef, params, optimizer, opt_state = build_state(cfg, mesh)
    manager = checkpoint.checkpoint_manager(run_dir, cfg.train.keep_checkpoints)
    start_step, wandb_id = 0, None
    resume_step = None if cfg.train.resume_step < 0 else cfg.train.resume_step
    restored = checkpoint.restore_checkpoint(manager, params, opt_state, cfg.model, resume_step, cfg.run.seed, log=say,
                                            train_cfg=cfg.train, data_cfg=cfg.data)
    if restored is not None:
        params, opt_state, meta = restored
        start_step, wandb_id = meta["step"], meta.get("wandb_id")
        say(f"resumed from {run_dir}/checkpoints/{start_step}"
            + (" (--train.init_from ignored: this run already has checkpoints)" if cfg.train.init_from else ""))
    elif cfg.train.init_from:
        params = checkpoint.restore_params(cfg.train.init_from, params, cfg.model, log=say)
        say(f"initialised params from {cfg.train.init_from} (fresh optimizer)")
    if is_main_process():
        truncate_metrics(run_dir, start_step)  # steps after the checkpoint will be redone
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump(config_to_dict(cfg), f, indent=2)
    log = MetricsLog(run_dir, cfg, enabled=is_main_process(), wandb_id=wandb_id)

    # --- compile ------------------------------------------------------------
    rows = par.process_rows(mesh, cfg.train.batch_size)
    train_step = train_steps.make_train_step(graphdef, cfg, mesh, optimizer, params, opt_state)
    eval_step = train_steps.make_eval_step(graphdef, cfg, mesh, params)
    first_batch = par.global_batch(mesh, data.batch("train", start_step, cfg.train.batch_size, cfg.model.seq_len, cfg.run.seed, rows), cfg.train.batch_size)
    t0 = time.perf_counter()
    compiled = train_step.lower(params, opt_state, first_batch, jnp.asarray(start_step)).compile()
    memory = par.memory_summary(params, opt_state, compiled, mesh.devices.flat[0])
    say(f"compiled train step in {time.perf_counter() - t0:.1f}s; device 0 holds params {human(memory['params_bytes'])}B, "
        f"optimizer {human(memory['opt_bytes'])}B, step temporaries {human(memory['temp_bytes'])}B")
    if cfg.log.show_sharding and is_main_process():
        show_sharding(first_batch, params)

    reporter = Reporter(cfg, log, make_progress(cfg, start_step), manager, mesh)

    # --- the loop -----------------------------------------------------------
    # Metrics of step s are read after step s+1 is dispatched, so the host never
    # makes the devices wait. Before an eval or a checkpoint the pending step is read
    # first: a checkpoint is only written for a step whose loss was finite.
    for step in range(start_step, cfg.train.steps):
        batch = first_batch if step == start_step else par.global_batch(
            mesh, data.batch("train", step, cfg.train.batch_size, cfg.model.seq_len, cfg.run.seed, rows), cfg.train.batch_size)
        params, opt_state, metrics = compiled(params, opt_state, batch, jnp.asarray(step))
        reporter.flush()  # the previous step's metrics
        done = step + 1  # steps completed; what metrics.jsonl and checkpoints call "step"
        reporter.pending = (done, metrics)
        if done % cfg.train.eval_every == 0 or done == cfg.train.steps:
            reporter.flush()
            val = evaluate(eval_step, params, data, cfg, mesh, rows)
            log.write(dict(step=done, val_loss=val))
            if is_main_process():
                reporter.progress.write(f"step {done}: val_loss {val:.4f}")
            reporter.restart_clock()
        if done % cfg.train.checkpoint_every == 0 or done == cfg.train.steps:
            reporter.flush()
            # The wandb run id travels in the checkpoint, so a resume continues the same
            # wandb run (kept even through a stretch trained without --log.wandb).
            meta = dict(seed=cfg.run.seed, data_position=done, config=config_to_dict(cfg),
                        wandb_id=log.wandb_id or wandb_id)
            checkpoint.save_checkpoint(manager, done, params, opt_state, meta)
    reporter.flush()
    manager.wait_until_finished()
    reporter.progress.close()
    data.close()
    # Every process, not only 0: each one should have read only its own rows.
    print(f"process {jax.process_index()} loaded rows: {data.rows_loaded}", flush=True)

    # --- samples ------------------------------------------------------------
    if cfg.sample.num_samples and cfg.train.steps > start_step:
        samples = samples_from_params(cfg, params, graphdef, cfg.sample.num_samples)
        if is_main_process():
            with open(os.path.join(run_dir, "samples.txt"), "a") as f:
                for s in samples:
                    f.write(f"--- step {cfg.train.steps}, prompt {cfg.sample.prompt!r}\n{s}\n")
            log.log_samples(cfg.train.steps, samples)
            say("sample:\n" + samples[0])
    log.close()
    if cfg.log.plots and is_main_process():
        from plots import plot_run

        plot_run(run_dir)
    return run_dir


class Reporter:
    """Reads finished steps' metrics on the host: progress bar, metrics.jsonl, wandb;
    stops the run loudly on a non-finite loss."""

    def __init__(self, cfg, log, progress, manager, mesh):
        self.cfg, self.log, self.progress, self.manager = cfg, log, progress, manager
        self.schedule = optimizers.lr_schedule(cfg.train)
        self.tokens_per_step = cfg.train.batch_size * cfg.model.seq_len
        self.flops_per_step = flops_per_token(cfg.model) * self.tokens_per_step
        self.peak_flops = measure_peak_flops(jnp.dtype(cfg.model.dtype)) * mesh.devices.size
        self.pending = None  # (step, device metrics) not yet read
        self.restart_clock()

    def restart_clock(self):
        """Time spent outside training steps (eval, compile) is not charged to a step."""
        self.last_time = time.perf_counter()

    def flush(self):
        if self.pending is None:
            return
        step, metrics = self.pending
        self.pending = None
        metrics = jax.device_get(metrics)
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
        self.progress.set_postfix(loss=f"{loss:.3f}", tok_s=human(tokens_per_sec), mfu=f"{mfu:.1%}", refresh=False)
        if step % self.cfg.log.every == 0 or step == self.cfg.train.steps:
            stats = metrics["stats_N"]
            load_NE = stats["tokens_per_expert"] / np.maximum(stats["tokens_per_expert"].sum(-1, keepdims=True), 1)
            assigned = max(int(np.sum(stats["tokens_per_expert"])), 1)
            row = dict(step=step, loss=loss, lr=float(self.schedule(step - 1)), grad_norm=float(metrics["grad_norm"]),
                       tokens_per_sec=tokens_per_sec, mfu=mfu, aux_loss=float(metrics["aux_loss"]),
                       dropped_frac=float(np.sum(stats["dropped"])) / assigned, expert_load=load_NE.round(4))
            moe_NE = load_NE[load_NE.sum(-1) > 0]
            if len(moe_NE):  # imbalance: the busiest expert's share over the uniform one, mean over MoE blocks
                row["load_max_over_mean"] = round(float(np.mean(moe_NE.max(-1) * moe_NE.shape[-1])), 4)
            for extra in ("seq_aux_loss", "mtp_loss"):  # with --model.seq_aux_loss_weight / --model.mtp_depth
                if extra in metrics:
                    row[extra] = float(metrics[extra])
            if "router_bias_NLE" in metrics:  # [MoE layer (block-major), expert]
                bias_NLE = np.asarray(metrics["router_bias_NLE"])
                row["router_bias"] = bias_NLE.reshape(-1, bias_NLE.shape[-1]).round(6)
            self.log.write(row)


def make_progress(cfg, start_step):
    import progress

    return progress.make_progress(cfg.train.steps, start_step, cfg.log.every, cfg.log.progress and is_main_process())


def show_sharding(batch, params):
    """Draw how the batch and one weight of each kind are laid out over the devices
    (for stacked or expert weights, the trailing 2-D slice of block 0 / expert 0)."""
    print("batch [B, T+1]:")
    jax.debug.visualize_array_sharding(batch)
    seen = set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = par.weight_name(path)
        if name in seen or leaf.ndim < 2:
            continue
        seen.add(name)
        spec = tuple(leaf.sharding.spec) + (None,) * (leaf.ndim - len(leaf.sharding.spec))
        print(f"{name} {leaf.shape} spec {leaf.sharding.spec}; its last two dims (a cell lists the devices holding that part):")
        jax.debug.visualize_sharding(leaf.shape[-2:], NamedSharding(leaf.sharding.mesh, P(*spec[-2:])))


# ----------------------------------------------------------------------------
# Sampling and export from a finished (or running) run


def load_run_params(cfg, devices=None, check=None):
    """The run's saved config and latest params, on the current mesh (over `devices`,
    default all), or the model of --train.init_from hf:DIR. `check(cfg)` runs on the
    resolved config, before any init."""
    run_dir = run_dir_of(cfg)
    config_path = os.path.join(run_dir, "config.json")
    if hf_interop.hf_dir(cfg.train.init_from):
        cfg = hf_interop.adopt_hf_config(cfg, hf_interop.hf_dir(cfg.train.init_from))
    elif not os.path.exists(config_path):
        raise ConfigError(f"no run at {run_dir} (missing config.json): train first, or pass --run.name/--run.out_dir")
    else:
        with open(config_path) as f:
            saved = config_from_dict(json.load(f))
        cfg = apply_overrides(cfg, {"model": vars(saved.model), "data": vars(saved.data)})
    if check is not None:
        check(cfg)
    mesh = par.make_mesh(cfg.mesh, devices)
    graphdef, params = par.init_params(cfg.model, mesh, cfg.mesh.expert_parallel, cfg.run.seed)
    source = cfg.train.init_from or run_dir
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
    cfg, graphdef, params = load_run_params(cfg, check=lambda cfg: hf_interop.check_exportable(cfg.model))
    host = host_params(params)
    out = os.path.join(run_dir_of(cfg), "hf")
    if is_main_process():
        tokenizer = get_tokenizer(cfg.data.tokenizer, cfg.data.encoding_file)
        hf_interop.write_hf_dir(out, host, cfg.model, tokenizer, cfg.export.dtype)
        model_type, architecture = hf_interop.architecture_of(cfg.model)
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


if __name__ == "__main__":
    main(sys.argv[1:])
