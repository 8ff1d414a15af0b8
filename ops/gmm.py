"""--model.moe_kernel gmm: the dropless experts' grouped matmul through megablox, the
Pallas TPU kernel that skips the tiles of other experts (interpret mode off a TPU).
Shape legend: model.py's docstring; P is N padded to the row tile."""

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox import ops as megablox_ops

from ops.collectives import varying_like
from ops.kernel_calls import interpret_kernels, unchecked

GMM_ROW_TILE = 128  # megablox's default m tile; the sorted (token, choice) rows are padded to a multiple of it
GMM_LANE_TILE = 128  # a TPU block's lanes: a k or n tile is a multiple of them, or a whole dim
GMM_K_TILE = 512  # the most of k a tile takes
GMM_TILE_BYTES = 4 * 2**20  # the most a float32 [tk, tn] tile may take (tgmm's output block, double-buffered in VMEM)


def gmm_tiling(m_padded, k, n):
    """(tm, tk, tn) for megablox.gmm of [m, k] rows by [E, k, n] weights. The kernel
    reads the rows once per n tile and each expert's [k, n] weights once per row tile
    (its cost_estimate), so n is taken whole or in the widest lane-multiple tile that
    divides it with a [tk, tn] float32 block within GMM_TILE_BYTES, and k in tiles of up
    to GMM_K_TILE (DeepSeek-V2-Lite's experts: 1.5 GB of HBM traffic per gmm call with
    128-wide tiles, 1.0 GB so; docs/peers.md). A dim that does not divide by 128 is whole."""
    def tile(d, most):
        fits = [t for t in range(GMM_LANE_TILE, min(d, most) + 1, GMM_LANE_TILE) if d % t == 0]
        return max(fits) if d % GMM_LANE_TILE == 0 and fits else d
    tk = tile(k, GMM_K_TILE)
    return min(GMM_ROW_TILE, m_padded), tk, tile(n, GMM_TILE_BYTES // (4 * tk))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def typed_gmm(x_PI, w_EIO, sizes_E, tiling, interpret):
    """megablox's gmm with its backward (gmm for the input's gradient, tgmm for the
    weights', as megablox.ops does), each result typed as varying over what x_PI and
    w_EIO vary over. Inside a shard_map both arrive with the same varying axes
    (`grouped_matmul` casts them first), so no cotangent needs a psum here."""
    return gmm_forward(x_PI, w_EIO, sizes_E, tiling, interpret)


def gmm_forward(x_PI, w_EIO, sizes_E, tiling, interpret):
    kernel = functools.partial(megablox_ops.backend.gmm, preferred_element_type=x_PI.dtype, tiling=tiling, interpret=interpret)
    return varying_like(unchecked(kernel, x_PI, w_EIO, sizes_E), x_PI, w_EIO)


def typed_gmm_fwd(x_PI, w_EIO, sizes_E, tiling, interpret):
    return gmm_forward(x_PI, w_EIO, sizes_E, tiling, interpret), (x_PI, w_EIO, sizes_E)


def typed_gmm_bwd(tiling, interpret, residuals, dy_PO):
    x_PI, w_EIO, sizes_E = residuals
    kernels = megablox_ops.backend
    dx_tiling = gmm_tiling(x_PI.shape[0], w_EIO.shape[2], w_EIO.shape[1])  # (dy [P, O] by the weights transposed: O contracted)
    dx_kernel = functools.partial(kernels.gmm, preferred_element_type=x_PI.dtype, tiling=dx_tiling, transpose_rhs=True,
                                  interpret=interpret)
    dw_kernel = functools.partial(kernels.tgmm, preferred_element_type=w_EIO.dtype, tiling=tiling,
                                  num_actual_groups=w_EIO.shape[0], interpret=interpret)
    dx_PI = unchecked(dx_kernel, dy_PO, w_EIO, sizes_E)
    dw_EIO = unchecked(dw_kernel, x_PI.swapaxes(0, 1), dy_PO, sizes_E)
    return varying_like(dx_PI, x_PI), varying_like(dw_EIO, w_EIO), None


typed_gmm.defvjp(typed_gmm_fwd, typed_gmm_bwd)


def grouped_matmul(x_NI, w_EIO, tokens_per_expert_E):
    """Rows of x_NI (sorted by expert, the runs of tokens_per_expert_E first, any rest
    after them) times their expert's weights; the rest's rows are 0 (jax.lax.ragged_dot's
    contract, through megablox).

    The rows are padded to a multiple of the row tile. The kernel leaves rows past the
    experts' runs unwritten (in both directions), so they are selected away on the way
    out and on the way back, never multiplied."""
    N, n_in = x_NI.shape
    padded = -N % min(GMM_ROW_TILE, N)
    written_P1 = (jnp.arange(N + padded) < jnp.sum(tokens_per_expert_E))[:, None]
    x_PI = jnp.where(written_P1, jnp.pad(x_NI, ((0, padded), (0, 0))), 0)
    w_EIO = w_EIO.astype(x_NI.dtype)
    # One varying type for both (the casts' transposes sum the gradients of whatever is replicated).
    x_PI, w_EIO = varying_like(x_PI, w_EIO), varying_like(w_EIO, x_PI)
    tiling = gmm_tiling(N + padded, n_in, w_EIO.shape[2])
    y_PO = typed_gmm(x_PI, w_EIO, tokens_per_expert_E.astype(jnp.int32), tiling, interpret_kernels())
    return jnp.where(written_P1, y_PO, 0)[:N]
