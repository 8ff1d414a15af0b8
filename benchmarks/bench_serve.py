"""Benchmark the server's batched decoding: decode tokens/s with one busy slot and with
every slot busy (engine.py, no HTTP in between).

    python benchmarks/bench_serve.py --preset shakespeare --serve.slots 8
    python benchmarks/bench_serve.py --preset tiny --serve.slots 16 --tokens 64
                                   # last line: tokens_per_sec_1=... tokens_per_sec_all=...
    python benchmarks/bench_serve.py --preset tiny --serve.slots 8 --guided json_object
                                   # also timed under response_format's masks (serving/structured.py);
                                   # last line gains guided_tokens_per_sec_1=... guided_tokens_per_sec_all=...

The model is the preset's, freshly initialised (decode speed does not depend on what
the weights hold). Each sequence has an 8-token prompt and generates --tokens tokens
(default: up to the end of the window, so every step is a decode step and no window
restart is timed). Tokens/s counts the tokens after each sequence's first, over the time
from the first token to the last: the decode steps, not the prefill. Best of --repeats
(default 3) runs: a neighbour's burst on a shared machine slows a run, never speeds it.
"""

import os
import sys

if __name__ == "__main__" and not __package__:
    # Run as a file: its folder comes first on the path, where the repo's modules do not
    # import. Run it again as the module benchmarks.bench_serve, the repo's root on the path.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    os.execve(sys.executable, [sys.executable, "-m", "benchmarks.bench_serve", *sys.argv[1:]], {**os.environ, "PYTHONPATH": path})

import threading
import time

import jax
import numpy as np
from flax import nnx

from benchmarks.step import split_own_flags  # noqa: E402
from data.shards import BYTE_EOT_ID, Tokenizer  # noqa: E402
from parallel.mesh import make_mesh
from parallel.weights import init_params
from serving.engine import Engine, Sequence  # noqa: E402
from serving.structured import Grammars, Guide  # noqa: E402
from utils import ConfigError, apply_overrides, parse_args  # noqa: E402

PROMPT_TOKENS = 8


def split_bench_flags(argv):
    own, rest = split_own_flags(argv, {"tokens": "0", "repeats": "3", "guided": ""})
    if own["guided"] not in ("", "json_object"):
        sys.exit(f"error: --guided takes json_object (a response_format of any JSON object), got {own['guided']!r}")
    return int(own["tokens"]), int(own["repeats"]), own["guided"], rest


def timed_run(engine, n_sequences, tokens, grammar=None):
    """Decode tokens/s of n sequences generated together (each under `grammar`'s masks
    when given: the byte vocabulary's, a JSON document's worth of tokens or up to `tokens`)."""
    times, done = [[] for _ in range(n_sequences)], threading.Semaphore(0)

    def emit(i):
        def on_event(event):
            if event[0] == "token":
                times[i].append(time.perf_counter())
            elif event[0] == "done":
                done.release()
        return on_event

    def guide():
        return None if grammar is None else Guide(grammar, engine.vocab, [BYTE_EOT_ID], np.zeros(engine.vocab, np.float32))

    engine.submit([Sequence(list(range(1, PROMPT_TOKENS + 1)), tokens, 0.8, 40, 1.0, i, emit(i), guide=guide())
                   for i in range(n_sequences)])
    for _ in range(n_sequences):
        done.acquire()
    decoded = sum(len(t) - 1 for t in times)
    return decoded / (max(t[-1] for t in times) - min(t[0] for t in times))


def main(argv):
    tokens, repeats, guided, rest = split_bench_flags(argv)
    try:
        cfg = parse_args(rest)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    if cfg.model.vocab_size == 0:
        cfg = apply_overrides(cfg, {"model": {"vocab_size": 257}})  # byte tokens, as the embedded data
    tokens = tokens or cfg.model.seq_len - PROMPT_TOKENS
    mesh = make_mesh(apply_overrides(cfg, {"mesh": dict(dp=1, pp=1, tp=1)}).mesh, jax.devices()[:1])
    graphdef, params = init_params(cfg.model, mesh, False, cfg.run.seed)
    engine = Engine(nnx.merge(graphdef, params), cfg.serve.slots, queue_limit=cfg.serve.slots)
    t0 = time.perf_counter()
    engine.start()
    print(f"preset {cfg.preset}: {cfg.serve.slots} slots, window {cfg.model.seq_len}, {tokens} tokens per sequence; "
          f"compiled in {time.perf_counter() - t0:.1f}s on {jax.devices()[0].device_kind}", flush=True)
    timed_run(engine, cfg.serve.slots, min(tokens, 8))  # first dispatches
    results = {}
    for n in (1, cfg.serve.slots):
        results[n] = max(timed_run(engine, n, tokens) for _ in range(repeats))
        print(f"decode with {n:>3} of {cfg.serve.slots} slots busy: {results[n]:10.1f} tokens/s "
              f"({1000 * n / results[n]:.2f} ms per step)", flush=True)
    last = f"tokens_per_sec_1={results[1]:.1f} tokens_per_sec_all={results[cfg.serve.slots]:.1f}"
    if guided:  # the same runs, every token drawn under the grammar's mask (computed on the host)
        grammar = Grammars(Tokenizer("bytes"), []).for_format({"type": guided})
        timed_run(engine, cfg.serve.slots, min(tokens, 8), grammar)  # masks of the first states
        for n in (1, cfg.serve.slots):
            guided_n = max(timed_run(engine, n, tokens, grammar) for _ in range(repeats))
            print(f"guided ({guided}) with {n:>3} of {cfg.serve.slots} slots busy: {guided_n:10.1f} tokens/s "
                  f"({guided_n / results[n]:.2f}x unguided)", flush=True)
            last += f" guided_tokens_per_sec_{'1' if n == 1 else 'all'}={guided_n:.1f}"
    engine.stop()
    print(f"batching: {results[cfg.serve.slots] / results[1]:.2f}x the tokens/s of one sequence")
    print(last)


if __name__ == "__main__":
    main(sys.argv[1:])
