"""data/tokenize.py --ray on a real Ray cluster of two nodes (`ray start --head` plus
`ray start --address`) on 127.0.0.1: the same bytes as the process pool, from local files
and from parquet through Hugging Face `datasets`, to a directory and to gs:// (the
emulator); a killed driver resumes, a killed worker node costs nothing; main.py trains on
the result exactly as on the pool's; bad input gets one-line errors.

Loopback only: the whole module runs in a network namespace of its own, holding nothing
but `lo` (Ray listens on every interface otherwise), so not a packet leaves the machine.
That needs root (`unshare -n`); the module is skipped without it.
"""

import ctypes
import hashlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from test_data import write_rank_file
from test_launch import launcher, needs_ssh_and_tmux, repo, sshd, states  # noqa: F401  (fixtures)

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import dataset  # noqa: E402
from data import (  # noqa: E402
    gcs_emulator,
    gcs_shards,  # noqa: E402
    tokenize_ray,
)
from data import tokenize as tokenize_script  # noqa: E402

RAY = str(Path(sys.executable).parent / "ray")
BUCKET = "meshformer-ray-test"
N_DOCS = 8000  # ~3 MB of text, ~2.4M tokens of the tiny BPE
FLAGS = ["--encoding", "tiny_bpe", "--shard_tokens", "40000", "--val_tokens", "100000"]
NODE_FLAGS = ["--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--object-store-memory", str(100 * 2**20),
              "--disable-usage-stats"]
START_TIMEOUT_S = 90
RUN_TIMEOUT_S = 240
CLONE_NEWNET = 0x40000000  # <sched.h>


# ---- A network namespace, a Ray cluster in it, a corpus, and the process pool's shards

@pytest.fixture(scope="module")
def private_network():
    """Move this process (and so everything it starts from now on) into a new network
    namespace with only loopback; move back at the end of the module."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and iproute2 for a private network namespace (unshare -n)")
    libc = ctypes.CDLL(None, use_errno=True)  # os.unshare and os.setns need Python 3.12
    original = os.open("/proc/self/ns/net", os.O_RDONLY)
    if libc.unshare(CLONE_NEWNET) != 0:
        os.close(original)
        pytest.skip(f"unshare(CLONE_NEWNET) failed: {os.strerror(ctypes.get_errno())}")
    try:
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
        assert [line.split(":")[1].strip() for line in links.splitlines()] == ["lo"], links
        yield
    finally:
        assert libc.setns(original, CLONE_NEWNET) == 0, os.strerror(ctypes.get_errno())
        os.close(original)


@pytest.fixture(scope="module")
def ray_env(private_network):
    """Settings every Ray process of this module gets (nodes, drivers): a private auth
    token, no usage reporting, and quick detection of a dead node."""
    temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    token = temp / "auth_token"
    token.write_text(secrets.token_hex(32))
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token), "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        yield temp
    shutil.rmtree(temp, ignore_errors=True)


def kill_session(sid: int) -> None:
    """SIGKILL every process of session `sid`: a node's raylet, its agents and its workers
    (which run in process groups of their own, but stay in the session of `ray start`)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:
            try:
                os.kill(int(stat.parent.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


def session_processes(sid: int) -> list[str]:
    """The command lines (process titles) of session `sid`'s processes."""
    titles = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[3]) == sid:
                titles.append((stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, ValueError):
            continue
    return titles


def wait_for_nodes(address: str, n: int, alive=lambda: True, logs=lambda: "", env=None) -> None:
    """Until the cluster at `address` has n live nodes."""
    script = (f"import ray; ray.init(address={address!r}, logging_level='ERROR'); "
              "print(sum(node['Alive'] for node in ray.nodes()))")
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
        if done.returncode == 0 and done.stdout.split()[-1:] == [str(n)]:
            return
        assert alive(), f"a Ray node exited:\n{logs()}"
        time.sleep(1)
    pytest.fail(f"the cluster at {address} does not have {n} nodes after {START_TIMEOUT_S}s:\n{logs()}")


class Cluster:
    def __init__(self, temp: Path):
        self.temp, self.nodes = temp, []
        self.address = f"127.0.0.1:{gcs_emulator.free_port()}"

    def start_node(self, *flags) -> subprocess.Popen:
        """`ray start --block` in a session of its own, so that it can be killed whole."""
        log = open(self.temp / f"node{len(self.nodes)}.log", "w")
        node = subprocess.Popen([RAY, "start", "--block", *NODE_FLAGS, "--temp-dir", str(self.temp), *flags],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.nodes.append(node)
        return node

    def wait_for_nodes(self, n: int) -> None:
        wait_for_nodes(self.address, n, alive=lambda: all(node.poll() is None for node in self.nodes),
                       logs=self.logs)

    def kill(self, node: subprocess.Popen) -> None:
        kill_session(node.pid)
        node.wait(timeout=30)

    def logs(self) -> str:
        return "\n".join(p.read_text()[-2000:] for p in sorted(self.temp.glob("node*.log")))


@pytest.fixture(scope="module")
def cluster(ray_env):
    """A head node and a second node, each with one CPU; killed at the end of the module,
    also when a test fails."""
    cluster = Cluster(ray_env)
    try:
        port = cluster.address.rsplit(":", 1)[1]
        cluster.start_node("--head", "--port", port, "--include-dashboard", "false")
        cluster.wait_for_nodes(1)
        cluster.start_node("--address", cluster.address)
        cluster.wait_for_nodes(2)
        yield cluster
    finally:
        for node in cluster.nodes:
            cluster.kill(node)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The same documents as two JSONL files and as two parquet files, plus the rank file."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    words = np.array("the king and queen then thou art in an honour none other sound a".split())
    docs = [" ".join(rng.choice(words, rng.integers(5, 120))) + f" #{i}" for i in range(N_DOCS)]
    (root / "jsonl").mkdir()
    (root / "parquet").mkdir()
    for part, chunk in enumerate((docs[:N_DOCS // 2], docs[N_DOCS // 2:])):
        (root / "jsonl" / f"part{part}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in chunk))
        pq.write_table(pa.table({"id": range(len(chunk)), "text": chunk}), root / "parquet" / f"part{part}.parquet",
                       row_group_size=500)
    return {"jsonl": root / "jsonl", "parquet": sorted((root / "parquet").glob("*.parquet")),
            "rank_file": write_rank_file(root / "tiny_bpe.tiktoken"), "docs": docs}


def tokenize_cmd(corpus, out, *args, source="jsonl") -> list[str]:
    inputs = {"jsonl": ["--input", str(corpus["jsonl"])],
              "jsonl x3": ["--input", *[str(corpus["jsonl"])] * 3],  # every document three times
              "parquet": ["--hf_dataset", "parquet", "--hf_data_files", *map(str, corpus["parquet"])]}[source]
    return [sys.executable, str(REPO / "data" / "tokenize.py"), *inputs, "--out", str(out), *FLAGS,
            "--encoding_file", str(corpus["rank_file"]), *args]


def run_tokenize(corpus, out, *args, source="jsonl", check=True, env=None) -> subprocess.CompletedProcess:
    done = subprocess.run(tokenize_cmd(corpus, out, *args, source=source), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, env=env)
    if check:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def pool_out(corpus, tmp_path_factory):
    """The process pool's output (the reference), from the JSONL files and from parquet."""
    root = tmp_path_factory.mktemp("pool")
    run_tokenize(corpus, root / "jsonl", "--workers", "2")
    run_tokenize(corpus, root / "parquet", "--workers", "2", source="parquet")
    return root


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def assert_same_files(got: dict[str, bytes], want: dict[str, bytes]) -> None:
    assert sorted(got) == sorted(want)
    differ = [name for name in want if got[name] != want[name]]
    assert not differ, f"files that differ: {differ}"


def shard_digests(folder: Path) -> dict:
    manifest = json.loads((folder / "manifest.json").read_text())
    return {e["file"]: (e["tokens"], e["start"], e["end"], hashlib.sha256((folder / e["file"]).read_bytes()).hexdigest())
            for shards in manifest["splits"].values() for e in shards}


# ---- Planning shards from document lengths alone (no cluster)

def fresh_progress() -> dict:
    return {"settings": {}, "split": "val", "next_doc": 0, "next_offset": 0,
            "splits": {"val": [], "train": []}, "done": False}


def cut_like_the_pool(lengths, shard_tokens, val_tokens, out: Path) -> dict:
    """The process pool's ShardCutter on documents of these lengths: its shard records."""
    out.mkdir()
    progress = fresh_progress()
    cutter = tokenize_script.ShardCutter(str(out), dataset.get_tokenizer("bytes"), shard_tokens, progress)
    for doc, n in enumerate(lengths):  # tokenize_corpus's loop
        cutter.add(doc, np.full(n, doc % 256, dtype=np.uint32), 0)
        if progress["split"] == "val" and cutter.split_tokens() >= val_tokens:
            cutter.flush(end=(doc + 1, 0), next_split="train")
    cutter.flush(end=(len(lengths), 0))
    return progress["splits"]


def plan(lengths, shard_tokens, val_tokens, batch_size, progress=None) -> list:
    """ShardPlanner's plans for the same documents, handed over in batches of batch_size
    documents; a piece's batch is named by its first document."""
    progress = progress or fresh_progress()
    planner = tokenize_ray.ShardPlanner(progress, shard_tokens, val_tokens)
    plans = []
    for first in range(progress["next_doc"], len(lengths), batch_size):
        offset = progress["next_offset"] if first == progress["next_doc"] else 0
        plans += planner.add_batch(first, first, np.array(lengths[first:first + batch_size]), offset)
    return plans + [planner.finish()]


def records(plans) -> dict:
    got = {"val": [], "train": []}
    for p in plans:
        if p.file:
            tokens = sum(hi - lo for _, lo, hi in p.pieces)
            got[p.split].append({"file": p.file, "tokens": tokens, "start": list(p.start), "end": list(p.end)})
    return got


@pytest.mark.parametrize("exact", [False, True], ids=["random", "exact-boundaries"])
def test_shard_plans_cut_where_the_pool_cuts_whatever_the_batching(tmp_path, exact):
    rng = np.random.default_rng(1)
    lengths = [int(n) for n in rng.integers(1, 700, 300)] + [5000, 3, 2]  # one document longer than a shard
    shard_tokens, val_tokens = 997, 2500
    if exact:  # val ends exactly at val_tokens, and train shards end exactly at documents' ends
        lengths = [500] * 5 + [997] * 3 + lengths
    want = cut_like_the_pool(lengths, shard_tokens, val_tokens, tmp_path / "pool")
    want = {split: [{k: e[k] for k in ("file", "tokens", "start", "end")} for e in shards]
            for split, shards in want.items()}
    assert len(want["val"]) == 3 and len(want["train"]) > 80
    if exact:
        assert want["val"][-1]["end"] == [5, 0] and want["train"][2]["end"] == [8, 0]
    starts = np.concatenate([[0], np.cumsum(lengths)])  # a batch's tokens begin at its first document's
    for batch_size in (1, 7, 256, 400):
        plans = plan(lengths, shard_tokens, val_tokens, batch_size)
        assert records(plans) == want, batch_size
        # the pieces are slices of their batches that cover the token stream once, in order
        stream = np.concatenate([starts[first] + np.arange(lo, hi) for p in plans for first, lo, hi in p.pieces])
        np.testing.assert_array_equal(stream, np.arange(starts[-1]))

    # resumed from a restart point in the middle of a document: the same remaining shards
    whole = plan(lengths, shard_tokens, val_tokens, 16)
    k = next(i for i, p in enumerate(whole) if p.split == "train" and p.end[1] > 0 and i > 10)
    progress = fresh_progress() | {"split": "train", "next_doc": whole[k].end[0], "next_offset": whole[k].end[1]}
    for split, shards in records(whole[:k + 1]).items():
        progress["splits"][split] = shards
    rest = plan(lengths, shard_tokens, val_tokens, 16, progress)
    assert records(rest) == records(whole[k + 1:]) and rest[-1].end == whole[-1].end


# ---- On the cluster

@pytest.mark.slow  # (the cluster takes ~25 s to start: the fast selection keeps the one-line errors)
def test_the_cluster_is_two_nodes_listening_on_loopback_only(cluster):
    listening = subprocess.run(["ss", "-Htuln"], capture_output=True, text=True, check=True).stdout.splitlines()
    addresses = {line.split()[4].rsplit(":", 1)[0] for line in listening}
    assert addresses and addresses <= {"127.0.0.1", "[::ffff:127.0.0.1]", "[::1]", "*", "0.0.0.0", "[::]"}, addresses
    # "*" and 0.0.0.0 are every interface of this namespace: only lo exists here
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert [line.split(":")[1].strip() for line in links.splitlines()] == ["lo"]
    assert len(cluster.nodes) == 2 and all(node.poll() is None for node in cluster.nodes)


@pytest.fixture(scope="module")
def ray_out(cluster, corpus, tmp_path_factory):
    """The JSONL corpus tokenized on the cluster: (data directory, the run's output)."""
    out = tmp_path_factory.mktemp("ray") / "jsonl"
    return out, run_tokenize(corpus, out, "--ray", cluster.address)


@pytest.mark.slow  # (~20 s; the fast selection keeps the one-line errors)
def test_ray_shards_from_files_equal_the_process_pool(cluster, corpus, pool_out, ray_out):
    out, done = ray_out
    assert_same_files(files_of(out), files_of(pool_out / "jsonl"))  # shards, manifest.json, progress.json
    assert "tokens/s; driver peak memory" in done.stdout
    assert "tok/s" in done.stderr and "8000/8000" in done.stderr  # the progress bar: documents of all
    again = run_tokenize(corpus, out, "--ray", cluster.address)  # complete: left as it is
    assert "is already complete" in again.stdout
    assert_same_files(files_of(out), files_of(pool_out / "jsonl"))

    other = run_tokenize(corpus, out, "--ray", cluster.address, "--val_tokens", "5000", check=False)
    assert other.returncode != 0
    assert other.stderr.strip().splitlines() == [
        f"error: {out} holds a run with other settings (differing: val_tokens); rerun with the same "
        "flags, or use a new --out"]


@pytest.fixture(scope="module")
def emulator(private_network):
    with gcs_emulator.running(BUCKET) as host, pytest.MonkeyPatch.context() as env:
        env.setenv("STORAGE_EMULATOR_HOST", host)
        env.setenv("MESHFORMER_GCS_BACKOFF_S", "0.05")
        yield host


def gcs_files(prefix: str) -> dict[str, bytes]:
    blobs = gcs_shards.gcs_client().list_blobs(BUCKET, prefix=f"{prefix}/")
    return {blob.name.removeprefix(f"{prefix}/"): blob.download_as_bytes() for blob in blobs}


@pytest.mark.slow
def test_ray_shards_from_parquet_to_gcs_equal_the_process_pool(cluster, corpus, pool_out, emulator, tmp_path):
    url = f"gs://{BUCKET}/parquet"
    run_tokenize(corpus, url, "--ray", cluster.address, source="parquet")
    assert_same_files(gcs_files("parquet"), files_of(pool_out / "parquet"))
    manifest = json.loads((pool_out / "parquet" / "manifest.json").read_text())
    assert manifest["source"]["hf_data_files"] == list(map(str, corpus["parquet"]))
    # read back as training reads it
    local = dataset.open_data(str(pool_out / "parquet"), str(tmp_path))
    remote = dataset.open_data(url, str(tmp_path / "cache"))
    for step in (0, 7):
        np.testing.assert_array_equal(remote.batch("train", step, 8, 32, seed=1), local.batch("train", step, 8, 32, seed=1))
    remote.close()
    again = run_tokenize(corpus, url, "--ray", cluster.address, source="parquet")
    assert "is already complete" in again.stdout

    # Progress lost (say the bucket was copied without it): the rerun encodes everything
    # again but uploads no shard that is already there, complete.
    bucket = gcs_shards.gcs_client().bucket(BUCKET)
    generations = {blob.name: blob.generation for blob in bucket.list_blobs(prefix="parquet/")}
    for name in ("manifest.json", "progress.json"):
        bucket.blob(f"parquet/{name}").delete()
    run_tokenize(corpus, url, "--ray", cluster.address, source="parquet")
    assert_same_files(gcs_files("parquet"), files_of(pool_out / "parquet"))
    now = {blob.name: blob.generation for blob in bucket.list_blobs(prefix="parquet/")}
    shards = [name for name in generations if name.endswith(".npy")]
    assert len(shards) > 30 and all(now[name] == generations[name] for name in shards)
    assert now["parquet/manifest.json"] != generations["parquet/manifest.json"]


# ---- Bad input: one line each

def test_unreachable_ray_address_is_one_line(corpus, tmp_path, private_network):
    port = gcs_emulator.free_port()
    done = run_tokenize(corpus, tmp_path / "out", "--ray", f"127.0.0.1:{port}", check=False)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        f"error: cannot reach a Ray cluster at --ray 127.0.0.1:{port} ([Errno 111] Connection refused); "
        "start one with ./launcher.sh ... --ray-start, or use --ray local"]


def test_a_dataset_that_cannot_be_loaded_is_one_line(corpus, tmp_path, private_network):
    missing = run_tokenize(corpus, tmp_path / "out", "--ray", "auto", "--hf_data_files", str(tmp_path / "none.parquet"),
                           source="parquet", check=False)
    assert missing.returncode != 0
    assert missing.stderr.strip().splitlines() == [f"error: --hf_data_files {str(tmp_path / 'none.parquet')!r} matches no file"]
    (tmp_path / "bad.parquet").write_text("not parquet")
    corrupt = run_tokenize(corpus, tmp_path / "out", "--ray", "auto", "--hf_data_files", str(tmp_path / "bad.parquet"),
                           source="parquet", check=False)
    assert corrupt.returncode != 0
    assert corrupt.stderr.strip().splitlines() == [
        f"error: could not load 'parquet' from [{str(tmp_path / 'bad.parquet')!r}]: Parquet magic bytes not found "
        "in footer. Either the file is corrupted or this is not a parquet file"]
    offline = subprocess.run(
        [sys.executable, str(REPO / "data" / "tokenize.py"), "--hf_dataset", "no-such-user/no-such-dataset",
         "--encoding", "bytes", "--out", str(tmp_path / "out"), "--ray", "auto"],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, HF_HUB_OFFLINE="1"))  # fail at once
    lines = offline.stderr.strip().splitlines()
    assert offline.returncode != 0 and len(lines) == 1, offline.stderr
    assert lines[0].startswith("error: could not stream 'no-such-user/no-such-dataset' from the Hugging Face hub")
    assert not (tmp_path / "out").exists()


# ---- Faults: a killed driver, a killed worker node

def train_shards_done(out: Path) -> int:
    try:
        return len(json.loads((out / "progress.json").read_text())["splits"]["train"])
    except (OSError, ValueError):  # not there yet
        return 0


@pytest.mark.slow
def test_killed_driver_resumes_to_the_same_shards(cluster, corpus, pool_out, tmp_path):
    out = tmp_path / "ray"
    driver = subprocess.Popen(tokenize_cmd(corpus, out, "--ray", cluster.address), start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while driver.poll() is None and train_shards_done(out) < 3:
            time.sleep(0.005)
    finally:
        os.killpg(driver.pid, signal.SIGKILL)  # the driver only: the nodes are sessions of their own
        driver.wait()
    assert not (out / "manifest.json").exists(), "the run was over before the kill: make the corpus larger"
    assert 3 <= train_shards_done(out) < len(json.loads((pool_out / "jsonl" / "manifest.json").read_text())["splits"]["train"])
    run_tokenize(corpus, out, "--ray", cluster.address)
    assert_same_files(files_of(out), files_of(pool_out / "jsonl"))


@pytest.mark.slow
def test_killed_worker_node_loses_no_shard(cluster, corpus, pool_out, tmp_path):
    """A third node joins, takes tasks, and is SIGKILLed (raylet, workers, objects) while
    it encodes a batch."""
    run_tokenize(corpus, tmp_path / "pool", "--workers", "2", source="jsonl x3")  # a longer run, for time to kill
    extra = cluster.start_node("--address", cluster.address, "--num-cpus", "2")
    try:
        cluster.wait_for_nodes(3)
        # Tasks of 2000 documents (~0.5 s each): the driver needs workers on every node.
        out, log = tmp_path / "ray", tmp_path / "driver.log"
        driver = subprocess.Popen(tokenize_cmd(corpus, out, "--ray", cluster.address, "--docs_per_task", "2000",
                                               source="jsonl x3"),
                                  stdout=open(log, "w"), stderr=subprocess.STDOUT)
        seen = set()
        while driver.poll() is None:
            titles = session_processes(extra.pid)
            seen.update(t.split()[0] for t in titles if t.strip())
            if any(t.startswith("ray::encode_batch") for t in titles):  # killed while it encodes
                break
            time.sleep(0.005)
        assert driver.poll() is None, f"the extra node was never busy while the run went on; it ran {seen}"
        cluster.kill(extra)
        assert driver.wait(timeout=RUN_TIMEOUT_S) == 0, log.read_text()[-3000:]
        assert_same_files(files_of(out), files_of(tmp_path / "pool"))
    finally:
        if extra.poll() is None:
            cluster.kill(extra)


# ---- launcher.sh --ray-start / --ray-stop, over ssh to this machine (inside the namespace)

@pytest.fixture(scope="module")
def loopback_sshd(private_network, request):
    return request.getfixturevalue("sshd")  # started after the move: it listens in the namespace


@pytest.mark.slow
@needs_ssh_and_tmux
def test_launcher_starts_a_ray_cluster_that_tokenizes_like_the_pool(repo, loopback_sshd, ray_env, corpus, pool_out,
                                                                     tmp_path):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("127.0.0.1\nlocalhost 127.0.0.1\n")  # two "hosts": the head and one more node
    remote = tmp_path / "remote"
    temp = Path(tempfile.mkdtemp(prefix="rayl", dir="/tmp"))  # short, for Ray's socket paths
    args = ["--name", "tok", "--remote-dir", str(remote), "--python", sys.executable,
            "--ray-port", str(gcs_emulator.free_port())]
    try:
        started = launcher(repo, loopback_sshd, hosts, *args, "--ray-start", "--", "--num-cpus", "1",
                           "--object-store-memory", str(100 * 2**20), "--temp-dir", str(temp))
        assert started.returncode == 0, started.stdout + started.stderr
        address = started.stdout.split("ray address: ")[1].split()[0]
        assert address == f"127.0.0.1:{args[-1]}"
        token = remote / "ray" / "tok.token"
        assert f"RAY_AUTH_TOKEN_PATH={token} python data/tokenize.py --ray {address}" in started.stderr
        assert oct(token.stat().st_mode & 0o777) == "0o600"
        status = launcher(repo, loopback_sshd, hosts, *args, "--ray-status")
        assert states(status.stdout) == {0: "running", 1: "running"}, status.stdout + status.stderr
        env = dict(os.environ, RAY_AUTH_TOKEN_PATH=str(token))
        wait_for_nodes(address, 2, env=env, logs=lambda: "\n".join(p.read_text()[-2000:] for p in (remote / "logs").glob("*.log")))
        out = tmp_path / "ray"
        run_tokenize(corpus, out, "--ray", address, env=env)
        assert_same_files(files_of(out), files_of(pool_out / "jsonl"))
    finally:
        stopped = launcher(repo, loopback_sshd, hosts, *args, "--ray-stop")
        left = subprocess.run(["pgrep", "-f", str(temp)], capture_output=True, text=True).stdout.split()
        for pid in left:  # the test must not leave a cluster behind, whatever happened
            os.kill(int(pid), signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)
    assert states(stopped.stdout) == {0: "stopped", 1: "stopped"}, stopped.stdout + stopped.stderr
    assert not left, f"Ray processes outlived --ray-stop: {left}"


# ---- Training reads the Ray-made shards as it reads the pool's

TRAIN_FLAGS = ["--preset", "tiny", "--model.n_blocks", "2", "--train.steps", "3", "--train.batch_size", "8",
               "--train.eval_every", "3", "--train.checkpoint_every", "1000", "--log.progress", "false",
               "--log.plots", "false", "--sample.num_samples", "0", "--log.every", "1"]


def train(data_dir: Path, corpus, runs: Path, name: str) -> dict:
    done = subprocess.run([sys.executable, str(REPO / "main.py"), *TRAIN_FLAGS, "--data.source", str(data_dir),
                           "--data.tokenizer", "tiny_bpe", "--data.encoding_file", str(corpus["rank_file"]),
                           "--run.out_dir", str(runs), "--run.name", name],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (runs / name / "metrics.jsonl").read_text().splitlines()]
    return {(r["step"], key): r[key] for r in rows for key in ("loss", "val_loss") if key in r}


@pytest.mark.slow
def test_training_on_ray_shards_equals_training_on_pool_shards(corpus, pool_out, ray_out, tmp_path):
    ray_losses = train(ray_out[0], corpus, tmp_path / "runs", "ray")
    pool_losses = train(pool_out / "jsonl", corpus, tmp_path / "runs", "pool")
    assert sorted(ray_losses) == [(1, "loss"), (2, "loss"), (3, "loss"), (3, "val_loss")]
    assert ray_losses == pool_losses  # exactly: the same tokens in the same batches
