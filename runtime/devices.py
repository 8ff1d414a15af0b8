"""Devices, set up before JAX starts its backend: fake CPU devices, the platform, the compiler's overlap flags, the
compilation cache, joining a multi-process run. Call them before touching a device (jax.devices(), an array); importing JAX is fine."""

import os
import sys
import threading

import jax
from jax._src import distributed, hardware_utils  # the coordination service's barriers; the checks JAX uses to suggest plugins


def skip_tpu_probe_without_tpu():
    """Ask for the CPU backend where no TPU or GPU is visible and no platform was chosen: an installed libtpu (a tooling
    dependency) would otherwise probe, warn and take a lock file that concurrent processes fight over. Run before the backend starts."""
    if os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms:
        return
    if (hardware_utils.num_available_tpu_chips_and_device_id()[0] or hardware_utils.has_visible_nvidia_gpu()
            or hardware_utils.num_available_amd_gpus(stop_at=1)):
        return
    jax.config.update("jax_platforms", "cpu")


# ---- The compiler's overlap options: communication scheduled under matmul work (when bytes move, not what is computed)
# TPU: MaxText's set plus reduce-scatter, all-reduce, permute and all-to-all, each accepted by libtpu 0.0.42.1 (an unknown
# flag aborts it; fusing all-reduces overflows a v4's VMEM: docs/benchmarks.md). GPU: XLA's latency-hiding scheduler.
TPU_OVERLAP_FLAGS = (
    "--xla_tpu_enable_async_collective_fusion=true",
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",
    "--xla_tpu_enable_async_collective_fusion_fuse_reduce_scatter=true",
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
    "--xla_tpu_overlap_compute_collective_tc=true",
    "--xla_enable_async_all_gather=true",
    "--xla_enable_async_all_reduce=true",
    "--xla_enable_async_collective_permute=true",
    "--xla_tpu_enable_async_all_to_all=true",
    "--xla_tpu_enable_data_parallel_all_reduce_opt=true",
    "--xla_tpu_data_parallel_opt_different_sized_ops=true",
)
GPU_OVERLAP_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_enable_highest_priority_async_stream=true",
    "--xla_gpu_enable_pipelined_all_gather=true",
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
    "--xla_gpu_enable_pipelined_all_reduce=true",
)
OVERLAP_VARIABLE = {"tpu": "LIBTPU_INIT_ARGS", "gpu": "XLA_FLAGS"}  # where each platform's compiler reads them
OVERLAP_FLAGS = {"tpu": TPU_OVERLAP_FLAGS, "gpu": GPU_OVERLAP_FLAGS}


def merge_flags(ours, theirs):
    """A flag string: `theirs` (the user's, as given) after each of `ours` whose name it does not set: the user's wins flag by flag."""
    named = {flag.split("=", 1)[0] for flag in theirs.split()}
    return " ".join([flag for flag in ours if flag.split("=", 1)[0] not in named] + theirs.split())


def overlap_environ(platform, environ=None):
    """{variable: value} giving `platform`'s compiler the overlap flags, merged with what `environ` (os.environ) holds; {} on CPU."""
    environ = os.environ if environ is None else environ
    if platform not in OVERLAP_VARIABLE:
        return {}
    variable = OVERLAP_VARIABLE[platform]
    return {variable: merge_flags(OVERLAP_FLAGS[platform], environ.get(variable, ""))}


def accelerator_platform():
    """"tpu", "gpu" or "cpu": the backend JAX will start, asked before it starts (JAX_PLATFORMS/jax_platforms, else PCI and /dev)."""
    chosen = (os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or "").split(",")[0].strip()
    if chosen:
        return {"cuda": "gpu", "rocm": "gpu"}.get(chosen, chosen)
    if hardware_utils.num_available_tpu_chips_and_device_id()[0]:
        return "tpu"
    if hardware_utils.has_visible_nvidia_gpu() or hardware_utils.num_available_amd_gpus(stop_at=1):
        return "gpu"
    return "cpu"


def set_overlap_flags(cfg):
    """--mode train on a TPU or GPU: the overlap flags into the compiler's environment (merged with the user's), printed once.
    Nothing on CPU or fake CPU devices. Must run before JAX starts its backend."""
    if cfg.mode != "train" or cfg.run.cpu_devices:
        return
    platform = accelerator_platform()
    for variable, value in overlap_environ(platform).items():
        os.environ[variable] = value
        print(f"{variable}={value}  (the compiler's overlap flags on {platform.upper()}; yours win flag by flag)", flush=True)


def use_fake_cpu_devices(n_devices, timeout_s=600):
    """Split the CPU into `n_devices` fake devices whose collectives cannot hang; must run before JAX starts its backend.
    XLA:CPU's shared pool gets max(cores, 2 x devices) threads unless PJRT_NPROC or NPROC is set: with one per device, every
    thread can wait in a different collective (docs/benchmarks.md). A collective may wait `timeout_s`, not XLA:CPU's 40 s, for
    a thread slowed by a loaded machine (a value in XLA_FLAGS wins)."""
    skip_tpu_probe_without_tpu()
    jax.config.update("jax_num_cpu_devices", n_devices)
    if "PJRT_NPROC" not in os.environ and "NPROC" not in os.environ:
        os.environ["PJRT_NPROC"] = str(max(os.cpu_count() or 1, 2 * n_devices))
    flag = "--xla_cpu_collective_call_terminate_timeout_seconds"
    flags = os.environ.get("XLA_FLAGS", "")
    if flag not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {flag}={timeout_s}".strip()


def setup_devices(cfg):
    """Fake CPU devices, the compiler's overlap flags (TPU, GPU), the compile cache and multi-process init; must run before JAX
    touches a device. Returns whether this is one process of several."""
    skip_tpu_probe_without_tpu()
    set_overlap_flags(cfg)
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
    # JAX's heartbeat stops all when one dies; a peer that never shows up gets this plainer message before JAX's connect timeout.
    never_met = threading.Timer(d.timeout_s, stop_now, [
        f"error: not all processes reached the coordinator {d.coordinator or '(auto-detected)'} within {d.timeout_s}s "
        "(--dist.timeout_s). Start every process with the same --dist.coordinator and --dist.num_processes and its "
        "own --dist.process_id, and check that the coordinator's host and port can be reached from every host."])
    never_met.daemon = True
    never_met.start()
    try:
        jax.distributed.initialize(**where, initialization_timeout=d.timeout_s + CONNECT_GRACE_S, heartbeat_timeout_seconds=d.timeout_s)
    finally:
        never_met.cancel()
    return True


def align_processes(name, timeout_s):
    """Wait until every process gets here (a coordination-service barrier): gloo gives a peer only 30 s to join a communicator,
    so main.py aligns processes before the first collectives. The deadline is at least ALIGN_MIN_S (a peer still compiling is
    alive); a dead one is caught by the heartbeat within --dist.timeout_s."""
    if distributed.global_state.client is not None and jax.process_count() > 1:
        deadline_s = max(timeout_s, ALIGN_MIN_S)
        distributed.global_state.client.wait_at_barrier(f"meshformer_{name}", timeout_in_ms=int(deadline_s * 1000))


ALIGN_MIN_S = 600  # a slow compile is not a lost process


CONNECT_GRACE_S = 10  # JAX's own connect timeout fires this long after ours, so ours is the one seen


def stop_now(message):
    """Exit at once, from any thread, skipping exit handlers: JAX's would first wait (up to the heartbeat timeout) for dead processes."""
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


def is_main_process():
    return jax.process_index() == 0


def say(*args):
    """print, on process 0 only."""
    if is_main_process():
        print(*args, flush=True)
