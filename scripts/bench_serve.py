#!/usr/bin/env python3
"""What `inferd serve` costs as a stock gRPC client sees it (run through
scripts/bench-serve, which supplies the Python environment).

Sections (each alternates the binaries given, median of --runs runs):

  single      one session's decode through gRPC next to the local CLI:
              ms/token of a streamed Generate (first to last token) and of
              `inferd generate --ignore-eos` whole process, as
              (time(32 + N tokens) - time(32 tokens)) / N.
  concurrent  aggregate decode tokens/s of 1, 4, 16 and 64 sessions that
              Generate at once (each with a 32-token prompt appended first).
  coldstart   from spawning `inferd serve` to the first CreateSession answered
              (the model file in the page cache).
  soak        16 clients looping create / append(32) / Generate(32) / close for
              --soak-seconds: p50, p99 and max of each phase.
  durability  the same 16 clients looping append(16) / Generate(32) on one
              session each for --soak-seconds, with no --state-dir and with
              each --durability: aggregate generated tokens/s, for every
              binary given, alternating.
  prefix      64 sessions (--prefix-sessions) whose histories share a
              2,000-token prefix (--prefix-tokens) then 16 tokens of their
              own, appended one session after another, against 64 with
              nothing in common: KV bytes the pool holds (each page once),
              the sum every session reports, and each session's time to its
              first token (append + Generate(1)).
  restore     a 4,096-token session (--restore-tokens) in a state directory:
              its cold prefill (the append) against its restore after a
              SIGKILL (spawn to the session answering idle, minus spawn to
              the first CreateSession answered with nothing to restore).
  spill       two 4,096-token sessions (--restore-tokens) in a KV cache that
              holds one: the second's append spills the first, then one more
              token appended to the first brings it back (spilling the
              second). That append's time with the spilled pages written out
              and read back (the default) against --max-spill-mib 0 (the
              session keeps only its history and is computed again).
  shards      the model split over two `inferd shard` processes (layers
              0..15 and 15..30) behind a coordinator, a 4,096-token session
              (--restore-tokens): the second shard killed (SIGKILL) and
              started again, then the time of the session's next one-token
              append (which rebuilds it on the shards), with the shards'
              --state-dir (pages kept) and without (the history fed again);
              then the coordinator killed and started on its --state-dir,
              spawn to the session restored, with and without the shards'
              state dirs.
  http        the OpenAI-compatible HTTP API through the official openai
              package: time to the first streamed token of each turn of a
              5-turn chat (each turn re-sends the conversation), with the
              default prefix cache (turns reuse the pages of the ones
              before) and with --prefix-cache-pages 0; and ms per streamed
              token of one 32-token prompt generating --tokens tokens,
              HTTP (server-sent events) next to gRPC, in one server.

The server runs with its defaults (one worker per core) unless --workers is
given. Stubs are generated from protos/ at run time, as in the interop tests.
"""

import argparse
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import grpc

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "interop"))
import runtime_client  # noqa: E402  (the stub generator the interop tests use)

PROMPT_TEXT = "The quick brown fox jumps over the lazy dog. " * 3


def prompt_ids(n, salt=0):
    """n token ids inside the reference vocabulary, different per salt."""
    return [(i * 7919 + 11 + salt * 104729) % 48000 + 100 for i in range(n)]


def cpu_line():
    flags, name = "", "?"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags") and not flags:
                flags = " " + line.split(":", 1)[1] + " "
            if line.startswith("model name") and name == "?":
                name = line.split(":", 1)[1].strip()
    simd = "none"
    for level in ["avx2", "avx512f", "avx512_vnni"]:
        if f" {level} " in flags:
            simd = level
    return f"cpu: {name} | simd: {simd} | cores: {os.cpu_count()}"


class Server:
    """`BIN serve` on a free loopback port (or `cmd` as given), stopped on
    exit."""

    def __init__(self, binary, model, workers=None, extra=(), cmd=None):
        self.log = tempfile.NamedTemporaryFile("w+", delete=False)
        if cmd is None:
            cmd = [binary, "serve", "--model", model, "--listen", "127.0.0.1:0"]
            if workers:
                cmd += ["--workers", str(workers)]
            cmd += list(extra)
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.DEVNULL)
        self.addr = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            text = pathlib.Path(self.log.name).read_text()
            m = re.search(r"^listening on (\S+)", text, re.M)
            if m:
                self.addr = m.group(1)
                break
            if self.proc.poll() is not None:
                break
            time.sleep(0.002)
        if self.addr is None:
            self.stop()
            raise SystemExit(f"{binary} serve did not start")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.unlink(self.log.name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def stream_times(client, sid, n):
    """Generates n greedy tokens; returns the arrival time of each."""
    pb = client.pb
    stream = client.stub.Generate(
        pb.GenerateRequest(session_id=sid, max_tokens=n), timeout=600
    )
    times = []
    for msg in stream:
        if msg.WhichOneof("payload") == "token_id":
            times.append(time.monotonic())
    return times


def connect(addr, pb, rpc):
    channel = grpc.insecure_channel(addr)
    grpc.channel_ready_future(channel).result(timeout=60)
    return channel, runtime_client.Client(channel, pb, rpc)


def median_spread(xs):
    return statistics.median(xs), min(xs), max(xs)


def single(args, pb, rpc):
    n = args.tokens
    serve_ms = {b: [] for b in args.binaries}
    cli_ms = {b: [] for b in args.binaries}
    for _ in range(args.runs):
        for b in args.binaries:
            with Server(b, args.model, args.workers) as srv:
                channel, client = connect(srv.addr, pb, rpc)
                sid = client.create(label="bench").session_id
                client.append(sid, prompt_ids(32))
                stream_times(client, sid, 8)  # warm the path
                times = stream_times(client, sid, n)
                serve_ms[b].append((times[-1] - times[0]) * 1e3 / (len(times) - 1))
                client.close(sid)
                channel.close()
            whole = {}
            for count in (32, 32 + n):
                t0 = time.monotonic()
                subprocess.run(
                    [b, "generate", "-m", args.model, "-p", PROMPT_TEXT, "-n", str(count),
                     "--ignore-eos"] + (["-t", str(args.workers)] if args.workers else []),
                    check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )
                whole[count] = time.monotonic() - t0
            cli_ms[b].append((whole[32 + n] - whole[32]) * 1e3 / n)
    print(f"\none session, {n} greedy tokens after a 32-token prompt, median of {args.runs}")
    print("| binary | serve ms/token | generate ms/token | serve / generate |")
    print("|---|---|---|---|")
    for b in args.binaries:
        s, smin, smax = median_spread(serve_ms[b])
        c, cmin, cmax = median_spread(cli_ms[b])
        print(f"| {b} | {s:.2f} ({smin:.2f}-{smax:.2f}) | {c:.2f} ({cmin:.2f}-{cmax:.2f}) "
              f"| {s / c:.3f} |")


def concurrent(args, pb, rpc):
    counts = [int(x) for x in args.sessions.split(",")]
    gen = args.concurrent_tokens
    rates = {(b, k): [] for b in args.binaries for k in counts}
    for _ in range(args.runs):
        for b in args.binaries:
            with Server(b, args.model, args.workers) as srv:
                channel, client = connect(srv.addr, pb, rpc)
                for k in counts:
                    sids = []
                    for i in range(k):
                        sid = client.create(label=f"c{i}").session_id
                        client.append(sid, prompt_ids(32, salt=i))
                        sids.append(sid)
                    got = [0] * k
                    start = threading.Barrier(k + 1)

                    def run(i):
                        start.wait()
                        got[i] = len(stream_times(client, sids[i], gen))

                    threads = [threading.Thread(target=run, args=(i,)) for i in range(k)]
                    for t in threads:
                        t.start()
                    start.wait()
                    t0 = time.monotonic()
                    for t in threads:
                        t.join()
                    wall = time.monotonic() - t0
                    rates[(b, k)].append(sum(got) / wall)
                    for sid in sids:
                        client.close(sid)
                channel.close()
    print(f"\nN sessions each Generate {gen} greedy tokens at once; aggregate tokens/s, "
          f"median of {args.runs}")
    print("| binary | sessions | aggregate tokens/s | x one session |")
    print("|---|---|---|---|")
    for b in args.binaries:
        one = statistics.median(rates[(b, counts[0])])
        for k in counts:
            m, lo, hi = median_spread(rates[(b, k)])
            print(f"| {b} | {k} | {m:.1f} ({lo:.1f}-{hi:.1f}) | {m / one:.2f} |")


def coldstart(args, pb, rpc):
    times = {b: [] for b in args.binaries}
    for _ in range(args.runs):
        for b in args.binaries:
            srv = Server(b, args.model, args.workers)
            try:
                channel = grpc.insecure_channel(srv.addr)
                stub = rpc.RuntimeServiceStub(channel)
                stub.CreateSession(pb.CreateSessionRequest(client_label="cold"), timeout=60,
                                   wait_for_ready=True)
                times[b].append((time.monotonic() - srv.started) * 1e3)
                channel.close()
            finally:
                srv.stop()
    print(f"\nspawn to first CreateSession answered, ms, median of {args.runs}")
    print("| binary | ms |")
    print("|---|---|")
    for b in args.binaries:
        m, lo, hi = median_spread(times[b])
        print(f"| {b} | {m:.0f} ({lo:.0f}-{hi:.0f}) |")


def metrics_server(binary, model, workers, extra=()):
    """A Server with a metrics endpoint; returns it and a scrape function."""
    srv = Server(binary, model, workers, ["--metrics-listen", "127.0.0.1:0", *extra])
    addr = None
    deadline = time.monotonic() + 30
    while addr is None and time.monotonic() < deadline:
        m = re.search(r"^metrics on (\S+)", pathlib.Path(srv.log.name).read_text(), re.M)
        addr = m and m.group(1)
        time.sleep(0.01)

    def scrape(name):
        import urllib.request

        text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=10).read().decode()
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        return float(m.group(1)) if m else None

    return srv, scrape


def durability(args, pb, rpc):
    modes = [("no state dir", [])] + [
        (f"--durability {m}", ["--durability", m]) for m in ["none", "batch", "sync"]
    ]
    # Every binary given, alternating run by run, so a build is compared
    # with another under the same conditions.
    rates = {(b, name): [] for b in args.binaries for name, _ in modes}
    for _ in range(args.runs):
        for b in args.binaries:
            for name, extra in modes:
                state = tempfile.mkdtemp(prefix="inferd-state-")
                flags = ["--state-dir", state, *extra] if extra else []
                with Server(b, args.model, args.workers, flags) as srv:
                    channel, client = connect(srv.addr, pb, rpc)
                    made = [0] * args.soak_clients
                    stop_at = time.monotonic() + args.soak_seconds

                    def loop(i):
                        sid = client.create(label=f"d{i}").session_id
                        n = 0
                        while time.monotonic() < stop_at:
                            client.append(sid, prompt_ids(16, salt=i * 1000 + n))
                            made[i] += len(stream_times(client, sid, 32))
                            n += 1
                        client.close(sid)

                    threads = [threading.Thread(target=loop, args=(i,))
                               for i in range(args.soak_clients)]
                    t0 = time.monotonic()
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join()
                    rates[(b, name)].append(sum(made) / (time.monotonic() - t0))
                    channel.close()
                shutil.rmtree(state, ignore_errors=True)
    print(f"\n{args.soak_clients} sessions looping append(16) / Generate(32) for "
          f"{args.soak_seconds} s; generated tokens/s, median of {args.runs}")
    print("| binary | state | tokens/s | x no state dir |")
    print("|---|---|---|---|")
    for b in args.binaries:
        base = statistics.median(rates[(b, "no state dir")])
        for name, _ in modes:
            m, lo, hi = median_spread(rates[(b, name)])
            print(f"| {b} | {name} | {m:.1f} ({lo:.1f}-{hi:.1f}) | {m / base:.3f} |")


def prefix(args, pb, rpc):
    b = args.binaries[0]
    n, shared = args.prefix_sessions, args.prefix_tokens
    print(f"\n{n} sessions, each a {shared}-token prefix and 16 tokens of its own, "
          f"appended one after another, {b}")
    print("| prefix | KV pool bytes held | sum of sessions' kv_live_bytes | "
          "reused tokens | first-token ms p50 | p99 | total s |")
    print("|---|---|---|---|---|---|---|")
    for same in [True, False]:
        srv, scrape = metrics_server(b, args.model, args.workers, ["--kv-mib", "4096"])
        with srv:
            channel, client = connect(srv.addr, pb, rpc)
            ttft, sids, live = [], [], 0
            t_all = time.monotonic()
            for i in range(n):
                history = prompt_ids(shared, salt=0 if same else 1000 + i)
                history += prompt_ids(16, salt=5000 + i)
                sid = client.create(label=f"p{i}").session_id
                t0 = time.monotonic()
                client.append(sid, history)
                stream_times(client, sid, 1)
                ttft.append((time.monotonic() - t0) * 1e3)
                sids.append(sid)
            total = time.monotonic() - t_all
            for sid in sids:
                live += client.info(sid).kv_live_bytes
            used = scrape("inferd_kv_used_bytes")
            reused = scrape("inferd_prefix_reused_tokens_total")
            channel.close()
        print(f"| {'shared' if same else 'distinct'} | {used / 2**20:.0f} MiB | "
              f"{live / 2**20:.0f} MiB | {reused:.0f} | {percentile(ttft, 0.5):.0f} | "
              f"{percentile(ttft, 0.99):.0f} | {total:.1f} |")


def restore(args, pb, rpc):
    b = args.binaries[0]
    prefill, back, spawn, anon = [], [], [], []
    for _ in range(args.runs):
        # The same prefill with no state directory (anonymous KV memory).
        with Server(b, args.model, args.workers) as srv:
            channel, client = connect(srv.addr, pb, rpc)
            sid = client.create(label="restore").session_id
            t0 = time.monotonic()
            client.append(sid, prompt_ids(args.restore_tokens, salt=3))
            anon.append(time.monotonic() - t0)
            channel.close()
        state = tempfile.mkdtemp(prefix="inferd-state-")
        flags = ["--state-dir", state]
        srv = Server(b, args.model, args.workers, flags)
        channel, client = connect(srv.addr, pb, rpc)
        sid = client.create(label="restore").session_id
        t0 = time.monotonic()
        client.append(sid, prompt_ids(args.restore_tokens, salt=3))
        prefill.append(time.monotonic() - t0)
        digest = client.info(sid).logits_digest
        channel.close()
        srv.proc.kill()
        srv.proc.wait()
        srv.stop()
        srv = Server(b, args.model, args.workers, flags)
        channel = grpc.insecure_channel(srv.addr)
        stub = rpc.RuntimeServiceStub(channel)
        while True:
            info = stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid), timeout=600,
                                       wait_for_ready=True)
            if not info.busy:
                break
            time.sleep(0.001)
        back.append(time.monotonic() - srv.started)
        assert info.logits_digest == digest, "restored logits differ"
        channel.close()
        srv.stop()
        empty = tempfile.mkdtemp(prefix="inferd-state-")
        srv = Server(b, args.model, args.workers, ["--state-dir", empty])
        channel = grpc.insecure_channel(srv.addr)
        stub = rpc.RuntimeServiceStub(channel)
        stub.CreateSession(pb.CreateSessionRequest(), timeout=60, wait_for_ready=True)
        spawn.append(time.monotonic() - srv.started)
        channel.close()
        srv.stop()
    p, r, s0, a = (statistics.median(x) for x in (prefill, back, spawn, anon))
    print(f"\na {args.restore_tokens}-token session, {b}, median of {args.runs}")
    print("| cold prefill s, no state dir | cold prefill s | spawn to restored s "
          "| spawn to serving s (nothing to restore) | restore s | prefill / restore |")
    print("|---|---|---|---|---|---|")
    print(f"| {a:.2f} | {p:.2f} | {r:.2f} | {s0:.2f} | {r - s0:.2f} "
          f"| {p / max(r - s0, 1e-9):.2f} |")


def shard(binary, model, layers, listen, state):
    """`BIN shard` for `layers` on `listen`, its pages in `state` if given."""
    cmd = [binary, "shard", "--model", model, "--layers", layers, "--listen", listen,
           "--kv-mib", "256"]
    if state:
        cmd += ["--state-dir", state]
    return Server(binary, model, cmd=cmd)


def kill(srv):
    srv.proc.kill()
    srv.proc.wait()
    srv.stop()


def until_served(call):
    """Calls `call` until it is not refused as UNAVAILABLE (a shard that is
    back is found at the coordinator's next connect)."""
    deadline = time.monotonic() + 120
    while True:
        try:
            return call()
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.001)


def shards(args, pb, rpc):
    b = args.binaries[0]
    n = args.restore_tokens
    modes = [("pages kept (--state-dir)", True), ("fed again (no state dir)", False)]
    rebuild = {m: [] for m, _ in modes}
    restore = {m: [] for m, _ in modes}
    cold = []
    digests = set()
    for _ in range(args.runs):
        for mode, kept in modes:
            dirs = [tempfile.mkdtemp(prefix="inferd-shard-") if kept else None
                    for _ in range(2)]
            first = shard(b, args.model, "0..15", "127.0.0.1:0", dirs[0])
            second = shard(b, args.model, "15..30", "127.0.0.1:0", dirs[1])
            listen = second.addr
            state = tempfile.mkdtemp(prefix="inferd-state-")
            flags = ["--shards", f"{first.addr},{second.addr}", "--state-dir", state]
            srv = Server(b, args.model, args.workers, flags)
            channel, client = connect(srv.addr, pb, rpc)
            sid = client.create(label="shards").session_id
            t0 = time.monotonic()
            client.append(sid, prompt_ids(n, salt=7))
            cold.append(time.monotonic() - t0)
            # The second shard dies and comes back on the same address.
            kill(second)
            second = shard(b, args.model, "15..30", listen, dirs[1])
            t0 = time.monotonic()
            until_served(lambda: client.append(sid, [1234]))
            rebuild[mode].append(time.monotonic() - t0)
            digests.add(client.info(sid).logits_digest)
            channel.close()
            # The coordinator dies and comes back on its state directory.
            kill(srv)
            srv = Server(b, args.model, args.workers, flags)
            channel = grpc.insecure_channel(srv.addr)
            stub = rpc.RuntimeServiceStub(channel)
            while True:
                info = stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid),
                                           timeout=600, wait_for_ready=True)
                if not info.busy:
                    break
                time.sleep(0.001)
            restore[mode].append(time.monotonic() - srv.started)
            digests.add(info.logits_digest)
            channel.close()
            for p in (srv, first, second):
                p.stop()
    assert len(digests) == 1, f"the rebuilt sessions' logits differ: {digests}"
    print(f"\na {n}-token session over two shards, {b}, median of {args.runs} "
          f"(its cold prefill through the shards: {statistics.median(cold):.2f} s)")
    print("| shards | next append after a shard's SIGKILL and restart, s "
          "| coordinator SIGKILL: spawn to restored, s |")
    print("|---|---|---|")
    for mode, _ in modes:
        print(f"| {mode} | {statistics.median(rebuild[mode]):.3f} "
              f"| {statistics.median(restore[mode]):.2f} |")


# Token ids the reference model ends a generation with; banned where a
# stream must run its full length.
EOG_IDS = (0, 2)


def http_openai(addr):
    import openai  # noqa: PLC0415  (only this section needs it)
    return openai.OpenAI(base_url=f"http://{addr}/v1", api_key="unused", max_retries=0,
                         timeout=600)


def chat_ttft(client, turns, messages):
    """Streams each turn; returns (ms to the first content, cached tokens) per turn."""
    out = []
    conversation = list(messages)
    for turn in range(turns):
        conversation.append({"role": "user",
                             "content": f"Give me fact number {turn + 1} about the ocean."})
        t0 = time.monotonic()
        first, text, cached = None, [], 0
        stream = client.chat.completions.create(
            model="m", messages=conversation, max_tokens=24, temperature=0, stream=True,
            stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.usage is not None:
                cached = chunk.usage.prompt_tokens_details.cached_tokens
            for choice in chunk.choices:
                if choice.delta.content:
                    if first is None:
                        first = (time.monotonic() - t0) * 1e3
                    text.append(choice.delta.content)
        out.append((first if first is not None else (time.monotonic() - t0) * 1e3, cached))
        conversation.append({"role": "assistant", "content": "".join(text)})
    return out


def http(args, pb, rpc):
    b = args.binaries[0]
    turns = 5
    system = [{"role": "system", "content": "You are a careful assistant. " * 60}]
    modes = [("prefix reuse (default)", []), ("no reuse (--prefix-cache-pages 0)",
                                              ["--prefix-cache-pages", "0"])]
    ttft = {(m, t): [] for m, _ in modes for t in range(turns)}
    cached = {(m, t): [] for m, _ in modes for t in range(turns)}
    per_token = {"grpc": [], "http": []}
    n = args.tokens
    for _ in range(args.runs):
        for mode, extra in modes:
            flags = ["--http-listen", "127.0.0.1:0"] + extra
            with Server(b, args.model, args.workers, flags) as srv:
                text = pathlib.Path(srv.log.name).read_text()
                addr = re.search(r"^http on (\S+)", text, re.M).group(1)
                for t, (ms, c) in enumerate(chat_ttft(http_openai(addr), turns, system)):
                    ttft[(mode, t)].append(ms)
                    cached[(mode, t)].append(c)
        with Server(b, args.model, args.workers, ["--http-listen", "127.0.0.1:0"]) as srv:
            text = pathlib.Path(srv.log.name).read_text()
            addr = re.search(r"^http on (\S+)", text, re.M).group(1)
            channel, client = connect(srv.addr, pb, rpc)
            sid = client.create(label="bench").session_id
            client.append(sid, prompt_ids(32))
            bias = [pb.LogitBias(token_id=t, bias=-100) for t in EOG_IDS]
            stream = client.stub.Generate(
                pb.GenerateRequest(session_id=sid, max_tokens=n, logit_bias=bias), timeout=600)
            times = [time.monotonic() for m in stream if m.WhichOneof("payload") == "token_id"]
            per_token["grpc"].append((times[-1] - times[0]) * 1e3 / (len(times) - 1))
            client.close(sid)
            channel.close()
            oai = http_openai(addr)
            stream = oai.completions.create(
                model="m", prompt=prompt_ids(32), max_tokens=n, temperature=0, stream=True,
                logit_bias={str(t): -100 for t in EOG_IDS})
            times = [time.monotonic() for c in stream if c.choices and c.choices[0].text]
            per_token["http"].append((times[-1] - times[0]) * 1e3 / (len(times) - 1))
    print(f"\na {turns}-turn chat through the openai package (a "
          f"{len(system[0]['content'])}-character system prompt, 24 tokens per reply), "
          f"{b}, median of {args.runs}")
    print("| turn | time to first token, reuse | cached tokens | time to first token, "
          "no reuse | cached tokens |")
    print("|---|---|---|---|---|")
    for t in range(turns):
        row = [f"{statistics.median(ttft[(m, t)]):.0f} ms | "
               f"{statistics.median(cached[(m, t)]):.0f}" for m, _ in modes]
        print(f"| {t + 1} | {row[0]} | {row[1]} |")
    g, h = statistics.median(per_token["grpc"]), statistics.median(per_token["http"])
    print(f"\none session streaming {n} greedy tokens after a 32-token prompt, median of "
          f"{args.runs}")
    print("| front end | ms/token | x gRPC |")
    print("|---|---|---|")
    print(f"| gRPC (Generate stream) | {g:.2f} | 1.000 |")
    print(f"| HTTP (server-sent events) | {h:.2f} | {h / g:.3f} |")


def spill(args, pb, rpc):
    b = args.binaries[0]
    n = args.restore_tokens
    # Pages of 16 positions: one session and a little more.
    pages = str(n // 16 + 40)
    modes = [("written out, read back", []),
             ("recomputed (--max-spill-mib 0)", ["--max-spill-mib", "0"])]
    times = {mode: [] for mode, _ in modes}
    for _ in range(args.runs):
        for mode, extra in modes:
            state = tempfile.mkdtemp(prefix="inferd-state-")
            flags = ["--state-dir", state, "--kv-pages", pages] + extra
            with Server(b, args.model, args.workers, flags) as srv:
                channel, client = connect(srv.addr, pb, rpc)
                first = client.create(label="first").session_id
                client.append(first, prompt_ids(n, salt=5))
                second = client.create(label="second").session_id
                client.append(second, prompt_ids(n, salt=6))
                assert client.info(first).kv_pages_held == 0, "the first was not spilled"
                t0 = time.monotonic()
                client.append(first, [1234])
                times[mode].append(time.monotonic() - t0)
                digest = client.info(first).logits_digest
                client.close(first)
                check = client.create(label="check").session_id
                client.append(check, prompt_ids(n, salt=5) + [1234])
                assert client.info(check).logits_digest == digest, "read back differs"
                channel.close()
    print(f"\nbringing a spilled {n}-token session back (an append of 1 token), {b}, "
          f"median of {args.runs}")
    print("| spilled pages | append s (median) | min | max |")
    print("|---|---|---|---|")
    for mode, xs in times.items():
        m, lo, hi = median_spread(xs)
        print(f"| {mode} | {m:.3f} | {lo:.3f} | {hi:.3f} |")


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def soak(args, pb, rpc):
    for b in args.binaries:
        with Server(b, args.model, args.workers) as srv:
            channel, client = connect(srv.addr, pb, rpc)
            phases = {p: [] for p in ["create", "append", "generate", "close", "loop"]}
            errors = []
            lock = threading.Lock()
            stop_at = time.monotonic() + args.soak_seconds

            def loop(i):
                n = 0
                while time.monotonic() < stop_at:
                    try:
                        t0 = time.monotonic()
                        sid = client.create(label=f"soak{i}").session_id
                        t1 = time.monotonic()
                        client.append(sid, prompt_ids(32, salt=i * 1000 + n))
                        t2 = time.monotonic()
                        stream_times(client, sid, 32)
                        t3 = time.monotonic()
                        client.close(sid)
                        t4 = time.monotonic()
                    except grpc.RpcError as e:
                        with lock:
                            errors.append(f"{e.code()}: {e.details()}")
                        continue
                    with lock:
                        for p, d in zip(phases, [t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0]):
                            phases[p].append(d * 1e3)
                    n += 1

            threads = [threading.Thread(target=loop, args=(i,)) for i in range(args.soak_clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            channel.close()
        print(f"\nsoak: {args.soak_clients} clients, {args.soak_seconds} s, {b}: "
              f"{len(phases['loop'])} loops, {len(errors)} errors")
        for e in sorted(set(errors))[:5]:
            print(f"  error: {e}")
        print("| phase | p50 ms | p99 ms | max ms | p99 / p50 |")
        print("|---|---|---|---|---|")
        for p, xs in phases.items():
            if xs:
                p50, p99 = percentile(xs, 0.5), percentile(xs, 0.99)
                print(f"| {p} | {p50:.1f} | {p99:.1f} | {max(xs):.1f} | {p99 / p50:.2f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("binaries", nargs="+", help="inferd binaries to compare")
    ap.add_argument("--model", default=str(REPO / "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--only", choices=["single", "concurrent", "coldstart", "soak",
                                       "durability", "prefix", "restore", "spill",
                                       "shards", "http"],
                    action="append")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workers", type=int)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--sessions", default="1,4,16,64")
    ap.add_argument("--concurrent-tokens", type=int, default=64)
    ap.add_argument("--soak-clients", type=int, default=16)
    ap.add_argument("--soak-seconds", type=float, default=30)
    ap.add_argument("--prefix-sessions", type=int, default=64)
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--restore-tokens", type=int, default=4096)
    args = ap.parse_args()
    stubs = tempfile.mkdtemp()
    pb, rpc, *_ = runtime_client.generate_stubs(stubs)
    print(cpu_line())
    sections = args.only or ["single", "concurrent", "coldstart", "soak"]
    for name in sections:
        globals()[name](args, pb, rpc)


if __name__ == "__main__":
    main()
