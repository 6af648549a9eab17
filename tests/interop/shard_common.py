"""What the shard-protocol interop scripts share: CRC-32C, computed here
so no inferd code is involved, and Python stubs generated from the
published schema with grpcio-tools."""

import importlib
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
PROTOS = REPO / "protos"


def crc32c(data):
    """CRC-32C (Castagnoli), reflected polynomial 0x82F63B78."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def stubs(out_dir):
    """Generates and imports the shard schema's message and service modules."""
    cmd = [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTOS}",
           f"--python_out={out_dir}", f"--grpc_python_out={out_dir}",
           "inferd/shard/v1/shard_runtime.proto"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"protoc failed: {done.stderr}")
    sys.path.insert(0, str(out_dir))
    return (importlib.import_module("inferd.shard.v1.shard_runtime_pb2"),
            importlib.import_module("inferd.shard.v1.shard_runtime_pb2_grpc"))
