"""--model.dtype auto: compute in the dtype whose matmuls are faster on this machine.

bfloat16 halves the bytes of every activation, and on CPUs with bfloat16 matmul units
(AVX512-BF16, AMX) its matmuls are several times faster than float32's: the default
run was tuned on such a machine (363 GFLOP/s in bfloat16, 274 s). Most laptop CPUs have
no such units; XLA:CPU then converts, and bfloat16 is the slower of the two (a 2-vCPU
AMD EPYC without them: 46.8 vs ~72 GFLOP/s, and the default run 842 s in bfloat16
against 572 s in float32). Nor does a CPU flag decide it: a 2-vCPU Intel Xeon VM that
lists avx512_bf16 ran the default's step 2.4x faster in float32 (bench.py: 7.2K against
3.0K tokens/s). So `auto` measures instead of guessing:

- on TPU and GPU: bfloat16, without a probe (their matmul units are built for it);
- on CPU: the model's own matmuls (its projections and expert products at this run's
  rows per step, forward and both backward products, through layers.project as the
  model calls it) are timed in both dtypes, alternating, the fastest of a few repeats
  each; float32 is chosen only when it is FLOAT32_MARGIN times faster. The times are
  cached per machine (CPU model, core count, backend, JAX version, shapes) in
  <XDG_CACHE_HOME or ~/.cache>/meshformer/dtype_probe.json, so the probe runs once.
- a run that already has a config.json (a resume, or --mode sample/eval/serve of it)
  keeps the dtype written there: a run computes in one dtype from start to end, on
  any machine it moves to.

main.py and bench.py call resolve_dtype(cfg) once, after the devices are set up and
before anything is built; from then on cfg.model.dtype is float32 or bfloat16, and that
is what the run's config.json records. planner.py and tpu_compile.py size and compile
for accelerators: there `auto` is bfloat16 (for_accelerator).
"""

import json
import math
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from layers import project
from utils import apply_overrides

AUTO = "auto"
DTYPES = ("bfloat16", "float32")

# float32 must be this much faster to be chosen. A tie keeps bfloat16, the dtype the
# default run's published figures (README, public/default_run/) were made in, so a
# machine where the two are close computes what the README shows; and the probe's
# fastest-of-N timings move by up to ~10% on a shared machine, which must not flip the
# choice from one machine (or cache) to the next. The machines measured are far from
# the margin either way: float32 1.5-2x faster (an AMD EPYC without bfloat16 units; the
# Intel Xeon above), bfloat16 about 5x faster (the development VM, issue 34).
FLOAT32_MARGIN = 1.2
REPEATS = 5  # timed calls per dtype, alternating; the fastest counts (a neighbour's burst only slows one)
PROBE_FLOPS = 5e9  # at most, per probe call (the default run's 4 GFLOP fit whole): ~20-100 ms on a laptop core


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
    """[(rows, in, out)]: the model's projections at this run's rows per microbatch (the
    expert products as one matmul over all top-k assignments, the FLOPs they do), scaled
    down together to about PROBE_FLOPS, so that a wide model's probe stays short."""
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
    return (f"{cpu_model()} | {os.cpu_count()} cores | {jax.default_backend()} {device.device_kind} | "
            f"jax {jax.__version__} | {shapes}")


def time_matmuls(shapes, repeats=REPEATS):
    """{dtype: seconds}: the fastest call of one jitted function that runs every shape's
    forward and backward products (layers.project and its vjp) in that dtype."""
    return fastest_calls(probe_calls(shapes), repeats)


def probe_calls(shapes):
    """{dtype: (fn, args)}: one jitted function of every shape's forward and backward
    products (layers.project and its vjp), compiled and warmed up, and its inputs in
    that dtype (the weights float32, as the model keeps them)."""
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
    """{name: seconds}: the fastest of `repeats` timed calls of each (fn, args) in
    `calls`, the names taking turns (a neighbour's burst only slows one)."""
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
    return "bfloat16", (f"float32 matmuls only {ratio:.2g}x faster than bfloat16 here, "
                        f"below the {FLOAT32_MARGIN}x that switching takes")


def probed_seconds(shapes):
    """{dtype: seconds} of this machine's probe: from the cache, else measured and cached.
    Returns (seconds, whether it came from the cache)."""
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
    """cfg with --model.dtype auto replaced by the dtype decided here (one line says which
    and why); other dtypes pass through untouched. Every process of a run computes in the
    dtype process 0 decided."""
    if cfg.model.dtype != AUTO:
        return cfg
    dtype, why = decide(cfg)
    # --mode sample/eval/export/serve of a run compute in its dtype, as they always did
    # (runs.load_run_params): nothing was chosen, so nothing to say.
    quiet = cfg.mode != "train" and why.startswith("kept from")
    if jax.process_count() > 1:
        index = int(multihost_utils.broadcast_one_to_all(np.int32(DTYPES.index(dtype))))
        dtype, why = DTYPES[index], why if DTYPES[index] == dtype else "process 0's choice"
    if jax.process_index() == 0 and not quiet:
        print(f"dtype: {dtype} (auto: {why})", flush=True)
    return apply_overrides(cfg, {"model": {"dtype": dtype}})


def for_accelerator(cfg):
    """cfg with auto read as bfloat16, for sizing and compiling for TPU/GPU (what auto
    gives there) on a machine that is not one."""
    return apply_overrides(cfg, {"model": {"dtype": "bfloat16"}}) if cfg.model.dtype == AUTO else cfg
