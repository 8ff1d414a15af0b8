"""Direct preference optimization (--train.objective dpo; Rafailov et al. 2023, arXiv:2305.18290):
the train step, imported only when DPO is chosen (parallel/steps.make_train_step asks for it).

Rows 2i and 2i + 1 of a batch are pair i's chosen and rejected conversation (data/preferences.py),
every target but the reply's stored as ~id < 0 (model.unmasked). With log p(x) the summed
log-probability of a row's reply tokens under the policy (the params trained) and log r(x) under
the frozen reference,

    margin_i = beta ((log p(chosen_i) - log r(chosen_i)) - (log p(rejected_i) - log r(rejected_i)))
    loss     = mean_i -log sigmoid(margin_i)  (+ the policy's weighted balance losses)

The reference is the params the run starts from: the fresh init of --run.seed or --train.init_from's,
rebuilt the same way at every start (a resumed run too), held beside the step and never in the
optimizer. At the start the policy is the reference bit for bit, so every margin is 0 and the
loss log 2. Metrics beside loss (the DPO loss alone): dpo_margin (the mean margin) and
dpo_accuracy (the share of pairs whose margin is positive).

The step is written as for one device and partitioned by the compiler, as the automatic executor
(parallel/auto.py) is, whatever --mesh.sharding says: params and optimizer state keep their
storage shardings, so checkpoints are the other objectives'. Hence pp = 1, and the batch is one
microbatch; no dropout (the policy and the reference see the same function); no MTP loss.
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from model import apply_blocks, rope_angles, unmasked
from ops.collectives import Axes
from parallel import auto
from parallel import step_core as core
from parallel.fsdp import gathering_loop
from parallel.mesh import named, specs_of
from parallel.weights import init_params
from runtime import checkpoint
from utils import DP, ConfigError


def check_dpo(cfg):
    """ConfigError (one line) for a layout the DPO step does not take."""
    t = cfg.train
    if t.batch_size % 2 or cfg.mesh.pp > 1 or t.microbatches > 1 or cfg.model.dropout or t.dpo_beta <= 0:
        raise ConfigError(f"--train.objective dpo takes an even --train.batch_size (pairs; got {t.batch_size}), --mesh.pp 1 "
                          f"(got {cfg.mesh.pp}), --train.microbatches 1 (got {t.microbatches}), --model.dropout 0 (got "
                          f"{cfg.model.dropout}) and --train.dpo_beta > 0 (got {t.dpo_beta})")


def reference_params(cfg, mesh):
    """The frozen reference: the params a fresh run of cfg starts from, in their storage shardings."""
    _, params = init_params(cfg.model, mesh, cfg.mesh.expert_parallel, cfg.run.seed)
    if not cfg.train.init_from:
        return params
    source = checkpoint.open_init_from(cfg)[1]  # (hf:DIR: opened again; else None and the path itself)
    params = checkpoint.restore_params(source or cfg.train.init_from, params, cfg.model, log=lambda *_: None)
    if source is not None:
        source.close()
    return params


def reply_logps(params, tokens_BT1, graphdef, cfg):
    """(summed log-probability of each row's counted targets [B] in float32, the blocks' MoE
    statistics): a global program, its layouts as parallel/auto.loss sets them."""
    m_cfg, ep = cfg.model, cfg.mesh.expert_parallel
    dtype = jnp.dtype(m_cfg.dtype)
    top = auto.prepare_for_use({k: v for k, v in params.items() if k != "blocks"}, ep, dtype)
    model = nnx.merge(graphdef, {**top, "blocks": params["blocks"]})
    axes = Axes(ep=DP if ep else None)  # tp None: the compiler writes the reductions
    loop = gathering_loop(lambda block_params: auto.prepare_for_use(block_params, ep, dtype, one_block=True))
    angles = rope_angles(jnp.arange(tokens_BT1.shape[1] - 1)[None, :], m_cfg)
    x_BTD = model.embed_and_prefix(tokens_BT1, angles, axes, None, m_cfg.remat, stream=auto.residual)
    y_BTD, stats_N = apply_blocks(model.blocks, x_BTD, angles, axes, None, remat=m_cfg.remat, unroll=m_cfg.unroll_blocks,
                                  loop=loop)
    logp_BTV = jax.nn.log_softmax(model.logits(auto.residual(y_BTD)), axis=-1)
    targets_BT = tokens_BT1[:, 1:]
    logp_BT = jnp.take_along_axis(logp_BTV, unmasked(targets_BT)[..., None], -1)[..., 0]
    return jnp.sum(jnp.where(targets_BT >= 0, logp_BT, 0.0), axis=1), stats_N


def loss(params, reference, tokens_BT1, graphdef, cfg):
    """(DPO loss + the policy's weighted balance losses, metrics) of a batch of pairs."""
    policy_B, stats_N = reply_logps(params, tokens_BT1, graphdef, cfg)
    reference_B = reply_logps(jax.lax.stop_gradient(reference), tokens_BT1, graphdef, cfg)[0]
    ratio_B = policy_B - reference_B
    margin_P = cfg.train.dpo_beta * (ratio_B[0::2] - ratio_B[1::2])  # (chosen, rejected) pairs
    dpo = jnp.mean(-jax.nn.log_sigmoid(margin_P))
    balance, metrics = core.loss_and_metrics(jnp.zeros((), jnp.float32), stats_N, cfg)  # (ce 0: balance losses only)
    metrics = dict(metrics, loss=dpo, dpo_margin=jnp.mean(margin_P), dpo_accuracy=jnp.mean(margin_P > 0, dtype=jnp.float32))
    return dpo + balance, metrics


def make_dpo_step(graphdef, cfg, mesh, optimizer, params, opt_state, reference=None):
    """parallel/steps.make_train_step's step under DPO: step(params, opt_state, tokens, step) ->
    (params, opt_state, metrics), jitted, donating the old params and optimizer state. reference:
    the frozen params (default: reference_params)."""
    check_dpo(cfg)
    reference = reference_params(cfg, mesh) if reference is None else reference
    param_specs, opt_specs = specs_of(params), specs_of(opt_state)

    def step_fn(params, opt_state, reference, tokens_BT1, step):
        (_, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params, reference, tokens_BT1, graphdef, cfg)
        return core.apply_gradients(params, opt_state, grads, metrics, cfg, optimizer, param_specs)

    # the automatic executor's partitioning (parallel/steps.partition, manual false): the compiler's
    sharded = jax.jit(jax.sharding.auto_axes(step_fn, out_sharding=named(mesh, (param_specs, opt_specs, P()))), donate_argnums=(0, 1))
    # (reference, closed over, is an argument of the compiled program, not a constant in it)
    return jax.jit(lambda params, opt_state, tokens_BT1, step: sharded(params, opt_state, reference, tokens_BT1, step),
                   donate_argnums=(0, 1))
