"""The GPipe executor (--train.pipeline gpipe, the default): (loss, metrics, grads) by autodiff through a loop of
pipeline ticks, inside the shard_map step.

At tick t stage s works on microbatch t - s: stage 0 takes microbatch t embedded (with the dense prefix, all before
the loop), the others what their left neighbour produced at t - 1 (ppermute). M + pp - 1 ticks; bubble (pp - 1) / (M +
pp - 1). Autodiff runs it backwards: ppermutes the other way, each FSDP all-gather a reduce-scatter. The rest is the
step core's (parallel/step_core.py) and the model's (embed_and_prefix, head_sums).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from model import apply_blocks
from ops.collectives import axis_index, vary
from parallel import fsdp
from parallel import step_core as core
from utils import PP

MANUAL = True  # runs inside jax.shard_map: every collective written out


def loss(params, tokens_bT1, graphdef, cfg, rng):
    """Global mean loss (cross-entropy + weighted balance losses + MTP) and metrics,
    from inside shard_map. rng: the step's dropout key, or None."""
    top = fsdp.gather_top(params, cfg)  # embedding, final norm, MTP: gathered once per step
    model = nnx.merge(graphdef, {**top, "blocks": params["blocks"]})
    b = tokens_bT1.shape[0]
    mb = core.split_microbatches(tokens_bT1, cfg, rng, first_row=core.first_row(b))
    ce_sum, stats_N, mtp_sum = pipeline_sums(model, mb, cfg)
    return core.loss_and_metrics(ce_sum, stats_N, cfg, mtp_sum)


def value_and_grad(params, tokens_bT1, graphdef, cfg, rng):
    """((loss, metrics), grads) of this device's shards."""
    return jax.value_and_grad(loss, has_aux=True)(params, tokens_bT1, graphdef, cfg, rng)


def pipeline_sums(model, mb, cfg):
    """GPipe over pp: (summed cross-entropy of this device's rows, MoE stats of this
    stage's blocks [N/pp, ...], summed MTP cross-entropy)."""
    m_cfg, axes = cfg.model, core.layer_axes(cfg)
    n_stages, stage = jax.lax.axis_size(PP), axis_index(PP)  # (0, not varying, when pp = 1)
    tokens_MbT1, keys_Mb = mb.tokens_MbT1, mb.keys_Mb
    M = tokens_MbT1.shape[0]
    # Embedding and prefix on stage 0 only, the head on the last only (core.when), one
    # microbatch at a time: no stage computes what it would mask away.
    def embed_and_prefix(tokens_MbT1):
        return jax.lax.map(lambda tkm: model.embed_and_prefix(tkm[0], mb.angles_of(tkm[2]), axes, tkm[1], m_cfg.remat),
                           (tokens_MbT1, keys_Mb, jnp.arange(M)))

    x0_MbTD = core.when(n_stages == 1 or stage == 0, embed_and_prefix, tokens_MbT1)

    blocks_def, blocks_state = nnx.split(model.blocks)
    first_block = stage * jax.tree.leaves(blocks_state)[0].shape[0]
    ticks = jnp.arange(M + n_stages - 1)
    loop = fsdp.block_loop(cfg, passes=len(ticks))

    def run_stage(blocks_state, x_bTD, keys_b, angles):
        return apply_blocks(nnx.merge(blocks_def, blocks_state), x_bTD, angles, axes, keys_b, remat=m_cfg.remat,
                            unroll=m_cfg.unroll_blocks, first_block=first_block, loop=loop)

    if m_cfg.remat == "stage":  # keep only the stage's input per tick
        run_stage = jax.checkpoint(run_stage)

    def tick(carry, t):
        received_bTD = carry
        x_bTD = jnp.where(stage == 0, x0_MbTD[jnp.minimum(t, M - 1)], received_bTD)
        m = jnp.clip(t - stage, 0, M - 1)  # this tick's microbatch
        y_bTD, stats_N = run_stage(blocks_state, x_bTD, None if keys_Mb is None else keys_Mb[m], mb.angles_of(m))
        valid = (t - stage >= 0) & (t - stage < M)  # is this stage working on a real microbatch?
        stats_N = core.mask_stats(stats_N, valid)
        # Hand the activation to the next stage; the last stage's output is kept as ys.
        sent_bTD = jax.lax.ppermute(y_bTD, PP, [(i, i + 1) for i in range(n_stages - 1)]) if n_stages > 1 else y_bTD
        return sent_bTD, (y_bTD, stats_N)

    first_received = vary(jnp.zeros_like(x0_MbTD[0]), (PP,))  # the carry differs per stage from tick 1 on
    _, (y_tbTD, stats_tN) = jax.lax.scan(tick, first_received, ticks)
    outputs_MbTD = y_tbTD[n_stages - 1:]  # on the last stage, microbatch m finished at tick m + pp - 1
    ce_sum, mtp_sum = core.when(n_stages == 1 or stage == n_stages - 1,
                                lambda y: last_stage_sums(model, y, mb, axes), outputs_MbTD)
    return ce_sum, core.total_stats(stats_tN), mtp_sum


def last_stage_sums(model, outputs_MbTD, mb, axes):
    """(summed cross-entropy, summed MTP cross-entropy) of the finished microbatches, one
    at a time (recomputed in the backward), so only one microbatch's float32 logits
    [b, T, V/tp] exist, not [M b, T, V/tp]: most of a device's memory at a large vocabulary."""
    def microbatch_sums(y_bTD, tokens_bT1, m):
        return model.head_sums(y_bTD, tokens_bT1, mb.angles_of(m), axes, None if mb.keys_Mb is None else mb.keys_Mb[m])

    if outputs_MbTD.shape[0] == 1:  # nothing to split: skip the recomputation
        return microbatch_sums(outputs_MbTD[0], mb.tokens_MbT1[0], 0)

    @jax.checkpoint
    def microbatch_loss(_, xs):
        return None, microbatch_sums(*xs)

    ce_M, mtp_M = jax.lax.scan(microbatch_loss, None, (outputs_MbTD, mb.tokens_MbT1, jnp.arange(outputs_MbTD.shape[0])))[1]
    return jnp.sum(ce_M), jnp.sum(mtp_M)
