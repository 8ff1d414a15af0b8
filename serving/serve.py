"""Serve a trained run over HTTP: an OpenAI-compatible API (completions, and chat
completions for a model with a chat template) and a web page.

    python main.py --mode serve --run.name shakespeare            # http://127.0.0.1:8000/
    curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "ROMEO:", "max_tokens": 64, "temperature": 0}'

Endpoints: POST /v1/completions (prompt as a string, a list of strings, or token ids;
max_tokens, temperature, top_k, top_p, seed, stop, frequency_penalty, presence_penalty,
logit_bias, stream as server-sent events with the usage last only when
stream_options.include_usage asks, logprobs and echo, so that evaluation harnesses
that speak this API can score log-likelihoods), POST /v1/chat/completions (messages
rendered by the model's chat template, chat.py; the same sampling fields; the reply
ends at the template's end of turn; logprobs, tools and tool_choice: tools.py), n and best_of,
vLLM's ignore_eos, stop_token_ids, include_stop_str_in_output, min_p, repetition_penalty and
min_tokens, response_format (json_object, json_schema: structured.py), GET /metrics
(Prometheus: metrics.py), GET /v1/models and /v1/models/{id}, vLLM's POST /tokenize,
POST /detokenize and GET /version, GET /health, and GET /
(serve.html: type a prompt or chat, watch the text stream in). engine.py does the
batched decoding; openai_api.py checks the request bodies and tokenizes their prompts; this
file routes them and turns tokens back into text, stop strings and JSON.

Why FastAPI on uvicorn: streaming clients hold their connection open for the whole
generation, and an asyncio server serves hundreds of them from one thread while the
engine's thread keeps the device busy (a thread-per-connection server such as
http.server would need a thread each, and Flask has no native async streaming).
pydantic, which FastAPI is built on, gives the request schema, and with extra="forbid"
rejects unknown fields. It is also what the usual OpenAI-compatible servers (vLLM,
SGLang) use, so its behaviour under clients such as `openai` and lm-eval is well trodden.

Bad input gets an OpenAI-style JSON error ({"error": {"message", "type", "param",
"code"}}) with a 4xx status, and the server keeps serving: 400 for a body that is not
UTF-8 JSON, unknown fields, values out of range, fields it cannot honour (suffix:
check_settings says why), an empty or too long prompt, prompt + max_tokens over the
context (unless --serve.slide), a chat message of an unknown role or without content,
chat for a model without a template; 413 for a body over 8 MiB (counted as it arrives when chunked); 401 without
the bearer token (when MESHFORMER_API_KEY is set); 404 for another model's
name; 429 when more sequences wait than --serve.queue. A client that goes away (a
timeout, a closed tab) cancels its sequences: queued ones leave the queue at once, running
ones free their slots at the engine's next step.

The server listens as soon as the weights are loaded and compiles its programs in the
background (or loads them from the compilation cache): GET /health answers 503 with
"status": "loading" until every program a request runs is compiled, then 200 with "ok".
"""

import asyncio
import contextlib
import functools
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
import traceback

import jax
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from flax import nnx
from starlette.exceptions import HTTPException

from dataset import get_tokenizer
from hf import config as hf_config
from runtime.devices import stop_now
from runtime.sampling import bias_row, host_params
from serving.chat import ReplyTokenizer, TemplateRefused, load_chat_template
from serving.engine import Engine, QueueFull, Sequence
from serving.metrics import Metrics
from serving.modes import load_run_params
from serving.openai_api import (APIError, ChatRequest, DetokenizeRequest, TokenizeRequest, check_settings, max_token_chars, parse_request,
                              tokenize_prompts)
from serving.structured import Grammars, Guide, SchemaRefused
from serving.tools import call_opening, check_tools, forced_calls, forced_node, parse_calls
from utils import ConfigError

API_KEY_ENV = "MESHFORMER_API_KEY"
ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # OpenAI's; another is a 400
MAX_BODY_BYTES = 8 << 20  # far more than --serve.queue prompts of a long context need
PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "serve.html")


# ---- Tokens -> text, chunk by chunk (streaming and non-streaming share this)


class Choice:
    """One prompt's completion as chunks {"index", "text", "logprobs", "finish_reason"}.

    Text is released only when it is final: never the start of a stop string (it may
    turn out to be one), never a trailing U+FFFD (a multi-byte character may be only
    partly generated). The non-streaming response is these same chunks joined, so a
    stream and a plain response always carry the same text. A token of `stop_ids`
    (default: end-of-text; a chat adds its template's end of turn) ends it unshown.
    """

    def __init__(self, index, prompt_text, prompt_ids, tokenizer, stops, logprobs, echo, stop_ids=None, keep_stop=False, min_tokens=0,
                 chat=False):
        self.index, self.prompt_text, self.prompt_ids = index, prompt_text, prompt_ids
        self.tokenizer, self.stops, self.logprobs, self.echo, self.keep_stop = tokenizer, stops, logprobs, echo, keep_stop
        self.min_tokens, self.chat, self.quiet = min_tokens, chat, None
        self.stop_ids = {tokenizer.eot_id} if stop_ids is None else set(stop_ids)
        self.ids, self.sent, self.offset = [], "", 0
        self.pending = self.empty_logprobs()
        self.finished, self.completion_tokens, self.cumulative_logprob = False, 0, 0.0
        self.seq = None

    def empty_logprobs(self):
        return dict(content=[]) if self.chat else dict(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])

    def add_logprob(self, token, logprob, top_ids, top_logprobs):
        """A token's log-probability and its `logprobs` likeliest alternatives, as a completion reports them (the token
        itself added when not among them, as vLLM) or as a chat does (OpenAI's content list, with each text's bytes)."""
        piece = self.tokenizer.decode([token])
        top = None if top_ids is None else [(self.tokenizer.decode([int(t)]), float(lp))
                                            for t, lp in zip(top_ids[:self.logprobs], top_logprobs[:self.logprobs])]
        if self.chat:
            def entry(text, lp):
                return dict(token=text, logprob=lp, bytes=list(text.encode("utf-8")))
            self.pending["content"].append(dict(entry(piece, logprob), top_logprobs=[entry(*alternative) for alternative in top]))
            return
        alternatives = None
        if top is not None:  # a text two ids decode to (a partial character's U+FFFD): the likelier's
            alternatives = {}
            for text, lp in top + [(piece, logprob)]:
                alternatives.setdefault(text, lp)
        for key, value in zip(self.pending, (piece, logprob, alternatives, self.offset)):
            self.pending[key].append(value)
        self.offset += len(piece)

    def chunk(self, text, finish_reason=None):
        logprobs = None
        if self.logprobs is not None:
            logprobs, self.pending = self.pending, self.empty_logprobs()
        return dict(index=self.index, text=text, logprobs=logprobs, finish_reason=finish_reason)

    def echo_chunk(self, prompt_logprobs=None):
        """The prompt itself (echo); with logprobs, each prompt token's log-probability
        given the ones before it (None for the first, as OpenAI's API)."""
        if prompt_logprobs is not None:
            next_logprob_T, top_id_TN, top_logprob_TN = prompt_logprobs
            for t, token in enumerate(self.prompt_ids):
                if t == 0:
                    self.add_logprob(token, None, None, None)
                    self.pending["top_logprobs"][-1] = None
                else:
                    self.add_logprob(token, float(next_logprob_T[t - 1]), top_id_TN[t - 1], top_logprob_TN[t - 1])
        self.offset = len(self.prompt_text)
        return self.chunk(self.prompt_text)

    def release(self, final):
        """The text now safe to send (all of it when `final`), and whether a stop string ended it."""
        text = self.tokenizer.decode(self.ids)
        quiet = self.quiet_chars(text)
        hits = [(i, i + len(s)) for s in self.stops if (i := text.find(s, max(0, quiet - len(s) + 1))) >= 0]
        if hits:
            start, end = min(hits)
            text, final = text[:end if self.keep_stop else start], True
        elif not final:
            text = text.rstrip("\ufffd")
            held = max((n for s in self.stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
            text = text[:len(text) - held]
        new = text[len(self.sent):] if len(text) > len(self.sent) else ""
        self.sent += new
        return new, bool(hits)

    def quiet_chars(self, text):
        """How many leading characters of `text` (the reply so far) no stop string may end in: a stop must end in the
        text of the min_tokens-th token or later (vLLM checks none before min_tokens, then each new token's text and
        the length - 1 before it). All of them until that token comes; then the text before it, worked out once."""
        if self.min_tokens <= 1:
            return 0
        if len(self.ids) < self.min_tokens:
            return len(text)
        if self.quiet is None:
            self.quiet = len(self.tokenizer.decode(self.ids[:self.min_tokens - 1]))
        return self.quiet

    def handle(self, event):
        """An engine event -> a chunk to send, or None."""
        if self.finished:
            return None
        kind = event[0]
        if kind == "prompt":
            return self.echo_chunk(event[1:])
        if kind == "token":
            token, logprob, top_ids, top_logprobs = event[1:]
            self.completion_tokens += 1  # what max_tokens counts, the end-of-text token too
            self.cumulative_logprob += logprob  # what best_of ranks by
            if token in self.stop_ids:  # end of text (or of turn): the model says it is done
                return self.finish("stop")
            self.ids.append(token)
            if self.logprobs is not None:
                self.add_logprob(token, logprob, top_ids, top_logprobs)
            text, stopped = self.release(final=False)
            if stopped:
                return self.finish("stop", text)
            return self.chunk(text) if text else None
        reason = event[1]
        if reason.startswith("error") or reason == "cancelled":
            self.finished = True
            raise APIError(500, f"generation failed: {reason}")
        return self.finish(reason)

    def finish(self, reason, text=None):
        self.finished = True
        if self.seq is not None:
            self.seq.cancel()  # a stop string or end of text: free the slot now
        if text is None:
            text = self.release(final=True)[0]
        return self.chunk(text, reason)


# ---- The app


async def read_body(request):
    """The whole body, or a 413 as soon as it is over MAX_BODY_BYTES: a Content-Length
    that says so is refused unread, and a chunked body (no Content-Length) is counted
    as it arrives, never buffered past the limit."""
    try:
        declared = int(request.headers.get("content-length") or 0)
    except ValueError:
        raise APIError(400, "the Content-Length header is not a number") from None
    too_big = APIError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB")
    if declared > MAX_BODY_BYTES:
        raise too_big
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > MAX_BODY_BYTES:
            raise too_big
        parts.append(part)
    return b"".join(parts)


async def disconnected(request):
    """Returns when the client has gone away. The body has been read, so the next ASGI
    message is the disconnect (uvicorn sends it when the connection closes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class AccessLog:
    """ASGI middleware: a line per request on stdout once its response has ended (a stream's
    too, or its client has gone): client, method, path, status, seconds. uvicorn's own
    access log is off (--log_level warning) as it logs a stream when it starts."""

    def __init__(self, app, metrics=None):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.perf_counter(), [0]

        async def send_seen(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_seen)
        finally:
            if self.metrics is not None:  # by route, not by the path asked: a client cannot add labels without end
                route = getattr(scope.get("route"), "path", "unrouted")
                self.metrics.requests.labels(route, str(status[0] or "-")).inc()
            host, port = scope.get("client") or ("-", 0)
            print(f'{host}:{port} "{scope["method"]} {scope["path"]} HTTP/{scope.get("http_version", "1.1")}" {status[0] or "-"} '
                  f"{time.perf_counter() - t0:.3f}s", flush=True)


def make_app(engine, tokenizer, model_name, max_tokens_limit, api_key=None, chat=None, slide=False):
    """The FastAPI app: the page, /health, /v1/models, and the two generation endpoints
    (`chat`: the model's ChatTemplate, or None: chat completions are then a 400)."""
    app = FastAPI(title="meshformer", docs_url=None, redoc_url=None, openapi_url=None)
    engine.metrics = metrics = Metrics(engine)
    app.add_middleware(AccessLog, metrics=metrics)
    created = int(time.time())
    with open(PAGE) as f:
        page = f.read()

    @app.exception_handler(APIError)
    async def api_error(request, e):
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(request, e):  # unknown paths, wrong methods: the same JSON shape
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    def authorized(request: Request):
        if api_key is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not secrets.compare_digest(given, f"Bearer {api_key}".encode()):
            raise APIError(401, f"missing or wrong bearer token: send 'Authorization: Bearer <{API_KEY_ENV}>'")

    @app.get("/", response_class=HTMLResponse)
    async def index():
        return page

    @app.get("/metrics")
    async def prometheus_metrics():
        """The figures of metrics.Metrics, in Prometheus' text format."""
        return Response(metrics.text(), media_type=metrics.content_type)

    @app.get("/health")
    async def health():
        """status "ok" (200) once every program is compiled, "loading" (503) before:
        a load balancer or a harness waits for the 200. Requests sent while loading wait
        in the queue. `chat`: whether the model has a chat template."""
        active, waiting = engine.busy()
        ready = engine.ready.is_set()
        return JSONResponse(dict(status="ok" if ready else "loading", model=model_name, slots=engine.n_slots, active=active,
                                 waiting=waiting, context=engine.window, max_tokens=max_tokens_limit, auth=api_key is not None,
                                 chat=chat is not None), status_code=200 if ready else 503)

    model_card = dict(id=model_name, object="model", created=created, owned_by="meshformer", max_model_len=engine.window)

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        return dict(object="list", data=[model_card])

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(authorized)])
    async def model(model_id: str):  # the SDK's models.retrieve
        if model_id != model_name:
            raise APIError(404, f"model {model_id!r} is not served here; this server serves {model_name!r}", param="model")
        return model_card

    server = Server(engine, tokenizer, model_name, max_tokens_limit, chat, slide)
    add_generation_routes(app, server, authorized)
    add_token_routes(app, server, authorized)
    return app


def add_token_routes(app, server, authorized):
    """vLLM's POST /tokenize and POST /detokenize, and GET /version."""
    s, version = server, project_version()

    @app.post("/tokenize", dependencies=[Depends(authorized)])
    async def tokenize(request: Request):
        req = parse_request(await read_body(request), TokenizeRequest)
        s.check_model(req)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give either prompt (a text) or messages (a chat)", param="prompt")
        if req.messages is not None:
            if s.chat is None:
                raise APIError(400, f"{s.model_name!r} has no chat template: tokenize a prompt", param="messages")
            ids = chat_prompt(req.messages, s.chat, s.tokenizer, s.engine.window, s.token_chars)[1]
        else:
            ids = s.tokenizer.encode(req.prompt) if req.prompt else []
        return dict(count=len(ids), max_model_len=s.engine.window, tokens=ids)

    @app.post("/detokenize", dependencies=[Depends(authorized)])
    async def detokenize(request: Request):
        req = parse_request(await read_body(request), DetokenizeRequest)
        s.check_model(req)
        specials = {i: text for text, i in s.chat.specials.items()} if s.chat else {}
        if any(not 0 <= t < s.tokenizer.vocab_size and t not in specials for t in req.tokens):
            raise APIError(400, f"tokens holds ids that are no token (the tokenizer's are 0..{s.tokenizer.vocab_size - 1})",
                           param="tokens")
        return dict(prompt=s.chat.decode(req.tokens, s.tokenizer) if s.chat else s.tokenizer.decode(req.tokens))

    @app.get("/version")
    async def get_version():
        return dict(version=version)


def project_version():
    """This checkout's commit (the project has no release numbers), or "unknown" outside git."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=os.path.dirname(PAGE), capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class Server:
    """What the generation endpoints share: the engine, the tokenizer, the model's name,
    the max_tokens limit, its chat template (or None) and --serve.slide."""

    def __init__(self, engine, tokenizer, model_name, max_tokens_limit, chat, slide=False):
        self.engine, self.tokenizer, self.model_name, self.max_tokens_limit = engine, tokenizer, model_name, max_tokens_limit
        self.slide = slide
        self.chat, self.token_chars = chat, max_token_chars(tokenizer)
        self.reply_tokenizer = ReplyTokenizer(tokenizer, chat) if chat is not None else None
        self.grammars = Grammars(tokenizer, chat.specials.values() if chat is not None else [tokenizer.eot_id])

    def grammar(self, req, max_tokens, forced=None):
        """The request's response_format (or a forced tool call's guide: `forced` (tools, names)) as a structured.Grammar
        (None: plain text), or a 400."""
        source = "tools" if forced else "response_format"
        if forced is None and req.response_format is None:
            return None
        try:
            grammar = self.grammars.for_node(forced_node(*forced)) if forced else self.grammars.for_format(req.response_format)
        except SchemaRefused as e:
            raise APIError(400, f"{source}: {e}", param=source) from None
        for field in ("ignore_eos", "min_tokens"):
            if grammar is not None and getattr(req, field):
                raise APIError(400, f"{field} cannot go with {source}: a guided reply ends when its JSON does", param=field)
        if grammar is not None and max_tokens < grammar.shortest:
            raise APIError(400, f"max_tokens {max_tokens} is too few for {source}: its shortest JSON is {grammar.shortest} "
                           "tokens", param="max_tokens")
        return grammar

    def check_model(self, req):
        if req.model is not None and req.model != self.model_name:
            raise APIError(404, f"model {req.model!r} is not served here; this server serves {self.model_name!r}", param="model")

    def head(self, kind):
        prefix = "chatcmpl" if kind.startswith("chat") else "cmpl"
        return dict(id=f"{prefix}-{secrets.token_hex(12)}", object=kind, created=int(time.time()), model=self.model_name)


def add_generation_routes(app, server, authorized):
    """POST /v1/completions and POST /v1/chat/completions."""
    s = server

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(request: Request):
        req = parse_request(await read_body(request))
        s.check_model(req)
        stops, bias = check_settings(req, req.max_tokens, s.max_tokens_limit, s.engine.vocab)
        prompts = tokenize_prompts(req.prompt, s.tokenizer, s.engine.window, s.token_chars)
        check_context([ids for _, ids in prompts], req.max_tokens, s.engine.window, s.slide, "prompt")
        k = req.best_of or req.n  # candidates per prompt
        stop_ids = ends(req, [s.tokenizer.eot_id])
        grammar = s.grammar(req, req.max_tokens)
        choices = [Choice(p * k + j, text, ids, s.tokenizer, stops, req.logprobs, req.echo, stop_ids, req.include_stop_str_in_output,
                          req.min_tokens)
                   for p, (text, ids) in enumerate(prompts) for j in range(k)]
        events = submit(s.engine, req, req.max_tokens, choices, bias, want_prompt_logprobs=req.echo and req.logprobs is not None,
                        grammar=grammar)
        leading = [choice.echo_chunk() for choice in choices] if req.echo and req.logprobs is None else []
        head = s.head("text_completion")
        if req.stream:
            return streaming(stream_events(head, req, choices, events, lambda chunk: chunk, leading))
        return await unless_client_gone(request, completion_response(head, req, choices, events, leading))

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(request: Request):
        req = parse_request(await read_body(request), ChatRequest)
        s.check_model(req)
        if s.chat is None:
            raise APIError(400, f"{s.model_name!r} has no chat template, so it cannot chat: use /v1/completions, or start the "
                           "server with --serve.chat_template (a Jinja file, or a Hugging Face directory)", param="messages")
        tools, forced, calls = check_tools(req.tools, req.tool_choice, s.chat)
        if forced and req.response_format is not None:
            raise APIError(400, "response_format cannot go with a forced tool call: its arguments follow the tool's schema",
                           param="response_format")
        opening = call_opening(forced) if forced else ""
        text, ids = chat_prompt(req.messages, s.chat, s.tokenizer, s.engine.window, s.token_chars, tools, opening)
        room = s.max_tokens_limit if s.slide else min(s.max_tokens_limit, s.engine.window - len(ids))  # vLLM's default: the rest
        max_tokens = next((m for m in (req.max_completion_tokens, req.max_tokens) if m is not None), room)
        stops, bias = check_settings(req, max_tokens, s.max_tokens_limit, s.engine.vocab)
        check_context([ids], max_tokens, s.engine.window, s.slide, "messages")
        grammar = s.grammar(req, max_tokens, (tools, forced) if forced else None)
        alternatives = (req.top_logprobs or 0) if req.logprobs else None
        choices = [Choice(j, text, ids, s.reply_tokenizer, stops, alternatives, False, ends(req, s.chat.end_ids),
                          req.include_stop_str_in_output, req.min_tokens, chat=True)
                   for j in range(req.best_of or req.n)]
        events = submit(s.engine, req, max_tokens, choices, bias, grammar=grammar)
        as_message = functools.partial(chat_message, calls=calls, forced=forced, chat=s.chat, tokenizer=s.tokenizer)
        if req.stream and calls:  # the calls are known at the end: the reply comes whole, in one chunk
            return streaming(stream_whole(s.head("chat.completion.chunk"), req, chat_response(s.head("chat.completion"), req,
                                                                                            choices, events, as_message)))
        if req.stream:
            roles = [dict(index=c.index, delta=dict(role="assistant", content=""), logprobs=None, finish_reason=None) for c in choices]
            return streaming(stream_events(s.head("chat.completion.chunk"), req, choices, events, chat_chunk, roles))
        return await unless_client_gone(request, chat_response(s.head("chat.completion"), req, choices, events, as_message))


def chat_prompt(messages, chat, tokenizer, window, token_chars, tools=None, opening=""):
    """(text, ids) of a chat rendered by its template (with `tools`, and `opening` after the
    generation prompt: a forced tool call's), or a 400: no messages, content other than text,
    what the template refuses, a prompt over the window (counted from its length before it is
    tokenized, as tokenize_prompts does)."""
    plain = []
    for i, message in enumerate(messages):
        check_message(i, message)
        message = message.model_dump(exclude_none=True)
        if isinstance(message.get("content"), list):  # text parts, joined as vLLM joins them for a text template
            if any(part.get("type") != "text" or not isinstance(part.get("text"), str) for part in message["content"]):
                raise APIError(400, f"messages[{i}].content: only text parts are supported (this model reads text)", param="messages")
            message["content"] = "\n".join(part["text"] for part in message["content"])
        plain.append(message)
    if not plain:
        raise APIError(400, "messages is empty: give at least one message", param="messages")
    try:
        text = chat.render(plain, tools=tools) + opening
    except TemplateRefused as e:
        raise APIError(400, f"the model's chat template refused these messages: {e}", param="messages") from None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "messages hold text that is not valid UTF-8 (a lone surrogate)", param="messages") from None
    pieces = chat.pieces(text)
    at_least = sum(1 if special is not None else -(-len(piece) // token_chars) for piece, special in pieces)
    ids = chat.encode(pieces, tokenizer) if at_least <= window else []
    if at_least > window or len(ids) > window:
        raise APIError(400, f"the chat's prompt is {max(at_least, len(ids))}{'+' if not ids else ''} tokens; this model's "
                       f"context is {window} (its seq_len)", param="messages", code="context_length_exceeded")
    return text, ids


def check_message(i, message):
    """OpenAI's refusals: a role it does not know; a message without content (missing, or
    null) unless it is the assistant's tool or function call."""
    if message.role not in ROLES:
        raise APIError(400, f"messages[{i}].role: {message.role!r} is not a role; the roles are {', '.join(ROLES)}",
                       param=f"messages.[{i}].role")
    calls = message.model_extra or {}
    if message.content is None and not (message.role == "assistant" and (calls.get("tool_calls") or calls.get("function_call"))):
        said = "is null" if "content" in message.model_fields_set else "is missing"
        raise APIError(400, f"messages[{i}].content {said}: a {message.role} message needs content (text, or text parts)",
                       param=f"messages.[{i}].content")


def check_context(prompts_ids, max_tokens, window, slide, param):
    """Each prompt and its max_tokens within the context, else a 400 context_length_exceeded
    (vLLM's and OpenAI's rule); with --serve.slide the window slides instead."""
    for ids in prompts_ids:
        if not slide and len(ids) + max_tokens > window:
            raise APIError(400, f"this model's maximum context length is {window} tokens, but {len(ids) + max_tokens} were asked "
                           f"({len(ids)} in the {param}, {max_tokens} in max_tokens): ask for fewer (or start the server with "
                           "--serve.slide)", param="max_tokens", code="context_length_exceeded")


# ---- A request: its sequences in the engine, its chunks out


def ends(req, default_ids):
    """The token ids that end a choice unshown: the default ends (end-of-text, a chat's end of
    turn) unless ignore_eos, and stop_token_ids."""
    return (set() if req.ignore_eos else set(default_ids)) | set(req.stop_token_ids or [])


def sample_seed(seed, i):
    """The seed of a request's sample i (of n or best_of, for every prompt alike): seed + i,
    wrapped into jax.random.key's 0..2^32-1; sample i of a seeded request with n > 1 is the
    one request with n = 1 and this seed returns."""
    return (seed + i) % 2**32


def submit(engine, req, max_tokens, choices, logit_bias, want_prompt_logprobs=False, grammar=None):
    """An engine Sequence per Choice (each with its own structured.Guide when `grammar`),
    queued together; returns the asyncio queue their engine events arrive on as (choice
    index, event). Choice i is sample i % k of its prompt (k = best_of or n)."""
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    k = req.best_of or req.n
    for choice in choices:
        emit = (lambda i: lambda event: loop.call_soon_threadsafe(events.put_nowait, (i, event)))(choice.index)
        seed = secrets.randbits(31) if req.seed is None else sample_seed(req.seed, choice.index % k)
        guide = None if grammar is None else Guide(grammar, engine.vocab, choice.stop_ids, bias_row(logit_bias, engine.vocab))
        choice.seq = Sequence(choice.prompt_ids, max_tokens, req.temperature, max(req.top_k, 0), req.top_p, seed, emit,
                              want_prompt_logprobs=want_prompt_logprobs, guide=guide, min_tokens=req.min_tokens,
                              end_ids=choice.stop_ids, frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty,
                              logit_bias=logit_bias, min_p=req.min_p, repetition_penalty=req.repetition_penalty)
    try:
        engine.submit([c.seq for c in choices])
    except QueueFull as e:
        raise APIError(429, f"the server is busy: {e}; retry shortly") from None
    return events


async def chunks(choices, events):
    """Every choice's chunks as the engine's events come in."""
    try:
        while not all(c.finished for c in choices):
            i, event = await events.get()
            chunk = choices[i].handle(event)
            if chunk is not None:
                yield chunk
    finally:  # done, or the client went away: free the slots
        for choice in choices:
            choice.seq.cancel()


def usage(choices):
    prompt_tokens = sum(len(c.prompt_ids) for c in choices)
    completion_tokens = sum(c.completion_tokens for c in choices)
    return dict(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens)


def chat_chunk(chunk):
    """A completion chunk as a chat.completion.chunk's choice: its text as a delta."""
    delta = dict(content=chunk["text"]) if chunk["text"] else {}
    return dict(index=chunk["index"], delta=delta, logprobs=chunk["logprobs"], finish_reason=chunk["finish_reason"])


def streaming(events):
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def stream_events(head, req, choices, events, shape, leading=()):
    """stream: one server-sent event per chunk (`leading` ones first, then each of
    chunks() through `shape`), then, as OpenAI's API, the usage with no choices only
    when stream_options.include_usage (every other chunk then says "usage": null),
    then [DONE]."""
    with_usage = req.stream_options is not None and req.stream_options.include_usage
    extra = dict(usage=None) if with_usage else {}
    try:
        for chunk in leading:
            yield f"data: {json.dumps(dict(head, choices=[chunk], **extra))}\n\n"
        async for chunk in chunks(choices, events):
            yield f"data: {json.dumps(dict(head, choices=[shape(chunk)], **extra))}\n\n"
    except APIError as e:
        yield f"data: {json.dumps(e.body())}\n\n"
        return
    if with_usage:
        yield f"data: {json.dumps(dict(head, choices=[], usage=usage(choices)))}\n\n"
    yield "data: [DONE]\n\n"


async def unless_client_gone(request, answer):
    """`answer` (a coroutine), or a 499 if the client goes away first. Starlette cancels a
    streaming response when its client goes away, but not a plain endpoint: without this
    watch, a client that timed out would keep its slots generating until max_tokens.
    Cancelling `answer` runs chunks()' finally, which cancels the sequences; the engine
    frees them at its next step."""
    answer, gone = asyncio.ensure_future(answer), asyncio.ensure_future(disconnected(request))
    await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
    if not answer.done():
        answer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await answer
        return JSONResponse(APIError(499, "the client went away").body(), status_code=499)
    gone.cancel()
    return answer.result()


async def joined_choices(choices, events, leading, logprobs):
    """Not streaming: each choice's chunks (`leading` ones first) joined into one."""
    joined = [dict(index=c.index, text="", logprobs=None if logprobs is None else c.empty_logprobs(),
                   finish_reason=None) for c in choices]

    def add(chunk):
        out = joined[chunk["index"]]
        out["text"] += chunk["text"]
        out["finish_reason"] = chunk["finish_reason"] or out["finish_reason"]
        if chunk["logprobs"] is not None:
            for key, values in chunk["logprobs"].items():
                out["logprobs"][key] += values

    for chunk in leading:
        add(chunk)
    async for chunk in chunks(choices, events):
        add(chunk)
    return joined


def best_of(joined, choices, req):
    """Of each prompt's best_of candidates, the n of highest cumulative log-probability, best
    first and numbered anew (vLLM's best_of); all of them when best_of is n. The usage
    counts every candidate's tokens, as OpenAI's."""
    k, n = req.best_of or req.n, req.n
    if k == n:
        return joined
    out = []
    for first in range(0, len(joined), k):
        ranked = sorted(range(first, first + k), key=lambda i: -choices[i].cumulative_logprob)[:n]
        out += [dict(joined[i], index=len(out) + rank) for rank, i in enumerate(ranked)]
    return out


async def completion_response(head, req, choices, events, leading):
    joined = best_of(await joined_choices(choices, events, leading, req.logprobs), choices, req)
    return dict(head, choices=joined, usage=usage(choices))


def chat_message(joined, choice, calls, forced, chat, tokenizer):
    """A joined choice as a chat choice: its message, and the tool calls in it when `calls` (a
    forced call's arguments are the whole reply; otherwise they are parsed out of its tokens)."""
    message, finish_reason = dict(role="assistant", content=joined["text"]), joined["finish_reason"]
    if calls:
        content, tool_calls = (None, forced_calls(forced, joined["text"])) if forced else parse_calls(chat.decode(choice.ids, tokenizer))
        if tool_calls:
            message, finish_reason = dict(message, content=content, tool_calls=tool_calls), "tool_calls"
    return dict(index=joined["index"], message=message, logprobs=joined["logprobs"], finish_reason=finish_reason)


async def chat_response(head, req, choices, events, as_message):
    joined = await joined_choices(choices, events, [], choices[0].logprobs)
    messages = best_of([as_message(j, choice) for j, choice in zip(joined, choices)], choices, req)
    return dict(head, choices=messages, usage=usage(choices))


async def stream_whole(head, req, response):
    """A chat whose tool calls are known only at its end, streamed as OpenAI streams one: per choice
    the role, then its content and calls in one delta with the finish_reason; the usage when asked."""
    with_usage = req.stream_options is not None and req.stream_options.include_usage
    extra = dict(usage=None) if with_usage else {}
    try:
        whole = await response
    except APIError as e:
        yield f"data: {json.dumps(e.body())}\n\n"
        return
    for c in whole["choices"]:
        message = c["message"]
        delta = dict(content=message["content"]) if message["content"] else {}
        if message.get("tool_calls"):
            delta["tool_calls"] = [dict(call, index=k) for k, call in enumerate(message["tool_calls"])]
        for shaped in (dict(index=c["index"], delta=dict(role="assistant", content=""), logprobs=None, finish_reason=None),
                       dict(index=c["index"], delta=delta, logprobs=c["logprobs"], finish_reason=c["finish_reason"])):
            yield f"data: {json.dumps(dict(head, choices=[shaped], **extra))}\n\n"
    if with_usage:
        yield f"data: {json.dumps(dict(head, choices=[], usage=whole['usage']))}\n\n"
    yield "data: [DONE]\n\n"


# ----------------------------------------------------------------------------
# --mode serve


def check_port_free(host, port):
    """A port in use is a one-line error before the model loads and compiles."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        raise ConfigError(f"cannot listen on {host}:{port} ({e.strerror}): choose another --serve.port or --serve.host") from None


def serve_run(cfg):
    if jax.process_count() > 1:
        raise ConfigError("--mode serve runs in one process: start it without --dist.* flags")
    s = cfg.serve
    check_port_free(s.host, s.port)
    api_key = os.environ.get(API_KEY_ENV) or None
    if s.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        print(f"warning: serving on {s.host} without a bearer token; set {API_KEY_ENV} to require one", file=sys.stderr)
    if s.chat_template and not os.path.exists(s.chat_template):
        raise ConfigError(f"--serve.chat_template {s.chat_template}: no such file or directory")
    cfg, graphdef, params = load_run_params(cfg)
    model = nnx.merge(graphdef, host_params(params))
    tokenizer = get_tokenizer(cfg.data.tokenizer, cfg.data.encoding_file)
    chat = load_chat_template(hf_config.hf_dir(cfg.train.init_from), s.chat_template, tokenizer)
    engine = Engine(model, s.slots, s.queue, tp_devices=jax.devices()[:cfg.mesh.tp])
    app = make_app(engine, tokenizer, cfg.run.name, s.max_tokens, api_key, chat, s.slide)
    engine.metrics.report_throughput()
    print(f"serving {cfg.run.name} on http://{s.host}:{s.port}/ (context {engine.window} tokens"
          f"{', bearer token required' if api_key else ''}; chat {'template: ' + chat.source if chat else 'off: no chat template'})"
          "; /health says loading until compiled", flush=True)
    threading.Thread(target=start_engine, args=(engine, cfg.mesh.tp), name="compile", daemon=True).start()
    try:
        uvicorn.run(app, host=s.host, port=s.port, log_level="warning")
    finally:
        engine.stop()


def start_engine(engine, n_devices):
    """Compile (or load from the compilation cache) every program, then start decoding;
    the server listens meanwhile, and /health says "ok" from then on. A compile that
    fails stops the server: it could never be ready."""
    t0 = time.perf_counter()
    try:
        engine.start()
    except Exception:
        traceback.print_exc()
        stop_now("error: the server could not compile its programs (above); it stops")
    print(f"compiled {len(engine.buckets)} prefill lengths {engine.buckets} and the decode step for {engine.n_slots} slots "
          f"on {n_devices} device(s) in {time.perf_counter() - t0:.1f}s: ready", flush=True)
