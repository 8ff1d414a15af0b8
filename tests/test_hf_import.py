"""Streamed import of sharded Hugging Face checkpoints (convert.HFSource,
safetensors_reader.py): a checkpoint of several safetensors files and an index is read
tensor by tensor, each process reading only the slices of the shards its devices hold,
into params on any mesh; a damaged or mismatched checkpoint is one line naming the file,
tensor or field, before anything is written.
"""

import builtins
import collections
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf import config as hf_config
from hf import convert as hf_interop
from hf.safetensors_reader import INDEX, Checkpoint  # noqa: E402
from model import abstract_params
from parallel.mesh import make_mesh, named
from parallel.weights import param_specs
from test_hf import hf_made_model, model_cfg  # noqa: E402
from test_multiprocess import free_port  # noqa: E402
from utils import ConfigError, MeshConfig  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARD = "40KB"  # transformers' max_shard_size: the tiny models below come out in 6-10 files
WORKER = os.path.join(REPO, "tests", "hf_import_worker.py")


def sharded(path, **config):
    """A transformers-made DeepseekV3 of 4 MoE layers saved over several files."""
    hf_made_model(path, first_k_dense=0, n_layers=4, max_shard_size=SHARD, **config)
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    assert len(files) >= 3 and os.path.isfile(os.path.join(path, INDEX))
    return path


def mesh_target(m, mesh):
    """The params' shapes with their shardings on `mesh`: what HFSource.load fills."""
    shapes = abstract_params(m)
    shardings = named(mesh, param_specs(shapes, False))
    return jax.tree.map(lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), shapes, shardings)


def whole_state(path):
    """Every tensor of a sharded checkpoint, read whole (the reference: no streaming)."""
    with open(os.path.join(path, INDEX)) as f:
        files = set(json.load(f)["weight_map"].values())
    from safetensors.numpy import load_file

    state = {}
    for file in files:
        state |= load_file(os.path.join(path, file))
    return state


def test_sharded_checkpoint_streams_into_a_2x2x2_mesh_as_the_whole_state_dict_imports(tmp_path):
    path = sharded(str(tmp_path / "hf"))
    m = hf_config.from_hf_config(hf_config.read_hf_config(path), model_cfg("tiny"))
    mesh = make_mesh(MeshConfig(dp=2, pp=2, tp=2))
    params = hf_interop.HFSource(path).load(mesh_target(m, mesh), m)
    expected = dict(jax.tree_util.tree_flatten_with_path(hf_interop.from_hf_state(whole_state(path), m))[0])
    got = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    assert sorted(map(jax.tree_util.keystr, got)) == sorted(map(jax.tree_util.keystr, expected))
    for key, value in expected.items():
        np.testing.assert_array_equal(np.asarray(got[key]), value, err_msg=jax.tree_util.keystr(key))
    # each device holds only its shard: the embedding is split over tp x dp x pp
    embed = params["embed_VD"]
    assert {s.data.shape for s in embed.addressable_shards} == {(embed.shape[0] // 2, embed.shape[1] // 4)}


def test_an_hf_init_from_opens_its_config_index_and_each_file_header_once(tmp_path, monkeypatch):
    """--train.init_from hf:DIR as --mode eval/sample/export_hf/serve load it (runs.
    load_run_params: the model adopted from the directory, then its weights restored):
    config.json, the index and every safetensors file are opened once, not once to adopt
    and again to load, and the params are the whole state dict's."""
    import safetensors

    from serving.modes import load_run_params
    from utils import apply_overrides

    path = sharded(str(tmp_path / "hf"))
    whole = whole_state(path)
    opened = collections.Counter()  # file name in the HF directory -> opens (Python's open, safetensors' header parse)
    real_open, real_safe_open = builtins.open, safetensors.safe_open

    def counted(real):
        def wrapper(file, *args, **kwargs):
            if os.path.dirname(os.path.abspath(file)) == path:
                opened[os.path.basename(file)] += 1
            return real(file, *args, **kwargs)
        return wrapper
    monkeypatch.setattr(builtins, "open", counted(real_open))
    monkeypatch.setattr(safetensors, "safe_open", counted(real_safe_open))
    cfg = apply_overrides(default_cfg(), {"train": {"init_from": f"hf:{path}"}, "run": {"out_dir": str(tmp_path / "runs")}})
    cfg, _, params = load_run_params(cfg)
    monkeypatch.undo()
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    assert opened == collections.Counter(["config.json", INDEX, *files])
    expected = hf_interop.from_hf_state(whole, cfg.model)
    got = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    for key, value in jax.tree_util.tree_flatten_with_path(expected)[0]:
        np.testing.assert_array_equal(np.asarray(got[key]), value, err_msg=jax.tree_util.keystr(key))


def test_reads_are_the_boxes_asked_for_even_across_concatenated_tensors(tmp_path):
    """q_b_proj holds wq_up (K rows per head) and wq_rope (R rows per head): a tp shard
    of wq_up reads only its heads' K rows, one contiguous run per head."""
    path = sharded(str(tmp_path / "hf"))
    m = hf_config.from_hf_config(hf_config.read_hf_config(path), model_cfg("tiny"))
    with Checkpoint(path) as tensors:
        source = hf_interop.import_sources(m, tensors)[("blocks", "layers", 0, "attn", "wq_up_QHK")]
        N, Q, H, K = abstract_params(m)["blocks"]["layers"][0]["attn"]["wq_up_QHK"].shape
        box = (slice(1, 2), slice(0, Q // 2), slice(H // 2, H), slice(0, K))  # block 1, half the latent, the upper heads
        got = source.read(tensors, box, (N, Q, H, K))
        R = m.rope_dim
        assert tensors.reads == [("model.layers.1.self_attn.q_b_proj.weight", ((h * (K + R), h * (K + R) + K), (0, Q // 2)))
                                 for h in range(H // 2, H)]
        assert tensors.bytes_read == (H // 2) * K * (Q // 2) * 4
        whole = tensors.read("model.layers.1.self_attn.q_b_proj.weight").reshape(H, K + R, Q)
    np.testing.assert_array_equal(got[0], whole[H // 2:, :K, :Q // 2].transpose(2, 0, 1))


def rewrite(path, file, change):
    """Rewrite one shard file with change(tensors) applied."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(os.path.join(path, file))
    change(tensors)
    save_file(tensors, os.path.join(path, file), metadata={"format": "pt"})


def file_of(path, name):
    with open(os.path.join(path, INDEX)) as f:
        return json.load(f)["weight_map"][name]


def test_a_damaged_checkpoint_is_one_line_naming_the_file_or_tensor(tmp_path):
    good = sharded(str(tmp_path / "good"))
    name = "model.layers.2.self_attn.kv_b_proj.weight"

    def damaged(tag, damage):
        path = str(tmp_path / tag)
        subprocess.run(["cp", "-r", good, path], check=True)
        damage(path)
        with pytest.raises(ConfigError) as error:
            hf_interop.HFSource(path).adopt(default_cfg())
        assert "\n" not in str(error.value)
        return str(error.value)

    def truncate(path):
        full = os.path.join(path, file_of(path, name))
        with open(full, "r+b") as f:
            f.truncate(os.path.getsize(full) - 100)

    assert file_of(good, name) in damaged("truncated", truncate) and "truncated" in damaged("truncated2", truncate)
    assert name in damaged("dropped", lambda path: rewrite(path, file_of(path, name), lambda t: t.pop(name)))
    assert f"{name} has shape (40, 16)" in damaged("reshaped", lambda path: rewrite(
        path, file_of(path, name), lambda t: t.update({name: np.zeros((40, 16), np.float32)})))

    def reindex(path, change):
        with open(os.path.join(path, INDEX)) as f:
            index = json.load(f)
        change(index["weight_map"])
        with open(os.path.join(path, INDEX), "w") as f:
            json.dump(index, f)

    def unlisted(path):  # gone from the file and the index alike
        rewrite(path, file_of(path, name), lambda t: t.pop(name))
        reindex(path, lambda weight_map: weight_map.pop(name))
    assert f"has no tensor {name}" in damaged("unlisted", unlisted)
    assert file_of(good, name) in damaged("missing", lambda path: os.remove(os.path.join(path, file_of(path, name))))
    extra = "model.layers.2.mlp.extra.weight"

    def added(path):
        rewrite(path, file_of(path, name), lambda t: t.update({extra: np.zeros(3, np.float32)}))
        reindex(path, lambda weight_map: weight_map.update({extra: file_of(path, name)}))
    assert "tensors this model has no place for" in damaged("extra", added)


def default_cfg():
    from utils import PRESETS, Config, apply_overrides

    return apply_overrides(Config(), PRESETS["tiny"])


def test_a_truncated_shard_stops_the_command_line_before_anything_is_written(tmp_path):
    path = sharded(str(tmp_path / "hf"))
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    full = os.path.join(path, file_of(path, name))
    with open(full, "r+b") as f:
        f.truncate(os.path.getsize(full) // 2)
    runs = tmp_path / "runs"
    cmd = [sys.executable, "main.py", "--preset", "tiny", "--train.init_from", f"hf:{path}", "--run.out_dir", str(runs),
           "--run.name", "ft", "--data.cache_dir", str(tmp_path / "data"), "--log.progress", "false"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    error = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(error) == 1 and file_of(path, name) in error[0], done.stderr[-2000:]
    assert not runs.exists() or not any(runs.iterdir())  # no run directory, no config.json, nothing


def run_workers(path, out_dir, processes):
    """hf_import_worker.py as `processes` processes x 8/processes devices: their records."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES")}
    procs = [subprocess.Popen([sys.executable, WORKER, path, str(out_dir / f"p{i}.json"), "--devices", str(8 // processes),
                               "--processes", str(processes), "--process-id", str(i), "--port", str(port)],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(processes)]
    try:
        outputs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, output in zip(procs, outputs):
        assert p.returncode == 0, output[-3000:]
    records = []
    for i in range(processes):
        with open(out_dir / f"p{i}.json") as f:
            records.append(json.load(f))
    return records


@pytest.mark.slow
def test_two_processes_import_the_same_params_as_one_each_reading_only_its_own_slices(tmp_path):
    """2 processes x 4 devices (gloo on 127.0.0.1) against 1 process x 8 devices, on
    dp2 x pp2 x tp2: the same params bit for bit, and each process reads exactly the
    bytes of the distinct shards its own devices hold, which for this model is about
    half the checkpoint (only norm scales and the router biases, replicated, are read by
    both)."""
    path = sharded(str(tmp_path / "hf"))
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = run_workers(path, tmp_path / "one", 1)[0]
    two = run_workers(path, tmp_path / "two", 2)
    assert one["params"].keys() == two[0]["params"].keys()
    for key, value in one["params"].items():
        np.testing.assert_array_equal(np.asarray(two[0]["params"][key]), np.asarray(value), err_msg=key)
    assert one["bytes_read"] == one["owned_bytes"] == one["total_bytes"]  # one process holds every shard: all of it, once
    for record in two:
        assert record["bytes_read"] == record["owned_bytes"]
        assert record["bytes_read"] < 0.55 * record["total_bytes"]
    # the two processes' reads of a split tensor are disjoint boxes
    reads = [{(name, tuple(map(tuple, box))) for name, box in record["reads"]} for record in two]
    shared = {name for name, _ in reads[0] & reads[1]}
    assert shared and all(name.endswith(("layernorm.weight", "norm.weight", "e_score_correction_bias")) for name in shared), shared
