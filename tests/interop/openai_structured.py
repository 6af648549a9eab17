#!/usr/bin/env python3
"""Structured output through inferd's OpenAI-compatible HTTP API with the
official `openai` package (tests/openai_structured.rs starts the server).

Checks: `chat.completions.parse` with a pydantic model as response_format
returns an instance of it (the reference model, greedy and seeded);
`response_format={"type": "json_object"}` gives a JSON object; a base
completion (`/v1/completions`) with a json_schema response_format gives
text that parses and fits the schema; a schema that does not compile is a
400 on `response_format`; llama.cpp's `grammar` (GBNF) and bare `json_schema`
fields work as its server's do.

With `base` (a base model without a chat template, Gemma 3 270M) only the
completions checks run.

Usage: openai_structured.py HTTP_ADDR [chat|base] (exits 0 when every check
passes)
"""

import json
import sys
from typing import List, Literal

import openai
import pydantic


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    age: int = pydantic.Field(ge=0, le=120)
    colour: Literal["red", "green", "blue"]
    hobbies: List[str] = pydantic.Field(max_length=3)


def main():
    http = sys.argv[1]
    client = openai.OpenAI(base_url=f"http://{http}/v1", api_key="unused")
    model = client.models.list().data[0].id
    messages = [
        {"role": "system", "content": "You answer in JSON."},
        {"role": "user", "content": "Describe Ada, a 36 year old who likes blue, chess and tea."},
    ]

    chat = (sys.argv[2] if len(sys.argv) > 2 else "chat") == "chat"
    for extra in ({"temperature": 0}, {"temperature": 0.8, "seed": 11}) if chat else ():
        done = client.chat.completions.parse(
            model=model, messages=messages, response_format=Person, max_tokens=160, **extra)
        choice = done.choices[0]
        assert choice.finish_reason == "stop", choice
        person = choice.message.parsed
        assert isinstance(person, Person), choice.message
        print("parsed:", person)

    if chat:
        done = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "A JSON object about a cat."}],
            response_format={"type": "json_object"}, temperature=0, max_tokens=120)
        content = done.choices[0].message.content
        if done.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(content), dict), content
        else:
            assert done.choices[0].finish_reason == "length", done

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20},
                       "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
        "required": ["city", "population"], "additionalProperties": False,
    }
    text = client.completions.create(
        model=model, prompt="The largest city of France, as JSON:", max_tokens=120, temperature=0,
        extra_body={"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "city", "schema": schema,
                                                        "strict": True}}})
    assert text.choices[0].finish_reason == "stop", text
    value = json.loads(text.choices[0].text)
    assert set(value) == {"city", "population"}, value
    assert isinstance(value["population"], int) and value["population"] >= 0, value
    print("completion:", value)

    # llama.cpp's extensions: a GBNF grammar, a bare JSON Schema.
    done = client.completions.create(
        model=model, prompt="Is water wet? Answer:", max_tokens=20, temperature=0,
        extra_body={"grammar": 'root ::= " " ("yes" | "no") "."'})
    assert done.choices[0].text in (" yes.", " no."), done.choices[0].text
    assert done.choices[0].finish_reason == "stop", done
    done = client.completions.create(
        model=model, prompt="The largest city of France, as JSON:", max_tokens=120, temperature=0,
        extra_body={"json_schema": schema})
    assert json.loads(done.choices[0].text) == value, done.choices[0].text
    try:
        client.completions.create(
            model=model, prompt="x", max_tokens=4,
            extra_body={"grammar": "root ::= missing"})
        raise AssertionError("a grammar that does not compile was accepted")
    except openai.BadRequestError as e:
        assert e.body.get("param") == "grammar", e.body
    try:
        client.completions.create(
            model=model, prompt="x", max_tokens=4,
            extra_body={"grammar": 'root ::= "a"', "json_schema": schema})
        raise AssertionError("two constraints were accepted")
    except openai.BadRequestError as e:
        assert "one constraint" in e.body.get("message"), e.body

    try:
        request = {"model": model, "max_tokens": 8,
                   "response_format": {"type": "json_schema",
                                       "json_schema": {"name": "bad",
                                                       "schema": {"type": "frobnicate"}}}}
        if chat:
            client.chat.completions.create(messages=messages, **request)
        else:
            client.completions.create(
                prompt="x", extra_body={"response_format": request.pop("response_format")},
                **request)
        raise AssertionError("a schema that does not compile was accepted")
    except openai.BadRequestError as e:
        assert e.body.get("param") == "response_format", e.body
        print("refused:", e.body.get("message"))

    print("checks passed")


if __name__ == "__main__":
    main()
