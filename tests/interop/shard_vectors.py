#!/usr/bin/env python3
"""Decodes the shard protocol's golden frames with Python stubs generated
from the published schema (protos/inferd/shard/v1/shard_runtime.proto) by
grpcio-tools, with no inferd code: a cross-language check of the schema.

For every frame in tests/vectors/shard/manifest.json it checks, on its own:
frames expected to pass parse, carry the manifest's epochs, number 1, 2, 3
... in their stream, have a payload whose CRC32C (computed here) matches the
header and whose length is what the runs and encoding say; frames expected
to be refused as `checksum`, `malformed` (unparseable, or a resume naming
more page chains than positions or an encoding not agreed), `stale_epoch`
or `too_large` are seen to be bad for that reason. Every good frame also
survives a Python encode/decode round trip (the bytes may differ: the Rust
encoder writes the oneof body after the payload field).

Usage: shard_vectors.py  (exits 0 when every check passes)
"""

import json
import sys
import tempfile

from shard_common import REPO, crc32c, stubs

VECTORS = REPO / "tests/vectors/shard"


def row_bytes(pb, encoding, hidden):
    if encoding == pb.ENCODING_F32:
        return 4 * hidden
    if encoding == pb.ENCODING_F16:
        return 2 * hidden
    if encoding == pb.ENCODING_Q8_0:
        return hidden // 32 * 34
    return None


def main():
    assert crc32c(b"123456789") == 0xE3069283
    manifest = json.loads((VECTORS / "manifest.json").read_text())
    hidden = manifest["hidden_size"]
    failures = []
    checked = 0
    with tempfile.TemporaryDirectory() as tmp:
        pb, _ = stubs(tmp)
        for case in manifest["cases"]:
            expected_sequence = 1
            for entry in case["frames"]:
                name = f'{case["name"]}/{entry["file"]}'
                data = (VECTORS / entry["file"]).read_bytes()
                expect = entry["expect"]
                checked += 1
                frame = pb.Frame()
                try:
                    frame.ParseFromString(data)
                    parsed = frame.HasField("header")
                except Exception:  # noqa: BLE001 - any parse failure is "malformed"
                    parsed = False
                if expect == "too_large":
                    if len(data) <= manifest["max_frame_bytes"]:
                        failures.append(f"{name}: {len(data)} bytes is within the limit")
                    continue
                if not parsed:
                    if expect != "malformed":
                        failures.append(f"{name}: does not parse, expected {expect}")
                    continue
                header = frame.header
                crc_ok = crc32c(frame.payload) == header.payload_crc32c
                epochs_ok = (header.shard_epoch == manifest["shard_epoch"]
                             and header.coordinator_epoch == manifest["coordinator_epoch"])
                if expect == "checksum":
                    if crc_ok:
                        failures.append(f"{name}: checksum matches, expected a mismatch")
                    continue
                if expect == "stale_epoch":
                    if epochs_ok:
                        failures.append(f"{name}: live epochs, expected stale ones")
                    continue
                if not crc_ok:
                    failures.append(f"{name}: CRC32C mismatch")
                if not epochs_ok:
                    failures.append(f"{name}: epochs differ from the manifest")
                if frame.WhichOneof("body") == "resume":
                    resume = frame.resume
                    agreed = [getattr(pb, "ENCODING_" + e.upper()) for e in case["encodings"]]
                    sound = (len(resume.page_chains) <= resume.length
                             and resume.encoding in agreed
                             and len(resume.session_id) == 16)
                    if sound != (expect == "ok"):
                        failures.append(f"{name}: a resume of {resume.length} positions, "
                                        f"{len(resume.page_chains)} chains, encoding "
                                        f"{resume.encoding}: expected {expect}")
                if expect == "ok":
                    if header.sequence != expected_sequence:
                        failures.append(f"{name}: sequence {header.sequence}, expected {expected_sequence}")
                    expected_sequence += 1
                    again = pb.Frame()
                    again.ParseFromString(frame.SerializeToString())
                    if again != frame:
                        failures.append(f"{name}: does not survive a Python round trip")
                    body = frame.WhichOneof("body")
                    if body in ("prefill", "decode", "output"):
                        rows = sum(run.count for run in getattr(frame, body).runs)
                        size = row_bytes(pb, header.encoding, hidden)
                        if size is None or rows * size != len(frame.payload):
                            failures.append(f"{name}: payload of {len(frame.payload)} bytes for {rows} rows")
                        if any(len(run.session_id) != 16 for run in getattr(frame, body).runs):
                            failures.append(f"{name}: a session id is not 16 bytes")
                    elif body is None:
                        failures.append(f"{name}: no body")
    if failures:
        print("\n".join(failures))
        return 1
    print(f"shard vectors: {checked} frames checked by Python stubs from the schema")
    return 0


if __name__ == "__main__":
    sys.exit(main())
