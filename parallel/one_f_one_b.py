"""The 1f1b, interleaved, zb1 and zbv executor (--train.pipeline 1f1b | interleaved | zb1 | zbv): (loss,
metrics, grads) by running a schedule table tick by tick, with the backward written by
hand, inside the shard_map step.

parallel/schedules.py builds the table; here one lax.scan runs its ticks, one lax.cond per
tick on the stage's op. A forward tick runs each block of its chunk under jax.vjp and
stashes the residuals that depend on the block's input; the backward tick runs only the
vjp from them (Megatron's 1F1B: no recompute, memory of the microbatches in flight). The
remat policy says what the stash holds: none, everything; block, each block's input;
block_dots, the matmul outputs; layer, each layer's input; stage, the chunk's input (the
chunk recomputed). The loss's derivatives come from step_core.sum_cotangents, so the
gradients equal GPipe's autodiff. Stage 0's first chunk starts with the embedding and
dense prefix; its backward tick recomputes them (embed, embed_backward).

Rings of R slots (R: most microbatches in flight on a stage, pp for 1f1b) keep what a
backward tick needs: the chunk's input [R + 1, b, T, D] (one trash slot) and each stash
leaf [R, L, ...].

zb1: the backward is two ops. B runs each block's vjp from the stash for the input
gradient alone and keeps each block's output gradient in a ring [R, L, b, T, D]; W, a
later tick, runs the same vjp for the weights alone (jit drops the matmuls the unused
half needs; W gathers the block's weights again under FSDP).

Interleaved: storage keeps each stage's blocks contiguous, so init, checkpoints, eval and
the planner do not depend on the schedule; the step moves chunk c to stage c % pp by
ppermute, and its gradient back. zbv: zb1's B and W over two chunks per stage in a V
(schedules.chunk_of), placed the same way; the second chunks' activations travel up the
stages on ppermutes of their own (send).
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.extend.core import Literal

from model import fold_in_rows, remat_block
from ops.collectives import axis_index, vary, widen, zeros_of
from parallel import fsdp
from parallel import step_core as core
from parallel.schedules import BACKWARD, FIELDS, FORWARD, WEIGHT, chunk_of, chunks_per_stage, place_of, schedule
from utils import PP, TP

MANUAL = True  # runs inside jax.shard_map: every collective written out


def value_and_grad(params, tokens_bT1, graphdef, cfg, rng):
    """((loss, metrics), grads) of one step, the same numbers autodiff of
    gpipe.loss gives."""
    return ScheduledStep(params, tokens_bT1, graphdef, cfg, rng).run()


# ---- Interleaved: which device holds which blocks


def move_chunks(tree_VL, source_of, axis):
    """Chunks permuted between devices: output chunk u of device d is chunk w of device
    source_of(d, u) = (device, w). Leaves [V, L, ...]; at most V*V ppermutes."""
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


def to_chunks(tree_N, V, axis, kind="interleaved"):
    """Local storage [V L, ...] (stage s's contiguous blocks: global chunks V s, ...,
    V s + V - 1) -> the chunks stage s runs [V, L, ...]: its v-th chunk is global chunk
    chunk_of(kind, pp, s, v) (v pp + s; under zbv s, then 2 pp - 1 - s)."""
    pp = jax.lax.axis_size(axis)
    tree = jax.tree.map(lambda x: x.reshape(V, x.shape[0] // V, *x.shape[1:]), tree_N)
    if V == 1 or pp == 1:
        return tree
    return move_chunks(tree, lambda d, v: divmod(chunk_of(kind, pp, d, v), V), axis)


def from_chunks(tree_VL, axis, kind="interleaved"):
    """The inverse of to_chunks: [V, L, ...] chunks back to storage order [V L, ...]."""
    pp = jax.lax.axis_size(axis)
    V = jax.tree.leaves(tree_VL)[0].shape[0]
    if V > 1 and pp > 1:
        tree_VL = move_chunks(tree_VL, lambda d, u: place_of(kind, pp, d * V + u), axis)
    return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), tree_VL)


# ---- The executor


class ScheduledStep:
    """One step's forward and backward ops, and the loop over the table's ticks."""

    def __init__(self, params, tokens_bT1, graphdef, cfg, rng):
        m_cfg, t_cfg = cfg.model, cfg.train
        self.cfg, self.params, self.graphdef = cfg, params, graphdef
        self.M = t_cfg.microbatches
        self.kind = t_cfg.pipeline
        self.V = chunks_per_stage(self.kind, t_cfg.virtual_stages)
        self.split = self.kind in ("zb1", "zbv")  # the backward in two ops, B and W
        self.pp, self.stage = jax.lax.axis_size(PP), axis_index(PP)
        self.sched = schedule(t_cfg.pipeline, self.pp, self.M, self.V)
        self.C = self.pp * self.V
        self.axes = core.layer_axes(cfg)
        self.remat = m_cfg.remat
        self.mb = core.split_microbatches(tokens_bT1, cfg, rng, first_row=core.first_row(tokens_bT1.shape[0]))
        self.cot = core.sum_cotangents(cfg, jax.lax.axis_size(TP))
        # Top-level weights gathered once per step; their float32 gradient reduce-scattered once at the end.
        top_local = {k: v for k, v in params.items() if k != "blocks"}
        self.top, self.top_vjp = jax.vjp(lambda t: fsdp.gather_top(t, cfg), top_local)
        self.chunks = to_chunks(params["blocks"], self.V, PP, self.kind)  # [V, L, ...]: this stage's chunks
        self.L = jax.tree.leaves(self.chunks)[0].shape[1]
        self.block_def = nnx.split(self.model_with(self.top).blocks)[0]
        self._x_dependent = None  # depends_on_x's answer, once traced

    def model_with(self, top):
        return nnx.merge(self.graphdef, {**top, "blocks": self.params["blocks"]})

    # --- blocks and chunks ---------------------------------------------------

    def keys(self, m):
        """Microbatch m's dropout keys [b], or None."""
        return None if self.mb.keys_Mb is None else self.mb.keys_Mb[m]

    def block_keys(self, m, n):
        """Block n's dropout keys on microbatch m, as model.apply_blocks folds them."""
        return None if self.mb.keys_Mb is None else fold_in_rows(self.mb.keys_Mb[m], n)

    def block(self, state, x_bTD, m, n):
        """Block n (global index) on microbatch m: (x, MoE stats)."""
        # Tied to this block's input, the gather stays in the loop (fsdp.gathering_loop).
        state = jax.lax.optimization_barrier((state, x_bTD))[0]
        block_rng = self.block_keys(m, n)
        block = nnx.merge(self.block_def, fsdp.gather_block(state, self.cfg))
        return block(x_bTD, self.mb.angles_of(m), self.axes, block_rng, remat_layers=self.remat == "layer")

    def run_chunk(self, chunk, x_bTD, m, c):
        """Forward through chunk c's L blocks: (y, every block's input [L, ...], stats [L])."""
        def body(x, state_and_j):
            state, j = state_and_j
            y, stats = self.block(state, x, m, c * self.L + j)
            return y, (x, stats)
        y, (xs_LbTD, stats_L) = jax.lax.scan(body, x_bTD, (chunk, jnp.arange(self.L)),
                                             unroll=self.L if self.cfg.model.unroll_blocks else 1)
        return y, xs_LbTD, stats_L

    def balance_cotangents(self, sums):
        return (jnp.full_like(sums[0], self.cot["aux"]), jnp.full_like(sums[1], self.cot["seq_aux"]))

    # --- the stash: what a block's backward needs, kept from its forward ----

    def block_fn(self, m, n):
        """Block n on microbatch m as a function (gathered weights, input) -> ((y, balance-loss
        sums), MoE stats), under the remat policy, which decides what its vjp keeps."""
        block_rng = self.block_keys(m, n)

        def f(w, x_bTD):
            y, stats = nnx.merge(self.block_def, w)(x_bTD, self.mb.angles_of(m), self.axes, block_rng,
                                                    remat_layers=self.remat == "layer")
            return (y, core.balance_sums(stats)), stats
        return remat_block(f, self.remat)

    def gathered(self, state, tie):
        """A block's weights gathered for use, tied to `tie` (its input, or its output's
        gradient) so the gather stays in the loop."""
        return fsdp.gather_block(jax.lax.optimization_barrier((state, tie))[0], self.cfg)

    def depends_on_x(self, w, x_bTD, m, n):
        """Which leaves of a block's vjp depend on its input (traced once): those are
        stashed; the rest (the weights as the matmuls use them, dropout masks, RoPE
        tables) are made again from the weights and keys in the backward tick."""
        if self._x_dependent is None:
            def leaves(w, x, m, n):
                return jax.tree.leaves(jax.vjp(self.block_fn(m, n), w, x, has_aux=True)[1])
            self._x_dependent = depends_on(jax.make_jaxpr(leaves)(w, x_bTD, m, n).jaxpr, len(jax.tree.leaves(w)))
        return self._x_dependent

    def stash_block(self, state, x_bTD, m, n):
        """Forward of block n, keeping its residuals: (y, stats, the stash)."""
        w = self.gathered(state, x_bTD)
        (y, _), vjp, stats = jax.vjp(self.block_fn(m, n), w, x_bTD, has_aux=True)
        stash = [leaf for leaf, dep in zip(jax.tree.leaves(vjp), self.depends_on_x(w, x_bTD, m, n)) if dep]
        return y, stats, stash

    def unstash_block(self, state, stash, gy, m, n, wrt="both"):
        """Backward of block n from its stash: (gradient of its input, of its weights).
        The vjp's other leaves come from a forward on zeros whose x-dependent part
        nothing reads (jit's dead-code elimination drops it: no matmul runs again).
        wrt "input" or "weights" (zb1's B and W): the other is None, and the matmuls
        only it needs are dropped the same way."""
        w, gather_vjp = jax.vjp(lambda s: self.gathered(s, gy), state)
        (_, sums), vjp, _ = jax.vjp(self.block_fn(m, n), w, jnp.zeros_like(gy), has_aux=True)
        leaves, treedef = jax.tree.flatten(vjp)
        stashed = iter(stash)
        vjp = jax.tree.unflatten(treedef, [next(stashed) if dep else leaf
                                           for leaf, dep in zip(leaves, self.depends_on_x(w, gy, m, n))])
        g_w, gx = vjp((gy, self.balance_cotangents(sums)))
        return (None if wrt == "weights" else gx), (None if wrt == "input" else gather_vjp(g_w)[0])

    def run_chunk_stashing(self, chunk, x_bTD, m, c):
        """Forward through chunk c's L blocks: (y, every block's stash [L, ...], stats [L])."""
        def body(x, state_and_j):
            state, j = state_and_j
            y, stats, stash = self.stash_block(state, x, m, c * self.L + j)
            return y, (stash, stats)
        y, (stash_L, stats_L) = jax.lax.scan(body, x_bTD, (chunk, jnp.arange(self.L)),
                                             unroll=self.L if self.cfg.model.unroll_blocks else 1)
        return y, stash_L, stats_L

    def backward_chunk(self, chunk, xs_LbTD, stash_L, gy, m, c):
        """Hand-written backward of chunk c: (gradient of its input, of its weights)."""
        if self.remat != "stage":  # from the stash: only the backward runs
            def body(g, state_stash_j):
                state, stash, j = state_stash_j
                return self.unstash_block(state, stash, g, m, c * self.L + j)
            return jax.lax.scan(body, gy, (chunk, stash_L, jnp.arange(self.L)), reverse=True,
                                unroll=self.L if self.cfg.model.unroll_blocks else 1)
        if self.remat == "stage":  # recompute the whole chunk from its input, then its vjp
            def f(chunk, x):
                y, _, stats = self.run_chunk(chunk, x, m, c)
                return y, core.balance_sums(stats)
            (_, sums), vjp = jax.vjp(f, chunk, xs_LbTD[0])
            g_chunk, gx = vjp((gy, self.balance_cotangents(sums)))
            return gx, g_chunk

    # --- zb1: the backward in two halves, B (input gradient) then W (weights) ---

    def chunk_stash(self, chunk, x_bTD, stash_L, m, c):
        """The chunk's stash: as kept by its forward, or under remat stage made again
        from its input (a forward of the chunk, in B and again in W)."""
        if self.remat != "stage":
            return stash_L
        return self.run_chunk_stashing(chunk, x_bTD, m, c)[1]

    def input_backward_chunk(self, chunk, x_bTD, stash_L, gy, m, c):
        """B: (gradient of the chunk's input, each block's output gradient [L, ...] for W)."""
        stash_L = self.chunk_stash(chunk, x_bTD, stash_L, m, c)

        def body(g, state_stash_j):
            state, stash, j = state_stash_j
            return self.unstash_block(state, stash, g, m, c * self.L + j, wrt="input")[0], g
        return jax.lax.scan(body, gy, (chunk, stash_L, jnp.arange(self.L)), reverse=True,
                            unroll=self.L if self.cfg.model.unroll_blocks else 1)

    def weight_backward_chunk(self, chunk, x_bTD, stash_L, gys_LbTD, m, c):
        """W: the gradient of the chunk's weights, from the stash and B's output gradients."""
        stash_L = self.chunk_stash(chunk, x_bTD, stash_L, m, c)

        def body(_, state_stash_gy_j):
            state, stash, gy, j = state_stash_gy_j
            return None, self.unstash_block(state, stash, gy, m, c * self.L + j, wrt="weights")[1]
        return jax.lax.scan(body, None, (chunk, stash_L, gys_LbTD, jnp.arange(self.L)),
                            unroll=self.L if self.cfg.model.unroll_blocks else 1)[1]

    # --- the two ops --------------------------------------------------------

    def embed(self, top, m):
        """Microbatch m embedded and through the dense prefix: what the first chunk starts from."""
        return self.model_with(top).embed_and_prefix(self.mb.tokens_MbT1[m], self.mb.angles_of(m), self.axes, self.keys(m))

    def head_sums(self, top, y_bTD, m):
        """(summed cross-entropy, summed MTP cross-entropy) of microbatch m's output."""
        return self.model_with(top).head_sums(y_bTD, self.mb.tokens_MbT1[m], self.mb.angles_of(m), self.axes, self.keys(m))

    def forward_op(self, x_saved, m, v, c):
        """F: (output to send, the chunk's input, its blocks' stash, stats, (ce, mtp), gradient of the output, of top)."""
        top = self.top
        x = jax.lax.cond(c == 0, lambda: vary(self.embed(top, m).astype(x_saved.dtype), tuple(jax.typeof(x_saved).manual_axis_type.varying)),
                         lambda: x_saved)  # the embedding and prefix, on the first chunk of stage 0 only
        chunk = jax.tree.map(lambda w: w[v], self.chunks)
        if self.remat == "stage":  # keep only the chunk's input
            y, _, stats_L = self.run_chunk(chunk, x, m, c)
            stash_L = []
        else:
            y, stash_L, stats_L = self.run_chunk_stashing(chunk, x, m, c)

        def head(y):  # the head and loss, on the last chunk of the last stage only
            sums, vjp = jax.vjp(lambda t, y: self.head_sums(t, y, m), top, y)
            g_top, gy = vjp((jnp.full_like(sums[0], self.cot["ce"]), jnp.full_like(sums[1], self.cot["mtp"])))
            return sums, gy, jax.tree.map(lambda g: g.astype(jnp.float32), g_top)

        sums, gy, g_top = core.when(c == self.C - 1, head, y)
        return y, x, stash_L, stats_L, sums, gy, g_top

    def backward_op(self, x_bTD, stash_L, gy, m, v, c):
        """B: (gradient to send, of the chunk's weights, of top, each block's output
        gradient). Under zb1 the chunk's weights get theirs in W (zeros here)."""
        chunk = jax.tree.map(lambda w: w[v], self.chunks)
        if self.split:
            gx, gys_L = self.input_backward_chunk(chunk, x_bTD, stash_L, gy, m, c)
            g_chunk = jax.tree.map(jnp.zeros_like, chunk)
        else:
            gx, g_chunk = self.backward_chunk(chunk, x_bTD[None], stash_L, gy, m, c)
            gys_L = None
        return gx, g_chunk, self.embed_backward_on_first(gx, m, c), gys_L

    def weight_op(self, x_bTD, stash_L, gys_LbTD, m, v, c):
        """W (zb1): the gradient of the chunk's weights."""
        chunk = jax.tree.map(lambda w: w[v], self.chunks)
        return self.weight_backward_chunk(chunk, x_bTD, stash_L, gys_LbTD, m, c)

    def embed_backward_on_first(self, gx, m, c):
        """The embedding's and prefix's gradient, on the first chunk of stage 0 only (zeros elsewhere)."""
        top = self.top

        def embed_backward(gx):  # (recomputing the prefix, as a backward tick does a chunk)
            x_bTD, vjp = jax.vjp(lambda t: self.embed(t, m), top)
            return jax.tree.map(lambda g: g.astype(jnp.float32), vjp(gx.astype(x_bTD.dtype))[0])
        return core.when(c == 0, embed_backward, gx)

    # --- the loop -----------------------------------------------------------

    def initial_carry(self):
        """Buffers. Activations vary over (slice, dp) (rows), cp (sequence chunks) and pp
        (stages); each ring has one trash slot at the end for writes with nothing to write."""
        m_cfg, sched = self.cfg.model, self.sched
        b, T = self.mb.tokens_MbT1.shape[1], self.mb.local_len
        act_dtype = jnp.dtype(m_cfg.dtype)
        x0 = vary(jnp.zeros((b, T, m_cfg.d_model), act_dtype), core.TOKEN_AXES + (PP,))
        zero_sum = vary(jnp.zeros((), jnp.float32), core.TOKEN_AXES + (PP,))
        # MoE statistics per chunk and block [V, L]; their types come from one block.
        stats_aval = jax.eval_shape(lambda: self.run_chunk(jax.tree.map(lambda w: w[0], self.chunks), x0, 0, 0)[2])
        # The stash: per slot, every leaf of the chunk's blocks' residuals [L, ...].
        stash_avals = [] if self.remat == "stage" else jax.eval_shape(
            lambda: self.run_chunk_stashing(jax.tree.map(lambda w: w[0], self.chunks), x0, 0, 0)[1])
        return dict(
            res=jnp.zeros((sched.res_slots + 1,) + x0.shape, act_dtype) + x0,
            stash=[jnp.stack([z] * sched.res_slots) for z in zeros_of(stash_avals)],  # (no trash slot: see tick)
            grads=jnp.zeros((sched.grad_slots + 1,) + x0.shape, act_dtype) + x0,
            x_recv=x0, g_recv=x0, **(dict(x_recv_1=x0, g_recv_1=x0) if self.kind == "zbv" else {}),
            g_chunks=jax.tree.map(lambda w: jnp.zeros_like(w, jnp.float32), self.chunks),
            g_top=jax.tree.map(lambda w: jnp.zeros_like(w, jnp.float32), self.top),
            stats=jax.tree.map(lambda z: jnp.stack([z] * self.V), core.empty_stats(stats_aval)),
            ce=zero_sum, mtp=zero_sum,
            # zb1: each block's output gradient, from B until W (slots as the stash's)
            gys=jnp.zeros((sched.res_slots, self.L) + x0.shape, act_dtype) + x0 if self.split else None)

    def tick(self, carry, row_S):
        pp, sched = self.pp, self.sched
        op, m, v, res_slot, recv_x_slot, grad_slot, recv_grad_slot, recv_x_slot_1, recv_grad_slot_1 = (
            row_S[self.stage, i] for i in range(len(FIELDS)))
        c = chunk_of(self.kind, pp, self.stage, v)  # the global chunk
        act_dtype = jnp.dtype(self.cfg.model.dtype)
        res = carry["res"].at[recv_x_slot].set(carry["x_recv"])  # what the previous stage sent last tick
        grads = carry["grads"].at[recv_grad_slot].set(carry["g_recv"])  # what the next stage sent
        if self.kind == "zbv":  # and what came for the second chunk, on the V's way back up
            res = res.at[recv_x_slot_1].set(carry["x_recv_1"])
            grads = grads.at[recv_grad_slot_1].set(carry["g_recv_1"])
        # (named_op: planning/hlo_reader.dot_flops(hlo, "forward_op") counts one op's matmuls)
        y, x_in, stash_L, stats_L, (ce, mtp), gy, g_top_f = core.when(op == FORWARD, named_op(self.forward_op), res[res_slot], m, v, c)
        stash_slot = jnp.minimum(res_slot, sched.res_slots - 1)  # (the stash ring has no trash slot)
        stash_in = [buf[stash_slot] for buf in carry["stash"]]
        gx, g_chunk, g_top_b, gys_L = core.when(op == BACKWARD, named_op(self.backward_op), res[res_slot],
                                                stash_in, grads[grad_slot], m, v, c)
        gys = carry["gys"]
        if self.split:  # W: the weight half of a backward that B ran earlier
            g_chunk_w = core.when(op == WEIGHT, named_op(self.weight_op), res[res_slot], stash_in, gys[stash_slot], m, v, c)
            g_chunk = jax.tree.map(jnp.add, g_chunk, g_chunk_w)
            gys = gys.at[stash_slot].set(jnp.where(op == BACKWARD, gys_L.astype(act_dtype), gys[stash_slot]))
        is_f, is_head = op == FORWARD, (op == FORWARD) & (c == self.C - 1)
        write = jnp.where(is_f, res_slot, sched.res_slots)
        res = res.at[write].set(x_in.astype(act_dtype))  # (the embedding's output, on chunk 0: kept for remat stage)
        # No trash slot (as big as a microbatch's activations): a non-forward tick writes the slot back.
        stash = [buf.at[stash_slot].set(jnp.where(is_f, leaf.astype(buf.dtype), buf[stash_slot]))
                 for buf, leaf in zip(carry["stash"], stash_L)]
        grads = grads.at[jnp.where(is_head, grad_slot, sched.grad_slots)].set(gy.astype(act_dtype))
        g_chunks = jax.tree.map(lambda acc, g: acc.at[v].add(g.astype(jnp.float32)), carry["g_chunks"], g_chunk)
        g_top = jax.tree.map(lambda acc, f, g: acc + f + g, carry["g_top"], g_top_f, g_top_b)
        stats = core.add_stats_at(carry["stats"], stats_L, v, is_f)  # (no forward: its zeros add nothing)
        sent = {k: x.astype(act_dtype) for k, x in self.send(y, gx).items()}
        return dict(res=res, stash=stash, grads=grads, **sent,
                    g_chunks=g_chunks, g_top=g_top, stats=stats, ce=carry["ce"] + ce, mtp=carry["mtp"] + mtp, gys=gys), None

    def send(self, y, gx):
        """The tick's output activation to the next chunk's stage, its input gradient to the
        previous chunk's: x_recv and g_recv (a ring down the stages, or a line), under zbv
        also x_recv_1 and g_recv_1 for the second chunks (the V: chunk 0 goes down, chunk 1
        comes up, the last stage hands its own chunk 0's output to its chunk 1). Every
        stage sends on every channel; the table says which arrivals are kept."""
        pp = self.pp
        if pp == 1:
            return dict(x_recv=y, g_recv=gx) if self.kind != "zbv" else dict(x_recv=y, g_recv=gx, x_recv_1=y, g_recv_1=gx)
        down = [(i, (i + 1) % pp) for i in range(pp if self.V > 1 and self.kind != "zbv" else pp - 1)]
        up = [(j, i) for i, j in down]
        sent = dict(x_recv=jax.lax.ppermute(y, PP, down), g_recv=jax.lax.ppermute(gx, PP, up))
        if self.kind == "zbv":
            last = self.stage == pp - 1
            sent = dict(x_recv=sent["x_recv"], g_recv=jnp.where(last, gx, sent["g_recv"]),
                        x_recv_1=jnp.where(last, y, jax.lax.ppermute(y, PP, up)), g_recv_1=jax.lax.ppermute(gx, PP, down))
        return sent

    def run(self):
        table = jnp.asarray(self.sched.table)
        carry = self.initial_carry()
        for _ in range(3):  # settle the carry's types (which axes each buffer varies over)
            out = jax.eval_shape(lambda c: self.tick(c, table[0])[0], carry)
            carry = widen(carry, out)
        carry, _ = jax.lax.scan(self.tick, carry, table)

        g_blocks = from_chunks(carry["g_chunks"], PP, self.kind)
        g_top_local = self.top_vjp(jax.tree.map(lambda g, w: g.astype(w.dtype), carry["g_top"], self.top))[0]
        grads = {**g_top_local, "blocks": jax.tree.map(lambda g, w: g.astype(w.dtype), g_blocks, self.params["blocks"])}
        stats_N = from_chunks(carry["stats"], PP, self.kind)
        return core.loss_and_metrics(carry["ce"], stats_N, self.cfg, carry["mtp"]), grads


def depends_on(jaxpr, n_weights):
    """Which outputs of jaxpr(weights..., x, ...) depend on x (its input n_weights):
    a walk over its equations; an equation with such an input taints all its outputs
    (inside loops and conds too, which can only stash more, never less)."""
    tainted = {jaxpr.invars[n_weights]}
    for eqn in jaxpr.eqns:
        if any(not isinstance(v, Literal) and v in tainted for v in eqn.invars):
            tainted.update(eqn.outvars)
    return [not isinstance(v, Literal) and v in tainted for v in jaxpr.outvars]


def named_op(method):
    """method, its ops under jax.named_scope(its name) (in the HLO's op_name metadata)."""
    def run(*args):
        with jax.named_scope(method.__name__):
            return method(*args)
    return run
