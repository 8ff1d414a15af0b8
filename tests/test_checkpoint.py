"""Checkpoints: exact resume (also after a kill in the middle of a write), damaged
checkpoints, restore onto other meshes, slim exports, fine-tuning, clear errors.

Fast tests save and restore in this process (8 fake devices, conftest.py); the slow
ones run main.py as a user does. Runs that share a reference use one lr schedule
(--train.decay_steps 100) so that a resumed run computes exactly what the reference did.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from model import Transformer
from parallel import optimizers
from parallel.mesh import make_mesh, named
from parallel.weights import is_trained, param_specs, weight_name
from runtime import checkpoint
from serving import modes
from utils import ConfigError, MeshConfig, apply_overrides, config_to_dict, parse_args

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUIET = ["--log.progress", "false", "--log.plots", "false", "--sample.num_samples", "0", "--log.every", "1"]
SCHEDULE = ["--train.decay_steps", "100", "--train.eval_every", "1000"]
REFERENCE = [*SCHEDULE, "--train.steps", "30", "--train.checkpoint_every", "10", "--train.keep_checkpoints", "5"]
MESH_2x2x2 = ["--run.cpu_devices", "8", "--mesh.dp", "2", "--mesh.pp", "2", "--mesh.tp", "2", "--train.microbatches", "2"]
BYTES_VOCAB = 257  # the byte tokenizer: 256 bytes + end-of-text


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data_cache"))


def main_cmd(args, out_dir, data_cache):
    return [sys.executable, os.path.join(REPO, "main.py"), "--preset", "tiny", "--run.out_dir", str(out_dir),
            "--data.cache_dir", data_cache, *QUIET, *args]


def main_py(args, out_dir, data_cache, check=True):
    result = subprocess.run(main_cmd(args, out_dir, data_cache), cwd=REPO, capture_output=True, text=True, timeout=600)
    if check:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def train_losses(run_dir):
    rows = [r for r in metrics(run_dir) if "loss" in r]
    return {r["step"]: r["loss"] for r in rows}, [r["step"] for r in rows]


def complete_steps(checkpoints_dir):
    return sorted(int(n) for n in os.listdir(checkpoints_dir) if n.isdigit())


def array_files(item_dir):
    """The files that hold an item's array bytes (OCDBT data files)."""
    return sorted(os.path.join(root, f) for root, _, files in os.walk(item_dir) for f in files
                  if os.path.basename(root) == "d" and "ocdbt.process_" in root)


@pytest.fixture(scope="session")
def reference(tmp_path_factory, data_cache):
    """One uninterrupted 30-step run on one device, checkpoints at 10, 20 and 30."""
    out = tmp_path_factory.mktemp("reference")
    main_py([*REFERENCE, "--run.name", "ref"], out, data_cache)
    return out / "ref"


def copy_run(run_dir, out_dir):
    shutil.copytree(run_dir, out_dir / run_dir.name, ignore=shutil.ignore_patterns("export"))
    return out_dir / run_dir.name


def assert_redid_steps_after_10(run, reference, stdout, set_aside):
    """The run resumed from checkpoint 10, set 20 and 30 aside as <step>.<set_aside>
    (then saved them again), and its steps 1..30 repeat the reference bit for bit."""
    assert f"resumed from {run}/checkpoints/10\n" in stdout
    assert sorted(os.listdir(run / "checkpoints")) == ["10", "20", f"20.{set_aside}", "30", f"30.{set_aside}"]
    resumed, order = train_losses(run)
    straight, _ = train_losses(reference)
    assert order == list(range(1, 31)) and resumed == straight


# ---- In process: fingerprints, restore onto other meshes, errors


def tiny_config(**mesh):
    cfg = parse_args(["--preset", "tiny", "--train.microbatches", "2"])
    return apply_overrides(cfg, {"model": {"vocab_size": BYTES_VOCAB}, "mesh": mesh})


def mesh_of(shape):
    return make_mesh(MeshConfig(dp=shape[0], pp=shape[1], tp=shape[2]), devices=jax.devices()[:int(np.prod(shape))])


def abstract_state(cfg, mesh):
    """Shapes and target shardings of params and AdamW state on `mesh`, without
    computing an init (all that restore needs)."""
    shapes = nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model, nnx.Rngs(0))))[1].to_pure_dict()
    shardings = named(mesh, param_specs(shapes, False))
    params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)
    with jax.set_mesh(mesh):
        opt_state = jax.eval_shape(optimizers.make_optimizer(cfg.train).init, params)
    spec = lambda a: a.sharding.spec if a.sharding is not None else P()  # noqa: E731  (the step count: replicated)
    return params, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec(a))), opt_state)


def host(tree):
    return jax.tree.map(np.asarray, tree)


@pytest.fixture(scope="module")
def saved_on_2x2x2(tmp_path_factory):
    """A checkpoint written from a dp2 x pp2 x tp2 mesh: random values in every
    array (not an init that a restore could silently fall back to)."""
    cfg = tiny_config(dp=2, pp=2, tp=2)
    rng = np.random.default_rng(0)
    fill = lambda a: jax.device_put(rng.standard_normal(a.shape).astype(a.dtype) if a.dtype == np.float32  # noqa: E731
                                    else np.asarray(7, a.dtype), a.sharding)
    params, opt_state = jax.tree.map(fill, abstract_state(cfg, mesh_of((2, 2, 2))))
    run_dir = tmp_path_factory.mktemp("inprocess") / "run"
    manager = checkpoint.checkpoint_manager(str(run_dir), keep=3)
    checkpoint.save_checkpoint(manager, 5, params, opt_state, dict(seed=cfg.run.seed, data_position=5, config=config_to_dict(cfg)))
    manager.wait_until_finished()
    return run_dir, host(params), host(opt_state)


@pytest.mark.parametrize("shape", [(1, 1, 1), (8, 1, 1), (1, 2, 4)])
def test_restore_onto_another_mesh_is_bit_exact(saved_on_2x2x2, shape):
    """Every array (params and optimizer state) written on dp2 x pp2 x tp2 comes back
    bit for bit in the new mesh's shardings, and passes the fingerprint check there."""
    run_dir, params_saved, opt_saved = saved_on_2x2x2
    cfg = tiny_config(dp=shape[0], pp=shape[1], tp=shape[2])
    params, opt_state = abstract_state(cfg, mesh_of(shape))
    manager = checkpoint.checkpoint_manager(str(run_dir), keep=3)
    restored_params, restored_opt, meta = checkpoint.restore_checkpoint(manager, params, opt_state, cfg.model, seed=0)
    assert meta["step"] == 5 and meta["data_position"] == 5 and meta["seed"] == 0
    assert meta["config"]["mesh"] == dict(dp=2, cp=1, pp=2, tp=2, slices=1, expert_parallel=False, sharding="manual")
    for restored, saved, target in [(restored_params, params_saved, params), (restored_opt, opt_saved, opt_state)]:
        assert jax.tree.structure(restored) == jax.tree.structure(saved)
        for r, s, t in zip(jax.tree.leaves(restored), jax.tree.leaves(saved), jax.tree.leaves(target)):
            np.testing.assert_array_equal(np.asarray(r), s)
            assert r.sharding == t.sharding, (r.sharding, t.sharding)


def test_fingerprint_is_the_same_on_every_mesh_and_sees_one_flipped_bit():
    values = np.random.default_rng(0).standard_normal((64, 48)).astype(np.float32)
    on = lambda shape, spec, x: jax.device_put(x, NamedSharding(mesh_of(shape), spec))  # noqa: E731
    reference = checkpoint.fingerprint({"w": on((1, 1, 1), P(), values)})
    for shape, spec in [((2, 2, 2), P("dp", ("pp", "tp"))), ((8, 1, 1), P(None, "dp")), ((1, 2, 4), P("tp", "pp"))]:
        assert checkpoint.fingerprint({"w": on(shape, spec, values)}) == reference
        for flat_index, bit in [(0, 0), (values.size // 2, 17), (values.size - 1, 31)]:
            flipped = values.copy().reshape(-1).view(np.uint32)
            flipped[flat_index] ^= np.uint32(1 << bit)
            damaged = flipped.view(np.float32).reshape(values.shape)
            assert checkpoint.fingerprint({"w": on(shape, spec, damaged)}) != reference, (shape, flat_index, bit)


def test_restore_refuses_another_model_another_seed_and_missing_steps(saved_on_2x2x2, tmp_path):
    run_dir, _, _ = saved_on_2x2x2
    cfg = tiny_config(dp=1, pp=1, tp=1)
    params, opt_state = abstract_state(cfg, mesh_of((1, 1, 1)))
    manager = checkpoint.checkpoint_manager(str(run_dir), keep=3)
    wider = apply_overrides(cfg, {"model": {"d_model": 64}})
    with pytest.raises(ConfigError, match=r"another model \(--model\.d_model: checkpoint 32 vs now 64\)"):
        checkpoint.restore_checkpoint(manager, params, opt_state, wider.model)
    with pytest.raises(ConfigError, match="written with --run.seed 0, not 3"):
        checkpoint.restore_checkpoint(manager, params, opt_state, cfg.model, seed=3)
    with pytest.raises(ConfigError, match=r"no checkpoint at step 7 .*available: \[5\]"):
        checkpoint.restore_checkpoint(manager, params, opt_state, cfg.model, step=7)
    with pytest.raises(ConfigError, match="does not exist"):
        checkpoint.find_params_source(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no checkpoint found in"):
        checkpoint.restore_params(str(tmp_path / "empty"), params, cfg.model)
    assert os.listdir(tmp_path / "empty") == []  # reading creates nothing
    fresh = checkpoint.checkpoint_manager(str(tmp_path / "fresh"), keep=3)
    assert checkpoint.restore_checkpoint(fresh, params, opt_state, cfg.model) is None


def test_resume_refuses_another_batch_size_or_schedule(saved_on_2x2x2):
    """The checkpoint was written at batch size 16 on the tiny schedule (100 steps,
    cosine to step 100). Another batch size would skip or repeat data, another
    --train.steps would change the lr of planned steps, another optimizer has another
    state: all are refused with the flags that fix it. The same schedule with more steps (--train.decay_steps 100), or
    another number of microbatches, resumes."""
    run_dir, _, _ = saved_on_2x2x2
    cfg = tiny_config(dp=1, pp=1, tp=1)
    params, opt_state = abstract_state(cfg, mesh_of((1, 1, 1)))
    manager = checkpoint.checkpoint_manager(str(run_dir), keep=3)
    resume = lambda **train: checkpoint.restore_checkpoint(  # noqa: E731
        manager, params, opt_state, cfg.model, seed=0, train_cfg=apply_overrides(cfg, {"train": train}).train)
    with pytest.raises(ConfigError, match=r"trained with --train\.batch_size 16, not 32: .*skip or repeat data"):
        resume(batch_size=32)
    with pytest.raises(ConfigError, match=r"decay_steps: checkpoint 100 vs now 200.*pass --train\.decay_steps 100"):
        resume(steps=200)
    with pytest.raises(ConfigError, match=r"lr: checkpoint 0\.003 vs now 0\.001"):
        resume(lr=1e-3)
    with pytest.raises(ConfigError, match=r"trained with --train\.optimizer adamw, not muon: .*Resume with --train\.optimizer adamw"):
        resume(optimizer="muon")
    assert resume(steps=200, decay_steps=100, microbatches=4)[2]["step"] == 5


def test_resume_with_changed_optimizer_settings_says_which_in_one_line_and_goes_on(saved_on_2x2x2):
    """muon_momentum, weight_decay, betas, grad_clip and data.source shape the steps to
    come, not the saved state's meaning: named in one line (checkpoint.RESUMABLE_CHANGES),
    and the resume goes on. Unchanged settings say nothing."""
    run_dir, _, _ = saved_on_2x2x2
    cfg = tiny_config(dp=1, pp=1, tp=1)
    params, opt_state = abstract_state(cfg, mesh_of((1, 1, 1)))
    manager = checkpoint.checkpoint_manager(str(run_dir), keep=3)
    said = []
    changed = apply_overrides(cfg, {"train": dict(weight_decay=0.05, beta2=0.99, grad_clip=0.5, muon_momentum=0.95),
                                    "data": dict(source="/data/other")})
    restored = checkpoint.restore_checkpoint(manager, params, opt_state, cfg.model, seed=0, log=said.append,
                                             train_cfg=changed.train, data_cfg=changed.data)
    assert restored[2]["step"] == 5 and len(said) == 1 and "\n" not in said[0], said
    for flag in ("--train.weight_decay 0.1 -> 0.05", "--train.beta2 0.95 -> 0.99", "--train.grad_clip 1.0 -> 0.5",
                 "--train.muon_momentum 0.9 -> 0.95", "--data.source 'shakespeare' -> '/data/other'"):
        assert flag in said[0], said[0]
    assert "beta1" not in said[0]
    said.clear()
    checkpoint.restore_checkpoint(manager, params, opt_state, cfg.model, seed=0, log=said.append, train_cfg=cfg.train,
                                  data_cfg=cfg.data)
    assert said == []


def test_slim_export_keeps_untrained_state_in_float32(tmp_path):
    """Router biases move in steps of --model.router_bias_rate (0.001), below bfloat16's
    resolution near 1 (2^-7): the slim export keeps them float32, bit for bit, and rounds
    the trained weights to bfloat16."""
    cfg = apply_overrides(tiny_config(dp=1, pp=1, tp=1), {"model": dict(router_bias_rate=0.001)})
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: jax.device_put((1 + 0.001 * rng.integers(-50, 50, a.shape)).astype(np.float32), a.sharding),
                          abstract_state(cfg, mesh_of((1, 1, 1)))[0])
    out = modes.export_slim(params, config_to_dict(cfg), str(tmp_path / "export"))
    back = host(checkpoint.restore_params(out, params, cfg.model))
    names = set()
    for (path, original), restored in zip(jax.tree_util.tree_flatten_with_path(host(params))[0], jax.tree.leaves(back)):
        name = weight_name(path)
        names.add(name)
        expected = original if not is_trained(name) else original.astype(jax.numpy.bfloat16).astype(np.float32)
        assert restored.dtype == np.float32 and np.array_equal(restored, expected), jax.tree_util.keystr(path)
    assert "router_bias_E" in names


# ---- main.py: resume after a kill mid-write, damaged checkpoints, errors


@pytest.mark.slow
def test_kill_during_a_checkpoint_write_resumes_from_the_last_complete_one(tmp_path, data_cache, reference):
    """SIGKILL while Orbax is writing a checkpoint (its <step>.orbax-checkpoint-tmp
    directory exists): the restarted run ignores and removes the partial write, resumes
    from the last complete checkpoint, and its losses equal the uninterrupted run's,
    bit for bit."""
    args = [*SCHEDULE, "--train.steps", "30", "--train.checkpoint_every", "1", "--run.name", "killed"]
    checkpoints = tmp_path / "killed" / "checkpoints"
    partial = []
    for _attempt in range(3):  # a kill can land just after the rename; then try again
        proc = subprocess.Popen(main_cmd(args, tmp_path, data_cache), cwd=REPO, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        deadline = time.time() + 300
        while proc.poll() is None and time.time() < deadline:
            names = os.listdir(checkpoints) if checkpoints.is_dir() else []
            if any(".orbax-checkpoint-tmp" in n and int(n.split(".")[0]) >= 5 for n in names):
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.001)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL, "the run finished before a write could be interrupted"
        partial = [n for n in os.listdir(checkpoints) if ".orbax-checkpoint-tmp" in n]
        if partial:
            break
    assert partial, "no kill landed during a checkpoint write in 3 tries"
    writing = int(partial[0].split(".")[0])
    last_complete = max(complete_steps(checkpoints))
    assert last_complete < writing

    result = main_py(args, tmp_path, data_cache)
    assert f"resumed from {checkpoints}/{last_complete}\n" in result.stdout
    assert not any(".orbax-checkpoint-tmp" in n for n in os.listdir(checkpoints))  # the partial write is gone
    resumed, order = train_losses(tmp_path / "killed")
    straight, _ = train_losses(reference)
    assert order == list(range(1, 31))
    assert resumed == straight  # bit for bit


@pytest.mark.slow
def test_damaged_checkpoints_fall_back_to_the_last_intact_one(tmp_path, data_cache, reference):
    """The latest checkpoint has one flipped byte in an array file (Orbax alone would
    restore the wrong value), the one before has truncated files: the run says so for
    each, moves them aside, resumes from step 10 and repeats the reference exactly."""
    run = copy_run(reference, tmp_path)
    flipped = max(array_files(run / "checkpoints" / "30" / "params"), key=os.path.getsize)
    with open(flipped, "r+b") as f:
        f.seek(os.path.getsize(flipped) // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x04]))
    for path in array_files(run / "checkpoints" / "20" / "opt_state"):
        os.truncate(path, os.path.getsize(path) // 2)

    result = main_py([*REFERENCE, "--run.name", "ref"], tmp_path, data_cache)
    out = result.stdout
    assert "checkpoint step 30" in out and "do not match the fingerprint" in out, out
    assert "checkpoint step 20" in out and "could not be restored" in out
    assert_redid_steps_after_10(run, reference, out, set_aside="unreadable")


@pytest.mark.slow
def test_resume_step_picks_an_earlier_checkpoint_and_redoes_the_steps_after_it(tmp_path, data_cache, reference):
    """--train.resume_step 10 with checkpoints 10, 20, 30: training restarts from 10,
    the later ones are moved aside (so that 20 and 30 are saved again, not skipped),
    and steps 11..30 repeat the reference bit for bit. Each checkpoint's meta holds
    what exact resume needs."""
    run = copy_run(reference, tmp_path)
    meta = json.loads((run / "checkpoints" / "30" / "meta" / "metadata").read_text())
    assert {"step", "data_position", "seed", "config", "wandb_id", "fingerprint"} <= set(meta)
    assert meta["step"] == meta["data_position"] == 30 and meta["config"]["model"]["vocab_size"] == BYTES_VOCAB
    result = main_py([*REFERENCE, "--run.name", "ref", "--train.resume_step", "10"], tmp_path, data_cache)
    assert_redid_steps_after_10(run, reference, result.stdout, set_aside="superseded")


@pytest.mark.slow
def test_bad_checkpoint_input_gets_a_clear_error(tmp_path, data_cache, reference):
    run = copy_run(reference, tmp_path)
    wider = main_py([*REFERENCE, "--run.name", "ref", "--model.d_model", "64"], tmp_path, data_cache, check=False)
    assert wider.returncode == 1 and "Traceback" not in wider.stderr
    assert "error: the checkpoint in" in wider.stderr and "--model.d_model: checkpoint 32 vs now 64" in wider.stderr
    assert complete_steps(run / "checkpoints") == [10, 20, 30]  # nothing was touched

    missing = main_py([*SCHEDULE, "--train.steps", "2", "--run.name", "ft", "--train.init_from", str(tmp_path / "nope")],
                      tmp_path, data_cache, check=False)
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    assert f"error: {tmp_path / 'nope'} does not exist" in missing.stderr
    assert "compiled" not in missing.stdout  # it failed before anything compiled


# ---- main.py: restore onto other meshes (--mode eval, --mode sample)


@pytest.fixture(scope="session")
def written_on_2x2x2(tmp_path_factory, data_cache):
    """12 steps on dp2 x pp2 x tp2; the end-of-training eval and sample (seed 0) are
    the figures every other mesh must reproduce from the checkpoint."""
    out = tmp_path_factory.mktemp("reshard")
    main_py([*SCHEDULE, *MESH_2x2x2, "--train.steps", "12", "--run.name", "src", "--sample.num_samples", "1",
             "--sample.max_tokens", "40"], out, data_cache)
    run = out / "src"
    val = [r["val_loss"] for r in metrics(run) if "val_loss" in r]
    text = (run / "samples.txt").read_text()
    header, _, sample = text.partition("\n")
    assert header.startswith("--- step 12") and len(val) == 1
    return run, val[0], sample[:-1]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [(1, 1, 1), (1, 2, 4)])  # (restores onto (8,1,1) and more: test_restore_onto_another_mesh_is_bit_exact)
def test_checkpoint_from_2x2x2_evaluates_and_samples_the_same_on(written_on_2x2x2, data_cache, mesh):
    run, val_2x2x2, sample_2x2x2 = written_on_2x2x2
    dp, pp, tp = mesh
    flags = ["--run.name", "src", "--mesh.dp", str(dp), "--mesh.pp", str(pp), "--mesh.tp", str(tp),
             "--train.microbatches", str(max(pp, 1))]
    if dp * pp * tp > 1:
        flags += ["--run.cpu_devices", str(dp * pp * tp)]
    evaluated = main_py(["--mode", "eval", *flags], run.parent, data_cache).stdout
    val = float(evaluated.strip().splitlines()[-1].removeprefix("val_loss="))
    np.testing.assert_allclose(val, val_2x2x2, rtol=1e-5)
    sampled = main_py(["--mode", "sample", *flags, "--sample.max_tokens", "40"], run.parent, data_cache).stdout
    assert sampled == sample_2x2x2 + "\n" and sampled.startswith("ROMEO:")


# ---- Slim export and fine-tuning


@pytest.fixture(scope="session")
def exported(reference, data_cache):
    main_py(["--mode", "export", "--run.name", "ref"], reference.parent, data_cache)
    return reference / "export"


def logits_of(source, cfg):
    """Logits [B, T, V] of two validation batches, params restored from `source` on one device."""
    from dataset import open_data

    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model, nnx.Rngs(0))))
    params, _ = abstract_state(cfg, mesh_of((1, 1, 1)))
    model = nnx.merge(graphdef, host(checkpoint.restore_params(str(source), params, cfg.model)))
    data = open_data(cfg.data.source, cfg.data.cache_dir, 1.0, 0)
    batch = next(iter(data.eval_batches(1, 32, cfg.model.seq_len, rows=range(32))))
    return np.asarray(model(jax.numpy.asarray(batch[:, :-1]))[0])[..., :cfg.model.vocab_size]


@pytest.mark.slow
def test_slim_export_is_a_sixth_of_a_checkpoint_and_gives_close_logits(reference, exported, data_cache):
    """bfloat16 params + config.json: at most a sixth of the full checkpoint's bytes
    (measured 0.146 here). --mode sample runs from it. Sampled text is not compared
    token for token with the float32 checkpoint's: this 30-step model's distributions
    are nearly flat, and a bf16 near-tie flipped the 2nd sampled token (tiny with the
    sigmoid router and the N(0, 1/D) embedding), after which the texts part. Logits: for the median token the largest
    difference is ~0.01 (bf16 rounding), but where rounding flips a router's top-k
    choice a token's logits move by up to ~0.3; so the bounds below are on the median,
    on probabilities and on how often the most likely token agrees."""
    full = modes.directory_bytes(reference / "checkpoints" / "30")
    slim = modes.directory_bytes(exported)
    assert slim <= full / 6, (slim, full, slim / full)
    assert json.loads((exported / "config.json").read_text())["model"]["d_model"] == 32

    sample = ["--mode", "sample", "--run.name", "ref", "--sample.max_tokens", "100"]
    from_checkpoint = main_py(sample, reference.parent, data_cache).stdout
    from_export = main_py([*sample, "--train.init_from", str(exported)], reference.parent, data_cache).stdout
    for text in (from_export, from_checkpoint):
        assert text.startswith("ROMEO:") and len(text) > 75

    cfg = apply_overrides(tiny_config(), {"data": {"cache_dir": data_cache}})
    logits_full, logits_slim = logits_of(reference, cfg), logits_of(exported, cfg)
    worst_per_token = np.abs(logits_full - logits_slim).max(-1)
    assert np.median(worst_per_token) < 0.03, np.percentile(worst_per_token, [50, 90, 99, 100])
    assert worst_per_token.max() < 1.0
    prob = lambda z: np.exp(z - z.max(-1, keepdims=True)) / np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)  # noqa: E731
    assert np.abs(prob(logits_full) - prob(logits_slim)).max() < 0.05
    assert np.mean(logits_full.argmax(-1) == logits_slim.argmax(-1)) >= 0.98


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["export", "run_dir"])
def test_fine_tune_starts_from_the_source_runs_loss_with_a_fresh_optimizer(tmp_path, reference, exported, data_cache, kind):
    """--train.init_from (a slim export or a run directory): the new run's first loss is
    where the 30-step source run ended (~5.0), not where a fresh init starts (~5.76,
    the uniform guess: the source's own first loss, same seed and data); its optimizer
    counts from 0."""
    source = exported if kind == "export" else reference
    result = main_py([*SCHEDULE, "--train.steps", "2", "--run.name", "ft", "--train.init_from", str(source)], tmp_path, data_cache)
    assert f"initialised params from {source} (fresh optimizer)" in result.stdout and "resumed" not in result.stdout
    tuned, _ = train_losses(tmp_path / "ft")
    straight, _ = train_losses(reference)
    source_end = np.mean([straight[s] for s in range(26, 31)])
    assert straight[1] - tuned[1] > 0.5, (straight[1], tuned[1])
    assert abs(tuned[1] - source_end) < 0.3, (tuned[1], source_end)

    import orbax.checkpoint as ocp

    saved = checkpoint.reader(str(tmp_path / "ft")).restore(2, args=ocp.args.Composite(
        opt_state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()))
    counts = [int(x) for x in jax.tree.leaves(saved["opt_state"]) if np.issubdtype(np.asarray(x).dtype, np.integer)]
    assert counts and set(counts) == {2}  # AdamW's step count (and its lr schedule) started again at 0
    assert saved["meta"]["step"] == 2
