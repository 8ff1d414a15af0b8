"""Direct preference optimization (--train.objective dpo): its loss starts at log 2 exactly,
two steps on a dp x tp mesh equal one device, the plays' pairs are what data/preferences.py
says, and its flags are checked (8 fake CPU devices, float32)."""

import numpy as np
import pytest

from data.preferences import open_preferences
from model import unmasked
from parallel import dpo
from parallel.mesh import global_batch
from parallel.steps import init_train_state, make_train_step
from test_parallel import assert_same_steps, mesh_for, run_steps, tiny_config
from test_sft import sft_batch
from utils import Config, ConfigError, apply_overrides, parse_args


def dpo_config(mesh_shape=(1, 1, 1)):
    cfg = apply_overrides(tiny_config(mesh_shape), {"train": dict(objective="dpo", microbatches=1, dpo_beta=0.5)})
    return apply_overrides(cfg, {"data": dict(preferences="plays")})


def dpo_batch(cfg):
    """Pairs as data/preferences.py lays them out: rows 2i and 2i + 1 share a prompt (targets
    skipped) and differ in the reply (targets counted)."""
    tokens = sft_batch(cfg, seed=3)[1][:cfg.train.batch_size]  # (one conversation per row)
    trained = tokens >= 0
    tokens[1::2], trained[1::2] = tokens[0::2], trained[0::2]
    rejected = np.random.default_rng(4).integers(0, cfg.model.vocab_size, tokens[1::2].shape).astype(np.int32)
    tokens[1::2] = np.where(trained[1::2], rejected, tokens[1::2])
    return tokens


def dpo_steps(cfg, tokens, n_steps=2):
    """Metrics, optimizer states and params of n_steps DPO steps from the fresh init on cfg's mesh."""
    mesh = mesh_for(cfg)
    graphdef, params, optimizer, opt_state = init_train_state(cfg, mesh)
    step = make_train_step(graphdef, cfg, mesh, optimizer, params, opt_state)
    batch = global_batch(mesh, tokens, cfg.train.batch_size)
    return run_steps(step, params, opt_state, batch, n_steps)


@pytest.fixture(scope="module")
def one_device():
    cfg = dpo_config()
    return dpo_steps(cfg, dpo_batch(cfg))


def test_dpo_loss_starts_at_log_2_exactly_then_falls(one_device):
    """The policy is the reference at step 0: every margin 0, the loss log 2 in float32 to the
    bit; the step's update then separates the pairs (the loss falls, the margin grows)."""
    (first, second), _, _ = one_device
    assert first["loss"] == np.float32(np.log(2)) and first["dpo_margin"] == 0 and first["dpo_accuracy"] == 0
    assert second["loss"] < first["loss"] and second["dpo_margin"] > 0 and second["dpo_accuracy"] > 0


def test_dpo_two_steps_on_dp_x_tp_equal_one_device(one_device):
    cfg = dpo_config((2, 1, 2))
    result = dpo_steps(cfg, dpo_batch(cfg))
    assert_same_steps(result, one_device)
    for m, ref in zip(result[0], one_device[0]):
        np.testing.assert_allclose([m["dpo_margin"], m["dpo_accuracy"]], [ref["dpo_margin"], ref["dpo_accuracy"]], rtol=1e-5)


def test_play_preferences_pair_a_reply_with_its_words_shuffled():
    cfg = apply_overrides(Config(), {"train": dict(objective="dpo"), "data": dict(preferences="plays")})
    data = open_preferences(apply_overrides(cfg, {"model": dict(seq_len=128)}))
    rows = data.batch("train", 0, 8, 128, seed=0)
    texts = [bytes(unmasked(r)[unmasked(r) < 256].astype(np.uint8)).decode() for r in rows]
    for chosen, rejected in zip(texts[0::2], texts[1::2]):
        assert chosen.split("ASSISTANT:\n")[0] == rejected.split("ASSISTANT:\n")[0]  # one prompt
        reply, shuffled = chosen.split("ASSISTANT:\n")[1], rejected.split("ASSISTANT:\n")[1]
        assert reply != shuffled and sorted(reply.split()) == sorted(shuffled.split())  # its words in another order
    np.testing.assert_array_equal(data.batch("train", 0, 8, 128, seed=0, rows=[2, 3]), rows[2:4])  # a process's rows


def test_dpo_flags_are_checked():
    with pytest.raises(ConfigError, match="dpo with --data.preferences"):
        parse_args(["--train.objective", "dpo"])
    with pytest.raises(ConfigError, match="even --train.batch_size"):
        dpo.check_dpo(apply_overrides(dpo_config(), {"train": dict(batch_size=3)}))
    assert parse_args(["--train.objective", "dpo", "--data.preferences", "plays"]).train.dpo_beta == 0.1


def test_planner_holds_the_reference_and_runs_its_forward():
    """The planner's DPO plan (dp 2 x tp 2): the reference's bytes per device are those
    dpo.reference_params holds on a device, its forward adds a third of the model FLOPs to
    what the step executes, and a pipelined layout is the DPO step's one-line refusal."""
    import jax

    from planning import costs
    cfg = dpo_config((2, 1, 2))
    reference = dpo.reference_params(cfg, mesh_for(cfg))
    device = jax.devices()[0]
    held = sum(s.data.nbytes for x in jax.tree.leaves(reference) for s in x.addressable_shards if s.device == device)
    with_reference = costs.plan(cfg, 4, "cpu", peak=1e12)
    plain = costs.plan(apply_overrides(cfg, {"train": dict(objective="lm"), "data": dict(preferences="")}), 4, "cpu", peak=1e12)
    assert with_reference["memory"]["reference params"] == held == plain["memory"]["params"]
    assert with_reference["total_bytes"] == plain["total_bytes"] + held
    added = with_reference["times"]["executed_flops"] - plain["times"]["executed_flops"]
    assert added == pytest.approx(plain["times"]["model_flops"] / 3, rel=1e-12) and added > 0
    with pytest.raises(ConfigError, match=r"--mesh.pp 1 \(got 2\)"):
        costs.plan(apply_overrides(dpo_config((2, 2, 1)), {"train": dict(microbatches=2)}), 4, "cpu", peak=1e12)
