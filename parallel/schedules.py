"""Pipeline schedules as data: which stage does what at every tick.

A schedule says, for every tick and every stage, what that stage does: a forward (F)
or backward (B) pass of one microbatch through one chunk of blocks, under zb1 the
backward's weight half (W) apart from B (then only the input gradient), or nothing.

    gpipe        all forwards, then all backwards; M microbatches' activations alive
    1f1b         pp - 1 - s warm-up forwards on stage s, then one forward and one
                 backward in turn (PipeDream-flush, arXiv:2006.09503): at most pp
                 microbatches alive per stage
    interleaved  1f1b over V chunks per device (Megatron's virtual stages,
                 arXiv:2104.04473, section 2.2): stage s holds chunks s, s + pp, ...,
                 so a microbatch passes every device V times; bubble
                 (pp - 1) / (V M + pp - 1) instead of (pp - 1) / (M + pp - 1)
    zb1          ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, arXiv:
                 2401.10241): B is the input gradient only, what the previous stage waits
                 for; each W (the weight gradient) runs later, stage s deferring s of them
                 so that the cooldown's idle ticks fill. F, B and W take a tick each:
                 3M + pp - 1 ticks, idle (pp - 1) / (3 M + pp - 1) (needs M >= pp);
                 at most pp microbatches in flight (F to W) per stage, as 1f1b's stage 0
    zbv          ZB-V (the same paper's V schedule; torch's ScheduleZBVZeroBubble): zb1's
                 B and W over two chunks per stage placed in a V, stage s holding chunks
                 s and 2 pp - 1 - s (the first and last on stage 0). 6M + pp - 1 chunk
                 ticks, pp - 1 of them idle per stage once M >= 2 pp: (pp - 1) / (6M + pp - 1)

`schedule(kind, pp, M, V)` builds the table by simulating the stages in lockstep (an op
waits for its input from the neighbour's previous tick) and gives every in-flight
microbatch a slot of a fixed ring of buffers; `grid` renders it as text.
parallel/one_f_one_b.py runs all but gpipe from it; planning/ and benchmarks/ read it.
"""

import dataclasses

import numpy as np

from utils import PIPELINE_SCHEDULES as SCHEDULES  # (one source of truth: the config)

IDLE, FORWARD, BACKWARD, WEIGHT = 0, 1, 2, 3  # (BACKWARD: the whole backward, or under zb1 its input half)
# Fields of one table row: what stage s does at tick t, and where its buffers are.
# recv_*_slot: where what arrives at the tick's start is kept; under zbv, the *_1 columns
# hold what arrives for the stage's second chunk (from the stage above: the V's way back up).
FIELDS = ("op", "microbatch", "chunk", "res_slot", "recv_x_slot", "grad_slot", "recv_grad_slot", "recv_x_slot_1",
          "recv_grad_slot_1")


# ---- The table


def stage_program(kind, pp, M, V, s):
    """The ordered ops [(op, microbatch, local chunk)] of stage s."""
    if kind == "gpipe":
        return [(FORWARD, m, 0) for m in range(M)] + [(BACKWARD, m, 0) for m in reversed(range(M))]
    if kind == "zb1":
        return zb1_program(pp, M, s)
    if kind == "zbv":
        return zbv_program(pp, M, s)
    if kind == "1f1b":
        warmup = min(pp - 1 - s, M)
        forwards = [(m, 0) for m in range(M)]
        backwards = forwards
    else:  # interleaved: microbatches in groups of pp, each group through chunk 0, then 1, ...
        warmup = min((pp - 1 - s) + (V - 1) * pp, M * V)
        forwards = [((k // (pp * V)) * pp + k % pp, (k // pp) % V) for k in range(M * V)]
        backwards = [(m, V - 1 - v) for m, v in forwards]
    program = [(FORWARD, m, v) for m, v in forwards[:warmup]]
    for i in range(len(forwards) - warmup):
        program += [(FORWARD, *forwards[warmup + i]), (BACKWARD, *backwards[i])]
    return program + [(BACKWARD, m, v) for m, v in backwards[len(forwards) - warmup:]]


def zb1_program(pp, M, s):
    """ZB-H1's ops on stage s: pp - 1 - s warm-up forwards, s forward-backward pairs whose
    W waits, then F B W while forwards remain, B W, and the s deferred Ws last."""
    ops, f, b, w = [], 0, 0, 0
    for _ in range(min(pp - 1 - s, M)):
        ops.append((FORWARD, f, 0))
        f += 1
    for _ in range(min(s, M - f)):
        ops += [(FORWARD, f, 0), (BACKWARD, b, 0)]
        f, b = f + 1, b + 1
    while f < M:
        ops += [(FORWARD, f, 0), (BACKWARD, b, 0), (WEIGHT, w, 0)]
        f, b, w = f + 1, b + 1, w + 1
    ops += [op for i in range(b, M) for op in ((BACKWARD, i, 0), (WEIGHT, w + i - b, 0))]
    return ops + [(WEIGHT, i, 0) for i in range(w + M - b, M)]


def zbv_program(pp, M, s):
    """ZB-V's ops on stage s (local chunk 0 is global chunk s, chunk 1 is 2 pp - 1 - s), as
    torch's ScheduleZBVZeroBubble orders them: 2 (pp - s) - 1 forwards of chunk 0, s pairs
    of forwards (chunk 1, chunk 0), pp - s F B W of chunk 1, then F B W of chunk 0 and of
    chunk 1 in turn while forwards remain; the cooldown runs the Bs first (s of each
    chunk, then chunk 0's with a W after each) and the remaining Ws last."""
    ops, f, b = [], [0, 0], [0, 0]

    def add(op, v):
        count = f if op == FORWARD else b
        ops.append((op, count[v], v))
        count[v] += op != WEIGHT
    for _ in range(min(2 * (pp - s) - 1, M)):
        add(FORWARD, 0)
    for _ in range(s):
        add(FORWARD, 1)
        if f[0] < M:
            add(FORWARD, 0)
    for _ in range(pp - s):
        if f[1] < M:
            add(FORWARD, 1)
        if b[1] < f[1]:
            add(BACKWARD, 1)
            ops.append((WEIGHT, b[1] - 1, 1))
    while f[1] < f[0] or f[0] < M:
        if f[0] < M:
            add(FORWARD, 0)
        add(BACKWARD, 0)
        ops.append((WEIGHT, b[0] - 1, 0))
        add(FORWARD, 1)
        add(BACKWARD, 1)
        ops.append((WEIGHT, b[1] - 1, 1))
    w = list(b)
    for _ in range(s):
        if b[0] < M:
            add(BACKWARD, 0)
        if b[1] < M:
            add(BACKWARD, 1)
    for _ in range(pp - s):
        if b[0] < M:
            add(BACKWARD, 0)
            ops.append((WEIGHT, w[0], 0))
            w[0] += 1
    ops += [(WEIGHT, i, 1) for i in range(w[1], b[1])]
    return ops + [(WEIGHT, i, 0) for i in range(w[0], b[0])]


@dataclasses.dataclass(frozen=True)
class Schedule:
    kind: str
    pp: int
    microbatches: int
    virtual_stages: int
    table: np.ndarray  # [ticks, pp, len(FIELDS)] int32
    res_slots: int  # ring slots of saved activations (the most microbatch-chunks in flight on a stage)
    grad_slots: int  # ring slots of incoming gradients

    @property
    def ticks(self):
        return self.table.shape[0]

    def bubble(self):
        """Idle share of the stage-ticks (forward and backward ticks counted alike)."""
        return float(np.mean(self.table[..., 0] == IDLE))


def chunks_per_stage(kind, V):
    """Chunks each stage holds: V interleaved, 2 under zbv, else 1."""
    return V if kind == "interleaved" else 2 if kind == "zbv" else 1


def chunk_of(kind, pp, s, v):
    """The global chunk that stage s runs as its v-th: v pp + s (a loop over the stages,
    V times), under zbv s then 2 pp - 1 - s (a V: down the stages and back up, the first
    and last chunk on stage 0). Works on traced s and v too."""
    if kind == "zbv":
        return s + v * (2 * pp - 1 - 2 * s)
    return v * pp + s


def place_of(kind, pp, c):
    """(stage, local chunk) of global chunk c: the inverse of chunk_of."""
    if kind == "zbv":
        return (c, 0) if c < pp else (2 * pp - 1 - c, 1)
    return c % pp, c // pp


def schedule(kind, pp, M, V=1):
    """Simulate the stages' programs in lockstep; return the Schedule."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {kind!r}")
    V = chunks_per_stage(kind, V)
    C = pp * V  # chunks: global chunk_of(kind, pp, s, v) is stage s's v-th
    programs = [stage_program(kind, pp, M, V, s) for s in range(pp)]
    done = {}  # (op, m, c) -> tick
    position, last_tick, t = [0] * pp, [-1] * pp, 0
    rows = []
    while any(position[s] < len(programs[s]) for s in range(pp)):
        row = [(IDLE, 0, 0)] * pp
        for s in range(pp):
            if position[s] == len(programs[s]):
                continue
            op, m, v = programs[s][position[s]]
            c = chunk_of(kind, pp, s, v)
            need = ((FORWARD, m, c - 1) if op == FORWARD else (BACKWARD, m, c) if op == WEIGHT
                    else (BACKWARD, m, c + 1) if c < C - 1 else (FORWARD, m, c))
            if (op == FORWARD and c == 0) or done.get(need, t) < t:
                row[s] = (op, m, v)
        for s in range(pp):
            if row[s][0] != IDLE:
                op, m, v = row[s]
                done[(op, m, chunk_of(kind, pp, s, v))] = t
                position[s] += 1
                last_tick[s] = t
        if all(r[0] == IDLE for r in row):
            raise RuntimeError(f"schedule {kind} deadlocks at tick {t} (pp={pp}, M={M}, V={V})")
        rows.append(row)
        t += 1
    table = np.zeros((len(rows), pp, len(FIELDS)), np.int32)
    for t, row in enumerate(rows):
        for s, (op, m, v) in enumerate(row):
            table[t, s, :3] = (op, m, v)
    res_slots, grad_slots = assign_slots(table, done, kind, pp, M, V)
    return Schedule(kind, pp, M, V, table, res_slots, grad_slots)


def assign_slots(table, done, kind, pp, M, V):
    """Give every (microbatch, chunk) on its stage a slot of the saved-activation ring,
    from when its input exists until its backward tick (under zb1 its W tick), and a slot
    of the gradient ring, from when its output gradient arrives until its backward tick. Fills the slot
    columns of the table in place; a write with nothing to write goes to the last
    slot (a trash slot). Returns (res_slots, grad_slots)."""
    C = pp * V
    res, grad = [[] for _ in range(pp)], [[] for _ in range(pp)]  # per stage: (start, end, m, v)
    for m in range(M):
        for c in range(C):
            (s, v), end = place_of(kind, pp, c), done[(BACKWARD, m, c)]
            res_end = done.get((WEIGHT, m, c), end)
            res[s].append((done[(FORWARD, m, c - 1)] + 1 if c > 0 else done[(FORWARD, m, c)], res_end, m, v))
            grad[s].append((done[(BACKWARD, m, c + 1)] + 1 if c < C - 1 else done[(FORWARD, m, c)], end, m, v))

    def colour(intervals):  # greedy interval colouring: slot -> free from tick
        free_from, out = [], {}
        for start, end, m, v in sorted(intervals):
            slot = next((i for i, f in enumerate(free_from) if f <= start), len(free_from))
            if slot == len(free_from):
                free_from.append(0)
            free_from[slot] = end + 1
            out[(m, v)] = (slot, start)
        return out, len(free_from)

    n_res = n_grad = 0
    res_of, grad_of = [], []
    for s in range(pp):
        r, n = colour(res[s])
        g, k = colour(grad[s])
        res_of.append(r)
        grad_of.append(g)
        n_res, n_grad = max(n_res, n), max(n_grad, k)
    table[..., 3:] = -1
    for t in range(table.shape[0]):
        for s in range(pp):
            op, m, v = table[t, s, :3]
            if op != IDLE:
                table[t, s, 3] = res_of[s][(m, v)][0]
                table[t, s, 5] = grad_of[s][(m, v)][0]
    second = kind == "zbv"  # zbv's second chunk: its arrivals in columns 7 and 8
    for s in range(pp):
        for (m, v), (slot, start) in res_of[s].items():
            if chunk_of(kind, pp, s, v) > 0:  # an activation that arrives from the previous chunk's stage at `start`
                table[start, s, 7 if second and v else 4] = slot
        for (m, v), (slot, start) in grad_of[s].items():
            if chunk_of(kind, pp, s, v) < C - 1:  # a gradient that arrives from the next chunk's stage at `start`
                table[start, s, 8 if second and v else 6] = slot
    for column, trash in zip(range(3, 9), (n_res, n_res, n_grad, n_grad, n_res, n_grad)):
        table[..., column] = np.where(table[..., column] < 0, trash, table[..., column])
    return n_res, n_grad


def grid(sched):
    """The table as text: one row per stage, one column per tick. F3 = forward of
    microbatch 3, B3 = its backward (zb1: its input gradient), W3 = its weight gradient, . = idle; with V chunks, F3b = through the
    stage's second chunk."""
    V = sched.virtual_stages
    cells = [[("." if op == IDLE else "FBW"[op - 1] + str(m) + ("abcdefghijklmnop"[v] if V > 1 else ""))
              for op, m, v in sched.table[:, s, :3]] for s in range(sched.pp)]
    width = max(len(c) for row in cells for c in row)
    head = (f"{sched.kind}: pp={sched.pp}, M={sched.microbatches}" + (f", V={V}" if V > 1 else "")
            + f"; {sched.ticks} ticks, bubble {sched.bubble():.1%}, at most {sched.res_slots} microbatch"
            + ("-chunks" if V > 1 else "es") + " in flight per stage")
    lines = [head, "tick    " + " ".join(f"{t:<{width}}" for t in range(sched.ticks)).rstrip()]
    lines += [f"stage {s} " + " ".join(f"{c:<{width}}" for c in row).rstrip() for s, row in enumerate(cells)]
    return "\n".join(lines)
