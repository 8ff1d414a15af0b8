"""Which layout should I use? Every layout of a preset on some devices, planned, ranked.

    python planner.py --preset moe1b --hardware tpu-v4 --mesh.dp 8 --mesh.pp 2 --mesh.tp 2 --search
    python planner.py --preset moe1b --tpu v4-64 --search        # and the top K compiled (planning/report.py)

A layout is what a user changes between runs on the same devices and the same global
batch: the mesh (dp x cp x pp x tp, the device count fixed; --mesh.slices as given), expert
parallelism, the pipeline schedule and its virtual stages, the microbatches and the
remat policy; cp layouts with every executor and with expert parallelism, as without
cp. Each is planned (costs.plan: pure arithmetic on shapes traced once); those
that do not divide the model or the batch raise ConfigError and drop out (so do the cp
layouts that utils.context_parallel_checks refuses: a sequence not in 2 cp chunks, a
routing group or attention block straddling chunks, dot_product_attention), and those
whose bytes exceed the device's memory are kept aside. The rest are ranked by the
predicted step: compute + bubble + the communication the compiled schedule leaves
exposed (costs.exposed_communication; the serial step, nothing overlapped, is
printed beside it).

Not searched:
  cp's model flags --model.routing_group (must divide seq_len / 2cp), --model.attention
                  and --model.attention_block: they change the model, not its layout,
                  so the search lays out cp only for a model whose flags allow it (the
                  moe1b preset's whole-sequence routing group allows none).
  --train.gather_once  the FSDP gather once per step or once per microbatch under
                  accumulation: each layout keeps the config's choice (auto by default:
                  once where the gathered blocks fit, executor_accumulate's rule).
  --mesh.sharding auto compiles the same layouts (pp = 1) with the compiler's collectives;
                  the planner predicts the same step for both, so it is not a lever here.
"""

import dataclasses
import itertools
import math

from planning.costs import plan
from utils import AXES, CP, PIPELINE_SCHEDULES, REMAT_POLICIES, ConfigError, apply_overrides

MAX_MICROBATCHES = 64  # beyond this a microbatch is a sliver of a sequence per device: no faster, rarely needed
VIRTUAL_STAGES = (2, 4)  # interleaved: chunks per stage tried (n_blocks must divide into pp x V)


# The axes the search lays out: every mesh axis within a slice, (dp, cp, pp, tp).
SEARCHED_AXES = AXES


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def mesh_shapes(n_devices):
    """Every (dp, cp, pp, tp) over SEARCHED_AXES whose product is n_devices."""
    for head in itertools.product(divisors(n_devices), repeat=len(SEARCHED_AXES) - 1):
        if n_devices % math.prod(head) == 0:
            yield (n_devices // math.prod(head),) + head


def layout_flags(cfg):
    """The flags that set cfg's layout, to paste after --preset NAME."""
    m, t, mesh = cfg.model, cfg.train, cfg.mesh
    flags = [f"--mesh.{axis} {getattr(mesh, axis)}" for axis in SEARCHED_AXES if axis != CP or mesh.cp > 1]
    if mesh.expert_parallel:
        flags.append("--mesh.expert_parallel true")
    if mesh.pp > 1:
        flags.append(f"--train.pipeline {t.pipeline}")
        if t.pipeline == "interleaved":
            flags.append(f"--train.virtual_stages {t.virtual_stages}")
    flags += [f"--train.microbatches {t.microbatches}", f"--model.remat {m.remat}"]
    return " ".join(flags)


def layouts(cfg, n_devices):
    """Configs of every layout of cfg's model and batch on n_devices (per slice)."""
    m, t = cfg.model, cfg.train
    rows = t.batch_size // cfg.mesh.slices
    ep_choices = (False, True) if "M" in m.block_pattern and m.capacity_factor > 0 else (False,)
    for shape in mesh_shapes(n_devices):
        mesh = dict(zip(SEARCHED_AXES, shape))
        dp, pp = mesh["dp"], mesh["pp"]
        if rows % dp or m.n_blocks % pp:
            continue
        schedules = [("gpipe", cfg.train.virtual_stages)] if pp == 1 else (
            [(kind, t.virtual_stages) for kind in PIPELINE_SCHEDULES if kind not in ("interleaved", "zbv")]
            + [("interleaved", v) for v in VIRTUAL_STAGES if m.n_blocks % (pp * v) == 0]
            + [("zbv", t.virtual_stages)] * (m.n_blocks % (2 * pp) == 0))
        micro = [d for d in divisors(rows // dp) if pp <= d <= MAX_MICROBATCHES]
        for ep, (kind, v), M, remat in itertools.product(ep_choices, schedules, micro, REMAT_POLICIES):
            if (kind == "interleaved" and M % pp) or (kind == "zbv" and M < 2 * pp):
                continue
            yield apply_overrides(cfg, {"mesh": dict(mesh, expert_parallel=ep),
                                        "train": dict(pipeline=kind, virtual_stages=v, microbatches=M),
                                        "model": dict(remat=remat)})


@dataclasses.dataclass
class Ranked:
    flags: str
    plan: dict
    cfg: object = None  # the layout's Config
    compiled_fits: bool | None = None  # what the TPU compiler says (--tpu --search), None: not compiled

    @property
    def step_s(self):
        """The predicted step (what the schedule leaves exposed), the search's ranking."""
        return self.plan["step_s_predicted"]

    @property
    def tokens_per_sec(self):
        """The batch's tokens over the predicted step."""
        p = self.plan
        return p["tokens_per_sec"] * p["step_s_serial"] / self.step_s

    @property
    def mfu(self):
        """Model FLOPs over the devices' peak for the predicted step."""
        p = self.plan
        return p["times"]["model_flops"] / (self.step_s * p["devices"] * p["peak_flops"])


def search(cfg, devices, hw_name, efficiency, peak=None):
    """(fitting, tried, too_big): the layouts that fit, fastest first (of equal steps, the
    one that needs less memory), as Ranked; how many were planned; how many divide but do
    not fit."""
    n = (devices or math.prod(getattr(cfg.mesh, a) for a in SEARCHED_AXES) * cfg.mesh.slices) // cfg.mesh.slices
    fitting, tried, too_big = [], 0, 0
    for layout in layouts(cfg, n):
        try:
            p = plan(layout, n * cfg.mesh.slices, hw_name, efficiency, peak)
        except (ConfigError, ValueError, ZeroDivisionError):
            continue  # does not divide the model (weights, heads, experts) or the batch
        tried += 1
        peak = p["peak_flops"]  # (cpu: measured once)
        if p["fits"]:
            fitting.append(Ranked(layout_flags(layout), p, layout))
        else:
            too_big += 1
    return sorted(fitting, key=lambda r: (round(r.step_s, 9), r.plan["total_bytes"])), tried, too_big


def suggestions(cfg, devices, hw_name, efficiency, peak):
    """Nearby configs on the same devices that fit: [(flags, plan)], those that keep the
    global batch first, then by memory."""
    m, t, mesh = cfg.model, cfg.train, cfg.mesh
    n = devices or mesh.dp * mesh.cp * mesh.pp * mesh.tp
    dp, pp, tp = (n // (mesh.cp * mesh.pp * mesh.tp) if mesh.dp == -1 else mesh.dp), mesh.pp, mesh.tp
    same_batch = {}
    if m.remat == "none":
        same_batch["--model.remat block"] = {"model": {"remat": "block"}}
    if m.dtype == "float32":
        same_batch["--model.dtype bfloat16"] = {"model": {"dtype": "bfloat16"}}
    smaller_batch = {}
    for factor in (2, 4, 8):
        if dp % factor == 0:
            same_batch[f"--mesh.dp {dp // factor} --mesh.tp {tp * factor}"] = {"mesh": {"dp": dp // factor, "tp": tp * factor}}
            microbatches = max(t.microbatches, 2 * pp * factor)
            same_batch[f"--mesh.dp {dp // factor} --mesh.pp {pp * factor} --train.microbatches {microbatches}"] = {
                "mesh": {"dp": dp // factor, "pp": pp * factor}, "train": {"microbatches": microbatches}}
        smaller = {"train": {"batch_size": t.batch_size // factor}}
        if m.remat == "none":
            smaller["model"] = {"remat": "block"}
        smaller_batch[f"--train.batch_size {t.batch_size // factor}" + (" --model.remat block" if m.remat == "none" else "")] = smaller
    fitting = []
    for rank, tries in enumerate((same_batch, smaller_batch)):
        for flags, overrides in tries.items():
            try:
                p = plan(apply_overrides(cfg, overrides), devices, hw_name, efficiency, peak)
            except (ConfigError, ValueError, ZeroDivisionError):
                continue  # that mesh does not divide the model or the batch
            if p["fits"]:
                fitting.append((rank, p["total_bytes"], flags, p))
    return [(flags, p) for _, _, flags, p in sorted(fitting, key=lambda x: x[:2])]
