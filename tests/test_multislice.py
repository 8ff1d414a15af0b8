"""Multi-slice (--mesh.slices): an outer data-parallel axis across TPU slices.

Two slices of dp2 x tp2 on 8 fake CPU devices take the same steps as one device; the
only collectives that cross slices are the once-per-step gradient all-reduce (of each
device's gradient shards: FSDP stays within a slice) and the scalar metric and
router-load reductions, none inside the layer loop; the TPU compiler builds the step
for 2 slices of v5p-64 and of v4-64 and its collective table marks what crosses slices.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import abstract_params
from parallel.mesh import batch_spec, check_config_fits_mesh, make_mesh
from parallel.weights import is_trained, weight_name
from planning import costs, hlo_reader, tpu_compile
from test_launch import hosts_file, launcher, needs_ssh_and_tmux, repo, sshd, wait_for_states  # noqa: F401  (fixtures)
from test_parallel import assert_tree_close, placed_step, tiny_config, train_steps
from utils import ConfigError, MeshConfig, apply_overrides

# Router-bias balancing on: its load is summed over (slice, dp), or the biases differ per slice.
MODEL = dict(router_bias_rate=0.01, dropout=0.1)


def two_slices(shape=(2, 1, 2), **overrides):
    cfg = tiny_config(shape, **MODEL)
    return apply_overrides(cfg, dict({"mesh": dict(slices=2)}, **overrides))


@pytest.fixture(scope="module")
def reference():
    return train_steps(tiny_config(**MODEL))


def assert_same_steps(result, reference):
    """Loss, aux loss, grad norm and router biases per step; the gradients (optimizer
    moments) per leaf; the final params. (The untrained router biases' moments stay 0.)"""
    (metrics, opt_states, params), (ref_metrics, ref_opt_states, ref_params) = result, reference
    for s, (m, ref_m) in enumerate(zip(metrics, ref_metrics)):
        for key in ("loss", "aux_loss", "grad_norm"):
            np.testing.assert_allclose(m[key], ref_m[key], rtol=1e-5, err_msg=f"step {s}: {key}")
        np.testing.assert_allclose(m["router_bias_NLE"], ref_m["router_bias_NLE"], atol=1e-7)
    for o, ref_o in zip(opt_states, ref_opt_states):
        moments = [(a, b) for a, b in zip(jax.tree.leaves(o), jax.tree.leaves(ref_o)) if np.any(b)]
        assert_tree_close([a for a, _ in moments], [b for _, b in moments])
    assert_tree_close(params, ref_params)


@pytest.fixture(scope="module")
def two_slice_run():
    """(the compiled step's HLO, two steps' results) of 2 slices x dp2 x tp2: one compile."""
    cfg = two_slices()
    step, (params, opt_state, batch) = placed_step(cfg)
    compiled = step.lower(params, opt_state, batch, jnp.asarray(0)).compile()
    metrics, opt_states = [], []
    for s in range(2):
        params, opt_state, m = compiled(params, opt_state, batch, jnp.asarray(s))
        metrics.append(jax.device_get(m))
        opt_states.append(jax.tree.map(np.asarray, opt_state))
    return cfg, compiled.as_text(), (metrics, opt_states, jax.tree.map(np.asarray, params))


def test_two_slices_equal_one_device(reference, two_slice_run):
    assert_same_steps(two_slice_run[2], reference)


@pytest.mark.slow
@pytest.mark.parametrize("shape, pipeline, expert_parallel, sharding",
                         [((2, 1, 2), "gpipe", True, "manual"), ((1, 2, 2), "1f1b", False, "manual"),
                          ((2, 1, 2), "gpipe", False, "auto")],
                         ids=["ep-dp2xtp2", "1f1b-pp2xtp2", "auto-dp2xtp2"])
def test_two_slices_with_experts_a_schedule_or_auto_equal_one_device(reference, shape, pipeline, expert_parallel, sharding):
    """(Under auto the compiler places the slice reduction: equal, but not held to once per step.)"""
    cfg = two_slices(shape, train=dict(pipeline=pipeline, microbatches=2))
    cfg = apply_overrides(cfg, {"mesh": dict(expert_parallel=expert_parallel, sharding=sharding)})
    assert_same_steps(train_steps(cfg), reference)


def gradient_shard_bytes(cfg, itemsize=4):
    """Bytes of one device's shards of the trained weights' gradients (float32)."""
    params = abstract_params(cfg.model)
    trained = jax.tree_util.tree_map_with_path(
        lambda path, w: w if is_trained(weight_name(path)) else None, params)
    return costs.layout_bytes(trained, cfg.mesh.expert_parallel, dict(dp=cfg.mesh.dp, cp=cfg.mesh.cp, pp=cfg.mesh.pp, tp=cfg.mesh.tp),
                                itemsize=itemsize)


def test_only_the_gradient_crosses_slices_once_per_step(two_slice_run):
    """From the compiled CPU step: every collective over slice runs once per step (none
    in the layer loop, whose ops run n_blocks times), the all-reduces over slice alone
    move exactly the gradient shards, and the rest over slice (the loss, the router
    load) are small metric reductions."""
    cfg, hlo, _ = two_slice_run
    mesh = make_mesh(cfg.mesh, jax.devices()[:8])
    ops = hlo_reader.collective_ops(hlo, mesh.devices.shape)
    crossing = [op for op in ops if hlo_reader.crosses_slices(op.over)]
    assert crossing and all(op.runs == 1 for op in crossing), [op for op in crossing if op.runs > 1]
    assert {op.kind for op in crossing} == {"all-reduce"}
    gradient = sum(b for op in crossing if op.over == "slice" for _, b in op.arrays)
    assert gradient == gradient_shard_bytes(cfg)
    metrics = sum(b for op in crossing if op.over != "slice" for _, b in op.arrays)
    assert 0 < metrics < gradient / 20, (metrics, gradient)
    within = [op for op in ops if not hlo_reader.crosses_slices(op.over) and op.runs > 1]
    assert within, "no collective inside a loop: the layer loop's FSDP gathers should be there"


@pytest.mark.parametrize("mesh_cfg, devices, message", [
    (MeshConfig(slices=3), 8, "--mesh.slices (3) must be >= 1 and divide the 8 devices"),
    (MeshConfig(slices=0), 8, "--mesh.slices (0) must be >= 1"),
    (MeshConfig(dp=4, tp=2, slices=2), 8, "but there are 4 per slice"),
])
def test_bad_slices_is_a_one_line_error(mesh_cfg, devices, message):
    with pytest.raises(ConfigError, match=None) as e:
        make_mesh(mesh_cfg, jax.devices()[:devices])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_batch_must_split_over_slices_and_dp():
    cfg = apply_overrides(two_slices(), {"train": dict(batch_size=6)})
    with pytest.raises(ConfigError, match=r"--mesh.slices x --mesh.dp x --train.microbatches \(2 x 2 x 1 = 4\)"):
        check_config_fits_mesh(cfg, make_mesh(cfg.mesh, jax.devices()[:8]))


def test_rows_are_slice_major():
    """Global row r sits on slice r // (B / slices): a row index means the same on any
    mesh (dropout keys are per global row)."""
    mesh = make_mesh(MeshConfig(dp=2, tp=2, slices=2), jax.devices()[:8])
    indices = jax.sharding.NamedSharding(mesh, batch_spec()).devices_indices_map((8, 1))
    for (s, d, _, _, t), device in np.ndenumerate(mesh.devices):  # (slice, dp, cp, pp, tp)
        assert indices[device][0] == slice(4 * s + 2 * d, 4 * s + 2 * d + 2)


# ---- The TPU compiler, 2 slices


def test_tpu_slices_must_match_the_devices():
    pytest.importorskip("libtpu")
    with pytest.raises(ConfigError, match=r"--mesh.slices 2, but the TPU devices form 1 slice\(s\)"):
        make_mesh(MeshConfig(dp=1, pp=1, tp=2, slices=2), tpu_compile.pod_devices("v4-8"))


@pytest.mark.slow
@pytest.mark.parametrize("pod", ["v5p-64", "v4-64"])
def test_two_tpu_slices_compile_and_only_the_gradient_crosses(pod):
    """tiny on 2 slices x (dp8 x pp2 x tp2): the cross-slice reductions are megascale
    host transfers outside every loop; they carry the gradient shards (the compiler
    packs them into tiles of 8 x 128 floats) and a few metric scalars; the report
    marks them."""
    pytest.importorskip("libtpu")
    cfg = tiny_config((8, 2, 2), **MODEL)
    cfg = apply_overrides(cfg, {"mesh": dict(slices=2), "model": dict(dtype="bfloat16"),
                                "train": dict(batch_size=32, microbatches=2)})
    devices = tpu_compile.pod_devices(pod, slices=2)
    mesh = make_mesh(cfg.mesh, devices)
    assert dict(mesh.shape) == {"slice": 2, "dp": 8, "cp": 1, "pp": 2, "tp": 2}
    assert all(d.slice_index == s for s in range(2) for d in mesh.devices[s].flat)
    hlo = tpu_compile.compile_steps(cfg, mesh, eval_step=False)["train"].as_text()
    ops = hlo_reader.collective_ops(hlo, mesh.devices.shape)
    crossing = [op for op in ops if hlo_reader.crosses_slices(op.over)]
    assert crossing and all(op.runs == 1 and op.kind == "all-reduce" for op in crossing), crossing
    sent = sum(b for op in crossing for dtype, b in op.arrays if dtype == "f32")
    shards = gradient_shard_bytes(cfg)
    tile = 8 * 128 * 4
    assert shards <= sent <= shards + tile * len(crossing) + tile, (sent, shards)
    report = tpu_compile.collectives_report(hlo_reader.collectives(hlo, mesh.devices.shape), "train step")
    assert any("DCN (crosses slices)" in line and " slice " in line for line in report)
    assert report[-1].startswith("  across slices:") and f"{sum(op.runs for op in crossing)} collectives" in report[-1]
    assert math.prod(mesh.devices.shape) == 64


# ---- launcher.sh: a multi-slice job's environment (over test_launch's loopback sshd)


@needs_ssh_and_tmux
def test_launcher_gives_each_host_its_slice(repo, sshd, tmp_path):
    """Hosts file with a SLICE column: every process gets the megascale runtime's
    environment (slice 0's first host as coordinator, its own slice id) and
    --mesh.slices; the job is a stand-in python that prints them."""
    fake_python = tmp_path / "python"
    fake_python.write_text('#!/usr/bin/env bash\nenv | grep ^MEGASCALE_ | sort\nprintf "arg:%s\\n" "$@"\n')
    fake_python.chmod(0o755)
    hosts = hosts_file(tmp_path, "127.0.0.1 10.0.0.1 0", "localhost 10.0.0.2 0", "127.0.0.1 10.0.0.3 1", "localhost 10.0.0.4 1")
    remote = tmp_path / "remote"
    args = ["--name", "ms", "--remote-dir", str(remote), "--python", str(fake_python)]
    started = launcher(repo, sshd, hosts, *args, "--", "--preset", "tiny")
    assert started.returncode == 0, started.stdout + started.stderr
    wait_for_states(repo, sshd, hosts, "ms", remote, lambda s: s.startswith("exit"), timeout_s=60)
    for i in range(4):
        log = (remote / "logs" / f"ms-p{i}.log").read_text()
        assert f"MEGASCALE_COORDINATOR_ADDRESS=10.0.0.1:8081\nMEGASCALE_NUM_SLICES=2\nMEGASCALE_PORT=8081\n" \
               f"MEGASCALE_SLICE_ID={i // 2}\n" in log, log
        assert f"arg:--dist.process_id\narg:{i}\narg:--preset\narg:tiny\narg:--run.name\narg:ms\narg:--mesh.slices=2\n" in log, log


@needs_ssh_and_tmux
def test_launcher_refuses_slices_out_of_order(repo, sshd, tmp_path):
    hosts = hosts_file(tmp_path, "127.0.0.1 10.0.0.1 0", "localhost 10.0.0.2 1", "127.0.0.1 10.0.0.3 0")
    done = launcher(repo, sshd, hosts, "--name", "ms", "--remote-dir", str(tmp_path / "remote"), "--status")
    assert done.returncode != 0 and "slice 0 out of order" in done.stderr, done.stderr
