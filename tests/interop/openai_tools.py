#!/usr/bin/env python3
"""Tool calls through inferd's OpenAI-compatible HTTP API with the official
`openai` package (tests/openai_tools.rs starts the server).

Checks, for the server's model and chat template:
- `tool_choice="required"`: the reply is `tool_calls` whose arguments parse
  and validate against the function's schema (`jsonschema`), with
  `finish_reason == "tool_calls"`;
- a named function among two: that function is called;
- streamed, the tool-call deltas add up to the same call as the whole
  reply (greedy), and the last chunk's finish_reason is "tool_calls";
- `parallel_tool_calls=False`: exactly one call;
- a tool loop completes: the client runs each call and sends the result
  back as a `tool` message (through the template) until the model answers
  in text (`tool_choice` "auto", then "none" after two rounds);
- `chat.completions.parse` with `openai.pydantic_function_tool` gives the
  arguments parsed into the pydantic model;
- refusals are 400s naming their field: an unknown named function, tools
  with response_format, a bad function name, a tool message without
  content.

With `reference` (the reference model, whose template has no tool syntax:
the generic JSON form) it also checks what the model says: asked for the
weather in Paris, it calls get_weather for Paris; given the tool's result,
it answers in text that uses it.

Usage: openai_tools.py HTTP_ADDR reference|native (exits 0 when every check
passes)
"""

import json
import sys

import jsonschema
import openai
import pydantic

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}

TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Forecast(pydantic.BaseModel):
    """Tomorrow's forecast for a city."""

    city: str = pydantic.Field(max_length=12)
    days: int = pydantic.Field(ge=1, le=7)


def schema_of(name):
    return {t["function"]["name"]: t for t in (WEATHER, TIME)}[name]["function"]["parameters"]


def check_calls(choice, names, at_most=None):
    """The choice's calls, each checked against its function's schema."""
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls, choice.message
    if at_most is not None:
        assert len(calls) <= at_most, calls
    for call in calls:
        assert call.type == "function" and call.id, call
        assert call.function.name in names, call
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, schema_of(call.function.name))
    return calls


def refused(param, **request):
    try:
        request["client"].chat.completions.create(
            **{k: v for k, v in request.items() if k != "client"})
    except openai.BadRequestError as e:
        body = e.body if isinstance(e.body, dict) else {}
        got = body.get("param") or (body.get("error") or {}).get("param")
        assert got == param, (param, e.body)
        return
    raise AssertionError(f"not refused, expected a 400 on {param}")


def main():
    http, mode = sys.argv[1], sys.argv[2]
    client = openai.OpenAI(base_url=f"http://{http}/v1", api_key="unused")
    model = client.models.list().data[0].id
    greedy = {"model": model, "temperature": 0, "max_tokens": 120}
    # A model with random weights may go on calling for ever where several
    # calls are allowed: its checks ask for one call.
    one = {"parallel_tool_calls": False} if mode == "native" else {}

    # Required: a call, valid against the schema.
    whole = client.chat.completions.create(
        messages=ASK, tools=[WEATHER], tool_choice="required", **one, **greedy)
    calls = check_calls(whole.choices[0], {"get_weather"})
    print("required:", [(c.function.name, c.function.arguments) for c in calls])
    if mode == "reference":
        assert json.loads(calls[0].function.arguments)["city"] == "Paris", calls

    # Named, among two.
    done = client.chat.completions.create(
        messages=ASK, tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}}, **greedy)
    check_calls(done.choices[0], {"get_time"}, at_most=1)

    # Streamed: the deltas add up to the whole reply's calls.
    streamed, finish = {}, None
    for chunk in client.chat.completions.create(
            messages=ASK, tools=[WEATHER], tool_choice="required", stream=True, **one,
            **greedy):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                entry = streamed.setdefault(delta.index, {"name": "", "arguments": ""})
                if delta.function.name:
                    entry["name"] += delta.function.name
                entry["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls", finish
    assert [(e["name"], e["arguments"]) for _, e in sorted(streamed.items())] == [
        (c.function.name, c.function.arguments) for c in calls
    ], (streamed, calls)

    # One call only.
    done = client.chat.completions.create(
        messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        parallel_tool_calls=False, **greedy)
    assert len(check_calls(done.choices[0], {"get_weather", "get_time"})) == 1

    # A tool loop: the client runs what the model calls and sends the
    # results back until the model answers in text (after two rounds of
    # calls it is told to answer: tool_choice "none").
    def run_tool(name, arguments):
        if name == "get_weather":
            return {"city": arguments["city"], "temperature": 21, "sky": "sunny"}
        return {"city": arguments["city"], "time": "14:05"}

    history = list(ASK)
    reply = whole.choices[0]
    for round_ in range(4):
        message = reply.message
        if not message.tool_calls:
            break
        history.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            result = run_tool(call.function.name, json.loads(call.function.arguments))
            history.append({"role": "tool", "tool_call_id": call.id,
                            "content": json.dumps(result)})
        choice = "none" if round_ >= 1 else "auto"
        reply = client.chat.completions.create(
            messages=history, tools=[WEATHER, TIME], tool_choice=choice, **one,
            **greedy).choices[0]
    assert reply.message.tool_calls is None, reply
    assert reply.finish_reason in ("stop", "length"), reply
    if mode == "reference":
        # An answer in words. (Whether it uses the tool's result is up to
        # the model: the 135M reference model, greedy, answers "Paris is a
        # beautiful city with a beautiful sky." to this conversation.)
        assert reply.message.content and reply.message.content.strip(), reply
    print(f"loop: answered after {round_} round(s) of calls:", repr(reply.message.content[:80]))

    # The openai package's own tool parsing.
    parsed = client.chat.completions.parse(
        messages=[{"role": "user", "content": "Forecast for Rome, 3 days."}],
        tools=[openai.pydantic_function_tool(Forecast)], tool_choice="required", **one,
        **greedy)
    call = parsed.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, Forecast), call
    print("parsed:", call.function.parsed_arguments)

    # Refusals.
    refused("tool_choice", client=client, messages=ASK, tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}}, **greedy)
    refused("tools", client=client, messages=ASK, tools=[WEATHER],
            response_format={"type": "json_object"}, **greedy)
    bad = {"type": "function", "function": {"name": "no spaces"}}
    refused("tools", client=client, messages=ASK, tools=[bad], **greedy)
    refused("messages", client=client, messages=ASK + [{"role": "tool", "tool_call_id": "x"}],
            tools=[WEATHER], **greedy)

    print("checks passed")


if __name__ == "__main__":
    main()
