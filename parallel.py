"""The mesh (dp x cp x pp x tp within a TPU slice, slices outermost) and how weights and
batches sit on it: the mesh, the sharding table, init in place, the FSDP gather that
the shard_map executors call, the global batch.

Mesh axes:
  dp  data parallel + FSDP (ZeRO-3): the batch is split over dp, and so is (almost)
      every weight and its optimizer state; a block's weights are all-gathered just
      before use, and autodiff turns that all-gather into a reduce-scatter of the
      gradient.
  cp  context parallel (--mesh.cp, size 1 by default): every sequence is cut into 2 cp
      chunks, rank i holding chunks i and 2cp-1-i; attention all-gathers the MLA latent
      over cp (context_parallel.py). Weights are stored over dp x cp (FSDP over both).
  pp  pipeline: stage i holds blocks [i*N/pp, (i+1)*N/pp); microbatches flow stage to
      stage with ppermute (executor_gpipe.py, executor_1f1b.py).
  tp  tensor parallel (Megatron): heads, FFN hidden units, expert hidden units and the
      vocabulary are split; model.py psums the partial outputs over tp.
  Experts may also be split over dp (expert parallelism, all-to-all in moe.MoE).
  slice (outermost, --mesh.slices) data parallel across TPU slices, over the data-center
      network: the batch is split over (slice, dp), weights are replicated per slice
      (FSDP stays within a slice), and the only collective across slices is one
      all-reduce of the gradient shards per step (step_core.reduce_over_slices), plus
      the scalar loss and the router load. Size 1 by default: no collective runs over it.

The train and eval steps that run over this mesh: train_steps.py (one step, executors
chosen by config; the shared loss and update in step_core.py).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from layers import live_axes
from moe import resolve_moe_kernel
from model import Transformer
from pipeline import formula_bubble
import quant
from utils import ConfigError
from weights import AXES, BATCH_AXES, CP, DP, EXPERT, FSDP, MESH_AXES, PP, SHAPE_LETTER_FLAGS, SLICE, is_stacked, is_trained, row, weight_name


# ----------------------------------------------------------------------------
# Mesh


def resolve_mesh_shape(mesh_cfg, n_devices):
    """(dp, cp, pp, tp) of one slice, with dp = -1 resolved to the devices left by slices,
    cp, pp and tp."""
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
    """The (slice, dp, cp, pp, tp) mesh over `devices` (default: all), the same for training
    and for planner.py --tpu.

    Device order, and why: slice is outermost (its devices are whole TPU slices, joined
    by the data-center network; on CPU and GPU consecutive blocks of devices, i.e. of
    processes); within a slice tp is innermost, so a tp group is the closest chips (one
    host's, which talk most: two all-reduces per layer); dp is outermost, so each
    host's chips share as few dp coordinates as possible, and a host loads only the
    rows of those (process_rows). On TPU, jax's topology-aware assignment
    (mesh_utils.create_device_mesh, which maps mesh axes onto torus axes for short
    rings, splitting a physical axis where needed) is used when it keeps both
    properties; where it cannot map the shape at all (jax.make_mesh raises
    NotImplementedError for dp8 x pp2 x tp2 on a v4-64's 2x4x4 chips) or would put a tp
    group across hosts, the fallback is an explicit order: host by host, each host's
    chips in a snake (consecutive chips are neighbours). CPU and GPU devices keep
    jax's order (process-major, which already gives both properties)."""
    devices = jax.devices() if devices is None else list(devices)
    shape = resolve_mesh_shape(mesh_cfg, len(devices))
    if devices[0].platform == "tpu":  # each slice's own grid (its torus), stacked
        grid = np.stack([tpu_device_grid(shape, group) for group in tpu_slices(devices, mesh_cfg.slices)])
    else:
        grid = mesh_utils.create_device_mesh((mesh_cfg.slices,) + shape, devices)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Explicit,) * len(MESH_AXES))


def shown_shape(mesh):
    """{axis: size} as runs print it: dp, pp and tp always, the slice and cp axes only
    when they split something (size > 1)."""
    return {axis: n for axis, n in mesh.shape.items() if axis not in (SLICE, CP) or n > 1}


def tpu_slices(devices, slices):
    """The devices of each TPU slice (their slice_index, 0 on a single slice), in order:
    --mesh.slices must be the number of slices the job runs on."""
    groups = {}
    for d in devices:
        groups.setdefault(getattr(d, "slice_index", 0), []).append(d)
    if len(groups) != slices:
        raise ConfigError(f"--mesh.slices {slices}, but the TPU devices form {len(groups)} slice(s) (their slice_index): "
                          f"set --mesh.slices {len(groups)}")
    return [groups[k] for k in sorted(groups)]


def tpu_device_grid(shape, devices):
    """[dp, cp, pp, tp] array of TPU devices: jax's topology-aware order if it keeps tp
    groups on as few hosts and hosts on as few dp rows as the host-major order does,
    else the host-major order."""
    fallback = host_major_grid(shape, devices)
    try:
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    except (NotImplementedError, ValueError, AssertionError):
        return fallback
    keeps_both = all(a <= b for a, b in zip(host_spread(grid), host_spread(fallback)))
    return grid if keeps_both else fallback


def host_major_grid(shape, devices):
    """Devices sorted host by host (process index), within a host in snake order over
    its chip coordinates (x reversed on odd rows, so consecutive chips are ICI
    neighbours; on a 2x2 host the order is a ring), both cores of a chip together."""
    def key(d):
        x, y, z = d.coords
        return d.process_index, z, y, -x if y % 2 else x, d.core_on_chip
    return np.array(sorted(devices, key=key), dtype=object).reshape(shape)


def host_spread(grid):
    """(most hosts one tp group spans, most dp rows one host's devices lie in): the two
    things make_mesh keeps small."""
    dp, tp = grid.shape[0], grid.shape[-1]
    tp_hosts = max(len({d.process_index for d in group}) for group in grid.reshape(-1, tp))
    rows_of = {}
    for i in range(dp):
        for d in grid[i].flat:
            rows_of.setdefault(d.process_index, set()).add(i)
    return tp_hosts, max(len(rows) for rows in rows_of.values())


# ----------------------------------------------------------------------------
# The sharding table: weights.WEIGHTS says how each dim of each weight is split (TP for
# compute, EXPERT over dp with expert parallelism, FSDP for storage only); weight_layout
# turns a row into mesh axes. Weights inside the stacked blocks get a leading N dim
# split over pp.


def weight_layout(name, stacked, expert_parallel):
    """(dims, fsdp_axes, fsdp_dim): each dim's mesh axes (None, an axis, or a tuple of
    axes), the axes that split the FSDP dim for storage only, and that dim's index.
    Unknown weights are an error."""
    dims = tuple({EXPERT: DP if expert_parallel else None}.get(d, d) for d in row(name).dims)
    if stacked:
        dims = (PP,) + dims
    compute_axes = {d for d in dims if d not in (None, FSDP)}
    # AXES, not MESH_AXES: storage is split within a slice only; every slice holds the
    # weights whole, so no per-layer gather or reduce-scatter crosses the slow network.
    fsdp_axes = tuple(a for a in AXES if a not in compute_axes) if FSDP in dims else ()
    dims = tuple((fsdp_axes or None) if d == FSDP else d for d in dims)
    return dims, fsdp_axes, fsdp_axes and dims.index(fsdp_axes)


def param_specs(params, expert_parallel):
    """PartitionSpec (storage layout) for every weight of a params tree."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: P(*weight_layout(weight_name(path), is_stacked(path), expert_parallel)[0]), params)


def axes_of(entry):
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def check_divisible(params, specs, mesh):
    """Every split dim must divide evenly; say which config field to change."""
    for (path, leaf), spec in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))):
        name = weight_name(path)
        letters = ("N" if is_stacked(path) else "") + name.rsplit("_", 1)[1]
        for size, entry, letter in zip(leaf.shape, spec, letters):
            ways = math.prod(mesh.shape[a] for a in axes_of(entry))
            if size % ways:
                split = " x ".join(f"--mesh.{a} = {mesh.shape[a]}" for a in axes_of(entry))
                raise ConfigError(f"{SHAPE_LETTER_FLAGS.get(letter, letter)} = {size} is not divisible by {split} "
                                  f"(weight {name} splits its {letter} dim {ways} ways); change one of them")


def check_config_fits_mesh(cfg, mesh):
    """Config x mesh checks that need no arrays, before anything compiles."""
    dp, cp, pp, tp = (mesh.shape[a] for a in AXES)
    slices = mesh.shape.get(SLICE, 1)
    m, t = cfg.model, cfg.train
    V = t.virtual_stages if t.pipeline == "interleaved" else 1
    if m.n_blocks % (pp * V):
        raise ConfigError(f"--model.n_blocks ({m.n_blocks}) must be divisible by --mesh.pp x --train.virtual_stages "
                          f"({pp} x {V}): each stage holds {V} chunk(s) of whole blocks" if V > 1 else
                          f"--model.n_blocks ({m.n_blocks}) must be divisible by --mesh.pp ({pp}): each stage holds whole blocks")
    if t.microbatches < pp:
        raise ConfigError(f"--train.microbatches ({t.microbatches}) must be >= --mesh.pp ({pp}) to keep every stage busy")
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
    if isinstance(mesh, Mesh):  # (an abstract mesh, the planner's, has no chip to ask)
        quant.check_chip(m.quant, mesh.devices.flat[0])
    if "M" in m.block_pattern and m.d_expert % tp:
        raise ConfigError(f"--model.d_expert ({m.d_expert}) must be divisible by --mesh.tp ({tp})")


def named(mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


# ----------------------------------------------------------------------------
# Init: same values on every mesh


def init_params(model_cfg, mesh, expert_parallel, seed):
    """(graphdef, params) with params created directly in their shards.

    jit with out_shardings lets each device compute only its own shard; JAX's
    partitionable threefry makes every value depend on (seed, position) alone, so
    every mesh starts from exactly the same weights.
    """
    abstract = nnx.eval_shape(lambda: Transformer(model_cfg, nnx.Rngs(seed)))
    graphdef, abstract_state = nnx.split(abstract)
    shapes = abstract_state.to_pure_dict()
    specs = param_specs(shapes, expert_parallel)
    check_divisible(shapes, specs, mesh)

    def create():
        return nnx.split(Transformer(model_cfg, nnx.Rngs(seed)))[1].to_pure_dict()

    params = jax.jit(create, out_shardings=named(mesh, specs))()
    return graphdef, params


def param_bytes_on_device(tree, device):
    """Bytes of a tree's shards that live on one device."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            if shard.device == device:
                total += shard.data.nbytes
    return total


# ----------------------------------------------------------------------------
# Inside shard_map: the FSDP gather


def gather_for_use(params, expert_parallel, dtype, one_block=False, reduce_dtype=jnp.float32, whole_stack=False):
    """FSDP: cast local weights to the compute dtype and all-gather their storage-only
    split (the FSDP dim). Casting first halves the bytes sent in bfloat16. In the
    backward pass each all_gather becomes a reduce-scatter, written as an all-to-all and
    a local sum (scatter_by_all_to_all): every device gets its shard of the gradient
    summed over all devices that used the weight.

    Gradients are reduced in `reduce_dtype` (--model.grad_reduce_dtype, float32 by
    default): summing dp x tp bfloat16 partial gradients loses precision, and TPU and
    GPU, unlike XLA:CPU, reduce in the dtype they are given. So the reduce-scatter
    runs in reduce_dtype (gather_weight), weights replicated over an axis (norm
    scales) are typed as varying over it before the cast (the psum autodiff inserts
    for them then sums reduce_dtype values), and the top-level weights (one_block
    False: the tied embedding and the final norm, gathered once per step and used by
    every microbatch) come out in reduce_dtype, so that their gradient accumulates
    over the microbatches in it; their users cast them to the compute dtype.
    one_block: the weights of one block, sliced out of the stack (no N dim).
    whole_stack: the blocks' stacked weights [N, ...] all at once (executor_accumulate's
    gather once per step); they come out in reduce_dtype too, so that their gradient,
    summed over the microbatches, reaches the reduce-scatter unrounded."""
    fetched, unpack = fetch_for_use(params, expert_parallel, dtype, one_block, reduce_dtype, whole_stack)
    return unpack(fetched)


def fetch_for_use(params, expert_parallel, dtype, one_block=False, reduce_dtype=jnp.float32, whole_stack=False,
                  pack=False):
    """gather_for_use in two parts: (fetched, unpack), where `fetched` (arrays) holds what
    the collectives bring and unpack(fetched) is the local work after them, so that a
    loop can fetch the next block in one step and unpack it in the next
    (model.apply_blocks's prefetch): the gathers' results then have no user in the
    step that issues them. unpack serves every block of the same shapes.

    pack (one_block): the block's weights that gather over the same axes go as one
    buffer (gather_packed; its transpose reduces their gradients in one all-to-all).
    The compiled TPU schedule runs one collective of a loop's step beside its matmuls
    and the rest of them exposed (4 weights a layer, 1 of 4 hidden; packed, all:
    docs/parallelism.md, "what hides behind what")."""
    out_dtype = jnp.dtype(dtype) if one_block else jnp.promote_types(dtype, reduce_dtype)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    out, packs = [None] * len(leaves), {}
    for i, (path, w) in enumerate(leaves):
        if not is_trained(weight_name(path)):  # replicated, float32, no gradient: nothing to gather
            out[i] = w
            continue
        _, fsdp_axes, fsdp_dim = weight_layout(weight_name(path), one_block or whole_stack, expert_parallel)
        replicated = live_axes(tuple(a for a in AXES if a not in jax.typeof(w).manual_axis_type.varying))
        if replicated:  # (in the wider of the two: the forward values must not change)
            w = jax.lax.pcast(w.astype(jnp.promote_types(dtype, reduce_dtype)), replicated, to="varying")
        # Axes of size 1 hold the whole dim already; XLA:CPU would still run (and copy
        # through) an all_gather over them: 3 ms of a 200 ms one-device step (shakespeare).
        fsdp_axes = tuple(a for a in fsdp_axes if jax.lax.axis_size(a) > 1)
        if not fsdp_axes:
            out[i] = w.astype(dtype).astype(out_dtype)
        elif pack and one_block:  # (the stacked N dim is already sliced away)
            packs.setdefault(fsdp_axes, []).append((i, w, fsdp_dim - 1))
        else:  # (inside a block the stacked N dim is already sliced away)
            out[i] = gather_weight(w, fsdp_axes, fsdp_dim - one_block, jnp.dtype(dtype), jnp.dtype(reduce_dtype), out_dtype)
    layouts = [(axes, [(i, w.shape, dim) for i, w, dim in pack]) for axes, pack in packs.items()]
    packed = [gather_packed([w for _, w, _ in pack], axes, jnp.dtype(dtype), jnp.dtype(reduce_dtype))
              for axes, pack in packs.items()]

    def unpack(fetched):
        out, packed = list(fetched[0]), fetched[1]
        for (axes, items), buffer in zip(layouts, packed):
            wholes = unpack_packed(buffer, jax.lax.axis_size(axes), [(shape, dim) for _, shape, dim in items])
            for i, whole in zip((i for i, _, _ in items), wholes):
                out[i] = whole.astype(out_dtype)
        return jax.tree_util.tree_unflatten(treedef, out)
    return (out, packed), unpack


PACK_WIDTH = 1024  # gather_packed's rows: 2-D in the TPU's own tiling, so that no relayout copy follows the gather


def gather_packed(shards, axes, dtype, reduce_dtype):
    """One all-gather of several weights' shards over `axes`: each device's shards
    flattened into one buffer (in the wider of their dtypes and reduce_dtype, so that
    the gradient reaches them unrounded), padded to rows of PACK_WIDTH, gathered in
    `dtype`: [n R, PACK_WIDTH], device j's buffer in rows j R .. (j + 1) R - 1
    (unpack_packed cuts the weights out). Its transpose reduces every weight's
    gradient in one all-to-all (gather_weight's, in reduce_dtype)."""
    wide = functools.reduce(jnp.promote_types, [w.dtype for w in shards], jnp.dtype(reduce_dtype))
    flat = jnp.concatenate([w.astype(wide).reshape(-1) for w in shards])
    flat = jnp.pad(flat, (0, -flat.size % PACK_WIDTH))
    return gather_weight(flat.reshape(-1, PACK_WIDTH), axes, 0, dtype, reduce_dtype, dtype)


def unpack_packed(packed, n, shapes_and_dims):
    """The weights of gather_packed's buffer over n devices, each (shard shape, FSDP dim)
    cut out of every device's part and laid along its dim in device order, as a tiled
    all_gather of that weight lays it."""
    parts_nF, out, start = packed.reshape(n, -1), [], 0
    for shape, dim in shapes_and_dims:
        size = math.prod(shape)
        part = parts_nF[:, start:start + size].reshape((n,) + shape)
        start += size
        whole = jnp.moveaxis(part, 0, dim)  # [..., n, shard dim, ...]: device-major along dim
        out.append(whole.reshape(shape[:dim] + (n * shape[dim],) + shape[dim + 1:]))
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def gather_weight(w, axes, dim, dtype, reduce_dtype, out_dtype):
    """all_gather of w's shards over `axes` in the compute dtype (then out_dtype); its
    transpose, the reduce-scatter of the gradient (scatter_by_all_to_all), in reduce_dtype."""
    return jax.lax.all_gather(w.astype(dtype), axes, axis=dim, tiled=True).astype(out_dtype)


def _gather_weight_fwd(w, axes, dim, dtype, reduce_dtype, out_dtype):
    return gather_weight(w, axes, dim, dtype, reduce_dtype, out_dtype), jnp.zeros((0,), w.dtype)


def _gather_weight_bwd(axes, dim, dtype, reduce_dtype, out_dtype, like, g):
    g = scatter_by_all_to_all(g.astype(reduce_dtype), axes, scatter_dimension=dim)
    return (g.astype(like.dtype),)


def scatter_by_all_to_all(g, axes, scatter_dimension):
    """psum_scatter(g, axes, scatter_dimension, tiled=True), written as an all-to-all
    of g's n slices (each device receives its slice from every device) and their sum
    here. Same bytes on the wire as a ring reduce-scatter, (n - 1) / n of g; but libtpu
    lowers a reduce-scatter over a 3-D group of chips (dp 32 on a v4-64's 2x4x4, v4-32's
    2x2x4, v5p-128's 4x4x4) to an all-reduce and a slice, twice the bytes, and keeps an
    all-to-all as it is; and its schedule runs an all-to-all beside the backward's other
    matmuls, a reduce-scatter never (docs/parallelism.md, "what hides behind what")."""
    n, dim = jax.lax.axis_size(axes), scatter_dimension
    g_n = g.reshape(g.shape[:dim] + (n, g.shape[dim] // n) + g.shape[dim + 1:])
    return jnp.sum(jax.lax.all_to_all(g_n, axes, dim, dim, tiled=True), axis=dim)


gather_weight.defvjp(_gather_weight_fwd, _gather_weight_bwd)


# ----------------------------------------------------------------------------
# Placing batches; what a compiled step holds


def specs_of(tree):
    return jax.tree.map(lambda a: a.sharding.spec, tree)


def live_spec(spec, mesh):
    """spec without the mesh axes of size 1 (the same layout): as a shard_map in_spec it
    keeps values from being typed as varying over an axis that nothing splits, so no
    collective is needed over it (layers.live_axes). A tree of specs is mapped."""
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
    """The global batch rows that the devices of `process` (default: this one) own,
    sorted: a range when they are contiguous (make_mesh's order makes them so), else a
    tuple. Read off the sharding itself, so it is exact for any device order;
    make_array_from_process_local_data takes a process's rows in this sorted order."""
    process = jax.process_index() if process is None else process
    indices = NamedSharding(mesh, batch_spec()).devices_indices_map((batch_size, 1))
    rows = sorted({r for d, idx in indices.items() if d.process_index == process
                   for r in range(*idx[0].indices(batch_size))})
    if rows and rows == list(range(rows[0], rows[-1] + 1)):
        return range(rows[0], rows[-1] + 1)
    return tuple(rows)


def bubble_fraction(pp, microbatches, kind="gpipe", virtual_stages=1):
    """(pp - 1) / (V M + pp - 1); pipeline.schedule(...).bubble() counts it off the table."""
    return formula_bubble(kind, pp, microbatches, virtual_stages)


def memory_summary(params, opt_state, compiled, device):
    out = dict(params_bytes=param_bytes_on_device(params, device), opt_bytes=param_bytes_on_device(opt_state, device))
    try:
        mem = compiled.memory_analysis()
        out["temp_bytes"] = int(mem.temp_size_in_bytes)
    except Exception:  # not every backend reports it
        out["temp_bytes"] = -1
    return out
