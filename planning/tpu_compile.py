"""Compile the real train step for a TPU pod, on this CPU (no TPU needed).

libtpu (requirements-test.txt) holds the TPU compiler. `jax.experimental.topologies`
describes a pod slice's chips (real coordinates, real hosts) without any hardware;
`jit(f).lower(ShapeDtypeStructs with shardings).compile()` then gives the executable a
TPU pod would run, its per-device memory (`memory_analysis()`) and its optimized HLO,
from which planning/hlo_reader.py reads the collectives, the dot FLOPs and the overlap.
planner.py --tpu TYPE prints all of it.

    python planner.py --preset moe1b --mesh.dp 8 --mesh.pp 2 --mesh.tp 2 --tpu v4-64
"""

import contextlib
import math
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from model import abstract_model, abstract_params
from parallel import optimizers
from parallel import steps as train_steps
from parallel.mesh import batch_spec, check_config_fits_mesh
from parallel.weights import check_divisible, param_specs
from planning import costs as planner_model
from planning.hlo_reader import COLLECTIVE_KINDS, crosses_slices
from runtime import devices, dtype_probe
from utils import ConfigError, apply_overrides, kernels_for

GiB = 2**30
LIBTPU_HINT = ("planner.py --tpu needs the TPU compiler: pip install libtpu==0.0.42.1 (it is in requirements-test.txt; "
               "a test and tooling dependency, not needed to train on CPU or GPU)")

# ---- Pod slices, as gcloud names them (--accelerator-type)


@dataclass(frozen=True)
class PodType:
    name: str  # gcloud accelerator type, e.g. v4-64
    topology: str  # e.g. v4:2x4x4 (chips per torus axis)
    chip_config: str  # megacore: one JAX device per chip (v4, v5p fuse their two TensorCores)
    host_bounds: tuple  # chips per host along each axis
    hardware: str  # planner.HARDWARE key (peak FLOP/s, HBM)
    wrap: tuple  # which torus axes wrap around

    @property
    def chips(self):
        return math.prod(int(n) for n in self.topology.split(":")[1].split("x"))


# v4 and v5p: 3-D torus, 4 chips per host (2x2x1), the type counts TensorCores (2 per
# chip); slices whose sides are all multiples of 4 are full tori (wraparound links).
# v5e (v5litepod) and v6e: 2-D, the type counts chips; up to 8 chips is one host,
# larger slices have 4 chips (2x2) per host.
CUBE_SHAPES = ["2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x16", "8x16x16"]
PLANE_SHAPES = ["1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"]


def pod_types():
    out = {}
    for gen, hardware in (("v4", "tpu-v4"), ("v5p", "tpu-v5p")):
        for shape in CUBE_SHAPES:
            dims = [int(n) for n in shape.split("x")]
            torus = all(n % 4 == 0 for n in dims)
            out[f"{gen}-{2 * math.prod(dims)}"] = PodType(f"{gen}-{2 * math.prod(dims)}", f"{gen}:{shape}", "megacore",
                                                          (2, 2, 1), hardware, (torus,) * 3)
    for gen, prefix, hardware in (("v5litepod", "v5e", "tpu-v5e"), ("v6e", "v6e", "tpu-v6e")):
        for shape in PLANE_SHAPES:
            x, y = (int(n) for n in shape.split("x"))
            host = (x, y, 1) if x * y <= 8 else (2, 2, 1)
            out[f"{gen}-{x * y}"] = PodType(f"{gen}-{x * y}", f"{prefix}:{shape}", "default", host, hardware, (False,) * 3)
    return out


POD_TYPES = pod_types()


def pod_type(name):
    if name not in POD_TYPES:
        raise ConfigError(f"unknown --tpu {name!r}; known accelerator types: {', '.join(POD_TYPES)}")
    return POD_TYPES[name]


def pod_devices(name, slices=1):
    """The slice's devices (compile-only: real ids, coordinates and process indices);
    with slices > 1, those of that many slices of this type (multi-slice: each device's
    slice_index says which; the compiler sends what crosses slices over the data-center
    network)."""
    pod = pod_type(name)
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise ConfigError(LIBTPU_HINT) from None
    # Compile-only use: say which slice this is and that no metadata server or peer
    # hosts are to be found, or libtpu prints warnings; several processes may load it.
    # libtpu's own log (glog, to fd 2) is the only place that splits a program's HBM
    # into live temporaries, fragmentation and code (compiler_log_memory): turn it on
    # (libtpu reads it when it loads, here) and keep it off the terminal (captured_stderr).
    # Only for this call: left in os.environ, TPU_WORKER_HOSTNAMES would tell every
    # main.py this process starts afterwards that it runs on a TPU pod (devices.setup_devices).
    # The compiler's options are main.py's on a TPU (devices.TPU_OVERLAP_FLAGS, merged
    # with a LIBTPU_INIT_ARGS of the user's): libtpu reads them once, when it loads, so
    # every program this process compiles for a pod is the one a pod runs.
    libtpu_environ = dict(TPU_WORKER_HOSTNAMES="localhost",
                          TPU_ACCELERATOR_TYPE=pod.name, TPU_SKIP_MDS_QUERY="1", ALLOW_MULTIPLE_LIBTPU_LOAD="1",
                          TPU_STDERR_LOG_LEVEL="0", TPU_MIN_LOG_LEVEL="0")
    from jax.experimental import topologies

    with environ_set_for_now(libtpu_environ, devices.overlap_environ("tpu")), captured_stderr():
        topology = topologies.get_topology_desc(platform="tpu", topology_name=pod.topology, chip_config_name=pod.chip_config,
                                                chips_per_host_bounds=pod.host_bounds, num_slices=slices, wrap=pod.wrap)
    return list(topology.devices)


@contextlib.contextmanager
def environ_set_for_now(values, replaced=None):
    """os.environ with `values` where it does not say otherwise already (unset or
    empty) and `replaced` whatever it says, then as before."""
    replaced = replaced or {}
    saved = {name: os.environ.get(name) for name in {**values, **replaced}}
    for name, value in values.items():
        os.environ[name] = os.environ.get(name) or value
    os.environ.update(replaced)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def captured_stderr():
    """Yields a list that holds, afterwards, the lines written to fd 2 meanwhile
    (libtpu writes its log there from C++, past sys.stderr); libtpu's log lines are
    dropped, anything else is written through."""
    lines = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 2)
        try:
            yield lines
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            lines += f.read().decode(errors="replace").splitlines()
            other = [line for line in lines if line.strip() and not LIBTPU_LOG_LINE.match(line)]
            if other:
                print("\n".join(other), file=sys.stderr)


# glog's lines (I/W/E/F + MMDD), the continuation lines of libtpu's memory summary, and
# XLA's slow-compile banner (it fires after a few minutes on a loaded CPU)
LIBTPU_LOG_LINE = re.compile(r"^([IWEF]\d{4} |\s|Output size |Total \w+ usage |Program \w+ requirement |\*+$"
                             r"|Slow compilation warning:|\[Run backend for module\] Very slow compile)")


# ---- The steps, from shapes only


def abstract_state(cfg, mesh):
    """(optimizer, params, opt_state): params and optimizer state as ShapeDtypeStructs laid
    out exactly as weights.init_params / init_opt_state lay out the real ones."""
    shapes = abstract_params(cfg.model)
    specs = param_specs(shapes, cfg.mesh.expert_parallel)
    check_divisible(shapes, specs, mesh)
    params = jax.tree.map(lambda s, spec: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, spec)),
                          shapes, specs)
    optimizer = optimizers.make_optimizer(cfg.train)
    with jax.set_mesh(mesh):
        opt_shapes = jax.eval_shape(jax.jit(optimizer.init), params)
    opt_state = jax.tree.map(lambda s: jax.ShapeDtypeStruct(
        s.shape, s.dtype, sharding=NamedSharding(mesh, s.sharding.spec if s.sharding is not None else P())), opt_shapes)
    return optimizer, params, opt_state


def compile_steps(cfg, mesh, eval_step=True, hardware=None):
    """{"train": compiled, "eval": compiled, "seconds": {name: compile seconds}}: the
    real train and eval steps (steps.make_train_step / make_eval_step).
    `hardware` (the planner's name for the chips, PodType.hardware): --train.gather_once
    auto is decided as on those chips (executor_accumulate asks this process's devices,
    CPUs here, which report no memory and so always gather per microbatch)."""
    cfg = dtype_probe.for_accelerator(cfg)  # --model.dtype auto is bfloat16 on a TPU
    cfg = kernels_for(cfg, "tpu")  # --model.attention / moe_kernel auto: splash, gmm where they run
    if hardware and cfg.train.gather_once == "auto":
        once = planner_model.plan(cfg, mesh.size, hardware)["gather_once"]
        cfg = apply_overrides(cfg, {"train": {"gather_once": "true" if once else "false"}})
    check_config_fits_mesh(cfg, mesh)
    optimizer, params, opt_state = abstract_state(cfg, mesh)
    graphdef = abstract_model(cfg.model)[0]
    tokens = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.seq_len + 1), jnp.int32,
                                  sharding=NamedSharding(mesh, batch_spec()))
    step = jax.ShapeDtypeStruct((), jnp.int32)
    out, seconds, logged = {}, {}, {}
    t0 = time.perf_counter()
    with captured_stderr() as log:
        out["train"] = train_steps.make_train_step(graphdef, cfg, mesh, optimizer, params, opt_state).lower(
            params, opt_state, tokens, step).compile()
    seconds["train"] = time.perf_counter() - t0
    logged["train"] = compiler_log_memory(log)
    if eval_step:
        t0 = time.perf_counter()
        with captured_stderr() as log:
            out["eval"] = train_steps.make_eval_step(graphdef, cfg, mesh, params).lower(params, tokens).compile()
        seconds["eval"] = time.perf_counter() - t0
        logged["eval"] = compiler_log_memory(log)
    out["seconds"], out["log"] = seconds, logged
    return out


# What memory_analysis() does not say. libtpu logs, for each program it compiles:
#
#   Program hbm requirement 80.33M:
#       global           912.5K
#       scoped            1.00M
#       HLO temp         42.97M (98.9% utilization: Unpadded (23.89M) Padded (24.14M), 43.8% fragmentation (18.82M))
#       overlays         35.47M
#   Program cmem requirement 25.51M:        (v4 only: its 128 MiB common memory)
#       HLO temp         25.51M (...)
#   Program vmem requirement 9.02M: ...
#   Total hbm usage >= 1.27G:
#       reserved          1.25G             (the runtime's, on every program)
#
# The HLO temp allocation is the live temporaries at their peak ("Padded") plus the
# holes between them: every HBM buffer starts at a multiple of 16 KiB (all offsets in
# the buffer assignment, --xla_dump_to), and nested loops leave gaps. On the scaled-down
# moe1b those holes are 44-59% of the allocation, on tiny 96-99%. memory_analysis()'s
# temp_size_in_bytes is that allocation plus the fragmentation once more (to the
# printed digit on all 5 programs checked: 2 tiny steps, 2 scaled-down moe1b steps, a
# scan); its figure is kept as the conservative one, and the log's split is printed
# beside it. A small program also keeps temporaries in v4's CMEM or v5e/v6e's VMEM,
# which on a large one spill to HBM.

LOG_SIZE = r"([\d.]+)([BKMG])"
LOG_UNITS = {"B": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def log_bytes(number, unit):
    return int(float(number) * LOG_UNITS[unit])


def compiler_log_memory(lines):
    """{"hbm live temporaries", "hbm fragmentation", "hbm program", "code overlays",
    "cmem temporaries", "vmem temporaries", "runtime reserved"} in bytes, from the log
    of one compile; None where libtpu logged none (it was loaded with logging off)."""
    out, memory = {}, None
    for line in lines:
        head = re.match(r".*Program (\w+) requirement " + LOG_SIZE, line)
        if head:
            memory = head.group(1)
            if memory == "hbm":
                out["hbm program"] = log_bytes(*head.group(2, 3))
            continue
        temp = re.match(r"\s+HLO temp\s+" + LOG_SIZE + r" \(.*Padded \(" + LOG_SIZE + r"\), .*fragmentation \(" + LOG_SIZE, line)
        if temp and memory == "hbm":
            out["hbm live temporaries"] = log_bytes(*temp.group(3, 4))
            out["hbm fragmentation"] = log_bytes(*temp.group(5, 6))
        elif temp and memory in ("cmem", "vmem"):
            out[f"{memory} temporaries"] = log_bytes(*temp.group(1, 2))
        overlays = re.match(r"\s+overlays\s+" + LOG_SIZE, line)
        if overlays and memory == "hbm":
            out["code overlays"] = log_bytes(*overlays.groups())
        reserved = re.match(r"\s+reserved\s+" + LOG_SIZE + r"\s*$", line)
        if reserved and memory is None and "runtime reserved" not in out:
            out["runtime reserved"] = log_bytes(*reserved.groups())
        if line.startswith("Program host") or "Total host usage" in line:
            memory = None
    return out if "hbm live temporaries" in out else None


def live_temporaries(logged):
    """The compiler's temporaries without holes: live at the peak in HBM, plus those it
    placed in CMEM (v4) or VMEM (v5e, v6e, v5p)."""
    return logged["hbm live temporaries"] + logged.get("cmem temporaries", 0) + logged.get("vmem temporaries", 0)


def live_total(tpu, logged):
    """The step's bytes (memory_bytes) with the log's live temporaries in place of
    memory_analysis's (which count the holes twice): what the planner models."""
    return tpu["total"] - tpu["temporaries"] + live_temporaries(logged)


def allocated_total(tpu, logged):
    """live_total with the holes between the live temporaries counted once: the HBM the
    program's allocation takes (libtpu's "HLO temp"), which the runtime must find."""
    return live_total(tpu, logged) + logged["hbm fragmentation"]


def fits(tpu, logged, hbm_bytes):
    """The step's bytes (memory_analysis) and the HBM the TPU runtime keeps for itself
    on every program (libtpu's log: 1.25 GiB on v4, 263 MiB on v5p, 260 MiB on v6e)
    within the chip's HBM."""
    return tpu["total"] + (logged or {}).get("runtime reserved", 0) <= hbm_bytes


def memory_bytes(compiled):
    """Per-device bytes from the TPU compiler. total = what the step holds at once:
    arguments + outputs - aliased (donated arguments the outputs overwrite) + temporaries."""
    m = compiled.memory_analysis()
    out = dict(arguments=m.argument_size_in_bytes, outputs=m.output_size_in_bytes, aliased=m.alias_size_in_bytes,
               temporaries=m.temp_size_in_bytes, code=m.generated_code_size_in_bytes)
    out["total"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temporaries"]
    return out


# ---- Printing (planner.py --tpu)


def gib(n):
    return f"{n / GiB:9.3f} GiB"


def memory_report(planned, tpu, hbm_bytes, pod, compile_seconds, logged=None):
    """Lines: the planner's estimate and the TPU compiler's bytes, row by row (logged:
    compiler_log_memory of the train step)."""
    mem = planned["memory"]
    batch = planned.get("batch_bytes", 0)
    rows = [
        ("arguments (params + optimizer + batch)", mem["params"] + mem["optimizer"] + batch, tpu["arguments"]),
        ("outputs (new params + optimizer + metrics)", mem["params"] + mem["optimizer"], tpu["outputs"]),
        ("aliased (donated: outputs written over inputs)", mem["params"] + mem["optimizer"], tpu["aliased"]),
        ("temporaries (activations, gathered weights, grads)", planned["temp_bytes"], tpu["temporaries"]),
        ("total = arguments + outputs - aliased + temporaries", planned["total_bytes"], tpu["total"]),
    ]
    if logged:
        live = live_temporaries(logged)
        rows += [("libtpu's log: temporaries live at the peak", planned["temp_bytes"], live),
                 ("  their holes (memory_analysis counts them twice)", 0, logged["hbm fragmentation"]),
                 ("total with the live temporaries", planned["total_bytes"], live_total(tpu, logged)),
                 ("total as allocated (the holes counted once)", planned["total_bytes"], allocated_total(tpu, logged)),
                 ("code overlays in HBM (not in the totals)", 0, logged.get("code overlays", 0)),
                 ("runtime's HBM reserve (not in the totals)", 0, logged.get("runtime reserved", 0))]
    width = max(len(r[0]) for r in rows) + 2
    lines = [f"TPU compiler, {pod.name} ({pod.topology}, {pod.chips} chips), per device "
             f"(train step compiled in {compile_seconds['train']:.0f}s, eval step in {compile_seconds['eval']:.0f}s):",
             f"{'':<{width}}{'planner':>13} {'TPU compiler':>13} {'ratio':>6}"]
    for label, plan_bytes, tpu_bytes in rows:
        ratio = f"{plan_bytes / tpu_bytes:6.2f}" if tpu_bytes and plan_bytes else "     -"
        lines.append(f"{label:<{width}}{gib(plan_bytes) if plan_bytes else '':>13} {gib(tpu_bytes)} {ratio}")
    lines.append(f"{'program code (not in the total)':<{width}}{'':>13} {gib(tpu['code'])}")
    reserved = (logged or {}).get("runtime reserved", 0)
    verdict = "fits" if fits(tpu, logged, hbm_bytes) else "does NOT fit"
    lines.append(f"{verdict}: {tpu['total'] / GiB:.2f} GiB per device"
                 + (f" + the runtime's {reserved / GiB:.2f} GiB" if reserved else "") + f" of {hbm_bytes / GiB:.0f} GiB HBM")
    return lines


def collectives_report(table, title):
    """Lines of a collectives() table; with several slices, the rows that cross slices
    (over the data-center network) are marked DCN and summed at the end."""
    lines = [f"collectives of the {title} (per step, per device):",
             f"  {'kind':<20}{'dtype':<7}{'over':<16}{'count':>7}{'bytes':>14}"]
    for (kind, dtype, over), row in sorted(table.items(), key=lambda kv: (COLLECTIVE_KINDS.index(kv[0][0]), kv[0][1:])):
        lines.append(f"  {kind:<20}{dtype:<7}{over:<16}{row['count']:>7}{row['bytes'] / 2**20:>10.1f} MiB"
                     + ("  DCN (crosses slices)" if crosses_slices(over) else ""))
    dcn = [row for (_, _, over), row in table.items() if crosses_slices(over)]
    if dcn:
        nbytes = sum(row["bytes"] for row in dcn)
        lines.append(f"  across slices: {sum(row['count'] for row in dcn)} collectives, {nbytes} bytes "
                     f"({nbytes / 2**20:.1f} MiB) per device per step")
    return lines
