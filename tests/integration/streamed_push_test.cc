// Pushes in parts (PushRequest.streamed, PushPart) against a real isthmus-server process on
// loopback with CURVE: a large tensor's sums are written to disk part by part. What a
// worker sees (the same sums as a whole push, applied once, durable), a whole push that
// lands between the parts, hostile parts refused with nothing changed, and a SIGKILL in
// the middle of the parts.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "common/transport.h"
#include "common/wire.h"
#include "tests/integration/server_process.h"

namespace isthmus {
namespace {

using testing::RawSocket;
using testing::ServerProcess;

// How long a reply may take (scaled for sanitized builds).
const int kReplyMs = 5000 * testing::TimeScale();
constexpr uint64_t kPart = 65536;              // storage.push_part_bytes of the server
constexpr int64_t kBig = 300000;               // floats: 1.2 MB, a slot file; 19 parts
const std::vector<int64_t> kBigShape{kBig};    // tensor "big"
const std::vector<int64_t> kSmallShape{4, 8};  // tensor "a"

std::vector<float> Ramp(size_t n, float start, float step) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = start + step * static_cast<float>(i % 1000);
  return v;
}

std::vector<float> Sum(const std::vector<float>& a, const std::vector<float>& b) {
  std::vector<float> out(a.size());
  for (size_t i = 0; i < a.size(); ++i) out[i] = a[i] + b[i];
  return out;
}

std::string Bytes(const std::vector<float>& v, size_t from = 0, size_t n = std::string::npos) {
  std::string all(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
  return all.substr(from, n);
}

std::string Envelope(flatbuffers::FlatBufferBuilder& fbb, uint64_t id, wire::Body type,
                     flatbuffers::Offset<void> body) {
  wire::FinishEnvelopeBuffer(fbb, wire::CreateEnvelope(fbb, 1, id, type, body));
  return std::string(reinterpret_cast<const char*>(fbb.GetBufferPointer()), fbb.GetSize());
}

// A PushRequest (id 42) of "big" in parts and, when `with_small`, "a" in a frame.
std::string StreamedHeader(const std::string& key, bool with_small,
                           std::vector<uint32_t> streamed = {0},
                           uint64_t big_bytes = kBig * sizeof(float)) {
  flatbuffers::FlatBufferBuilder fbb;
  std::vector<flatbuffers::Offset<wire::TensorMeta>> metas{
      wire::CreateTensorMetaDirect(fbb, "big", &kBigShape, wire::DType::F32, 0, big_bytes, 0)};
  if (with_small) {
    metas.push_back(wire::CreateTensorMetaDirect(fbb, "a", &kSmallShape, wire::DType::F32, 0,
                                                 32 * sizeof(float), 0));
  }
  auto body = wire::CreatePushRequestDirect(fbb, "j", key.c_str(), 0, 1, &metas, 0, &streamed);
  return Envelope(fbb, 42, wire::Body::PushRequest, body.Union());
}

std::string PartHeader(const std::string& key, uint32_t tensor, uint64_t offset) {
  flatbuffers::FlatBufferBuilder fbb;
  auto body = wire::CreatePushPartDirect(fbb, "j", key.c_str(), tensor, offset);
  return Envelope(fbb, 1000 + offset / kPart, wire::Body::PushPart, body.Union());
}

// The parts of `delta` from byte `from` up to byte `to`, as a client cuts them.
void SendParts(RawSocket& raw, const std::string& key, const std::vector<float>& delta, size_t from,
               size_t to) {
  for (size_t off = from; off < to; off += kPart) {
    raw.Send({PartHeader(key, 0, off), Bytes(delta, off, std::min<size_t>(kPart, to - off))});
  }
}

class StreamedPushTest : public ::testing::Test {
 protected:
  StreamedPushTest() : server_("[storage]\npush_part_bytes = " + std::to_string(kPart) + "\n") {}
  void SetUp() override {
    ASSERT_TRUE(server_.Start());
    auto admin = server_.AdminClient();
    auto r = admin->CreateJob("j", "h",
                              {{"big", kBigShape, big0_.data()}, {"a", kSmallShape, a0_.data()}});
    ASSERT_TRUE(r.ok()) << r.status().ToString();
  }
  std::map<std::string, std::vector<float>> PullAll() {
    auto w = server_.WorkerClient();
    auto r = w->Pull("j");
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    std::map<std::string, std::vector<float>> out;
    if (r.ok()) {
      for (auto& t : r->tensors) out[t.name] = t.data;
    }
    return out;
  }
  uint64_t Requests() {
    auto st = server_.AdminClient()->Stats();
    EXPECT_TRUE(st.ok()) << st.status().ToString();
    return st.ok() ? st->requests : 0;
  }
  uint64_t Pushes() {
    auto st = server_.AdminClient()->Stats();
    EXPECT_TRUE(st.ok()) << st.status().ToString();
    return st.ok() ? st->jobs.at(0).pushes : 0;
  }
  // A worker client that has said Hello (so it knows the job takes parts).
  std::unique_ptr<ShardClient> Worker(bool in_parts = true) {
    ClientOptions o = server_.WorkerClient()->options();
    o.push_in_parts = in_parts;
    auto c = ShardClient::Connect(o);
    EXPECT_TRUE(c.ok());
    auto hello = (*c)->Hello("j", wire::Role::Worker, "h", "test");
    EXPECT_TRUE(hello.ok()) << hello.status().ToString();
    if (hello.ok()) EXPECT_EQ(hello->push_part_bytes, kPart);
    return std::move(c).value();
  }

  ServerProcess server_;
  std::vector<float> big0_ = Ramp(kBig, -2.0f, 0.004f), a0_ = Ramp(32, 1.0f, 0.5f);
  std::vector<float> d_big_ = Ramp(kBig, 0.1f, -0.0003f), d_a_ = Ramp(32, -1.0f, 0.125f);
};

TEST_F(StreamedPushTest, PartsGiveTheSumsOfAWholePushOnceAndDurably) {
  auto parts = Worker(true);
  auto whole = Worker(false);
  const uint64_t requests = Requests();
  auto p = parts->Push("j", "k1", 0, 1,
                       {{"big", kBigShape, d_big_.data()}, {"a", kSmallShape, d_a_.data()}});
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_FALSE(p->duplicate);
  // The request, 19 parts (1.2 MB in 64 KiB) and the two Stats calls.
  EXPECT_EQ(Requests() - requests, 1u + 19u + 1u);
  std::vector<float> big1 = Sum(big0_, d_big_), a1 = Sum(a0_, d_a_);
  auto now = PullAll();
  EXPECT_EQ(now["big"], big1);
  EXPECT_EQ(now["a"], a1);
  // The same deltas whole, under another key: added once more, the same arithmetic.
  const uint64_t requests2 = Requests();
  ASSERT_TRUE(whole
                  ->Push("j", "k2", 0, 1,
                         {{"big", kBigShape, d_big_.data()}, {"a", kSmallShape, d_a_.data()}})
                  .ok());
  EXPECT_EQ(Requests() - requests2, 2u) << "one message, and the Stats call";
  std::vector<float> big2 = Sum(big1, d_big_), a2 = Sum(a1, d_a_);
  // A retry of the first, in parts again: a duplicate, nothing added.
  auto again = parts->Push("j", "k1", 0, 1,
                           {{"big", kBigShape, d_big_.data()}, {"a", kSmallShape, d_a_.data()}});
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_TRUE(again->duplicate);
  now = PullAll();
  EXPECT_EQ(now["big"], big2);
  EXPECT_EQ(now["a"], a2);
  EXPECT_EQ(Pushes(), 2u);
  // Durable: after a SIGKILL the restarted server serves the same values.
  server_.Kill(SIGKILL);
  ASSERT_TRUE(server_.Start());
  now = PullAll();
  EXPECT_EQ(now["big"], big2);
  EXPECT_EQ(now["a"], a2);
}

// A whole push of the same tensor lands while a push's parts come: both are applied, the
// one in parts on top of the other (its sums computed again from the values served).
TEST_F(StreamedPushTest, AWholePushBetweenThePartsIsAddedToo) {
  RawSocket raw(server_);
  const size_t bytes = kBig * sizeof(float), half = 9 * kPart;
  raw.Send({StreamedHeader("s1", true), Bytes(d_a_)});
  SendParts(raw, "s1", d_big_, 0, half);
  std::vector<float> e(kBig, 0.5f);
  auto whole = Worker(false);
  ASSERT_TRUE(whole->Push("j", "w1", 0, 1, {{"big", kBigShape, e.data()}}).ok());
  SendParts(raw, "s1", d_big_, half, bytes);
  uint64_t id = 0;
  Status s = raw.Receive(&id, kReplyMs);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(id, 42u) << "the reply answers the PushRequest";
  const std::vector<float> big = Sum(Sum(big0_, e), d_big_), a = Sum(a0_, d_a_);
  auto now = PullAll();
  EXPECT_EQ(now["big"], big);
  EXPECT_EQ(now["a"], a);
  EXPECT_EQ(Pushes(), 2u);
  server_.Kill(SIGKILL);
  ASSERT_TRUE(server_.Start());
  now = PullAll();
  EXPECT_EQ(now["big"], big);
  EXPECT_EQ(now["a"], a);
}

TEST_F(StreamedPushTest, HostilePartsAreRefusedAndChangeNothing) {
  const auto before = PullAll();
  RawSocket raw(server_);
  const size_t bytes = kBig * sizeof(float);
  // A part of no push is dropped without an answer (nor harm).
  raw.Send({PartHeader("nobody", 0, 0), Bytes(d_big_, 0, kPart)});
  EXPECT_EQ(raw.Receive(nullptr, 300).code(), Code::kTimeout);
  // Parts that do not follow: a gap, a repeat, the wrong tensor, a piece of a float, two
  // frames, none, more bytes than the tensor has left.
  struct Bad {
    const char* what;
    std::vector<std::string> part;
  };
  std::vector<float> one(kPart / sizeof(float), 1.0f);
  const std::vector<Bad> bad = {
      {"gap", {PartHeader("x", 0, 2 * kPart), Bytes(one)}},
      {"wrong tensor", {PartHeader("x", 1, kPart), Bytes(one)}},
      {"piece of a float", {PartHeader("x", 0, kPart), Bytes(one).substr(0, 6)}},
      {"two frames", {PartHeader("x", 0, kPart), Bytes(one), Bytes(one)}},
      {"no frame", {PartHeader("x", 0, kPart)}},
      {"too long", {PartHeader("x", 0, kPart), std::string(bytes, '\0')}},
  };
  for (const auto& b : bad) {
    raw.Send({StreamedHeader("x", false)});
    raw.Send({PartHeader("x", 0, 0), Bytes(one)});
    raw.Send(b.part);
    uint64_t id = 0;
    Status s = raw.Receive(&id, kReplyMs);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << b.what << ": " << s.ToString();
    EXPECT_EQ(id, 42u) << b.what;
    EXPECT_NE(s.message().find("expects"), std::string::npos) << s.ToString();
    // What the client still sends for it is dropped.
    SendParts(raw, "x", d_big_, 2 * kPart, 4 * kPart);
  }
  // A NaN in a part.
  {
    std::vector<float> nan = one;
    nan[3] = std::numeric_limits<float>::quiet_NaN();
    raw.Send({StreamedHeader("n", false)});
    raw.Send({PartHeader("n", 0, 0), Bytes(nan)});
    Status s = raw.Receive(nullptr, kReplyMs);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.ToString();
  }
  // Requests that cannot be taken in parts: indices out of order or out of range, a size
  // that is not the tensor's, a frame missing for the tensor that is not in parts.
  EXPECT_EQ(raw.Call({StreamedHeader("i1", true, {1, 0}), Bytes(d_a_)}).code(),
            Code::kInvalidArgument);
  EXPECT_EQ(raw.Call({StreamedHeader("i2", false, {3})}).code(), Code::kInvalidArgument);
  EXPECT_EQ(raw.Call({StreamedHeader("i3", false, {0}, bytes - 4)}).code(), Code::kInvalidArgument);
  EXPECT_EQ(raw.Call({StreamedHeader("i4", true)}).code(), Code::kInvalidArgument);
  EXPECT_EQ(PullAll(), before);
  EXPECT_EQ(Pushes(), 0u);
  // The harness is sound: the same socket's well-formed push in parts is applied.
  raw.Send({StreamedHeader("good", false)});
  SendParts(raw, "good", d_big_, 0, bytes);
  Status s = raw.Receive(nullptr, kReplyMs);
  EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(PullAll()["big"], Sum(big0_, d_big_));
}

// A client that gives up on an attempt (a timeout) sends the push again on a new
// connection. Parts of the first attempt that the server still reads from the old
// connection afterwards are ignored: they neither refuse nor mix with the retry's.
TEST_F(StreamedPushTest, PartsOfAnAttemptGivenUpDoNotMixWithItsRetry) {
  const size_t bytes = kBig * sizeof(float);
  auto admin = server_.AdminClient();
  auto st = admin->Stats();
  ASSERT_TRUE(st.ok());
  uint64_t counted = st->requests;  // every request counts, these Stats calls too
  // Waits until the server has handled `n` more requests than counted so far.
  auto wait_for = [&](uint64_t n) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (std::chrono::steady_clock::now() < deadline) {
      auto now = admin->Stats();
      if (!now.ok()) return false;
      if (now->requests - counted - 1 >= n) {
        counted = now->requests;
        return true;
      }
      counted += 1;  // this Stats call
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  };
  RawSocket first(server_), retry(server_);
  std::vector<float> wrong(kBig, 7.0f);
  first.Send({StreamedHeader("r", false)});
  SendParts(first, "r", wrong, 0, 6 * kPart);
  ASSERT_TRUE(wait_for(7));
  // The retry's request is taken before the rest of the first attempt's parts come.
  retry.Send({StreamedHeader("r", false)});
  ASSERT_TRUE(wait_for(1));
  SendParts(retry, "r", d_big_, 0, 3 * kPart);
  SendParts(first, "r", wrong, 6 * kPart, bytes);  // late, on the old connection
  SendParts(retry, "r", d_big_, 3 * kPart, bytes);
  Status s = retry.Receive(nullptr, kReplyMs);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(first.Receive(nullptr, 300).code(), Code::kTimeout) << "the first attempt's parts";
  EXPECT_EQ(PullAll()["big"], Sum(big0_, d_big_));
  EXPECT_EQ(Pushes(), 1u);
}

// The server dies (SIGKILL) after taking half of a push's parts: nothing of it was
// applied, and the client's retry under the same key after the restart is applied once.
TEST_F(StreamedPushTest, SigkillHalfWayThroughThePartsLosesNothingAndDoublesNothing) {
  const auto before = PullAll();
  auto admin = server_.AdminClient();
  auto st = admin->Stats();
  ASSERT_TRUE(st.ok());
  const uint64_t requests = st->requests;
  RawSocket raw(server_);
  raw.Send({StreamedHeader("k", true), Bytes(d_a_)});
  SendParts(raw, "k", d_big_, 0, 10 * kPart);
  // Wait until the server has handled the request and the ten parts (each counts).
  // Every request counts, these Stats calls too.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  uint64_t handled = 0, calls = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    st = admin->Stats();
    ASSERT_TRUE(st.ok());
    handled = st->requests - requests - ++calls;
    if (handled >= 11) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_EQ(handled, 11u);
  server_.Kill(SIGKILL);
  ASSERT_TRUE(server_.Start());
  EXPECT_EQ(PullAll(), before);
  auto w = Worker(true);
  auto p =
      w->Push("j", "k", 0, 1, {{"big", kBigShape, d_big_.data()}, {"a", kSmallShape, d_a_.data()}});
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_FALSE(p->duplicate);
  auto now = PullAll();
  EXPECT_EQ(now["big"], Sum(big0_, d_big_));
  EXPECT_EQ(now["a"], Sum(a0_, d_a_));
  EXPECT_EQ(Pushes(), 1u);
}

}  // namespace
}  // namespace isthmus
