"""What planner.py prints: the plan of one layout, the TPU compiler's figures beside it
(--tpu TYPE), and docs/planning.md's table of every preset on the pods people use (--table).
"""

import json
import re

from parallel.mesh import make_mesh
from planning import hlo_reader, tpu_compile
from planning.costs import DCN_BW_PER_CHIP, HARDWARE, GiB, plan, plan_config
from runtime.flops import human
from utils import PRESETS, Config, apply_overrides

# ---- Printing


def memory_unit(n):
    """(name, bytes) of the unit that shows n best: one unit for a whole table."""
    return next((name, size) for name, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)) if n >= size / 10)


def seconds(s):
    return f"{s * 1e3:9.1f} ms" if s < 10 else f"{s:9.1f} s "


def report(p):
    mesh, mem, t = p["mesh"], p["memory"], p["times"]
    slices = f"slices={mesh['slice']} x " if mesh.get("slice", 1) > 1 else ""
    head = [f"{p['preset']} on {p['devices']} x {p['hardware']}: mesh {slices}dp={mesh['dp']}"
            + (f" cp={mesh['cp']}" if mesh.get("cp", 1) > 1 else "") + f" pp={mesh['pp']} tp={mesh['tp']}"
            f"{' (expert parallel)' if p['expert_parallel'] else ''}, {p['dtype']}, remat {p['remat']}, "
            f"{p['microbatches']} microbatches" + (" accumulated, the blocks gathered once per step" if p.get("gather_once") else ""),
            f"params: {human(p['params_total'])} total, {human(p['params_active'])} active per token"]
    unit, size = memory_unit(p["total_bytes"])

    def mem_str(n):
        return f"{n / size:9.2f} {unit}"

    rows = [("memory per device", "")]
    rows += [("  " + key, mem_str(value)) for key, value in mem.items() if key != "activations"]
    rows.append(("  activations", mem_str(mem["activations"])))
    rows += [("    " + name, mem_str(value)) for name, value in p["activations"].items()]
    rows += [("  total", mem_str(p["total_bytes"]) + f"   of {p['available_bytes'] / GiB:.2f} GiB"), ("", "")]
    how = "as the TPU compiler would time it (planning/compute_clock.py): " if p.get("compute_kinds") else "at an assumed "
    rows.append((f"step time (compute {how}{p['efficiency']:.0%} of {human(p['peak_flops'])}FLOP/s per device)", ""))
    rows.append((f"  compute: {human(t['executed_flops'])}FLOP executed ({human(t['model_flops'])}FLOP model"
                 + (f", DPO's reference forward {human(t['reference_flops'])}FLOP" if "reference_flops" in t else "") + ")"
                 + (f" + Muon's Newton-Schulz {human(t['optimizer_flops'])}FLOP per device" if "optimizer_flops" in t else ""),
                 seconds(t["compute"])))
    if p["mesh"]["pp"] > 1:
        rows.append((f"  pipeline bubble ({p['pipeline']}: {p['bubble_fraction']:.1%} of the table idle)", seconds(t["bubble"])))
        rows.append(("  output layer and loss on the last stage (the others wait)", seconds(t["head"])))
        if t["prefix_imbalance"]:
            rows.append(("  the dense prefix on stage 0 alone, the other stages waiting", seconds(t["prefix_imbalance"])))
        rows.append(("  model FLOPs per token by stage: " + ", ".join(human(f) for f in p["stage_flops_per_token"])
                     + " (first: + dense prefix; last: + output layer, MTP)", ""))
    rows += [("  " + name, seconds(value)) for name, value in p["comm"].items()]
    rows.append(("  step, communication not overlapped", seconds(p["step_s_serial"]) + f"   ({p['tokens_per_sec']:,.0f} tokens/s)"))
    rows.append(("  step, communication fully overlapped", seconds(p["step_s_overlapped"])))
    rows.append(("  step predicted, what the schedule leaves exposed (costs.exposed_communication)",
                 seconds(p["step_s_predicted"]) + f"   ({exposed_share(p):.0%} of the communication exposed)"))
    width = max(len(label) for label, value in rows if value) + 2
    lines = head + [""] + [f"{label:<{width}}{value}".rstrip() for label, value in rows] + [""]
    need, have = p["total_bytes"] / GiB, p["available_bytes"] / GiB
    lines.append(f"fits: {need:.2f} GiB needed per device, {have:.2f} available" if p["fits"] else
                 f"will not fit: {need:.2f} GiB needed per device, {have:.2f} available")
    if p["loss_phase_bytes"] > p["total_bytes"] / 4:
        lines.append(f"note: {p['loss_phase_bytes'] / GiB:.2f} GiB of it is the loss: float32 logits of one microbatch "
                     "([batch/(dp x microbatches), T, V/tp], parallel.last_stage_loss_sums); more microbatches shrink it")
    if p["gpu"]:
        lines.append("note: JAX preallocates 75% of GPU memory; XLA_PYTHON_CLIENT_MEM_FRACTION=.95 lets it use more")
    return lines



def exposed_share(p):
    """The share of the plan's communication time its model of the schedule leaves exposed."""
    total = sum(p["comm"].values())
    return sum(p["comm_exposed"].values()) / total if total else 0.0


def tpu_check(cfg, tpu_name, p, hlo_out=""):
    """Compile the train and eval steps for a TPU slice (tpu_compile.py); print the
    compiler's bytes beside the plan's, the collectives, the step on the compiler's
    clock, and the contract's last line. hlo_out: a path to write the compiled train
    step's optimized HLO text to."""
    pod = tpu_compile.pod_type(tpu_name)
    mesh = make_mesh(cfg.mesh, tpu_compile.pod_devices(tpu_name, cfg.mesh.slices))
    compiled = tpu_compile.compile_steps(plan_config(cfg), mesh, hardware=pod.hardware)
    tpu = tpu_compile.memory_bytes(compiled["train"])
    hbm = HARDWARE[pod.hardware].memory_bytes
    lines = [""] + tpu_compile.memory_report(p, tpu, hbm, pod, compiled["seconds"], compiled["log"]["train"]) + [""]
    for name in ("train", "eval"):
        lines += tpu_compile.collectives_report(hlo_reader.collectives(compiled[name].as_text(), tuple(mesh.shape.values())),
                                                f"{name} step")
        over_cp = {k: v for k, v in p["times"]["collective_bytes"].items() if k.endswith(" over cp")}
        if name == "train" and over_cp:  # context parallelism's latent, as costs.latent_gathers counts it
            lines.append("  the planner's MLA latent over cp: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(over_cp.items())))
        lines.append("")
    train_hlo = compiled["train"].as_text()
    found = hlo_reader.kernels(train_hlo)
    lines += ["Pallas kernels of the train step (tpu_custom_calls in its HLO): "
              + (", ".join(f"{name} x{n}" for name, n in sorted(found.items())) or "none, every op is the compiler's"), ""]
    ov = hlo_reader.overlap(train_hlo, tuple(mesh.shape.values()))
    lines += overlap_report(ov)
    compiled_share = ov["exposed"] / max(1, ov["overlapped"] + ov["exposed"])
    lines += [f"exposed: the compiler's schedule {compiled_share:.1%} of the collective bytes; the planner's model "
              f"{exposed_share(p):.1%} of the communication time (predicted step {p['step_s_predicted'] * 1e3:.4g} ms, "
              f"serial {p['step_s_serial'] * 1e3:.4g} ms)", ""]
    if hlo_out:
        with open(hlo_out, "w") as f:
            f.write(train_hlo)
    clock = compiler_clock(train_hlo, HARDWARE[pod.hardware], ov)
    lines += clock_report(p, clock, found) + [""]
    fits = tpu_compile.fits(tpu, compiled["log"]["train"], hbm)
    lines.append(f"tpu_bytes_per_device={tpu['total']} planner_bytes_per_device={p['total_bytes']} fits={str(fits).lower()} "
                 f"collective_bytes={ov['overlapped'] + ov['exposed']} exposed_bytes={ov['exposed']} "
                 f"dot_flops_per_device={hlo_reader.dot_flops(train_hlo)} "
                 f"planner_dot_flops_per_device={round(p['times']['device_flops'])} "
                 f"low_precision_dot_flops_per_device={hlo_reader.low_precision_dot_flops(train_hlo)} "
                 f"compiler_step_ms={clock['step_s'] * 1e3:.6g} compiler_compute_ms={clock['compute_s'] * 1e3:.6g}")
    return lines


# ---- The compiler's clock: the train step as the TPU compiler's cost model times it

# The jax.named_scope names of the model's parts (model.py) and of the update (parallel/step_core.py)
MODEL_PARTS = ("attention", "rms_norm", "router", "moe_dispatch_combine", "moe_experts", "dense_ffn", "embedding",
               "loss_heads", "optimizer")


def exposed_collective_seconds(ov, hw):
    """The collective bytes the compiled schedule leaves exposed (hlo_reader.overlap) at
    the planner's rates: a ring collective at ring_bw (an all-reduce moves its bytes
    twice), a collective-permute at p2p_bw, what crosses slices at DCN_BW_PER_CHIP."""
    total = 0.0
    for (kind, over), row in ov["by kind"].items():
        bw = DCN_BW_PER_CHIP if hlo_reader.crosses_slices(over) else hw.p2p_bw if kind == "collective-permute" else hw.ring_bw
        total += row["exposed"] * (2 if kind == "all-reduce" else 1) / bw
    return total


def compiler_clock(hlo, hw, ov):
    """{"ops": [hlo_reader.TimedOp], "compute_s", "exposed_s", "step_s"}: the step on the
    compiler's clock, compute (every op's estimated cycles over its runs, the kernels at
    their roofline) plus the collectives its schedule leaves exposed."""
    ops = hlo_reader.timed_ops(hlo, hlo_reader.Chip(hw.clock_hz, hw.peak_flops, hw.hbm_bw))
    compute = sum(op.step_seconds for op in ops)
    exposed = exposed_collective_seconds(ov, hw)
    return dict(ops=ops, compute_s=compute, exposed_s=exposed, step_s=compute + exposed)


def short_op_name(op_name, width=90):
    """An op_name without the jit(...)/ prefix, its tail kept when too long."""
    name = op_name.split("/", 1)[-1]
    return name if len(name) <= width else "..." + name[-width + 3:]


def clock_report(p, clock, kernels_found, top=12):
    """Lines: the planner's step beside the compiler's clock, by kind of op, by the
    model's parts (MODEL_PARTS), and the costliest ops outside the matmuls."""
    t, step = p["times"], clock["step_s"]
    planner_compute = t["compute"] + t.get("bubble", 0) + t.get("head", 0)
    lines = ["the train step on the compiler's clock (each op's estimated_cycles x its runs per step, Pallas kernels at "
             "their roofline; per device):",
             f"  {'':<44}{'planner':>10}{'compiler':>11}",
             f"  {'compute':<44}{planner_compute * 1e3:>7.1f} ms{clock['compute_s'] * 1e3:>8.1f} ms",
             f"  {'communication exposed':<44}{(p['step_s_predicted'] - planner_compute) * 1e3:>7.1f} ms"
             f"{clock['exposed_s'] * 1e3:>8.1f} ms   (the compiler's: its schedule's exposed bytes at the planner's rates)",
             f"  {'step':<44}{p['step_s_predicted'] * 1e3:>7.1f} ms{step * 1e3:>8.1f} ms", "", "  by kind of op:"]
    by_kind = hlo_reader.seconds_by(clock["ops"], lambda op: op.kind)
    rows = [(kind, by_kind.get(kind, 0.0)) for kind in hlo_reader.COMPUTE_KINDS] + [("collectives exposed", clock["exposed_s"])]
    lines += [f"    {name:<42}{s * 1e3:>10.1f} ms {s / step:6.1%}" for name, s in rows]
    if p.get("compute_kinds"):  # the planner's model of the same clock (compute_clock), the kinds lumped as it lumps them
        # (stretched by what the pipeline adds to them, its bubble and the last stage's head, as the compiled ticks run)
        stretch = planner_compute / (t["compute"] or 1.0)
        rest = sum(s for kind, s in by_kind.items() if kind not in p["compute_kinds"])
        lines.append(f"  {'the planner, by kind (planning/compute_clock.py)':<44}{'planner':>10}{'compiler':>11}")
        for kind, s in p["compute_kinds"].items():
            compiled, note = ((by_kind.get(kind, 0.0), "") if kind in hlo_reader.COMPUTE_KINDS else
                              (rest, "   (other fusions, copies and transposes, other ops)"))
            lines.append(f"    {kind:<42}{s * stretch * 1e3:>7.1f} ms{compiled * 1e3:>8.1f} ms{note}")
    timed = {re.sub(r"\.\d+$", "", op.name) for op in clock["ops"] if op.kind == "kernels"}
    untimed = sorted(set(kernels_found) - timed)
    if untimed:
        lines.append(f"    (not counted: Pallas kernels with no cost estimate: {', '.join(untimed)})")
    lines += ["", "  by the model's part (jax.named_scope on the op's path; the innermost named):"]
    by_part = hlo_reader.seconds_by(clock["ops"], lambda op: hlo_reader.model_part(op.op_name, MODEL_PARTS))
    matmul_part = hlo_reader.seconds_by([op for op in clock["ops"] if op.kind == "matmul fusions"],
                                        lambda op: hlo_reader.model_part(op.op_name, MODEL_PARTS))
    lines += [f"    {part:<42}{s * 1e3:>10.1f} ms {s / step:6.1%}   (matmul fusions {matmul_part.get(part, 0) * 1e3:.1f} ms)"
              for part, s in by_part.items()]
    unnamed = hlo_reader.seconds_by([op for op in clock["ops"] if hlo_reader.model_part(op.op_name, MODEL_PARTS) == "other"],
                                    lambda op: op.op_name.rsplit("/", 1)[-1] or "(no op_name)")
    lines.append("    other, by the op it was: " + ", ".join(f"{name} {s * 1e3:.1f} ms" for name, s in list(unnamed.items())[:8]))
    lines += ["", "  the costliest ops outside the matmul fusions (ms per step = runs x one run):"]
    others = sorted((op for op in clock["ops"] if op.kind != "matmul fusions"), key=lambda op: -op.step_seconds)
    lines += [f"    {op.step_seconds * 1e3:8.2f} ms {op.runs:>4} x {op.name:<28} {op.kind:<22} {short_op_name(op.op_name)}"
              for op in others[:top]]
    return lines


def overlap_report(ov):
    """Lines: what of the train step's communication the compiled schedule runs beside
    matmul work (hlo_reader.overlap), in all and by kind."""
    total = ov["overlapped"] + ov["exposed"]
    lines = [f"the compiled train step's schedule (per step, per device): of {total / 2**20:.1f} MiB of collectives it "
             f"overlaps {ov['overlapped'] / 2**20:.1f} MiB with matmul work and leaves {ov['exposed'] / 2**20:.1f} MiB "
             f"exposed ({ov['exposed'] / max(total, 1):.0%})",
             f"  {'kind':<20}{'over':<16}{'overlapped':>14}{'exposed':>14}"]
    for (kind, over), row in sorted(ov["by kind"].items(), key=lambda kv: (hlo_reader.COLLECTIVE_KINDS.index(kv[0][0]), kv[0][1])):
        lines.append(f"  {kind:<20}{over:<16}{row['overlapped'] / 2**20:>10.1f} MiB{row['exposed'] / 2**20:>10.1f} MiB")
    return lines


# ---- docs/planning.md's table: every preset on the pods people use, planner beside compiler
#
#     python planner.py --table [--presets shakespeare,tiny,moe1b] [--pods v4-8,v4-64,...]

# preset -> pod -> mesh flags (dp, pp, tp, microbatches)
TABLE_MESHES = {
    "shakespeare": {"v4-8": (4, 1, 1, 1), "v4-64": (16, 1, 2, 1), "v5p-64": (16, 1, 2, 1), "v5litepod-16": (16, 1, 1, 1),
                    "v6e-16": (16, 1, 1, 1)},
    "tiny": {"v4-8": (4, 1, 1, 1), "v4-64": (8, 2, 2, 2), "v5p-64": (8, 2, 2, 2), "v5litepod-16": (4, 2, 2, 2),
             "v6e-16": (4, 2, 2, 2)},
    "deepseek_v3": {"v4-8": (4, 1, 1, 1), "v4-64": (16, 1, 2, 1), "v5p-64": (16, 1, 2, 1), "v5litepod-16": (16, 1, 1, 1),
                    "v6e-16": (16, 1, 1, 1)},
    "moe1b": {"v4-8": (1, 2, 2, 4), "v4-64": (8, 2, 2, 4), "v5p-64": (8, 2, 2, 4), "v5litepod-16": (4, 2, 2, 4),
              "v6e-16": (4, 2, 2, 4)},
}


def table_row(preset, pod_name):
    dp, pp, tp, microbatches = TABLE_MESHES[preset][pod_name]
    cfg = plan_config(apply_overrides(apply_overrides(Config(), PRESETS[preset]), {
        "mesh": dict(dp=dp, pp=pp, tp=tp), "train": dict(microbatches=microbatches)}))
    pod = tpu_compile.pod_type(pod_name)
    mesh = make_mesh(cfg.mesh, tpu_compile.pod_devices(pod_name))
    compiled = tpu_compile.compile_steps(cfg, mesh, eval_step=False, hardware=pod.hardware)
    tpu = tpu_compile.memory_bytes(compiled["train"])
    planned = plan(cfg, 0, pod.hardware)
    hbm = HARDWARE[pod.hardware].memory_bytes
    return dict(preset=preset, pod=pod_name, mesh=f"{dp}x{pp}x{tp}", microbatches=microbatches, tpu_bytes=tpu["total"],
                planner_bytes=planned["total_bytes"], fits=tpu_compile.fits(tpu, compiled["log"]["train"], hbm),
                compile_s=compiled["seconds"]["train"],
                tpu=tpu, planner_temp_bytes=planned["temp_bytes"], log=compiled["log"]["train"])


def print_pod_table(argv):
    """`python planner.py --table [--presets P,...] [--pods T,...] [--json PATH]`."""
    args = dict(zip(argv[::2], argv[1::2]))
    presets = args.get("--presets", ",".join(TABLE_MESHES)).split(",")
    pods = args.get("--pods", "v4-8,v4-64,v5p-64,v5litepod-16,v6e-16").split(",")
    print("| preset | pod | dp x cp x pp x tp, microbatches | TPU compiler MiB/device (live) | planner MiB/device | planner / TPU (live) "
          "| fits | train step compile s |")
    print("|---|---|---|---|---|---|---|---|")
    for preset in presets:
        for pod_name in pods:
            r = table_row(preset, pod_name)
            tpu_mib, planner_mib = r["tpu_bytes"] / 2**20, r["planner_bytes"] / 2**20
            tpu_col, ratio_col = f"{tpu_mib:.1f}", f"{planner_mib / tpu_mib:.2f}"
            if r["log"]:  # the total with the live temporaries, the planner's model of them
                live_mib = tpu_compile.live_total(r["tpu"], r["log"]) / 2**20
                tpu_col, ratio_col = f"{tpu_mib:.1f} ({live_mib:.1f})", f"{ratio_col} ({planner_mib / live_mib:.2f})"
            dp, pp, tp = r["mesh"].split("x")  # the table's meshes split no sequence: cp 1
            print(f"| {preset} | {pod_name} | {dp} x 1 x {pp} x {tp}, {r['microbatches']} | {tpu_col} | {planner_mib:.1f} | "
                  f"{ratio_col} | {'yes' if r['fits'] else 'no'} | {r['compile_s']:.0f} |", flush=True)
            if "--json" in args:
                with open(args["--json"], "a") as f:
                    f.write(json.dumps(r) + "\n")



# ----------------------------------------------------------------------------
# --search: the layouts that fit, fastest first (planning/search.py)


def search_row(rank, r):
    p = r.plan
    return (f"{rank:>4} {r.step_s * 1e3:9.4g} {p['step_s_serial'] * 1e3:9.4g} {r.tokens_per_sec:>13,.0f} "
            f"{r.mfu:6.1%} {p['total_bytes'] / GiB:7.3g}   {r.flags}")


def search_report(ranked, preset, preset_flags, tried, too_big, top):
    """Lines: the top layouts by predicted step (what the schedule leaves exposed), the
    preset's own layout below them, and how many were tried."""
    from planning.search import Ranked
    p = ranked[0].plan
    lines = [f"{preset['preset']} on {p['devices']} x {p['hardware']}, batch {p['tokens_per_sec'] * p['step_s_serial']:,.0f} "
             f"tokens per step: {tried} layouts divide the model and the batch, {len(ranked)} fit, {too_big} do not",
             "(compute " + ("as the TPU compiler would time each layout, planning/compute_clock.py" if p.get("compute_kinds")
                           else f"at an assumed {p['efficiency']:.0%} of peak") + "; step = compute + bubble + the communication the schedule "
             "leaves exposed (costs.exposed_communication); serial = with none of it overlapped; "
             "MFU = model FLOPs / (step x peak))", "",
             f"{'rank':>4} {'step ms':>9} {'serial':>9} {'tokens/s':>13} {'MFU':>6} {'GiB/dev':>7}   flags"]
    lines += [search_row(i + 1, r) for i, r in enumerate(ranked[:top])]
    own = Ranked(preset_flags, preset)
    rank = next((i + 1 for i, r in enumerate(ranked) if r.flags == preset_flags), None)
    lines += ["", "the preset's own layout" + (f" (rank {rank}):" if rank else
                                              " (does not fit):" if not preset["fits"] else ":"),
              search_row(rank or 0, own).replace("   0 ", "   - ", 1),
              f"best / preset: {own.step_s / ranked[0].step_s:.2f}x the tokens/s"]
    return lines


def mib(n):
    return f"{n / 2**20:10.1f} MiB"


def compiled_layout(cfg, tpu_name):
    """The TPU compiler's figures for one layout's train step: memory, whether it fits,
    dot FLOPs and collective bytes per device, and what of it the schedule overlaps."""
    pod = tpu_compile.pod_type(tpu_name)
    cfg = plan_config(cfg)
    mesh = make_mesh(cfg.mesh, tpu_compile.pod_devices(tpu_name, cfg.mesh.slices))
    compiled = tpu_compile.compile_steps(cfg, mesh, eval_step=False, hardware=pod.hardware)
    hlo, shape = compiled["train"].as_text(), tuple(mesh.shape.values())
    tpu, logged = tpu_compile.memory_bytes(compiled["train"]), compiled["log"]["train"]
    by_kind = {}
    for (kind, _, over), row in hlo_reader.collectives(hlo, shape).items():
        by_kind[f"{kind} over {over}"] = by_kind.get(f"{kind} over {over}", 0) + row["bytes"]
    ov = hlo_reader.overlap(hlo, shape)
    return dict(tpu=tpu, log=logged, fits=tpu_compile.fits(tpu, logged, HARDWARE[pod.hardware].memory_bytes),
                hbm=HARDWARE[pod.hardware].memory_bytes, dot_flops=hlo_reader.dot_flops(hlo), collective_bytes=by_kind,
                overlap=ov, seconds=compiled["seconds"]["train"], clock=compiler_clock(hlo, HARDWARE[pod.hardware], ov))


def compiled_report(rank, r, c):
    """Lines: one layout, the planner's figures beside the compiler's."""
    p, t = r.plan, r.plan["times"]
    reserved = (c["log"] or {}).get("runtime reserved", 0)
    verdict = (f"fits ({c['tpu']['total'] / GiB:.2f} GiB + the runtime's {reserved / GiB:.2f} GiB of {c['hbm'] / GiB:.0f})"
               if c["fits"] else f"does NOT fit: {c['tpu']['total'] / GiB:.2f} GiB + the runtime's {reserved / GiB:.2f} GiB "
               f"> {c['hbm'] / GiB:.0f} GiB HBM: drops out")
    lines = [f"rank {rank}: {r.flags}", f"  compiled in {c['seconds']:.0f} s: {verdict}",
             f"  {'':<34}{'planner':>14}{'TPU compiler':>15}",
             f"  {'bytes per device':<34}{p['total_bytes'] / GiB:10.2f} GiB{c['tpu']['total'] / GiB:11.2f} GiB",
             f"  {'dot FLOPs per device (lockstep)':<34}{human(t['device_flops']):>13}F{human(c['dot_flops']):>14}F"]
    planned = t["collective_bytes"]
    for key in sorted(set(planned) | set(c["collective_bytes"])):
        if planned.get(key, 0) or c["collective_bytes"].get(key, 0) > 2**20 / 10:
            lines.append(f"  {key:<34}{mib(planned.get(key, 0)):>14} {mib(c['collective_bytes'].get(key, 0)):>14}")
    lines.append(f"  {'collectives, all':<34}{mib(sum(planned.values())):>14} {mib(sum(c['collective_bytes'].values())):>14}")
    ov = c["overlap"]
    total = ov["overlapped"] + ov["exposed"]
    lines.append(f"  the compiled schedule overlaps {ov['overlapped'] / 2**20:.1f} MiB of it with matmul work and leaves "
                 f"{ov['exposed'] / 2**20:.1f} MiB exposed ({ov['exposed'] / max(total, 1):.0%})")
    clock = c["clock"]
    lines.append(f"  {'step on the compiler clock':<34}{r.step_s * 1e3:>11.1f} ms{clock['step_s'] * 1e3:>12.1f} ms"
                 f"   (compute {clock['compute_s'] * 1e3:.1f} ms + collectives exposed {clock['exposed_s'] * 1e3:.1f} ms)")
    return lines


def compile_ranked(ranked, tpu_name, k):
    """--tpu TYPE --search: compile the top k layouts; those the compiler says do not fit
    (or will not compile) drop out (Ranked.compiled_fits = False), with the reason."""
    lines = ["", f"the top {k} compiled for {tpu_name} with the TPU compiler (train step, on this CPU):"]
    for rank, r in enumerate(ranked[:k], 1):
        try:
            c = compiled_layout(r.cfg, tpu_name)
        except Exception as e:  # a compile error (e.g. out of memory at compile time) drops the layout
            r.compiled_fits = False
            lines += [f"rank {rank}: {r.flags}", f"  does not compile, drops out: {str(e).splitlines()[0][:200]}"]
            continue
        r.compiled_fits = c["fits"]
        lines += compiled_report(rank, r, c)
    return lines
