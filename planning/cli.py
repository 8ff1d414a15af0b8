"""planner.py's command line: its own flags, the plan or the search, the report (the
usage is planner.py's docstring)."""


import json
import sys

from planning import report, search, tpu_compile
from planning.costs import GiB, plan
from runtime.devices import skip_tpu_probe_without_tpu
from utils import ConfigError, apply_overrides, parse_args

BOOLEAN_FLAGS = ("search",)  # planner flags that take no value


def split_planner_flags(argv):
    """Pull out the planner's own flags; the rest are main.py's config flags."""
    own, rest, i = {"hardware": "tpu-v5p", "devices": "0", "efficiency": "", "json": "", "tpu": "",
                    "search": "", "top": "10", "compile": "3",
                    "hlo-out": ""}, [], 0
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
    ranked, tried, too_big = search.search(cfg, devices, own["hardware"], efficiency, preset["peak_flops"])
    if not ranked:
        raise ConfigError(f"no layout of {cfg.preset} fits {preset['devices']} x {preset['hardware']} at --train.batch_size "
                          f"{cfg.train.batch_size}: try more devices, a smaller batch or a smaller model")
    preset_flags = search.layout_flags(apply_overrides(cfg, {"mesh": {"dp": preset["mesh"]["dp"]}}))  # (dp -1 resolved)
    lines = report.search_report(ranked, preset, preset_flags, tried, too_big, int(own["top"]))
    if own["tpu"]:
        lines += report.compile_ranked(ranked, own["tpu"], int(own["compile"]))
    best = next((r for r in ranked if r.compiled_fits is not False), ranked[0])
    lines.append(f'best_step_ms={best.step_s * 1e3:.6g} preset_step_ms={preset["step_s_predicted"] * 1e3:.6g} best_flags="{best.flags}"')
    return lines


def main(argv, usage=""):
    """planner.py's command line (`usage`: its help text)."""
    if any(a in ("-h", "--help") for a in argv):
        print(usage)
        print("--tpu TYPE, known types:\n  " + " ".join(tpu_compile.POD_TYPES))
        print("main.py's flags (python main.py --help) are accepted too.")
        return
    skip_tpu_probe_without_tpu()
    if argv[:1] == ["--table"]:
        return report.print_pod_table(argv[1:])
    try:
        own, rest = split_planner_flags(argv)
        cfg = parse_args(rest)
        devices, efficiency = int(own["devices"]), float(own["efficiency"]) if own["efficiency"] else None
        if own["tpu"]:
            pod = tpu_compile.pod_type(own["tpu"])
            own["hardware"], devices = pod.hardware, pod.chips * cfg.mesh.slices
        if own["search"]:
            return print("\n".join(search_main(cfg, own, devices, efficiency)))
        p = plan(cfg, devices, own["hardware"], efficiency)
        tpu_lines = report.tpu_check(cfg, own["tpu"], p, own["hlo-out"]) if own["tpu"] else []
    except (ConfigError, ValueError) as e:
        sys.exit(f"error: {e}")
    print("\n".join(report.report(p)))
    if not p["fits"] and not tpu_lines:
        fitting = search.suggestions(cfg, devices, own["hardware"], efficiency, p["peak_flops"])
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
