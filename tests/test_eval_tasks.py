"""--eval.tasks: lm-evaluation-harness tasks scored inside the training loop (runtime/harness.py) give the scores the
harness gets through the server (`--mode serve`, its local-completions client) for the same checkpoint: a multiple-choice
task's accuracy and a perplexity task's word and byte perplexities and bits per byte.

Both tasks are local files written here (nothing is downloaded); every item fits the tiny preset's 16-token window
(the server refuses a longer prompt), so both sides score the same tokens in one window.
"""

import glob
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

from test_harness import OFFLINE  # noqa: E402
from test_serve import REPO, free_port, serving  # noqa: E402
CONTEXTS = ["ROMEO: my ", "JULIET: O ", "Good night", "What light", "To be, or ", "First Citiz"]
CHOICES = ["love", "dead", "sir,", "good"]
DOCS = ["To be, or no", "What light?", "Good night, good", "ROMEO: I am"]


def write_tasks(task_dir):
    """A multiple-choice task (t_mc) and a perplexity one (t_ppl), from JSON lines beside their YAML."""
    task_dir.mkdir()
    items = [dict(context=c, choices=CHOICES[i % 4:] + CHOICES[:i % 4], answer=i % 4) for i, c in enumerate(CONTEXTS)]
    (task_dir / "items.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items))
    (task_dir / "docs.jsonl").write_text("".join(json.dumps(dict(text=t)) + "\n" for t in DOCS))
    common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n"
    (task_dir / "t_mc.yaml").write_text(f"""task: t_mc
{common}    validation: {task_dir / 'items.jsonl'}
validation_split: validation
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
""")
    (task_dir / "t_ppl.yaml").write_text(f"""task: t_ppl
{common}    test: {task_dir / 'docs.jsonl'}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""")




def served_scores(run_args, hf_dir, task_dir, out_dir):
    """lm_eval local-completions against `--mode serve` of the run: {eval/<task>/<metric>: score}."""
    with serving(run_args, out_dir.parent / "serve.log") as port:
        cmd = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args",
               f"model=r,base_url=http://127.0.0.1:{port}/v1/completions,tokenizer_backend=huggingface,tokenizer={hf_dir},"
               "num_concurrent=1,max_retries=1,max_length=16", "--tasks", "t_mc,t_ppl", "--include_path", str(task_dir),
               "--output_path", str(out_dir), "--batch_size", "1"]
        result = subprocess.run(cmd, cwd=str(out_dir.parent), capture_output=True, text=True, timeout=600,
                                env=dict(os.environ, **OFFLINE))
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    (results_file,) = glob.glob(str(out_dir / "**" / "results_*.json"), recursive=True)
    with open(results_file) as f:
        results = json.load(f)["results"]
    return {f"eval/{task}/{metric.removesuffix(',none')}": value for task, scores in results.items()
            for metric, value in scores.items() if isinstance(value, (int, float)) and "stderr" not in metric}


@pytest.mark.slow
def test_in_loop_task_scores_equal_lm_eval_through_the_server(tmp_path):
    task_dir = tmp_path / "tasks"
    write_tasks(task_dir)
    run_args = ["--preset", "tiny", "--run.out_dir", str(tmp_path / "runs"), "--run.name", "r", "--data.cache_dir",
                str(tmp_path / "cache"), "--log.progress", "false", "--log.plots", "false", "--sample.num_samples", "0",
                "--model.dtype", "float32"]
    train = ["--train.steps", "20", "--train.eval_every", "20", "--eval.tasks", "t_mc,t_ppl", "--eval.include_path", str(task_dir)]
    for extra in (train, ["--mode", "export_hf", "--export.dtype", "float32"]):
        result = subprocess.run([sys.executable, "main.py", *run_args, *extra], cwd=REPO, capture_output=True, text=True,
                                timeout=900, env=dict(os.environ, **OFFLINE))
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(tmp_path / "runs" / "r" / "metrics.jsonl") as f:
        (in_loop,) = [row for row in map(json.loads, f) if "eval/t_mc/acc" in row]
    assert in_loop["step"] == 20
    served = served_scores(run_args, tmp_path / "runs" / "r" / "hf", task_dir, tmp_path / "out_served")
    print({key: (in_loop.get(key), value) for key, value in served.items()})
    assert {k for k in in_loop if k.startswith("eval/")} == set(served) - {"eval/t_mc/sample_len", "eval/t_ppl/sample_len"}
    assert in_loop["eval/t_mc/acc"] == served["eval/t_mc/acc"]
    for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        assert in_loop[f"eval/t_ppl/{metric}"] == pytest.approx(served[f"eval/t_ppl/{metric}"], rel=1e-4), metric
    assert 1 < in_loop["eval/t_ppl/byte_perplexity"] < 257  # trained a little: under a uniform guess over the byte ids


def test_a_run_without_lm_eval_is_told_in_one_line_what_to_install():
    """--eval.tasks where lm-eval cannot be imported: the ConfigError main.py prints as its one `error:` line."""
    code = ("import sys; sys.modules['lm_eval'] = None\n"
            "from utils import ConfigError\n"
            "try:\n    import runtime.harness\nexcept ConfigError as e:\n    print(e)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "--eval.tasks needs lm-evaluation-harness: pip install lm-eval==0.4.13 (requirements-test.txt)"


def test_tasks_png_plots_each_tasks_scores_against_tokens_seen(tmp_path):
    from runtime.plots import plot_run

    cfg = {"run": {"name": "r"}, "train": {"batch_size": 4, "seq_len": 8}, "model": {"seq_len": 8}, "data": {}, "eval": {"tasks": "a,b"}}
    rows = [{"step": 10, "val_loss": 2.0, "eval/a/acc": 0.25, "eval/b/byte_perplexity": 40.0},
            {"step": 20, "val_loss": 1.5, "eval/a/acc": 0.5, "eval/b/byte_perplexity": 30.0}]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    drawn = plot_run(str(tmp_path))["tasks.png"]
    assert drawn == {"a": {"acc": ([320.0, 640.0], [0.25, 0.5])}, "b": {"byte_perplexity": ([320.0, 640.0], [40.0, 30.0])}}
    assert (tmp_path / "tasks.png").stat().st_size > 0
    cfg["eval"]["tasks"] = ""  # a run without tasks: no tasks.png
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert "tasks.png" not in plot_run(str(tmp_path))


# ---- The in-loop forward: any mesh equals a plain one-device forward


def mesh_scores(mesh_shape, pairs, expert_parallel=False):
    """MeshLM.score_rows of `pairs` on a tiny model over a (dp, cp, pp, tp) mesh of fake CPU devices."""
    import jax

    from parallel.mesh import make_mesh, process_rows
    from parallel.weights import init_params
    from runtime.harness import MeshLM
    from utils import PRESETS, Config, apply_overrides

    dp, cp, pp, tp = mesh_shape
    cfg = apply_overrides(apply_overrides(Config(), PRESETS["tiny"]), {
        "model": dict(vocab_size=257, dtype="float32"), "train": dict(batch_size=4),
        "mesh": dict(dp=dp, cp=cp, pp=pp, tp=tp, expert_parallel=expert_parallel)})
    mesh = make_mesh(cfg.mesh, jax.devices()[:dp * cp * pp * tp])
    _, params = init_params(cfg.model, mesh, expert_parallel, cfg.run.seed)
    return cfg, params, MeshLM(cfg, mesh, process_rows(mesh, cfg.train.batch_size), params).score_rows(pairs)


def reference_scores(cfg, params, pairs):
    """The plain single-device forward (model.Transformer.__call__, dropless) on each pair alone."""
    import jax
    import numpy as np
    from flax import nnx

    from model import Transformer
    from parallel.steps import eval_model_config

    model_cfg = eval_model_config(cfg).model
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(model_cfg, nnx.Rngs(0))))[0]
    model = nnx.merge(graphdef, jax.device_get(params))
    out = []
    for context, continuation in pairs:
        ids = (context + continuation)[-(cfg.model.seq_len + 1):]
        logits = np.asarray(model(np.asarray([ids[:-1]], np.int32))[0][0], np.float64)  # over the padded vocabulary, as training
        log_probs = logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1, keepdims=True)) - logits.max(-1, keepdims=True)
        n = min(len(continuation), len(ids) - 1)
        positions = range(len(ids) - 1 - n, len(ids) - 1)
        out.append((sum(log_probs[p, ids[p + 1]] for p in positions), all(logits[p].argmax() == ids[p + 1] for p in positions)))
    return out


@pytest.mark.slow
def test_row_scores_on_any_mesh_equal_a_plain_forward():
    """Nine requests (more than one batch of 4, one longer than the window: its context's start is cut) scored over
    1 device, dp 2 x pp 2 x tp 2, and dp 2 x cp 2 x tp 2 with expert parallelism: each request's log-likelihood equals
    the one-device forward's, and so does whether it is the greedy continuation."""
    import numpy as np

    rng = np.random.default_rng(0)
    lengths = [(1, 1), (3, 4), (10, 5), (15, 1), (2, 14), (20, 6), (5, 5), (8, 2), (1, 15)]
    pairs = [(rng.integers(0, 256, c).tolist(), rng.integers(0, 256, n).tolist()) for c, n in lengths]
    cfg, params, one = mesh_scores((1, 1, 1, 1), pairs)
    reference = reference_scores(cfg, params, pairs)
    for scores in (one, mesh_scores((2, 1, 2, 2), pairs)[2], mesh_scores((2, 2, 1, 2), pairs, expert_parallel=True)[2]):
        np.testing.assert_allclose([s for s, _ in scores], [s for s, _ in reference], rtol=1e-5)
        assert [g for _, g in scores] == [g for _, g in reference]
    assert len({round(s, 3) for s, _ in one}) == len(pairs)  # varied, real scores


@pytest.mark.slow  # (lm-eval indexes its thousands of task files, twice)
def test_unknown_and_generation_tasks_stop_before_training_in_one_line(tmp_path):
    from runtime.harness import TaskEval
    from utils import ConfigError, parse_args

    write_tasks(tmp_path / "tasks")
    ppl = (tmp_path / "tasks" / "t_ppl.yaml").read_text().split("metric_list")[0]
    generation = ppl.replace("task: t_ppl", "task: t_gen").replace("loglikelihood_rolling", "generate_until")
    (tmp_path / "tasks" / "t_gen.yaml").write_text(generation + "generation_kwargs:\n  until: [\"\\n\"]\nmetric_list:\n  - metric: exact_match\n")
    for tasks, says in (("t_mc,nope", "--eval.tasks: no task ['nope'] in lm-eval's tasks or --eval.include_path"),
                        ("t_gen", "--eval.tasks: t_gen is a generate_until task; in the loop only loglikelihood, multiple_choice, "
                                  "loglikelihood_rolling tasks run")):
        cfg = parse_args(["--eval.tasks", tasks, "--eval.include_path", str(tmp_path / "tasks")])
        with pytest.raises(ConfigError) as error:
            TaskEval(cfg, mesh=None, rows=None, params=None)  # (refused before the model is touched)
        assert str(error.value).startswith(says) and "\n" not in str(error.value)


@pytest.mark.slow
def test_two_processes_score_the_tasks_as_one_process_does(tmp_path):
    """dp 2 x pp 2 x tp 2 over 2 processes x 4 devices and over 1 process x 8: the same eval row, bit for bit (each process
    runs the harness on the same requests and feeds the rows its devices hold)."""
    write_tasks(tmp_path / "tasks")
    common = ["--preset", "tiny", "--model.dtype", "float32", "--mesh.dp", "2", "--mesh.pp", "2", "--mesh.tp", "2",
              "--train.microbatches", "2", "--train.batch_size", "8", "--train.steps", "2", "--train.eval_every", "2",
              "--train.eval_batches", "1", "--eval.tasks", "t_mc,t_ppl", "--eval.include_path", str(tmp_path / "tasks"),
              "--sample.num_samples", "0", "--log.plots", "false", "--log.progress", "false",
              "--data.cache_dir", str(tmp_path / "cache"), "--run.out_dir", str(tmp_path / "runs"), "--dist.timeout_s", "300"]
    env = dict(os.environ, **OFFLINE)
    one = subprocess.run([sys.executable, "main.py", *common, "--run.cpu_devices", "8", "--run.name", "one"], cwd=REPO,
                         capture_output=True, text=True, timeout=900, env=env)
    assert one.returncode == 0, one.stderr[-3000:]
    two = ["--run.cpu_devices", "4", "--run.name", "two", "--dist.coordinator", f"127.0.0.1:{free_port()}", "--dist.num_processes", "2"]
    procs = [subprocess.Popen([sys.executable, "main.py", *common, *two, "--dist.process_id", str(i)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outputs = [p.communicate(timeout=900)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]

    def eval_row(name):
        with open(tmp_path / "runs" / name / "metrics.jsonl") as f:
            (row,) = [row for row in map(json.loads, f) if "eval/t_mc/acc" in row]
        return row

    assert eval_row("one") == eval_row("two")
    assert {"eval/t_mc/acc", "eval/t_ppl/bits_per_byte"} <= set(eval_row("two"))
