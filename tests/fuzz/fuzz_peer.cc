// Fuzz target: the peer message handler (PeerLinks::HandlePeerMessage) in front of a real
// sync engine on an in-memory store. Site "alpha" holds job "j" (tensors "a" [4, 8] and
// "b" [3]) and has closed round 1; its one peer is "beta". Membership prepares and queries
// reach the engine's membership rules too. The links run without CURVE,
// so a message names its site itself (under CURVE the key does; the checks after that
// are the same). A delta that passes every check is decoded and stored, and commits
// round 1; then the state is built afresh, so that later inputs meet the same state.
// Input: 2-byte header length, header, frame count (mod 5), then per frame a 2-byte
// length and its bytes.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include <spdlog/spdlog.h>

#include "common/client.h"
#include "server/shard/shard.h"
#include "server/storage/store.h"
#include "server/sync/peer_link.h"
#include "server/sync/sync_engine.h"

namespace {

using namespace isthmus;

Frames ToFrames(const uint8_t* data, size_t size) {
  Frames f;
  if (size < 2) return f;
  const size_t header_len = std::min<size_t>(size - 2, data[0] | (data[1] << 8));
  f.header = zmq::message_t(data + 2, header_len);
  size_t at = 2 + header_len;
  const size_t nframes = at < size ? data[at++] % 5 : 0;
  for (size_t i = 0; i < nframes && at + 2 <= size; ++i) {
    const size_t len = std::min<size_t>(size - at - 2, data[at] | (data[at + 1] << 8));
    f.payload.emplace_back(data + at + 2, len);
    at += 2 + len;
  }
  return f;
}

Reply Send(Shard& shard, wire::Role role, const flatbuffers::FlatBufferBuilder& fbb,
           const std::vector<std::vector<float>>& frames) {
  Frames f;
  f.header = zmq::message_t(fbb.GetBufferPointer(), fbb.GetSize());
  for (const auto& v : frames) f.payload.emplace_back(v.data(), v.size() * sizeof(float));
  return shard.Handle(role, f);
}

// Alpha's shard, its engine and its links, as a server wires them.
struct Site {
  zmq::context_t ctx{1};
  std::unique_ptr<Shard> shard;
  std::unique_ptr<PeerLinks> links;

  Site() {
    ShardOptions o;
    o.shard_id = "alpha-0";
    o.open_store = []() -> Result<std::unique_ptr<Store>> { return NewMemStore(); };
    SyncOptions so;
    so.site = "alpha";
    so.peer_sites = {"beta"};
    o.sync = so;
    shard = std::move(Shard::Open(o)).value();
    std::vector<std::vector<float>> init{std::vector<float>(32, 1.0f), std::vector<float>(3, 2.0f)};
    std::vector<TensorView> views{{"a", {4, 8}, init[0].data()}, {"b", {3}, init[1].data()}};
    {
      flatbuffers::FlatBufferBuilder fbb;
      auto metas = BuildTensorMetas(fbb, views);
      FinishEnvelope(
          fbb, 1, wire::Body::JobCreate,
          wire::CreateJobCreate(fbb, fbb.CreateString("j"), fbb.CreateString("h"), metas).Union());
      Send(*shard, wire::Role::Admin, fbb, init);
    }
    {
      std::vector<std::vector<float>> delta{std::vector<float>(32, 0.5f),
                                            std::vector<float>(3, -0.5f)};
      views = {{"a", {4, 8}, delta[0].data()}, {"b", {3}, delta[1].data()}};
      flatbuffers::FlatBufferBuilder fbb;
      auto metas = BuildTensorMetas(fbb, views);
      FinishEnvelope(
          fbb, 2, wire::Body::PushRequest,
          wire::CreatePushRequest(fbb, fbb.CreateString("j"), fbb.CreateString("r1"), 1, 100, metas)
              .Union());
      Send(*shard, wire::Role::Worker, fbb, delta);
    }
    PeerLinkOptions lo;
    lo.site = "alpha";
    lo.shard_index = 0;
    lo.insecure_plaintext = true;
    // No listener: alpha dials beta at an address nobody binds; only the handler runs.
    lo.peers = {{"beta", "inproc://isthmus-fuzz-peer-nowhere", "", {}, ""}};
    SyncEngine* engine = shard->sync();
    lo.initial_digest = [engine](const std::string& job) {
      auto d = engine->Digests(job, 0, 1);
      return d.ok() && !d->empty() ? d->front().second : std::string();
    };
    links = std::make_unique<PeerLinks>(ctx, lo, engine, engine);
    (void)links->Start();
  }
  ~Site() {
    links.reset();
    shard.reset();
  }
};

std::unique_ptr<Site>& TheSite() {
  static std::unique_ptr<Site> site = [] {
    spdlog::set_level(spdlog::level::off);  // a refusal per input would drown the run
    return std::make_unique<Site>();
  }();
  return site;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto& site = TheSite();
  Frames f = ToFrames(data, size);
  flatbuffers::FlatBufferBuilder reply;
  (void)site->links->HandlePeerMessage("", f, reply);
  // An accepted delta or membership change altered the state: start the next input afresh.
  auto st = site->shard->sync()->JobStatus("j");
  if (site->shard->sync()->HeldFrom("beta", "j") > 0 || !st.ok() || st->pending ||
      st->members.epoch > 0) {
    site = std::make_unique<Site>();
  }
  return 0;
}
