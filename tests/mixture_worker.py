"""One process of a multi-process mixture read (tests/test_mixture.py): python mixture_worker.py OUT.npy [main.py flags].
Sets up the devices as main.py does, reads this process's rows of steps 0..20, assembles the global batches, gathers them
to every process and saves them to OUT.npy; prints rows_loaded=N (this process's rows)."""

import sys

import numpy as np

from runtime.devices import setup_devices
from utils import parse_args

STEPS = 21


def main(out, argv):
    cfg = parse_args(argv)
    setup_devices(cfg)
    from jax.experimental import multihost_utils

    from data.mixture import open_mixture
    from parallel.mesh import global_batch, make_mesh, process_rows

    mesh = make_mesh(cfg.mesh)
    rows = process_rows(mesh, cfg.train.batch_size)
    data = open_mixture(cfg)
    batches = [multihost_utils.process_allgather(global_batch(mesh, data.batch("train", s, cfg.train.batch_size, cfg.model.seq_len,
                                                                                cfg.run.seed, rows), cfg.train.batch_size), tiled=True)
               for s in range(STEPS)]
    np.save(out, np.stack(batches))
    print(f"rows_loaded={data.rows_loaded}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
