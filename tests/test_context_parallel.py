"""--mesh.cp (ops/context_parallel.py): every sequence split over cp, rank i holding chunks
i and 2cp-1-i, attention gathering the MLA latent over cp. On 8 fake CPU devices,
float32, the deepseek_v3 preset (every loss term on, the aux loss weighted) at T = 256:
two train steps equal one device within 1e-5 (loss and its parts, grad norm, each
gradient leaf through the optimizer's moments, router biases, the weights); the
collectives over cp in the compiled step move kv_latent + rope_dim numbers per token and
nothing of heads x head_dim; bad flags are one-line errors.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from model import MLAttention, project, rope_angles
from ops.blockwise import blockwise_attention
from ops.context_parallel import SequenceChunks, chunk_positions, gathered_positions
from parallel.mesh import make_mesh, resolve_mesh_shape
from planning import hlo_reader
from test_executors import REAL_CHECKPOINT_OPTIONS
from test_parallel import RTOL, assert_tree_close, placed_step, train_steps
from utils import CP, PRESETS, Config, ConfigError, MeshConfig, apply_overrides, config_from_dict, config_to_dict, parse_args

SEQ_LEN, ROUTING_GROUP = 256, 16  # a routing group must divide T / (2 cp) = 16 at cp 8


def v3_config(dp=1, cp=1, pp=1, tp=1, optimizer="adamw", pipeline="gpipe", slices=1, expert_parallel=False, sharding="manual", microbatches=None,
              **model):
    """The deepseek_v3 preset with the real checkpoints' options (test_executors), narrower
    (D 64) and shorter in vocabulary, a dense layer first and 4 blocks in a loop (2 chunks
    per stage for interleaved on pp 2), with the aux loss weighted (the preset's 0 would
    hide its gradient), dropout on, and routing groups of 16 tokens (the preset's
    whole-sequence group would straddle cp ranks)."""
    cfg = apply_overrides(Config(), PRESETS["deepseek_v3"])
    model = dict(vocab_size=256, seq_len=SEQ_LEN, d_model=64, n_blocks=4, first_dense=1, dtype="float32", unroll_blocks=False,
                 aux_loss_weight=0.01, routing_group=ROUTING_GROUP, attention_block=16, dropout=0.1,
                 **REAL_CHECKPOINT_OPTIONS | dict(rope_original_len=64)) | model
    return apply_overrides(cfg, {"model": model, "mesh": dict(dp=dp, cp=cp, pp=pp, tp=tp, slices=slices, expert_parallel=expert_parallel,
                                              sharding=sharding),
                                 "train": dict(batch_size=4, microbatches=microbatches or (2 if pp > 1 else 1), optimizer=optimizer,
                                               pipeline=pipeline, virtual_stages=2)})


@functools.cache
def one_device(optimizer="adamw"):
    return train_steps(v3_config(optimizer=optimizer))


@pytest.fixture(scope="module")
def reference():
    return {"matmul": one_device()}


def trained_leaves(tree):
    """The leaves of a tree (an optimizer state) but the router biases' (untrained: zero
    moments), Adam's second moments nu = EMA of g^2 as their square roots: on the
    gradient's scale, where 1e-5 is the gradient's tolerance (nu itself doubles a
    relative difference)."""
    flat = [(jax.tree_util.keystr(path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]
    return {key: np.sqrt(leaf) if ".nu" in key else leaf for key, leaf in flat if "router_bias" not in key}


# AdamW's moments of the small norm scales (ffn_norm, kv_norm, the shared rotary key) are
# sums over every token, reassociated by cp's chunk order: they differ from one device's
# by up to 1.8e-5 (relative, float32) on a 2-core AMD EPYC and 2.56e-5 on CI's machine
# (dp2xcp2xtp2-auto), at 5e1a73d already. A lost or doubled chunk moves them by ~1/cp
# (0.5 at cp 2), so 1e-4 still fails every real fault. The weights, losses and grad norm
# stay within RTOL, but for the weights under --mesh.sharding auto (the partitioner's own
# reduction order): AdamW's first step moves each weight by +-lr whatever its gradient's
# size, so an element whose gradient is ~0 can flip sign there (1.75e-5 measured on
# dp2xcp2xtp2-auto's prefix w_down_FD); those are held to MOMENT_RTOL too.
MOMENT_RTOL = 1e-4


def assert_equals_one_device(result, reference, params_rtol=RTOL):
    """test_parallel.assert_same_steps' comparison (the gradients through AdamW's
    moments, after each step, within MOMENT_RTOL), plus every loss part and the router biases."""
    (metrics, opt_states, params), (ref_metrics, ref_opt_states, ref_params) = result, reference
    for s, (o, ref_o) in enumerate(zip(opt_states, ref_opt_states)):
        assert_tree_close(trained_leaves(o), trained_leaves(ref_o), rtol=MOMENT_RTOL, what=f"optimizer state after step {s}: ")
    assert_tree_close(params, ref_params, rtol=params_rtol, what="params: ")
    for s, (m, ref_m) in enumerate(zip(metrics, ref_metrics)):
        np.testing.assert_array_equal(m["stats_N"]["tokens_per_expert"], ref_m["stats_N"]["tokens_per_expert"])
        for key in ("loss", "aux_loss", "grad_norm", "seq_aux_loss", "mtp_loss", "max_logit"):
            assert ref_m[key] > 0, key
            np.testing.assert_allclose(m[key], ref_m[key], rtol=RTOL, err_msg=f"step {s}: {key}")
        assert_tree_close(m["max_logit_NLH"], ref_m["max_logit_NLH"], what=f"step {s}: max_logit_NLH")  # (test_parallel: why as a whole)
        assert np.abs(ref_m["router_bias_NLE"]).max() > 0
        np.testing.assert_allclose(m["router_bias_NLE"], ref_m["router_bias_NLE"], atol=1e-7, err_msg=f"step {s}: router biases")


# (all slow: the fast selection keeps cp's attention on chunks, the chunks' balance and the bad flags)
CASES = [pytest.param(dict(dp=2, cp=2, tp=2), id="dp2xcp2xtp2", marks=pytest.mark.slow),
         pytest.param(dict(cp=2), id="cp2", marks=pytest.mark.slow),
         pytest.param(dict(cp=4, remat="block_dots"), id="cp4-remat-block_dots", marks=pytest.mark.slow),
         pytest.param(dict(cp=8, remat="block"), id="cp8-remat-block", marks=pytest.mark.slow),
         pytest.param(dict(cp=2, pp=2, tp=2), id="cp2xpp2xtp2", marks=pytest.mark.slow),
         pytest.param(dict(cp=2, pp=2, tp=2, pipeline="1f1b", remat="layer"), id="cp2xpp2xtp2-1f1b-remat-layer", marks=pytest.mark.slow),
         pytest.param(dict(cp=2, pp=2, tp=2, pipeline="interleaved", remat="stage"), id="cp2xpp2xtp2-interleaved-stage",
                      marks=pytest.mark.slow),
         # (zb1: the same executor as zbv, its B and W apart, one chunk a stage)
         pytest.param(dict(cp=2, pp=2, tp=2, pipeline="zbv", microbatches=4), id="cp2xpp2xtp2-zbv", marks=pytest.mark.slow),
         pytest.param(dict(dp=2, cp=2, tp=2, sharding="auto"), id="dp2xcp2xtp2-auto", marks=pytest.mark.slow),
         pytest.param(dict(dp=2, cp=2, tp=2, expert_parallel=True), id="dp2xcp2xtp2-ep", marks=pytest.mark.slow),
         pytest.param(dict(cp=2, tp=2, slices=2), id="2slices-cp2xtp2", marks=pytest.mark.slow)]


@pytest.mark.parametrize("mesh", CASES)
def test_context_parallel_equals_one_device(reference, mesh):
    assert_equals_one_device(train_steps(v3_config(**mesh)), reference["matmul"],
                             params_rtol=MOMENT_RTOL if mesh.get("sharding") == "auto" else RTOL)


@pytest.mark.slow
def test_context_parallel_blockwise_attention_equals_one_device(reference):
    """The blockwise kernel on cp 4 (blocks of 16 = one chunk: the skipped block pairs
    are whole chunks) against the matmul kernel on one device."""
    assert_equals_one_device(train_steps(v3_config(cp=4, attention="blockwise")), reference["matmul"])


@pytest.mark.slow
def test_context_parallel_with_muon_equals_one_device():
    """Muon orthogonalizes each matrix on one owner among the devices that store it:
    with storage over dp x cp those owners are other devices than without cp."""
    assert_equals_one_device(train_steps(v3_config(dp=2, cp=2, tp=2, optimizer="muon")), one_device("muon"))


@pytest.mark.parametrize("seq_len, cp", [(32, 2), (64, 4), (256, 8)])
def test_every_cp_rank_holds_the_same_causal_attention_work(seq_len, cp):
    """The ranks' positions (chunk_positions) cover the sequence once, and under the
    causal mask every rank's queries see the same number of keys, T (T + 1) / (2 cp)
    (contiguous chunks would give the last rank 2 cp - 1 times the first's work). The
    gathered keys sit in rank order."""
    positions_RT = np.stack([chunk_positions(seq_len, cp, rank, np) for rank in range(cp)])
    np.testing.assert_array_equal(np.sort(positions_RT.ravel()), np.arange(seq_len))
    np.testing.assert_array_equal(gathered_positions(seq_len, cp), positions_RT.ravel())
    visible_pairs_R = [int(np.sum(positions_T[:, None] >= np.arange(seq_len)[None, :])) for positions_T in positions_RT]
    assert visible_pairs_R == [seq_len * (seq_len + 1) // (2 * cp)] * cp


@functools.cache
def compiled_hlo(cfg):
    step, (params, opt_state, batch) = placed_step(cfg)
    return step.lower(params, opt_state, batch, jnp.asarray(0)).compile().as_text()


@pytest.mark.slow
def test_collectives_over_cp_move_the_latent_not_keys_and_values():
    """On dp2 x cp2 x tp2 the weights' FSDP collectives run over dp+cp (or dp+cp+tp),
    so those over cp alone are attention's and the sequence-wise loss's statistics. Per
    attention layer (4 in the blocks, 2 in the MTP block) one all-gather of the latent
    [b, T, A + R] forward, one reduce-scatter of its gradient [b, T / cp, A + R] backward;
    nothing else over cp is bigger than [b, E]: keys and values [b, T, H, K] never cross."""
    cfg = v3_config(dp=2, cp=2, tp=2)
    m = cfg.model
    ops = [op for op in hlo_reader.collective_ops(compiled_hlo(cfg), make_mesh(cfg.mesh, jax.devices()[:8]).devices.shape)
           if op.over == "cp"]
    b, latent = cfg.train.batch_size // 2, m.kv_latent + m.rope_dim
    n_attention = m.first_dense + m.n_blocks * len(m.block_pattern) + m.mtp_depth * len(m.block_pattern)
    sizes = lambda kind: sorted(nbytes for op in ops if op.kind == kind for _ in range(op.runs) for _, nbytes in op.arrays)  # noqa: E731
    assert sizes("all-gather") == [b * SEQ_LEN * latent * 4] * n_attention, sizes("all-gather")
    assert sizes("reduce-scatter") == [b * SEQ_LEN // 2 * latent * 4] * n_attention, sizes("reduce-scatter")
    others = [op for op in ops if op.kind not in ("all-gather", "reduce-scatter")]
    assert all(nbytes <= b * m.n_experts * 4 for op in others for _, nbytes in op.arrays), others
    assert m.n_heads * m.head_dim > 2 * latent  # keys alone would be more than twice the latent's bytes


@pytest.mark.slow
def test_the_compiler_gathers_the_latent_under_auto():
    """Under --mesh.sharding auto the partitioner writes the collectives: with rows [B, T]
    kept apart in the projections (model.sequence_split_by_the_compiler) it all-gathers
    the latent [b, T, kv_latent + rope_dim] over cp in every attention layer's forward,
    as the manual executors do. (Flattening the rows made it gather the residual stream
    instead, 37 times, and none of the latent: the sequence was not split.)"""
    cfg = v3_config(dp=2, cp=2, tp=2, sharding="auto")
    m = cfg.model
    ops = [op for op in hlo_reader.collective_ops(compiled_hlo(cfg), make_mesh(cfg.mesh, jax.devices()[:8]).devices.shape)
           if op.over == "cp" and op.kind == "all-gather"]
    latent_bytes = cfg.train.batch_size // 2 * SEQ_LEN * (m.kv_latent + m.rope_dim) * 4
    n_attention = m.first_dense + m.n_blocks * len(m.block_pattern) + m.mtp_depth * len(m.block_pattern)
    assert sum(op.runs for op in ops for _, nbytes in op.arrays if nbytes == latent_bytes) >= n_attention
    residual_bytes = cfg.train.batch_size // 2 * SEQ_LEN * m.d_model * 4
    assert sum(op.runs for op in ops for _, nbytes in op.arrays if nbytes == residual_bytes) < n_attention


@pytest.mark.parametrize("argv, message", [
    (["--mesh.cp", "2", "--model.seq_len", "250", "--model.routing_group", "25"],
     r"--model.seq_len \(250\) must be divisible by 2 x --mesh.cp \(4\)"),
    (["--mesh.cp", "4"], r"--model.routing_group \(128\) must divide --model.seq_len / \(2 x --mesh.cp\) = 16"),
    (["--mesh.cp", "2", "--model.routing_group", "32", "--model.attention", "dot_product_attention"],
     "--mesh.cp 2 needs --model.attention matmul, blockwise or splash"),
])
def test_bad_context_parallel_flags_are_one_line_errors(argv, message):
    with pytest.raises(ConfigError, match=message) as error:
        parse_args(argv)
    assert "\n" not in str(error.value)


def test_cp_times_the_other_axes_must_be_the_device_count():
    with pytest.raises(ConfigError, match=r"mesh dp=2 x cp=2 x pp=1 x tp=4 = 16 devices, but there are 8") as error:
        resolve_mesh_shape(MeshConfig(dp=2, cp=2, tp=4), 8)
    assert "\n" not in str(error.value)
    assert resolve_mesh_shape(MeshConfig(cp=2, tp=2), 8) == (2, 2, 1, 2)  # dp -1: the rest


def attention_with_gather(keys_values):
    """One MLA attention layer at DeepSeek-V3's head widths (128 heads of 128, kv_latent
    512, rope_dim 64; d_model 128 and T = 256 to stay small) on cp 2, as a function of
    (weights, x), x [1, T, D] in cp rank order. keys_values False: the model's attention
    (MLAttention.__call__: the latent gathered over cp); True: what context parallelism
    without MLA does, keys and values up-projected on each rank's own tokens and gathered."""
    cfg = dataclasses.replace(v3_config().model, d_model=128, n_heads=128, head_dim=128, kv_latent=512, rope_dim=64, q_latent=0,
                              first_dense=0, dropout=0.0)
    attn = MLAttention(cfg, nnx.Rngs(0))
    graphdef, weights = nnx.split(attn)
    T, cp = SEQ_LEN, 2

    def local(weights, x_bTD):
        attn = nnx.merge(graphdef, weights)
        positions_T = chunk_positions(T, cp, jax.lax.axis_index(CP))
        chunks = SequenceChunks(rope_angles(positions_T[None, :], cfg), positions_T, jnp.asarray(gathered_positions(T, cp)), CP)
        if not keys_values:
            return attn(x_bTD, chunks)
        q_nope, q_rope = attn.queries(x_bTD, chunks.angles)
        kv, k_rope = attn.latents(x_bTD, chunks.angles)
        k_nope, v = project(kv, attn.wk_up_AHK[...]), project(kv, attn.wv_up_AHK[...])
        k_nope, v, k_rope = (jax.lax.all_gather(a, CP, axis=1, tiled=True) for a in (k_nope, v, k_rope))
        out = blockwise_attention(q_nope, q_rope, k_nope, k_rope, v, chunks.q_pos_T, chunks.k_pos_S, attn.softmax_scale, 64)
        return project(out, attn.wo_HKD[...], 2)

    mesh = jax.make_mesh((cp,), (CP,), devices=jax.devices()[:cp], axis_types=(jax.sharding.AxisType.Auto,))
    sharded = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(None, CP)), out_specs=P(None, CP))
    x_bTD = jax.random.normal(jax.random.key(1), (1, T, cfg.d_model))
    return jax.jit(jax.value_and_grad(lambda w, x: jnp.sum(sharded(w, x) ** 2), argnums=(0, 1))), (weights, x_bTD), mesh


def test_blockwise_attention_on_cp_chunks_equals_one_device():
    """One narrow MLA layer with the blockwise kernel on cp 2 (T 256, blocks of 16 = one
    chunk) equals the matmul kernel on one device at every position: its causal mask
    and block skipping see each rank's queries at their global positions."""
    cfg = dataclasses.replace(v3_config().model, n_heads=4, head_dim=16, kv_latent=32, rope_dim=8, q_latent=0, dropout=0.0)
    T, cp = SEQ_LEN, 2
    graphdef, weights = nnx.split(MLAttention(cfg, nnx.Rngs(0)))
    on_cp = nnx.graphdef(MLAttention(dataclasses.replace(cfg, attention="blockwise"), nnx.Rngs(0)))
    x_bTD = jax.random.normal(jax.random.key(1), (1, T, cfg.d_model))
    whole_bTD = nnx.merge(graphdef, weights)(x_bTD, rope_angles(jnp.arange(T)[None, :], cfg))

    def local(weights, x_bTD):
        positions_T = chunk_positions(T, cp, jax.lax.axis_index(CP))
        chunks = SequenceChunks(rope_angles(positions_T[None, :], cfg), positions_T, jnp.asarray(gathered_positions(T, cp)), CP)
        return nnx.merge(on_cp, weights)(x_bTD, chunks)

    mesh = jax.make_mesh((cp,), (CP,), devices=jax.devices()[:cp], axis_types=(jax.sharding.AxisType.Auto,))
    sharded = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(None, CP)), out_specs=P(None, CP)))
    order_T = gathered_positions(T, cp)  # rank order: rank 0's chunks, then rank 1's
    np.testing.assert_allclose(sharded(weights, x_bTD[:, order_T]), whole_bTD[:, order_T], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_the_latent_crosses_cp_57x_smaller_than_keys_and_values():
    """The byte comparison of docs/parallelism.md, from the compiled programs: at V3's
    widths one attention layer's collectives over cp move kv_latent + rope_dim = 576
    numbers per token (all-gather forward, reduce-scatter backward); gathering keys and
    values moves 2 x 128 x 128 + 64 = 32,832, 57x more. Both compute the same numbers."""
    results, moved = [], []
    for keys_values in (False, True):
        fn, args, mesh = attention_with_gather(keys_values)
        results.append(fn(*args))
        ops = hlo_reader.collective_ops(fn.lower(*args).compile().as_text(), mesh.devices.shape)
        moved.append({kind: sum(nbytes * op.runs for op in ops if op.kind == kind for _, nbytes in op.arrays)
                      for kind in ("all-gather", "reduce-scatter")})
    (latent_value, latent_grads), (kv_value, kv_grads) = results
    np.testing.assert_allclose(latent_value, kv_value, rtol=1e-5)
    assert_tree_close(latent_grads, kv_grads)
    print(f"bytes over cp per attention layer (T {SEQ_LEN}, cp 2, float32): latent {moved[0]}, keys and values {moved[1]}")
    assert moved[0] == {"all-gather": SEQ_LEN * 576 * 4, "reduce-scatter": SEQ_LEN // 2 * 576 * 4}
    assert moved[1] == {"all-gather": SEQ_LEN * (2 * 128 * 128 + 64) * 4, "reduce-scatter": SEQ_LEN // 2 * (2 * 128 * 128 + 64) * 4}


def test_a_config_saved_before_cp_restores_with_cp_1():
    """Run directories and checkpoints written before --mesh.cp existed have no cp key."""
    saved = config_to_dict(v3_config())
    del saved["mesh"]["cp"]
    assert config_from_dict(saved) == v3_config()
