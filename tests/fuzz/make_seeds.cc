// Writes the fuzz targets' seed corpora under the folder given (tests/fuzz/corpus): valid
// messages, files and encodings, and the hostile shapes and versions found before (the
// [2^62] tensor with an empty frame, schema_version 999), in each target's input layout.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <tuple>
#include <vector>

#include "common/client.h"
#include "common/safetensors.h"
#include "common/varint.h"
#include "common/wire.h"
#include "ops/codec.h"

namespace {

namespace fs = std::filesystem;
using namespace isthmus;

void Write(const fs::path& path, const std::string& bytes) {
  fs::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary) << bytes;
}

// 2-byte header length, header, frame count, then the frames: fuzz_wire's layout gives each
// a 1-byte length in 4-byte words (the frame is cut to whole words), fuzz_peer's a 2-byte
// length in bytes.
enum class Layout { kWire, kPeer };
std::string Message(const flatbuffers::FlatBufferBuilder& fbb,
                    const std::vector<std::string>& frames, Layout layout = Layout::kWire) {
  std::string out;
  const size_t n = fbb.GetSize();
  out.push_back(static_cast<char>(n & 0xff));
  out.push_back(static_cast<char>(n >> 8));
  out.append(reinterpret_cast<const char*>(fbb.GetBufferPointer()), n);
  out.push_back(static_cast<char>(frames.size()));
  for (const auto& f : frames) {
    if (layout == Layout::kWire) {
      out.push_back(static_cast<char>(f.size() / 4));
      out += f.substr(0, (f.size() / 4) * 4);
    } else {
      out.push_back(static_cast<char>(f.size() & 0xff));
      out.push_back(static_cast<char>(f.size() >> 8));
      out += f;
    }
  }
  return out;
}

std::string Floats(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4);
}

std::string Tensors(wire::Body type,
                    const std::vector<std::pair<std::string, std::vector<int64_t>>>& ts,
                    const std::vector<uint64_t>& nbytes, uint32_t version = kSchemaVersion) {
  flatbuffers::FlatBufferBuilder fbb;
  std::vector<flatbuffers::Offset<wire::TensorMeta>> metas;
  for (size_t i = 0; i < ts.size(); ++i) {
    metas.push_back(wire::CreateTensorMetaDirect(fbb, ts[i].first.c_str(), &ts[i].second,
                                                 wire::DType::F32, static_cast<uint32_t>(i),
                                                 nbytes[i], 0));
  }
  flatbuffers::Offset<void> body;
  if (type == wire::Body::PushRequest) {
    body = wire::CreatePushRequestDirect(fbb, "j", "key", 1, 16, &metas).Union();
  } else {
    body = wire::CreateJobCreateDirect(fbb, "new", "h", &metas).Union();
  }
  wire::FinishEnvelopeBuffer(fbb, wire::CreateEnvelope(fbb, version, 7, type, body));
  std::vector<std::string> frames;
  for (uint64_t n : nbytes) frames.push_back(Floats(std::vector<float>(n / 4, 0.5f)));
  return Message(fbb, frames);
}

std::string PeerMessage(const flatbuffers::FlatBufferBuilder& fbb,
                        const std::vector<std::string>& frames = {}) {
  return Message(fbb, frames, Layout::kPeer);
}

// Site beta's round `round` of fuzz_peer's job "j" ("a" [4, 8], "b" [3]) under `pipeline`.
std::vector<std::pair<std::string, std::string>> Encoded(const std::string& pipeline) {
  auto p = codec::ParsePipeline(pipeline).value();
  std::vector<float> a(32), b{0.25f, -0.5f, 0.125f};
  for (size_t i = 0; i < a.size(); ++i) a[i] = std::cos(0.3f * static_cast<float>(i)) * 0.1f;
  const std::vector<int64_t> sa{4, 8}, sb{3};
  return {{"a", codec::Encode(p, a, sa)}, {"b", codec::Encode(p, b, sb)}};
}

// The packed layout senders write: sizes in name order, the bytes inline in the header.
std::string PackedDelta(const std::string& site, uint64_t round, const std::string& pipeline,
                        uint32_t version = kSchemaVersion, bool with_acks = false) {
  std::string sizes, bytes;
  for (const auto& [name, enc] : Encoded(pipeline)) {
    PutVarint(&sizes, enc.size());
    bytes += enc;
  }
  flatbuffers::FlatBufferBuilder fbb;
  std::vector<wire::PeerHeld> acks{{9, 1, 2000}};
  auto body = wire::CreatePeerDelta(
      fbb, fbb.CreateString("j"), site.empty() ? 0 : fbb.CreateString(site), round, 500, 0, 0,
      fbb.CreateVector(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()), 500,
      with_acks ? fbb.CreateVectorOfStructs(acks) : 0,
      fbb.CreateVector(reinterpret_cast<const uint8_t*>(sizes.data()), sizes.size()));
  wire::FinishEnvelopeBuffer(
      fbb, wire::CreateEnvelope(fbb, version, 11, wire::Body::PeerDelta, body.Union()));
  return PeerMessage(fbb);
}

// The listed layout: one PeerTensor and payload frame per tensor.
std::string ListedDelta(uint64_t round) {
  flatbuffers::FlatBufferBuilder fbb;
  std::vector<flatbuffers::Offset<wire::PeerTensor>> metas;
  std::vector<std::string> frames;
  const std::vector<std::vector<int64_t>> shapes{{4, 8}, {3}};
  uint32_t i = 0;
  for (const auto& [name, enc] : Encoded("int8")) {
    metas.push_back(wire::CreatePeerTensorDirect(fbb, name.c_str(), &shapes[i], i, enc.size()));
    frames.push_back(enc);
    ++i;
  }
  FinishEnvelope(fbb, 12, wire::Body::PeerDelta,
                 wire::CreatePeerDelta(fbb, fbb.CreateString("j"), fbb.CreateString("beta"), round,
                                       500, fbb.CreateVector(metas))
                     .Union());
  return PeerMessage(fbb, frames);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
    return 2;
  }
  const fs::path root = argv[1];
  const int64_t p31 = int64_t{1} << 31, p61 = int64_t{1} << 61, p62 = int64_t{1} << 62;
  std::vector<std::pair<std::string, std::string>> msgs = {
      {"push", Tensors(wire::Body::PushRequest, {{"a", {4, 8}}, {"b", {3}}}, {128, 12})},
      {"push-v999", Tensors(wire::Body::PushRequest, {{"b", {3}}}, {12}, 999)},
      {"create", Tensors(wire::Body::JobCreate, {{"w", {2, 2}}}, {16})},
      {"create-wrap-2p62", Tensors(wire::Body::JobCreate, {{"w", {p62}}}, {0})},
      {"create-wrap-2p31x2p31", Tensors(wire::Body::JobCreate, {{"w", {p31, p31}}}, {0})},
      {"create-wrap-2p61x2", Tensors(wire::Body::JobCreate, {{"w", {p61, 2}}}, {0})},
      {"push-wrap-2p62", Tensors(wire::Body::PushRequest, {{"a", {p62}}}, {0})},
  };
  {
    flatbuffers::FlatBufferBuilder fbb;
    FinishEnvelope(fbb, 3, wire::Body::PullRequest,
                   wire::CreatePullRequestDirect(fbb, "j").Union());
    msgs.push_back({"pull", Message(fbb, {})});
  }
  {
    flatbuffers::FlatBufferBuilder fbb;
    FinishEnvelope(fbb, 4, wire::Body::Hello,
                   wire::CreateHelloDirect(fbb, "j", wire::Role::Worker, "h", "fuzz").Union());
    msgs.push_back({"hello", Message(fbb, {})});
  }
  {
    // A push of "a" in parts, and its first part (64 of its 128 bytes).
    flatbuffers::FlatBufferBuilder fbb;
    const std::vector<int64_t> shape{4, 8};
    const std::vector<uint32_t> streamed{0};
    std::vector<flatbuffers::Offset<wire::TensorMeta>> metas{
        wire::CreateTensorMetaDirect(fbb, "a", &shape, wire::DType::F32, 0, 128, 0)};
    FinishEnvelope(
        fbb, 6, wire::Body::PushRequest,
        wire::CreatePushRequestDirect(fbb, "j", "parts", 1, 16, &metas, 0, &streamed).Union());
    msgs.push_back({"push-in-parts", Message(fbb, {})});
    flatbuffers::FlatBufferBuilder part;
    FinishEnvelope(part, 7, wire::Body::PushPart,
                   wire::CreatePushPartDirect(part, "j", "parts", 0, 0).Union());
    msgs.push_back({"push-part", Message(part, {std::string(64, '\0')})});
  }
  {
    flatbuffers::FlatBufferBuilder fbb;
    FinishEnvelope(fbb, 5, wire::Body::JobDescribe,
                   wire::CreateJobDescribeDirect(fbb, "j").Union());
    msgs.push_back({"describe", Message(fbb, {})});
  }
  for (const auto& [name, bytes] : msgs) {
    Write(root / "wire" / name, bytes);
    Write(root / "shard" / ("worker-" + name), std::string(1, '\0') + bytes);
    Write(root / "shard" / ("admin-" + name), std::string(1, '\1') + bytes);
  }

  // Peer messages: a handshake, a ping, and beta's round-1 delta in both layouts and
  // several codecs, with acks, claiming another site, of another schema version, round 0.
  {
    flatbuffers::FlatBufferBuilder fbb;
    std::vector<flatbuffers::Offset<wire::PeerJob>> jobs{
        wire::CreatePeerJobDirect(fbb, "j", "", 0)};
    FinishEnvelope(fbb, 10, wire::Body::PeerHello,
                   wire::CreatePeerHelloDirect(fbb, "beta", 0, &jobs).Union());
    Write(root / "peer" / "hello", PeerMessage(fbb));
  }
  {
    flatbuffers::FlatBufferBuilder fbb;
    FinishEnvelope(fbb, 13, wire::Body::PeerPing, wire::CreatePeerPingDirect(fbb, "beta").Union());
    Write(root / "peer" / "ping", PeerMessage(fbb));
  }
  for (const char* text : {"topk:0.05+int2+zstd", "dense", "int8", "lowrank:2+int8"}) {
    std::string name = text;
    for (char& c : name) c = std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
    Write(root / "peer" / ("delta-" + name), PackedDelta("beta", 1, text));
  }
  Write(root / "peer" / "delta-round2-acks", PackedDelta("beta", 2, "int8", kSchemaVersion, true));
  Write(root / "peer" / "delta-listed", ListedDelta(1));
  Write(root / "peer" / "delta-other-site", PackedDelta("gamma", 1, "int8"));
  Write(root / "peer" / "delta-v999", PackedDelta("beta", 1, "int8", 999));
  Write(root / "peer" / "delta-round0", PackedDelta("beta", 0, "int8"));
  // Membership: beta's prepare of its own leave (alpha alone from round 1), a query, and a
  // prepare whose sites are out of order.
  for (auto [name, step, sites] :
       {std::tuple{"membership-prepare", wire::MembershipStepKind::Prepare,
                   std::vector<std::string>{"alpha"}},
        std::tuple{"membership-query", wire::MembershipStepKind::Query,
                   std::vector<std::string>{"alpha"}},
        std::tuple{"membership-unsorted", wire::MembershipStepKind::Prepare,
                   std::vector<std::string>{"beta", "alpha"}}}) {
    flatbuffers::FlatBufferBuilder fbb;
    std::vector<flatbuffers::Offset<flatbuffers::String>> names;
    for (const auto& n : sites) names.push_back(fbb.CreateString(n));
    auto next = wire::CreateMembershipState(fbb, 1, fbb.CreateVector(names), 1);
    FinishEnvelope(fbb, 14, wire::Body::PeerMembership,
                   wire::CreatePeerMembership(fbb, fbb.CreateString("beta"), fbb.CreateString("j"),
                                              step, next, fbb.CreateString("beta"))
                       .Union());
    Write(root / "peer" / name, PeerMessage(fbb));
  }

  // Codec: 2 bytes (element count - 1), then an encoding of that many values.
  std::vector<float> x(200);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.37f * static_cast<float>(i)) * 0.01f;
  const std::vector<int64_t> shape{10, 20};
  for (const char* text :
       {"dense", "int8", "int2+zstd", "topk:0.05+int2+zstd", "topk:0.1+int4", "lowrank:2+int8"}) {
    auto pipe = codec::ParsePipeline(text);
    if (!pipe.ok()) {
      std::fprintf(stderr, "pipeline %s: %s\n", text, pipe.status().ToString().c_str());
      return 1;
    }
    std::string seed = {static_cast<char>((x.size() - 1) & 0xff),
                        static_cast<char>((x.size() - 1) >> 8)};
    seed += codec::Encode(*pipe, x, shape);
    std::string name = text;
    for (char& c : name) c = std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
    Write(root / "codec" / name, seed);
  }

  // Safetensors: a valid file, a half-precision one, and the wrapping shape.
  const fs::path tmp = fs::temp_directory_path() / "isthmus-seed.safetensors";
  std::vector<Tensor> ts{{"wte.weight", {4, 2}, std::vector<float>(8, 0.25f)},
                         {"b", {3}, {1, 2, 3}}};
  if (!WriteSafetensors(tmp.string(), ts, {{"format", "pt"}, {"n_head", "2"}}).ok()) return 1;
  std::ifstream in(tmp, std::ios::binary);
  Write(root / "safetensors" / "valid", std::string((std::istreambuf_iterator<char>(in)), {}));
  fs::remove(tmp);
  auto raw = [](const std::string& header, const std::string& data) {
    std::string out(8, '\0');
    uint64_t n = header.size();
    for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    return out + header + data;
  };
  Write(root / "safetensors" / "bf16",
        raw(R"({"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}})", "\x80\x3f\x00\x40"));
  Write(root / "safetensors" / "wrap-2p62",
        raw(R"({"a":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,0]}})", ""));

  // Config: the example shard config and a synced one.
  Write(root / "config" / "plain",
        "[shard]\nid = \"s0\"\ndata_dir = \"/tmp/x\"\n[listen]\nworker = \"tcp://127.0.0.1:7100\"\n"
        "admin = \"tcp://127.0.0.1:7101\"\n[security]\ninsecure_plaintext = true\n");
  Write(root / "config" / "synced",
        "[shard]\nid = \"A-0\"\nindex = 0\ndata_dir = \"/tmp/x\"\n[listen]\npeer = "
        "\"tcp://127.0.0.1:7102\"\n[security]\ninsecure_plaintext = true\n[sync]\nsite = \"A\"\n"
        "peers = [\"B=tcp://127.0.0.1:7202=b.pub\"]\ncodec = \"topk:0.05+int2+zstd\"\n"
        "codec_overrides = [\"*.bias=dense\"]\nmax_rounds_ahead = 2\nouter_lr = 1.0\n");
  std::printf("wrote the seed corpora under %s\n", root.c_str());
  return 0;
}
