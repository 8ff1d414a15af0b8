"""QK-clip (--train.qk_clip, step_core.qk_clip) and the metric it reads (max_logit).

On its own (queries through a latent, and full-rank): exactly the heads whose largest logit
exceeded tau are scaled, by sqrt(gamma) on the query and key content parts and gamma on the
rotary query (gamma = tau / max_logit), so that head's largest logit on the same tokens
becomes tau; every other weight stays bit for bit. In the step: two clipped Muon steps on
dp x tp, pp 2 and cp 2 equal two clipped steps on one device (the metric, every optimizer
moment, the weights; the second step's forward runs through the clipped weights). With
AdamW, on this small model, the meshes' moments differ by 2e-5 from one device's with the
clip off too (AdamW's first update is about lr x sign(g): a tiny g's sign is the mesh's),
so AdamW's clipped step is test_executors' (every executor, QK_CLIP_TAU). (The unclipped
metric's mesh invariance is checked by every equality-to-one-device test: test_parallel,
test_executors, test_context_parallel.)
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model import MLAttention, rope_angles
from parallel.step_core import qk_clip
from test_parallel import RTOL, assert_tree_close, initial_params, tiny_config, train_steps
from utils import PRESETS, ConfigError, apply_overrides, validate_model

# the power of gamma each weight is scaled by: queries through a latent (tiny's), or full-rank (q_latent 0)
SCALED = {"wq_up_QHK": 0.5, "wq_DHK": 0.5, "wk_up_AHK": 0.5, "wq_rope_QHR": 1.0, "wq_rope_DHR": 1.0}


@pytest.mark.parametrize("q_latent", [PRESETS["tiny"]["model"]["q_latent"], 0], ids=["query-latent", "full-rank-queries"])
def test_only_heads_above_tau_are_scaled_and_their_largest_logit_becomes_tau(q_latent):
    cfg = tiny_config(q_latent=q_latent)
    graphdef, params = initial_params(cfg.model)
    tokens_BT = jnp.asarray(np.random.default_rng(0).integers(0, 256, (4, cfg.model.seq_len)))
    forward = jax.jit(lambda p: nnx.merge(graphdef, p)(tokens_BT)[1]["max_logit_LH"])  # [N, L, H]
    max_logit_NLH = np.asarray(forward(params))
    tau = float(np.median(max_logit_NLH))  # half the heads above it
    above_NLH = max_logit_NLH > tau
    assert 0 < above_NLH.sum() < above_NLH.size

    clipped = jax.device_get(qk_clip(params, jnp.asarray(max_logit_NLH), tau))
    gamma_NH = np.where(above_NLH[:, 0], tau / max_logit_NLH[:, 0], 1.0)
    attn, new_attn = params["blocks"]["layers"][0]["attn"], clipped["blocks"]["layers"][0]["attn"]
    queries = ("wq_up_QHK", "wq_rope_QHR") if q_latent else ("wq_DHK", "wq_rope_DHR")
    assert set(SCALED) & set(attn) == {"wk_up_AHK", *queries}
    for name, w in attn.items():
        if name not in SCALED:  # the shared rotary key, the latents' down-projections and norms, values, output
            assert jax.tree.all(jax.tree.map(np.array_equal, new_attn[name], w)), name
            continue
        factor_N11H1 = (gamma_NH ** SCALED[name])[:, None, :, None]
        np.testing.assert_allclose(new_attn[name], w * factor_N11H1, rtol=1e-6, err_msg=name)
        kept_NH = ~above_NLH[:, 0]
        np.testing.assert_array_equal(new_attn[name].transpose(0, 2, 1, 3)[kept_NH], w.transpose(0, 2, 1, 3)[kept_NH])
    rest = lambda p: {k: v for k, v in p.items() if k != "blocks"}  # noqa: E731
    assert jax.tree.all(jax.tree.map(np.array_equal, rest(clipped), rest(params)))

    # The first layer's input is the embedding alone, unchanged: its clipped heads' largest logit is now tau.
    new_max_H = np.asarray(forward(clipped))[0, 0]
    np.testing.assert_allclose(new_max_H[above_NLH[0, 0]], tau, rtol=1e-5)
    np.testing.assert_array_equal(new_max_H[~above_NLH[0, 0]], max_logit_NLH[0, 0][~above_NLH[0, 0]])


def test_a_negative_tau_is_a_one_line_error():
    with pytest.raises(ConfigError, match=r"^--train.qk_clip must be >= 0 .*got -1.0$"):
        validate_model(apply_overrides(tiny_config(), {"train": {"qk_clip": -1.0}}))


# ---- The clipped step on meshes


def clip_config(mesh_shape=(1, 1, 1), cp=1, tau=0.0):
    """tiny with routing groups of 4 tokens (a group must not straddle cp 2's chunks of T/4)."""
    cfg = tiny_config(mesh_shape, routing_group=4)
    return apply_overrides(cfg, {"mesh": dict(cp=cp), "train": dict(optimizer="muon", qk_clip=tau)})


@functools.cache
def one_device():
    """(tau, unclipped steps, clipped steps) on one device; tau: the median head's
    largest logit of the first step, so about half the heads are clipped."""
    unclipped = train_steps(clip_config())
    tau = float(np.median(unclipped[0][0]["max_logit_NLH"]))
    return tau, unclipped, train_steps(clip_config(tau=tau))


CASES = [pytest.param((2, 1, 2), 1, id="dp2xtp2"),
         pytest.param((1, 2, 1), 1, id="pp2"),
         pytest.param((1, 1, 1), 2, id="cp2")]


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape, cp", CASES)
def test_clipped_steps_equal_one_clipped_device(mesh_shape, cp):
    tau, unclipped, reference = one_device()
    (ref_metrics, ref_opt_states, ref_params) = reference
    assert float(ref_metrics[0]["max_logit"]) > tau  # the clip had work to do
    assert not np.array_equal(ref_params["blocks"]["layers"][0]["attn"]["wk_up_AHK"],
                              unclipped[2]["blocks"]["layers"][0]["attn"]["wk_up_AHK"])
    metrics, opt_states, params = train_steps(clip_config(mesh_shape, cp, tau))
    for s, (m, ref_m) in enumerate(zip(metrics, ref_metrics)):
        for key in ("loss", "grad_norm", "max_logit"):
            np.testing.assert_allclose(m[key], ref_m[key], rtol=RTOL, err_msg=f"step {s}: {key}")
        assert_tree_close(m["max_logit_NLH"], ref_m["max_logit_NLH"], what=f"step {s}: max_logit_NLH")  # (test_parallel: why as a whole)
    np.testing.assert_allclose(metrics[0]["max_logit_NLH"], ref_metrics[0]["max_logit_NLH"], rtol=RTOL)  # the first step's, per head
    for s, (o, ref_o) in enumerate(zip(opt_states, ref_opt_states)):
        assert_tree_close(o, ref_o, what=f"optimizer state after step {s}: ")
    assert_tree_close(params, ref_params, what="params: ")


def test_every_attention_kernel_reports_the_same_largest_logits():
    """The blockwise kernel's running max (4 x 4 blocks, those above the diagonal
    skipped) and the fused kernel's separate pass give the matmul kernel's largest logit
    per head. (Their outputs and gradients: tests/test_blockwise_attention.py.)"""
    cfg = apply_overrides(tiny_config(), {"model": dict(seq_len=64, attention_block=16)}).model
    attn = MLAttention(cfg, nnx.Rngs(0))
    x_BTD = jax.random.normal(jax.random.key(1), (2, cfg.seq_len, cfg.d_model))
    angles = rope_angles(jnp.arange(cfg.seq_len)[None], cfg)

    def max_logit_H(implementation):
        attn.implementation = implementation
        return attn.with_max_logits(x_BTD, angles)[1]

    want_H = max_logit_H("matmul")
    assert want_H.shape == (cfg.n_heads,) and np.ptp(want_H) > 0
    for implementation in ("blockwise", "dot_product_attention"):
        np.testing.assert_allclose(max_logit_H(implementation), want_H, rtol=1e-5, err_msg=implementation)
