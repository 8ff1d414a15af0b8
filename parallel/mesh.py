"""The mesh (dp x cp x pp x tp within a TPU slice, slices outermost), the config checks it
needs before anything compiles, and how batches sit on it.

Mesh axes (names: utils.AXES):
  dp     data parallel + FSDP (ZeRO-3): the batch and (almost) every weight and its optimizer
         state are split over dp (parallel/fsdp.py gathers them); with expert parallelism
         the experts too (all-to-all in model.MoE).
  cp     context parallel: each sequence in 2 cp chunks, rank i holding chunks i and 2cp-1-i;
         attention all-gathers the MLA latent over cp (ops/context_parallel.py).
  pp     pipeline: stage i holds blocks [i N/pp, (i+1) N/pp); activations go by ppermute.
  tp     tensor parallel (Megatron): heads, FFN and expert hidden units, vocabulary; psum over tp.
  slice  outermost (--mesh.slices), data parallel over the data-center network: weights whole
         per slice, one gradient all-reduce per step (step_core.reduce_over_slices).
Weight splits: parallel/weights.py; the steps: parallel/steps.py.
"""

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from model import resolve_moe_kernel
from utils import AXES, BATCH_AXES, CP, MESH_AXES, SLICE, ConfigError

# ---- Mesh


def resolve_mesh_shape(mesh_cfg, n_devices):
    """(dp, cp, pp, tp) of one slice; dp = -1 takes the devices the other axes leave."""
    cp, pp, tp, slices = mesh_cfg.cp, mesh_cfg.pp, mesh_cfg.tp, mesh_cfg.slices
    if pp < 1 or tp < 1 or cp < 1:
        raise ConfigError(f"--mesh.cp ({cp}), --mesh.pp ({pp}) and --mesh.tp ({tp}) must be >= 1")
    if slices < 1 or n_devices % slices:
        raise ConfigError(f"--mesh.slices ({slices}) must be >= 1 and divide the {n_devices} devices")
    per_slice = n_devices // slices
    dp = mesh_cfg.dp
    if dp == -1:
        if per_slice % (cp * pp * tp):
            raise ConfigError(f"{per_slice} devices per slice cannot be split into cp={cp} x pp={pp} x tp={tp}; "
                              f"choose cp x pp x tp dividing {per_slice}")
        dp = per_slice // (cp * pp * tp)
    if dp * cp * pp * tp != per_slice:
        in_slices = f" per slice ({n_devices} devices / --mesh.slices {slices})" if slices > 1 else ""
        cp_part = f" x cp={cp}" if cp > 1 else ""
        raise ConfigError(f"mesh dp={dp}{cp_part} x pp={pp} x tp={tp} = {dp * cp * pp * tp} devices, but there are {per_slice}{in_slices}; "
                          f"set --mesh.dp -1 to use the rest, or change --mesh.* (or --run.cpu_devices)")
    return dp, cp, pp, tp


def make_mesh(mesh_cfg, devices=None):
    """The (slice, dp, cp, pp, tp) mesh over `devices` (default: all), for training and planner.py --tpu alike.

    slice is outermost (whole TPU slices; on CPU and GPU consecutive processes). Within a slice tp is innermost, so a
    tp group (two all-reduces per layer) is one host's closest chips, and dp outermost, so a host spans few dp rows
    and loads only those (process_rows). TPU: jax's topology-aware order where it keeps both, else host by host, each
    host's chips in a snake (tpu_device_grid). CPU and GPU: jax's process-major order, which keeps both."""
    devices = jax.devices() if devices is None else list(devices)
    shape = resolve_mesh_shape(mesh_cfg, len(devices))
    if devices[0].platform == "tpu":  # each slice's own grid (its torus), stacked
        grid = np.stack([tpu_device_grid(shape, group) for group in tpu_slices(devices, mesh_cfg.slices)])
    else:
        grid = mesh_utils.create_device_mesh((mesh_cfg.slices,) + shape, devices)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Explicit,) * len(MESH_AXES))


def shown_shape(mesh):
    """{axis: size} as runs print it: dp, pp and tp always, slice and cp only when > 1."""
    return {axis: n for axis, n in mesh.shape.items() if axis not in (SLICE, CP) or n > 1}


def tpu_slices(devices, slices):
    """Each TPU slice's devices (by slice_index), in order; raises unless there are `slices`."""
    groups = {}
    for d in devices:
        groups.setdefault(getattr(d, "slice_index", 0), []).append(d)
    if len(groups) != slices:
        raise ConfigError(f"--mesh.slices {slices}, but the TPU devices form {len(groups)} slice(s) (their slice_index): "
                          f"set --mesh.slices {len(groups)}")
    return [groups[k] for k in sorted(groups)]


def tpu_device_grid(shape, devices):
    """[dp, cp, pp, tp] TPU devices: jax's topology-aware order where it spreads tp groups and
    hosts no wider than host_major_grid does (host_spread), else host_major_grid."""
    fallback = host_major_grid(shape, devices)
    try:
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    except (NotImplementedError, ValueError, AssertionError):
        return fallback
    keeps_both = all(a <= b for a, b in zip(host_spread(grid), host_spread(fallback)))
    return grid if keeps_both else fallback


def host_major_grid(shape, devices):
    """Devices host by host, each host's chips in snake order (x reversed on odd rows, so
    consecutive chips are ICI neighbours), both cores of a chip together."""
    def key(d):
        x, y, z = d.coords
        return d.process_index, z, y, -x if y % 2 else x, d.core_on_chip
    return np.array(sorted(devices, key=key), dtype=object).reshape(shape)


def host_spread(grid):
    """(most hosts one tp group spans, most dp rows one host's devices lie in)."""
    dp, tp = grid.shape[0], grid.shape[-1]
    tp_hosts = max(len({d.process_index for d in group}) for group in grid.reshape(-1, tp))
    rows_of = {}
    for i in range(dp):
        for d in grid[i].flat:
            rows_of.setdefault(d.process_index, set()).add(i)
    return tp_hosts, max(len(rows) for rows in rows_of.values())


def describe_mesh(mesh):
    """The mesh as text: each device's id, process and coordinates (shown_shape's axes)."""
    shown = shown_shape(mesh)
    lines = [f"mesh {shown} over {mesh.devices.size} devices, {jax.process_count()} process(es)"]
    for coords in np.ndindex(mesh.devices.shape):
        device, at = mesh.devices[coords], dict(zip(mesh.axis_names, coords))
        lines.append(f"  device {device.id:>3} (process {device.process_index}): " + " ".join(f"{a}={at[a]}" for a in shown))
    return "\n".join(lines)


# ---- What a config needs of the mesh


def check_config_fits_mesh(cfg, mesh):
    """Config x mesh checks that need no arrays, before anything compiles."""
    dp, cp, pp, tp = (mesh.shape[a] for a in AXES)
    slices = mesh.shape.get(SLICE, 1)
    m, t = cfg.model, cfg.train
    V, zbv = t.virtual_stages if t.pipeline == "interleaved" else 2 if t.pipeline == "zbv" else 1, t.pipeline == "zbv"
    if m.n_blocks % (pp * V):
        raise ConfigError(f"--train.pipeline zbv gives each stage two chunks: --model.n_blocks ({m.n_blocks}) must be divisible by 2 x "
                          f"--mesh.pp ({pp})" if zbv else f"--model.n_blocks ({m.n_blocks}) must be divisible by --mesh.pp x --train.virtual_stages "
                          f"({pp} x {V}): each stage holds {V} chunk(s) of whole blocks" if V > 1 else
                          f"--model.n_blocks ({m.n_blocks}) must be divisible by --mesh.pp ({pp}): each stage holds whole blocks")
    if t.microbatches < pp * V ** zbv:
        raise ConfigError(f"--train.microbatches ({t.microbatches}) must be >= {'2 x ' * zbv}--mesh.pp ({pp}) to keep every stage busy")
    if t.pipeline == "interleaved" and t.microbatches % pp:
        raise ConfigError(f"--train.pipeline interleaved sends microbatches in groups of --mesh.pp: --train.microbatches "
                          f"({t.microbatches}) must be a multiple of {pp}")
    if t.batch_size % (slices * dp * t.microbatches):
        by = f"--mesh.slices x --mesh.dp x --train.microbatches ({slices} x " if slices > 1 else "--mesh.dp x --train.microbatches ("
        raise ConfigError(f"--train.batch_size ({t.batch_size}) must be divisible by {by}"
                          f"{dp} x {t.microbatches} = {slices * dp * t.microbatches})")
    if cfg.mesh.expert_parallel:
        if m.n_experts % dp:
            raise ConfigError(f"--model.n_experts ({m.n_experts}) must be divisible by --mesh.dp ({dp}) with --mesh.expert_parallel")
        if m.capacity_factor == 0 and cfg.mesh.sharding == "auto":
            raise ConfigError("--mesh.expert_parallel with dropless experts (--model.capacity_factor 0) needs --mesh.sharding "
                              "manual: the automatic executor places fixed-size expert buffers only")
    if "M" in m.block_pattern and m.capacity_factor == 0 and resolve_moe_kernel(m.moe_kernel) == "gmm" and \
            cfg.mesh.sharding == "auto" and mesh.size > 1:
        raise ConfigError(f"--model.moe_kernel gmm on {mesh.size} devices needs --mesh.sharding manual (the compiler does not "
                          "partition the kernel); use --model.moe_kernel ragged_dot")
    if m.quant != "none" and isinstance(mesh, Mesh):  # (an abstract mesh, the planner's, has no chip to ask)
        from ops import quant  # (only a quantized run imports the quantized kernels)
        quant.check_chip(m.quant, mesh.devices.flat[0])
    if "M" in m.block_pattern and m.d_expert % tp:
        raise ConfigError(f"--model.d_expert ({m.d_expert}) must be divisible by --mesh.tp ({tp})")


def axes_of(entry):
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def named(mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


# ---- Placing batches; what a compiled step holds


def specs_of(tree):
    return jax.tree.map(lambda a: a.sharding.spec, tree)


def live_spec(spec, mesh):
    """spec (or a tree of specs) without its size-1 axes, the same layout: as a shard_map
    in_spec, nothing is typed as varying over them, so no collective runs there."""
    if not isinstance(spec, P):
        return jax.tree.map(lambda s: live_spec(s, mesh), spec, is_leaf=lambda x: isinstance(x, P))
    live = [tuple(a for a in axes_of(entry) if mesh.shape[a] > 1) for entry in spec]
    return P(*(None if not axes else axes[0] if len(axes) == 1 else axes for axes in live))


def batch_spec():
    return P(BATCH_AXES, None)  # rows over (slice, dp), slice-major; pp and tp devices see the same rows


def global_batch(mesh, rows_for_process, batch_size):
    """Assemble this process's rows into a global array split over (slice, dp)."""
    sharding = NamedSharding(mesh, batch_spec())
    return jax.make_array_from_process_local_data(sharding, rows_for_process, (batch_size, rows_for_process.shape[1]))


def process_rows(mesh, batch_size, process=None):
    """The global batch rows the devices of `process` (default: this one) own, sorted, as
    make_array_from_process_local_data takes them: a range when contiguous, else a tuple.
    Read off the sharding, so exact for any device order."""
    process = jax.process_index() if process is None else process
    indices = NamedSharding(mesh, batch_spec()).devices_indices_map((batch_size, 1))
    rows = sorted({r for d, idx in indices.items() if d.process_index == process
                   for r in range(*idx[0].indices(batch_size))})
    if rows and rows == list(range(rows[0], rows[-1] + 1)):
        return range(rows[0], rows[-1] + 1)
    return tuple(rows)


def param_bytes_on_device(tree, device):
    """Bytes of a tree's shards that live on one device."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            if shard.device == device:
                total += shard.data.nbytes
    return total


def memory_summary(params, opt_state, compiled, device):
    out = dict(params_bytes=param_bytes_on_device(params, device), opt_bytes=param_bytes_on_device(opt_state, device))
    try:
        mem = compiled.memory_analysis()
        out["temp_bytes"] = int(mem.temp_size_in_bytes)
    except Exception:  # not every backend reports it
        out["temp_bytes"] = -1
    return out
