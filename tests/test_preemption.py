"""Runs that survive the pod: save on the signal (every process at one step, exit 75,
one line; with JAX's preemption service off, by the flag all-gathered each step), a
checkpoint cut short or damaged is never the one resumed, launcher.sh --watch brings a
run back after a host's process dies, and goodput says where the wall time went.

The 2-process runs use tests/test_multiprocess.py's flags (tiny with 2 blocks on dp2 x
pp2 x tp2, 4 fake devices per process) and the loopback sshd of tests/test_launch.py.
Each compares every step's loss with one uninterrupted 2-process run, bit for bit.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from runtime import checkpoint, goodput
from runtime.plots import draw_goodput
from runtime.preemption import PREEMPTED_EXIT_CODE
from test_checkpoint import abstract_state, host, mesh_of, tiny_config
from test_launch import SSH_OPTIONS, hosts_file, launcher, needs_ssh_and_tmux, repo, ssh_env, sshd  # noqa: F401  (fixtures)
from test_multiprocess import REPO, TRAIN_FLAGS, data_flags, free_port, run_env, start_processes, stop_all, train_losses
from utils import config_to_dict

STEPS = 16
RUN_TIMEOUT_S = 400  # one 2-process run, compile included, on a crowded 2-core machine; failing tests stop here
RUN_FLAGS = ["--train.steps", str(STEPS), "--train.checkpoint_every", "4", "--train.eval_every", "1000"]


def rows_of(metrics_path):
    return [json.loads(line) for line in open(metrics_path).read().splitlines() if line.strip()]


def wait_for_step(metrics_path, step, procs=(), timeout_s=RUN_TIMEOUT_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.path.exists(metrics_path) and any(s >= step for s in train_losses(metrics_path)):
            return
        for p in procs:
            assert p.poll() is None, f"a process ended (status {p.returncode}) before step {step}"
        time.sleep(0.05)
    pytest.fail(f"no step {step} in {metrics_path} after {timeout_s}s")


def goodput_line(output):
    """(wall seconds, {phase: fraction}) from the run's last 'goodput: ...' line."""
    line = [x for x in output.splitlines() if x.startswith("goodput: ")][-1]
    wall = float(re.match(r"goodput: ([\d.]+)s of wall time", line).group(1))
    return wall, line


def assert_goodput_adds_up(rows, measured_s):
    """The end row's phases add up to the run's wall time, and that is the wall time the
    test measured (from the first process's start to the end row) within 2%."""
    end = [r for r in rows if r.get("event") == "end"][-1]
    total = sum(end["goodput"].values())
    assert total == pytest.approx(end["time"] - end["run_start"], abs=0.01), end
    assert total == pytest.approx(measured_s, rel=0.02), (total, measured_s, end["goodput"])
    return end["goodput"]


# ---- In process: goodput arithmetic, the plot, a checkpoint cut short


def test_phases_add_up_and_a_resume_counts_the_steps_redone_and_the_time_down():
    clock = goodput.PhaseClock(start=time.time() - 1.0)  # one second of start-up already
    with clock.phase("compile"):
        time.sleep(0.05)
    clock.switch("train")
    time.sleep(0.05)
    row = clock.row(4, "checkpoint")
    assert sum(row["goodput"].values()) == pytest.approx(row["time"] - row["run_start"], abs=2e-3)
    assert row["goodput"]["startup"] >= 1.0 and row["goodput"]["compile"] >= 0.05 and row["goodput"]["train"] >= 0.05

    # The attempt went on to step 6 (logged 2 s after the checkpoint) and died; a new
    # process started 3 s later and resumes from checkpoint 4.
    rows = [dict(step=4, loss=1.0, time=row["time"] - 0.1), row, dict(step=5, loss=1.0, time=row["time"] + 1),
            dict(step=6, loss=1.0, time=row["time"] + 2)]
    resumed = goodput.PhaseClock(start=row["time"] + 5)
    restart = resumed.resume(rows, 4, "a test")
    assert restart["restart"] == 1 and restart["steps_redone"] == 2 and restart["reason"] == "a test"
    assert restart["redone_s"] == pytest.approx(2.0, abs=1e-3) and restart["down_s"] == pytest.approx(3.0, abs=1e-3)
    later = resumed.row(8, "end")
    assert later["run_start"] == row["run_start"]
    assert sum(later["goodput"].values()) == pytest.approx(later["time"] - row["run_start"], abs=2e-3)
    line = goodput.summary(later["goodput"], restarts=1)
    assert "lost to 1 restart(s)" in line and "steps redone 2.0s, down 3.0s" in line
    assert goodput.PhaseClock().resume([], 4, "fresh") is None  # no goodput rows: nothing to continue


def test_goodput_plot_draws_the_totals_and_the_restart():
    from matplotlib.figure import Figure

    totals = dict(startup=10.0, compile=5.0, train=30.0, eval=1.0, checkpoint=2.0, data=0.5, redone=3.0, down=6.0, other=0.5)
    rows = [dict(step=1, loss=5.0, time=1016.0), dict(step=2, loss=4.9, time=1017.0),
            dict(step=2, event="restart", restart=1, reason="test", steps_redone=1, redone_s=3.0, down_s=6.0,
                 stopped_at=1020.0, started_at=1026.0, time=1030.0),
            dict(step=3, loss=4.8, time=1040.0), dict(step=3, event="end", time=1058.0, run_start=1000.0, goodput=totals)]
    drawn = draw_goodput(Figure(), rows, {"run": {"name": "t"}})
    assert drawn["seconds"] == totals
    assert drawn["steps"] == ([16.0, 17.0, 40.0], [1.0, 2.0, 3.0])
    assert draw_goodput(Figure(), [dict(step=1, loss=5.0)], {"run": {"name": "t"}}) is None


def damage(step_dir, how):
    """Cut a committed checkpoint short as a host killed mid-write (or a lost file) would."""
    arrays = sorted(os.path.join(root, f) for root, _, files in os.walk(step_dir) for f in files
                    if os.path.basename(root) == "d")
    assert arrays, f"no array files under {step_dir}"
    if how == "truncated":
        for path in arrays:
            os.truncate(path, os.path.getsize(path) // 3)
    elif how == "files_removed":
        for path in arrays[::2]:
            os.remove(path)
    elif how == "item_removed":
        import shutil

        shutil.rmtree(os.path.join(step_dir, "opt_state"))
    elif how == "byte_flipped":  # read without complaint by Orbax: only the fingerprint sees it
        flipped = max((p for p in arrays if os.sep + "params" + os.sep in p), key=os.path.getsize)
        with open(flipped, "r+b") as f:
            f.seek(os.path.getsize(flipped) // 2)
            byte = f.read(1)[0]
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte ^ 0x04]))


@pytest.mark.parametrize("how", ["truncated", "files_removed", "item_removed", "byte_flipped"])
def test_a_checkpoint_cut_short_is_skipped_with_a_line_naming_it(tmp_path, how):
    """Checkpoints 5 and 10 (different random values), then 10 damaged (byte_flipped:
    only the fingerprint check sees it) and a write of 15 left half done (Orbax's
    temporary directory): the manager removes the partial write and names it, restore
    names step 10, moves it aside, and gives step 5's arrays bit for bit."""
    cfg = tiny_config(dp=1, pp=1, tp=1)
    mesh = mesh_of((1, 1, 1))
    run_dir = tmp_path / "run"
    manager = checkpoint.checkpoint_manager(str(run_dir), keep=3)
    saved = {}
    for step in (5, 10):
        rng = np.random.default_rng(step)
        fill = lambda a: jax.device_put(rng.standard_normal(a.shape).astype(a.dtype) if a.dtype == np.float32  # noqa: E731
                                        else np.asarray(step, a.dtype), a.sharding)
        params, opt_state = jax.tree.map(fill, abstract_state(cfg, mesh))
        checkpoint.save_checkpoint(manager, step, params, opt_state, dict(seed=0, data_position=step, config=config_to_dict(cfg)))
        manager.wait_until_finished()
        saved[step] = host(params)
    damage(run_dir / "checkpoints" / "10", how)
    partial = run_dir / "checkpoints" / f"15{checkpoint.TMP_MARK}-1796000000"
    (partial / "params").mkdir(parents=True)
    (partial / "params" / "half_written").write_bytes(b"\0" * 100)

    said = []
    manager = checkpoint.checkpoint_manager(str(run_dir), keep=3, log=said.append)
    assert said == [f"skipping the partial checkpoint {partial} (a write cut short; removed)"]
    assert sorted(manager.all_steps()) == [5, 10]
    params, opt_state = abstract_state(cfg, mesh)
    restored_params, _, meta = checkpoint.restore_checkpoint(manager, params, opt_state, cfg.model, seed=0, log=said.append)
    assert meta["step"] == 5
    jax.tree.map(np.testing.assert_array_equal, host(restored_params), saved[5])
    named = [line for line in said[1:] if "checkpoint step 10" in line]
    assert named and "could not be restored" in named[0] and "falling back to the previous checkpoint" in named[0], said
    if how == "byte_flipped":
        assert "do not match the fingerprint saved with them" in named[0], named
    assert any("moved checkpoint step 10 aside" in line for line in said), said
    assert sorted(manager.all_steps()) == [5]
    deadline = time.monotonic() + 10
    while partial.exists():  # Orbax removes it in the background
        assert time.monotonic() < deadline, f"{partial} is still there"
        time.sleep(0.1)


# ---- 2 processes, JAX's preemption service off: the flag all-gathered each step

SHOULD_STOP_WORKER = """
import json, os, signal, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_enable_preemption_service", False)
jax.distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))
from runtime.preemption import Preemption, jax_sync_manager
with Preemption() as preemption:
    said = [jax_sync_manager() is None, preemption.jax_owns_sigterm, preemption.should_stop(1)]
    if jax.process_index() == 1:
        os.kill(os.getpid(), signal.SIGTERM)  # caught by Preemption: only this process holds the flag
    said += [preemption.received, preemption.should_stop(2), preemption.why()]
print(json.dumps(said), flush=True)
"""


def test_without_jax_preemption_service_a_flag_in_one_process_stops_both_at_the_same_step(tmp_path_factory):
    """With jax_enable_preemption_service off there is no sync manager: Preemption
    catches SIGTERM itself and should_stop all-gathers the flag, so a signal to process
    1 alone stops process 0 at the same step."""
    address = f"127.0.0.1:{free_port()}"
    env = dict(run_env(tmp_path_factory), JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, "-c", SHOULD_STOP_WORKER, address, str(i)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        stop_all(procs)
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in outs]
    said = [json.loads(out.splitlines()[-1]) for out, _ in outs]
    why = ("a preemption notice (SIGTERM or SIGINT to a process of this run{}); all 2 processes stop at this step")
    assert said == [[True, False, False, None, True, why.format("")],
                    [True, False, False, "SIGTERM", True, why.format(", here SIGTERM")]], said


# ---- 2 processes x 4 devices: SIGTERM to one


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Two processes, STEPS steps, never stopped: {step: loss}."""
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    procs = start_processes(tmp_path, tmp_path_factory, RUN_FLAGS)
    try:
        for p in procs:
            p.wait(timeout=RUN_TIMEOUT_S)
    finally:
        stop_all(procs)
    for i, p in enumerate(procs):
        assert p.returncode == 0, (tmp_path / f"p{i}.err").read_text()[-3000:]
    return train_losses(tmp_path / "runs" / "two" / "metrics.jsonl")


@pytest.mark.slow
def test_sigterm_to_one_process_saves_everywhere_at_one_step_and_resumes_bit_for_bit(tmp_path, tmp_path_factory,
                                                                                     uninterrupted):
    metrics = tmp_path / "runs" / "two" / "metrics.jsonl"
    started = time.time()
    procs = start_processes(tmp_path, tmp_path_factory, RUN_FLAGS)
    try:
        wait_for_step(metrics, 2, procs)
        procs[1].send_signal(signal.SIGTERM)
        time.sleep(0.3)
        procs[1].send_signal(signal.SIGTERM)  # a second signal while it saves changes nothing
        codes = [p.wait(timeout=RUN_TIMEOUT_S) for p in procs]
    finally:
        stop_all(procs)
    outs = [(tmp_path / f"p{i}.out").read_text() for i in range(2)]
    assert codes == [PREEMPTED_EXIT_CODE] * 2, [(tmp_path / f"p{i}.err").read_text()[-2000:] for i in range(2)]
    lines = [[x for x in out.splitlines() if x.startswith("preempted: ")] for out in outs]
    assert [len(x) for x in lines] == [1, 1], outs
    stopped = [int(re.search(r"saved checkpoint step (\d+)", x[0]).group(1)) for x in lines]
    assert stopped[0] == stopped[1] and 2 < stopped[0] < STEPS, lines  # the same step, mid-run
    assert all("a preemption notice" in x[0] and "all 2 processes stop at this step" in x[0] for x in lines), lines
    checkpoints = tmp_path / "runs" / "two" / "checkpoints"
    assert str(stopped[0]) in os.listdir(checkpoints)
    assert max(train_losses(metrics)) == stopped[0]

    again = start_processes(tmp_path, tmp_path_factory, RUN_FLAGS)  # the same command
    try:
        codes = [p.wait(timeout=RUN_TIMEOUT_S) for p in again]
    finally:
        stop_all(again)
    out = (tmp_path / "p0.out").read_text()
    assert codes == [0, 0], out[-3000:]
    ended = time.time()
    assert f"resumed from {checkpoints}/{stopped[0]}\n" in out
    assert train_losses(metrics) == uninterrupted  # every step, bit for bit
    rows = rows_of(metrics)
    (restart,) = [r for r in rows if r.get("event") == "restart"]
    assert restart["reason"] == f"preempted at step {stopped[0]}" and restart["steps_redone"] == 0 and restart["down_s"] > 0
    totals = assert_goodput_adds_up(rows, goodput_line(out)[0])
    assert totals["down"] == pytest.approx(restart["down_s"], abs=1e-3)
    assert goodput_line(out)[0] <= ended - started


# ---- launcher.sh --watch over the loopback sshd


def host_python(runs, process, launcher=None):
    """The pid of process `process`'s python (main.py) of the run writing into `runs`; with `launcher` (its Popen),
    waits for that python to start while the launcher runs."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        found = subprocess.run(["pgrep", "-f", f"main.py .*--dist.process_id {process} .*{runs}"], capture_output=True, text=True)
        pids = [int(p) for p in found.stdout.split()]
        if pids or launcher is None:
            break
        assert launcher.poll() is None and time.monotonic() < deadline, f"no python of process {process} (launcher: {launcher.poll()})"
        time.sleep(0.05)
    assert len(pids) == 1, (found.stdout, found.stderr)
    return pids[0]


def watch(repo, sshd, hosts, name, remote, runs, tmp_path_factory, *options):
    """Start launcher.sh --watch in the background; its output goes to a file. A survivor
    whose peer died stops within 60 s (--dist.timeout_s), not the default 120."""
    cmd = ["bash", str(repo / "launcher.sh"), "--hosts", str(hosts), *SSH_OPTIONS, "--watch", "--poll", "1", *options,
           "--name", name, "--port", str(free_port()), "--remote-dir", str(remote), "--python", sys.executable, "--",
           *TRAIN_FLAGS, *data_flags(tmp_path_factory), *RUN_FLAGS, "--run.cpu_devices", "4", "--run.out_dir", str(runs),
           "--dist.timeout_s", "60"]
    out_path = remote.parent / f"{name}.launcher.out"
    return subprocess.Popen(cmd, cwd=repo, env=ssh_env(sshd), stdout=open(out_path, "w"), stderr=subprocess.STDOUT), out_path


@pytest.mark.slow
@needs_ssh_and_tmux
def test_watch_relaunches_both_hosts_after_a_kill_9_and_the_run_finishes_bit_for_bit(repo, sshd, tmp_path, tmp_path_factory,
                                                                                    uninterrupted):
    hosts = hosts_file(tmp_path, "127.0.0.1", "localhost")
    remote, runs = tmp_path / "remote", tmp_path / "runs"
    started = time.time()
    proc, out_path = watch(repo, sshd, hosts, "w", remote, runs, tmp_path_factory, "--max-restarts", "2")
    try:
        wait_for_step(runs / "w" / "metrics.jsonl", 6, [proc])  # past checkpoint 4
        os.kill(host_python(runs, 1), signal.SIGKILL)
        assert proc.wait(timeout=2 * RUN_TIMEOUT_S) == 0, out_path.read_text()[-4000:]
    finally:
        stop_all([proc])
        launcher(repo, sshd, hosts, "--name", "w", "--remote-dir", str(remote), "--stop")
    ended = time.time()
    said = out_path.read_text()
    assert re.search(r"launcher: restart 1/2 of run w: .*process 1 \(localhost\): killed by signal 9 \(exit 137\)", said), said
    assert "launcher: run w finished on every host (exit 0) after 1 restart(s)" in said, said
    metrics = runs / "w" / "metrics.jsonl"
    assert train_losses(metrics) == uninterrupted
    rows = rows_of(metrics)
    (restart,) = [r for r in rows if r.get("event") == "restart"]
    assert restart["reason"].startswith("launcher.sh --watch restart 1/2: ") and "killed by signal 9" in restart["reason"]
    assert restart["steps_redone"] >= 1 and restart["redone_s"] > 0 and restart["down_s"] > 0, restart
    log = (remote / "logs" / "w-p0.log").read_text()
    totals = assert_goodput_adds_up(rows, goodput_line(log)[0])
    assert totals["redone"] + totals["down"] == pytest.approx(restart["redone_s"] + restart["down_s"], abs=1e-3)
    assert goodput_line(log)[0] <= ended - started


@pytest.mark.slow
@needs_ssh_and_tmux
def test_watch_with_max_restarts_0_gives_up_with_a_clear_line(repo, sshd, tmp_path, tmp_path_factory):
    hosts = hosts_file(tmp_path, "127.0.0.1", "localhost")
    remote, runs = tmp_path / "remote", tmp_path / "runs"
    proc, out_path = watch(repo, sshd, hosts, "w0", remote, runs, tmp_path_factory, "--max-restarts", "0")
    try:
        os.kill(host_python(runs, 0, launcher=proc), signal.SIGKILL)  # as it starts: the launcher sees the end it sees mid-run
        assert proc.wait(timeout=RUN_TIMEOUT_S) == 1
    finally:
        stop_all([proc])
        launcher(repo, sshd, hosts, "--name", "w0", "--remote-dir", str(remote), "--stop")
    said = out_path.read_text()
    assert re.search(r"launcher: run w0: process 0 \(127\.0\.0\.1\): killed by signal 9 \(exit 137\).*; giving up after 0 "
                     r"restart\(s\) \(--max-restarts 0\): stopping the other hosts\. To resume from the latest checkpoint, "
                     r"launch again with --name w0", said), said
    assert "restart 1" not in said
