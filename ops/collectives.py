"""The one family of collective helpers: the mesh axes a collective must cross at this point of the trace (those
shard_map made manual with more than one device: live_axes), and the sums, maxima and casts over them. On one device
and under the automatic executor every helper is an identity, so the model and the step's loss are written once. The
model learns which axes split what from one small value passed down, Axes."""

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import AxisType


@dataclasses.dataclass(frozen=True)
class Axes:
    """The mesh axes a layer's collectives run over (None: not split; the default is one
    device). Under the shard_map executors: tp = "tp", ep = "dp" with expert parallelism."""
    tp: str | None = None  # heads, hidden units, expert hidden units and the vocabulary (Megatron)
    ep: str | None = None  # the routed experts (expert parallelism: all-to-all dispatch)


ONE_DEVICE = Axes()


def live_axes(axes):
    """The axes among `axes` (None, a name or a tuple) that a collective must cross here:
    manual ones of more than one device. Skipping a size-1 axis is exact (the steps give
    shard_map no size-1 axes: parallel/mesh.live_spec) and saves XLA:CPU a copying all-reduce."""
    mesh = jax.sharding.get_abstract_mesh()
    if axes is None or mesh.empty:
        return ()
    sizes = {name: size for name, size, kind in zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types)
             if kind == AxisType.Manual}
    return tuple(a for a in ((axes,) if isinstance(axes, str) else axes) if sizes.get(a, 1) > 1)


def psum(x, axes):
    """Sum over the live manual axes among `axes`; an identity where there are none."""
    axes = live_axes(axes)
    return jax.lax.psum(x, axes) if axes else x


def pmax(x, axes):
    axes = live_axes(axes)
    return jax.lax.pmax(x, axes) if axes else x


def pmean(x, axes):
    axes = live_axes(axes)
    return jax.lax.pmean(x, axes) if axes else x


def axis_index(axis):
    """This device's index along a mesh axis; 0 (a constant, not varying) where it is not live."""
    return jax.lax.axis_index(axis) if live_axes(axis) else 0


def is_auto_axis(axis):
    """Is `axis` a mesh axis that the compiler partitions (jit under auto axes, as in
    parallel/auto.py) rather than one that shard_map makes manual?"""
    mesh = jax.sharding.get_abstract_mesh()
    return dict(zip(mesh.axis_names, mesh.axis_types)).get(axis) == AxisType.Auto


def split_by_the_compiler(axis):
    """Does the compiler split `axis` here (an auto axis of more than one device)?"""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and axis in mesh.axis_names and mesh.shape[axis] > 1 and is_auto_axis(axis)


# ---- Typing: inside shard_map, both branches of a cond and a loop's carry must agree on
# which mesh axes a value varies over.


def vary(x, axes):
    """x typed as varying over `axes` (a pcast over the live ones it does not vary over yet)."""
    missing = live_axes(tuple(a for a in axes if a not in jax.typeof(x).manual_axis_type.varying))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def varying_like(tree, *refs):
    """tree typed as varying over every mesh axis any of refs varies over (a no-op outside
    shard_map): a loop's zero-initialised carry must have the type its update gives it."""
    axes = set().union(*(jax.typeof(r).manual_axis_type.varying for r in refs))

    def cast(x):
        missing = tuple(axes - set(jax.typeof(x).manual_axis_type.varying))
        return jax.lax.pcast(x, missing, to="varying") if missing else x
    return jax.tree.map(cast, tree)


def zeros_of(avals):
    """Zeros typed as avals (shape, dtype and the axes each varies over)."""
    return jax.tree.map(lambda s: vary(jnp.zeros(s.shape, s.dtype), tuple(s.manual_axis_type.varying)), avals)


def widen(tree, avals):
    """tree varying over every axis its counterpart in avals varies over."""
    return jax.tree.map(lambda x, s: vary(x, tuple(s.manual_axis_type.varying)), tree, avals)
