"""Hugging Face interop: this model <-> a transformers checkpoint directory.

The model here is arithmetically a DeepSeek-V3 (MLA attention with decoupled RoPE,
shared + routed SwiGLU experts, RMSNorm, tied embedding), so a run leaves the repo as a
directory that transformers loads with its own, built-in classes (no remote code),
through `AutoModelForCausalLM.from_pretrained` for the first two rows:

  router_score sigmoid (or no MoE layer) -> deepseek_v3 (DeepseekV3ForCausalLM, AutoModelForCausalLM)
  router_score softmax, top_k 1           -> deepseek_v2 (DeepseekV2ForCausalLM, AutoModelForCausalLM)
  router_score softmax, top_k > 1         -> mistral4    (Mistral4ForCausalLM; not AutoModelForCausalLM)

Why three: transformers' DeepseekV3 router always scores experts with a sigmoid. Its
DeepseekV2 scores with a softmax but never renormalises the top k (its router deletes
norm_topk_prob: gate = softmax score x routed_scaling_factor), which is ours only when
k = 1, where our gate is the raw score too. Its Mistral4 is the same architecture (MLA,
shared experts, dense-first layers) with softmax scores renormalised over the top k,
exactly this repo's softmax router, but transformers 5.24 maps it to
AutoModelForImageTextToText, not AutoModelForCausalLM.

How the pieces map (ours -> HF, per layer l = block n x len(pattern) + position i):

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

Layers: HF puts dense layers only first (`first_k_dense_replace`). Our model stacks
n_blocks copies of one block pattern, so the layouts that export are: every layer dense
(pattern of D), every layer MoE (pattern of M), or one block whose pattern is D...DM...M.
"""

import dataclasses
import json
import math
import os
import shutil

import jax
import ml_dtypes
import numpy as np

from model import padded_vocab
from utils import ConfigError, apply_overrides

HF_PREFIX = "hf:"
ARCHITECTURES = {  # model_type -> (class, the router score it computes); see architecture_of
    "deepseek_v3": ("DeepseekV3ForCausalLM", "sigmoid"),
    "deepseek_v2": ("DeepseekV2ForCausalLM", "softmax"),
    "mistral4": ("Mistral4ForCausalLM", "softmax"),
}
RMS_EPS = 1e-6  # model.RMSNorm's
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


def check_exportable(m):
    """Raise ConfigError for a model HF's classes cannot express, saying what would export."""
    kinds = layer_kinds(m)
    n_dense = len(kinds) - len(kinds.lstrip("D"))
    if "D" in kinds[n_dense:]:
        L = len(kinds)
        raise ConfigError(
            f"the layers are {kinds} (--model.n_blocks {m.n_blocks} x --model.block_pattern {m.block_pattern}); "
            f"HF's DeepseekV3 puts dense layers only first (first_k_dense_replace), so this model cannot be exported. "
            f"Layouts that export: --model.block_pattern M (every layer MoE) or D (every layer dense) with any "
            f"--model.n_blocks, or --model.n_blocks 1 --model.block_pattern {'D' * kinds.count('D') + 'M' * kinds.count('M')} "
            f"(the same {L} layers, dense first)")
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
        scoring_func=ARCHITECTURES[model_type][1], topk_method="noaux_tc" if model_type == "deepseek_v3" else "greedy",
        moe_layer_freq=1, rope_theta=m.rope_theta,
        max_position_embeddings=m.seq_len, rms_norm_eps=RMS_EPS, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=tokenizer.eot_id, pad_token_id=None, use_cache=True,
        initializer_range=0.02,
    )
    if model_type == "deepseek_v3":
        config.update(rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
                      num_nextn_predict_layers=0)
    elif model_type == "deepseek_v2":  # "default" RoPE spans head_dim, which its config sets to qk_rope_head_dim
        config.update(rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta}, mlp_bias=False)
    else:
        # Mistral4's "default" RoPE would take its frequencies over the whole head (K + R);
        # "linear" with factor 1 honours partial_rotary_factor, i.e. spans the R RoPE dims
        # only, and changes nothing else. llama_4_scaling_beta 0: no position-dependent
        # query scale.
        config["rope_parameters"] = {"rope_type": "linear", "factor": 1.0, "rope_theta": m.rope_theta,
                                     "partial_rotary_factor": rope_fraction(m.head_dim, m.rope_dim),
                                     "llama_4_scaling_beta": 0.0, "original_max_position_embeddings": m.seq_len}
    config[OURS_KEY] = {k: getattr(m, k) for k in OURS_FIELDS}
    return config


def architecture_of(m):
    """(model_type, class) of the export: the one transformers class that computes this
    router (module docstring). A model without MoE layers has no router: deepseek_v3."""
    if "M" not in layer_kinds(m) or m.router_score == "sigmoid":
        model_type = "deepseek_v3"
    else:
        model_type = "deepseek_v2" if m.top_k == 1 else "mistral4"
    return model_type, ARCHITECTURES[model_type][0]


def rope_fraction(head_dim, rope_dim):
    """partial_rotary_factor p with int((K + R) * p) == R exactly (transformers truncates)."""
    p = rope_dim / (head_dim + rope_dim)
    while int((head_dim + rope_dim) * p) < rope_dim:
        p = math.nextafter(p, 1.0)
    return p


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
    moe = k < L
    if moe:
        top_k = hf["num_experts_per_tok"]
        score = ARCHITECTURES[model_type][1]
        need(hf.get("scoring_func", score) == score, "scoring_func", f"{model_type}'s class in transformers scores "
             f"experts with a {score}; a config that says otherwise is read one way by transformers, another by vLLM")
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
    kinds = "D" * k + "M" * (L - k)
    ours = hf.get(OURS_KEY, {})
    if ours and ours.get("block_pattern", "") * ours.get("n_blocks", 0) == kinds:
        n_blocks, pattern = ours["n_blocks"], ours["block_pattern"]  # our own export: the same grouping
    elif k in (0, L):
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
        router_score=ARCHITECTURES[model_type][1],
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


def to_hf_state(params, m, dtype=np.float32):
    """{HF name: array} from our params (a pure dict of host arrays, the stacked blocks'
    leading axis N included). Per-expert names (experts.{e}.gate_proj...) for
    deepseek_v3 and deepseek_v2, as DeepSeek's own checkpoints and vLLM/SGLang have them;
    mistral4's fused expert tensors, as its transformers class stores them."""
    check_exportable(m)
    H, K, R, Q, A, D = m.n_heads, m.head_dim, m.rope_dim, m.q_latent, m.kv_latent, m.d_model
    model_type = architecture_of(m)[0]
    fused_experts = model_type == "mistral4"
    out = {"model.embed_tokens.weight": params["embed_VD"]}
    P = len(m.block_pattern)
    for n in range(m.n_blocks):
        for i, kind in enumerate(m.block_pattern):
            w = jax.tree.map(lambda a: np.asarray(a[n]), params["blocks"]["layers"][i])
            at = w["attn"]
            L = f"model.layers.{n * P + i}."
            out |= {
                L + "input_layernorm.weight": w["attn_norm"]["scale_D"],
                L + "post_attention_layernorm.weight": w["ffn_norm"]["scale_D"],
                L + "self_attn.q_a_proj.weight": at["wq_down_DQ"].T,
                L + "self_attn.q_a_layernorm.weight": at["q_norm"]["scale_D"],
                L + "self_attn.q_b_proj.weight": np.concatenate([at["wq_up_QHK"], at["wq_rope_QHR"]], -1).reshape(Q, H * (K + R)).T,
                L + "self_attn.kv_a_proj_with_mqa.weight": np.concatenate([at["wkv_down_DA"], at["wk_rope_DR"]], 1).T,
                L + "self_attn.kv_a_layernorm.weight": at["kv_norm"]["scale_D"],
                L + "self_attn.kv_b_proj.weight": np.concatenate([at["wk_up_AHK"], at["wv_up_AHK"]], -1).reshape(A, H * 2 * K).T,
                L + "self_attn.o_proj.weight": at["wo_HKD"].reshape(H * K, D).T,
            }
            f = w["ffn"]
            if kind == "D":
                out |= {L + "mlp.gate_proj.weight": f["w_gate_DF"].T, L + "mlp.up_proj.weight": f["w_up_DF"].T,
                        L + "mlp.down_proj.weight": f["w_down_FD"].T}
                continue
            out[L + "mlp.gate.weight"] = f["router_DE"].T
            if model_type == "deepseek_v3":  # selection bias (ours would be router_bias_rate > 0, refused above)
                out[L + "mlp.gate.e_score_correction_bias"] = np.zeros((m.n_experts,), np.float32)
            if not fused_experts:
                for e in range(m.n_experts):
                    E = f"{L}mlp.experts.{e}."
                    out |= {E + "gate_proj.weight": f["w_gate_EDF"][e].T, E + "up_proj.weight": f["w_up_EDF"][e].T,
                            E + "down_proj.weight": f["w_down_EFD"][e].T}
            else:
                out[L + "mlp.experts.gate_up_proj"] = np.concatenate([f["w_gate_EDF"], f["w_up_EDF"]], -1).transpose(0, 2, 1)
                out[L + "mlp.experts.down_proj"] = f["w_down_EFD"].transpose(0, 2, 1)
            shared = f.get("shared") or {"w_gate_DF": np.zeros((D, 0), np.float32), "w_up_DF": np.zeros((D, 0), np.float32),
                                         "w_down_FD": np.zeros((0, D), np.float32)}
            out |= {L + "mlp.shared_experts.gate_proj.weight": shared["w_gate_DF"].T,
                    L + "mlp.shared_experts.up_proj.weight": shared["w_up_DF"].T,
                    L + "mlp.shared_experts.down_proj.weight": shared["w_down_FD"].T}
    out["model.norm.weight"] = final_norm_out(params["final_norm"]["scale_D"], m, dtype)
    return {k: np.ascontiguousarray(np.asarray(v, np.float32).astype(dtype)) for k, v in out.items()}


def from_hf_state(tensors, m):
    """Our params (pure dict of float32 numpy arrays, stacked blocks) from an HF state
    dict; the inverse of `to_hf_state`. Accepts per-expert and fused expert tensors."""
    H, K, R, Q, A, D = m.n_heads, m.head_dim, m.rope_dim, m.q_latent, m.kv_latent, m.d_model
    used = set()

    def get(name):
        if name not in tensors:
            raise ConfigError(f"the checkpoint has no tensor {name}: is it the model its config.json describes?")
        used.add(name)
        return np.asarray(tensors[name], np.float32)

    def layer(l, kind):
        L = f"model.layers.{l}."
        q_b = get(L + "self_attn.q_b_proj.weight").T.reshape(Q, H, K + R)
        kv_a = get(L + "self_attn.kv_a_proj_with_mqa.weight").T
        kv_b = get(L + "self_attn.kv_b_proj.weight").T.reshape(A, H, 2 * K)
        w = {"attn_norm": {"scale_D": get(L + "input_layernorm.weight")},
             "ffn_norm": {"scale_D": get(L + "post_attention_layernorm.weight")},
             "attn": {"wq_down_DQ": get(L + "self_attn.q_a_proj.weight").T,
                      "q_norm": {"scale_D": get(L + "self_attn.q_a_layernorm.weight")},
                      "wq_up_QHK": q_b[..., :K], "wq_rope_QHR": q_b[..., K:],
                      "wkv_down_DA": kv_a[:, :A], "wk_rope_DR": kv_a[:, A:],
                      "kv_norm": {"scale_D": get(L + "self_attn.kv_a_layernorm.weight")},
                      "wk_up_AHK": kv_b[..., :K], "wv_up_AHK": kv_b[..., K:],
                      "wo_HKD": get(L + "self_attn.o_proj.weight").T.reshape(H, K, D)}}
        if kind == "D":
            w["ffn"] = {"w_gate_DF": get(L + "mlp.gate_proj.weight").T, "w_up_DF": get(L + "mlp.up_proj.weight").T,
                        "w_down_FD": get(L + "mlp.down_proj.weight").T}
            return w
        bias = L + "mlp.gate.e_score_correction_bias"
        if bias in tensors:
            if np.any(get(bias) != 0):
                raise ConfigError(f"cannot import: {bias} is not zero: selecting experts with a score bias "
                                  "(DeepSeek-V3's aux-loss-free balancing) is not in this model yet")
        if L + "mlp.experts.gate_up_proj" in tensors:
            gate_up = get(L + "mlp.experts.gate_up_proj").transpose(0, 2, 1)
            F = gate_up.shape[-1] // 2
            gate, up, down = gate_up[..., :F], gate_up[..., F:], get(L + "mlp.experts.down_proj").transpose(0, 2, 1)
        else:
            E = range(m.n_experts)
            gate = np.stack([get(f"{L}mlp.experts.{e}.gate_proj.weight").T for e in E])
            up = np.stack([get(f"{L}mlp.experts.{e}.up_proj.weight").T for e in E])
            down = np.stack([get(f"{L}mlp.experts.{e}.down_proj.weight").T for e in E])
        w["ffn"] = {"router_DE": get(L + "mlp.gate.weight").T, "w_gate_EDF": gate, "w_up_EDF": up, "w_down_EFD": down}
        if m.n_shared:
            w["ffn"]["shared"] = {"w_gate_DF": get(L + "mlp.shared_experts.gate_proj.weight").T,
                                  "w_up_DF": get(L + "mlp.shared_experts.up_proj.weight").T,
                                  "w_down_FD": get(L + "mlp.shared_experts.down_proj.weight").T}
        return w

    P = len(m.block_pattern)
    layers = [[layer(n * P + i, kind) for n in range(m.n_blocks)] for i, kind in enumerate(m.block_pattern)]
    stacked = [jax.tree.map(lambda *xs: np.stack(xs), *per_block) for per_block in layers]
    embed = get("model.embed_tokens.weight")
    V = padded_vocab(m.vocab_size, m.vocab_multiple)
    if embed.shape[0] != V:
        raise ConfigError(f"the checkpoint's embedding has {embed.shape[0]} rows, the model {V}")
    params = {"embed_VD": embed, "final_norm": {"scale_D": final_norm_in(tensors["model.norm.weight"], m)},
              "blocks": {"layers": {i: w for i, w in enumerate(stacked)}}}
    used.add("model.norm.weight")
    # Multi-token-prediction layers (DeepSeek-V3's extra layers after the last) and an
    # untied lm_head copy are not next-token weights of this model.
    n_layers = m.n_blocks * P
    unused = [k for k in tensors if k not in used and k != "lm_head.weight"
              and not k.startswith(tuple(f"model.layers.{l}." for l in range(n_layers, n_layers + 8)))]
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
    """The whole export: config.json, model.safetensors, generation_config.json and the
    tokenizer (tokenizer.json + tokenizer_config.json). `params`: host arrays."""
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
