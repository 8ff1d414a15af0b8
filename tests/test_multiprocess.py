"""Several processes on one machine, started by hand with the --dist.* flags (gloo CPU
collectives over 127.0.0.1, 4 fake CPU devices each): two processes train exactly like
one process with all 8 devices, each reads only its own rows of every batch, and a
process that dies (or hangs, or never shows up) stops the others with a clear message
within --dist.timeout_s instead of leaving them waiting forever.

tests/test_launch.py imports the helpers below (the shared flags and the reference run).
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# tiny, shortened to 2 blocks (one per pipeline stage) so that compiling is quick; the
# decay length is fixed so that the compiled step does not depend on --train.steps.
STEPS, BATCH, EVAL_BATCHES = 3, 16, 2
MESH_FLAGS = ["--mesh.dp", "2", "--mesh.pp", "2", "--mesh.tp", "2", "--train.microbatches", "2"]
TRAIN_FLAGS = ["--preset", "tiny", "--model.n_blocks", "2", "--train.decay_steps", "100", *MESH_FLAGS,
               "--train.batch_size", str(BATCH), "--train.eval_batches", str(EVAL_BATCHES), "--log.every", "1",
               "--sample.num_samples", "0", "--log.plots", "false", "--log.progress", "false"]
ROWS = (STEPS + EVAL_BATCHES) * BATCH  # rows of all train and eval batches of a STEPS-step run
RTOL = 1e-5
RUN_TIMEOUT_S = 240  # one run on 2 busy cores, compile included; failing tests stop here


def shared_dir(tmp_path_factory, name):
    """A directory shared by every test module of this pytest session."""
    path = tmp_path_factory.getbasetemp() / name
    path.mkdir(exist_ok=True)
    return path


def run_env(tmp_path_factory):
    """Environment for main.py subprocesses. Programs compiled once are reused from
    main.py's persistent compilation cache (--run.compile_cache), across tests too."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="offline")
    for key in ("XLA_FLAGS", "JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES"):
        env.pop(key, None)
    return env


def data_flags(tmp_path_factory):
    return ["--data.cache_dir", str(shared_dir(tmp_path_factory, "data_cache"))]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_losses(metrics_path):
    """{step: loss} of the train rows of a metrics.jsonl."""
    rows = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def loaded_rows(output):
    """{process: rows} from the 'process I loaded rows: N' lines main.py prints at the end."""
    return {int(p): int(n) for p, n in re.findall(r"process (\d+) loaded rows: (\d+)", output)}


def assert_same_losses(got, want):
    assert sorted(got) == list(range(1, STEPS + 1)), f"steps logged: {sorted(got)}"
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=RTOL), f"step {step}: {got[step]} != {want[step]}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process with 8 devices: {"losses": {step: loss}, "rows": rows it loaded}.
    Computed once per session (tests/test_launch.py compares against it too)."""
    record = shared_dir(tmp_path_factory, "reference") / "reference.json"
    if not record.exists():
        out_dir = record.parent / "runs"
        cmd = [sys.executable, "main.py", *TRAIN_FLAGS, *data_flags(tmp_path_factory), "--train.steps", str(STEPS),
               "--run.cpu_devices", "8", "--run.out_dir", str(out_dir), "--run.name", "one"]
        done = subprocess.run(cmd, cwd=REPO, env=run_env(tmp_path_factory), capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        rows = loaded_rows(done.stdout)
        losses = train_losses(out_dir / "one" / "metrics.jsonl")
        record.write_text(json.dumps({"losses": losses, "rows": rows[0]}))
    saved = json.loads(record.read_text())
    return {"losses": {int(k): v for k, v in saved["losses"].items()}, "rows": saved["rows"]}


# ---- Two processes started by hand


def start_processes(tmp_path, tmp_path_factory, extra_flags, n=2, timeout_s=None, ids=None):
    """Start processes `ids` (default all) of an n-process run; stdout/stderr go to files."""
    port = free_port()
    dist = ["--dist.coordinator", f"127.0.0.1:{port}", "--dist.num_processes", str(n)]
    if timeout_s is not None:
        dist += ["--dist.timeout_s", str(timeout_s)]
    procs = []
    for i in range(n) if ids is None else ids:
        cmd = [sys.executable, "main.py", *TRAIN_FLAGS, *data_flags(tmp_path_factory), "--run.cpu_devices", "4",
               "--run.out_dir", str(tmp_path / "runs"), "--run.name", "two", *dist, "--dist.process_id", str(i),
               *extra_flags]
        out = open(tmp_path / f"p{i}.out", "w")
        err = open(tmp_path / f"p{i}.err", "w")
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=run_env(tmp_path_factory), stdout=out, stderr=err))
    return procs


def stop_all(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def finish_processes(procs, tmp_path):
    """Wait for start_processes's two processes (stopping both on a timeout): each one's
    stdout + stderr, once both exited 0."""
    try:
        for p in procs:
            p.wait(timeout=RUN_TIMEOUT_S)
    finally:
        stop_all(procs)
    outputs = [(tmp_path / f"p{i}.out").read_text() + (tmp_path / f"p{i}.err").read_text() for i in range(2)]
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"process {i} failed:\n{outputs[i][-4000:]}"
    return outputs


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """Two processes x 4 devices, trained to the end: their output files and run dir."""
    tmp_path = tmp_path_factory.mktemp("two_processes")
    outputs = finish_processes(start_processes(tmp_path, tmp_path_factory, ["--train.steps", str(STEPS)]), tmp_path)
    return dict(dir=tmp_path, stdout=[(tmp_path / f"p{i}.out").read_text() for i in range(2)], outputs=outputs)


# In file order, so that no test pays for more than one run (fixtures run on first use).


@pytest.mark.slow
def test_one_process_with_all_devices_reads_every_row(reference):
    """The reference run: it loads every row of every train and eval batch."""
    assert sorted(reference["losses"]) == list(range(1, STEPS + 1))
    assert reference["rows"] == ROWS


@pytest.mark.slow
def test_each_process_reads_only_its_own_rows(two_processes):
    """dp=2 is the outermost mesh axis and each process holds one dp slice of it, so each
    loads exactly half of the rows: its own half of every batch."""
    rows = [loaded_rows(out) for out in two_processes["stdout"]]
    assert rows == [{0: ROWS // 2}, {1: ROWS // 2}]


@pytest.mark.slow
def test_two_processes_train_like_one_process_with_all_devices(two_processes, reference):
    losses = train_losses(two_processes["dir"] / "runs" / "two" / "metrics.jsonl")
    assert_same_losses(losses, reference["losses"])
    # Only process 0 prints progress (every process prints its row count, and errors).
    assert "mesh {" in two_processes["stdout"][0] and "val_loss" in two_processes["stdout"][0]
    assert "mesh {" not in two_processes["stdout"][1] and "val_loss" not in two_processes["stdout"][1]


# ---- A process that dies, hangs, or never comes


def wait_for_training(metrics, procs, min_step=2, timeout_s=RUN_TIMEOUT_S):
    """Block until metrics.jsonl shows step >= min_step (training is under way)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if metrics.exists() and any(step >= min_step for step in train_losses(metrics)):
            return
        for i, p in enumerate(procs):
            if p.poll() is not None:
                output = "".join((metrics.parents[2] / f"p{i}.{kind}").read_text()[-2000:] for kind in ("out", "err"))
                pytest.fail(f"process {i} ended before training got going (status {p.returncode}):\n{output}")
        time.sleep(0.5)
    pytest.fail(f"no step {min_step} in {metrics} after {timeout_s}s")


def survivor_after(procs, victim, how, tmp_path, wait_s):
    """Stop `victim` with signal `how`; return the survivor's (status, seconds, output)."""
    survivor = procs[1 - victim]
    procs[victim].send_signal(how)
    start = time.monotonic()
    try:
        status = survivor.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        status = None
    elapsed = time.monotonic() - start
    i = 1 - victim
    output = (tmp_path / f"p{i}.out").read_text() + (tmp_path / f"p{i}.err").read_text()
    return status, elapsed, output


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0], ids=["worker_killed", "coordinator_killed"])
def test_killed_process_stops_the_other_with_a_clear_message(tmp_path, tmp_path_factory, victim):
    # --dist.timeout_s 10: a survivor blocked in a collective that gloo does not fail may
    # otherwise wait out the default 120 s heartbeat before it learns (~100 s seen)
    procs = start_processes(tmp_path, tmp_path_factory, ["--train.steps", "100000"], timeout_s=10)
    try:
        wait_for_training(tmp_path / "runs" / "two" / "metrics.jsonl", procs)
        status, elapsed, output = survivor_after(procs, victim, signal.SIGKILL, tmp_path, wait_s=130)
    finally:
        stop_all(procs)
    assert status is not None, f"the survivor was still running 130 s after its peer died:\n{output[-3000:]}"
    assert status != 0
    assert elapsed < 120, f"took {elapsed:.0f}s"
    # gloo sees the dead peer's connection close at once (or times out a read it was in the
    # middle of); JAX's own service may get there first when the coordinator is the one that died.
    assert re.search(r"Connection (closed|reset) by peer|Read timeout|another task died", output), output[-3000:]
    if "another task died" not in output:
        assert f"error: process {1 - victim} of 2 stopped" in output, output[-3000:]


@pytest.mark.slow
def test_hung_process_stops_the_other_after_the_timeout(tmp_path, tmp_path_factory):
    """A peer that stops answering (SIGSTOP: its sockets stay open, so no collective
    fails) is caught by JAX's heartbeat, which --dist.timeout_s sets."""
    timeout_s = 10
    procs = start_processes(tmp_path, tmp_path_factory, ["--train.steps", "100000"], timeout_s=timeout_s)
    try:
        wait_for_training(tmp_path / "runs" / "two" / "metrics.jsonl", procs)
        status, elapsed, output = survivor_after(procs, 1, signal.SIGSTOP, tmp_path, wait_s=timeout_s + 60)
    finally:
        procs[1].send_signal(signal.SIGCONT)
        stop_all(procs)
    assert status is not None and status != 0, output[-3000:]
    assert elapsed < timeout_s + 30, f"took {elapsed:.0f}s with --dist.timeout_s {timeout_s}"
    assert "another task died" in output and "stopped sending heartbeats" in output, output[-3000:]


def test_missing_process_gives_up_with_a_clear_message(tmp_path, tmp_path_factory):
    """Process 0 of 2 alone: it waits --dist.timeout_s for process 1, then says why it stops."""
    timeout_s = 5
    (proc,) = start_processes(tmp_path, tmp_path_factory, ["--train.steps", "1"], timeout_s=timeout_s, ids=[0])
    start = time.monotonic()
    try:
        status = proc.wait(timeout=timeout_s + 60)
    finally:
        stop_all([proc])
    elapsed = time.monotonic() - start
    err = (tmp_path / "p0.err").read_text()
    assert status != 0
    assert elapsed < timeout_s + 20, f"took {elapsed:.0f}s"
    assert "not all processes reached the coordinator 127.0.0.1:" in err, err[-2000:]
    assert "--dist.timeout_s" in err


def test_bad_process_id_is_refused():
    done = subprocess.run([sys.executable, "main.py", "--preset", "tiny", "--dist.coordinator", "127.0.0.1:1",
                           "--dist.num_processes", "2", "--dist.process_id", "2"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "--dist.process_id 2 must be in 0..1" in done.stderr
