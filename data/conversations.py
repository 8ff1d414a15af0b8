"""Conversations for supervised fine-tuning (--train.objective sft): each rendered by the
model's chat template, the text the server builds (serving/chat.py), and tokenized with the
assistant's tokens marked as the only targets the loss counts.

    --data.conversations PATH    JSONL, one {"messages": [{"role": ..., "content": ...}, ...]} a line
    --data.conversations plays   one character's speech (user) and the next character's reply
                                 (assistant), from the embedded Shakespeare (data/shakespeare.py)

The template: --serve.chat_template's (a Jinja file or a Hugging Face directory), else that of
--train.init_from hf:DIR, else (plays only) serving/play.jinja. An assistant message's tokens
are those the template puts between the prompt (the messages before it, with the generation
prompt) and the end of its turn (the messages through it, without); the end-of-text token
closes a conversation that ends on the assistant's turn unless the template ends it with one
of its end tokens, so that a reply learns to stop where the server stops.

Conversations are packed into rows of seq_len + 1 tokens in their order (a row takes the
next while it fits), the rest of a row padded with end-of-text tokens the loss skips; none
attends to another, and each runs at its own positions (ops/packing.py), so a packed row
trains what its conversations would one per row. A row stores a target the loss skips as
~id < 0 (model.unmasked), and a conversation's first token with utils.SEGMENT_START set.
Row r of step s is packed row perm_e[(s B + r) mod N] with a seeded permutation per epoch
e: it depends only on (seed, step, batch size, data), never on the mesh. Held out for eval:
the plays of shakespeare.VAL_PLAYS; of a JSONL file, every VAL_EVERY-th conversation.
"""

import functools
import json
import os

import numpy as np

from data import shakespeare
from data.shards import get_tokenizer
from utils import HF_PREFIX, SEGMENT_START, ConfigError

PLAYS = "plays"
PLAY_TEMPLATE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "serving", "play.jinja")
VAL_EVERY = 20  # a JSONL file's conversations i with i % VAL_EVERY == VAL_EVERY - 1 are the eval set


# ---- Rendering and tokenizing one conversation


def check_messages(messages, where):
    """A conversation's messages as the template takes them; ConfigError (one line) otherwise."""
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"{where}: \"messages\" must be a non-empty list of {{\"role\": ..., \"content\": ...}}")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ConfigError(f"{where}: messages[{i}] must have a string role and a string content")
    if not any(m["role"] == "assistant" for m in messages):
        raise ConfigError(f"{where}: no assistant message, so nothing to train on (SFT learns the assistant's turns)")
    return messages


def render(chat, messages, add_generation_prompt, where):
    from serving.chat import TemplateRefused
    try:
        return chat.render(messages, add_generation_prompt)
    except TemplateRefused as e:
        raise ConfigError(f"{where}: the chat template {chat.source} refuses it: {e}") from None


def assistant_spans(chat, messages, where):
    """The whole conversation's text and the [start, end) character spans of the assistant's
    turns in it."""
    text = render(chat, messages, False, where)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt, through = render(chat, messages[:i], True, where), render(chat, messages[:i + 1], False, where)
        if not (text.startswith(through) and through.startswith(prompt)):
            raise ConfigError(f"{where}: the chat template {chat.source} does not render it turn by turn (messages[{i}]'s "
                              "prompt is not a prefix of the conversation's text), so its tokens cannot be told apart")
        spans.append((len(prompt), len(through)))
    return text, spans


def encode_conversation(chat, tokenizer, messages, where):
    """(ids, trained) of one conversation: int32 token ids and whether each is an assistant's
    token (a target the loss counts)."""
    text, spans = assistant_spans(chat, check_messages(messages, where), where)
    ids, trained, at = [], [], 0
    for start, end in spans + [(len(text), len(text))]:
        for piece, is_assistant in ((text[at:start], False), (text[start:end], True)):
            piece_ids = chat.encode(chat.pieces(piece), tokenizer)
            ids += piece_ids
            trained += [is_assistant] * len(piece_ids)
        at = end
    if messages[-1]["role"] == "assistant" and (not ids or ids[-1] not in chat.end_ids):
        ids, trained = ids + [tokenizer.eot_id], trained + [True]
    return np.asarray(ids, np.int32), np.asarray(trained, bool)


def as_row(ids, trained, row_len, eot_id):
    """One row of row_len tokens: the conversation, then padding; each token whose target
    the loss skips (not the assistant's, or padding) stored as ~id."""
    row = np.full(row_len, ~eot_id, np.int32)
    row[:len(ids)] = np.where(trained, ids, ~ids)
    return row


def packed_rows(conversations, row_len, eot_id):
    """Rows [N, row_len] of (ids, trained) conversations packed in order, each one's first
    token flagged (SEGMENT_START) and skipped as a target: alone in a row it is never one, and
    so no target crosses from one conversation into the next."""
    rows = [np.full(row_len, ~eot_id, np.int32)]  # (padding: skipped end-of-text tokens)
    used = 0
    for ids, trained in conversations:
        if used + len(ids) > row_len:
            rows.append(np.full(row_len, ~eot_id, np.int32))
            used = 0
        rows[-1][used:used + len(ids)] = np.where(trained, ids, ~ids)
        rows[-1][used] = ~(ids[0] | SEGMENT_START)
        used += len(ids)
    return np.stack(rows)


# ---- Sources: a JSONL file, the plays


def jsonl_records(path, flag, lines_of):
    """(where, record) of each non-blank line of a JSONL file; ConfigError (one line) for a missing file or a line
    that is not JSON. `flag` and `lines_of` (what a line holds) name them in the message."""
    if not os.path.isfile(path):
        raise ConfigError(f"{flag} {path}: no such file (give a JSONL file of {lines_of} lines, or plays)")
    with open(path) as f:
        for n, line in enumerate(f, start=1):
            if line.strip():
                try:
                    yield f"{path} line {n}", json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{path} line {n}: not JSON ({e.msg})") from None


def read_jsonl(path):
    """[(where, messages)] of a JSONL file of {"messages": [...]} lines."""
    out = []
    for where, record in jsonl_records(path, "--data.conversations", '{"messages": [...]}'):
        if not isinstance(record, dict) or "messages" not in record:
            raise ConfigError(f"{where}: expected an object with \"messages\"")
        out.append((where, record["messages"]))
    if not out:
        raise ConfigError(f"--data.conversations {path}: the file holds no conversation")
    return out


def speeches(play_text):
    """[(speaker, speech)] of one play as data/shakespeare.markdown_to_text writes it."""
    out = []
    for block in play_text.split("\n\n"):
        head, _, speech = block.partition("\n")
        if head.endswith(":") and speech.strip():
            out.append((head[:-1], speech.strip()))
    return out


@functools.cache
def play_conversations():
    """{"train": [...], "val": [...]} of [(where, messages)]: each speech answered by the next
    speech of another character, the val plays (shakespeare.VAL_PLAYS) held out."""
    splits = {"train": [], "val": []}
    for path in shakespeare.play_files():
        said = speeches(shakespeare.markdown_to_text(path.read_text(encoding="utf-8")))
        split = splits["val" if path.stem in shakespeare.VAL_PLAYS else "train"]
        for i, ((speaker, line), (replier, reply)) in enumerate(zip(said, said[1:])):
            if speaker != replier:
                split.append((f"plays {path.stem} speech {i}", [dict(role="user", content=line),
                                                                  dict(role="assistant", content=reply)]))
    return splits


# ---- The data object main.py trains on (TokenData's interface)


class ConversationData:
    """Tokenized conversations as rows [seq_len + 1] of the deterministic global batch."""

    def __init__(self, rows_by_split, tokenizer):
        self.rows = rows_by_split  # {"train" | "val": int32 [N, seq_len + 1]}
        self.tokenizer_name, self.vocab_size = tokenizer.name, tokenizer.vocab_size
        self.rows_loaded = 0

    def batch(self, split, step, batch_size, seq_len, seed, rows=None):
        """Rows `rows` (default: all) of the global batch of `step`: int32 [len(rows), seq_len + 1]."""
        table = self.rows[split]
        rows = range(batch_size) if rows is None else rows
        picked = []
        for row in rows:
            epoch, index = divmod(step * batch_size + row, len(table))
            picked.append(epoch_order(seed, epoch, len(table))[index])
        self.rows_loaded += len(picked)
        return table[np.asarray(picked, np.int64)]

    def eval_batches(self, n_batches, batch_size, seq_len, rows=None):
        """The fixed eval set: the val conversations in order (from the first again if too few)."""
        table = self.rows["val"]
        rows = range(batch_size) if rows is None else rows
        for b in range(n_batches):
            self.rows_loaded += len(rows)
            yield table[np.asarray([(b * batch_size + r) % len(table) for r in rows], np.int64)]

    def close(self):
        pass


@functools.lru_cache(maxsize=4)
def epoch_order(seed, epoch, n):
    return np.random.default_rng([seed, epoch, 2]).permutation(n)


def chat_template(cfg, tokenizer, plays=None):
    """The ChatTemplate conversations are rendered with (the module docstring says which);
    plays: whether the data is the plays (default: --data.conversations plays)."""
    from serving.chat import load_chat_template
    init_from = cfg.train.init_from
    hf_dir = init_from[len(HF_PREFIX):] if init_from.startswith(HF_PREFIX) else None
    flag = cfg.serve.chat_template or (PLAY_TEMPLATE if (plays or cfg.data.conversations == PLAYS) and not hf_dir else "")
    chat = load_chat_template(hf_dir, flag, tokenizer)
    if chat is None:
        raise ConfigError(f"--train.objective {cfg.train.objective} needs a chat template: give --serve.chat_template (a Jinja file or a Hugging "
                          "Face directory), or --train.init_from hf:DIR of a model that has one")
    return chat


def train_and_val(records):
    """{"train", "val"}: every VAL_EVERY-th record held out (a file too short for both: all in each)."""
    val = [r for i, r in enumerate(records) if i % VAL_EVERY == VAL_EVERY - 1]
    return dict(train=[r for i, r in enumerate(records) if i % VAL_EVERY != VAL_EVERY - 1] or records, val=val or records)


def open_conversations(cfg, process_index=0):
    """The ConversationData of --data.conversations, tokenized for cfg.model.seq_len. A
    conversation longer than a row is a ConfigError (the plays keep only those that fit)."""
    tokenizer = get_tokenizer(cfg.data.tokenizer, cfg.data.encoding_file)
    chat, row_len = chat_template(cfg, tokenizer), cfg.model.seq_len + 1
    source = cfg.data.conversations
    if source == PLAYS:
        splits = play_conversations()
    else:
        splits = train_and_val(read_jsonl(source))
    rows, counts = {}, {}
    for split, conversations in splits.items():
        encoded = []
        for where, messages in conversations:
            ids, trained = encode_conversation(chat, tokenizer, messages, where)
            if len(ids) > row_len and source == PLAYS:
                continue
            if len(ids) > row_len:
                raise ConfigError(f"{where}: {len(ids)} tokens rendered, more than --model.seq_len + 1 = {row_len}: raise "
                                  "--model.seq_len or shorten the conversation")
            encoded.append((ids, trained))
        if not encoded:
            raise ConfigError(f"--data.conversations {source}: no {split} conversation fits --model.seq_len + 1 = {row_len} tokens")
        rows[split], counts[split] = packed_rows(encoded, row_len, tokenizer.eot_id), len(encoded)
    if process_index == 0:
        print(f"conversations {source}: {counts['train']:,} train, {counts['val']:,} held out, packed in "
              f"{len(rows['train']):,} + {len(rows['val']):,} rows of {row_len} tokens, template {chat.source}", flush=True)
    return ConversationData(rows, tokenizer)
