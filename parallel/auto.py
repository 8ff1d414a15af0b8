"""The automatic executor (--mesh.sharding auto): (loss, metrics, grads) of a program
written as for one device, partitioned by the compiler (jax.jit + shardings, no
shard_map).

The model code runs as it does on one device (tp_axis = None: no collectives written,
global shapes everywhere), the weights sit in the same storage shardings as under the
shard_map executors (weights.param_specs, placed by weights.init_params), and a few
sharding constraints say how values should be laid out where they are used. XLA's
partitioner then inserts the all-gathers, reduce-scatters, all-reduces and
all-to-alls itself. The step core's loss and update are the same functions as under
shard_map: with no manual axis their reductions are identities (ops/collectives.psum).

Where the constraints are (everything else is propagated by the compiler):
  weights         just before use (per block, inside the loop over blocks): the FSDP
                  dim whole, the tensor-parallel dim split over tp, experts split over
                  dp with --mesh.expert_parallel (the compute layout of weight_layout)
  residual stream x_BTD out of the embedding and into the loss: rows over dp, the
                  sequence over cp, whole over tp (RESIDUAL_SPEC; the batch arrives
                  with rows over dp)
  expert buffers  x_GECD with --mesh.expert_parallel: experts over dp, every group
                  (model.MoE.routed_with_capacity; the compiler picks the dispatch)
Storage shardings are the jit's input and output shardings, so params, optimizer state
and checkpoints are interchangeable with --mesh.sharding manual. docs/parallelism.md
compares what the compiler chose with the shard_map executors' choices.

Axis types: the mesh keeps mesh.make_mesh's Explicit axes (one mesh, one set of
arrays for both modes), and the step body runs under jax.sharding.auto_axes (parallel/steps.py),
which turns every axis Auto inside. With Explicit axes every op whose output sharding
is ambiguous (a matmul contracting a dim split like the batch, the embedding's gather
from a vocab-split table, routing's top_k / argsort / scatter) would need an
out_sharding written into model.py: the model code would have to know the mesh, which
is what this mode is meant to avoid. Pipelining needs the shard_map executors: pp = 1.
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from model import apply_blocks
from ops.collectives import Axes
from parallel import step_core as core
from parallel.fsdp import gathering_loop
from parallel.weights import is_stacked, is_trained, weight_layout, weight_name
from utils import BATCH_AXES, CP, DP

MANUAL = False  # jit partitions a global program: the compiler writes the collectives

# The residual stream [B, T, D]: rows over (slice, dp), replicated over tp (Megatron's layout
# between layers: each tp device holds the whole activation of its rows), the sequence
# over cp (the tokens in cp rank order under context parallelism: ops/context_parallel.py).
RESIDUAL_SPEC = P(BATCH_AXES, CP, None)


def compute_spec(path, one_block, expert_parallel):
    """How a weight is split while it is used: its storage layout without the FSDP
    (storage-only) split. one_block: a block's weight sliced out of the stack."""
    dims, fsdp_axes, _ = weight_layout(weight_name(path), not one_block and is_stacked(path), expert_parallel)
    return P(*(None if fsdp_axes and d == fsdp_axes else d for d in dims))


def prepare_for_use(params, expert_parallel, dtype, one_block=False):
    """The automatic counterpart of fsdp.gather_for_use: cast to the compute dtype
    (first, so a bfloat16 gather moves half the bytes) and constrain to the compute
    layout. XLA inserts the all-gather; the gradient, constrained the same way by
    autodiff, goes back to storage as a reduce-scatter (XLA:CPU: an all-reduce and a
    slice). Untrained state (the router biases) keeps float32, as under shard_map."""
    def prepare(path, w):
        if not is_trained(weight_name(path)):
            return w
        return jax.lax.with_sharding_constraint(w.astype(dtype), compute_spec(path, one_block, expert_parallel))
    return jax.tree_util.tree_map_with_path(prepare, params)


def residual(x_BTD):
    return jax.lax.with_sharding_constraint(x_BTD, RESIDUAL_SPEC)


def loss(params, tokens_BT1, graphdef, cfg, rng):
    """Global mean loss and metrics, written as for one device (global shapes)."""
    m_cfg = cfg.model
    dtype = jnp.dtype(m_cfg.dtype)
    ep = cfg.mesh.expert_parallel
    top = prepare_for_use({k: v for k, v in params.items() if k != "blocks"}, ep, dtype)
    model = nnx.merge(graphdef, {**top, "blocks": params["blocks"]})
    axes = Axes(ep=DP if ep else None)  # tp None: no psum written, the compiler reduces
    loop = gathering_loop(lambda block_params: prepare_for_use(block_params, ep, dtype, one_block=True))
    # Microbatch m takes rows m, m + M, m + 2M, ...: each microbatch's rows stay split
    # over dp as the batch is, so splitting it moves nothing.
    mb = core.split_microbatches(tokens_BT1, cfg, rng, first_row=0, strided=True)
    M = mb.tokens_MbT1.shape[0]

    def run_blocks(x_bTD, keys_b):
        return apply_blocks(model.blocks, x_bTD, mb.angles, axes, keys_b, remat=m_cfg.remat, unroll=m_cfg.unroll_blocks, loop=loop)

    if m_cfg.remat == "stage":  # all blocks are the one stage: keep only their input per microbatch
        run_blocks = jax.checkpoint(run_blocks)

    def head_sums(y_bTD, tokens_bT1, keys_b):  # (axes.tp None: the compiler splits the vocabulary)
        return model.head_sums(y_bTD, tokens_bT1, mb.angles, axes, keys_b)

    if M > 1:  # recompute each microbatch's float32 logits in the backward pass rather than keep all M
        head_sums = jax.checkpoint(head_sums)

    def microbatch(sums, tokens_and_index):
        tokens_bT1, index = tokens_and_index
        keys_b = None if mb.keys_Mb is None else mb.keys_Mb[index]
        x_bTD = model.embed_and_prefix(tokens_bT1, mb.angles, axes, keys_b, m_cfg.remat, stream=residual)
        y_bTD, stats_N = run_blocks(x_bTD, keys_b)
        ce, mtp = head_sums(residual(y_bTD), tokens_bT1, keys_b)
        return (sums[0] + ce, sums[1] + mtp), stats_N

    zero = jnp.zeros((), jnp.float32)
    (ce_sum, mtp_sum), stats_MN = jax.lax.scan(microbatch, (zero, zero), (mb.tokens_MbT1, jnp.arange(M)))
    stats_N = core.total_stats(stats_MN)
    return core.loss_and_metrics(ce_sum, stats_N, cfg, mtp_sum)


def value_and_grad(params, tokens_BT1, graphdef, cfg, rng):
    """((loss, metrics), grads) of the global arrays."""
    return jax.value_and_grad(loss, has_aux=True)(params, tokens_BT1, graphdef, cfg, rng)
