"""main.py end to end, as a user runs it: the command line, training, resume after a
kill, sampling, and the same losses on a 2x2x2 mesh as on one device."""

import ast
import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from parallel import optimizers
from runtime.preemption import PREEMPTED_EXIT_CODE
from utils import ConfigError, config_from_dict, parse_args

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUIET = ["--log.progress", "false", "--log.plots", "false", "--sample.num_samples", "0", "--log.every", "1"]


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    """One prepared copy of the embedded Shakespeare data for every run in the session."""
    return str(tmp_path_factory.mktemp("data_cache"))


def main_py(args, out_dir, data_cache, check=True, **kwargs):
    cmd = [sys.executable, os.path.join(REPO, "main.py"), "--preset", "tiny", "--run.out_dir", str(out_dir),
           "--data.cache_dir", data_cache, *QUIET, *args]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, **kwargs)
    if check:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def train_losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}, [r["step"] for r in rows if "loss" in r]


# ---- The command line


def test_cli_both_flag_forms_and_bare_boolean():
    cfg = parse_args(["--train.steps=7", "--train.lr", "0.5", "--log.wandb", "--mesh.tp", "2", "--mesh.expert_parallel", "false"])
    assert (cfg.train.steps, cfg.train.lr, cfg.log.wandb, cfg.mesh.tp, cfg.mesh.expert_parallel) == (7, 0.5, True, 2, False)
    assert cfg.run.name == "shakespeare"  # defaults to the preset name


def test_cli_preset_then_overrides():
    cfg = parse_args(["--preset", "moe1b", "--model.d_model", "512"])
    assert (cfg.model.d_model, cfg.model.n_experts, cfg.model.block_pattern) == (512, 16, "DDDDDM")


@pytest.mark.parametrize("argv, message", [
    (["--train.stepz", "3"], "did you mean --train.steps"),
    (["--nonsense"], "unknown flag --nonsense"),
    (["--train.steps", "many"], "--train.steps expects an integer, got 'many'"),
    (["--train.lr=fast"], "--train.lr expects a number"),
    (["--log.wandb=maybe"], "expects true or false"),
    (["--preset", "huge"], "unknown preset 'huge'"),
    (["--mode", "dance"], "unknown mode 'dance'"),
    (["--model.dtype", "float16"], "--model.dtype must be float32, bfloat16 or auto"),
    (["--model.top_k", "9"], "--model.top_k"),
    (["--train.batch_size", "10", "--train.microbatches", "4"], "divisible by --train.microbatches"),
    (["stray"], "unexpected argument 'stray'"),
    (["--train.steps"], "--train.steps needs a value"),
    (["--mode", "serve", "--serve.slots", "0"], "--serve.slots and --serve.max_tokens must be >= 1"),
    (["--serve.port", "70000"], "--serve.port must be in 0..65535"),
    (["--train.optimizer", "sgd"], "--train.optimizer must be muon or adamw, got 'sgd'"),
    (["--train.muon_momentum", "1"], "--train.muon_momentum must be in"),
])
def test_cli_rejects_bad_input_with_a_clear_message(argv, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        parse_args(argv)


def test_cli_errors_exit_cleanly_and_help_lists_every_field():
    bad = subprocess.run([sys.executable, "main.py", "--train.stepz", "3"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "error: unknown flag --train.stepz; did you mean --train.steps" in bad.stderr
    assert "Traceback" not in bad.stderr
    helped = subprocess.run([sys.executable, "main.py", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0
    for flag in ("--run.cpu_devices", "--mesh.dp", "--dist.coordinator", "--train.microbatches", "--model.dtype",
                 "--data.source", "--log.wandb", "--sample.top_k", "--preset", "--mode"):
        assert flag in helped.stdout


def test_missing_data_is_one_line_that_says_what_to_give(tmp_path):
    missing = subprocess.run([sys.executable, "main.py", "--data.source", str(tmp_path / "nowhere"), "--run.out_dir", str(tmp_path)],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
    assert missing.returncode != 0 and "Traceback" not in missing.stderr
    assert missing.stderr.strip().splitlines() == [f"error: data source {str(tmp_path / 'nowhere')!r} is neither an embedded dataset "
                                                   "('shakespeare', 'code'), an existing directory, nor gs://bucket/prefix"]


# ---- Training, resume, sampling


@pytest.mark.slow
def test_main_py_is_a_script_nothing_imports():
    """Device set-up, runs, training and sampling live in modules of their own
    (runtime/devices.py, serving/modes.py, main.py, runtime/sampling.py); main.py only dispatches."""
    importers = []
    for path in glob.glob(os.path.join(REPO, "**", "*.py"), recursive=True):
        if "/." in os.path.relpath(path, REPO):
            continue
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            if "main" in names:
                importers.append(f"{os.path.relpath(path, REPO)}:{node.lineno}")
    assert importers == [], importers


def assert_goodput_phases_match_the_run(stdout, run_dir, event="end", timed=("data", "eval", "checkpoint", "train")):
    """The goodput phases of the run's one `event` row against the run's own figures:
    compile is the compile time the run printed (plus the memory summary after it), and
    each phase in `timed` took some time."""
    compiled_s = float(re.search(r"^compiled train step in ([\d.]+)s", stdout, re.M).group(1))
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        (row,) = [row for row in map(json.loads, f) if row.get("event") == event]
    phases = row["goodput"]
    assert compiled_s - 0.06 <= phases["compile"] <= compiled_s + max(1.0, 0.1 * compiled_s), (compiled_s, phases)
    assert min(phases[p] for p in timed) > 0, phases


@pytest.mark.slow
def test_resume_after_sigkill_repeats_and_skips_no_step(tmp_path, data_cache):
    """Kill -9 mid-run, start again: per-step losses equal an uninterrupted run's, bit
    for bit, and every step appears exactly once in metrics.jsonl."""
    steps = ["--train.steps", "40", "--train.checkpoint_every", "10", "--train.eval_every", "1000"]
    ran = main_py([*steps, "--run.name", "straight"], tmp_path, data_cache)
    straight, _ = train_losses(tmp_path / "straight")
    assert_goodput_phases_match_the_run(ran.stdout, tmp_path / "straight")

    cmd = [sys.executable, "main.py", "--preset", "tiny", "--run.out_dir", str(tmp_path), "--data.cache_dir", data_cache,
           *QUIET, *steps, "--run.name", "killed"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = tmp_path / "killed" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 25:  # past checkpoints 10 and 20
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed; raise --train.steps"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = len(metrics.read_text().splitlines())
    assert killed_at < 40

    result = main_py([*steps, "--run.name", "killed"], tmp_path, data_cache)
    assert "resumed from" in result.stdout
    resumed, order = train_losses(tmp_path / "killed")
    assert order == list(range(1, 41))  # no step repeated, none skipped
    assert resumed == straight  # bit for bit


@pytest.mark.slow
def test_sigterm_saves_the_step_it_reached_where_no_checkpoint_was_due(tmp_path, data_cache):
    """SIGTERM mid-run, with checkpoints, evals and the end 100000 steps away: the stop
    alone saves the step the run reached (a checkpoint, a `preempted` row, one line)
    and the run exits with 75. The row's goodput charges compile the time the run printed."""
    cmd = [sys.executable, "main.py", "--preset", "tiny", "--run.out_dir", str(tmp_path), "--data.cache_dir", data_cache,
           *QUIET, "--train.steps", "100000", "--train.checkpoint_every", "100000", "--train.eval_every", "100000",
           "--run.name", "stopped"]
    with open(tmp_path / "out.txt", "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    metrics = tmp_path / "stopped" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    try:
        assert proc.poll() is None, (tmp_path / "out.txt").read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) == PREEMPTED_EXIT_CODE, (tmp_path / "out.txt").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    said = [line for line in (tmp_path / "out.txt").read_text().splitlines() if line.startswith("preempted: ")]
    assert len(said) == 1 and said[0].startswith("preempted: SIGTERM received; saved checkpoint step "), said
    stopped = int(re.search(r"saved checkpoint step (\d+)", said[0]).group(1))
    assert stopped >= 3 and os.listdir(tmp_path / "stopped" / "checkpoints") == [str(stopped)]
    losses, order = train_losses(tmp_path / "stopped")
    assert order == list(range(1, stopped + 1))
    last = json.loads(metrics.read_text().splitlines()[-1])
    assert (last["step"], last["event"]) == (stopped, "preempted"), last
    # no eval ran: the one checkpoint is the stop's
    assert_goodput_phases_match_the_run((tmp_path / "out.txt").read_text(), tmp_path / "stopped", "preempted",
                                        ("data", "checkpoint", "train"))


@pytest.mark.slow
def test_2x2x2_mesh_trains_like_one_device(tmp_path, data_cache):
    """The command-line check of mesh invariance: same seed, same config, 8 fake
    devices as dp2 x pp2 x tp2 against one device: the same losses."""
    common = ["--train.steps", "12", "--train.eval_every", "6", "--train.microbatches", "2", "--train.checkpoint_every", "1000"]
    main_py([*common, "--run.name", "one"], tmp_path, data_cache)
    main_py([*common, "--run.name", "mesh", "--run.cpu_devices", "8", "--mesh.dp", "2", "--mesh.pp", "2", "--mesh.tp", "2"],
            tmp_path, data_cache)
    one, _ = train_losses(tmp_path / "one")
    mesh, _ = train_losses(tmp_path / "mesh")
    assert sorted(one) == sorted(mesh) == list(range(1, 13))
    np.testing.assert_allclose([mesh[s] for s in sorted(mesh)], [one[s] for s in sorted(one)], rtol=1e-5)
    assert one[12] < one[1] - 0.2  # it learned something: these are not two untouched inits
    val = lambda d: [json.loads(x)["val_loss"] for x in open(d / "metrics.jsonl") if "val_loss" in x]  # noqa: E731
    np.testing.assert_allclose(val(tmp_path / "mesh"), val(tmp_path / "one"), rtol=1e-5)


@pytest.mark.slow
def test_dropout_run_on_2x2x2_trains_like_one_device(tmp_path, data_cache):
    """The issue's command: dropout 0.1 on dp2 x pp2 x tp2 with two microbatches, 20
    steps, against one device with the same dropout: the same losses (float32, the tiny
    preset). Masks are drawn per global row, block, layer and step, never per device."""
    common = ["--model.dropout", "0.1", "--train.steps", "20", "--train.eval_every", "10", "--train.checkpoint_every", "1000"]
    main_py([*common, "--run.name", "one"], tmp_path, data_cache)
    main_py([*common, "--run.name", "mesh", "--run.cpu_devices", "8", "--mesh.dp", "2", "--mesh.pp", "2", "--mesh.tp", "2",
             "--train.microbatches", "2"], tmp_path, data_cache)
    one, _ = train_losses(tmp_path / "one")
    mesh, _ = train_losses(tmp_path / "mesh")
    assert sorted(one) == sorted(mesh) == list(range(1, 21))
    np.testing.assert_allclose([mesh[s] for s in sorted(mesh)], [one[s] for s in sorted(one)], rtol=1e-5)
    assert one[20] < one[1] - 0.2  # it learned something


@pytest.mark.parametrize("environ, threads", [({}, str(max(os.cpu_count(), 16))), ({"PJRT_NPROC": "3"}, "3"),
                                              ({"NPROC": "5"}, None)])
def test_fake_devices_get_two_pool_threads_each_unless_the_user_chose(environ, threads):
    """XLA:CPU sizes its thread pool max(cores, devices); with one thread per device a
    2x2x2 step on 2 cores deadlocked in 7 of 9 runs (devices.use_fake_cpu_devices). The
    variable must be set before the backend starts, and a user's own choice wins."""
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC")}
    code = ("import os; from runtime import devices; devices.use_fake_cpu_devices(8); import jax; "
            "print(os.environ.get('PJRT_NPROC'), len(jax.devices()))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**env, **environ})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == [str(threads), "8"]


@pytest.mark.parametrize("platform, mode, cpu_devices, expected", [
    ("tpu", "train", 0, "tpu"), ("cuda", "train", 0, "gpu"), ("cpu", "train", 0, None),
    ("tpu", "sample", 0, None), ("tpu", "train", 8, None)])
def test_overlap_flags_go_to_the_accelerators_compiler_on_train_only(monkeypatch, capsys, platform, mode, cpu_devices,
                                                                     expected):
    """--mode train on a TPU or GPU: the compiler's overlap flags (devices.OVERLAP_FLAGS)
    in LIBTPU_INIT_ARGS or XLA_FLAGS, merged with the user's (whose own value of a flag
    wins), printed once. On CPU, fake CPU devices or another mode: the environment as it
    was (the default run compiles as before)."""
    from runtime import devices
    monkeypatch.setenv("JAX_PLATFORMS", platform)
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_enable_async_all_gather=false --xla_tpu_user_flag=1")
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_latency_hiding_scheduler=false")
    before = dict(os.environ)
    devices.set_overlap_flags(parse_args(["--mode", mode, "--run.cpu_devices", str(cpu_devices)]))
    printed = capsys.readouterr().out
    changed = {k: v for k, v in os.environ.items() if before.get(k) != v}
    if expected is None:
        assert changed == {} and printed == ""
        return
    variable = devices.OVERLAP_VARIABLE[expected]
    ours = [f for f in devices.OVERLAP_FLAGS[expected] if not f.startswith(("--xla_enable_async_all_gather=",
                                                                           "--xla_gpu_enable_latency_hiding_scheduler="))]
    assert len(ours) == len(devices.OVERLAP_FLAGS[expected]) - 1
    assert changed == {variable: " ".join(ours + before[variable].split())}
    assert printed.count("\n") == 1 and printed.startswith(f"{variable}={changed[variable]}  ")


def test_gpu_overlap_flags_are_flags_xla_knows():
    """XLA aborts at start-up on a flag in XLA_FLAGS it does not know (the list changes
    between versions: --xla_gpu_enable_async_collectives is gone from jaxlib 0.10.2);
    devices.GPU_OVERLAP_FLAGS all parse (here, on CPU; they apply to GPU compiles)."""
    from runtime import devices
    env = {**os.environ, "XLA_FLAGS": " ".join(devices.GPU_OVERLAP_FLAGS), "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", "import jax; print(jax.numpy.ones(3).sum())"], cwd=REPO,
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0 and result.stdout.split() == ["3.0"], result.stderr[-2000:]


@pytest.mark.slow
def test_run_writes_contract_files_and_samples(tmp_path, data_cache):
    """A short run leaves config.json, metrics.jsonl (the schema in docs/checkpoints.md),
    checkpoints/ and samples.txt; --mode sample with a fixed seed repeats itself."""
    main_py(["--train.steps", "30", "--train.eval_every", "15", "--run.name", "r", "--sample.num_samples", "1",
             "--sample.max_tokens", "40"], tmp_path, data_cache)
    run = tmp_path / "r"
    config = json.loads((run / "config.json").read_text())
    assert config["model"]["vocab_size"] == 257 and config["train"]["steps"] == 30
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_sec", "mfu", "aux_loss", "dropped_frac", "expert_load"):
        assert key in train_rows[-1], key
    assert all(r["max_logit"] > 0 and len(r["max_logit_layer"]) == 8 for r in train_rows)  # every row; tiny: 8 blocks of 1 layer
    schedule = optimizers.lr_schedule(config_from_dict(config).train)  # the lr each row's step trained with
    assert [r["lr"] for r in train_rows] == [float(schedule(r["step"] - 1)) for r in train_rows]
    (end,) = [r for r in rows if r.get("event") == "end"]  # how long the host held the devices between steps
    assert end["device_busy_s"] > 0 and 0 <= end["host_held_s"] <= end["goodput"]["train"] + end["goodput"]["data"], end
    assert [r["step"] for r in rows if "val_loss" in r] == [15, 30]
    assert sorted(os.listdir(run / "checkpoints")) == ["30"]
    assert (run / "samples.txt").read_text().count("--- step 30") == 1

    sample = ["--mode", "sample", "--run.name", "r", "--sample.max_tokens", "30", "--sample.seed", "3"]
    first = main_py(sample, tmp_path, data_cache).stdout
    second = main_py(sample, tmp_path, data_cache).stdout
    assert first == second and first.startswith("ROMEO:") and len(first) > len("ROMEO:") + 10
    greedy = main_py(["--mode", "sample", "--run.name", "r", "--sample.temperature", "0", "--sample.max_tokens", "30"],
                     tmp_path, data_cache).stdout
    assert greedy != first


def test_sample_without_a_run_says_what_to_do(tmp_path, data_cache):
    result = main_py(["--mode", "sample", "--run.name", "nope"], tmp_path, data_cache, check=False)
    assert result.returncode != 0 and "no run at" in result.stderr and "train first" in result.stderr
