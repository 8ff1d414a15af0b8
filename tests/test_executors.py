"""One step, every executor: with every DeepSeek-V3 option on (sigmoid router, bias
balancing, the sequence-wise loss, group-limited routing, scaled routed output, MTP) and
the options of real DeepSeek-family checkpoints (an untied head, full-rank queries, YaRN
over an original context of 16 at T = 32, another norm eps), each executor computes what
one device computes (8 fake CPU devices, fp32).

    1f1b and interleaved (hand-written backward) on dp2 x pp2 x tp2
    accumulation (pp = 1, a vjp per microbatch) on one device and on dp4 x tp2, the
        FSDP gather per microbatch and once per step
    auto (the compiler partitions it) on dp4 x tp2

Compared with the GPipe executor on one device, the whole batch as one microbatch: the
loss and its parts, every gradient leaf (before the optimizer, which would hide a leaf's
scale), and after one whole step (QK-clipped: some heads above tau, some not) the grad
norm, the attention's largest logits, the router biases and every updated weight. (The
real checkpoints' softmax router with raw top-k gates is per-token arithmetic that no executor touches: tests/test_model_options.py checks it against
transformers.)
"""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from parallel import accumulate as executor_accumulate
from parallel import gpipe as executor_gpipe
from parallel import optimizers
from parallel import steps as train_steps
from parallel.mesh import batch_spec, check_config_fits_mesh, global_batch, named
from parallel.weights import is_trained, param_specs, weight_name
from test_parallel import RTOL, assert_tree_close, initial_params, mesh_for, token_batch
from utils import PRESETS, Config, apply_overrides

CASES = [pytest.param(((2, 2, 2), "manual", "1f1b"), marks=pytest.mark.slow), ((1, 1, 1), "manual", "gpipe"),
         pytest.param(((2, 2, 2), "manual", "interleaved"), marks=pytest.mark.slow),
         pytest.param(((4, 1, 2), "auto", "gpipe"), marks=pytest.mark.slow),
         pytest.param(((4, 1, 2), "manual", "gpipe", "false"), marks=pytest.mark.slow),
         pytest.param(((4, 1, 2), "manual", "gpipe", "true"), marks=pytest.mark.slow)]
CASE_IDS = ["2x2x2-1f1b", "1x1x1-accumulate", "2x2x2-interleaved", "4x1x2-auto", "4x1x2-accumulate-gather-per-microbatch",
            "4x1x2-accumulate-gather-once"]


# The options of real DeepSeek-family checkpoints (issue 30; tests/test_model_options.py
# checks each against transformers): YaRN's factor on the RoPE parts and its softmax
# correction both other than 1, positions 16..31 past the original context.
REAL_CHECKPOINT_OPTIONS = dict(tie_embeddings=False, q_latent=0, rope_scaling="yarn", rope_factor=4.0, rope_original_len=16,
                               yarn_mscale_all_dim=0.5, norm_eps=1e-5)


def v3_config(mesh_shape=(1, 1, 1), sharding="manual", pipeline="gpipe", gather_once="auto", microbatches=None, **model):
    """The deepseek_v3 preset with REAL_CHECKPOINT_OPTIONS, smaller in T, B and vocabulary, its blocks in a loop
    (compiles faster); 4 blocks so that interleaved has 2 chunks per stage on pp = 2.
    Every loss term on: the preset's aux_loss_weight is 0 (V3 balances by its biases),
    so it is set here, or a wrong aux-loss gradient would go unseen.
    The automatic executor keeps pp = 1: its 4 dp rows take 2 microbatches of 2 rows
    each (the same rows' sums in another order); so does the accumulation executor
    (manual, pp = 1, microbatches > 1: executor_accumulate), on 1x1x1 with 4. model:
    more model fields."""
    dp, pp, tp = mesh_shape
    cfg = apply_overrides(Config(), PRESETS["deepseek_v3"])
    return apply_overrides(cfg, {"model": dict(vocab_size=256, seq_len=32, n_blocks=4, dtype="float32", unroll_blocks=False,
                                               **{"aux_loss_weight": 0.01, **REAL_CHECKPOINT_OPTIONS, **model}),
                                 "mesh": dict(dp=dp, pp=pp, tp=tp, sharding=sharding),
                                 "train": dict(batch_size=8, microbatches=microbatches or (2 if dp == 4 else 4), pipeline=pipeline,
                                               virtual_stages=2, gather_once=gather_once)})


def placed(cfg):
    mesh = mesh_for(cfg)
    check_config_fits_mesh(cfg, mesh)
    graphdef, host_params = initial_params(cfg.model)
    specs = param_specs(host_params, cfg.mesh.expert_parallel)
    return mesh, graphdef, jax.device_put(host_params, named(mesh, specs)), specs


def executor_gradients(cfg):
    """(loss, loss parts, gradients) of the executor cfg selects, on the host."""
    mesh, graphdef, params, specs = placed(cfg)
    executor = train_steps.executor_of(cfg)

    def fn(params, tokens_bT1):
        (loss, metrics), grads = executor.value_and_grad(params, tokens_bT1, graphdef, cfg, None)
        parts = {k: metrics[k] for k in ("loss", "aux_loss", "seq_aux_loss", "mtp_loss")}
        return loss, parts, grads

    specs_out = (P(), P(), specs)
    step = jax.jit(train_steps.partition(fn, executor.MANUAL, mesh, (specs, batch_spec()), specs_out))
    return jax.device_get(step(params, global_batch(mesh, token_batch(cfg), cfg.train.batch_size)))


# QK-clip on in the whole step: between the reference's 10th and 11th largest of its 32
# heads' largest logits (4.407, 4.416), so 22 heads are clipped and 10 are not.
QK_CLIP_TAU = 4.41


def whole_step(cfg):
    """(metrics, params) after one train step (AdamW: Muon's equality has its own tests),
    QK-clipped at QK_CLIP_TAU."""
    cfg = apply_overrides(cfg, {"train": dict(optimizer="adamw", qk_clip=QK_CLIP_TAU)})
    mesh, graphdef, params, _ = placed(cfg)
    optimizer = optimizers.make_optimizer(cfg.train)
    opt_state = optimizers.init_opt_state(optimizer, params, mesh)
    step = train_steps.make_train_step(graphdef, cfg, mesh, optimizer, params, opt_state)
    params, _, metrics = step(params, opt_state, global_batch(mesh, token_batch(cfg), cfg.train.batch_size), jax.numpy.asarray(0))
    return jax.device_get(metrics), jax.tree.map(np.asarray, params)


@pytest.fixture(scope="module")
def reference():
    one = v3_config(microbatches=1)  # the whole batch at once: GPipe's autodiff, no accumulation
    assert train_steps.executor_of(one) is executor_gpipe
    return executor_gradients(one), whole_step(one)


def trained_leaves(tree):
    """The gradient leaves of trained weights (a router bias's gradient is 0 by design)."""
    return {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
            if is_trained(weight_name(path))}


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_every_v3_feature_under_every_executor_equals_one_device(reference, case):
    cfg = v3_config(*case)
    if case[1:3] == ("manual", "gpipe"):
        assert train_steps.executor_of(cfg) is executor_accumulate
    assert_equals_one_device(cfg, reference)


def assert_equals_one_device(cfg, reference):
    (ref_loss, ref_parts, ref_grads), (ref_metrics, ref_params) = reference
    loss, parts, grads = executor_gradients(cfg)
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL)
    for key, want in ref_parts.items():
        assert want > 0, f"{key} is 0 in the reference: the preset no longer turns it on"
        np.testing.assert_allclose(parts[key], want, rtol=RTOL, err_msg=key)
    assert_tree_close(trained_leaves(grads), trained_leaves(ref_grads), what="gradient ")

    metrics, params = whole_step(cfg)
    clipped_NLH = ref_metrics["max_logit_NLH"] > QK_CLIP_TAU
    assert 0 < clipped_NLH.sum() < clipped_NLH.size, "QK_CLIP_TAU no longer splits the heads: choose it again"
    for key in ("loss", "grad_norm", "seq_aux_loss", "mtp_loss", "max_logit", "max_logit_NLH"):
        np.testing.assert_allclose(metrics[key], ref_metrics[key], rtol=RTOL, err_msg=key)
    np.testing.assert_array_equal(metrics["stats_N"]["tokens_per_expert"], ref_metrics["stats_N"]["tokens_per_expert"])
    bias, ref_bias = metrics["router_bias_NLE"], ref_metrics["router_bias_NLE"]
    assert np.abs(ref_bias).max() > 0  # the biases moved: balancing ran
    np.testing.assert_allclose(bias, ref_bias, atol=1e-7)
    assert_tree_close(params, ref_params, what="params ")


def test_every_loss_term_reaches_the_automatic_executor(reference):
    """The fast selection's check of the automatic executor (its mesh case above is
    slow): on one device, where it compiles fastest, its loss, every loss part and
    every gradient leaf equal the GPipe executor's, so a loss term it dropped (MTP, the
    balance losses) or weighted wrongly fails here. (1f1b's hand-written cotangents of
    the same terms: the 2x2x2-1f1b case above, with the aux loss weighted.)"""
    (ref_loss, ref_parts, ref_grads), _ = reference
    loss, parts, grads = executor_gradients(v3_config(sharding="auto"))
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL)
    for key, want in ref_parts.items():
        assert want > 0, key
        np.testing.assert_allclose(parts[key], want, rtol=RTOL, err_msg=key)
    assert_tree_close(trained_leaves(grads), trained_leaves(ref_grads), what="gradient ")
