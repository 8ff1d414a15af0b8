"""The house of the design card (../shared/DESIGN.md, "Layout"): four files on top that a
reader opens (main.py, model.py, utils.py, dataset.py) beside the planner.py and bench.py
entries, every other module in a folder named for what it holds, no import cycle, no
sys.path edit outside tests, and a training run that imports training only."""

import ast
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOP_LEVEL = {"main.py", "model.py", "utils.py", "dataset.py", "planner.py", "bench.py"}
# What `python main.py` may import of the project with the default settings (evaluation,
# samples and plots): the figure docs/parallelism.md states ("What a training run imports").
DEFAULT_RUN_LINES = 6000
NOT_TRAINING = ("serving/", "hf/", "planning/")
# The kernels and executors a config selects: the default run selects none of these.
UNSELECTED = ("ops/blockwise.py", "ops/splash.py", "ops/gmm.py", "ops/quant.py", "parallel/accumulate.py",
              "parallel/one_f_one_b.py", "parallel/auto.py", "parallel/schedules.py")


def project_files():
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    return [f for f in listed if os.path.exists(os.path.join(REPO, f))]


def test_the_top_level_is_the_design_card():
    assert {f for f in project_files() if "/" not in f} == TOP_LEVEL


def test_folders_hold_modules_named_for_what_they_hold():
    """No code in __init__.py; a module's name does not repeat its folder's; no folder or
    module shares a name with a top-level module."""
    tops = {f[:-3] for f in TOP_LEVEL}
    for path in project_files():
        if "/" not in path or path.startswith("tests/"):
            continue
        folder, name = path.split("/")[0], os.path.basename(path)[:-3]
        if name == "__init__":
            assert not open(os.path.join(REPO, path)).read().strip(), f"{path} holds code"
            continue
        assert not name.startswith(folder.rstrip("s")) and folder not in tops and name not in tops, path


def test_no_sys_path_edit_outside_tests():
    edits = [f for f in project_files() if not f.startswith("tests/")
             and re.search(r"sys\.path\.(insert|append)|sys\.path\[", open(os.path.join(REPO, f)).read())]
    assert not edits, edits


def module_of(path):
    return path[:-3].replace("/", ".")


def imports_of(path, modules):
    """The project modules a file imports (at the top or inside a function)."""
    found = set()
    for node in ast.walk(ast.parse(open(os.path.join(REPO, path)).read())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {m for m in (node.module, *(f"{node.module}.{a.name}" for a in node.names)) if m in modules}
    return found


def test_no_import_cycle():
    files = [f for f in project_files() if not f.startswith("tests/")]
    modules = {module_of(f) for f in files}
    graph = {module_of(f): imports_of(f, modules) - {module_of(f)} for f in files}
    done, path = set(), []

    def visit(m):
        if m in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(m):] + [m]))
        if m in done:
            return
        path.append(m)
        for n in sorted(graph[m]):
            visit(n)
        path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)


# `python main.py ARGS`, run so that at exit it prints the files of the modules it imported.
RUN_AND_LIST = """
import atexit, runpy, sys
atexit.register(lambda: print("IMPORTED", *sorted({getattr(m, "__file__", None) or "" for m in list(sys.modules.values())}),
                              sep="\\n", file=sys.stderr))
sys.argv = ["main.py", *sys.argv[1:]]
runpy.run_path("main.py", run_name="__main__")
"""


def imported_files(args, tmp_path):
    """The project's files a `python main.py ARGS` run imports (lazily imported ones included)."""
    env = dict(os.environ)
    env.pop("PJRT_NPROC", None)  # (the suite's fake devices: main.py sets its own)
    run = subprocess.run([sys.executable, "-c", RUN_AND_LIST, *args, "--run.out_dir", str(tmp_path)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    listed = run.stderr.split("IMPORTED\n", 1)[1].splitlines()
    files = {os.path.relpath(f, REPO) for f in listed if f.startswith(REPO + os.sep)}
    return sorted({"main.py"} | {f for f in files if f in project_files() and not f.startswith("tests/")})


def test_a_default_training_run_imports_training_only(tmp_path):
    files = imported_files(["--train.steps", "2", "--train.eval_every", "2", "--train.eval_batches", "1",
                            "--sample.max_tokens", "8"], tmp_path)
    lines = {f: sum(1 for _ in open(os.path.join(REPO, f))) for f in files}
    assert not [f for f in files if f.startswith(NOT_TRAINING) or f in UNSELECTED], files
    assert sum(lines.values()) <= DEFAULT_RUN_LINES, sorted(lines.items(), key=lambda kv: -kv[1])
    stated = re.search(r"imports (\d[\d,]*) lines of the project's own code", open(os.path.join(REPO, "docs", "parallelism.md")).read())
    assert stated and int(stated.group(1).replace(",", "")) == sum(lines.values()), (
        f"docs/parallelism.md should say the default run imports {sum(lines.values()):,} lines of the project's own code")


@pytest.mark.parametrize("args, expected", [
    (["--train.microbatches", "2", "--train.batch_size", "4"], "parallel/accumulate.py"),
    (["--model.attention", "blockwise", "--model.attention_block", "64"], "ops/blockwise.py"),
])
def test_a_run_imports_the_kernel_or_executor_its_config_selects(args, expected, tmp_path):
    files = imported_files(["--preset", "tiny", "--train.steps", "1", "--train.eval_batches", "1", "--sample.num_samples", "0",
                            "--log.plots", "false", *args], tmp_path)
    assert expected in files and not [f for f in files if f.startswith(NOT_TRAINING)], files
