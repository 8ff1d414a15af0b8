"""Quantized training matmuls (--model.quant int8 | fp8): the weight matmuls of attention,
the experts and the dense FFN run with 8-bit operands, forward and backward.

Each product quantizes both operands with scales constant along the contraction, multiplies
the 8-bit values (int8 accumulates in int32, fp8 in float32) and multiplies the scales back
in. Gradients are straight-through: the backward is the plain product's, with its two
matmuls quantized the same way. Scales (absmax / the format's largest value):

  forward   y_NO = x_NI @ w_IO     x per row (over I), w per output column (over I)
  backward dx_NI = dy_NO @ w_IO^T  dy per row (over O), w per input row (over O)
           dw_IO = x_NI^T @ dy_NO  per tile of rows (one sequence; a routing group's slots):
                                   x per (tile, I), dy per (tile, O), the tiles' products
                                   summed in float32

Mesh invariance: a scale must not change when a mesh splits the dim it is reduced over.
Under tensor parallelism the contraction (row-parallel: w_down_FD, wo_HKD) or the output
(column-parallel) is split over tp: those scales are pmax'ed over tp (`in_axis`,
`out_axis`), so every tp rank quantizes with the one-device scale. FSDP gathers a weight
before its matmul, and expert parallelism splits experts (each has its own scales). The
rows of dw's contraction are split by dp and by microbatches, so its scales are per tile of
rows that no split cuts (one sequence: dp and microbatches split the batch, never a
sequence). Context parallelism cuts sequences: under cp > 1 dw's tiles are the local chunks,
and a quantized step is not the one-device step.

Attention's own products under --model.attention matmul (the scores q.k, the probabilities
times the values) run in 8 bits too (quantized_matmul): a batch of products over the heads
whose contraction is a head dim or the keys, each scale per row or column along it. No mesh
splits those (tp splits heads, a batch dim; cp gathers the keys whole); the backward's sums
over the queries are cut by cp as dw's rows are. blockwise, splash and dot_product_attention
keep theirs in --model.dtype (fused kernels: no 8-bit path inside them).

fp8 uses e4m3 for activations and weights and e5m2 (more range) for gradients, as
Micikevicius et al. 2022 (arXiv:2209.05433) and DeepSeek-V3 do.
"""

import functools

import jax
import jax.numpy as jnp

from ops.collectives import live_axes
from utils import ConfigError

# TPU generations without fp8 matmul units: v4, v5e, v5p, v6e (Cloud TPU's published peaks list
# bf16 and int8 only; fp8 arrives with v7 Ironwood, 4614 fp8 TFLOP/s). device_kind prefixes.
TPUS_WITHOUT_FP8 = ("TPU v2", "TPU v3", "TPU v4", "TPU v5", "TPU v6")

# mode -> (dtype of activations and weights, dtype of gradients)
FORMATS = {"int8": (jnp.int8, jnp.int8), "fp8": (jnp.float8_e4m3fn, jnp.float8_e5m2)}


def check_chip(quant_mode, device):
    """ConfigError for fp8 on a TPU without fp8 units; the one-line note to print when the
    chip runs 8-bit products without 8-bit units (a CPU: correct, slower than float32), else None."""
    if quant_mode == "fp8" and device.platform == "tpu" and device.device_kind.startswith(TPUS_WITHOUT_FP8):
        raise ConfigError(f"--model.quant fp8: a {device.device_kind} has no fp8 matmul units (v7 has); use --model.quant int8")
    if quant_mode != "none" and device.platform == "cpu":
        return (f"note: --model.quant {quant_mode} on CPU quantizes as on a chip (same numbers) but runs slower than "
                f"float32: XLA:CPU has no 8-bit matmul units")
    return None


def largest(dtype):
    """The largest magnitude a scaled value takes: 127 (symmetric int8), or fp8's largest finite."""
    return 127.0 if dtype == jnp.int8 else float(jnp.finfo(dtype).max)


def scale_of(x, axis, mesh_axes, dtype):
    """absmax / largest(dtype) over `axis` (kept as size 1), the max also taken over
    `mesh_axes` (a tuple of live manual axes, ops/collectives.live_axes) that split that dim. An
    all-zero slice gets scale 1."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axis, keepdims=True)
    amax = jax.lax.pmax(amax, mesh_axes) if mesh_axes else amax
    return jnp.where(amax > 0, amax / largest(dtype), 1.0)


def quantize(x, scale, dtype):
    """x / scale in `dtype`: int8 rounds to nearest and clips to +-127; fp8 rounds to nearest even."""
    scaled = x.astype(jnp.float32) / scale
    if dtype == jnp.int8:
        return jnp.clip(jnp.round(scaled), -127, 127).astype(jnp.int8)
    return scaled.astype(dtype)


def accumulator(dtype):
    return jnp.int32 if dtype == jnp.int8 else jnp.float32


def scaled_dot(a_q, b_q, dims, out_scale):
    """dot_general of two quantized operands (dims as lax.dot_general's), accumulated in
    int32 (int8) or float32 (fp8), times out_scale (both operands' scales, shaped to the
    output), in float32."""
    acc = jax.lax.dot_general(a_q, b_q, dims, preferred_element_type=accumulator(a_q.dtype))
    return acc.astype(jnp.float32) * out_scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def quantized_dot(x_NI, w_IO, mode, in_axis, out_axis, row_tile):
    """x_NI @ w_IO with 8-bit operands (see the module docstring), in x's dtype.
    in_axis / out_axis: the live manual mesh axes splitting I / O here (a tuple, () when
    not split; x and w must vary over the same axes, `same_varying`);
    row_tile: rows per tile of dw's scales (divides N)."""
    fmt, _ = FORMATS[mode]
    sx_N1 = scale_of(x_NI, 1, in_axis, fmt)
    sw_1O = scale_of(w_IO, 0, in_axis, fmt)
    y_NO = scaled_dot(quantize(x_NI, sx_N1, fmt), quantize(w_IO, sw_1O, fmt), (((1,), (0,)), ((), ())), sx_N1 * sw_1O)
    return y_NO.astype(x_NI.dtype)


def quantized_dot_fwd(x_NI, w_IO, mode, in_axis, out_axis, row_tile):
    return quantized_dot(x_NI, w_IO, mode, in_axis, out_axis, row_tile), (x_NI, w_IO)


def quantized_dot_bwd(mode, in_axis, out_axis, row_tile, residuals, dy_NO):
    x_NI, w_IO = residuals
    fmt, grad_fmt = FORMATS[mode]
    sdy_N1 = scale_of(dy_NO, 1, out_axis, grad_fmt)
    sw_I1 = scale_of(w_IO, 1, out_axis, fmt)
    dx_NI = scaled_dot(quantize(dy_NO, sdy_N1, grad_fmt), quantize(w_IO, sw_I1, fmt), (((1,), (1,)), ((), ())), sdy_N1 * sw_I1.T)
    tiles = x_NI.shape[0] // row_tile
    x_KTI, dy_KTO = x_NI.reshape(tiles, row_tile, -1), dy_NO.reshape(tiles, row_tile, -1)
    sx_K1I, sdy_K1O = scale_of(x_KTI, 1, (), fmt), scale_of(dy_KTO, 1, (), grad_fmt)
    dw_KIO = scaled_dot(quantize(x_KTI, sx_K1I, fmt), quantize(dy_KTO, sdy_K1O, grad_fmt), (((1,), (1,)), ((0,), (0,))),
                        sx_K1I.swapaxes(1, 2) * sdy_K1O)
    return dx_NI.astype(x_NI.dtype), jnp.sum(dw_KIO, axis=0).astype(w_IO.dtype)


quantized_dot.defvjp(quantized_dot_fwd, quantized_dot_bwd)


def same_varying(x, w):
    """x and w typed as varying over the union of their mesh axes (inside shard_map; a
    no-op outside), so the custom backward returns cotangents of its primals' types: the
    casts' transposes sum the gradient of whatever was replicated."""
    axes = set(jax.typeof(x).manual_axis_type.varying) | set(jax.typeof(w).manual_axis_type.varying)

    def vary(a):
        missing = tuple(axes - set(jax.typeof(a).manual_axis_type.varying))
        return jax.lax.pcast(a, missing, to="varying") if missing else a
    return vary(x), vary(w)


# ---- Attention's products: activations on both sides


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def quantized_matmul(a_xMK, b_xKN, mode):
    """a @ b over their shared leading (batch) dims with 8-bit operands, in float32: a per
    row, b per column, both over K. The backward as quantized_dot's, every scale along its
    product's contraction: dA = dY @ B^T (dY per row, B per row, over N), dB = A^T @ dY
    (A per column, dY per column, over M). Neither operand is a weight: no row tiles."""
    fmt, _ = FORMATS[mode]
    sa_xM1, sb_x1N = scale_of(a_xMK, -1, (), fmt), scale_of(b_xKN, -2, (), fmt)
    return scaled_dot(quantize(a_xMK, sa_xM1, fmt), quantize(b_xKN, sb_x1N, fmt), contracting(a_xMK.ndim, -1, -2), sa_xM1 * sb_x1N)


def contracting(ndim, a_dim, b_dim):
    """dot_general's dims for operands of `ndim` dims: the leading ndim - 2 batched, a's
    `a_dim` against b's `b_dim` (each -1 or -2)."""
    batch = tuple(range(ndim - 2))
    return ((ndim + a_dim,), (ndim + b_dim,)), (batch, batch)


def quantized_matmul_fwd(a_xMK, b_xKN, mode):
    return quantized_matmul(a_xMK, b_xKN, mode), (a_xMK, b_xKN)


def quantized_matmul_bwd(mode, residuals, dy_xMN):
    a_xMK, b_xKN = residuals
    fmt, grad_fmt = FORMATS[mode]
    sdy_xM1, sb_xK1 = scale_of(dy_xMN, -1, (), grad_fmt), scale_of(b_xKN, -1, (), fmt)
    da_xMK = scaled_dot(quantize(dy_xMN, sdy_xM1, grad_fmt), quantize(b_xKN, sb_xK1, fmt), contracting(a_xMK.ndim, -1, -1),
                        sdy_xM1 * sb_xK1.swapaxes(-1, -2))
    sa_x1K, sdy_x1N = scale_of(a_xMK, -2, (), fmt), scale_of(dy_xMN, -2, (), grad_fmt)
    db_xKN = scaled_dot(quantize(a_xMK, sa_x1K, fmt), quantize(dy_xMN, sdy_x1N, grad_fmt), contracting(a_xMK.ndim, -2, -2),
                        sa_x1K.swapaxes(-1, -2) * sdy_x1N)
    return da_xMK.astype(a_xMK.dtype), db_xKN.astype(b_xKN.dtype)


quantized_matmul.defvjp(quantized_matmul_fwd, quantized_matmul_bwd)


# ---- The dropless experts' grouped matmul


def rows_expert(sizes_E, n_rows):
    """The expert of each row of a ragged_dot (rows past the experts' runs: the last)."""
    return jnp.minimum(jnp.searchsorted(jnp.cumsum(sizes_E), jnp.arange(n_rows), side="right"), sizes_E.shape[0] - 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def quantized_ragged_dot(x_NI, w_EIO, sizes_E, mode, in_axis, out_axis):
    """jax.lax.ragged_dot with 8-bit operands: x per row, w per (expert, output column),
    forward; dx quantized as quantized_dot's. dw (a sum over each expert's rows, which
    the batch's splits cut) runs in x's dtype. Rows past the experts' runs are 0."""
    fmt, _ = FORMATS[mode]
    sx_N1 = scale_of(x_NI, 1, in_axis, fmt)
    sw_E1O = scale_of(w_EIO, 1, in_axis, fmt)
    acc_NO = jax.lax.ragged_dot(quantize(x_NI, sx_N1, fmt), quantize(w_EIO, sw_E1O, fmt), sizes_E,
                                preferred_element_type=accumulator(fmt))
    sw_NO = sw_E1O[rows_expert(sizes_E, x_NI.shape[0]), 0]
    return (acc_NO.astype(jnp.float32) * sx_N1 * sw_NO).astype(x_NI.dtype)


def quantized_ragged_dot_fwd(x_NI, w_EIO, sizes_E, mode, in_axis, out_axis):
    return quantized_ragged_dot(x_NI, w_EIO, sizes_E, mode, in_axis, out_axis), (x_NI, w_EIO, sizes_E)


def quantized_ragged_dot_bwd(mode, in_axis, out_axis, residuals, dy_NO):
    x_NI, w_EIO, sizes_E = residuals
    fmt, grad_fmt = FORMATS[mode]
    sdy_N1 = scale_of(dy_NO, 1, out_axis, grad_fmt)
    sw_EI1 = scale_of(w_EIO, 2, out_axis, fmt)
    acc_NI = jax.lax.ragged_dot(quantize(dy_NO, sdy_N1, grad_fmt), quantize(w_EIO, sw_EI1, fmt).swapaxes(1, 2), sizes_E,
                                preferred_element_type=accumulator(fmt))
    sw_NI = sw_EI1[rows_expert(sizes_E, x_NI.shape[0]), :, 0]
    dx_NI = (acc_NI.astype(jnp.float32) * sdy_N1 * sw_NI).astype(x_NI.dtype)
    _, ragged_vjp = jax.vjp(lambda w: jax.lax.ragged_dot(x_NI, w, sizes_E), w_EIO)
    return dx_NI, ragged_vjp(dy_NO)[0], None


quantized_ragged_dot.defvjp(quantized_ragged_dot_fwd, quantized_ragged_dot_bwd)


# ---- The experts' matmuls (model.MoE)


def quantized_expert_matmuls(x_ENI, w_EIO, quant_mode, row_tile, tp_axis, tp_splits):
    """A batch (over E) of quantized_dot, each expert with its own scales; dw's row
    tiles are one routing group's slots. tp_splits: "out" (gate, up) or "in" (down)."""
    axes = dict(in_axis=live_axes(tp_axis) if tp_splits == "in" else (), out_axis=live_axes(tp_axis) if tp_splits == "out" else ())
    x_ENI, w_EIO = same_varying(x_ENI, w_EIO.astype(x_ENI.dtype))
    dot = lambda x_NI, w_IO: quantized_dot(x_NI, w_IO, quant_mode, axes["in_axis"], axes["out_axis"], row_tile)  # noqa: E731
    return jax.vmap(dot)(x_ENI, w_EIO)


def quantized_grouped_matmul(x_NI, w_EIO, tokens_per_expert_E, quant_mode, tp_axis, tp_splits):
    """The dropless experts' ragged_dot through quantized_ragged_dot."""
    in_axis, out_axis = (live_axes(tp_axis), ()) if tp_splits == "in" else ((), live_axes(tp_axis))
    x_NI, w_EIO = same_varying(x_NI, w_EIO.astype(x_NI.dtype))
    return quantized_ragged_dot(x_NI, w_EIO, tokens_per_expert_E, quant_mode, in_axis, out_axis)
