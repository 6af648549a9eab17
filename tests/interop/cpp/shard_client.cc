// A C++ client of the shard protocol, built from the published schema
// (protos/inferd/shard/v1/shard_runtime.proto) with Debian's protoc and
// grpc_cpp_plugin, with no inferd code (scripts/cpp-client builds it;
// tests/cpp_interop.rs runs it).
//
//   shard_client vectors DIR PLAN
//     Decodes every golden frame the plan names (lines "FILE EXPECT
//     SHARD_EPOCH COORDINATOR_EPOCH MAX_FRAME_BYTES HIDDEN") and checks it
//     the way a receiver would: good frames parse, carry the epochs and a
//     payload whose CRC32C and length match; bad ones fail for their reason.
//   shard_client live ADDR SHA256_HEX BEGIN END COUNT HIDDEN
//     Drives a real `inferd shard` (all layers, one thread, with a state
//     directory): handshakes (and is refused for another version or
//     layer range), then on one stream sends a frame of every kind and
//     every bad frame, each answered as the protocol says: outputs, a
//     Resumed, and a ShardError of the expected kind per bad frame.
//
// Prints "cpp shard client: N checks passed" and exits 0, or says what
// failed and exits 1.

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "inferd/shard/v1/shard_runtime.grpc.pb.h"

namespace pb = inferd::shard::v1;

namespace {

int checks = 0;

[[noreturn]] void fail(const std::string& what) {
  std::cerr << "cpp shard client: " << what << std::endl;
  std::exit(1);
}

void check(bool ok, const std::string& what) {
  if (!ok) fail(what);
}

// CRC32C (Castagnoli), reflected, as the protocol's payload checksum.
uint32_t crc32c(const std::string& bytes) {
  static uint32_t table[256];
  static bool ready = false;
  if (!ready) {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      table[i] = c;
    }
    ready = true;
  }
  uint32_t crc = 0xFFFFFFFFu;
  for (unsigned char b : bytes) crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot read " + path);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

size_t row_bytes(pb::Encoding e, size_t hidden) {
  switch (e) {
    case pb::ENCODING_F32: return 4 * hidden;
    case pb::ENCODING_F16: return 2 * hidden;
    case pb::ENCODING_Q8_0: return hidden / 32 * 34;
    default: return 0;
  }
}

const pb::Hidden* hidden_body(const pb::Frame& f) {
  switch (f.body_case()) {
    case pb::Frame::kPrefill: return &f.prefill();
    case pb::Frame::kDecode: return &f.decode();
    case pb::Frame::kOutput: return &f.output();
    default: return nullptr;
  }
}

int vectors(const std::string& dir, const std::string& plan_path) {
  std::istringstream plan(read_file(plan_path));
  std::string file, expect;
  uint64_t shard_epoch, coordinator_epoch, max_bytes, hidden;
  std::map<std::string, uint64_t> next_sequence;
  while (plan >> file >> expect >> shard_epoch >> coordinator_epoch >> max_bytes >> hidden) {
    std::string bytes = read_file(dir + "/" + file);
    std::string what = file + " (" + expect + ")";
    if (expect == "too_large") {
      check(bytes.size() > max_bytes, what + ": within the size limit");
      ++checks;
      continue;
    }
    pb::Frame f;
    bool parsed = f.ParseFromString(bytes) && f.has_header();
    if (!parsed) {
      check(expect == "malformed", what + ": does not parse");
      ++checks;
      continue;
    }
    const auto& h = f.header();
    bool crc_ok = crc32c(f.payload()) == h.payload_crc32c();
    bool epochs_ok = h.shard_epoch() == shard_epoch && h.coordinator_epoch() == coordinator_epoch;
    if (expect == "checksum") {
      check(!crc_ok, what + ": the checksum matches");
    } else if (expect == "stale_epoch") {
      check(!epochs_ok, what + ": live epochs");
    } else {
      check(crc_ok, what + ": CRC32C mismatch");
      check(epochs_ok, what + ": epochs");
      const pb::Hidden* body = hidden_body(f);
      bool shape_ok = f.body_case() != pb::Frame::BODY_NOT_SET;
      if (body) {
        size_t rows = 0;
        for (const auto& r : body->runs()) {
          rows += r.count();
          shape_ok = shape_ok && r.session_id().size() == 16;
        }
        shape_ok = shape_ok && rows * row_bytes(h.encoding(), hidden) == f.payload().size();
      }
      if (f.body_case() == pb::Frame::kResume) {
        shape_ok = shape_ok &&
                   static_cast<uint64_t>(f.resume().page_chains_size()) <= f.resume().length();
      }
      if (expect == "ok") {
        check(shape_ok, what + ": shape");
        pb::Frame again;
        check(again.ParseFromString(f.SerializeAsString()), what + ": round trip");
        check(again.SerializeAsString() == f.SerializeAsString(), what + ": round trip bytes");
      }
    }
    ++checks;
  }
  check(checks > 20, "the plan named " + std::to_string(checks) + " frames");
  std::cout << "cpp shard client: " << checks << " checks passed" << std::endl;
  return 0;
}

std::string from_hex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  }
  return out;
}

// Exactly representable values, as the other clients use.
std::string rows(size_t count, size_t first, size_t hidden) {
  std::string out;
  for (size_t i = first * hidden; i < (first + count) * hidden; ++i) {
    float v = static_cast<float>((static_cast<int>(i * 37 % 101) - 50) / 64.0);
    out.append(reinterpret_cast<const char*>(&v), sizeof v);
  }
  return out;
}

struct Live {
  std::unique_ptr<pb::ShardRuntime::Stub> stub;
  uint64_t shard_epoch = 0;
  uint64_t coordinator_epoch = 0x43505043;  // "CPPC"
  uint64_t sequence = 0;
  size_t hidden = 0;

  pb::Frame frame(const std::string& payload, uint64_t deadline_nanos = 0) {
    pb::Frame f;
    auto* h = f.mutable_header();
    h->set_shard_epoch(shard_epoch);
    h->set_coordinator_epoch(coordinator_epoch);
    h->set_sequence(++sequence);
    h->set_deadline_unix_nanos(deadline_nanos);
    h->set_encoding(payload.empty() ? pb::ENCODING_UNSPECIFIED : pb::ENCODING_F32);
    h->set_payload_crc32c(crc32c(payload));
    f.set_payload(payload);
    return f;
  }
};

pb::Hidden run(const std::string& session, uint64_t position, uint32_t count) {
  pb::Hidden h;
  auto* r = h.add_runs();
  r->set_session_id(session);
  r->set_position(position);
  r->set_count(count);
  return h;
}

int live(char** argv) {
  Live s;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetMaxSendMessageSize(64 << 20);
  auto channel = grpc::CreateCustomChannel(argv[0], grpc::InsecureChannelCredentials(), args);
  s.stub = pb::ShardRuntime::NewStub(channel);
  s.hidden = std::stoul(argv[5]);
  pb::ModelFingerprint fp;
  fp.set_gguf_sha256(from_hex(argv[1]));
  fp.set_layer_begin(std::stoul(argv[2]));
  fp.set_layer_end(std::stoul(argv[3]));
  fp.set_layer_count(std::stoul(argv[4]));
  fp.set_hidden_size(s.hidden);

  auto handshake = [&](pb::ProtocolVersion version, const pb::ModelFingerprint& expected,
                       pb::HandshakeResponse* reply) {
    pb::HandshakeRequest req;
    req.set_protocol_version(version);
    *req.mutable_expected() = expected;
    req.set_coordinator_epoch(s.coordinator_epoch);
    auto* limits = req.mutable_limits();
    limits->set_max_frame_bytes(16 << 20);
    limits->set_credit_window(4);
    limits->add_encodings(pb::ENCODING_F32);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    return s.stub->Handshake(&ctx, req, reply);
  };
  pb::HandshakeResponse reply;
  grpc::Status refused = handshake(pb::PROTOCOL_VERSION_UNSPECIFIED, fp, &reply);
  check(refused.error_code() == grpc::StatusCode::FAILED_PRECONDITION,
        "a handshake of another version: " + refused.error_message());
  pb::ModelFingerprint other = fp;
  other.set_layer_end(fp.layer_end() + 1);
  refused = handshake(pb::PROTOCOL_VERSION_1, other, &reply);
  check(refused.error_code() == grpc::StatusCode::FAILED_PRECONDITION,
        "a handshake for other layers: " + refused.error_message());
  grpc::Status ok = handshake(pb::PROTOCOL_VERSION_1, fp, &reply);
  check(ok.ok(), "the handshake: " + ok.error_message());
  check(reply.served().SerializeAsString() == fp.SerializeAsString(), "the served fingerprint");
  check(reply.keeps_pages(), "the shard keeps pages (it has a state directory)");
  check(reply.limits().max_frame_rows() == 2048, "max_frame_rows 2048");
  s.shard_epoch = reply.shard_epoch();
  checks += 4;

  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  auto stream = s.stub->Session(&ctx);
  // The next frame that is not a credit.
  auto answer = [&]() {
    pb::Frame f;
    do {
      check(stream->Read(&f), "the stream ended early");
      check(crc32c(f.payload()) == f.header().payload_crc32c(), "a reply's checksum");
    } while (f.body_case() == pb::Frame::kCredit);
    return f;
  };
  auto expect_error = [&](pb::ShardError::Kind kind, uint64_t refused_sequence,
                          const std::string& what) {
    pb::Frame f = answer();
    check(f.body_case() == pb::Frame::kError,
          what + ": expected an error, got " + f.ShortDebugString());
    check(f.error().kind() == kind,
          what + ": kind " + pb::ShardError::Kind_Name(f.error().kind()));
    if (refused_sequence) {
      check(f.error().refused_sequence() == refused_sequence, what + ": refused_sequence");
    }
    ++checks;
  };
  const std::string session(16, '\x11');
  const size_t h = s.hidden;
  auto now_nanos = [] {
    return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                     std::chrono::system_clock::now().time_since_epoch())
                                     .count());
  };
  const uint64_t far = now_nanos() + 60'000'000'000ull;

  // 1: a prefill fragment of 3 rows.
  pb::Frame f = s.frame(rows(3, 0, h), far);
  *f.mutable_prefill() = run(session, 0, 3);
  check(stream->Write(f), "write");
  pb::Frame out = answer();
  check(out.body_case() == pb::Frame::kOutput && out.output().answers_sequence() == 1,
        "the output of frame 1: " + out.ShortDebugString());
  check(out.payload().size() == 3 * h * 4, "3 rows out");
  ++checks;

  // 2: a corrupted payload: KIND_CHECKSUM, and the stream goes on.
  f = s.frame(rows(1, 3, h), far);
  *f.mutable_decode() = run(session, 3, 1);
  std::string bad = f.payload();
  bad[0] ^= 0x40;
  f.set_payload(bad);
  check(stream->Write(f), "write");
  expect_error(pb::ShardError::KIND_CHECKSUM, 2, "a corrupted payload");

  // 3: a decode frame continuing the session.
  f = s.frame(rows(1, 3, h), far);
  *f.mutable_decode() = run(session, 3, 1);
  check(stream->Write(f), "write");
  out = answer();
  check(out.body_case() == pb::Frame::kOutput && out.output().answers_sequence() == 3,
        "the output of frame 3: " + out.ShortDebugString());
  ++checks;

  // A stale shard epoch (refused before its sequence counts).
  f = s.frame(rows(1, 4, h), far);
  *f.mutable_decode() = run(session, 4, 1);
  f.mutable_header()->set_shard_epoch(s.shard_epoch ^ 1);
  --s.sequence;
  check(stream->Write(f), "write");
  expect_error(pb::ShardError::KIND_STALE_EPOCH, 0, "a stale epoch");

  // A gap in the sequence.
  f = s.frame(rows(1, 4, h), far);
  *f.mutable_decode() = run(session, 4, 1);
  f.mutable_header()->set_sequence(s.sequence + 5);
  --s.sequence;
  check(stream->Write(f), "write");
  expect_error(pb::ShardError::KIND_SEQUENCE, 0, "a sequence gap");

  // 4: a session id of 3 bytes.
  f = s.frame(rows(1, 4, h), far);
  *f.mutable_decode() = run("abc", 4, 1);
  check(stream->Write(f), "write");
  expect_error(pb::ShardError::KIND_MALFORMED, 4, "a 3-byte session id");

  // 5: a session the shard does not hold, past position 0.
  f = s.frame(rows(1, 5, h), far);
  *f.mutable_decode() = run(std::string(16, '\x22'), 5, 1);
  check(stream->Write(f), "write");
  expect_error(pb::ShardError::KIND_UNKNOWN_SESSION, 5, "an unknown session");

  // 6: a deadline already past.
  f = s.frame(rows(1, 4, h), now_nanos() - 1'000'000'000ull);
  *f.mutable_decode() = run(session, 4, 1);
  check(stream->Write(f), "write");
  expect_error(pb::ShardError::KIND_DEADLINE, 6, "an expired deadline");

  // 7: positions past the model's context.
  f = s.frame(rows(1, 0, h), far);
  *f.mutable_prefill() = run(std::string(16, '\x33'), uint64_t{1} << 40, 1);
  check(stream->Write(f), "write");
  expect_error(pb::ShardError::KIND_TOO_LARGE, 7, "a position past the context");

  // 8: a Resume of the session's 4 positions (no full page: keeps 0).
  f = s.frame("", far);
  auto* resume = f.mutable_resume();
  resume->set_session_id(session);
  resume->set_length(4);
  resume->set_encoding(pb::ENCODING_F32);
  check(stream->Write(f), "write");
  out = answer();
  check(out.body_case() == pb::Frame::kResumed && out.resumed().answers_sequence() == 8 &&
            out.resumed().kept() == 0,
        "the Resumed answering frame 8: " + out.ShortDebugString());
  ++checks;

  // 9: a Resume naming a page chain for 4 positions: malformed.
  f = s.frame("", far);
  resume = f.mutable_resume();
  resume->set_session_id(session);
  resume->set_length(4);
  resume->add_page_chains(7);
  resume->set_encoding(pb::ENCODING_F32);
  check(stream->Write(f), "write");
  expect_error(pb::ShardError::KIND_MALFORMED, 9, "a Resume with a chain too many");

  // 10-14: five hidden-state frames at once with a credit window of 4 (the
  // first, 512 rows through every layer on one thread, keeps the shard
  // busy while the others arrive): four are answered, one refused for
  // flow control.
  for (int i = 0; i < 5; ++i) {
    size_t n = i == 0 ? 512 : 1;
    f = s.frame(rows(n, 0, h), far);
    *f.mutable_prefill() = run(std::string(16, static_cast<char>(0x40 + i)), 0, n);
    check(stream->Write(f), "write");
  }
  int outputs = 0, flow = 0;
  for (int i = 0; i < 5; ++i) {
    out = answer();
    if (out.body_case() == pb::Frame::kOutput) {
      ++outputs;
    } else if (out.body_case() == pb::Frame::kError &&
               out.error().kind() == pb::ShardError::KIND_FLOW_CONTROL) {
      ++flow;
    } else {
      fail("a burst: " + out.ShortDebugString());
    }
  }
  check(outputs == 4 && flow == 1, "four outputs and one flow-control refusal");
  ++checks;

  // 15, 16: cancel and release need no answer; the stream then ends.
  f = s.frame("", far);
  f.mutable_cancel()->add_session_ids(session);
  check(stream->Write(f), "write");
  f = s.frame("", far);
  f.mutable_release()->add_session_ids(session);
  check(stream->Write(f), "write");
  stream->WritesDone();
  pb::Frame rest;
  while (stream->Read(&rest)) {
    check(rest.body_case() == pb::Frame::kCredit, "after the release: " + rest.ShortDebugString());
  }
  grpc::Status end = stream->Finish();
  check(end.ok(), "the stream's status: " + end.error_message());
  ++checks;

  std::cout << "cpp shard client: " << checks << " checks passed" << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "vectors" && argc == 4) return vectors(argv[2], argv[3]);
  if (mode == "live" && argc == 8) return live(argv + 2);
  std::cerr << "usage: shard_client vectors DIR PLAN | live ADDR SHA256_HEX BEGIN END COUNT HIDDEN"
            << std::endl;
  return 2;
}
