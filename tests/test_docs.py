"""The docs are run, so they cannot go stale.

Every fenced ```bash or ```python block in README.md and docs/*.md carries a comment on the
line before it that says what the test does with it:

    <!-- test: run [slow] [port=N] [SCRIPT+="ARGS"] ["/TEXT/+=ARGS"] -->
        run the block's commands in order in one scratch copy of the repo per page (the
        page's blocks share it, so a later block may use an earlier one's run), with ARGS
        appended to every `python SCRIPT` command (e.g. main.py+="--train.steps 3") or to
        every command containing TEXT; flags given twice take the last value, so ARGS
        shrink a run without the page saying so. `pip install` lines are not run (the
        suite runs in what they install). `slow`: only under -m slow. `port=N`: the
        number N in the block (a server's port, as the page writes it) is replaced by a
        port that is free, the same one for every block of the page that says port=N.
        A command that ends in ` &` (a server) runs in the background, its output in a
        log that a failing command shows, until the page's blocks are done.
    <!-- test: skip (WHY) -->      not runnable on a laptop CPU (a pod, a bucket, a
                                   server that runs until stopped), or a command another
                                   test already runs; WHY names the test that covers it,
                                   as `covered by tests/test_X.py::name` where it can
                                   (that test must exist)
    <!-- test: ci -->              the test command: must appear verbatim in .ci/run
    <!-- test: files -->           the README's file map: every name exists, and every
                                   top-level file and folder is in it

A block without a marker fails the test, so a new command cannot be left unrun by
accident, and every main.py, bench.py and planner.py command on a page, run or skipped,
must parse (a misspelt flag fails in a second, without JAX). Links between pages, to
files and to headings must resolve, and no file of the repo may name a .md document the
repo does not have.

What the run blocks cost is compiling, not starting: on 2 cores a cold compile of a train
step is 20-45 s of CPU, the same command with its programs in JAX's compilation cache
(main.py's --run.compile_cache, on by default) ~8 s, of which 3.5 s are imports. So the
overrides also make runs share programs (the same model, mesh, shapes and lr schedule as
an earlier command, e.g. --train.decay_steps 10 like the quick start's 10 steps), blocks
that another test runs as written are skipped and name it, and `python SCRIPT` commands
start from a process that has the imports done (WarmPython).

The figures that describe the default run (README, "What the default run gives") are
checked against public/default_run/ (that run's config.json, metrics.jsonl and
samples.txt), and that directory against the code: the quick start's short run must
resolve to the same config and reach the same loss at its last logged step. After a
change to the default, run `python main.py` and then
    python tests/test_docs.py runs/shakespeare
which checks the README's figures against the fresh run and says what differs (copy the
run's three files into public/default_run/ when the new figures are the ones to keep).
"""

import glob
import json
import os
import re
import resource
import shlex
import signal
import subprocess
import sys
import threading

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))
DEFAULT_RUN = os.path.join(REPO, "public", "default_run")
RUNNABLE_LANGS = ("bash", "sh", "python")
# Config fields the quick start overrides (or that name where a run lives): not compared.
# And the compute dtype: the default is --model.dtype auto, which each machine resolves
# to its faster dtype (runtime/dtype_probe.py), and config.json records what it resolved to.
QUICK_START_FIELDS = {("train", "steps"), ("train", "eval_every"), ("train", "eval_batches"), ("sample", "max_tokens"),
                      ("run", "out_dir"), ("model", "dtype")}
COMMAND_TIMEOUT_S = 600


# ---- Reading the pages

def read(page):
    with open(os.path.join(REPO, page)) as f:
        return f.read()


def blocks(page):
    """[(line, lang, body, marker or None)] for every fenced block of the page."""
    lines, found, i = read(page).split("\n"), [], 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, end = i, i + 1
        while not lines[end].startswith("```"):
            end += 1
        before = start - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        marker = re.match(r"^<!--\s*test:\s*(.*?)\s*-->$", lines[before].strip()) if before >= 0 else None
        found.append((start + 1, m.group(1), "\n".join(lines[start + 1:end]), marker.group(1) if marker else None))
        i = end + 1
    return found


def parse_marker(marker):
    """'run slow main.py+="--a 1"' -> ("run", slow, [(selector, [args])])."""
    mode = marker.split(None, 1)[0]
    tokens = shlex.split(marker) if mode == "run" else [mode]  # a skip's reason is prose
    slow, overrides = False, []
    for token in tokens[1:] if mode == "run" else []:
        if token == "slow":
            slow = True
        elif token.startswith("port="):
            overrides.append(("port", token[len("port="):]))
        else:
            selector, sep, args = token.partition("+=")
            assert sep, f"marker {marker!r}: {token!r} is not SCRIPT+=ARGS or /TEXT/+=ARGS"
            overrides.append((selector, shlex.split(args)))
    return mode, slow, overrides


def commands(body, overrides):
    """The shell lines to run for a bash block, overrides applied."""
    joined = re.sub(r"\\\n\s*", " ", body)
    out = []
    for line in joined.split("\n"):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        tokens = shlex.split(line, comments=True)
        if tokens[0] == "pip":
            continue
        background = tokens[-1] == "&"
        if background:  # the overrides go before the `&`
            line, tokens = without_comment(line, tokens)[:-1].rstrip(), tokens[:-1]
        extra = []
        for selector, args in overrides:
            if selector == "port":
                continue
            if selector.startswith("/") and selector.endswith("/"):
                hit = selector[1:-1] in line
            else:
                hit = len(tokens) > 1 and tokens[0] == "python" and os.path.basename(tokens[1]) == selector
            extra += args if hit else []
        if extra:
            assert tokens[0] == "python" and not set(tokens) & {"|", ">", "&&", ";"}, \
                f"overrides apply to plain `python ...` commands only: {line!r}"
            line = without_comment(line, tokens) + " " + shlex.join(extra)  # the page's words as bash reads them (globs too)
        out.append(line + " &" if background else line)
    return out


def without_comment(line, tokens):
    """`line` cut before its trailing `# comment` (the shortest prefix with all its words)."""
    for cut in [m.start() for m in re.finditer(r"\s#", line)]:
        if shlex.split(line[:cut]) == tokens:
            return line[:cut].rstrip()
    return line.rstrip()


def runnable(page, slow):
    return [(line, lang, body, parse_marker(marker)[2]) for line, lang, body, marker in blocks(page)
            if lang in RUNNABLE_LANGS and marker and parse_marker(marker)[0] == "run"
            and parse_marker(marker)[1] == slow]


def pages_with(slow):
    return [page for page in PAGES if runnable(page, slow)]


# ---- Running a page's commands

@pytest.fixture(scope="module")
def shared_data_cache(tmp_path_factory):
    """One prepared embedded corpus for every page (preparing it takes seconds)."""
    return str(tmp_path_factory.mktemp("docs_data_cache"))


def scratch_copy(tmp_path, data_cache):
    """A directory that looks like the repo to a reader's commands (every top-level entry
    linked), with runs/ and data_cache/ of its own."""
    for name in os.listdir(REPO):
        if name not in ("runs", "data_cache", ".git", "__pycache__", ".pytest_cache", "wandb"):
            os.symlink(os.path.join(REPO, name), tmp_path / name)
    os.symlink(data_cache, tmp_path / "data_cache")
    return tmp_path


def reader_env():
    env = dict(os.environ)
    env.pop("PJRT_NPROC", None)  # the suite's fake-device setting; main.py sets its own
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


# A `python SCRIPT ARGS` line (a script at the top of the repo, plain arguments) runs in a
# fresh process forked from one that has imported JAX, Flax, Optax and Orbax and nothing
# else (no project module, no JAX backend): the script then runs as `python SCRIPT ARGS`
# would, as __main__, from its own directory, exiting through the interpreter's own exit,
# but without paying those imports again (3.5 s of CPU per command on the reference machine,
# against ~8 s for a whole command whose programs are in the compilation cache). Anything
# else a page shows (pipes, redirections, globs, other programs) runs under bash.
WARM_IMPORTS = "jax, jax.numpy, flax.nnx, optax, orbax.checkpoint"
WARM_SERVER = f"""
import json, os, runpy, sys
import {WARM_IMPORTS}  # noqa: F401 (loaded once; the backend starts in each child)

def serve():
    for request in sys.stdin:
        pid = os.fork()
        if pid == 0:
            return json.loads(request)
        print(pid, flush=True)
        _, status, usage = os.wait4(pid, 0)
        print(os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime, flush=True)
    sys.exit(0)

cwd, stdout, stderr, argv = serve()
os.chdir(cwd)
for fd, path in ((1, stdout), (2, stderr)):
    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
sys.stdin = open(os.devnull)
sys.argv = argv
sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
runpy.run_path(argv[0], run_name="__main__")
"""
SHELL_SYNTAX = re.compile(r"[|&;<>()$`*?~]")


class WarmPython:
    """Runs `python SCRIPT ARGS` in a child of the warm server (WARM_SERVER)."""

    def __init__(self):
        self.server = subprocess.Popen([sys.executable, "-c", WARM_SERVER], cwd=REPO, env=reader_env(), text=True,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def takes(self, command, cwd):
        tokens = shlex.split(command)
        return (not SHELL_SYNTAX.search(command) and len(tokens) > 1 and tokens[0] == "python"
                and "/" not in tokens[1] and tokens[1].endswith(".py") and os.path.exists(os.path.join(cwd, tokens[1])))

    def run(self, command, cwd):
        out, err = cwd / ".cmd.stdout", cwd / ".cmd.stderr"
        self.server.stdin.write(json.dumps([str(cwd), str(out), str(err), shlex.split(command)[1:]]) + "\n")
        self.server.stdin.flush()
        pid = int(self.server.stdout.readline())
        timer = threading.Timer(COMMAND_TIMEOUT_S, os.kill, [pid, signal.SIGKILL])
        timer.start()
        returncode, cpu_s = self.server.stdout.readline().split()
        timer.cancel()
        return int(returncode), float(cpu_s), out.read_text(), err.read_text()

    def close(self):
        self.server.stdin.close()
        self.server.wait(timeout=60)


@pytest.fixture(scope="module")
def warm_python():
    warm = WarmPython()
    yield warm
    warm.close()


class Background:
    """The page's background commands (` &`): started under bash with their output in a
    log, stopped (their whole process group) when the page is done."""

    def __init__(self, cwd):
        self.cwd, self.procs = cwd, []

    def start(self, command):
        log = open(self.cwd / f".background_{len(self.procs)}.log", "w")
        self.procs.append((subprocess.Popen(["bash", "-c", command], cwd=self.cwd, env=reader_env(), stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True), log))

    def logs(self):
        return "".join(f"\n--- background {p.args[-1]}:\n{open(log.name).read()[-3000:]}" for p, log in self.procs)

    def stop(self):
        for proc, log in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()


def with_port(body, overrides, port):
    """The block with its port=N replaced by the page's free port."""
    for selector, number in overrides:
        if selector == "port":
            body = re.sub(rf"\b{number}\b", str(port), body)
    return body


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_block(cwd, page, line, lang, body, overrides, warm, background, port):
    body = with_port(body, overrides, port)
    if lang == "python":
        script = cwd / f"block_{line}.py"
        script.write_text(body + "\n")
        shell_lines = [f"python {script.name}"]
    else:
        shell_lines = commands(body, overrides)
    output = []
    for command in shell_lines:
        if command.endswith(" &"):
            background.start(command[:-2])
            print(f"{page}:{line}: background  {command}")
            continue
        if warm.takes(command, cwd):
            returncode, cpu_s, stdout, stderr = warm.run(command, cwd)
        else:
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            result = subprocess.run(["bash", "-eo", "pipefail", "-c", command], cwd=cwd, env=reader_env(),
                                    capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            returncode, stdout, stderr = result.returncode, result.stdout, result.stderr
            cpu_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        print(f"{page}:{line}: {cpu_s:5.1f} s CPU  {command}")  # what each command costs (pytest -s shows it)
        assert returncode == 0, (f"{page}:{line}: `{command}` exited {returncode}\n{stdout[-2000:]}\n{stderr[-3000:]}"
                                 f"{background.logs()}")
        output.append(stdout + stderr)
    return "\n".join(output)


def run_page(page, slow, tmp_path, data_cache, warm):
    cwd = scratch_copy(tmp_path, data_cache)
    background, port = Background(cwd), free_port()
    try:
        return {line: run_block(cwd, page, line, lang, body, overrides, warm, background, port)
                for line, lang, body, overrides in runnable(page, slow)}, cwd
    finally:
        background.stop()


# README.md's commands train the default run (~50 s): under -m slow, as the other pages' long ones.
@pytest.mark.parametrize("page", [pytest.param(page, marks=pytest.mark.slow) if page == "README.md" else page
                                  for page in pages_with(slow=False)])
def test_page_commands_run(page, tmp_path, shared_data_cache, warm_python):
    outputs, cwd = run_page(page, False, tmp_path, shared_data_cache, warm_python)
    if page == "README.md":
        check_quick_start_against_default_run(outputs, cwd)


@pytest.mark.slow
@pytest.mark.parametrize("page", pages_with(slow=True))
def test_page_slow_commands_run(page, tmp_path, shared_data_cache, warm_python):
    run_page(page, True, tmp_path, shared_data_cache, warm_python)


def test_every_code_block_says_what_the_test_does_with_it():
    problems = []
    for page in PAGES:
        for line, lang, body, marker in blocks(page):
            if lang in RUNNABLE_LANGS and marker is None:
                problems.append(f"{page}:{line}: a ```{lang} block without a <!-- test: ... --> comment")
            elif not lang and re.search(r"^(python|pip|\./|lm_eval|curl) ", body, re.M):
                problems.append(f"{page}:{line}: commands in an unlabeled block: make it ```bash with a test comment")
            elif marker is not None:
                mode = parse_marker(marker)[0]
                if mode not in ("run", "skip", "ci", "files"):
                    problems.append(f"{page}:{line}: unknown test mode {mode!r}")
                if mode == "skip" and not marker[len("skip"):].strip():
                    problems.append(f"{page}:{line}: a skipped block says why (and which test covers it)")
                if mode == "run" and lang in RUNNABLE_LANGS:
                    commands(body, parse_marker(marker)[2])  # overrides land on plain commands only
    assert not problems, "\n".join(problems)


SHELL_OPERATORS = {"|", "||", "&&", ";", "&", ">", ">>", "<", "2>&1"}


def config_argvs(body):
    """[(script, argv)] of every `python main.py|bench.py|planner.py ARGS` in a bash block and
    the main.py flags after a launcher's `--`, as the page writes them (no overrides)."""
    found = []
    for line in re.sub(r"\\\n\s*", " ", body).split("\n"):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        tokens = shlex.split(line, comments=True)
        while tokens:
            cut = next((i for i, t in enumerate(tokens) if t in SHELL_OPERATORS), len(tokens))
            part, tokens = tokens[:cut], tokens[cut + 1:]
            if len(part) > 1 and part[0] == "python" and part[1] in ("main.py", "bench.py", "planner.py"):
                found.append((part[1], part[2:]))
            elif part and part[0].endswith("launcher.sh") and "--" in part:
                found.append(("main.py", part[part.index("--") + 1:]))
    return found


def test_every_command_line_parses():
    """Every main.py, bench.py and planner.py command on every page (run or skipped) gets
    flags its script accepts: the parsing only, no JAX, so a misspelt flag in a block that
    only runs under -m slow, or in one another test covers, fails here within a second."""
    from benchmarks.step import split_bench_flags
    from planning.cli import split_planner_flags
    from utils import ConfigError, parse_args

    rest = {"main.py": lambda argv: argv, "bench.py": lambda argv: split_bench_flags(argv)[-1],
            "planner.py": lambda argv: split_planner_flags(argv)[1]}
    problems, checked = [], 0
    for page in PAGES:
        for line, lang, body, marker in blocks(page):
            if lang not in ("bash", "sh") or marker in ("ci", "files"):
                continue
            for script, argv in config_argvs(body):
                if "--help" in argv:
                    continue  # prints and exits; the README's `--help` is run
                checked += 1
                try:
                    parse_args(rest[script](argv))
                except (ConfigError, ValueError) as e:
                    problems.append(f"{page}:{line}: python {script} {shlex.join(argv)}: {e}")
    assert checked > 20 and not problems, "\n".join(problems)


COVERED_BY = re.compile(r"tests/(test_\w+\.py)::(\w+)")


def test_a_skip_that_names_a_test_names_one_that_exists():
    """`skip (covered by tests/test_X.py::name)`: the test the reason names must exist, so a
    renamed or deleted test cannot leave a block that nothing runs."""
    missing, named = [], 0
    for page in PAGES:
        for line, _, _, marker in blocks(page):
            for file, name in COVERED_BY.findall(marker or "") if (marker or "").startswith("skip") else []:
                named += 1
                path = os.path.join(REPO, "tests", file)
                if not os.path.exists(path) or not re.search(rf"^def {name}\(", open(path).read(), re.M):
                    missing.append(f"{page}:{line}: tests/{file}::{name}")
    assert named and not missing, "skips name tests that do not exist:\n" + "\n".join(missing)


def test_the_test_command_is_the_one_ci_runs():
    with open(os.path.join(REPO, ".ci", "run")) as f:
        ci_lines = [line.strip() for line in f]
    found = 0
    for page in PAGES:
        for line, lang, body, marker in blocks(page):
            if marker == "ci":
                found += 1
                for command in body.strip().split("\n"):
                    assert command.strip() in ci_lines, f"{page}:{line}: `{command}` is not what .ci/run runs"
    assert found, "README.md shows the test command in a <!-- test: ci --> block"


# ---- Files and links

def test_the_file_map_names_every_file_and_only_files_that_exist():
    (body,) = [body for _, _, body, marker in blocks("README.md") if marker == "files"]
    named = [line.split()[0].rstrip("/") for line in body.split("\n") if line.strip()]
    missing = [name for name in named if not os.path.exists(os.path.join(REPO, name))]
    tops = {name.split("/")[0] for name in named}
    unlisted = sorted(top for top in tracked_top_level() if top not in tops and top not in NOT_IN_THE_MAP)
    assert not missing and not unlisted, (f"the README's file map names files that do not exist: {missing}; "
                                          f"and leaves out: {unlisted}")


NOT_IN_THE_MAP = {".gitignore", "README.md", "requirements.txt", "requirements-test.txt", "pytest.ini", "ruff.toml"}


def tracked_top_level():
    """The repo's top-level files and folders (git's view; without git, what is there)."""
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    if listed.returncode == 0 and listed.stdout:
        return {path.split("/")[0] for path in listed.stdout.split()}
    return {name for name in os.listdir(REPO) if name not in ("runs", "data_cache", "wandb", ".git")
            and not name.startswith((".pytest", ".env", "__pycache__"))}


def slug(heading):
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page):
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", read(page), re.M)}


def test_links_resolve():
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", read(page), flags=re.S)  # links inside code are not links
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(os.path.join(REPO, resolved)):
                broken.append(f"{page}: {target} (no file {resolved})")
            elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
                broken.append(f"{page}: {target} (no heading #{anchor} in {resolved})")
    assert not broken, "links that do not resolve:\n" + "\n".join(broken)


def test_no_file_points_to_a_document_the_repo_does_not_have():
    stale = []
    for path in glob.glob(os.path.join(REPO, "**", "*"), recursive=True):
        if not path.endswith((".py", ".sh", ".md", ".html", ".ini")) and os.path.basename(path) != "run":
            continue
        if os.path.isdir(path) or "/runs/" in path or "/data_cache/" in path:
            continue
        with open(path, errors="replace") as f:
            for n, text in enumerate(f, 1):
                for doc in re.findall(r"[\w./-]*[A-Za-z_]\.md\b", text):
                    here = os.path.join(os.path.dirname(path), doc)
                    if not any(os.path.exists(p) for p in (here, os.path.join(REPO, doc), os.path.join(REPO, "docs", doc))):
                        stale.append(f"{os.path.relpath(path, REPO)}:{n}: {doc}")
    assert not stale, "files name documents the repo does not have:\n" + "\n".join(stale)


# ---- The default run's figures

def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def readme_figures():
    """The README's figures table and sample, as {row name: text} and the sample's text."""
    text = read("README.md")
    table = text.split("<!-- figures: public/default_run -->", 1)[1].split("\n\n", 1)[0]
    rows = {cells[1].strip(): cells[2].strip() for cells in (row.split("|") for row in table.split("\n")[2:])}
    sample = [body for _, _, body, _ in blocks("README.md") if body.startswith("ROMEO:")]
    return rows, sample[0] if sample else None


def figure_problems(run_dir):
    """What the README says about the default run that `run_dir` does not bear out."""
    rows, sample = readme_figures()
    problems = []
    evals = [row for row in read_metrics(run_dir) if "val_loss" in row]
    m = re.match(r"([\d.]+) nats/byte at step (\d+)", rows["validation loss"])
    if not evals or (f"{evals[-1]['val_loss']:.3f}", evals[-1]["step"]) != (m.group(1), int(m.group(2))):
        last = f"{evals[-1]['val_loss']:.3f} at step {evals[-1]['step']}" if evals else "no eval row"
        problems.append(f"validation loss: the README says {m.group(1)} at step {m.group(2)}, the run {last}")
    with open(os.path.join(run_dir, "config.json")) as f:
        cfg = json.load(f)
    m = re.match(r"(\d+) steps of (\d+) x (\d+) bytes", rows["training"])
    said = tuple(int(g) for g in m.groups())
    ran = (cfg["train"]["steps"], cfg["train"]["batch_size"], cfg["model"]["seq_len"])
    if said != ran:
        problems.append(f"training: the README says {said} (steps, batch, seq_len), the run {ran}")
    with open(os.path.join(run_dir, "samples.txt")) as f:
        samples = f.read()
    if sample is None or sample.strip() not in samples:
        problems.append("the README's sample is not in the run's samples.txt")
    return problems


def test_readme_figures_match_the_committed_default_run():
    assert not figure_problems(DEFAULT_RUN), figure_problems(DEFAULT_RUN)


def flat(cfg):
    return {(section, key): value for section, fields in cfg.items() if isinstance(fields, dict)
            for key, value in fields.items()}


def check_quick_start_against_default_run(outputs, cwd):
    """The quick start's short `python main.py` is the default run cut short: the same
    resolved config but for the fields it overrides, the same model size as the README
    says, and the same train loss at its last logged step as the committed run's."""
    rows, _ = readme_figures()
    params = rows["model"].split(" (")[0]
    assert any(f"model: {params}" in out for out in outputs.values()), \
        f"the README says the default model has {params!r}; the quick start printed otherwise"
    short_dir = os.path.join(cwd, "runs", "shakespeare")
    with open(os.path.join(short_dir, "config.json")) as f:
        short = flat(json.load(f))
    with open(os.path.join(DEFAULT_RUN, "config.json")) as f:
        committed = flat(json.load(f))
    differ = {k: (committed[k], short[k]) for k in committed.keys() & short.keys()
              if k not in QUICK_START_FIELDS and committed[k] != short[k]}
    assert not differ, (f"the default config changed since public/default_run was made (committed, now): {differ}; "
                        "run `python main.py` and `python tests/test_docs.py runs/shakespeare` (module docstring)")
    short_rows = [row for row in read_metrics(short_dir) if "loss" in row]
    committed_loss = {row["step"]: row["loss"] for row in read_metrics(DEFAULT_RUN) if "loss" in row}
    step, loss = short_rows[-1]["step"], short_rows[-1]["loss"]
    assert step in committed_loss, f"the committed default run has no train row at step {step}"
    # Warmup is the same whatever the total steps, so the losses agree but for how another
    # CPU rounds in bfloat16, or computes in float32 where auto chose it (step 10: 5.70918
    # in bfloat16, 5.70940 in float32; a changed default moves them by much more).
    assert loss == pytest.approx(committed_loss[step], rel=2e-3), (step, loss, committed_loss[step])


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/test_docs.py RUN_DIR   (a fresh `python main.py` run: runs/shakespeare)")
    problems = figure_problems(sys.argv[1])
    train = [row for row in read_metrics(sys.argv[1]) if "tokens_per_sec" in row]
    speeds = sorted(row["tokens_per_sec"] for row in train)
    print(f"median tokens/s {speeds[len(speeds) // 2]:.0f}, median MFU {sorted(r['mfu'] for r in train)[len(train) // 2]:.1%}")
    for problem in problems:
        print("differs:", problem)
    print("the README's figures match this run" if not problems else f"{len(problems)} figure(s) differ")
    sys.exit(1 if problems else 0)
