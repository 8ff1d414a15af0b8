"""Our train step beside MaxText's on the TPU compiler's clock: DeepSeek-V2-Lite's shape
(our `deepseek_v2_lite`, MaxText's `deepseek2-16b`) on a v4-64 at dp / fsdp 32, 32 x 2048
tokens per step, AdamW, remat of each block (MaxText's `full`), splash attention and
dropless megablox experts on both, the same LIBTPU_INIT_ARGS (devices.TPU_OVERLAP_FLAGS).

    python benchmarks/maxtext_step.py MAXTEXT_CHECKOUT [--python PY] [--out DIR]
    python benchmarks/maxtext_step.py --ours-hlo F --maxtext-hlo G     # read compiled HLO only

Each side is compiled for the slice on this CPU (libtpu, no TPU), ours by `planner.py
--tpu v4-64 --hlo-out`, MaxText's by its ahead-of-time `train_compile` with
`dump_hlo=true` (its `*after_codegen.txt`: the optimized module with the compiler's
estimates; `--python` is an interpreter with MaxText's dependencies, e.g. a venv of its
checkout). Both HLOs are read by planning/hlo_reader.py: the compiler's estimated cycles
at v4's clock by kind of op, the Pallas kernels at their roofline (splash's from its
shapes; any other without a cost estimate named, not counted), dot FLOPs, collective bytes and the share its schedule
leaves exposed. A benchmark, not a test: the suite never needs MaxText.
Last line: ours_compute_ms=... maxtext_compute_ms=...
"""

import os
import sys

if __name__ == "__main__" and not __package__:
    # Run as a file: run it again as the module benchmarks.maxtext_step, the repo's root on the path.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    os.execve(sys.executable, [sys.executable, "-m", "benchmarks.maxtext_step", *sys.argv[1:]], {**os.environ, "PYTHONPATH": path})

import argparse  # noqa: E402
import glob  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402

from planning import hlo_reader  # noqa: E402
from planning.costs import HARDWARE  # noqa: E402
from runtime import devices  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POD, DEVICES = "v4-64", 32
OURS = ["--preset", "deepseek_v2_lite", "--mesh.dp", "32", "--mesh.pp", "1", "--mesh.tp", "1", "--train.batch_size", "32",
        "--model.seq_len", "2048", "--train.microbatches", "1", "--model.remat", "block", "--train.optimizer", "adamw",
        "--model.attention", "splash", "--model.capacity_factor", "0", "--model.moe_kernel", "gmm", "--tpu", POD]
MAXTEXT = ["run_name=peer", "model_name=deepseek2-16b", "dataset_type=synthetic", "enable_checkpointing=false",
           f"compile_topology={POD}", "compile_topology_num_slices=1", "ici_fsdp_parallelism=32", "per_device_batch_size=1",
           "max_target_length=2048", "remat_policy=full", "opt_type=adamw", "sparse_matmul=true", "megablox=true",
           "capacity_factor=-1", "attention=flash"]
# What a compile-only libtpu needs on a machine with no TPU (planning/tpu_compile.pod_devices says why)
COMPILE_ONLY = dict(ALLOW_MULTIPLE_LIBTPU_LOAD="1", TPU_SKIP_MDS_QUERY="1", TPU_WORKER_HOSTNAMES="localhost", JAX_PLATFORMS="cpu",
                    DECOUPLE_GCLOUD="TRUE")


def compile_ours(out):
    """Our train step's optimized HLO (planner.py --tpu --hlo-out), its path."""
    path = os.path.join(out, "ours.hlo")
    subprocess.run([sys.executable, os.path.join(ROOT, "planner.py"), *OURS, "--hlo-out", path], cwd=ROOT, check=True)
    return path


def compile_maxtext(checkout, python, out):
    """MaxText's train step compiled by its train_compile, dumped; the path of the dump's
    largest *after_codegen.txt (the train step's)."""
    dump = os.path.join(out, "maxtext_dump")
    env = {**os.environ, **COMPILE_ONLY, **devices.overlap_environ("tpu", {}),
           "PYTHONPATH": os.path.join(checkout, "src")}
    subprocess.run([python, "-m", "maxtext.trainers.pre_train.train_compile", "src/maxtext/configs/base.yml", *MAXTEXT,
                    "dump_hlo=true", f"dump_hlo_local_dir={dump}", "dump_hlo_delete_local_after=false"],
                   cwd=checkout, env=env, check=True)
    found = glob.glob(os.path.join(dump, "**", "*after_codegen.txt"), recursive=True)
    if not found:
        sys.exit(f"no *after_codegen.txt under {dump}: did MaxText's dump_hlo write one?")
    return max(found, key=os.path.getsize)


def figures(hlo):
    """{name: value} of one optimized module on v4's clock (ms per step per device)."""
    hw = HARDWARE["tpu-v4"]
    ops = hlo_reader.timed_ops(hlo, hlo_reader.Chip(hw.clock_hz, hw.peak_flops, hw.hbm_bw))
    by_kind = hlo_reader.seconds_by(ops, lambda op: op.kind)
    timed = {re.sub(r"\.\d+$", "", op.name) for op in ops if op.kind == "kernels"}
    ov = hlo_reader.overlap(hlo, (DEVICES,))
    total = ov["overlapped"] + ov["exposed"]
    out = {"compute ms": sum(op.step_seconds for op in ops) * 1e3}
    out.update({f"  {kind} ms": by_kind.get(kind, 0.0) * 1e3 for kind in hlo_reader.COMPUTE_KINDS})
    out["kernels not counted (no cost estimate)"] = sum(n for name, n in hlo_reader.kernels(hlo).items() if name not in timed)
    out["dot FLOPs per device"] = hlo_reader.dot_flops(hlo)
    out["collective GiB per device"] = total / 2**30
    out["collective bytes exposed"] = ov["exposed"] / max(total, 1)
    return out


def main(argv):
    args = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args.add_argument("maxtext", nargs="?", help="a MaxText checkout (its src/maxtext)")
    args.add_argument("--python", default=sys.executable, help="an interpreter with MaxText's dependencies")
    args.add_argument("--out", default="", help="where the HLOs go (default: a temporary directory)")
    args.add_argument("--ours-hlo", default="", help="our compiled train step's HLO: skip compiling ours")
    args.add_argument("--maxtext-hlo", default="", help="MaxText's *after_codegen.txt: skip compiling MaxText's")
    a = args.parse_args(argv)
    if not (a.maxtext_hlo or a.maxtext):
        sys.exit("error: give a MaxText checkout, or --maxtext-hlo FILE")
    out = a.out or tempfile.mkdtemp(prefix="maxtext_step_")
    ours = a.ours_hlo or compile_ours(out)
    theirs = a.maxtext_hlo or compile_maxtext(os.path.abspath(a.maxtext), a.python, out)
    rows = {name: figures(open(path).read()) for name, path in (("ours", ours), ("MaxText", theirs))}
    print(f"DeepSeek-V2-Lite's shape on a {POD}, dp/fsdp {DEVICES}, on the TPU compiler's clock (v4, 1.05 GHz):")
    print(f"  {'':<42}{'ours':>16}{'MaxText':>16}")
    for key in rows["ours"]:
        cells = [rows[side][key] for side in ("ours", "MaxText")]
        fmt = "{:>16.1%}" if "exposed" in key else "{:>16.4g}" if "FLOPs" in key or "counted" in key else "{:>16.1f}"
        print(f"  {key:<42}" + "".join(fmt.format(c) for c in cells))
    print(f"ours_compute_ms={rows['ours']['compute ms']:.6g} maxtext_compute_ms={rows['MaxText']['compute ms']:.6g}")


if __name__ == "__main__":
    main(sys.argv[1:])
