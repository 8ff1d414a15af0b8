"""Hugging Face interop (hf/convert.py), checked against transformers itself (torch, CPU).

Exports are compared with our dropless forward: transformers never drops tokens.
"""

import copy
import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
# One thread: on a CPU shared with other work, torch's thread pool spins. 40 greedy
# tokens of the tiny model took 7.3 s with the default threads here, 0.6 s with one.
torch.set_num_threads(1)

from dataset import get_tokenizer  # noqa: E402
from hf import config as hf_config  # noqa: E402
from hf import convert as hf_interop  # noqa: E402
from hf import tokenizer as hf_tokenizer  # noqa: E402
from model import Transformer  # noqa: E402
from parallel.mesh import check_config_fits_mesh, global_batch, make_mesh  # noqa: E402
from parallel.steps import make_eval_step  # noqa: E402
from parallel.weights import init_params  # noqa: E402
from runtime import checkpoint, sampling  # noqa: E402
from utils import PRESETS, Config, ConfigError, apply_overrides  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BYTES = get_tokenizer("bytes")
GREEDY_TOKENS = 40


def model_cfg(preset, **overrides):
    """A preset's model in float32, dropless, for the byte tokenizer, fields replaced."""
    m = apply_overrides(Config(), PRESETS[preset]).model
    return dataclasses.replace(m, vocab_size=BYTES.vocab_size, dtype="float32", dropout=0.0, capacity_factor=0.0, **overrides)


def random_model(m, seed=0):
    """(model, host params): weights drawn in numpy at our init's scales (no compile:
    jitting the init took 11-16 s here), with every norm scale drawn around 1 (an init
    of ones would hide a norm mapped to the wrong place), a smaller embedding and larger
    residual-branch outputs, so that the layers, not the input token's own embedding,
    decide the next token and the greedy continuation varies."""
    abstract = nnx.eval_shape(lambda: Transformer(m, nnx.Rngs(seed)))
    graphdef, shapes = nnx.split(abstract)
    rng = np.random.default_rng(seed)
    n_layers = m.n_blocks * len(m.block_pattern)

    def draw(path, x):
        name = jax.tree_util.keystr(path)
        if "scale_D" in name:
            return (1 + 0.3 * rng.standard_normal(x.shape)).astype(np.float32)
        if "router_bias_E" in name:  # a trained selection bias: it moves which experts win, never the gates
            return (0.05 * rng.standard_normal(x.shape)).astype(np.float32)
        letters = name.split("_")[-1].strip("']")
        dims = dict(zip(letters, x.shape[-len(letters):]))
        std = 1 / np.sqrt(np.prod([dims[a] for a in FAN_IN[letters]]))
        if "embed_VD" in name:
            std *= 0.3
        if "wo_HKD" in name or "w_down" in name:  # our init's 1/sqrt(2 layers), times the gain
            std *= RESIDUAL_OUT_GAIN / np.sqrt(2 * n_layers)
        return (std * rng.standard_normal(x.shape)).astype(np.float32)

    host = jax.tree_util.tree_map_with_path(draw, shapes.to_pure_dict())
    return nnx.merge(graphdef, jax.tree.map(jnp.asarray, host)), host


FAN_IN = {  # weight name suffix -> its input axes (model.init_normal's fan_in)
    "DQ": "D", "QHK": "Q", "QHR": "Q", "DA": "D", "DR": "D", "AHK": "A", "HKD": "HK",
    "DF": "D", "FD": "F", "DE": "D", "EDF": "D", "EFD": "F", "VD": "D", "DD": "D", "DHK": "D", "DHR": "D"}


def random_host(m, seed=0):
    """Host params of model `m` drawn in numpy from its shapes alone (no compile): for
    the tests that only move weights around."""
    shapes = nnx.split(nnx.eval_shape(lambda: Transformer(m, nnx.Rngs(0))))[1].to_pure_dict()
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32), shapes)


RESIDUAL_OUT_GAIN = 8.0  # measured: at 2 and 4 a random tiny model repeats one token after a few


def our_logits(model, tokens_BT):
    graphdef, state = nnx.split(model)
    return np.asarray(jax.jit(lambda state, t: nnx.merge(graphdef, state)(t)[0])(state, jnp.asarray(tokens_BT)))


def load_hf(path):
    """The directory loaded by transformers' AutoModelForCausalLM: with its built-in
    classes (deepseek_v3, deepseek_v2: no auto_map, no code in the directory), or with
    the modeling_meshformer.py the export wrote (meshformer), which only
    trust_remote_code=True runs; without it transformers refuses the directory rather
    than compute another model from its weights."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    remote = config["model_type"] == "meshformer"
    assert ("auto_map" in config) == remote and os.path.isfile(os.path.join(path, "modeling_meshformer.py")) == remote
    if remote:
        with pytest.raises(ValueError, match="trust_remote_code"):
            transformers.AutoModelForCausalLM.from_pretrained(path)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, trust_remote_code=remote).eval()


def our_greedy(model, prompt, n):
    """n greedy tokens from our latent-KV-cache decoder (padding ids never chosen): the
    sampler of --mode sample and the server, at temperature 0."""
    return sampling.generate_ids(model, list(prompt), n, temperature=0.0, top_k=0, seed=0)


def hf_greedy(hf, prompt, n):
    config = copy.deepcopy(hf.generation_config)
    config.max_new_tokens, config.do_sample = n, False
    # Ours does not stop at end-of-text either. (A None in the config passed to generate
    # is filled in from the model's own generation_config, so it is cleared there.)
    hf.generation_config.eos_token_id = config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), generation_config=config)
    return out[0, len(prompt):].tolist()


def safetensors_of(path):
    from safetensors.numpy import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def bits(a):
    return np.asarray(a).view(np.uint16 if np.asarray(a).dtype == ml_dtypes.bfloat16 else np.uint32)


# ---- Export: transformers computes what we compute


EXPORT_CASES = {  # id: (preset, overrides, expected model_type)
    "tiny-sigmoid-moe": ("tiny", dict(seq_len=64), "deepseek_v3"),
    # the default run's layout and router (blocks DM x 2, softmax top-2) at the tiny widths
    "tiny-default-layout": ("tiny", dict(seq_len=64, router_score="softmax", n_blocks=2, block_pattern="DM"), "meshformer"),
    "tiny-softmax-dense-first": ("tiny", dict(seq_len=64, router_score="softmax", n_blocks=1, block_pattern="DDMM"), "meshformer"),
    "tiny-softmax-top1-dense-first": ("tiny", dict(seq_len=64, router_score="softmax", top_k=1, n_blocks=1, block_pattern="DMMM"),
                                      "deepseek_v2"),
    "tiny-sigmoid-top1": ("tiny", dict(seq_len=64, n_blocks=2, top_k=1), "deepseek_v3"),
    "tiny-sigmoid-moe-first": ("tiny", dict(seq_len=64, n_blocks=3, block_pattern="MD"), "meshformer"),
    "tiny-softmax-top1-alternating": ("tiny", dict(seq_len=64, router_score="softmax", top_k=1, n_blocks=2, block_pattern="DM"),
                                      "meshformer"),
    "shakespeare-default": ("shakespeare", dict(), "meshformer"),
    "shakespeare-sigmoid-dense-first": ("shakespeare", dict(router_score="sigmoid", n_blocks=1, block_pattern="DMM"), "deepseek_v3"),
    "shakespeare-softmax-moe": ("shakespeare", dict(block_pattern="M"), "meshformer"),
    "shakespeare-dense": ("shakespeare", dict(block_pattern="D"), "deepseek_v3"),
    # DeepSeek-V3's routing options on (selection bias, 4 expert groups of 2, top 2 groups,
    # routed scale 2.5): the preset (blocks DM x 2: remote code), and dense-first (built in)
    "deepseek_v3-preset": ("deepseek_v3", dict(), "meshformer"),
    "tiny-v3-routing-dense-first": ("tiny", dict(seq_len=64, n_blocks=1, block_pattern="DMMM", router_bias_rate=0.001, n_groups=4,
                                                 topk_groups=2, routed_scale=2.5), "deepseek_v3"),
}
SEEDS = {"tiny-softmax-top1-dense-first": 1}  # seed 0 draws a model whose greedy continuation repeats one token
FAST_EXPORT_CASES = ("tiny-softmax-top1-dense-first", "deepseek_v3-preset")  # the rest: slow


@pytest.mark.parametrize("case", [c if c in FAST_EXPORT_CASES else pytest.param(c, marks=pytest.mark.slow) for c in EXPORT_CASES])
def test_export_gives_our_logits_and_greedy_tokens_in_transformers(case, tmp_path):
    preset, overrides, model_type = EXPORT_CASES[case]
    m = model_cfg(preset, **overrides)
    model, host = random_model(m, SEEDS.get(case, 0))
    out = hf_interop.write_hf_dir(str(tmp_path / "hf"), host, m, BYTES, "float32")
    hf = load_hf(out)
    assert hf.config.model_type == model_type

    tokens_BT = np.asarray(jax.random.randint(jax.random.key(7), (2, m.seq_len), 0, m.vocab_size))
    ours_BTV = our_logits(model, tokens_BT)
    with torch.no_grad():
        theirs_BTV = hf(torch.tensor(tokens_BT)).logits.numpy()
    assert theirs_BTV.shape == ours_BTV.shape  # the padded vocabulary, every row
    np.testing.assert_allclose(theirs_BTV, ours_BTV, atol=1e-5, rtol=0)

    prompt = BYTES.encode("ROMEO:\n")
    ours = our_greedy(model, prompt, GREEDY_TOKENS)
    assert len(set(ours)) > 3, f"a degenerate continuation tests little: {ours}"
    assert hf_greedy(hf, prompt, GREEDY_TOKENS) == ours


def test_export_files_config_and_tokenizer(tmp_path):
    m = model_cfg("tiny")
    out = hf_interop.write_hf_dir(str(tmp_path / "hf"), random_host(m), m, BYTES, "bfloat16")
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors",
                                       "tokenizer.json", "tokenizer_config.json"]  # no remote code for a DeepseekV3
    with open(os.path.join(out, "config.json")) as f:
        assert "auto_map" not in json.load(f)
    config = transformers.AutoConfig.from_pretrained(out)
    expected = dict(model_type="deepseek_v3", vocab_size=320, hidden_size=32, num_hidden_layers=8, first_k_dense_replace=0,
                    num_attention_heads=8, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                    v_head_dim=8, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=16,
                    norm_topk_prob=True, routed_scaling_factor=1.0, tie_word_embeddings=True, rope_interleave=True)
    assert {k: getattr(config, k) for k in expected} == expected
    tensors = safetensors_of(out)
    assert {a.dtype for a in tensors.values()} == {np.dtype(ml_dtypes.bfloat16)}
    assert "lm_head.weight" not in tensors  # tied to the embedding
    generation = transformers.GenerationConfig.from_pretrained(out)
    assert generation.suppress_tokens == list(range(257, 320)) and generation.eos_token_id == 256

    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = "JULIET: O Romeo, Romeo! wherefore art thou — «Roméo»?\n"
    assert tokenizer(text).input_ids == BYTES.encode(text)
    assert tokenizer.decode(BYTES.encode(text) + [BYTES.eot_id]) == text + "<|endoftext|>"


def test_tiktoken_tokenizer_loads_in_transformers(tmp_path):
    sys.path.insert(0, os.path.dirname(__file__))
    from test_data import tiny_encoding

    tokenizer = get_tokenizer(tiny_encoding())
    hf_tokenizer.write_tokenizer(str(tmp_path), tokenizer, 64)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    text = "in the end, and on the other hand: thé ünïcode 123 4567\n\n  the  end  "
    assert theirs(text).input_ids == tokenizer.encode(text)
    assert theirs.decode(tokenizer.encode(text)) == text
    assert theirs.convert_tokens_to_ids("<|endoftext|>") == tokenizer.eot_id


# The config.json fields that the DeepseekV2/V3 loaders of other stacks read, each with
# the value that means our model. From their source:
# - vLLM, vllm/model_executor/models/deepseek_v2.py (commit 002d607): DeepseekV2MoE reads
#   routed_scaling_factor, n_routed_experts, n_shared_experts, hidden_act, topk_method
#   ("noaux_tc" -> e_score_correction_bias), num_experts_per_tok, moe_intermediate_size,
#   norm_topk_prob (renormalize), n_group, topk_group and getattr(config, "scoring_func",
#   "softmax"); DeepseekV2DecoderLayer reads moe_layer_freq (is_moe_layer = layer_idx >=
#   first_k_dense_replace and layer_idx % moe_layer_freq == 0), first_k_dense_replace,
#   max_position_embeddings, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank,
#   q_lora_rank, num_attention_heads, intermediate_size, rms_norm_eps; the attention reads
#   rope_parameters["rope_type"] (anything but "default" becomes deepseek_yarn).
# - transformers 5.24, models/deepseek_v3/modeling_deepseek_v3.py: every config.X it
#   reads (attention_bias, first_k_dense_replace, hidden_act, hidden_size, intermediate_size,
#   kv_lora_rank, moe_intermediate_size, n_group, n_shared_experts, norm_topk_prob,
#   num_attention_heads, num_experts_per_tok, num_hidden_layers, num_key_value_heads,
#   n_routed_experts (its num_local_experts), q_lora_rank, qk_nope_head_dim,
#   qk_rope_head_dim, rms_norm_eps, rope_interleave, rope_parameters,
#   routed_scaling_factor, topk_group, v_head_dim, vocab_size); its router is always a
#   sigmoid with e_score_correction_bias.
# - DeepSeek-V3's own config.json states scoring_func, topk_method, norm_topk_prob,
#   n_group, topk_group, routed_scaling_factor, first_k_dense_replace, moe_layer_freq and
#   rope_theta at the top level.
def loader_fields(m, score, topk_method, n_dense):
    return dict(
        scoring_func=score, topk_method=topk_method, norm_topk_prob=m.top_k > 1, n_group=1, topk_group=1,
        routed_scaling_factor=1.0, first_k_dense_replace=n_dense, moe_layer_freq=1, rope_theta=m.rope_theta,
        n_routed_experts=m.n_experts, n_shared_experts=m.n_shared, num_experts_per_tok=m.top_k,
        moe_intermediate_size=m.d_expert, intermediate_size=m.d_ff, hidden_act="silu", hidden_size=m.d_model,
        num_hidden_layers=m.n_blocks * len(m.block_pattern), num_attention_heads=m.n_heads, num_key_value_heads=m.n_heads,
        qk_nope_head_dim=m.head_dim, qk_rope_head_dim=m.rope_dim, v_head_dim=m.head_dim, kv_lora_rank=m.kv_latent,
        q_lora_rank=m.q_latent, max_position_embeddings=m.seq_len, rms_norm_eps=m.norm_eps, attention_bias=False,
        rope_interleave=True, tie_word_embeddings=True, vocab_size=320,
        rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta})


@pytest.mark.parametrize("overrides, score, topk_method, n_dense", [
    (dict(), "sigmoid", "noaux_tc", 0),
    (dict(n_blocks=1, block_pattern="DMMM", router_score="sigmoid"), "sigmoid", "noaux_tc", 1),
    (dict(n_blocks=1, block_pattern="DMMM", router_score="softmax", top_k=1), "softmax", "greedy", 1),
], ids=["deepseek_v3", "deepseek_v3-dense-first", "deepseek_v2"])
def test_export_config_states_every_field_vllm_and_transformers_read_with_our_meaning(overrides, score, topk_method, n_dense,
                                                                                      tmp_path):
    """Present in config.json itself (not a class default: vLLM has other defaults)."""
    m = model_cfg("tiny", **overrides)
    config = hf_config.to_hf_config(m, BYTES, "float32")
    expected = loader_fields(m, score, topk_method, n_dense)
    assert {k: config.get(k, "<missing>") for k in expected} == expected
    assert "index_topk" not in config  # vLLM would take it for DeepSeek-V3.2 (sparse attention)


def test_import_reads_legacy_rope_scaling_as_transformers_does(tmp_path):
    """transformers reads `rope_scaling or rope_parameters` (convert_rope_params_to_dict),
    with rope_theta beside it: a YaRN model written by transformers 4.x or DeepSeek
    imports as YaRN, never unscaled."""
    path = str(tmp_path / "hf")
    hf_made_model(path, first_k_dense=1, n_layers=2)
    good = hf_config.read_hf_config(path)
    m = model_cfg("tiny")
    yarn = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 0.707}
    legacy = dict(good, rope_scaling=yarn, rope_theta=10000.0)
    imported = hf_config.from_hf_config(legacy, m)
    assert (imported.rope_scaling, imported.rope_factor, imported.rope_original_len, imported.yarn_mscale,
            imported.yarn_mscale_all_dim, imported.yarn_beta_fast, imported.yarn_beta_slow) == ("yarn", 40.0, 4096, 0.707, 0.0, 32.0, 1.0)
    assert transformers.DeepseekV3Config(**{k: v for k, v in legacy.items() if k != "rope_parameters"}).rope_parameters["rope_type"] == "yarn"
    plain = dict({k: v for k, v in good.items() if k != "rope_parameters"}, rope_scaling=None, rope_theta=50000.0)
    assert hf_config.from_hf_config(plain, m).rope_theta == 50000.0
    assert hf_config.from_hf_config(plain, m).rope_scaling == "none"
    with pytest.raises(ConfigError, match="scoring_func"):
        hf_config.from_hf_config(dict(good, scoring_func="softmax"), m)


def test_every_layout_exports_with_a_built_in_class_where_one_computes_it_else_remote_code():
    for m in (model_cfg("shakespeare"), apply_overrides(Config(), PRESETS["moe1b"]).model):  # DM x 2, DDDDDM x 8
        hf_config.check_exportable(m)
        assert hf_config.architecture_of(m) == ("meshformer", "MeshformerForCausalLM")
    with pytest.raises(ConfigError, match="ffn_activation"):
        hf_config.check_exportable(model_cfg("shakespeare", block_pattern="D", ffn_activation="gelu"))
    hf_config.check_exportable(model_cfg("shakespeare", tie_embeddings=False, q_latent=0, norm_topk=False))  # (issue 30: exported)
    # the built-in class that computes the router and the layout: sigmoid -> DeepseekV3;
    # softmax -> DeepseekV2 (whose gates are never renormalised, i.e. ours at k = 1 only);
    # both dense layers first only; no MoE layer, no router. Anything else: meshformer.
    kinds = {(score, k, pattern): hf_config.architecture_of(model_cfg("shakespeare", router_score=score, top_k=k, n_blocks=1,
                                                                        block_pattern=pattern))[0]
             for score in ("sigmoid", "softmax") for k in (1, 2) for pattern in ("M", "D", "DM", "MD")}
    assert kinds == {**{(s, k, p): "deepseek_v3" for s in ("sigmoid", "softmax") for k in (1, 2) for p in ("D",)},
                     ("sigmoid", 1, "M"): "deepseek_v3", ("sigmoid", 2, "M"): "deepseek_v3",
                     ("sigmoid", 1, "DM"): "deepseek_v3", ("sigmoid", 2, "DM"): "deepseek_v3",
                     ("softmax", 1, "M"): "deepseek_v2", ("softmax", 1, "DM"): "deepseek_v2",
                     ("softmax", 2, "M"): "meshformer", ("softmax", 2, "DM"): "meshformer",
                     **{(s, k, "MD"): "meshformer" for s in ("sigmoid", "softmax") for k in (1, 2)}}


# ---- Import: a model that transformers made


HF_KINDS = {  # model_type -> (config class, model class, what the class needs to be ours)
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(num_experts_per_tok=2)),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(num_experts_per_tok=1, topk_method="greedy")),
}


def hf_made_model(path, first_k_dense, n_layers, dtype=torch.float32, seed=0, kind="deepseek_v3", max_shard_size=None, **config):
    """A random DeepseekV3ForCausalLM (or DeepseekV2ForCausalLM) built and saved by
    transformers (in files of at most max_shard_size), every weight drawn at a scale
    where all of them matter."""
    config_class, model_class, needs = HF_KINDS[kind]
    config = getattr(transformers, config_class)(
        vocab_size=300, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=n_layers,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=16,
        q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1,
        first_k_dense_replace=first_k_dense, routed_scaling_factor=1.0, tie_word_embeddings=True,
        **dict(max_position_embeddings=64) | needs | config)
    torch.manual_seed(seed)
    hf = getattr(transformers, model_class)(config)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    hf = hf.to(dtype).eval()
    hf.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return hf


def hf_loss(hf, tokens_BT):
    with torch.no_grad():
        ids = torch.tensor(np.asarray(tokens_BT, np.int64))
        return float(hf(ids, labels=ids).loss)


def test_transformers_model_imported_on_a_2x2x2_mesh_gives_transformers_loss(tmp_path):
    path = str(tmp_path / "hf")
    hf = hf_made_model(path, first_k_dense=0, n_layers=4)
    tokens_BT = np.asarray(jax.random.randint(jax.random.key(3), (4, 33), 0, 300), np.int32)

    cfg = apply_overrides(Config(), PRESETS["tiny"])
    cfg = apply_overrides(cfg, {"model": dict(seq_len=32, capacity_factor=0.0), "train": dict(batch_size=4, microbatches=2),
                                "mesh": dict(dp=2, pp=2, tp=2)})
    source = hf_interop.HFSource(path)
    cfg = source.adopt(cfg)
    assert (cfg.model.n_blocks, cfg.model.block_pattern, cfg.model.vocab_size) == (4, "M", 300)
    mesh = make_mesh(cfg.mesh)
    check_config_fits_mesh(cfg, mesh)
    graphdef, params = init_params(cfg.model, mesh, False, 0)
    params = source.load(params, cfg.model)
    eval_step = make_eval_step(graphdef, cfg, mesh, params)
    ours = float(eval_step(params, global_batch(mesh, tokens_BT, 4)))
    assert ours == pytest.approx(hf_loss(hf, tokens_BT), abs=1e-5)


@pytest.mark.parametrize("kind", HF_KINDS)
def test_transformers_dense_first_model_imported_gives_transformers_logits_and_loss(kind, tmp_path):
    path = str(tmp_path / "hf")
    mtp = dict(num_nextn_predict_layers=1) if kind == "deepseek_v3" else {}  # MTP: not a next-token weight
    hf = hf_made_model(path, first_k_dense=1, n_layers=3, kind=kind, **mtp)
    m = hf_config.from_hf_config(hf_config.read_hf_config(path), model_cfg("tiny", seq_len=32))
    assert (m.first_dense, m.n_blocks, m.block_pattern, m.router_score, m.final_norm_folded) == (
        1, 2, "M", {"deepseek_v3": "sigmoid", "deepseek_v2": "softmax"}[kind], True)
    abstract = nnx.eval_shape(lambda: Transformer(m, nnx.Rngs(0)))
    graphdef, shapes = nnx.split(abstract)
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])),
                          shapes.to_pure_dict())
    params = hf_interop.HFSource(path).load(target, m)
    model = nnx.merge(graphdef, params)
    tokens_BT = np.asarray(jax.random.randint(jax.random.key(4), (2, 33), 0, 300))
    logits_BTV = model(jnp.asarray(tokens_BT[:, :-1]))[0]
    with torch.no_grad():
        theirs_BTV = hf(torch.tensor(tokens_BT[:, :-1])).logits.numpy()
    np.testing.assert_allclose(np.asarray(logits_BTV), theirs_BTV, atol=1e-5, rtol=0)
    ours = float(jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(logits_BTV), jnp.asarray(tokens_BT[:, 1:, None]), -1)))
    assert ours == pytest.approx(hf_loss(hf, tokens_BT), abs=1e-5)


@pytest.mark.parametrize("kind", HF_KINDS)
def test_transformers_model_round_trips_through_import_and_export_bit_for_bit(kind, tmp_path):
    """float32 and bfloat16, every tensor bit for bit, the final norm too: a foreign
    model imports with final_norm_folded (HF's norm weight kept as it is; ours x
    1/sqrt(D) cannot reach 11-13% of float32 weights), which our export then records."""
    for dtype, name in ((torch.bfloat16, "bfloat16"), (torch.float32, "float32")):
        path = str(tmp_path / name)
        hf_made_model(path, first_k_dense=1, n_layers=3, dtype=dtype, kind=kind)
        m = hf_config.from_hf_config(hf_config.read_hf_config(path), model_cfg("tiny"))
        original = safetensors_of(path)
        host = hf_interop.from_hf_state(original, m)
        out = hf_interop.write_hf_dir(str(tmp_path / f"again-{name}"), host, m, BYTES, name)
        again = safetensors_of(out)
        assert sorted(again) == sorted(original)
        for key in original:
            assert again[key].dtype == original[key].dtype and np.array_equal(bits(again[key]), bits(original[key])), key
        # and our export of it imports as the same model, final norm representation included
        arch = lambda c: {k: getattr(c, k) for k in hf_config.ARCH_FIELDS}  # noqa: E731
        assert arch(hf_config.from_hf_config(hf_config.read_hf_config(out), model_cfg("shakespeare"))) == arch(m)


@pytest.mark.parametrize("overrides", [dict(n_blocks=4, block_pattern="MM"), dict(n_blocks=2, block_pattern="DM", router_score="softmax")],
                         ids=["deepseek_v3", "meshformer"])
def test_our_export_round_trips_bit_for_bit(overrides, tmp_path):
    """export -> import -> export writes the same bits, and the import is our model:
    every weight equal, the final norm up to what the export's rounding of 1/sqrt(D)
    cannot tell apart (one ulp)."""
    m = model_cfg("tiny", **overrides)
    host = random_host(m, seed=5)
    out = hf_interop.write_hf_dir(str(tmp_path / "hf"), host, m, BYTES, "float32")
    imported = hf_config.from_hf_config(hf_config.read_hf_config(out), model_cfg("shakespeare"))
    arch = lambda c: {k: getattr(c, k) for k in hf_config.ARCH_FIELDS}  # noqa: E731
    assert arch(imported) == arch(m)  # the grouping into blocks, the padding, and the unfolded final norm come back too
    assert not imported.final_norm_folded  # so fine-tuning it trains what the run trained
    written = safetensors_of(out)
    back = hf_interop.from_hf_state(written, m)
    again = hf_interop.to_hf_state(back, m)
    assert sorted(again) == sorted(written)
    for key in written:
        assert np.array_equal(bits(again[key]), bits(written[key])), key
    back_flat = dict(jax.tree_util.tree_flatten_with_path(back)[0])
    for key, value in jax.tree_util.tree_flatten_with_path(host)[0]:
        difference = np.abs(bits(back_flat[key]).astype(np.int64) - bits(value).astype(np.int64))
        assert difference.max() <= (1 if "final_norm" in jax.tree_util.keystr(key) else 0), jax.tree_util.keystr(key)


def test_configs_this_model_cannot_express_name_the_field(tmp_path):
    path = str(tmp_path / "hf")
    hf_made_model(path, first_k_dense=1, n_layers=2)
    good = hf_config.read_hf_config(path)
    m = model_cfg("tiny")
    hf_config.from_hf_config(good, m)
    for field, value in [("v_head_dim", 16), ("hidden_act", "gelu"), ("num_key_value_heads", 2), ("attention_bias", True),
                         ("rope_parameters", {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}),
                         ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                              "attention_factor": 2.0, "rope_theta": 10000.0}),
                         ("rope_interleave", False), ("moe_layer_freq", 2), ("n_group", 3), ("topk_group", 5),
                         ("topk_method", "group_limited_greedy"), ("quantization_config", {"quant_method": "fp8"}),
                         ("index_topk", 2048), ("model_type", "llama")]:
        with pytest.raises(ConfigError, match=field) as error:
            hf_config.from_hf_config(dict(good, **{field: value}), m)
        assert "\n" not in str(error.value) and "not in this model yet" not in str(error.value)
    with pytest.raises(ConfigError, match="norm_topk_prob"):  # one expert renormalised is a gate of 1: ours is the raw score
        hf_config.from_hf_config(dict(good, num_experts_per_tok=1, norm_topk_prob=True), m)

    # meshformer (our remote code): the layout comes from mlp_layer_types, the score from scoring_func
    ours = hf_config.to_hf_config(model_cfg("tiny", n_blocks=2, block_pattern="DM", router_score="softmax"), BYTES, "float32")
    del ours[hf_config.OURS_KEY]  # as transformers' save_pretrained of a MeshformerForCausalLM would write it
    imported = hf_config.from_hf_config(ours, m)
    assert (imported.n_blocks, imported.block_pattern, imported.router_score) == (1, "DMDM", "softmax")
    for field, value in [("mlp_layer_types", ["dense", "sparse", "dense"]), ("mlp_layer_types", ["dense", "moe"] * 2),
                         ("scoring_func", "sqrtsoftplus")]:
        with pytest.raises(ConfigError, match=field):
            hf_config.from_hf_config(dict(ours, **{field: value}), m)

    # DeepseekV2: group-limited routing by the best score per group is not V3's top-2 sum
    path = str(tmp_path / "v2")
    hf_made_model(path, first_k_dense=1, n_layers=2, kind="deepseek_v2")
    good = hf_config.read_hf_config(path)
    assert hf_config.from_hf_config(good, m).router_score == "softmax"
    for field, value in [("topk_method", "group_limited_greedy"), ("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")]:
        with pytest.raises(ConfigError, match=field):
            hf_config.from_hf_config(dict(good, **{field: value}), m)


def test_every_field_of_transformers_deepseek_configs_is_read_or_known_not_to_matter():
    """Each field of transformers' DeepseekV3Config and DeepseekV2Config (and of the
    configs DeepSeek and Moonlight ship) is read with our meaning, or changes nothing
    this model computes; an unknown one is refused by name (test above)."""
    known = set(hf_config.READ) | set(hf_config.IGNORED)
    for config in (transformers.DeepseekV3Config(), transformers.DeepseekV2Config()):
        assert set(config.to_dict()) <= known, set(config.to_dict()) - known
    sys.path.insert(0, os.path.dirname(__file__))
    from test_hf_real import REAL_CONFIGS

    for name, config in REAL_CONFIGS.items():
        assert set(config) <= known, (name, set(config) - known)


def test_what_the_issue_found_refused_now_imports_with_its_meaning(tmp_path):
    """issue 30's table: each field (real value) that the importer refused maps to ours."""
    path = str(tmp_path / "hf")
    hf_made_model(path, first_k_dense=1, n_layers=2)
    good = hf_config.read_hf_config(path)
    m = model_cfg("tiny")
    yarn = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
            "mscale": 1.0, "mscale_all_dim": 1.0}
    cases = [(dict(tie_word_embeddings=False), dict(tie_embeddings=False)),
             (dict(q_lora_rank=None), dict(q_latent=0)),
             (dict(rope_scaling=yarn), dict(rope_scaling="yarn", rope_factor=40.0, rope_original_len=4096, yarn_beta_fast=32.0,
                                            yarn_beta_slow=1.0, yarn_mscale=1.0, yarn_mscale_all_dim=1.0)),
             (dict(routed_scaling_factor=2.5), dict(routed_scale=2.5)),
             (dict(n_group=4, topk_group=2, topk_method="noaux_tc"), dict(n_groups=4, topk_groups=2, router_bias=True)),
             (dict(rms_norm_eps=1e-5), dict(norm_eps=1e-5)),
             (dict(norm_topk_prob=False), dict(norm_topk=False)),
             (dict(first_k_dense_replace=1), dict(first_dense=1, n_blocks=1, block_pattern="M"))]
    for hf, ours in cases:
        imported = hf_config.from_hf_config(dict(good, **hf), m)
        assert {k: getattr(imported, k) for k in ours} == ours, hf


# ---- The command line


def command_line(tmp_path, preset="tiny"):
    """run(*args): `python main.py --preset PRESET ...` in tmp_path, checked unless check=False."""
    def run(*args, check=True):
        cmd = [sys.executable, os.path.join(REPO, "main.py"), "--preset", preset, "--run.out_dir", str(tmp_path / "runs"),
               "--data.cache_dir", str(tmp_path / "data"), "--log.progress", "false", "--log.plots", "false", *args]
        result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
        if check:
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return result
    return run


def val_loss(result):
    """The value `--mode eval` prints."""
    return float(result.stdout.strip().splitlines()[-1].split("=")[1])


@pytest.mark.slow
def test_command_line_export_loads_in_transformers_and_evaluates_from_hf_on_another_mesh(tmp_path):
    run = command_line(tmp_path)
    run("--train.steps", "20", "--run.name", "t")
    run("--mode", "export_hf", "--run.name", "t", "--export.dtype", "float32")
    hf_path = str(tmp_path / "runs" / "t" / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_path)
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    prompt = tokenizer("ROMEO:", return_tensors="pt").input_ids
    assert hf.generate(prompt, max_new_tokens=8, do_sample=False).shape == (1, prompt.shape[1] + 8)

    # the exported weights, evaluated here from hf: on another mesh, give the run's own val loss
    own = run("--mode", "eval", "--run.name", "t")
    from_hf = run("--mode", "eval", "--run.name", "t2", "--train.init_from", f"hf:{hf_path}",
                  "--run.cpu_devices", "8", "--mesh.dp", "2", "--mesh.pp", "2", "--mesh.tp", "2", "--train.microbatches", "2")
    assert val_loss(from_hf) == pytest.approx(val_loss(own), abs=1e-5)

    bad = run("--mode", "export_hf", "--run.name", "t", "--train.init_from", f"hf:{tmp_path}", check=False)
    assert bad.returncode != 0 and "error: " in bad.stderr and "no config.json" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_command_line_default_run_exports_a_model_auto_model_for_causal_lm_loads(tmp_path):
    """`python main.py` (blocks DM x 2, softmax top-2 router), then --mode export_hf: the
    directory carries its modeling code and loads, offline, with AutoModelForCausalLM
    and trust_remote_code, as lm_eval --model hf loads it; and it imports back here."""
    run = command_line(tmp_path, preset="shakespeare")
    run("--train.steps", "2", "--train.eval_every", "1000", "--sample.num_samples", "0", "--run.name", "d")
    out = run("--mode", "export_hf", "--run.name", "d", "--export.dtype", "float32").stdout
    assert "MeshformerForCausalLM" in out and "trust_remote_code" in out
    hf_path = str(tmp_path / "runs" / "d" / "hf")
    load = ("import sys, transformers; d = sys.argv[1]; "
            "m = transformers.AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True); "
            "t = transformers.AutoTokenizer.from_pretrained(d, trust_remote_code=True); ids = t('ROMEO:', return_tensors='pt').input_ids; "
            "print(type(m).__name__, m.generate(ids, max_new_tokens=8, do_sample=False).shape[1] - ids.shape[1])")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))  # nothing from the network
    loaded = subprocess.run([sys.executable, "-c", load, hf_path], capture_output=True, text=True, env=env, timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert loaded.stdout.split() == ["MeshformerForCausalLM", "8"]

    own = run("--mode", "eval", "--run.name", "d")
    from_hf = run("--mode", "eval", "--run.name", "d2", "--train.init_from", f"hf:{hf_path}")
    assert val_loss(from_hf) == pytest.approx(val_loss(own), abs=1e-5)


@pytest.mark.slow
def test_command_line_transformers_model_exports_bit_for_bit_and_fine_tunes_resumes_exports(tmp_path):
    """A float32 model made by transformers, through the command line: exported straight
    from hf: it is its own files bit for bit; fine-tuned from hf:, resumed from a
    checkpoint and exported, it keeps HF's final norm representation (final_norm_folded)
    and the export evaluates to the run's loss."""
    run = command_line(tmp_path)
    foreign = str(tmp_path / "foreign")
    hf_made_model(foreign, first_k_dense=1, n_layers=3)
    runs = tmp_path / "runs"
    run("--mode", "export_hf", "--run.name", "imp", "--train.init_from", f"hf:{foreign}", "--export.dtype", "float32")
    original, again = safetensors_of(foreign), safetensors_of(str(runs / "imp" / "hf"))
    assert sorted(again) == sorted(original)
    for key in original:
        assert np.array_equal(bits(again[key]), bits(original[key])), key

    fine_tune = ("--run.name", "ft", "--train.init_from", f"hf:{foreign}", "--train.steps", "4", "--train.checkpoint_every", "2",
                 "--sample.num_samples", "0")
    assert "initialised params from hf:" in run(*fine_tune).stdout
    assert "resumed from" in run(*fine_tune, "--train.resume_step", "2").stdout  # steps 3 and 4 again
    run("--mode", "export_hf", "--run.name", "ft", "--export.dtype", "float32")
    with open(runs / "ft" / "hf" / "config.json") as f:
        assert json.load(f)[hf_config.OURS_KEY]["final_norm_folded"] is True
    own = run("--mode", "eval", "--run.name", "ft")
    exported = run("--mode", "eval", "--run.name", "ft2", "--train.init_from", f"hf:{runs / 'ft' / 'hf'}")
    assert val_loss(exported) == pytest.approx(val_loss(own), abs=1e-5)

    # the run's checkpoint refuses the preset's own model (the final norm means another thing) in one line
    with open(runs / "ft" / "config.json") as f:
        saved = json.load(f)["model"]
    preset = dataclasses.replace(apply_overrides(Config(), PRESETS["tiny"]).model, **{k: saved[k] for k in hf_config.ARCH_FIELDS
                                                                                      if k != "final_norm_folded"})
    with pytest.raises(ConfigError, match=r"--model.final_norm_folded: checkpoint True vs now False") as error:
        checkpoint.check_model_config(saved, preset, "runs/ft")
    assert "\n" not in str(error.value)
