"""bench.py's step benchmark (the usage is bench.py's docstring): one preset on one mesh,
compiled and timed on this machine, its MFU against a matmul peak measured in the same run."""


import collections
import glob
import gzip
import json
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from parallel import schedules
from parallel import steps as train_steps
from parallel.mesh import check_config_fits_mesh, global_batch, make_mesh, memory_summary, process_rows, shown_shape
from planning.hlo_reader import collective_table
from runtime import dtype_probe
from runtime.devices import setup_devices
from runtime.flops import count_params, flops_per_token, measure_peak_flops
from utils import ConfigError, apply_overrides, parse_args


def split_own_flags(argv, own, switches=()):
    """Pull a script's own flags (`own`: {name: default text}; `switches`: names that
    take no value) out of argv: ({name: text}, the rest, main.py's config flags)."""
    own, rest, i = dict(own), [], 0
    while i < len(argv):
        name = argv[i][2:].split("=", 1)[0] if argv[i].startswith("--") else None
        if name in switches:
            own[name] = "true"
        elif name in own:
            if "=" in argv[i]:
                own[name] = argv[i].split("=", 1)[1]
            else:
                own[name], i = argv[i + 1], i + 1
        else:
            rest.append(argv[i])
        i += 1
    return own, rest


def split_bench_flags(argv):
    """bench.py's own flags; the rest are main.py's config flags."""
    own, rest = split_own_flags(argv, {"json": "", "steps": "10", "warmup": "2", "profile": "", "show-schedule": ""},
                                switches=("show-schedule",))
    return own["json"], int(own["steps"]), int(own["warmup"]), own["profile"], bool(own["show-schedule"]), rest


def schedule_of(cfg):
    """The pipeline schedule table this config runs (parallel/schedules.schedule)."""
    t = cfg.train
    return schedules.schedule(t.pipeline, cfg.mesh.pp, t.microbatches, t.virtual_stages)


def profile_steps(compiled, params, opt_state, batch, steps, trace_dir, top=25):
    """Trace `steps` steps with jax.profiler and print where the time goes: device time
    per kind of XLA operation (the HLO name without its number: ynn_fusion = a matmul
    fused by XLA:CPU, dot = a matmul left to Eigen, all_gather, ...), slowest first.
    Open the trace itself with Perfetto (ui.perfetto.dev) or TensorBoard."""
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for i in range(steps):
            params, opt_state, metrics = compiled(params, opt_state, batch, jnp.asarray(i))
        jax.block_until_ready(metrics)
    trace_file = max(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True), key=os.path.getmtime)
    with gzip.open(trace_file) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    us_by_kind, count_by_kind = collections.Counter(), collections.Counter()
    for e in events:  # XLA's ops; host-side Python and runtime frames are left out
        if e["name"].startswith("$") or "Thunk" in e["name"] or "ThreadPool" in e["name"] or "PjitFunction" in e["name"]:
            continue
        kind = re.sub(r"\.\d+$", "", e["name"])
        us_by_kind[kind] += e["dur"]
        count_by_kind[kind] += 1
    total = sum(us_by_kind.values())
    print(f"device time per step by XLA op kind ({total / steps / 1e3:.1f} ms of op time per step; trace in {trace_file}):")
    for kind, us in us_by_kind.most_common(top):
        print(f"  {us / steps / 1e3:8.2f} ms {us / total:6.1%} {count_by_kind[kind] // steps:5d}x  {kind}")
    return params, opt_state


# What a run spends outside its steps and evaluations: starting Python and JAX, preparing
# the embedded data, sampling, plots. Measured: the default run on a 2-vCPU AMD EPYC VM in
# float32, 572 s = 4.4 s compile + 1000 x 0.53 s steps + 7 s evals + 30 s (issue 34).
RUN_OVERHEAD_S = 30
FORWARD_SHARE = 1 / 3  # an evaluation batch is a forward pass: a third of a train step's FLOPs


def run_estimate_s(compile_s, step_s, steps, eval_batches):
    """Wall time of `python main.py` with the benched flags, from this machine's measured
    step: the README's time estimate (its arithmetic on two machines: docs/benchmarks.md)."""
    return compile_s + step_s * (steps + FORWARD_SHARE * eval_batches) + RUN_OVERHEAD_S


def bench(cfg, steps, warmup, profile_dir=""):
    if cfg.model.vocab_size == 0:  # the byte tokenizer of the embedded default
        cfg = apply_overrides(cfg, {"model": {"vocab_size": 257}})
    mesh = make_mesh(cfg.mesh)
    check_config_fits_mesh(cfg, mesh)
    graphdef, params, optimizer, opt_state = train_steps.init_train_state(cfg, mesh)
    train_step = train_steps.make_train_step(graphdef, cfg, mesh, optimizer, params, opt_state)
    rows = process_rows(mesh, cfg.train.batch_size)
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (len(rows), cfg.model.seq_len + 1)).astype(np.int32)
    batch = global_batch(mesh, tokens, cfg.train.batch_size)

    start = time.perf_counter()
    compiled = train_step.lower(params, opt_state, batch, jnp.asarray(0)).compile()
    compile_s = time.perf_counter() - start
    memory = memory_summary(params, opt_state, compiled, mesh.devices.flat[0])
    collectives = {f"{kind} over {axes}": dict(count=count, bytes=nbytes)
                   for (kind, axes), (count, nbytes) in collective_table(compiled.as_text(), mesh).items()}
    for i in range(warmup):
        params, opt_state, metrics = compiled(params, opt_state, batch, jnp.asarray(i))
    jax.block_until_ready(metrics) if warmup else None
    step_times = []
    for i in range(steps):  # each step timed alone; the median ignores a neighbour's burst
        start = time.perf_counter()
        params, opt_state, metrics = compiled(params, opt_state, batch, jnp.asarray(warmup + i))
        jax.block_until_ready(metrics)
        step_times.append(time.perf_counter() - start)
    step_s = float(np.median(step_times))
    if profile_dir:
        params, opt_state = profile_steps(compiled, params, opt_state, batch, steps, profile_dir)

    peak = measure_peak_flops(jnp.dtype(cfg.model.dtype), size=2048 if jax.default_backend() == "cpu" else 8192)
    evals = -(-cfg.train.steps // cfg.train.eval_every)  # every eval_every steps and at the end
    tokens_per_step = cfg.train.batch_size * cfg.model.seq_len
    total, active = count_params(cfg.model)
    n_devices = mesh.devices.size
    return dict(
        preset=cfg.preset, mesh=shown_shape(mesh), devices=n_devices, backend=jax.default_backend(),
        dtype=cfg.model.dtype, params=total, active_params=active, tokens_per_step=tokens_per_step,
        compile_s=compile_s, step_s=step_s, tokens_per_sec=tokens_per_step / step_s,
        model_tflops_per_step=flops_per_token(cfg.model) * tokens_per_step / 1e12,
        peak_tflops_per_device=peak / 1e12,
        mfu=flops_per_token(cfg.model) * tokens_per_step / step_s / (n_devices * peak),
        run_estimate_s=run_estimate_s(compile_s, step_s, cfg.train.steps, evals * cfg.train.eval_batches),
        pipeline=cfg.train.pipeline, bubble=schedule_of(cfg).bubble(),
        loss=float(metrics["loss"]), sharding=cfg.mesh.sharding, **memory, collectives=collectives)


def main(argv):
    """bench.py's command line."""
    json_path, steps, warmup, profile_dir, show_schedule, rest = split_bench_flags(argv)
    try:
        cfg = parse_args(rest)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    if show_schedule:  # the table only: no devices, nothing compiled
        print(schedules.grid(schedule_of(cfg)))
        return
    setup_devices(cfg)
    try:
        result = bench(dtype_probe.resolve_dtype(cfg), steps, warmup, profile_dir)
    except ConfigError as e:  # a mesh the model does not fit: say which flag to change
        sys.exit(f"error: {e}")
    for key, value in result.items():
        if key != "collectives":
            print(f"{key:>24}: {value:.4g}" if isinstance(value, float) else f"{key:>24}: {value}")
    print(f"{'collectives':>24}: per device per step, from the optimized HLO (a loop's body counted once per trip)")
    for name, c in result["collectives"].items():
        print(f"{name:>32}: {c['count']:5d}x {c['bytes'] / 1e3:10.1f} KB")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
    print(f"tokens_per_sec={result['tokens_per_sec']:.1f} mfu={result['mfu']:.4f}")
