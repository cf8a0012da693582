// The wire codec: envelopes round-trip, and every malformed header or payload is refused
// with a precise error (never a crash).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "common/client.h"
#include "common/wire.h"

namespace isthmus {
namespace {

zmq::message_t Copy(const flatbuffers::FlatBufferBuilder& fbb) {
  return zmq::message_t(fbb.GetBufferPointer(), fbb.GetSize());
}

zmq::message_t FloatFrame(const std::vector<float>& v) {
  return zmq::message_t(v.data(), v.size() * sizeof(float));
}

// A push envelope for tensors a [2,3] and b [4].
struct PushFixture {
  std::vector<float> a{1, 2, 3, 4, 5, 6}, b{0.5f, -1, 2, 8};
  std::vector<TensorView> views{{"a", {2, 3}, nullptr}, {"b", {4}, nullptr}};
  flatbuffers::FlatBufferBuilder fbb;
  PushFixture() {
    views[0].data = a.data();
    views[1].data = b.data();
    auto metas = BuildTensorMetas(fbb, views);
    auto body = wire::CreatePushRequest(fbb, fbb.CreateString("job"), fbb.CreateString("key-1"), 7,
                                        1234, metas);
    wire::FinishEnvelopeBuffer(
        fbb, wire::CreateEnvelope(fbb, 1, 99, wire::Body::PushRequest, body.Union()));
  }
  std::vector<zmq::message_t> Frames() {
    std::vector<zmq::message_t> f;
    f.push_back(FloatFrame(a));
    f.push_back(FloatFrame(b));
    return f;
  }
};

TEST(WireTest, PushRoundTrips) {
  PushFixture p;
  zmq::message_t header = Copy(p.fbb);
  auto env = ParseEnvelope(header, WireLimits{});
  ASSERT_TRUE(env.ok()) << env.status().ToString();
  EXPECT_EQ((*env)->request_id(), 99u);
  ASSERT_EQ((*env)->body_type(), wire::Body::PushRequest);
  const auto* push = (*env)->body_as_PushRequest();
  EXPECT_EQ(push->job()->str(), "job");
  EXPECT_EQ(push->idempotency_key()->str(), "key-1");
  EXPECT_EQ(push->round(), 7u);
  EXPECT_EQ(push->tokens(), 1234u);
  ASSERT_EQ(push->tensors()->size(), 2u);
  EXPECT_EQ(ShapeOf(push->tensors()->Get(0)), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(push->tensors()->Get(1)->nbytes(), 16u);
  auto frames = p.Frames();
  EXPECT_TRUE(ValidateTensors(push->tensors(), frames, WireLimits{}, true).ok());
}

TEST(WireTest, ErrorReplyCarriesCodeAndMessage) {
  flatbuffers::FlatBufferBuilder fbb;
  BuildErrorReply(fbb, 5, Status::NotFound("no such job"));
  zmq::message_t header = Copy(fbb);
  auto env = ParseEnvelope(header, WireLimits{});
  ASSERT_TRUE(env.ok());
  Status s = ErrorFromEnvelope(*env);
  EXPECT_EQ(s.code(), Code::kNotFound);
  EXPECT_EQ(s.message(), "no such job");
  for (int c = 0; c <= static_cast<int>(Code::kResourceExhausted); ++c) {
    EXPECT_EQ(FromWireCode(ToWireCode(static_cast<Code>(c))), static_cast<Code>(c));
  }
}

TEST(WireTest, GarbageAndTruncatedHeadersAreRefused) {
  PushFixture p;
  std::string bytes(reinterpret_cast<const char*>(p.fbb.GetBufferPointer()), p.fbb.GetSize());
  // (The last bytes can be alignment padding, so only cuts into the tables are checked.)
  for (size_t cut : {size_t{0}, size_t{3}, size_t{8}, bytes.size() / 2, bytes.size() - 24}) {
    zmq::message_t m(bytes.data(), cut);
    EXPECT_FALSE(ParseEnvelope(m, WireLimits{}).ok()) << "truncated at " << cut;
  }
  std::string garbage(256, '\xAB');
  zmq::message_t g(garbage.data(), garbage.size());
  EXPECT_EQ(ParseEnvelope(g, WireLimits{}).status().code(), Code::kInvalidArgument);
  WireLimits tiny;
  tiny.max_header_bytes = 16;
  zmq::message_t full(bytes.data(), bytes.size());
  EXPECT_EQ(ParseEnvelope(full, tiny).status().code(), Code::kResourceExhausted);
}

TEST(WireTest, ElementCountsStayWhereTheirByteCountsCannotWrap) {
  const int64_t p31 = int64_t{1} << 31, p61 = int64_t{1} << 61, p62 = int64_t{1} << 62;
  EXPECT_EQ(NumElements({}), 1);
  EXPECT_EQ(NumElements({3, 0, 5}), 0);
  EXPECT_EQ(NumElements({kMaxElements}), kMaxElements);
  EXPECT_EQ(NumElements({int64_t{1} << 28, int64_t{1} << 28}), kMaxElements);
  for (const std::vector<int64_t>& shape :
       std::vector<std::vector<int64_t>>{{p62},
                                         {p31, p31},
                                         {p61, 2},
                                         {2, p61},
                                         {kMaxElements, 2},
                                         {p31, 0, p31},
                                         {0, p62},
                                         {p62, 0},
                                         {-1},
                                         {4, -2},
                                         {INT64_MAX},
                                         {INT64_MAX, INT64_MAX}}) {
    EXPECT_EQ(NumElements(shape), -1) << ::testing::PrintToString(shape);
  }
}

// The shapes of the out-of-bounds read: nbytes 0 and an empty frame must not pass as a
// tensor of 2^62 elements (x 4 bytes wraps to 0).
TEST(WireTest, ShapesWhoseByteCountWrapsAreRefusedBeforeThePayloadIsRead) {
  const int64_t p31 = int64_t{1} << 31, p61 = int64_t{1} << 61, p62 = int64_t{1} << 62;
  for (const std::vector<int64_t>& shape :
       std::vector<std::vector<int64_t>>{{p62}, {p31, p31}, {p61, 2}, {p31, 0, p31}}) {
    flatbuffers::FlatBufferBuilder fbb;
    auto meta = wire::CreateTensorMetaDirect(fbb, "w", &shape, wire::DType::F32, 0, 0, 0);
    std::vector<flatbuffers::Offset<wire::TensorMeta>> metas{meta};
    auto body = wire::CreatePushRequestDirect(fbb, "j", "k", 0, 1, &metas);
    FinishEnvelope(fbb, 1, wire::Body::PushRequest, body.Union());
    zmq::message_t header = Copy(fbb);
    auto env = ParseEnvelope(header, WireLimits{});
    ASSERT_TRUE(env.ok()) << env.status().ToString();
    const auto* v = (*env)->body_as_PushRequest()->tensors();
    std::vector<zmq::message_t> frames;
    frames.emplace_back();  // empty
    Status s = ValidateTensors(v, frames, WireLimits{}, true);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.ToString();
    EXPECT_NE(s.message().find("negative or huge shape"), std::string::npos) << s.ToString();
  }
}

TEST(WireTest, OtherSchemaVersionsAreRefusedNamingBothVersions) {
  for (uint32_t version : {0u, 2u, 999u}) {
    flatbuffers::FlatBufferBuilder fbb;
    auto body = wire::CreatePullRequestDirect(fbb, "job");
    wire::FinishEnvelopeBuffer(
        fbb, wire::CreateEnvelope(fbb, version, 77, wire::Body::PullRequest, body.Union()));
    zmq::message_t m = Copy(fbb);
    uint64_t id = 0;
    auto env = ParseEnvelope(m, WireLimits{}, &id);
    ASSERT_FALSE(env.ok());
    EXPECT_EQ(env.status().code(), Code::kInvalidArgument);
    EXPECT_NE(env.status().message().find("schema_version " + std::to_string(version)),
              std::string::npos)
        << env.status().ToString();
    EXPECT_NE(
        env.status().message().find("speaks schema_version " + std::to_string(kSchemaVersion)),
        std::string::npos)
        << env.status().ToString();
    EXPECT_EQ(id, 77u);  // a refusal can still answer the request
  }
  // What this build writes carries its own version and passes.
  flatbuffers::FlatBufferBuilder fbb;
  FinishEnvelope(fbb, 5, wire::Body::PullRequest, wire::CreatePullRequestDirect(fbb, "j").Union());
  zmq::message_t m = Copy(fbb);
  auto env = ParseEnvelope(m, WireLimits{});
  ASSERT_TRUE(env.ok()) << env.status().ToString();
  EXPECT_EQ((*env)->schema_version(), kSchemaVersion);
}

TEST(WireTest, RandomMutationsNeverCrashTheVerifier) {
  PushFixture p;
  std::string bytes(reinterpret_cast<const char*>(p.fbb.GetBufferPointer()), p.fbb.GetSize());
  std::mt19937 rng(42);
  int accepted = 0;
  for (int i = 0; i < 5000; ++i) {
    std::string m = bytes;
    int flips = 1 + rng() % 4;
    for (int f = 0; f < flips; ++f) m[rng() % m.size()] = static_cast<char>(rng());
    zmq::message_t msg(m.data(), m.size());
    auto env = ParseEnvelope(msg, WireLimits{});
    if (!env.ok()) continue;
    ++accepted;
    // Whatever passed the verifier must be safe to walk.
    if ((*env)->body_type() == wire::Body::PushRequest) {
      auto frames = p.Frames();
      (void)ValidateTensors((*env)->body_as_PushRequest()->tensors(), frames, WireLimits{}, true);
    }
  }
  EXPECT_LT(accepted, 5000);  // most mutations are caught
}

TEST(WireTest, PayloadChecksNameTheProblem) {
  PushFixture p;
  zmq::message_t header = Copy(p.fbb);
  auto metas = (*ParseEnvelope(header, WireLimits{}))->body_as_PushRequest()->tensors();
  auto expect_invalid = [&](std::vector<zmq::message_t> frames, const std::string& needle,
                            Code code = Code::kInvalidArgument, WireLimits limits = {}) {
    Status s = ValidateTensors(metas, frames, limits, true);
    EXPECT_EQ(s.code(), code) << s.ToString();
    EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
  };
  {  // missing frame
    std::vector<zmq::message_t> f;
    f.push_back(FloatFrame(p.a));
    expect_invalid(std::move(f), "payload frames");
  }
  {  // short frame
    std::vector<zmq::message_t> f;
    f.push_back(FloatFrame(p.a));
    f.push_back(FloatFrame({1, 2, 3}));
    expect_invalid(std::move(f), "tensor 'b'");
  }
  for (float bad : {std::nanf(""), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    auto b = p.b;
    b[2] = bad;
    std::vector<zmq::message_t> f;
    f.push_back(FloatFrame(p.a));
    f.push_back(FloatFrame(b));
    expect_invalid(std::move(f), "NaN or infinite");
  }
  {  // payload over the limit
    WireLimits l;
    l.max_payload_bytes = 20;
    expect_invalid(p.Frames(), "exceeds the limit", Code::kResourceExhausted, l);
  }
  {  // too many tensors
    WireLimits l;
    l.max_tensors = 1;
    expect_invalid(p.Frames(), "exceed", Code::kResourceExhausted, l);
  }
}

TEST(WireTest, DuplicateNamesBadDtypeAndReusedFramesAreRefused) {
  std::vector<float> v{1, 2};
  auto check = [&](auto build, const std::string& needle) {
    flatbuffers::FlatBufferBuilder fbb;
    std::vector<int64_t> shape{2};
    auto metas = build(fbb, shape);
    auto body = wire::CreatePushRequest(fbb, fbb.CreateString("j"), fbb.CreateString("k"), 0, 0,
                                        fbb.CreateVector(metas));
    wire::FinishEnvelopeBuffer(
        fbb, wire::CreateEnvelope(fbb, 1, 1, wire::Body::PushRequest, body.Union()));
    zmq::message_t header = Copy(fbb);
    auto env = ParseEnvelope(header, WireLimits{});
    ASSERT_TRUE(env.ok());
    std::vector<zmq::message_t> frames;
    frames.push_back(FloatFrame(v));
    frames.push_back(FloatFrame(v));
    Status s =
        ValidateTensors((*env)->body_as_PushRequest()->tensors(), frames, WireLimits{}, true);
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
  };
  using Metas = std::vector<flatbuffers::Offset<wire::TensorMeta>>;
  check(
      [](auto& fbb, auto& shape) {
        return Metas{wire::CreateTensorMetaDirect(fbb, "x", &shape, wire::DType::F32, 0, 8),
                     wire::CreateTensorMetaDirect(fbb, "x", &shape, wire::DType::F32, 1, 8)};
      },
      "appears twice");
  check(
      [](auto& fbb, auto& shape) {
        return Metas{wire::CreateTensorMetaDirect(fbb, "x", &shape, wire::DType::F32, 0, 8),
                     wire::CreateTensorMetaDirect(fbb, "y", &shape, wire::DType::F32, 0, 8)};
      },
      "used twice");
  check(
      [](auto& fbb, auto& shape) {
        return Metas{
            wire::CreateTensorMetaDirect(fbb, "x", &shape, static_cast<wire::DType>(7), 0, 8),
            wire::CreateTensorMetaDirect(fbb, "y", &shape, wire::DType::F32, 1, 8)};
      },
      "only F32");
  check(
      [](auto& fbb, auto&) {
        std::vector<int64_t> neg{-2};
        return Metas{wire::CreateTensorMetaDirect(fbb, "x", &neg, wire::DType::F32, 0, 8),
                     wire::CreateTensorMetaDirect(fbb, "y", &neg, wire::DType::F32, 1, 8)};
      },
      "negative");
}

}  // namespace
}  // namespace isthmus
