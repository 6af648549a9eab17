#!/usr/bin/env python3
"""Drives a running `inferd serve` with a stock Python gRPC client.

The stubs are generated at run time from the repository's published
`protos/` with grpcio-tools, so this proves that a client built from the
.proto alone, with no inferd code, works: the full session lifecycle,
streaming, every error status a client can provoke, deadlines and
cancellation (CONTRACT section 2), and inferd's ForkSession extension
(section 2.11) from stubs of its own schema.

Usage: runtime_client.py HOST:PORT [--max-sessions N] [--eviction none|lru]
                         [--spread N]
       runtime_client.py HOST:PORT --idle-ttl SECONDS [--spread N]

The server must run with the same `--max-sessions N --eviction POLICY`
(defaults: 2, none) and hold no other sessions. With `--idle-ttl` (the
server's `--idle-ttl`) only seeded sampling (the same seed draws the same
tokens) and idle-TTL eviction are checked. With `--spread N` (for
replicas behind a proxy) the client opens N channels, each its own
connection, and sends each call on the next one, so a session's calls
reach different replicas and the session moves between them; the session
limit is then checked on one channel (one replica), since the replicas'
limits add up. Exits 0 when every check passes; otherwise prints what
differed and exits 1.
"""

import argparse
import importlib
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import grpc

REPO = pathlib.Path(__file__).resolve().parents[2]
PROTOS = REPO / "protos"
# Any ids inside the reference vocabulary; the checks never depend on the
# particular continuation, only on the protocol.
PROMPT = [1, 504, 3458, 282, 4667, 30, 216, 1095, 314]
# Generous per-call limit for calls expected to succeed, so a hung server
# fails the run instead of stalling it.
CALL_TIMEOUT = 120.0


class Mismatch(Exception):
    """A server reply that differs from what the contract requires."""


def check(ok, message):
    if not ok:
        raise Mismatch(message)


def generate_stubs(out_dir):
    """Runs protoc (from grpcio-tools) on the published protos into out_dir
    and imports the generated modules."""
    out_dir = pathlib.Path(out_dir)
    protoc(PROTOS, out_dir, "kakeya/v1/runtime.proto")
    protoc(PROTOS, out_dir, "inferd/session/v1/session_service.proto")
    # The health schema's own path (grpc/health/v1) would put its modules
    # under the `grpc` package, which the grpcio runtime already owns; a copy
    # under another folder keeps the service name (it comes from the
    # `package` line) and imports cleanly.
    health_dir = out_dir / "health_proto"
    health_dir.mkdir()
    (health_dir / "inferd_health").mkdir()
    shutil.copy(PROTOS / "grpc/health/v1/health.proto", health_dir / "inferd_health")
    protoc(health_dir, out_dir, "inferd_health/health.proto")
    sys.path.insert(0, str(out_dir))
    pb = importlib.import_module("kakeya.v1.runtime_pb2")
    rpc = importlib.import_module("kakeya.v1.runtime_pb2_grpc")
    health_pb = importlib.import_module("inferd_health.health_pb2")
    health_rpc = importlib.import_module("inferd_health.health_pb2_grpc")
    ext_pb = importlib.import_module("inferd.session.v1.session_service_pb2")
    ext_rpc = importlib.import_module("inferd.session.v1.session_service_pb2_grpc")
    return pb, rpc, health_pb, health_rpc, ext_pb, ext_rpc


def protoc(include, out_dir, proto):
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        proto,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise Mismatch(f"protoc on {proto} failed ({done.returncode}): {done.stderr.strip()}")


class Client:
    """The generated stubs (one per channel, used in turn) plus the helpers
    the checks share. `channels` is one channel or a list of them."""

    def __init__(self, channels, pb, rpc):
        if not isinstance(channels, (list, tuple)):
            channels = [channels]
        self.pb = pb
        self.stubs = [rpc.RuntimeServiceStub(channel) for channel in channels]
        self.calls = 0
        self.vocab_size = None

    @property
    def stub(self):
        """The stub of the next channel in turn."""
        self.calls += 1
        return self.stubs[self.calls % len(self.stubs)]

    def create(self, label="interop", eos=()):
        reply = self.stub.CreateSession(
            self.pb.CreateSessionRequest(client_label=label, eos_token_ids=list(eos)),
            timeout=CALL_TIMEOUT,
        )
        check(len(reply.session_id) > 0, "CreateSession returned an empty session id")
        self.vocab_size = reply.vocab_size
        return reply

    def append(self, sid, tokens):
        return self.stub.AppendTokens(
            self.pb.AppendTokensRequest(session_id=sid, token_ids=list(tokens)),
            timeout=CALL_TIMEOUT,
        )

    def info(self, sid):
        return self.stub.GetSessionInfo(
            self.pb.GetSessionInfoRequest(session_id=sid), timeout=CALL_TIMEOUT
        )

    def close(self, sid):
        return self.stub.CloseSession(
            self.pb.CloseSessionRequest(session_id=sid), timeout=CALL_TIMEOUT
        )

    def generate(self, sid, timeout=CALL_TIMEOUT, **knobs):
        """Runs Generate to its end: (tokens, done, truncated messages)."""
        stream = self.stub.Generate(
            self.pb.GenerateRequest(session_id=sid, **knobs), timeout=timeout
        )
        tokens, done, truncated = [], None, []
        for msg in stream:
            kind = msg.WhichOneof("payload")
            check(done is None, f"a {kind} message arrived after done")
            if kind == "token_id":
                tokens.append(msg.token_id)
            elif kind == "done":
                done = msg.done
            elif kind == "truncated":
                check(not tokens, "HistoryTruncated arrived after a token")
                truncated.append(msg.truncated)
        check(done is not None, f"the stream ended without done after {len(tokens)} tokens")
        return tokens, done, truncated


def expect_status(code, what, call):
    """Runs call (which must fail) and checks the status code; returns the
    status message. Streaming calls go through Client.generate, which drains
    the stream so that its status surfaces."""
    try:
        call()
    except grpc.RpcError as err:
        got = err.code()
        check(
            got == code,
            f"{what}: expected {code.name}, got {got.name}: {err.details()}",
        )
        check(err.details(), f"{what}: {code.name} came without a message")
        print(f"ok   {what} -> {code.name}: {err.details()}")
        return err.details()
    raise Mismatch(f"{what}: expected {code.name}, but the call succeeded")


def stop_reason(pb, done):
    return pb.GenerateDone.StopReason.Name(done.stop_reason)


def check_health(channel, health_pb, health_rpc):
    stub = health_rpc.HealthStub(channel)
    for service in ["", "kakeya.v1.RuntimeService"]:
        reply = stub.Check(
            health_pb.HealthCheckRequest(service=service), timeout=CALL_TIMEOUT
        )
        check(
            reply.status == health_pb.HealthCheckResponse.SERVING,
            f"health of {service!r} is {reply.status}, not SERVING",
        )
    print("ok   health: SERVING")


def check_lifecycle(c):
    pb = c.pb
    created = c.create(label="lifecycle")
    sid = created.session_id
    check(created.vocab_size > max(PROMPT), f"vocab_size {created.vocab_size} is too small")
    check(created.context_length > 0, "context_length is 0")

    appended = c.append(sid, PROMPT[:4])
    check(appended.history_length == 4, f"history after 4 tokens: {appended.history_length}")
    appended = c.append(sid, PROMPT[4:])
    check(
        appended.history_length == len(PROMPT),
        f"history after the rest: {appended.history_length}, want {len(PROMPT)}",
    )

    tokens, done, truncated = c.generate(sid, max_tokens=4)
    check(len(tokens) == 4, f"MAX_TOKENS run streamed {len(tokens)} tokens, want 4")
    check(not truncated, "a short history was reported truncated")
    check(
        done.stop_reason == pb.GenerateDone.STOP_REASON_MAX_TOKENS,
        f"stop reason {stop_reason(pb, done)}, want STOP_REASON_MAX_TOKENS",
    )
    check(done.generated_token_count == 4, f"generated_token_count {done.generated_token_count}")
    check(
        done.history_length == len(PROMPT) + 4,
        f"done.history_length {done.history_length}, want {len(PROMPT) + 4}",
    )
    check(all(t < created.vocab_size for t in tokens), f"token outside the vocabulary: {tokens}")
    check(done.total_duration_seconds > 0, "total_duration_seconds is not positive")
    print(f"ok   Generate streamed {tokens}, done MAX_TOKENS")

    info = c.info(sid)
    check(
        info.history_length == len(PROMPT) + 4,
        f"GetSessionInfo history {info.history_length}, want {len(PROMPT) + 4}",
    )
    check(info.kv_live_bytes > 0, "a session with history holds no KV bytes")
    check(
        info.cache_invariant_inv1_violations == 0 and info.cache_invariant_inv2_violations == 0,
        "invariant violations on a healthy session",
    )
    check(info.client_label == "lifecycle", f"client_label came back as {info.client_label!r}")
    print(f"ok   GetSessionInfo: history {info.history_length}, kv {info.kv_live_bytes} bytes")

    closed = c.close(sid)
    check(
        closed.final_history_length == len(PROMPT) + 4,
        f"final_history_length {closed.final_history_length}",
    )
    expect_status(grpc.StatusCode.NOT_FOUND, "second CloseSession", lambda: c.close(sid))
    expect_status(grpc.StatusCode.NOT_FOUND, "GetSessionInfo on a closed id", lambda: c.info(sid))
    return tokens


def check_fork(c, channels, ext_pb, ext_rpc):
    """ForkSession: the fork continues exactly like a session fed the same
    history, and outlives its source. Needs two free session places."""
    stubs = [ext_rpc.SessionServiceStub(channel) for channel in channels]

    def fork(sid, **at):
        stubs.append(stubs.pop(0))
        return stubs[0].ForkSession(
            ext_pb.ForkSessionRequest(session_id=sid, **at), timeout=CALL_TIMEOUT
        )

    at = len(PROMPT) - 2
    independent = c.create(label="independent").session_id
    c.append(independent, PROMPT[:at])
    digest = c.info(independent).logits_digest
    want, _, _ = c.generate(independent, max_tokens=4)
    c.close(independent)

    source = c.create(label="source").session_id
    c.append(source, PROMPT)
    forked = fork(source, at_length=at)
    check(forked.history_length == at, f"fork history_length {forked.history_length}, want {at}")
    check(forked.session_id != source, "the fork has its source's id")
    info = c.info(forked.session_id)
    check(info.logits_digest == digest, "the fork's logits differ from an independent session's")
    check(info.client_label == "source", f"the fork's label is {info.client_label!r}")
    expect_status(
        grpc.StatusCode.INVALID_ARGUMENT,
        "ForkSession past the history",
        lambda: fork(source, at_length=len(PROMPT) + 1),
    )
    expect_status(
        grpc.StatusCode.NOT_FOUND,
        "ForkSession of an unknown id",
        lambda: fork(unknown_id_like(source)),
    )
    c.close(source)
    got, _, _ = c.generate(forked.session_id, max_tokens=4)
    check(got == want, f"the fork generated {got}, an independent session {want}")
    whole = fork(forked.session_id)
    check(
        whole.history_length == at + 4,
        f"a fork without at_length kept {whole.history_length} tokens, want {at + 4}",
    )
    c.close(forked.session_id)
    c.close(whole.session_id)
    print(f"ok   ForkSession at {at}: same digest and tokens {got} as a fresh session")


def check_eos(c, greedy):
    """The first greedy token, declared as EOS, ends the call at once."""
    pb = c.pb
    first = greedy[0]
    sid = c.create(label="eos", eos=[first]).session_id
    c.append(sid, PROMPT)
    tokens, done, _ = c.generate(sid, max_tokens=16)
    check(tokens == [first], f"EOS run streamed {tokens}, want [{first}]")
    check(
        done.stop_reason == pb.GenerateDone.STOP_REASON_EOS,
        f"stop reason {stop_reason(pb, done)}, want STOP_REASON_EOS",
    )
    check(done.generated_token_count == 1, f"generated_token_count {done.generated_token_count}")
    # An extension field (19): checked when the server fills it in.
    echoed = list(c.info(sid).eos_token_ids)
    if echoed:
        check(echoed == [first], f"GetSessionInfo.eos_token_ids {echoed}, want [{first}]")
    else:
        print("note GetSessionInfo leaves the eos_token_ids extension empty")
    c.close(sid)
    print(f"ok   eos_token_ids=[{first}] stops at once with STOP_REASON_EOS, count 1")


def unknown_id_like(sid):
    """A well-formed id that no session has: the given one, last digit changed."""
    last = sid[-1]
    swap = "0" if last != "0" else "1"
    return sid[:-1] + swap


def check_invalid_arguments(c):
    code = grpc.StatusCode.INVALID_ARGUMENT
    sid = c.create(label="invalid").session_id
    vocab = c.vocab_size

    expect_status(
        grpc.StatusCode.NOT_FOUND,
        "GetSessionInfo on an unknown id",
        lambda: c.info(unknown_id_like(sid)),
    )
    expect_status(
        grpc.StatusCode.NOT_FOUND,
        "AppendTokens on an unknown id",
        lambda: c.append(unknown_id_like(sid), [1]),
    )

    expect_status(code, "Generate on an empty history", lambda: c.generate(sid, max_tokens=1))
    c.append(sid, PROMPT)
    expect_status(code, f"token id {vocab} (= vocab)", lambda: c.append(sid, [1, 2, vocab]))
    expect_status(code, "token id 2^32-1", lambda: c.append(sid, [0xFFFFFFFF]))
    length = c.info(sid).history_length
    check(
        length == len(PROMPT),
        f"a rejected AppendTokens changed the history: {length}, want {len(PROMPT)}",
    )
    print("ok   rejected AppendTokens left the history as it was")

    # An id the server does not hold is NOT_FOUND whatever its form: the
    # published SDKs' own integration tests send `sess-does-not-exist`.
    missing = grpc.StatusCode.NOT_FOUND
    for bad in ["sess-does-not-exist", "", sid.upper(), sid + "00", "z" * len(sid)]:
        expect_status(missing, f"GetSessionInfo id {bad!r}", lambda bad=bad: c.info(bad))
        expect_status(missing, f"AppendTokens id {bad!r}", lambda bad=bad: c.append(bad, [1]))
        expect_status(missing, f"CloseSession id {bad!r}", lambda bad=bad: c.close(bad))
        expect_status(
            missing, f"Generate id {bad!r}", lambda bad=bad: c.generate(bad, max_tokens=1)
        )
        # A bad argument is INVALID_ARGUMENT whatever the id.
        expect_status(
            code,
            f"Generate max_tokens 0, id {bad!r}",
            lambda bad=bad: c.generate(bad, max_tokens=0),
        )

    expect_status(code, "max_tokens 0", lambda: c.generate(sid, max_tokens=0))
    expect_status(code, "temperature -1", lambda: c.generate(sid, max_tokens=1, temperature=-1.0))
    expect_status(
        code, "temperature NaN", lambda: c.generate(sid, max_tokens=1, temperature=float("nan"))
    )
    expect_status(code, "top_p 0", lambda: c.generate(sid, max_tokens=1, top_p=0.0))
    expect_status(code, "top_p 1.5", lambda: c.generate(sid, max_tokens=1, top_p=1.5))
    length = c.info(sid).history_length
    check(length == len(PROMPT), f"a rejected Generate changed the history: {length}")
    c.close(sid)


def check_unparsable_bodies(channel):
    """Request bytes that are not a valid message, sent by the stock client
    as they are (no serializer): INVALID_ARGUMENT on every method, never
    INTERNAL, and the server goes on."""
    bodies = {
        "garbage (field number 0)": b"\x00\x01\x02\x03",
        "a truncated varint": b"\x10\x80",
        "field 1 as a fixed32": b"\x0d\x00\x00\x00\x00",
        "field 1 not UTF-8": b"\x0a\x02\xff\xfe",
    }
    methods = [
        ("CreateSession", False),
        ("AppendTokens", False),
        ("Generate", True),
        ("CloseSession", False),
        ("GetSessionInfo", False),
    ]
    for method, streaming in methods:
        path = f"/kakeya.v1.RuntimeService/{method}"
        call = channel.unary_stream(path) if streaming else channel.unary_unary(path)
        for what, body in bodies.items():

            def send(call=call, body=body, streaming=streaming):
                reply = call(body, timeout=CALL_TIMEOUT)
                if streaming:
                    list(reply)

            expect_status(grpc.StatusCode.INVALID_ARGUMENT, f"{method} with {what}", send)


def check_bounds(c):
    """Fields over their documented bounds: INVALID_ARGUMENT, nothing kept."""
    code = grpc.StatusCode.INVALID_ARGUMENT
    expect_status(code, "a client_label of 257 bytes", lambda: c.create(label="x" * 257))
    expect_status(code, "65 eos_token_ids", lambda: c.create(eos=range(65)))
    sid = c.create(label="y" * 256, eos=range(64)).session_id
    expect_status(
        code, "65537 token ids in one AppendTokens", lambda: c.append(sid, [1] * 65537)
    )
    c.append(sid, PROMPT)
    one = c.pb.StopSequence(token_ids=[1])
    expect_status(
        code,
        "17 stop sequences",
        lambda: c.generate(sid, max_tokens=1, stop_sequences=[one] * 17),
    )
    bias = c.pb.LogitBias(token_id=1, bias=0.5)
    expect_status(
        code,
        "1025 logit_bias entries",
        lambda: c.generate(sid, max_tokens=1, logit_bias=[bias] * 1025),
    )
    expect_status(
        code, "temperature 1e-45", lambda: c.generate(sid, max_tokens=1, temperature=1e-45)
    )
    length = c.info(sid).history_length
    check(length == len(PROMPT), f"a refused call changed the history: {length}")
    c.close(sid)


def expect_exhausted(c, what):
    message = expect_status(
        grpc.StatusCode.RESOURCE_EXHAUSTED, what, lambda: c.create(label="one-too-many")
    )
    check(
        any(ch.isdigit() for ch in message),
        f"RESOURCE_EXHAUSTED message carries no numbers: {message!r}",
    )


def start_busy(c, sid):
    """Starts a long Generate on sid and waits for its first token, so the
    session is mid-call (and may not be evicted) until the stream is
    cancelled."""
    stream = c.stub.Generate(
        c.pb.GenerateRequest(session_id=sid, max_tokens=2000), timeout=CALL_TIMEOUT
    )
    for msg in stream:
        if msg.WhichOneof("payload") == "token_id":
            return stream
    raise Mismatch("a long Generate ended before its first token")


def check_resource_exhausted(c, max_sessions, eviction):
    held = []
    for i in range(max_sessions):
        sid = c.create(label=f"hold-{i}").session_id
        c.append(sid, PROMPT)
        held.append(sid)

    # The session limit with every session idle: the policy decides.
    if eviction == "none":
        expect_exhausted(c, f"CreateSession {max_sessions + 1} of {max_sessions}, eviction none")
    else:
        newest = c.create(label="evicts-an-idle-one").session_id
        # Sessions are sharded over the workers, and each shard evicts its
        # own least recently used idle session: exactly one of the others
        # must be gone, whichever shard the new one landed on.
        alive = []
        for sid in held:
            try:
                c.info(sid)
                alive.append(sid)
            except grpc.RpcError as err:
                check(
                    err.code() == grpc.StatusCode.NOT_FOUND,
                    f"GetSessionInfo after an eviction: {err.code().name}: {err.details()}",
                )
        check(
            len(alive) == max_sessions - 1,
            f"{max_sessions - len(alive)} sessions evicted to make room for one",
        )
        c.append(newest, PROMPT)
        held = alive + [newest]
        print("ok   eviction lru: one idle session made room for a new one")

    # The limit with every session mid-call: nothing may be evicted, under
    # any policy (CONTRACT 2.6).
    streams = [start_busy(c, sid) for sid in held]
    expect_exhausted(c, f"CreateSession {max_sessions + 1} of {max_sessions}, all busy")
    for stream in streams:
        stream.cancel()
    for sid in held:
        c.close(sid)
    c.close(c.create(label="after-close").session_id)
    print("ok   closing sessions frees room for new ones")


def check_deadline(c):
    pb = c.pb
    sid = c.create(label="deadline").session_id
    c.append(sid, PROMPT)
    started = time.monotonic()
    expect_status(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        "Generate of 2000 tokens with a 0.25 s deadline",
        lambda: c.generate(sid, timeout=0.25, max_tokens=2000),
    )
    # The server stops the work within one decode step, so the session
    # answers again at once and its committed history is a whole number of
    # tokens it can build on.
    tokens, done, _ = c.generate(sid, timeout=30.0, max_tokens=1)
    check(
        done.stop_reason == pb.GenerateDone.STOP_REASON_MAX_TOKENS and len(tokens) == 1,
        f"Generate after a deadline: {tokens}, {stop_reason(pb, done)}",
    )
    info = c.info(sid)
    check(
        info.history_length == done.history_length,
        f"history {info.history_length} after the deadline run, done said {done.history_length}",
    )
    check(
        info.history_length < len(PROMPT) + 2000,
        f"the deadline did not stop the work: history {info.history_length}",
    )
    c.close(sid)
    print(
        f"ok   session usable after DEADLINE_EXCEEDED "
        f"(history {info.history_length}, {time.monotonic() - started:.2f} s)"
    )


def check_cancellation(c):
    pb = c.pb
    sid = c.create(label="cancel").session_id
    c.append(sid, PROMPT)
    stream = c.stub.Generate(
        pb.GenerateRequest(session_id=sid, max_tokens=2000), timeout=CALL_TIMEOUT
    )
    first = None
    try:
        for msg in stream:
            if msg.WhichOneof("payload") == "token_id":
                first = msg.token_id
                stream.cancel()
                break
    except grpc.RpcError as err:
        raise Mismatch(f"Generate failed before its first token: {err.code().name}") from err
    check(first is not None, "Generate ended before its first token")
    check(stream.code() == grpc.StatusCode.CANCELLED, f"cancelled stream: {stream.code()}")

    committed = c.info(sid).history_length
    check(
        committed >= len(PROMPT) + 1,
        f"after cancel the history is {committed}: the streamed token was not committed",
    )
    # A queued Generate runs once the cancelled one has stopped; its done
    # says the final length, which GetSessionInfo must agree with.
    tokens, done, _ = c.generate(sid, timeout=60.0, max_tokens=1)
    check(len(tokens) == 1, f"Generate after cancel streamed {tokens}")
    final = c.info(sid).history_length
    check(final == done.history_length, f"history {final}, done said {done.history_length}")
    check(final >= committed + 1, f"history went from {committed} to {final}")
    check(
        final < len(PROMPT) + 2000,
        f"cancellation did not stop the work: history {final}",
    )

    # Everything committed is the greedy continuation: a fresh session given
    # the same prompt generates the same first and last tokens.
    twin = c.create(label="twin").session_id
    c.append(twin, PROMPT)
    again, _, _ = c.generate(twin, max_tokens=final - len(PROMPT))
    check(again[0] == first, f"first token {again[0]} in a twin session, {first} before")
    check(again[-1] == tokens[0], f"last token {again[-1]} in a twin session, {tokens[0]} before")
    c.close(twin)
    c.close(sid)
    print(
        f"ok   cancel after the first token: {committed - len(PROMPT)} committed, "
        f"session still works (history {final})"
    )


def check_seeded(c):
    """Seeded sampling repeats, reports its seed, and another seed differs."""
    def sample(seed):
        sid = c.create(label="seeded").session_id
        c.append(sid, PROMPT)
        tokens, done, _ = c.generate(sid, max_tokens=16, temperature=1.0, seed=seed)
        c.close(sid)
        return tokens, done

    first, done = sample(1234)
    again, _ = sample(1234)
    other, _ = sample(4321)
    check(first == again, f"seed 1234 twice: {first} then {again}")
    check(done.seed_used == 1234, f"seed_used {done.seed_used}")
    check(first != other, "seeds 1234 and 4321 drew the same 16 tokens")
    print("ok   seeded sampling repeats and reports its seed")


def check_idle_ttl(c, ttl):
    """A session idle for longer than the server's TTL is evicted."""
    sid = c.create(label="idle").session_id
    c.append(sid, PROMPT)
    time.sleep(ttl + 1.5)
    expect_status(grpc.StatusCode.NOT_FOUND, "GetSessionInfo after the idle TTL",
                  lambda: c.info(sid))
    print(f"ok   a session idle past the {ttl} s TTL is evicted")


def open_channels(address, count):
    """count channels to address, each on a connection of its own (gRPC
    would otherwise share one among channels to the same target), ready."""
    channels = [
        grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(count)
    ]
    for channel in channels:
        grpc.channel_ready_future(channel).result(timeout=30)
    return channels


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("address", help="HOST:PORT of a running inferd serve")
    parser.add_argument("--max-sessions", type=int, default=2)
    parser.add_argument("--eviction", choices=["none", "lru"], default="none")
    parser.add_argument("--idle-ttl", type=float,
                        help="the server's idle TTL: run only the seeded-sampling and TTL checks")
    parser.add_argument("--spread", type=int, default=1,
                        help="channels to send the calls over in turn (replicas behind a proxy)")
    args = parser.parse_args()
    if args.idle_ttl is not None:
        with tempfile.TemporaryDirectory(prefix="inferd-stubs-") as out_dir:
            pb, rpc, *_ = generate_stubs(out_dir)
            channels = open_channels(args.address, args.spread)
            c = Client(channels, pb, rpc)
            check_seeded(c)
            check_idle_ttl(c, args.idle_ttl)
            for channel in channels:
                channel.close()
        print("interop: every check passed")
        return

    with tempfile.TemporaryDirectory(prefix="inferd-stubs-") as out_dir:
        pb, rpc, health_pb, health_rpc, ext_pb, ext_rpc = generate_stubs(out_dir)
        channels = open_channels(args.address, args.spread)
        c = Client(channels, pb, rpc)
        for channel in channels:
            check_health(channel, health_pb, health_rpc)
        greedy = check_lifecycle(c)
        check_fork(c, channels, ext_pb, ext_rpc)
        check_eos(c, greedy)
        check_invalid_arguments(c)
        check_unparsable_bodies(channels[0])
        check_bounds(c)
        # The session limit is one replica's: checked on one channel.
        check_resource_exhausted(Client(channels[:1], pb, rpc), args.max_sessions, args.eviction)
        check_deadline(c)
        check_cancellation(c)
        for channel in channels:
            channel.close()
    print("interop: every check passed")


if __name__ == "__main__":
    try:
        main()
    except Mismatch as err:
        print(f"interop: MISMATCH: {err}", file=sys.stderr)
        sys.exit(1)
    except grpc.RpcError as err:
        print(
            f"interop: unexpected gRPC failure {err.code().name}: {err.details()}",
            file=sys.stderr,
        )
        sys.exit(1)
