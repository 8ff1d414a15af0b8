"""The launch scripts, for real, over ssh to this machine.

A throwaway sshd listens on 127.0.0.1 (its own config, host key and user key, made
here); launcher.sh starts two processes on two loopback "hosts" in tmux sessions, and
they train exactly like one process with all 8 devices. Also: --status and --stop, a
host that cannot be reached, hosts from a (stubbed) gcloud, debug_tpu.sh's panes,
run.sh's environment, setup_tpu.sh run twice, and shellcheck on all four scripts.

Needs the Debian packages openssh-server, tmux and shellcheck (.ci/run installs them).
"""

import getpass
import importlib.util
import os
import shutil
import site
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_multiprocess import (  # noqa: F401
    REPO,
    ROWS,
    RUN_TIMEOUT_S,
    STEPS,
    TRAIN_FLAGS,
    assert_same_losses,
    data_flags,
    free_port,
    loaded_rows,
    reference,
    shared_dir,
    train_losses,
)

SCRIPTS = ["launcher.sh", "run.sh", "debug_tpu.sh", "setup_tpu.sh"]
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
SECRET = "s3cr3t-do-not-print"

needs_ssh_and_tmux = pytest.mark.skipif(
    not (os.path.exists(SSHD) and shutil.which("tmux") and shutil.which("ssh")),
    reason="needs openssh-server, openssh-client and tmux (apt-get install openssh-server tmux)")


# ---- Fixtures: a snapshot of the working tree as a git repo, and an sshd on 127.0.0.1


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """This working tree, committed into a fresh repo: launcher.sh sends the launching
    checkout's HEAD, and the tests should run the code as it is now. With a .env."""
    root = tmp_path_factory.mktemp("checkout")
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True)
    if listed.returncode == 0:  # tracked and untracked files, not the ignored ones
        for name in filter(None, listed.stdout.decode().split("\0")):
            if (REPO / name).is_file():
                (root / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / name, root / name)
    else:  # not a git checkout
        shutil.copytree(REPO, root, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
            ".git", ".env", "data_cache", "runs", "wandb", "__pycache__", ".pytest_cache"))
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com"]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "snapshot"]):
        subprocess.run(git + cmd, cwd=root, check=True, capture_output=True)
    (root / ".env").write_text(f"# secrets for run.sh\nMESHFORMER_TEST_SECRET={SECRET}\nexport OTHER_SETTING='quoted value'\n")
    return root


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    """sshd on 127.0.0.1:<free port> for the current user, key login only; its sessions
    (and the tmux servers they start) use a private TMUX_TMPDIR and virtualenv."""
    if not (os.path.exists(SSHD) and shutil.which("tmux")):
        pytest.skip("needs openssh-server and tmux")
    d = tmp_path_factory.mktemp("sshd")
    for key in ("host_key", "user_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)], check=True)
    (d / "authorized_keys").write_text((d / "user_key.pub").read_text())
    (d / "user_key").chmod(0o600)
    tmux_dir = d / "tmux"
    tmux_dir.mkdir(mode=0o700)
    port = free_port()
    (d / "sshd_config").write_text(f"""\
Port {port}
ListenAddress 127.0.0.1
HostKey {d}/host_key
PidFile {d}/sshd.pid
AuthorizedKeysFile {d}/authorized_keys
PermitRootLogin prohibit-password
AllowUsers {getpass.getuser()}
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
SetEnv TMUX_TMPDIR={tmux_dir} WANDB_MODE=offline MESHFORMER_VENV={d}/venv MESHFORMER_ACCELERATOR=cpu PIP_NO_INDEX=1
""")
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", exist_ok=True)  # privilege separation directory sshd insists on
    server = subprocess.Popen([SSHD, "-D", "-e", "-f", str(d / "sshd_config")], stdout=subprocess.DEVNULL,
                              stderr=open(d / "sshd.log", "w"))
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert server.poll() is None, f"sshd did not start:\n{(d / 'sshd.log').read_text()}"
            assert time.monotonic() < deadline, "sshd is not listening after 20 s"
            time.sleep(0.2)
    yield dict(port=port, key=d / "user_key", tmux_dir=tmux_dir, dir=d, venv=d / "venv")
    subprocess.run(["tmux", "kill-server"], env=dict(os.environ, TMUX_TMPDIR=str(tmux_dir)), capture_output=True)
    server.terminate()
    server.wait(timeout=10)


def make_venv_seeing_these_packages(venv):
    """A virtualenv at `venv` whose python imports what the interpreter running the tests
    imports. `--system-site-packages` alone is not that when the tests run in a virtualenv:
    the new one would see the base interpreter's site-packages, not this virtualenv's. So a
    .pth file adds this interpreter's site directories too (their own .pth files included)."""
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    purelib = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    lines = [f"import site; site.addsitedir({path!r})\n" for path in site.getsitepackages()]
    (Path(purelib) / "meshformer_tests_parent.pth").write_text("".join(lines))
    where = "import importlib.util; print(importlib.util.find_spec('jax').origin)"
    seen = subprocess.run([str(venv / "bin" / "python"), "-c", where], capture_output=True, text=True, check=True)
    assert seen.stdout.strip() == importlib.util.find_spec("jax").origin, seen.stdout  # the same jax, not another


def ssh_env(sshd):
    env = dict(os.environ, LAUNCHER_SSH_PORT=str(sshd["port"]), LAUNCHER_SSH_KEY=str(sshd["key"]))
    env.pop("TMUX", None)
    return env


SSH_OPTIONS = ["--ssh-option", "StrictHostKeyChecking=no", "--ssh-option", "UserKnownHostsFile=/dev/null",
               "--ssh-option", "LogLevel=ERROR", "--connect-timeout", "5"]


def launcher(repo, sshd, hosts, *args, script="launcher.sh", timeout=120, env=None):
    cmd = ["bash", str(repo / script), "--hosts", str(hosts), *SSH_OPTIONS, *args]
    return subprocess.run(cmd, cwd=repo, env=env or ssh_env(sshd), capture_output=True, text=True, timeout=timeout)


def hosts_file(tmp_path, *hosts):
    path = tmp_path / "hosts.txt"
    path.write_text("# test hosts\n" + "\n".join(hosts) + "\n")
    return path


def states(status_output):
    """{process: state} from launcher.sh --status lines 'HOST (process I): STATE; log: ...'."""
    out = {}
    for line in status_output.splitlines():
        if "(process " in line and "): " in line:
            i = int(line.split("(process ")[1].split(")")[0])
            out[i] = line.split("): ", 1)[1].split("; log:")[0]
    return out


def wait_for_states(repo, sshd, hosts, name, remote, done, timeout_s=RUN_TIMEOUT_S):
    """Poll --status until every process's state satisfies done(state); returns states seen."""
    seen = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = launcher(repo, sshd, hosts, "--name", name, "--remote-dir", str(remote), "--status")
        assert status.returncode == 0, status.stdout + status.stderr
        now = states(status.stdout)
        seen.append(now)
        if now and all(done(s) for s in now.values()):
            return seen
        time.sleep(2)
    pytest.fail(f"states after {timeout_s}s: {seen[-1]}")


# ---- launcher.sh


@pytest.mark.slow
def test_reference_run_for_the_launch(reference):
    """One process with all 8 devices (run once per session; first used here, so that the
    next test pays only for its own run)."""
    assert sorted(reference["losses"]) == list(range(1, STEPS + 1)) and reference["rows"] == ROWS


@pytest.mark.slow
@needs_ssh_and_tmux
def test_launcher_trains_two_hosts_like_one_process(repo, sshd, reference, tmp_path, tmp_path_factory):
    hosts = hosts_file(tmp_path, "127.0.0.1", "localhost")  # two "hosts": processes 0 and 1
    remote, runs = tmp_path / "remote", tmp_path / "runs"
    started = launcher(repo, sshd, hosts, "--name", "pair", "--port", str(free_port()), "--remote-dir", str(remote),
                       "--python", sys.executable, "--", *TRAIN_FLAGS, *data_flags(tmp_path_factory),
                       "--train.steps", str(STEPS), "--run.cpu_devices", "4", "--run.out_dir", str(runs))
    assert started.returncode == 0, started.stdout + started.stderr
    assert "started tmux session pair-p0" in started.stdout and "started tmux session pair-p1" in started.stdout

    seen = wait_for_states(repo, sshd, hosts, "pair", remote, lambda s: s != "running")
    assert seen[0] == {0: "running", 1: "running"}, seen[0]
    assert seen[-1] == {0: "exit 0", 1: "exit 0"}, (seen[-1], (remote / "logs" / "pair-p0.log").read_text()[-3000:])

    assert_same_losses(train_losses(runs / "pair" / "metrics.jsonl"), reference["losses"])
    logs = [(remote / "logs" / f"pair-p{i}.log").read_text() for i in range(2)]
    assert [loaded_rows(log) for log in logs] == [{0: ROWS // 2}, {1: ROWS // 2}]
    # The code ran from a snapshot of this commit; the secrets in .env reached run.sh
    # (it names them) without their values being printed anywhere.
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    assert (remote / "code" / commit / "main.py").is_file()
    assert f"commit {commit}" in logs[0]
    assert "environment from .env: MESHFORMER_TEST_SECRET OTHER_SETTING" in logs[1]
    assert stat.S_IMODE((remote / ".env").stat().st_mode) == 0o600
    assert all(SECRET not in log for log in logs) and SECRET not in started.stdout + started.stderr


@pytest.mark.slow
@needs_ssh_and_tmux
def test_launcher_status_and_stop(repo, sshd, tmp_path, tmp_path_factory):
    hosts = hosts_file(tmp_path, "127.0.0.1", "localhost")
    remote, runs = tmp_path / "remote", tmp_path / "runs"
    args = ["--name", "long", "--port", str(free_port()), "--remote-dir", str(remote), "--python", sys.executable]
    flags = ["--", *TRAIN_FLAGS, *data_flags(tmp_path_factory), "--train.steps", "100000", "--run.cpu_devices", "4",
             "--run.out_dir", str(runs)]
    assert states(launcher(repo, sshd, hosts, *args, "--status").stdout) == {0: "not started", 1: "not started"}
    started = launcher(repo, sshd, hosts, *args, *flags)
    assert started.returncode == 0, started.stdout + started.stderr
    assert states(launcher(repo, sshd, hosts, *args, "--status").stdout) == {0: "running", 1: "running"}

    again = launcher(repo, sshd, hosts, *args, *flags)  # refused, and the running run is left alone
    assert again.returncode != 0 and "already running" in again.stderr, again.stderr
    assert states(launcher(repo, sshd, hosts, *args, "--status").stdout) == {0: "running", 1: "running"}

    time.sleep(3)  # let the processes get going, so that stopping has something to stop
    stopped = launcher(repo, sshd, hosts, *args, "--stop")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert states(stopped.stdout) == {0: "stopped", 1: "stopped"}
    assert states(launcher(repo, sshd, hosts, *args, "--status").stdout) == {0: "stopped", 1: "stopped"}
    deadline = time.monotonic() + 15  # the python processes went with their sessions
    while subprocess.run(["pgrep", "-f", str(runs)], capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, "training processes still alive after --stop"
        time.sleep(0.5)


@needs_ssh_and_tmux
def test_launcher_names_an_unreachable_host_and_starts_nothing(repo, sshd, tmp_path):
    hosts = hosts_file(tmp_path, "127.0.0.1", "no-such-host.invalid")
    remote = tmp_path / "remote"
    done = launcher(repo, sshd, hosts, "--name", "bad", "--remote-dir", str(remote), "--", "--preset", "tiny")
    assert done.returncode != 0
    assert "no-such-host.invalid (process 1): cannot reach it over ssh" in done.stderr, done.stderr
    assert "nothing was started" in done.stderr
    status = launcher(repo, sshd, hosts, "--name", "bad", "--remote-dir", str(remote), "--status")
    assert status.returncode != 0 and "no-such-host.invalid" in status.stderr
    assert states(status.stdout)[0] == "not started"


@needs_ssh_and_tmux
def test_launcher_takes_the_hosts_of_a_tpu_from_gcloud(repo, sshd, tmp_path):
    """--tpu asks `gcloud compute tpus tpu-vm describe` for the workers (stubbed here)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "gcloud_calls"
    (bin_dir / "gcloud").write_text(f"""#!/usr/bin/env bash
echo "$*" >> {calls}
case "$*" in
  *"describe my-tpu --zone us-central2-b"*"networkEndpoints[].ipAddress"*) echo "127.0.0.1;127.0.0.1" ;;
  *externalIp*) echo "" ;;
  *) echo "unexpected: $*" >&2; exit 1 ;;
esac
""")
    (bin_dir / "gcloud").chmod(0o755)
    env = dict(ssh_env(sshd), PATH=f"{bin_dir}:{os.environ['PATH']}")
    cmd = ["bash", str(repo / "launcher.sh"), "--tpu", "my-tpu", "--zone", "us-central2-b", "--ssh-user", getpass.getuser(),
           *SSH_OPTIONS, "--name", "tpu", "--remote-dir", str(tmp_path / "remote"), "--status"]
    done = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert states(done.stdout) == {0: "not started", 1: "not started"}
    assert "tpus tpu-vm describe my-tpu --zone us-central2-b" in calls.read_text()


@pytest.mark.slow  # pip checks every pinned requirement: 10-20 s
@needs_ssh_and_tmux
def test_launcher_setup_runs_setup_on_every_host(repo, sshd, tmp_path):
    """--setup runs setup_tpu.sh on each host; the hosts' virtualenv (from the sshd's
    environment) sees this interpreter's packages, so nothing is downloaded."""
    make_venv_seeing_these_packages(sshd["venv"])
    hosts = hosts_file(tmp_path, "127.0.0.1", "localhost")
    done = launcher(repo, sshd, hosts, "--remote-dir", str(tmp_path / "remote"), "--setup", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    for i, host in enumerate(["127.0.0.1", "localhost"]):
        mine = [line for line in lines if line.startswith(f"{host} (process {i}): setup_tpu: ")]
        assert any("accelerator: cpu" in line for line in mine), done.stdout
        assert any("done: jax" in line or "nothing to do" in line for line in mine), done.stdout


# ---- debug_tpu.sh


def local_tmux(tmp_path, *args):
    env = dict(os.environ, TMUX_TMPDIR=str(tmp_path))
    env.pop("TMUX", None)
    return subprocess.run(["tmux", *args], env=env, capture_output=True, text=True)


@needs_ssh_and_tmux
def test_debug_session_has_a_pane_per_host_in_both_windows(repo, sshd, tmp_path):
    hosts = hosts_file(tmp_path, "127.0.0.1", "localhost", "127.0.0.1")  # any number: three
    local = tmp_path / "local_tmux"
    local.mkdir(mode=0o700)
    env = dict(ssh_env(sshd), TMUX_TMPDIR=str(local))
    try:
        done = launcher(repo, sshd, hosts, "--name", "dbg", "--remote-dir", str(tmp_path / "remote"), "--detach",
                        "--cmd", 'echo "marker $PROCESS_ID of $NUM_PROCESSES via $COORDINATOR"',
                        script="debug_tpu.sh", env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        for window in ("run", "monitor"):
            panes = local_tmux(local, "list-panes", "-t", f"debug-dbg:{window}", "-F", "#{pane_id} #{pane_title}")
            lines = panes.stdout.splitlines()
            assert [line.split(" ", 1)[1] for line in lines] == [
                "127.0.0.1 (process 0)", "localhost (process 1)", "127.0.0.1 (process 2)"], panes.stdout + panes.stderr
        sync = local_tmux(local, "show-options", "-w", "-t", "debug-dbg:run", "-v", "synchronize-panes")
        assert sync.stdout.strip() == "on"
        run_panes = local_tmux(local, "list-panes", "-t", "debug-dbg:run", "-F", "#{pane_id}").stdout.split()
        deadline = time.monotonic() + 30
        for i, pane in enumerate(run_panes):
            want = f"marker {i} of 3 via 127.0.0.1:8476"
            while want not in (text := local_tmux(local, "capture-pane", "-p", "-S", "-", "-t", pane).stdout):
                assert time.monotonic() < deadline, f"pane {i} shows:\n{text}"
                time.sleep(0.5)
        monitor = local_tmux(local, "list-panes", "-t", "debug-dbg:monitor", "-F", "#{pane_id}").stdout.split()[0]
        deadline = time.monotonic() + 30  # no TPU or GPU here, so the monitor is top
        while "load average" not in (text := local_tmux(local, "capture-pane", "-p", "-t", monitor).stdout):
            assert time.monotonic() < deadline, f"monitor pane shows:\n{text}"
            time.sleep(0.5)
    finally:
        local_tmux(local, "kill-server")


@needs_ssh_and_tmux
def test_debug_session_runs_run_sh_by_default(repo, sshd, tmp_path):
    """Without --cmd each pane runs what launcher.sh would start (here main.py --help)."""
    hosts = hosts_file(tmp_path, "127.0.0.1", "localhost")
    local = tmp_path / "local_tmux"
    local.mkdir(mode=0o700)
    env = dict(ssh_env(sshd), TMUX_TMPDIR=str(local))
    try:
        done = launcher(repo, sshd, hosts, "--name", "dbg2", "--remote-dir", str(tmp_path / "remote"), "--detach",
                        "--python", sys.executable, "--", "--help", script="debug_tpu.sh", env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        panes = local_tmux(local, "list-panes", "-t", "debug-dbg2:run", "-F", "#{pane_id}").stdout.split()
        assert len(panes) == 2
        deadline = time.monotonic() + 60
        for i, pane in enumerate(panes):
            while "--dist.process_id" not in (text := local_tmux(local, "capture-pane", "-p", "-S", "-", "-t", pane).stdout):
                assert time.monotonic() < deadline, f"pane {i} shows:\n{text}"
                time.sleep(0.5)
            assert f"process {i} of 2, coordinator 127.0.0.1:8476" in text
    finally:
        local_tmux(local, "kill-server")


# ---- run.sh, setup_tpu.sh, and the scripts themselves


def test_run_sh_exports_env_secrets_silently_and_passes_the_process_place(tmp_path):
    fake_python = tmp_path / "python"
    fake_python.write_text('#!/usr/bin/env bash\necho "secret=$MESHFORMER_TEST_SECRET other=$OTHER_SETTING"\n'
                           'printf "arg:%s\\n" "$@"\n')
    fake_python.chmod(0o755)
    env_file = tmp_path / "secrets.env"
    env_file.write_text(f"MESHFORMER_TEST_SECRET={SECRET}\nexport OTHER_SETTING=\"a b\"\nnot a setting {SECRET}\n")
    env = dict(os.environ, PYTHON=str(fake_python), MESHFORMER_ENV_FILE=str(env_file))
    done = subprocess.run(["bash", str(REPO / "run.sh"), "--coordinator", "10.0.0.1:8476", "--num-processes", "4",
                           "--process-id", "3", "--", "--preset", "tiny"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert f"secret={SECRET} other=a b" in done.stdout  # exported to main.py...
    assert SECRET not in done.stderr  # ...but never printed by run.sh, not even from a bad line
    assert "line 3 is not KEY=value; skipped" in done.stderr
    args = [line[4:] for line in done.stdout.splitlines() if line.startswith("arg:")]
    assert args == [str(REPO / "main.py"), "--dist.coordinator", "10.0.0.1:8476", "--dist.num_processes", "4",
                    "--dist.process_id", "3", "--preset", "tiny"]
    one = subprocess.run(["bash", str(REPO / "run.sh"), "--preset", "tiny"], env=env, capture_output=True, text=True)
    assert [line[4:] for line in one.stdout.splitlines() if line.startswith("arg:")][1:] == ["--preset", "tiny"]
    bad = subprocess.run(["bash", str(REPO / "run.sh"), "--num-processes", "2", "--process-id", "2"], env=env,
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "--process-id must be in 0..1" in bad.stderr


@pytest.mark.slow  # pip checks every pinned requirement: 10-20 s
def test_setup_is_idempotent(tmp_path):
    """Into a virtualenv that sees this interpreter's packages, so that nothing is
    downloaded: the first run installs (all satisfied), the second does nothing."""
    venv = tmp_path / "venv"
    make_venv_seeing_these_packages(venv)
    env = dict(os.environ, MESHFORMER_VENV=str(venv), MESHFORMER_ACCELERATOR="cpu", PIP_NO_INDEX="1")
    check = subprocess.run(["bash", str(REPO / "setup_tpu.sh"), "--check"], env=env, capture_output=True, text=True)
    assert check.returncode == 0 and "would run: pip install -r requirements.txt" in check.stdout, check.stdout
    first = subprocess.run(["bash", str(REPO / "setup_tpu.sh")], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "done: jax" in first.stdout
    second = subprocess.run(["bash", str(REPO / "setup_tpu.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert second.returncode == 0 and "nothing to do" in second.stdout, second.stdout + second.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_parses_and_passes_shellcheck(script):
    assert subprocess.run(["bash", "-n", str(REPO / script)], capture_output=True).returncode == 0
    if not shutil.which("shellcheck"):
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    done = subprocess.run(["shellcheck", "-x", script], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_help(script):
    done = subprocess.run(["bash", str(REPO / script), "--help"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) > 5 and "#" not in done.stdout.splitlines()[0]
