"""The model options that real DeepSeek-family checkpoints need (issue 30), each against
an independent computation, on one CPU device in float32.

What is proved here: YaRN's frequencies, RoPE factor and softmax scale are
transformers' (DeepseekV3RotaryEmbedding, DeepseekV2/V3Attention.scaling) for the real
DeepSeek-V3 / V2-Lite rope_scaling and for the small ones the tests train with; our
attention equals transformers' DeepseekV3Attention (query latent) and DeepseekV2Attention
(full-rank queries, q_lora_rank null) with YaRN, weights copied over, at positions past
the original context; norm_topk false gives DeepseekV2TopkRouter's gates (softmax, top-k,
no renormalisation); the untied head is the output layer (a head equal to the embedding
gives the tied model's logits, another head other logits); norm_eps reaches every norm of
the residual stream and only those.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model import MLAttention, RMSNorm, Transformer, attention_softmax_scale, rope_angles, rope_frequencies, top_k_routing, yarn_attention_factor
from test_model import tiny

torch = pytest.importorskip("torch")

# rope_scaling as the real checkpoints' config.json have it, and the small ones the
# tests use (original context 16, sequences of 32-48: the scaling is exercised).
DEEPSEEK_V3_YARN = dict(rope_factor=40.0, rope_original_len=4096, yarn_mscale=1.0, yarn_mscale_all_dim=1.0)
DEEPSEEK_V2_LITE_YARN = dict(rope_factor=40.0, rope_original_len=4096, yarn_mscale=0.707, yarn_mscale_all_dim=0.707)
SMALL_YARN = dict(rope_factor=4.0, rope_original_len=16, yarn_mscale=1.0, yarn_mscale_all_dim=1.0)
SMALL_YARN_NO_ALL_DIM = dict(rope_factor=4.0, rope_original_len=16, yarn_mscale=1.0, yarn_mscale_all_dim=0.0)
# a base and betas that put several pairs on the ramp between kept and interpolated
SMALL_YARN_RAMP = dict(rope_factor=4.0, rope_original_len=16, rope_theta=100.0, yarn_beta_fast=2.0, yarn_beta_slow=0.25,
                       yarn_mscale=0.707, yarn_mscale_all_dim=0.5)


def yarn(rope_dim=64, **fields):
    return tiny(rope_scaling="yarn", rope_dim=rope_dim, **fields)


def hf_config(cfg, model_type="deepseek_v3"):
    """transformers' config for our model config's attention (rope_scaling as DeepSeek's
    config.json writes it)."""
    from transformers import DeepseekV2Config, DeepseekV3Config
    rope_scaling = None
    if cfg.rope_scaling == "yarn":
        rope_scaling = dict(type="yarn", factor=cfg.rope_factor, original_max_position_embeddings=cfg.rope_original_len,
                            beta_fast=cfg.yarn_beta_fast, beta_slow=cfg.yarn_beta_slow, mscale=cfg.yarn_mscale,
                            mscale_all_dim=cfg.yarn_mscale_all_dim)
    config_class = DeepseekV3Config if model_type == "deepseek_v3" else DeepseekV2Config
    config = config_class(vocab_size=256, hidden_size=cfg.d_model, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_heads,
                          qk_nope_head_dim=cfg.head_dim, qk_rope_head_dim=cfg.rope_dim, v_head_dim=cfg.head_dim,
                          q_lora_rank=cfg.q_latent or None, kv_lora_rank=cfg.kv_latent, max_position_embeddings=4 * cfg.seq_len,
                          rope_theta=cfg.rope_theta, rope_scaling=rope_scaling, attention_bias=False)
    config._attn_implementation = "eager"
    return config


@pytest.mark.parametrize("fields", [DEEPSEEK_V3_YARN, DEEPSEEK_V2_LITE_YARN, SMALL_YARN, SMALL_YARN_NO_ALL_DIM, SMALL_YARN_RAMP],
                         ids=["deepseek_v3", "deepseek_v2_lite", "small", "small-no-mscale_all_dim", "small-ramp"])
def test_yarn_equals_transformers(fields):
    """Inverse frequencies, cos and sin at positions up to 3x the original context (in
    transformers times the attention factor, here the factor apart), and the softmax
    scale: ours against DeepseekV3RotaryEmbedding and DeepseekV3Attention.scaling."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding
    cfg = yarn(rope_dim=64 if fields["rope_original_len"] > 16 else 16, **fields)
    config = hf_config(cfg)
    rotary = DeepseekV3RotaryEmbedding(config)
    inv_freq = rotary.inv_freq.numpy()
    np.testing.assert_allclose(rope_frequencies(cfg), inv_freq, rtol=1e-6)
    default = rope_frequencies(tiny(rope_dim=cfg.rope_dim, rope_theta=cfg.rope_theta))
    assert np.abs(np.asarray(default) / inv_freq - 1).max() > 1, "premise: some frequencies are interpolated"
    assert yarn_attention_factor(cfg) == pytest.approx(rotary.attention_scaling, rel=1e-12)
    assert attention_softmax_scale(cfg) == pytest.approx(DeepseekV3Attention(config, 0).scaling, rel=1e-12)

    positions_BT = np.arange(0, 3 * cfg.rope_original_len, 7)[None]
    hf_cos, hf_sin = rotary(torch.zeros(1), torch.from_numpy(positions_BT))
    angles_BTR2 = np.asarray(rope_angles(jnp.asarray(positions_BT), cfg), np.float64)
    half = cfg.rope_dim // 2  # transformers' cos/sin repeat the R/2 angles twice
    scale = yarn_attention_factor(cfg)
    atol = 1e-6 * positions_BT.max()  # float32 angles: a 1-ulp frequency difference grows with the position
    np.testing.assert_allclose(scale * np.cos(angles_BTR2), hf_cos.numpy()[..., :half], atol=atol)
    np.testing.assert_allclose(scale * np.sin(angles_BTR2), hf_sin.numpy()[..., half:], atol=atol)


def copy_into_hf(attn, hf):
    """Our MLAttention's weights into transformers' DeepseekV2/V3Attention (torch's [out, in];
    per head the K content dims, then the R RoPE dims; keys and values per head K then K)."""
    def linear(w_IO):  # [in, out...] -> torch [out, in]
        w = np.asarray(w_IO, np.float32)
        return torch.from_numpy(w.reshape(w.shape[0], -1).T.copy())

    def heads(w_content_IHK, w_rope_IHR):
        return np.concatenate([np.asarray(w_content_IHK), np.asarray(w_rope_IHR)], axis=-1)

    with torch.no_grad():
        if attn.full_rank_queries:
            hf.q_proj.weight.copy_(linear(heads(attn.wq_DHK[...], attn.wq_rope_DHR[...])))
        else:
            hf.q_a_proj.weight.copy_(linear(attn.wq_down_DQ[...]))
            hf.q_a_layernorm.weight.copy_(torch.from_numpy(np.array(attn.q_norm.scale_D[...])))
            hf.q_b_proj.weight.copy_(linear(heads(attn.wq_up_QHK[...], attn.wq_rope_QHR[...])))
        hf.kv_a_proj_with_mqa.weight.copy_(linear(np.concatenate([attn.wkv_down_DA[...], attn.wk_rope_DR[...]], axis=-1)))
        hf.kv_a_layernorm.weight.copy_(torch.from_numpy(np.array(attn.kv_norm.scale_D[...])))
        hf.kv_b_proj.weight.copy_(linear(heads(attn.wk_up_AHK[...], attn.wv_up_AHK[...])))
        hf.o_proj.weight.copy_(linear(np.asarray(attn.wo_HKD[...]).reshape(-1, attn.wo_HKD.shape[-1])))


@pytest.mark.parametrize("model_type, q_latent, fields", [
    ("deepseek_v3", 32, SMALL_YARN), ("deepseek_v2", 0, SMALL_YARN_RAMP), ("deepseek_v3", 0, SMALL_YARN_NO_ALL_DIM),
    ("deepseek_v2", 0, {})], ids=["v3-latent-q", "v2-full-rank-q-ramp", "v3-full-rank-q-no-mscale_all_dim", "v2-full-rank-q-no-yarn"])
def test_attention_equals_transformers(model_type, q_latent, fields):
    """MLAttention with YaRN (or without) against transformers' attention of the same
    weights at positions 20..67, past the original context of 16: the frequencies, the
    factor on the RoPE parts, the softmax scale and (q_latent 0) the full-rank queries
    all enter the output. Norm scales not all ones."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Attention, DeepseekV2RotaryEmbedding
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding
    cfg = tiny(q_latent=q_latent, seq_len=48, **(dict(rope_scaling="yarn", **fields) if fields else {}))
    attn = MLAttention(cfg, nnx.Rngs(0))
    for norm, key in ((getattr(attn, "q_norm", None), 2), (attn.kv_norm, 3)):
        if norm is not None:
            norm.scale_D[...] = 1 + 0.5 * jax.random.normal(jax.random.key(key), norm.scale_D.shape)
    B, T, start = 2, cfg.seq_len, 20
    x_BTD = jax.random.normal(jax.random.key(1), (B, T, cfg.d_model))
    positions_BT = start + jnp.broadcast_to(jnp.arange(T), (B, T))
    got_BTD = nnx.jit(lambda attn, x_BTD, angles: attn(x_BTD, angles))(attn, x_BTD, rope_angles(positions_BT, cfg))

    config = hf_config(cfg, model_type)
    v3 = model_type == "deepseek_v3"
    hf = (DeepseekV3Attention if v3 else DeepseekV2Attention)(config, 0).eval()
    copy_into_hf(attn, hf)
    rotary = (DeepseekV3RotaryEmbedding if v3 else DeepseekV2RotaryEmbedding)(config)
    x = torch.from_numpy(np.asarray(x_BTD))
    position_embeddings = rotary(x, torch.from_numpy(np.asarray(positions_BT)))
    mask = torch.triu(torch.full((T, T), float("-inf")), 1)[None, None]
    with torch.no_grad():
        want_BTD = hf(x, position_embeddings=position_embeddings, attention_mask=mask)[0].numpy()
    np.testing.assert_allclose(got_BTD, want_BTD, rtol=1e-4, atol=2e-5)
    assert np.abs(want_BTD).mean() > 1e-2  # a real output, not a near-zero one


def test_raw_top_k_gates_equal_transformers_deepseek_v2_router():
    """norm_topk false with softmax scores (DeepSeek-V2-Lite: greedy top-6 of 64, no
    renormalisation, routed_scaling_factor 1) against DeepseekV2TopkRouter: the same
    experts with the same gates, and gates that do not sum to 1. True renormalises."""
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    S, D, E, k = 40, 32, 64, 6
    x_SD = jax.random.normal(jax.random.key(0), (S, D))
    router_DE = jax.random.normal(jax.random.key(1), (D, E)) / np.sqrt(D)
    hf = DeepseekV2TopkRouter(DeepseekV2Config(hidden_size=D, n_routed_experts=E, num_experts_per_tok=k, topk_method="greedy",
                                               routed_scaling_factor=1.0))
    with torch.no_grad():
        hf.weight.copy_(torch.from_numpy(np.asarray(router_DE).T.copy()))
        _, hf_gates_SX, hf_experts_SX = hf(torch.from_numpy(np.asarray(x_SD)))
    gates_SX, experts_SX, _ = top_k_routing(x_SD, router_DE, k, "softmax", norm_topk=False)
    order = np.argsort(hf_experts_SX.numpy(), axis=-1)  # transformers' top-k is unsorted
    ours = np.argsort(np.asarray(experts_SX), axis=-1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(experts_SX), ours, -1), np.take_along_axis(hf_experts_SX.numpy(), order, -1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(gates_SX), ours, -1), np.take_along_axis(hf_gates_SX.numpy(), order, -1), rtol=1e-6)
    assert np.asarray(gates_SX).sum(-1).max() < 0.9
    normed_SX = top_k_routing(x_SD, router_DE, k, "softmax")[0]
    np.testing.assert_allclose(normed_SX, gates_SX / gates_SX.sum(-1, keepdims=True), rtol=1e-6)


def test_untied_head_is_the_output_layer():
    """Untied, every weight but the head is the tied model's (the head is made last); a
    head set to the embedding gives the tied model's logits exactly, the head as
    initialised other logits, near-uniform like the tied ones (the same row norms)."""
    tied = Transformer(tiny(), nnx.Rngs(0))
    untied = Transformer(tiny(tie_embeddings=False), nnx.Rngs(0))
    tied_params = nnx.state(tied, nnx.Param).to_pure_dict()
    untied_params = nnx.state(untied, nnx.Param).to_pure_dict()
    head_VD = untied_params.pop("head_VD")
    jax.tree.map(np.testing.assert_array_equal, untied_params, tied_params)
    np.testing.assert_allclose(np.linalg.norm(head_VD, axis=-1).mean(), np.linalg.norm(tied_params["embed_VD"], axis=-1).mean(), rtol=0.05)

    tokens_BT = jax.random.randint(jax.random.key(4), (2, tied.cfg.seq_len), 0, tied.cfg.vocab_size)
    forward = nnx.jit(lambda model, tokens_BT: model(tokens_BT)[0])
    tied_BTV, untied_BTV = forward(tied, tokens_BT), forward(untied, tokens_BT)
    assert np.abs(untied_BTV - tied_BTV).max() > 0.1
    assert np.abs(untied_BTV).max() < 3  # near uniform at init, as tied
    untied.head_VD[...] = untied.embed_VD[...]
    np.testing.assert_array_equal(forward(untied, tokens_BT), tied_BTV)


def test_norm_eps_reaches_the_residual_norms_and_not_the_latent_ones():
    """--model.norm_eps sets every RMSNorm of the residual stream (each layer's two, the
    final norm, MTP's three and its block's); the latent norms keep 1e-6, as DeepSeek's
    and transformers' q_a_layernorm / kv_a_layernorm do whatever rms_norm_eps says."""
    model = nnx.eval_shape(lambda: Transformer(tiny(norm_eps=1e-5, mtp_depth=1, block_pattern="DM"), nnx.Rngs(0)))
    eps = {"/".join(map(str, path)): node.eps for path, node in nnx.iter_graph(model) if isinstance(node, RMSNorm)}
    latent = {p: e for p, e in eps.items() if p.endswith(("q_norm", "kv_norm"))}
    stream = {p: e for p, e in eps.items() if p not in latent}
    # the stacked blocks' 2 layers and MTP's block's 2: q_norm and kv_norm each; 2 norms per layer,
    # the final norm, MTP's hidden, embedding and final norms
    assert len(latent) == 8 and set(latent.values()) == {1e-6}, latent
    assert len(stream) == 4 * 2 + 1 + 3 and set(stream.values()) == {1e-5}, stream


def test_bad_yarn_flags_get_a_clear_error():
    from utils import ConfigError, parse_args
    for flags, message in [(["--model.rope_scaling", "ntk"], "must be none or yarn"),
                           (["--model.rope_scaling", "yarn", "--model.rope_factor", "0.5"], "rope_factor >= 1"),
                           (["--model.rope_scaling", "yarn", "--model.yarn_beta_slow", "40"], "yarn_beta_slow"),
                           (["--model.q_latent", "-1"], "q_latent must be >= 0"),
                           (["--model.norm_eps", "0"], "norm_eps must be > 0")]:
        with pytest.raises(ConfigError, match=message):
            parse_args(flags)


def test_full_rank_queries_replace_the_query_latent():
    """q_latent 0: the query weights are wq_DHK and wq_rope_DHR, no q_norm, and the
    queries are x times them (nothing else in between)."""
    cfg = tiny(q_latent=0)
    attn = MLAttention(cfg, nnx.Rngs(0))
    names = set(nnx.state(attn, nnx.Param).to_pure_dict())
    assert {"wq_DHK", "wq_rope_DHR"} <= names and not names & {"wq_down_DQ", "wq_up_QHK", "wq_rope_QHR", "q_norm"}
    x_BTD = jax.random.normal(jax.random.key(1), (1, 3, cfg.d_model))
    q_nope_BTHK, q_rope_BTHR = attn.queries(x_BTD, jnp.zeros((1, 3, cfg.rope_dim // 2)))  # angle 0: no rotation
    np.testing.assert_allclose(q_nope_BTHK, jnp.einsum("btd,dhk->bthk", x_BTD, attn.wq_DHK[...]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(q_rope_BTHR, jnp.einsum("btd,dhr->bthr", x_BTD, attn.wq_rope_DHR[...]), rtol=1e-5, atol=1e-6)
