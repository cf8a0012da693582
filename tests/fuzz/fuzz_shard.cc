// Fuzz target: the worker- and admin-facing request handler (Shard::Handle) on an
// in-memory store holding job "j" (tensors "a" [4, 8] and "b" [3]). Input: the first byte
// picks the socket role, then the fuzz_wire.cc layout (header, then frames).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include <spdlog/spdlog.h>

#include "common/client.h"
#include "server/shard/shard.h"
#include "server/storage/store.h"

namespace {

isthmus::Frames ToFrames(const uint8_t* data, size_t size) {
  isthmus::Frames f;
  if (size < 2) return f;
  const size_t header_len = std::min<size_t>(size - 2, data[0] | (data[1] << 8));
  f.header = zmq::message_t(data + 2, header_len);
  size_t at = 2 + header_len;
  const size_t nframes = at < size ? data[at++] % 5 : 0;
  for (size_t i = 0; i < nframes && at < size; ++i) {
    const size_t len = std::min<size_t>(size - at - 1, data[at] * 4u);
    f.payload.emplace_back(data + at + 1, len);
    at += 1 + len;
  }
  return f;
}

isthmus::Shard& TheShard() {
  using namespace isthmus;
  static std::unique_ptr<Shard> shard = [] {
    spdlog::set_level(spdlog::level::off);  // a refusal per input would drown the run
    ShardOptions o;
    o.shard_id = "fuzz";
    o.open_store = []() -> Result<std::unique_ptr<Store>> { return NewMemStore(); };
    auto s = std::move(Shard::Open(o)).value();
    std::vector<float> a(32, 1.0f), b(3, 2.0f);
    flatbuffers::FlatBufferBuilder fbb;
    std::vector<TensorView> views{{"a", {4, 8}, a.data()}, {"b", {3}, b.data()}};
    auto metas = BuildTensorMetas(fbb, views);
    FinishEnvelope(
        fbb, 1, wire::Body::JobCreate,
        wire::CreateJobCreate(fbb, fbb.CreateString("j"), fbb.CreateString("h"), metas).Union());
    Frames f;
    f.header = zmq::message_t(fbb.GetBufferPointer(), fbb.GetSize());
    f.payload.emplace_back(a.data(), a.size() * 4);
    f.payload.emplace_back(b.data(), b.size() * 4);
    s->Handle(wire::Role::Admin, f);
    return s;
  }();
  return *shard;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace isthmus;
  if (size < 1) return 0;
  // Snapshots would write to disk: the fuzzer leaves them out of its reach.
  const wire::Role role = data[0] & 1 ? wire::Role::Admin : wire::Role::Worker;
  Frames f = ToFrames(data + 1, size - 1);
  if (f.header.size() >= 8) {
    auto env = ParseEnvelope(f.header, WireLimits{});
    if (env.ok()) {
      const auto t = (*env)->body_type();
      if (t == wire::Body::SnapshotCreate || t == wire::Body::SnapshotRestore) return 0;
    }
  }
  (void)TheShard().Handle(role, f);
  return 0;
}
