"""Every test process sees 8 fake CPU devices, set before JAX starts, so that the
parallel tests can build any mesh up to 8 devices; single-device tests use device 0."""

import os

import jax

from runtime.devices import use_fake_cpu_devices

use_fake_cpu_devices(8)

# The tests compile fast rather than run fast. Their models are tiny, so XLA:CPU spends
# most of a test's time compiling: at LLVM -O0 it compiles in about half the time (two
# test_parallel cases, one process: 73 s at the default level, 35 s at -O0; `python
# main.py --preset tiny --train.steps 30`: 18.3 s -> 10.5 s), and with XLA:CPU's older
# elemental emitters instead of its fusion emitters the compile halves again (two
# test_two_steps_equal_one_device cases: backend compile 12.9 s -> 5.5 s, the tests 22.2 s
# -> 14.0 s). The programs compute the same functions, and each comparison is between
# programs compiled alike. The main.py runs that tests start inherit the flags, except
# the multi-process and launcher runs (test_multiprocess.run_env, and ssh), which drop
# XLA_FLAGS and compare only among themselves.
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = f"{os.environ['XLA_FLAGS']} {FAST_COMPILE_FLAGS}"
jax.devices()
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


# The files whose tests take longest (whole-file times, from --durations: 2026-12-06), run first.
# pytest.ini hands out whole files to the two workers (--dist loadfile) in collection
# order, so one of these started last would run on alone after the other worker is done.
LONGEST_FIRST = ["test_tpu_compile.py", "test_context_parallel.py", "test_local_tier.py", "test_preemption.py",
                 "test_executors.py", "test_pipeline.py", "test_hf.py", "test_hf_real.py", "test_eval_tasks.py",
                 "test_main.py", "test_multiprocess.py", "test_docs.py", "test_harness.py", "test_tokenize_ray.py",
                 "test_planner.py", "test_model.py", "test_launch.py", "test_prefix.py", "test_serve.py"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # (stable: file order otherwise)
