#!/usr/bin/env python3
"""A stock Python gRPC client whose session outlives a restart of the server.

Stubs are generated at run time from the repository's `protos/`, as in
runtime_client.py. Run in two steps around a restart of `inferd serve
--state-dir DIR` (the test kills the process with SIGKILL in between):

  restart_client.py first HOST:PORT            creates a session, appends a
                                               prompt, prints `ID DIGEST`
  restart_client.py second HOST:PORT ID DIGEST checks the session is back with
                                               its history and logits, then
                                               appends again and generates

Exits 0 when every check passes; otherwise prints what differed and exits 1.
"""

import sys
import tempfile
import time

import grpc

from runtime_client import CALL_TIMEOUT, PROMPT, Mismatch, check, generate_stubs


def first(stub, pb):
    sid = stub.CreateSession(
        pb.CreateSessionRequest(client_label="survivor"), timeout=CALL_TIMEOUT
    ).session_id
    stub.AppendTokens(
        pb.AppendTokensRequest(session_id=sid, token_ids=PROMPT[:5]), timeout=CALL_TIMEOUT
    )
    digest = stub.GetSessionInfo(
        pb.GetSessionInfoRequest(session_id=sid), timeout=CALL_TIMEOUT
    ).logits_digest
    print(sid, digest)


def second(stub, pb, sid, digest):
    # Right after a start the session is busy while its history is fed again.
    deadline = time.monotonic() + CALL_TIMEOUT
    while True:
        info = stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid), timeout=CALL_TIMEOUT)
        if not info.busy or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    check(info.history_length == 5, f"history {info.history_length} after the restart, want 5")
    check(info.client_label == "survivor", f"label {info.client_label!r} after the restart")
    check(info.logits_digest == digest, "the logits differ from before the restart")
    check(info.durable, "a restored session says it is journaled")
    reply = stub.AppendTokens(
        pb.AppendTokensRequest(session_id=sid, token_ids=PROMPT[5:]), timeout=CALL_TIMEOUT
    )
    check(reply.history_length == len(PROMPT), f"history {reply.history_length} after appending")
    done = None
    for msg in stub.Generate(
        pb.GenerateRequest(session_id=sid, max_tokens=3), timeout=CALL_TIMEOUT
    ):
        if msg.WhichOneof("payload") == "done":
            done = msg.done
    check(done is not None and done.generated_token_count == 3, f"generate ended with {done}")
    print("restart: the session survived")


def main():
    with tempfile.TemporaryDirectory(prefix="inferd-stubs-") as out_dir:
        pb, rpc, *_ = generate_stubs(out_dir)
        with grpc.insecure_channel(sys.argv[2]) as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
            stub = rpc.RuntimeServiceStub(channel)
            if sys.argv[1] == "first":
                first(stub, pb)
            else:
                second(stub, pb, sys.argv[3], int(sys.argv[4]))


if __name__ == "__main__":
    try:
        main()
    except Mismatch as err:
        print(f"restart: MISMATCH: {err}", file=sys.stderr)
        sys.exit(1)
