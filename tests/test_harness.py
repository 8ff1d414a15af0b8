"""An evaluation harness as a real client: lm-evaluation-harness runs three tasks two ways
on the same trained run, through `--mode serve` (its `local-completions` client, with
`max_length=` as docs/evaluation.md says) and on the `--mode export_hf` directory (its
`hf` model, transformers on torch): a multiple-choice task (echoed prompt log-probabilities:
the same accuracy and, item by item, the same log-likelihoods, float32: within 1e-4), a
generation task with four `until` strings (with lm-eval's end-of-text, five stops: the same
greedy texts) and a perplexity task (rolling windows: the same log-likelihood per document).

The tasks are written here from the run's own validation split (nothing is downloaded):
each multiple-choice item is a 10-byte context and four 4-byte continuations, the true one
and three from elsewhere in the split, so that context + continuation fits the 16-token
window, which the server enforces; a generation item continues the same context by up to
4 tokens; a perplexity document is three windows' text.
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
TASK, GEN_TASK, PPL_TASK = "meshformer_val_mc", "meshformer_val_gen", "meshformer_val_ppl"
UNTIL = ["\n", ",", "e ", "o "]  # lm-eval adds end-of-text: five stop strings
GEN_TOKENS = 4  # a generation's context (10) and tokens fit 14: the hf side's max_length (below)
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
    (task_dir / f"{GEN_TASK}.yaml").write_text(f"""task: {GEN_TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {task_dir / 'items.jsonl'}
validation_split: validation
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: {json.dumps(UNTIL)}
  max_gen_toks: {GEN_TOKENS}
  do_sample: false
metric_list:
  - metric: exact_match
""")
    documents = ["".join(texts[i:i + 3]) for i in range(0, 3 * 3, 3)]
    (task_dir / "documents.jsonl").write_text("".join(json.dumps(dict(text=d)) + "\n" for d in documents))
    (task_dir / f"{PPL_TASK}.yaml").write_text(f"""task: {PPL_TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {task_dir / 'documents.jsonl'}
validation_split: validation
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
""")
    return task_dir


def lm_eval(model, model_args, task_dir, out_dir, *extra):
    """Run the harness's command line on the three tasks; (accuracy, {(item, choice): log-likelihood},
    [each generation item's text], [each document's log-likelihood])."""
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", model, "--model_args", model_args, "--tasks",
           f"{TASK},{GEN_TASK},{PPL_TASK}", "--include_path", str(task_dir), "--output_path", str(out_dir), "--log_samples",
           "--batch_size", "1", *extra]
    result = subprocess.run(cmd, cwd=str(out_dir.parent), capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, **OFFLINE))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    (results_file,) = glob.glob(str(out_dir / "**" / "results_*.json"), recursive=True)
    with open(results_file) as f:
        accuracy = json.load(f)["results"][TASK]["acc,none"]

    def samples(task):
        (samples_file,) = glob.glob(str(out_dir / "**" / f"samples_{task}_*.jsonl"), recursive=True)
        with open(samples_file) as f:
            return sorted((json.loads(line) for line in f), key=lambda sample: sample["doc_id"])

    loglikelihoods = {(sample["doc_id"], c): float(response[0][0]) for sample in samples(TASK)
                      for c, response in enumerate(sample["resps"])}
    generated = [sample["resps"][0][0] for sample in samples(GEN_TASK)]
    rolling = [float(sample["resps"][0][0]) for sample in samples(PPL_TASK)]
    return accuracy, loglikelihoods, generated, rolling


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["deepseek_v3"])  # router bias, expert groups, routed scale, MTP (remote code; the
# built-in classes' exports: tests/test_hf.py, against transformers' logits)
def test_lm_eval_through_the_server_equals_lm_eval_on_the_hf_export(tmp_path, preset):
    cache = tmp_path / "data_cache"
    run_args = ["--preset", preset, "--run.out_dir", str(tmp_path / "runs"), "--run.name", "r", "--data.cache_dir", str(cache),
                "--log.progress", "false", "--log.plots", "false", "--sample.num_samples", "0"]
    for extra in (["--train.steps", "20", "--train.eval_every", "1000"], ["--mode", "export_hf", "--export.dtype", "float32"]):
        result = subprocess.run([sys.executable, "main.py", *run_args, *extra], cwd=REPO, capture_output=True, text=True,
                                timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    hf_dir = tmp_path / "runs" / "r" / "hf"
    task_dir = write_task(cache, tmp_path)

    with serving(run_args, tmp_path / "serve.log") as port:
        served = lm_eval("local-completions", f"model=r,base_url=http://127.0.0.1:{port}/v1/completions,"
                         f"tokenizer_backend=huggingface,tokenizer={hf_dir},num_concurrent=1,max_retries=1,max_length=16",
                         task_dir, tmp_path / "out_served")
    remote = ",trust_remote_code=True" if (hf_dir / "modeling_meshformer.py").exists() else ""  # (the deepseek_v3 preset's DM blocks)
    # lm-eval's API client keeps max_length - 1 tokens (one "for generation") and scores rolling windows one shorter still
    # (one is the context it sends): 14 predicted tokens each at max_length 16; its hf model windows of max_length. So
    # max_length 14 here, that the perplexity task's windows are the same on both sides.
    exported = lm_eval("hf", f"pretrained={hf_dir},dtype=float32,max_length=14{remote}", task_dir, tmp_path / "out_hf",
                       "--device", "cpu")

    (served_acc, served_ll, served_texts, served_rolling), (hf_acc, hf_ll, hf_texts, hf_rolling) = served, exported
    print(f"generated: served {served_texts}, hf {hf_texts}; rolling log-likelihoods: served {served_rolling}, hf {hf_rolling}")
    assert served_texts == hf_texts and len(hf_texts) == N_ITEMS and any(len(t) < GEN_TOKENS for t in hf_texts)  # some stopped
    np.testing.assert_allclose(served_rolling, hf_rolling, atol=1e-3, rtol=0)
    assert len(hf_rolling) == 3 and min(hf_rolling) < -20  # three windows of real text each
    assert sorted(served_ll) == sorted(hf_ll) and len(hf_ll) == 4 * N_ITEMS
    gaps = np.abs(np.array([served_ll[k] - hf_ll[k] for k in hf_ll]))
    print(f"harness accuracy: served {served_acc}, hf {hf_acc}; largest log-likelihood gap {gaps.max():.2e}")
    assert served_acc == hf_acc
    assert gaps.max() < 1e-4, gaps.max()
    assert len({round(v, 3) for v in hf_ll.values()}) > N_ITEMS  # real, varied scores, not one value everywhere
