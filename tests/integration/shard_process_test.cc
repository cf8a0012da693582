// Integration tests against a real isthmus-server process on loopback with CURVE: what a
// worker and an operator see (push/pull, idempotent retries, refused keys, hostile
// frames, SIGKILL mid-stream, snapshots, SIGTERM, key-file permissions), and what makes
// it refuse to start, each with its documented exit code and nothing stored changed.
#include <gtest/gtest.h>
#include <pwd.h>
#include <sys/stat.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <random>

#include "common/transport.h"
#include "common/wire.h"
#include "tests/integration/server_process.h"

namespace isthmus {
namespace {

using testing::RawSocket;
using testing::ServerProcess;

const std::vector<int64_t> kShape{4, 8};

std::vector<float> Iota(float start, float step = 1.0f) {
  std::vector<float> v(32);
  for (size_t i = 0; i < v.size(); ++i) v[i] = start + step * static_cast<float>(i);
  return v;
}

// Creates job "j" with tensors "a" = Iota(0) and "b" = all ones.
void CreateJob(const ServerProcess& server) {
  auto admin = server.AdminClient();
  std::vector<float> a = Iota(0), b(32, 1.0f);
  auto r = admin->CreateJob("j", "base-hash-1", {{"a", kShape, a.data()}, {"b", kShape, b.data()}});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
}

std::map<std::string, std::vector<float>> PullAll(ShardClient& c) {
  auto r = c.Pull("j");
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  std::map<std::string, std::vector<float>> out;
  if (r.ok()) {
    for (auto& t : r->tensors) out[t.name] = t.data;
  }
  return out;
}

class ShardProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(server_.Start());
    CreateJob(server_);
  }
  ServerProcess server_;
};

TEST_F(ShardProcessTest, PushThenPullReturnsTheSum) {
  auto w = server_.WorkerClient();
  auto hello = w->Hello("j", wire::Role::Worker, "base-hash-1", "test");
  ASSERT_TRUE(hello.ok()) << hello.status().ToString();
  EXPECT_EQ(hello->tensor_count, 2u);
  auto before = w->Pull("j");
  ASSERT_TRUE(before.ok());
  uint64_t v0 = before->job_version;

  std::vector<float> d = Iota(0.5f, 0.25f);
  auto p = w->Push("j", "k1", 0, 100, {{"a", kShape, d.data()}});
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_FALSE(p->duplicate);
  EXPECT_GT(p->job_version, v0);

  auto all = PullAll(*w);
  std::vector<float> a0 = Iota(0);
  for (size_t i = 0; i < 32; ++i) EXPECT_EQ(all["a"][i], a0[i] + d[i]) << i;
  EXPECT_EQ(all["b"], std::vector<float>(32, 1.0f));

  // Only what changed after v0 comes back with newer_than, and names select.
  auto newer = w->Pull("j", {}, v0);
  ASSERT_TRUE(newer.ok());
  ASSERT_EQ(newer->tensors.size(), 1u);
  EXPECT_EQ(newer->tensors[0].name, "a");
  auto named = w->Pull("j", {"b"});
  ASSERT_TRUE(named.ok());
  ASSERT_EQ(named->tensors.size(), 1u);
  EXPECT_EQ(named->tensors[0].name, "b");
  EXPECT_EQ(named->tensors[0].shape, kShape);
}

TEST_F(ShardProcessTest, WrongBaseHashIsRefused) {
  auto w = server_.WorkerClient();
  auto hello = w->Hello("j", wire::Role::Worker, "another-base", "test");
  ASSERT_FALSE(hello.ok());
  EXPECT_EQ(hello.status().code(), Code::kFailedPrecondition);
}

TEST_F(ShardProcessTest, RepeatedKeyIsAppliedOnce) {
  auto w = server_.WorkerClient();
  std::vector<float> d(32, 2.0f);
  ASSERT_TRUE(w->Push("j", "same", 0, 1, {{"b", kShape, d.data()}}).ok());
  auto again = w->Push("j", "same", 0, 1, {{"b", kShape, d.data()}});
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->duplicate);
  EXPECT_EQ(PullAll(*w)["b"], std::vector<float>(32, 3.0f));
}

// The server is frozen (SIGSTOP) while a push is in flight, so the client times out and
// retries on a fresh socket; when the server resumes it sees both copies and applies one.
TEST_F(ShardProcessTest, RetryAfterTimeoutIsAppliedOnce) {
  auto w = server_.WorkerClient(/*timeout_ms=*/400, /*retries=*/10);
  // Connected before the freeze, so the first copy reaches the server's socket buffer.
  ASSERT_TRUE(w->Hello("j", wire::Role::Worker, "", "test").ok());
  std::vector<float> d(32, 5.0f);
  server_.Signal(SIGSTOP);
  std::thread resume([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    server_.Signal(SIGCONT);
  });
  auto p = w->Push("j", "retried", 0, 1, {{"b", kShape, d.data()}});
  resume.join();
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  // The copy sent before the freeze reached the server's socket buffer: wait until the
  // server has answered a copy as a duplicate, then check it changed nothing.
  auto admin = server_.AdminClient();
  uint64_t duplicates = 0;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (duplicates == 0 && std::chrono::steady_clock::now() < deadline) {
    auto st = admin->Stats();
    ASSERT_TRUE(st.ok()) << st.status().ToString();
    duplicates = st->jobs.at(0).duplicate_pushes;
    if (duplicates == 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_GE(duplicates, 1u) << "no second copy of the push reached the server";
  EXPECT_EQ(PullAll(*w)["b"], std::vector<float>(32, 6.0f));
  auto stats = admin->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->jobs.at(0).pushes, 1u);
}

TEST_F(ShardProcessTest, UnlistedKeyIsRefused) {
  auto stranger_keys = GenerateKeyPair();
  ASSERT_TRUE(stranger_keys.ok());
  auto stranger = server_.Client(server_.worker_port(), *stranger_keys, 1000, 0);
  std::vector<float> d(32, 7.0f);
  auto p = stranger->Push("j", "evil", 0, 1, {{"b", kShape, d.data()}});
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), Code::kPermissionDenied) << p.status().ToString();
  auto w = server_.WorkerClient();
  EXPECT_EQ(PullAll(*w)["b"], std::vector<float>(32, 1.0f));
  EXPECT_NE(server_.Log().find("refused"), std::string::npos) << server_.Log();
}

// Keys rotate on a running shard: SIGHUP reads the allowlist folders again. A key added to
// security.worker_keys is admitted without a restart; a key taken out is refused at once,
// even on the connection it already had open (the socket is bound anew, so the old
// connection goes and the reconnect's handshake is refused).
TEST_F(ShardProcessTest, SighupAdmitsAddedKeysAndClosesRevokedOnesWithoutARestart) {
  const pid_t pid = server_.pid();
  auto wait_for_log = [&](const std::string& text, size_t count) {
    for (int i = 0; i < 200 * testing::TimeScale(); ++i) {
      const std::string log = server_.Log();
      size_t n = 0;
      for (size_t at = log.find(text); at != std::string::npos; at = log.find(text, at + 1)) ++n;
      if (n >= count) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  };
  auto newcomer_keys = GenerateKeyPair();
  ASSERT_TRUE(newcomer_keys.ok());
  {
    auto before = server_.Client(server_.worker_port(), *newcomer_keys, 1000, 0);
    auto p = before->Pull("j");
    ASSERT_FALSE(p.ok());
    EXPECT_EQ(p.status().code(), Code::kPermissionDenied) << p.status().ToString();
  }
  // The worker that was allowed from the start has its connection open and working.
  auto old_worker = server_.WorkerClient(1000, 0);
  EXPECT_EQ(PullAll(*old_worker)["b"], std::vector<float>(32, 1.0f));

  // Add the newcomer's public key, reload: it is admitted, the server is the same process.
  const auto workers = server_.dir() / "workers";
  ASSERT_TRUE(WriteKeyPairFiles((workers / "newcomer").string(), *newcomer_keys, false).ok());
  std::filesystem::remove(workers / "newcomer.key");  // the folder holds public keys only
  server_.Signal(SIGHUP);
  ASSERT_TRUE(wait_for_log("reload: 2 worker key(s) allowed, 0 removed", 1)) << server_.Log();
  auto newcomer = server_.Client(server_.worker_port(), *newcomer_keys, 2000, 2);
  EXPECT_EQ(PullAll(*newcomer)["b"], std::vector<float>(32, 1.0f));

  // Take the first worker's key out, reload: its open connection stops working within
  // seconds (refused, not served), and the newcomer's goes on after a reconnect.
  std::filesystem::remove(workers / "w0.pub");
  server_.Signal(SIGHUP);
  ASSERT_TRUE(wait_for_log("reload: 1 worker key(s) allowed, 1 removed", 1)) << server_.Log();
  EXPECT_TRUE(wait_for_log("its connections are closed", 1)) << server_.Log();
  // The first pull may find the old connection mid-close (Unavailable: dropped before the
  // reply); the next handshake with the revoked key is refused. No pull is ever served.
  const auto t0 = std::chrono::steady_clock::now();
  Status refused = Status::Ok();
  for (int attempt = 0; attempt < 20; ++attempt) {
    auto p = old_worker->Pull("j");
    ASSERT_FALSE(p.ok()) << "a revoked key's open connection still served a pull";
    refused = p.status();
    if (refused.code() != Code::kUnavailable) break;
  }
  const double refused_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(refused.code(), Code::kPermissionDenied) << refused.ToString();
  EXPECT_LT(refused_s, 5.0 * testing::TimeScale());
  EXPECT_EQ(PullAll(*newcomer)["b"], std::vector<float>(32, 1.0f));
  // A broken key file keeps the lists as they were (the newcomer still works).
  {
    std::ofstream bad(workers / "broken.pub");
    bad << "not a key\n";
  }
  server_.Signal(SIGHUP);
  ASSERT_TRUE(wait_for_log("the allowlists stay as they were", 1)) << server_.Log();
  EXPECT_EQ(PullAll(*newcomer)["b"], std::vector<float>(32, 1.0f));
  EXPECT_EQ(server_.pid(), pid);
  EXPECT_EQ(::kill(pid, 0), 0) << "the server restarted or died";
}

TEST_F(ShardProcessTest, WorkerKeyCannotUseAdminSocket) {
  // The admin socket does not admit a worker's key.
  auto on_admin = server_.Client(server_.admin_port(), server_.worker_keys(), 1000, 0);
  auto st = on_admin->Stats();
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.status().code(), Code::kPermissionDenied) << st.status().ToString();
  auto w = server_.WorkerClient();
  // Admin operations on the worker socket are refused by role.
  auto snap = w->CreateSnapshot("nope");
  ASSERT_FALSE(snap.ok());
  EXPECT_EQ(snap.status().code(), Code::kPermissionDenied) << snap.status().ToString();
}

// Hostile frames sent on a raw DEALER socket with a listed key. Each must get a typed
// error reply and change nothing; the server must stay up.
std::string PushHeader(const std::string& key, const std::string& name, uint64_t nbytes,
                       std::vector<int64_t> shape = kShape, uint32_t schema_version = 1) {
  flatbuffers::FlatBufferBuilder fbb;
  auto meta =
      wire::CreateTensorMetaDirect(fbb, name.c_str(), &shape, wire::DType::F32, 0, nbytes, 0);
  std::vector<flatbuffers::Offset<wire::TensorMeta>> metas{meta};
  auto body = wire::CreatePushRequestDirect(fbb, "j", key.c_str(), 0, 1, &metas);
  wire::FinishEnvelopeBuffer(
      fbb, wire::CreateEnvelope(fbb, schema_version, 42, wire::Body::PushRequest, body.Union()));
  return std::string(reinterpret_cast<const char*>(fbb.GetBufferPointer()), fbb.GetSize());
}

// A JobCreate for job `job` with one tensor `name` (default "w"; any bytes, NUL included) of
// `shape` whose header claims `nbytes`.
std::string JobCreateHeader(const std::string& job, std::vector<int64_t> shape, uint64_t nbytes,
                            const std::string& name = "w") {
  flatbuffers::FlatBufferBuilder fbb;
  auto meta = wire::CreateTensorMeta(fbb, fbb.CreateString(name), fbb.CreateVector(shape),
                                     wire::DType::F32, 0, nbytes, 0);
  std::vector<flatbuffers::Offset<wire::TensorMeta>> metas{meta};
  auto body = wire::CreateJobCreateDirect(fbb, job.c_str(), "h", &metas);
  wire::FinishEnvelopeBuffer(fbb,
                             wire::CreateEnvelope(fbb, 1, 43, wire::Body::JobCreate, body.Union()));
  return std::string(reinterpret_cast<const char*>(fbb.GetBufferPointer()), fbb.GetSize());
}

std::string Floats(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

TEST_F(ShardProcessTest, HostileFramesAreRefusedWithStateUnchanged) {
  auto w = server_.WorkerClient();
  auto before = PullAll(*w);
  RawSocket raw(server_);
  std::vector<float> ones(32, 1.0f);

  // A well-formed push through the raw socket works (the harness itself is sound).
  EXPECT_TRUE(raw.Call({PushHeader("ok", "b", 128), Floats(ones)}).ok());
  before["b"] = std::vector<float>(32, 2.0f);

  std::mt19937 rng(7);
  std::string garbage(200, '\0');
  for (auto& c : garbage) c = static_cast<char>(rng());
  EXPECT_EQ(raw.Call({garbage}).code(), Code::kInvalidArgument);
  EXPECT_EQ(raw.Call({""}).code(), Code::kInvalidArgument);

  std::string good = PushHeader("t1", "b", 128);
  // (The last bytes of a FlatBuffer can be alignment padding, so cuts stay well inside.)
  for (size_t cut : {size_t{4}, size_t{12}, good.size() / 2, good.size() - 16}) {
    EXPECT_EQ(raw.Call({good.substr(0, cut), Floats(ones)}).code(), Code::kInvalidArgument) << cut;
  }
  // Truncated payload: the header says 128 bytes, the frame has 100.
  EXPECT_EQ(raw.Call({PushHeader("t5", "b", 128), Floats(ones).substr(0, 100)}).code(),
            Code::kInvalidArgument);
  // Missing payload frame; an extra payload frame.
  EXPECT_EQ(raw.Call({PushHeader("t6", "b", 128)}).code(), Code::kInvalidArgument);
  EXPECT_EQ(raw.Call({PushHeader("t7", "b", 128), Floats(ones), Floats(ones)}).code(),
            Code::kInvalidArgument);
  // Wrong shape for the tensor; unknown tensor.
  EXPECT_NE(raw.Call({PushHeader("t2", "b", 128, {8, 4}), Floats(ones)}).code(), Code::kOk);
  EXPECT_EQ(raw.Call({PushHeader("t3", "zz", 128), Floats(ones)}).code(), Code::kNotFound);
  // NaN and infinity in the payload.
  for (float bad :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    std::vector<float> v(32, 1.0f);
    v[17] = bad;
    EXPECT_EQ(raw.Call({PushHeader("nan", "b", 128), Floats(v)}).code(), Code::kInvalidArgument);
  }
  // A huge claimed shape with a small frame.
  EXPECT_NE(raw.Call({PushHeader("t4", "b", 128, {1 << 30, 1 << 30}), Floats(ones)}).code(),
            Code::kOk);

  EXPECT_EQ(PullAll(*w), before);
  auto stats = server_.AdminClient()->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_GE(stats->errors, 12u);
  EXPECT_EQ(stats->jobs.at(0).pushes, 1u);
}

// Shapes whose element count x 4 wraps to 0 in 64 bits, sent with nbytes 0 and an empty
// frame: each is refused as a shape before a byte of payload is read (a reader that
// trusted the wrapped size would go past the empty frame). On the admin socket's
// JobCreate no job appears; on the worker socket's push nothing changes.
TEST_F(ShardProcessTest, ShapesWhoseByteCountWrapsAreRefusedOnBothSockets) {
  const int64_t p31 = int64_t{1} << 31, p61 = int64_t{1} << 61, p62 = int64_t{1} << 62;
  const std::vector<std::vector<int64_t>> wrapping{{p62},    {p31, p31},    {p61, 2},
                                                   {2, p61}, {p31, 0, p31}, {0, p62, 4}};
  RawSocket admin(server_, /*admin=*/true), worker(server_);
  auto w = server_.WorkerClient();
  auto before = PullAll(*w);
  for (const auto& shape : wrapping) {
    std::string label = ::testing::PrintToString(shape);
    Status created = admin.Call({JobCreateHeader("wrap", shape, 0), ""});
    EXPECT_EQ(created.code(), Code::kInvalidArgument) << label << ": " << created.ToString();
    EXPECT_NE(created.message().find("negative or huge shape"), std::string::npos)
        << label << ": " << created.ToString();
    Status pushed = worker.Call({PushHeader("wrap", "b", 0, shape), ""});
    EXPECT_EQ(pushed.code(), Code::kInvalidArgument) << label << ": " << pushed.ToString();
    EXPECT_NE(pushed.message().find("negative or huge shape"), std::string::npos)
        << label << ": " << pushed.ToString();
  }
  EXPECT_EQ(server_.AdminClient()->DescribeJob("wrap").status().code(), Code::kNotFound);
  EXPECT_EQ(PullAll(*w), before);
}

// Issue 27 item 6: job create took shape [0], a scalar [] and the tensor names "../x" and
// "a\0b". Each is refused naming the tensor and the rule; no job appears, and pushes to
// the existing job go on as before.
TEST_F(ShardProcessTest, JobCreateRefusesUnsafeTensorNamesAndTensorsWithoutAShapeOrValues) {
  auto admin = server_.AdminClient();
  std::vector<float> four(4, 1.0f);
  const std::vector<std::pair<TensorView, std::string>> refused = {
      {{"../x", {4}, four.data()}, "tensor name '../x' of job 'bad' is not valid: "},
      {{"a/../../b", {4}, four.data()}, "is not valid"},
      {{"line\nbreak", {4}, four.data()}, "'line\\x0abreak'"},
      {{"/abs", {4}, four.data()}, "is not valid"},
      {{"scalar", {}, four.data()}, "tensor 'scalar' of job 'bad' has shape [] (a scalar)"},
      {{"empty", {0}, nullptr}, "tensor 'empty' of job 'bad' has shape [0] with a zero dimension"},
      {{"empty2", {4, 0}, nullptr}, "has shape [4, 0] with a zero dimension"},
  };
  for (const auto& [tensor, says] : refused) {
    // A good tensor beside it: the whole create is refused.
    auto r = admin->CreateJob("bad", "", {{"ok", {4}, four.data()}, tensor});
    ASSERT_FALSE(r.ok()) << says;
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << r.status().ToString();
    EXPECT_NE(r.status().message().find(says), std::string::npos) << r.status().ToString();
  }
  // A NUL inside a name (the client library cannot send one: a raw request).
  RawSocket raw(server_, /*admin=*/true);
  Status nul = raw.Call({JobCreateHeader("bad", {4}, 16, std::string("a\0b", 3)), Floats(four)});
  EXPECT_EQ(nul.code(), Code::kInvalidArgument) << nul.ToString();
  EXPECT_NE(nul.message().find("tensor name 'a\\x00b' of job 'bad' is not valid"),
            std::string::npos)
      << nul.ToString();
  EXPECT_TRUE(raw.Call({JobCreateHeader("rawok", {4}, 16, "w"), Floats(four)}).ok());
  EXPECT_EQ(admin->DescribeJob("bad").status().code(), Code::kNotFound);
  auto good = admin->CreateJob("good", "", {{"layer/0/w", {2, 2}, four.data()}});
  EXPECT_TRUE(good.ok()) << good.status().ToString();
  auto w = server_.WorkerClient();
  std::vector<float> d(32, 1.0f);
  ASSERT_TRUE(w->Push("j", "after", 0, 1, {{"b", kShape, d.data()}}).ok());
  EXPECT_EQ(PullAll(*w)["b"], std::vector<float>(32, 2.0f));
}

// A message of another schema version is refused on both sockets, the refusal names both
// versions and answers the request's own id, and nothing is applied.
TEST_F(ShardProcessTest, UnknownSchemaVersionIsRefusedNamingBothVersions) {
  auto w = server_.WorkerClient();
  auto before = PullAll(*w);
  RawSocket worker(server_), admin(server_, /*admin=*/true);
  std::vector<float> ones(32, 1.0f);
  for (uint32_t version : {0u, 2u, 999u}) {
    for (RawSocket* raw : {&worker, &admin}) {
      uint64_t id = 0;
      Status s = raw->Call(
          {PushHeader("v" + std::to_string(version), "b", 128, kShape, version), Floats(ones)},
          &id);
      EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.ToString();
      EXPECT_NE(s.message().find("schema_version " + std::to_string(version)), std::string::npos)
          << s.ToString();
      EXPECT_NE(s.message().find("speaks schema_version 1"), std::string::npos) << s.ToString();
      EXPECT_EQ(id, 42u);
    }
  }
  EXPECT_EQ(PullAll(*w), before);
  auto job = server_.AdminClient()->DescribeJob("j");
  ASSERT_TRUE(job.ok()) << job.status().ToString();
  EXPECT_EQ(job->pushes, 0u);
  // The same push at version 1 is applied: the refusals were about the version alone.
  EXPECT_TRUE(worker.Call({PushHeader("v1", "b", 128), Floats(ones)}).ok());
  EXPECT_EQ(server_.AdminClient()->DescribeJob("j")->pushes, 1u);
}

// Random single-byte mutations of a valid push: the server must answer every one (or
// apply a still-valid one) and never die.
TEST_F(ShardProcessTest, MutatedPushesNeverKillTheServer) {
  RawSocket raw(server_);
  std::string good = PushHeader("m", "b", 128);
  std::vector<float> zeros(32, 0.0f);
  std::mt19937 rng(11);
  int answered = 0, parts = 0;
  for (int i = 0; i < 300; ++i) {
    std::string h = good;
    h[rng() % h.size()] = static_cast<char>(rng());
    Status s = raw.Call({h, Floats(zeros)});
    if (s.code() != Code::kTimeout) {
      ++answered;
      continue;
    }
    // The one request left unanswered by design: a part of a push in parts (here of no push
    // that waits), which a mutated body type can turn the push into.
    zmq::message_t m(h.data(), h.size());
    auto env = ParseEnvelope(m, WireLimits{});
    if (env.ok() && (*env)->body_type() == wire::Body::PushPart) ++parts;
  }
  EXPECT_EQ(answered + parts, 300);
  EXPECT_LE(parts, 10);
  auto w = server_.WorkerClient();
  EXPECT_TRUE(w->Hello("j", wire::Role::Worker, "", "after-fuzz").ok());
}

TEST(ShardProcessLimits, OversizedMessageIsRefused) {
  ServerProcess server("[limits]\nmax_message_bytes = 65536\n");
  ASSERT_TRUE(server.Start());
  std::vector<float> small(16, 0.0f);
  auto admin = server.AdminClient();
  ASSERT_TRUE(
      admin->CreateJob("j", "", {{"big", {32768}, std::vector<float>(32768).data()}}).ok() ==
      false);  // 128 KiB of payload: over the limit at creation too
  ASSERT_TRUE(admin->CreateJob("j", "", {{"s", {16}, small.data()}}).ok());
  auto w = server.WorkerClient();
  std::vector<float> big(32768, 1.0f);
  auto p = w->Push("j", "big", 0, 1, {{"s", {32768}, big.data()}});
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), Code::kResourceExhausted) << p.status().ToString();
  auto r = w->Pull("j");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->tensors.at(0).data, small);
}

// A client streams pushes (each adds 1 to "b" with its own key) while the server is
// killed with SIGKILL at a random moment; after a restart every acknowledged push is
// present, and re-sending the one in flight (same key) makes the total exact.
TEST(ShardProcessCrash, SigkillDuringPushesLosesNothingAcknowledged) {
  const int loops =
      std::getenv("ISTHMUS_CRASH_LOOPS") ? std::atoi(std::getenv("ISTHMUS_CRASH_LOOPS")) : 3;
  ServerProcess server;
  ASSERT_TRUE(server.Start());
  CreateJob(server);
  std::mt19937 rng(1234);
  int next_key = 0;
  int acked_total = 0;
  std::vector<float> one(32, 1.0f);
  for (int loop = 0; loop < loops; ++loop) {
    std::atomic<bool> stop{false};
    std::atomic<int> acked{0};
    std::atomic<int> in_flight{-1};
    std::atomic<bool> pusher_done{false};
    std::thread pusher([&] {
      auto w = server.WorkerClient(1000, 0);
      while (!stop) {
        int k = next_key;
        in_flight = k;
        auto p = w->Push("j", "key-" + std::to_string(k), 0, 1, {{"b", kShape, one.data()}});
        if (!p.ok()) break;
        ++next_key;
        in_flight = -1;
        ++acked;
      }
      pusher_done = true;
    });
    // The kill falls at a random moment of a running stream: after the first push is
    // acknowledged (a sanitized client's first CURVE handshake can take longer than the
    // random delay alone) and while later ones go on.
    const auto first_deadline =
        std::chrono::steady_clock::now() + std::chrono::seconds(10 * isthmus::testing::TimeScale());
    while (acked == 0 && !pusher_done && std::chrono::steady_clock::now() < first_deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(150 + rng() % 400));
    int status = server.Kill(SIGKILL);
    EXPECT_TRUE(WIFSIGNALED(status));
    stop = true;
    pusher.join();
    acked_total += acked;
    EXPECT_GT(acked.load(), 0) << "no push was acknowledged before the kill in loop " << loop;

    ASSERT_TRUE(server.Start());
    auto w = server.WorkerClient();
    float b = PullAll(*w)["b"].at(0);
    // Every acknowledged push is there; the one in flight may or may not be.
    EXPECT_GE(b, 1.0f + acked_total) << "loop " << loop;
    EXPECT_LE(b, 1.0f + acked_total + 1) << "loop " << loop;
    if (in_flight >= 0) {
      auto p = w->Push("j", "key-" + std::to_string(in_flight.load()), 0, 1,
                       {{"b", kShape, one.data()}});
      ASSERT_TRUE(p.ok()) << p.status().ToString();
      ++next_key;
      ++acked_total;
    }
    auto all = PullAll(*w);
    EXPECT_EQ(all["b"], std::vector<float>(32, 1.0f + acked_total)) << "loop " << loop;
    EXPECT_EQ(all["a"], Iota(0)) << "loop " << loop;
  }
}

TEST(ShardProcessSnapshots, RestoreGivesBackTheSnapshotState) {
  ServerProcess server;
  ASSERT_TRUE(server.Start());
  CreateJob(server);
  auto w = server.WorkerClient();
  auto admin = server.AdminClient();
  std::vector<float> d(32, 0.5f);
  ASSERT_TRUE(w->Push("j", "p1", 0, 1, {{"a", kShape, d.data()}}).ok());
  auto at_snapshot = PullAll(*w);
  auto snap = admin->CreateSnapshot("s1");
  ASSERT_TRUE(snap.ok()) << snap.status().ToString();
  EXPECT_EQ(snap->name, "s1");
  ASSERT_TRUE(w->Push("j", "p2", 0, 1, {{"a", kShape, d.data()}, {"b", kShape, d.data()}}).ok());
  EXPECT_NE(PullAll(*w), at_snapshot);

  auto list = admin->ListSnapshots();
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ(list->at(0).name, "s1");
  EXPECT_FALSE(admin->CreateSnapshot("s1").ok());  // names are unique

  auto restored = admin->RestoreSnapshot("s1");
  ASSERT_TRUE(restored.ok()) << restored.status().ToString();
  EXPECT_EQ(PullAll(*w), at_snapshot);
  // The key pushed after the snapshot is unknown again: state and dedup move together.
  auto p2 = w->Push("j", "p2", 0, 1, {{"a", kShape, d.data()}});
  ASSERT_TRUE(p2.ok());
  EXPECT_FALSE(p2->duplicate);
  auto p1 = w->Push("j", "p1", 0, 1, {{"a", kShape, d.data()}});
  ASSERT_TRUE(p1.ok());
  EXPECT_TRUE(p1->duplicate);

  // The restored state survives a restart.
  auto expected = PullAll(*w);
  EXPECT_EQ(WEXITSTATUS(server.Kill(SIGTERM)), 0);
  ASSERT_TRUE(server.Start());
  EXPECT_EQ(PullAll(*server.WorkerClient()), expected);
  EXPECT_FALSE(admin->RestoreSnapshot("missing").ok());
}

// A snapshot cut short by a crash or a power loss leaves its .tmp- folder; the next start
// removes it (it would only hold disk space) and keeps the finished ones.
TEST(ShardProcessSnapshots, AnUnfinishedSnapshotIsRemovedAtStart) {
  ServerProcess server;
  ASSERT_TRUE(server.Start());
  CreateJob(server);
  ASSERT_TRUE(server.AdminClient()->CreateSnapshot("done").ok());
  EXPECT_EQ(WEXITSTATUS(server.Kill(SIGTERM)), 0);
  const auto snaps = server.dir() / "data" / "snapshots";
  std::filesystem::create_directories(snaps / ".tmp-cut" / "db");
  std::ofstream(snaps / ".tmp-cut" / "db" / "000001.sst") << "partial";
  ASSERT_TRUE(server.Start());
  EXPECT_FALSE(std::filesystem::exists(snaps / ".tmp-cut")) << server.Log();
  EXPECT_NE(server.Log().find("a snapshot that was never finished"), std::string::npos)
      << server.Log();
  auto list = server.AdminClient()->ListSnapshots();
  ASSERT_TRUE(list.ok()) << list.status().ToString();
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ(list->at(0).name, "done");
}

TEST(ShardProcessLifecycle, SigtermExitsCleanlyAndStateSurvives) {
  ServerProcess server;
  ASSERT_TRUE(server.Start());
  CreateJob(server);
  std::vector<float> d(32, 3.0f);
  ASSERT_TRUE(server.WorkerClient()->Push("j", "x", 0, 1, {{"b", kShape, d.data()}}).ok());
  int status = server.Kill(SIGTERM);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << server.Log();
  ASSERT_TRUE(server.Start());
  EXPECT_EQ(PullAll(*server.WorkerClient())["b"], std::vector<float>(32, 4.0f));
}

TEST(ShardProcessLifecycle, LooseSecretKeyPermissionsRefuseToStart) {
  ServerProcess server;
  ::chmod((server.dir() / "server.key").c_str(), 0644);
  auto started = server.Start();
  ASSERT_FALSE(started);
  EXPECT_EQ(server.last_exit_code(), 3);
  EXPECT_NE(server.Log().find("chmod 600"), std::string::npos) << server.Log();
}

// --- Refusals at start (issue 27, items 6 and 11) ------------------------------------------
// Each exits with the code docs/CLI.md gives, says what to do, and leaves the data dir as
// it was (not even created, where the refusal comes before it).

// The user a test running as root starts the server as (nobody), so that the test's files
// are another user's to the server (root may read and write any file). nullopt, with the
// reason in *why, when there is none or when the server runs through a wrapper
// (ISTHMUS_SERVER_BIN: the units' sandbox of tests/deploy needs root to make its mount
// namespace).
std::optional<std::pair<uid_t, gid_t>> Unprivileged(std::string* why) {
  const char* wrapper = std::getenv("ISTHMUS_SERVER_BIN");
  if (wrapper != nullptr && *wrapper != '\0') {
    *why = "running as root with the server behind a wrapper (ISTHMUS_SERVER_BIN)";
    return std::nullopt;
  }
  const passwd* pw = ::getpwnam("nobody");
  if (pw == nullptr) {
    *why = "running as root without a 'nobody' user to start the server as";
    return std::nullopt;
  }
  return std::make_pair(pw->pw_uid, pw->pw_gid);
}

// The server's folder readable (not writable) by every user: its config and public keys
// are, as under /etc/isthmus.
void OpenToOthers(const ServerProcess& server) {
  namespace fs = std::filesystem;
  fs::permissions(server.dir(), fs::perms(0755));
  for (const auto& e : fs::recursive_directory_iterator(server.dir())) {
    if (e.path().extension() == ".key") continue;
    fs::permissions(e.path(), fs::perms(e.is_directory() ? 0755 : 0644));
  }
}

// libzmq aborted on runtime.io_threads = 1000000 after the store was open.
TEST(ShardProcessStart, IoThreadsOutOfRangeExitsTwoBeforeZeroMqOrTheDataDir) {
  ServerProcess server("[runtime]\nio_threads = 1000000");
  ASSERT_FALSE(server.Start());
  EXPECT_EQ(server.last_exit_code(), 2) << server.Log();
  EXPECT_NE(server.Log().find("runtime.io_threads must be in [1, 64], not '1000000'"),
            std::string::npos)
      << server.Log();
  EXPECT_FALSE(std::filesystem::exists(server.dir() / "data"));
}

// A secret key file this user may not read exited 4 ("not found"); docs/CLI.md says 3.
TEST(ShardProcessStart, AnUnreadableSecretKeyExitsThreeNamingTheUser) {
  ServerProcess server;
  OpenToOthers(server);
  if (::geteuid() == 0) {
    std::string why;
    auto user = Unprivileged(&why);
    if (!user) GTEST_SKIP() << why;
    server.set_run_as(user->first, user->second);  // server.key stays root's, mode 0600
  } else {
    ::chmod((server.dir() / "server.key").c_str(), 0);
  }
  ASSERT_FALSE(server.Start());
  EXPECT_EQ(server.last_exit_code(), 3) << server.Log();
  EXPECT_NE(server.Log().find("server.key': Permission denied"), std::string::npos) << server.Log();
  EXPECT_NE(server.Log().find("chown"), std::string::npos) << server.Log();
  EXPECT_FALSE(std::filesystem::exists(server.dir() / "data")) << "refused before the data dir";
}

TEST(ShardProcessStart, AWorldWritableOrEmptyAllowlistExitsThree) {
  ServerProcess server;
  const std::string workers = (server.dir() / "workers").string();
  ASSERT_EQ(::chmod(workers.c_str(), 0777), 0);
  ASSERT_FALSE(server.Start());
  EXPECT_EQ(server.last_exit_code(), 3) << server.Log();
  EXPECT_NE(
      server.Log().find("allowlist folder '" + workers + "' (security.worker_keys) has mode 0777"),
      std::string::npos)
      << server.Log();
  EXPECT_NE(server.Log().find("chmod o-w " + workers), std::string::npos) << server.Log();
  EXPECT_FALSE(std::filesystem::exists(server.dir() / "data"));

  ASSERT_EQ(::chmod(workers.c_str(), 0755), 0);
  const std::string pub = (server.dir() / "admins" / "a0.pub").string();
  ASSERT_EQ(::chmod(pub.c_str(), 0666), 0);
  ASSERT_FALSE(server.Start());
  EXPECT_EQ(server.last_exit_code(), 3) << server.Log();
  EXPECT_NE(server.Log().find("chmod o-w " + pub), std::string::npos) << server.Log();

  std::filesystem::remove(pub);  // admins/ keeps only a0.key: no *.pub
  ASSERT_FALSE(server.Start());
  EXPECT_EQ(server.last_exit_code(), 3) << server.Log();
  EXPECT_NE(server.Log().find("(security.admin_keys) holds no *.pub file"), std::string::npos)
      << server.Log();
  EXPECT_FALSE(std::filesystem::exists(server.dir() / "data"));
}

// An unwritable data dir exited 6 saying "is another isthmus-server using this data dir?".
TEST(ShardProcessStart, AnUnwritableDataDirExitsSixWithAPermissionHint) {
  ServerProcess server;
  OpenToOthers(server);
  const auto data = server.dir() / "data";
  std::filesystem::create_directories(data);
  if (::geteuid() == 0) {
    std::string why;
    auto user = Unprivileged(&why);
    if (!user) GTEST_SKIP() << why;
    server.set_run_as(user->first, user->second);  // data/ stays root's, mode 0755
    ASSERT_EQ(::chown((server.dir() / "server.key").c_str(), user->first, user->second), 0);
  } else {
    std::filesystem::permissions(data, std::filesystem::perms(0555));
  }
  ASSERT_FALSE(server.Start());
  std::filesystem::permissions(data, std::filesystem::perms(0755));
  EXPECT_EQ(server.last_exit_code(), 6) << server.Log();
  EXPECT_NE(
      server.Log().find("cannot write shard.data_dir '" + data.string() + "': Permission denied"),
      std::string::npos)
      << server.Log();
  EXPECT_NE(server.Log().find("chown"), std::string::npos) << server.Log();
  EXPECT_EQ(server.Log().find("another isthmus-server"), std::string::npos) << server.Log();
  EXPECT_TRUE(std::filesystem::is_empty(data));
}

// The hint about another server comes only when another process holds the LOCK: then it
// names that process.
TEST(ShardProcessStart, ADataDirInUseNamesTheProcessHoldingIt) {
  const char* wrapper = std::getenv("ISTHMUS_SERVER_BIN");
  if (wrapper != nullptr && *wrapper != '\0') {
    GTEST_SKIP() << "the server runs behind a wrapper (ISTHMUS_SERVER_BIN), which may confine "
                    "its writes to its own folder (tests/deploy's sandbox)";
  }
  ServerProcess first, second;
  ASSERT_TRUE(first.Start());
  const std::string shared = (first.dir() / "data").string();
  ::setenv("ISTHMUS_SHARD_DATA_DIR", shared.c_str(), 1);  // over second's own config
  const bool started = second.Start();
  ::unsetenv("ISTHMUS_SHARD_DATA_DIR");
  ASSERT_FALSE(started);
  EXPECT_EQ(second.last_exit_code(), 6) << second.Log();
  EXPECT_NE(second.Log().find("process " + std::to_string(first.pid()) + " holds its LOCK"),
            std::string::npos)
      << second.Log();
  EXPECT_NE(second.Log().find("another isthmus-server"), std::string::npos) << second.Log();
  EXPECT_TRUE(first.AdminClient()->Stats().ok()) << "the first server serves on";
}

// One start with sync.site set turned a plain job into a sync job for good. Now the start
// is refused (exit 2) naming the job and the setting that converts it; started without
// sync.site the job is plain as before; with sync.convert_plain_jobs it is converted, and
// stays converted.
TEST(ShardProcessStart, APlainJobIsNotTurnedIntoASyncJobWithoutTheOperatorsWord) {
  ServerProcess server;
  ASSERT_TRUE(server.Start());
  CreateJob(server);
  ASSERT_EQ(WEXITSTATUS(server.Kill(SIGTERM)), 0);

  server.set_extra("[sync]\nsite = \"A\"");
  ASSERT_FALSE(server.Start());
  EXPECT_EQ(server.last_exit_code(), 2) << server.Log();
  EXPECT_NE(server.Log().find("job(s) 'j' were created without cross-site sync, and sync.site "
                              "is now 'A'"),
            std::string::npos)
      << server.Log();
  EXPECT_NE(server.Log().find("sync.convert_plain_jobs = true"), std::string::npos) << server.Log();

  server.set_extra("");
  ASSERT_TRUE(server.Start());
  EXPECT_EQ(server.AdminClient()->Digests("j", 0).status().code(), Code::kFailedPrecondition)
      << "the job is plain on a shard without sync";
  auto w = server.WorkerClient();
  std::vector<float> d(32, 1.0f);
  ASSERT_TRUE(w->Push("j", "plain", 0, 1, {{"b", kShape, d.data()}}).ok());
  EXPECT_EQ(PullAll(*w)["b"], std::vector<float>(32, 2.0f));
  ASSERT_EQ(WEXITSTATUS(server.Kill(SIGTERM)), 0);

  server.set_extra("[sync]\nsite = \"A\"\nconvert_plain_jobs = true");
  ASSERT_TRUE(server.Start());
  auto digests = server.AdminClient()->Digests("j", 0);
  ASSERT_TRUE(digests.ok()) << digests.status().ToString();
  EXPECT_EQ(digests->committed_round, 0u);
  EXPECT_NE(server.Log().find("sync.convert_plain_jobs: job(s) 'j'"), std::string::npos)
      << server.Log();
  EXPECT_EQ(PullAll(*server.WorkerClient())["b"], std::vector<float>(32, 2.0f))
      << "round 0 is the job's state at the conversion";
  ASSERT_EQ(WEXITSTATUS(server.Kill(SIGTERM)), 0);
  server.set_extra("[sync]\nsite = \"A\"");
  ASSERT_TRUE(server.Start()) << "a converted job is a sync job";
}

}  // namespace
}  // namespace isthmus
