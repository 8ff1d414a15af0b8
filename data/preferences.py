"""Preference pairs for direct preference optimization (--train.objective dpo, parallel/dpo.py):
a prompt with a chosen and a rejected reply, each rendered as a conversation by the chat
template and tokenized as data/conversations.py does (the reply's tokens the only targets).

    --data.preferences PATH    JSONL, one {"prompt": ..., "chosen": "...", "rejected": "..."} a line;
                               the prompt a string (one user message) or a list of messages
    --data.preferences plays   the plays' conversations (conversations.play_conversations): the
                               prompt a character's speech, chosen the next character's real
                               reply, rejected the same reply with its words shuffled (replies
                               of four words or more). What that teaches: the same words, so
                               only their order tells the two apart, the order the plays write.
                               (The reply to another speech as the rejected one, which only its
                               fit to the prompt tells apart, is not learnt by the tiny model in
                               200 steps: docs/data.md.)

Rows 2i and 2i + 1 of a batch are pair i's chosen and rejected rows (seq_len + 1 tokens each);
pairs are drawn as conversations.ConversationData draws rows (seeded, mesh-independent), so a
batch holds batch_size / 2 pairs. Held out: the plays of shakespeare.VAL_PLAYS; of a JSONL
file, every conversations.VAL_EVERY-th pair.
"""


import numpy as np

from data.conversations import (PLAYS, ConversationData, as_row, chat_template, encode_conversation, jsonl_records, open_conversations,
                                play_conversations, train_and_val)
from data.shards import get_tokenizer
from utils import ConfigError


def shuffled_words(text, seed):
    """`text`'s words in a seeded order, its line breaks kept where they were."""
    words = text.split(" ")
    np.random.default_rng(seed).shuffle(words)
    return " ".join(words)


def play_preferences():
    """{"train" | "val": [(where, prompt messages, chosen, rejected)]} from the plays."""
    splits = {}
    for split, conversations in play_conversations().items():
        splits[split] = [(where, messages[:1], messages[1]["content"], shuffled_words(messages[1]["content"], i))
                         for i, (where, messages) in enumerate(conversations) if messages[1]["content"].count(" ") >= 3]
    return splits


def read_preferences(path):
    """[(where, prompt messages, chosen, rejected)] of a JSONL file; ConfigError (one line) for a bad line."""
    out = []
    for where, record in jsonl_records(path, "--data.preferences", '{"prompt", "chosen", "rejected"}'):
        if not (isinstance(record, dict) and all(isinstance(record.get(k), str) for k in ("chosen", "rejected"))
                and isinstance(record.get("prompt"), (str, list))):
            raise ConfigError(f"{where}: expected {{\"prompt\": a string or a list of messages, \"chosen\": a string, "
                              "\"rejected\": a string}")
        prompt = record["prompt"]
        out.append((where, [dict(role="user", content=prompt)] if isinstance(prompt, str) else prompt,
                    record["chosen"], record["rejected"]))
    if not out:
        raise ConfigError(f"--data.preferences {path}: the file holds no pair")
    return out


class PreferenceData(ConversationData):
    """Pairs [N, 2, seq_len + 1] (chosen, rejected) served as rows: row r of a batch is member
    r % 2 of the batch's pair r // 2."""

    def batch(self, split, step, batch_size, seq_len, seed, rows=None):
        rows = np.arange(batch_size) if rows is None else np.asarray(rows)
        pairs = super().batch(split, step, batch_size // 2, seq_len, seed, rows=rows // 2)
        return pairs[np.arange(len(rows)), rows % 2]

    def eval_batches(self, n_batches, batch_size, seq_len, rows=None):
        rows = np.arange(batch_size) if rows is None else np.asarray(rows)
        for pairs in super().eval_batches(n_batches, batch_size // 2, seq_len, rows=rows // 2):
            yield pairs[np.arange(len(rows)), rows % 2]


def open_preferences(cfg, process_index=0):
    """The PreferenceData of --data.preferences, tokenized for cfg.model.seq_len. A pair
    whose chosen or rejected conversation is longer than a row is a ConfigError (the plays
    keep only the pairs that fit)."""
    tokenizer = get_tokenizer(cfg.data.tokenizer, cfg.data.encoding_file)
    source, row_len = cfg.data.preferences, cfg.model.seq_len + 1
    chat = chat_template(cfg, tokenizer, plays=source == PLAYS)
    if source == PLAYS:
        splits = play_preferences()
    else:
        splits = train_and_val(read_preferences(source))
    pairs = {}
    for split, records in splits.items():
        table = []
        for where, prompt, chosen, rejected in records:
            encoded = [encode_conversation(chat, tokenizer, prompt + [dict(role="assistant", content=reply)], where)
                       for reply in (chosen, rejected)]
            longest = max(len(ids) for ids, _ in encoded)
            if longest > row_len and source == PLAYS:
                continue
            if longest > row_len:
                raise ConfigError(f"{where}: {longest} tokens rendered, more than --model.seq_len + 1 = {row_len}: raise "
                                  "--model.seq_len or shorten the pair")
            table.append([as_row(ids, trained, row_len, tokenizer.eot_id) for ids, trained in encoded])
        if not table:
            raise ConfigError(f"--data.preferences {source}: no {split} pair fits --model.seq_len + 1 = {row_len} tokens")
        pairs[split] = np.asarray(table, np.int32)
    if process_index == 0:
        print(f"preferences {source}: {len(pairs['train']):,} train pairs, {len(pairs['val']):,} held out, rows of {row_len} "
              f"tokens, template {chat.source}", flush=True)
    return PreferenceData(pairs, tokenizer)


def open_objective_data(cfg, process_index=0):
    """What --train.objective sft (conversations) or dpo (preference pairs) trains on: main.py's one door to both."""
    return (open_preferences if cfg.train.objective == "dpo" else open_conversations)(cfg, process_index)
