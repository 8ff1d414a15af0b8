"""The step's layout rules, pure functions of the config and sizes (no arrays): which
executor runs (executor_name), whether parallel/accumulate.py gathers the blocks once per
step (gathers_once), a pipeline's textbook bubble (formula_bubble). The step acts on them
and the planner asks them, so the two never disagree and the planner imports no executor.
"""

# gather_once auto: the most of a device's memory the gathered blocks and their float32
# gradient may take (the rest: params, optimizer state, activations, compiler buffers).
GATHER_ONCE_SHARE = 0.25

ACCUMULATE = "accumulate"


def executor_name(cfg, pp):
    """The executor on `pp` stages: "auto" (--mesh.sharding auto), "accumulate" (manual,
    pp = 1, gpipe, microbatches > 1), else "gpipe" or "1f1b" (which also runs interleaved)."""
    if cfg.mesh.sharding == "auto":
        return "auto"
    if pp == 1 and cfg.train.pipeline == "gpipe" and cfg.train.microbatches > 1:
        return ACCUMULATE  # no pipeline: accumulation (one microbatch: GPipe's autodiff is the same)
    return "gpipe" if cfg.train.pipeline == "gpipe" else "1f1b"


def gathers_once(cfg, held_bytes, memory_bytes):
    """Does parallel/accumulate.py gather the blocks once per step (True) or per microbatch?
    --train.gather_once true/false as it says; auto: once when M > 1 and `held_bytes` (per
    device: all blocks' gathered weights and their float32 gradient) is at most
    GATHER_ONCE_SHARE of `memory_bytes` (None, as on CPU: per microbatch)."""
    choice = cfg.train.gather_once
    if choice != "auto":
        return choice == "true"
    return cfg.train.microbatches > 1 and memory_bytes is not None and held_bytes <= GATHER_ONCE_SHARE * memory_bytes


def formula_bubble(kind, pp, M, V=1):
    """The textbook bubble: (pp - 1) / (V M + pp - 1) (V = 1 for gpipe and 1f1b; zb1: 3 M, its F, B, W ticks; zbv: 6 M)."""
    V = V if kind == "interleaved" else {"zb1": 3, "zbv": 6}.get(kind, 1)
    return (pp - 1) / (V * M + pp - 1)
