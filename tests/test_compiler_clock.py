"""The compiler's clock (planning/hlo_reader.timed_ops): the TPU compiler's estimated
cycles of an optimized module summed over the ops a step runs, Pallas kernels at their
roofline, and the model's parts told apart by their jax.named_scope. Text in, numbers
out: hand-written modules and a CPU-compiled one; no TPU compiler needed."""

import jax
import jax.numpy as jnp
import pytest

from planning import hlo_reader

V4 = hlo_reader.Chip(clock_hz=1e9, peak_flops=275e12, hbm_bytes_per_s=1.25e12)


def cycles(n):
    return f'backend_config={{"window_config":{{"estimated_cycles":"{n}"}}}}'


ATTENTION = 'metadata={op_name="jit(step)/transpose(jvp())/while/body/attention/dot_general"}'
KERNEL_CONFIG = ('backend_config={"custom_call_config":{"body":"x","cost_estimate":{"flops":"2750000000","transcendentals":"0",'
                 '"bytes_accessed":"2500000","remote_bytes_transferred":"0"}}}')

# A step by hand: a loop of 4 trips whose body runs a matmul fusion (1000 cycles) under
# "attention"; in the entry a copy (500), a transpose-only fusion (300), an elementwise
# fusion (40), a conditional whose branches cost 200 and 700, and a Pallas kernel whose
# cost_estimate is 2.75e9 FLOPs (10 us at 275 TFLOP/s) and 2.5e6 bytes (2 us at 1.25 TB/s).
STEP_HLO = f"""HloModule m, is_scheduled=true

%matmul (p0: bf16[64,128], p1: bf16[128,256]) -> bf16[64,256] {{
  %p0 = bf16[64,128]{{1,0}} parameter(0)
  %p1 = bf16[128,256]{{1,0}} parameter(1)
  ROOT %convolution.1 = bf16[64,256]{{1,0}} convolution(%p0, %p1), dim_labels=bf_io->bf
}}

%swap (p0: bf16[64,128]) -> bf16[128,64] {{
  %p0 = bf16[64,128]{{1,0}} parameter(0)
  ROOT %transpose.1 = bf16[128,64]{{1,0}} transpose(%p0), dimensions={{1,0}}
}}

%scale (p0: bf16[64,128]) -> bf16[64,128] {{
  %p0 = bf16[64,128]{{1,0}} parameter(0)
  ROOT %multiply.1 = bf16[64,128]{{1,0}} multiply(%p0, %p0)
}}

%body (t: (s32[], bf16[64,128], bf16[128,256])) -> (s32[], bf16[64,128], bf16[128,256]) {{
  %t = (s32[], bf16[64,128]{{1,0}}, bf16[128,256]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %a = bf16[64,128]{{1,0}} get-tuple-element(%t), index=1
  %b = bf16[128,256]{{1,0}} get-tuple-element(%t), index=2
  %fusion.1 = bf16[64,256]{{1,0}} fusion(%a, %b), kind=kOutput, calls=%matmul, {ATTENTION}, {cycles(1000)}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], bf16[64,128]{{1,0}}, bf16[128,256]{{1,0}}) tuple(%next, %a, %b)
}}

%cond (t: (s32[], bf16[64,128], bf16[128,256])) -> pred[] {{
  %t = (s32[], bf16[64,128]{{1,0}}, bf16[128,256]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}}

%cheap (p: bf16[64,128]) -> bf16[64,128] {{
  %p = bf16[64,128]{{1,0}} parameter(0)
  ROOT %copy.2 = bf16[64,128]{{1,0}} copy(%p), {cycles(200)}
}}

%costly (p: bf16[64,128]) -> bf16[64,128] {{
  %p = bf16[64,128]{{1,0}} parameter(0)
  ROOT %copy.3 = bf16[64,128]{{1,0}} copy(%p), {cycles(700)}
}}

ENTRY %main (a: bf16[64,128], b: bf16[128,256], k: s32[]) -> (s32[], bf16[64,128], bf16[128,256]) {{
  %a = bf16[64,128]{{1,0}} parameter(0)
  %b = bf16[128,256]{{1,0}} parameter(1)
  %k = s32[] parameter(2)
  %copy.1 = bf16[64,128]{{1,0}} copy(%a), metadata={{op_name="jit(step)/optimizer/copy"}}, {cycles(500)}
  %fusion.2 = bf16[128,64]{{1,0}} fusion(%a), kind=kLoop, calls=%swap, {cycles(300)}
  %fusion.3 = bf16[64,128]{{1,0}} fusion(%a), kind=kLoop, calls=%scale, metadata={{op_name="jit(step)/rms_norm/mul"}}, {cycles(40)}
  %conditional = bf16[64,128]{{1,0}} conditional(%k, %a, %a), branch_computations={{%cheap, %costly}}
  %gmm.1 = f32[8]{{0}} custom-call(%a), custom_call_target="tpu_custom_call", {KERNEL_CONFIG}
  %zero = s32[] constant(0)
  %init = (s32[], bf16[64,128]{{1,0}}, bf16[128,256]{{1,0}}) tuple(%zero, %a, %b)
  ROOT %while = (s32[], bf16[64,128]{{1,0}}, bf16[128,256]{{1,0}}) while(%init), condition=%cond, body=%body
}}
"""


def test_a_step_on_the_compilers_clock():
    """4 x 1000 in the loop + 500 + 300 + 40 + 700 (the costlier branch) cycles at 1 GHz,
    + the kernel's 10 us: each op by its kind, with its runs per step."""
    ops = hlo_reader.timed_ops(STEP_HLO, V4)
    by_name = {op.name: op for op in ops}
    assert by_name["fusion.1"].runs == 4 and by_name["fusion.1"].seconds == pytest.approx(1e-6)
    assert "copy.2" not in by_name and by_name["copy.3"].runs == 1
    assert by_name["gmm.1"].seconds == pytest.approx(10e-6)
    kinds = hlo_reader.seconds_by(ops, lambda op: op.kind)
    assert kinds == pytest.approx({"matmul fusions": 4000e-9, "copies and transposes": (500 + 300 + 700) * 1e-9,
                                   "other fusions": 40e-9, "kernels": 10e-6})
    assert sum(op.step_seconds for op in ops) == pytest.approx((4000 + 500 + 300 + 40 + 700) * 1e-9 + 10e-6)


def test_a_kernel_bound_by_its_bytes_takes_their_time():
    hlo = STEP_HLO.replace('"bytes_accessed":"2500000"', '"bytes_accessed":"25000000000"')  # 20 ms at 1.25 TB/s
    kernel = next(op for op in hlo_reader.timed_ops(hlo, V4) if op.kind == "kernels")
    assert kernel.seconds == pytest.approx(20e-3)


# A splash kernel as libtpu writes it (its Mosaic body left out): no cost_estimate; its
# block mask [heads, 2, 2] (blocks of 1024) first, then q [B, H, T, W], k, v [B, H, T, K] (bfloat16), q's
# positions; results: VMEM scratch of rank 3, then the output and log-sum-exp (rank 4).
B, H, T, W, K = 2, 4, 2048, 192, 128
SPLASH_LINE = ('  %splash_mha_{kind}.3 = (f32[2,128,128]{{2,1,0}}, bf16[2,4,2048,128]{{3,2,1,0}}, f32[2,4,2048,128]{{3,2,1,0}}) '
               'custom-call(%m, %n, %q, %k, %v, %s), custom_call_target="tpu_custom_call", operand_layout_constraints={{'
               's8[1,2,2]{{2,1,0}}, s8[1,2,2]{{2,1,0}}, bf16[2,4,2048,192]{{3,2,1,0}}, bf16[2,4,2048,192]{{3,2,1,0}}, '
               'bf16[2,4,2048,128]{{3,2,1,0}}, s32[2048,128]{{1,0}}}}, backend_config={{"custom_call_config":{{"body":"x"}}}}')


@pytest.mark.parametrize("kind, macs", [("fwd_residuals", W + K), ("dq_no_residuals", 2 * W + K),
                                        ("dkv_no_residuals", 2 * W + 2 * K)])
def test_a_splash_kernel_is_timed_from_the_blocks_its_causal_mask_visits(kind, macs):
    """Splash carries no cost estimate: its FLOPs are counted from its shapes, the pairs
    of the 3 of 2 x 2 blocks a causal mask visits, each (query, key) pair's multiply-adds
    as the kernel runs them (the scores again in both backward kernels), and timed at
    the chip's peak or by its bytes, whichever is longer."""
    line = SPLASH_LINE.format(kind=kind)
    flops = 2 * macs * B * H * T * T * 3 / 4
    assert hlo_reader.attention_kernel_flops(line) == flops
    q_k_v = 2 * (2 * B * H * T * W + B * H * T * K)
    results = 2 * B * H * T * 128 + 4 * B * H * T * 128
    assert hlo_reader.attention_kernel_bytes(line) == 2 * 4 + q_k_v + 4 * T * 128 + results
    assert hlo_reader.kernel_seconds(line, V4) == pytest.approx(flops / V4.peak_flops)
    slow_memory = hlo_reader.Chip(clock_hz=1e9, peak_flops=275e12, hbm_bytes_per_s=1e9)
    assert hlo_reader.kernel_seconds(line, slow_memory) == pytest.approx(hlo_reader.attention_kernel_bytes(line) / 1e9)
    assert hlo_reader.causal_blocks(4, 4, 512, 512) == 10 and hlo_reader.causal_blocks(2, 4, 256, 512) == 7


def test_ops_go_to_the_innermost_named_part():
    parts = ("attention", "rms_norm", "optimizer", "moe_experts", "moe_dispatch_combine")
    ops = hlo_reader.timed_ops(STEP_HLO, V4)
    assert hlo_reader.seconds_by(ops, lambda op: hlo_reader.model_part(op.op_name, parts)) == pytest.approx(
        {"attention": 4000e-9, "optimizer": 500e-9, "rms_norm": 40e-9, "other": 300e-9 + 700e-9 + 10e-6})
    assert hlo_reader.model_part("jit(s)/moe_dispatch_combine/moe_experts/transpose(jvp(dot_general))", parts) == "moe_experts"


def test_named_scopes_reach_the_compiled_backward():
    """A scope on a method names its ops forward, in the remat's recompute and in the
    backward pass: every dot of the compiled gradient is attention's."""
    @jax.named_scope("attention")
    def attend(x, w):
        return jnp.tanh(x @ w)

    def loss(w, x):
        y, _ = jax.lax.scan(jax.checkpoint(lambda c, _: (attend(c, w), None)), x, None, length=3)
        return y.sum()

    hlo = jax.jit(jax.grad(loss)).lower(jnp.ones((4, 4)), jnp.ones((2, 4))).compile().as_text()
    dots = [line for line in hlo.splitlines() if " dot(" in line]
    assert len(dots) >= 3 and all(hlo_reader.model_part(hlo_reader.OP_NAME.search(d).group(1), ("attention",)) == "attention"
                                  for d in dots)


def test_exposed_collectives_at_the_planners_rates():
    """1 GB all-gathered at ring_bw 100 GB/s: 10 ms; 1 GB all-reduced: twice that; 1 GB
    sent to a neighbour at p2p_bw 50 GB/s: 20 ms; overlapped bytes cost nothing."""
    from planning import report
    from planning.costs import HARDWARE
    ov = {"by kind": {("all-gather", "dp"): {"overlapped": 5e9, "exposed": 1e9}, ("all-reduce", "tp"): {"overlapped": 0, "exposed": 1e9},
                      ("collective-permute", "pp"): {"overlapped": 0, "exposed": 1e9}}}
    assert report.exposed_collective_seconds(ov, HARDWARE["tpu-v4"]) == pytest.approx(0.010 + 0.020 + 0.020)
