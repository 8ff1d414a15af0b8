"""An evaluation harness as a real client: lm-evaluation-harness scores one multiple-choice
task two ways on the same trained run, through `--mode serve` (its `local-completions`
client, which asks for echoed prompt log-probabilities) and on the `--mode export_hf`
directory (its `hf` model, transformers on torch). Both must give the same accuracy and,
item by item, the same log-likelihoods (float32: within 1e-4).

The task is written here from the run's own validation split (nothing is downloaded):
each item is a 10-byte context and four 4-byte continuations, the true one and three
from elsewhere in the split, so that context + continuation fits the tiny preset's
16-token window, which the server enforces.
"""

import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

from test_serve import REPO, serving  # noqa: E402

N_ITEMS, CONTEXT, CONTINUATION = 8, 10, 4
TASK = "meshformer_val_mc"
OFFLINE = dict(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1")


def write_task(cache_dir, out_dir):
    """items.jsonl from the validation split (byte tokens, so bytes are text) and the
    task's YAML beside it; returns the directory for --include_path."""
    from dataset import open_data

    data = open_data("shakespeare", str(cache_dir))
    rows = next(data.eval_batches(1, 4 * N_ITEMS, CONTEXT + CONTINUATION - 1))  # [rows, 14]
    rows = [r for r in rows if all(32 <= t < 127 or t == 10 for t in r)][:N_ITEMS + 3]
    texts = [bytes(int(t) for t in r).decode("ascii") for r in rows]
    assert len(texts) >= N_ITEMS + 3, "too few ASCII windows in the validation split"
    items = []
    for i in range(N_ITEMS):
        true = texts[i][CONTEXT:]
        others = [t[CONTEXT:] for t in texts if t[CONTEXT:] != true][i % 3:i % 3 + 3]
        answer = i % 4  # the true continuation at every position in turn
        choices = others[:answer] + [true] + others[answer:]
        items.append(dict(context=texts[i][:CONTEXT], choices=choices, answer=answer))
    task_dir = out_dir / "task"
    task_dir.mkdir()
    (task_dir / "items.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items))
    (task_dir / f"{TASK}.yaml").write_text(f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {task_dir / 'items.jsonl'}
validation_split: validation
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
""")
    return task_dir


def lm_eval(model, model_args, task_dir, out_dir, *extra):
    """Run the harness's command line; (accuracy, {(item, choice): log-likelihood})."""
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", model, "--model_args", model_args, "--tasks", TASK,
           "--include_path", str(task_dir), "--output_path", str(out_dir), "--log_samples", "--batch_size", "1", *extra]
    result = subprocess.run(cmd, cwd=str(out_dir.parent), capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, **OFFLINE))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    (results_file,) = glob.glob(str(out_dir / "**" / "results_*.json"), recursive=True)
    (samples_file,) = glob.glob(str(out_dir / "**" / f"samples_{TASK}_*.jsonl"), recursive=True)
    with open(results_file) as f:
        accuracy = json.load(f)["results"][TASK]["acc,none"]
    loglikelihoods = {}
    with open(samples_file) as f:
        for line in f:
            sample = json.loads(line)
            for c, response in enumerate(sample["resps"]):
                loglikelihoods[(sample["doc_id"], c)] = float(response[0][0])
    return accuracy, loglikelihoods


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["deepseek_v3"])  # router bias, expert groups, routed scale, MTP (remote code; the
# built-in classes' exports: tests/test_hf.py, against transformers' logits)
def test_lm_eval_through_the_server_equals_lm_eval_on_the_hf_export(tmp_path, preset):
    cache = tmp_path / "data_cache"
    run_args = ["--preset", preset, "--run.out_dir", str(tmp_path / "runs"), "--run.name", "r", "--data.cache_dir", str(cache),
                "--log.progress", "false", "--log.plots", "false", "--sample.num_samples", "0"]
    for extra in (["--train.steps", "30", "--train.eval_every", "1000"], ["--mode", "export_hf", "--export.dtype", "float32"]):
        result = subprocess.run([sys.executable, "main.py", *run_args, *extra], cwd=REPO, capture_output=True, text=True,
                                timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    hf_dir = tmp_path / "runs" / "r" / "hf"
    task_dir = write_task(cache, tmp_path)

    with serving(run_args, tmp_path / "serve.log") as port:
        served = lm_eval("local-completions", f"model=r,base_url=http://127.0.0.1:{port}/v1/completions,"
                         f"tokenizer_backend=huggingface,tokenizer={hf_dir},num_concurrent=1,max_retries=1",
                         task_dir, tmp_path / "out_served")
    remote = ",trust_remote_code=True" if (hf_dir / "modeling_meshformer.py").exists() else ""  # (the deepseek_v3 preset's DM blocks)
    exported = lm_eval("hf", f"pretrained={hf_dir},dtype=float32{remote}", task_dir, tmp_path / "out_hf", "--device", "cpu")

    (served_acc, served_ll), (hf_acc, hf_ll) = served, exported
    assert sorted(served_ll) == sorted(hf_ll) and len(hf_ll) == 4 * N_ITEMS
    gaps = np.abs(np.array([served_ll[k] - hf_ll[k] for k in hf_ll]))
    print(f"harness accuracy: served {served_acc}, hf {hf_acc}; largest log-likelihood gap {gaps.max():.2e}")
    assert served_acc == hf_acc
    assert gaps.max() < 1e-4, gaps.max()
    assert len({round(v, 3) for v in hf_ll.values()}) > N_ITEMS  # real, varied scores, not one value everywhere
