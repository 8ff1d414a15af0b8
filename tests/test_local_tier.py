"""The local checkpoint tier (runtime/local_tier.py): a run killed with SIGKILL resumes from the newest local step
(newer than the persistent tier's) with the losses of an uninterrupted run, bit for bit; goodput counts the steps redone;
a truncated local checkpoint is skipped with a line naming it. main.py runs as a subprocess: one CPU device, then two
processes x 4 fake devices (tests/test_multiprocess.py's helpers) of which one is SIGKILLed."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from test_multiprocess import RUN_TIMEOUT_S, start_processes, stop_all, train_losses, wait_for_training

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
MP_FLAGS = ["--train.steps", str(MP_STEPS), "--train.checkpoint_every", "100", "--train.eval_every", "1000", "--dist.timeout_s", "20"]


def finish(procs, tmp_path):
    try:
        for p in procs:
            p.wait(timeout=RUN_TIMEOUT_S)
    finally:
        stop_all(procs)
    outputs = [(tmp_path / f"p{i}.out").read_text() + (tmp_path / f"p{i}.err").read_text() for i in range(2)]
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"process {i} failed:\n{outputs[i][-4000:]}"
    return outputs


@pytest.mark.slow
def test_two_processes_one_killed_resume_from_the_local_tier_bit_for_bit(tmp_path_factory):
    straight_dir = tmp_path_factory.mktemp("mp_straight")
    finish(start_processes(straight_dir, tmp_path_factory, MP_FLAGS), straight_dir)
    straight = train_losses(straight_dir / "runs" / "two" / "metrics.jsonl")

    tmp_path = tmp_path_factory.mktemp("mp_killed")
    metrics = tmp_path / "runs" / "two" / "metrics.jsonl"
    procs = start_processes(tmp_path, tmp_path_factory, [*MP_FLAGS, *LOCAL])
    try:
        wait_for_training(metrics, procs, min_step=MP_KILL_AFTER)
        procs[1].send_signal(signal.SIGKILL)  # a lost host: no signal, no save
        procs[0].wait(timeout=120)  # the survivor stops on the broken collective (--dist.timeout_s)
    finally:
        stop_all(procs)
    local = tmp_path / "runs" / "two" / "local"
    assert sorted(os.listdir(local / "process_1")) == ["10", "5"], "the kill landed after step 15"
    outputs = finish(start_processes(tmp_path, tmp_path_factory, [*MP_FLAGS, *LOCAL]), tmp_path)
    assert f"resumed from step 10 of the local tier ({local}/process_0/10 on each process" in outputs[0]
    got = train_losses(metrics)
    assert sorted(got) == list(range(1, MP_STEPS + 1))
    assert [got[s] for s in range(11, MP_STEPS + 1)] == [straight[s] for s in range(11, MP_STEPS + 1)]  # bit for bit
