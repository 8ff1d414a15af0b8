"""A Hugging Face checkpoint read tensor by tensor, slice by slice (safetensors files).

A real checkpoint is one `model.safetensors` or, past a few GB, several files and a
`model.safetensors.index.json` that says which file holds each tensor (a 16B model is
32 GB in bfloat16, DeepSeek-V3 ~700 GB). Like transformers and vLLM, nothing here reads a
whole file: `safe_open` memory-maps it and `get_slice(name)[box]` copies out only the
rows and columns asked for, so each process reads only the slices its devices hold
(convert.HFSource.load asks per shard). Every read is recorded (`reads`,
`bytes_read`): the tests check that a process reads only what it owns.

Opening checks every file's header against the index (a file that is missing, truncated
or names other tensors is a one-line ConfigError naming it) before a byte of weights is
read, so a damaged download fails before anything is built or written.
"""

import json
import math
import os

import ml_dtypes
import numpy as np

from utils import ConfigError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# safetensors dtype names -> numpy; weights are read into float32 (the params' dtype).
DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64,
          "F8_E4M3": ml_dtypes.float8_e4m3fn}


class Checkpoint:
    """The tensors of an HF directory: names, shapes and dtypes from the file headers,
    values read on demand by box (`read`)."""

    def __init__(self, path):
        from safetensors import safe_open

        self.path = path
        index = checkpoint_files(path)  # tensor name -> file name; None: one model.safetensors
        self.file_of, self.shapes, self.dtypes, self._handles = {}, {}, {}, {}
        self.reads, self.bytes_read = [], 0
        for file in sorted(set(index.values())) if index else [SINGLE]:
            full = os.path.join(path, file)
            if not os.path.isfile(full):
                raise ConfigError(f"hf:{path}: {file} is missing (its index names it): download it again")
            try:
                handle = safe_open(full, framework="numpy")
            except Exception as error:  # SafetensorError: a truncated file fails its header's size check
                raise ConfigError(f"hf:{path}: {file} is not a readable safetensors file ({str(error).splitlines()[0]}): "
                                  "truncated or damaged? download it again") from None
            self._handles[file] = handle
            names = set(handle.keys())
            listed = {name for name, f in index.items() if f == file} if index else names
            if not listed <= names:
                raise ConfigError(f"hf:{path}: {file} lacks {sorted(listed - names)[0]}, which {INDEX} places there: "
                                  "the files are from different downloads?")
            for name in listed:
                piece = handle.get_slice(name)
                self.shapes[name], self.dtypes[name] = tuple(piece.get_shape()), piece.get_dtype()
                self.file_of[name] = file
        unknown = {name: dtype for name, dtype in self.dtypes.items() if dtype not in DTYPES}
        if unknown:
            name = sorted(unknown)[0]
            raise ConfigError(f"hf:{path}: tensor {name} is {unknown[name]}; this importer reads {', '.join(DTYPES)}")

    def __contains__(self, name):
        return name in self.shapes

    def names(self):
        return list(self.shapes)

    def nbytes(self, name):
        return math.prod(self.shapes[name]) * np.dtype(DTYPES[self.dtypes[name]]).itemsize

    def read(self, name, box=None):
        """Tensor `name`, only the elements in `box` (a tuple of slices, step 1), as float32."""
        box = tuple(slice(None) for _ in self.shapes[name]) if box is None else box
        values = np.asarray(self._handles[self.file_of[name]].get_slice(name)[box])
        self.reads.append((name, tuple((s.indices(n)[0], s.indices(n)[1]) for s, n in zip(box, self.shapes[name]))))
        self.bytes_read += values.nbytes
        return values.astype(np.float32)

    def close(self):
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def checkpoint_files(path):
    """{tensor: file} from the index, or None for a single model.safetensors (its header
    lists the tensors). A directory with neither is an error naming what is missing."""
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (ValueError, KeyError) as error:
            raise ConfigError(f"hf:{path}: {INDEX} is not a safetensors index ({error}): download it again") from None
        return dict(weight_map)
    if os.path.isfile(os.path.join(path, SINGLE)):
        return None
    raise ConfigError(f"hf:{path} has no {SINGLE} (or {INDEX})")
