"""The gradient-accumulation executor (pp = 1, --train.pipeline gpipe, --mesh.sharding
manual): (loss, metrics, grads) with one microbatch's activations alive, whatever
--train.microbatches is, inside the shard_map step.

A lax.scan over the M microbatches, each iteration one microbatch's forward and backward
(jax.vjp seeded with step_core.sum_cotangents), its weight gradients added to float32
accumulators in the carry. Unlike autodiff through GPipe's scan, no backward needs
another microbatch's activations (docs/parallelism.md has the memory).

FSDP, --train.gather_once:
  true   all blocks gathered once before the loop; their float32 gradient summed over the
         microbatches (each block's backward adding into the sums in place:
         scan_adding_gradients_to) and reduce-scattered once after it. Holds both for the
         whole step.
  false  each microbatch gathers each block just before use and reduce-scatters its
         gradient (M of each per step, as GPipe); at remat none, layer or stage the next
         block is fetched beside this one (fsdp.block_loop).
  auto   (default) once when M > 1 and it fits rules.GATHER_ONCE_SHARE of the device's
         memory (rules.gathers_once, asked by the planner too; CPU: per microbatch).
The top-level weights are gathered once per step either way (fsdp.gather_top). Remat
acts inside each microbatch's vjp as under GPipe.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from model import apply_blocks, remat_block, scan_blocks
from ops.collectives import vary, widen
from parallel import fsdp, rules
from parallel import step_core as core
from parallel.weights import is_trained, weight_name
from utils import AXES, TP

MANUAL = True  # runs inside jax.shard_map: every collective written out


def value_and_grad(params, tokens_bT1, graphdef, cfg, rng):
    """((loss, metrics), grads) of this device's shards: the numbers autodiff of
    gpipe.loss gives, summed over the microbatches in another order."""
    m_cfg = cfg.model
    mb = core.split_microbatches(tokens_bT1, cfg, rng, first_row=core.first_row(tokens_bT1.shape[0]))
    cot = core.sum_cotangents(cfg, jax.lax.axis_size(TP))
    axes = core.layer_axes(cfg)
    dtype = jnp.dtype(m_cfg.dtype)

    top_local = {k: v for k, v in params.items() if k != "blocks"}
    once = gathers_once(cfg, params["blocks"])
    top, top_vjp = jax.vjp(lambda t: fsdp.gather_top(t, cfg), top_local)
    if once:  # gathered in reduce_dtype (the gradient's way back), used in the compute dtype
        blocks_wide, blocks_vjp = jax.vjp(lambda b: gather_stack(b, cfg), params["blocks"])
        blocks, loop = to_compute_dtype(blocks_wide, dtype), scan_blocks
    else:
        # Varying over every axis before the loop: replicated weights (norm scales) get their
        # gradient summed once, by this pcast's transpose, and the tie below changes no type.
        blocks, blocks_vjp = jax.vjp(lambda b: jax.tree.map(lambda w: vary(w, AXES), b), params["blocks"])
        loop = fsdp.block_loop(cfg, passes=1)

    def microbatch_sums(top, blocks, tokens_bT1, keys_b, angles, loop=loop):
        """((cross-entropy, MTP, balance losses per block), MoE statistics) of one microbatch."""
        model = nnx.merge(graphdef, {**top, "blocks": blocks})
        x_bTD = model.embed_and_prefix(tokens_bT1, angles, axes, keys_b, m_cfg.remat)

        def run_blocks(x_bTD):
            return apply_blocks(model.blocks, x_bTD, angles, axes, keys_b, remat=m_cfg.remat, unroll=m_cfg.unroll_blocks,
                                loop=loop)

        if m_cfg.remat == "stage":  # all blocks are the one stage: keep only the microbatch's input
            run_blocks = jax.checkpoint(run_blocks)
        y_bTD, stats_N = run_blocks(x_bTD)
        return model.head_sums(y_bTD, tokens_bT1, angles, axes, keys_b) + core.balance_sums(stats_N), stats_N

    def cotangents(sums):
        return tuple(jnp.full_like(s, c) for s, c in zip(sums, (cot["ce"], cot["mtp"], cot["aux"], cot["seq_aux"])))

    def step(carry, m):
        tokens_bT1 = mb.tokens_MbT1[m]
        keys_b = None if mb.keys_Mb is None else mb.keys_Mb[m]
        # Tied to this microbatch's tokens, the gathers stay in the loop (else JAX hoists them
        # all and keeps every block's gathered weights for the step: a "once" not asked for).
        add = lambda acc, g: acc + g.astype(acc.dtype)  # noqa: E731
        if once:  # the blocks' backward adds their gradients to the sums in place: the cotangent of the sums is the new sums
            sums, vjp, stats_N = jax.vjp(lambda t, acc: microbatch_sums(t, blocks, tokens_bT1, keys_b, mb.angles_of(m),
                                                                        loop=scan_adding_gradients_to(acc)),
                                         top, carry["g_blocks"], has_aux=True)
            g_top, g_blocks = vjp(cotangents(sums))
        else:
            blocks_m = jax.lax.optimization_barrier((blocks, tokens_bT1))[0]
            sums, vjp, stats_N = jax.vjp(lambda t, b: microbatch_sums(t, b, tokens_bT1, keys_b, mb.angles_of(m)), top, blocks_m,
                                         has_aux=True)
            g_top, g_blocks = vjp(cotangents(sums))
            g_blocks = jax.tree.map(add, carry["g_blocks"], g_blocks)
        return dict(g_top=jax.tree.map(add, carry["g_top"], g_top), g_blocks=g_blocks,
                    ce=carry["ce"] + sums[0], mtp=carry["mtp"] + sums[1],
                    stats=core.add_stats(carry["stats"], stats_N)), None

    f32_zeros = lambda tree: jax.tree.map(lambda w: jnp.zeros_like(w, jnp.float32), tree)  # noqa: E731
    carry = dict(g_top=f32_zeros(top), g_blocks=f32_zeros(blocks), ce=jnp.zeros((), jnp.float32),
                 mtp=jnp.zeros((), jnp.float32))
    first = lambda t, b: microbatch_sums(t, b, mb.tokens_MbT1[0], None if mb.keys_Mb is None else mb.keys_Mb[0], mb.angles_of(0))  # noqa: E731
    carry["stats"] = core.empty_stats(jax.eval_shape(first, top, blocks)[1])
    for _ in range(2):  # settle the carry's types (which axes each sum varies over)
        carry = widen(carry, jax.eval_shape(lambda c: step(c, 0)[0], carry))
    carry, _ = jax.lax.scan(step, carry, jnp.arange(mb.tokens_MbT1.shape[0]))

    g_top_local = top_vjp(jax.tree.map(lambda g, w: g.astype(w.dtype), carry["g_top"], top))[0]
    g_blocks = blocks_vjp(jax.tree.map(lambda g, w: g.astype(w.dtype), carry["g_blocks"], blocks_wide if once else blocks))[0]
    g_blocks = jax.tree.map(lambda g, w: g.astype(w.dtype), g_blocks, params["blocks"])
    return core.loss_and_metrics(carry["ce"], carry["stats"], cfg, carry["mtp"]), {**g_top_local, "blocks": g_blocks}


# ---- The blocks' gradients added where they are made


def scan_adding_gradients_to(sums_f32):
    """A block loop (model.apply_blocks' `loop`, as model.scan_blocks) whose backward adds
    each block's weight gradient to its rows of sums_f32 (float32, stacked as the blocks)
    in place, and hands the new sums back as the cotangent of sums_f32; the weights get
    none. Autodiff of the scan would write each microbatch's gradients into a stack of
    its own (zeroed first), then add it to the sums: two more passes over every block
    weight per microbatch (docs/pods.md)."""
    def loop(run_block, block_state, x_BTD, remat, unroll):
        n_blocks = jax.tree.leaves(block_state)[0].shape[0]
        body = remat_block(lambda x_BTD, state_and_index: run_block(x_BTD, *state_and_index), remat)
        xs, rolled = (block_state, jnp.arange(n_blocks)), n_blocks if unroll else 1  # (scan's xs and its unroll)

        def block_and_backward(x_BTD, state_and_index):  # (y, (stats, the block's pullback: its residuals))
            state, index = state_and_index
            (y_BTD, stats), pullback = jax.vjp(lambda x, w: body(x, (w, index)), x_BTD, state)
            return y_BTD, (stats, pullback)

        @jax.custom_vjp
        def blocks(sums, x_BTD):
            return jax.lax.scan(body, x_BTD, xs, unroll=rolled)

        def forward(sums, x_BTD):
            y_BTD, (stats, pullbacks) = jax.lax.scan(block_and_backward, x_BTD, xs, unroll=rolled)
            return (y_BTD, stats), (pullbacks, sums)

        def backward(residuals, cotangent):
            pullbacks, sums = residuals
            d_y_BTD, d_stats = cotangent

            def step(carry, index):
                d_x_BTD, sums = carry
                pullback, d_stats_i = jax.tree.map(lambda r: r[index], (pullbacks, d_stats))
                d_x_BTD, d_state = pullback((d_x_BTD, d_stats_i))
                leaves, tree = jax.tree.flatten(sums)  # (a dict of the blocks' params; d_state, the nnx.State of one block)
                return (d_x_BTD, tree.unflatten([s.at[index].add(g.astype(s.dtype)) for s, g in zip(leaves, jax.tree.leaves(d_state),
                                                                                                      strict=True)])), None
            (d_x_BTD, sums), _ = jax.lax.scan(step, (d_y_BTD, sums), xs[1], reverse=True, unroll=rolled)
            return sums, d_x_BTD

        blocks.defvjp(forward, backward)
        return blocks(sums_f32, x_BTD)
    return loop


# ---- FSDP: once per step or per microbatch


def gathers_once(cfg, blocks_local):
    """Does this step all-gather the blocks once (True) or per microbatch (False)?
    rules.gathers_once, asked with this device's blocks and memory."""
    return rules.gathers_once(cfg, gather_once_bytes(blocks_local, cfg), device_memory())


def device_memory():
    """Bytes of memory of this process's first device, as jax reports it (None on CPU)."""
    stats = jax.local_devices()[0].memory_stats()
    return None if not stats else stats.get("bytes_limit")


def gather_once_bytes(blocks_local, cfg):
    """Bytes per device gathering once holds for the step: the gathered block weights in the
    compute dtype and their float32 gradient (from traced shapes)."""
    gathered = jax.eval_shape(lambda b: to_compute_dtype(gather_stack(b, cfg), jnp.dtype(cfg.model.dtype)), blocks_local)
    return sum(w.size * (w.dtype.itemsize + 4) for w in jax.tree.leaves(gathered))


def gather_stack(blocks_local, cfg):
    """Every block's weights, gathered (fsdp.gather_for_use, whole_stack)."""
    m = cfg.model
    return fsdp.gather_for_use(blocks_local, cfg.mesh.expert_parallel, jnp.dtype(m.dtype), whole_stack=True,
                          reduce_dtype=jnp.dtype(m.grad_reduce_dtype))


def to_compute_dtype(tree, dtype):
    """Trained weights cast to the compute dtype; untrained state (router biases) as it is."""
    return jax.tree_util.tree_map_with_path(lambda path, w: w.astype(dtype) if is_trained(weight_name(path)) else w, tree)
