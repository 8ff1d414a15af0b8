"""--model.attention splash (ops/splash.py): MLA attention through JAX's Pallas
splash kernel, run in interpret mode on CPU, equals the matmul attention (float32):
one attention layer's output, max logits and gradients, and two whole train steps
(losses, grad norms, every gradient leaf via the optimizer moments, the params) on one
device and on dp2 x tp2 (each device's kernel over its own heads). Bad flags are
one-line errors.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_blockwise_attention import small_attention_config

from model import MLAttention, rope_angles
from test_parallel import assert_same_steps, tiny_config, train_steps
from utils import ConfigError, apply_overrides, parse_args

T = 256  # two blocks of 128 (the kernel's smallest): one skipped above the diagonal


def test_splash_equals_matmul_attention_forward_max_logits_and_gradients():
    cfg = small_attention_config(attention="matmul", seq_len=T)
    graphdef, params = nnx.split(MLAttention(cfg, nnx.Rngs(0)))
    x_BTD = jax.random.normal(jax.random.key(1), (2, T, cfg.d_model))
    angles = rope_angles(jnp.arange(T)[None], cfg)
    w_BTD = jax.random.normal(jax.random.key(2), x_BTD.shape)  # a loss that weighs every output differently

    def run(implementation):
        def loss(params, x_BTD):
            module = nnx.merge(graphdef, params)
            module.implementation, module.block = implementation, 128
            y_BTD, max_logit_H = module.with_max_logits(x_BTD, angles)
            return jnp.sum(y_BTD * w_BTD), (y_BTD, max_logit_H)
        return jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(params, x_BTD)

    (grads, d_x), (y, max_logit) = run("splash")
    (ref_grads, ref_d_x), (ref_y, ref_max_logit) = run("matmul")
    np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-5)
    assert np.abs(ref_y).mean() > 1e-2
    np.testing.assert_allclose(max_logit, ref_max_logit, rtol=1e-5)
    np.testing.assert_allclose(d_x, ref_d_x, rtol=1e-5, atol=1e-5)
    for (path, g), (_, ref_g) in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves_with_path(ref_grads)):
        assert np.abs(ref_g).max() > 0, path
        np.testing.assert_allclose(g, ref_g, rtol=1e-5, atol=1e-5, err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def matmul_steps():
    return train_steps(tiny_config(seq_len=128, n_blocks=2, attention="matmul"))


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [(1, 1, 1), (2, 1, 2)], ids=["1x1x1", "dp2xtp2"])
def test_two_splash_train_steps_equal_matmul(matmul_steps, mesh_shape):
    """The tiny model at T = 128 (one block), 2 blocks: two AdamW steps."""
    assert_same_steps(train_steps(tiny_config(mesh_shape, seq_len=128, n_blocks=2, attention="splash")), matmul_steps)


@pytest.fixture(scope="module")
def long_matmul_steps():
    return train_steps(tiny_config(seq_len=512, routing_group=128, n_blocks=2, attention="matmul"))


@pytest.mark.slow
def test_two_splash_train_steps_on_cp2_x_tp2_equal_matmul(long_matmul_steps):
    """T = 512 on cp 2 (chunks of 128: each rank's kernel skips the key blocks its two
    chunks cannot see, a different set per rank) x tp 2, against matmul on one device."""
    cfg = apply_overrides(tiny_config((1, 1, 2), seq_len=512, routing_group=128, n_blocks=2, attention="splash"),
                          {"mesh": dict(cp=2)})
    assert_same_steps(train_steps(cfg), long_matmul_steps)


@pytest.mark.parametrize("argv, message", [
    (["--model.attention", "splash", "--model.seq_len", "384", "--model.attention_block", "256"],
     r"--model.attention_block \(256\) must divide --model.seq_len \(384\)"),
    (["--model.attention", "splash", "--model.seq_len", "256", "--model.attention_block", "64"],
     r"splash needs blocks of a multiple of 128 tokens .* gives 64"),
    (["--model.attention", "splash", "--model.seq_len", "256", "--model.routing_group", "64", "--mesh.cp", "2"],
     r"splash needs blocks of a multiple of 128 tokens .*: --model.attention_block 512 at --model.seq_len / \(2 x --mesh.cp\) "
     r"= 64 gives 64"),
    (["--model.attention", "splash", "--model.seq_len", "768", "--model.routing_group", "64", "--mesh.cp", "2",
      "--model.attention_block", "128"],
     r"--model.attention_block \(128\) must divide --model.seq_len / \(2 x --mesh.cp\) = 192 \(blocks within a chunk\)"),
    (["--model.attention", "splash", "--model.seq_len", "128", "--mesh.sharding", "auto"],
     r"--model.attention splash needs --mesh.sharding manual"),
])
def test_bad_splash_flags_are_one_line_errors(argv, message):
    with pytest.raises(ConfigError, match=message) as error:
        parse_args(["--preset", "tiny", *argv])
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("argv, platform, expected", [
    (["--model.seq_len", "1024"], "tpu", "splash"),
    (["--model.seq_len", "1024"], "cpu", "matmul"),
    (["--model.seq_len", "1024"], "gpu", "matmul"),
    (["--model.seq_len", "1024", "--mesh.sharding", "auto"], "tpu", "matmul"),
    (["--model.seq_len", "64"], "tpu", "matmul"),  # one block of 64: not a multiple of the kernel's 128 lanes
    (["--model.seq_len", "1024", "--model.attention", "blockwise"], "tpu", "blockwise"),
])
def test_auto_attention_is_splash_on_a_tpu_where_the_kernel_runs(argv, platform, expected):
    """--model.attention auto (the default): main.py decides it for its platform, the
    planner and its TPU compile for the chips planned (utils.kernels_for); a model built
    from an undecided config runs matmul, as off a TPU."""
    from utils import kernels_for
    cfg = parse_args(["--preset", "tiny", "--model.routing_group", "64", *argv])
    assert kernels_for(cfg, platform).model.attention == expected
    if "--model.attention" not in argv:
        assert cfg.model.attention == "auto"
        assert MLAttention(cfg.model, nnx.Rngs(0)).implementation == "matmul"
