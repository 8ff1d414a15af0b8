"""Weighted mixtures of token-shard sources, with stages: `--data.mixture shakespeare:0.7,code:0.3` or a JSON file.

A source is what --data.source takes (an embedded name, a prepared directory, gs://bucket/prefix); every source must have
been made with one tokenizer. Weights count tokens: every row of a batch is one window of seq_len + 1 tokens cut from one
source's token stream, in which documents were packed back to back (end-of-text between them) when the source was prepared
(data/tokenize.py, or the embedded corpora). Packing happens there, before mixing; a row never spans two sources, so a
source's share of rows is its share of tokens. Weights need not sum to 1 (they are normalised).

The JSON form names the sources, their first weights and the stages (the weights from a step on; a source left out of a
stage weighs 0 in it):

    {"sources": {"plays": "shakespeare", "stdlib": "code"},
     "weights": {"plays": 0.9, "stdlib": 0.1},
     "stages": [{"step": 500, "weights": {"plays": 0.5, "stdlib": 0.5}}]}

The schedule ("Which source a row reads" below) is a closed form: global sample n = step * batch_size + row goes to one
source and to that source's k-th sample, which its own TokenData places as it places any sample (dataset.py, "Batch
order"). So the batch of step s depends only on (seed, the mixture, s, batch size, seq_len): never on the mesh, the number
of processes or a restart, and a resume needs only the step. Each process reads only its rows. Grain's `mix` is not used:
it has no stages, and this reader already reaches any sample in O(1) without iterator state to checkpoint.

Per-source numbers: train rows carry `tokens/<name>` (tokens trained on from that source so far), eval rows
`val_loss/<name>` (each source's own fixed eval set) beside `val_loss`, their mean weighted by the last stage's weights.
main.py imports this module only when --data.mixture is set.
"""

import functools
import json
import os
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from dataset import EMBEDDED_SOURCES, ShardError, open_data
from utils import ConfigError


@dataclass(frozen=True)
class Mixture:
    """Sources by name, and the stages: (first step, weights normalised to sum 1, one per source)."""
    names: tuple[str, ...]
    sources: tuple[str, ...]
    stages: tuple[tuple[int, tuple[Fraction, ...]], ...]


# ---- Reading the flag


def parse_mixture(spec: str) -> Mixture:
    """`NAME:WEIGHT,...` or a JSON file (ending in .json) -> Mixture; ConfigError in one line for what is wrong."""
    if spec.endswith(".json"):
        return mixture_from_json(spec)
    pairs = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        source, sep, weight = item.rpartition(":")  # rpartition: gs://bucket/prefix keeps its colon
        if not sep or not source:
            raise ConfigError(f"--data.mixture: {item!r} is not NAME:WEIGHT; write e.g. --data.mixture shakespeare:0.7,code:0.3")
        pairs.append((short_name(source), source, weight))
    names = tuple(name for name, _, _ in pairs)
    return make_mixture(names, tuple(source for _, source, _ in pairs), [(0, dict(zip(names, (w for _, _, w in pairs))))])


def short_name(source: str) -> str:
    """The name a source's metrics carry: an embedded name, or the last part of a directory or gs:// prefix."""
    return os.path.basename(source.rstrip("/")) or source


def mixture_from_json(path: str) -> Mixture:
    if not os.path.isfile(path):
        raise ConfigError(f"--data.mixture: no file {path}; give NAME:WEIGHT,... or the path of a JSON file of sources and weights")
    try:
        with open(path) as f:
            spec = json.load(f)
        sources, stages = spec["sources"], [(0, spec["weights"])] + [(s["step"], s["weights"]) for s in spec.get("stages", [])]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ConfigError(f"--data.mixture {path}: {type(e).__name__} {e}; it needs \"sources\" {{name: source}}, \"weights\" "
                          "{name: weight} and optionally \"stages\" [{\"step\": S, \"weights\": {...}}] (docs/data.md)") from None
    if not isinstance(sources, dict):
        raise ConfigError(f"--data.mixture {path}: \"sources\" must map names to sources, e.g. {{\"plays\": \"shakespeare\"}}")
    return make_mixture(tuple(sources), tuple(sources.values()), stages)


def make_mixture(names, sources, stages) -> Mixture:
    """Check names, steps and weights (stages: [(first step, {name: weight})]) and normalise the weights."""
    if not names:
        raise ConfigError("--data.mixture names no source; write e.g. --data.mixture shakespeare:0.7,code:0.3")
    if len(set(names)) < len(names):
        raise ConfigError(f"--data.mixture names a source twice ({', '.join(names)}); list each once, or name them apart "
                          "in a JSON mixture (\"sources\": {name: source})")
    steps = [step for step, _ in stages]
    if not all(isinstance(s, int) and s >= 0 for s in steps) or steps != sorted(set(steps)):
        raise ConfigError(f"--data.mixture: stage steps {steps} must be increasing whole numbers after step 0")
    return Mixture(tuple(names), tuple(sources), tuple((step, stage_weights(names, weights)) for step, weights in stages))


def stage_weights(names, weights: dict) -> tuple[Fraction, ...]:
    unknown = sorted(set(weights) - set(names))
    if unknown:
        raise ConfigError(f"--data.mixture: weights for {unknown}, which are not among the sources {list(names)}")
    values = []
    for name in names:
        try:
            value = Fraction(str(weights.get(name, 0)))  # exact: the schedule's counts are integer arithmetic
        except ValueError:
            value = None
        if value is None or value < 0:
            raise ConfigError(f"--data.mixture: the weight of {name!r} is {weights.get(name)!r}; weights are numbers >= 0")
        values.append(value)
    if sum(values) == 0:
        raise ConfigError(f"--data.mixture: every weight is 0 in {weights}; give at least one source a positive weight")
    return tuple(v / sum(values) for v in values)


# ---- Which source a row reads: a pure function of the sample index. The sources with weight in a stage sit at the leaves
# of a balanced binary tree; at each node the left half takes floor(m * p) of the node's first m samples (p: its share of
# the node's weight), which is a Bresenham line: sample m goes left exactly when floor((m + 1) p) > floor(m p), and it is
# then the left's sample floor(m p), else the right's m - floor(m p). Every source's count stays within the tree's depth of
# its exact share, and any sample is placed in O(log sources) without looking at the others.


def split_node(weights, members):
    left, right = members[:len(members) // 2], members[len(members) // 2:]
    return left, right, sum(weights[j] for j in left) / sum(weights[j] for j in members)


def place_in_stage(weights, m: int) -> tuple[int, int]:
    """Sample m of a stage -> (source, its sample index among the stage's samples of that source)."""
    members = tuple(j for j, w in enumerate(weights) if w > 0)
    while len(members) > 1:
        left, right, p = split_node(weights, members)
        before = m * p.numerator // p.denominator
        goes_left = (m + 1) * p.numerator // p.denominator > before
        members, m = (left, before) if goes_left else (right, m - before)
    return members[0], m


def counts_in_stage(weights, n: int) -> list[int]:
    """How many of a stage's first n samples each source gets."""
    counts, todo = [0] * len(weights), [(tuple(j for j, w in enumerate(weights) if w > 0), n)]
    while todo:
        members, n = todo.pop()
        if len(members) == 1:
            counts[members[0]] += n
            continue
        left, right, p = split_node(weights, members)
        todo += [(left, n * p.numerator // p.denominator), (right, n - n * p.numerator // p.denominator)]
    return counts


@functools.lru_cache(maxsize=64)
def stage_starts(mixture: Mixture, batch_size: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """Per stage: its first global sample, and each source's samples in the stages before it."""
    out, before = [], [0] * len(mixture.names)
    for k, (step, weights) in enumerate(mixture.stages):
        out.append((step * batch_size, tuple(before)))
        if k + 1 < len(mixture.stages):
            length = (mixture.stages[k + 1][0] - step) * batch_size
            before = [a + b for a, b in zip(before, counts_in_stage(weights, length))]
    return tuple(out)


def locate_sample(mixture: Mixture, batch_size: int, sample: int) -> tuple[int, int]:
    """Global sample index (step * batch_size + row) -> (source, that source's sample index)."""
    starts = stage_starts(mixture, batch_size)
    k = max(i for i, (first, _) in enumerate(starts) if first <= sample)
    source, index = place_in_stage(mixture.stages[k][1], sample - starts[k][0])
    return source, starts[k][1][source] + index


def samples_seen(mixture: Mixture, batch_size: int, n: int) -> list[int]:
    """Each source's share of the global samples 0..n-1."""
    starts = stage_starts(mixture, batch_size)
    k = max(i for i, (first, _) in enumerate(starts) if first <= n)
    in_stage = counts_in_stage(mixture.stages[k][1], n - starts[k][0])
    return [a + b for a, b in zip(starts[k][1], in_stage)]


# ---- MixtureData: TokenData's reading interface over several sources


class MixtureData:
    """The sources of a mixture (each a dataset.TokenData), read as deterministic global batches."""

    def __init__(self, mixture: Mixture, parts: list, batch_size: int, seq_len: int):
        self.mixture, self.parts, self.batch_size, self.seq_len = mixture, parts, batch_size, seq_len
        first = parts[0]
        for name, part in zip(mixture.names[1:], parts[1:]):
            if (part.tokenizer_name, part.vocab_size) != (first.tokenizer_name, first.vocab_size):
                raise ConfigError(f"--data.mixture: {name!r} was tokenized with {part.tokenizer_name!r} ({part.vocab_size} ids) but "
                                  f"{mixture.names[0]!r} with {first.tokenizer_name!r} ({first.vocab_size} ids); mix sources made with "
                                  "one tokenizer (data/tokenize.py --encoding) or leave one out")
        self.vocab_size, self.tokenizer_name = first.vocab_size, first.tokenizer_name

    @property
    def rows_loaded(self) -> int:
        return sum(part.rows_loaded for part in self.parts)

    def batch(self, split: str, step: int, batch_size: int, seq_len: int, seed: int, rows: range | None = None) -> np.ndarray:
        """Rows `rows` (default: all) of the global batch for `step`: int32 [len(rows), seq_len + 1], each from one source."""
        rows = range(batch_size) if rows is None else rows
        if step < 0 or (len(rows) and (min(rows) < 0 or max(rows) >= batch_size)):
            raise ValueError(f"step {step} and rows {rows} must lie in steps >= 0 and range(0, {batch_size})")
        out = np.empty((len(rows), seq_len + 1), np.int32)
        for i, row in enumerate(rows):
            source, index = locate_sample(self.mixture, batch_size, step * batch_size + row)
            out[i] = self.parts[source].batch(split, index, 1, seq_len, seed)[0]  # its sample `index`: step index, batch of 1
        return out

    def train_row(self, step: int) -> dict:
        """`tokens/<name>`: the tokens of each source that steps 0..step-1 trained on."""
        seen = samples_seen(self.mixture, self.batch_size, step * self.batch_size)
        return {f"tokens/{name}": n * self.seq_len for name, n in zip(self.mixture.names, seen)}

    def evaluate(self, evaluate_one) -> dict:
        """`val_loss/<name>` = evaluate_one(that source) for each source; `val_loss` their mean under the last stage's weights."""
        losses = {name: evaluate_one(part) for name, part in zip(self.mixture.names, self.parts)}
        final = self.mixture.stages[-1][1]
        return {"val_loss": float(sum(float(w) * loss for w, loss in zip(final, losses.values()))),
                **{f"val_loss/{name}": loss for name, loss in losses.items()}}

    def close(self) -> None:
        for part in self.parts:
            part.close()


def open_mixture(cfg, process_index: int = 0) -> MixtureData:
    """--data.mixture's sources opened (each checked before anything compiles) as one MixtureData."""
    mixture = parse_mixture(cfg.data.mixture)
    parts = []
    try:
        for name, source in zip(mixture.names, mixture.sources):
            if source not in EMBEDDED_SOURCES and not source.startswith("gs://") and not os.path.isdir(source):
                raise ConfigError(f"--data.mixture: source {source!r} is neither an embedded dataset {EMBEDDED_SOURCES}, "
                                  "an existing directory, nor gs://bucket/prefix; prepare it with data/tokenize.py or fix the name")
            try:
                parts.append(open_data(source, cfg.data.cache_dir, cfg.data.cache_max_gb, process_index))
            except (FileNotFoundError, ValueError, ShardError) as e:
                raise ConfigError(f"--data.mixture: source {name!r} ({source}): {e}") from None
        return MixtureData(mixture, parts, cfg.train.batch_size, cfg.model.seq_len)
    except BaseException:
        for part in parts:
            part.close()
        raise
