"""--model.attention blockwise (ops/blockwise.py): MLA attention over key blocks
with an online softmax and a hand-written backward equals the plain attention on a
causal sequence of 1024 tokens, forward and gradients (float32, one CPU device), and
its compiled temporaries grow linearly in T where the plain attention's grow as T^2.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model import MLAttention, rope_angles
from ops.blockwise import blockwise_attention
from utils import ConfigError, parse_args

T_LONG, BLOCK = 1024, 128


def small_attention_config(**overrides):
    cfg = parse_args(["--preset", "tiny", "--model.dtype", "float32", "--model.seq_len", str(T_LONG)]).model
    return dataclasses.replace(cfg, n_heads=2, head_dim=16, rope_dim=8, q_latent=32, kv_latent=16, d_model=32, **overrides)


def test_blockwise_equals_matmul_attention_forward_and_gradients():
    """MLAttention with the blockwise kernel (8 x 8 blocks of 128, the blocks above the
    diagonal skipped) against the same weights with the matmul kernel: the output and
    the gradients of every weight and of the input agree within 1e-5."""
    cfg = small_attention_config(attention="matmul")
    attn = MLAttention(cfg, nnx.Rngs(0))
    graphdef, params = nnx.split(attn)
    B = 2
    x_BTD = jax.random.normal(jax.random.key(1), (B, T_LONG, attn.wq_down_DQ.shape[0]))
    angles = rope_angles(jnp.arange(T_LONG)[None], cfg)
    w_BTD = jax.random.normal(jax.random.key(2), x_BTD.shape)  # a loss that weighs every output differently

    def run(implementation):
        def loss(params, x_BTD):
            module = nnx.merge(graphdef, params)
            module.implementation, module.block = implementation, BLOCK
            y_BTD = module(x_BTD, angles)
            return jnp.sum(y_BTD * w_BTD), y_BTD
        return jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(params, x_BTD)

    (grads, d_x), y = run("blockwise")
    (ref_grads, ref_d_x), ref_y = run("matmul")
    np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-5)
    assert np.abs(ref_y).mean() > 1e-2
    np.testing.assert_allclose(d_x, ref_d_x, rtol=1e-5, atol=1e-5)
    for (path, g), (_, ref_g) in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves_with_path(ref_grads)):
        assert np.abs(ref_g).max() > 0, path
        # atol 2e-5: wo's gradient sums B x T = 2048 products per element in another order
        # (one element of 1024 differs by 1.8e-5 on a 2-core AMD EPYC, at 5e1a73d already)
        np.testing.assert_allclose(g, ref_g, rtol=1e-5, atol=2e-5, err_msg=jax.tree_util.keystr(path))


def temporaries(T, blockwise, B=1, H=2, K=16, R=8):
    """Bytes of temporaries of the compiled forward + backward of causal attention at T."""
    def loss(q_nope, q_rope, k_nope, k_rope, v):
        positions_T = jnp.arange(T)
        if blockwise:
            out = blockwise_attention(q_nope, q_rope, k_nope, k_rope, v, positions_T, positions_T, 0.2, BLOCK)
        else:
            scores = jnp.einsum("bthk,bshk->bhts", q_nope, k_nope) + jnp.einsum("bthr,bsr->bhts", q_rope, k_rope)
            scores = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores * 0.2, -jnp.inf)
            out = jnp.einsum("bhts,bshk->bthk", jax.nn.softmax(scores, -1), v)
        return jnp.sum(out * out)
    shapes = [jax.ShapeDtypeStruct(s, jnp.float32) for s in [(B, T, H, K), (B, T, H, R), (B, T, H, K), (B, T, R), (B, T, H, K)]]
    compiled = jax.jit(jax.grad(loss, argnums=range(5))).lower(*shapes).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_blockwise_temporaries_grow_linearly_in_T():
    """T = 2048 -> 4096: the blockwise kernel's temporaries at most ~double (measured
    2.3 -> 4.2 MB), the plain kernel's quadruple (168 -> 672 MB): the measurement can
    tell the two apart."""
    blockwise = temporaries(2 * T_LONG, True), temporaries(4 * T_LONG, True)
    plain = temporaries(2 * T_LONG, False), temporaries(4 * T_LONG, False)
    assert blockwise[1] <= 2.2 * blockwise[0], blockwise
    assert plain[1] >= 3.5 * plain[0], plain
    assert blockwise[1] < plain[0] / 10


@pytest.mark.parametrize("argv, message", [
    (["--model.attention", "blockwise", "--model.attention_block", "48"], r"--model.attention_block \(48\) must divide --model.seq_len \(128\)"),
    (["--model.attention", "flash"], "must be one of auto, matmul, dot_product_attention, blockwise, splash, got 'flash'"),
])
def test_bad_attention_flags_are_one_line_errors(argv, message):
    with pytest.raises(ConfigError, match=message) as error:
        parse_args(argv)
    assert "\n" not in str(error.value)
