// A stock TypeScript gRPC client of kakeya.v1.RuntimeService: @grpc/grpc-js
// with the schema loaded from protos/ by @grpc/proto-loader at run time, no
// inferd code. tests/typescript_interop.rs starts `inferd serve` (session
// limit 2, eviction none, idle TTL 3 s) and runs this against it.
//
// Scenarios: create (id, vocabulary, context), append, a streamed greedy
// Generate, info (history, digest), continue (append and generate again:
// the same tokens as one session fed everything at once), close, each
// typed error a client can provoke (NOT_FOUND, INVALID_ARGUMENT,
// RESOURCE_EXHAUSTED at the session limit), EOS, seeded sampling that
// repeats, and idle-TTL eviction.
//
// Usage: node dist/scenarios.js ADDR   (exits 0 when every check passes)

import * as path from "path";
import * as grpc from "@grpc/grpc-js";
import * as protoLoader from "@grpc/proto-loader";

const PROMPT = [1, 504, 3575, 282, 4649, 314, 9, 45, 2, 17, 330];
const DEADLINE_MS = 120_000;

type Msg = Record<string, any>;

function check(ok: boolean, what: string): void {
  if (!ok) {
    throw new Error(`check failed: ${what}`);
  }
}

class Client {
  constructor(private stub: any) {}

  private unary(method: string, request: Msg): Promise<Msg> {
    return new Promise((resolve, reject) => {
      const deadline = new Date(Date.now() + DEADLINE_MS);
      this.stub[method](request, { deadline }, (err: grpc.ServiceError | null, reply: Msg) =>
        err ? reject(err) : resolve(reply),
      );
    });
  }

  create(label: string, eos: number[] = []): Promise<Msg> {
    return this.unary("CreateSession", { client_label: label, eos_token_ids: eos });
  }

  append(id: string, tokens: number[]): Promise<Msg> {
    return this.unary("AppendTokens", { session_id: id, token_ids: tokens });
  }

  info(id: string): Promise<Msg> {
    return this.unary("GetSessionInfo", { session_id: id });
  }

  close(id: string): Promise<Msg> {
    return this.unary("CloseSession", { session_id: id });
  }

  /** Runs a Generate to its end: the tokens and the done message. */
  generate(request: Msg): Promise<{ tokens: number[]; done: Msg }> {
    return new Promise((resolve, reject) => {
      const deadline = new Date(Date.now() + DEADLINE_MS);
      const call = this.stub.Generate(request, { deadline });
      const tokens: number[] = [];
      let done: Msg | null = null;
      call.on("data", (msg: Msg) => {
        if (msg.payload === "token_id") {
          tokens.push(msg.token_id);
        } else if (msg.payload === "done") {
          done = msg.done;
        }
      });
      call.on("error", reject);
      call.on("end", () =>
        done ? resolve({ tokens, done }) : reject(new Error("the stream ended without done")),
      );
    });
  }
}

async function expectStatus(code: grpc.status, what: string, call: () => Promise<unknown>) {
  try {
    await call();
  } catch (e) {
    const err = e as grpc.ServiceError;
    check(err.code === code, `${what}: status ${err.code} (${err.details}), expected ${code}`);
    return;
  }
  throw new Error(`${what}: succeeded, expected status ${code}`);
}

function unknownLike(id: string): string {
  const last = id[id.length - 1];
  return id.slice(0, -1) + (last === "0" ? "1" : "0");
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

async function main(): Promise<number> {
  const addr = process.argv[2];
  const repo = path.resolve(__dirname, "..", "..", "..", "..");
  const definition = protoLoader.loadSync(path.join(repo, "protos/kakeya/v1/runtime.proto"), {
    keepCase: true,
    longs: Number,
    enums: String,
    defaults: true,
    oneofs: true,
    includeDirs: [path.join(repo, "protos")],
  });
  const pkg = grpc.loadPackageDefinition(definition) as any;
  const stub = new pkg.kakeya.v1.RuntimeService(addr, grpc.credentials.createInsecure());
  const c = new Client(stub);
  let checks = 0;

  // Create, append, stream, info.
  const created = await c.create("ts");
  const id: string = created.session_id;
  check(/^[0-9a-f]{32}$/.test(id), `a 128-bit hex session id: ${id}`);
  check(created.vocab_size === 49152, `vocab_size ${created.vocab_size}`);
  check(created.context_length > 0, "a context length");
  const appended = await c.append(id, PROMPT);
  check(appended.history_length === PROMPT.length, `history ${appended.history_length}`);
  const first = await c.generate({ session_id: id, max_tokens: 8 });
  check(first.tokens.length === 8, `8 tokens: ${first.tokens}`);
  check(first.done.stop_reason === "STOP_REASON_MAX_TOKENS", first.done.stop_reason);
  check(first.done.history_length === PROMPT.length + 8, "history after the Generate");
  const info = await c.info(id);
  check(info.history_length === PROMPT.length + 8, "info's history");
  check(info.client_label === "ts", "info's label");
  check(!info.busy, "idle after the Generate");
  checks += 1;

  // Continue: more tokens, then another Generate; a second session fed the
  // same history at once ends in the same tokens and the same digest.
  const more = [264, 1782];
  await c.append(id, more);
  const second = await c.generate({ session_id: id, max_tokens: 6 });
  const twin = (await c.create("ts-twin")).session_id;
  await c.append(twin, [...PROMPT, ...first.tokens, ...more]);
  const twinGen = await c.generate({ session_id: twin, max_tokens: 6 });
  check(
    JSON.stringify(twinGen.tokens) === JSON.stringify(second.tokens),
    `continued ${second.tokens} vs at once ${twinGen.tokens}`,
  );
  const [a, b] = [await c.info(id), await c.info(twin)];
  check(a.logits_digest === b.logits_digest, "the same logits digest");
  await c.close(twin);
  checks += 1;

  // Typed errors.
  await expectStatus(grpc.status.NOT_FOUND, "info on an unknown id", () => c.info(unknownLike(id)));
  await expectStatus(grpc.status.INVALID_ARGUMENT, "a token past the vocabulary", () =>
    c.append(id, [49152]),
  );
  await expectStatus(grpc.status.INVALID_ARGUMENT, "max_tokens 0", () =>
    c.generate({ session_id: id, max_tokens: 0 }),
  );
  // A malformed id is one the server does not hold: the same status.
  await expectStatus(grpc.status.NOT_FOUND, "a malformed id", () => c.info("not-an-id"));
  checks += 1;

  // EOS: the first greedy token as the session's EOS ends the call there.
  const eosId = (await c.create("ts-eos", [first.tokens[0]])).session_id;
  await c.append(eosId, PROMPT);
  const stopped = await c.generate({ session_id: eosId, max_tokens: 8 });
  check(stopped.tokens.length === 1 && stopped.tokens[0] === first.tokens[0], "stops at EOS");
  check(stopped.done.stop_reason === "STOP_REASON_EOS", stopped.done.stop_reason);
  checks += 1;

  // Seeded sampling repeats, and reports its seed.
  const seeded = async (seed: number) => {
    const sid = (await c.create("ts-seed")).session_id;
    await c.append(sid, PROMPT);
    const got = await c.generate({ session_id: sid, max_tokens: 12, temperature: 0.9, seed });
    await c.close(sid);
    return got;
  };
  await c.close(eosId);
  const [s1, s2] = [await seeded(7), await seeded(7)];
  check(JSON.stringify(s1.tokens) === JSON.stringify(s2.tokens), "the same seed, the same tokens");
  check(s1.done.seed_used === 7, `seed_used ${s1.done.seed_used}`);
  checks += 1;

  // The session limit (2, eviction none): a third session is refused.
  const other = (await c.create("ts-second")).session_id;
  await expectStatus(grpc.status.RESOURCE_EXHAUSTED, "a session past the limit", () =>
    c.create("ts-third"),
  );
  await c.close(other);
  checks += 1;

  // Close, then the id is gone.
  const closed = await c.close(id);
  check(closed.final_history_length === PROMPT.length + 8 + more.length + 6, "final history");
  await expectStatus(grpc.status.NOT_FOUND, "info after close", () => c.info(id));
  checks += 1;

  // Idle TTL (3 s): an idle session is evicted.
  const idle = (await c.create("ts-idle")).session_id;
  await c.append(idle, PROMPT);
  await sleep(4500);
  await expectStatus(grpc.status.NOT_FOUND, "info after the idle TTL", () => c.info(idle));
  checks += 1;

  stub.close();
  console.log(`typescript client: ${checks} scenarios passed`);
  return 0;
}

main().then(
  (code) => process.exit(code),
  (e) => {
    console.error(e);
    process.exit(1);
  },
);
