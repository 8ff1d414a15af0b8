"""--model.dtype auto: compute in the dtype whose matmuls are faster on this machine. TPU and GPU: bfloat16, no probe. CPU
(its flags do not predict it, docs/benchmarks.md): the model's own matmuls at this run's rows per step are timed in both
dtypes, float32 needing to be FLOAT32_MARGIN times faster; times are cached per machine and shapes in cache_path(). A run
with a config.json keeps the dtype written there. main.py and bench.py call resolve_dtype(cfg) once, after device setup
and before anything is built; planner.py and planning/tpu_compile.py read auto as bfloat16 (for_accelerator)."""

import json
import math
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from model import project
from utils import apply_overrides

AUTO = "auto"
DTYPES = ("bfloat16", "float32")

# float32 must be this much faster to be chosen: a near-tie keeps the default run's bfloat16, and noise must not flip it.
FLOAT32_MARGIN = 1.2
REPEATS = 5  # timed calls per dtype, alternating; the fastest counts (a neighbour's burst only slows one)
PROBE_FLOPS = 5e9  # at most, per probe call, to keep the probe short (the default run's fit whole)


def cache_path():
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "meshformer", "dtype_probe.json")


def cpu_model():
    """The CPU's marketing name (the same chip gives the same answer)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def matmul_shapes(m, train):
    """[(rows, in, out)]: the model's projections at this run's rows per microbatch (expert products as one matmul over all
    top-k assignments), scaled down together to about PROBE_FLOPS so that a wide model's probe stays short."""
    widths = [(m.d_model, m.q_latent), (m.q_latent, m.n_heads * (m.head_dim + m.rope_dim)),
              (m.d_model, m.kv_latent + m.rope_dim), (m.kv_latent, 2 * m.n_heads * m.head_dim),
              (m.n_heads * m.head_dim, m.d_model), (m.d_model, m.vocab_size or 257)]
    if "D" in m.block_pattern:
        widths += [(m.d_model, 2 * m.d_ff), (m.d_ff, m.d_model)]
    if "M" in m.block_pattern:
        widths += [(m.d_model, 2 * m.d_expert), (m.d_expert, m.d_model)]
    rows = train.batch_size * m.seq_len // train.microbatches
    per_row = 6 * sum(i * o for i, o in widths)  # forward + two backward products, 2 FLOPs each
    rows = max(64, min(rows, int(PROBE_FLOPS // per_row)))
    return [(rows, i, o) for i, o in widths]


def probe_key(shapes):
    device = jax.devices()[0]
    return (f"{cpu_model()} | {os.cpu_count()} cores | {jax.default_backend()} {device.device_kind} | jax {jax.__version__} | {shapes}")


def time_matmuls(shapes, repeats=REPEATS):
    """{dtype: seconds}: the fastest call of one jitted function of every shape's forward and backward products in that dtype."""
    return fastest_calls(probe_calls(shapes), repeats)


def probe_calls(shapes):
    """{dtype: (fn, args)}: one jitted, warmed-up function of every shape's forward and backward products (model.project and
    its vjp), and its inputs in that dtype (the weights float32, as the model keeps them)."""
    def products(x_list, w_list, dy_list):
        outs = []
        for x, w, dy in zip(x_list, w_list, dy_list):
            y, pullback = jax.vjp(project, x, w)
            outs += [y, *pullback(dy)]
        return outs

    rng = np.random.default_rng(0)
    calls = {}
    for name in DTYPES:
        dtype = jnp.dtype(name)
        xs = [jnp.asarray(rng.standard_normal((r, i)), dtype) for r, i, o in shapes]
        ws = [jnp.asarray(rng.standard_normal((i, o)) / math.sqrt(i), jnp.float32) for r, i, o in shapes]  # weights stay float32
        dys = [jnp.asarray(rng.standard_normal((r, o)), dtype) for r, i, o in shapes]
        fn = jax.jit(products)
        jax.block_until_ready(fn(xs, ws, dys))  # compile and warm up
        calls[name] = (fn, (xs, ws, dys))
    return calls


def fastest_calls(calls, repeats=REPEATS):
    """{name: seconds}: the fastest of `repeats` calls of each (fn, args) in `calls`, names taking turns (a burst only slows one)."""
    fastest = dict.fromkeys(calls, math.inf)
    for _ in range(repeats):
        for name, (fn, args) in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            fastest[name] = min(fastest[name], time.perf_counter() - start)
    return fastest


def choose(seconds):
    """(dtype, why) from {dtype: seconds} of the same matmuls."""
    ratio = seconds["bfloat16"] / seconds["float32"]
    if ratio >= FLOAT32_MARGIN:
        return "float32", f"float32 matmuls {ratio:.2g}x faster than bfloat16 here"
    if ratio <= 1:
        return "bfloat16", f"bfloat16 matmuls {1 / ratio:.2g}x faster than float32 here"
    return "bfloat16", (f"float32 matmuls only {ratio:.2g}x faster than bfloat16 here, below the {FLOAT32_MARGIN}x that switching takes")


def probed_seconds(shapes):
    """({dtype: seconds}, whether it came from the cache) of this machine's probe: from the cache, else measured and cached."""
    path, key = cache_path(), probe_key(shapes)
    cache = {}
    if os.path.exists(path):
        try:
            with open(path) as f:
                cache = json.load(f)
        except (OSError, ValueError):
            cache = {}  # a damaged cache is measured again and rewritten
    if key in cache:
        return cache[key], True
    seconds = time_matmuls(shapes)
    cache[key] = seconds
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(cache, f, indent=1)
    os.replace(path + ".tmp", path)  # concurrent runs each write a whole file
    return seconds, False


def saved_dtype(run_dir):
    """The compute dtype in the run's config.json, if it has one."""
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            dtype = json.load(f).get("model", {}).get("dtype")
    except (OSError, ValueError):
        return None
    return dtype if dtype in DTYPES else None


def decide(cfg):
    """(dtype, why) for --model.dtype auto on this machine and run."""
    run_dir = os.path.join(cfg.run.out_dir, cfg.run.name)
    saved = saved_dtype(run_dir)
    if saved:
        return saved, f"kept from {run_dir}/config.json: a run computes in one dtype"
    if jax.default_backend() != "cpu":
        return "bfloat16", f"bfloat16 on {jax.default_backend()}, no probe"
    seconds, cached = probed_seconds(matmul_shapes(cfg.model, cfg.train))
    dtype, why = choose(seconds)
    return dtype, f"{why}, probe {'cached in' if cached else 'measured, cached in'} {cache_path()}"


def resolve_dtype(cfg):
    """cfg with --model.dtype auto replaced by the dtype decided here (one line says which and why); others pass through.
    Every process of a run computes in the dtype process 0 decided."""
    if cfg.model.dtype != AUTO:
        return cfg
    dtype, why = decide(cfg)
    # Other modes of a run keep its saved dtype: nothing was chosen, so nothing to say.
    quiet = cfg.mode != "train" and why.startswith("kept from")
    if jax.process_count() > 1:
        index = int(multihost_utils.broadcast_one_to_all(np.int32(DTYPES.index(dtype))))
        dtype, why = DTYPES[index], why if DTYPES[index] == dtype else "process 0's choice"
    if jax.process_index() == 0 and not quiet:
        print(f"dtype: {dtype} (auto: {why})", flush=True)
    return apply_overrides(cfg, {"model": {"dtype": dtype}})


def for_accelerator(cfg):
    """cfg with auto read as bfloat16 (what auto gives on TPU/GPU), for sizing and compiling for them on a machine that is not one."""
    return apply_overrides(cfg, {"model": {"dtype": "bfloat16"}}) if cfg.model.dtype == AUTO else cfg
