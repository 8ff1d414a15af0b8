"""The 3-D mesh and everything that talks across it: sharding table, FSDP gathers,
the GPipe pipeline (1f1b and interleaved: pipeline.py), and the train / eval steps.

Mesh axes:
  dp  data parallel + FSDP (ZeRO-3): the batch is split over dp, and so is (almost)
      every weight and its optimizer state; a block's weights are all-gathered just
      before use, and autodiff turns that all-gather into a reduce-scatter of the
      gradient.
  pp  pipeline: stage i holds blocks [i*N/pp, (i+1)*N/pp); microbatches flow stage to
      stage with ppermute (GPipe), gradients flow back by autodiff.
  tp  tensor parallel (Megatron): heads, FFN hidden units, expert hidden units and the
      vocabulary are split; model.py psums the partial outputs over tp.
  Experts may also be split over dp (expert parallelism, all-to-all in model.MoE).

The whole train step is one `jax.shard_map` over the mesh, so every collective is
written out (auto_sharding.py has the same step partitioned by the compiler instead,
--mesh.sharding auto). Gradients of weights that are replicated over an axis (norm scales
over dp, the router over tp, the embedding over pp, ...) come out summed over that
axis without any code here: shard_map tracks which values vary over which axes
(check_vma), and the transpose of "use a replicated value with varying data" is a
psum. tests/test_parallel.py proves each layout equals one device.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from model import Transformer, apply_blocks, axis_index, balance_router_biases, live_axes, pmax_if, psum_if, rope_angles, router_biases
from pipeline import formula_bubble, scheduled_value_and_grad, when
from utils import ConfigError, apply_overrides

DP, PP, TP = "dp", "pp", "tp"
AXES = (DP, PP, TP)

# ----------------------------------------------------------------------------
# Mesh


def resolve_mesh_shape(mesh_cfg, n_devices):
    """(dp, pp, tp) with dp = -1 resolved to the devices left by pp and tp."""
    pp, tp = mesh_cfg.pp, mesh_cfg.tp
    if pp < 1 or tp < 1:
        raise ConfigError(f"--mesh.pp ({pp}) and --mesh.tp ({tp}) must be >= 1")
    dp = mesh_cfg.dp
    if dp == -1:
        if n_devices % (pp * tp):
            raise ConfigError(f"{n_devices} devices cannot be split into pp={pp} x tp={tp}; choose pp x tp dividing {n_devices}")
        dp = n_devices // (pp * tp)
    if dp * pp * tp != n_devices:
        raise ConfigError(f"mesh dp={dp} x pp={pp} x tp={tp} = {dp * pp * tp} devices, but there are {n_devices}; "
                          f"set --mesh.dp -1 to use the rest, or change --mesh.* (or --run.cpu_devices)")
    return dp, pp, tp


def make_mesh(mesh_cfg, devices=None):
    """The (dp, pp, tp) mesh over `devices` (default: all), the same for training and
    for planner.py --tpu.

    Device order, and why: tp is innermost, so a tp group is the closest chips (one
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
    grid = tpu_device_grid(shape, devices) if devices[0].platform == "tpu" else mesh_utils.create_device_mesh(shape, devices)
    return Mesh(grid, AXES, axis_types=(AxisType.Explicit,) * 3)


def tpu_device_grid(shape, devices):
    """[dp, pp, tp] array of TPU devices: jax's topology-aware order if it keeps tp
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
    dp, pp, tp = grid.shape
    tp_hosts = max(len({d.process_index for d in grid[i, j]}) for i in range(dp) for j in range(pp))
    rows_of = {}
    for i in range(dp):
        for d in grid[i].flat:
            rows_of.setdefault(d.process_index, set()).add(i)
    return tp_hosts, max(len(rows) for rows in rows_of.values())


# ----------------------------------------------------------------------------
# The sharding table: weight name -> how each of its dims is split.
#
# Names end in their shape letters (model.py legend). Per dim:
#   TP     split over tp for compute (Megatron): each device uses its slice
#   EXPERT split over dp when expert parallelism is on (each device owns E/dp experts)
#   FSDP   split for storage only (ZeRO-3) over every mesh axis that does not split
#          the weight for compute; all-gathered just before use
# Weights inside the stacked blocks get a leading N dim split over pp. So a weight
# that every tp device needs whole (wq_down_DQ) is stored over dp x tp, the
# embedding (needed by every stage) over dp x pp, and each weight is held once.

FSDP, EXPERT = "fsdp", "expert"
# Not weights the optimizer trains: kept in float32 in the forward pass (a bias step of
# 0.001 is below bfloat16's resolution near 0.5) and left out of AdamW's weight decay.
UNTRAINED = ("router_bias_E",)
WEIGHT_SPECS = {
    "embed_VD": (TP, FSDP),          # vocab rows over tp (vocab-parallel)
    "scale_D": (None,),              # RMSNorm scales: small, replicated everywhere
    "wq_down_DQ": (FSDP, None),      # latent down-projections: every tp device needs them whole
    "wkv_down_DA": (FSDP, None),
    "wk_rope_DR": (FSDP, None),      # the shared RoPE key
    "wq_up_QHK": (FSDP, TP, None),   # heads over tp
    "wq_rope_QHR": (FSDP, TP, None),
    "wk_up_AHK": (FSDP, TP, None),
    "wv_up_AHK": (FSDP, TP, None),
    "wo_HKD": (TP, None, FSDP),      # row-parallel output: psum over tp in model.py
    "w_gate_DF": (FSDP, TP),         # FFN and shared experts: hidden units over tp
    "w_up_DF": (FSDP, TP),
    "w_down_FD": (TP, FSDP),
    "w_hidden_DD": (FSDP, None),     # MTP: the two halves of V3's projection M_k
    "w_embed_DD": (FSDP, None),
    "router_DE": (FSDP, None),       # every tp device routes identically
    "router_bias_E": (None,),        # balancing bias (train state, not trained): same on every device
    "w_gate_EDF": (EXPERT, FSDP, TP),  # routed experts: expert hidden units over tp
    "w_up_EDF": (EXPERT, FSDP, TP),
    "w_down_EFD": (EXPERT, TP, FSDP),
}
SHAPE_LETTER_FLAGS = {"V": "vocab (padded; --model.vocab_multiple)", "D": "--model.d_model", "Q": "--model.q_latent",
                      "A": "--model.kv_latent", "R": "--model.rope_dim", "H": "--model.n_heads", "K": "--model.head_dim",
                      "F": "--model.d_ff / --model.d_expert", "E": "--model.n_experts", "N": "--model.n_blocks"}


def weight_name(path):
    return next(k.key for k in reversed(path) if isinstance(getattr(k, "key", None), str))


def is_stacked(path):
    return any(getattr(k, "key", None) == "blocks" for k in path)


def weight_layout(name, stacked, expert_parallel):
    """(dims, fsdp_axes, fsdp_dim): each dim's mesh axes (None, an axis, or a tuple of
    axes), the axes that split the FSDP dim for storage only, and that dim's index.
    Unknown weights are an error."""
    if name not in WEIGHT_SPECS:
        raise KeyError(f"no sharding rule for weight {name!r}: add it to WEIGHT_SPECS in parallel.py")
    dims = tuple({EXPERT: DP if expert_parallel else None}.get(d, d) for d in WEIGHT_SPECS[name])
    if stacked:
        dims = (PP,) + dims
    compute_axes = {d for d in dims if d not in (None, FSDP)}
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
    dp, pp, tp = (mesh.shape[a] for a in AXES)
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
    if t.batch_size % (dp * t.microbatches):
        raise ConfigError(f"--train.batch_size ({t.batch_size}) must be divisible by --mesh.dp x --train.microbatches "
                          f"({dp} x {t.microbatches} = {dp * t.microbatches})")
    if cfg.mesh.expert_parallel:
        if m.n_experts % dp:
            raise ConfigError(f"--model.n_experts ({m.n_experts}) must be divisible by --mesh.dp ({dp}) with --mesh.expert_parallel")
        if m.capacity_factor == 0:
            raise ConfigError("--mesh.expert_parallel needs fixed-size expert buffers: set --model.capacity_factor > 0")
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
# Inside shard_map: FSDP gather, the pipeline, the loss


def gather_for_use(params, expert_parallel, dtype, one_block=False, reduce_dtype=jnp.float32):
    """FSDP: cast local weights to the compute dtype and all-gather their storage-only
    split (the FSDP dim). Casting first halves the bytes sent in bfloat16. In the
    backward pass each all_gather becomes a reduce-scatter (psum_scatter): every device
    gets its shard of the gradient summed over all devices that used the weight.

    Gradients are reduced in `reduce_dtype` (--model.grad_reduce_dtype, float32 by
    default): summing dp x tp bfloat16 partial gradients loses precision, and TPU and
    GPU, unlike XLA:CPU, reduce in the dtype they are given. So the reduce-scatter
    runs in reduce_dtype (gather_weight), weights replicated over an axis (norm
    scales) are typed as varying over it before the cast (the psum autodiff inserts
    for them then sums reduce_dtype values), and the top-level weights (one_block
    False: the tied embedding and the final norm, gathered once per step and used by
    every microbatch) come out in reduce_dtype, so that their gradient accumulates
    over the microbatches in it; their users cast them to the compute dtype.
    one_block: the weights of one block, sliced out of the stack (no N dim)."""
    out_dtype = jnp.dtype(dtype) if one_block else jnp.promote_types(dtype, reduce_dtype)

    def gather(path, w):
        if weight_name(path) in UNTRAINED:  # replicated, float32, no gradient: nothing to gather
            return w
        _, fsdp_axes, fsdp_dim = weight_layout(weight_name(path), one_block, expert_parallel)
        replicated = live_axes(tuple(a for a in AXES if a not in jax.typeof(w).manual_axis_type.varying))
        if replicated:  # (in the wider of the two: the forward values must not change)
            w = jax.lax.pcast(w.astype(jnp.promote_types(dtype, reduce_dtype)), replicated, to="varying")
        # Axes of size 1 hold the whole dim already; XLA:CPU would still run (and copy
        # through) an all_gather over them: 3 ms of a 200 ms one-device step (shakespeare).
        fsdp_axes = tuple(a for a in fsdp_axes if jax.lax.axis_size(a) > 1)
        if not fsdp_axes:
            return w.astype(dtype).astype(out_dtype)
        # inside a block the stacked N dim is already sliced away
        return gather_weight(w, fsdp_axes, fsdp_dim - one_block, jnp.dtype(dtype), jnp.dtype(reduce_dtype), out_dtype)
    return jax.tree_util.tree_map_with_path(gather, params)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def gather_weight(w, axes, dim, dtype, reduce_dtype, out_dtype):
    """all_gather of w's shards over `axes` in the compute dtype (then out_dtype); its
    transpose, the reduce-scatter of the gradient, in reduce_dtype."""
    return jax.lax.all_gather(w.astype(dtype), axes, axis=dim, tiled=True).astype(out_dtype)


def _gather_weight_fwd(w, axes, dim, dtype, reduce_dtype, out_dtype):
    return gather_weight(w, axes, dim, dtype, reduce_dtype, out_dtype), jnp.zeros((0,), w.dtype)


def _gather_weight_bwd(axes, dim, dtype, reduce_dtype, out_dtype, like, g):
    g = jax.lax.psum_scatter(g.astype(reduce_dtype), axes, scatter_dimension=dim, tiled=True)
    return (g.astype(like.dtype),)


gather_weight.defvjp(_gather_weight_fwd, _gather_weight_bwd)


def varying_over(x, axis):
    """Type x as varying over `axis` (a scan carry must keep one type); over an axis of
    size 1 nothing varies (live_axes), and the pcast would transpose to an all-reduce."""
    if not live_axes(axis) or axis in jax.typeof(x).manual_axis_type.varying:
        return x
    return jax.lax.pcast(x, axis, to="varying")


def pipeline_loss(model, params_fn, tokens_MbT1, cfg, rng):
    """GPipe over pp: returns (summed cross-entropy of this device's rows, MoE stats of
    this stage's blocks [N/pp, ...], summed MTP cross-entropy). Runs inside shard_map.
    rng: the step's dropout key (dropout_rng), or None.

    At tick t stage s works on microbatch m = t - s: stage 0 embeds microbatch t,
    every other stage takes what its left neighbour produced at tick t-1 (ppermute).
    After M + pp - 1 ticks the last stage has produced every microbatch; the bubble
    (idle share) is (pp - 1) / (M + pp - 1).
    """
    m_cfg = cfg.model
    n_stages, stage = jax.lax.axis_size(PP), axis_index(PP)
    M, b, T1 = tokens_MbT1.shape
    inputs_MbT = tokens_MbT1[..., :-1]
    angles = rope_angles(jnp.arange(T1 - 1)[None, :], m_cfg.rope_dim, m_cfg.rope_theta)
    # The embedding on stage 0 only, the head and loss on the last stage only: no
    # stage computes what it would mask away (pipeline.when: a cond, zeros elsewhere).
    # (the embedding comes in float32, see gather_for_use: the stream runs in the compute dtype)
    x0_MbTD = when(n_stages == 1 or stage == 0, lambda t: jax.vmap(lambda t: model.embed(t, TP))(t).astype(m_cfg.dtype), inputs_MbT)
    ep_axis = DP if cfg.mesh.expert_parallel else None

    blocks_def, blocks_state = nnx.split(model.blocks)
    first_block = stage * jax.tree.leaves(blocks_state)[0].shape[0]
    # Dropout keys of this device's rows: rows [dp_index * M * b, ...) of the global
    # batch, microbatch m holding the m-th b of them (sharded_loss's reshape).
    keys_Mb = None if rng is None else dropout_rows(rng, axis_index(DP) * M * b, M * b).reshape(M, b)

    def run_stage(blocks_state, x_bTD, keys_b):
        return apply_blocks(nnx.merge(blocks_def, blocks_state), x_bTD, angles, TP, ep_axis, keys_b,
                            remat=m_cfg.remat, prepare=params_fn, unroll=m_cfg.unroll_blocks, first_block=first_block)

    if m_cfg.remat == "stage":  # keep only the stage's input per tick
        run_stage = jax.checkpoint(run_stage)

    def tick(carry, t):
        received_bTD = carry
        x_bTD = jnp.where(stage == 0, x0_MbTD[jnp.minimum(t, M - 1)], received_bTD)
        keys_b = None if keys_Mb is None else keys_Mb[jnp.clip(t - stage, 0, M - 1)]  # this tick's microbatch
        y_bTD, stats_N = run_stage(blocks_state, x_bTD, keys_b)
        valid = (t - stage >= 0) & (t - stage < M)  # is this stage working on a real microbatch?
        stats_N = jax.tree.map(lambda s: jnp.where(valid, s, jnp.zeros_like(s)), stats_N)
        # Hand the activation to the next stage; the last stage's output is kept as ys.
        sent_bTD = jax.lax.ppermute(y_bTD, PP, [(i, i + 1) for i in range(n_stages - 1)]) if n_stages > 1 else y_bTD
        return sent_bTD, (y_bTD, stats_N)

    ticks = jnp.arange(M + n_stages - 1)
    first_received = varying_over(jnp.zeros_like(x0_MbTD[0]), PP)  # the carry differs per stage from tick 1 on
    _, (y_tbTD, stats_tN) = jax.lax.scan(tick, first_received, ticks)
    outputs_MbTD = y_tbTD[n_stages - 1:]  # on the last stage, microbatch m finished at tick m + pp - 1
    ce_sum, mtp_sum = when(n_stages == 1 or stage == n_stages - 1, lambda y: last_stage_loss_sums(model, y, tokens_MbT1, angles, keys_Mb), outputs_MbTD)
    return ce_sum, jax.tree.map(lambda s: jnp.sum(s, axis=0), stats_tN), mtp_sum


def last_stage_loss_sums(model, outputs_MbTD, tokens_MbT1, angles, keys_Mb):
    """(summed cross-entropy, summed MTP cross-entropy over its depths; 0 without MTP)
    of the finished microbatches, whatever schedule produced them. keys_Mb: the dropout
    keys of each microbatch's rows (dropout_rows), or None.

    One microbatch at a time: the float32 logits [b, T, V/tp] of only one microbatch
    exist at once (the backward pass recomputes them per microbatch), instead of
    [M * b, T, V/tp], which for a large vocabulary would be most of a device's memory.
    """
    def microbatch_losses(x_bTD, tokens_bT1, m):
        ce = model.loss_sum(x_bTD, tokens_bT1[:, 1:], TP)
        if model.mtp is None:
            return ce, jnp.zeros((), jnp.float32)
        return ce, model.mtp_loss_sum(x_bTD, tokens_bT1, angles, TP, None if keys_Mb is None else keys_Mb[m])

    if outputs_MbTD.shape[0] == 1:  # nothing to split: skip the recomputation
        return microbatch_losses(outputs_MbTD[0], tokens_MbT1[0], 0)

    @jax.checkpoint
    def microbatch_loss(_, xs):
        return None, microbatch_losses(*xs)

    ce_M, mtp_M = jax.lax.scan(microbatch_loss, None, (outputs_MbTD, tokens_MbT1, jnp.arange(outputs_MbTD.shape[0])))[1]
    return jnp.sum(ce_M), jnp.sum(mtp_M)


def sharded_loss(params, tokens_bT1, graphdef, cfg, rng):
    """Global mean loss (cross-entropy + weighted load-balance loss) and metrics, from
    inside shard_map. Every device returns the same (mesh-invariant) numbers."""
    m_cfg, t_cfg = cfg.model, cfg.train
    dtype = jnp.dtype(m_cfg.dtype)
    ep = cfg.mesh.expert_parallel
    top = {k: v for k, v in params.items() if k != "blocks"}
    reduce_dtype = jnp.dtype(m_cfg.grad_reduce_dtype)
    top = gather_for_use(top, ep, dtype, reduce_dtype=reduce_dtype)  # embedding + final norm: gathered once per step
    # Only some stages use them (inside a cond): typed as varying over pp, their gradient
    # is summed over the stages by this pcast's transpose, outside the cond, where every
    # stage takes part (a psum inside a branch that only one stage takes never returns).
    top = jax.tree.map(lambda w: varying_over(w, PP), top)
    model = nnx.merge(graphdef, {**top, "blocks": params["blocks"]})
    blocks_fn = lambda block_params: gather_for_use(block_params, ep, dtype, one_block=True, reduce_dtype=reduce_dtype)  # noqa: E731
    M = t_cfg.microbatches
    tokens_MbT1 = tokens_bT1.reshape(M, tokens_bT1.shape[0] // M, tokens_bT1.shape[1])
    ce_sum, stats_N, mtp_sum = pipeline_loss(model, blocks_fn, tokens_MbT1, cfg, rng)
    return loss_and_metrics(ce_sum, stats_N, cfg, mtp_sum)


def loss_and_metrics(ce_sum, stats_N, cfg, mtp_sum=None):
    """(loss, metrics) from this device's summed cross-entropy, its stage's MoE
    statistics per block and its summed MTP cross-entropy (GPipe only: the 1f1b and
    interleaved executor refuses MTP, utils.validate_model)."""
    m_cfg, t_cfg = cfg.model, cfg.train
    n_tokens = t_cfg.batch_size * m_cfg.seq_len
    ce = psum_if(ce_sum, (DP, PP)) / n_tokens
    # Routing statistics, per block, summed over the batch. Every tp device routed the
    # same tokens the same way (the router is gathered whole), but the router came out
    # of an all_gather over tp, so shard_map types the statistics as varying over tp:
    # pmean/pmax state that they agree. pmean also gives each tp device 1/tp of the
    # aux loss gradient, which the router's reduce-scatter sums back to one.
    aux_sum_N = stats_N.pop("aux_loss_sum")
    seq_aux_sum_N = stats_N.pop("seq_aux_loss_sum", None)  # with --model.seq_aux_loss_weight
    n_moe_layers = m_cfg.n_blocks * m_cfg.block_pattern.count("M")
    mean_over_mesh = lambda sum_N, count: psum_if(psum_if(jnp.sum(sum_N), (DP, PP)), TP) / jax.lax.axis_size(TP) / count  # noqa: E731
    aux = jnp.zeros((), jnp.float32)
    if n_moe_layers:  # (a dense model's all-zero statistics are not reduced: XLA:CPU aborts on that all-reduce)
        stats_N = jax.tree.map(lambda s: pmax_if(psum_if(s, DP), TP), stats_N)
        groups_per_layer = n_tokens // (m_cfg.routing_group or m_cfg.seq_len)
        aux = mean_over_mesh(aux_sum_N, groups_per_layer * n_moe_layers)
    loss = ce + m_cfg.aux_loss_weight * aux
    metrics = dict(loss=ce, aux_loss=aux, stats_N=stats_N)
    if seq_aux_sum_N is not None:  # DeepSeek-V3's sequence-wise balance loss: mean over sequences and MoE layers
        metrics["seq_aux_loss"] = mean_over_mesh(seq_aux_sum_N, t_cfg.batch_size * n_moe_layers)
        loss = loss + m_cfg.seq_aux_loss_weight * metrics["seq_aux_loss"]
    if m_cfg.mtp_depth:  # V3: lambda / depth x sum over depths of each depth's loss, each divided by all T positions
        metrics["mtp_loss"] = psum_if(mtp_sum, (DP, PP)) / (n_tokens * m_cfg.mtp_depth)
        loss = loss + m_cfg.mtp_loss_weight * metrics["mtp_loss"]
    return loss, metrics


def global_grad_norm(grads, specs):
    """sqrt(sum of squares) over the whole mesh. Each shard's sum is psummed over the
    axes that split that weight only: a replicated weight's gradient is identical on
    every replica (shard_map already summed it), so it is counted once."""
    total = jnp.zeros((), jnp.float32)
    for g, spec in zip(jax.tree.leaves(grads), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))):
        sq = jnp.sum(jnp.square(g.astype(jnp.float32)))
        total += psum_if(sq, tuple(a for entry in spec for a in axes_of(entry)))
    return jnp.sqrt(total)


# ----------------------------------------------------------------------------
# Steps (the optimizer: optimizers.py)


def specs_of(tree):
    return jax.tree.map(lambda a: a.sharding.spec, tree)


def live_spec(spec, mesh):
    """spec without the mesh axes of size 1 (the same layout): as a shard_map in_spec it
    keeps values from being typed as varying over an axis that nothing splits, so no
    collective is needed over it (model.live_axes). A tree of specs is mapped."""
    if not isinstance(spec, P):
        return jax.tree.map(lambda s: live_spec(s, mesh), spec, is_leaf=lambda x: isinstance(x, P))
    live = [tuple(a for a in axes_of(entry) if mesh.shape[a] > 1) for entry in spec]
    return P(*(None if not axes else axes[0] if len(axes) == 1 else axes for axes in live))


def shard_map_live(fn, mesh, in_specs, out_specs):
    """jax.shard_map whose in_specs leave out the axes of size 1 (live_spec); the
    arguments are resharded to match, which moves nothing (the same layout). The
    outputs keep out_specs, so the step returns arrays with the specs it was given."""
    live = live_spec(in_specs, mesh)
    sharded = jax.shard_map(fn, mesh=mesh, in_specs=live, out_specs=out_specs)

    @functools.wraps(fn)  # jit names the program after fn (profiles, HLO dumps)
    def on_live_axes(*args):
        return sharded(*jax.reshard(args, named(mesh, live)))
    return on_live_axes


def batch_spec():
    return P(DP, None)  # rows over dp; pp and tp devices see the same rows


def make_train_step(graphdef, cfg, mesh, optimizer, params, opt_state):
    """One jitted function over the mesh: loss, grads, clip, the optimizer. Donates the old
    params and optimizer state (updated in place). --mesh.sharding auto: the same step
    partitioned by the compiler (auto_sharding.py)."""
    if cfg.mesh.sharding == "auto":
        import auto_sharding
        return auto_sharding.make_train_step(graphdef, cfg, mesh, optimizer, params, opt_state)
    param_spec_tree, opt_spec_tree = specs_of(params), specs_of(opt_state)
    clip = cfg.train.grad_clip

    def step_fn(params, opt_state, tokens_bT1, step):
        rng = dropout_rng(cfg, step)
        if cfg.train.pipeline == "gpipe":  # autodiff through the pipeline's loop
            (_, metrics), grads = jax.value_and_grad(sharded_loss, has_aux=True)(params, tokens_bT1, graphdef, cfg, rng)
        else:  # 1f1b / interleaved: the backward written by hand, tick by tick (pipeline.py)
            (_, metrics), grads = scheduled_value_and_grad(
                params, tokens_bT1, graphdef, cfg, rng, axes=AXES, dropout_rows=dropout_rows,
                gather=lambda tree, one_block: gather_for_use(tree, cfg.mesh.expert_parallel, jnp.dtype(cfg.model.dtype), one_block,
                                                              reduce_dtype=jnp.dtype(cfg.model.grad_reduce_dtype)),
                loss_and_metrics=lambda ce_sum, stats_N: loss_and_metrics(ce_sum, stats_N, cfg))
        grad_norm = global_grad_norm(grads, param_spec_tree)
        if clip > 0:
            scale = jnp.minimum(1.0, clip / (grad_norm + 1e-6))
            grads = jax.tree.map(lambda g: g * scale, grads)
        # the layout of these shards, for the optimizers that need whole matrices (Muon)
        updates, opt_state = optimizer.update(grads, opt_state, params, param_specs=param_spec_tree)
        new_params = optax.apply_updates(params, updates)
        metrics = dict(metrics, grad_norm=grad_norm)
        if balancing:
            # Outside the optimizer (whose update of a bias is exactly 0: zero gradient, no
            # decay), the router biases follow the step's global load. That load was
            # psummed over dp, so the new bias is the same on every device and mesh.
            blocks = balance_router_biases(new_params["blocks"], metrics["stats_N"]["tokens_per_expert_LE"],
                                           m_cfg.router_bias_rate, m_cfg.block_pattern)
            new_params = dict(new_params, blocks=blocks)
            metrics["router_bias_NLE"] = router_biases(blocks, m_cfg.block_pattern)
        return new_params, opt_state, metrics

    m_cfg = cfg.model
    balancing = m_cfg.router_bias_rate > 0 and "M" in m_cfg.block_pattern
    metric_specs = dict(loss=P(), aux_loss=P(), grad_norm=P(), stats_N=P(PP))
    if balancing:
        metric_specs["router_bias_NLE"] = P(PP)
    if m_cfg.seq_aux_loss_weight > 0 and "M" in m_cfg.block_pattern:
        metric_specs["seq_aux_loss"] = P()
    if m_cfg.mtp_depth:
        metric_specs["mtp_loss"] = P()
    sharded = shard_map_live(step_fn, mesh, in_specs=(param_spec_tree, opt_spec_tree, batch_spec(), P()),
                             out_specs=(param_spec_tree, opt_spec_tree, metric_specs))
    return jax.jit(sharded, donate_argnums=(0, 1))


def eval_model_config(cfg):
    """The model that evaluation measures: training's, with --train.eval_capacity_factor
    (0 = dropless, the function that sampling computes, so val_loss counts no token
    whose expert output was dropped). Expert parallelism needs fixed-size buffers, so
    there "dropless" is the capacity factor E / top_k: C = the group size, room for
    every token in every expert, nothing dropped."""
    m = cfg.model
    factor = cfg.train.eval_capacity_factor
    if factor == 0 and cfg.mesh.expert_parallel:
        factor = m.n_experts / m.top_k
    return apply_overrides(cfg, {"model": {"capacity_factor": factor}})


def make_eval_step(graphdef, cfg, mesh, params):
    """Mean validation cross-entropy of one batch (dropout off), with the eval
    capacity (eval_model_config). graphdef: training's; the capacity is a static
    attribute of the MoE layers, so the eval graphdef is built anew (same params)."""
    cfg = eval_model_config(cfg)
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model, nnx.Rngs(0))))[0]
    if cfg.mesh.sharding == "auto":
        import auto_sharding
        return auto_sharding.make_eval_step(graphdef, cfg, mesh, params)

    def eval_fn(params, tokens_bT1):
        _, metrics = sharded_loss(params, tokens_bT1, graphdef, cfg, None)
        return metrics["loss"]

    return jax.jit(shard_map_live(eval_fn, mesh, in_specs=(specs_of(params), batch_spec()), out_specs=P()))


def dropout_rng(cfg, step):
    """The dropout key of a step, from (seed, step) alone: the same on every device
    (None without dropout). Masks are drawn from it per global batch row
    (dropout_rows), then per block, layer and branch (model.fold_in_rows), so a run
    with dropout takes the same steps on every mesh. Megatron-style per-tp-rank keys
    are not needed: dropout only masks the residual stream, which every tp device
    holds whole."""
    if cfg.model.dropout == 0:
        return None
    return jax.random.fold_in(jax.random.key(cfg.run.seed), step)


def dropout_rows(rng, first_row, n_rows):
    """Keys [n_rows] for global batch rows first_row, first_row + 1, ...: each device
    derives only the keys of the rows it holds."""
    return jax.vmap(jax.random.fold_in, (None, 0))(rng, first_row + jnp.arange(n_rows))


def global_batch(mesh, rows_for_process, batch_size):
    """Assemble this process's rows into a global array split over dp."""
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
