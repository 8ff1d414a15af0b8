"""--mesh.sharding auto (parallel/auto.py): the same train step under jax.jit with
shardings, partitioned by the compiler, takes the step one device takes and the step
the explicit shard_map takes (8 fake CPU devices, fp32); with expert parallelism the
compiler really dispatches tokens to the experts' devices; checkpoints cross modes;
pipeline stages are a clear error; the collectives table reads real HLO right.
"""

import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from parallel import optimizers
from parallel.mesh import global_batch, named
from parallel.steps import make_train_step
from parallel.weights import param_specs
from planning import hlo_reader
from runtime import checkpoint
from test_parallel import VARIANTS, assert_params_close, assert_same_step, initial_params, mesh_for, tiny_config, token_batch
from utils import ConfigError, apply_overrides, config_to_dict, parse_args

MESHES = [(8, 1, 1), (1, 1, 8), (2, 1, 4), (4, 1, 2)]
EXPERT_PARALLEL_MESHES = [(8, 1, 1), (2, 1, 4)]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
mesh_id = lambda s: "x".join(map(str, s))  # noqa: E731


def config(mesh_shape=(1, 1, 1), sharding="manual", expert_parallel=False, variant="moe"):
    cfg = tiny_config(mesh_shape, expert_parallel, **VARIANTS[variant])
    return apply_overrides(cfg, {"mesh": dict(sharding=sharding)})


@functools.cache
def compiled_step(cfg):
    """cfg's train step (its mode, its mesh), built and compiled once per test module."""
    mesh = mesh_for(cfg)
    graphdef, _ = initial_params(cfg.model)
    params, opt_state = fresh_state(cfg)
    optimizer = optimizers.make_optimizer(cfg.train)
    step = make_train_step(graphdef, cfg, mesh, optimizer, params, opt_state)
    return step.lower(params, opt_state, batch_for(cfg, 0), jnp.asarray(0)).compile()


def fresh_state(cfg):
    """The shared initial weights placed by weights.WEIGHTS on cfg's mesh, fresh AdamW state."""
    mesh = mesh_for(cfg)
    _, host_params = initial_params(cfg.model)
    params = jax.device_put(host_params, named(mesh, param_specs(host_params, cfg.mesh.expert_parallel)))
    return params, optimizers.init_opt_state(optimizers.make_optimizer(cfg.train), params, mesh)


def batch_for(cfg, step):
    return global_batch(mesh_for(cfg), token_batch(cfg, seed=step), cfg.train.batch_size)


def take_step(cfg, params, opt_state, step):
    return compiled_step(cfg)(params, opt_state, batch_for(cfg, step), jnp.asarray(step))


def one_step(cfg):
    """(metrics, params) on the host after one step from the shared initial state."""
    params, _, metrics = take_step(cfg, *fresh_state(cfg), 0)
    return jax.device_get(metrics), jax.tree.map(np.asarray, params)


@pytest.fixture(scope="module")
def reference():
    return {variant: one_step(config(variant=variant)) for variant in VARIANTS}


def collectives(cfg):
    return hlo_reader.collective_table(compiled_step(cfg).as_text(), mesh_for(cfg))


# ---- The same step as one device, and as the explicit shard_map


@pytest.mark.parametrize("variant, mesh_shape", [pytest.param("moe", m, marks=[pytest.mark.slow] if m in ((8, 1, 1), (1, 1, 8)) else [])
                                                 for m in MESHES] + [("dense", (2, 1, 4))],  # (dp alone: also in 4x1x2; tp alone: in 2x1x4)
                         ids=lambda x: x if isinstance(x, str) else mesh_id(x))
def test_auto_step_equals_one_device(reference, variant, mesh_shape):
    cfg = config(mesh_shape, "auto", variant=variant)
    assert_same_step(*one_step(cfg), *reference[variant])
    # The step hands back params and optimizer state in their storage layout (weights.WEIGHTS),
    # so the next step, a checkpoint or a manual step takes them as they are.
    params, opt_state = fresh_state(cfg)
    out_params, out_opt, _ = compiled_step(cfg).output_shardings
    assert jax.tree.leaves(out_params) + jax.tree.leaves(out_opt) == [a.sharding for a in jax.tree.leaves((params, opt_state))]
    # No hand-written collective ran: the compiler partitioned a program written for
    # one device. Without expert parallelism it has no reason to move tokens.
    assert not any(kind == "all-to-all" for kind, _ in collectives(cfg))


@pytest.mark.parametrize("mesh_shape", EXPERT_PARALLEL_MESHES, ids=mesh_id)
def test_auto_expert_parallel_equals_one_device_and_dispatches_tokens(reference, mesh_shape):
    """Experts stored and computed split over dp: the compiler chooses the dispatch, and
    it chooses all-to-alls over dp (without the constraint on the expert buffers in
    model.MoE it all-gathers the experts' weights instead, i.e. no expert parallelism)."""
    cfg = config(mesh_shape, "auto", expert_parallel=True)
    assert_same_step(*one_step(cfg), *reference["moe"])
    table = collectives(cfg)
    assert table.get(("all-to-all", "dp"), (0, 0))[0] >= 2 * cfg.model.n_blocks, table  # there and back, every block


# (Each mode equals one device on every mesh above, so these two are the direct check,
# with expert parallelism and without.)
AUTO_VS_MANUAL = [pytest.param((2, 1, 4), "moe", True, id="2x1x4-moe-ep"), pytest.param((4, 1, 2), "dense", False, id="4x1x2-dense")]


@pytest.mark.parametrize("mesh_shape, variant, expert_parallel", AUTO_VS_MANUAL)
def test_auto_step_equals_manual_step(mesh_shape, variant, expert_parallel):
    """Directly against the shard_map step on the same mesh: loss, grad norm, routing
    statistics, every updated weight."""
    manual = one_step(config(mesh_shape, "manual", expert_parallel, variant))
    assert_same_step(*one_step(config(mesh_shape, "auto", expert_parallel, variant)), *manual)


def test_checkpoints_cross_sharding_modes(tmp_path, reference):
    """manual step -> checkpoint -> restored by auto, auto step -> checkpoint -> restored
    by manual, manual step: the same three steps as one device takes."""
    modes = [config((2, 1, 4), mode, expert_parallel=True) for mode in ("manual", "auto", "manual")]
    params, opt_state = fresh_state(modes[0])
    manager = None  # the previous step's, restored from
    for step, cfg in enumerate(modes):
        if step:  # restore into the trees (and shardings) this mode builds for itself
            target_params, target_opt = fresh_state(cfg)
            params, opt_state, meta = checkpoint.restore_checkpoint(manager, target_params, target_opt, cfg.model, seed=0)
            assert meta["config"]["mesh"]["sharding"] == modes[step - 1].mesh.sharding
        params, opt_state, _ = take_step(cfg, params, opt_state, step)
        manager = checkpoint.checkpoint_manager(str(tmp_path / f"written_by_{cfg.mesh.sharding}_{step}"), keep=1)
        checkpoint.save_checkpoint(manager, step + 1, params, opt_state, dict(seed=0, data_position=step + 1, config=config_to_dict(cfg)))
        manager.wait_until_finished()

    one = config()
    ref_params, ref_opt = fresh_state(one)
    for step in range(3):
        ref_params, ref_opt, _ = take_step(one, ref_params, ref_opt, step)
    got = jax.tree.map(np.asarray, params)
    assert_params_close(got, jax.device_get(ref_params))
    assert not np.allclose(got["embed_VD"], reference["moe"][1]["embed_VD"])  # three steps, not one


# ---- Errors and the collectives table


@pytest.mark.parametrize("argv, message", [
    (["--mesh.sharding", "auto", "--mesh.pp", "2"], "--mesh.pp 2"),
    (["--mesh.sharding", "gspmd"], "--mesh.sharding must be manual or auto"),
])
def test_bad_sharding_mode_is_a_clear_error(argv, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        parse_args(argv)


def test_collective_table_counts_loops_axes_and_bytes():
    """A program with known collectives: 5 trips of a loop with a psum over tp (f32[4, 8]),
    one all-gather over dp (to f32[8, 8]) and one ppermute along dp."""
    cfg = config((2, 1, 4))
    mesh = mesh_for(cfg)

    def per_device(x_ab):  # x_ab: [4, 2] on each device
        x = jax.lax.fori_loop(0, 5, lambda i, x: jax.lax.psum(jnp.tile(x, (1, 4))[:, :2] * 0.5, "tp") + x, x_ab)
        gathered = jax.lax.all_gather(jnp.tile(x, (1, 4)), "dp", axis=0, tiled=True)  # [8, 8]
        return jax.lax.ppermute(gathered, "dp", [(0, 1), (1, 0)])

    fn = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("dp", "tp"), out_specs=P(("dp", "tp"))))
    x = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P("dp", "tp")))
    table = hlo_reader.collective_table(fn.lower(x).compile().as_text(), mesh)
    assert table[("all-reduce", "tp")] == (5, 5 * 4 * 2 * 4)
    assert table[("all-gather", "dp")] == (1, 8 * 8 * 4)
    assert table[("collective-permute", "dp")] == (1, 8 * 8 * 4)


# ---- Slower: microbatches, remat, dropout, the command line


@pytest.mark.slow
@pytest.mark.parametrize("model", [dict(remat="stage")], ids=["stage"])  # (recomputes per microbatch)
def test_auto_microbatched_step_equals_one_device(model):
    """Two microbatches (rows m, m + 2, ... each), and remat around all blocks."""
    cfg = apply_overrides(config((2, 1, 4), "auto", expert_parallel=True), {"train": dict(microbatches=2), "model": model})
    one = apply_overrides(config(), {"train": dict(microbatches=2)})
    assert_same_step(*one_step(cfg), *one_step(one))


@pytest.mark.slow
def test_auto_dropout_is_mesh_invariant():
    """Dropout masks are drawn for the global arrays from one key per step, so unlike
    the manual step's per-device keys they do not depend on the mesh."""
    dropout = {"model": dict(dropout=0.1)}
    metrics, params = one_step(apply_overrides(config((2, 1, 4), "auto"), dropout))
    ref_metrics, ref_params = one_step(apply_overrides(config((1, 1, 1), "auto"), dropout))
    assert_same_step(metrics, params, ref_metrics, ref_params)
    no_dropout_loss = one_step(config((1, 1, 1), "auto"))[0]["loss"]
    assert abs(metrics["loss"] - no_dropout_loss) > 1e-3  # the masks did something


@pytest.mark.slow
def test_command_line_auto_run_trains_like_one_device(tmp_path):
    """The issue's command: dp2 x tp4, auto, float32: the same per-step and validation
    losses as one device."""
    common = ["--preset", "tiny", "--model.dtype", "float32", "--train.steps", "12", "--train.eval_every", "6",
              "--train.checkpoint_every", "1000", "--run.out_dir", str(tmp_path), "--data.cache_dir", str(tmp_path / "data"),
              "--log.progress", "false", "--log.plots", "false", "--sample.num_samples", "0", "--log.every", "1"]
    auto_args = ["--run.cpu_devices", "8", "--mesh.dp", "2", "--mesh.tp", "4", "--mesh.sharding", "auto"]
    for name, extra in (("one", []), ("auto", auto_args)):
        result = subprocess.run([sys.executable, os.path.join(REPO, "main.py"), *common, "--run.name", name, *extra],
                                cwd=REPO, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {name: [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")] for name in ("one", "auto")}
    losses = {name: [r["loss"] for r in rows[name] if "loss" in r] for name in rows}
    assert len(losses["auto"]) == 12 and losses["one"][-1] < losses["one"][0] - 0.2  # it learns (from ln 256 + padding at init)
    np.testing.assert_allclose(losses["auto"], losses["one"], rtol=1e-5)
    val = {name: [r["val_loss"] for r in rows[name] if "val_loss" in r] for name in rows}
    np.testing.assert_allclose(val["auto"], val["one"], rtol=1e-5)
