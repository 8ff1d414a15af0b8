"""Hugging Face interop: this model <-> a transformers checkpoint directory.

The model here is arithmetically a DeepSeek-V3 (MLA attention with decoupled RoPE,
shared + routed SwiGLU experts, RMSNorm, tied embedding), so a run leaves the repo as a
directory that `AutoModelForCausalLM.from_pretrained` loads: with transformers' own,
built-in classes where one computes the model, else with a short subclass of its
DeepseekV3 that the export writes beside the weights (modeling_meshformer.py, loaded
with trust_remote_code=True; config.json's auto_map points at it):

  dense layers first only (D...DM...M), and
    router_score sigmoid (or no MoE layer) -> deepseek_v3 (DeepseekV3ForCausalLM)
    router_score softmax, top_k 1           -> deepseek_v2 (DeepseekV2ForCausalLM)
  anything else (the default run's DM x 2 with a softmax top-2 router; moe1b's
  DDDDDM x 8)                               -> meshformer  (MeshformerForCausalLM, remote code)

Why: transformers' DeepseekV3 router always scores experts with a sigmoid. Its
DeepseekV2 scores with a softmax but never renormalises the top k (its router deletes
norm_topk_prob: gate = softmax score x routed_scaling_factor), which is ours only when
k = 1, where our gate is the raw score too. Both put dense layers only first
(first_k_dense_replace). Mistral4 renormalises softmax scores, but is dense-first too and
transformers 5.24 leaves it out of AutoModelForCausalLM (so out of `lm_eval --model hf`).
modeling_meshformer.py adds the two missing pieces (a per-layer dense/MoE list,
`mlp_layer_types`; a softmax or sigmoid router with the top k renormalised) and reuses
everything else of transformers' DeepseekV3; its model_type is not deepseek_v3, so
without trust_remote_code transformers refuses it rather than compute another model.

How the pieces map (ours -> HF, per layer l = block n x len(pattern) + position i; the
names and layouts are the rows of weights.WEIGHTS, under HF_MODULES):

  wq_down_DQ                    q_a_proj [Q, D]            (transposed: torch stores [out, in])
  wq_up_QHK | wq_rope_QHR       q_b_proj [H (K + R), Q]    per head: K content dims, then R RoPE dims
  wkv_down_DA | wk_rope_DR      kv_a_proj_with_mqa [A + R, D]
  wk_up_AHK | wv_up_AHK         kv_b_proj [H (K + K), A]   per head: K key dims, then K value dims
  wo_HKD                        o_proj [D, H K]
  final_norm / sqrt(D)          model.norm                 (our logits are scaled by 1/sqrt(D); a model
                                                           imported from HF keeps HF's weight: final_norm_folded)
  embed_VD (padded rows too)    embed_tokens, tied to lm_head

RoPE: ours rotates pairs (x[2i], x[2i+1]); HF's `rope_interleave: true` rotates the same
pairs (it writes them out de-interleaved, to queries and keys alike, which leaves every
score unchanged), and DeepseekV2 rotates them as complex numbers in place, so RoPE
weights copy as they are. Softmax scale 1/sqrt(K + R) on all three.

Routing fields: config.json states every one DeepSeek's own has (scoring_func,
topk_method, norm_topk_prob, n_group, topk_group, routed_scaling_factor,
first_k_dense_replace, moe_layer_freq, rope_theta), since vLLM reads some with other
defaults than transformers (scoring_func defaults to softmax there).

Vocabulary: the exported vocab_size is our padded one, so HF's logits and loss are ours
over every row; generation_config.json suppresses the padding ids, as our sampler does.

Capacity: HF never drops tokens, so an export equals our dropless forward
(capacity_factor 0, and decoding), not a capacity-dropping training step.

Experts: per-expert tensors (experts.{e}.gate_proj...) for deepseek_v3 and deepseek_v2, as
DeepSeek's own checkpoints have them (transformers fuses them on load); fused ones
(experts.gate_up_proj, experts.down_proj) for meshformer, as its classes store them
(transformers converts names for its own model types only, not for remote code).
"""

import dataclasses
import json
import math
import os
import shutil

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from model import Transformer, padded_vocab
from utils import ConfigError, apply_overrides
from weights import WEIGHTS, row

HF_PREFIX = "hf:"
ARCHITECTURES = {  # model_type -> (class, the router score it computes; None: config.json's scoring_func)
    "deepseek_v3": ("DeepseekV3ForCausalLM", "sigmoid"),
    "deepseek_v2": ("DeepseekV2ForCausalLM", "softmax"),
    "mistral4": ("Mistral4ForCausalLM", "softmax"),  # imported, never exported (not in AutoModelForCausalLM)
    "meshformer": ("MeshformerForCausalLM", None),  # remote code: REMOTE_CODE, written beside the weights
}
REMOTE_CODE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "modeling_meshformer.py")
MLP_LAYER_TYPES = {"D": "dense", "M": "sparse"}  # our layer kinds -> transformers' mlp_layer_types
RMS_EPS = 1e-6  # layers.RMSNorm's
EXPORT_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
# Fields of our ModelConfig that no HF field carries, kept in config.json under this key
# so that our own export imports back as exactly the model it came from.
OURS_KEY = "meshformer"
OURS_FIELDS = ("vocab_size", "vocab_multiple", "n_blocks", "block_pattern", "final_norm_folded")


def hf_dir(init_from):
    """The directory of --train.init_from hf:DIR, or None for other sources."""
    return init_from[len(HF_PREFIX):] if init_from.startswith(HF_PREFIX) else None


def layer_kinds(m):
    """The whole stack, layer by layer: e.g. "DMDM" for 2 blocks of "DM"."""
    return m.block_pattern * m.n_blocks


# ----------------------------------------------------------------------------
# Config: ours -> HF


def options_not_exported(m):
    """The options of model.py (issue 30) this exporter does not write yet, as flags."""
    on = {"tie_embeddings": not m.tie_embeddings, "q_latent": m.q_latent == 0, "rope_scaling": m.rope_scaling != "none",
          "norm_eps": m.norm_eps != RMS_EPS, "norm_topk": not m.norm_topk}
    return [f"--model.{k} {getattr(m, k)}" for k, is_on in on.items() if is_on]


def check_exportable(m):
    """Raise ConfigError for a model HF's classes cannot express, saying what would export.
    Every layer layout exports (architecture_of picks the class)."""
    if options_not_exported(m):
        raise ConfigError(f"{', '.join(options_not_exported(m))}: the exporter does not write this yet; "
                          "export a model trained without it")
    kinds = layer_kinds(m)
    if "D" in kinds and m.ffn_activation != "swiglu":
        raise ConfigError(f"--model.ffn_activation {m.ffn_activation}: HF's DeepseekV3 dense layers are SwiGLU; "
                          "train with --model.ffn_activation swiglu to export")
    if "M" in kinds and m.n_experts < 2:
        raise ConfigError("--model.n_experts must be >= 2 to export: HF's router ranks experts in groups of at least 2")
    routing = {"--model.router_bias_rate": (m.router_bias_rate, 0.0), "--model.n_groups": (m.n_groups, 1),
               "--model.routed_scale": (m.routed_scale, 1.0)}
    if "M" in kinds and any(value != off for value, off in routing.values()):
        on = ", ".join(f"{flag} {value}" for flag, (value, off) in routing.items() if value != off)
        raise ConfigError(f"{on}: the exporter does not yet write DeepSeek-V3's routing options (HF's "
                          "e_score_correction_bias, n_group / topk_group, routed_scaling_factor); export a model trained without them")


def to_hf_config(m, tokenizer, dtype):
    """config.json of the export: every field derived from our ModelConfig `m`."""
    check_exportable(m)
    kinds = layer_kinds(m)
    model_type, architecture = architecture_of(m)
    score = ARCHITECTURES[model_type][1] or m.router_score
    config = dict(
        architectures=[architecture], model_type=model_type, dtype=dtype,
        vocab_size=padded_vocab(m.vocab_size, m.vocab_multiple), hidden_size=m.d_model,
        num_hidden_layers=len(kinds), first_k_dense_replace=len(kinds) - len(kinds.lstrip("D")),
        intermediate_size=m.d_ff, hidden_act="silu",
        num_attention_heads=m.n_heads, num_key_value_heads=m.n_heads,
        q_lora_rank=m.q_latent, kv_lora_rank=m.kv_latent,
        qk_nope_head_dim=m.head_dim, qk_rope_head_dim=m.rope_dim, v_head_dim=m.head_dim,
        rope_interleave=True, attention_bias=False, attention_dropout=0.0,
        n_routed_experts=m.n_experts, n_shared_experts=m.n_shared, moe_intermediate_size=m.d_expert,
        num_experts_per_tok=m.top_k,
        # Ours renormalises the top-k scores to sum to 1, except with one expert, whose
        # gate is its raw score (DeepseekV2 ignores the field: it exports only k = 1).
        norm_topk_prob=m.top_k > 1, routed_scaling_factor=1.0, n_group=1, topk_group=1,
        # Every routing field DeepSeek's own config.json states, so that a loader that
        # reads them with other defaults (vLLM: getattr(config, "scoring_func",
        # "softmax"), layer_idx % moe_layer_freq) routes as we do. noaux_tc: top k of the
        # score plus e_score_correction_bias (written, zeros); greedy: top k of the score.
        scoring_func=score, topk_method="noaux_tc" if score == "sigmoid" else "greedy",
        moe_layer_freq=1, rope_theta=m.rope_theta,
        max_position_embeddings=m.seq_len, rms_norm_eps=RMS_EPS, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=tokenizer.eot_id, pad_token_id=None, use_cache=True,
        initializer_range=0.02,
    )
    # "default" RoPE spans head_dim, which both configs set to qk_rope_head_dim
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": m.rope_theta}
    if model_type == "deepseek_v2":
        config["mlp_bias"] = False
    else:
        config["num_nextn_predict_layers"] = 0
    if model_type == "meshformer":  # modeling_meshformer.py: DeepseekV3 with any layer layout and router
        stem = os.path.splitext(os.path.basename(REMOTE_CODE))[0]
        config.update(auto_map={"AutoConfig": f"{stem}.MeshformerConfig", "AutoModelForCausalLM": f"{stem}.MeshformerForCausalLM"},
                      mlp_layer_types=[MLP_LAYER_TYPES[kind] for kind in kinds])
    config[OURS_KEY] = {k: getattr(m, k) for k in OURS_FIELDS}
    return config


def architecture_of(m):
    """(model_type, class) of the export: the built-in transformers class that computes
    this layout and router, else our remote code (module docstring). A model without
    MoE layers has no router: deepseek_v3."""
    kinds = layer_kinds(m)
    dense_first = "D" not in kinds.lstrip("D")
    if "M" not in kinds or (dense_first and m.router_score == "sigmoid"):
        model_type = "deepseek_v3"
    elif dense_first and m.router_score == "softmax" and m.top_k == 1:
        model_type = "deepseek_v2"
    else:
        model_type = "meshformer"
    return model_type, ARCHITECTURES[model_type][0]


# ----------------------------------------------------------------------------
# Config: HF -> ours


ARCH_FIELDS = ("vocab_size", "vocab_multiple", "d_model", "n_heads", "head_dim", "rope_dim", "q_latent", "kv_latent",
               "rope_theta", "n_blocks", "block_pattern", "d_ff", "ffn_activation", "n_experts", "n_shared", "top_k",
               "d_expert", "router_score", "final_norm_folded")


def from_hf_config(hf, m):
    """Our ModelConfig for an HF config dict: `m` with its architecture fields replaced.
    What this model cannot express is a ConfigError naming the HF field."""

    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ConfigError(f"config.json has model_type {model_type!r}; this model imports "
                          f"{', '.join(ARCHITECTURES)} (MLA + DeepSeek MoE) checkpoints")

    def need(ok, field, why):
        if not ok:
            raise ConfigError(f"cannot import: config.json field {field} = {hf.get(field)!r}: {why}")

    # As transformers reads it (PreTrainedConfig.convert_rope_params_to_dict): the legacy
    # `rope_scaling` (transformers 4.x's and DeepSeek's own configs) wins over
    # `rope_parameters`, and rope_theta may sit beside it at the top level.
    rope_field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rope = dict(hf.get(rope_field) or {"rope_type": "default"})
    rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    L, k = hf["num_hidden_layers"], hf.get("first_k_dense_replace", 0)
    need(hf.get("q_lora_rank") is not None, "q_lora_rank", "this model always has a query latent (MLA's low-rank query)")
    need(hf.get("v_head_dim") == hf["qk_nope_head_dim"], "v_head_dim", f"values here are as wide as the key content part "
         f"(qk_nope_head_dim = {hf['qk_nope_head_dim']})")
    need(hf.get("num_key_value_heads", hf["num_attention_heads"]) == hf["num_attention_heads"], "num_key_value_heads",
         "MLA here has one key/value head per query head")
    need(hf.get("hidden_act", "silu") == "silu", "hidden_act", "experts and dense layers here are SwiGLU (silu)")
    need(not hf.get("attention_bias", False), "attention_bias", "projections here have no bias")
    need(not hf.get("mlp_bias", False), "mlp_bias", "projections here have no bias")
    need(hf.get("tie_word_embeddings", False), "tie_word_embeddings", "the output layer here is the input embedding")
    need(math.isclose(hf.get("rms_norm_eps", RMS_EPS), RMS_EPS), "rms_norm_eps", f"RMSNorm here uses eps {RMS_EPS}")
    need(hf.get("rope_interleave", True), "rope_interleave", "RoPE here rotates interleaved pairs (x[2i], x[2i+1])")
    if model_type != "mistral4":
        need(rope_type == "default", rope_field, f"rope_type {rope_type!r}: RoPE here is unscaled (no YaRN)")
    else:
        need(rope_type in ("default", "linear") and rope.get("factor", 1.0) == 1.0 and not rope.get("llama_4_scaling_beta"),
             rope_field, "RoPE here is unscaled (no YaRN, no llama-4 query scaling)")
    kinds = "D" * k + "M" * (L - k)
    if model_type == "meshformer":  # our remote code: any layout, either score
        by_type = {v: kind for kind, v in MLP_LAYER_TYPES.items()}
        layer_types = hf.get("mlp_layer_types") or []
        need(len(layer_types) == L and all(t in by_type for t in layer_types), "mlp_layer_types",
             f"one of {', '.join(by_type)} per layer ({L} layers)")
        kinds = "".join(by_type[t] for t in layer_types)
    score = ARCHITECTURES[model_type][1] or hf.get("scoring_func", "softmax")
    moe = "M" in kinds
    if moe:
        top_k = hf["num_experts_per_tok"]
        if ARCHITECTURES[model_type][1]:
            need(hf.get("scoring_func", score) == score, "scoring_func", f"{model_type}'s class in transformers scores "
                 f"experts with a {score}; a config that says otherwise is read one way by transformers, another by vLLM")
        else:
            need(score in ("softmax", "sigmoid"), "scoring_func", "routers here score with a softmax or a sigmoid")
        need(hf.get("routed_scaling_factor", 1.0) == 1.0, "routed_scaling_factor", "routed expert outputs here are not "
             "rescaled (DeepSeek-V3 routing options are not in this model yet)")
        need(hf.get("n_group", 1) in (1, None) or hf.get("topk_group") == hf.get("n_group"), "n_group",
             f"with topk_group {hf.get('topk_group')}: group-limited routing is not in this model yet")
        if model_type == "deepseek_v2":  # its router never renormalises, whatever norm_topk_prob says
            need(top_k == 1, "num_experts_per_tok", "HF's DeepseekV2 gates are the top-k softmax scores, not "
                 "renormalised (it ignores norm_topk_prob); gates here are renormalised over the top k when k > 1")
            need(hf.get("topk_method", "greedy") == "greedy", "topk_method", "group-limited routing is not in this model yet")
        else:
            need(bool(hf.get("norm_topk_prob", True)) == (top_k > 1), "norm_topk_prob", "gates here are renormalised "
                 "over the top k when k > 1 and are the raw score when k = 1")
    ours = hf.get(OURS_KEY, {})
    if ours and ours.get("block_pattern", "") * ours.get("n_blocks", 0) == kinds:
        n_blocks, pattern = ours["n_blocks"], ours["block_pattern"]  # our own export: the same grouping
    elif len(set(kinds)) == 1:
        n_blocks, pattern = L, kinds[0]  # one layer per block, so the pipeline can split them anywhere
    else:
        n_blocks, pattern = 1, kinds
    vocab, multiple = hf["vocab_size"], math.gcd(hf["vocab_size"], m.vocab_multiple)
    if ours and padded_vocab(ours.get("vocab_size", 0), ours.get("vocab_multiple", 1)) == hf["vocab_size"]:
        vocab, multiple = ours["vocab_size"], ours["vocab_multiple"]  # the padding rows stay padding
    new = dict(
        vocab_size=vocab, vocab_multiple=multiple, d_model=hf["hidden_size"], n_heads=hf["num_attention_heads"],
        head_dim=hf["qk_nope_head_dim"], rope_dim=hf["qk_rope_head_dim"], q_latent=hf["q_lora_rank"],
        kv_latent=hf["kv_lora_rank"], rope_theta=float(rope.get("rope_theta", 10000.0)), n_blocks=n_blocks,
        block_pattern=pattern, d_ff=hf.get("intermediate_size", m.d_ff), ffn_activation="swiglu",
        router_score=score,
        # HF's norm weight kept as it is, bit for bit (times 1/sqrt(D) it would not map
        # back); our own export says which way its model had it.
        final_norm_folded=ours.get("final_norm_folded", not ours))
    if moe:
        new.update(n_experts=hf["n_routed_experts"], n_shared=hf.get("n_shared_experts", 0), top_k=hf["num_experts_per_tok"],
                   d_expert=hf["moe_intermediate_size"])
    return dataclasses.replace(m, **new)


def read_hf_config(path):
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ConfigError(f"--train.init_from hf:{path}: no config.json there; give a Hugging Face model directory "
                          "(DeepseekV3 format, e.g. from --mode export_hf)")
    with open(config_path) as f:
        return json.load(f)


def adopt_hf_config(cfg, path):
    """cfg with the model architecture of the HF directory `path` (training-time fields,
    such as seq_len, dtype and capacity_factor, stay as configured)."""
    model = from_hf_config(read_hf_config(path), cfg.model)
    return apply_overrides(cfg, {"model": {k: getattr(model, k) for k in ARCH_FIELDS}})


# ----------------------------------------------------------------------------
# Weights: ours <-> HF state dict (numpy, float32)


def final_norm_out(scale_D, m, dtype=np.float32):
    """HF's final norm weight: ours times our logits' 1/sqrt(D), rounded once into `dtype`
    (ours as it is when it already holds that factor, m.final_norm_folded)."""
    scale_D = np.asarray(scale_D, np.float32)
    if not m.final_norm_folded:
        scale_D = (scale_D.astype(np.float64) / math.sqrt(m.d_model)).astype(np.float32)
    return scale_D.astype(dtype)


def final_norm_in(weight_D, m):
    """Our final norm scale for HF's weight: the weight itself with m.final_norm_folded
    (what an import from a foreign model sets), else the float32 nearest weight x sqrt(D).
    The latter is for our own exports: a weight that an export wrote exports back from
    it to exactly itself (every one of 10^5 draws at D = 32, 128 and 768), and so does
    every bfloat16 weight. A foreign float32 weight can fall between two values an
    export can write (1/sqrt(D) is not a power of two, so no float32 scale maps onto
    it; 11-13% of random draws), hence the folded representation for those."""
    weight_D = np.asarray(weight_D).astype(np.float32)
    if m.final_norm_folded:
        return weight_D
    return (weight_D.astype(np.float64) * math.sqrt(m.d_model)).astype(np.float32)


# Our module names -> HF's (DeepseekV3's modeling code). Each weight's own tensor name
# under its module, and how it is laid out there, is its row in weights.WEIGHTS.
HF_MODULES = {"attn_norm": "input_layernorm", "attn": "self_attn", "q_norm": "q_a_layernorm", "kv_norm": "kv_a_layernorm",
              "ffn_norm": "post_attention_layernorm", "ffn": "mlp", "shared": "shared_experts", "final_norm": "norm"}


def hf_name(keys, prefix, fused_experts=False):
    """The HF tensor of our weight at `keys` (module names, then the weight name) under
    `prefix` ("model." or "model.layers.{l}."); routed experts' names hold `{e}`
    unless fused_experts (one tensor for all experts)."""
    hf = row(keys[-1]).hf
    tensor = hf.fused if fused_experts and hf.fused else hf.name
    return prefix + ".".join([*(HF_MODULES[k] for k in keys[:-1]), tensor])


def hf_layout(tree, prefix, fused_experts):
    """{HF tensor: [keys of our weights in it]} for a dict of our weights (one layer's, or
    the top level's), the weights of one tensor in table order (concatenated along their
    last dim)."""
    layout = {}
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = tuple(k.key for k in path)
        layout.setdefault(hf_name(keys, prefix, fused_experts), []).append(keys)
    order = list(WEIGHTS)
    return {name: sorted(parts, key=lambda keys: order.index(keys[-1])) for name, parts in layout.items()}


def torch_shape(shape, weight):
    """HF's shape for ours: [E.., out, in] (nn.Linear's [out, in]) for a weight with
    fan-in dims, whose fan-in and fan-out dims flatten into `in` and `out`."""
    if weight.fan_in is None:
        return tuple(shape)
    b = int(weight.routed)
    return (*shape[:b], math.prod(shape[b + weight.fan_in:]), math.prod(shape[b:b + weight.fan_in]))


def to_hf_tensors(tree, prefix, fused_experts):
    """{HF name: array} of a dict of our weights (numpy, no N dim)."""
    out = {}
    for name, parts in hf_layout(tree, prefix, fused_experts).items():
        weight = row(parts[0][-1])
        x = np.concatenate([leaf_at(tree, keys) for keys in parts], -1)
        if weight.fan_in is not None:  # ours [E.., in.., out..] -> torch's [E.., out, in]
            out_size, in_size = torch_shape(x.shape, weight)[-2:]
            x = np.swapaxes(x.reshape(*x.shape[:int(weight.routed)], in_size, out_size), -1, -2)
        if "{e}" in name:  # one tensor per expert
            out |= {name.format(e=e): x[e] for e in range(x.shape[0])}
        else:
            out[name] = x
    return out


def from_hf_tensors(shapes, prefix, get, fused_experts):
    """Our weights (a dict like `shapes`, a dict of ShapeDtypeStructs without N) from the
    HF tensors under `prefix`; the inverse of to_hf_tensors. get(name): HF's tensor."""
    out = {}
    for name, parts in hf_layout(shapes, prefix, fused_experts).items():
        weight = row(parts[0][-1])
        part_shapes = [leaf_at(shapes, keys).shape for keys in parts]
        whole = (*part_shapes[0][:-1], sum(s[-1] for s in part_shapes))  # ours, before the split
        x = np.stack([get(name.format(e=e)) for e in range(whole[0])]) if "{e}" in name else get(name)
        if x.shape != torch_shape(whole, weight):
            raise ConfigError(f"{name} has shape {x.shape} in the checkpoint; this model's is {torch_shape(whole, weight)}")
        x = (np.swapaxes(x, -1, -2) if weight.fan_in is not None else x).reshape(whole)
        for keys, part in zip(parts, np.split(x, np.cumsum([s[-1] for s in part_shapes])[:-1], axis=-1)):
            node = out
            for k in keys[:-1]:
                node = node.setdefault(k, {})
            node[keys[-1]] = part
    return out


def leaf_at(tree, keys):
    for k in keys:
        tree = tree[k]
    return tree


def to_hf_state(params, m, dtype=np.float32):
    """{HF name: array} from our params (a pure dict of host arrays, the stacked blocks'
    leading axis N included). Per-expert names (experts.{e}.gate_proj...) for
    deepseek_v3 and deepseek_v2, as DeepSeek's own checkpoints and vLLM/SGLang have them;
    meshformer's fused expert tensors, as its (remote-code) class stores them.
    Multi-token prediction modules are not exported (num_nextn_predict_layers 0)."""
    check_exportable(m)
    D = m.d_model
    model_type = architecture_of(m)[0]
    fused_experts = model_type == "meshformer"
    top = {"embed_VD": params["embed_VD"], "final_norm": {"scale_D": final_norm_out(params["final_norm"]["scale_D"], m, dtype)}}
    out = to_hf_tensors(top, "model.", fused_experts)
    P = len(m.block_pattern)
    for n in range(m.n_blocks):
        for i, kind in enumerate(m.block_pattern):
            w = jax.tree.map(lambda a: np.asarray(a[n]), params["blocks"]["layers"][i])
            L = f"model.layers.{n * P + i}."
            if kind == "M" and "shared" not in w["ffn"]:  # HF's MoE layers always have shared experts: none = width 0
                w["ffn"]["shared"] = {"w_gate_DF": np.zeros((D, 0), np.float32), "w_up_DF": np.zeros((D, 0), np.float32),
                                      "w_down_FD": np.zeros((0, D), np.float32)}
            out |= to_hf_tensors(w, L, fused_experts)
            if kind == "M" and model_type != "deepseek_v2":  # its selection bias (ours, router_bias_rate > 0, is refused above)
                out[hf_name(("ffn", "router_bias_E"), L)] = np.zeros((m.n_experts,), np.float32)
    return {k: np.ascontiguousarray(np.asarray(v, np.float32).astype(dtype)) for k, v in out.items()}


def from_hf_state(tensors, m):
    """Our params (pure dict of float32 numpy arrays, stacked blocks) from an HF state
    dict; the inverse of `to_hf_state`. Accepts per-expert and fused expert tensors."""
    shapes = nnx.state(nnx.eval_shape(lambda: Transformer(m, nnx.Rngs(0)))).to_pure_dict()  # no allocation
    used = set()

    def get(name):
        if name not in tensors:
            raise ConfigError(f"the checkpoint has no tensor {name}: is it the model its config.json describes?")
        used.add(name)
        return np.asarray(tensors[name], np.float32)

    def layer(index, layer_shapes):
        L = f"model.layers.{index}."
        bias = hf_name(("ffn", "router_bias_E"), L)
        if bias in tensors and np.any(get(bias) != 0):
            raise ConfigError(f"cannot import: {bias} is not zero: selecting experts with a score bias "
                              "(DeepSeek-V3's aux-loss-free balancing) is not in this model yet")
        fused_only = hf_layout(layer_shapes, L, True).keys() - hf_layout(layer_shapes, L, False).keys()
        return from_hf_tensors(layer_shapes, L, get, fused_experts=any(name in tensors for name in fused_only))

    P = len(m.block_pattern)
    stacked = []
    for i in range(P):
        layer_shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), shapes["blocks"]["layers"][i])
        per_block = [layer(n * P + i, layer_shapes) for n in range(m.n_blocks)]
        stacked.append(jax.tree.map(lambda *xs: np.stack(xs), *per_block))
    top = from_hf_tensors({"embed_VD": shapes["embed_VD"], "final_norm": shapes["final_norm"]}, "model.", get, False)
    params = {"embed_VD": top["embed_VD"], "final_norm": {"scale_D": final_norm_in(top["final_norm"]["scale_D"], m)},
              "blocks": {"layers": {i: w for i, w in enumerate(stacked)}}}
    # Multi-token-prediction layers (DeepSeek-V3's extra layers after the last) and an
    # untied lm_head copy are not next-token weights of this model.
    n_layers = m.n_blocks * P
    unused = [k for k in tensors if k not in used and k != "lm_head.weight"
              and not k.startswith(tuple(f"model.layers.{j}." for j in range(n_layers, n_layers + 8)))]
    if unused:
        raise ConfigError(f"the checkpoint has tensors this model has no place for, e.g. {unused[:3]}")
    return params


# ----------------------------------------------------------------------------
# Files


def read_safetensors(path):
    """{name: float32 numpy array} from model.safetensors or a sharded index."""
    from safetensors.numpy import load_file

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise ConfigError(f"hf:{path} has no model.safetensors (or model.safetensors.index.json)")
    tensors = {}
    for name in files:
        tensors |= load_file(os.path.join(path, name))
    return tensors


def load_params(path, params, m):
    """Weights of the HF directory `path` in the shardings of `params` (any mesh, any
    number of processes: each device takes its own slice of the host arrays)."""
    hf = read_hf_config(path)
    expected = from_hf_config(hf, m)
    diffs = [f"{k} {getattr(m, k)!r} vs {getattr(expected, k)!r}" for k in ARCH_FIELDS if getattr(m, k) != getattr(expected, k)]
    if diffs:
        raise ConfigError(f"the model config differs from hf:{path}'s ({'; '.join(diffs)})")
    host = from_hf_state(read_safetensors(path), m)
    targets, treedef = jax.tree_util.tree_flatten_with_path(params)

    def lookup(path_keys):
        node = host
        for key in path_keys:
            node = node[getattr(key, "key", getattr(key, "idx", None))]
        return node

    arrays = []
    for key_path, target in targets:
        value = lookup(key_path)
        if value.shape != target.shape:
            raise ConfigError(f"{jax.tree_util.keystr(key_path)}: checkpoint shape {value.shape}, model {target.shape}")
        arrays.append(jax.make_array_from_callback(target.shape, target.sharding, lambda index, v=value: v[index]))
    return jax.tree_util.tree_unflatten(treedef, arrays)


def tokenizer_json(tokenizer):
    """tokenizer.json (the `tokenizers` library's format, written out directly) for our
    byte tokenizer or a tiktoken encoding: byte-level BPE, ids = our ids."""
    byte_char = bytes_to_unicode()

    def text(token_bytes):
        return "".join(byte_char[b] for b in token_bytes)

    encoding = tokenizer._encoding
    if encoding is None:  # bytes: id = byte value, no merges, no split pattern
        vocab, merges, pre = {byte_char[b]: b for b in range(256)}, [], []
        specials = {"<|endoftext|>": tokenizer.eot_id}
    else:  # tiktoken: its ranks are its ids; merges as transformers' TikTokenConverter derives them
        ranks = encoding._mergeable_ranks
        vocab, merges = {text(t): r for t, r in ranks.items()}, []
        for token, rank in ranks.items():
            pairs = [(token[:j], token[j:]) for j in range(1, len(token)) if token[:j] in ranks and token[j:] in ranks]
            merges += [(ranks[a], ranks[b], rank, a, b) for a, b in pairs]
        merges = [[text(a), text(b)] for *_, a, b in sorted(merges, key=lambda x: (x[2], x[0], x[1]))]
        pre = [{"type": "Split", "pattern": {"Regex": encoding._pat_str}, "behavior": "Isolated", "invert": False}]
        specials = dict(encoding._special_tokens)
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for s, i in sorted(specials.items(), key=lambda x: x[1])],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": pre + [byte_level]},
        "post_processor": dict(byte_level, trim_offsets=False),
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": vocab, "merges": merges},
    }


def bytes_to_unicode():
    """GPT-2's map from the 256 byte values to printable characters (byte-level BPE)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def write_hf_dir(out_dir, params, m, tokenizer, dtype="float32"):
    """The whole export: config.json, model.safetensors, generation_config.json, the
    tokenizer (tokenizer.json + tokenizer_config.json) and, for a model no built-in
    transformers class computes, modeling_meshformer.py (config.json's auto_map names
    it). `params`: host arrays."""
    from safetensors.numpy import save_file

    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"--export.dtype must be one of {', '.join(EXPORT_DTYPES)}, got {dtype!r}")
    config = to_hf_config(m, tokenizer, dtype)
    state = to_hf_state(params, m, EXPORT_DTYPES[dtype])
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    V = config["vocab_size"]
    generation = {"eos_token_id": tokenizer.eot_id, "pad_token_id": tokenizer.eot_id,
                  # Padding rows of the vocabulary are never sampled here; nor there.
                  "suppress_tokens": list(range(tokenizer.vocab_size, V)) or None}
    for name, content in (("config.json", config), ("generation_config.json", generation)):
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(content, f, indent=2)
    if "auto_map" in config:
        shutil.copyfile(REMOTE_CODE, os.path.join(out_dir, os.path.basename(REMOTE_CODE)))
    write_tokenizer(out_dir, tokenizer, m.seq_len)
    return out_dir


def write_tokenizer(out_dir, tokenizer, max_length):
    """tokenizer.json + tokenizer_config.json, which AutoTokenizer loads (no tiktoken
    or transformers needed here to write them)."""
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                        "pad_token": "<|endoftext|>", "model_max_length": max_length, "clean_up_tokenization_spaces": False}
    with open(os.path.join(out_dir, "tokenizer.json"), "w") as f:
        json.dump(tokenizer_json(tokenizer), f, ensure_ascii=False)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config, f, indent=2)
