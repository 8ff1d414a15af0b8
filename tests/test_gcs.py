"""gs:// data: upload with data/upload_gcs.py to a local Cloud Storage emulator, read back
through the real google-cloud-storage client, and get exactly the local batches - also
when the server fails requests, and with a cache too small to hold the data set."""

import http.client
import http.server
import os
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # import the repo's modules wherever pytest runs from

import dataset  # noqa: E402
from data import (  # noqa: E402
    gcs_emulator,
    gcs_shards,  # noqa: E402
    shakespeare,
    upload_gcs,
)

BUCKET = "meshformer-test"
BATCH, SEQ, SEED = 16, 128, 5
STEPS = range(0, 2400, 150)  # one epoch is ~2170 steps: every train shard, then the next epoch


@pytest.fixture(scope="module")
def emulator():
    with gcs_emulator.running(BUCKET) as host, pytest.MonkeyPatch.context() as env:
        env.setenv("STORAGE_EMULATOR_HOST", host)
        yield host


@pytest.fixture(scope="module")
def local_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shakespeare")
    shakespeare.prepare(str(folder))  # 5 train shards, 1 val shard
    return folder


@pytest.fixture(scope="module")
def uploaded(emulator, local_dir):
    url = f"gs://{BUCKET}/shakespeare"
    assert upload_gcs.upload_data_dir(str(local_dir), url, workers=4) == {"uploaded": 6, "skipped": 0}
    return url


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    monkeypatch.setattr(gcs_shards, "GCS_BACKOFF_S", 0.01)


def read_all(data: dataset.TokenData, rows=None) -> list[np.ndarray]:
    batches = [data.batch("train", step, BATCH, SEQ, SEED, rows) for step in STEPS]
    return batches + list(data.eval_batches(4, BATCH, SEQ, rows))


def assert_same(batches, expected):
    assert len(batches) == len(expected)
    for got, want in zip(batches, expected):
        np.testing.assert_array_equal(got, want)


def test_gcs_batches_equal_local_batches(uploaded, local_dir, tmp_path):
    local = dataset.open_data(str(local_dir), str(tmp_path))
    remote = dataset.open_data(uploaded, str(tmp_path / "cache"))
    assert remote.manifest == local.manifest
    assert_same(read_all(remote), read_all(local))
    half = range(BATCH // 2, BATCH)  # what the second of two processes would read
    assert_same(read_all(remote, half), [b[BATCH // 2:] for b in read_all(local)])
    all_rows = (len(STEPS) + 4) * BATCH
    assert remote.rows_loaded == all_rows + all_rows // 2
    cached = sorted(os.listdir(tmp_path / "cache" / "gcs" / BUCKET / "shakespeare"))
    assert cached == sorted(e["file"] for shards in local.manifest["splits"].values() for e in shards)
    remote.close()


def test_second_upload_skips_what_is_there(uploaded, local_dir):
    assert upload_gcs.upload_data_dir(str(local_dir), uploaded) == {"uploaded": 0, "skipped": 6}


def test_corrupt_local_shard_is_not_uploaded(local_dir, emulator, tmp_path):
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    for path in local_dir.iterdir():
        (corrupt / path.name).write_bytes(path.read_bytes())
    (corrupt / "val_000000.npy").write_bytes((local_dir / "val_000000.npy").read_bytes()[:-10])
    with pytest.raises(dataset.ShardError, match="checksum mismatch for .*val_000000.npy"):
        upload_gcs.upload_data_dir(str(corrupt), f"gs://{BUCKET}/not-uploaded")
    from google.cloud import storage
    assert storage.Client().bucket(BUCKET).get_blob("not-uploaded/manifest.json") is None


def test_next_round_is_downloaded_in_the_background(uploaded, tmp_path, monkeypatch):
    monkeypatch.setattr(dataset, "SHARDS_PER_ROUND", 2)  # 5 train shards: rounds of 2, 2, 1
    dataset._epoch_rounds.cache_clear(), dataset._round_order.cache_clear()
    try:
        data = dataset.open_data(uploaded, str(tmp_path))
        data.batch("train", 0, BATCH, SEQ, SEED)
        counts = data.windows_per_shard("train", SEQ)
        read = {dataset.locate_window(SEED, counts, row)[0] for row in range(BATCH)}
        upcoming = dataset.next_round_shards(SEED, counts, BATCH - 1)
        assert not read & set(upcoming)
        paths = [tmp_path / "gcs" / BUCKET / "shakespeare" / data.manifest["splits"]["train"][s]["file"] for s in upcoming]
        deadline = time.monotonic() + 20
        while not all(p.exists() for p in paths) and time.monotonic() < deadline:  # only the prefetch asks for them
            time.sleep(0.01)
        assert all(p.exists() for p in paths)
        data.close()
    finally:
        dataset._epoch_rounds.cache_clear(), dataset._round_order.cache_clear()


def test_cache_stays_within_its_bound(uploaded, local_dir, tmp_path):
    shard_bytes = (local_dir / "train_000000.npy").stat().st_size
    bound_gb = 2.5 * shard_bytes / 1e9  # room for two of the five 2 MB train shards
    remote = dataset.open_data(uploaded, str(tmp_path), cache_max_gb=bound_gb)
    local = dataset.open_data(str(local_dir), str(tmp_path))
    assert_same(read_all(remote), read_all(local))
    remote.close()
    cache = tmp_path / "gcs"
    assert sum(p.stat().st_size for p in cache.rglob("*") if p.is_file()) <= bound_gb * 1e9


def test_missing_data_in_the_bucket_is_reported(uploaded, local_dir, emulator, tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing-here/manifest.json does not exist.*upload_gcs.py"):
        dataset.open_data(f"gs://{BUCKET}/nothing-here", str(tmp_path))
    # a corrupt object: the manifest's checksum catches it, after retrying the download
    upload_gcs.upload_data_dir(str(local_dir), f"gs://{BUCKET}/corrupt")
    from google.cloud import storage
    blob = storage.Client().bucket(BUCKET).blob("corrupt/val_000000.npy")
    blob.upload_from_string(b"\x93NUMPY" + b"\0" * 100)
    data = dataset.open_data(f"gs://{BUCKET}/corrupt", str(tmp_path))
    with pytest.raises(RuntimeError, match="val_000000.npy failed after 7 tries.*checksum mismatch"):
        list(data.eval_batches(1, BATCH, SEQ))
    data.close()


# ---- A flaky server: a proxy in front of the emulator that fails downloads in turn with a
# 503, a dropped connection, a body cut off half way and a body with one byte flipped,
# then lets one through.

FAULTS = ("503", "drop", "truncate", "flip", None)


class FlakyProxy(http.server.ThreadingHTTPServer):
    def __init__(self, upstream: str):
        super().__init__(("127.0.0.1", 0), FlakyHandler)
        self.upstream = upstream.removeprefix("http://")
        self.downloads = 0
        self.injected = {fault: 0 for fault in FAULTS if fault}
        self.lock = threading.Lock()

    def next_fault(self, path: str):
        if "alt=media" not in path:  # only object downloads fail
            return None
        with self.lock:
            fault = FAULTS[self.downloads % len(FAULTS)]
            self.downloads += 1
            if fault:
                self.injected[fault] += 1
        return fault


class FlakyHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        fault = self.server.next_fault(self.path)
        if fault == "503":
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if fault == "drop":
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        status, headers, body = self.forward()
        self.send_response(status)
        for name, value in headers:
            if name.lower() not in ("transfer-encoding", "connection", "content-length", "date", "server"):
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if fault == "truncate":
            body = body[:len(body) // 2]
        elif fault == "flip":
            body = body[:-1] + bytes([body[-1] ^ 1])
        self.wfile.write(body)

    def forward(self):
        upstream = http.client.HTTPConnection(self.server.upstream, timeout=30)
        upstream.request("GET", self.path, headers={k: v for k, v in self.headers.items() if k.lower() != "host"})
        response = upstream.getresponse()
        body = response.read()
        upstream.close()
        return response.status, response.getheaders(), body

    def log_message(self, *args):
        pass


@pytest.fixture
def flaky_host(emulator, monkeypatch):
    proxy = FlakyProxy(emulator)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{proxy.server_address[1]}")
    yield proxy
    proxy.shutdown()
    proxy.server_close()


def test_reads_survive_a_flaky_server(uploaded, local_dir, flaky_host, tmp_path):
    remote = dataset.open_data(uploaded, str(tmp_path))  # the manifest comes through the proxy too
    local = dataset.open_data(str(local_dir), str(tmp_path))
    assert_same(read_all(remote), read_all(local))
    remote.close()
    # the manifest and 6 shards: each download met every fault once before it went through
    assert flaky_host.injected == {"503": 7, "drop": 7, "truncate": 7, "flip": 7}


# ---- Training end to end from gs:// (the real client, through the flaky proxy)


def train_losses(source: str, out_dir: Path, name: str) -> list[float]:
    import json
    import subprocess

    cmd = [sys.executable, str(REPO / "main.py"), "--preset", "tiny", "--data.source", source,
           "--data.cache_dir", str(out_dir / "cache"), "--run.out_dir", str(out_dir), "--run.name", name,
           "--train.steps", "8", "--train.eval_every", "4", "--log.every", "1", "--log.progress", "false",
           "--log.plots", "false", "--sample.num_samples", "0"]
    env = dict(os.environ, MESHFORMER_GCS_BACKOFF_S="0.01")
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (out_dir / name / "metrics.jsonl").read_text().splitlines()]
    return [r.get("loss", r.get("val_loss")) for r in rows if "loss" in r or "val_loss" in r]  # (not goodput rows)


@pytest.mark.slow
def test_training_from_gcs_equals_training_from_disk(uploaded, local_dir, flaky_host, tmp_path):
    """main.py trains on gs://... through a server that fails every download four times
    (503, dropped connection, truncated body, flipped byte) and gets the losses of the
    same shards read from disk, bit for bit."""
    from_disk = train_losses(str(local_dir), tmp_path, "disk")
    from_gcs = train_losses(uploaded, tmp_path, "gcs")
    assert len(from_disk) == 8 + 2 and from_gcs == from_disk
    assert all(flaky_host.injected[fault] > 0 for fault in ("503", "drop", "truncate", "flip"))
