"""The same train step, partitioned by the compiler: jax.jit + shardings, no shard_map.

parallel.py writes each device's program by hand (one jax.shard_map, every collective
spelled out). Here the model code runs as it does on one device (tp_axis = ep_axis =
None: no collectives at all, global shapes everywhere), the weights sit in the same
storage shardings (parallel.WEIGHT_SPECS, placed by parallel.init_params), and a few
sharding constraints say how values should be laid out where they are used. XLA's
partitioner then inserts the all-gathers, reduce-scatters, all-reduces and
all-to-alls itself. Select it with --mesh.sharding auto.

Where the constraints are (everything else is propagated by the compiler):
  weights         just before use (per block, inside the loop over blocks): the FSDP
                  dim whole, the tensor-parallel dim split over tp, experts split over
                  dp with --mesh.expert_parallel (the compute layout of weight_layout)
  residual stream x_BTD out of the embedding and into the loss: rows over dp, whole
                  over tp (the batch arrives with rows over dp)
  expert buffers  x_GECD with --mesh.expert_parallel: experts over dp, every group
                  (model.MoE.routed_with_capacity; the compiler picks the dispatch)
Storage shardings are the jit's input and output shardings, so params, optimizer state
and checkpoints are interchangeable with --mesh.sharding manual. docs/parallelism.md's
"Automatic vs explicit" compares what the compiler chose with parallel.py's choices.

Axis types: the mesh keeps parallel.make_mesh's Explicit axes (one mesh, one set of
arrays for both modes), and the step body runs under jax.sharding.auto_axes, which
turns every axis Auto inside. With Explicit axes every op whose output sharding is
ambiguous (a matmul contracting a dim split like the batch, the embedding's gather
from a vocab-split table, routing's top_k / argsort / scatter) would need an
out_sharding written into model.py: the model code would have to know the mesh, which
is what this mode is meant to avoid.
"""

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import parallel as par
from model import apply_blocks, rope_angles
from utils import ConfigError

# The residual stream [B, T, D]: rows over dp, replicated over tp (Megatron's layout
# between layers: each tp device holds the whole activation of its rows).
RESIDUAL_SPEC = P(par.DP, None, None)


def check_mesh(mesh):
    if mesh.shape[par.PP] > 1:
        raise ConfigError(f"--mesh.sharding auto does not pipeline (--mesh.pp {mesh.shape[par.PP]}): "
                          "use --mesh.pp 1, or --mesh.sharding manual for pipeline stages")


def compute_spec(path, one_block, expert_parallel):
    """How a weight is split while it is used: its storage layout without the FSDP
    (storage-only) split. one_block: a block's weight sliced out of the stack."""
    dims, fsdp_axes, _ = par.weight_layout(par.weight_name(path), not one_block and par.is_stacked(path), expert_parallel)
    return P(*(None if fsdp_axes and d == fsdp_axes else d for d in dims))


def prepare_for_use(params, expert_parallel, dtype, one_block=False):
    """The auto counterpart of parallel.gather_for_use: cast to the compute dtype
    (first, so a bfloat16 gather moves half the bytes) and constrain to the compute
    layout. XLA inserts the all-gather; the gradient, constrained the same way by
    autodiff, goes back to storage as a reduce-scatter (XLA:CPU: an all-reduce and a
    slice)."""
    def prepare(path, w):
        return jax.lax.with_sharding_constraint(w.astype(dtype), compute_spec(path, one_block, expert_parallel))
    return jax.tree_util.tree_map_with_path(prepare, params)


def residual(x_BTD):
    return jax.lax.with_sharding_constraint(x_BTD, RESIDUAL_SPEC)


def auto_loss(params, tokens_BT1, graphdef, cfg, rng):
    """Global mean loss and metrics, written as for one device (global shapes)."""
    m_cfg, t_cfg = cfg.model, cfg.train
    dtype = jnp.dtype(m_cfg.dtype)
    ep = cfg.mesh.expert_parallel
    top = prepare_for_use({k: v for k, v in params.items() if k != "blocks"}, ep, dtype)
    model = nnx.merge(graphdef, {**top, "blocks": params["blocks"]})
    ep_axis = par.DP if ep else None  # tp_axis stays None: no psum, the compiler reduces
    blocks_fn = lambda block_params: prepare_for_use(block_params, ep, dtype, one_block=True)  # noqa: E731

    # Microbatch m takes rows m, m + M, m + 2M, ...: each microbatch's rows stay split
    # over dp as the batch is, so splitting it moves nothing.
    M = t_cfg.microbatches
    B, T1 = tokens_BT1.shape
    tokens_MbT1 = tokens_BT1.reshape(B // M, M, T1).swapaxes(0, 1)
    angles = rope_angles(jnp.arange(T1 - 1)[None, :], m_cfg.rope_dim, m_cfg.rope_theta)
    # Dropout keys per global row (parallel.dropout_rows), so masks equal the manual step's.
    keys_Mb = None if rng is None else par.dropout_rows(rng, 0, B).reshape(B // M, M).swapaxes(0, 1)

    def run_blocks(x_bTD, micro_rng):
        return apply_blocks(model.blocks, x_bTD, angles, None, ep_axis, micro_rng, remat=m_cfg.remat,
                            prepare=blocks_fn, unroll=m_cfg.unroll_blocks)

    if m_cfg.remat == "stage":  # all blocks are the one stage: keep only their input per microbatch
        run_blocks = jax.checkpoint(run_blocks)

    def microbatch(ce_sum, tokens_and_index):
        tokens_bT1, index = tokens_and_index
        x_bTD = residual(model.embed(tokens_bT1[:, :-1]))
        micro_rng = None if keys_Mb is None else keys_Mb[index]
        y_bTD, stats_N = run_blocks(x_bTD, micro_rng)
        return ce_sum + loss_sum(model, residual(y_bTD), tokens_bT1[:, 1:], M > 1), stats_N

    ce_sum, stats_MN = jax.lax.scan(microbatch, jnp.zeros((), jnp.float32), (tokens_MbT1, jnp.arange(M)))
    stats_N = jax.tree.map(lambda s: jnp.sum(s, axis=0), stats_MN)

    n_tokens = t_cfg.batch_size * m_cfg.seq_len
    ce = ce_sum / n_tokens
    aux_sum_N = stats_N.pop("aux_loss_sum")
    n_moe_layers = m_cfg.n_blocks * m_cfg.block_pattern.count("M")
    aux = jnp.zeros((), jnp.float32)
    if n_moe_layers:
        groups_per_layer = n_tokens // (m_cfg.routing_group or m_cfg.seq_len)
        aux = jnp.sum(aux_sum_N) / (groups_per_layer * n_moe_layers)
    loss = ce + m_cfg.aux_loss_weight * aux
    return loss, dict(loss=ce, aux_loss=aux, stats_N=stats_N)


def loss_sum(model, x_bTD, targets_bT, recompute):
    """Summed cross-entropy of one microbatch; with several microbatches its float32
    logits are recomputed in the backward pass rather than kept for all of them (as
    parallel.microbatched_loss_sum does)."""
    fn = lambda x, t: model.loss_sum(x, t)  # noqa: E731  (tp_axis None: the compiler splits the vocabulary)
    return (jax.checkpoint(fn) if recompute else fn)(x_bTD, targets_bT)


def dropout_rng(cfg, step):
    """One key per step: the masks are drawn for the global arrays, as on one device."""
    if cfg.model.dropout == 0:
        return None
    return jax.random.fold_in(jax.random.key(cfg.run.seed), step)


def shardings_of(tree):
    return jax.tree.map(lambda a: a.sharding, tree)


def make_train_step(graphdef, cfg, mesh, optimizer, params, opt_state):
    """Same signature and results as parallel.make_train_step's shard_map step."""
    check_mesh(mesh)
    param_shardings, opt_shardings = shardings_of(params), shardings_of(opt_state)
    replicated = NamedSharding(mesh, P())
    clip = cfg.train.grad_clip

    def step_fn(params, opt_state, tokens_BT1, step):
        rng = dropout_rng(cfg, step)
        (_, metrics), grads = jax.value_and_grad(auto_loss, has_aux=True)(params, tokens_BT1, graphdef, cfg, rng)
        grad_norm = optax.global_norm(grads)  # plain sum over global arrays: nothing to double-count
        if clip > 0:
            scale = jnp.minimum(1.0, clip / (grad_norm + 1e-6))
            grads = jax.tree.map(lambda g: g * scale, grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, dict(metrics, grad_norm=grad_norm)

    body = jax.sharding.auto_axes(step_fn, out_sharding=(param_shardings, opt_shardings, replicated))
    return jax.jit(body, donate_argnums=(0, 1))


def make_eval_step(graphdef, cfg, mesh, params):
    """Mean validation cross-entropy of one batch (dropout off), as parallel's."""
    check_mesh(mesh)
    replicated = NamedSharding(mesh, P())

    def eval_fn(params, tokens_BT1):
        return auto_loss(params, tokens_BT1, graphdef, cfg, None)[1]["loss"]

    return jax.jit(jax.sharding.auto_axes(eval_fn, out_sharding=replicated))


# ----------------------------------------------------------------------------
# What the compiler chose: the collectives of a compiled step, from its optimized HLO
# (tpu_compile's parser, which planner.py --tpu prints from too).


def collective_table(hlo_text, mesh):
    """{(kind, axes): (count, bytes)} per step per device: each collective in the
    optimized HLO, times the trip count of the loops around it. Bytes are the
    collective's result on one device (for an all-gather the gathered array, for a
    reduce-scatter the scattered shard); axes "none": it moves nothing."""
    import tpu_compile

    table = {}
    for op in tpu_compile.collective_ops(hlo_text, mesh.devices.shape):
        key = (op.kind, "none" if op.over == "-" else op.over)
        count, nbytes = table.get(key, (0, 0))
        table[key] = (count + op.runs, nbytes + op.runs * sum(b for _, b in op.arrays))
    return dict(sorted(table.items()))
