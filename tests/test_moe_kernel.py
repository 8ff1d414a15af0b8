"""--model.moe_kernel: the dropless experts through megablox's grouped matmul (gmm, in
interpret mode on CPU) compute what jax.lax.ragged_dot computes, forward and backward,
in float32; dropless experts under expert parallelism equal one device; bad
combinations are one-line ConfigErrors."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ops.gmm import GMM_TILE_BYTES, gmm_tiling, grouped_matmul
from parallel.mesh import check_config_fits_mesh
from test_parallel import assert_same_steps, mesh_for, tiny_config, train_steps
from utils import ConfigError, apply_overrides, parse_args


@pytest.mark.parametrize("rows, tokens_per_expert, n_in, n_out", [(200, [50, 0, 70, 80], 32, 16), (37, [9, 20, 0, 3], 32, 16),
                                                                    (200, [50, 0, 70, 80], 1024, 384)],
                         ids=["rows-past-one-tile", "a-rest-past-the-runs", "lane-tiles"])
def test_gmm_equals_ragged_dot_with_gradients(rows, tokens_per_expert, n_in, n_out):
    """200 rows pad to two row tiles of 128; in the second case 5 rows follow the experts'
    runs (as rows of other devices' experts would), and must come out 0 with 0 gradient;
    in the third the weights are tiled in lanes: 1024 inputs in two tiles of 512, 384
    outputs whole (and the backward's own tiles: gmm_tiling)."""
    x_key, w_key, cot_key = jax.random.split(jax.random.key(0), 3)
    x_NI, w_EIO = jax.random.normal(x_key, (rows, n_in)), jax.random.normal(w_key, (4, n_in, n_out))
    cot_NO = jax.random.normal(cot_key, (rows, n_out))
    sizes_E = jnp.asarray(tokens_per_expert, jnp.int32)

    def loss_and_grads(matmul):
        loss = lambda x_NI, w_EIO: jnp.sum(jnp.sin(matmul(x_NI, w_EIO, sizes_E)) * cot_NO)  # noqa: E731
        return jax.value_and_grad(loss, (0, 1))(x_NI, w_EIO)

    (loss, (dx, dw)), (ref_loss, (ref_dx, ref_dw)) = loss_and_grads(grouped_matmul), loss_and_grads(jax.lax.ragged_dot)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for got, want in ((dx, ref_dx), (dw, ref_dw)):
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
    rest = int(sizes_E.sum())
    assert np.all(np.asarray(dx[rest:]) == 0) and np.all(np.isfinite(dx))


def test_gmm_tiles_read_the_rows_once_within_the_tile_budget():
    """The rows are read once per n tile and the weights once per row tile (megablox's
    cost_estimate), so n is whole where a [tk, tn] float32 block fits GMM_TILE_BYTES;
    DeepSeek-V2-Lite's experts (2048 x 1408, and back) and DeepSeek-V3's (7168 x 2048)."""
    assert gmm_tiling(12288, 2048, 1408) == (128, 512, 1408)
    assert gmm_tiling(12288, 1408, 2048) == (128, 128, 2048)  # (1408 = 11 x 128: no wider tile divides it)
    assert gmm_tiling(100, 7168, 2048) == (100, 512, 2048)
    tm, tk, tn = gmm_tiling(4096, 2048, 7168)
    assert 7168 % tn == 0 and tn % 128 == 0 and tk * tn * 4 <= GMM_TILE_BYTES < tk * 7168 * 4
    assert gmm_tiling(256, 64, 96) == (128, 64, 96)  # dims not in lanes: whole


@pytest.fixture(scope="module")
def ragged_dot_steps():
    return train_steps(tiny_config(capacity_factor=0.0, moe_kernel="ragged_dot"))


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape, expert_parallel", [((1, 1, 1), False), ((2, 1, 2), False), ((2, 1, 2), True)],
                         ids=["1x1x1", "dp2xtp2", "dp2xtp2-ep"])
def test_two_gmm_steps_equal_ragged_dot(ragged_dot_steps, mesh_shape, expert_parallel):
    """Loss, aux loss, grad norm, expert counts, every gradient (Adam's moments) and the
    params after 2 dropless train steps of the tiny model, against ragged_dot on one
    device: gmm on one device, on dp2 x tp2 (each device's kernel over its rows and its
    half of d_expert), and with the experts over dp (4 per device, each device's kernel
    over the pairs of its own experts)."""
    gmm = train_steps(tiny_config(mesh_shape, expert_parallel, capacity_factor=0.0, moe_kernel="gmm"))
    assert_same_steps(gmm, ragged_dot_steps)


@pytest.mark.parametrize("argv, message", [
    (["--model.moe_kernel", "gmm"], "--model.moe_kernel gmm computes dropless experts: set --model.capacity_factor 0 (got 1.5)"),
    (["--model.moe_kernel", "megablox", "--model.capacity_factor", "0"],
     "--model.moe_kernel must be one of auto, ragged_dot, gmm, got 'megablox'"),
])
def test_bad_kernel_flags_get_one_line(argv, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as error:
        parse_args(argv)
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_dropless_expert_parallel_equals_one_device():
    """Experts over dp 4 (2 of the 8 per device) beside tp 2, no capacity: each device
    gathers the 4 devices' groups and runs its own experts' pairs; 2 steps equal one device."""
    reference = train_steps(tiny_config(capacity_factor=0.0, moe_kernel="ragged_dot"))
    assert_same_steps(train_steps(tiny_config((4, 1, 2), expert_parallel=True, capacity_factor=0.0, moe_kernel="ragged_dot")),
                      reference)


@pytest.mark.parametrize("mesh_shape, expert_parallel, sharding, message", [
    ((2, 1, 1), False, "auto", "--model.moe_kernel gmm on 2 devices needs --mesh.sharding manual (the compiler does not partition "
                               "the kernel); use --model.moe_kernel ragged_dot"),
    ((2, 1, 1), True, "auto", "--mesh.expert_parallel with dropless experts (--model.capacity_factor 0) needs --mesh.sharding manual"),
], ids=["gmm-auto-sharding", "dropless-expert-parallel-auto"])
def test_mesh_refusals_get_one_line(mesh_shape, expert_parallel, sharding, message):
    cfg = tiny_config(mesh_shape, expert_parallel, capacity_factor=0.0, moe_kernel="gmm" if "gmm" in message else "ragged_dot")
    cfg = apply_overrides(cfg, {"mesh": dict(sharding=sharding)})
    with pytest.raises(ConfigError, match=re.escape(message)) as error:
        check_config_fits_mesh(cfg, mesh_for(cfg))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("platform, sharding, kernel, expected", [
    ("tpu", "auto", "auto", "ragged_dot"), ("tpu", "manual", "auto", "gmm"), ("cpu", "manual", "auto", "ragged_dot"),
    ("tpu", "auto", "gmm", "gmm")])
def test_auto_kernel_is_gmm_on_a_tpu_under_manual_sharding(platform, sharding, kernel, expected):
    """--model.moe_kernel auto is megablox on a TPU, but not under --mesh.sharding auto:
    its partitioner cannot split the kernel, so main.py (and the planner's TPU compile,
    utils.kernels_for) read it as ragged_dot there (an explicit gmm is left to the mesh
    check's one-line refusal above)."""
    from utils import kernels_for
    cfg = parse_args(["--mesh.sharding", sharding, "--model.moe_kernel", kernel, "--model.capacity_factor", "0"])
    assert kernels_for(cfg, platform).model.moe_kernel == expected
