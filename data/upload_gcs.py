"""Upload a data directory (manifest.json + shards) to gs://bucket/prefix.

    python data/upload_gcs.py DIR gs://bucket/prefix [--workers 16]

Shards upload in parallel; each is checked against its manifest checksum first, so a
corrupt shard never reaches the bucket. Objects already there with the same size and MD5
are skipped, so an interrupted upload can simply be rerun. manifest.json goes last, so a
reader never sees a manifest whose shards are not all in place.

Credentials are found as google-cloud-storage finds them (e.g. `gcloud auth
application-default login`, or a VM's service account); STORAGE_EMULATOR_HOST points it at
an emulator instead.
"""

import os
import sys

if __name__ == "__main__" and not __package__:
    # Run as a file: its folder comes first on the path, where the repo's modules do not
    # import. Run it again as the module data.upload_gcs, the repo's root on the path.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    os.execve(sys.executable, [sys.executable, "-m", "data.upload_gcs", *sys.argv[1:]], {**os.environ, "PYTHONPATH": path})

import argparse
import base64
import hashlib
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import dataset  # noqa: E402
from data import gcs_shards, shards  # noqa: E402


def file_md5_base64(path: str) -> str:
    """MD5 as Cloud Storage reports it (base64 of the digest)."""
    digest = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return base64.b64encode(digest.digest()).decode("ascii")


class Uploader:
    """Uploads files under gs://bucket/prefix, one storage client per thread."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.bucket_name, self.prefix = gcs_shards.split_gcs_url(url)
        self._local = threading.local()
        self._transient = gcs_shards.gcs_transient_errors()

    def _bucket(self):
        if not hasattr(self._local, "bucket"):
            self._local.bucket = gcs_shards.gcs_client().bucket(self.bucket_name)
        return self._local.bucket

    def object_name(self, file_name: str) -> str:
        return f"{self.prefix}/{file_name}" if self.prefix else file_name

    def existing(self) -> dict[str, tuple[int, str]]:
        """Object name -> (size, md5) of everything already under the prefix."""
        prefix = f"{self.prefix}/" if self.prefix else ""
        blobs = gcs_shards.gcs_client().list_blobs(self.bucket_name, prefix=prefix)
        return {blob.name: (blob.size, blob.md5_hash) for blob in blobs}

    def upload(self, path: str, file_name: str) -> None:
        blob = self._bucket().blob(self.object_name(file_name))
        gcs_shards.with_retries(lambda: blob.upload_from_filename(path, retry=None),
                             f"upload {path} to {self.url}/{file_name}", self._transient,
                             gcs_shards.GCS_RETRIES, gcs_shards.GCS_BACKOFF_S)


def upload_data_dir(data_dir: str, url: str, workers: int = 16) -> dict[str, int]:
    """Upload the shards (skipping unchanged ones), then the manifest; counts of each outcome."""
    manifest_path = os.path.join(data_dir, dataset.MANIFEST)
    if not os.path.isfile(manifest_path):
        raise FileNotFoundError(f"{manifest_path} is missing: {data_dir} is not a data directory")
    with open(manifest_path) as f:
        manifest = json.load(f)
    dataset.validate_manifest(manifest, where=data_dir)
    uploader = Uploader(url)
    existing = uploader.existing()

    def upload_shard(entry: dict) -> str:
        path = os.path.join(data_dir, entry["file"])
        if not os.path.isfile(path):
            raise shards.ShardError(f"shard {path} listed in the manifest is missing")
        shards.verify_shard_file(path, entry, where=path)
        if existing.get(uploader.object_name(entry["file"])) == (os.path.getsize(path), file_md5_base64(path)):
            return "skipped"
        uploader.upload(path, entry["file"])
        return "uploaded"

    entries = [entry for shards in manifest["splits"].values() for entry in shards]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        outcomes = list(pool.map(upload_shard, entries))
    uploader.upload(manifest_path, dataset.MANIFEST)  # last: the data set is complete from now on
    return {"uploaded": outcomes.count("uploaded"), "skipped": outcomes.count("skipped")}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data_dir", help="local data directory (manifest.json + shards)")
    parser.add_argument("url", help="gs://bucket/prefix")
    parser.add_argument("--workers", type=int, default=16, help="parallel uploads")
    args = parser.parse_args()
    counts = upload_data_dir(args.data_dir, args.url, args.workers)
    print(f"{args.url}: {counts['uploaded']} shards uploaded, {counts['skipped']} already there; "
          "manifest.json uploaded last")


if __name__ == "__main__":
    main()
