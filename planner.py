"""Plan a run before paying for it: per-device memory, step time and whether it fits.

    python planner.py --preset moe1b --hardware tpu-v5p
    python planner.py --preset moe1b --hardware h200 --mesh.dp 1 --mesh.pp 1 --mesh.tp 1
    python planner.py --preset moe1b --hardware tpu-v5e --devices 64 --mesh.dp -1 --model.remat none

Nothing is allocated and no device is needed: parameter shapes come from
`nnx.eval_shape`, the storage layout from `parallel.param_specs` (the same sharding
table the train step uses), and the mesh shape is arithmetic (`--mesh.dp -1` takes the
rest of `--devices N`). The model of a step is planner_model.py, the search
planner_search.py, the printing and the compiler's side planner_report.py. Takes every
main.py flag, plus:

    --hardware NAME   one of the HARDWARE table below (default tpu-v5p)
    --devices N       devices in the run (needed with --mesh.dp -1)
    --efficiency X    assumed fraction of peak FLOP/s the matmuls reach (default 0.5)
    --json PATH       also write the plan as JSON
    --tpu TYPE        compile the real train and eval steps for that TPU slice (gcloud's
                      accelerator type, below) with the TPU compiler, on this CPU, and print
                      its per-device bytes beside the estimate, whether it fits the chip's
                      HBM, the compiled program's collectives and how much of them its
                      schedule overlaps with matmul work. Compiles with the options main.py
                      sets on a TPU (devices.TPU_OVERLAP_FLAGS). Needs libtpu
                      (requirements-test.txt). Sets --hardware and --devices. Last line:
                      tpu_bytes_per_device=<int> planner_bytes_per_device=<int> fits=<true|false>
                      collective_bytes=<int> exposed_bytes=<int> dot_flops_per_device=<int>
                      planner_dot_flops_per_device=<int> low_precision_dot_flops_per_device=<int>
                      (one line; the train step's collectives and those left exposed, bytes
                      per device per step, and its dot FLOPs per device per step, compiled
                      and planned, and the compiled ones whose operands are int8 / fp8
                      (--model.quant); loops by their trips, a conditional at its costliest
                      branch)

    --search          rank every layout of the model and batch on these devices (mesh,
                      expert parallelism, schedule, microbatches, remat; planner_search.py)
                      by predicted step and list the fastest that fit, with the flags to
                      paste, beside the preset's own layout. --top N: how many (default 10).
                      With --tpu TYPE, the top --compile K (default 3) are compiled too: the
                      compiler's bytes, dot FLOPs and collectives, and how much of the
                      communication its schedule overlaps with compute. Last line:
                      best_step_ms=<float> preset_step_ms=<float> best_flags="..."

    python planner.py --table [--presets P,...] [--pods T,...] [--json PATH]
                      docs/planning.md's table: every preset compiled for the pods people use
                      (TABLE_MESHES below), the TPU compiler's bytes beside the planner's

What each row of memory and time means: planner_model.py.
"""

import json
import sys

from planning import planner_report
from planning import planner_search
from planning import tpu_compile
from devices import skip_tpu_probe_without_tpu
from model import abstract_model, abstract_params  # noqa: F401  (the tests call them here)
from planning.planner_model import DEFAULT_EFFICIENCY, GiB, HARDWARE, gathered_bytes, layout_bytes, plan, plan_config  # noqa: F401
from planning.planner_search import search, suggestions
from utils import ConfigError, apply_overrides, parse_args

BOOLEAN_FLAGS = ("search",)  # planner flags that take no value


def split_planner_flags(argv):
    """Pull out the planner's own flags; the rest are main.py's config flags."""
    own, rest, i = {"hardware": "tpu-v5p", "devices": "0", "efficiency": str(DEFAULT_EFFICIENCY), "json": "", "tpu": "",
                    "search": "", "top": "10", "compile": "3"}, [], 0
    while i < len(argv):
        name = argv[i][2:].split("=", 1)[0] if argv[i].startswith("--") else None
        if name in BOOLEAN_FLAGS and "=" not in argv[i]:
            own[name] = "true"
        elif name in own:
            if "=" in argv[i]:
                own[name] = argv[i].split("=", 1)[1]
            elif i + 1 < len(argv):
                own[name], i = argv[i + 1], i + 1
            else:
                raise ValueError(f"--{name} needs a value")
        else:
            rest.append(argv[i])
        i += 1
    return own, rest


def search_main(cfg, own, devices, efficiency):
    """--search: the ranked layouts, the preset's own beside them, with --tpu the top K
    compiled; then the scripts' last line."""
    preset = plan(cfg, devices, own["hardware"], efficiency)
    ranked, tried, too_big = search(cfg, devices, own["hardware"], efficiency, preset["peak_flops"])
    if not ranked:
        raise ConfigError(f"no layout of {cfg.preset} fits {preset['devices']} x {preset['hardware']} at --train.batch_size "
                          f"{cfg.train.batch_size}: try more devices, a smaller batch or a smaller model")
    preset_flags = planner_search.layout_flags(apply_overrides(cfg, {"mesh": {"dp": preset["mesh"]["dp"]}}))  # (dp -1 resolved)
    lines = planner_report.search_report(ranked, preset, preset_flags, tried, too_big, int(own["top"]))
    if own["tpu"]:
        lines += planner_report.compile_ranked(ranked, own["tpu"], int(own["compile"]))
    best = next((r for r in ranked if r.compiled_fits is not False), ranked[0])
    lines.append(f'best_step_ms={best.step_s * 1e3:.6g} preset_step_ms={preset["step_s_predicted"] * 1e3:.6g} best_flags="{best.flags}"')
    return lines


def main(argv):
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        print("--tpu TYPE, known types:\n  " + " ".join(tpu_compile.POD_TYPES))
        print("main.py's flags (python main.py --help) are accepted too.")
        return
    skip_tpu_probe_without_tpu()
    if argv[:1] == ["--table"]:
        return planner_report.print_pod_table(argv[1:])
    try:
        own, rest = split_planner_flags(argv)
        cfg = parse_args(rest)
        devices, efficiency = int(own["devices"]), float(own["efficiency"])
        if own["tpu"]:
            pod = tpu_compile.pod_type(own["tpu"])
            own["hardware"], devices = pod.hardware, pod.chips * cfg.mesh.slices
        if own["search"]:
            return print("\n".join(search_main(cfg, own, devices, efficiency)))
        p = plan(cfg, devices, own["hardware"], efficiency)
        tpu_lines = planner_report.tpu_check(cfg, own["tpu"], p) if own["tpu"] else []
    except (ConfigError, ValueError) as e:
        sys.exit(f"error: {e}")
    print("\n".join(planner_report.report(p)))
    if not p["fits"] and not tpu_lines:
        fitting = suggestions(cfg, devices, own["hardware"], efficiency, p["peak_flops"])
        if fitting:
            print("try (on the same devices, these fit):")
            for flags, q in fitting[:5]:
                print(f"  {flags:<64} {q['total_bytes'] / GiB:7.2f} GiB per device, step ~{q['step_s_predicted']:.3g} s")
        else:
            print("try: more devices (--devices / --mesh.dp), a smaller --train.batch_size or a smaller model")
    if own["json"]:
        with open(own["json"], "w") as f:
            json.dump(p, f, indent=2)
    if tpu_lines:
        print("\n".join(tpu_lines))


if __name__ == "__main__":
    main(sys.argv[1:])

