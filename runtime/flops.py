"""Parameter and FLOP accounting, from shapes alone (no arrays allocated), and the measured peak FLOP/s of this
machine: together the numerator and denominator of MFU (main.py's progress and metrics, bench.py, planner.py).
"""

import math
import time

import jax
import jax.numpy as jnp
from flax import nnx

from model import Transformer, padded_vocab
from parallel.weights import weight_name


def count_params(model_cfg):
    """(total, active per token) parameter counts, from shapes alone (nnx.eval_shape)."""
    abstract = nnx.eval_shape(lambda: Transformer(model_cfg, nnx.Rngs(0)))
    state = nnx.state(abstract, nnx.Param)
    total, routed = 0, 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        size = math.prod(leaf.shape)
        total += size
        if any(getattr(k, "key", None) in ("w_gate_EDF", "w_up_EDF", "w_down_EFD") for k in path):
            routed += size
    inactive = routed * (model_cfg.n_experts - model_cfg.top_k) / model_cfg.n_experts
    return total, int(total - inactive)


def flops_per_token(model_cfg):
    """Model FLOPs to train on one token: 3 x forward, forward = 2 x active matmul params (no norm scales, no
    embedding lookup; a tied embedding counts once, as the output layer) + per layer 2TH(K + R) for q.k and 2THK for
    p.v (full T x T, as PaLM's MFU). Remat recomputation is not counted: MFU measures useful work."""
    m = model_cfg
    total, active = count_params(m)
    n_layers = m.n_blocks * len(m.block_pattern) + m.first_dense  # (the dense prefix's layers are whole layers too)
    norms = m.d_model * (2 * n_layers + 1) + n_layers * (m.q_latent + m.kv_latent)
    lookup = 0 if m.tie_embeddings else padded_vocab(m.vocab_size, m.vocab_multiple) * m.d_model  # the untied embedding: a gather
    matmul_params = active - norms - lookup  # tied: the embedding counts once, as the output layer
    attention = n_layers * 2 * m.seq_len * m.n_heads * (2 * m.head_dim + m.rope_dim)
    return 3 * (2 * matmul_params + attention)


def part_flops_per_token(model_cfg):
    """flops_per_token as {prefix: the dense prefix, blocks: all N blocks, head: the output
    layer and MTP}; they sum to it (up to the MTP blocks' norm scales)."""
    m = model_cfg
    state = nnx.state(nnx.eval_shape(lambda: Transformer(m, nnx.Rngs(0))), nnx.Param)
    params = dict(prefix=0.0, blocks=0.0, head=0.0)
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        name, part = weight_name(path), getattr(path[0], "key", None)
        if name == "scale_D" or (name == "embed_VD" and not m.tie_embeddings):  # norm scales, an untied embedding: no matmul
            continue
        active = m.top_k / m.n_experts if name in ("w_gate_EDF", "w_up_EDF", "w_down_EFD") else 1
        params[part if part in ("prefix", "blocks") else "head"] += math.prod(leaf.shape) * active
    attention = 2 * m.seq_len * m.n_heads * (2 * m.head_dim + m.rope_dim)  # per layer, as in flops_per_token
    return dict(prefix=3 * (2 * params["prefix"] + m.first_dense * attention),
                blocks=3 * (2 * params["blocks"] + m.n_blocks * len(m.block_pattern) * attention),
                head=3 * 2 * params["head"])


def stage_flops_per_token(model_cfg, pp):
    """flops_per_token over the pipeline's pp stages, [pp]: each runs N/pp blocks, the
    first also the dense prefix, the last the output layer and MTP."""
    return stage_flops(part_flops_per_token(model_cfg), pp)


def stage_flops(parts, pp):
    """part_flops_per_token's `parts` over pp stages (stage_flops_per_token)."""
    stages = [parts["blocks"] / pp] * pp
    stages[0] += parts["prefix"]
    stages[-1] += parts["head"]
    return stages


def human(n):
    for unit in ("", "K", "M", "B", "T"):
        if abs(n) < 1000:
            return f"{n:.3g}{unit}"
        n /= 1000
    return f"{n:.3g}P"


def measure_peak_flops(dtype, size=1024, repeats=5):
    """FLOP/s of a `size` square matmul on one device, the fastest of `repeats` (noise only slows): MFU's denominator,
    measured in this run. Accumulates in float32, bfloat16's fast path (docs/benchmarks.md)."""
    a = jnp.ones((size, size), dtype)
    matmul = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
    matmul(a, a).block_until_ready()
    fastest_s = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, a).block_until_ready()
        fastest_s = min(fastest_s, time.perf_counter() - start)
    return 2 * size**3 / fastest_s
