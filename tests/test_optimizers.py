"""Muon (parallel/optimizers.py): the orthogonalization does what it claims, Muon trains exactly
the weight matrices, and a Muon step is the same on every mesh as on one device
(each matrix is orthogonalized whole by one owner device of those that hold its
shards), with the Newton-Schulz work split among them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model import Transformer
from parallel import optimizers
from parallel.mesh import specs_of
from parallel.weights import init_params, is_stacked, weight_name
from test_parallel import MESH_IDS, VARIANTS, assert_same_step, assert_same_steps, mesh_for, one_step, placed_step, tiny_config, train_steps
from utils import PRESETS, Config, apply_overrides


def muon_config(mesh_shape=(1, 1, 1), expert_parallel=False, **model):
    return apply_overrides(tiny_config(mesh_shape, expert_parallel, **model), {"train": dict(optimizer="muon")})


@pytest.fixture(scope="module")
def reference():
    """One-device Muon results, per model variant."""
    return {variant: train_steps(muon_config(**kwargs)) for variant, kwargs in VARIANTS.items()}


# Each kind of split once per variant (a Muon step adds its gathers to those that
# tests/test_parallel.py proves on every mesh): dp alone, tp alone, all three, pp x tp.
MUON_CASES = [("moe", (8, 1, 1)), ("moe", (2, 2, 2)), ("moe", (1, 4, 2)), ("dense", (1, 1, 8)), ("dense", (2, 1, 4))]


@pytest.mark.parametrize("variant, mesh_shape", [pytest.param(v, m, marks=[pytest.mark.slow] if m in ((8, 1, 1), (2, 1, 4)) else [])
                                                 for v, m in MUON_CASES],  # (dp alone: also inside 2x2x2; 2x1x4: 1x1x8 and 2x2x2)
                         ids=[f"{v}-{MESH_IDS(m)}" for v, m in MUON_CASES])
def test_muon_steps_equal_one_device(reference, variant, mesh_shape):
    """Loss, grad norm, momentum and AdamW moments after each of 2 steps, and the
    params: the same as one device. The matrices here are split over dp (FSDP), tp
    (heads, hidden units) and both. Orthogonalizing each shard alone instead of the
    whole matrix fails this on 8x1x1, 1x1x8 and 2x1x4 (step 1's loss is already off by
    1e-4 to 5e-4)."""
    assert_same_steps(train_steps(muon_config(mesh_shape, **VARIANTS[variant])), reference[variant])


@pytest.mark.parametrize("mesh_shape", [(2, 2, 2)], ids=MESH_IDS)
def test_muon_with_expert_parallelism_equals_one_device(reference, mesh_shape):
    """Experts split over dp are a batch of matrices each device holds whole (but for
    tp): the experts' dim is not gathered, the rest is."""
    assert_same_steps(train_steps(muon_config(mesh_shape, expert_parallel=True)), reference["moe"])


@pytest.mark.slow
def test_muon_under_automatic_sharding_equals_one_device():
    """--mesh.sharding auto: the update runs on global arrays (nothing to gather by hand)."""
    cfg = apply_overrides(muon_config((2, 1, 4)), {"mesh": dict(sharding="auto")})
    assert_same_step(*one_step(cfg), *one_step(muon_config()))


def test_muon_inside_shard_map_needs_the_param_specs():
    """Without the specs (which steps.make_train_step passes) the update would
    orthogonalize each shard alone: an error, not a wrong step."""
    cfg = muon_config((2, 1, 1))
    mesh = mesh_for(cfg)
    _, params = init_params(cfg.model, mesh, False, cfg.run.seed)
    optimizer = optimizers.make_optimizer(cfg.train)
    opt_state = optimizers.init_opt_state(optimizer, params, mesh)
    specs = (specs_of(params), specs_of(opt_state))
    update = jax.shard_map(lambda p, s: optimizer.update(p, s, p)[0], mesh=mesh, in_specs=specs, out_specs=specs[0])
    with pytest.raises(ValueError, match="PartitionSpecs"):
        jax.jit(update).lower(params, opt_state)


@pytest.mark.slow
def test_newton_schulz_flops_per_device_fall_by_the_group_size():
    """On dp4 x tp2 every matrix of the tiny model is split 8 ways (FSDP over dp, heads
    or hidden units over tp) and every pool holds a multiple of 8 matrices, so each
    device's Newton-Schulz dots, read off the optimized HLO, are exactly 1/8 of one
    device's. (Gathering every matrix to every device of its group, the former update,
    gives 1/1: 72.8 MFLOP on both; now 9.10 on dp4 x tp2.)"""
    from planning import hlo_reader

    flops = {}
    for mesh_shape in [(1, 1, 1), (4, 1, 2)]:
        step, args = placed_step(muon_config(mesh_shape))
        flops[mesh_shape] = hlo_reader.dot_flops(step.lower(*args, jnp.asarray(0)).compile().as_text(), "newton_schulz")
    assert flops[(1, 1, 1)] > 0
    assert flops[(4, 1, 2)] * 8 == flops[(1, 1, 1)], flops


def singular_values(x):
    return np.linalg.svd(np.asarray(x, np.float64), compute_uv=False)


@pytest.mark.parametrize("shape", [(64, 16), (16, 64), (3, 48, 48)], ids=["tall", "wide", "batch"])
def test_orthogonalize_gives_about_the_polar_factor(shape):
    """Newton-Schulz on a matrix with singular values spread over 30x: every singular
    value of the result in Jordan's about [0.7, 1.2] (the plain SVD would give 1), and
    the result points where U V^T does (measured: 0.68-1.13, cosine 0.985)."""
    rng = np.random.default_rng(0)
    *batch, m, n = shape
    k = min(m, n)
    u = np.linalg.qr(rng.normal(size=(*batch, m, k)))[0]
    v = np.linalg.qr(rng.normal(size=(*batch, n, k)))[0]
    s = np.geomspace(30, 1, k)
    g = np.einsum("...ik,k,...jk->...ij", u, s, v).astype(np.float32)
    got = np.asarray(optimizers.orthogonalize(jnp.asarray(g.reshape(-1, m, n)))).reshape(shape)
    assert got.shape == g.shape
    for one, u_, v_ in zip(got.reshape(-1, m, n), u.reshape(-1, m, k), v.reshape(-1, n, k)):
        sv = singular_values(one)
        assert 0.65 < sv.min() and sv.max() < 1.25, sv
        polar = u_ @ v_.T
        cosine = np.sum(one * polar) / (np.linalg.norm(one) * np.linalg.norm(polar))
        assert cosine > 0.98


def test_muon_update_has_rms_0_2_times_the_learning_rate():
    """One Muon step on a weight matrix (no decay, warmup done): each element moves by
    about lr x 0.2 in RMS, whatever the gradient's scale (AdamW's first step: ~lr)."""
    cfg = apply_overrides(Config(), {"train": dict(optimizer="muon", weight_decay=0.0, warmup_steps=0, lr=1e-2)})
    params = dict(w_up_DF=jnp.zeros((32, 128)), embed_VD=jnp.zeros((64, 32)))
    optimizer = optimizers.make_optimizer(cfg.train)
    grads = dict(w_up_DF=1e-4 * jax.random.normal(jax.random.key(1), (32, 128)), embed_VD=jax.random.normal(jax.random.key(2), (64, 32)))
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    rms = float(jnp.sqrt(jnp.mean(jnp.square(updates["w_up_DF"]))))
    assert 0.8 * 0.2e-2 < rms < 1.2 * 0.2e-2, rms
    # the embedding is AdamW's: its first step is lr x sign(g) (bias-corrected moments)
    np.testing.assert_allclose(np.abs(updates["embed_VD"]), 1e-2, rtol=1e-4)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_weight_matrix_is_muons(preset):
    """Muon trains every weight with 2+ dims but the embedding, the untied head and the routers (the
    muon flag in weights.WEIGHTS); a new weight matrix without it would silently fall to AdamW."""
    from model import abstract_params

    cfg = apply_overrides(Config(), PRESETS[preset])
    cfg = apply_overrides(cfg, {"model": dict(mtp_depth=1, vocab_size=cfg.model.vocab_size or 256)})
    shapes = abstract_params(cfg.model)
    for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
        name = weight_name(path)
        matrix = leaf.ndim - is_stacked(path) >= 2 and name not in ("embed_VD", "head_VD", "router_DE")  # (head: AdamW, parallel/weights.py)
        assert optimizers.is_matrix(path) == matrix, name


def test_each_matrix_update_has_singular_values_near_one_per_block_and_expert():
    """Muon's promise, checked on each matrix by itself rather than against one-device
    Muon (which reads the same table, so a wrong table passes every mesh test): for every
    weight the table marks as a matrix, in a model that has every kind (dense and MoE
    layers, shared experts, MTP), the update of a random gradient, divided by its RMS
    scale 0.2 sqrt(max(fan_in, fan_out)), has singular values near 1 in each stacked
    block and each expert on its own. Table dims that orthogonalized all of a block's
    experts as one matrix (w_gate_EDF: (0, 2)) fail this."""
    cfg = muon_config(block_pattern="DM", mtp_depth=1)
    shapes = nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model, nnx.Rngs(0))))[1].to_pure_dict()
    rng = np.random.default_rng(0)
    checked = set()
    for path, shape in jax.tree_util.tree_flatten_with_path(shapes)[0]:
        if not optimizers.is_matrix(path):
            continue
        name = weight_name(path)
        grad = rng.standard_normal(shape.shape).astype(np.float32)
        update = np.asarray(optimizers.orthogonal_updates({"w": (path, jnp.asarray(grad))}, {})["w"])
        # One matrix: what is left after the stacked blocks' N and the routed experts' E
        # (named by the weight's shape letters), its dims grouped into fan-in and fan-out
        # as the table groups them.
        letters = name.split("_")[-1]
        own_batch = int(is_stacked(path)) + (letters[0] == "E")
        _, fan_in_dims, fan_out_dims = optimizers.matrix_dims(path, update.ndim)
        fan_in_dims = [d for d in fan_in_dims if d >= own_batch]
        fan_out_dims = [d for d in fan_out_dims if d >= own_batch]
        assert sorted(fan_in_dims + fan_out_dims) == list(range(own_batch, update.ndim)), name
        fan_in = int(np.prod([update.shape[d] for d in fan_in_dims]))
        fan_out = int(np.prod([update.shape[d] for d in fan_out_dims]))
        matrices = update.reshape(-1, *update.shape[own_batch:]).transpose(0, *[1 + d - own_batch for d in fan_in_dims + fan_out_dims])
        matrices = matrices.reshape(-1, fan_in, fan_out) / (optimizers.UPDATE_RMS * np.sqrt(max(fan_in, fan_out)))
        singular = np.linalg.svd(matrices.astype(np.float64), compute_uv=False)
        assert singular.min() > 0.5 and singular.max() < 1.3, (name, singular.min(), singular.max())
        checked.add(name)
    assert {"w_gate_EDF", "w_up_EDF", "w_down_EFD", "w_gate_DF", "wo_HKD", "w_embed_DD", "w_hidden_DD"} <= checked, checked
