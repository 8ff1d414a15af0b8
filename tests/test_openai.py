"""The official `openai` client against `python main.py --mode serve`, as a new user tries
it: completions, streaming with and without usage, chat and chat streaming, penalties
and logit_bias, and every refusal as the SDK's BadRequestError.

One server for the module: a small random DeepseekV3 made and saved by transformers
(test_hf.hf_made_model), given a byte-level tokenizer with two chat tokens and a ChatML
template in its tokenizer_config.json, imported with --train.init_from hf:DIR. As Llama
3 Instruct's, its tokenizer's eos is end-of-text and generation_config.json adds the end
of turn. Its replies are compared with transformers' greedy decoding of the same
rendered chat. A multi-line template is compared with apply_chat_template without a server.
"""

import json
import os
import shutil
import subprocess
import time
import urllib.request
from typing import Optional

import numpy as np
import pytest

openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dataset import get_tokenizer  # noqa: E402
from hf import tokenizer as hf_tokenizer  # noqa: E402
from serving.chat import load_chat_template  # noqa: E402
from test_hf import hf_made_model  # noqa: E402
from test_serve import REPO, serving  # noqa: E402

BYTES = get_tokenizer("bytes")
IM_START, IM_END = 257, 258  # the chat tokens, after the bytes and <|endoftext|> (256); the model's vocabulary is 300
CHATML_TOKENS = {IM_START: "<|im_start|>", IM_END: "<|im_end|>"}
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
DEEPSEEK_V3_TOKENS = {257: "<｜begin▁of▁sentence｜>", 258: "<｜end▁of▁sentence｜>", 259: "<｜User｜>", 260: "<｜Assistant｜>"}
# DeepSeek-V3's template laid out as multi-line templates are: most lines a block tag, indented
# (transformers' trim_blocks and lstrip_blocks drop the newline after it and the indent before it).
DEEPSEEK_V3 = """\
{% if not add_generation_prompt is defined %}
    {% set add_generation_prompt = false %}
{% endif %}
{% set ns = namespace(system_prompt='', is_first_sp=true) %}
{% for message in messages %}
    {% if message['role'] == 'system' %}
        {% if ns.is_first_sp %}
            {% set ns.system_prompt = message['content'] %}
            {% set ns.is_first_sp = false %}
        {% else %}
            {% set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] %}
        {% endif %}
    {% endif %}
{% endfor %}
{{ bos_token }}{{ ns.system_prompt }}
{%- for message in messages %}
    {% if message['role'] == 'user' %}
        {{- '<｜User｜>' + message['content'] -}}
    {% elif message['role'] == 'assistant' %}
        {{- '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' -}}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
    {{- '<｜Assistant｜>' -}}
{% endif %}
"""
TOOL_TOKENS = {**DEEPSEEK_V3_TOKENS, **dict(enumerate(["<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                                                        "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>", "<｜tool▁outputs▁begin｜>",
                                                        "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>", "<｜tool▁outputs▁end｜>"], 261))}
# DeepSeek-V3's turns and tool calls, with the tools listed after the system prompt (as vLLM's
# examples/tool_chat_template_deepseekv3.jinja lists them).
DEEPSEEK_V3_TOOLS = (
    "{{ bos_token }}{% for m in messages if m['role'] == 'system' %}{{ m['content'] }}{% endfor %}"
    "{% if tools %}\n\n## Tools\n{% for tool in tools %}### {{ tool['function']['name'] }}\n"
    "{{ tool['function']['description'] }}\nParameters: {{ tool['function']['parameters'] | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' and m['tool_calls'] is defined %}<｜Assistant｜>{{ m['content'] or '' }}<｜tool▁calls▁begin｜>"
    "{% for call in m['tool_calls'] %}<｜tool▁call▁begin｜>{{ call['type'] }}<｜tool▁sep｜>{{ call['function']['name'] }}\n```json\n"
    "{{ call['function']['arguments'] }}\n```<｜tool▁call▁end｜>{% endfor %}<｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>"
    "{% elif m['role'] == 'tool' %}<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{{ m['content'] }}<｜tool▁output▁end｜>"
    "<｜tool▁outputs▁end｜>{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}")
WINDOW = 64  # the model's max_position_embeddings, and --model.seq_len: no window restart in a reply
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]  # 41 tokens: 20 more fit
ASCII_ONLY = {t: -100.0 for t in range(128, 300) if t != IM_END}  # replies whose text is their tokens exactly


def write_chat_tokenizer(path, template=CHATML, tokens=CHATML_TOKENS, ends=(BYTES.eot_id, IM_END), **special):
    """tokenizer.json (our byte-level BPE plus the chat `tokens` {id: text}),
    tokenizer_config.json with the template and the `special` tokens (default: eos
    <|endoftext|>), generation_config.json whose eos_token_id lists the ids that end a turn."""
    tok = hf_tokenizer.tokenizer_json(BYTES)
    tok["added_tokens"] += [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True} for i, s in tokens.items()]
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump(tok, f)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                   "model_max_length": WINDOW, "chat_template": template, **special}, f)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": list(ends), "pad_token_id": BYTES.eot_id}, f)


@pytest.fixture(scope="module")
def hf_chat_model(tmp_path_factory):
    """(directory, transformers model, its tokenizer)."""
    torch.set_num_threads(1)
    path = str(tmp_path_factory.mktemp("hf_chat"))
    hf = hf_made_model(path, first_k_dense=1, n_layers=2, seed=5)  # seed 5: <|im_end|> is nearest the top 12 tokens in
    write_chat_tokenizer(path)
    return path, hf, transformers.AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def server_log(tmp_path_factory):
    return tmp_path_factory.mktemp("serve") / "serve.log"


@pytest.fixture(scope="module")
def server(hf_chat_model, server_log):
    """`python main.py --mode serve --train.init_from hf:DIR`, once /health says ok: its URL."""
    with serving(["--preset", "tiny", "--model.seq_len", str(WINDOW), "--train.init_from", f"hf:{hf_chat_model[0]}", "--run.name",
                  "chatty", "--run.out_dir", str(server_log.parent), "--serve.slots", "2", "--serve.max_tokens", "48"], server_log,
                 env={"MESHFORMER_LOG_STATS_INTERVAL": "0.5"}) as port:
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    """(directory, tokenizer) of a small random DeepseekV3 with a 512-token context (the tools'
    list is long in bytes) and DeepSeek-V3's tool-call template."""
    path = tmp_path_factory.mktemp("hf_tools")
    hf_made_model(str(path), first_k_dense=1, n_layers=2, seed=3, max_position_embeddings=512)
    write_chat_tokenizer(path, DEEPSEEK_V3_TOOLS, TOOL_TOKENS, ends=[258], bos_token=TOOL_TOKENS[257], eos_token=TOOL_TOKENS[258])
    return str(path), transformers.AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def tool_server(tool_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("tool_serve") / "serve.log"
    with serving(["--preset", "tiny", "--model.seq_len", "512", "--train.init_from", f"hf:{tool_model[0]}", "--run.name", "tooly",
                  "--run.out_dir", str(log.parent), "--serve.slots", "2", "--serve.max_tokens", "64"], log) as port:
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=300)


def hf_greedy(hf, prompt_ids, n, bias=None, logits_processor=None):
    """transformers' greedy continuation (stopping at <|im_end|>, generation_config.json's
    eos, or <|endoftext|>: the server's ends of turn), with `bias` {id: b} added to the logits (sequence_bias: what logit_bias does)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, eos_token_id=[IM_END, 256], pad_token_id=256,
                          sequence_bias={(t,): b for t, b in (bias or {}).items()} or None, logits_processor=logits_processor)
    return out[0, len(prompt_ids):].tolist()


def reply_ids(text, finish_reason):
    """The tokens of an ASCII-only reply: its bytes, and <|im_end|> if it ended the turn."""
    return BYTES.encode(text) + ([IM_END] if finish_reason == "stop" else [])


# ---- Chat


def test_chat_reply_equals_transformers_greedy_of_the_rendered_chat(client, hf_chat_model):
    """The server renders the chat as apply_chat_template does and replies, token for
    token, what transformers' greedy decoding of that prompt gives: stopping at the
    template's end of turn (<|im_end|>, favoured by a logit_bias that transformers'
    sequence_bias applies alike, at the first strength that ends the turn mid-reply),
    streamed as chat.completion.chunks; and with no bias at all, the same text."""
    _, hf, tok = hf_chat_model
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert prompt[:1] == [IM_START] and prompt.count(IM_END) == 2
    for strength in range(16):
        bias = {**ASCII_ONLY, IM_END: strength / 4}
        expected = hf_greedy(hf, prompt, 20, bias)
        if expected[-1] == IM_END and len(expected) >= 5:
            break
    assert expected[-1] == IM_END and len(set(expected)) > 3, expected  # ends its turn after a real reply
    logit_bias = {str(t): b for t, b in bias.items()}
    reply = client.chat.completions.create(model="chatty", messages=MESSAGES, temperature=0, max_tokens=20, logit_bias=logit_bias)
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and choice.message.role == "assistant" and choice.finish_reason == "stop"
    assert reply_ids(choice.message.content, choice.finish_reason) == expected
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt), len(expected))

    stream = client.chat.completions.create(model="chatty", messages=MESSAGES, temperature=0, max_tokens=20, logit_bias=logit_bias,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage == reply.usage and len(chunks) > 5

    plain = client.chat.completions.create(model="chatty", messages=MESSAGES, temperature=0, max_tokens=20).choices[0]
    theirs = hf_greedy(hf, prompt, 20)
    assert plain.message.content == BYTES.decode([t for t in theirs if t not in (IM_START, IM_END)])
    assert plain.finish_reason == ("stop" if theirs[-1] == IM_END else "length")


def test_the_chat_ends_at_the_turn_end_that_only_generation_config_names(client, hf_chat_model):
    """The tokenizer's eos is <|endoftext|>; <|im_end|> ends a turn because
    generation_config.json's eos_token_id lists it: a reply made to start with it
    (logit_bias) is empty and stops there, streamed or not."""
    assert hf_chat_model[2].eos_token_id == BYTES.eot_id != IM_END
    forced = dict(model="chatty", messages=MESSAGES, temperature=0, max_tokens=5, logit_bias={str(IM_END): 100})
    reply = client.chat.completions.create(**forced)
    assert (reply.choices[0].message.content, reply.choices[0].finish_reason, reply.usage.completion_tokens) == ("", "stop", 1)
    chunks = list(client.chat.completions.create(**forced, stream=True))
    assert [c.choices[0].finish_reason for c in chunks] == [None, "stop"]


def test_a_multi_line_indented_template_renders_as_apply_chat_template(tmp_path):
    """DeepSeek-V3's template over indented lines: the rendered chat and its tokens are
    apply_chat_template's, which is DeepSeek-V3's prompt (no newline or indent of the
    template's layout left in it)."""
    write_chat_tokenizer(tmp_path, DEEPSEEK_V3, DEEPSEEK_V3_TOKENS, ends=[258], bos_token=DEEPSEEK_V3_TOKENS[257],
                         eos_token=DEEPSEEK_V3_TOKENS[258])
    tok, chat = transformers.AutoTokenizer.from_pretrained(tmp_path), load_chat_template(str(tmp_path), None, BYTES)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi!"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye?"}]
    theirs = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert theirs == ("<｜begin▁of▁sentence｜>Be brief.\n\nBe kind.<｜User｜>Hi!<｜Assistant｜>Hello.<｜end▁of▁sentence｜>"
                      "<｜User｜>Bye?<｜Assistant｜>")
    assert chat.render(messages) == theirs
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert chat.encode(chat.pieces(theirs), BYTES) == ids and ids.count(259) == 2  # <｜User｜> as its id


class OpenAIPenalties(transformers.LogitsProcessor):
    """OpenAI's documented penalties, in transformers' decoding loop: token j's logit minus
    frequency x c[j] minus presence x (c[j] > 0), c counting the generated tokens."""

    def __init__(self, prompt_length, frequency, presence):
        self.prompt_length, self.frequency, self.presence = prompt_length, frequency, presence

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores)
        counts.scatter_add_(1, input_ids[:, self.prompt_length:], torch.ones_like(input_ids[:, self.prompt_length:], dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def test_penalties_and_logit_bias_equal_transformers_with_openai_s_formula(client, hf_chat_model):
    """frequency_penalty and presence_penalty, greedy: the tokens transformers chooses
    with OpenAI's formula applied to its logits (counting only generated tokens); without
    them the same prompt repeats tokens more."""
    _, hf, _ = hf_chat_model
    prompt = BYTES.encode("ROMEO:\n")
    ascii_text = {**ASCII_ONLY, IM_END: -100.0}  # a completion does not end at a chat's end of turn
    logit_bias = {str(t): b for t, b in ascii_text.items()}
    runs = {}
    for frequency, presence in ((0.0, 0.0), (0.7, 0.0), (0.0, 1.5), (0.4, -0.3)):
        out = client.completions.create(model="chatty", prompt="ROMEO:\n", max_tokens=30, temperature=0, logit_bias=logit_bias,
                                        frequency_penalty=frequency, presence_penalty=presence).choices[0]
        processor = transformers.LogitsProcessorList([OpenAIPenalties(len(prompt), frequency, presence)])
        expected = hf_greedy(hf, prompt, 30, ascii_text, processor)
        assert reply_ids(out.text, out.finish_reason) == expected, (frequency, presence)
        runs[frequency, presence] = out.text
    assert len(set(runs.values())) == 4 and len(set(runs[0.0, 1.5])) > len(set(runs[0.0, 0.0])), runs


def test_vllm_s_repetition_penalty_min_p_and_min_tokens(client, hf_chat_model):
    """repetition_penalty, greedy: the tokens transformers' generate(repetition_penalty=) chooses
    (the prompt's tokens penalized too); min_p 1 at temperature 1 keeps only the likeliest token, so
    any seed gives the greedy text; min_tokens 6 with end-of-text favoured: six tokens, then the end."""
    _, hf, _ = hf_chat_model
    text = "And the sea and the wind, "  # the reply's likeliest tokens are in the prompt: penalized from the first
    prompt = BYTES.encode(text)
    ascii_text = {**ASCII_ONLY, IM_END: -100.0}
    logit_bias = {str(t): b for t, b in ascii_text.items()}
    greedy = dict(model="chatty", prompt=text, max_tokens=30, temperature=0, logit_bias=logit_bias)
    texts = {}
    for penalty in (1.0, 1.3, 0.8):
        out = client.completions.create(**greedy, extra_body={"repetition_penalty": penalty}).choices[0]
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, eos_token_id=[IM_END, 256], pad_token_id=256,
                                 sequence_bias={(t,): b for t, b in ascii_text.items()}, repetition_penalty=penalty)
        assert reply_ids(out.text, out.finish_reason) == theirs[0, len(prompt):].tolist(), penalty
        texts[penalty] = out.text
    assert len(set(texts.values())) == 3, texts
    sampled = dict(greedy, temperature=1.0)
    assert [client.completions.create(**sampled, seed=seed, extra_body={"min_p": 1.0}).choices[0].text for seed in (1, 2)] == [texts[1.0]] * 2
    assert client.completions.create(**sampled, seed=1, extra_body={"min_p": 0.05}).choices[0].text != texts[1.0]

    ended = dict(model="chatty", prompt="KING", max_tokens=10, temperature=0, logit_bias={str(BYTES.eot_id): 100})
    out = client.completions.create(**ended, extra_body={"min_tokens": 6})
    assert (out.usage.completion_tokens, out.choices[0].finish_reason, len(out.choices[0].text)) == (7, "stop", 6)
    whole = out.choices[0].text
    stop = whole[1]  # a stop string the text holds before its 6th token (and maybe after): only a later one counts
    at = whole.find(stop, 5)
    assert client.completions.create(**ended, stop=[stop], extra_body={"min_tokens": 6}).choices[0].text == (whole if at < 0 else whole[:at])


def test_chat_logprobs_are_transformers_log_softmax(client, hf_chat_model):
    """Chat logprobs + top_logprobs 2, greedy: OpenAI's content list, one entry per reply token
    (transformers' greedy tokens), its log-probability and the two likeliest alternatives'
    transformers' log-softmax of the rendered chat at that position; streamed, the same entries."""
    _, hf, tok = hf_chat_model
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = [t for t in hf_greedy(hf, prompt, 8) if t != IM_END]
    asked = dict(model="chatty", messages=MESSAGES, temperature=0, max_tokens=8, logprobs=True, top_logprobs=2)
    content = client.chat.completions.create(**asked).choices[0].logprobs.content
    assert len(content) == len(ids) >= 4
    with torch.no_grad():
        logprobs_TV = torch.log_softmax(hf(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].double(), -1)
    for entry, token, logprobs_V in zip(content, ids, logprobs_TV):
        top = torch.argsort(logprobs_V, descending=True)[:2].tolist()
        assert top[0] == token and entry.token == BYTES.decode([token]) and entry.bytes == list(entry.token.encode())
        assert abs(entry.logprob - float(logprobs_V[token])) < 1e-4, (entry, float(logprobs_V[token]))
        assert [e.token for e in entry.top_logprobs] == [BYTES.decode([t]) for t in top], (entry, top)
        np.testing.assert_allclose([e.logprob for e in entry.top_logprobs], logprobs_V[top].numpy(), atol=1e-4)
    streamed = [entry for chunk in client.chat.completions.create(**asked, stream=True) if chunk.choices and chunk.choices[0].logprobs
                for entry in chunk.choices[0].logprobs.content]
    assert streamed == content


# ---- Tools: DeepSeek-V3's calls, through the SDK and langchain

ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
ASK = [{"role": "user", "content": "What is 2 + 3?"}]
NAMED = {"type": "function", "function": {"name": "add"}}


def test_a_named_tool_is_called_with_arguments_that_follow_its_schema(tool_server, tool_model):
    """tool_choice naming a tool: finish_reason tool_calls, one call of it whose arguments
    validate against its parameters at temperature 1 (5 seeds); the prompt is transformers'
    apply_chat_template(tools=...) and the call's opening; streamed, the same call in one delta;
    tool_choice none, a plain reply; a tool_choice naming no tool, a 400 naming the tools."""
    jsonschema = pytest.importorskip("jsonschema")
    tok = tool_model[1]
    client = openai.OpenAI(base_url=tool_server + "/v1", api_key="unused", max_retries=0, timeout=300)
    forced = dict(model="tooly", messages=ASK, tools=[ADD], tool_choice=NAMED, temperature=1, max_tokens=40)
    for seed in range(5):
        reply = client.chat.completions.create(**forced, seed=seed)
        choice = reply.choices[0]
        assert (choice.finish_reason, choice.message.content, len(choice.message.tool_calls)) == ("tool_calls", None, 1)
        call = choice.message.tool_calls[0]
        assert (call.type, call.function.name, call.id[:5]) == ("function", "add", "call_")
        jsonschema.validate(json.loads(call.function.arguments), ADD["function"]["parameters"])
    prompt = tok.apply_chat_template(ASK, tools=[ADD], add_generation_prompt=True, tokenize=True, return_dict=False)
    opening = tok.encode("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n", add_special_tokens=False)
    assert reply.usage.prompt_tokens == len(prompt) + len(opening) and len(opening) == 23
    chunks = list(client.chat.completions.create(**forced, seed=4, stream=True))
    deltas = [d for chunk in chunks for d in chunk.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [(0, "add", call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    plain = client.chat.completions.create(**dict(forced, tool_choice="none", temperature=0, max_tokens=4)).choices[0]
    assert plain.finish_reason in ("stop", "length") and plain.message.tool_calls is None
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**dict(forced, tool_choice={"type": "function", "function": {"name": "mul"}}))
    assert "naming one of the tools (add)" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # a function that is not an object: a 400, not a 500
        client.chat.completions.create(**dict(forced, tool_choice={"type": "function", "function": "add"}))
    assert "naming one of the tools (add)" in e.value.message
    odd = {"type": "function", "function": dict(ADD["function"], parameters={"type": "string", "pattern": "^a"})}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**dict(forced, tools=[odd]))
    assert "400 - tools: add's parameters: the keyword 'pattern' is not supported" in e.value.message, e.value.message


MUL = {"type": "function", "function": {"name": "mul", "description": "Multiply two numbers.", "parameters": {
    "type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"]}}}


def test_required_picks_one_of_the_tools_and_its_arguments_follow_that_tool_s_schema(tool_server):
    """tool_choice required with two tools: the reply is guided to a name, then to that tool's
    parameters: at temperature 1 (8 seeds) each call names add or mul and validates against its
    own schema, both names turn up."""
    jsonschema = pytest.importorskip("jsonschema")
    client = openai.OpenAI(base_url=tool_server + "/v1", api_key="unused", max_retries=0, timeout=300)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (ADD, MUL)}
    names = []
    for seed in range(8):
        choice = client.chat.completions.create(model="tooly", messages=ASK, tools=[ADD, MUL], tool_choice="required", temperature=1,
                                                max_tokens=40, seed=seed).choices[0]
        (call,) = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and call.function.name in schemas, choice
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        names.append(call.function.name)
    assert set(names) == {"add", "mul"}, names


def test_calls_the_template_writes_are_parsed_back(tool_model):
    """An assistant's calls as the template renders them (two calls, text before them) parse
    back into the same calls and text: what tool_choice auto reads out of a reply."""
    from serving.chat import load_chat_template
    from serving.tools import parse_calls

    calls = [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}},
             {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 1}'}}]
    chat = load_chat_template(tool_model[0], None, BYTES)
    said = chat.render(ASK + [{"role": "assistant", "content": "Let me add.", "tool_calls": calls}], add_generation_prompt=False)
    reply = said.split("<｜Assistant｜>")[1]
    content, parsed = parse_calls(reply)
    assert content == "Let me add." and [c["function"] for c in parsed] == [c["function"] for c in calls]
    assert parse_calls("Just text.") == ("Just text.", [])


def test_langchain_binds_a_tool_round_trip_and_structured_output(tool_server, tool_model):
    """langchain-openai against the server: bind_tools with the tool named returns its call, the
    tool runs, and the conversation with the call and its result goes back (rendered as
    transformers renders it, counted in the usage); with_structured_output gives the pydantic
    object, by json_schema and by function calling."""
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    from langchain_core.utils.function_calling import convert_to_openai_tool
    from pydantic import BaseModel

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    class Part(BaseModel):
        value: int

    class Sum(BaseModel):
        a: int
        b: int
        note: Optional[str] = None  # (an anyOf of string and null)
        parts: list[Part]  # (a $ref to the root's $defs)

    llm = langchain_openai.ChatOpenAI(model="tooly", base_url=tool_server + "/v1", api_key="unused", temperature=0, max_tokens=40,
                                      max_retries=0)
    asked = [HumanMessage("What is 2 + 3?")]
    called = llm.bind_tools([add], tool_choice="add").invoke(asked)
    (call,) = called.tool_calls
    assert call["name"] == "add" and set(call["args"]) == {"a", "b"}
    result = add.invoke(call)
    assert result.content == str(call["args"]["a"] + call["args"]["b"])
    reply = llm.bind_tools([add]).invoke(asked + [called, result])
    messages = [ASK[0], {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call["id"], "type": "function", "function": {"name": "add", "arguments": json.dumps(call["args"])}}]},
                {"role": "tool", "content": result.content, "tool_call_id": call["id"]}]
    prompt = tool_model[1].apply_chat_template(messages, tools=[convert_to_openai_tool(add)], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
    assert reply.usage_metadata["input_tokens"] == len(prompt) and isinstance(reply.content, str)
    for method in ("json_schema", "function_calling"):
        assert isinstance(llm.with_structured_output(Sum, method=method).invoke("Add 2 and 3."), Sum), method


# ---- Completions and streaming, as the SDK's own examples use them


def test_completions_stream_with_and_without_usage(client):
    """The SDK's example (`chunk.choices[0].text` for every chunk) runs to the end: no
    chunk without choices unless include_usage asks for the usage, which then comes last
    with `choices: []`, every other chunk saying usage null."""
    whole = client.completions.create(model="chatty", prompt="KING", max_tokens=20, temperature=0)
    assert whole.object == "text_completion" and whole.usage.completion_tokens == 20 and whole.choices[0].finish_reason == "length"
    text = "".join(chunk.choices[0].text for chunk in client.completions.create(model="chatty", prompt="KING", max_tokens=20,
                                                                                 temperature=0, stream=True))
    assert text == whole.choices[0].text
    chunks = list(client.completions.create(model="chatty", prompt="KING", max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.choices and c.usage is None for c in chunks[:-1]) and "".join(c.choices[0].text for c in chunks[:-1]) == text


def streamed_events(url, path, body):
    """The `data:` events of a streamed request as the server wrote them, parsed (an absent
    field and a null one differ here, not in the SDK's objects), up to [DONE]."""
    request = urllib.request.Request(url + path, json.dumps(dict(body, stream=True)).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as r:
        data = [line[len(b"data: "):].strip() for line in r if line.startswith(b"data: ")]
    assert data[-1] == b"[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_every_chunk_before_the_usage_says_usage_null(server, client):
    """stream_options.include_usage, as OpenAI documents it, in the server's raw JSON:
    every chunk but the last carries "usage": null; the last has no choices and the usage
    of the same request unstreamed. Completions and chat alike."""
    whole = {"/v1/completions": client.completions.create(model="chatty", prompt="KING", max_tokens=20, temperature=0),
             "/v1/chat/completions": client.chat.completions.create(model="chatty", messages=MESSAGES, max_tokens=20, temperature=0)}
    bodies = {"/v1/completions": dict(prompt="KING"), "/v1/chat/completions": dict(messages=MESSAGES)}
    for path, body in bodies.items():
        events = streamed_events(server, path, dict(body, max_tokens=20, temperature=0, stream_options={"include_usage": True}))
        assert len(events) > 3 and all(e["choices"] and "usage" in e and e["usage"] is None for e in events[:-1]), (path, events)
        assert events[-1]["choices"] == [] and events[-1]["usage"] == whole[path].usage.model_dump(exclude_none=True), path


REFUSED = {  # what the SDK is asked -> the words its BadRequestError carries
    "suffix": (dict(suffix="THE END"), "suffix is not supported"),
    "stream_options without stream": (dict(stream_options={"include_usage": True}), "stream_options is only allowed when stream"),
    "a penalty out of range": (dict(frequency_penalty=2.5), "frequency_penalty must be in [-2, 2]"),
    "logit_bias of no token": (dict(logit_bias={"300": 1}), "logit_bias: '300' is not a token id in 0..299"),
    "logit_bias over 100": (dict(logit_bias={"65": 101}), "must be in [-100, 100]"),
    "max_tokens over the limit": (dict(max_tokens=49), "max_tokens must be in 0..48"),
    "a prompt and max_tokens over the context": (dict(prompt="x" * 40, max_tokens=25), "but 65 were asked (40 in the prompt, 25 in max_tokens)"),
    "n over the limit": (dict(n=65), "n must be in 1..64"),
    "best_of under n": (dict(n=3, best_of=2), "best_of must be in n..64 (n = 3)"),
    "negative temperature": (dict(temperature=-1), "temperature must be in"),
    "an unknown field": (dict(extra_body={"guided_json": {}}), "unknown field 'guided_json'"),
}
CHAT_REFUSED = {
    "tools on a template without them": (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]),
                                         "does not render tools in a format read here (DeepSeek-V3's)"),
    "an image": (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]),
                 "only text parts are supported"),
    "a chat longer than the context": (dict(messages=[{"role": "user", "content": "x" * 70}]), "this model's context is 64"),
    "max_completion_tokens over the limit": (dict(max_completion_tokens=100), "max_tokens must be in 0..48"),
    "top_logprobs over 5": (dict(logprobs=True, top_logprobs=6), "top_logprobs must be in 0..5, got 6"),
    "top_logprobs without logprobs": (dict(top_logprobs=2), "top_logprobs needs logprobs: true"),
    "min_tokens over max_tokens": (dict(extra_body={"min_tokens": 5}), "min_tokens must be in 0..max_tokens (4), got 5"),
    "min_p over 1": (dict(extra_body={"min_p": 1.5}), "min_p must be in [0, 1]"),
    "a role OpenAI does not know": (dict(messages=[{"role": "wizard", "content": "Hi!"}]),
                                    "messages[0].role: 'wizard' is not a role; the roles are system, developer, user, assistant, tool"),
    "a message without content": (dict(messages=[MESSAGES[0], {"role": "user"}]), "messages[1].content is missing: a user message needs"),
    "a message whose content is null": (dict(messages=[{"role": "system", "content": None}]), "messages[0].content is null"),
    "a prompt and max_tokens over the context": (dict(max_tokens=24), "maximum context length is 64 tokens, but 65 were asked (41 in"),
    "no messages": (dict(messages=[]), "messages is empty"),
    "a schema keyword the guide cannot honour": (dict(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "^a"}}}), "response_format: schema: the keyword 'pattern' is not supported"),
    "max_tokens under the shortest JSON": (dict(response_format={"type": "json_object"}, max_tokens=1), "max_tokens 1 is too few"),
}


def test_what_the_server_cannot_do_is_a_bad_request_error_naming_the_field(client):
    greedy = dict(model="chatty", prompt="KING", max_tokens=3, temperature=0)
    before = client.completions.create(**greedy)
    for name, (kwargs, words) in REFUSED.items():
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**dict(dict(model="chatty", prompt="KING", max_tokens=4), **kwargs))
        assert words in e.value.message and "\n" not in e.value.message, (name, e.value.message)
    for name, (kwargs, words) in CHAT_REFUSED.items():
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**dict(dict(model="chatty", messages=MESSAGES, max_tokens=4), **kwargs))
        assert words in e.value.message and "\n" not in e.value.message, (name, e.value.message)
    # Served as before them (sampled at the default temperature, 3 tokens could end early on a stop token).
    after = client.completions.create(**greedy)
    assert (after.choices[0].text, after.usage) == (before.choices[0].text, before.usage)
    assert client.chat.completions.create(model="chatty", messages=MESSAGES, max_tokens=3, logprobs=False).usage.completion_tokens <= 3


def test_context_overflow_is_context_length_exceeded_and_a_chat_s_default_fills_the_context(client):
    """prompt + max_tokens over the 64-token context: a 400 whose code is vLLM's and OpenAI's
    (completions and chat); a chat without max_tokens gets the rest of the context (23 of
    41 + 23 = 64 tokens), as vLLM's default."""
    for call, kwargs in ((client.completions.create, dict(prompt="x" * 40, max_tokens=25)),
                         (client.chat.completions.create, dict(messages=MESSAGES, max_tokens=24))):
        with pytest.raises(openai.BadRequestError) as e:
            call(model="chatty", **kwargs)
        assert e.value.code == "context_length_exceeded" and e.value.param == "max_tokens", e.value.body
    assert len(client.completions.create(model="chatty", prompt="x" * 40, max_tokens=24, temperature=0).choices[0].text) == 24
    no_end = {str(IM_END): -100, str(BYTES.eot_id): -100}
    reply = client.chat.completions.create(model="chatty", messages=MESSAGES, temperature=0, logit_bias=no_end)
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.choices[0].finish_reason) == (41, 23, "length")


def test_stop_strings_have_no_limit_of_four(client):
    """Six stop strings (lm-eval sends its `until` strings and end-of-text: five and more): the
    greedy text ends before the first that occurs, as vLLM's."""
    ascii_text = {str(t): b for t, b in {**ASCII_ONLY, IM_END: -100.0, BYTES.eot_id: -100.0}.items()}
    greedy = dict(model="chatty", prompt="KING", max_tokens=30, temperature=0, logit_bias=ascii_text)
    whole = client.completions.create(**greedy).choices[0].text
    at = next(i for i in range(12, 28) if whole.find(whole[i:i + 2]) == i)
    cut = whole[at:at + 2]
    assert len(whole) == 30 and len(cut) == 2, whole
    stops = ["\u2603", "zzzz", "QQQ", "@@", "~~~", cut]
    out = client.completions.create(**greedy, stop=stops).choices[0]
    assert (out.text, out.finish_reason) == (whole[:at], "stop")
    kept = client.completions.create(**greedy, stop=stops, extra_body={"include_stop_str_in_output": True}).choices[0]
    assert (kept.text, kept.finish_reason) == (whole[:at + 2], "stop")


def test_vllm_s_ignore_eos_and_stop_token_ids(client):
    """ignore_eos: a text made to end at once (end-of-text favoured) runs to max_tokens;
    stop_token_ids: the greedy text ends, unshown, at the first of the ids."""
    ended = dict(model="chatty", prompt="KING", max_tokens=5, temperature=0, logit_bias={str(BYTES.eot_id): 100})
    short = client.completions.create(**ended)
    assert (short.choices[0].text, short.choices[0].finish_reason, short.usage.completion_tokens) == ("", "stop", 1)
    long = client.completions.create(**ended, extra_body={"ignore_eos": True})
    assert (long.choices[0].finish_reason, long.usage.completion_tokens) == ("length", 5)
    ascii_text = {str(t): b for t, b in {**ASCII_ONLY, IM_END: -100.0, BYTES.eot_id: -100.0}.items()}
    greedy = dict(model="chatty", prompt="KING", max_tokens=30, temperature=0, logit_bias=ascii_text)
    whole = client.completions.create(**greedy).choices[0].text
    at = next(i for i in range(5, 30) if whole.index(whole[i]) == i)
    out = client.completions.create(**greedy, extra_body={"stop_token_ids": [ord(whole[at]), 299]}).choices[0]
    assert (out.text, out.finish_reason) == (whole[:at], "stop")


def test_models_retrieve_tokenize_detokenize_version_and_the_access_log(server, client, hf_chat_model, server_log):
    """The SDK's models.retrieve (404 for another name); vLLM's /tokenize (a prompt, or a chat
    rendered as apply_chat_template renders it), /detokenize (special tokens as their text),
    /version (this checkout's commit); and a line per request in the server's log."""
    card = client.models.retrieve("chatty")
    assert (card.id, card.object, card.owned_by, card.model_extra["max_model_len"]) == ("chatty", "model", "meshformer", WINDOW)
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert "'gpt-4o' is not served here" in e.value.message

    def post(path, body):
        request = urllib.request.Request(server + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as r:
            return json.load(r)

    assert post("/tokenize", {"prompt": "ROMEO:"}) == {"count": 6, "max_model_len": WINDOW, "tokens": BYTES.encode("ROMEO:")}
    tok = hf_chat_model[2]
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert post("/tokenize", {"model": "chatty", "messages": MESSAGES})["tokens"] == ids
    assert post("/detokenize", {"tokens": ids}) == {"prompt": tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)}
    with urllib.request.urlopen(server + "/version", timeout=60) as r:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        assert json.load(r) == {"version": commit}
    time.sleep(0.2)
    lines = server_log.read_text().splitlines()
    assert any('"GET /v1/models/gpt-4o HTTP/1.1" 404 ' in line for line in lines), lines[-5:]
    assert sum('"POST /tokenize HTTP/1.1" 200 ' in line for line in lines) == 2 and any(" /version " in line for line in lines)
    paths = {dict(labels)["path"] for name, labels in scrape(server) if name == "meshformer:requests_total"}
    assert "/v1/models/{model_id:path}" in paths and not any("gpt-4o" in path for path in paths), paths  # counted by route


def test_n_samples_are_the_single_requests_with_the_derived_seeds(client):
    """n=3 with seed 7: three choices, sample i the text of one request with seed 7 + i
    (serve.sample_seed), for completions (two prompts: choice index = prompt x n + i), chat,
    and streamed; best_of=3 returns the candidate of highest cumulative log-probability."""
    sampled = dict(model="chatty", max_tokens=12, temperature=1.0, logit_bias={str(BYTES.eot_id): -100, str(IM_END): -100})
    single = [client.completions.create(**sampled, prompt="KING", seed=7 + i, logprobs=0).choices[0] for i in range(3)]
    assert len({c.text for c in single}) == 3, [c.text for c in single]
    lp = single[0].logprobs  # logprobs 0: no alternatives, but the sampled token itself (vLLM's)
    assert lp.top_logprobs == [{t: p} for t, p in zip(lp.tokens, lp.token_logprobs)]
    many = client.completions.create(**sampled, prompt="KING", seed=7, n=3)
    assert [c.index for c in many.choices] == [0, 1, 2] and [c.text for c in many.choices] == [c.text for c in single]
    assert many.usage.completion_tokens == 36
    two = client.completions.create(**sampled, prompt=["ROMEO:", "KING"], seed=7, n=2)
    assert [c.text for c in two.choices][2:] == [c.text for c in single[:2]]
    streamed = {}
    for chunk in client.completions.create(**sampled, prompt="KING", seed=7, n=3, stream=True):
        streamed[chunk.choices[0].index] = streamed.get(chunk.choices[0].index, "") + chunk.choices[0].text
    assert [streamed[i] for i in range(3)] == [c.text for c in single]

    best = client.completions.create(**sampled, prompt="KING", seed=7, n=1, best_of=3)
    scores = [sum(c.logprobs.token_logprobs) for c in single]
    assert [c.text for c in best.choices] == [single[scores.index(max(scores))].text] and best.usage.completion_tokens == 36

    chat = dict(sampled, messages=MESSAGES, max_tokens=8)
    replies = [client.chat.completions.create(**chat, seed=7 + i).choices[0].message.content for i in range(3)]
    assert [c.message.content for c in client.chat.completions.create(**chat, seed=7, n=3).choices] == replies and len(set(replies)) == 3


# ---- The page offers chat when the model has a template


# ---- Operations


def scrape(url):
    """/metrics parsed by prometheus_client's own text parser: {(sample name, labels): value}."""
    parser = pytest.importorskip("prometheus_client.parser")
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in parser.text_string_to_metric_families(text) for sample in family.samples}


@pytest.mark.slow
def test_metrics_count_the_requests_of_a_16_stream_load(server, client, server_log):
    """GET /metrics, read by Prometheus' text parser while 16 streams run (2 slots: some wait)
    and after: the counters grew by exactly the requests, prompt tokens and tokens sent; the
    log's throughput lines (every 0.5 s here) counted every token the load was sent, with at most 2 running."""
    import re

    import concurrent.futures

    completions = ("meshformer:requests_total", (("path", "/v1/completions"), ("status", "200")))
    before = scrape(server)

    def one(i):
        chunks = list(client.completions.create(model="chatty", prompt=f"Stream {i}:", max_tokens=24, temperature=1, seed=i,
                                                stream=True, stream_options={"include_usage": True}))
        return chunks[-1].usage

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(one, i) for i in range(16)]
        during = []
        while not all(f.done() for f in futures):
            during.append(scrape(server))
            time.sleep(0.2)
        usages = [f.result() for f in futures]
    after = scrape(server)
    busy = [m[("meshformer:num_requests_running", ())] + m[("meshformer:num_requests_waiting", ())] for m in during]
    assert max(busy) > 2 and max(m[("meshformer:num_requests_running", ())] for m in during) == 2, busy

    def grew(name, labels=()):
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert grew(*completions) == 16
    assert grew("meshformer:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert grew("meshformer:generation_tokens_total") == sum(u.completion_tokens for u in usages) > 16
    assert grew("meshformer:time_to_first_token_seconds_count") == 16
    assert grew("meshformer:time_per_output_token_seconds_count") == sum(u.completion_tokens - 1 for u in usages)
    time.sleep(1.0)  # a line for the load's last interval
    pattern = (r"throughput: prompt ([\d.]+) tokens/s, generation ([\d.]+) tokens/s, running (\d+), waiting (\d+) \(last 0.5 s\)")
    lines = [tuple(map(float, m.groups())) for m in re.finditer(pattern, server_log.read_text())]
    assert lines and max(line[1] for line in lines) > 0 and {line[2] for line in lines} <= {0, 1, 2}, lines
    assert sum(line[1] for line in lines) * 0.5 >= sum(u.completion_tokens for u in usages), lines  # every token sampled counted

# ---- Structured output

CARD = {"type": "object", "properties": {"n": {"type": "string", "maxLength": 5}, "a": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "t": {"type": "array", "items": {"enum": ["x", "yz"]}, "maxItems": 3}, "b": {"type": "boolean"}},
        "required": ["n", "a", "t", "b"], "additionalProperties": False}


def test_json_schema_replies_parse_and_validate_at_temperature_1(client):
    """response_format json_schema: 20 chats sampled at temperature 1 from a model that knows
    no JSON all parse and validate (jsonschema), within 40 tokens; the same chats without it
    do not parse. json_object streamed: an object. The SDK's parse() with a pydantic model."""
    jsonschema = pytest.importorskip("jsonschema")
    pydantic = pytest.importorskip("pydantic")
    card = {"type": "json_schema", "json_schema": {"name": "card", "schema": CARD, "strict": True}}
    texts = []
    for i in range(20):
        chat = dict(model="chatty", messages=[{"role": "user", "content": f"C{i}"}], temperature=1, max_tokens=40, seed=i)
        reply = client.chat.completions.create(**chat, response_format=card).choices[0]
        jsonschema.validate(json.loads(reply.message.content), CARD)
        texts.append(reply.message.content)
        plain = client.chat.completions.create(**chat).choices[0].message.content
        with pytest.raises(ValueError):
            json.loads(plain)
    assert len(set(texts)) == 20, texts
    stream = client.chat.completions.create(model="chatty", messages=[{"role": "user", "content": "Obj"}], temperature=1, max_tokens=30,
                                            seed=3, response_format={"type": "json_object"}, stream=True)
    assert isinstance(json.loads("".join(c.choices[0].delta.content or "" for c in stream)), dict)

    class Card(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=4)
        age: int = pydantic.Field(ge=0, le=120)
        ok: bool

    parsed = client.chat.completions.parse(model="chatty", messages=[{"role": "user", "content": "P"}], temperature=1, max_tokens=40,
                                           seed=1, response_format=Card).choices[0].message.parsed
    assert isinstance(parsed, Card) and 0 <= parsed.age <= 120 and len(parsed.name) <= 4


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("chromium") and shutil.which("chromedriver")), reason="needs Debian's chromium and chromium-driver")
def test_the_page_chats_in_a_real_browser(server, client, tmp_path):
    """Headless chromium: the page shows the chat box (the model has a template), sends
    two user turns greedily, and shows the replies the API gives for that conversation."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    find = lambda id: driver.find_element(By.ID, id)  # noqa: E731
    try:
        driver.get(server + "/")
        deadline = time.time() + 30
        while not find("chat").is_displayed():
            assert time.time() < deadline
            time.sleep(0.1)
        find("chat").click()
        for id, value in (("temperature", "0"), ("max_tokens", "8")):
            find(id).clear()
            find(id).send_keys(value)
        conversation, replies = [], []
        for said in ("Hi!", "Go on"):
            find("prompt").clear()
            find("prompt").send_keys(said)
            find("go").click()
            deadline = time.time() + 120
            while "tokens in" not in find("status").text or find("go").get_attribute("disabled"):
                assert time.time() < deadline and "error" not in find("status").get_attribute("class"), find("status").text
                time.sleep(0.1)
            replies.append(driver.execute_script("return document.getElementById('completion').textContent"))
            conversation.append({"role": "user", "content": said})
            expected = client.chat.completions.create(model="chatty", messages=conversation, temperature=0, max_tokens=8)
            assert replies[-1] == expected.choices[0].message.content
            conversation.append({"role": "assistant", "content": replies[-1]})
        assert replies[0] != replies[1] and "user: Go on" in find("output").text
    finally:
        driver.quit()
