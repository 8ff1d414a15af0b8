"""LoRA (--train.lora_rank, parallel/lora.py): at init the model is the base model bit for bit, a step moves the
adapters alone (the optimizer holds nothing else) and equals one device on dp x tp, the merged weights equal the
unmerged forward (x @ W + s (x @ A) @ B), the planner counts the adapters' optimizer state only, and bad configs are
one-line errors (8 fake CPU devices, float32)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from parallel import lora
from parallel.mesh import global_batch
from parallel.steps import init_train_state, make_train_step
from test_parallel import assert_tree_close, mesh_for, tiny_config, token_batch
from utils import ConfigError, apply_overrides


def lora_config(mesh_shape=(1, 1, 1), **train):
    return apply_overrides(tiny_config(mesh_shape), {"train": dict(dict(lora_rank=4, lora_targets="all"), **train)})


def host(tree):
    return jax.tree.map(np.asarray, tree)


def lora_steps(cfg, n_steps=1):
    """(initial params, params after n_steps, optimizer state, metrics) of a LoRA run on cfg's mesh, host copies."""
    mesh = mesh_for(cfg)
    graphdef, params, optimizer, opt_state = init_train_state(cfg, mesh)
    initial = host(params)
    step = make_train_step(graphdef, cfg, mesh, optimizer, params, opt_state)
    batch = global_batch(mesh, token_batch(cfg), cfg.train.batch_size)
    for s in range(n_steps):
        params, opt_state, metrics = step(params, opt_state, batch, jnp.asarray(s))
    return graphdef, initial, host(params), host(opt_state), jax.device_get(metrics)


def test_init_logits_equal_the_base_model_exactly():
    cfg = lora_config()
    graphdef, params, _, _ = init_train_state(cfg, mesh_for(cfg))
    params = host(params)
    tokens = token_batch(cfg)[:, :-1]
    base_logits = nnx.merge(graphdef, lora.frozen(params))(tokens)[0]
    lora_logits = nnx.merge(graphdef, lora.merged(params, cfg.train))(tokens)[0]
    np.testing.assert_array_equal(lora_logits, base_logits)
    assert np.abs(params["lora"]["a"]["blocks"]["layers"][0]["attn"]["wq_up_QHK"]).max() > 0  # A is random, B zero


@pytest.mark.slow
def test_a_step_moves_the_adapters_only_and_equals_one_device():
    ref = lora_steps(lora_config(), n_steps=2)
    _, initial, params, opt_state, metrics = ref
    base_before, base_after = lora.frozen(initial), lora.frozen(params)
    for (path, before), after in zip(jax.tree_util.tree_flatten_with_path(base_before)[0], jax.tree.leaves(base_after)):
        np.testing.assert_array_equal(after, before, err_msg=jax.tree_util.keystr(path))
    for path, before in jax.tree_util.tree_flatten_with_path(initial["lora"])[0]:
        after = params["lora"]
        for k in path:
            after = after[k.key]
        assert not np.array_equal(after, before), jax.tree_util.keystr(path)
    # AdamW's moments are trees of the adapters exactly: no state for a base weight.
    adam = opt_state[0]
    assert jax.tree.structure(adam.mu) == jax.tree.structure(params["lora"])
    adapter_size = sum(x.size for x in jax.tree.leaves(params["lora"]))
    assert sum(x.size for x in jax.tree.leaves(opt_state)) == 2 * adapter_size + 2  # + Adam's and the schedule's step counts
    # dp x tp (the adapters sharded as their base weights): the same step as one device.
    _, _, params_2x2, opt_state_2x2, metrics_2x2 = lora_steps(lora_config((2, 1, 2)), n_steps=2)
    np.testing.assert_allclose(metrics_2x2["loss"], metrics["loss"], rtol=1e-5)
    np.testing.assert_allclose(metrics_2x2["grad_norm"], metrics["grad_norm"], rtol=1e-5)
    # the adapters' gradients (test_parallel.train_steps); the routed experts' sums reassociate: w_down_EFD's A
    # 1.01e-4 off at 7fe456c on a 2-vCPU AMD EPYC (~1.5e-5 where this was written), 1.08e-4 once the program changed shape
    assert_tree_close(opt_state_2x2[0].mu, adam.mu, rtol=3e-4, what="mu")
    # Adam's second step divides by sqrt(v): a reassociation's 1e-6 in a small gradient shows up larger (w_down_EFD's B
    # 1.02e-4 off, that AMD EPYC).
    assert_tree_close(params_2x2["lora"], params["lora"], rtol=3e-4, what="lora")


def test_merged_weights_equal_the_unmerged_forward():
    """After a step (B != 0): each target's x @ (W + s A @ B) equals x @ W + s (x @ A) @ B, and the model on the merged
    weights (what export writes) moved away from the base."""
    cfg = lora_config()
    graphdef, initial, params, _, _ = lora_steps(cfg)
    weights = lora.merged(params, cfg.train)
    s = lora.scale(cfg.train)
    rng = np.random.default_rng(0)
    checked = 0
    for keys, path, w in lora.target_leaves(lora.frozen(params), cfg.train):
        a, b, merged_w = params["lora"]["a"], params["lora"]["b"], weights
        for k in keys:
            a, b, merged_w = a[k], b[k], merged_w[k]
        batch, fan_in, _ = lora.split_dims(path, w.ndim)
        lead, ins = w.shape[:batch], w.shape[batch:batch + fan_in]
        x = rng.standard_normal((*lead, 3, int(np.prod(ins)))).astype(np.float32)
        as_matrix = lambda t, k: t.reshape(*lead, -1, *t.shape[batch + k:]).reshape(*lead, int(np.prod(t.shape[batch:batch + k])), -1)  # noqa: E731
        unmerged = x @ as_matrix(w, fan_in) + s * ((x @ as_matrix(a, fan_in)) @ b.reshape(*lead, b.shape[batch], -1))
        np.testing.assert_allclose(x @ as_matrix(merged_w, fan_in), unmerged, rtol=1e-5, atol=1e-5, err_msg=str(keys))
        checked += 1
    assert checked == 8 + 3 + 3  # tiny's MoE block: MLA's 8 (low-rank queries), the shared and the routed FFN's 3
    tokens = token_batch(cfg)[:, :-1]
    moved = nnx.merge(graphdef, weights)(tokens)[0] - nnx.merge(graphdef, lora.frozen(initial))(tokens)[0]
    assert np.abs(moved).max() > 1e-4


@pytest.mark.parametrize("train, message", [
    (dict(lora_rank=0, lora_targets="attention"), "--train.lora_rank must be > 0"),
    (dict(lora_rank=-2), "--train.lora_rank must be > 0"),
    (dict(lora_rank=4, lora_targets="mlp"), "--train.lora_targets must be one of attention, experts, all, got 'mlp'"),
    (dict(lora_rank=4, qk_clip=50.0), "--train.qk_clip rescales the base weights"),
    (dict(lora_rank=4, objective="dpo"), "--train.objective dpo does not train LoRA adapters here"),
])
def test_bad_configs_are_one_line_errors(train, message):
    cfg = apply_overrides(tiny_config(), {"train": train})
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(")) as e:
        init_train_state(cfg, mesh_for(cfg))
    assert "\n" not in str(e.value)


def test_planner_counts_the_adapters_optimizer_state_only():
    """The planner's optimizer bytes per device equal the LoRA state's (AdamW over the adapters' shards, dp 2 x tp 2),
    far below the full model's."""
    from planning import costs
    cfg = lora_config((2, 1, 2))
    _, params, _, opt_state = init_train_state(cfg, mesh_for(cfg))
    device = jax.devices()[0]
    held = sum(s.data.nbytes for x in jax.tree.leaves(opt_state) for s in x.addressable_shards if s.device == device)
    mesh_items = tuple(dict(costs.abstract_mesh(costs.resolve_mesh_shape(cfg.mesh, 4)).shape).items())
    with_lora = costs.storage(*costs.shape_keys(cfg), mesh_items, False, False)["optimizer"]
    without = costs.storage(*costs.shape_keys(apply_overrides(cfg, {"train": dict(lora_rank=0, lora_targets="")})),
                            mesh_items, False, False)["optimizer"]
    assert with_lora == held
    assert with_lora < without  # tiny, rank 4 on every target: 235,528 against Muon's 366,856 bytes
