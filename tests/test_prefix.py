"""A dense prefix before the blocks (--model.first_dense: DeepSeek's first k dense
layers) is a layout every executor splits: the prefix runs on the first pipeline stage
beside the embedding (8 fake CPU devices, fp32).

The model: tiny with 2 dense prefix layers and 4 MoE blocks, and dropout on, so the
prefix's dropout keys must be mesh-invariant too. Two train steps on dp2 x pp2 x tp2
under gpipe and 1f1b, and under --mesh.sharding auto (pp 1), equal one device (loss,
grad norm, every gradient leaf through the optimizer's moments, every updated param);
the pipelined loss and gradients equal autodiff of the plain forward; decoding with the
latent cache (prefix entries included) equals the full forward; the existing weights'
init does not move when a prefix is added.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_pipeline import scheduled_grads

from model import Transformer, decode_step, init_cache
from parallel import accumulate as executor_accumulate
from parallel import gpipe as executor_gpipe
from parallel import one_f_one_b as executor_1f1b
from parallel.steps import executor_of
from planning import costs
from runtime import sampling
from runtime.flops import flops_per_token, part_flops_per_token, stage_flops_per_token
from test_model import random_tokens, tiny
from test_parallel import RTOL, assert_params_close, assert_same_steps, initial_params, plain_loss, tiny_config, token_batch, train_steps
from utils import ConfigError, apply_overrides, parse_args

PREFIX = dict(first_dense=2, n_blocks=4)


def prefix_config(mesh_shape=(1, 1, 1), pipeline="gpipe", sharding="manual", **model):
    cfg = tiny_config(mesh_shape, **PREFIX, **model)
    return apply_overrides(cfg, {"mesh": dict(sharding=sharding), "train": dict(pipeline=pipeline)})


@pytest.fixture(scope="module")
def reference():
    return train_steps(prefix_config(dropout=0.1))


CASES = [pytest.param((2, 2, 2), "1f1b", "manual", marks=pytest.mark.slow),
         pytest.param((2, 2, 2), "gpipe", "manual", marks=pytest.mark.slow),
         pytest.param((4, 1, 2), "gpipe", "auto", marks=pytest.mark.slow)]


@pytest.mark.parametrize("mesh_shape, pipeline, sharding", CASES, ids=["2x2x2-1f1b", "2x2x2-gpipe", "4x1x2-auto"])
def test_prefix_two_steps_equal_one_device(reference, mesh_shape, pipeline, sharding):
    """The reference checks (assert_tree_close) that every leaf, the prefix's included,
    has a non-zero gradient: the prefix is trained, not skipped."""
    result = train_steps(prefix_config(mesh_shape, pipeline, sharding, dropout=0.1))
    assert_same_steps(result, reference)


def test_prefix_under_accumulation_equals_one_device(reference):
    """pp = 1 with 2 microbatches (executor_accumulate) runs the prefix in each
    microbatch's vjp, with dropout, on dp4 x tp2."""
    cfg = apply_overrides(prefix_config((4, 1, 2), dropout=0.1), {"train": dict(microbatches=2)})
    assert executor_of(cfg) is executor_accumulate
    assert_same_steps(train_steps(cfg), reference)


@pytest.mark.parametrize("pipeline, executor", [pytest.param("gpipe", executor_gpipe, marks=pytest.mark.slow),
                                                pytest.param("1f1b", executor_1f1b, marks=pytest.mark.slow)])
def test_pipelined_prefix_equals_plain_forward(pipeline, executor):
    """Loss and every gradient leaf of the pipelined, sharded step against autodiff of
    model.__call__ (the plain single-device reference) on dp2 x pp2 x tp2."""
    cfg = prefix_config((2, 2, 2), pipeline)
    tokens = token_batch(cfg, seed=3)
    loss, grads = scheduled_grads(cfg, tokens, executor)
    graphdef, host_params = initial_params(cfg.model)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(lambda p: plain_loss(nnx.merge(graphdef, p), jnp.asarray(tokens), cfg)))(host_params)
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL)
    assert_params_close(grads, jax.device_get(ref_grads))
    assert set(grads["prefix"]) == {0, 1}


def test_prefix_decode_equals_full_forward():
    """Prefill, then one token at a time through the latent cache, whose first entries
    are the prefix layers': the logits equal the full forward's."""
    cfg = tiny(**PREFIX, capacity_factor=0.0)
    model = Transformer(cfg, nnx.Rngs(0))
    B, T, prompt = 2, cfg.seq_len, 5
    tokens_BT = random_tokens(4, (B, T))
    full_BTV, _ = jax.jit(lambda t: model(t))(tokens_BT)
    cache = init_cache(cfg, B, T)
    assert len(cache) == cfg.first_dense + len(cfg.block_pattern) and cache[0][0].shape == (1, B, T, cfg.kv_latent)
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda state, tokens_BT, cache, start: decode_step(nnx.merge(graphdef, state), tokens_BT, cache, start))
    logits_BTV, cache = step(state, tokens_BT[:, :prompt], cache, jnp.int32(0))
    pieces = [logits_BTV]
    for t in range(prompt, T):
        logits_BTV, cache = step(state, tokens_BT[:, t:t + 1], cache, jnp.int32(t))
        pieces.append(logits_BTV)
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), full_BTV, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_sampler_with_a_prefix_decodes_greedily():
    """The sampler's prefill writes every cache entry's row (the prefix's too): it
    continues a prompt as greedy decoding of the full forward does."""
    cfg = tiny(**PREFIX, capacity_factor=0.0)
    model = Transformer(cfg, nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    prompt, tokens_BT = 5, random_tokens(4, (1, cfg.seq_len))
    # Greedy continuation without a cache: the full forward over a fixed-length buffer
    # (positions after t cannot affect logits at t).
    forward = jax.jit(lambda state, t: nnx.merge(graphdef, state)(t)[0])
    buffer_1T = tokens_BT.at[:, prompt:].set(0)
    for t in range(prompt, prompt + 4):
        buffer_1T = buffer_1T.at[:, t].set(jnp.argmax(forward(state, buffer_1T)[0, t - 1, :cfg.vocab_size]))
    generated = sampling.generate_ids(model, [int(i) for i in tokens_BT[0, :prompt]], 4, temperature=0.0, top_k=0, seed=0)
    assert generated == [int(i) for i in buffer_1T[0, prompt:prompt + 4]]


def test_adding_a_prefix_keeps_the_other_weights_init():
    """The prefix is made last: every other weight draws the same random numbers with
    or without it. Only the residual branches' output projections differ, by the
    residual scale's factor (the prefix's layers count in the depth)."""
    plain = nnx.state(Transformer(tiny(n_blocks=4), nnx.Rngs(0))).to_pure_dict()
    with_prefix = nnx.state(Transformer(tiny(**PREFIX), nnx.Rngs(0))).to_pure_dict()
    assert set(with_prefix) - set(plain) == {"prefix"}
    factor = np.sqrt((4 + 2) / 4)  # 1 / sqrt(2 x layers): 4 layers without, 6 with
    for path, want in jax.tree_util.tree_flatten_with_path(plain)[0]:
        got = with_prefix
        for k in path:
            got = got[k.key]
        if path[-1].key in ("wo_HKD", "w_down_FD", "w_down_EFD"):
            np.testing.assert_allclose(got * factor, want, rtol=1e-6, err_msg=jax.tree_util.keystr(path))
        else:
            np.testing.assert_array_equal(got, want, err_msg=jax.tree_util.keystr(path))


def test_negative_first_dense_is_a_config_error():
    with pytest.raises(ConfigError, match=r"--model\.first_dense \(-1\) must be >= 0"):
        parse_args(["--model.first_dense", "-1"])



def test_planner_puts_the_prefix_on_the_first_stage():
    """Per-stage FLOPs sum to the model's; the first stage carries the prefix (what
    the same model without one lacks), the last the output layer; the plan charges the
    prefix's time on stage 0 and its activations."""
    m = tiny(**PREFIX)
    stages, without = stage_flops_per_token(m, 2), stage_flops_per_token(tiny(n_blocks=4), 2)
    assert sum(stages) == pytest.approx(flops_per_token(m))
    assert stages[0] - without[0] == pytest.approx(part_flops_per_token(m)["prefix"]) and stages[1] == pytest.approx(without[1])
    cfg = apply_overrides(prefix_config((1, 2, 1)), {"model": dict(dtype="float32")})
    plan = costs.plan(cfg, 0, "tpu-v5p")
    assert plan["stage_flops_per_token"] == stages and plan["times"]["prefix_imbalance"] > 0
    assert any(k.startswith("dense prefix (stage 0)") for k in plan["activations"])
    assert costs.plan(tiny_config((1, 2, 1), n_blocks=4), 0, "tpu-v5p")["times"]["prefix_imbalance"] == 0
