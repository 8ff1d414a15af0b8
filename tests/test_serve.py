"""--mode serve end to end: a tiny trained run served by the real server (uvicorn in a
subprocess on 127.0.0.1), talked to over HTTP as clients and harnesses do, and by a
real headless browser.

One run and one server for the module (slots 4, queue 16, max_tokens limit 256, a
bearer token); the prompts fit the tiny preset's 16-token window, and completions run
past it, so every slot restarts its window (sampling.Decoder's rule) several times.
"""

import contextlib
import dataclasses
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import jax
import numpy as np
import pytest
from flax import nnx

from model import Transformer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUIET = ["--log.progress", "false", "--log.plots", "false", "--sample.num_samples", "0"]
KEY = "test-key-7f3a"
AUTH = {"Authorization": f"Bearer {KEY}"}
SLOTS, QUEUE, MAX_TOKENS = 4, 16, 256
PROMPTS = ["ROMEO:", "KING", "First Citizen:", "JULIET:\nO Romeo", "And", "What, ho!", "Nay", "The king",
           "LEAR:", "HAMLET:", "My lord,", "Good", "I will", "O, ", "Come, sir", "Farewell"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(run_args, log_path, env=None):
    """`python main.py --mode serve` of the run (`env`: variables added to its environment), its
    output in log_path: yields its port once /health answers (within 300 s), and stops it after."""
    port = free_port()
    with open(log_path, "w+") as log:
        server = subprocess.Popen([sys.executable, "main.py", "--mode", "serve", *run_args, "--serve.port", str(port)],
                                  cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, **(env or {})))
        try:
            deadline = time.time() + 300
            while True:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).close()
                    break
                except (urllib.error.URLError, ConnectionError):
                    log.seek(0)
                    assert server.poll() is None and time.time() < deadline, log.read()[-3000:]
                    time.sleep(0.5)
            yield port
        finally:
            server.terminate()
            server.wait(timeout=60)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny run trained for 300 steps (at 20 steps, and at the preset's 100 since the
    embedding starts at N(0, 1/D), greedy continuations are one repeated character,
    which would prove little)."""
    out, cache = tmp_path_factory.mktemp("runs"), tmp_path_factory.mktemp("data_cache")
    args = ["--preset", "tiny", "--run.out_dir", str(out), "--data.cache_dir", str(cache), "--run.name", "r", *QUIET]
    result = subprocess.run([sys.executable, "main.py", *args, "--train.steps", "300", "--train.eval_every", "1000"], cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return args


@pytest.fixture(scope="module")
def server_process(run, tmp_path_factory):
    """`python main.py --mode serve` on the run, with a bearer token: (process, URL, log)."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("serve") / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "main.py", "--mode", "serve", *run, "--serve.slide", "true", "--serve.port", str(port),
                             "--serve.slots", str(SLOTS), "--serve.queue", str(QUEUE), "--serve.max_tokens", str(MAX_TOKENS)],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, MESHFORMER_API_KEY=KEY))
    try:
        yield proc, f"http://127.0.0.1:{port}", log
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


@pytest.fixture(scope="module")
def server(server_process):
    """The server's base URL, once /health answers."""
    proc, url, log = server_process
    deadline = time.time() + 300
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                assert json.load(r)["auth"] is True
            return url
        except (urllib.error.URLError, ConnectionError):
            log.seek(0)
            assert proc.poll() is None and time.time() < deadline, log.read()[-3000:]
            time.sleep(0.5)


@pytest.fixture(scope="module")
def loaded(run, server_process):
    """The run's model in this process, loaded as `--mode sample` loads it
    (modes.load_run_params, on one device), while the server starts."""
    from runtime.sampling import host_params
    from serving.modes import load_run_params
    from utils import parse_args

    cfg, graphdef, params = load_run_params(parse_args([*run, "--mode", "sample"]), jax.devices()[:1])
    return cfg, jax.device_put(host_params(params), jax.devices()[0])


def post(url, body, headers=AUTH, path="/v1/completions"):
    """(status, parsed JSON) of a POST; `body` as bytes is sent as it is."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=300) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def complete(url, **body):
    status, out = post(url, body)
    assert status == 200, out
    return out


def stream(url, body, first_chunk_only=False):
    """(status, the `data:` events as parsed JSON, in order) of a streaming request."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    conn.request("POST", "/v1/completions", json.dumps(dict(body, stream=True)), {"Content-Type": "application/json", **AUTH})
    response = conn.getresponse()
    if response.status != 200:
        out = response.status, json.loads(response.read())
        conn.close()
        return out
    events = []
    for line in response:
        if line.startswith(b"data: "):
            data = line[len(b"data: "):].strip()
            if data == b"[DONE]":
                break
            events.append(json.loads(data))
            if first_chunk_only:
                break
    conn.close()
    return response.status, events


def streamed_text(events, index=0):
    return "".join(c["text"] for e in events for c in e["choices"] if c["index"] == index)


# ---- Completions equal the sampler's; logprobs equal the model's forward


def sample_cli(loaded, prompt, max_tokens, temperature, top_k=40, seed=0):
    """What `python main.py --mode sample` prints with these --sample.* flags:
    sampling.generate, the function it prints (modes.sample_run -> samples_from_params)."""
    from dataset import get_tokenizer
    from runtime.sampling import generate

    cfg, params = loaded
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model, nnx.Rngs(0))))[0]
    return generate(nnx.merge(graphdef, params), get_tokenizer("bytes"), prompt, max_tokens, temperature, top_k, seed)


def test_greedy_and_seeded_completions_equal_mode_sample(loaded, server):
    """Greedy: `--mode sample --sample.temperature 0`, for prompts of 4 to 16 bytes and
    40 tokens (so past the 16-token window: restarts); a seeded sample (temperature 0.8,
    top_k 40, seed 3) equals `--mode sample --sample.seed 3` too."""
    texts = []
    for prompt in ["ROMEO:", "KING", "JULIET:\nO Romeo,"]:  # the last one fills the whole window
        served = complete(server, prompt=prompt, max_tokens=40, temperature=0)["choices"][0]
        assert prompt + served["text"] == sample_cli(loaded, prompt, 40, 0) and served["finish_reason"] == "length"
        texts.append(served["text"])
    assert max(len(set(t)) for t in texts) >= 4, texts  # a real continuation somewhere, not one repeated character
    sampled = complete(server, prompt="KING", max_tokens=40, temperature=0.8, top_k=40, seed=3)["choices"][0]["text"]
    assert "KING" + sampled == sample_cli(loaded, "KING", 40, 0.8, top_k=40, seed=3)
    assert sampled != complete(server, prompt="KING", max_tokens=40, temperature=0.8, top_k=40, seed=4)["choices"][0]["text"]


@pytest.mark.slow
def test_penalties_in_mode_sample_equal_the_server_s(run, server):
    """`--mode sample --sample.frequency_penalty F --sample.presence_penalty P` prints the
    completion the server gives with those penalties (greedy), which differs from the
    plain greedy one."""
    penalized = complete(server, prompt="KING", max_tokens=40, temperature=0, frequency_penalty=0.3, presence_penalty=1.5)
    plain = complete(server, prompt="KING", max_tokens=40, temperature=0)
    assert penalized["choices"][0]["text"] != plain["choices"][0]["text"]
    result = subprocess.run([sys.executable, "main.py", "--mode", "sample", *run, "--sample.prompt", "KING", "--sample.max_tokens", "40",
                             "--sample.temperature", "0", "--sample.frequency_penalty", "0.3", "--sample.presence_penalty", "1.5"],
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.endswith("KING" + penalized["choices"][0]["text"] + "\n"), result.stdout[-500:]


@pytest.fixture(scope="module")
def forward(loaded):
    """log_softmax of the run's plain full forward (Transformer.__call__, jitted), over
    the padded vocabulary, as the loss takes it. Dropless, as decoding is (MoE.decode:
    at inference every token gets its experts), not with the training capacity."""
    cfg, params = loaded
    dropless = dataclasses.replace(cfg.model, capacity_factor=0.0)
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(dropless, nnx.Rngs(0))))[0]
    log_softmax = jax.jit(lambda params, tokens_BT: jax.nn.log_softmax(nnx.merge(graphdef, params)(tokens_BT)[0][0]))
    return lambda ids: np.asarray(log_softmax(params, jax.numpy.asarray([ids])))


def check_logprobs(logprobs_TV, ids, lp, n_top):
    from dataset import get_tokenizer

    tokenizer = get_tokenizer("bytes")
    assert lp["tokens"] == [tokenizer.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    expected = [logprobs_TV[t - 1, ids[t]] for t in range(1, len(ids))]
    np.testing.assert_allclose(lp["token_logprobs"][1:], expected, atol=2e-5, rtol=0)
    outside = 0
    for t in range(1, len(ids)):
        top = [int(i) for i in np.argsort(-logprobs_TV[t - 1, :tokenizer.vocab_size])[:n_top]]
        top += [] if ids[t] in top else [ids[t]]  # the token itself when not among the top n (vLLM's)
        outside += len(top) > n_top
        got = lp["top_logprobs"][t]
        assert list(got) == [tokenizer.decode([i]) for i in top]
        np.testing.assert_allclose(list(got.values()), logprobs_TV[t - 1, top], atol=2e-5, rtol=0)
    return outside


def test_echo_logprobs_equal_the_forward_log_softmax(server, forward):
    """echo + logprobs: every prompt token's (and generated token's) log-probability
    and top-5 alternatives equal the full forward's log-softmax at that position;
    max_tokens 0 scores a list of prompts (the lm-eval loglikelihood request)."""
    from dataset import get_tokenizer

    tokenizer = get_tokenizer("bytes")
    out = complete(server, prompt="ROMEO:\nAy, me!", max_tokens=2, temperature=0, echo=True, logprobs=5)["choices"][0]
    generated = tokenizer.encode(out["text"])
    assert out["text"].startswith("ROMEO:\nAy, me!") and len(generated) == 16
    check_logprobs(forward(generated), generated, out["logprobs"], 5)

    prompts = ["KING", "First Citizen:"]
    scored = complete(server, prompt=prompts, max_tokens=0, echo=True, logprobs=1, temperature=0)
    assert scored["usage"] == dict(prompt_tokens=18, completion_tokens=0, total_tokens=18)
    for choice, prompt in zip(scored["choices"], prompts):
        ids = tokenizer.encode(prompt)
        assert choice["text"] == prompt and len(choice["logprobs"]["tokens"]) == len(ids)
        assert check_logprobs(forward(ids), ids, choice["logprobs"], 1) > 0  # a prompt token outside the top 1 is listed too


def test_16_concurrent_clients_each_get_their_own_completion(server):
    """16 clients at once on 4 slots (12 wait, join as others finish): each gets what it
    gets alone. Half greedy, half sampled with their own seeds."""
    bodies = [dict(prompt=p, max_tokens=24 + i, temperature=0 if i % 2 else 0.9, seed=i) for i, p in enumerate(PROMPTS)]
    alone = [complete(server, **body)["choices"][0]["text"] for body in bodies]
    assert len(set(alone)) == len(alone)
    together = [None] * len(bodies)
    start = threading.Barrier(len(bodies))

    def client(i):
        start.wait()
        together[i] = complete(server, **bodies[i])["choices"][0]["text"]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone


def test_streaming_sends_the_same_text_and_logprobs_as_one_response(server):
    """Server-sent events carry, joined, exactly the non-streaming response: text with
    a stop string cut out of the middle, logprobs, several prompts, echo."""
    plain = complete(server, prompt="KING", max_tokens=60, temperature=0.8, seed=5)["choices"][0]["text"]
    stop = plain[20:22]
    body = dict(prompt=["KING", "LEAR:"], max_tokens=60, temperature=0.8, seed=5, stop=[stop, "\x00never"], logprobs=2, echo=True)
    whole = complete(server, **body)
    assert whole["choices"][0]["text"] == "KING" + plain[:plain.find(stop)]
    assert whole["choices"][0]["finish_reason"] == "stop"
    status, events = stream(server, dict(body, stream_options={"include_usage": True}))
    assert status == 200 and events[-1]["usage"] == whole["usage"] and events[-1]["choices"] == []
    for choice in whole["choices"]:
        i = choice["index"]
        assert streamed_text(events, i) == choice["text"]
        chunks = [c for e in events for c in e["choices"] if c["index"] == i]
        assert [c["finish_reason"] for c in chunks if c["finish_reason"]] == [choice["finish_reason"]]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert sum((c["logprobs"][key] for c in chunks), []) == choice["logprobs"][key]
    status, events = stream(server, dict(prompt="KING", max_tokens=60, temperature=0.8, seed=5))
    assert all(e["choices"] and "usage" not in e for e in events)  # no usage chunk unless stream_options asks for it
    assert streamed_text(events) == plain and len([e for e in events if e["choices"] and e["choices"][0]["text"]]) > 10


# ---- Bad input


BAD = {
    "empty prompt": ({"prompt": ""}, 400, "empty"),
    "empty prompt list": ({"prompt": []}, 400, "empty"),
    "body not UTF-8": (b'{"prompt": "\xff\xfeROMEO"}', 400, "not UTF-8"),
    "prompt not UTF-8 (lone surrogate)": (b'{"prompt": "ROMEO\\ud800"}', 400, "not valid UTF-8"),
    "prompt longer than the context": ({"prompt": "x" * 17}, 400, "context is 16"),
    "token ids outside the vocabulary": ({"prompt": [1, 2, 999]}, 400, "outside the vocabulary"),
    "max_tokens over the limit": ({"prompt": "KING", "max_tokens": MAX_TOKENS + 1}, 400, "--serve.max_tokens"),
    "negative temperature": ({"prompt": "KING", "temperature": -1}, 400, "temperature"),
    "seed that would collide with another": ({"prompt": "KING", "seed": 2**40}, 400, "seed must be in"),
    "a field of the wrong type": ({"prompt": "KING", "max_tokens": "many"}, 400, "max_tokens"),
    "unknown field": ({"prompt": "KING", "best_of_beams": 4}, 400, "unknown field 'best_of_beams'"),
    "response_format of an unknown type": ({"prompt": "KING", "response_format": {"type": "yaml"}}, 400, "json_object or json_schema"),
    "malformed JSON": (b'{"prompt": "KING",', 400, "not valid JSON"),
    "JSON that is not an object": (b'["KING"]', 400, "JSON object"),
    "another model": ({"prompt": "KING", "model": "gpt-4"}, 404, "not served here"),
}


def test_each_bad_input_gets_its_4xx_and_the_next_request_works(server):
    good = dict(prompt="KING", max_tokens=5, temperature=0)
    expected = complete(server, **good)["choices"][0]["text"]
    for name, (body, status, words) in BAD.items():
        got, out = post(server, body)
        assert (got, words in out["error"]["message"]) == (status, True), (name, out)
        assert complete(server, **good)["choices"][0]["text"] == expected, name
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        got, out = post(server, good, headers=headers)
        assert got == 401 and "bearer token" in out["error"]["message"]
        assert complete(server, **good)["choices"][0]["text"] == expected


def test_chat_on_a_model_without_a_chat_template_is_a_400_that_says_so(server):
    status, out = post(server, dict(messages=[{"role": "user", "content": "Hi"}]), path="/v1/chat/completions")
    assert status == 400 and out["error"]["message"].startswith("'r' has no chat template, so it cannot chat")
    with urllib.request.urlopen(server + "/health") as r:
        assert json.load(r)["chat"] is False


def test_too_many_waiting_sequences_get_429(server):
    """slots + queue sequences fit, one more is refused whole; a flood of streaming
    clients that hang up after their first token gets some 429s, and every slot is
    free again afterwards (a client that goes away frees its slot)."""
    status, out = post(server, dict(prompt=["KING"] * (SLOTS + QUEUE + 1), max_tokens=1))
    assert status == 429 and "--serve.queue 16" in out["error"]["message"]
    status, out = post(server, dict(prompt=["KING"] * (SLOTS + QUEUE), max_tokens=1))
    assert status == 200 and len(out["choices"]) == SLOTS + QUEUE

    results = [None] * 40
    start = threading.Barrier(len(results))

    def client(i):
        start.wait()
        results[i] = stream(server, dict(prompt=PROMPTS[i % 16], max_tokens=MAX_TOKENS, temperature=1.0), first_chunk_only=True)[0]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count(429) >= 1 and results.count(200) >= SLOTS + QUEUE and set(results) == {200, 429}, results
    deadline = time.time() + 120
    while True:
        with urllib.request.urlopen(server + "/health") as r:
            health = json.load(r)
        if health["active"] == health["waiting"] == 0:
            break
        assert time.time() < deadline, health
        time.sleep(0.2)
    assert complete(server, prompt="KING", max_tokens=3)["usage"]["completion_tokens"] == 3


def health(server):
    with urllib.request.urlopen(server + "/health") as r:
        return json.load(r)


def wait_until_idle(server, seconds):
    """Seconds until no slot is busy and nothing waits (None if not within `seconds`)."""
    t0 = time.time()
    while time.time() - t0 < seconds:
        h = health(server)
        if h["active"] == h["waiting"] == 0:
            return time.time() - t0
        time.sleep(0.05)
    return None


def health_or_none(url):
    """/health's JSON (also its 503 while loading), or None while nothing listens."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        return json.load(e)
    except (urllib.error.URLError, ConnectionError):
        return None


def impatient_clients(url, n=8):
    """n non-streaming clients, two prompts each, that give up after 0.3 s."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(dict(prompt=["KING", "LEAR:"], max_tokens=MAX_TOKENS, temperature=1.0))

    def impatient(i):
        conn = http.client.HTTPConnection(host, int(port), timeout=0.3)
        try:
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json", **AUTH})
            conn.getresponse()
            raise AssertionError("answered within 0.3 s: the test would prove nothing")
        except TimeoutError:
            pass
        finally:
            conn.close()

    threads = [threading.Thread(target=impatient, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_clients_that_time_out_free_every_slot_within_a_second(server):
    """Eight non-streaming clients (two prompts each: every slot busy, the rest queued)
    give up after 0.3 s: a plain endpoint is not cancelled by Starlette, so without the
    server's disconnect watch their 16 sequences kept generating 256 tokens each (the
    slots stayed busy 1.6 s and more after the clients had gone, and this failed)."""
    assert wait_until_idle(server, 120) is not None
    impatient_clients(server)
    freed = wait_until_idle(server, 1.0)
    assert freed is not None, health(server)
    assert complete(server, prompt="KING", max_tokens=3)["usage"]["completion_tokens"] == 3


def test_a_fresh_server_is_ready_when_it_says_so(run, tmp_path):
    """A fresh server says `loading` on /health (503) until every program a request runs
    is compiled; then, at once, the clients of the test above leave every slot free
    within a second. (Before: the first request compiled its prefill inside the
    engine's loop, 6 s here, and 2 s after the clients had gone 1 slot was busy and 7
    sequences waited.)"""
    port = free_port()
    url, states = f"http://127.0.0.1:{port}", []
    with open(tmp_path / "serve.log", "w+") as log:
        proc = subprocess.Popen([sys.executable, "main.py", "--mode", "serve", *run, "--serve.slide", "true", "--serve.port", str(port),
                                 "--serve.slots", str(SLOTS), "--serve.queue", str(QUEUE), "--serve.max_tokens", str(MAX_TOKENS),
                                 "--run.compile_cache", str(tmp_path / "jax_cache")],  # cold: every program compiles here
                                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, MESHFORMER_API_KEY=KEY))
        try:
            deadline = time.time() + 300
            while not states or states[-1] != "ok":
                h = health_or_none(url)
                if h is not None:
                    states.append(h["status"])
                log.seek(0)
                assert proc.poll() is None and time.time() < deadline, log.read()[-3000:]
                time.sleep(0.05)
            impatient_clients(url)
            freed = wait_until_idle(url, 1.0)
            assert freed is not None, health(url)
            assert "loading" in states, states  # (so it listened, and said so, while it compiled)
            assert complete(url, prompt="KING", max_tokens=3)["usage"]["completion_tokens"] == 3
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def test_a_queued_sequence_whose_client_left_leaves_the_queue_at_once(loaded):
    """Cancelled while it waits (here: in an engine still loading, whose loop has not
    started), a sequence leaves the queue at once and says so, without waiting for the
    engine's next iteration; a running one is the engine's to free."""
    from serving.engine import Engine, Sequence

    cfg, params = loaded
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model, nnx.Rngs(0))))[0]
    engine = Engine(nnx.merge(graphdef, params), SLOTS, QUEUE)
    events = [[] for _ in range(3)]
    seqs = [Sequence([1, 2, 3], 5, 0.0, 0, 1.0, i, events[i].append) for i in range(3)]
    engine.submit(seqs)
    seqs[1].cancel()
    assert engine.busy() == (0, 2) and events == [[], [("done", "cancelled")], []]
    seqs[1].cancel()  # twice: still one "done"
    assert events[1] == [("done", "cancelled")]


def test_the_engine_ends_a_sequence_at_its_end_token_whoever_reads_it(loaded):
    """A sequence ends at the first of its end_ids it samples ("done", "stop"), freed by
    the engine in that step: its reader, which never cancels here, gets no token after it
    and the metrics count none. (The server's reader cancelled on the end token, and
    under load the engine had sampled and counted one more token for the sequence by then:
    generation_tokens_total 355 against the usages' 353.)"""
    from serving.engine import Engine, Sequence
    from serving.metrics import PREFIX, Metrics

    cfg, params = loaded
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model, nnx.Rngs(0))))[0]
    engine = Engine(nnx.merge(graphdef, params), SLOTS, QUEUE)
    engine.metrics = Metrics(engine)

    def run(end_ids):
        events, done = [], threading.Event()
        engine.submit([Sequence([1, 2, 3], 12, 0.0, 0, 1.0, 0, lambda e: (events.append(e), e[0] == "done" and done.set()),
                                end_ids=end_ids)])
        assert done.wait(120)
        return events

    engine.start()
    try:
        free = run(())  # greedy: the same tokens both times
        end = free[3][1]  # its fourth token ends the second
        sampled = lambda: engine.metrics.registry.get_sample_value(PREFIX + "generation_tokens_total")  # noqa: E731
        before = sampled()
        ended = run([end])
        counted = sampled() - before
    finally:
        engine.stop()
    first = next(i for i, e in enumerate(free) if e[1] == end)
    kinds_and_tokens = [e[:2] for e in ended]  # (kind, token id or reason)
    assert kinds_and_tokens == [e[:2] for e in free[:first + 1]] + [("done", "stop")] and counted == first + 1, (kinds_and_tokens, counted)


def test_a_chunked_body_over_the_limit_is_413_before_it_ends(server):
    """No Content-Length: the body is counted as it arrives. The client sends just over
    8 MiB and then waits, its body unfinished: the answer is a 413 now (the old server
    waited for the whole body, so this timed out)."""
    host, port = server.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    try:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
                     "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        piece = b'{"prompt": "' + b"x" * ((1 << 20) - 12)
        for _ in range(8):  # exactly 8 MiB: within the limit, all read by the server
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            piece = b"x" * (1 << 20)
        sock.sendall(b"400\r\n" + b"x" * 0x400 + b"\r\n")  # 1 KiB over; the body never ends
        answer = b""
        while b"\r\n\r\n" not in answer:
            data = sock.recv(65536)
            assert data, answer
            answer += data
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert complete(server, prompt="KING", max_tokens=3)["usage"]["completion_tokens"] == 3


def test_a_long_text_prompt_is_refused_before_it_is_tokenized():
    """A text of more than window x (the longest token's characters) is more tokens than
    the window: a 400 from its length alone, the tokenizer never asked for it."""
    from dataset import Tokenizer
    from serving import serve

    asked = []

    class Recording(Tokenizer):  # the real byte tokenizer, recording what it is asked to encode
        def encode(self, text):
            asked.append(len(text))
            return super().encode(text)

    tokenizer = Recording("bytes")
    with pytest.raises(serve.APIError, match="more than 16 tokens; this model's context is 16") as e:
        serve.tokenize_prompts(["KING", "x" * 5_000_000], tokenizer, 16)
    assert e.value.code == "context_length_exceeded" and asked == [4]
    assert serve.tokenize_prompts("x" * 16, tokenizer, 16)[0][1] == [ord("x")] * 16


def test_usage_counts_the_end_of_text_token_that_max_tokens_counts():
    """The engine counts every sampled token against max_tokens, end-of-text included;
    usage.completion_tokens counts the same tokens."""
    from dataset import get_tokenizer
    from serving import serve

    tokenizer = get_tokenizer("bytes")
    choice = serve.Choice(0, "KING", tokenizer.encode("KING"), tokenizer, [], None, False)
    for token in tokenizer.encode("ab"):
        choice.handle(("token", token, -0.5, None, None))
    last = choice.handle(("token", tokenizer.eot_id, -0.1, None, None))
    assert last["finish_reason"] == "stop" and choice.completion_tokens == 3


def test_models_and_health(server):
    with urllib.request.urlopen(urllib.request.Request(server + "/v1/models", headers=AUTH)) as r:
        assert [m["id"] for m in json.load(r)["data"]] == ["r"]
    with urllib.request.urlopen(server + "/health") as r:
        assert json.load(r)["slots"] == SLOTS


def test_a_port_in_use_is_a_one_line_error_before_loading(server, run):
    port = server.rsplit(":", 1)[1]
    result = subprocess.run([sys.executable, "main.py", "--mode", "serve", *run, "--serve.port", port], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and result.stderr.strip().splitlines()[-1] == (
        f"error: cannot listen on 127.0.0.1:{port} (Address already in use): choose another --serve.port or --serve.host")


# ---- A person at the page, in a real browser


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("chromium") and shutil.which("chromedriver")), reason="needs Debian's chromium and chromium-driver")
def test_the_page_streams_a_completion_in_a_real_browser(server, tmp_path):
    """Headless chromium opens GET /, gives the key, types a prompt, sets temperature 0,
    clicks Generate, sees the text grow while it streams, and ends with the greedy
    completion. MESHFORMER_SCREENSHOT=path keeps a screenshot (public/serve.png)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--window-size=1000,720", f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    try:
        driver.get(server + "/")
        find = lambda id: driver.find_element(By.ID, id)  # noqa: E731
        deadline = time.time() + 30
        while not find("key").is_displayed():  # /health says a key is needed
            assert time.time() < deadline
            time.sleep(0.1)
        find("key").send_keys(KEY)
        for id, value in (("prompt", "KING"), ("temperature", "0"), ("max_tokens", str(MAX_TOKENS))):
            find(id).clear()
            find(id).send_keys(value)
        find("go").click()
        lengths, deadline = set(), time.time() + 120
        while "tokens in" not in find("status").text:
            assert time.time() < deadline and "error" not in find("status").get_attribute("class"), find("status").text
            lengths.add(len(driver.execute_script("return document.getElementById('completion').textContent")))
        text = driver.execute_script("return document.getElementById('completion').textContent")
        assert text == complete(server, prompt="KING", max_tokens=MAX_TOKENS, temperature=0)["choices"][0]["text"]
        assert len(lengths - {0, len(text)}) >= 2, lengths  # seen part-way, more than once: it streamed
        assert f"{MAX_TOKENS} tokens in" in find("status").text
        driver.save_screenshot(str(tmp_path / "serve.png"))
        if os.environ.get("MESHFORMER_SCREENSHOT"):
            shutil.copy(tmp_path / "serve.png", os.environ["MESHFORMER_SCREENSHOT"])
    finally:
        driver.quit()


@pytest.mark.slow
def test_tensor_parallel_engine_decodes_what_the_one_device_server_does(loaded, server):
    """The engine with weights split over tp = 2 (heads, hidden units, vocabulary) gives
    the one-device server's tokens and log-probabilities, and its compiled decode step
    all-reduces partial results instead of gathering weights."""
    import re

    from dataset import get_tokenizer
    from runtime.sampling import decode_slots
    from serving.engine import Engine, Sequence

    cfg, params = loaded
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model, nnx.Rngs(0))))[0]
    engine = Engine(nnx.merge(graphdef, params), SLOTS, QUEUE, tp_devices=jax.devices()[:2])
    decoder = engine.decoder
    hlo = decode_slots.lower(decoder.graphdef, decoder.state, decoder.cache, *[jax.numpy.zeros(SLOTS, jax.numpy.int32)] * 2).compile().as_text()
    collectives = set(re.findall(r" (all-reduce|all-gather|all-to-all|collective-permute)\(", hlo))
    assert collectives == {"all-reduce"}, collectives
    engine.start()
    tokenizer, bodies = get_tokenizer("bytes"), [dict(prompt=p, max_tokens=30, temperature=t, seed=i, logprobs=0)
                                                 for i, (p, t) in enumerate([("KING", 0), ("ROMEO:", 0.8), ("JULIET:\nO Romeo,", 0)])]
    events = [[] for _ in bodies]
    done = threading.Semaphore(0)
    try:
        engine.submit([Sequence(tokenizer.encode(b["prompt"]), b["max_tokens"], b["temperature"], 0, 1.0, b["seed"],
                                lambda e, i=i: (events[i].append(e), e[0] == "done" and done.release())) for i, b in enumerate(bodies)])
        for _ in bodies:
            done.acquire()
    finally:
        engine.stop()
    for body, got in zip(bodies, events):
        served = complete(server, **body)["choices"][0]
        tokens = [e for e in got if e[0] == "token"]
        assert tokenizer.decode([e[1] for e in tokens]) == served["text"]
        np.testing.assert_allclose([e[2] for e in tokens], served["logprobs"]["token_logprobs"], atol=2e-5, rtol=0)
