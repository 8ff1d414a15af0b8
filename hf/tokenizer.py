"""The tokenizer of a Hugging Face export: tokenizer.json (the `tokenizers` library's
format, written out directly, no tiktoken or transformers needed) and
tokenizer_config.json, which AutoTokenizer loads with our ids.
"""

import json
import os


def tokenizer_json(tokenizer):
    """tokenizer.json (the `tokenizers` library's format, written out directly) for our
    byte tokenizer or a tiktoken encoding: byte-level BPE, ids = our ids."""
    byte_char = bytes_to_unicode()

    def text(token_bytes):
        return "".join(byte_char[b] for b in token_bytes)

    encoding = tokenizer._encoding
    if encoding is None:  # bytes: id = byte value, no merges, no split pattern
        vocab, merges, pre = {byte_char[b]: b for b in range(256)}, [], []
        specials = {"<|endoftext|>": tokenizer.eot_id}
    else:  # tiktoken: its ranks are its ids; merges as transformers' TikTokenConverter derives them
        ranks = encoding._mergeable_ranks
        vocab, merges = {text(t): r for t, r in ranks.items()}, []
        for token, rank in ranks.items():
            pairs = [(token[:j], token[j:]) for j in range(1, len(token)) if token[:j] in ranks and token[j:] in ranks]
            merges += [(ranks[a], ranks[b], rank, a, b) for a, b in pairs]
        merges = [[text(a), text(b)] for *_, a, b in sorted(merges, key=lambda x: (x[2], x[0], x[1]))]
        pre = [{"type": "Split", "pattern": {"Regex": encoding._pat_str}, "behavior": "Isolated", "invert": False}]
        specials = dict(encoding._special_tokens)
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for s, i in sorted(specials.items(), key=lambda x: x[1])],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": pre + [byte_level]},
        "post_processor": dict(byte_level, trim_offsets=False),
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": vocab, "merges": merges},
    }


def bytes_to_unicode():
    """GPT-2's map from the 256 byte values to printable characters (byte-level BPE)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def write_tokenizer(out_dir, tokenizer, max_length):
    """tokenizer.json + tokenizer_config.json, which AutoTokenizer loads (no tiktoken
    or transformers needed here to write them)."""
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                        "pad_token": "<|endoftext|>", "model_max_length": max_length, "clean_up_tokenization_spaces": False}
    with open(os.path.join(out_dir, "tokenizer.json"), "w") as f:
        json.dump(tokenizer_json(tokenizer), f, ensure_ascii=False)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config, f, indent=2)
