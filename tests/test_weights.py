"""The weight table (parallel/weights.py): every parameter of the model has a row and every row a
parameter, each row fits its weight's shape, the README's copy is the table, and a
weight with no row is an error that names parallel/weights.py. Shapes only (nnx.eval_shape)."""

import glob
import os

import jax
import pytest
from flax import nnx

from model import Transformer
from parallel import optimizers
from parallel.weights import EXPERT, FSDP, WEIGHTS, is_stacked, markdown_table, shape_letters, weight_layout, weight_name
from utils import CP, DP, PP, PRESETS, TP, Config, apply_overrides

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESET_NAMES = ("shakespeare", "tiny", "deepseek_v3", "moe1b")  # shakespeare: the default
# Options no preset turns on yet, with the weights they add: an untied head, full-rank queries.
OPTIONS = {"deepseek_v3 untied full-rank-q": ("deepseek_v3", dict(tie_embeddings=False, q_latent=0))}


@pytest.fixture(scope="module")
def preset_params():
    """{preset: [(path, ShapeDtypeStruct)]} of every parameter of each preset's model
    (and of OPTIONS' models)."""
    out = {}
    configs = {preset: (preset, {}) for preset in PRESET_NAMES} | OPTIONS
    for name, (preset, model_overrides) in configs.items():
        model_cfg = apply_overrides(apply_overrides(Config(), PRESETS[preset]), {"model": model_overrides}).model
        shapes = nnx.state(nnx.eval_shape(lambda: Transformer(model_cfg, nnx.Rngs(0)))).to_pure_dict()
        out[name] = jax.tree_util.tree_flatten_with_path(shapes)[0]
    return out


def test_every_parameter_has_a_row_and_every_row_a_parameter(preset_params):
    names = {preset: {weight_name(path) for path, _ in leaves} for preset, leaves in preset_params.items()}
    for preset, used in names.items():
        no_row = sorted(used - WEIGHTS.keys())
        assert not no_row, f"{preset}: parameters {no_row} have no row in WEIGHTS"
    no_parameter = sorted(WEIGHTS.keys() - set().union(*names.values()))
    assert not no_parameter, f"rows {no_parameter} are no parameter of the presets {PRESET_NAMES} or {list(OPTIONS)}"


def test_every_row_fits_its_weights_shape(preset_params):
    for leaves in preset_params.values():
        for path, leaf in leaves:
            name = weight_name(path)
            assert leaf.ndim == len(shape_letters(name)) + is_stacked(path), jax.tree_util.keystr(path)
    for name, w in WEIGHTS.items():
        letters = shape_letters(name)
        assert len(w.dims) == len(letters), name
        assert set(w.dims) <= {None, TP, EXPERT, FSDP} and w.dims.count(FSDP) <= 1, name
        assert w.routed == (w.dims[0] == EXPERT) == (letters[0] == "E" and len(letters) > 1), name
        if w.muon or w.fan_in is not None:  # a matmul's weight: batch dims, >= 1 fan-in and >= 1 fan-out dims
            batch, fan_in = w.muon_dims
            assert fan_in is not None and fan_in >= 1 and batch + fan_in < len(letters), name
        assert w.trained or not w.muon, name
    # Weights in one HF tensor are laid out alike; the routed experts' names say where the expert goes.
    for name, w in WEIGHTS.items():
        if w.hf is not None:
            assert ("{e}" in w.hf.name) == w.routed == (w.hf.fused is not None), name
            for other, v in WEIGHTS.items():
                if v.hf is not None and v.hf.name == w.hf.name:
                    assert (v.fan_in, v.routed) == (w.fan_in, w.routed), (name, other)


def test_readme_holds_the_table():
    """The README's sharding table is markdown_table() (`python -m parallel.weights`
    prints it), so it cannot drift from the table the code reads. (It may move to docs/.)"""
    table = "\n\n" + markdown_table() + "\n"  # the whole table: a blank line before and after
    places = [p for p in [os.path.join(REPO, "README.md"), *sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))]
              if table in open(p).read()]
    assert len(places) == 1, f"README.md (or one docs/*.md) should hold `python -m parallel.weights`'s table, exactly; found in {places}"


def test_a_weight_with_no_row_is_an_error_naming_weights_py():
    path = (jax.tree_util.DictKey("blocks"), jax.tree_util.DictKey("w_new_DX"))
    for read in (lambda: weight_layout("w_new_DX", True, False), lambda: optimizers.is_matrix(path),
                 lambda: optimizers.matrix_dims(path, 3)):
        with pytest.raises(KeyError, match="w_new_DX.*add one to parallel/weights.py"):
            read()


def test_readers_read_the_table():
    """parallel's layout and Muon's matrix dims are the rows' (a few rows, by hand)."""
    assert weight_layout("wq_up_QHK", True, False)[0] == (PP, (DP, CP), TP, None)  # stored over dp x cp
    assert weight_layout("w_gate_EDF", False, True)[0] == (DP, (CP, PP), TP)
    stacked = (jax.tree_util.DictKey("blocks"), jax.tree_util.DictKey("wo_HKD"))
    assert optimizers.matrix_dims(stacked, 4) == ((0,), (1, 2), (3,))
    expert = (jax.tree_util.DictKey("w_down_EFD"),)
    assert optimizers.matrix_dims(expert, 3) == ((0,), (1,), (2,))
    assert not optimizers.is_matrix((jax.tree_util.DictKey("router_DE"),))
