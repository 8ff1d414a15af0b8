"""Plan a run before paying for it: per-device memory, step time and whether it fits.

    python planner.py --preset moe1b --hardware tpu-v5p
    python planner.py --preset moe1b --hardware h200 --mesh.dp 1 --mesh.pp 1 --mesh.tp 1
    python planner.py --preset moe1b --hardware tpu-v5e --devices 64 --mesh.dp -1 --model.remat none

Nothing is allocated and no device is needed: parameter shapes come from
`nnx.eval_shape`, the storage layout from `weights.param_specs` (the same sharding
table the train step uses), and the mesh shape is arithmetic (`--mesh.dp -1` takes the
rest of `--devices N`). The model of a step is planning/costs.py, the search
planning/search.py, the printing and the compiler's side planning/report.py. Takes every
main.py flag, plus:

    --hardware NAME   one of the HARDWARE table below (default tpu-v5p)
    --devices N       devices in the run (needed with --mesh.dp -1)
    --efficiency X    fraction of peak FLOP/s the compute runs at (default: on a TPU the
                      model of the compiler's clock, planning/compute_clock.py; else 0.5)
    --json PATH       also write the plan as JSON
    --tpu TYPE        compile the real train and eval steps for that TPU slice (gcloud's
                      accelerator type, below) with the TPU compiler, on this CPU, and print
                      its per-device bytes beside the estimate, whether it fits the chip's
                      HBM, the compiled program's collectives and how much of them its
                      schedule overlaps with matmul work. Compiles with the options main.py
                      sets on a TPU (devices.TPU_OVERLAP_FLAGS). Needs libtpu
                      (requirements-test.txt). Sets --hardware and --devices. Last line:
                      tpu_bytes_per_device=<int> planner_bytes_per_device=<int> fits=<true|false>
                      collective_bytes=<int> exposed_bytes=<int> dot_flops_per_device=<int>
                      planner_dot_flops_per_device=<int> low_precision_dot_flops_per_device=<int>
                      compiler_step_ms=<float> compiler_compute_ms=<float>
                      (one line; the train step's collectives and those left exposed, bytes
                      per device per step, and its dot FLOPs per device per step, compiled
                      and planned, and the compiled ones whose operands are int8 / fp8
                      (--model.quant); loops by their trips, a conditional at its costliest
                      branch; the step on the compiler's clock: its ops' estimated_cycles
                      at the chip's clock and the Pallas kernels at their roofline, + the
                      collectives its schedule leaves exposed, by kind of op and by the
                      model's parts above the line)
    --hlo-out PATH    with --tpu: write the compiled train step's optimized HLO text there

    --search          rank every layout of the model and batch on these devices (mesh,
                      expert parallelism, schedule, microbatches, remat; planning/search.py)
                      by predicted step and list the fastest that fit, with the flags to
                      paste, beside the preset's own layout. --top N: how many (default 10).
                      With --tpu TYPE, the top --compile K (default 3) are compiled too: the
                      compiler's bytes, dot FLOPs and collectives, and how much of the
                      communication its schedule overlaps with compute. Last line:
                      best_step_ms=<float> preset_step_ms=<float> best_flags="..."

    python planner.py --table [--presets P,...] [--pods T,...] [--json PATH]
                      docs/planning.md's table: every preset compiled for the pods people use
                      (TABLE_MESHES below), the TPU compiler's bytes beside the planner's

What each row of memory and time means: planning/costs.py.
"""

import sys

from planning import cli

if __name__ == "__main__":
    cli.main(sys.argv[1:], usage=__doc__)
