"""The server's side of a request before the engine: OpenAI's request bodies (pydantic
schemas: an unknown field is a 400 that names it), the checks of their settings, the
errors as OpenAI reports them (APIError), and prompts -> token ids within the window.
serve.py routes the requests; engine.py decodes."""

import json
from typing import Optional, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from runtime.sampling import TOP_LOGPROBS

MAX_N = 64  # choices per prompt (n, best_of): each takes a slot, so at most --serve.slots decode at once

class APIError(Exception):
    """An error the client caused (or a 5xx it did not), as OpenAI's API reports it."""

    def __init__(self, status, message, param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self):
        kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False  # a last chunk with the usage and no choices, before [DONE]


class SamplingRequest(BaseModel):
    """What both endpoints take. Unknown fields are a 400 that names them, not ignored."""

    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = None
    temperature: float = 1.0
    top_k: int = 0  # 0 (or -1, vLLM's spelling) = all tokens
    top_p: float = 1.0
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None  # {"token id": bias in [-100, 100]}
    n: int = 1  # choices per prompt, sample i seeded (seed + i) mod 2^32
    best_of: Optional[int] = None  # generate this many (>= n), return the n of highest cumulative log-probability
    ignore_eos: bool = False  # vLLM's: end-of-text (and a chat's end of turn) does not end the text
    stop_token_ids: Optional[list[int]] = None  # vLLM's: these tokens end the text too (unshown, as end-of-text)
    include_stop_str_in_output: bool = False  # vLLM's: the text ends after the stop string, not before
    min_p: float = 0.0  # vLLM's: tokens less likely than min_p x the likeliest are dropped (0 = off)
    repetition_penalty: float = 1.0  # vLLM's (transformers'): the logits of the prompt's and reply's tokens divided by it (1 = off)
    min_tokens: int = 0  # vLLM's: no end of text, stop token or stop string before this many tokens
    response_format: Optional[dict] = None  # {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}
    user: Optional[str] = None


class CompletionRequest(SamplingRequest):
    """POST /v1/completions. suffix is OpenAI's field this server cannot honour: accepted
    by the schema so that check_settings refuses it saying why."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int = 16  # OpenAI's default
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None


class ChatMessage(BaseModel):
    """A message as the chat template sees it: role, content (text, or a list of text
    parts) and whatever else the client sends (name, tool_call_id, ...)."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: Union[str, list[dict], None] = None


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's): a prompt, or chat messages rendered by the model's template."""

    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True  # accepted: this tokenizer adds none to a prompt


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = None
    tokens: list[int]


class ChatRequest(SamplingRequest):
    """POST /v1/chat/completions. max_tokens (or OpenAI's newer max_completion_tokens)
    defaults to --serve.max_tokens: a reply ends at the template's end of turn."""

    messages: list[ChatMessage]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    tools: Optional[list] = None  # [{"type": "function", "function": {"name", "description", "parameters"}}]: serving/tools.py
    tool_choice: Union[str, dict, None] = None  # none | auto (the default with tools) | required | {"type": "function", ...}
    parallel_tool_calls: Optional[bool] = None  # accepted: a reply holds the calls the model writes
    logprobs: Optional[bool] = None  # each reply token's log-probability (OpenAI's content list)
    top_logprobs: Optional[int] = None  # and this many likeliest alternatives at each (needs logprobs)


# ---- Requests -> sequences


def parse_request(body_bytes, schema=CompletionRequest):
    """Raw body -> a `schema` instance, or a 400 saying what is wrong with it."""
    try:
        text = body_bytes.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not UTF-8 (byte {e.start}): send UTF-8 JSON") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return schema.model_validate(obj)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        if first["type"] == "extra_forbidden":
            known = ", ".join(schema.model_fields)
            raise APIError(400, f"unknown field {where!r}; this server accepts: {known}", param=where) from None
        raise APIError(400, f"{where}: {first['msg']}", param=where.split(".")[0]) from None


def check_settings(req, max_tokens, max_tokens_limit, vocab):
    """The request's settings in range (else a 400 naming the field), and its stop strings."""
    checks = [
        (0 <= max_tokens <= max_tokens_limit, "max_tokens",
         f"max_tokens must be in 0..{max_tokens_limit} (--serve.max_tokens), got {max_tokens}"),
        (0 <= req.temperature <= 100, "temperature", f"temperature must be in [0, 100] (0 = greedy), got {req.temperature}"),
        (req.top_k >= -1, "top_k", f"top_k must be >= 0 (0 or -1 = all tokens), got {req.top_k}"),
        (0 < req.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {req.top_p}"),
        (-2 <= req.frequency_penalty <= 2, "frequency_penalty", f"frequency_penalty must be in [-2, 2], got {req.frequency_penalty}"),
        (-2 <= req.presence_penalty <= 2, "presence_penalty", f"presence_penalty must be in [-2, 2], got {req.presence_penalty}"),
        (0 <= req.min_p <= 1, "min_p", f"min_p must be in [0, 1] (0 = off), got {req.min_p}"),
        (0 < req.repetition_penalty <= 10, "repetition_penalty", f"repetition_penalty must be in (0, 10] (1 = off), got {req.repetition_penalty}"),
        (0 <= req.min_tokens <= max_tokens, "min_tokens", f"min_tokens must be in 0..max_tokens ({max_tokens}), got {req.min_tokens}"),
        (1 <= req.n <= MAX_N, "n", f"n must be in 1..{MAX_N}, got {req.n}"),
        (req.best_of is None or req.n <= req.best_of <= MAX_N, "best_of", f"best_of must be in n..{MAX_N} (n = {req.n}), got {req.best_of}"),
        (not req.stream or req.best_of in (None, req.n), "best_of", "best_of other than n cannot stream: the best are known at the end"),
        (req.seed is None or 0 <= req.seed < 2**32, "seed", "seed must be in 0..2^32-1 (jax.random.key would fold larger ones onto these)"),
        (req.stream or req.stream_options is None, "stream_options", "stream_options is only allowed when stream is true"),
    ]
    if isinstance(req, CompletionRequest):
        checks += [
            (req.logprobs is None or 0 <= req.logprobs <= TOP_LOGPROBS, "logprobs", f"logprobs must be in 0..{TOP_LOGPROBS}, got {req.logprobs}"),
            (not req.suffix, "suffix", "suffix is not supported: this model continues a text, it was not trained to fill in the middle"),
        ]
    if isinstance(req, ChatRequest):
        checks += [
            (req.top_logprobs is None or 0 <= req.top_logprobs <= TOP_LOGPROBS, "top_logprobs",
             f"top_logprobs must be in 0..{TOP_LOGPROBS}, got {req.top_logprobs}"),
            (req.logprobs or not req.top_logprobs, "top_logprobs", "top_logprobs needs logprobs: true"),
        ]
    for ok, param, message in checks:
        if not ok:
            raise APIError(400, message, param=param)
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if not all(stops):  # as many as the client likes (vLLM's rule; OpenAI allows 4)
        raise APIError(400, "stop strings must be non-empty", param="stop")
    if any(not 0 <= t < vocab for t in req.stop_token_ids or []):
        raise APIError(400, f"stop_token_ids must be token ids in 0..{vocab - 1}", param="stop_token_ids")
    return stops, check_logit_bias(req.logit_bias, vocab)


def check_logit_bias(logit_bias, vocab):
    """{"token id": bias} -> {id: bias}, ids in the model's vocabulary, biases in [-100, 100]."""
    out = {}
    for key, bias in (logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token < vocab:
            raise APIError(400, f"logit_bias: {key!r} is not a token id in 0..{vocab - 1}", param="logit_bias")
        if not -100 <= bias <= 100:
            raise APIError(400, f"logit_bias: the bias of token {token} must be in [-100, 100], got {bias}", param="logit_bias")
        out[token] = bias
    return out


def max_token_chars(tokenizer):
    """The most characters one token can stand for (bytes: 1; tiktoken: its longest
    token's bytes): a text of more than window x this many characters is more than
    window tokens, known before tokenizing it."""
    encoding = tokenizer._encoding
    return 1 if encoding is None else max(len(t) for t in encoding._mergeable_ranks)


def tokenize_prompts(prompt, tokenizer, window, token_chars=None):
    """[(text, ids)] per prompt. Empty, non-UTF-8 (lone surrogates from \\ud800 escapes)
    and over-long prompts are 400s: a prompt must fit the training window. A text far
    over it is refused by its length alone, before it is tokenized (a few MB of text
    would hold the event loop for seconds)."""
    token_chars = token_chars or max_token_chars(tokenizer)
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt is an empty list", param="prompt")
    out = []
    for i, p in enumerate(prompt):
        where = "prompt" if len(prompt) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            try:
                p.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError(400, f"{where} is not valid UTF-8 text (it holds a lone surrogate)", param="prompt") from None
            if len(p) > window * token_chars:  # each token is at most token_chars characters
                raise APIError(400, f"{where} is {len(p)} characters, so more than {window} tokens; this model's context "
                               f"is {window} (its seq_len)", param="prompt", code="context_length_exceeded")
            ids = tokenizer.encode(p)
        else:
            ids = list(p)
            if any(not 0 <= t < tokenizer.vocab_size for t in ids):
                raise APIError(400, f"{where} holds token ids outside the vocabulary 0..{tokenizer.vocab_size - 1}", param="prompt")
            p = tokenizer.decode(ids)
        if not ids:
            raise APIError(400, f"{where} is empty: give some text to continue", param="prompt")
        if len(ids) > window:
            raise APIError(400, f"{where} is {len(ids)} tokens; this model's context is {window} (its seq_len)",
                           param="prompt", code="context_length_exceeded")
        out.append((p, ids))
    return out
