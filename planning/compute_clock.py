"""The planner's compute on a TPU by kind of work, as the TPU compiler's cost model
times it (planner.py --tpu reads that clock off the compiled step: report.compiler_clock).

Per device and step, from the shapes alone:
- matmul fusions: each of a layer's matmuls at its roofline, max(FLOPs / peak, bytes /
  HBM bandwidth) with its two operands and its output moved once; the forward, the
  backward's two (the input's and the weight's gradients, the same FLOPs and bytes), and
  the forward again where remat recomputes it; the roofline reached at MATMUL_SHARE;
- kernels: splash attention's FLOPs (its causal blocks, as hlo_reader counts them) at
  the peak, megablox's grouped matmuls at the roofline of their own cost estimate;
- the rest (elementwise, reductions, copies, the saves of the residuals): per token, the
  bytes of what each layer keeps for its backward pass (activations.layer_bytes) and the
  float32 logits, moved ELEMENTWISE_PASSES times at HBM bandwidth; and the update's pass
  over the params and optimizer state (update_seconds).

Why not one efficiency: moe1b's matmuls (d_model 768, 1,024 tokens a microbatch) sit at
the roofline's ridge, DeepSeek-V2-Lite's at twice the width are compute-bound, and half
of moe1b's step is outside the matmuls; one assumed share of the peak put its compute
at a third of the compiler's (docs/planning.md, "The planner's compute on that clock":
the fit, and the layouts it was checked on).
"""

import math

from ops.gmm import GMM_ROW_TILE, gmm_tiling
from planning.activations import F32, layer_bytes, local_sizes
from planning.hlo_reader import SPLASH_MACS

# Fitted to the compiler's clock (libtpu 0.0.42.1, v4) on moe1b at dp 32, 8 microbatches
# at remat none and 1 at block_dots (36c05b4: blocks unrolled, splash's operands projected
# into its layout): the matmul fusions' time over their rooflines, and the rest's bytes
# over those of the layers' residuals (docs/planning.md).
MATMUL_SHARE = 0.474
ELEMENTWISE_PASSES = 4.63
RECOMPUTE_FORWARD = ("layer", "block", "stage")  # the remats that run the forward again (block_dots keeps the matmul outputs)


def roofline(flops, nbytes, hw):
    """Seconds of work at its roofline: its FLOPs at the peak or its bytes at HBM
    bandwidth, whichever takes longer."""
    return max(flops / hw.peak_flops, nbytes / hw.hbm_bw)


def roofline_s(M, K, N, c, hw, batch=1):
    """One [M, K] x [K, N] matmul (`batch` of them) at its roofline: operands and output
    of c bytes each, moved once."""
    return batch * roofline(2 * M * K * N, c * (M * K + K * N + M * N), hw)


def layer_matmuls(s, kind, m):
    """[(M, K, N, batch)]: the forward's matmuls of one layer over one microbatch of this
    device (s: activations.Local), the splash kernel's scores left out (kernels)."""
    M = s.b * s.T
    Mk = s.b * s.Tk  # keys and values: under cp made of the whole gathered sequence
    if s.splash and m.quant == "none":  # ops/splash.projected_attention: [content | RoPE] heads, their lanes' RoPE partners
        W = s.K + s.R
        queries = ([(M, s.D, s.Q, 1), (M, s.Q, s.H * W, 1)] if s.Q else [(M, s.D, s.H * W, 1)]) + [(M * s.H, W, W, 1)]
        keys_values = [(Mk, s.A + s.R, s.H * W, 1), (Mk, s.A, s.H * s.K, 1)]
    else:
        queries = [(M, s.D, s.Q, 1), (M, s.Q, s.H * s.K, 1), (M, s.Q, s.H * s.R, 1)] if s.Q else [
            (M, s.D, s.H * s.K, 1), (M, s.D, s.H * s.R, 1)]
        keys_values = [(Mk, s.A, s.H * s.K, 2)]
    out = queries + [(M, s.D, s.A, 1), (M, s.D, s.R, 1)] + keys_values + [(M, s.H * s.K, s.D, 1)]
    if not s.splash and not s.block:  # matmul attention: scores and probs x values, per sequence and head
        out += [(s.T, s.K + s.R, s.Tk, s.b * s.H), (s.T, s.Tk, s.K, s.b * s.H)]
    if kind == "M":
        rows_per_expert = M // s.S * s.C
        out += [(M, s.D, s.E, 1)]
        if m.capacity_factor > 0:  # (dropless: megablox's kernels, not matmul fusions)
            out += [(rows_per_expert, s.D, s.Fe, 2 * s.E), (rows_per_expert, s.Fe, s.D, s.E)]
        if m.n_shared:
            out += [(M, s.D, s.Fs, 2), (M, s.Fs, s.D, 1)]
    else:
        out += [(M, s.D, s.F, 2 if m.ffn_activation == "swiglu" else 1), (M, s.F, s.D, 1)]
    return out


def kernel_seconds(s, kind, m, recompute, hw):
    """One layer's Pallas kernels over one microbatch, forward and backward, at their
    roofline (recompute: the forward twice, as every remat policy runs it: a kernel is
    no matmul block_dots keeps). Splash: its FLOPs at the peak, per visible pair of its
    causal blocks W + K multiply-adds forward, 2W + K for dq and 2W + 2K for dkv (W = K +
    R; hlo_reader's count). Megablox (dropless experts): gmm_seconds' three matmuls."""
    seconds = 0.0
    if s.splash:
        n = s.Tk // min(m.attention_block, s.Tk)
        pairs = s.b * s.H * s.T * s.Tk * (n + 1) / (2 * n)
        macs = {kernel: count(s.K + s.R, s.K) for kernel, count in SPLASH_MACS.items()}
        seconds += 2 * pairs * ((1 + recompute) * macs["fwd"] + macs["dq"] + macs["dkv"]) / hw.peak_flops
    if kind == "M" and m.capacity_factor == 0:
        rows = math.ceil(s.b * s.T * s.X / GMM_ROW_TILE) * GMM_ROW_TILE
        for k, n, calls in ((s.D, s.Fe, 2), (s.Fe, s.D, 1)):  # gate and up, down
            forward, backward = gmm_seconds(rows, k, n, s.E, s.c, hw)
            seconds += calls * ((1 + recompute) * forward + backward)
    return seconds


def gmm_seconds(m, k, n, E, c, hw):
    """(forward, backward) seconds of megablox's grouped matmul of m rows by [E, k, n]
    weights (the backward: gmm of the gradient by the weights transposed, and tgmm for
    theirs), each at the roofline of the kernel's own cost estimate: 2mkn FLOPs; the
    rows read once per n tile, each expert's weights once per row tile it is active in
    (m / tm + E - 1 tiles), the output written once (ops/gmm.gmm_tiling's tiles)."""
    tm, tk, tn = gmm_tiling(m, k, n)
    _, _, dn = gmm_tiling(m, n, k)  # the input's gradient: [m, n] by [n, k], its own tiles
    active, flops = m // tm + E - 1, 2 * m * k * n
    forward = roofline(flops, c * (m * k * (n // tn) + k * n * active + m * n), hw)
    d_input = roofline(flops, c * (m * n * (k // dn) + n * k * active + m * k), hw)
    d_weights = roofline(flops, c * (k * m * (n // tn) + m * n * (k // tk) + E * k * n), hw)
    return forward, d_input + d_weights


def compute_seconds(cfg, mesh_shape, hw, summed_gradient_bytes):
    """{kind of work: seconds per step on one device}: "matmul fusions", "kernels",
    "elementwise" (the rest), as the TPU compiler's clock would have the layers and the
    loss, every stage's layers over pp (the pipeline's bubble and the update are the
    caller's: update_seconds). summed_gradient_bytes: the float32 gradient sums each
    microbatch after the first adds into (0 without accumulation): the compiler fuses the
    add into the weight gradient's matmul."""
    m, t = cfg.model, cfg.train
    s = local_sizes(cfg, mesh_shape)
    pp = mesh_shape["pp"]
    layers = "D" * m.first_dense + m.block_pattern * (m.n_blocks + m.mtp_depth)  # each layer's kind
    passes = 4 if m.remat in RECOMPUTE_FORWARD else 3
    matmul = sum(roofline_s(M, K, N, s.c, hw, batch) for kind in layers for M, K, N, batch in layer_matmuls(s, kind, m))
    rows = s.b * s.T
    matmul = passes * (matmul / pp + roofline_s(rows, s.D, s.V, s.c, hw)) / MATMUL_SHARE  # (the output layer: the last stage's)
    kernels = sum(kernel_seconds(s, kind, m, m.remat != "none", hw) for kind in layers) / pp
    residuals = rows * sum(layer_bytes(s, kind, m) for kind in layers) / pp + rows * s.V * F32  # + the logits
    elementwise = residuals * ELEMENTWISE_PASSES / hw.hbm_bw
    sums = 3 * summed_gradient_bytes * (t.microbatches - 1) / hw.hbm_bw  # the sum and the gradient read, the sum written
    return {"matmul fusions": t.microbatches * matmul + sums, "kernels": t.microbatches * kernels,
            "elementwise": t.microbatches * elementwise}


def update_seconds(hw, state_bytes):
    """The update's elementwise work: the params and optimizer state (state_bytes)
    read and written once."""
    return 2 * state_bytes / hw.hbm_bw


def step_efficiency(cfg, mesh_shape, hw, executed_flops, summed_gradient_bytes):
    """(share of the peak, compute_seconds): the share at which the executed FLOPs
    (costs.executed_flops, all devices) take compute_seconds' total, the planner's
    compute model of the layers in one number."""
    n_devices = math.prod(mesh_shape.values())
    seconds = compute_seconds(cfg, mesh_shape, hw, summed_gradient_bytes)
    return executed_flops / (n_devices * hw.peak_flops * sum(seconds.values())), seconds
