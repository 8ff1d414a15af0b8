"""Pipeline schedules as data, and the executor that runs them inside shard_map.

A schedule says, for every tick and every stage, what that stage does: a forward (F)
or backward (B) pass of one microbatch through one chunk of blocks, or nothing.

    gpipe        all forwards, then all backwards; M microbatches' activations alive
    1f1b         pp - 1 - s warm-up forwards on stage s, then one forward and one
                 backward in turn (PipeDream-flush, arXiv:2006.09503): at most pp
                 microbatches alive per stage
    interleaved  1f1b over V chunks per device (Megatron's virtual stages,
                 arXiv:2104.04473, section 2.2): stage s holds chunks s, s + pp, ...,
                 so a microbatch passes every device V times; bubble
                 (pp - 1) / (V M + pp - 1) instead of (pp - 1) / (M + pp - 1)

`schedule(kind, pp, M, V)` builds the table by simulating the stages in lockstep (each
stage runs its program in order, an op waits for its input from the neighbour's
previous tick), and assigns every in-flight microbatch a slot of a fixed ring of
buffers. `grid(...)` prints it. GPipe runs by autodiff (parallel.pipeline_loss); 1f1b
and interleaved run here (`scheduled_value_and_grad`): one lax.scan over the table's
ticks, one `lax.cond` per tick on the stage's op, the backward written by hand
(jax.vjp of a block per backward tick), gradients accumulated in the loop.

What a backward tick needs from its forward tick (the "residuals") is kept as the
input of each of the chunk's blocks (remat stage: the chunk's input) in a ring of
slots [R, L, b, T, D], R = the most microbatches in flight on a stage (pp for 1f1b):
the backward tick recomputes a block from its input, then runs its vjp. So under
these schedules remat none behaves as block; layer and block_dots still bound what
one block's backward holds.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model import axis_index, fold_in_rows, rope_angles
from utils import PIPELINE_SCHEDULES as SCHEDULES  # (one source of truth: the config)

IDLE, FORWARD, BACKWARD = 0, 1, 2
# Fields of one table row: what stage s does at tick t, and where its buffers are.
FIELDS = ("op", "microbatch", "chunk", "res_slot", "recv_x_slot", "grad_slot", "recv_grad_slot")


# ----------------------------------------------------------------------------
# The table


def stage_program(kind, pp, M, V, s):
    """The ordered ops [(op, microbatch, local chunk)] of stage s."""
    if kind == "gpipe":
        return [(FORWARD, m, 0) for m in range(M)] + [(BACKWARD, m, 0) for m in reversed(range(M))]
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


def schedule(kind, pp, M, V=1):
    """Simulate the stages' programs in lockstep; return the Schedule."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {kind!r}")
    V = V if kind == "interleaved" else 1
    C = pp * V  # chunks; global chunk c = v * pp + s lives on stage s = c % pp
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
            c = v * pp + s
            need = (FORWARD, m, c - 1) if op == FORWARD else (BACKWARD, m, c + 1) if c < C - 1 else (FORWARD, m, c)
            if (op == FORWARD and c == 0) or done.get(need, t) < t:
                row[s] = (op, m, v)
        for s in range(pp):
            if row[s][0] != IDLE:
                op, m, v = row[s]
                done[(op, m, v * pp + s)] = t
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
    res_slots, grad_slots = assign_slots(table, done, pp, M, V)
    return Schedule(kind, pp, M, V, table, res_slots, grad_slots)


def assign_slots(table, done, pp, M, V):
    """Give every (microbatch, chunk) on its stage a slot of the saved-activation ring,
    from when its input exists until its backward tick, and a slot of the gradient
    ring, from when its output gradient arrives until the same tick. Fills the slot
    columns of the table in place; a write with nothing to write goes to the last
    slot (a trash slot). Returns (res_slots, grad_slots)."""
    C = pp * V
    res, grad = [[] for _ in range(pp)], [[] for _ in range(pp)]  # per stage: (start, end, m, v)
    for m in range(M):
        for c in range(C):
            s, v, end = c % pp, c // pp, done[(BACKWARD, m, c)]
            res[s].append((done[(FORWARD, m, c - 1)] + 1 if c > 0 else done[(FORWARD, m, c)], end, m, v))
            grad[s].append((done[(BACKWARD, m, c + 1)] + 1 if c < C - 1 else done[(FORWARD, m, c)], end, m, v))

    def colour(intervals):  # greedy interval colouring: slot -> free from tick
        slots, free_from, out = {}, [], {}
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
    for s in range(pp):
        for (m, v), (slot, start) in res_of[s].items():
            if v * pp + s > 0:  # an activation that arrives from the previous stage at `start`
                table[start, s, 4] = slot
        for (m, v), (slot, start) in grad_of[s].items():
            if v * pp + s < C - 1:  # a gradient that arrives from the next stage at `start`
                table[start, s, 6] = slot
    table[..., 3] = np.where(table[..., 3] < 0, n_res, table[..., 3])
    table[..., 4] = np.where(table[..., 4] < 0, n_res, table[..., 4])
    table[..., 5] = np.where(table[..., 5] < 0, n_grad, table[..., 5])
    table[..., 6] = np.where(table[..., 6] < 0, n_grad, table[..., 6])
    return n_res, n_grad


def grid(sched):
    """The table as text: one row per stage, one column per tick. F3 = forward of
    microbatch 3, B3 = its backward, . = idle; with V chunks, F3b = through the
    stage's second chunk."""
    V = sched.virtual_stages
    cells = [[("." if op == IDLE else "FB"[op - 1] + str(m) + ("abcdefghijklmnop"[v] if V > 1 else ""))
              for op, m, v in sched.table[:, s, :3]] for s in range(sched.pp)]
    width = max(len(c) for row in cells for c in row)
    head = (f"{sched.kind}: pp={sched.pp}, M={sched.microbatches}" + (f", V={V}" if V > 1 else "")
            + f"; {sched.ticks} ticks, bubble {sched.bubble():.1%}, at most {sched.res_slots} microbatch"
            + ("-chunks" if V > 1 else "es") + " in flight per stage")
    lines = [head, "tick    " + " ".join(f"{t:<{width}}" for t in range(sched.ticks)).rstrip()]
    lines += [f"stage {s} " + " ".join(f"{c:<{width}}" for c in row).rstrip() for s, row in enumerate(cells)]
    return "\n".join(lines)


def formula_bubble(kind, pp, M, V=1):
    """The textbook bubble: (pp - 1) / (V M + pp - 1) (V = 1 for gpipe and 1f1b)."""
    V = V if kind == "interleaved" else 1
    return (pp - 1) / (V * M + pp - 1)


# ----------------------------------------------------------------------------
# Interleaved: which device holds which blocks
#
# Storage keeps blocks contiguous (stage s stores blocks [s N/pp, (s+1) N/pp)), so init,
# checkpoints, eval and the planner's layouts do not depend on the schedule. The
# interleaved step moves each chunk once per step to the stage that runs it (chunk c to
# stage c % pp) with ppermutes, and its gradient back the same way; each chunk moves
# once, V*V ppermutes each carrying one chunk between the devices that need it.


def move_chunks(tree_VL, source_of, axis):
    """Permute chunks between devices: output chunk u of device d is chunk w of device
    source_of(d, u) = (device, w). Leaves [V, L, ...]."""
    n = jax.lax.axis_size(axis)
    V = jax.tree.leaves(tree_VL)[0].shape[0]
    out = []
    for u in range(V):
        total = None
        for w in range(V):
            pairs = [(source_of(d, u)[0], d) for d in range(n) if source_of(d, u)[1] == w]
            if not pairs:
                continue
            moved = jax.tree.map(lambda x: jax.lax.ppermute(x[w], axis, pairs), tree_VL)
            total = moved if total is None else jax.tree.map(jnp.add, total, moved)
        out.append(total)
    return jax.tree.map(lambda *xs: jnp.stack(xs), *out)


def to_chunks(tree_N, V, axis):
    """Local storage [V L, ...] (stage s's contiguous blocks) -> the chunks stage s runs
    [V, L, ...]: its v-th chunk is global chunk v pp + s."""
    pp = jax.lax.axis_size(axis)
    tree = jax.tree.map(lambda x: x.reshape(V, x.shape[0] // V, *x.shape[1:]), tree_N)
    if V == 1 or pp == 1:
        return tree
    return move_chunks(tree, lambda d, v: divmod(v * pp + d, V), axis)


def from_chunks(tree_VL, axis):
    """The inverse of to_chunks: [V, L, ...] chunks back to storage order [V L, ...]."""
    pp = jax.lax.axis_size(axis)
    V = jax.tree.leaves(tree_VL)[0].shape[0]
    if V > 1 and pp > 1:
        tree_VL = move_chunks(tree_VL, lambda d, u: ((d * V + u) % pp, (d * V + u) // pp), axis)
    return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), tree_VL)


# ----------------------------------------------------------------------------
# Typing helpers: inside shard_map, both branches of a cond and a scan's carry must
# agree on which mesh axes a value varies over.


def vary(x, axes):
    missing = tuple(a for a in axes if a not in jax.typeof(x).manual_axis_type.varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def zeros_of(avals):
    return jax.tree.map(lambda s: vary(jnp.zeros(s.shape, s.dtype), tuple(s.manual_axis_type.varying)), avals)


def when(pred, fn, *args):
    """fn(*args) where pred holds; zeros of the same types elsewhere, computing nothing.
    A pred known when tracing (a Python bool, e.g. "the only stage is the last") needs
    no cond: XLA:CPU inlines a cond on a constant predicate, and the collectives of the
    inlined branch then share ids with the step's own (a crash, "Id can't be larger than
    the number of participating threads", seen at pp=1, tp>1 with MTP in the branch)."""
    if isinstance(pred, bool):
        return fn(*args) if pred else zeros_of(jax.eval_shape(fn, *args))
    avals = jax.eval_shape(fn, *args)
    return jax.lax.cond(pred, fn, lambda *_: zeros_of(avals), *args)


def widen(tree, avals):
    """Make tree vary over every axis its counterpart in avals varies over."""
    return jax.tree.map(lambda x, s: vary(x, tuple(s.manual_axis_type.varying)), tree, avals)


# ----------------------------------------------------------------------------
# The executor


def scheduled_value_and_grad(params, tokens_bT1, graphdef, cfg, rng, *, gather, loss_and_metrics, axes, dropout_rows=None):
    """((loss, metrics), grads) of one step under --train.pipeline 1f1b | interleaved,
    from inside shard_map; the same numbers autodiff of parallel.sharded_loss gives.

    gather(tree, one_block) is parallel.gather_for_use (FSDP all-gather + cast; its vjp
    reduce-scatters the gradient); loss_and_metrics(ce_sum, stats_N) is the loss of
    parallel.sharded_loss from the per-device sums; dropout_rows(rng, first_row, n)
    is parallel.dropout_rows (the per-row dropout keys GPipe uses too; needed when rng is not None).
    """
    DP, PP, TP = axes
    m_cfg, t_cfg = cfg.model, cfg.train
    M, V = t_cfg.microbatches, (t_cfg.virtual_stages if t_cfg.pipeline == "interleaved" else 1)
    pp, stage = jax.lax.axis_size(PP), axis_index(PP)  # (0, not varying, when pp = 1: model.live_axes)
    sched = schedule(t_cfg.pipeline, pp, M, V)
    C = pp * V
    ep_axis = DP if cfg.mesh.expert_parallel else None
    remat = m_cfg.remat

    tokens_MbT1 = tokens_bT1.reshape(M, tokens_bT1.shape[0] // M, tokens_bT1.shape[1])
    T = tokens_MbT1.shape[2] - 1
    b = tokens_MbT1.shape[1]
    # Dropout keys of this device's rows, as parallel.pipeline_loss derives them: rows
    # [dp_index * M * b, ...) of the global batch, microbatch m holding the m-th b.
    keys_Mb = None if rng is None else dropout_rows(rng, axis_index(DP) * M * b, M * b).reshape(M, b)
    angles = rope_angles(jnp.arange(T)[None, :], m_cfg.rope_dim, m_cfg.rope_theta)

    # The embedding and final norm, gathered once per step; their gradient is summed
    # in float32 over the step and reduce-scattered once at the end (the gather's vjp).
    # Typed as varying over pp: the stages use them in different branches of a cond,
    # and a gradient summed over pp inside a branch only some stages take would wait
    # forever for the others; this way the sum over stages is the transpose of the
    # pcast, after the loop, on every stage.
    top_local = {k: v for k, v in params.items() if k != "blocks"}
    top, top_vjp = jax.vjp(lambda t: jax.tree.map(lambda w: vary(w, (PP,)), gather(t, False)), top_local)
    chunks = to_chunks(params["blocks"], V, PP)  # [V, L, ...]: this stage's chunks
    L = jax.tree.leaves(chunks)[0].shape[1]
    block_def = nnx.split(nnx.merge(graphdef, {**top, "blocks": params["blocks"]}).blocks)[0]

    def model_with(top_g):
        return nnx.merge(graphdef, {**top_g, "blocks": params["blocks"]})

    def block_fn(state, x_bTD, m, n):
        """Block n (global index) on microbatch m: (x, MoE stats)."""
        # Tie the weights to this block's input so the gather stays in the loop
        # (see model.apply_blocks) instead of all blocks' gathers being hoisted.
        state = jax.lax.optimization_barrier((state, x_bTD))[0]
        block_rng = None if keys_Mb is None else fold_in_rows(keys_Mb[m], n)  # as model.apply_blocks folds block n
        block = nnx.merge(block_def, gather(state, True))
        return block(x_bTD, angles, TP, ep_axis, block_rng, remat_layers=remat == "layer")

    def differentiable_block(state, x_bTD, m, n):
        y, stats = block_fn(state, x_bTD, m, n)
        return y, stats["aux_loss_sum"]

    if remat == "block_dots":  # keep the matmul outputs of the block being differentiated
        differentiable_block = jax.checkpoint(differentiable_block, policy=jax.checkpoint_policies.dots_saveable)

    def run_chunk(chunk, x_bTD, m, c):
        """Forward through chunk c's L blocks: (y, every block's input [L, ...], stats [L])."""
        def body(x, state_and_j):
            state, j = state_and_j
            y, stats = block_fn(state, x, m, c * L + j)
            return y, (x, stats)
        y, (xs_LbTD, stats_L) = jax.lax.scan(body, x_bTD, (chunk, jnp.arange(L)), unroll=L if m_cfg.unroll_blocks else 1)
        return y, xs_LbTD, stats_L

    # The aux loss is aux_loss_weight x pmean_tp(psum_{dp,pp}(sum of aux_loss_sum)) /
    # (groups x MoE layers): each device's block statistic gets that cotangent, 1/tp
    # of it per tp device (parallel.sharded_loss), like autodiff gives.
    n_tokens = t_cfg.batch_size * m_cfg.seq_len
    n_moe = m_cfg.n_blocks * m_cfg.block_pattern.count("M")
    groups = n_tokens // (m_cfg.routing_group or m_cfg.seq_len)
    aux_cot = m_cfg.aux_loss_weight / (groups * n_moe * jax.lax.axis_size(TP)) if n_moe else 0.0

    def backward_chunk(chunk, xs_LbTD, gy, m, c):
        """Hand-written backward of chunk c: (gradient of its input, of its weights)."""
        if remat == "stage":  # recompute the whole chunk from its input, then its vjp
            def f(chunk, x):
                y, _, stats = run_chunk(chunk, x, m, c)
                return y, stats["aux_loss_sum"]
            (_, aux), vjp = jax.vjp(f, chunk, xs_LbTD[0])
            g_chunk, gx = vjp((gy, jnp.full_like(aux, aux_cot)))
            return gx, g_chunk

        def body(g, state_x_j):
            state, x, j = state_x_j
            (_, aux), vjp = jax.vjp(lambda s, x: differentiable_block(s, x, m, c * L + j), state, x)
            g_state, gx = vjp((g, jnp.full_like(aux, aux_cot)))
            return gx, g_state
        gx, g_chunk = jax.lax.scan(body, gy, (chunk, xs_LbTD, jnp.arange(L)), reverse=True,
                                   unroll=L if m_cfg.unroll_blocks else 1)
        return gx, g_chunk

    def embed(top_g, m):
        return model_with(top_g).embed(tokens_MbT1[m, :, :-1], TP)

    def head_loss(top_g, y_bTD, m):
        return model_with(top_g).loss_sum(y_bTD, tokens_MbT1[m, :, 1:], TP)

    def forward_op(x_saved, m, v, c):
        """F: (output to send, block inputs to save, stats, ce, gradient of the output, of top)."""
        x = jax.lax.cond(c == 0, lambda: vary(embed(top, m).astype(x_saved.dtype), tuple(jax.typeof(x_saved).manual_axis_type.varying)),
                         lambda: x_saved)  # the embedding, on the first chunk of stage 0 only
        chunk = jax.tree.map(lambda w: w[v], chunks)
        y, xs_LbTD, stats_L = run_chunk(chunk, x, m, c)

        def head(y):  # the head and loss, on the last chunk of the last stage only
            ce, vjp = jax.vjp(lambda t, y: head_loss(t, y, m), top, y)
            g_top, gy = vjp(jnp.ones_like(ce) / n_tokens)
            return ce, gy, jax.tree.map(lambda g: g.astype(jnp.float32), g_top)

        ce, gy, g_top = when(c == C - 1, head, y)
        saved = xs_LbTD[:1] if remat == "stage" else xs_LbTD
        return y, saved, stats_L, ce, gy, g_top

    def backward_op(xs_LbTD, gy, m, v, c):
        """B: (gradient to send, of the chunk's weights, of top)."""
        chunk = jax.tree.map(lambda w: w[v], chunks)
        gx, g_chunk = backward_chunk(chunk, xs_LbTD, gy, m, c)

        def embed_backward(gx):  # the embedding's gradient, on the first chunk of stage 0 only
            _, vjp = jax.vjp(lambda t: embed(t, m), top)
            return jax.tree.map(lambda g: g.astype(jnp.float32), vjp(gx.astype(top["embed_VD"].dtype))[0])

        g_top = when(c == 0, embed_backward, gx)
        return gx, g_chunk, g_top

    # Buffers. Activations vary over dp (rows) and pp (stages); the ring has one trash
    # slot at the end for writes with nothing to write.
    b = tokens_MbT1.shape[1]
    act_dtype = jnp.dtype(m_cfg.dtype)
    x0 = vary(jnp.zeros((b, T, m_cfg.d_model), act_dtype), (DP, PP))
    saved_L = 1 if remat == "stage" else L
    zeros_chunks = jax.tree.map(lambda w: jnp.zeros_like(w, jnp.float32), chunks)
    carry = dict(
        res=jnp.zeros((sched.res_slots + 1, saved_L) + x0.shape, act_dtype) + x0,
        grads=jnp.zeros((sched.grad_slots + 1,) + x0.shape, act_dtype) + x0,
        x_recv=x0, g_recv=x0,
        g_chunks=zeros_chunks,
        g_top=jax.tree.map(lambda w: jnp.zeros_like(w, jnp.float32), top),
        stats=None, ce=vary(jnp.zeros((), jnp.float32), (DP, PP)))
    forward_pairs = [(i, (i + 1) % pp) for i in range(pp if V > 1 else pp - 1)]
    backward_pairs = [(j, i) for i, j in forward_pairs]

    def tick(carry, row_S):
        op, m, v, res_slot, recv_x_slot, grad_slot, recv_grad_slot = (row_S[stage, i] for i in range(len(FIELDS)))
        c = v * pp + stage
        res = carry["res"].at[recv_x_slot, 0].set(carry["x_recv"])  # what the previous stage sent last tick
        grads = carry["grads"].at[recv_grad_slot].set(carry["g_recv"])  # what the next stage sent
        y, saved, stats_L, ce, gy, g_top_f = when(op == FORWARD, forward_op, res[res_slot, 0], m, v, c)
        gx, g_chunk, g_top_b = when(op == BACKWARD, backward_op, res[res_slot], grads[grad_slot], m, v, c)
        is_f, is_head = op == FORWARD, (op == FORWARD) & (c == C - 1)
        res = res.at[jnp.where(is_f, res_slot, sched.res_slots)].set(saved.astype(act_dtype))
        grads = grads.at[jnp.where(is_head, grad_slot, sched.grad_slots)].set(gy.astype(act_dtype))
        g_chunks = jax.tree.map(lambda acc, g: acc.at[v].add(g.astype(jnp.float32)), carry["g_chunks"], g_chunk)
        g_top = jax.tree.map(lambda acc, f, g: acc + f + g, carry["g_top"], g_top_f, g_top_b)
        stats = jax.tree.map(lambda acc, s: acc.at[v].add(s), carry["stats"], stats_L)
        if pp > 1:  # activations to the next stage, gradients to the previous one
            x_recv, g_recv = jax.lax.ppermute(y, PP, forward_pairs), jax.lax.ppermute(gx, PP, backward_pairs)
        else:
            x_recv, g_recv = y, gx
        return dict(res=res, grads=grads, x_recv=x_recv.astype(act_dtype), g_recv=g_recv.astype(act_dtype),
                    g_chunks=g_chunks, g_top=g_top, stats=stats, ce=carry["ce"] + ce), None

    table = jnp.asarray(sched.table)
    # MoE statistics per chunk and block [V, L]; their types come from one block.
    stats_aval = jax.eval_shape(lambda: run_chunk(jax.tree.map(lambda w: w[0], chunks), x0, 0, 0)[2])
    carry["stats"] = jax.tree.map(lambda z: jnp.stack([z] * V), zeros_of(stats_aval))
    for _ in range(3):  # settle the carry's types (which axes each buffer varies over)
        out = jax.eval_shape(lambda c: tick(c, table[0])[0], carry)
        carry = widen(carry, out)
    carry, _ = jax.lax.scan(tick, carry, table)

    g_blocks = from_chunks(carry["g_chunks"], PP)
    g_top_local = top_vjp(jax.tree.map(lambda g, w: g.astype(w.dtype), carry["g_top"], top))[0]
    grads = {**g_top_local, "blocks": jax.tree.map(lambda g, w: g.astype(w.dtype), g_blocks, params["blocks"])}
    stats_N = from_chunks(carry["stats"], PP)
    loss, metrics = loss_and_metrics(carry["ce"], stats_N)
    return (loss, metrics), grads
