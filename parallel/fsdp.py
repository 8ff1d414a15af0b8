"""FSDP for the shard_map executors: the weights gathered for use, packed, prefetched.

Each weight is stored split over the axes that do not split it for compute (its FSDP dim, parallel/weights.py); before
use its shards are cast to the compute dtype and all-gathered (gather_for_use), whose transpose reduce-scatters the
gradient. Top-level weights are gathered once per step (gather_top); a block's just before it runs, by the loop given
to model.apply_blocks (block_loop): where used, or fetched beside the previous block in one packed all-gather per
group of axes (prefetching_loop), to hide behind its matmuls.
"""

import functools
import math

import jax
import jax.numpy as jnp

from model import scan_blocks
from ops.collectives import live_axes, vary
from parallel.weights import is_trained, weight_layout, weight_name
from utils import AXES, CP, DP, PP, TP

# ---- The gather and its transpose


def gather_for_use(params, expert_parallel, dtype, one_block=False, reduce_dtype=jnp.float32, whole_stack=False):
    """Local weights cast to the compute `dtype` (first: half the bytes in bfloat16) with their FSDP dim all-gathered.
    The backward reduce-scatters each gradient (scatter_by_all_to_all) to the shard's owner, summed over every device
    that used it.

    Gradients are reduced in `reduce_dtype` (--model.grad_reduce_dtype): TPU and GPU, unlike XLA:CPU, sum bfloat16
    partial gradients in bfloat16. So weights replicated over an axis (norm scales) are typed as varying over it
    before the cast (autodiff's psum then sums reduce_dtype values), and all but one_block weights come out in the
    wider of dtype and reduce_dtype (users cast them), their gradient summed over microbatches unrounded. one_block:
    one block's weights, sliced out of the stack (no N dim). whole_stack: all blocks' stacked weights [N, ...] at once
    (parallel/accumulate.py)."""
    fetched, unpack = fetch_for_use(params, expert_parallel, dtype, one_block, reduce_dtype, whole_stack)
    return unpack(fetched)


def fetch_for_use(params, expert_parallel, dtype, one_block=False, reduce_dtype=jnp.float32, whole_stack=False,
                  pack=False):
    """gather_for_use in two parts, (fetched, unpack): `fetched` (arrays) is what the collectives bring,
    unpack(fetched) the local work after them, so a loop can fetch the next block in one step and unpack it in the
    next. unpack serves every block of the same shapes. pack (one_block): weights gathered over the same axes go as
    one buffer (gather_packed), since the TPU schedule hides one collective per loop step (docs/parallelism.md)."""
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
        # Size-1 axes hold the whole dim; XLA:CPU would still run (and copy through) an all_gather.
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
    """One all-gather in `dtype` of several weights' shards over `axes`: [n R, PACK_WIDTH],
    device j's shards flattened (in the widest of their dtypes and reduce_dtype) in rows
    j R .. (j + 1) R - 1 (unpack_packed cuts them out). Its transpose: one all-to-all."""
    wide = functools.reduce(jnp.promote_types, [w.dtype for w in shards], jnp.dtype(reduce_dtype))
    flat = jnp.concatenate([w.astype(wide).reshape(-1) for w in shards])
    flat = jnp.pad(flat, (0, -flat.size % PACK_WIDTH))
    return gather_weight(flat.reshape(-1, PACK_WIDTH), axes, 0, dtype, reduce_dtype, dtype)


def unpack_packed(packed, n, shapes_and_dims):
    """The whole weights in gather_packed's buffer over n devices, each (shard shape, FSDP
    dim) laid out as a tiled all_gather would."""
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
    """psum_scatter(g, axes, scatter_dimension, tiled=True) as an all-to-all of g's n slices and a local sum, the same
    bytes as a ring reduce-scatter: libtpu keeps an all-to-all and runs it beside matmuls, but lowers a reduce-scatter
    over a 3-D chip group to an all-reduce (twice the bytes) and never overlaps it (docs/parallelism.md)."""
    n, dim = jax.lax.axis_size(axes), scatter_dimension
    g_n = g.reshape(g.shape[:dim] + (n, g.shape[dim] // n) + g.shape[dim + 1:])
    return jnp.sum(jax.lax.all_to_all(g_n, axes, dim, dim, tiled=True), axis=dim)


gather_weight.defvjp(_gather_weight_fwd, _gather_weight_bwd)


# ---- What the executors gather


def gather_top(params, cfg):
    """The weights outside the blocks (embedding, dense prefix, final norm, MTP), gathered once per step in the reduce
    dtype, typed as varying over pp: only some stages use them (inside a cond), and a psum there would hang, so the
    pcast's transpose sums their gradient over the stages outside it."""
    m = cfg.model
    top = {k: v for k, v in params.items() if k != "blocks"}
    top = gather_for_use(top, cfg.mesh.expert_parallel, jnp.dtype(m.dtype), reduce_dtype=jnp.dtype(m.grad_reduce_dtype))
    return jax.tree.map(lambda w: vary(w, (PP,)), top)


def gather_block(block_params, cfg):
    """One block's weights (sliced out of the stack), gathered just before use."""
    fetched, unpack = fetch_block(block_params, cfg, pack=False)
    return unpack(fetched)


def fetch_block(block_params, cfg, pack=True):
    """gather_block as fetch_for_use's (fetched, unpack), packed by default: prefetching_loop's fetch."""
    m = cfg.model
    return fetch_for_use(block_params, cfg.mesh.expert_parallel, jnp.dtype(m.dtype), one_block=True,
                         reduce_dtype=jnp.dtype(m.grad_reduce_dtype), pack=pack)


def prefetches_gathers(cfg, passes):
    """Does block_loop fetch block i + 1 beside block i (prefetching_loop)? Yes where a gather crosses devices (dp, cp
    or tp > 1), the block loop runs once per microbatch (`passes` == 1: accumulation, one-tick GPipe; a pipeline's
    ticks keep gathering where used) and remat keeps each gathered block for the backward anyway (none, layer, stage)."""
    return (passes == 1 and cfg.model.remat in ("none", "layer", "stage")
            and any(jax.lax.axis_size(a) > 1 for a in (DP, CP, TP)))


# ---- The loops over a stage's blocks (model.apply_blocks's `loop`)


def block_loop(cfg, passes, gather=None):
    """The shard_map executors' block loop: prefetching where prefetches_gathers(cfg,
    passes), else each block gathered where used (`gather`, default gather_block)."""
    if prefetches_gathers(cfg, passes):
        return prefetching_loop(lambda w: fetch_block(w, cfg))
    return gathering_loop(gather or (lambda w: gather_block(w, cfg)))


def gathering_loop(gather):
    """A block loop that readies each block's weights just before use (gather: FSDP's
    all-gather, or parallel/auto.py's constraint), inside remat, so remat block regathers."""
    def loop(run_block, block_state, x_BTD, remat, unroll):
        def gathered_run(x_BTD, state, index):
            if remat in ("block", "block_dots"):
                # Tied to the input, the gather stays in the loop: else JAX hoists every block's
                # gather out of it and keeps them all (wanted without remat: one gather, not per tick).
                state = jax.lax.optimization_barrier((state, x_BTD))[0]
            return run_block(x_BTD, gather(state), index)
        return scan_blocks(gathered_run, block_state, x_BTD, remat, unroll)
    return loop


def prefetching_loop(fetch):
    """A block loop that fetches block i + 1 beside block i, its all-gather under block i's
    matmuls (and each gradient reduction under the next block's backward). fetch(weights)
    -> (fetched arrays, unpack), as fetch_block. The last step fetches block 0 again,
    unused, so every step is alike (docs/parallelism.md). For remat none, layer, stage."""
    def fetch_beside(state, x_BTD):
        # Tied to the running block's input, else the compiler splits the loop in two, the
        # fetches alone in the first. (Also before the loop, so the carry keeps its types.)
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
