"""--model.moe_kernel: the dropless experts through megablox's grouped matmul (gmm, in
interpret mode on CPU) compute what jax.lax.ragged_dot computes, forward and backward,
in float32; bad combinations are one-line ConfigErrors."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_parallel import assert_same_steps, tiny_config, train_steps

from moe import grouped_matmul
from utils import ConfigError, parse_args


@pytest.mark.parametrize("rows, tokens_per_expert", [(200, [50, 0, 70, 80]), (37, [9, 20, 0, 3])],
                         ids=["rows-past-one-tile", "a-rest-past-the-runs"])
def test_gmm_equals_ragged_dot_with_gradients(rows, tokens_per_expert):
    """200 rows pad to two row tiles of 128; in the second case 5 rows follow the experts'
    runs (as rows of other devices' experts would), and must come out 0 with 0 gradient."""
    x_key, w_key, cot_key = jax.random.split(jax.random.key(0), 3)
    x_NI, w_EIO = jax.random.normal(x_key, (rows, 32)), jax.random.normal(w_key, (4, 32, 16))
    cot_NO = jax.random.normal(cot_key, (rows, 16))
    sizes_E = jnp.asarray(tokens_per_expert, jnp.int32)

    def loss_and_grads(kernel):
        loss = lambda x_NI, w_EIO: jnp.sum(jnp.sin(grouped_matmul(kernel, x_NI, w_EIO, sizes_E)) * cot_NO)  # noqa: E731
        return jax.value_and_grad(loss, (0, 1))(x_NI, w_EIO)

    (loss, (dx, dw)), (ref_loss, (ref_dx, ref_dw)) = loss_and_grads("gmm"), loss_and_grads("ragged_dot")
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for got, want in ((dx, ref_dx), (dw, ref_dw)):
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
    rest = int(sizes_E.sum())
    assert np.all(np.asarray(dx[rest:]) == 0) and np.all(np.isfinite(dx))


@pytest.mark.slow
def test_two_gmm_steps_equal_ragged_dot():
    """Loss, aux loss, grad norm, expert counts, every gradient (Adam's moments) and the
    params after 2 dropless train steps of the tiny model on one device."""
    gmm, ragged = (train_steps(tiny_config(capacity_factor=0.0, moe_kernel=kernel)) for kernel in ("gmm", "ragged_dot"))
    assert_same_steps(gmm, ragged)


@pytest.mark.parametrize("argv, message", [
    (["--model.moe_kernel", "gmm"], "--model.moe_kernel gmm computes dropless experts: set --model.capacity_factor 0 (got 1.5)"),
    (["--model.moe_kernel", "megablox", "--model.capacity_factor", "0"],
     "--model.moe_kernel must be one of auto, ragged_dot, gmm, got 'megablox'"),
])
def test_bad_kernel_flags_get_one_line(argv, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as error:
        parse_args(argv)
    assert "\n" not in str(error.value)
