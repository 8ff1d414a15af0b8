"""Benchmark one preset on one mesh: compile time, step time, tokens/s, memory, MFU.

    python bench.py --preset shakespeare
    python bench.py --preset tiny --run.cpu_devices 8 --mesh.dp 2 --mesh.pp 2 --mesh.tp 2 --train.microbatches 2
    python bench.py --preset moe1b --json moe1b.json      # last line: tokens_per_sec=... mfu=...
    python bench.py --preset tiny --run.cpu_devices 8 --mesh.dp 2 --mesh.tp 4 --mesh.sharding auto   # vs manual

MFU = model FLOPs per step / (step time x devices x peak), where model FLOPs are
flops.flops_per_token (matmuls of the active parameters, forward + backward, plus
attention scores) and peak is a large matmul in the compute dtype timed on this
device in this run (the fastest of 5), so the figure is a ratio that survives a noisy
machine; the step time is the median of the timed steps. With fake CPU devices all
"devices" share the same cores, so there MFU is only comparable between runs on the
same mesh.

`--mesh.sharding auto|manual` compares the compiler's partitioning (parallel/auto.py)
with the hand-written shard_map step on the same mesh: step time, temporaries, and the
collectives of the compiled program (kind, mesh axes, count, bytes per device).

`run_estimate_s` is the wall time of `python main.py` with the same flags, estimated from
the measured step (compile + steps x step time + evaluations + RUN_OVERHEAD_S): on this
machine, in the dtype the run would compute in (`--model.dtype auto` resolves here as in
main.py, runtime/dtype_probe.py).

Takes every main.py flag, plus --json PATH, --steps N (timed steps, default 10),
--warmup N (untimed steps after compile, default 2) and --profile DIR (trace the steps
once more and print device time per kind of XLA op), --show-schedule (print the pipeline
schedule's table for --mesh.pp, --train.microbatches, --train.pipeline and
--train.virtual_stages, then stop). Tokens are random: this measures
the step, not the data loader (see benchmarks/data_loader.py for that).
"""

import sys

from benchmarks import step

if __name__ == "__main__":
    step.main(sys.argv[1:])
