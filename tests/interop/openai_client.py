#!/usr/bin/env python3
"""Drives inferd's OpenAI-compatible HTTP API with the official `openai`
Python package, as its users do (tests/openai_http.rs starts the server).

Checks: /v1/models; chat completions whole and streamed (the streamed
deltas add up to the whole answer, the usage arrives in the last chunk);
greedy answers equal to a stock gRPC client's on the same tokens (the
completions endpoint with token ids, log-probabilities to the bit); a
seeded sample repeats; stop strings cut the text; log-probabilities; a
conversation of five turns whose cached prompt tokens grow turn by turn;
the errors (n > 1, a temperature out of range, an unknown route, a wrong
API key) raised as the package's typed exceptions with their HTTP status.

Usage: openai_client.py HTTP_ADDR GRPC_ADDR [TOKEN]
(exits 0 when every check passes; TOKEN: the server's bearer token)
"""

import struct
import sys
import tempfile

import openai

from runtime_client import Client, generate_stubs

import grpc


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def check_twin(client, ids, grpc_addr):
    # Token ids in, greedy: the same tokens and log-probabilities, to the
    # bit, as a stock gRPC client gets for the same history.
    prompt_ids = [1, 504, 3575, 282, 4649, 314, 9, 45, 2, 17, 330]
    text = client.completions.create(
        model=ids[0], prompt=prompt_ids, max_tokens=12, temperature=0, logprobs=2)
    lp = text.choices[0].logprobs
    n = len(lp.token_logprobs)
    if text.choices[0].finish_reason == "length":
        assert n == text.usage.completion_tokens == 12, text
    else:
        # Ended by an end-of-generation token: counted, not shown.
        assert 0 < n == text.usage.completion_tokens - 1, text
    with tempfile.TemporaryDirectory() as tmp:
        pb, rpc, *_ = generate_stubs(tmp)
        channel = grpc.insecure_channel(grpc_addr)
        grpc_client = Client(channel, pb, rpc)
        sid = grpc_client.create(label="twin").session_id
        grpc_client.append(sid, prompt_ids)
        events = list(grpc_client.stub.Generate(
            pb.GenerateRequest(session_id=sid, max_tokens=12, top_logprobs=2), timeout=120))
        got = [e.logprobs.chosen.logprob for e in events if e.WhichOneof("payload") == "logprobs"]
        grpc_client.close(sid)
        channel.close()
    assert [f32(x) for x in lp.token_logprobs] == [f32(x) for x in got[:n]], (lp.token_logprobs, got)
    assert "".join(lp.tokens) == text.choices[0].text, (lp.tokens, text.choices[0].text)


def check_bound(client, ids, grpc_addr):
    # A request bound to the client's own session (x-inferd-session) runs in
    # it: only the prompt past its history is appended, and it stays open.
    prompt_ids = [1, 504, 3575, 282, 4649, 314, 9, 45, 2, 17, 330]
    with tempfile.TemporaryDirectory() as tmp:
        pb, rpc, *_ = generate_stubs(tmp)
        channel = grpc.insecure_channel(grpc_addr)
        grpc_client = Client(channel, pb, rpc)
        sid = grpc_client.create(label="bound").session_id
        grpc_client.append(sid, prompt_ids[:6])
        bound = {"x-inferd-session": sid}
        text = client.completions.create(
            model=ids[0], prompt=prompt_ids, max_tokens=5, temperature=0, extra_headers=bound)
        assert text.usage.prompt_tokens_details.cached_tokens >= 6, text.usage
        length = grpc_client.info(sid).history_length
        assert length == len(prompt_ids) + text.usage.completion_tokens, (length, text.usage)
        try:
            client.completions.create(model=ids[0], prompt=[7, 8, 9], max_tokens=2,
                                      extra_headers=bound)
            raise AssertionError("a prompt that does not continue the session was accepted")
        except openai.BadRequestError as e:
            assert e.body["code"] == "session_history_mismatch", e.body
        grpc_client.close(sid)
        try:
            client.completions.create(model=ids[0], prompt=prompt_ids, max_tokens=2,
                                      extra_headers=bound)
            raise AssertionError("a closed session answered")
        except openai.NotFoundError as e:
            assert e.status_code == 404, e
        channel.close()


def main():
    http_addr, grpc_addr = sys.argv[1], sys.argv[2]
    token = sys.argv[3] if len(sys.argv) > 3 else "unused"
    base = f"http://{http_addr}/v1"
    client = openai.OpenAI(base_url=base, api_key=token, max_retries=0, timeout=120)
    checks = 0

    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids == ["SmolLM2-135M-Instruct.Q4_1"], ids
    checks += 1

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(
        model=ids[0], messages=messages, max_tokens=24, temperature=0)
    answer = whole.choices[0].message.content
    assert whole.object == "chat.completion", whole
    assert answer, whole
    assert whole.choices[0].finish_reason in ("stop", "length"), whole
    usage = whole.usage
    assert usage.prompt_tokens > 0 and usage.completion_tokens > 0, usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens, usage
    checks += 1

    # Streamed: the same greedy answer, piece by piece, usage at the end.
    stream = client.chat.completions.create(
        model=ids[0], messages=messages, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True})
    pieces, finish, streamed_usage, roles = [], None, None, []
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk", chunk
        if chunk.usage is not None:
            # Asked for with include_usage: a chunk of its own, no choices.
            assert not chunk.choices, chunk
            streamed_usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.role:
                roles.append(choice.delta.role)
            if choice.delta.content:
                pieces.append(choice.delta.content)
            if choice.finish_reason:
                finish = choice.finish_reason
    assert roles == ["assistant"], roles
    assert "".join(pieces) == answer, (pieces, answer)
    assert len(pieces) > 1, pieces
    assert finish == whole.choices[0].finish_reason, finish
    assert streamed_usage.completion_tokens == usage.completion_tokens, streamed_usage
    checks += 1

    # (With a token the gRPC twin would need it too: the run without one
    # compares.)
    if len(sys.argv) <= 3:
        check_twin(client, ids, grpc_addr)
        check_bound(client, ids, grpc_addr)
        checks += 2

    # Completions streamed: the same greedy text, piece by piece, with the
    # usage in the last chunk.
    whole_text = client.completions.create(
        model=ids[0], prompt="The three primary colors are", max_tokens=20, temperature=0)
    pieces, streamed_usage = [], None
    for chunk in client.completions.create(
            model=ids[0], prompt="The three primary colors are", max_tokens=20, temperature=0,
            stream=True):
        assert chunk.object == "text_completion", chunk
        # Without include_usage every chunk has a choice (code that reads
        # chunk.choices[0] works), the usage rides on the finishing one.
        assert chunk.choices, chunk
        if chunk.usage is not None:
            assert chunk.choices[0].finish_reason, chunk
            streamed_usage = chunk.usage
        pieces.extend(c.text for c in chunk.choices)
    assert "".join(pieces) == whole_text.choices[0].text, (pieces, whole_text)
    assert streamed_usage.completion_tokens == whole_text.usage.completion_tokens, streamed_usage
    checks += 1

    # Seeded sampling repeats; stop strings cut the text.
    sampled = [client.completions.create(
        model=ids[0], prompt="Once upon a time", max_tokens=16, temperature=0.9, seed=42,
    ).choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1], sampled
    story = client.completions.create(
        model=ids[0], prompt="List: 1. apples\n2.", max_tokens=32, temperature=0)
    full = story.choices[0].text
    cut_at = full.find("\n")
    if cut_at > 0:
        stopped = client.completions.create(
            model=ids[0], prompt="List: 1. apples\n2.", max_tokens=32, temperature=0,
            stop=["\n"])
        assert stopped.choices[0].text == full[:cut_at], (stopped.choices[0].text, full)
        assert stopped.choices[0].finish_reason == "stop", stopped
        checks += 1

    # Chat log-probabilities.
    withlp = client.chat.completions.create(
        model=ids[0], messages=messages, max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=3)
    content = withlp.choices[0].logprobs.content
    assert len(content) in (withlp.usage.completion_tokens, withlp.usage.completion_tokens - 1), withlp
    assert all(len(t.top_logprobs) == 3 for t in content), content
    assert all(t.top_logprobs[0].logprob >= t.logprob for t in content), content
    checks += 1

    # A conversation: each turn re-sends everything; the pages of what came
    # before are reused, so the cached prompt tokens grow turn by turn.
    conversation = [{"role": "system", "content": "You are a helpful assistant. " * 20}]
    cached = []
    for turn in range(5):
        conversation.append({"role": "user", "content": f"Tell me fact number {turn + 1} about the sea."})
        reply = client.chat.completions.create(
            model=ids[0], messages=conversation, max_tokens=20, temperature=0)
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
        conversation.append({"role": "assistant", "content": reply.choices[0].message.content})
    assert cached[1] > 0, cached
    assert all(b > a for a, b in zip(cached[1:], cached[2:])), cached
    checks += 1

    # Errors, typed.
    for kwargs, param in [({"n": 2}, "n"), ({"temperature": 5}, "temperature")]:
        try:
            client.chat.completions.create(model=ids[0], messages=messages, max_tokens=4, **kwargs)
            raise AssertionError(f"{kwargs} was accepted")
        except openai.BadRequestError as e:
            assert e.status_code == 400, e
            assert e.body["param"] == param, e.body
    try:
        client.get("/nowhere", cast_to=object)
        raise AssertionError("an unknown route answered")
    except openai.NotFoundError as e:
        assert e.status_code == 404, e
    if len(sys.argv) > 3:
        wrong = openai.OpenAI(base_url=base, api_key="not-the-token", max_retries=0)
        try:
            wrong.models.list()
            raise AssertionError("a wrong API key was accepted")
        except openai.AuthenticationError as e:
            assert e.status_code == 401, e
        checks += 1
    checks += 1

    print(f"openai client: {checks} checks passed (cached tokens by turn: {cached})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
