"""Data loader throughput: tokens/s of TokenData.batch reading from local disk and from gs://.

    python benchmarks/data_loader.py [--batch_size 64] [--seq_len 256] [--epochs 1]

Reads the embedded Shakespeare shards (prepared into a temporary directory) for whole
epochs of global batches. The gs:// figure is measured against a local Cloud Storage
emulator (gcp-storage-emulator) starting from an empty cache, so it includes downloading,
checksumming and caching every shard (the next one prefetched while the current is read).
Tokens counted are training tokens, batch_size x seq_len per step.
Last line: tokens_per_sec_local=... tokens_per_sec_gcs=...
"""

import os
import sys

if __name__ == "__main__" and not __package__:
    # Run as a file: its folder comes first on the path, where the repo's modules do not
    # import. Run it again as the module benchmarks.data_loader, the repo's root on the path.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    os.execve(sys.executable, [sys.executable, "-m", "benchmarks.data_loader", *sys.argv[1:]], {**os.environ, "PYTHONPATH": path})

import argparse
import tempfile
import time

import dataset  # noqa: E402
from data import gcs_emulator, shakespeare, upload_gcs  # noqa: E402

BUCKET = "bench"


def tokens_per_sec(data: dataset.TokenData, steps: int, batch_size: int, seq_len: int) -> float:
    start = time.perf_counter()
    for step in range(steps):
        data.batch("train", step, batch_size, seq_len, seed=0)
    return steps * batch_size * seq_len / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--epochs", type=float, default=1.0, help="how much of the data to read")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        local_dir = os.path.join(tmp, "shakespeare")
        os.makedirs(local_dir)
        shakespeare.prepare(local_dir)
        local = dataset.open_data(local_dir, cache_dir=tmp)
        windows = sum(local.windows_per_shard("train", args.seq_len))
        steps = int(args.epochs * windows / args.batch_size)
        print(f"{steps} steps of {args.batch_size} x {args.seq_len} tokens "
              f"({args.epochs} epoch of {windows} windows)")
        local_rate = tokens_per_sec(local, steps, args.batch_size, args.seq_len)
        print(f"local disk: {local_rate:,.0f} tokens/s")

        with gcs_emulator.running(BUCKET) as host:
            os.environ["STORAGE_EMULATOR_HOST"] = host
            url = f"gs://{BUCKET}/shakespeare"
            upload_gcs.upload_data_dir(local_dir, url)
            remote = dataset.open_data(url, cache_dir=os.path.join(tmp, "cache"))
            gcs_rate = tokens_per_sec(remote, steps, args.batch_size, args.seq_len)
            print(f"gs:// (emulator, cold cache: downloads included): {gcs_rate:,.0f} tokens/s")
            warm_rate = tokens_per_sec(remote, steps, args.batch_size, args.seq_len)
            print(f"gs:// (emulator, warm cache): {warm_rate:,.0f} tokens/s")
            remote.close()

    print(f"tokens_per_sec_local={local_rate:.0f} tokens_per_sec_gcs={gcs_rate:.0f}")


if __name__ == "__main__":
    main()
