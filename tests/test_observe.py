"""What a run shows its user: metrics.jsonl, the PNG plots drawn from it, and wandb
(offline: no key, no network), including a resumed run continuing the same wandb run.

The plots are checked against the file: plot_run returns the data read back from the
matplotlib artists it drew, and that must be the logged values (scaled where the axis
says %). wandb is checked by reading the run's own transaction log (run-<id>.wandb)
with wandb's reader, `wandb leet inspect --json`."""

import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from runtime.metrics import MetricsLog, read_metrics, truncate_metrics, wandb_row, wandb_step
from runtime.plots import HEATMAP_COLUMNS, plot_run, smoothed
from utils import config_to_dict, parse_args

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOTS = ["expert_load.png", "load_balance.png", "loss.png", "speed.png"]


def png_size(path):
    """(width, height) from a PNG's IHDR chunk, after checking the signature."""
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == PNG_MAGIC and head[12:16] == b"IHDR", f"{path} is not a PNG"
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def check_pngs(run_dir, names):
    for name in names:
        path = os.path.join(run_dir, name)
        width, height = png_size(path)
        assert width >= 800 and height >= 500, (name, width, height)  # sharp at README width
        assert os.path.getsize(path) > 20_000, name  # drawn, not a blank canvas


def check_drawn_equals_file(drawn, rows, tokens_per_step):
    """Every plotted series holds exactly the values in metrics.jsonl."""
    train = [r for r in rows if "loss" in r]
    val = [r for r in rows if "val_loss" in r]
    steps = [r["step"] for r in train]
    col = lambda key: [r[key] for r in train]  # noqa: E731
    assert drawn["loss.png"]["train"] == ([s * tokens_per_step for s in steps], col("loss"))
    assert drawn["loss.png"]["val"] == ([r["step"] * tokens_per_step for r in val], [r["val_loss"] for r in val])
    assert drawn["loss.png"]["max_logit"] == ([s * tokens_per_step for s in steps], col("max_logit"))
    assert drawn["load_balance.png"]["aux_loss"] == (steps, col("aux_loss"))
    assert drawn["load_balance.png"]["dropped_percent"][0] == steps
    np.testing.assert_allclose(drawn["load_balance.png"]["dropped_percent"][1], 100 * np.array(col("dropped_frac")), rtol=1e-12)
    assert drawn["speed.png"]["tokens_per_sec"] == (steps, col("tokens_per_sec"))
    np.testing.assert_allclose(drawn["speed.png"]["mfu_percent"][1], 100 * np.array(col("mfu")), rtol=1e-12)
    load_SNE = np.array(col("expert_load"))
    moe_blocks = [n for n in range(load_SNE.shape[1]) if load_SNE[:, n].any()]
    assert sorted(drawn["expert_load.png"]) == sorted(f"block{n}" for n in moe_blocks)
    for n in moe_blocks:
        assert drawn["expert_load.png"][f"block{n}"] == (steps, load_SNE[:, n, :].tolist())


# ---- Plots from a hand-made metrics.jsonl (fast): exact values, dense blocks, long runs


def write_run(run_dir, steps, n_blocks=3, dense_blocks=(1,), n_experts=4, val_every=10, seed=0):
    """A run directory as main.py leaves it: config.json + metrics.jsonl."""
    rng = np.random.default_rng(seed)
    os.makedirs(run_dir, exist_ok=True)
    cfg = parse_args(["--preset", "tiny", "--run.name", "fake", "--model.n_experts", str(n_experts)])
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(config_to_dict(cfg), f)
    log = MetricsLog(run_dir, cfg)
    for s in steps:
        load_NE = rng.dirichlet(np.ones(n_experts), n_blocks)
        load_NE[list(dense_blocks)] = 0
        log.write(dict(step=s, loss=5 - s / 100 + rng.normal(0, 0.05), lr=1e-3, grad_norm=float(rng.uniform(0.5, 2)),
                       tokens_per_sec=float(rng.uniform(9e3, 1.1e4)), mfu=float(rng.uniform(0.2, 0.3)),
                       aux_loss=float(1 + rng.uniform(0, 0.5)), dropped_frac=float(rng.uniform(0, 0.1)),
                       expert_load=load_NE.round(4), max_logit=float(rng.uniform(5, 8))))
        if s % val_every == 0:
            log.write(dict(step=s, val_loss=5 - s / 100))
    return cfg.train.batch_size * cfg.model.seq_len


def test_plots_draw_exactly_the_logged_values(tmp_path):
    """Uneven steps (log.every, the last step, a gap from a resume) and a dense block:
    every series drawn is the file's, and the dense block gets no heatmap."""
    steps = [*range(5, 61, 5), 63, *range(80, 101, 5), 101]
    tokens_per_step = write_run(tmp_path, steps, n_blocks=3, dense_blocks=(1,))
    drawn = plot_run(tmp_path)
    assert sorted(drawn) == PLOTS
    check_pngs(tmp_path, PLOTS)
    check_drawn_equals_file(drawn, read_metrics(tmp_path), tokens_per_step)
    assert sorted(drawn["expert_load.png"]) == ["block0", "block2"]
    assert "train_smoothed" not in drawn["loss.png"]  # few points: drawn raw


def test_dense_model_draws_no_routing_plots(tmp_path):
    write_run(tmp_path, range(1, 21), n_blocks=2, dense_blocks=(0, 1))
    with open(tmp_path / "metrics.jsonl") as f:
        rows = [dict(json.loads(line), aux_loss=0.0) if '"loss"' in line else json.loads(line) for line in f]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for old in PLOTS:
        (tmp_path / old).unlink(missing_ok=True)
    assert sorted(plot_run(tmp_path)) == ["loss.png", "speed.png"]
    assert sorted(p for p in os.listdir(tmp_path) if p.endswith(".png")) == ["loss.png", "speed.png"]


def test_long_run_is_smoothed_and_binned(tmp_path):
    """Thousands of rows: the train loss gets a smoothed curve that does not lag (on a
    straight line it is the line), and each heatmap column is the mean of its rows."""
    n = 1000
    write_run(tmp_path, range(1, n + 1), n_blocks=1, dense_blocks=(), val_every=100)
    drawn = plot_run(tmp_path)
    rows = [r for r in read_metrics(tmp_path) if "loss" in r]
    raw_x, raw_y = drawn["loss.png"]["train"]
    assert len(raw_y) == n and drawn["loss.png"]["train_smoothed"][0] == raw_x
    assert np.std(np.diff(drawn["loss.png"]["train_smoothed"][1])) < np.std(np.diff(raw_y)) / 3
    line = np.linspace(5, 3, 101)
    np.testing.assert_allclose(smoothed(line, 9)[4:-4], line[4:-4], rtol=1e-12)

    steps, load_SE = drawn["expert_load.png"]["block0"]
    assert len(steps) == len(load_SE) == HEATMAP_COLUMNS
    per_column = n // HEATMAP_COLUMNS
    first = np.array([r["expert_load"][0] for r in rows[:per_column]])
    np.testing.assert_allclose(load_SE[0], first.mean(0), rtol=1e-12)
    assert steps[0] == np.mean([r["step"] for r in rows[:per_column]])


@pytest.mark.slow
def test_plot_command_line(tmp_path):
    write_run(tmp_path / "r", range(1, 11))
    ok = subprocess.run([sys.executable, "utils.py", "plot", str(tmp_path / "r")], cwd=REPO, capture_output=True,
                        text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert sorted(ok.stdout.split()) == sorted(str(tmp_path / "r" / p) for p in PLOTS)
    check_pngs(tmp_path / "r", PLOTS)
    (tmp_path / "empty").mkdir()
    bad = subprocess.run([sys.executable, "utils.py", "plot", str(tmp_path / "empty")], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 1 and "has no metrics.jsonl" in bad.stderr and "Traceback" not in bad.stderr
    usage = subprocess.run([sys.executable, "utils.py"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert usage.returncode == 1 and "usage: python utils.py plot RUN_DIR" in usage.stderr


# ---- metrics.jsonl and the rows sent to wandb


def test_metrics_file_survives_a_kill_mid_line_and_truncates_on_resume(tmp_path):
    write_run(tmp_path, range(1, 11), val_every=5)
    path = tmp_path / "metrics.jsonl"
    whole = path.read_text()
    path.write_text(whole + '{"step": 11, "loss": 4.')  # killed while writing step 11
    assert read_metrics(tmp_path) == [json.loads(line) for line in whole.splitlines()]
    truncate_metrics(tmp_path, 5)  # resume from the checkpoint at step 5
    assert sorted({r["step"] for r in read_metrics(tmp_path)}) == [1, 2, 3, 4, 5]
    assert not os.path.exists(str(path) + ".tmp")
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], "garbage", *lines[1:]]) + "\n")  # damage is not silently skipped
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        read_metrics(tmp_path)


def test_wandb_row_flattens_expert_load_per_block_and_expert():
    row = dict(step=7, loss=2.5, mfu=0.3, expert_load=[[0.5, 0.25, 0.25], [0, 0, 0], [0.1, 0.2, 0.7]])
    assert wandb_row(row, tokens_per_step=100) == {
        "tokens": 700, "loss": 2.5, "mfu": 0.3,
        "expert_load/block0/expert0": 0.5, "expert_load/block0/expert1": 0.25, "expert_load/block0/expert2": 0.25,
        "expert_load/block2/expert0": 0.1, "expert_load/block2/expert1": 0.2, "expert_load/block2/expert2": 0.7}
    assert wandb_row(dict(step=3, val_loss=4.0), 10) == {"tokens": 30, "val_loss": 4.0}


def wandb_env(tmp_path, **changes):
    """No key and no network: offline, with wandb's own files kept under tmp_path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DATA_DIR=str(tmp_path / "wandb_data"),
               WANDB_CACHE_DIR=str(tmp_path / "wandb_cache"), WANDB_CONFIG_DIR=str(tmp_path / "wandb_config"),
               WANDB_ARTIFACT_DIR=str(tmp_path / "wandb_artifacts"), HOME=str(tmp_path / "home"))
    env.update(changes)
    return {k: v for k, v in env.items() if v is not None}


def wandb_records(path):
    """Every record of a run's .wandb transaction log, as JSON, via wandb's own reader."""
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def offline_parts(run_dir):
    """The offline run directories under <run_dir>/wandb, oldest first: one per start,
    offline-run-<time>-<id>, with a -1 added when two start within the same second."""
    return sorted(p for p in glob.glob(os.path.join(run_dir, "wandb", "offline-run-*")) if os.path.isdir(p))


def run_id_of(part):
    """The run id, from the name of the part's transaction log, run-<id>.wandb."""
    (log,) = glob.glob(os.path.join(part, "run-*.wandb"))
    return os.path.basename(log)[len("run-"):-len(".wandb")]


def wandb_history(records):
    return {r["history"]["item"]["_step"]: r["history"]["item"] for r in records if r["type"] == "history"}


def test_wandb_offline_gets_the_rows_and_samples_and_a_resume_continues_the_run(tmp_path):
    """MetricsLog alone (fast): two rows, an eval row, a samples table; then a second
    MetricsLog given the first one's id, as main.py does on resume."""
    code = f"""
from runtime.metrics import MetricsLog
from utils import parse_args
cfg = parse_args(["--preset", "tiny", "--run.name", "w", "--log.wandb"])
log = MetricsLog({str(tmp_path)!r}, cfg)
log.write(dict(step=1, loss=5.5, mfu=0.25, expert_load=[[0.75, 0.25], [0.0, 0.0]]))
log.write(dict(step=2, loss=5.0, mfu=0.5, expert_load=[[0.5, 0.5], [0.0, 0.0]]))
log.write(dict(step=2, val_loss=4.5))
log.log_samples(2, ["ROMEO: one", "ROMEO: two"])
first_id = log.wandb_id
log.close()
log = MetricsLog({str(tmp_path)!r}, cfg, wandb_id=first_id)
log.write(dict(step=3, loss=4.0, mfu=0.5, expert_load=[[0.0, 1.0], [0.0, 0.0]]))
assert log.wandb_id == first_id
log.close()
"""
    (tmp_path / "home").mkdir()
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env=wandb_env(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    first, second = offline_parts(tmp_path)
    run_id = run_id_of(first)
    assert run_id_of(second) == run_id
    assert f"wandb: new run {run_id} (offline)" in result.stdout
    assert f"wandb: continuing run {run_id} (offline)" in result.stdout
    tokens_per_step = 16 * 16  # tiny: batch 16 x seq_len 16
    strip = lambda item: {k: v for k, v in item.items() if not k.startswith(("_", "samples"))}  # noqa: E731
    history = wandb_history(wandb_records(first))
    assert {s: strip(item) for s, item in history.items()} == {
        1: {"tokens": tokens_per_step, "loss": 5.5, "mfu": 0.25,
            "expert_load/block0/expert0": 0.75, "expert_load/block0/expert1": 0.25},
        2: {"tokens": 2 * tokens_per_step, "loss": 5.0, "mfu": 0.5, "val_loss": 4.5,
            "expert_load/block0/expert0": 0.5, "expert_load/block0/expert1": 0.5}}
    with open(os.path.join(first, "files", history[2]["samples.path"])) as f:
        assert json.load(f) == {"columns": ["step", "prompt", "text"],
                                "data": [[2, "ROMEO:", "ROMEO: one"], [2, "ROMEO:", "ROMEO: two"]]}
    records = wandb_records(second)
    assert [r["run"]["run_id"] for r in records if r["type"] == "run"] == [run_id]
    assert {s: strip(item) for s, item in wandb_history(records).items()} == {
        3: {"tokens": 3 * tokens_per_step, "loss": 4.0, "mfu": 0.5,
            "expert_load/block0/expert0": 0.0, "expert_load/block0/expert1": 1.0}}


def test_wandb_online_without_a_key_says_how_to_fix(tmp_path):
    (tmp_path / "home").mkdir()
    code = ("from runtime.metrics import MetricsLog\nfrom utils import parse_args\n"
            f"MetricsLog({str(tmp_path)!r}, parse_args(['--preset', 'tiny', '--log.wandb']))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env=wandb_env(tmp_path, WANDB_MODE=None), stdin=subprocess.DEVNULL)
    assert result.returncode != 0
    assert "ConfigError: --log.wandb: wandb could not start" in result.stderr
    assert "wandb login" in result.stderr and "WANDB_MODE=offline" in result.stderr


# ---- A real run: tiny preset (2 blocks), wandb offline, resumed once


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    """8 steps with a sample, then the same run resumed from its step-8 checkpoint to
    step 12. Returns (run_dir, stdout of the first part, stdout of the resume)."""
    tmp = tmp_path_factory.mktemp("observe")
    (tmp / "home").mkdir()
    common = [sys.executable, "main.py", "--preset", "tiny", "--model.n_blocks", "2", "--run.out_dir", str(tmp),
              "--run.name", "r", "--data.cache_dir", str(tmp / "data_cache"), "--log.progress", "false",
              "--log.every", "1", "--train.eval_every", "4", "--train.checkpoint_every", "4", "--log.wandb",
              "--train.decay_steps", "12",  # one schedule for both parts: a resume may not change it
              # HOME is a temporary one for wandb's sake; keep the user's compilation cache all the same
              "--run.compile_cache", os.path.expanduser(parse_args([]).run.compile_cache)]
    outs = []
    for extra in (["--train.steps", "8", "--sample.num_samples", "1", "--sample.max_tokens", "8", "--log.plots", "false"],
                  ["--train.steps", "12", "--sample.num_samples", "0"]):
        result = subprocess.run(common + extra, cwd=REPO, capture_output=True, text=True, timeout=600, env=wandb_env(tmp))
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        outs.append(result.stdout)
    return tmp / "r", outs[0], outs[1]


@pytest.mark.slow
def test_real_run_plots_show_its_metrics(resumed_run):
    """main.py draws the PNGs at the end of training; what they show is metrics.jsonl,
    which after the resume holds every step once."""
    run_dir, _, _ = resumed_run
    check_pngs(run_dir, PLOTS)  # written by main.py itself
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 13))
    assert [r["step"] for r in rows if "val_loss" in r] == [4, 8, 12]
    for r in rows:
        if "expert_load" in r:  # fractions of the routed tokens: each MoE block's row sums to 1
            np.testing.assert_allclose(np.sum(r["expert_load"], axis=1), 1, atol=1e-3)
    config = json.loads((run_dir / "config.json").read_text())
    check_drawn_equals_file(plot_run(run_dir), rows, config["train"]["batch_size"] * config["model"]["seq_len"])


@pytest.mark.slow
def test_wandb_offline_logs_history_config_samples_and_resumes_the_same_run(resumed_run):
    run_dir, first_out, resume_out = resumed_run
    parts = offline_parts(run_dir)
    assert len(parts) == 2, parts  # one offline segment per start of main.py
    run_id = run_id_of(parts[0])
    assert run_id_of(parts[1]) == run_id  # the resume continued the same wandb run
    assert f"wandb: new run {run_id} (offline)" in first_out
    assert f"wandb: continuing run {run_id} (offline)" in resume_out
    meta = json.loads((run_dir / "checkpoints" / "12" / "meta" / "metadata").read_text())
    assert meta["wandb_id"] == run_id  # the id travels in the checkpoint

    rows = read_metrics(run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    tokens_per_step = config["train"]["batch_size"] * config["model"]["seq_len"]
    history = {}
    for part, steps in zip(parts, (8, 12)):
        records = wandb_records(part)
        (run,) = [r["run"] for r in records if r["type"] == "run"]
        assert run["run_id"] == run_id and run["display_name"] == "r"
        logged_config = {k: v for k, v in run["config"]["update"].items() if k != "_wandb"}
        assert logged_config["train"]["steps"] == steps
        assert logged_config["model"]["vocab_size"] == 257  # resolved from the data, not the default 0
        part_history = wandb_history(records)
        assert not set(part_history) & set(history)  # no step logged twice
        history.update(part_history)
    assert logged_config == config  # the resumed part logged the config.json the run wrote
    assert sorted(history) == list(range(1, 13))

    restarts = [row for row in rows if row.get("event") == "restart"]
    assert [row["step"] for row in restarts] == [8] and history[9]["down_s"] == restarts[0]["down_s"]
    # wandb merges the rows of one step, a later row's keys over an earlier one's (step 12:
    # the checkpoint's goodput, then the end's); the restart row joins step 9, the first
    # one trained after it
    expected = {}
    for row in rows:
        merged = expected.setdefault(wandb_step(row), {})
        for key, value in row.items():
            if key == "expert_load":
                merged.update({f"expert_load/block{n}/expert{e}": x for n, load_E in enumerate(value) if any(load_E)
                               for e, x in enumerate(load_E)})
            elif key == "goodput":  # seconds per phase, on checkpoint, restart and end rows
                merged.update({f"goodput/{phase}": x for phase, x in value.items()})
            elif isinstance(value, list):  # max_logit_layer: one value per layer
                merged.update({f"{key}/" + "/".join(map(str, i)): x for i, x in np.ndenumerate(np.asarray(value))})
            elif key not in ("step", "time") and not isinstance(value, str):  # (event, reason: words; time: wandb's own)
                merged[key] = value
    for step, merged in expected.items():
        assert history[step]["tokens"] == step * tokens_per_step
        assert {key: history[step][key] for key in merged} == pytest.approx(merged, rel=1e-12), step
    for key in ("loss", "lr", "grad_norm", "tokens_per_sec", "mfu", "aux_loss", "dropped_frac", "expert_load/block1/expert7"):
        assert key in history[12], key
    assert "val_loss" in history[4] and "val_loss" in history[12] and "val_loss" not in history[5]

    assert history[8]["samples._type"] == "table-file"
    with open(os.path.join(parts[0], "files", history[8]["samples.path"])) as f:
        table = json.load(f)
    assert table["columns"] == ["step", "prompt", "text"]
    [[step, prompt, text]] = table["data"]
    with open(run_dir / "samples.txt", newline="") as f:
        assert (step, prompt) == (8, "ROMEO:") and f.read() == f"--- step 8, prompt 'ROMEO:'\n{text}\n"


# ---- Progress lines (runtime/progress.py)


def test_progress_is_a_plain_line_every_log_every_steps_when_stderr_is_not_a_terminal(tmp_path):
    """Into a file: one plain line per --log.every steps (and the last), each with its
    own step's figures, no carriage-return frames; val_loss lines still on stdout. On a
    terminal (a real pseudo-terminal here): tqdm's bar."""
    import pty

    from tqdm import tqdm

    from runtime import progress

    with open(tmp_path / "stderr.log", "w") as stream:
        bar = progress.make_progress(25, 0, 10, True, stream)
        for step in range(1, 26):  # as main.Reporter drives it
            bar.update(1)
            bar.set_postfix(loss=f"{10 - step / 10:.3f}", tok_s="1.2K", refresh=False)
        bar.close()
    text = (tmp_path / "stderr.log").read_text()
    assert "\r" not in text
    lines = text.splitlines()
    assert [line.split(" elapsed ")[0] for line in lines] == [
        "train step 10/25 (40%) loss=9.000 tok_s=1.2K", "train step 20/25 (80%) loss=8.000 tok_s=1.2K",
        "train step 25/25 (100%) loss=7.500 tok_s=1.2K"]
    master, replica = pty.openpty()
    with os.fdopen(replica, "w") as terminal:
        assert isinstance(progress.make_progress(25, 0, 10, True, terminal), tqdm)
    os.close(master)


@pytest.mark.slow
def test_a_run_whose_stderr_is_a_file_logs_plain_progress_lines(tmp_path):
    """End to end: main.py with stderr to a pipe (as a launcher's log) prints
    `train step S/N ...` lines, not tqdm's \\r frames (before runtime/progress.py: one line of
    frames, and this failed)."""
    result = subprocess.run([sys.executable, "main.py", "--preset", "tiny", "--run.out_dir", str(tmp_path), "--run.name", "r",
                             "--data.cache_dir", str(tmp_path / "data_cache"), "--train.steps", "6", "--log.every", "3",
                             "--train.eval_every", "100", "--sample.num_samples", "0", "--log.plots", "false"],
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "\r" not in result.stderr
    steps = [line.split()[2] for line in result.stderr.splitlines() if line.startswith("train step ")]
    assert steps == ["3/6", "6/6"], result.stderr[-2000:]
