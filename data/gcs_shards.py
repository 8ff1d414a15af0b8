"""Token shards in gs://bucket/prefix (--data.source gs://...): copied on first use into a
size-bounded local cache, verified, retried on transient errors. dataset.py opens it for
a gs:// source; data/tokenize_ray.py and data/upload_gcs.py write through the same client."""

import functools
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from data.shards import MANIFEST, ShardError, open_shard_file, verify_shard_file

log = logging.getLogger(__name__)

# Downloads retry transient errors this many times, waiting GCS_BACKOFF_S * 2**attempt (~30 s in all).
GCS_RETRIES = 6
GCS_BACKOFF_S = float(os.environ.get("MESHFORMER_GCS_BACKOFF_S", "0.5"))  # tests shorten it


def with_retries(action, what: str, transient: tuple, retries: int, backoff_s: float):
    """Run action(); on a transient error wait backoff_s * 2**attempt and try again."""
    for attempt in range(retries + 1):
        try:
            return action()
        except transient as e:
            if attempt == retries:
                raise RuntimeError(f"{what} failed after {retries + 1} tries: {e!r}") from e
            delay = backoff_s * 2**attempt
            log.warning("%s: %r; retrying in %.2fs", what, e, delay)
            time.sleep(delay)


def gcs_transient_errors() -> tuple:
    """Errors worth retrying: overload/5xx answers, dropped or cut-off connections, bad bytes."""
    import requests
    import urllib3
    from google.api_core import exceptions as api
    from google.cloud.storage.exceptions import DataCorruption
    return (api.TooManyRequests, api.InternalServerError, api.BadGateway,
            api.ServiceUnavailable, api.GatewayTimeout, requests.ConnectionError,
            requests.Timeout, requests.exceptions.ChunkedEncodingError, urllib3.exceptions.HTTPError,
            ConnectionError, TimeoutError, DataCorruption, ShardError)


def gcs_client():
    """A google-cloud-storage client (it honours STORAGE_EMULATOR_HOST)."""
    from google.auth.exceptions import DefaultCredentialsError
    from google.cloud import storage
    try:
        return storage.Client()
    except DefaultCredentialsError as e:
        raise RuntimeError(
            "no Google Cloud credentials for gs:// data: run `gcloud auth application-default "
            "login` (or run on a VM with a service account), or set STORAGE_EMULATOR_HOST to "
            "use an emulator") from e


def split_gcs_url(url: str) -> tuple[str, str]:
    """gs://bucket/some/prefix -> ("bucket", "some/prefix")."""
    bucket, _, prefix = url.removeprefix("gs://").partition("/")
    if not bucket:
        raise ValueError(f"{url!r} is not of the form gs://bucket/prefix")
    return bucket, prefix.strip("/")


class GcsShards:
    """Shards in gs://bucket/prefix, copied on first use into a size-bounded local cache.
    Downloads run on one background thread (prefetch overlaps reading; the client never
    leaves it); files enter the cache only once their sha256 matches (temp file + rename,
    safe to share between processes); the least recently opened are evicted."""

    def __init__(self, url: str, cache_dir: str, cache_max_bytes: float):
        from google.api_core.exceptions import NotFound  # imported here: only gs:// needs it
        self.url = url.rstrip("/")
        bucket, self.prefix = split_gcs_url(url)
        self.cache_root = os.path.join(cache_dir, "gcs")
        self.local_dir = os.path.join(self.cache_root, bucket, self.prefix)
        self.cache_max_bytes = cache_max_bytes
        self._bucket = gcs_client().bucket(bucket)
        self._not_found = NotFound
        self._transient = gcs_transient_errors()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gcs-download")
        self._fetches = {}  # file name -> Future of its verified local path

    def _download(self, file_name: str, read):
        """One try at read(blob), with the client's own retries off (ours are clearer)."""
        blob = self._bucket.blob(f"{self.prefix}/{file_name}" if self.prefix else file_name)
        try:
            return read(blob)
        except self._not_found as e:
            raise FileNotFoundError(
                f"{self.url}/{file_name} does not exist. Upload the data directory with "
                f"data/upload_gcs.py DIR {self.url}") from e

    def read_manifest(self) -> str:
        action = functools.partial(self._download, MANIFEST, lambda blob: blob.download_as_bytes(retry=None))
        data = self._pool.submit(with_retries, action, f"download {self.url}/{MANIFEST}",
                                 self._transient, GCS_RETRIES, GCS_BACKOFF_S).result()
        return data.decode("utf-8")

    def _fetch_verified(self, entry: dict) -> str:
        """(background thread) A cached, checksum-verified copy of the shard: its path."""
        path = os.path.join(self.local_dir, entry["file"])
        if os.path.isfile(path):
            try:
                verify_shard_file(path, entry, where=path)
                return path
            except ShardError:
                log.warning("cached %s is corrupt; downloading it again", path)
        os.makedirs(self.local_dir, exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"

        def download_and_verify():
            self._download(entry["file"], lambda blob: blob.download_to_filename(tmp, retry=None))
            verify_shard_file(tmp, entry, where=f"{self.url}/{entry['file']} (downloaded)")

        try:
            with_retries(download_and_verify, f"download {self.url}/{entry['file']}",
                         self._transient, GCS_RETRIES, GCS_BACKOFF_S)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
        os.replace(tmp, path)
        evict_least_recently_used(self.cache_root, self.cache_max_bytes, keep=path)
        return path

    def _fetch(self, entry: dict):
        """The download of this shard: in flight, done, or (if none, or it failed) started now."""
        fetch = self._fetches.get(entry["file"])
        if fetch is None or (fetch.done() and fetch.exception()):
            fetch = self._fetches[entry["file"]] = self._pool.submit(self._fetch_verified, entry)
        return fetch

    def prefetch(self, entry: dict) -> None:
        self._fetch(entry)

    def open(self, entry: dict, dtype: str) -> np.ndarray:
        path = self._fetch(entry).result()
        if not os.path.isfile(path):  # evicted since, by us or another process: fetch again
            del self._fetches[entry["file"]]
            path = self._fetch(entry).result()
        os.utime(path)  # mark as recently used for eviction
        return open_shard_file(path, entry, dtype, where=path)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def evict_least_recently_used(cache_root: str, max_bytes: float, keep: str) -> None:
    """Delete the oldest files under cache_root until it fits in max_bytes (never `keep`);
    another process's memory maps stay readable after deletion (POSIX)."""
    files = []
    for folder, _, names in os.walk(cache_root):
        for name in names:
            if ".tmp" in name:
                continue  # a download in progress, maybe another process's
            path = os.path.join(folder, name)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue  # removed meanwhile by another process
            files.append((st.st_mtime, st.st_size, path))
    total = sum(size for _, size, _ in files)
    for _, size, path in sorted(files):
        if total <= max_bytes:
            break
        if path == keep:
            continue
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        total -= size
