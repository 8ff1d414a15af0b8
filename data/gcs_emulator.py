"""A local Cloud Storage emulator (the gcp-storage-emulator package) on a free port.

For tests, benchmarks, and trying gs:// sources without a GCP account:

    with gcs_emulator.running(bucket="my-bucket") as host:   # "http://127.0.0.1:PORT"
        os.environ["STORAGE_EMULATOR_HOST"] = host              # google-cloud-storage goes there
"""

import contextlib
import socket
import subprocess
import sys
import time
from typing import Iterator

STARTUP_TIMEOUT_S = 30


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_for_port(host: str, port: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gcp-storage-emulator exited with code {proc.returncode} at startup")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
            return
        time.sleep(0.05)
    raise TimeoutError(f"gcp-storage-emulator did not listen on {host}:{port} within {STARTUP_TIMEOUT_S}s")


@contextlib.contextmanager
def running(bucket: str, host: str = "127.0.0.1") -> Iterator[str]:
    """Run an in-memory emulator holding an empty `bucket`; yield its address; stop it after."""
    port = free_port(host)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", host, "--port", str(port),
         "--in-memory", "--default-bucket", bucket, "--quiet"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(host, port, proc)
        yield f"http://{host}:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
