#!/usr/bin/env python3
"""What keeping sessions in PostgreSQL costs (`inferd serve --session-store`),
as a stock Python gRPC client sees it (run through scripts/bench-replicas,
which supplies the Python environment and PostgreSQL).

Sections:

  latency   --clients clients (1: the store's cost alone, no queueing
            behind other sessions), each looping append(16) / Generate(8)
            on a session of its own for --seconds: p50 and p99 of each
            call with the
            sessions in memory only, in a state directory
            (--durability sync) and in the session store; the three
            alternate, --runs times.
  move      a session of --move-tokens tokens on replica a, then a
            Generate(1) on it through replica b: while a lives (a hands
            it over) and after a is killed (b waits out the lease,
            --lease-secs, then takes it over); against the same call on a
            session that stays. Median of --runs.
  capacity  sessions of --move-tokens tokens created and filled until a
            replica (--kv-mib, --eviction none) refuses one, on one replica
            and on three sharing the store.
"""

import argparse
import os
import pathlib
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import grpc

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "tests" / "interop"))
import runtime_client  # noqa: E402
from bench_serve import Server, connect, cpu_line, percentile, prompt_ids  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Postgres:
    """A PostgreSQL cluster of its own in a temporary directory (as the
    `postgres` user when root: PostgreSQL refuses root)."""

    def __init__(self):
        bins = sorted(pathlib.Path("/usr/lib/postgresql").glob("*/bin"),
                      key=lambda p: int(p.parent.name))
        if not bins:
            raise SystemExit("no PostgreSQL (scripts/setup installs it)")
        self.bin = bins[-1]
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="inferd-bench-pg-"))
        self.as_user = []
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres", "postgres")
            self.as_user = ["runuser", "-u", "postgres", "--"]
        subprocess.run(self.as_user + [str(self.bin / "initdb"), "-D", str(self.dir / "data"),
                                       "-U", "inferd", "--auth=trust", "-E", "UTF8"],
                       check=True, stdout=subprocess.DEVNULL)
        self.port = free_port()
        self.proc = subprocess.Popen(
            self.as_user + [str(self.bin / "postgres"), "-D", str(self.dir / "data"),
                            "-p", str(self.port), "-c", "listen_addresses=127.0.0.1",
                            "-c", f"unix_socket_directories={self.dir}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(200):
            ready = subprocess.run(self.as_user + [str(self.bin / "pg_isready"), "-q", "-h",
                                                   "127.0.0.1", "-p", str(self.port)])
            if ready.returncode == 0:
                break
            time.sleep(0.05)
        self.url = f"postgres://inferd@127.0.0.1:{self.port}/postgres?sslmode=disable"

    def close(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)
        shutil.rmtree(self.dir, ignore_errors=True)


def replica(args, pg, name, extra=()):
    return Server(args.binary, args.model, args.workers,
                  ["--session-store", pg.url, "--replica-id", name,
                   "--lease-secs", str(args.lease_secs), *extra])


def latency(args, pb, rpc, pg):
    modes = [("in memory", lambda: []),
             ("--state-dir, --durability sync",
              lambda: ["--state-dir", tempfile.mkdtemp(prefix="inferd-bench-state-"),
                       "--durability", "sync"]),
             ("--session-store", lambda: ["--session-store", pg.url, "--replica-id", "bench"])]
    calls = {(name, call): [] for name, _ in modes for call in ("append", "generate")}
    for _ in range(args.runs):
        for name, flags in modes:
            extra = flags()
            with Server(args.binary, args.model, args.workers, extra) as srv:
                channel, client = connect(srv.addr, pb, rpc)
                stop_at = time.monotonic() + args.seconds

                def loop(i):
                    sid = client.create(label=f"l{i}").session_id
                    n = 0
                    while time.monotonic() < stop_at:
                        t0 = time.monotonic()
                        client.append(sid, prompt_ids(16, salt=i * 1000 + n))
                        t1 = time.monotonic()
                        for _ in client.stub.Generate(
                                pb.GenerateRequest(session_id=sid, max_tokens=8), timeout=600):
                            pass
                        t2 = time.monotonic()
                        calls[(name, "append")].append((t1 - t0) * 1e3)
                        calls[(name, "generate")].append((t2 - t1) * 1e3)
                        n += 1
                    client.close(sid)

                threads = [threading.Thread(target=loop, args=(i,))
                           for i in range(args.clients)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                channel.close()
            if "--state-dir" in extra:
                shutil.rmtree(extra[1], ignore_errors=True)
    print(f"\n{args.clients} sessions looping append(16) / Generate(8) for {args.seconds} s, "
          f"{args.runs} runs alternating, {args.binary}")
    print("| sessions kept | AppendTokens p50 ms | p99 ms | Generate(8) p50 ms | p99 ms | calls |")
    print("|---|---|---|---|---|---|")
    for name, _ in modes:
        a, g = calls[(name, "append")], calls[(name, "generate")]
        print(f"| {name} | {percentile(a, 0.5):.2f} | {percentile(a, 0.99):.2f} | "
              f"{percentile(g, 0.5):.2f} | {percentile(g, 0.99):.2f} | {len(a)} |")


def fill(client, sid, tokens, salt):
    """Appends `tokens` tokens, 500 at a time; sessions of other salts
    share no prefix (nothing to map instead of computing)."""
    for start in range(0, tokens, 500):
        client.append(sid, prompt_ids(min(500, tokens - start), salt=salt * 100 + start))


def timed_generate(client, pb, sid):
    t0 = time.monotonic()
    for _ in client.stub.Generate(pb.GenerateRequest(session_id=sid, max_tokens=1), timeout=600):
        pass
    return (time.monotonic() - t0) * 1e3


def move(args, pb, rpc, pg):
    times = {"stays on a": [], "handed over to b (a alive)": [],
             "taken over by b (a killed)": [], "its prefill on a (the appends)": []}
    for _ in range(args.runs):
        a = replica(args, pg, "a")
        b = replica(args, pg, "b")
        try:
            ca, on_a = connect(a.addr, pb, rpc)
            cb, on_b = connect(b.addr, pb, rpc)
            stays = on_a.create(label="stays").session_id
            fill(on_a, stays, args.move_tokens, 1)
            times["stays on a"].append(timed_generate(on_a, pb, stays))
            moves = on_a.create(label="moves").session_id
            t0 = time.monotonic()
            fill(on_a, moves, args.move_tokens, 2)
            times["its prefill on a (the appends)"].append((time.monotonic() - t0) * 1e3)
            times["handed over to b (a alive)"].append(timed_generate(on_b, pb, moves))
            dies = on_a.create(label="dies").session_id
            fill(on_a, dies, args.move_tokens, 3)
            a.proc.kill()
            a.proc.wait()
            times["taken over by b (a killed)"].append(timed_generate(on_b, pb, dies))
            ca.close()
            cb.close()
        finally:
            a.stop()
            b.stop()
    print(f"\na {args.move_tokens}-token session's next Generate(1) through another replica, "
          f"lease {args.lease_secs} s, median of {args.runs}, {args.binary}")
    print("| the session | ms |")
    print("|---|---|")
    for name, xs in times.items():
        print(f"| {name} | {statistics.median(xs):.0f} |")


def capacity(args, pb, rpc, pg):
    def count(servers):
        held = 0
        channels = [connect(s.addr, pb, rpc) for s in servers]
        for ch, client in channels:
            while True:
                try:
                    sid = client.create(label="c").session_id
                    fill(client, sid, args.move_tokens, 10 + held)
                    held += 1
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                        raise
                    break
            ch.close()
        return held

    flags = ["--kv-mib", str(args.kv_mib), "--eviction", "none"]
    one = [replica(args, pg, "solo", flags)]
    try:
        alone = count(one)
    finally:
        one[0].stop()
    three = [replica(args, pg, f"r{n}", flags) for n in range(3)]
    try:
        together = count(three)
    finally:
        for s in three:
            s.stop()
    print(f"\n{args.move_tokens}-token sessions held with --kv-mib {args.kv_mib} --eviction none "
          f"per replica, {args.binary}")
    print("| replicas | sessions held |")
    print("|---|---|")
    print(f"| 1 | {alone} |")
    print(f"| 3 (one store) | {together} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("binary")
    ap.add_argument("--model", default=str(REPO / "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--only", choices=["latency", "move", "capacity"], action="append")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--clients", type=int, default=1)
    ap.add_argument("--lease-secs", type=float, default=2)
    ap.add_argument("--move-tokens", type=int, default=2000)
    ap.add_argument("--kv-mib", type=int, default=256)
    args = ap.parse_args()
    stubs = tempfile.mkdtemp()
    pb, rpc, *_ = runtime_client.generate_stubs(stubs)
    print(cpu_line())
    pg = Postgres()
    try:
        for name in args.only or ["latency", "move", "capacity"]:
            globals()[name](args, pb, rpc, pg)
    finally:
        pg.close()


if __name__ == "__main__":
    main()
