"""Chat templates: a chat's messages -> the prompt text the model was tuned on, and
that text -> token ids, special tokens as their own ids.

A Hugging Face directory carries its template in tokenizer_config.json ("chat_template":
a string, or a list of named ones of which "default" is used; newer transformers write
chat_template.jinja beside it instead), its special tokens in tokenizer.json's
"added_tokens" (and tokenizer_config.json's "added_tokens_decoder"), and the end of an
assistant's turn as its eos_token (and generation_config.json's eos_token_id). Rendering
is transformers' apply_chat_template: Jinja in an immutable sandbox with trim_blocks and
lstrip_blocks, loop controls, a tojson that does not escape HTML, raise_exception and
strftime_now, the special tokens (bos_token, eos_token, ...) as variables, messages
without their None fields, add_generation_prompt true. Its text is then tokenized as
apply_chat_template tokenizes it (add_special_tokens=False): special tokens are cut out
as their ids, every piece between them goes through the model's own tokenizer.

`--serve.chat_template PATH` gives a template for a model without one (a Jinja file), or
another directory's (a Hugging Face directory: its template, special tokens and eos).
"""

import datetime
import json
import os
import re

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dataset import EOT_TEXT
from utils import ConfigError

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")  # what transformers passes as variables


class TemplateRefused(Exception):
    """The template could not render these messages (its raise_exception, or a message it
    cannot take): the client's to fix."""


class ChatTemplate:
    """A template with the tokens it names: `specials` {text: id}, `variables` (the special
    tokens' texts by name), `end_ids` (the ids that end an assistant's turn)."""

    def __init__(self, source, template, specials, variables, end_ids):
        self.source, self.template, self.specials = source, template, dict(specials)
        self.variables, self.end_ids = dict(variables), set(end_ids)
        self.compiled = environment().from_string(template)
        names = sorted(self.specials, key=len, reverse=True)  # longest first: one special may start another
        self.split_pattern = re.compile("(" + "|".join(map(re.escape, names)) + ")") if names else None

    def render(self, messages, add_generation_prompt=True, tools=None):
        """The prompt text of `messages` (dicts with role and content), ready for the
        assistant's reply (add_generation_prompt false: the conversation as it stands, for
        training on it: data/conversations.py); `tools`: OpenAI's tool list (serving/tools.py)."""
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return self.compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                        documents=None, **self.variables)
        except jinja2.TemplateError as e:
            raise TemplateRefused(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise TemplateRefused(f"{type(e).__name__}: {e}") from None

    def pieces(self, text):
        """`text` cut into [(piece, special id or None)]."""
        parts = self.split_pattern.split(text) if self.split_pattern else [text]
        return [(part, self.specials.get(part) if i % 2 else None) for i, part in enumerate(parts) if part]

    def encode(self, pieces, tokenizer):
        ids = []
        for piece, special in pieces:
            ids += [special] if special is not None else tokenizer.encode(piece)
        return ids

    def decode(self, ids, tokenizer):
        """`ids` as text, the special tokens as their text (encode's inverse)."""
        names = {i: text for text, i in self.specials.items()}
        text, run = "", []
        for t in list(ids) + [None]:
            if t is None or t in names:
                text, run = text + tokenizer.decode(run) + names.get(t, ""), []
            else:
                run.append(t)
        return text


def environment():
    """The Jinja environment of transformers' chat templates (utils/chat_template_utils.py)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


class GenerationTag(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %} (transformers marks the assistant's tokens
    with it for training masks): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


# ---- Loading


def read_json(path):
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def token_text(value):
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def template_text(directory, tokenizer_config):
    """The directory's default chat template, or None."""
    path = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path) as f:
            return f.read()
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates (tool use, RAG, ...): the default one
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    return template or None


def directory_tokens(directory, tokenizer):
    """(specials {text: id}, variables {name: text}, end ids) of a Hugging Face directory."""
    tokenizer_config = read_json(os.path.join(directory, "tokenizer_config.json"))
    specials = {EOT_TEXT: tokenizer.eot_id}
    for token in read_json(os.path.join(directory, "tokenizer.json")).get("added_tokens", []):
        specials[token["content"]] = token["id"]
    for i, token in tokenizer_config.get("added_tokens_decoder", {}).items():
        specials[token_text(token)] = int(i)
    variables = {name: token_text(tokenizer_config[name]) for name in SPECIAL_TOKEN_NAMES if tokenizer_config.get(name)}
    end_ids = {specials[variables["eos_token"]]} if variables.get("eos_token") in specials else set()
    eos = read_json(os.path.join(directory, "generation_config.json")).get("eos_token_id")
    end_ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return specials, variables, end_ids | {tokenizer.eot_id}


def load_chat_template(hf_directory, flag_path, tokenizer):
    """The served model's ChatTemplate, or None when it has none: the one of
    `--serve.chat_template` (flag_path: a Jinja file, or a Hugging Face directory), else
    the imported directory's (hf_directory, from --train.init_from hf:DIR)."""
    specials, variables, end_ids = {EOT_TEXT: tokenizer.eot_id}, {"eos_token": EOT_TEXT}, {tokenizer.eot_id}
    template, source = None, None
    if hf_directory:
        specials, variables, end_ids = directory_tokens(hf_directory, tokenizer)
        template = template_text(hf_directory, read_json(os.path.join(hf_directory, "tokenizer_config.json")))
        source = hf_directory
    if flag_path and os.path.isdir(flag_path):
        specials, variables, end_ids = directory_tokens(flag_path, tokenizer)
        template = template_text(flag_path, read_json(os.path.join(flag_path, "tokenizer_config.json")))
        if template is None:
            raise ConfigError(f"--serve.chat_template {flag_path}: that directory has no chat template "
                              "(tokenizer_config.json's chat_template, or chat_template.jinja)")
        source = flag_path
    elif flag_path:
        if not os.path.isfile(flag_path):
            raise ConfigError(f"--serve.chat_template {flag_path}: no such file (give a Jinja template or a Hugging Face directory)")
        with open(flag_path) as f:
            template, source = f.read(), flag_path
    if template is None:
        return None
    try:
        return ChatTemplate(source, template, specials, variables, end_ids)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"the chat template of {source} does not parse: {e.message} (line {e.lineno})") from None


class ReplyTokenizer:
    """The model's tokenizer for an assistant's reply: the template's special tokens
    decode to nothing (transformers' and vLLM's skip_special_tokens), so a reply never
    shows an <|im_start|> or, for a special id the tokenizer does not have, a U+FFFD."""

    def __init__(self, tokenizer, chat):
        self.tokenizer, self.hidden = tokenizer, set(chat.specials.values())
        self.eot_id, self.vocab_size = tokenizer.eot_id, tokenizer.vocab_size

    def encode(self, text):
        return self.tokenizer.encode(text)

    def decode(self, ids):
        return self.tokenizer.decode([i for i in map(int, ids) if i not in self.hidden])
