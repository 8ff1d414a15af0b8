"""lm-evaluation-harness tasks inside the training loop: `--eval.tasks NAME,...` (with `--eval.include_path DIR` for
task files of your own) scored every --train.eval_every steps, as rows `eval/<task>/<metric>` in metrics.jsonl.

The harness talks to an `LM` (lm_eval.api.model); here it is `MeshLM`, whose log-likelihoods come from one jitted program
over the training mesh: GPipe's forward under shard_map (the eval step's under manual sharding, parallel/steps.py's
make_eval_step: dropless, no dropout; under --mesh.sharding auto too, on the same storage shardings) on the current
params in their training shardings, with a loss head that keeps each row's own sums instead of the batch's. A request is
one row of [seq_len + 1] tokens: context then continuation, left-aligned, the continuation's targets scored and every
other target skipped (stored as ~id, as sft's prompts are: model.unmasked). So the scores are the ones lm-eval gets from
the server or the Hugging Face export for the same params, on any mesh (dp, cp, pp, tp, expert parallelism) and process
count (tests/test_eval_tasks.py).

Kinds: multiple choice and other log-likelihood tasks (`loglikelihood`), perplexity ones (`loglikelihood_rolling`: the
document in disjoint windows of seq_len, lm-eval's own windowing). Generation tasks are refused before training starts.
Every process runs the harness on the same requests in the same order (each feeds the rows its devices hold); process 0
writes the rows. lm-eval is imported only when --eval.tasks is set (main.py imports this module only then).
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from dataset import get_tokenizer
from model import Transformer, held_positions, local_targets, unmasked
from ops.collectives import axis_index, pmax, psum
from parallel import fsdp, gpipe
from parallel import step_core as core
from parallel.mesh import batch_spec, global_batch, specs_of
from parallel.steps import eval_model_config, partition
from utils import BATCH_AXES, CP, PP, ConfigError, apply_overrides

try:
    from lm_eval import evaluator
    from lm_eval.api.model import TemplateLM
except ImportError:  # a one-line error from main.py, not a traceback
    raise ConfigError("--eval.tasks needs lm-evaluation-harness: pip install lm-eval==0.4.13 (requirements-test.txt)") from None

SCORED_KINDS = ("loglikelihood", "multiple_choice", "loglikelihood_rolling")  # the output_types scored here


# ---- The forward: each row's summed log-likelihood of its scored targets, and whether each was the greedy token


class RowHead:
    """The model, with a loss head that returns per-row sums [b, 2] (log-likelihood, targets not argmax) of the targets
    not skipped; the rest (embedding, blocks) is the model's own, which GPipe runs as in the eval step."""

    def __init__(self, model):
        self.model = model

    def __getattr__(self, name):
        return getattr(self.model, name)

    def head_sums(self, y_bTD, tokens_bT1, angles, axes, keys_b=None):
        targets_bT = local_targets(tokens_bT1, held_positions(angles))
        scored_bT = targets_bT >= 0
        targets_bT = unmasked(targets_bT)
        # Vocab-parallel as model.loss_sum: logits [b, T, V/tp] are never gathered; max and sum of exps reduced over tp.
        logits_bTV = self.model.logits(y_bTD)
        V_local = logits_bTV.shape[-1]
        local_bT = targets_bT - axis_index(axes.tp) * V_local
        max_bT = pmax(jnp.max(logits_bTV, axis=-1), axes.tp)
        sum_exp_bT = psum(jnp.sum(jnp.exp(logits_bTV - max_bT[..., None]), axis=-1), axes.tp)
        picked_bT = jnp.take_along_axis(logits_bTV, jnp.clip(local_bT, 0, V_local - 1)[..., None], -1)[..., 0]
        target_bT = psum(jnp.where((local_bT >= 0) & (local_bT < V_local), picked_bT, 0.0), axes.tp)
        log_prob_bT = target_bT - max_bT - jnp.log(sum_exp_bT)
        missed_bT = target_bT < max_bT  # another token scores higher: not greedy
        sums_b2 = jnp.stack([jnp.sum(jnp.where(scored_bT, log_prob_bT, 0.0), -1),
                             jnp.sum(scored_bT & missed_bT, -1).astype(jnp.float32)], -1)
        return sums_b2, jnp.zeros((), jnp.float32)


def make_row_scores(cfg, mesh, params):
    """Jitted (params, tokens [B, T + 1]) -> [B, 2] on every device: each row's summed log-probability of its targets
    >= 0, and how many of them were not the argmax. One microbatch; the eval step's model config (dropless)."""
    cfg = apply_overrides(eval_model_config(cfg), {"train": {"microbatches": 1}, "model": {"dropout": 0.0}})
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model, nnx.Rngs(0))))[0]
    B = cfg.train.batch_size

    def scores(params, tokens_bT1):
        model = nnx.merge(graphdef, {**fsdp.gather_top(params, cfg), "blocks": params["blocks"]})
        first = core.first_row(tokens_bT1.shape[0])
        mb = core.split_microbatches(tokens_bT1, cfg, None, first_row=first)
        sums_b2 = gpipe.pipeline_sums(RowHead(model), mb, cfg)[0]  # (the last stage's; zeros on the others)
        placed_B2 = jax.lax.dynamic_update_slice(jnp.zeros((B, 2), jnp.float32), sums_b2, (first, 0))
        return psum(placed_B2, BATCH_AXES + (CP, PP))  # every row, summed over cp's chunks, on every device

    return jax.jit(partition(scores, True, mesh, in_specs=(specs_of(params), batch_spec()), out_specs=P()))


# ---- The harness's model


class MeshLM(TemplateLM):
    """lm-eval's LM over the training mesh; `params` are set to the current ones before each evaluation."""

    def __init__(self, cfg, mesh, rows, params):
        super().__init__()
        self.cfg, self.mesh, self.rows, self.params = cfg, mesh, rows, params
        self.tokenizer_ = get_tokenizer(cfg.data.tokenizer, cfg.data.encoding_file)
        self.scores = make_row_scores(cfg, mesh, params)
        self.max_length, self.batch_size = cfg.model.seq_len, cfg.train.batch_size

    @property
    def eot_token_id(self):
        return self.tokenizer_.eot_id

    def tok_encode(self, string, add_special_tokens=None, **kwargs):
        return self.tokenizer_.encode(string)

    def score_rows(self, pairs):
        """[(context ids, continuation ids)] -> [(log-likelihood, greedy)], batch_size rows per call; a row keeps the last
        seq_len + 1 tokens (lm-eval's truncation: the context's start goes)."""
        out, T1 = [], self.max_length + 1
        for start in range(0, len(pairs), self.batch_size):
            tokens_BT1 = np.full((self.batch_size, T1), -1, np.int32)  # ~0: padding, no target scored
            for row, (context, continuation) in enumerate(pairs[start:start + self.batch_size]):
                ids = np.asarray((context + continuation)[-T1:], np.int32)
                n_scored = min(len(continuation), len(ids) - 1)
                tokens_BT1[row, :len(ids)] = np.where(np.arange(len(ids)) < len(ids) - n_scored, ~ids, ids)
                tokens_BT1[row, 0] = ids[0]  # an input, never a target
            batch = global_batch(self.mesh, tokens_BT1[np.asarray(self.rows)], self.batch_size)
            sums_B2 = np.asarray(jax.device_get(self.scores(self.params, batch)))
            out += [(float(s[0]), bool(s[1] == 0)) for s in sums_B2[:len(pairs) - start]]
        return out

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
        return self.score_rows([(context, continuation) for _, context, continuation in requests])

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        totals = []
        for (text,) in (req.args for req in requests):
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                self.tok_encode(text), self.prefix_token_id, self.max_length, 1)]
            totals.append(sum(score for score, _ in self.score_rows(windows)))
        return totals

    def generate_until(self, requests, disable_tqdm=False):
        raise ConfigError("--eval.tasks scores log-likelihood tasks only (multiple choice, perplexity); "
                          "run generation tasks through the server (docs/evaluation.md)")


# ---- Tasks, every eval


class TaskEval:
    """The tasks of --eval.tasks, loaded once (before training: a bad name fails early); called with the current params,
    {f"eval/{task}/{metric}": value}."""

    def __init__(self, cfg, mesh, rows, params):
        from lm_eval.tasks import TaskManager, get_task_dict

        names = [name.strip() for name in cfg.eval.tasks.split(",") if name.strip()]
        manager = TaskManager(include_path=cfg.eval.include_path or None)
        unknown = [name for name in names if name not in manager.all_tasks]
        if unknown:
            raise ConfigError(f"--eval.tasks: no task {unknown} in lm-eval's tasks or --eval.include_path "
                              f"{cfg.eval.include_path!r}; give a task's name, and the directory of its YAML")
        self.tasks = get_task_dict(names, manager)
        for name, task in self.tasks.items():
            if getattr(task, "OUTPUT_TYPE", None) not in SCORED_KINDS:
                raise ConfigError(f"--eval.tasks: {name} is a {getattr(task, 'OUTPUT_TYPE', 'group')} task; in the loop only "
                                  f"{', '.join(SCORED_KINDS)} tasks run (generation: through the server, docs/evaluation.md)")
        self.lm = MeshLM(cfg, mesh, rows, params)
        self.limit = cfg.eval.limit or None

    def __call__(self, params) -> dict:
        self.lm.params = params
        results = evaluator.evaluate(self.lm, self.tasks, limit=self.limit, bootstrap_iters=0, log_samples=False,
                                             verbosity="WARNING")["results"]
        return {f"eval/{task}/{metric.removesuffix(',none').replace(',', '_')}": float(value)
                for task, scores in results.items() for metric, value in scores.items()
                if isinstance(value, (int, float)) and "_stderr" not in metric and metric != "sample_len"}
