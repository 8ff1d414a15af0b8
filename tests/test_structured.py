"""serving/structured.py without a server: random walks through the token masks (every
allowed token drawn at random, as temperature 1 on a model that knows nothing) give text
that parses and validates against its schema (jsonschema), at every max_tokens from the
shortest document up; unsupported keywords are refused with a line naming them."""

import json

import numpy as np
import pytest

from serving.structured import Grammar, Guide, SchemaRefused, TokenTrie, compile_schema

jsonschema = pytest.importorskip("jsonschema")

END = 256  # end-of-text, after the 256 byte tokens
TRIE = TokenTrie({i: bytes([i]) for i in range(256)} | {300: b'{"', 301: b'":', 302: b"true", 303: b"\xe2\x82"})
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": -5, "maximum": 120},
                                      "ok": {"type": "boolean"}, "pick": {"enum": ["red", 1, 12]}, "z": {"type": "null"},
                                      "xs": {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 3},
                                      "c": {"const": {"a": [1, 2]}}}, "required": ["name", "age"], "additionalProperties": False},
    {"type": "object"},  # json_object: any object
    {"type": "array", "items": {"type": "integer", "minimum": 100, "maximum": 250}, "minItems": 2},
    {"type": "integer", "minimum": -30, "maximum": -12},
    {"type": "string", "minLength": 3, "maxLength": 5},
    # pydantic's Optional fields: X or null (anyOf, alternatives that begin differently)
    {"type": "object", "properties": {"n": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}], "default": None},
                                      "s": {"anyOf": [{"type": "string", "maxLength": 2}, {"type": "array", "items": {"type": "boolean"},
                                                                                           "maxItems": 2}, {"const": 7}]}},
     "required": ["n", "s"]},
    # pydantic's nested models: $ref to the root's $defs, inlined
    {"$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["x"]}},
     "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}, "q": {"anyOf": [{"$ref": "#/$defs/P"}, {"type": "null"}]},
                                      "ps": {"type": "array", "items": {"$ref": "#/$defs/P"}, "maxItems": 2}}, "required": ["p", "q", "ps"]},
]


def random_walk(grammar, max_tokens, rng):
    """The bytes of a reply that takes a random allowed token each step, and whether it ended."""
    guide, out = Guide(grammar, 310, [END], np.zeros(310, np.float32)), b""
    for t in range(max_tokens):
        allowed = np.flatnonzero(guide.mask(max_tokens - t))
        assert len(allowed), out
        token = int(rng.choice(allowed))
        if token == END:
            return out, True
        out += TRIE.bytes_of[token]
        guide.take(token)
    return out, False


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda s: json.dumps(s)[:30])
def test_every_masked_random_walk_validates_within_max_tokens(schema):
    grammar, rng = Grammar(compile_schema(schema), TRIE), np.random.default_rng(0)
    ended = 0
    for max_tokens in [grammar.shortest] * 20 + list(range(grammar.shortest + 1, grammar.shortest + 60)) * 3:
        out, end = random_walk(grammar, max_tokens, rng)
        jsonschema.validate(json.loads(out.decode("utf-8")), schema)
        ended += end
    assert ended > 40  # walks with room to end their document ended it


def test_the_masks_are_the_documents_that_can_still_validate():
    """After '{"age":1' of a 0..15 integer: digits 0-5 (10..15) or the closing brace; with a
    budget of one token, only the brace; '{"age":2' may only close."""
    grammar = Grammar(compile_schema({"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 15}}}), TRIE)
    guide = Guide(grammar, 310, [END], np.zeros(310, np.float32))
    assert np.flatnonzero(guide.mask(20)).tolist() == [ord("{"), 300] and grammar.shortest == len('{"age":0}')
    for b in b'{"age":1':
        guide.take(b)
    assert set(np.flatnonzero(guide.mask(5)).tolist()) == set(b"012345}")
    assert np.flatnonzero(guide.mask(1)).tolist() == [ord("}")]
    two = Guide(grammar, 310, [END], np.zeros(310, np.float32))
    for b in b'{"age":2':
        two.take(b)
    assert np.flatnonzero(two.mask(5)).tolist() == [ord("}")]
    two.take(ord("}"))
    assert np.flatnonzero(two.mask(5)).tolist() == [END]


@pytest.mark.parametrize("schema, words", [
    ({"type": "string", "pattern": "^a"}, "schema: the keyword 'pattern' is not supported here"),
    ({"anyOf": [{"type": "integer"}, {"type": "number"}]}, "schema.anyOf: alternatives 0 and 1 may both begin with '-'"),
    ({"anyOf": [{"type": "string"}], "type": "string"}, "schema.anyOf must be a non-empty list of schemas with no other keyword"),
    ({"$defs": {"N": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/N"}}}}}, "$ref": "#/$defs/N"},
     "schema.$ref(N).properties.kids.items.$ref: N refers to itself: recursive schemas are not supported"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}, 'schema.properties.a.$ref must name one of the root\'s $defs'),
    ({"type": ["string", "null"]}, 'schema.type: ["string", "null"] is not supported'),
    ({"type": "object", "properties": {"a": {"type": "string", "format": "date"}}}, "schema.properties.a: the keyword 'format'"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum 5 is over maximum 1"),
    ({"type": "object", "properties": {}, "required": ["a"]}, "required names 'a', which is not in its properties"),
    ({"enum": []}, "schema.enum is empty"),
])
def test_unsupported_schemas_are_refused_in_a_line_naming_the_keyword(schema, words):
    with pytest.raises(SchemaRefused) as e:
        compile_schema(schema)
    assert words in str(e.value) and "\n" not in str(e.value)
