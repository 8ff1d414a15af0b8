"""The automatic executor (--mesh.sharding auto): (loss, metrics, grads) of a program
written as for one device (global shapes, no collectives written), partitioned by the
compiler (jax.jit + shardings, no shard_map). Weights keep the storage shardings of the
shard_map executors (so params, optimizer state and checkpoints are interchangeable);
the step core's reductions are identities here (no manual axis).

Sharding constraints (the compiler propagates the rest):
  weights         just before use, per block: weight_layout's compute layout (FSDP dim
                  whole, tp dim over tp, experts over dp with --mesh.expert_parallel)
  residual stream x_BTD out of the embedding and into the loss: RESIDUAL_SPEC
  expert buffers  x_GECD with --mesh.expert_parallel: experts over dp
                  (model.MoE.routed_with_capacity)
docs/parallelism.md compares the compiler's choices with the shard_map executors'.

The mesh's axes are Explicit (one mesh for both modes); the step runs under
jax.sharding.auto_axes (parallel/steps.py), Auto inside, since with Explicit axes every op
of ambiguous output sharding (a matmul contracting the batch-split dim, a gather from a
vocab-split table, top_k) would need an out_sharding in model.py. No pipelining: pp = 1.
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

# The residual stream [B, T, D]: rows over (slice, dp), the sequence over cp (tokens in cp rank
# order), whole over tp (Megatron's layout between layers).
RESIDUAL_SPEC = P(BATCH_AXES, CP, None)


def compute_spec(path, one_block, expert_parallel):
    """How a weight is split while it is used: its storage layout without the FSDP
    (storage-only) split. one_block: a block's weight sliced out of the stack."""
    dims, fsdp_axes, _ = weight_layout(weight_name(path), not one_block and is_stacked(path), expert_parallel)
    return P(*(None if fsdp_axes and d == fsdp_axes else d for d in dims))


def prepare_for_use(params, expert_parallel, dtype, one_block=False):
    """fsdp.gather_for_use's counterpart: cast to the compute dtype (first: half the bytes
    in bfloat16), constrained to the compute layout; XLA inserts the all-gather and the
    gradient's reduce-scatter. Untrained state (router biases) stays float32."""
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
    # Strided microbatches stay split over dp as the batch is: splitting moves nothing.
    mb = core.split_microbatches(tokens_BT1, cfg, rng, first_row=0, strided=True)
    M = mb.tokens_MbT1.shape[0]

    def run_blocks(x_bTD, keys_b, angles):
        return apply_blocks(model.blocks, x_bTD, angles, axes, keys_b, remat=m_cfg.remat, unroll=m_cfg.unroll_blocks, loop=loop)

    if m_cfg.remat == "stage":  # all blocks are the one stage: keep only their input per microbatch
        run_blocks = jax.checkpoint(run_blocks)

    def head_sums(y_bTD, tokens_bT1, keys_b, angles):  # (axes.tp None: the compiler splits the vocabulary)
        return model.head_sums(y_bTD, tokens_bT1, angles, axes, keys_b)

    if M > 1:  # recompute each microbatch's float32 logits in the backward pass rather than keep all M
        head_sums = jax.checkpoint(head_sums)

    def microbatch(sums, tokens_and_index):
        tokens_bT1, index = tokens_and_index
        keys_b, angles = None if mb.keys_Mb is None else mb.keys_Mb[index], mb.angles_of(index)
        x_bTD = model.embed_and_prefix(tokens_bT1, angles, axes, keys_b, m_cfg.remat, stream=residual)
        y_bTD, stats_N = run_blocks(x_bTD, keys_b, angles)
        ce, mtp = head_sums(residual(y_bTD), tokens_bT1, keys_b, angles)
        return (sums[0] + ce, sums[1] + mtp), stats_N

    zero = jnp.zeros((), jnp.float32)
    (ce_sum, mtp_sum), stats_MN = jax.lax.scan(microbatch, (zero, zero), (mb.tokens_MbT1, jnp.arange(M)))
    stats_N = core.total_stats(stats_MN)
    return core.loss_and_metrics(ce_sum, stats_N, cfg, mtp_sum)


def value_and_grad(params, tokens_BT1, graphdef, cfg, rng):
    """((loss, metrics), grads) of the global arrays."""
    return jax.value_and_grad(loss, has_aux=True)(params, tokens_BT1, graphdef, cfg, rng)
