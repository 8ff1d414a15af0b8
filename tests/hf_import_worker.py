"""One process of tests/test_hf_import.py's streamed import (not a test itself).

python tests/hf_import_worker.py CKPT OUT.json [--devices 8] [--processes N --process-id I --port P]

Imports the Hugging Face directory CKPT onto a dp2 x pp2 x tp2 mesh (over all processes'
devices; gloo collectives on 127.0.0.1 when N > 1), and writes OUT.json: every read this
process made (tensor, box), the bytes it read, the bytes of the distinct param shards its
own devices hold (what it must read, in the checkpoint's dtype), the checkpoint's total,
and (process 0) every imported param gathered whole, as lists.
"""

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel.mesh import make_mesh, named
from parallel.weights import param_specs
from runtime.devices import use_fake_cpu_devices


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt")
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    use_fake_cpu_devices(args.devices)
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if args.processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{args.port}", args.processes, args.process_id)
    from hf import config as hf_config
    from hf import convert as hf_interop
    from hf.safetensors_reader import DTYPES, Checkpoint
    from model import abstract_params
    from utils import MeshConfig, ModelConfig

    opened = []

    class Recording(Checkpoint):  # the real reader, remembered so that its record can be read after the import
        def __init__(self, path):
            super().__init__(path)
            opened.append(self)

    hf_interop.Checkpoint = Recording
    m = hf_config.from_hf_config(hf_config.read_hf_config(args.ckpt), ModelConfig(seq_len=16))
    mesh = make_mesh(MeshConfig(dp=2, pp=2, tp=2))
    shapes = abstract_params(m)
    shardings = named(mesh, param_specs(shapes, False))
    target = jax.tree.map(lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), shapes, shardings)
    params = hf_interop.HFSource(args.ckpt).load(target, m)
    tensors = opened[-1]
    itemsize = {np.dtype(DTYPES[d]).itemsize for d in tensors.dtypes.values()}.pop()
    owned = 0
    for leaf in jax.tree.leaves(params):
        boxes = {tuple((s.start, s.stop) for s in shard.index) for shard in leaf.addressable_shards}
        owned += sum(math.prod((stop or n) - (start or 0) for (start, stop), n in zip(box, leaf.shape)) for box in boxes)
    record = dict(bytes_read=tensors.bytes_read, owned_bytes=owned * itemsize, reads=tensors.reads,
                  total_bytes=sum(tensors.nbytes(name) for name in tensors.names()), files=sorted(set(tensors.file_of.values())))
    gathered = multihost_utils.process_allgather(params, tiled=True)
    if jax.process_index() == 0:
        record["params"] = {jax.tree_util.keystr(path): np.asarray(x).tolist()
                            for path, x in jax.tree_util.tree_flatten_with_path(gathered)[0]}
    with open(args.out, "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
