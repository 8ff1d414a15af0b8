"""Hugging Face config.json <-> our ModelConfig, both ways, for transformers'
DeepseekV3Config and DeepseekV2Config (and our remote code's MeshformerConfig).

Every field of those configs either maps to a ModelConfig field with the same meaning
(the table below), is a loader or training knob that does not change what the model
computes (IGNORED), or cannot be expressed here: a one-line ConfigError naming it.

  HF field                          ours
  hidden_size, num_attention_heads  d_model, n_heads
  qk_nope_head_dim (= v_head_dim)   head_dim
  qk_rope_head_dim                  rope_dim
  q_lora_rank (null: none)          q_latent (0: full-rank queries, HF q_proj)
  kv_lora_rank                      kv_latent
  intermediate_size                 d_ff
  num_hidden_layers,                first_dense dense layers, then n_blocks blocks of
    first_k_dense_replace           block_pattern "M" (our own export: its own grouping)
  n_routed_experts, n_shared_experts, moe_intermediate_size, num_experts_per_tok
                                    n_experts, n_shared, d_expert, top_k
  scoring_func                      router_score (DeepseekV3's class: sigmoid; V2's: softmax)
  topk_method noaux_tc / greedy     a router selection bias (router_bias) / none
  norm_topk_prob                    norm_topk
  routed_scaling_factor             routed_scale
  n_group, topk_group               n_groups, topk_groups (model.limit_to_top_groups is
                                    transformers' noaux_tc group selection: top-2 sums, -inf)
  rms_norm_eps                      norm_eps
  rope_theta                        rope_theta
  rope_scaling / rope_parameters    rope_scaling none | yarn, rope_factor, rope_original_len,
    (yarn)                          yarn_beta_fast, yarn_beta_slow, yarn_mscale, yarn_mscale_all_dim
  tie_word_embeddings               tie_embeddings
  vocab_size                        vocab_size (padded: our own export records the unpadded one)
  num_nextn_predict_layers          not read: DeepSeek-V3's MTP layer is an MoE layer, ours
                                    dense, so its weights are skipped (a one-line note)
"""

import dataclasses
import json
import math
import os

from model import has_router_bias, padded_vocab
from utils import HF_PREFIX, ConfigError, apply_overrides

ARCHITECTURES = {  # model_type -> (class, the router score it computes; None: config.json's scoring_func)
    "deepseek_v3": ("DeepseekV3ForCausalLM", "sigmoid"),
    "deepseek_v2": ("DeepseekV2ForCausalLM", "softmax"),
    "mistral4": ("Mistral4ForCausalLM", "softmax"),  # imported, never exported (not in AutoModelForCausalLM)
    "meshformer": ("MeshformerForCausalLM", None),  # remote code: REMOTE_CODE, written beside the weights
}
REMOTE_CODE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "modeling_meshformer.py")
MLP_LAYER_TYPES = {"D": "dense", "M": "sparse"}  # our layer kinds -> transformers' mlp_layer_types
# Fields of our ModelConfig that no HF field carries, kept in config.json under this key
# so that our own export imports back as exactly the model it came from.
OURS_KEY = "meshformer"
OURS_FIELDS = ("vocab_size", "vocab_multiple", "first_dense", "n_blocks", "block_pattern", "final_norm_folded")
YARN_FIELDS = {  # ours -> HF's rope_parameters key (transformers' defaults where it has them)
    "rope_factor": "factor", "rope_original_len": "original_max_position_embeddings", "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow", "yarn_mscale": "mscale", "yarn_mscale_all_dim": "mscale_all_dim"}
# The config.json fields from_hf_config reads (each maps to ours, or is refused by name).
READ = ("model_type", "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "qk_nope_head_dim",
        "qk_rope_head_dim", "v_head_dim", "q_lora_rank", "kv_lora_rank", "intermediate_size", "hidden_act", "attention_bias",
        "mlp_bias", "rope_interleave", "rope_theta", "rope_scaling", "rope_parameters", "rms_norm_eps", "tie_word_embeddings",
        "num_hidden_layers", "first_k_dense_replace", "moe_layer_freq", "mlp_layer_types", "n_routed_experts",
        "n_shared_experts", "moe_intermediate_size", "num_experts_per_tok", "scoring_func", "topk_method", "norm_topk_prob",
        "routed_scaling_factor", "n_group", "topk_group", "quantization_config", OURS_KEY)
# Fields that do not change what the model computes: loaders' and trainers' knobs, values
# transformers derives from the fields above (head_dim = qk_rope_head_dim, qk_head_dim),
# and PretrainedConfig's own. Any other field is refused by name: it may be a feature
# this model does not have (DeepSeek-V3.2's index_topk, sparse attention).
IGNORED = ("architectures", "auto_map", "aux_loss_alpha", "seq_aux", "ep_size", "pretraining_tp", "use_cache",
           "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "dtype", "transformers_version",
           "initializer_range", "attention_dropout", "max_position_embeddings", "num_nextn_predict_layers", "head_dim",
           "qk_head_dim", "output_router_logits", "_name_or_path", "chunk_size_feed_forward", "id2label", "label2id",
           "is_encoder_decoder", "output_attentions", "output_hidden_states", "problem_type", "return_dict")
# The architecture: what an HF directory decides (adopt_hf_config), and what must match it.
ARCH_FIELDS = ("vocab_size", "vocab_multiple", "d_model", "n_heads", "head_dim", "rope_dim", "q_latent", "kv_latent",
               "rope_theta", "first_dense", "n_blocks", "block_pattern", "d_ff", "ffn_activation", "n_experts", "n_shared",
               "top_k", "d_expert", "router_score", "router_bias", "norm_topk", "routed_scale", "n_groups", "topk_groups",
               "norm_eps", "tie_embeddings", "rope_scaling", *YARN_FIELDS, "final_norm_folded")


def hf_dir(init_from):
    """The directory of --train.init_from hf:DIR, or None for other sources."""
    return init_from[len(HF_PREFIX):] if init_from.startswith(HF_PREFIX) else None


def layer_kinds(m):
    """The whole stack, layer by layer: e.g. "DMDM" for 2 blocks of "DM", "DMMM" for
    one dense prefix layer and 3 blocks of "M"."""
    return "D" * m.first_dense + m.block_pattern * m.n_blocks


# ---- Ours -> HF


def check_exportable(m):
    """Raise ConfigError for a model HF's classes cannot express, saying what would export.
    Every layer layout and router exports (architecture_of picks the class)."""
    kinds = layer_kinds(m)
    if "D" in kinds and m.ffn_activation != "swiglu":
        raise ConfigError(f"--model.ffn_activation {m.ffn_activation}: HF's DeepseekV3 dense layers are SwiGLU; "
                          "train with --model.ffn_activation swiglu to export")
    if "M" in kinds and m.n_experts < 2:
        raise ConfigError("--model.n_experts must be >= 2 to export: HF's router ranks experts in groups of at least 2")


def architecture_of(m):
    """(model_type, class) of the export: the built-in transformers class that computes
    this layout and router, else our remote code (hf_interop's docstring). A model
    without MoE layers has no router: deepseek_v3.

    DeepseekV3 puts dense layers only first and scores with a sigmoid (selection bias,
    groups, norm_topk_prob, routed_scaling_factor: all V3's). DeepseekV2 scores with a
    softmax and never renormalises (gates: score x routed_scaling_factor), has no
    selection bias, and limits groups by their best score, not V3's top-2 sum."""
    kinds = layer_kinds(m)
    dense_first = "D" not in kinds.lstrip("D")
    raw_gates = not m.norm_topk or m.top_k == 1
    if "M" not in kinds or (dense_first and m.router_score == "sigmoid"):
        model_type = "deepseek_v3"
    elif dense_first and m.router_score == "softmax" and raw_gates and m.n_groups == 1 and not has_router_bias(m):
        model_type = "deepseek_v2"
    else:
        model_type = "meshformer"
    return model_type, ARCHITECTURES[model_type][0]


def rope_parameters(m):
    """transformers' rope_parameters for ours: default, or YaRN with every field stated."""
    rope = {"rope_type": m.rope_scaling if m.rope_scaling == "yarn" else "default", "rope_theta": m.rope_theta}
    if m.rope_scaling == "yarn":
        rope |= {hf: getattr(m, ours) for ours, hf in YARN_FIELDS.items()}
        rope["type"] = "yarn"  # DeepSeek's own key, which vLLM's deepseek_yarn reads
    return rope


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
        q_lora_rank=m.q_latent or None, kv_lora_rank=m.kv_latent,
        qk_nope_head_dim=m.head_dim, qk_rope_head_dim=m.rope_dim, v_head_dim=m.head_dim,
        rope_interleave=True, attention_bias=False, attention_dropout=0.0,
        n_routed_experts=m.n_experts, n_shared_experts=m.n_shared, moe_intermediate_size=m.d_expert,
        num_experts_per_tok=m.top_k,
        # With one expert, our gate is its raw score: HF's renormalisation would make it 1.
        norm_topk_prob=m.norm_topk and m.top_k > 1, routed_scaling_factor=m.routed_scale,
        n_group=m.n_groups, topk_group=m.topk_groups,
        # Every routing field DeepSeek's own config.json states, so that a loader that
        # reads them with other defaults (vLLM: getattr(config, "scoring_func",
        # "softmax"), layer_idx % moe_layer_freq) routes as we do. noaux_tc: top k of the
        # score plus e_score_correction_bias (ours, or zeros); greedy: top k of the score.
        scoring_func=score, topk_method="greedy" if model_type == "deepseek_v2" else "noaux_tc",
        moe_layer_freq=1, rope_theta=m.rope_theta, rope_parameters=rope_parameters(m),
        max_position_embeddings=m.seq_len, rms_norm_eps=m.norm_eps, tie_word_embeddings=m.tie_embeddings,
        bos_token_id=None, eos_token_id=tokenizer.eot_id, pad_token_id=None, use_cache=True,
        initializer_range=0.02,
    )
    if model_type == "deepseek_v2":
        config["mlp_bias"] = False
    else:
        config["num_nextn_predict_layers"] = 0
    if model_type == "meshformer":  # modeling_meshformer.py: DeepseekV3 with any layer layout and router
        stem = os.path.splitext(os.path.basename(REMOTE_CODE))[0]
        config.update(auto_map={"AutoConfig": f"{stem}.MeshformerConfig", "AutoModelForCausalLM": f"{stem}.MeshformerForCausalLM"},
                      mlp_layer_types=[MLP_LAYER_TYPES[kind] for kind in kinds])
    # (router_bias: whether the exported model had a bias, trained or frozen; without one
    # its zeros are not imported as one)
    config[OURS_KEY] = {k: getattr(m, k) for k in OURS_FIELDS} | {"router_bias": has_router_bias(m)}
    return config


# ---- HF -> ours


def hf_rope(hf):
    """(the field it came from, its dict) as transformers reads it
    (PreTrainedConfig.convert_rope_params_to_dict): the legacy `rope_scaling`
    (transformers 4.x's and DeepSeek's own configs) wins over `rope_parameters`, and
    rope_theta may sit beside it at the top level."""
    field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rope = dict(hf.get(field) or {"rope_type": "default"})
    rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    return field, rope


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

    unknown = sorted(set(hf) - set(READ) - set(IGNORED))
    need(not unknown, unknown[0] if unknown else "", "a field this importer does not know: the checkpoint may compute "
         "something this model cannot (ask for it in an issue)")
    need(not hf.get("quantization_config"), "quantization_config", "weights are read as float32/bfloat16 here; convert "
         "the FP8 checkpoint to bfloat16 first (DeepSeek-V3's inference/fp8_cast_bf16.py)")
    need(hf.get("v_head_dim") == hf["qk_nope_head_dim"], "v_head_dim", f"values here are as wide as the key content part "
         f"(qk_nope_head_dim = {hf['qk_nope_head_dim']})")
    need(hf.get("num_key_value_heads", hf["num_attention_heads"]) == hf["num_attention_heads"], "num_key_value_heads",
         "MLA here has one key/value head per query head")
    need(hf.get("hidden_act", "silu") == "silu", "hidden_act", "experts and dense layers here are SwiGLU (silu)")
    need(not hf.get("attention_bias", False), "attention_bias", "projections here have no bias")
    need(not hf.get("mlp_bias", False), "mlp_bias", "projections here have no bias")
    need(hf.get("rope_interleave", True), "rope_interleave", "RoPE here rotates interleaved pairs (x[2i], x[2i+1])")
    need(hf.get("moe_layer_freq", 1) == 1, "moe_layer_freq", "after the first_k_dense_replace dense layers every layer "
         "here is an MoE layer (give the layout as mlp_layer_types, our remote code's field)")
    new = rope_fields(hf, model_type, need)
    kinds, new = layout(hf, model_type, need, new)
    ours = hf.get(OURS_KEY, {})
    if "M" in kinds:
        new |= routing_fields(hf, model_type, need)
        new["router_bias"] = ours.get("router_bias", new["router_bias"])  # our own export says whether it had one
    vocab, multiple = hf["vocab_size"], math.gcd(hf["vocab_size"], m.vocab_multiple)
    if ours and padded_vocab(ours.get("vocab_size", 0), ours.get("vocab_multiple", 1)) == hf["vocab_size"]:
        vocab, multiple = ours["vocab_size"], ours["vocab_multiple"]  # the padding rows stay padding
    q_latent = hf.get("q_lora_rank") or 0
    new |= dict(
        vocab_size=vocab, vocab_multiple=multiple, d_model=hf["hidden_size"], n_heads=hf["num_attention_heads"],
        head_dim=hf["qk_nope_head_dim"], rope_dim=hf["qk_rope_head_dim"], q_latent=q_latent,
        kv_latent=hf["kv_lora_rank"], d_ff=hf.get("intermediate_size", m.d_ff), ffn_activation="swiglu",
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        # HF's norm weight kept as it is, bit for bit (times 1/sqrt(D) it would not map
        # back); our own export says which way its model had it.
        final_norm_folded=ours.get("final_norm_folded", not ours))
    return dataclasses.replace(m, **new)


def rope_fields(hf, model_type, need):
    field, rope = hf_rope(hf)
    new = dict(rope_theta=float(rope["rope_theta"]), rope_scaling="none")
    kind = rope["rope_type"]
    if model_type == "mistral4":
        need(kind in ("default", "linear") and rope.get("factor", 1.0) == 1.0 and not rope.get("llama_4_scaling_beta"),
             field, "RoPE here is unscaled or YaRN (no linear scaling, no llama-4 query scaling)")
        return new
    need(kind in ("default", "yarn"), field, f"rope_type {kind!r}: RoPE here is unscaled or YaRN")
    if kind == "yarn":
        need(rope.get("factor") and rope.get("original_max_position_embeddings"), field,
             "YaRN here needs factor and original_max_position_embeddings")
        need(rope.get("truncate", True) and rope.get("attention_factor") is None, field,
             "YaRN here is transformers' default: truncate true, attention_factor from mscale / mscale_all_dim")
        new |= dict(rope_scaling="yarn", rope_factor=float(rope["factor"]),
                    rope_original_len=int(rope["original_max_position_embeddings"]),
                    yarn_beta_fast=float(rope.get("beta_fast") or 32), yarn_beta_slow=float(rope.get("beta_slow") or 1),
                    yarn_mscale=float(rope.get("mscale") or 0), yarn_mscale_all_dim=float(rope.get("mscale_all_dim") or 0))
    return new


def layout(hf, model_type, need, new):
    """(layer kinds, `new` with first_dense, n_blocks, block_pattern): our own export's
    grouping when config.json records it, else the dense prefix and one MoE layer per
    block (so that the pipeline can split the MoE stack anywhere)."""
    L, k = hf["num_hidden_layers"], hf.get("first_k_dense_replace") or 0
    kinds = "D" * k + "M" * (L - k)
    if model_type == "meshformer":  # our remote code: any layout, either score
        by_type = {v: kind for kind, v in MLP_LAYER_TYPES.items()}
        layer_types = hf.get("mlp_layer_types") or []
        need(len(layer_types) == L and all(t in by_type for t in layer_types), "mlp_layer_types",
             f"one of {', '.join(by_type)} per layer ({L} layers)")
        kinds = "".join(by_type[t] for t in layer_types)
    ours = hf.get(OURS_KEY, {})
    dense = len(kinds) - len(kinds.lstrip("D"))
    if ours and "D" * ours.get("first_dense", 0) + ours.get("block_pattern", "") * ours.get("n_blocks", 0) == kinds:
        grouping = (ours.get("first_dense", 0), ours["n_blocks"], ours["block_pattern"])  # our own export: the same grouping
    elif len(set(kinds[dense:])) == 1:
        grouping = (dense, L - dense, "M")  # dense prefix, then one MoE layer per block
    elif len(set(kinds)) == 1:
        grouping = (0, L, kinds[0])  # all dense
    else:
        grouping = (0, 1, kinds)  # any other layout: one block
    if set(kinds) == {"D"}:
        grouping = (0, L, "D")
    return kinds, dict(new, first_dense=grouping[0], n_blocks=grouping[1], block_pattern=grouping[2])


def routing_fields(hf, model_type, need):
    """The MoE fields: experts, score, selection bias, gate normalisation, scale, groups."""
    top_k, n_experts = hf["num_experts_per_tok"], hf["n_routed_experts"]
    score = ARCHITECTURES[model_type][1] or hf.get("scoring_func", "softmax")
    if ARCHITECTURES[model_type][1]:
        need(hf.get("scoring_func", score) == score, "scoring_func", f"{model_type}'s class in transformers scores "
             f"experts with a {score}; a config that says otherwise is read one way by transformers, another by vLLM")
    else:
        need(score in ("softmax", "sigmoid"), "scoring_func", "routers here score with a softmax or a sigmoid")
    groups = (hf.get("n_group") or 1, hf.get("topk_group") or 1)
    if model_type == "deepseek_v2":  # softmax gates, never renormalised, no selection bias
        method = hf.get("topk_method", "greedy")
        need(method == "greedy", "topk_method", "group-limited routing here ranks a group by its two best scores "
             "(DeepSeek-V3's noaux_tc), not by its best (V2's group_limited_greedy)")
        norm_topk, bias, groups = False, False, (1, 1)  # greedy ignores n_group
    else:  # DeepseekV3's router: score + e_score_correction_bias selects, groups by top-2 sums
        need(hf.get("topk_method", "noaux_tc") in ("noaux_tc", "greedy"), "topk_method",
             "transformers' DeepseekV3 routes noaux_tc (score + e_score_correction_bias, groups by their top-2 sum)")
        norm_topk, bias = bool(hf.get("norm_topk_prob", True)), model_type != "mistral4"  # (Mistral4's has no bias)
        need(not (norm_topk and top_k == 1), "norm_topk_prob", "with one expert per token a renormalised gate is 1; "
             "gates here are the raw score then")
    need(n_experts % groups[0] == 0 and (groups[0] == 1 or n_experts // groups[0] >= 2), "n_group",
         f"expert groups here split {n_experts} experts evenly, at least 2 per group")
    need(1 <= groups[1] <= groups[0], "topk_group", f"between 1 and n_group ({groups[0]})")
    return dict(n_experts=n_experts, n_shared=hf.get("n_shared_experts") or 0, top_k=top_k,
                d_expert=hf["moe_intermediate_size"], router_score=score, router_bias=bias, norm_topk=norm_topk,
                routed_scale=float(hf.get("routed_scaling_factor") or 1.0), n_groups=groups[0], topk_groups=groups[1])


def read_hf_config(path):
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ConfigError(f"--train.init_from hf:{path}: no config.json there; give a Hugging Face model directory "
                          "(DeepseekV3 format, e.g. from --mode export_hf)")
    with open(config_path) as f:
        return json.load(f)


def adopt_hf_config(cfg, hf):
    """cfg with the model architecture of config.json `hf` (a dict; training-time fields,
    such as seq_len, dtype and capacity_factor, stay as configured)."""
    model = from_hf_config(hf, cfg.model)
    return apply_overrides(cfg, {"model": {k: getattr(model, k) for k in ARCH_FIELDS}})
