"""The local checkpoint tier (runtime/local_tier.py): a run killed with SIGKILL resumes from the newest local step
(newer than the persistent tier's) with the losses of an uninterrupted run, bit for bit; goodput counts the steps redone;
a truncated local checkpoint is skipped with a line naming it. main.py runs as a subprocess: one CPU device, then two
processes x 4 fake devices (tests/test_multiprocess.py's helpers) of which one is SIGKILLed."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from test_launch import SSH_OPTIONS, hosts_file, launcher, needs_ssh_and_tmux, repo, ssh_env, sshd  # noqa: F401  (fixtures)
from test_multiprocess import (RUN_TIMEOUT_S, TRAIN_FLAGS, data_flags, finish_processes, free_port, start_processes, stop_all, train_losses,
                               wait_for_training)
from test_preemption import host_python

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUIET = ["--log.progress", "false", "--log.plots", "false", "--sample.num_samples", "0", "--log.every", "1"]
STEPS, KILL_AFTER, LOCAL_EVERY = 60, 47, 5
ARGS = ["--preset", "tiny", "--train.steps", str(STEPS), "--train.decay_steps", "100", "--train.eval_every", "1000",
        "--train.checkpoint_every", "100", "--run.name", "run", *QUIET]
LOCAL = ["--train.local_checkpoint_every", str(LOCAL_EVERY)]


def main_cmd(out_dir, data_cache, *extra):
    return [sys.executable, os.path.join(REPO, "main.py"), *ARGS, "--run.out_dir", str(out_dir), "--data.cache_dir", data_cache, *extra]


def rows(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def losses(run_dir):
    return {r["step"]: r["loss"] for r in rows(run_dir) if "loss" in r}


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data_cache"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_cache):
    """The uninterrupted run, without the local tier."""
    out = tmp_path_factory.mktemp("reference")
    subprocess.run(main_cmd(out, data_cache), cwd=REPO, check=True, capture_output=True, timeout=600)
    return losses(out / "run")


@pytest.fixture(scope="module")
def killed(tmp_path_factory, data_cache):
    """A run with the local tier every 5 steps (persistent every 100), SIGKILLed once step 47's loss is logged."""
    for _attempt in range(3):  # the kill must land before step 50's local save
        out = tmp_path_factory.mktemp("killed")
        proc = subprocess.Popen(main_cmd(out, data_cache, *LOCAL), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 300
        while proc.poll() is None and time.time() < deadline and KILL_AFTER not in losses(out / "run"):
            time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        local = out / "run" / "local" / "process_0"
        if sorted(os.listdir(local)) == ["40", "45"]:
            return out
    pytest.fail(f"no kill landed between steps 47 and 50 in 3 tries: {sorted(os.listdir(local))}")


def resume(killed, tmp_path, data_cache):
    out = tmp_path / "resumed"
    shutil.copytree(killed, out)
    result = subprocess.run(main_cmd(out, data_cache, *LOCAL), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out / "run", result


@pytest.mark.slow
def test_kill_9_resumes_from_the_local_tier_with_the_uninterrupted_losses(killed, reference, tmp_path, data_cache):
    run_dir, result = resume(killed, tmp_path, data_cache)
    assert f"resumed from step 45 of the local tier ({run_dir}/local/process_0/45 on each process" in result.stdout
    assert result.stdout.count("resumed from") == 1
    got = losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert [got[s] for s in range(46, STEPS + 1)] == [reference[s] for s in range(46, STEPS + 1)]  # bit for bit
    restart = [r for r in rows(run_dir) if r.get("event") == "restart"]
    assert len(restart) == 1 and restart[0]["step"] == 45 and restart[0]["steps_redone"] == KILL_AFTER - 45


@pytest.mark.slow
def test_a_truncated_local_checkpoint_is_skipped_with_a_line_naming_it(killed, reference, tmp_path, data_cache):
    shards = killed / "run" / "local" / "process_0" / "45" / "shards.npz"
    damaged = tmp_path / "damaged"
    shutil.copytree(killed, damaged)
    target = damaged / "run" / "local" / "process_0" / "45" / "shards.npz"
    with open(target, "r+b") as f:
        f.truncate(os.path.getsize(shards) // 2)
    run_dir, result = resume(damaged, tmp_path, data_cache)
    where = run_dir / "local" / "process_0" / "45"
    assert f"skipping the local checkpoint {where} (" in result.stdout
    assert f"resumed from step 40 of the local tier ({run_dir}/local/process_0/40" in result.stdout
    assert os.path.isdir(f"{where}.unreadable")
    got = losses(run_dir)
    assert [got[s] for s in range(41, STEPS + 1)] == [reference[s] for s in range(41, STEPS + 1)]


# ---- Two processes x 4 fake devices (mesh dp 2 x pp 2 x tp 2): SIGKILL of process 1


MP_STEPS, MP_KILL_AFTER = 16, 12
MP_FLAGS = ["--train.steps", str(MP_STEPS), "--train.checkpoint_every", "100", "--train.eval_every", "1000", "--dist.timeout_s", "60"]


@pytest.fixture(scope="module")
def mp_straight(tmp_path_factory):
    """Two processes, 16 steps, never stopped, without the local tier: {step: loss}."""
    straight_dir = tmp_path_factory.mktemp("mp_straight")
    finish_processes(start_processes(straight_dir, tmp_path_factory, MP_FLAGS), straight_dir)
    return train_losses(straight_dir / "runs" / "two" / "metrics.jsonl")


@pytest.fixture(scope="module")
def mp_killed(tmp_path_factory, mp_straight):
    """(the straight 2-process run's {step: loss}, the dir of a 2-process run with the local tier whose process 1 was
    SIGKILLed after step 12: local steps 5 and 10 on each process, and each one's replica in its peer's directory)."""
    tmp_path = tmp_path_factory.mktemp("mp_killed")
    procs = start_processes(tmp_path, tmp_path_factory, [*MP_FLAGS, *LOCAL])
    try:
        wait_for_training(tmp_path / "runs" / "two" / "metrics.jsonl", procs, min_step=MP_KILL_AFTER)
        procs[1].send_signal(signal.SIGKILL)  # a lost host: no signal, no save
        procs[0].wait(timeout=240)  # the survivor stops on the broken collective (--dist.timeout_s)
    finally:
        stop_all(procs)
    local = tmp_path / "runs" / "two" / "local"
    assert sorted(os.listdir(local / "process_1")) == ["10", "5", "peer_0"], "the kill landed after step 15"
    assert sorted(os.listdir(local / "process_0" / "peer_1")) == ["10", "5"]
    return mp_straight, tmp_path


def mp_resume(mp_killed, tmp_path_factory, name, damage=lambda local: None):
    """Restart both processes on a copy of the killed run, after damage(its local dir); (outputs, {step: loss}, local)."""
    straight, killed_dir = mp_killed
    tmp_path = tmp_path_factory.mktemp(name)
    shutil.copytree(killed_dir, tmp_path, dirs_exist_ok=True)
    local = tmp_path / "runs" / "two" / "local"
    damage(local)
    outputs = finish_processes(start_processes(tmp_path, tmp_path_factory, [*MP_FLAGS, *LOCAL]), tmp_path)
    got = train_losses(tmp_path / "runs" / "two" / "metrics.jsonl")
    assert sorted(got) == list(range(1, MP_STEPS + 1))
    assert [got[s] for s in range(11, MP_STEPS + 1)] == [straight[s] for s in range(11, MP_STEPS + 1)]  # bit for bit
    return outputs, local


@pytest.mark.slow
def test_two_processes_one_killed_resume_from_the_local_tier_bit_for_bit(mp_killed, tmp_path_factory):
    outputs, local = mp_resume(mp_killed, tmp_path_factory, "mp_resumed")
    assert f"resumed from step 10 of the local tier ({local}/process_0/10 on each process" in outputs[0]
    assert "peer's replica" not in outputs[0] + outputs[1]


@pytest.mark.slow
def test_a_replaced_host_resumes_from_its_peers_replica_bit_for_bit(mp_killed, tmp_path_factory):
    """Process 1's local directory deleted (its host replaced): it reads step 10 from process_0/peer_1."""
    outputs, local = mp_resume(mp_killed, tmp_path_factory, "mp_replaced", lambda local: shutil.rmtree(local / "process_1"))
    assert f"resumed from step 10 of the local tier ({local}/process_0/10 on each process" in outputs[0]
    assert (f"process 1 reads local step 10 from its peer's replica {local}/process_0/peer_1/10 ({local}/process_1 holds "
            "no step 10)") in outputs[1]
    assert "peer's replica" not in outputs[0]


@pytest.mark.slow
def test_one_process_whose_local_directory_is_gone_resumes_from_the_persistent_tier(reference, tmp_path, data_cache):
    """One process has no peer: a run lost after step 55's local save (its final checkpoint removed) on a host replaced
    (its local directory deleted) resumes from the persistent tier's step 40, with one line saying so."""
    out = tmp_path / "gone"
    persistent_40 = ["--train.checkpoint_every", "40"]
    subprocess.run(main_cmd(out, data_cache, *LOCAL, *persistent_40), cwd=REPO, check=True, capture_output=True, timeout=600)
    assert sorted(os.listdir(out / "run" / "local" / "process_0")) == ["50", "55"]
    shutil.rmtree(out / "run" / "checkpoints" / str(STEPS))
    shutil.rmtree(out / "run" / "local")
    result = subprocess.run(main_cmd(out, data_cache, *LOCAL, *persistent_40), cwd=REPO, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    said = [line for line in result.stdout.splitlines() if line.startswith("resumed from")]
    assert said == [f"resumed from step 40 of the persistent tier ({out}/run/checkpoints/40); no newer complete step in "
                    "the local tier"], said
    got = losses(out / "run")
    assert [got[s] for s in range(41, STEPS + 1)] == [reference[s] for s in range(41, STEPS + 1)]


# ---- launcher.sh --watch over the loopback sshd (tests/test_launch.py): SIGKILL of process 1 after step 12


@pytest.mark.slow
@needs_ssh_and_tmux
def test_watch_restarts_a_kill_9_from_local_step_10_bit_for_bit(repo, sshd, tmp_path, tmp_path_factory, mp_straight):
    """The run of mp_straight under launcher.sh --watch with the local tier, process 1 SIGKILLed after step 12: the
    launcher restarts both, they resume from local step 10 (2 steps redone) and steps 11..16 equal mp_straight's."""
    hosts = hosts_file(tmp_path, "127.0.0.1", "localhost")
    remote, runs = tmp_path / "remote", tmp_path / "runs"
    metrics = runs / "lw" / "metrics.jsonl"
    cmd = ["bash", str(repo / "launcher.sh"), "--hosts", str(hosts), *SSH_OPTIONS, "--watch", "--poll", "1",
           "--max-restarts", "1", "--name", "lw", "--port", str(free_port()), "--remote-dir", str(remote),
           "--python", sys.executable, "--", *TRAIN_FLAGS, *data_flags(tmp_path_factory), *MP_FLAGS, *LOCAL,
           "--run.cpu_devices", "4", "--run.out_dir", str(runs)]
    said = tmp_path / "launcher.out"
    proc = subprocess.Popen(cmd, cwd=repo, env=ssh_env(sshd), stdout=open(said, "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not (metrics.exists() and MP_KILL_AFTER in train_losses(metrics)):
            assert proc.poll() is None and time.monotonic() < deadline, said.read_text()[-3000:]
            time.sleep(0.001)
        os.kill(host_python(runs, 1), signal.SIGKILL)  # a lost host: no signal, no save
        assert proc.wait(timeout=3 * RUN_TIMEOUT_S) == 0, said.read_text()[-4000:]
    finally:
        stop_all([proc])
        launcher(repo, sshd, hosts, "--name", "lw", "--remote-dir", str(remote), "--stop")
    assert re.search(r"launcher: restart 1/1 of run lw: .*process 1 \(localhost\): killed by signal 9", said.read_text())
    log = (remote / "logs" / "lw-p0.log").read_text()
    assert f"resumed from step 10 of the local tier ({runs}/lw/local/process_0/10 on each process" in log, log[-3000:]
    got = train_losses(metrics)
    assert sorted(got) == list(range(1, MP_STEPS + 1))
    assert [got[s] for s in range(11, MP_STEPS + 1)] == [mp_straight[s] for s in range(11, MP_STEPS + 1)]  # bit for bit
    (restart,) = [r for r in rows(runs / "lw") if r.get("event") == "restart"]
    assert restart["step"] == 10 and restart["steps_redone"] == MP_KILL_AFTER - 10, restart  # goodput: 2 steps redone
    assert restart["reason"].startswith("launcher.sh --watch restart 1/1: ") and restart["redone_s"] > 0


# ---- 2 slices -> 1 slice: a run that lost a slice goes on from its checkpoint on the slice left

SLICE_STEPS, SLICE_SAVED = 40, 20
SLICE_ARGS = ["--train.steps", str(SLICE_STEPS), "--train.checkpoint_every", str(SLICE_SAVED), "--mesh.dp", "2"]
TWO_SLICES = ["--run.cpu_devices", "4", "--mesh.slices", "2", *SLICE_ARGS]
# one slice of the same 2 devices: the global batch kept, twice the microbatches (each one the size a device had)
ONE_SLICE = ["--run.cpu_devices", "2", "--mesh.slices", "1", "--train.microbatches", "2", *SLICE_ARGS]


@pytest.mark.slow
def test_two_slices_restarted_on_one_keep_the_losses(tmp_path, data_cache):
    """The 2-slice run's checkpoint at step 20, restored onto 1 slice (2 devices, 2 microbatches): steps 21..40 equal
    the uninterrupted 2-slice run's within float32 reassociation."""
    two = tmp_path / "two"
    two_slices = subprocess.run(main_cmd(two, data_cache, *TWO_SLICES), cwd=REPO, check=True, capture_output=True, text=True,
                                timeout=600)
    assert " over 4 devices, 1 process(es)" in two_slices.stdout and "slice=1" in two_slices.stdout
    straight = losses(two / "run")
    assert sorted(straight) == list(range(1, SLICE_STEPS + 1))
    one = tmp_path / "one"
    shutil.copytree(two, one)
    shutil.rmtree(one / "run" / "checkpoints" / str(SLICE_STEPS))  # the slice was lost after step 20's checkpoint
    result = subprocess.run(main_cmd(one, data_cache, *ONE_SLICE), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"resumed from {one}/run/checkpoints/{SLICE_SAVED}\n" in result.stdout
    assert " over 2 devices, 1 process(es)" in result.stdout and "slice=1" not in result.stdout  # one slice left
    got = losses(one / "run")
    assert sorted(got) == list(range(1, SLICE_STEPS + 1))
    after = range(SLICE_SAVED + 1, SLICE_STEPS + 1)
    assert max(abs(got[s] - straight[s]) for s in after) <= 1e-5, [(s, got[s], straight[s]) for s in after]
