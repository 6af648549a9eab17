#!/usr/bin/env python3
"""A corpus of JSON Schemas through inferd's OpenAI-compatible HTTP API
(tests/openai_structured.rs starts the server): every schema compiles, every
output that ends with finish_reason "stop" validates with the `jsonschema`
package (draft 2020-12, formats checked), and nearly all end that way.

Outputs cut by max_tokens are listed (a small model can run on inside an
unbounded number or a `+` pattern); at least 90 of 120 must complete.

The corpus (120 schemas, seeded) covers flat and nested objects, required
subsets, strings with lengths, patterns and formats, integers and numbers
with bounds, enums and consts, arrays with bounds, anyOf and oneOf, and
$defs with $ref.

Usage: schema_corpus.py HTTP_ADDR (exits 0 when every check passes)
"""

import json
import random
import sys

import jsonschema

PATTERNS = ["^[A-Z]{3}-[0-9]{2}$", "^[a-z]+@[a-z]+\\.com$", "^(yes|no)$", "^#[0-9a-f]{6}$"]
FORMATS = ["date", "email", "uuid", "ipv4", "time"]
WORDS = ["alpha", "beta", "gamma", "delta", "red", "green", "blue", "north", "south"]


def leaf(rng):
    kind = rng.randrange(9)
    if kind == 0:
        return {"type": "string", "maxLength": rng.choice([5, 12, 24])}
    if kind == 1:
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    if kind == 2:
        return {"type": "string", "format": rng.choice(FORMATS)}
    if kind == 3:
        lo = rng.randrange(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.choice([1, 10, 1000])}
    if kind == 4:
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 100, 1e6])}
    if kind == 5:
        return {"type": "boolean"}
    if kind == 6:
        return {"enum": rng.sample(WORDS, rng.randrange(2, 5))}
    if kind == 7:
        return {"enum": [1, 2, 3, "many", None]}
    return {"const": rng.choice(WORDS)}


def array(rng, depth):
    lo = rng.randrange(0, 3)
    return {"type": "array", "items": node(rng, depth + 1), "minItems": lo,
            "maxItems": lo + rng.randrange(1, 4)}


def obj(rng, depth):
    n = rng.randrange(1, 5)
    names = rng.sample(["id", "name", "size", "kind", "when", "where", "tags", "score"], n)
    props = {k: node(rng, depth + 1) for k in names}
    required = [k for k in names if rng.random() < 0.7] or names[:1]
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


def node(rng, depth=0):
    if depth >= 3:
        return leaf(rng)
    kind = rng.randrange(10)
    if kind < 4:
        return leaf(rng)
    if kind < 6:
        return array(rng, depth)
    if kind < 8:
        return obj(rng, depth)
    if kind == 8:
        return {"anyOf": [leaf(rng), obj(rng, depth + 1)]}
    return {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                      {"type": "string", "maxLength": 6}]}


def with_defs(rng):
    item = obj(rng, 1)
    return {"$defs": {"item": item},
            "type": "object",
            "properties": {"first": {"$ref": "#/$defs/item"},
                           "rest": {"type": "array", "items": {"$ref": "#/$defs/item"},
                                    "maxItems": 2}},
            "required": ["first", "rest"], "additionalProperties": False}


def corpus():
    rng = random.Random(2026)
    schemas = []
    for i in range(120):
        if i % 6 == 5:
            schemas.append(with_defs(rng))
        else:
            schemas.append(obj(rng, 0))
    return schemas


def main():
    http = sys.argv[1]
    # Imported here so that corpus() is usable without the client
    # (benches/constraint_libraries.py).
    import openai  # noqa: PLC0415

    client = openai.OpenAI(base_url=f"http://{http}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    stopped = cut = 0
    for i, schema in enumerate(corpus()):
        done = client.chat.completions.create(
            model=model, max_tokens=300, temperature=0.7, seed=i,
            messages=[{"role": "user", "content": "Fill in this JSON object."}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})
        choice = done.choices[0]
        if choice.finish_reason != "stop":
            cut += 1
            print(f"schema {i} cut after {done.usage.completion_tokens} tokens: "
                  f"{choice.message.content[-80:]!r}")
            continue
        value = json.loads(choice.message.content)
        validator = jsonschema.Draft202012Validator(
            schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
        errors = list(validator.iter_errors(value))
        assert not errors, f"schema {i}: {json.dumps(schema)}\n{choice.message.content}\n{errors[0]}"
        stopped += 1
    print(f"{stopped} outputs validated, {cut} cut by max_tokens")
    # A small model can run on inside an unbounded number or a `+` pattern
    # until max_tokens (reported as "length", never as invalid JSON): about
    # one output in seven here. Far more would mean masks that trap it.
    assert stopped >= 90, "too many outputs were cut before their end"
    print("checks passed")


if __name__ == "__main__":
    main()
