"""Guided decoding for `response_format`: a JSON schema (or "any JSON object") becomes, at
every step, the set of tokens that keep the output a prefix of a document that validates.

The schema is compiled into nodes (tuples), and the text generated so far into a stack of
frames (tuples too, so a state is hashable and its mask can be cached). A frame reads one
byte at a time: `step` says whether it takes the byte, hands it to the frame below (it is
complete: an integer ends at the comma after it), or refuses it. A token is allowed when
all of its bytes are taken, found by walking a trie of the vocabulary's byte strings
(`TokenTrie`) so that tokens sharing a prefix share the work. Every byte value is a token
of its own in our tokenizers (bytes, tiktoken), so `min_bytes` (the fewest bytes that
complete a state) is also the fewest tokens: a token is allowed only when what it leaves
can still be completed within max_tokens, so a guided reply always parses, even when it
hits its length.

Output is compact JSON (no whitespace between tokens), the properties of an object in the
schema's order, every one of them present. The subset of JSON Schema read here is
SUPPORTED; any other keyword is refused (SchemaRefused, a 400) rather than ignored.
"""

import functools
import json
import math
from collections import OrderedDict

import numpy as np

SUPPORTED = ("type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems", "minLength",
             "maxLength", "minimum", "maximum", "enum", "const", "anyOf", "$ref")
ANNOTATIONS = ("title", "description", "$schema", "$id", "$comment", "examples", "default")  # read by people, not by the guide
DEFINITIONS = ("$defs", "definitions")  # where a $ref points ("#/$defs/Name": pydantic's nested models), read at the root
ESCAPES = b'"\\/bfnrt'
DIGITS = b"0123456789"
MAX_INT_DIGITS = 15  # an unbounded integer: at most this many digits (int64 range, and floats hold it exactly)
MAX_DEPTH = 32  # nesting of a free-form (json_object) value


class SchemaRefused(Exception):
    """The schema uses what the guide cannot honour: the message names it."""


# ---- Schema -> nodes: ("lit", bytes) ("choice", alternatives) ("str", lo, hi) ("int", lo, hi) ("num",)
#      ("seq", parts) ("arr", item, lo, hi) ("any", depth) ("alt", nodes: their first bytes apart)
#      ("switch", ((key bytes, node), ...)): a key, then its node (keys prefix-free: a forced tool call's name)


def literal(value):
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def compile_schema(schema, where="schema", defs=None, refs=()):
    """A JSON schema (dict) -> its node, or SchemaRefused naming the keyword and where it is. `defs`: the root's
    definitions ($ref's targets, inlined; `refs` those being inlined, so that a recursive one is refused)."""
    if not isinstance(schema, dict):
        raise SchemaRefused(f"{where} must be a JSON object (a schema), got {json.dumps(schema)[:40]}")
    if defs is None:
        defs = {name: sub for key in DEFINITIONS if isinstance(schema.get(key), dict) for name, sub in schema[key].items()}
        schema = {k: v for k, v in schema.items() if k not in DEFINITIONS}
    if "$ref" in schema:
        return compile_ref(schema, where, defs, refs)
    unknown = [k for k in schema if k not in SUPPORTED and k not in ANNOTATIONS]
    if unknown:
        raise SchemaRefused(f"{where}: the keyword {unknown[0]!r} is not supported here (supported: {', '.join(SUPPORTED)})")
    if "anyOf" in schema:
        return compile_any_of(schema, where, defs, refs)
    if "const" in schema:
        return ("choice", (literal(schema["const"]),))
    if "enum" in schema:
        if not schema["enum"]:
            raise SchemaRefused(f"{where}.enum is empty: nothing could validate")
        return ("choice", tuple(dict.fromkeys(literal(v) for v in schema["enum"])))
    kind = schema.get("type")
    if kind is None:
        return ("any", MAX_DEPTH)
    if kind == "string":
        return ("str", *bounds(schema, "minLength", "maxLength", where, 0))
    if kind == "integer":
        lo, hi = bounds(schema, "minimum", "maximum", where)
        return ("int", None if lo is None else math.ceil(lo), None if hi is None else math.floor(hi))
    if kind in ("number", "boolean", "null"):
        if kind == "number" and ("minimum" in schema or "maximum" in schema):
            raise SchemaRefused(f"{where}: minimum/maximum are supported on integers only")
        return {"number": ("num",), "boolean": ("choice", (b"true", b"false")), "null": ("choice", (b"null",))}[kind]
    if kind == "array":
        item = compile_schema(schema.get("items", {}), f"{where}.items", defs, refs)
        return ("arr", item, *bounds(schema, "minItems", "maxItems", where, 0))
    if kind == "object":
        return compile_object(schema, where, defs, refs)
    raise SchemaRefused(f"{where}.type: {json.dumps(kind)} is not supported here (one type of string, integer, number, "
                        "boolean, null, array, object)")


def compile_ref(schema, where, defs, refs):
    """{"$ref": "#/$defs/Name"} (or #/definitions/): the definition, inlined; a recursive one is refused (its
    documents have no bound the masks could count down)."""
    ref, others = schema["$ref"], [k for k in schema if k not in ANNOTATIONS and k != "$ref"]
    name = next((ref[len(f"#/{key}/"):] for key in DEFINITIONS if isinstance(ref, str) and ref.startswith(f"#/{key}/")), None)
    if others or name not in defs:
        raise SchemaRefused(f"{where}.$ref must name one of the root's $defs (#/$defs/Name) with no keyword beside it, got "
                            f"{json.dumps(ref)}" + (f" beside {others[0]!r}" if others else ""))
    if name in refs:
        raise SchemaRefused(f"{where}.$ref: {name} refers to itself: recursive schemas are not supported")
    return compile_schema(defs[name], f"{where}.$ref({name})", defs, refs + (name,))


def compile_any_of(schema, where, defs, refs):
    """anyOf (pydantic's Optional[X] is X or null): alternatives whose documents begin with different bytes, so that
    the first byte picks one and the rest is read deterministically; SchemaRefused when two may begin alike."""
    others = [k for k in schema if k not in ANNOTATIONS and k != "anyOf"]
    if others or not isinstance(schema["anyOf"], list) or not schema["anyOf"]:
        raise SchemaRefused(f"{where}.anyOf must be a non-empty list of schemas with no other keyword beside it"
                            + (f" (found {others[0]!r})" if others else ""))
    nodes = tuple(dict.fromkeys(compile_schema(sub, f"{where}.anyOf[{i}]", defs, refs) for i, sub in enumerate(schema["anyOf"])))
    seen = {}
    for i, node in enumerate(nodes):
        for b in first_bytes(node):
            if b in seen:
                raise SchemaRefused(f"{where}.anyOf: alternatives {seen[b]} and {i} may both begin with {chr(b)!r}: the "
                                    "alternatives must begin differently (as X or null does)")
            seen[b] = i
    return nodes[0] if len(nodes) == 1 else ("alt", nodes)


def first_bytes(node):
    return [b for b in range(256) if advance(start_state(node), b) is not None]


def bounds(schema, low, high, where, default=None):
    """(schema[low], schema[high]): numbers (counts, when default is 0: whole and >= 0), low <= high;
    else SchemaRefused."""
    lo, hi = schema.get(low, default), schema.get(high)
    for name, value in ((low, lo), (high, hi)):
        count = default == 0
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or count and (value < 0 or value != int(value))):
            raise SchemaRefused(f"{where}.{name} must be a {'count' if count else 'number'}, got {json.dumps(value)}")
    if lo is not None and hi is not None and lo > hi:
        raise SchemaRefused(f"{where}: {low} {lo} is over {high} {hi}: nothing could validate")
    return (lo, hi) if not count else (int(lo), None if hi is None else int(hi))


def compile_object(schema, where, defs, refs):
    """An object with `properties`: every property, in order (a sequence of literals and values);
    without: any object."""
    properties = schema.get("properties")
    if properties is None:
        return ("any-object", MAX_DEPTH)
    missing = [name for name in schema.get("required", []) if name not in properties]
    if missing:
        raise SchemaRefused(f"{where}.required names {missing[0]!r}, which is not in its properties")
    parts, opener = [], b"{"
    for name, sub in properties.items():
        parts += [("lit", opener + literal(name) + b":"), compile_schema(sub, f"{where}.properties.{name}", defs, refs)]
        opener = b","
    parts.append(("lit", b"}" if parts else b"{}"))
    return ("seq", tuple(parts))


# ---- Frames: a node being read. step(frame, byte) -> None (refused) or (frames replacing it, taken?)


def frame_of(node):
    """The fresh frame that reads `node`."""
    kind = node[0]
    if kind == "lit":
        return ("lit", node[1], 0)
    if kind == "choice":
        return ("choice", node[1], b"")
    if kind == "str":
        return ("str", node[1], node[2], 0, "open")
    if kind == "int":
        return ("int", node[1], node[2], b"")
    if kind == "num":
        return ("num", "start")
    if kind == "arr":
        return ("arr", node[1], node[2], node[3], 0, "open")
    if kind == "switch":
        return ("switch", node[1], b"")
    return node  # seq, any, any-object: read by their own step


def step(frame, b):
    return STEPS[frame[0]](frame, b)


def step_lit(frame, b):
    _, text, i = frame
    if text[i] != b:
        return None
    return ((("lit", text, i + 1),) if i + 1 < len(text) else (), True)


def step_alt(frame, b):
    """The one alternative whose document begins with b, as it stands after b."""
    for node in frame[1]:
        stack = advance(start_state(node), b)
        if stack is not None:
            return stack, True
    return None


def step_switch(frame, b):
    """One more byte of a key; once a whole key is read, its node."""
    _, cases, prefix = frame
    longer = prefix + bytes([b])
    matching = [(key, node) for key, node in cases if key.startswith(longer)]
    if not matching:
        return None
    if matching[0][0] == longer:  # (keys are prefix-free: the only match)
        return (frame_of(matching[0][1]),), True
    return (("switch", cases, longer),), True


def step_choice(frame, b):
    _, alternatives, prefix = frame
    longer = prefix + bytes([b])
    if any(a.startswith(longer) for a in alternatives):
        more = any(len(a) > len(longer) and a.startswith(longer) for a in alternatives)
        return ((("choice", alternatives, longer),) if more else (), True)
    return ((), False) if prefix in alternatives else None


def utf8_tail(b):
    """(continuation bytes due, the range of the next one) after UTF-8 lead byte b (None: not
    a lead byte); the ranges rule out overlong forms, surrogates and code points past U+10FFFF."""
    if 0xC2 <= b <= 0xDF:
        return (1, 0x80, 0xBF)
    if 0xE0 <= b <= 0xEF:
        return (2, 0xA0 if b == 0xE0 else 0x80, 0x9F if b == 0xED else 0xBF)
    if 0xF0 <= b <= 0xF4:
        return (3, 0x90 if b == 0xF0 else 0x80, 0x8F if b == 0xF4 else 0xBF)
    return None


def step_str(frame, b):
    """A string of lo..hi characters: an escape or a UTF-8 character counts one."""
    _, lo, hi, n, phase = frame
    if phase == "open":
        return ((("str", lo, hi, 0, "body"),), True) if b == ord('"') else None
    if phase == "escape":
        return ((("str", lo, hi, n, "body"),), True) if b in ESCAPES else None
    if isinstance(phase, tuple):  # continuation bytes still due
        due, low, high = phase
        return ((("str", lo, hi, n, (due - 1, 0x80, 0xBF) if due > 1 else "body"),), True) if low <= b <= high else None
    if b == ord('"'):
        return ((), True) if n >= lo else None
    if b < 0x20 or (hi is not None and n >= hi):
        return None
    if b == ord("\\"):
        return ((("str", lo, hi, n + 1, "escape"),), True)
    if b < 0x80:
        return ((("str", lo, hi, n + 1, "body"),), True)
    tail = utf8_tail(b)
    return ((("str", lo, hi, n + 1, tail),), True) if tail else None


def int_extra_digits(text, lo, hi):
    """The fewest bytes to append to `text` (a prefix of an integer) for a value in [lo, hi]
    (None: none do)."""
    if text == b"":  # a digit first, or a minus sign
        options = [int_extra_digits(b"-", lo, hi), magnitude_digits(b"", False, lo, hi)]
        return min([k + 1 for k in options[:1] if k is not None] + [k for k in options[1:] if k is not None], default=None)
    return magnitude_digits(text.lstrip(b"-"), text.startswith(b"-"), lo, hi)


def magnitude_digits(digits, negative, lo, hi):
    """The fewest digits to append to `digits` for a value (negated when `negative`) in [lo, hi]."""
    for k in range(0 if digits else 1, MAX_INT_DIGITS - len(digits) + 1):
        if digits == b"0" and k:
            return None  # 0 takes no more digits
        if digits:
            low = int(digits) * 10**k
            high = low + 10**k - 1
        else:  # k digits, no leading zero (and no -0)
            low, high = (10 ** (k - 1) if k > 1 or negative else 0), 10**k - 1
        low, high = (-high, -low) if negative else (low, high)
        if (hi is None or low <= hi) and (lo is None or high >= lo):
            return k
    return None


def step_int(frame, b):
    _, lo, hi, text = frame
    longer = text + bytes([b])
    if b in DIGITS or (b == ord("-") and text == b""):
        if longer == b"-0" or (longer.lstrip(b"-").startswith(b"0") and len(longer.lstrip(b"-")) > 1):
            return None  # no leading zeros, no -0
        return ((("int", lo, hi, longer),), True) if int_extra_digits(longer, lo, hi) is not None else None
    return ((), False) if int_extra_digits(text, lo, hi) == 0 else None


# A JSON number's grammar as a DFA: state -> {byte class: state}; COMPLETE states may end it.
NUMBER = {"start": {"-": "minus", "0": "zero", "1": "int"}, "minus": {"0": "zero", "1": "int"}, "zero": {".": "dot", "e": "exp"},
          "int": {"0": "int", "1": "int", ".": "dot", "e": "exp"}, "dot": {"0": "frac", "1": "frac"},
          "frac": {"0": "frac", "1": "frac", "e": "exp"}, "exp": {"+": "sign", "-": "sign", "0": "exp_digits", "1": "exp_digits"},
          "sign": {"0": "exp_digits", "1": "exp_digits"}, "exp_digits": {"0": "exp_digits", "1": "exp_digits"}}
NUMBER_COMPLETE = {"zero": 0, "int": 0, "frac": 0, "exp_digits": 0, "start": 1, "minus": 1, "dot": 1, "exp": 1, "sign": 1}


def number_class(b):
    return "0" if b == ord("0") else "1" if b in DIGITS else "e" if b in b"eE" else chr(b)


def step_num(frame, b):
    state = NUMBER[frame[1]].get(number_class(b))
    if state is not None:
        return ((("num", state),), True)
    return ((), False) if NUMBER_COMPLETE[frame[1]] == 0 else None


def step_arr(frame, b):
    """[item,item,...] with lo..hi items."""
    _, item, lo, hi, count, phase = frame
    closing = ((), True) if b == ord("]") and count >= lo else None
    if phase == "open":
        return ((("arr", item, lo, hi, 0, "first"),), True) if b == ord("[") else None
    if phase == "first":
        if closing or (hi is not None and hi == 0):
            return closing
        return ((("arr", item, lo, hi, 1, "next"), frame_of(item)), False)
    if b == ord(",") and (hi is None or count < hi):
        return ((("arr", item, lo, hi, count + 1, "next"), frame_of(item)), True)
    return closing


def step_any(frame, b):
    """Any JSON value (json_object's values), told apart by its first byte."""
    depth = frame[1]
    c = chr(b)
    if c == "{" and depth > 0:
        return ((("any-object", depth - 1),), False)
    if c == "[" and depth > 0:
        return ((("arr", ("any", depth - 1), 0, None, 0, "open"),), False)
    if c == '"':
        return ((frame_of(("str", 0, None)),), False)
    if b in b"-" + DIGITS:
        return ((("num", "start"),), False)
    if c in "tfn":
        return ((("choice", (b"true", b"false", b"null"), b""),), False)
    return None


def step_any_object(frame, b):
    """{"key":value,...}, any keys and values; phases in frame[2:]."""
    depth, phase = frame[1], frame[2] if len(frame) > 2 else "open"
    value = (("any-object", depth, "after"), ("any", depth), ("lit", b":", 0), ("str", 0, None, 0, "open"))
    if phase == "open":
        return ((("any-object", depth, "first"),), True) if b == ord("{") else None
    if phase == "first":
        return ((), True) if b == ord("}") else (value, False) if b == ord('"') else None
    return ((), True) if b == ord("}") else (value, True) if b == ord(",") else None


STEPS = {"lit": step_lit, "choice": step_choice, "str": step_str, "int": step_int, "num": step_num, "arr": step_arr,
         "any": step_any, "any-object": step_any_object, "alt": step_alt, "switch": step_switch}


# ---- The fewest bytes that complete a frame or a node (what max_tokens must leave room for)


@functools.lru_cache(maxsize=None)
def node_min(node):
    kind = node[0]
    if kind == "seq":
        return sum(node_min(part) for part in node[1])
    if kind == "any":
        return 1  # a digit
    if kind == "any-object":
        return 2
    if kind == "alt":
        return min(node_min(alternative) for alternative in node[1])
    if kind == "switch":
        return min(len(key) + node_min(case) for key, case in node[1])
    return frame_min(frame_of(node))


def frame_min(frame):
    kind = frame[0]
    if kind == "lit":
        return len(frame[1]) - frame[2]
    if kind == "choice":
        return min(len(a) - len(frame[2]) for a in frame[1] if a.startswith(frame[2]))
    if kind == "str":
        _, lo, _, n, phase = frame
        left = max(lo - n, 0)
        return 2 + lo if phase == "open" else left + 1 + (1 if phase == "escape" else phase[0] if isinstance(phase, tuple) else 0)
    if kind == "int":
        return int_extra_digits(frame[3], frame[1], frame[2])
    if kind == "num":
        return NUMBER_COMPLETE[frame[1]]
    if kind == "arr":
        _, item, lo, _, count, phase = frame
        items = max(lo - count, 0)
        return (2 if phase == "open" else 1) + items * node_min(item) + max(items - (phase != "next"), 0)
    if kind == "alt":
        return node_min(frame)
    if kind == "switch":
        return min(len(key) - len(frame[2]) + node_min(case) for key, case in frame[1] if key.startswith(frame[2]))
    return node_min(frame) if len(frame) == 2 else 1  # any, any-object before "{"; any-object after it: "}"


# ---- A state: the stack of frames (top last)


def expand(stack):
    """Sequences on top are replaced by their parts (the first on top)."""
    while stack and stack[-1][0] == "seq":
        stack = stack[:-1] + tuple(frame_of(part) for part in reversed(stack[-1][1]))
    return stack


@functools.lru_cache(maxsize=1 << 16)
def advance(stack, b):
    """The stack after byte b, or None when no valid document goes on with it."""
    while True:
        stack = expand(stack)
        if not stack:
            return None  # the document is complete: nothing may follow
        result = step(stack[-1], b)
        if result is None:
            return None
        frames, taken = result
        stack = stack[:-1] + tuple(frames)
        if taken:
            return expand(stack)


def min_bytes(stack):
    return sum(frame_min(frame) for frame in stack)


def start_state(node):
    return expand((frame_of(node),))


# ---- Tokens


class TokenTrie:
    """The vocabulary's byte strings as a trie: {byte: (child, ids ending here)}. Tokens
    without bytes of their own (end-of-text, a chat's special tokens) are not in it."""

    def __init__(self, token_bytes):
        self.root, self.bytes_of = {}, dict(token_bytes)
        for token, text in token_bytes.items():
            node = self.root
            for i, b in enumerate(text):
                child = node.setdefault(b, ({}, []))
                if i == len(text) - 1:
                    child[1].append(token)
                node = child[0]

    def allowed(self, stack):
        """(ids, min_bytes after each) of the tokens whose bytes `stack` takes whole."""
        ids, after = [], []

        def walk(node, stack):
            for b, (child, ending) in node.items():
                next_stack = advance(stack, b)
                if next_stack is None:
                    continue
                if ending:
                    ids.extend(ending)
                    after.extend([min_bytes(next_stack)] * len(ending))
                walk(child, next_stack)

        walk(self.root, stack)
        return np.asarray(ids, np.int64), np.asarray(after, np.int64)


def token_bytes(tokenizer, skip):
    """{id: bytes} of every token with text (ids in `skip`, the special ones, left out)."""
    encoding = tokenizer._encoding
    if encoding is None:
        return {i: bytes([i]) for i in range(256) if i not in skip}
    specials = set(encoding._special_tokens.values())
    return {i: encoding.decode_single_token_bytes(i) for i in range(encoding.n_vocab) if i not in specials | set(skip)}


class Grammar:
    """A compiled response_format over one vocabulary: its start state, the fewest tokens of a
    complete document (`shortest`), and masks cached per state."""

    CACHED_STATES = 4096

    def __init__(self, node, trie):
        self.start, self.trie, self.cache = start_state(node), trie, OrderedDict()
        self.shortest = min_bytes(self.start)

    def allowed(self, stack):
        hit = self.cache.get(stack)
        if hit is None:
            hit = self.cache[stack] = self.trie.allowed(stack)
            if len(self.cache) > self.CACHED_STATES:
                self.cache.popitem(last=False)
        return hit


class Guide:
    """One sequence's place in its grammar. mask(left) -> the bool [vocab] row of the tokens
    it may take with `left` tokens to go (end ids only once the document is complete);
    bias_row(left) -> the logit bias that enforces it over `bias_V` (the request's logit_bias);
    take(token) moves on."""

    def __init__(self, grammar, vocab, end_ids, bias_V):
        self.grammar, self.vocab, self.state, self.bias_V = grammar, vocab, grammar.start, bias_V
        self.end_ids = [t for t in end_ids if 0 <= t < vocab]

    def bias_row(self, left):
        return np.where(self.mask(left), self.bias_V, -np.inf).astype(np.float32)

    def mask(self, left):
        mask_V = np.zeros(self.vocab, bool)
        if self.state is None:  # done: only an end (the sequence is ending anyway)
            mask_V[self.end_ids] = True
            return mask_V
        ids, after = self.grammar.allowed(self.state)
        mask_V[ids[after <= left - 1]] = True
        if min_bytes(self.state) == 0:
            mask_V[self.end_ids] = True
        return mask_V

    def take(self, token):
        if token in self.end_ids or self.state is None:
            self.state = None
            return
        for b in self.grammar.trie.bytes_of.get(token, b"\xff"):  # a token outside the trie: no document goes on
            self.state = advance(self.state, b) if self.state is not None else None


# ---- response_format -> a Grammar, for one served vocabulary


class Grammars:
    """The server's grammars: the vocabulary's trie (built at the first guided request) and
    the compiled response_formats, the most recent CACHED kept."""

    CACHED = 64

    def __init__(self, tokenizer, special_ids):
        self.tokenizer, self.special_ids, self.trie, self.cache = tokenizer, set(special_ids), None, OrderedDict()

    def for_format(self, response_format):
        """OpenAI's response_format ({"type": "text" | "json_object" | "json_schema", "json_schema":
        {"name", "schema", "strict"}}) -> its Grammar, or None for plain text; SchemaRefused
        saying what is wrong."""
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            node = ("any-object", MAX_DEPTH)
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise SchemaRefused('json_schema must be {"name": ..., "schema": {...}}: its schema is missing')
            node = compile_schema(spec["schema"])
        else:
            raise SchemaRefused(f"type must be text, json_object or json_schema, got {json.dumps(kind)}")
        return self.for_node(node)

    def for_node(self, node):
        """A compiled node's Grammar (a forced tool call's: serving/tools.py)."""
        if self.trie is None:
            self.trie = TokenTrie(token_bytes(self.tokenizer, self.special_ids))
        if node not in self.cache:
            self.cache[node] = Grammar(node, self.trie)
            if len(self.cache) > self.CACHED:
                self.cache.popitem(last=False)
        return self.cache[node]
