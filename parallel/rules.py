"""The step's layout rules, as pure functions of the config and sizes (no arrays):

  executor_name  which executor computes (loss, metrics, grads) on a layout
                 (parallel/steps.executor_of runs it)
  gathers_once   whether parallel/accumulate.py all-gathers the FSDP blocks once per step
                 or per microbatch (accumulate.gathers_once acts on it)
  formula_bubble the idle share of a pipeline schedule, by its formula (the schedule
                 tables of parallel/schedules.py count it off the table)

The step acts on them; the planner (planning/) asks them with the sizes it computes
from shapes, so the two never disagree and the planner imports no executor.
"""

# auto: gather the blocks once per step when their gathered weights and float32
# gradient take at most this share of a device's memory (the rest: optimizer state,
# params, one microbatch's activations, the compiler's buffers).
GATHER_ONCE_SHARE = 0.25

ACCUMULATE = "accumulate"


def executor_name(cfg, pp):
    """The executor of this config on a mesh with `pp` pipeline stages: "auto"
    (--mesh.sharding auto), "accumulate" (manual, pp = 1, gpipe, microbatches > 1),
    else the pipeline's: "gpipe", or "1f1b" (which also runs interleaved)."""
    if cfg.mesh.sharding == "auto":
        return "auto"
    if pp == 1 and cfg.train.pipeline == "gpipe" and cfg.train.microbatches > 1:
        return ACCUMULATE  # no pipeline: accumulation (one microbatch: GPipe's autodiff is the same)
    return "gpipe" if cfg.train.pipeline == "gpipe" else "1f1b"


def gathers_once(cfg, held_bytes, memory_bytes):
    """Does executor_accumulate all-gather the blocks once per step (True) or per
    microbatch (False)? --train.gather_once true or false as it says; auto: once when
    M > 1 and `held_bytes` (per device: every block's gathered weights in the compute
    dtype and their float32 gradient) is at most GATHER_ONCE_SHARE of `memory_bytes`
    (the device's memory; None where the device reports none, as CPU: per microbatch)."""
    choice = cfg.train.gather_once
    if choice != "auto":
        return choice == "true"
    return cfg.train.microbatches > 1 and memory_bytes is not None and held_bytes <= GATHER_ONCE_SHARE * memory_bytes


def formula_bubble(kind, pp, M, V=1):
    """The textbook bubble: (pp - 1) / (V M + pp - 1) (V = 1 for gpipe and 1f1b)."""
    V = V if kind == "interleaved" else 1
    return (pp - 1) / (V * M + pp - 1)
