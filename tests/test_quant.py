"""Quantized training (--model.quant, quant.py): the 8-bit products are the dequantized
products they claim to be, forward and backward, and a quantized step on a mesh equals
the quantized step on one device (float32, test_parallel's bound)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import quant
from test_parallel import assert_same_steps, tiny_config, train_steps
from utils import Config, ConfigError, apply_overrides, validate_model


def random(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def int8_by_hand(a, axis):
    """(a's int8 values, its scales): absmax / 127 over `axis`, round to nearest, in numpy."""
    a = np.asarray(a, np.float64)
    scale = np.abs(a).max(axis=axis, keepdims=True) / 127
    return np.clip(np.round(a / scale), -127, 127), scale


def test_int8_forward_is_the_dequantized_product():
    x_NI, w_IO = random((16, 64), 0), random((64, 24), 1)
    y_NO = np.asarray(quant.quantized_dot(x_NI, w_IO, "int8", (), (), 8))
    (xq, sx), (wq, sw) = int8_by_hand(x_NI, 1), int8_by_hand(w_IO, 0)
    assert len(np.unique(xq)) > 100 and np.all(np.abs(xq) <= 127)  # int8 values, the range used
    np.testing.assert_allclose(y_NO, (xq * sx) @ (wq * sw), rtol=1e-5, atol=1e-5)
    exact_NO = np.asarray(x_NI, np.float64) @ np.asarray(w_IO, np.float64)
    error = np.linalg.norm(y_NO - exact_NO) / np.linalg.norm(exact_NO)
    assert 1e-4 < error < 1e-2, error  # quantized (not the exact product), within int8's error


def test_int8_backward_quantizes_both_gradient_matmuls():
    """dx = q(dy) q(w)^T with dy per row and w per input row; dw = sum over tiles of rows
    of q(x_tile)^T q(dy_tile), per (tile, channel) scales."""
    x_NI, w_IO, dy_NO, tile = random((16, 32), 2), random((32, 24), 3), random((16, 24), 4), 8
    _, vjp = jax.vjp(lambda x, w: quant.quantized_dot(x, w, "int8", (), (), tile), x_NI, w_IO)
    dx_NI, dw_IO = (np.asarray(g) for g in vjp(dy_NO))
    (dyq, sdy), (wq, sw) = int8_by_hand(dy_NO, 1), int8_by_hand(w_IO, 1)
    np.testing.assert_allclose(dx_NI, (dyq * sdy) @ (wq * sw).T, rtol=1e-5, atol=1e-5)
    want_IO = sum((xq * sx).T @ (gq * sg) for (xq, sx), (gq, sg) in
                  ((int8_by_hand(x_NI[k:k + tile], 0), int8_by_hand(dy_NO[k:k + tile], 0)) for k in range(0, 16, tile)))
    np.testing.assert_allclose(dw_IO, want_IO, rtol=1e-5, atol=1e-5)
    exact_IO = np.asarray(x_NI).T @ np.asarray(dy_NO)
    assert 1e-4 < np.linalg.norm(dw_IO - exact_IO) / np.linalg.norm(exact_IO) < 2e-2


def test_fp8_is_near_the_exact_product_and_not_it():
    x_NI, w_IO = random((16, 64), 5), random((64, 24), 6)
    exact_NO = np.asarray(x_NI @ w_IO)
    y_NO = np.asarray(quant.quantized_dot(x_NI, w_IO, "fp8", (), (), 16))
    error = np.linalg.norm(y_NO - exact_NO) / np.linalg.norm(exact_NO)
    assert 1e-3 < error < 5e-2, error  # e4m3's 3 mantissa bits: a few percent per element, less in the sum


def test_ragged_dot_quantizes_each_expert_with_its_own_scales():
    """Rows of expert e times expert e's weights equal quantized_dot of that run alone;
    rows past the runs are 0; dx is the plain product's within int8's error."""
    x_NI, w_EIO, sizes_E = random((12, 16), 7), random((3, 16, 8), 8), jnp.asarray([4, 0, 6])
    y_NO = np.asarray(quant.quantized_ragged_dot(x_NI, w_EIO, sizes_E, "int8", (), ()))
    np.testing.assert_allclose(y_NO[:4], quant.quantized_dot(x_NI[:4], w_EIO[0], "int8", (), (), 4), rtol=1e-6)
    np.testing.assert_allclose(y_NO[4:10], quant.quantized_dot(x_NI[4:10], w_EIO[2], "int8", (), (), 6), rtol=1e-6)
    np.testing.assert_array_equal(y_NO[10:], 0)
    grads = jax.grad(lambda x: jnp.sum(quant.quantized_ragged_dot(x, w_EIO, sizes_E, "int8", (), ()) ** 2))(x_NI)
    exact = jax.grad(lambda x: jnp.sum(jax.lax.ragged_dot(x, w_EIO, sizes_E) ** 2))(x_NI)
    assert 1e-4 < np.linalg.norm(grads - exact) / np.linalg.norm(exact) < 2e-2


@pytest.mark.parametrize("model, message", [
    (dict(quant="int4"), "--model.quant must be one of none, int8, fp8"),
    (dict(quant="int8", moe_kernel="gmm", capacity_factor=0.0), "--model.quant int8 runs the dropless experts through ragged_dot"),
])
def test_bad_quant_raises_one_line(model, message):
    with pytest.raises(ConfigError, match=message):
        validate_model(apply_overrides(Config(), {"model": model}))


# ----------------------------------------------------------------------------
# A quantized step on a mesh equals the quantized step on one device


@pytest.fixture(scope="module")
def quantized_reference():
    return {}


def reference_for(cache, **model):
    key = tuple(sorted(model.items()))
    if key not in cache:
        cache[key] = train_steps(tiny_config(**model))
    return cache[key]


MESH_CASES = [  # (dp, pp, tp), expert parallelism, model overrides
    pytest.param((2, 1, 2), False, dict(quant="int8"), id="int8-dp2xtp2"),
    pytest.param((1, 2, 1), False, dict(quant="int8"), id="int8-pp2", marks=pytest.mark.slow),
    pytest.param((4, 1, 1), True, dict(quant="int8"), id="int8-ep4", marks=pytest.mark.slow),
    pytest.param((2, 1, 2), True, dict(quant="int8", capacity_factor=0.0), id="int8-dropless-ep2xtp2", marks=pytest.mark.slow),
    pytest.param((2, 1, 2), False, dict(quant="fp8", block_pattern="D", ffn_activation="gelu"), id="fp8-dense-dp2xtp2",
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("mesh_shape, expert_parallel, model", MESH_CASES)
def test_quantized_steps_equal_one_quantized_device(quantized_reference, mesh_shape, expert_parallel, model):
    reference = reference_for(quantized_reference, **model)
    assert_same_steps(train_steps(tiny_config(mesh_shape, expert_parallel, **model)), reference)


def test_quantization_changes_the_step(quantized_reference):
    """The quantized one-device step is not the unquantized one (the quantized path runs)."""
    quantized, plain = reference_for(quantized_reference, quant="int8"), train_steps(tiny_config())
    loss, plain_loss = quantized[0][0]["loss"], plain[0][0]["loss"]
    assert loss != plain_loss and abs(loss - plain_loss) < 1e-2 * abs(plain_loss)
