"""Calling a Pallas kernel (splash attention, megablox) from inside the step's
shard_map: where it runs, and how its outputs get their mesh types."""

import jax
from jax.sharding import PartitionSpec as P


def interpret_kernels():
    """Do Pallas kernels run in interpret mode in the program being traced? Off a TPU they
    must. The platform is the mesh's devices' where there is one: planning/tpu_compile.py
    compiles for a TPU slice's devices from a CPU host, where the default backend says cpu."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return (device.platform if device is not None else jax.default_backend()) != "tpu"


def unchecked(kernel, *arrays):
    """kernel(*arrays) inside a nested shard_map that takes no mesh axes and checks no
    varying axes: a Pallas call declares its outputs without the axes they vary over,
    which the step's check_vma refuses; the caller types the outputs
    (ops/collectives.varying_like). The kernel is vmapped over a batch of one: Pallas'
    interpret mode otherwise loops over blocks typed as not varying while its operands
    are, and refuses."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.manual_axes:
        return kernel(*arrays)

    def batch_of_one(*arrays):
        return jax.tree.map(lambda y: y[0], jax.vmap(kernel)(*jax.tree.map(lambda a: a[None], arrays)))
    return jax.shard_map(batch_of_one, mesh=mesh, in_specs=P(), out_specs=P(), axis_names=frozenset(), check_vma=False)(*arrays)
