#!/usr/bin/env python3
"""Drives a running `inferd shard` with Python stubs generated from the
published schema (protos/inferd/shard/v1/shard_runtime.proto) by
grpcio-tools, with no inferd code: handshake, a prefill fragment, a frame
with a corrupted payload (refused with KIND_CHECKSUM, the stream goes on),
a decode frame continuing the session, and a release.

Usage: shard_client.py ADDR GGUF LAYER_BEGIN LAYER_END LAYER_COUNT HIDDEN

Prints one JSON line: the SHA-256 of the two output payloads, for the
caller to compare with its own computation; exits 1 on any mismatch.
"""

import hashlib
import json
import pathlib
import queue
import struct
import sys
import tempfile

import grpc

from shard_common import crc32c, stubs

SESSION = bytes([0x11] * 16)


def rows(count, first, hidden):
    """Exactly representable values, the same bits in Python and Rust."""
    values = [((i * 37) % 101 - 50) / 64.0 for i in range(first * hidden, (first + count) * hidden)]
    return struct.pack(f"<{len(values)}f", *values)


def fail(message):
    print(message, file=sys.stderr)
    sys.exit(1)


def main():
    addr, gguf, begin, end, count, hidden = sys.argv[1:7]
    begin, end, count, hidden = int(begin), int(end), int(count), int(hidden)
    digest = hashlib.sha256(pathlib.Path(gguf).read_bytes()).digest()
    with tempfile.TemporaryDirectory() as tmp:
        pb, rpc = stubs(tmp)
        channel = grpc.insecure_channel(addr, options=[
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20)])
        stub = rpc.ShardRuntimeStub(channel)
        fingerprint = pb.ModelFingerprint(gguf_sha256=digest, layer_begin=begin, layer_end=end,
                                          layer_count=count, hidden_size=hidden)
        coordinator_epoch = 0x5059_7468_6f6e
        reply = stub.Handshake(pb.HandshakeRequest(
            protocol_version=pb.PROTOCOL_VERSION_1, expected=fingerprint,
            coordinator_epoch=coordinator_epoch,
            limits=pb.Limits(max_frame_bytes=1 << 20, credit_window=4,
                             encodings=[pb.ENCODING_F32])), timeout=30)
        if reply.served != fingerprint:
            fail(f"the shard serves {reply.served}")
        outgoing = queue.Queue()
        sequence = [0]

        def frame(body_name, body, payload=b""):
            sequence[0] += 1
            f = pb.Frame(payload=payload)
            f.header.shard_epoch = reply.shard_epoch
            f.header.coordinator_epoch = coordinator_epoch
            f.header.sequence = sequence[0]
            f.header.encoding = pb.ENCODING_F32 if payload else pb.ENCODING_UNSPECIFIED
            f.header.payload_crc32c = crc32c(payload)
            getattr(f, body_name).CopyFrom(body)
            return f

        def requests():
            while True:
                item = outgoing.get()
                if item is None:
                    return
                yield item

        responses = stub.Session(requests(), timeout=60)

        def next_payload_frame():
            for f in responses:
                if crc32c(f.payload) != f.header.payload_crc32c:
                    fail("a reply with a bad checksum")
                if f.WhichOneof("body") != "credit":
                    return f
            fail("the stream ended")

        outputs = []
        prefill = pb.Hidden(runs=[pb.Rows(session_id=SESSION, position=0, count=3)])
        outgoing.put(frame("prefill", prefill, rows(3, 0, hidden)))
        out = next_payload_frame()
        if out.WhichOneof("body") != "output" or out.output.answers_sequence != 1:
            fail(f"expected the output of frame 1, got {out}")
        if len(out.payload) != 3 * hidden * 4:
            fail(f"output payload of {len(out.payload)} bytes")
        outputs.append(hashlib.sha256(out.payload).hexdigest())

        bad = frame("decode", pb.Hidden(runs=[pb.Rows(session_id=SESSION, position=3, count=1)]),
                    rows(1, 3, hidden))
        corrupted = bytearray(bad.payload)
        corrupted[0] ^= 0x80
        bad.payload = bytes(corrupted)
        outgoing.put(bad)
        err = next_payload_frame()
        if err.WhichOneof("body") != "error" or err.error.kind != pb.ShardError.KIND_CHECKSUM:
            fail(f"expected KIND_CHECKSUM, got {err}")

        decode = pb.Hidden(runs=[pb.Rows(session_id=SESSION, position=3, count=1)])
        outgoing.put(frame("decode", decode, rows(1, 3, hidden)))
        out = next_payload_frame()
        if out.WhichOneof("body") != "output" or out.output.answers_sequence != 3:
            fail(f"expected the output of frame 3, got {out}")
        outputs.append(hashlib.sha256(out.payload).hexdigest())

        outgoing.put(frame("release", pb.Release(session_ids=[SESSION])))
        outgoing.put(None)
        for _ in responses:
            pass
        print(json.dumps({"outputs": outputs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
