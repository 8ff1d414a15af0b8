"""FSDP for the shard_map executors: the weights gathered for use, packed, prefetched.

Every weight is stored split over the axes that do not split it for compute (its FSDP
dim, parallel/weights.py). Before use its shards are cast to the compute dtype and
all-gathered (gather_for_use); autodiff turns that all-gather into a reduce-scatter of
the gradient. The top-level weights are gathered once per step (gather_top); a block's
weights just before the block runs, by the loop model.apply_blocks is given
(block_loop): gathered where used, or the next block fetched beside this one, packed
into one all-gather per group of axes (prefetching_loop), so the compiler can hide it
behind this block's matmuls.
"""

import functools
import math

import jax
import jax.numpy as jnp

from model import scan_blocks
from ops.collectives import live_axes, vary
from parallel.weights import is_trained, weight_layout, weight_name
from utils import AXES, CP, DP, PP, TP

# ----------------------------------------------------------------------------
# The gather and its transpose


def gather_for_use(params, expert_parallel, dtype, one_block=False, reduce_dtype=jnp.float32, whole_stack=False):
    """FSDP: cast local weights to the compute dtype and all-gather their storage-only
    split (the FSDP dim). Casting first halves the bytes sent in bfloat16. In the
    backward pass each all_gather becomes a reduce-scatter, written as an all-to-all and
    a local sum (scatter_by_all_to_all): every device gets its shard of the gradient
    summed over all devices that used the weight.

    Gradients are reduced in `reduce_dtype` (--model.grad_reduce_dtype, float32 by
    default): summing dp x tp bfloat16 partial gradients loses precision, and TPU and
    GPU, unlike XLA:CPU, reduce in the dtype they are given. So the reduce-scatter
    runs in reduce_dtype (gather_weight), weights replicated over an axis (norm
    scales) are typed as varying over it before the cast (the psum autodiff inserts
    for them then sums reduce_dtype values), and the top-level weights (one_block
    False: the tied embedding and the final norm, gathered once per step and used by
    every microbatch) come out in reduce_dtype, so that their gradient accumulates
    over the microbatches in it; their users cast them to the compute dtype.
    one_block: the weights of one block, sliced out of the stack (no N dim).
    whole_stack: the blocks' stacked weights [N, ...] all at once (executor_accumulate's
    gather once per step); they come out in reduce_dtype too, so that their gradient,
    summed over the microbatches, reaches the reduce-scatter unrounded."""
    fetched, unpack = fetch_for_use(params, expert_parallel, dtype, one_block, reduce_dtype, whole_stack)
    return unpack(fetched)


def fetch_for_use(params, expert_parallel, dtype, one_block=False, reduce_dtype=jnp.float32, whole_stack=False,
                  pack=False):
    """gather_for_use in two parts: (fetched, unpack), where `fetched` (arrays) holds what
    the collectives bring and unpack(fetched) is the local work after them, so that a
    loop can fetch the next block in one step and unpack it in the next
    (model.apply_blocks's prefetch): the gathers' results then have no user in the
    step that issues them. unpack serves every block of the same shapes.

    pack (one_block): the block's weights that gather over the same axes go as one
    buffer (gather_packed; its transpose reduces their gradients in one all-to-all).
    The compiled TPU schedule runs one collective of a loop's step beside its matmuls
    and the rest of them exposed (4 weights a layer, 1 of 4 hidden; packed, all:
    docs/parallelism.md, "what hides behind what")."""
    out_dtype = jnp.dtype(dtype) if one_block else jnp.promote_types(dtype, reduce_dtype)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    out, packs = [None] * len(leaves), {}
    for i, (path, w) in enumerate(leaves):
        if not is_trained(weight_name(path)):  # replicated, float32, no gradient: nothing to gather
            out[i] = w
            continue
        _, fsdp_axes, fsdp_dim = weight_layout(weight_name(path), one_block or whole_stack, expert_parallel)
        replicated = live_axes(tuple(a for a in AXES if a not in jax.typeof(w).manual_axis_type.varying))
        if replicated:  # (in the wider of the two: the forward values must not change)
            w = jax.lax.pcast(w.astype(jnp.promote_types(dtype, reduce_dtype)), replicated, to="varying")
        # Axes of size 1 hold the whole dim already; XLA:CPU would still run (and copy
        # through) an all_gather over them: 3 ms of a 200 ms one-device step (shakespeare).
        fsdp_axes = tuple(a for a in fsdp_axes if jax.lax.axis_size(a) > 1)
        if not fsdp_axes:
            out[i] = w.astype(dtype).astype(out_dtype)
        elif pack and one_block:  # (the stacked N dim is already sliced away)
            packs.setdefault(fsdp_axes, []).append((i, w, fsdp_dim - 1))
        else:  # (inside a block the stacked N dim is already sliced away)
            out[i] = gather_weight(w, fsdp_axes, fsdp_dim - one_block, jnp.dtype(dtype), jnp.dtype(reduce_dtype), out_dtype)
    layouts = [(axes, [(i, w.shape, dim) for i, w, dim in pack]) for axes, pack in packs.items()]
    packed = [gather_packed([w for _, w, _ in pack], axes, jnp.dtype(dtype), jnp.dtype(reduce_dtype))
              for axes, pack in packs.items()]

    def unpack(fetched):
        out, packed = list(fetched[0]), fetched[1]
        for (axes, items), buffer in zip(layouts, packed):
            wholes = unpack_packed(buffer, jax.lax.axis_size(axes), [(shape, dim) for _, shape, dim in items])
            for i, whole in zip((i for i, _, _ in items), wholes):
                out[i] = whole.astype(out_dtype)
        return jax.tree_util.tree_unflatten(treedef, out)
    return (out, packed), unpack


PACK_WIDTH = 1024  # gather_packed's rows: 2-D in the TPU's own tiling, so that no relayout copy follows the gather


def gather_packed(shards, axes, dtype, reduce_dtype):
    """One all-gather of several weights' shards over `axes`: each device's shards
    flattened into one buffer (in the wider of their dtypes and reduce_dtype, so that
    the gradient reaches them unrounded), padded to rows of PACK_WIDTH, gathered in
    `dtype`: [n R, PACK_WIDTH], device j's buffer in rows j R .. (j + 1) R - 1
    (unpack_packed cuts the weights out). Its transpose reduces every weight's
    gradient in one all-to-all (gather_weight's, in reduce_dtype)."""
    wide = functools.reduce(jnp.promote_types, [w.dtype for w in shards], jnp.dtype(reduce_dtype))
    flat = jnp.concatenate([w.astype(wide).reshape(-1) for w in shards])
    flat = jnp.pad(flat, (0, -flat.size % PACK_WIDTH))
    return gather_weight(flat.reshape(-1, PACK_WIDTH), axes, 0, dtype, reduce_dtype, dtype)


def unpack_packed(packed, n, shapes_and_dims):
    """The weights of gather_packed's buffer over n devices, each (shard shape, FSDP dim)
    cut out of every device's part and laid along its dim in device order, as a tiled
    all_gather of that weight lays it."""
    parts_nF, out, start = packed.reshape(n, -1), [], 0
    for shape, dim in shapes_and_dims:
        size = math.prod(shape)
        part = parts_nF[:, start:start + size].reshape((n,) + shape)
        start += size
        whole = jnp.moveaxis(part, 0, dim)  # [..., n, shard dim, ...]: device-major along dim
        out.append(whole.reshape(shape[:dim] + (n * shape[dim],) + shape[dim + 1:]))
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def gather_weight(w, axes, dim, dtype, reduce_dtype, out_dtype):
    """all_gather of w's shards over `axes` in the compute dtype (then out_dtype); its
    transpose, the reduce-scatter of the gradient (scatter_by_all_to_all), in reduce_dtype."""
    return jax.lax.all_gather(w.astype(dtype), axes, axis=dim, tiled=True).astype(out_dtype)


def _gather_weight_fwd(w, axes, dim, dtype, reduce_dtype, out_dtype):
    return gather_weight(w, axes, dim, dtype, reduce_dtype, out_dtype), jnp.zeros((0,), w.dtype)


def _gather_weight_bwd(axes, dim, dtype, reduce_dtype, out_dtype, like, g):
    g = scatter_by_all_to_all(g.astype(reduce_dtype), axes, scatter_dimension=dim)
    return (g.astype(like.dtype),)


def scatter_by_all_to_all(g, axes, scatter_dimension):
    """psum_scatter(g, axes, scatter_dimension, tiled=True), written as an all-to-all
    of g's n slices (each device receives its slice from every device) and their sum
    here. Same bytes on the wire as a ring reduce-scatter, (n - 1) / n of g; but libtpu
    lowers a reduce-scatter over a 3-D group of chips (dp 32 on a v4-64's 2x4x4, v4-32's
    2x2x4, v5p-128's 4x4x4) to an all-reduce and a slice, twice the bytes, and keeps an
    all-to-all as it is; and its schedule runs an all-to-all beside the backward's other
    matmuls, a reduce-scatter never (docs/parallelism.md, "what hides behind what")."""
    n, dim = jax.lax.axis_size(axes), scatter_dimension
    g_n = g.reshape(g.shape[:dim] + (n, g.shape[dim] // n) + g.shape[dim + 1:])
    return jnp.sum(jax.lax.all_to_all(g_n, axes, dim, dim, tiled=True), axis=dim)


gather_weight.defvjp(_gather_weight_fwd, _gather_weight_bwd)




# ----------------------------------------------------------------------------
# What the executors gather


def gather_top(params, cfg):
    """The weights outside the stacked blocks (embedding, dense prefix, final norm, MTP), gathered
    once per step (gather_for_use; they come out in the reduce dtype so their
    gradient accumulates over the microbatches in it). Only some stages use them
    (inside a cond): typed as varying over pp, their gradient is summed over the stages
    by this pcast's transpose, outside the cond, where every stage takes part (a psum
    inside a branch that only one stage takes never returns)."""
    m = cfg.model
    top = {k: v for k, v in params.items() if k != "blocks"}
    top = gather_for_use(top, cfg.mesh.expert_parallel, jnp.dtype(m.dtype), reduce_dtype=jnp.dtype(m.grad_reduce_dtype))
    return jax.tree.map(lambda w: vary(w, (PP,)), top)


def gather_block(block_params, cfg):
    """One block's weights (sliced out of the stack), gathered just before use."""
    fetched, unpack = fetch_block(block_params, cfg, pack=False)
    return unpack(fetched)


def fetch_block(block_params, cfg, pack=True):
    """gather_block in two parts, (fetched, unpack), by default the block's weights packed
    into one gather per group of axes (fetch_for_use): prefetching_loop's fetch."""
    m = cfg.model
    return fetch_for_use(block_params, cfg.mesh.expert_parallel, jnp.dtype(m.dtype), one_block=True,
                         reduce_dtype=jnp.dtype(m.grad_reduce_dtype), pack=pack)


def prefetches_gathers(cfg, passes):
    """Does block_loop gather block i + 1 beside block i (prefetching_loop)? Where a
    gather crosses devices (a block's weights are split over the axes of dp, cp and tp
    its compute does not use: one of size > 1), the loop over the blocks runs once for
    each microbatch (`passes`, the runs of that loop in the executor's loop: 1 for the
    accumulation executor and a one-tick GPipe; a pipeline's M + pp - 1 ticks, whose
    gathers JAX hoists out of them at remat none, keep gathering where used), and remat
    keeps each gathered block for the backward pass anyway (none, layer, stage)."""
    return (passes == 1 and cfg.model.remat in ("none", "layer", "stage")
            and any(jax.lax.axis_size(a) > 1 for a in (DP, CP, TP)))


# ----------------------------------------------------------------------------
# The loops over a stage's blocks (model.apply_blocks's `loop`): each block's weights
# gathered just before use, or the next block's fetched beside this one


def block_loop(cfg, passes, gather=None):
    """The loop model.apply_blocks runs a device's blocks with under the shard_map
    executors: prefetching where prefetches_gathers(cfg, passes), else each block
    gathered where it is used (`gather`, default gather_block)."""
    if prefetches_gathers(cfg, passes):
        return prefetching_loop(lambda w: fetch_block(w, cfg))
    return gathering_loop(gather or (lambda w: gather_block(w, cfg)))


def gathering_loop(gather):
    """model.apply_blocks's loop with each block's weights made ready just before use
    (gather: FSDP's all-gather and cast, or parallel/auto.py's layout constraint), inside
    the block's remat, so that under remat block the backward pass gathers again."""
    def loop(run_block, block_state, x_BTD, remat, unroll):
        def gathered_run(x_BTD, state, index):
            if remat in ("block", "block_dots"):
                # Tie the weights to this block's input, so that the gather stays in the loop
                # and the backward pass regathers each block: else JAX hoists every block's
                # gather out of the loop (they depend only on loop-invariant weights) and keeps
                # them all. Without remat, hoisting is what we want: one gather, not one per tick.
                state = jax.lax.optimization_barrier((state, x_BTD))[0]
            return run_block(x_BTD, gather(state), index)
        return scan_blocks(gathered_run, block_state, x_BTD, remat, unroll)
    return loop


def prefetching_loop(fetch):
    """model.apply_blocks's loop with block i + 1's weights fetched beside block i, so that
    its all-gather runs under block i's matmuls (and, in the backward pass, each block's
    gradient reduction under the next one's). fetch(weights) -> (fetched arrays, unpack),
    as fetch_block. A scan whose carry holds the next block's fetched arrays, unpacked
    where they are used; the last step fetches block 0 again, unused (a block's gather
    and a zero gradient's reduction more per pass; peeling the last block out of the loop
    instead held twice the temporaries: docs/parallelism.md). For remat none, layer and
    stage, under which each gathered block is kept for the backward pass anyway."""
    def fetch_beside(state, x_BTD):
        # Tied to the running block's input: else the compiler splits the loop in two, the
        # fetches alone in the first (nothing to run beside) and the blocks in the second.
        # (Tied the same way before the loop too, so that the carry keeps its types.)
        return fetch(jax.lax.optimization_barrier((state, x_BTD))[0])

    def loop(run_block, block_state, x_BTD, remat, unroll):
        assert remat in ("none", "layer", "stage"), remat  # (remat block would keep every carried block for its backward)
        n_blocks = jax.tree.leaves(block_state)[0].shape[0]
        fetched, unpack = fetch_beside(jax.tree.map(lambda w: w[0], block_state), x_BTD)

        def body(carry, next_state_and_index):
            x_BTD, fetched = carry
            next_state, index = next_state_and_index
            next_fetched, _ = fetch_beside(next_state, x_BTD)
            x_BTD, stats = run_block(x_BTD, unpack(fetched), index)
            return (x_BTD, next_fetched), stats

        next_states = jax.tree.map(lambda w: jnp.roll(w, -1, axis=0), block_state)  # step i fetches block i + 1 (mod N)
        (x_BTD, _), stats_N = jax.lax.scan(body, (x_BTD, fetched), (next_states, jnp.arange(n_blocks)),
                                           unroll=n_blocks if unroll else 1)
        return x_BTD, stats_N
    return loop
