"""The pieces every part of the model is made of: weight init, the projection (a
matmul that accumulates in float32), collectives that skip axes of one device, RMSNorm
and the dense feed-forward layer. Shape legend: model.py's docstring.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

import quant
from weights import CP

# ----------------------------------------------------------------------------
# Building blocks

# Softmax and norms run in float32 whatever the compute dtype: they are cheap and
# bfloat16 would lose the small differences between large logits.
ACC_DTYPE = jnp.float32


def init_normal(rngs, shape, fan_in, scale=1.0):
    """Weights ~ N(0, scale^2 / fan_in): keeps activations at unit scale at any width."""
    return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32) * (scale / math.sqrt(fan_in)))


def residual_scale(cfg):
    """Output projections of residual branches start small, 1/sqrt(2 x layers) (GPT-2),
    so the residual stream does not grow with depth. (Not zero: a zero projection
    would give every weight before it a zero gradient at step 0.) The dense prefix's
    layers count too (first_dense; 0 adds nothing)."""
    return 1.0 / math.sqrt(2 * (cfg.n_blocks * len(cfg.block_pattern) + cfg.first_dense))


def project(x, w, n_in=1, quant_mode="none", in_axis=None, out_axis=None):
    """Contract x's last `n_in` dims with w's first `n_in` dims: x [..., I] @ w [I, O...].

    The leading dims of x are flattened into one row dim before the matmul. Why: XLA:CPU
    computes the weight gradient of a matmul whose rows span two dims (B and T) about 3x
    slower than the same product with one row dim (a SwiGLU FFN on [16, 128, 128] with
    F = 512, forward + backward: 48.6 ms vs 14.9 ms). The product accumulates in float32,
    which for bfloat16 inputs is both more accurate and, on CPU, the fast path (363 vs
    161 GFLOP/s at 2048^3), and comes back in x's dtype.

    quant_mode int8 / fp8: the product of 8-bit operands (quant.quantized_dot); in_axis /
    out_axis name the mesh axis (tp) that splits I / O here, for mesh-invariant scales.
    """
    lead, inner = x.shape[:x.ndim - n_in], x.shape[x.ndim - n_in:]
    w_IO = w.reshape(math.prod(inner), -1).astype(x.dtype)
    if quant_mode != "none":
        return quantized_project(x, w_IO, lead, quant_mode, in_axis, out_axis).reshape(*lead, *w.shape[n_in:])
    if sequence_split_by_the_compiler():  # rows [B, T] kept apart (see below)
        y_xO = jnp.tensordot(x.reshape(*lead, -1), w_IO, axes=1, preferred_element_type=ACC_DTYPE).astype(x.dtype)
        return y_xO.reshape(*lead, *w.shape[n_in:])
    rows_NI = x.reshape(-1, math.prod(inner))
    y_NO = jnp.dot(rows_NI, w_IO, preferred_element_type=ACC_DTYPE).astype(x.dtype)
    return y_NO.reshape(*lead, *w.shape[n_in:])


def quantized_project(x, w_IO, lead, quant_mode, in_axis, out_axis):
    """project's rows through quant.quantized_dot; dw's row tiles are one sequence each
    (lead's last dim, T), which no split of the batch cuts."""
    rows_NI, w_IO = quant.same_varying(x.reshape(math.prod(lead), w_IO.shape[0]), w_IO)
    row_tile = lead[-1] if len(lead) > 1 else rows_NI.shape[0]
    return quant.quantized_dot(rows_NI, w_IO, quant_mode, live_axes(in_axis), live_axes(out_axis), row_tile)


def sequence_split_by_the_compiler():
    """Is a sequence dim split over cp by the compiler (the automatic executor with
    --mesh.cp > 1)? Then x [B, T, D] is split over dp on B and over cp on T, and
    flattening B and T into one row dim asks for a layout the partitioner does not keep
    (a device's rows are not contiguous in B x T): it all-gathers x over cp first, and
    the sequence is no longer split. So project keeps the rows apart there, and the
    compiler gathers the latent over cp instead (test_the_compiler_gathers_the_latent_under_auto;
    the measured collectives: docs/parallelism.md)."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and CP in mesh.axis_names and mesh.shape[CP] > 1 and is_auto_axis(CP)


def is_auto_axis(axis):
    """Is `axis` a mesh axis that the compiler partitions (jit under auto axes, as in
    executor_auto.py) rather than one that shard_map makes manual?"""
    mesh = jax.sharding.get_abstract_mesh()
    return dict(zip(mesh.axis_names, mesh.axis_types)).get(axis) == jax.sharding.AxisType.Auto


def live_axes(axes):
    """The mesh axes among `axes` (None, a name or a tuple of names) that a collective
    must cross here: those shard_map made manual with more than one device. An axis of
    size 1 holds everything already, yet XLA:CPU keeps a psum over it as an all-reduce
    that copies its operand (on one device the default step ran 32 of them, 19 MB).
    Skipping one is exact only when nothing is typed as varying over that axis: the
    steps give shard_map specs without size-1 axes (parallel.live_spec), so values are
    invariant over those and need no collective to become so."""
    mesh = jax.sharding.get_abstract_mesh()
    if axes is None or mesh.empty:
        return ()
    sizes = {name: size for name, size, kind in zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types)
             if kind == jax.sharding.AxisType.Manual}
    return tuple(a for a in ((axes,) if isinstance(axes, str) else axes) if sizes.get(a, 1) > 1)


def psum_if(x, axes):
    """Sum over mesh axes inside shard_map, only those with more than one device
    (live_axes); on one device (axes None or all of size 1) a no-op."""
    axes = live_axes(axes)
    return jax.lax.psum(x, axes) if axes else x


def pmax_if(x, axes):
    axes = live_axes(axes)
    return jax.lax.pmax(x, axes) if axes else x


def axis_index(axis):
    """This device's index along a mesh axis; 0 (a constant, not varying) on one device."""
    return jax.lax.axis_index(axis) if live_axes(axis) else 0


# ----------------------------------------------------------------------------
# Small pieces


class RMSNorm(nnx.Module):
    def __init__(self, dim, eps=1e-6):
        self.scale_D = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x_BTD):
        x = x_BTD.astype(ACC_DTYPE)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return (x * self.scale_D[...].astype(ACC_DTYPE)).astype(x_BTD.dtype)


# ----------------------------------------------------------------------------
# Feed-forward: dense (SwiGLU or GELU), and the experts of an MoE layer


class DenseFFN(nnx.Module):
    """SwiGLU (Shazeer 2020) or GELU MLP. Under tensor parallelism F is split: the up
    projections are column-parallel and the down projection row-parallel, so one psum
    at the end completes the output."""

    def __init__(self, d_model, d_hidden, activation, rngs, out_scale, quant_mode="none"):
        self.activation, self.quant_mode = activation, quant_mode
        if activation == "swiglu":
            self.w_gate_DF = init_normal(rngs, (d_model, d_hidden), d_model)
        self.w_up_DF = init_normal(rngs, (d_model, d_hidden), d_model)
        self.w_down_FD = init_normal(rngs, (d_hidden, d_model), d_hidden, out_scale)

    def __call__(self, x_BTD, tp_axis=None):  # partial sum over F when F is split: caller psums
        column, row = dict(quant_mode=self.quant_mode, out_axis=tp_axis), dict(quant_mode=self.quant_mode, in_axis=tp_axis)
        up_BTF = project(x_BTD, self.w_up_DF[...], **column)
        if self.activation == "swiglu":
            hidden_BTF = jax.nn.silu(project(x_BTD, self.w_gate_DF[...], **column)) * up_BTF
        else:
            hidden_BTF = jax.nn.gelu(up_BTF)
        return project(hidden_BTF, self.w_down_FD[...], **row)
