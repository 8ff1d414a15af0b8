"""Real DeepSeek-family checkpoints in and out: DeepSeek-V3, DeepSeek-V2-Lite and
Moonlight-16B-A3B, each as its config.json has every field (REAL_CONFIGS), scaled down
only in width, depth, expert count and vocabulary (SMALL), randomly initialised by
transformers (a non-zero e_score_correction_bias, an untied head) and saved over several
safetensors files. Each imports with transformers' logits (also past YaRN's original
context), trains on a mesh as on one device, and exports back to a directory transformers
loads with our logits.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

from hf import convert as hf_interop  # noqa: E402
from hf.safetensors_reader import INDEX  # noqa: E402
from model import Transformer  # noqa: E402
from parallel import optimizers  # noqa: E402
from parallel.mesh import check_config_fits_mesh, global_batch, named  # noqa: E402
from parallel.steps import make_train_step  # noqa: E402
from parallel.weights import param_specs  # noqa: E402
from test_hf import BYTES, load_hf  # noqa: E402
from test_parallel import assert_same_steps, mesh_for, token_batch  # noqa: E402
from utils import PRESETS, Config, apply_overrides  # noqa: E402

# config.json as published (huggingface.co: deepseek-ai/DeepSeek-V3, deepseek-ai/DeepSeek-V2-Lite,
# moonshotai/Moonlight-16B-A3B), every field.
REAL_CONFIGS = {
    "DeepSeek-V3": {
        "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config", "AutoModel": "modeling_deepseek.DeepseekV3Model",
                     "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
        "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
        "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
        "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048, "moe_layer_freq": 1,
        "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
        "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
        "pretraining_tp": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]},
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
        "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
        "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280},
    "DeepSeek-V2-Lite": {
        "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV2Config", "AutoModel": "modeling_deepseek.DeepseekV2Model",
                     "AutoModelForCausalLM": "modeling_deepseek.DeepseekV2ForCausalLM"},
        "aux_loss_alpha": 0.001, "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1,
        "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 10944, "kv_lora_rank": 512,
        "max_position_embeddings": 163840, "model_type": "deepseek_v2", "moe_intermediate_size": 1408, "moe_layer_freq": 1,
        "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 16,
        "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16, "pretraining_tp": 1,
        "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True,
        "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16",
        "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 102400},
    "Moonlight-16B-A3B": {
        "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config", "AutoModel": "modeling_deepseek.DeepseekV3Model",
                     "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
        "aux_loss_alpha": 0.001, "bos_token_id": 163584, "eos_token_id": 163585, "ep_size": 1, "first_k_dense_replace": 1,
        "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 11264, "kv_lora_rank": 512,
        "max_position_embeddings": 8192, "model_type": "deepseek_v3", "moe_intermediate_size": 1408, "moe_layer_freq": 1,
        "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": True, "num_attention_heads": 16,
        "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16, "num_nextn_predict_layers": 0,
        "pretraining_tp": 1, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05,
        "rope_scaling": None, "rope_theta": 50000.0, "routed_scaling_factor": 2.446, "scoring_func": "sigmoid", "seq_aux": True,
        "tie_word_embeddings": False, "topk_group": 1, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
        "transformers_version": "4.48.0", "use_cache": True, "v_head_dim": 128, "vocab_size": 163840},
}
# Scaled down in width, depth (the dense prefix kept, 2 MoE layers: one per stage at pp 2),
# expert count and vocabulary only; YaRN's factor and original context stay.
WIDTHS = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, qk_nope_head_dim=16, qk_rope_head_dim=16,
              v_head_dim=16, kv_lora_rank=32, intermediate_size=64, moe_intermediate_size=16, vocab_size=512)
SMALL = {
    "DeepSeek-V3": dict(WIDTHS, q_lora_rank=48, num_hidden_layers=5, n_routed_experts=32),  # 8 groups of 4, top 8 in the best 4
    "DeepSeek-V2-Lite": dict(WIDTHS, num_hidden_layers=3, n_routed_experts=8),
    "Moonlight-16B-A3B": dict(WIDTHS, num_hidden_layers=3, n_routed_experts=8),
}
# transformers' class for each, and what it needs said that DeepSeek's config.json says
# only to DeepSeek's own code.
CLASSES = {"deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"), "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM")}
SHARD = "60KB"
HEAD_SCALE = 0.3
MODELS = list(REAL_CONFIGS)


def small_config(name):
    """The real config.json, scaled down, without its quantization_config: these weights
    are float32, not DeepSeek-V3's FP8 blocks (hf_config refuses FP8: convert to bf16)."""
    config = dict(REAL_CONFIGS[name], **SMALL[name])
    config.pop("quantization_config", None)
    return config


def make_checkpoint(name, path, seed=0):
    """(transformers model, path): the model drawn at scales where every weight matters,
    a non-zero selection bias, saved over several files with config.json the real one's."""
    config = small_config(name)
    config_class, model_class = CLASSES[config["model_type"]]
    hf_cfg = getattr(transformers, config_class)(**{k: v for k, v in config.items() if k != "auto_map"})
    torch.manual_seed(seed)
    hf = getattr(transformers, model_class)(hf_cfg)
    with torch.no_grad():
        for key, p in hf.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if p.ndim == 1 else torch.randn_like(p) / p.shape[-1] ** 0.5)
        # Logits of order 1 (at the head's full scale they reach 5, where float32's own
        # noise through 5 layers, ~3e-6 of the logit on either side, is past 1e-5).
        hf.lm_head.weight.mul_(HEAD_SCALE)
        for key, b in hf.named_buffers():
            if key.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    hf = hf.eval()
    hf.save_pretrained(path, max_shard_size=SHARD)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)  # every field as DeepSeek/Moonlight wrote it (legacy rope_scaling, scoring_func...)
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) >= 3
    if config.get("num_nextn_predict_layers"):
        add_mtp_layer(path, config)
    return hf, path


def add_mtp_layer(path, config):
    """DeepSeek-V3's MTP layer (model.layers.{L}: its projections and an MoE layer), which
    transformers' class does not build, in a file of its own: imported, it is skipped."""
    from safetensors.numpy import save_file

    L, D = config["num_hidden_layers"], config["hidden_size"]
    tensors = {f"model.layers.{L}.{k}": v for k, v in {
        "eh_proj.weight": np.zeros((D, 2 * D), np.float32), "enorm.weight": np.ones(D, np.float32),
        "hnorm.weight": np.ones(D, np.float32), "mlp.gate.weight": np.zeros((config["n_routed_experts"], D), np.float32),
        "shared_head.norm.weight": np.ones(D, np.float32)}.items()}
    save_file(tensors, os.path.join(path, "model-mtp.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, INDEX)) as f:
        index = json.load(f)
    index["weight_map"] |= {k: "model-mtp.safetensors" for k in tensors}
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump(index, f)


def base_cfg(seq_len=32, batch=8, mesh=(1, 1, 1), microbatches=1, **train):
    cfg = apply_overrides(Config(), PRESETS["tiny"])
    dp, pp, tp = mesh
    return apply_overrides(cfg, {"model": dict(seq_len=seq_len, capacity_factor=0.0, dropout=0.0, dtype="float32"),
                                 "train": dict(batch_size=batch, microbatches=microbatches, **train),
                                 "mesh": dict(dp=dp, pp=pp, tp=tp)})


def import_one_device(path, cfg, log=None):
    """(cfg with the checkpoint's model, graphdef, host params) via the streamed import."""
    source = hf_interop.HFSource(path)
    cfg = source.adopt(cfg)
    abstract = nnx.eval_shape(lambda: Transformer(cfg.model, nnx.Rngs(0)))
    graphdef, shapes = nnx.split(abstract)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), shapes.to_pure_dict())
    params = source.load(target, cfg.model, log)
    return cfg, graphdef, jax.device_get(params)


def our_logits(graphdef, params, tokens_BT):
    return np.asarray(jax.jit(lambda p, t: nnx.merge(graphdef, p)(t)[0])(params, jnp.asarray(tokens_BT)))


def hf_logits(hf, tokens_BT):
    with torch.no_grad():
        return hf(torch.tensor(np.asarray(tokens_BT, np.int64))).logits.numpy()


@pytest.mark.parametrize("name", MODELS)
def test_real_config_imports_with_transformers_logits_and_exports_back(name, tmp_path):
    hf, path = make_checkpoint(name, str(tmp_path / "hf"))
    notes = []
    cfg, graphdef, params = import_one_device(path, base_cfg(), notes.append)
    m, real = cfg.model, REAL_CONFIGS[name]
    assert (m.first_dense, m.n_blocks, m.block_pattern) == (real["first_k_dense_replace"], SMALL[name]["num_hidden_layers"]
                                                            - real["first_k_dense_replace"], "M")
    assert not m.tie_embeddings and "head_VD" in params and m.q_latent == (real["q_lora_rank"] and 48 or 0)
    assert m.rope_scaling == ("yarn" if real["rope_scaling"] else "none") and m.norm_eps == real["rms_norm_eps"]
    assert (m.routed_scale, m.n_groups, m.topk_groups, m.norm_topk) == (
        real["routed_scaling_factor"], real["n_group"] if real["topk_method"] == "noaux_tc" else 1,
        real["topk_group"] if real["topk_method"] == "noaux_tc" else 1, real["norm_topk_prob"])
    biases = [layer["ffn"]["router_bias_E"] for layer in params["blocks"]["layers"].values() if "router_bias_E" in layer["ffn"]]
    assert (len(biases) > 0) == (real["topk_method"] == "noaux_tc") and all(np.any(b != 0) for b in biases)
    assert bool(notes) == bool(real.get("num_nextn_predict_layers")), notes  # V3's MTP layer: skipped, said in one line
    tokens_BT = np.random.default_rng(1).integers(0, 512, (2, 32))
    ours_BTV = our_logits(graphdef, params, tokens_BT)
    np.testing.assert_allclose(ours_BTV, hf_logits(hf, tokens_BT), atol=1e-5, rtol=0)

    out = hf_interop.write_hf_dir(str(tmp_path / "export"), params, m, BYTES, "float32")
    exported = load_hf(out)
    assert exported.config.model_type == real["model_type"]  # built-in classes: nothing to trust
    np.testing.assert_allclose(hf_logits(exported, tokens_BT), ours_BTV, atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in MODELS if REAL_CONFIGS[n]["rope_scaling"]])
def test_real_config_past_yarns_original_context_gives_transformers_logits(name, tmp_path):
    """4160 tokens, past the 4096 YaRN's original context, in one sequence."""
    hf, path = make_checkpoint(name, str(tmp_path / "hf"))
    cfg, graphdef, params = import_one_device(path, base_cfg(seq_len=4160))
    tokens_BT = np.random.default_rng(2).integers(0, 512, (1, 4160))
    np.testing.assert_allclose(our_logits(graphdef, params, tokens_BT), hf_logits(hf, tokens_BT), atol=1e-5, rtol=0)


def steps_on_mesh(cfg, host_params, n_steps=3):
    """n_steps train steps of the imported params on cfg's mesh (one batch): host
    copies of (metrics of each step, optimizer state after each, params after the last)."""
    mesh = mesh_for(cfg)
    check_config_fits_mesh(cfg, mesh)
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model, nnx.Rngs(0))))[0]
    specs = param_specs(host_params, cfg.mesh.expert_parallel)
    params = jax.device_put(host_params, named(mesh, specs))
    optimizer = optimizers.make_optimizer(cfg.train)
    opt_state = optimizers.init_opt_state(optimizer, params, mesh)
    step = make_train_step(graphdef, cfg, mesh, optimizer, params, opt_state)
    batch = global_batch(mesh, token_batch(cfg), cfg.train.batch_size)
    all_metrics, opt_states = [], []
    for s in range(n_steps):
        params, opt_state, metrics = step(params, opt_state, batch, jnp.asarray(s))
        all_metrics.append(jax.device_get(metrics))
        # (the router bias is no optimizer's: its moments stay zero, nothing to compare)
        opt_states.append(jax.tree_util.tree_map_with_path(
            lambda path, x: None if "router_bias_E" in jax.tree_util.keystr(path) else np.asarray(x), opt_state))
    return all_metrics, opt_states, jax.tree.map(np.asarray, params)


TRAIN_MESHES = {"2x2x2": dict(mesh=(2, 2, 2), microbatches=2), "auto-4x1x2": dict(mesh=(4, 1, 2), microbatches=2)}


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_real_config_trains_on_a_mesh_as_on_one_device(name, tmp_path):
    """3 steps (Muon, as Moonlight was trained; the selection bias trained on at V3's rate
    0.001 for the models that have one) on dp2 x pp2 x tp2 (and for Moonlight under
    --mesh.sharding auto on dp4 x tp2) equal 3 steps on one device."""
    _, path = make_checkpoint(name, str(tmp_path / "hf"))
    train = dict(optimizer="muon")
    rate = dict(router_bias_rate=0.001) if REAL_CONFIGS[name]["topk_method"] == "noaux_tc" else {}
    cfg, _, params = import_one_device(path, base_cfg(microbatches=2, **train))
    cfg = apply_overrides(cfg, {"model": rate})
    reference = steps_on_mesh(cfg, params)
    assert reference[2]["blocks"]["layers"][0]["ffn"].get("router_bias_E") is None or not np.array_equal(
        reference[2]["blocks"]["layers"][0]["ffn"]["router_bias_E"], params["blocks"]["layers"][0]["ffn"]["router_bias_E"])
    for case, layout in TRAIN_MESHES.items():
        if case.startswith("auto") and name != "Moonlight-16B-A3B":  # (the automatic executor with every option on:
            continue  # tests/test_executors.py; here once, on the layout users would most want to continue)
        mesh_cfg = dict(dp=layout["mesh"][0], pp=layout["mesh"][1], tp=layout["mesh"][2],
                        sharding="auto" if case.startswith("auto") else "manual")
        on_mesh = apply_overrides(cfg, {"mesh": mesh_cfg, "train": dict(microbatches=layout["microbatches"])})
        assert_same_steps(steps_on_mesh(on_mesh, params), reference)


@pytest.mark.slow
def test_moonlight_trains_on_pp2_tp2_dp2_under_1f1b_as_on_one_device(tmp_path):
    """Moonlight's layout (a dense layer, then MoE blocks) split over 2 pipeline stages
    by the hand-written 1F1B schedule, its imported selection bias frozen (rate 0)."""
    _, path = make_checkpoint("Moonlight-16B-A3B", str(tmp_path / "hf"))
    cfg, _, params = import_one_device(path, base_cfg(microbatches=4, optimizer="muon"))
    reference = steps_on_mesh(cfg, params)
    bias = params["blocks"]["layers"][0]["ffn"]["router_bias_E"]
    np.testing.assert_array_equal(reference[2]["blocks"]["layers"][0]["ffn"]["router_bias_E"], bias)  # frozen
    on_mesh = apply_overrides(cfg, {"mesh": dict(dp=2, pp=2, tp=2), "train": dict(pipeline="1f1b", microbatches=4)})
    assert_same_steps(steps_on_mesh(on_mesh, params), reference)
