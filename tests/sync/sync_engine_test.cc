// The round protocol in one process: three sites' engines (each on its own RocksDB store in
// a temp folder) wired by direct calls, delivering outbox deltas in shuffled orders with
// duplicates, withholding a site, reopening stores between steps as a crash would, and
// feeding malformed or replayed deltas. Committed digests must agree on every site.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <memory>
#include <random>
#include <thread>

#include "common/tensor.h"
#include "ops/codec.h"
#include "server/storage/keys.h"
#include "server/sync/sync_engine.h"
#include "tests/server/test_util.h"

namespace isthmus {
namespace {

constexpr char kJob[] = "j";

struct Spec {
  std::string name;
  std::vector<int64_t> shape;
};
const std::vector<Spec> kTensors = {{"a.weight", {8, 16}}, {"b.bias", {16}}, {"c.lora_A", {4, 32}}};

std::vector<float> Random(size_t n, uint64_t seed, float scale) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

size_t Numel(const std::vector<int64_t>& s) { return static_cast<size_t>(NumElements(s)); }

// The worker's delta of `site` for round `r`, tensor index i (deterministic).
std::vector<float> DeltaOf(const std::string& site, uint64_t r, size_t i) {
  return Random(Numel(kTensors[i].shape), std::hash<std::string>{}(site)*131 + r * 17 + i, 0.01f);
}
uint64_t TokensOf(const std::string& site, uint64_t r) {
  return 100 * site.size() + 7 * r + site[0];
}

// Everything in a store, for "nothing changed" checks.
std::map<std::string, std::string> Dump(Store* store) {
  std::map<std::string, std::string> out;
  for (int c = 0; c < static_cast<int>(Column::kCount); ++c) {
    EXPECT_TRUE(store
                    ->Scan(static_cast<Column>(c), "",
                           [&](std::string_view k, std::string_view v) {
                             out[std::to_string(c) + ":" + std::string(k)] = std::string(v);
                             return true;
                           })
                    .ok());
  }
  return out;
}

class Site {
 public:
  Site(std::string name, std::vector<std::string> peers, const std::string& codec, double lr = 1.0,
       double mu = 0.0)
      : name_(std::move(name)) {
    options_.site = name_;
    options_.peer_sites = std::move(peers);
    options_.codec = codec;
    options_.outer_lr = lr;
    options_.outer_momentum = mu;
    // No link measures bandwidth here: rounds keep their codec until a test reports one
    // (OnLinkBandwidth) or sets a start figure itself.
    options_.adaptive_start_mbit = 0;
    Open(/*fresh=*/true);
  }

  void Open(bool fresh = false) {
    StoreOptions so;
    so.sync_writes = false;
    auto store = OpenRocksStore(dir_.str() + "/db", so);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    store_ = std::move(store).value();
    if (fresh) {
      WriteBatch b;
      std::vector<std::vector<float>> keep;
      for (size_t i = 0; i < kTensors.size(); ++i) {
        keep.push_back(Random(Numel(kTensors[i].shape), 1000 + i, 1.0f));  // same on all sites
      }
      for (size_t i = 0; i < kTensors.size(); ++i) {
        b.Put(Column::kTensors, keys::JobKey(kJob, kTensors[i].name),
              {reinterpret_cast<const char*>(keep[i].data()), keep[i].size() * 4});
        std::string shape;
        for (size_t d = 0; d < kTensors[i].shape.size(); ++d) {
          shape += (d ? "," : "") + std::to_string(kTensors[i].shape[d]);
        }
        b.PutOwned(Column::kTensorMeta, keys::JobKey(kJob, kTensors[i].name),
                   "{\"shape\":[" + shape + "],\"version\":1}");
      }
      ASSERT_TRUE(store_->Write(b).ok());
    }
    auto engine =
        SyncEngine::Create(wrap_store_ ? wrap_store_(store_.get()) : store_.get(), options_);
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    engine_ = std::move(engine).value();
    engine_->SetDeferRoundWork(defer_);
    auto tensors = SyncEngine::ReadTensors(store_.get(), kJob);
    ASSERT_TRUE(tensors.ok()) << tensors.status().ToString();
    ASSERT_TRUE(engine_->AttachJob(kJob, std::move(*tensors), 1).ok());
  }
  // Closes and reopens everything, as after a crash (writes are in RocksDB's WAL).
  void Reopen() {
    engine_.reset();
    store_.reset();
    Open();
  }

  // Pushes round r in one call (every tensor): the close runs from memory. With `keep`, the
  // deltas are handed over with a keepalive (as the shard server does), which the engine
  // may hold until a deferred close; the last one is kept in last_keep.
  Result<SyncPushResult> PushWholeRound(uint64_t r, bool keep = false) {
    auto deltas = std::make_shared<std::vector<std::vector<float>>>();
    std::vector<SyncPushTensor> ts;
    for (size_t i = 0; i < kTensors.size(); ++i) deltas->push_back(DeltaOf(name_, r, i));
    for (size_t i = 0; i < kTensors.size(); ++i)
      ts.push_back({kTensors[i].name, (*deltas)[i], kTensors[i].shape});
    WriteBatch b;
    if (keep) last_keep = deltas;
    return engine_->PushRound(kJob, r, TokensOf(name_, r), ts, b, 0,
                              keep ? std::shared_ptr<const void>(deltas) : nullptr);
  }
  std::weak_ptr<const void> last_keep;

  // Pushes round r as the workers would: tensor 0 alone, then the rest.
  Result<SyncPushResult> PushRound(uint64_t r, int part = -1, uint64_t compute_ms = 0) {
    std::vector<std::vector<float>> deltas;
    for (size_t i = 0; i < kTensors.size(); ++i) deltas.push_back(DeltaOf(name_, r, i));
    Result<SyncPushResult> last = SyncPushResult{};
    for (int p = 0; p < 2; ++p) {
      if (part >= 0 && p != part) continue;
      std::vector<SyncPushTensor> ts;
      for (size_t i = 0; i < kTensors.size(); ++i) {
        if ((i == 0) == (p == 0)) ts.push_back({kTensors[i].name, deltas[i], kTensors[i].shape});
      }
      WriteBatch b;
      last = engine_->PushRound(kJob, r, TokensOf(name_, r), ts, b, compute_ms);
      if (!last.ok()) return last;
    }
    return last;
  }

  std::vector<std::string> Digests() {
    auto d = engine_->Digests(kJob, 0, 1000);
    EXPECT_TRUE(d.ok());
    std::vector<std::string> out;
    for (auto& [r, h] : *d) {
      EXPECT_EQ(r, out.size());
      out.push_back(h);
    }
    return out;
  }

  SyncEngine& engine() { return *engine_; }
  Store* store() { return store_.get(); }
  const std::string& name() const { return name_; }
  SyncOptions& options() { return options_; }
  // Round work after replies (SyncEngine::SetDeferRoundWork); applies from the next Open.
  void set_defer(bool on) {
    defer_ = on;
    engine_->SetDeferRoundWork(on);
  }
  // What the engine writes through, given the store (fault injection); from the next Open.
  void set_store_wrapper(std::function<Store*(Store*)> wrap) { wrap_store_ = std::move(wrap); }

 private:
  bool defer_ = false;
  std::function<Store*(Store*)> wrap_store_;
  std::string name_;
  SyncOptions options_;
  testing::TempDir dir_;
  std::unique_ptr<Store> store_;
  std::unique_ptr<SyncEngine> engine_;
};

// Sends every outbox round of `from` above what `to` holds; acks back. Returns rounds sent.
int Deliver(Site& from, Site& to, bool twice = false) {
  int sent = 0;
  uint64_t held = to.engine().HeldFrom(from.name(), kJob);
  for (uint64_t r = held + 1; r <= from.engine().OutboxHighRound(kJob); ++r) {
    auto d = from.engine().OutboxDelta(kJob, r);
    EXPECT_TRUE(d.ok()) << d.status().ToString();
    if (!d.ok()) return sent;
    for (int k = 0; k < (twice ? 2 : 1); ++k) {
      auto ack = to.engine().ReceiveDelta(from.name(), **d);
      EXPECT_TRUE(ack.ok()) << ack.status().ToString();
      if (ack.ok()) from.engine().OnPeerAck(to.name(), kJob, *ack);
    }
    ++sent;
  }
  return sent;
}

// The committed tensors as the store holds them, as the engine holds them, and how many
// round deltas the store keeps (the checkpoint tests).
std::map<std::string, std::vector<float>> Floats(const std::map<std::string, SyncTensor>& t) {
  std::map<std::string, std::vector<float>> out;
  for (const auto& [name, v] : t) out[name] = *v.data;
  return out;
}
std::map<std::string, std::vector<float>> StoredTensors(Site& s) {
  auto t = SyncEngine::ReadTensors(s.store(), kJob);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? Floats(*t) : std::map<std::string, std::vector<float>>{};
}
std::map<std::string, std::vector<float>> CommittedTensors(Site& s) {
  auto t = s.engine().Committed(kJob);
  EXPECT_TRUE(t.ok());
  return t.ok() ? Floats(*t) : std::map<std::string, std::vector<float>>{};
}
// Round r pushed whole by every site and exchanged within each pair: every site commits it.
void CommitInPairs(uint64_t r, const std::vector<std::pair<Site*, Site*>>& pairs) {
  for (auto [x, y] : pairs) {
    for (Site* s : {x, y}) ASSERT_TRUE(s->PushWholeRound(r).ok()) << s->name();
  }
  for (auto [x, y] : pairs) {
    Deliver(*x, *y);
    Deliver(*y, *x);
  }
  for (auto [x, y] : pairs) {
    for (Site* s : {x, y}) ASSERT_EQ(s->engine().CommittedRound(kJob), r) << s->name();
  }
}
int DeltasHeld(Site& s) {
  int n = 0;
  EXPECT_TRUE(s.store()
                  ->ScanKeys(Column::kDeltas, keys::JobPrefix(kJob),
                             [&](std::string_view) {
                               ++n;
                               return true;
                             })
                  .ok());
  return n;
}

std::vector<std::unique_ptr<Site>> ThreeSites(const std::string& codec, double lr = 1.0,
                                              double mu = 0.0) {
  std::vector<std::string> names = {"siteA", "siteB", "siteC"};
  std::vector<std::unique_ptr<Site>> sites;
  for (const auto& n : names) {
    std::vector<std::string> peers;
    for (const auto& p : names) {
      if (p != n) peers.push_back(p);
    }
    sites.push_back(std::make_unique<Site>(n, peers, codec, lr, mu));
  }
  return sites;
}

// theta0 + sum over rounds of the token-weighted merge (lr 1, momentum 0, lossless codec),
// in the engine's order: sites by name, then element order.
std::map<std::string, std::vector<float>> Reference(const std::vector<std::string>& sites,
                                                    uint64_t rounds) {
  std::map<std::string, std::vector<float>> theta;
  for (size_t i = 0; i < kTensors.size(); ++i) {
    theta[kTensors[i].name] = Random(Numel(kTensors[i].shape), 1000 + i, 1.0f);
  }
  for (uint64_t r = 1; r <= rounds; ++r) {
    uint64_t total = 0;
    for (const auto& s : sites) total += TokensOf(s, r);
    for (size_t i = 0; i < kTensors.size(); ++i) {
      std::vector<float> merged(Numel(kTensors[i].shape), 0.0f);
      for (const auto& s : sites) {
        float w =
            static_cast<float>(static_cast<double>(TokensOf(s, r)) / static_cast<double>(total));
        auto d = DeltaOf(s, r, i);
        for (size_t k = 0; k < merged.size(); ++k) merged[k] += w * d[k];
      }
      auto& th = theta[kTensors[i].name];
      for (size_t k = 0; k < th.size(); ++k) th[k] += 1.0f * merged[k];
    }
  }
  return theta;
}

void ExpectCommittedEquals(Site& site, const std::map<std::string, std::vector<float>>& want) {
  auto got = site.engine().Committed(kJob);
  ASSERT_TRUE(got.ok());
  for (const auto& [name, v] : want) {
    ASSERT_EQ(*got->at(name).data, v) << site.name() << " tensor " << name;
  }
}

TEST(SyncEngineTest, ThreeSitesCommitIdenticalDigestsEveryRound) {
  auto sites = ThreeSites("", /*lr=*/0.7, /*mu=*/0.9);  // the codec's default pipeline
  std::mt19937 rng(7);
  for (uint64_t r = 1; r <= 5; ++r) {
    for (auto& s : sites) ASSERT_TRUE(s->PushRound(r).ok());
    std::vector<std::pair<int, int>> pairs;
    for (int a = 0; a < 3; ++a) {
      for (int b = 0; b < 3; ++b) {
        if (a != b) pairs.emplace_back(a, b);
      }
    }
    std::shuffle(pairs.begin(), pairs.end(), rng);
    for (auto [a, b] : pairs) Deliver(*sites[a], *sites[b], /*twice=*/r % 2 == 1);
    for (auto& s : sites) ASSERT_EQ(s->engine().CommittedRound(kJob), r) << s->name();
    auto d0 = sites[0]->Digests();
    ASSERT_EQ(d0.size(), r + 1);
    EXPECT_EQ(sites[1]->Digests(), d0);
    EXPECT_EQ(sites[2]->Digests(), d0);
    EXPECT_NE(d0[r], d0[r - 1]);
    // Every peer acknowledged round r and it committed: the outbox keeps it for
    // sync.replay_rounds (4) more commits, for workers that pull by replay, then drops it.
    EXPECT_TRUE(sites[0]->engine().OutboxDelta(kJob, r).ok());
    if (r > 4) {
      EXPECT_EQ(sites[0]->engine().OutboxDelta(kJob, r - 4).status().code(), Code::kNotFound);
    }
  }
  auto st = sites[0]->engine().JobStatus(kJob);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->committed_round, 5u);
  EXPECT_EQ(st->held.at("siteC"), 5u);
  EXPECT_EQ(st->acked.at("siteB"), 5u);
  EXPECT_GT(st->raw_bytes, 0u);
  EXPECT_GT(st->compression_ratio, 0.0);
  std::printf("default pipeline compression ratio on this synthetic delta: %.1fx (%s)\n",
              st->compression_ratio, st->pipelines.begin()->first.c_str());
}

TEST(SyncEngineTest, WithheldSiteConvergesWithNothingDoubled) {
  auto sites = ThreeSites("dense");
  auto& a = *sites[0];
  auto& b = *sites[1];
  auto& c = *sites[2];
  for (uint64_t r = 1; r <= 3; ++r) {
    for (auto& s : sites) ASSERT_TRUE(s->PushRound(r).ok());
    Deliver(a, b), Deliver(b, a), Deliver(a, c), Deliver(b, c);  // nothing from c
  }
  EXPECT_EQ(a.engine().CommittedRound(kJob), 0u);
  EXPECT_EQ(a.engine().LocalRound(kJob), 3u);
  EXPECT_EQ(c.engine().CommittedRound(kJob), 3u);  // c holds everyone's deltas
  // Round 4 pushed meanwhile, and c's outbox is delivered twice over.
  for (auto& s : sites) ASSERT_TRUE(s->PushRound(4).ok());
  EXPECT_EQ(Deliver(c, a, true), 4);
  EXPECT_EQ(Deliver(c, b, true), 4);
  Deliver(a, b), Deliver(b, a), Deliver(a, c), Deliver(b, c);
  auto want = Reference({"siteA", "siteB", "siteC"}, 4);
  for (auto& s : sites) {
    EXPECT_EQ(s->engine().CommittedRound(kJob), 4u);
    ExpectCommittedEquals(*s, want);
  }
  EXPECT_EQ(a.Digests(), c.Digests());
  EXPECT_EQ(b.Digests(), c.Digests());
  // Replays of everything: no change.
  auto before = Dump(a.store());
  for (uint64_t r = 1; r <= 4; ++r) {
    auto d = b.engine().OutboxDelta(kJob, r);
    if (d.ok()) {
      EXPECT_TRUE(a.engine().ReceiveDelta("siteB", **d).ok());
    }
  }
  EXPECT_EQ(Dump(a.store()), before);
}

TEST(SyncEngineTest, ReopenBetweenAnyTwoStepsLosesNothing) {
  auto sites = ThreeSites("dense");
  std::mt19937 rng(11);
  const uint64_t kRounds = 3;
  int steps = 0;
  for (uint64_t r = 1; r <= kRounds; ++r) {
    // Steps: each site's two half-pushes, then every (from, to) delivery, in random order
    // (a site's halves in order; deliveries after the pushes).
    std::vector<std::function<void()>> plan;
    for (auto& s : sites) {
      Site* p = s.get();
      plan.push_back([p, r] { ASSERT_TRUE(p->PushRound(r, 0).ok()); });
      plan.push_back([p, r] { ASSERT_TRUE(p->PushRound(r, 1).ok()); });
    }
    std::vector<std::function<void()>> deliveries;
    for (int x = 0; x < 3; ++x) {
      for (int y = 0; y < 3; ++y) {
        if (x != y) {
          Site* from = sites[x].get();
          Site* to = sites[y].get();
          deliveries.push_back([from, to] { Deliver(*from, *to, true); });
        }
      }
    }
    std::shuffle(deliveries.begin(), deliveries.end(), rng);
    plan.insert(plan.end(), deliveries.begin(), deliveries.end());
    for (auto& step : plan) {
      step();
      if (HasFatalFailure()) return;
      sites[rng() % 3]->Reopen();  // a crash of one shard
      ++steps;
    }
  }
  auto want = Reference({"siteA", "siteB", "siteC"}, kRounds);
  for (auto& s : sites) {
    s->Reopen();
    EXPECT_EQ(s->engine().CommittedRound(kJob), kRounds);
    ExpectCommittedEquals(*s, want);
  }
  EXPECT_EQ(sites[0]->Digests(), sites[1]->Digests());
  EXPECT_EQ(sites[0]->Digests(), sites[2]->Digests());
  EXPECT_GT(steps, 20);
}

TEST(SyncEngineTest, MalformedOrReplayedDeltaChangesNothing) {
  auto sites = ThreeSites("");
  auto& a = *sites[0];
  auto& b = *sites[1];
  for (auto& s : sites) ASSERT_TRUE(s->PushRound(1).ok());
  for (int x = 0; x < 3; ++x) {
    for (int y = 0; y < 3; ++y) {
      if (x != y) Deliver(*sites[x], *sites[y]);
    }
  }
  ASSERT_EQ(b.engine().CommittedRound(kJob), 1u);
  ASSERT_TRUE(a.PushRound(2).ok());
  auto good = a.engine().OutboxDelta(kJob, 2);
  ASSERT_TRUE(good.ok());
  const EncodedDelta& g = **good;
  auto before = Dump(b.store());
  const uint64_t version = b.engine().Version(kJob);
  auto expect_refused = [&](const std::string& from, EncodedDelta d, Code code) {
    auto r = b.engine().ReceiveDelta(from, d);
    EXPECT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), code) << r.status().ToString();
  };
  expect_refused("siteC", g, Code::kPermissionDenied);  // labelled siteA, sent by siteC
  EncodedDelta d = g;
  d.site = "siteZ";
  expect_refused("siteZ", d, Code::kPermissionDenied);  // not a configured peer
  d = g;
  d.job = "nope";
  expect_refused("siteA", d, Code::kNotFound);
  d = g;
  d.tensors.pop_back();
  expect_refused("siteA", d, Code::kInvalidArgument);  // missing tensor
  d = g;
  d.tensors.push_back(d.tensors[0]);
  expect_refused("siteA", d, Code::kInvalidArgument);  // one too many
  d = g;
  d.tensors[1] = d.tensors[0];
  expect_refused("siteA", d, Code::kInvalidArgument);  // repeated
  d = g;
  d.tensors[0].shape = {16, 8};
  expect_refused("siteA", d, Code::kInvalidArgument);  // wrong shape
  d = g;
  d.tensors[0].name = "zzz";
  expect_refused("siteA", d, Code::kInvalidArgument);
  d = g;
  d.tensors[2].bytes.resize(d.tensors[2].bytes.size() / 2);
  expect_refused("siteA", d, Code::kInvalidArgument);  // truncated bytes
  d = g;
  d.tensors[2].bytes[0] ^= 0x5a;
  expect_refused("siteA", d, Code::kInvalidArgument);  // bad header
  d = g;
  d.round = 0;
  expect_refused("siteA", d, Code::kInvalidArgument);
  d = g;
  d.round = 1000;
  expect_refused("siteA", d, Code::kFailedPrecondition);  // too far ahead
  // A replay of the committed round 1 (even with other contents) is ignored and acked.
  auto replay = sites[2]->engine().OutboxDelta(kJob, 1);
  EncodedDelta old = g;
  old.round = 1;
  auto ack = b.engine().ReceiveDelta("siteA", old);
  ASSERT_TRUE(ack.ok());
  EXPECT_EQ(*ack, 1u);
  EXPECT_EQ(Dump(b.store()), before);
  EXPECT_EQ(b.engine().Version(kJob), version);
  // The genuine delta is still accepted afterwards.
  auto ok = b.engine().ReceiveDelta("siteA", g);
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(*ok, 2u);
  EXPECT_GT(b.engine().Version(kJob), version);
}

TEST(SyncEngineTest, OptimisticViewAddsKnownUncommittedDeltas) {
  auto sites = ThreeSites("dense");
  auto& a = *sites[0];
  auto& b = *sites[1];
  auto theta0 = a.engine().Committed(kJob);
  ASSERT_TRUE(theta0.ok());
  const uint64_t v0 = a.engine().Version(kJob);
  ASSERT_TRUE(a.PushRound(1, 0).ok());
  EXPECT_EQ(a.engine().Version(kJob), v0);  // a half round changes nothing served
  ASSERT_TRUE(a.PushRound(1, 1).ok());
  const uint64_t v1 = a.engine().Version(kJob);
  EXPECT_GT(v1, v0);
  EXPECT_EQ(a.engine().LocalRound(kJob), 1u);
  EXPECT_EQ(a.engine().CommittedRound(kJob), 0u);
  auto view = a.engine().View(kJob);
  ASSERT_TRUE(view.ok());
  for (size_t i = 0; i < kTensors.size(); ++i) {
    auto want = *theta0->at(kTensors[i].name).data;
    auto d = DeltaOf("siteA", 1, i);
    for (size_t k = 0; k < want.size(); ++k) want[k] += 0.0f + 1.0f * d[k];
    EXPECT_EQ(*view->at(kTensors[i].name).data, want);
  }
  // b's round 1 arrives: the view is theta0 + the merge over {a, b}, weights renormalised.
  ASSERT_TRUE(b.PushRound(1).ok());
  Deliver(b, a);
  EXPECT_GT(a.engine().Version(kJob), v1);
  view = a.engine().View(kJob);
  ASSERT_TRUE(view.ok());
  const double total = TokensOf("siteA", 1) + TokensOf("siteB", 1);
  const float wa = static_cast<float>(TokensOf("siteA", 1) / total);
  const float wb = static_cast<float>(TokensOf("siteB", 1) / total);
  for (size_t i = 0; i < kTensors.size(); ++i) {
    auto want = *theta0->at(kTensors[i].name).data;
    auto da = DeltaOf("siteA", 1, i);
    auto db = DeltaOf("siteB", 1, i);
    for (size_t k = 0; k < want.size(); ++k) {
      float m = 0.0f;
      m += wa * da[k];
      m += wb * db[k];
      want[k] += m;
    }
    EXPECT_EQ(*view->at(kTensors[i].name).data, want);
  }
  // Committed state is untouched until every site's delta is held.
  EXPECT_EQ(*a.engine().Committed(kJob)->at("b.bias").data, *theta0->at("b.bias").data);
  // b's round 2 arrives before a has closed round 2 (a's workers are still training it):
  // the view leaves it out, so what a pulls does not depend on when a peer's delta lands.
  const std::map<std::string, SyncTensor> before = *view;
  ASSERT_TRUE(b.PushRound(2).ok());
  Deliver(b, a);
  EXPECT_EQ(b.engine().LocalRound(kJob), 2u);
  view = a.engine().View(kJob);
  ASSERT_TRUE(view.ok());
  for (const auto& t : kTensors) EXPECT_EQ(*view->at(t.name).data, *before.at(t.name).data);
  // Once a closes round 2 the view takes b's round-2 delta as well.
  ASSERT_TRUE(a.PushRound(2).ok());
  view = a.engine().View(kJob);
  ASSERT_TRUE(view.ok());
  EXPECT_NE(*view->at("b.bias").data, *before.at("b.bias").data);
}

TEST(SyncEngineTest, NoPeerModeEqualsPlainAdd) {
  Site solo("solo", {}, "topk:0.01+int2+zstd");  // ignored: nothing crosses a link
  auto theta0 = solo.engine().Committed(kJob);
  ASSERT_TRUE(theta0.ok());
  for (uint64_t r = 1; r <= 3; ++r) {
    auto res = solo.PushRound(r);
    ASSERT_TRUE(res.ok()) << res.status().ToString();
    EXPECT_TRUE(res->closed);
    EXPECT_EQ(solo.engine().CommittedRound(kJob), r);
    EXPECT_EQ(solo.engine().LocalRound(kJob), r);
  }
  for (size_t i = 0; i < kTensors.size(); ++i) {
    auto want = *theta0->at(kTensors[i].name).data;
    for (uint64_t r = 1; r <= 3; ++r) {
      auto d = DeltaOf("solo", r, i);
      for (size_t k = 0; k < want.size(); ++k) want[k] += d[k];
    }
    EXPECT_EQ(*solo.engine().Committed(kJob)->at(kTensors[i].name).data, want);
    EXPECT_EQ(*solo.engine().View(kJob)->at(kTensors[i].name).data, want);
  }
  // Round-less adds are allowed without peers.
  std::vector<float> one(16, 1.0f);
  WriteBatch batch;
  auto v = solo.engine().AddNow(kJob, {{"b.bias", one, {16}}}, batch);
  ASSERT_TRUE(v.ok());
  solo.Reopen();
  EXPECT_EQ(solo.engine().CommittedRound(kJob), 3u);
  EXPECT_EQ(solo.engine().Version(kJob), *v);
  // ...and refused with peers.
  Site paired("siteA", {"siteB"}, "dense");
  WriteBatch b2;
  EXPECT_EQ(paired.engine().AddNow(kJob, {{"b.bias", one, {16}}}, b2).status().code(),
            Code::kFailedPrecondition);
}

// Two sites A and B on fresh stores (dense codec, the given outer optimiser), each with the
// job attached holding one tensor "w" = w0: for tests that check the outer step by hand.
struct HandPair {
  testing::TempDir da, db;
  double lr = 1.0, mu = 0.0;
  std::vector<std::unique_ptr<Store>> stores;
  std::vector<std::unique_ptr<SyncEngine>> engines;

  SyncOptions Options(const char* site, const char* peer) const {
    SyncOptions o;
    o.site = site;
    o.peer_sites = {peer};
    o.codec = "dense";
    o.outer_lr = lr;
    o.outer_momentum = mu;
    return o;
  }
  void Open(double outer_lr, double outer_momentum, const std::vector<float>& w0) {
    lr = outer_lr;
    mu = outer_momentum;
    for (auto [dir, site, peer] : {std::tuple{&da, "A", "B"}, std::tuple{&db, "B", "A"}}) {
      stores.push_back(std::move(OpenRocksStore(dir->str(), StoreOptions{})).value());
      engines.push_back(
          std::move(SyncEngine::Create(stores.back().get(), Options(site, peer))).value());
      std::map<std::string, SyncTensor> t;
      t["w"] = {{static_cast<int64_t>(w0.size())}, std::make_shared<const std::vector<float>>(w0)};
      // The job's rows, as the shard writes them when it creates the job.
      WriteBatch b;
      b.Put(Column::kTensors, keys::JobKey(kJob, "w"),
            {reinterpret_cast<const char*>(w0.data()), w0.size() * sizeof(float)});
      b.PutOwned(Column::kTensorMeta, keys::JobKey(kJob, "w"),
                 "{\"shape\":[" + std::to_string(w0.size()) + "],\"version\":1}");
      ASSERT_TRUE(stores.back()->Write(b).ok());
      ASSERT_TRUE(engines.back()->AttachJob(kJob, t, 1).ok());
    }
  }
};

// The view takes each uncommitted round's outer step with the deltas held so far. When
// the missing site's delta turns out equal to the held one, the commit lands exactly where
// the view was; under Nesterov momentum the raw delta would be far from it.
TEST(SyncEngineTest, OptimisticViewTakesTheOuterStepTheCommitWillTake) {
  HandPair pair;
  pair.Open(0.7, 0.9, {1, 2, 3});
  if (HasFatalFailure()) return;
  auto& engines = pair.engines;
  auto push = [&](int e, uint64_t r, std::vector<float> v) {
    WriteBatch b;
    ASSERT_TRUE(
        engines[e]->PushRound(kJob, r, 100, {{"w", v, {static_cast<int64_t>(v.size())}}}, b).ok());
  };
  auto deliver = [&](int from, int to, uint64_t r) {
    auto x = engines[from]->OutboxDelta(kJob, r);
    ASSERT_TRUE(x.ok());
    ASSERT_TRUE(engines[to]->ReceiveDelta(from == 0 ? "A" : "B", **x).ok());
  };
  // Round 1 commits on both: momentum is now non-zero.
  push(0, 1, {0.5f, -0.25f, 1.0f});
  push(1, 1, {0.25f, 0.5f, -1.0f});
  deliver(0, 1, 1);
  deliver(1, 0, 1);
  ASSERT_EQ(engines[0]->CommittedRound(kJob), 1u);
  const std::vector<float> theta1 = *engines[0]->Committed(kJob)->at("w").data;
  // Rounds 2 and 3 from A only: A's view steps twice with A's deltas.
  const std::vector<float> d2 = {0.125f, 0.0625f, -0.5f}, d3 = {-0.25f, 0.125f, 0.25f};
  push(0, 2, d2);
  push(0, 3, d3);
  const std::vector<float> view = *engines[0]->View(kJob)->at("w").data;
  // By hand: m1 = g1, then m2 = 0.9 m1 + d2, theta2 = theta1 + 0.7 (d2 + 0.9 m2), ...
  const std::vector<float> g1 = {0.375f, 0.125f, 0.0f};
  for (size_t i = 0; i < 3; ++i) {
    const float m2 = 0.9f * g1[i] + d2[i];
    const float t2 = theta1[i] + 0.7f * (d2[i] + 0.9f * m2);
    const float m3 = 0.9f * m2 + d3[i];
    const float t3 = t2 + 0.7f * (d3[i] + 0.9f * m3);
    EXPECT_NEAR(view[i], t3, 1e-6) << i;
    EXPECT_GT(std::fabs(view[i] - (theta1[i] + d2[i] + d3[i])), 0.05f) << i;  // raw deltas
  }
  // B sends the same deltas: both rounds commit where A's view was.
  push(1, 2, d2);
  push(1, 3, d3);
  deliver(1, 0, 2);
  deliver(1, 0, 3);
  ASSERT_EQ(engines[0]->CommittedRound(kJob), 3u);
  const auto committed = *engines[0]->Committed(kJob)->at("w").data;
  for (size_t i = 0; i < 3; ++i) EXPECT_NEAR(committed[i], view[i], 1e-6) << i;
}

TEST(SyncEngineTest, NesterovMatchesHandComputation) {
  // Two sites, one 2-element tensor: g1 = 0.25 * [1, 0] + 0.75 * [3, 4] = [2.5, 3].
  // lr 0.5, mu 0.9:  m1 = g1;  theta1 = [1, 2] + 0.5 * (g1 + 0.9 * m1) = [3.375, 4.85].
  // Round 2, zero deltas: m2 = 0.9 * m1 = [2.25, 2.7]; theta2 = theta1 + 0.5 * 0.9 * m2
  // = [4.3875, 6.065].
  HandPair pair;
  pair.Open(0.5, 0.9, {1.0f, 2.0f});
  if (HasFatalFailure()) return;
  auto& stores = pair.stores;
  auto& engines = pair.engines;
  auto push = [&](int e, uint64_t r, std::vector<float> v, uint64_t tokens) {
    WriteBatch b;
    ASSERT_TRUE(engines[e]
                    ->PushRound(kJob, r, tokens, {{"w", v, {static_cast<int64_t>(v.size())}}}, b)
                    .ok());
  };
  auto exchange = [&](uint64_t r) {
    auto x = engines[0]->OutboxDelta(kJob, r);
    auto y = engines[1]->OutboxDelta(kJob, r);
    ASSERT_TRUE(x.ok() && y.ok());
    ASSERT_TRUE(engines[1]->ReceiveDelta("A", **x).ok());
    ASSERT_TRUE(engines[0]->ReceiveDelta("B", **y).ok());
  };
  push(0, 1, {1, 0}, 1);
  push(1, 1, {3, 4}, 3);
  exchange(1);
  for (auto& e : engines) {
    auto t = *e->Committed(kJob)->at("w").data;
    EXPECT_NEAR(t[0], 3.375, 1e-6);
    EXPECT_NEAR(t[1], 4.85, 1e-6);
  }
  push(0, 2, {0, 0}, 1);
  push(1, 2, {0, 0}, 1);
  exchange(2);
  for (auto& e : engines) {
    auto t = *e->Committed(kJob)->at("w").data;
    EXPECT_NEAR(t[0], 4.3875, 1e-5);
    EXPECT_NEAR(t[1], 6.065, 1e-5);
    EXPECT_EQ(e->CommittedRound(kJob), 2u);
  }
  EXPECT_EQ(*engines[0]->Digests(kJob, 0, 10), *engines[1]->Digests(kJob, 0, 10));
  // Momentum survives a restart: reopen A and commit round 3 (zero deltas) on both.
  engines[0].reset();
  stores[0].reset();
  stores[0] = std::move(OpenRocksStore(pair.da.str(), StoreOptions{})).value();
  engines[0] = std::move(SyncEngine::Create(stores[0].get(), pair.Options("A", "B"))).value();
  ASSERT_TRUE(engines[0]->AttachJob(kJob, *SyncEngine::ReadTensors(stores[0].get(), kJob), 1).ok());
  push(0, 3, {0, 0}, 1);
  push(1, 3, {0, 0}, 1);
  exchange(3);
  EXPECT_EQ(*engines[0]->Digests(kJob, 0, 10), *engines[1]->Digests(kJob, 0, 10));
  EXPECT_EQ(engines[0]->Digests(kJob, 0, 10)->size(), 4u);
}

TEST(SyncEngineTest, ARoundPushedInOneCallClosesLikeAStagedOne) {
  // siteA pushes each round in one call (closed from memory), siteB in two (staged on
  // disk first); the committed state is the reference either way, and survives a reopen.
  Site a("siteA", {"siteB"}, "dense"), b("siteB", {"siteA"}, "dense");
  for (uint64_t r = 1; r <= 3; ++r) {
    auto pa = a.PushWholeRound(r);
    ASSERT_TRUE(pa.ok()) << pa.status().ToString();
    EXPECT_TRUE(pa->closed);
    ASSERT_TRUE(b.PushRound(r).ok());
    a.Reopen();
    Deliver(a, b), Deliver(b, a);
  }
  EXPECT_EQ(a.Digests(), b.Digests());
  ExpectCommittedEquals(a, Reference({"siteA", "siteB"}, 3));
  // A replayed whole-round push is a duplicate and changes nothing.
  auto again = a.PushWholeRound(3);
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->duplicate);
  EXPECT_EQ(a.engine().CommittedRound(kJob), 3u);
}

// Deferred round work (the shard server's mode): a push that completes its round is
// answered once the round is staged durably, and the close and commits run afterwards, in
// RunDeferred. siteA defers and hands its deltas over with a keepalive (closed from that
// memory), siteB defers without (closed from the staged copies read back), siteC works
// inline: with the default codec, an outer learning rate and Nesterov momentum, every
// round's digest is the same on all three.
TEST(SyncEngineTest, DeferredRoundWorkCommitsTheSameDigestsAsInline) {
  auto sites = ThreeSites("", /*lr=*/0.7, /*mu=*/0.9);
  auto& a = *sites[0];
  auto& b = *sites[1];
  a.set_defer(true);
  b.set_defer(true);
  for (uint64_t r = 1; r <= 4; ++r) {
    auto pa = a.PushWholeRound(r, /*keep=*/true);
    ASSERT_TRUE(pa.ok()) << pa.status().ToString();
    EXPECT_TRUE(pa->close_pending);
    EXPECT_FALSE(pa->closed);
    // Durable and answered, not closed: workers are told the round is pushed.
    EXPECT_EQ(a.engine().LocalRound(kJob), r - 1);
    EXPECT_EQ(a.engine().PushedRound(kJob), r);
    EXPECT_TRUE(a.engine().HasDeferred());
    EXPECT_FALSE(a.last_keep.expired()) << "the pushed deltas are held until the close";
    ASSERT_TRUE(b.PushRound(r).ok());  // two pushes, the second completes the round
    EXPECT_EQ(b.engine().LocalRound(kJob), r - 1);
    ASSERT_TRUE(sites[2]->PushRound(r).ok());
    EXPECT_EQ(sites[2]->engine().LocalRound(kJob), r);
    ASSERT_TRUE(a.engine().RunDeferred().ok());
    ASSERT_TRUE(b.engine().RunDeferred().ok());
    EXPECT_EQ(a.engine().LocalRound(kJob), r);
    EXPECT_FALSE(a.engine().HasDeferred());
    EXPECT_TRUE(a.last_keep.expired()) << "the close let the pushed deltas go";
    for (int from = 0; from < 3; ++from) {
      for (int to = 0; to < 3; ++to) {
        if (from != to) Deliver(*sites[from], *sites[to]);
      }
    }
    // Received deltas are held at once; the commit they allow is deferred work too.
    EXPECT_EQ(a.engine().CommittedRound(kJob), r - 1);
    EXPECT_TRUE(a.engine().HasDeferred());
    ASSERT_TRUE(a.engine().RunDeferred().ok());
    ASSERT_TRUE(b.engine().RunDeferred().ok());
    for (auto& s : sites) ASSERT_EQ(s->engine().CommittedRound(kJob), r) << s->name();
    auto d = sites[2]->Digests();
    EXPECT_EQ(a.Digests(), d);
    EXPECT_EQ(b.Digests(), d);
    // a's pushes came with their deltas in memory: each close encoded while the stage was
    // written; b's second push had no keepalive, so b encoded in the close.
    EXPECT_EQ(a.engine().EarlyEncodes(), r);
    EXPECT_EQ(b.engine().EarlyEncodes(), 0u);
  }
}

// A crash after the acknowledgement and before the deferred close loses nothing: the
// restarted engine closes the durable stage (AttachJob), and the outbox holds exactly the
// bytes an inline twin (same site, same pushes) produced.
TEST(SyncEngineTest, CrashBetweenAcknowledgedPushAndDeferredCloseLosesNothing) {
  Site a("siteA", {"siteB"}, "topk:0.25+int8+zstd"),
      twin("siteA", {"siteB"}, "topk:0.25+int8+zstd");
  a.set_defer(true);
  for (uint64_t r = 1; r <= 3; ++r) {
    // Round 2 comes in two pushes (staged), the others in one.
    auto pushed = r == 2 ? a.PushRound(r) : a.PushWholeRound(r, /*keep=*/true);
    ASSERT_TRUE(pushed.ok()) << pushed.status().ToString();
    EXPECT_TRUE(pushed->close_pending);
    ASSERT_TRUE((r == 2 ? twin.PushRound(r) : twin.PushWholeRound(r)).ok());
    a.Reopen();  // the crash: the close never ran
    a.set_defer(true);
    EXPECT_EQ(a.engine().LocalRound(kJob), r) << "the restart closes the acknowledged round";
    EXPECT_FALSE(a.engine().HasDeferred());
    auto mine = a.engine().OutboxDelta(kJob, r);
    auto theirs = twin.engine().OutboxDelta(kJob, r);
    ASSERT_TRUE(mine.ok() && theirs.ok());
    EXPECT_EQ(EncodeDelta(**mine), EncodeDelta(**theirs)) << "round " << r;
    // A retried push of the acknowledged round is a duplicate.
    auto again = a.PushWholeRound(r);
    ASSERT_TRUE(again.ok());
    EXPECT_TRUE(again->duplicate);
  }
}

// sync.encode_threads changes who encodes which tensor, never the bytes: one site closing
// its rounds on one thread and its twin (same name, same pushes) on four hold the same
// outbox, round after round (the residuals they carry agree too, or later rounds would not).
TEST(SyncEngineTest, EncodeThreadsDoNotChangeTheOutbox) {
  Site one("siteA", {"siteB"}, ""), four("siteA", {"siteB"}, "");
  one.options().encode_threads = 1;
  four.options().encode_threads = 4;
  one.Reopen();
  four.Reopen();
  for (uint64_t r = 1; r <= 4; ++r) {
    ASSERT_TRUE(one.PushWholeRound(r).ok());
    ASSERT_TRUE(four.PushRound(r).ok());
    auto a = one.engine().OutboxDelta(kJob, r);
    auto b = four.engine().OutboxDelta(kJob, r);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(EncodeDelta(**a), EncodeDelta(**b)) << "round " << r;
  }
}

// A Store that forwards to another and fails writes while told to (fault injection).
class FlakyStore : public Store {
 public:
  explicit FlakyStore(Store* inner) : inner_(inner) {}
  Status Write(const WriteBatch& batch) override {
    if (fail_) return Status::ResourceExhausted("injected: disk full");
    return inner_->Write(batch);
  }
  Result<std::optional<std::string>> Get(Column c, std::string_view key) override {
    return inner_->Get(c, key);
  }
  Status Scan(Column c, std::string_view prefix,
              const std::function<bool(std::string_view, std::string_view)>& fn) override {
    return inner_->Scan(c, prefix, fn);
  }
  Status Checkpoint(const std::string& dir) override { return inner_->Checkpoint(dir); }
  uint64_t ApproximateBytes() override { return inner_->ApproximateBytes(); }
  bool fail_ = false;

 private:
  Store* inner_;
};

// Deferred work that fails (the disk is full when the close writes) keeps the round staged
// and acknowledged, is retried after a backoff, and a push of the next round closes it
// first rather than being refused as skipping ahead.
TEST(SyncEngineTest, FailedDeferredCloseIsRetriedAndOrdersTheNextPush) {
  auto now =
      std::make_shared<std::chrono::steady_clock::time_point>(std::chrono::steady_clock::now());
  std::unique_ptr<FlakyStore> flaky;
  Site a("siteA", {"siteB"}, "dense"), b("siteB", {"siteA"}, "dense");
  a.options().now = [now] { return *now; };
  a.set_store_wrapper([&](Store* inner) {
    flaky = std::make_unique<FlakyStore>(inner);
    return flaky.get();
  });
  a.Reopen();
  a.set_defer(true);
  auto p1 = a.PushWholeRound(1, /*keep=*/true);
  ASSERT_TRUE(p1.ok()) << p1.status().ToString();
  flaky->fail_ = true;
  EXPECT_EQ(a.engine().RunDeferred().code(), Code::kResourceExhausted);
  EXPECT_EQ(a.engine().LocalRound(kJob), 0u);
  EXPECT_EQ(a.engine().PushedRound(kJob), 1u);
  EXPECT_TRUE(a.engine().HasDeferred());
  EXPECT_EQ(a.engine().DeferredRetryMs(), 1000);
  EXPECT_TRUE(a.engine().RunDeferred().ok()) << "nothing is tried before the backoff";
  *now += std::chrono::milliseconds(1000);
  EXPECT_EQ(a.engine().DeferredRetryMs(), 0);
  EXPECT_EQ(a.engine().RunDeferred().code(), Code::kResourceExhausted);
  EXPECT_EQ(a.engine().DeferredRetryMs(), 2000) << "the backoff doubles";
  // The next round's push needs round 1 closed: it tries, and fails as the close does.
  EXPECT_EQ(a.PushWholeRound(2, true).status().code(), Code::kResourceExhausted);
  flaky->fail_ = false;
  auto p2 = a.PushWholeRound(2, /*keep=*/true);
  ASSERT_TRUE(p2.ok()) << p2.status().ToString();
  EXPECT_EQ(a.engine().LocalRound(kJob), 1u);
  EXPECT_EQ(a.engine().PushedRound(kJob), 2u);
  ASSERT_TRUE(a.engine().RunDeferred().ok());
  EXPECT_FALSE(a.engine().HasDeferred());
  EXPECT_EQ(a.engine().DeferredRetryMs(), -1);
  for (uint64_t r = 1; r <= 2; ++r) ASSERT_TRUE(b.PushRound(r).ok());
  Deliver(a, b), Deliver(b, a);
  ASSERT_TRUE(a.engine().RunDeferred().ok());
  EXPECT_EQ(a.engine().CommittedRound(kJob), 2u);
  EXPECT_EQ(a.Digests(), b.Digests());
  ExpectCommittedEquals(a, Reference({"siteA", "siteB"}, 2));
}

// Deferred work that fails with an error-feedback codec: neither a failed close (its new
// residuals were computed, its batch refused) nor a failed commit leaves a trace in memory,
// so the retried close writes the bytes an inline twin (same site, same pushes) wrote and
// the retried commit the digests every site has. Each failure shows in JobStatus (the
// server's metrics) until the retry succeeds.
TEST(SyncEngineTest, FailedDeferredCloseAndCommitMatchAnInlineTwin) {
  auto now =
      std::make_shared<std::chrono::steady_clock::time_point>(std::chrono::steady_clock::now());
  std::unique_ptr<FlakyStore> flaky;
  const std::string codec = "topk:0.25+int8+zstd";
  Site a("siteA", {"siteB"}, codec, 0.7, 0.9), twin("siteA", {"siteB"}, codec, 0.7, 0.9),
      b("siteB", {"siteA"}, codec, 0.7, 0.9);
  a.options().now = [now] { return *now; };
  a.set_store_wrapper([&](Store* inner) {
    flaky = std::make_unique<FlakyStore>(inner);
    return flaky.get();
  });
  a.Reopen();
  a.set_defer(true);
  auto status = [&] {
    auto js = a.engine().JobStatus(kJob);
    EXPECT_TRUE(js.ok());
    return js.ok() ? *js : SyncJobStatus{};
  };
  uint64_t failures = 0;
  for (uint64_t r = 1; r <= 3; ++r) {
    ASSERT_TRUE(a.PushWholeRound(r, /*keep=*/true).ok());
    ASSERT_TRUE(twin.PushWholeRound(r).ok());
    ASSERT_TRUE(b.PushRound(r).ok());
    // The close fails, then succeeds.
    flaky->fail_ = true;
    EXPECT_EQ(a.engine().RunDeferred().code(), Code::kResourceExhausted);
    EXPECT_EQ(status().round_work_failures, ++failures);
    EXPECT_TRUE(status().round_work_pending);
    EXPECT_NE(status().round_work_error.find("disk full"), std::string::npos);
    flaky->fail_ = false;
    *now += std::chrono::milliseconds(a.engine().DeferredRetryMs());
    ASSERT_TRUE(a.engine().RunDeferred().ok());
    EXPECT_FALSE(status().round_work_pending);
    EXPECT_EQ(status().round_work_error, "");
    ASSERT_EQ(a.engine().LocalRound(kJob), r);
    auto mine = a.engine().OutboxDelta(kJob, r);
    auto theirs = twin.engine().OutboxDelta(kJob, r);
    ASSERT_TRUE(mine.ok() && theirs.ok());
    EXPECT_EQ(EncodeDelta(**mine), EncodeDelta(**theirs)) << "round " << r;
    // The commit fails, then succeeds.
    Deliver(a, b);
    {  // twin is siteA too: it takes siteB's delta without acknowledging it for siteA
      auto d = b.engine().OutboxDelta(kJob, r);
      ASSERT_TRUE(d.ok()) << d.status().ToString();
      ASSERT_TRUE(twin.engine().ReceiveDelta("siteB", **d).ok());
    }
    Deliver(b, a);
    flaky->fail_ = true;
    EXPECT_EQ(a.engine().RunDeferred().code(), Code::kResourceExhausted);
    EXPECT_EQ(a.engine().CommittedRound(kJob), r - 1);
    EXPECT_EQ(status().round_work_failures, ++failures);
    flaky->fail_ = false;
    *now += std::chrono::milliseconds(a.engine().DeferredRetryMs());
    ASSERT_TRUE(a.engine().RunDeferred().ok());
    ASSERT_EQ(a.engine().CommittedRound(kJob), r);
    EXPECT_EQ(a.Digests(), twin.Digests());
    EXPECT_EQ(a.Digests(), b.Digests());
  }
}

TEST(SyncEngineTest, FragmentsAreLargestFirstIntoTheLeastLoadedGroup) {
  auto f = AssignFragments({{"a.weight", 128}, {"b.bias", 16}, {"c.lora_A", 128}, {"d", 100}}, 2);
  EXPECT_EQ(f.at("a.weight"), 0u);
  EXPECT_EQ(f.at("c.lora_A"), 1u);
  EXPECT_EQ(f.at("d"), 0u);  // 128 vs 128: the lower group
  EXPECT_EQ(f.at("b.bias"), 1u);
  auto one = AssignFragments({{"x", 5}, {"y", 7}}, 1);
  EXPECT_EQ(one.at("x"), 0u);
  EXPECT_EQ(one.at("y"), 0u);
}

TEST(SyncEngineTest, StreamedFragmentsCrossOnTheirRoundsWithTheDeferredDeltas) {
  // Two fragments: {a.weight, b.bias} on odd rounds, {c.lora_A} on even ones.
  for (double mu : {0.0, 0.9}) {
    Site a("siteA", {"siteB"}, "dense", 1.0, mu), b("siteB", {"siteA"}, "dense", 1.0, mu);
    for (Site* s : {&a, &b}) {
      s->options().fragments = 2;
      s->Reopen();
    }
    auto committed = [&](Site& s, const std::string& t) {
      return *s.engine().Committed(kJob)->at(t).data;
    };
    const auto c0 = committed(a, "c.lora_A");
    const auto a0 = committed(a, "a.weight");
    ASSERT_TRUE(a.PushRound(1).ok());
    ASSERT_TRUE(b.PushRound(1).ok());
    // Round 1 sends fragment 0 only: c.lora_A is a deferred (header-only) encoding.
    auto out = a.engine().OutboxDelta(kJob, 1);
    ASSERT_TRUE(out.ok());
    for (const auto& t : (*out)->tensors) {
      EXPECT_EQ(codec::IsDeferred(t.bytes), t.name == "c.lora_A") << t.name;
      if (t.name == "c.lora_A") {
        EXPECT_LT(t.bytes.size(), 10u);
      }
    }
    Deliver(a, b), Deliver(b, a);
    EXPECT_EQ(committed(a, "c.lora_A"), c0) << "deferred tensor moved, mu " << mu;
    EXPECT_NE(committed(a, "a.weight"), a0);
    const auto a1 = committed(a, "a.weight");
    ASSERT_TRUE(a.PushRound(2).ok());
    ASSERT_TRUE(b.PushRound(2).ok());
    Deliver(a, b), Deliver(b, a);
    EXPECT_EQ(committed(a, "a.weight"), a1) << "mu " << mu;  // fragment 0 waits in round 2
    const auto c2 = committed(a, "c.lora_A");
    if (mu == 0.0) {
      // Round 2 carries c's deltas of rounds 1 and 2 (dense: exactly), weighted by round 2.
      std::vector<float> want = c0;
      const uint64_t total = TokensOf("siteA", 2) + TokensOf("siteB", 2);
      std::vector<float> merged(want.size(), 0.0f);
      for (const std::string site : {"siteA", "siteB"}) {
        const float w =
            static_cast<float>(static_cast<double>(TokensOf(site, 2)) / static_cast<double>(total));
        auto d1 = DeltaOf(site, 1, 2), d2 = DeltaOf(site, 2, 2);
        for (size_t k = 0; k < merged.size(); ++k) merged[k] += w * (d2[k] + d1[k]);
      }
      for (size_t k = 0; k < want.size(); ++k) want[k] += 1.0f * merged[k];
      EXPECT_EQ(c2, want);
    }
    // Round 3: fragment 0 again; c.lora_A stays put, its momentum too.
    ASSERT_TRUE(a.PushRound(3).ok());
    ASSERT_TRUE(b.PushRound(3).ok());
    Deliver(a, b), Deliver(b, a);
    EXPECT_EQ(committed(a, "c.lora_A"), c2) << "mu " << mu;
    EXPECT_EQ(a.Digests(), b.Digests());
    EXPECT_EQ(a.engine().CommittedRound(kJob), 3u);
  }
}

TEST(SyncEngineTest, PushRules) {
  Site a("siteA", {"siteB"}, "dense");
  a.options().hard_cap_rounds = 2;
  a.Reopen();
  EXPECT_EQ(a.PushRound(2).status().code(), Code::kFailedPrecondition);  // skips round 1
  ASSERT_TRUE(a.PushRound(1, 0).ok());
  EXPECT_EQ(a.PushRound(1, 0).status().code(), Code::kFailedPrecondition);  // tensor twice
  ASSERT_TRUE(a.PushRound(1, 1).ok());
  auto dup = a.PushRound(1);
  ASSERT_TRUE(dup.ok());
  EXPECT_TRUE(dup->duplicate);
  WriteBatch b;
  std::vector<float> wrong(3);
  EXPECT_EQ(a.engine().PushRound(kJob, 2, 1, {{"nope", wrong, {3}}}, b).status().code(),
            Code::kNotFound);
  EXPECT_EQ(a.engine().PushRound(kJob, 2, 1, {{"b.bias", wrong, {3}}}, b).status().code(),
            Code::kInvalidArgument);
  std::vector<float> nan(16, std::nanf(""));
  EXPECT_EQ(a.engine().PushRound(kJob, 2, 1, {{"b.bias", nan, {16}}}, b).status().code(),
            Code::kInvalidArgument);
  ASSERT_TRUE(a.PushRound(2).ok());
  auto over = a.PushRound(3);
  EXPECT_EQ(over.status().code(), Code::kFailedPrecondition);
  EXPECT_NE(over.status().message().find("hard cap"), std::string::npos);
}

TEST(SyncEngineTest, AdaptiveSizesToTheSlowestLink) {
  Site a("siteA", {"siteB", "siteC"}, "int8+zstd");
  auto now = std::chrono::steady_clock::time_point{};
  a.options().adaptive = true;
  a.options().adaptive_floor = "topk:0.001+int2+zstd";
  a.options().adaptive_ceiling = "dense";
  a.options().now = [&now] { return now; };
  a.Reopen();
  ASSERT_TRUE(a.PushRound(1).ok());  // no measurement yet: the configured pipeline
  EXPECT_EQ(a.engine().JobStatus(kJob)->pipelines.begin()->first, "int8+zstd");
  now += std::chrono::seconds(10);
  a.engine().OnLinkBandwidth("siteB", 1e9);
  a.engine().OnLinkBandwidth("siteC", 1e9);
  ASSERT_TRUE(a.PushRound(2).ok());  // first duration is measured at this close
  now += std::chrono::seconds(10);
  const uint64_t before3 = a.engine().JobStatus(kJob)->bytes_encoded;
  ASSERT_TRUE(a.PushRound(3).ok());  // fast links, 10 s rounds: the finest allowed
  EXPECT_EQ(a.engine().JobStatus(kJob)->pipelines.begin()->first, "dense");
  const uint64_t after3 = a.engine().JobStatus(kJob)->bytes_encoded;
  now += std::chrono::seconds(10);
  a.engine().OnLinkBandwidth("siteC", 2.0);  // 2 B/s towards siteC
  ASSERT_TRUE(a.PushRound(4).ok());
  auto st = a.engine().JobStatus(kJob);
  EXPECT_EQ(st->pipelines.begin()->first, "topk:0.001+int2+zstd");  // floor: nothing fits
  EXPECT_LT(st->bytes_encoded - after3, (after3 - before3) / 4);
}

// The pipelines a worker that encodes its own deltas asks for (RoundPipelines, answered to
// a Hello right before it encodes) are sized from the compute time of the last push, before
// that round closes: a slow link and a reported compute time give the next round a coarser
// rung than the configured pipeline. A compute time given with the question sizes the
// round as well, the first one included (with the link counted at adaptive_start_mbit).
TEST(SyncEngineTest, RoundPipelinesAreSizedFromTheLastPushsComputeTime) {
  Site a("siteA", {"siteB"}, "int8+zstd");
  a.options().adaptive = true;
  a.options().adaptive_start_mbit = 1e-4;  // 12.5 B/s
  a.Reopen();
  auto pipes = a.engine().RoundPipelines(kJob, 1);
  ASSERT_TRUE(pipes.ok());
  EXPECT_EQ(pipes->at("a.weight"), "int8+zstd");  // no round time known yet
  pipes = a.engine().RoundPipelines(kJob, 1, /*compute_ms=*/1000);
  ASSERT_TRUE(pipes.ok());
  for (const auto& [name, pipe] : *pipes) EXPECT_EQ(pipe, "topk:0.001+int2+zstd") << name;
  a.engine().OnLinkBandwidth("siteB", 1e9);
  pipes = a.engine().RoundPipelines(kJob, 1, 1000);
  ASSERT_TRUE(pipes.ok());
  EXPECT_EQ(pipes->at("a.weight"), "int8+zstd") << "a measured fast link";
  a.engine().OnLinkBandwidth("siteB", 20.0);                          // 20 B/s
  ASSERT_TRUE(a.PushRound(1, /*part=*/0, /*compute_ms=*/1000).ok());  // tensor 0 staged only
  pipes = a.engine().RoundPipelines(kJob, 2);
  ASSERT_TRUE(pipes.ok());
  for (const auto& [name, pipe] : *pipes) EXPECT_EQ(pipe, "topk:0.001+int2+zstd") << name;
  EXPECT_EQ(a.engine().RoundPipelines(kJob, 0).status().code(), Code::kInvalidArgument);
}

// A peer's link that has not been measured yet counts at sync.adaptive_start_mbit: a first
// round too large for that goes coarser (here to the floor), one that fits keeps the codec,
// and 0 keeps the codec until the link is measured.
TEST(SyncEngineTest, AnUnmeasuredLinkCountsAtTheStartBandwidth) {
  for (double mbit : {1e-4, 1e3, 0.0}) {  // 12.5 B/s, 125 MB/s, none
    Site a("siteA", {"siteB"}, "int8+zstd");
    ASSERT_TRUE(a.options().adaptive);
    a.options().adaptive_start_mbit = mbit;
    a.Reopen();
    ASSERT_TRUE(a.PushRound(1, -1, /*compute_ms=*/1000).ok());
    auto st = a.engine().JobStatus(kJob);
    ASSERT_TRUE(st.ok());
    ASSERT_EQ(st->pipelines.size(), 1u) << mbit;
    EXPECT_EQ(st->pipelines.begin()->first, mbit == 1e-4 ? "topk:0.001+int2+zstd" : "int8+zstd")
        << mbit;
    // Measured, the link's own figure counts.
    a.engine().OnLinkBandwidth("siteB", 1e9);
    ASSERT_TRUE(a.PushRound(2, -1, 1000).ok());
    st = a.engine().JobStatus(kJob);
    EXPECT_EQ(st->pipelines.count("int8+zstd"), 1u) << mbit;
  }
}

// The start figure is the site's uplink, which the delta crosses once per member peer:
// with two peers each unmeasured link counts at half of it.
TEST(SyncEngineTest, UnmeasuredLinksShareTheStartBandwidth) {
  // Rounds of 1 s at the default share.
  auto first_pipelines = [](std::vector<std::string> peers, double mbit) {
    Site a("siteA", std::move(peers), "int8+zstd");
    a.options().adaptive_start_mbit = mbit;
    a.Reopen();
    EXPECT_TRUE(a.PushRound(1, -1, /*compute_ms=*/1000).ok());
    auto st = a.engine().JobStatus(kJob);
    EXPECT_TRUE(st.ok());
    return st->pipelines;
  };
  // Find a start figure at which one peer keeps int8+zstd and two peers' half does not.
  double fits = 0;
  for (double mbit = 0.002; mbit < 1.0 && fits == 0; mbit *= 1.25) {
    if (first_pipelines({"siteB"}, mbit).count("int8+zstd") == 1 &&
        first_pipelines({"siteB"}, mbit / 2).count("int8+zstd") == 0) {
      fits = mbit;
    }
  }
  ASSERT_GT(fits, 0) << "no start figure where int8+zstd just fits one link";
  EXPECT_EQ(first_pipelines({"siteB", "siteC"}, fits).count("int8+zstd"), 0u)
      << "two peers at " << fits << " Mbit/s: each link counts at half";
  EXPECT_EQ(first_pipelines({"siteB", "siteC"}, 2 * fits).count("int8+zstd"), 1u);
}

// sync.adaptive_share is the share of the round's compute time one round's transfer may
// take: a link that carries the fp32 round in 0.8 of the round keeps int8+zstd at the
// default share, and at a share of 0.2 (a budget of a quarter of fp32: int8's bytes plus its
// header and scale do not fit) goes coarser.
TEST(SyncEngineTest, AdaptiveShareIsTheShareOfTheRoundTheTransferMayTake) {
  uint64_t raw = 0;  // fp32 bytes of one round
  for (const auto& t : kTensors) raw += 4 * NumElements(t.shape);
  for (double share : {0.8, 0.2}) {
    Site a("siteA", {"siteB"}, "int8+zstd");
    a.options().adaptive = true;
    a.options().adaptive_share = share;
    a.Reopen();
    a.engine().OnLinkBandwidth("siteB", static_cast<double>(raw) / 0.8);
    ASSERT_TRUE(a.PushRound(1, /*part=*/0, /*compute_ms=*/1000).ok());
    auto pipes = a.engine().RoundPipelines(kJob, 2);
    ASSERT_TRUE(pipes.ok());
    for (const auto& [name, pipe] : *pipes) {
      if (share == 0.8) {
        EXPECT_EQ(pipe, "int8+zstd") << name;
      } else {
        EXPECT_NE(pipe, "int8+zstd") << name;
      }
    }
  }
}

// The defaults: adaptive on, no ceiling, the floor the ladder's coarsest. A round uses the
// configured codec while it fits (never a finer rung, even on a fast link) and the rung
// coarser than it that fits when it does not.
TEST(SyncEngineTest, AdaptiveByDefaultKeepsTheCodecWhileItFits) {
  Site a("siteA", {"siteB"}, std::string(codec::kDefaultPipeline));
  auto now = std::chrono::steady_clock::time_point{};
  ASSERT_TRUE(a.options().adaptive);
  ASSERT_TRUE(a.options().adaptive_ceiling.empty());
  a.options().now = [&now] { return now; };
  a.Reopen();
  uint64_t raw = 0;  // fp32 bytes of one round
  for (const auto& t : kTensors) raw += 4 * NumElements(t.shape);
  a.engine().OnLinkBandwidth("siteB", 1e9);
  ASSERT_TRUE(a.PushRound(1, -1, 1000).ok());
  now += std::chrono::seconds(1);
  const uint64_t before2 = a.engine().JobStatus(kJob)->bytes_encoded;
  ASSERT_TRUE(a.PushRound(2, -1, 1000).ok());  // a fast link: still the codec, not dense
  auto st = a.engine().JobStatus(kJob);
  const uint64_t codec_bytes = st->bytes_encoded - before2;
  ASSERT_EQ(st->pipelines.size(), 1u);
  EXPECT_EQ(st->pipelines.begin()->first, "int2:256+zstd");
  // A link that carries a twentieth of a dense round in the round's compute time: the
  // 2.1-bit codec (1/15 of dense) does not fit, a sparser rung does.
  a.engine().OnLinkBandwidth("siteB", static_cast<double>(raw) / 20 / 0.8);
  now += std::chrono::seconds(1);
  const uint64_t before = a.engine().JobStatus(kJob)->bytes_encoded;
  ASSERT_TRUE(a.PushRound(3, -1, 1000).ok());
  st = a.engine().JobStatus(kJob);
  EXPECT_EQ(st->pipelines.count("int2:256+zstd"), 0u);
  EXPECT_EQ(st->pipelines.count("dense"), 0u);
  EXPECT_LT(st->bytes_encoded - before, codec_bytes);
}

// Rounds 10 s apart because the workers waited for the WAN, but only 0.25 s of compute
// each: with the compute time reported, the round's transfer is sized to fit 0.25 s, not
// the 10 s that include the wait.
TEST(SyncEngineTest, AdaptiveBudgetIsTheReportedComputeTimeNotTheWait) {
  Site a("siteA", {"siteB"}, "int8+zstd");
  auto now = std::chrono::steady_clock::time_point{};
  a.options().adaptive = true;
  a.options().adaptive_floor = "topk:0.01+int2+zstd";
  a.options().adaptive_ceiling = "dense";
  a.options().now = [&now] { return now; };
  a.Reopen();
  uint64_t raw = 0;  // fp32 bytes of one round
  for (const auto& t : kTensors) raw += 4 * NumElements(t.shape);
  a.engine().OnLinkBandwidth("siteB", static_cast<double>(raw));  // one dense round per second
  auto round_bytes = [&](uint64_t r, uint64_t compute_ms) {
    const uint64_t before = a.engine().JobStatus(kJob)->bytes_encoded;
    EXPECT_TRUE(a.PushRound(r, -1, compute_ms).ok());
    return a.engine().JobStatus(kJob)->bytes_encoded - before;
  };
  round_bytes(1, 0);  // no round duration known yet
  now += std::chrono::seconds(10);
  round_bytes(2, 0);  // 10 s between closes measured here
  now += std::chrono::seconds(10);
  EXPECT_GE(round_bytes(3, 0), raw);  // budget 8 dense rounds: dense for every tensor
  auto dense = a.engine().JobStatus(kJob)->pipelines;
  ASSERT_EQ(dense.size(), 1u);
  EXPECT_EQ(dense.begin()->first, "dense");
  now += std::chrono::seconds(10);
  const uint64_t sized = round_bytes(4, 250);  // budget 0.2 of a dense round
  auto st = a.engine().JobStatus(kJob);
  EXPECT_EQ(st->pipelines.count("dense"), 0u);
  EXPECT_LT(sized, raw / 2) << "pipelines of round 4: " << st->pipelines.begin()->first;
}

// Site D, about to join: its own store and engine (the Site helper's sync settings), no
// job yet, the job's tensors taken as they are installed.
struct JoiningSiteD {
  explicit JoiningSiteD(std::vector<std::string> peers) {
    store = std::move(OpenRocksStore(dir.str(), StoreOptions{})).value();
    SyncOptions o;
    o.site = "siteD";
    o.peer_sites = std::move(peers);
    o.codec = "dense";
    o.outer_lr = 1.0;
    o.outer_momentum = 0.0;
    engine = std::move(SyncEngine::Create(store.get(), o)).value();
    SyncEngine::JobHooks hooks;
    hooks.install = [](const std::string&, const std::string&,
                       const std::map<std::string, SyncTensor>&, uint64_t,
                       WriteBatch&) { return Status::Ok(); };
    engine->SetJobHooks(hooks);
  }
  testing::TempDir dir;
  std::unique_ptr<Store> store;
  std::unique_ptr<SyncEngine> engine;
};

// Sends `from`'s one membership request for `to`, which must be of `step`, and hands `from`
// the answer; returns it.
MembershipAnswer AskOnce(SyncEngine& from, const std::string& from_name, SyncEngine& to,
                         const std::string& to_name, MembershipStep step) {
  auto reqs = from.MembershipRequests(to_name);
  EXPECT_EQ(reqs.size(), 1u) << from_name << " -> " << to_name;
  if (reqs.empty()) return MembershipAnswer{};
  EXPECT_EQ(reqs[0].step, step) << from_name << " -> " << to_name;
  MembershipAnswer answer = to.OnMembershipRequest(from_name, reqs[0]);
  from.OnMembershipAnswer(to_name, reqs[0], answer);
  return answer;
}

// One exchange of every pending membership request between every pair of `sites`.
void ConverseAll(const std::map<std::string, SyncEngine*>& sites) {
  for (auto& [fname, from] : sites) {
    for (auto& [tname, to] : sites) {
      if (fname == tname) continue;
      for (const auto& req : from->MembershipRequests(tname)) {
        from->OnMembershipAnswer(tname, req, to->OnMembershipRequest(fname, req));
      }
    }
  }
}

// siteA and siteB commit round 1; siteB commits round 2 and siteA does not hold siteB's
// round 2 yet; then both list siteD as a peer.
void BAheadByARoundBothListingD(Site& a, Site& b) {
  for (Site* s : {&a, &b}) ASSERT_TRUE(s->PushRound(1).ok());
  Deliver(a, b), Deliver(b, a);
  for (Site* s : {&a, &b}) ASSERT_TRUE(s->PushRound(2).ok());
  Deliver(a, b);
  ASSERT_EQ(b.engine().CommittedRound(kJob), 2u);
  ASSERT_EQ(a.engine().CommittedRound(kJob), 1u);
  for (Site* s : {&a, &b}) {
    s->options().peer_sites.push_back("siteD");
    s->Reopen();
  }
}

// A join given up after the coordinator sent the state: site D holds siteA's state and
// waits for the members' digests, but siteB refused the addition (it does not list D), so
// siteB never answers D. D must learn the outcome from its coordinator, not wait for ever
// (seen under load: the refusal reached siteA just after D's fetch).
TEST(SyncEngineTest, AJoinGivenUpAfterTheStateWasSentFailsAtTheJoiningSite) {
  Site a("siteA", {"siteB", "siteC"}, "dense"), b("siteB", {"siteA", "siteC"}, "dense"),
      c("siteC", {"siteA", "siteB"}, "dense");
  for (Site* s : {&a, &b, &c}) ASSERT_TRUE(s->PushRound(1).ok());
  for (Site* from : {&a, &b, &c})
    for (Site* to : {&a, &b, &c})
      if (from != to) Deliver(*from, *to);
  ASSERT_EQ(a.engine().CommittedRound(kJob), 1u);
  // siteA now lists D as a peer (its operator added it before the join); B and C do not.
  a.options().peer_sites = {"siteB", "siteC", "siteD"};
  a.Reopen();
  JoiningSiteD joining({"siteA", "siteB", "siteC"});
  SyncEngine* d = joining.engine.get();
  ASSERT_TRUE(d->membership().StartJoin(kJob, "siteA").ok());
  ASSERT_TRUE(a.engine().membership().Invite(kJob, "siteD", std::chrono::hours(1)).ok());
  // D asks A; A proposes the addition and sends D its prepare; D fetches A's state.
  EXPECT_EQ(AskOnce(*d, "siteD", a.engine(), "siteA", MembershipStep::kJoin).vote,
            MembershipVote::kPending);
  EXPECT_EQ(AskOnce(a.engine(), "siteA", *d, "siteD", MembershipStep::kPrepare).vote,
            MembershipVote::kPending);
  auto fetched = AskOnce(*d, "siteD", a.engine(), "siteA", MembershipStep::kFetch);
  ASSERT_EQ(fetched.vote, MembershipVote::kPrepared);
  ASSERT_TRUE(fetched.image != nullptr);
  EXPECT_NE(d->JobStatus(kJob)->change_note.find("checking the state"), std::string::npos);
  // Now siteB refuses the addition and siteA gives it up.
  EXPECT_EQ(AskOnce(a.engine(), "siteA", b.engine(), "siteB", MembershipStep::kPrepare).vote,
            MembershipVote::kRefused);
  EXPECT_FALSE(a.engine().JobStatus(kJob)->pending.has_value());
  // D, which siteB will never answer, asks its coordinator: given up. D asks again (a
  // coordinator may give an addition up because the rounds moved on), and is told why this
  // one was given up: the join fails with the reason.
  EXPECT_EQ(AskOnce(*d, "siteD", a.engine(), "siteA", MembershipStep::kQuery).vote,
            MembershipVote::kAbandoned);
  EXPECT_NE(d->JobStatus(kJob)->change_note.find("asking it again"), std::string::npos);
  EXPECT_EQ(AskOnce(*d, "siteD", a.engine(), "siteA", MembershipStep::kJoin).vote,
            MembershipVote::kRefused);
  const std::string note = d->JobStatus(kJob)->change_note;
  EXPECT_NE(note.find("join failed"), std::string::npos) << note;
  EXPECT_NE(note.find("has no sync.peers entry"), std::string::npos) << note;
  EXPECT_TRUE(d->MembershipRequests("siteA").empty());
  EXPECT_TRUE(d->MembershipRequests("siteB").empty());
}

// Sends `from`'s membership requests for `to` and hands back the answers; returns them.
std::vector<MembershipAnswer> Converse(Site& from, Site& to) {
  std::vector<MembershipAnswer> answers;
  for (const auto& req : from.engine().MembershipRequests(to.name())) {
    answers.push_back(to.engine().OnMembershipRequest(from.name(), req));
    from.engine().OnMembershipAnswer(to.name(), req, answers.back());
  }
  return answers;
}

// The silence policy judged a slow site dead (seen under ThreadSanitizer and load: siteB's
// round-2 delta reached siteC but not yet siteA). Its proposal must neither hold commits nor
// be made again from a stale round: siteC, which committed round 2 with siteB's delta,
// refuses; siteA then takes siteC's state (the survivors' highest committed round) and would
// propose only from there. A proposal waiting for a silent site's vote is given up, and so is
// an automatic removal of a site heard from again.
TEST(SyncEngineTest, SilencePolicyNeverHoldsCommitsOnAStaleOrHopelessProposal) {
  auto sites = ThreeSites("dense");
  Site &a = *sites[0], &b = *sites[1], &c = *sites[2];
  for (auto& s : sites) ASSERT_TRUE(s->PushRound(1).ok());
  for (auto& from : sites)
    for (auto& to : sites)
      if (from != to) Deliver(*from, *to);
  for (auto& s : sites) ASSERT_TRUE(s->PushRound(2).ok());
  Deliver(a, c), Deliver(b, c), Deliver(c, a), Deliver(a, b), Deliver(c, b);  // b -> a is slow
  ASSERT_EQ(c.engine().CommittedRound(kJob), 2u);
  ASSERT_EQ(a.engine().CommittedRound(kJob), 1u);

  auto proposed = a.engine().membership().ProposeSilentRemoval(kJob, {"siteB"});
  ASSERT_TRUE(proposed.ok() && *proposed) << proposed.status().ToString();
  auto refused = Converse(a, c);
  ASSERT_EQ(refused.size(), 1u);
  EXPECT_EQ(refused[0].vote, MembershipVote::kRefused);
  EXPECT_EQ(refused[0].committed, 2u);
  auto st = a.engine().JobStatus(kJob);
  EXPECT_FALSE(st->pending.has_value()) << st->change_note;
  EXPECT_TRUE(st->catching_up) << st->change_note;
  // Still behind siteC: the policy waits instead of proposing again from round 2.
  auto again = a.engine().membership().ProposeSilentRemoval(kJob, {"siteB"});
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(*again);
  EXPECT_NE(a.engine().JobStatus(kJob)->change_note.find("before this site has committed round 2"),
            std::string::npos)
      << a.engine().JobStatus(kJob)->change_note;
  // The catch-up brings siteA to round 2 with siteC's state, digests equal; siteB's late delta
  // is then a harmless duplicate.
  Converse(a, c);
  EXPECT_EQ(a.engine().CommittedRound(kJob), 2u);
  EXPECT_EQ(a.Digests(), c.Digests());
  EXPECT_EQ(Deliver(b, a), 0);
  ASSERT_TRUE(b.engine().CommittedRound(kJob) == 2u);

  // A removal that needs the vote of a site that has gone silent itself is given up.
  proposed = a.engine().membership().ProposeSilentRemoval(kJob, {"siteB"});
  ASSERT_TRUE(proposed.ok() && *proposed) << proposed.status().ToString();
  ASSERT_TRUE(a.engine().JobStatus(kJob)->pending.has_value());
  ASSERT_TRUE(a.engine().membership().ProposeSilentRemoval(kJob, {"siteB", "siteC"}).ok());
  st = a.engine().JobStatus(kJob);
  EXPECT_FALSE(st->pending.has_value());
  EXPECT_NE(st->change_note.find("which is silent too"), std::string::npos) << st->change_note;

  // An automatic removal of a site that is heard from again is given up too.
  proposed = a.engine().membership().ProposeSilentRemoval(kJob, {"siteB"});
  ASSERT_TRUE(proposed.ok() && *proposed);
  ASSERT_TRUE(a.engine().membership().ProposeSilentRemoval(kJob, {}).ok());
  st = a.engine().JobStatus(kJob);
  EXPECT_FALSE(st->pending.has_value());
  EXPECT_NE(st->change_note.find("heard from again"), std::string::npos) << st->change_note;
  EXPECT_EQ(st->members.epoch, 0u);
  // Nothing holds round 3 now.
  for (auto& s : sites) ASSERT_TRUE(s->PushRound(3).ok());
  for (auto& from : sites)
    for (auto& to : sites)
      if (from != to) Deliver(*from, *to);
  for (auto& s : sites) EXPECT_EQ(s->engine().CommittedRound(kJob), 3u);
  EXPECT_EQ(a.Digests(), b.Digests());
}

// A join needs an operator's consent on the member asked (issue 27 item 2: a removed site
// whose key was still allowed sent one Join and the members held every commit until an
// operator abandoned the addition). Without an invitation the request is refused and
// nothing is held; with one, a join that then makes no progress is given up after
// sync.change_timeout_s, releasing the commits.
TEST(SyncEngineTest, AJoinNeedsAnInvitationAndAStalledOneExpires) {
  auto now = std::chrono::steady_clock::now();
  Site a("siteA", {"siteB"}, "dense"), b("siteB", {"siteA"}, "dense");
  // siteA's operator lists siteD as a peer (before inviting it).
  a.options().peer_sites = {"siteB", "siteD"};
  a.options().now = [&] { return now; };
  a.options().change_timeout_s = 60;
  a.Reopen();
  for (Site* s : {&a, &b}) ASSERT_TRUE(s->PushRound(1).ok());
  Deliver(a, b), Deliver(b, a);
  ASSERT_EQ(a.engine().CommittedRound(kJob), 1u);
  MembershipRequest join{kJob, MembershipStep::kJoin, {{0, {"siteD"}, 0}, "siteA"}};
  MembershipAnswer refused = a.engine().OnMembershipRequest("siteD", join);
  EXPECT_EQ(refused.vote, MembershipVote::kRefused);
  EXPECT_NE(refused.reason.find("isthmusctl sync invite --site siteD"), std::string::npos)
      << refused.reason;
  EXPECT_FALSE(a.engine().JobStatus(kJob)->pending.has_value());
  // Inviting a member or an unknown site is refused.
  EXPECT_FALSE(a.engine().membership().Invite(kJob, "siteB", std::chrono::hours(1)).ok());
  EXPECT_EQ(a.engine().membership().Invite(kJob, "siteX", std::chrono::hours(1)).code(),
            Code::kNotFound);
  ASSERT_TRUE(a.engine().membership().Invite(kJob, "siteD", std::chrono::minutes(5)).ok());
  EXPECT_EQ(a.engine().OnMembershipRequest("siteD", join).vote, MembershipVote::kPending);
  ASSERT_TRUE(a.engine().JobStatus(kJob)->pending.has_value());
  // siteD never fetches: round 2 is held at siteA meanwhile...
  for (Site* s : {&a, &b}) ASSERT_TRUE(s->PushRound(2).ok());
  Deliver(a, b), Deliver(b, a);
  EXPECT_EQ(a.engine().CommittedRound(kJob), 1u);
  now += std::chrono::seconds(30);
  a.engine().membership().ExpireStalled();
  EXPECT_TRUE(a.engine().JobStatus(kJob)->pending.has_value());
  // ...until the change timeout: given up, and the held round commits.
  now += std::chrono::seconds(31);
  a.engine().membership().ExpireStalled();
  auto st = a.engine().JobStatus(kJob);
  EXPECT_FALSE(st->pending.has_value());
  EXPECT_NE(st->change_note.find("no progress for 60 s"), std::string::npos) << st->change_note;
  EXPECT_EQ(a.engine().CommittedRound(kJob), 2u);
  // An expired invitation is refused too.
  ASSERT_TRUE(a.engine().membership().Invite(kJob, "siteD", std::chrono::seconds(10)).ok());
  now += std::chrono::seconds(11);
  refused = a.engine().OnMembershipRequest("siteD", join);
  EXPECT_EQ(refused.vote, MembershipVote::kRefused);
  EXPECT_NE(refused.reason.find("expired"), std::string::npos) << refused.reason;
}

// Joining while the members train (issue 27 item 3): siteB had committed a round more than
// siteA when siteA proposed the addition, so siteB refused ("the sites disagree on rounds",
// with advice to run catch-up) and the join failed, when asking again is what works. Now the
// refusal is taken as passing: siteD asks again and is added from a later round.
TEST(SyncEngineTest, AJoinRefusedBecauseTheRoundsMovedOnIsAskedAgainAndSucceeds) {
  Site a("siteA", {"siteB"}, "dense"), b("siteB", {"siteA"}, "dense");
  BAheadByARoundBothListingD(a, b);
  if (HasFatalFailure()) return;
  JoiningSiteD joining({"siteA", "siteB"});
  SyncEngine* d = joining.engine.get();
  ASSERT_TRUE(a.engine().membership().Invite(kJob, "siteD", std::chrono::hours(1)).ok());
  ASSERT_TRUE(d->membership().StartJoin(kJob, "siteA").ok());
  std::map<std::string, SyncEngine*> by_name{
      {"siteA", &a.engine()}, {"siteB", &b.engine()}, {"siteD", d}};
  auto converse = [&] { ConverseAll(by_name); };
  converse();  // D asks A; A proposes "add siteD from round 2"; B refuses: it has round 2
  converse();
  EXPECT_FALSE(d->JobStatus(kJob)->change_note.find("join failed") == 0)
      << d->JobStatus(kJob)->change_note;
  Deliver(b, a);  // siteA commits round 2 too
  ASSERT_EQ(a.engine().CommittedRound(kJob), 2u);
  for (int i = 0; i < 8 && !d->HasJob(kJob); ++i) converse();
  for (int i = 0; i < 8; ++i) converse();
  auto st = a.engine().JobStatus(kJob);
  EXPECT_EQ(st->members.sites, (std::vector<std::string>{"siteA", "siteB", "siteD"}))
      << st->change_note << " / D: " << d->JobStatus(kJob)->change_note;
  EXPECT_EQ(st->members.from_round, 3u);
  EXPECT_TRUE(d->HasJob(kJob)) << d->JobStatus(kJob)->change_note;
}

// The same race, later: siteD was prepared and fetches the state only after siteB's refusal
// made siteA give the addition up. The fetch is answered "abandoned" (it was "refused", and
// the join failed: found by the nemesis across sites), so siteD asks again and is added.
TEST(SyncEngineTest, AFetchForAnAdditionGivenUpMeanwhileIsAskedAgainAndSucceeds) {
  Site a("siteA", {"siteB"}, "dense"), b("siteB", {"siteA"}, "dense");
  BAheadByARoundBothListingD(a, b);
  if (HasFatalFailure()) return;
  JoiningSiteD joining({"siteA", "siteB"});
  SyncEngine* d = joining.engine.get();
  ASSERT_TRUE(a.engine().membership().Invite(kJob, "siteD", std::chrono::hours(1)).ok());
  ASSERT_TRUE(d->membership().StartJoin(kJob, "siteA").ok());
  EXPECT_EQ(AskOnce(*d, "siteD", a.engine(), "siteA", MembershipStep::kJoin).vote,
            MembershipVote::kPending);
  EXPECT_EQ(AskOnce(a.engine(), "siteA", *d, "siteD", MembershipStep::kPrepare).vote,
            MembershipVote::kPending);
  EXPECT_EQ(AskOnce(a.engine(), "siteA", b.engine(), "siteB", MembershipStep::kPrepare).vote,
            MembershipVote::kRefused);  // siteB has committed round 2
  ASSERT_FALSE(a.engine().JobStatus(kJob)->pending.has_value());
  EXPECT_EQ(AskOnce(*d, "siteD", a.engine(), "siteA", MembershipStep::kFetch).vote,
            MembershipVote::kAbandoned);
  EXPECT_NE(d->JobStatus(kJob)->change_note.find("asking it again"), std::string::npos)
      << d->JobStatus(kJob)->change_note;
  Deliver(b, a);  // siteA commits round 2 too
  std::map<std::string, SyncEngine*> by_name{
      {"siteA", &a.engine()}, {"siteB", &b.engine()}, {"siteD", d}};
  for (int i = 0; i < 16 && !d->HasJob(kJob); ++i) ConverseAll(by_name);
  EXPECT_TRUE(d->HasJob(kJob)) << d->JobStatus(kJob)->change_note;
}

// A planned leave proposed by a site that has committed a round another member has not
// yet (found under TSan load: sync_process_test's PlannedLeaveWaitsForTheLeavingSitesLastRound
// timed out). The member used to refuse ("the sites disagree on rounds") and the leaving site,
// draining, never proposed again; now the member answers "pending" until that round has
// committed here too, then agrees, and the leave applies on every site.
TEST(SyncEngineTest, APlannedLeaveFromASiteAheadByARoundWaitsForTheOthersAndApplies) {
  auto sites = ThreeSites("dense");
  Site &a = *sites[0], &b = *sites[1], &c = *sites[2];
  for (auto& s : sites) ASSERT_TRUE(s->PushRound(1).ok());
  for (auto& from : sites)
    for (auto& to : sites)
      if (from != to) Deliver(*from, *to);
  for (auto& s : sites) ASSERT_TRUE(s->PushRound(2).ok());
  // siteC has every round-2 delta; siteA has none of the others' yet.
  Deliver(a, c), Deliver(b, c), Deliver(a, b), Deliver(c, b);
  ASSERT_EQ(c.engine().CommittedRound(kJob), 2u);
  ASSERT_EQ(a.engine().CommittedRound(kJob), 1u);
  auto leave = c.engine().membership().ProposeRemoval(kJob, "siteC");
  ASSERT_TRUE(leave.ok()) << leave.status().ToString();
  ASSERT_EQ(leave->next.from_round, 3u);
  const MembershipAnswer early =
      AskOnce(c.engine(), "siteC", a.engine(), "siteA", MembershipStep::kPrepare);
  EXPECT_EQ(early.vote, MembershipVote::kPending) << early.reason;
  EXPECT_NE(early.reason.find("round 2 is not committed here yet"), std::string::npos)
      << early.reason;
  ASSERT_TRUE(c.engine().JobStatus(kJob)->pending.has_value()) << "the leave was dropped";
  Deliver(b, a), Deliver(c, a);  // siteA commits round 2
  ASSERT_EQ(a.engine().CommittedRound(kJob), 2u);
  std::map<std::string, SyncEngine*> by_name{
      {"siteA", &a.engine()}, {"siteB", &b.engine()}, {"siteC", &c.engine()}};
  for (int i = 0; i < 8; ++i) ConverseAll(by_name);
  for (Site* s : {&a, &b, &c}) {
    auto st = s->engine().JobStatus(kJob);
    EXPECT_EQ(st->members.sites, (std::vector<std::string>{"siteA", "siteB"})) << st->change_note;
    EXPECT_EQ(st->members.from_round, 3u);
    EXPECT_FALSE(st->pending.has_value());
  }
}

// Membership (docs/SYNC.md): the removal of a silent site, agreed in two phases, survives a
// reopen of either side at any step, changes who merges from the cut on, and the digests
// (which cover the membership) agree.
TEST(SyncEngineTest, RemovalIsAgreedDurablyAndCutsAtTheNextRound) {
  auto sites = ThreeSites("dense");
  Site &a = *sites[0], &b = *sites[1], &c = *sites[2];
  for (auto& s : sites) ASSERT_TRUE(s->PushRound(1).ok());
  for (auto& from : sites)
    for (auto& to : sites)
      if (from != to) Deliver(*from, *to);
  ASSERT_EQ(a.engine().CommittedRound(kJob), 1u);
  // Round 2: siteC's delta reaches nobody.
  ASSERT_TRUE(a.PushRound(2).ok());
  ASSERT_TRUE(b.PushRound(2).ok());
  ASSERT_TRUE(c.PushRound(2).ok());
  Deliver(a, b), Deliver(b, a);
  ASSERT_EQ(a.engine().CommittedRound(kJob), 1u);

  // Refused up front: removing a non-member. Leaving with an uncommitted round of ours
  // drains first (no round is proposed yet); abandoning calls that off.
  EXPECT_EQ(a.engine().membership().ProposeRemoval(kJob, "siteX").status().code(),
            Code::kFailedPrecondition);
  auto leave = a.engine().membership().ProposeRemoval(kJob, "siteA");
  ASSERT_TRUE(leave.ok()) << leave.status().ToString();
  EXPECT_EQ(leave->next.from_round, 0u);
  EXPECT_TRUE(a.engine().JobStatus(kJob)->draining);
  ASSERT_TRUE(a.engine().membership().AbandonChange(kJob).ok());
  EXPECT_FALSE(a.engine().JobStatus(kJob)->draining);

  auto change = a.engine().membership().ProposeRemoval(kJob, "siteC");
  ASSERT_TRUE(change.ok()) << change.status().ToString();
  EXPECT_EQ(change->next.epoch, 1u);
  EXPECT_EQ(change->next.from_round, 2u);
  EXPECT_EQ(change->next.sites, (std::vector<std::string>{"siteA", "siteB"}));
  EXPECT_TRUE(a.engine().MembershipRequests("siteC").empty());  // not asked: it is removed
  auto prepare = a.engine().MembershipRequests("siteB");
  ASSERT_EQ(prepare.size(), 1u);
  EXPECT_EQ(prepare[0].step, MembershipStep::kPrepare);

  // siteC (still at epoch 0, but not in the new membership) refuses to take part.
  EXPECT_EQ(c.engine().OnMembershipRequest("siteA", prepare[0]).vote, MembershipVote::kRefused);
  // A prepare that does not come from its coordinator is refused.
  EXPECT_EQ(b.engine().OnMembershipRequest("siteC", prepare[0]).vote, MembershipVote::kRefused);
  ASSERT_EQ(b.engine().OnMembershipRequest("siteA", prepare[0]).vote, MembershipVote::kPrepared);
  // Both sides reopen as after a crash: the agreement and the proposal are durable, the
  // coordinator's tally is not (it asks again).
  b.Reopen();
  a.Reopen();
  auto query = b.engine().MembershipRequests("siteA");
  ASSERT_EQ(query.size(), 1u);
  EXPECT_EQ(query[0].step, MembershipStep::kQuery);
  EXPECT_EQ(a.engine().OnMembershipRequest("siteB", query[0]).vote, MembershipVote::kPending);
  // siteC's late delta would make round 2 complete; agreed sites hold their commits.
  Deliver(c, b);
  EXPECT_EQ(b.engine().CommittedRound(kJob), 1u);
  prepare = a.engine().MembershipRequests("siteB");
  ASSERT_EQ(prepare.size(), 1u);
  MembershipAnswer again = b.engine().OnMembershipRequest("siteA", prepare[0]);
  EXPECT_EQ(again.vote, MembershipVote::kPrepared);
  a.engine().OnMembershipAnswer("siteB", prepare[0], again);
  EXPECT_EQ(a.engine().CommittedRound(kJob), 2u);  // applied, and round 2 merged A and B
  MembershipAnswer outcome = a.engine().OnMembershipRequest("siteB", query[0]);
  EXPECT_EQ(outcome.vote, MembershipVote::kApplied);
  b.engine().OnMembershipAnswer("siteA", query[0], outcome);
  EXPECT_EQ(b.engine().CommittedRound(kJob), 2u);
  EXPECT_EQ(a.Digests(), b.Digests());

  auto st = b.engine().JobStatus(kJob);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->members.epoch, 1u);
  EXPECT_FALSE(st->pending.has_value());
  EXPECT_EQ(st->removed, (std::map<std::string, uint64_t>{{"siteC", 2}}));
  EXPECT_EQ(st->held.count("siteC"), 0u);
  // The removed site: refused, holds nothing from its cut on, and gets nothing sent.
  auto late = c.engine().OutboxDelta(kJob, 2);
  ASSERT_TRUE(late.ok());
  auto refused = a.engine().ReceiveDelta("siteC", **late);
  EXPECT_EQ(refused.status().code(), Code::kPermissionDenied);
  EXPECT_NE(refused.status().message().find("must join again"), std::string::npos);
  EXPECT_EQ(a.engine().HeldFrom("siteC", kJob), 1u);
  EXPECT_EQ(a.engine().FirstRoundTo("siteC", kJob), 0u);
  EXPECT_EQ(a.engine().FirstRoundTo("siteB", kJob), 1u);
  EXPECT_NE(a.engine().RefusesPeer("siteC", kJob), "");

  // The digest covers the membership: the same tensors under other members differ.
  auto theta = a.engine().Committed(kJob);
  ASSERT_TRUE(theta.ok());
  const Membership now = st->members;
  Membership other = now;
  other.sites.push_back("siteC");
  EXPECT_EQ(StateDigest(2, *theta, {}, now), a.Digests()[2]);
  EXPECT_NE(StateDigest(2, *theta, {}, other), a.Digests()[2]);

  // From here A and B commit alone.
  ASSERT_TRUE(a.PushRound(3).ok());
  ASSERT_TRUE(b.PushRound(3).ok());
  Deliver(a, b), Deliver(b, a);
  EXPECT_EQ(a.engine().CommittedRound(kJob), 3u);
  EXPECT_EQ(a.Digests(), b.Digests());

  // A peer's word that this site was removed from a round before the membership it holds
  // (members from round 2) is stale: a site that joined again reads it when the peer
  // answered before it applied the addition. Ignored, the workers go on; a removal from a
  // round of the current membership is news and stops them, saying so.
  b.engine().OnRemovedNotice("siteA", kJob, 1);
  EXPECT_EQ(b.engine().membership().RemovedNotice(kJob), "");
  EXPECT_EQ(b.engine().JobStatus(kJob)->change_note.find("no longer counts"), std::string::npos);
  b.engine().OnRemovedNotice("siteA", kJob, 4);
  EXPECT_NE(b.engine().membership().RemovedNotice(kJob).find(
                "site siteA no longer counts this site (siteB) in job 'j': it was removed "
                "from round 4"),
            std::string::npos)
      << b.engine().membership().RemovedNotice(kJob);
}

TEST(SyncEngineTest, RecordsWithoutMembershipReadAsTheConfiguredSites) {
  auto rec = DecodeSyncRecord(
      R"({"committed":3,"local":3,"version":9,"staged_round":0,"staged_tokens":0,"staged":[],)"
      R"("acked":{},"bytes_encoded":0,"raw_bytes":0,"pipelines":{}})",
      "j");
  ASSERT_TRUE(rec.ok()) << rec.status().ToString();
  EXPECT_TRUE(rec->members.sites.empty());
  EXPECT_FALSE(rec->pending.has_value());
  SyncRecord r;
  r.members = {2, {"a", "b"}, 5};
  r.removed = {{"c", 5}};
  r.pending = MembershipChange{{3, {"a"}, 7}, "a"};
  auto back = DecodeSyncRecord(EncodeSyncRecord(r), "j");
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->members, r.members);
  EXPECT_EQ(back->removed, r.removed);
  EXPECT_EQ(back->pending, r.pending);
  // Unsorted or repeated members are damage, not a membership.
  std::string bad = EncodeSyncRecord(r);
  bad.replace(bad.find(R"(["a","b"])"), 9, R"(["b","a"])");
  EXPECT_EQ(DecodeSyncRecord(bad, "j").status().code(), Code::kCorruption);
}

// sync.checkpoint_rounds: the commits between checkpoints write no tensor rows, and a
// start rebuilds the committed state from the stored one and the rounds' deltas, bit for
// bit what a twin that writes every commit holds (lossy codec, Nesterov momentum, a
// restart after every commit); a damaged delta stops the start with the round named.
TEST(SyncEngineTest, CheckpointedStateIsRebuiltAtAStartBitForBit) {
  const std::string codec = "topk:0.25+int2+zstd";
  Site a("siteA", {"siteB"}, codec, 1.25, 0.6), b("siteB", {"siteA"}, codec, 1.25, 0.6);
  Site a1("siteA", {"siteB"}, codec, 1.25, 0.6), b1("siteB", {"siteA"}, codec, 1.25, 0.6);
  for (Site* s : {&a, &b}) {
    s->options().checkpoint_rounds = 3;
    s->options().replay_rounds = 0;  // the deltas kept are only the rebuild's
  }
  for (Site* s : {&a1, &b1}) s->options().checkpoint_rounds = 1;
  for (Site* s : {&a, &b, &a1, &b1}) s->Reopen();
  const uint64_t kRounds = 8;
  for (uint64_t r = 1; r <= kRounds; ++r) {
    ASSERT_NO_FATAL_FAILURE(CommitInPairs(r, {{&a, &b}, {&a1, &b1}}));
    const auto want = CommittedTensors(a1);
    EXPECT_EQ(StoredTensors(a1), want) << "round " << r << ": the twin writes every commit";
    // The store holds the state of the last multiple of 3, and the deltas since.
    const uint64_t state_round = r / 3 * 3;
    if (state_round == r) {
      EXPECT_EQ(StoredTensors(a), want) << "round " << r;
    } else {
      EXPECT_NE(StoredTensors(a), want) << "round " << r << " was written between checkpoints";
    }
    EXPECT_EQ(DeltasHeld(a), static_cast<int>(2 * (r - state_round))) << "round " << r;
    for (Site* s : {&a, &b}) {
      s->Reopen();  // the start rebuilds rounds state_round + 1 .. r
      ASSERT_EQ(s->engine().CommittedRound(kJob), r);
      EXPECT_EQ(CommittedTensors(*s), want) << s->name() << " round " << r;
    }
  }
  EXPECT_EQ(a.Digests(), a1.Digests());
  EXPECT_EQ(b.Digests(), b1.Digests());
  // Rounds closed ahead of the commits, staged in two pushes: the residuals are written at
  // round 9's close only; a start after round 10's recomputes them from round 9's and round
  // 10's staged delta, so round 11 encodes the same bytes as the twin that wrote them all.
  for (uint64_t r = kRounds + 1; r <= kRounds + 3; ++r) {
    ASSERT_TRUE(a.PushRound(r).ok());
    ASSERT_TRUE(a1.PushRound(r).ok());
    a.Reopen();
    auto mine = a.engine().OutboxDelta(kJob, r);
    auto twin = a1.engine().OutboxDelta(kJob, r);
    ASSERT_TRUE(mine.ok() && twin.ok());
    EXPECT_EQ(EncodeDelta(**mine), EncodeDelta(**twin)) << "round " << r;
  }
  // Round 8's state is rebuilt from round 6's and the deltas of rounds 7 and 8: one flipped
  // byte in a delta stops the start, naming the round.
  const std::string key = keys::DeltaKey(kJob, "siteB", 7);
  auto bytes = a.store()->Get(Column::kDeltas, key);
  ASSERT_TRUE(bytes.ok() && bytes->has_value());
  auto d = DecodeDelta(**bytes);
  ASSERT_TRUE(d.ok());
  d->tokens += 1;  // a valid delta, merged with another weight
  WriteBatch wb;
  wb.PutOwned(Column::kDeltas, key, EncodeDelta(*d));
  ASSERT_TRUE(a.store()->Write(wb).ok());
  auto engine = SyncEngine::Create(a.store(), a.options());
  ASSERT_TRUE(engine.ok());
  auto tensors = SyncEngine::ReadTensors(a.store(), kJob);
  ASSERT_TRUE(tensors.ok());
  const Status st = (*engine)->AttachJob(kJob, std::move(*tensors), 1);
  EXPECT_EQ(st.code(), Code::kCorruption) << st.ToString();
  EXPECT_NE(st.message().find("round 7"), std::string::npos) << st.ToString();
}

// With background_state_writes a checkpoint commit is published before its state is
// written: until the write is applied the store holds the earlier state with the rounds'
// deltas (a crash then rebuilds from those, bit for bit), and once applied the rows and
// the record name the checkpoint's round and the deltas it no longer needs go.
TEST(SyncEngineTest, AStateWrittenInTheBackgroundIsNamedOnlyOnceApplied) {
  const std::string codec = "topk:0.25+int2+zstd";
  Site a("siteA", {"siteB"}, codec, 1.25, 0.6), b("siteB", {"siteA"}, codec, 1.25, 0.6);
  Site a1("siteA", {"siteB"}, codec, 1.25, 0.6), b1("siteB", {"siteA"}, codec, 1.25, 0.6);
  for (Site* s : {&a, &b}) {
    s->options().checkpoint_rounds = 3;
    s->options().replay_rounds = 0;
  }
  a.options().background_state_writes = true;
  for (Site* s : {&a1, &b1}) s->options().checkpoint_rounds = 1;
  for (Site* s : {&a, &b, &a1, &b1}) s->Reopen();
  const auto base = StoredTensors(a);
  std::map<uint64_t, std::map<std::string, std::vector<float>>> want;
  for (uint64_t r = 1; r <= 8; ++r) {
    ASSERT_NO_FATAL_FAILURE(CommitInPairs(r, {{&a, &b}, {&a1, &b1}}));
    want[r] = CommittedTensors(a1);
    ASSERT_EQ(CommittedTensors(a), want[r]) << "round " << r;
    if (r == 3) {
      // Round 3's state is being written: the store still holds round 0's and every delta.
      EXPECT_EQ(StoredTensors(a), base);
      EXPECT_EQ(DeltasHeld(a), 6);
      a.Reopen();  // lost before it was applied, as in a crash
      EXPECT_EQ(CommittedTensors(a), want[r]) << "rebuilt from round 0's state and the deltas";
      EXPECT_EQ(StoredTensors(a), base);
    }
    if (r == 4) {
      // The commit after the start writes it (round 0's is 4 rounds back).
      EXPECT_EQ(StoredTensors(a), base);
      const int before = DeltasHeld(a);
      ASSERT_TRUE(a.engine().FinishStateWrites().ok());
      EXPECT_EQ(StoredTensors(a), want[4]);
      EXPECT_LT(DeltasHeld(a), before) << "the rounds up to 4 are not needed for a start";
      a.Reopen();
      EXPECT_EQ(CommittedTensors(a), want[4]);
    }
  }
  // Round 7's, started at its commit, is applied by the event loop's RunDeferred once
  // filled, without waiting for it; round 8's commit did not start another.
  for (int i = 0; i < 2000 && StoredTensors(a) != want[7]; ++i) {
    ASSERT_TRUE(a.engine().RunDeferred().ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(StoredTensors(a), want[7]);
  a.Reopen();
  EXPECT_EQ(CommittedTensors(a), want[8]);
  EXPECT_EQ(a.Digests(), a1.Digests());
}

// The early encode (StartEarlyEncode) runs while the push's stage is written. When that
// write fails the push fails whole, the encode is waited for and dropped, and the retried
// rounds encode the bytes an inline twin encodes.
TEST(SyncEngineTest, AStageWriteThatFailsWhileTheCloseEncodesLeavesNothingBehind) {
  const std::string codec = "topk:0.25+int2+zstd";
  std::unique_ptr<FlakyStore> flaky;
  Site a("siteA", {"siteB"}, codec, 1.25, 0.6), twin("siteA", {"siteB"}, codec, 1.25, 0.6);
  a.set_store_wrapper([&](Store* inner) {
    flaky = std::make_unique<FlakyStore>(inner);
    return flaky.get();
  });
  a.Reopen();
  a.set_defer(true);
  flaky->fail_ = true;
  EXPECT_EQ(a.PushWholeRound(1, /*keep=*/true).status().code(), Code::kResourceExhausted);
  EXPECT_EQ(a.engine().PushedRound(kJob), 0u);
  EXPECT_FALSE(a.engine().HasDeferred());
  EXPECT_TRUE(a.last_keep.expired()) << "nothing holds the failed push's deltas";
  flaky->fail_ = false;
  for (uint64_t r = 1; r <= 3; ++r) {
    ASSERT_TRUE(a.PushWholeRound(r, /*keep=*/true).ok());
    ASSERT_TRUE(a.engine().RunDeferred().ok());
    ASSERT_TRUE(twin.PushWholeRound(r).ok());
    auto mine = a.engine().OutboxDelta(kJob, r);
    auto theirs = twin.engine().OutboxDelta(kJob, r);
    ASSERT_TRUE(mine.ok() && theirs.ok());
    EXPECT_EQ(EncodeDelta(**mine), EncodeDelta(**theirs)) << "round " << r;
  }
  EXPECT_EQ(a.engine().EarlyEncodes(), 3u);
}

// Site A's round r with each tensor's delta (DeltaOf) encoded by its worker or by the shard
// (shard(i)), with error feedback in the residuals kept here on the side: what the shard must
// send (`want`), and the tensors to push, the worker-encoded ones as their bytes. The
// deltas and bytes are shared, so a push may keep them alive (PushRound's keepalive).
struct MixedRound {
  std::shared_ptr<std::vector<std::vector<float>>> deltas =
      std::make_shared<std::vector<std::vector<float>>>();
  std::shared_ptr<std::vector<std::string>> bytes = std::make_shared<std::vector<std::string>>();
  std::vector<std::string> want;
  std::vector<SyncPushTensor> tensors;
};

// The error-feedback residuals of the shard and of the worker, kept on the side; zeros at
// the start.
struct SideResiduals {
  SideResiduals() {
    for (const auto& t : kTensors) {
      shard.emplace_back(Numel(t.shape), 0.0f);
      worker.emplace_back(Numel(t.shape), 0.0f);
    }
  }
  std::vector<std::vector<float>> shard, worker;
};

void MakeMixedRound(Site& a, uint64_t r, const std::function<bool(size_t)>& shard,
                    SideResiduals& side, MixedRound* out) {
  auto pipes = a.engine().RoundPipelines(kJob, r);
  ASSERT_TRUE(pipes.ok()) << pipes.status().ToString();
  ASSERT_EQ(pipes->size(), kTensors.size());
  for (size_t i = 0; i < kTensors.size(); ++i) {
    out->deltas->push_back(DeltaOf("siteA", r, i));
    auto pipe = codec::ParsePipeline(pipes->at(kTensors[i].name));
    ASSERT_TRUE(pipe.ok());
    std::vector<float> decoded(out->deltas->back().size());
    std::vector<float>& res = shard(i) ? side.shard[i] : side.worker[i];
    out->want.push_back(
        codec::EncodeWithFeedback(*pipe, out->deltas->back(), kTensors[i].shape, res, decoded));
    out->bytes->push_back(shard(i) ? std::string() : out->want.back());
  }
  for (size_t i = 0; i < kTensors.size(); ++i) {
    SyncPushTensor t{kTensors[i].name, (*out->deltas)[i], kTensors[i].shape};
    if (!(*out->bytes)[i].empty()) {
      t.delta = {};
      t.encoded = (*out->bytes)[i];
    }
    out->tensors.push_back(std::move(t));
  }
}

// Site A sends exactly `want` for round r; B pushes its round, both deliver, and both commit
// round r with the same digests.
void ExpectSentAndCommitted(Site& a, Site& b, uint64_t r, const std::vector<std::string>& want) {
  auto sent = a.engine().OutboxDelta(kJob, r);
  ASSERT_TRUE(sent.ok()) << sent.status().ToString();
  ASSERT_EQ((*sent)->tensors.size(), kTensors.size());
  for (size_t i = 0; i < kTensors.size(); ++i) {
    EXPECT_EQ((*sent)->tensors[i].name, kTensors[i].name);
    EXPECT_TRUE((*sent)->tensors[i].bytes == want[i]) << kTensors[i].name;
  }
  ASSERT_TRUE(b.PushRound(r).ok());
  Deliver(a, b);
  Deliver(b, a);
  ASSERT_TRUE(a.engine().RunDeferred().ok());
  ASSERT_EQ(a.engine().CommittedRound(kJob), r);
  ASSERT_EQ(b.engine().CommittedRound(kJob), r);
  EXPECT_EQ(a.Digests(), b.Digests());
}

// Deltas encoded by the worker (docs/SYNC.md, "Deltas encoded by the worker"): a tensor its
// worker encoded (error feedback in the worker's residual) is sent as it came, and one pushed
// as fp32 is encoded by the shard with the shard's residual, in any mix round by round. The
// shard's residuals skip the worker-encoded rounds, also when a start recomputes them between
// checkpoints. Checked against both residuals kept on the side, in three push styles: the
// whole round in one push (closed from memory), two pushes (closed from the staged rows), and
// deferred round work with the deltas kept alive (the encode starts while the stage is
// written). The peer commits every round with the same digests.
TEST(SyncEngineTest, WorkerEncodedDeltasAreSentAsTheyCameAndTheShardResidualSkipsThem) {
  const std::string codec = "topk:0.1+int4+zstd";
  for (int style = 0; style < 3; ++style) {
    SCOPED_TRACE("push style " + std::to_string(style));
    Site a("siteA", {"siteB"}, codec);
    Site b("siteB", {"siteA"}, codec);
    a.options().checkpoint_rounds = 3;
    b.options().checkpoint_rounds = 3;
    a.set_defer(style == 2);
    a.Reopen();
    b.Reopen();
    SideResiduals side;
    for (uint64_t r = 1; r <= 8; ++r) {
      SCOPED_TRACE("round " + std::to_string(r));
      // Round 4 all by the worker, round 5 all by the shard, the others mixed.
      MixedRound m;
      ASSERT_NO_FATAL_FAILURE(MakeMixedRound(
          a, r, [r](size_t i) { return r == 5 || (r != 4 && (i + r) % 3 == 0); }, side, &m));
      const auto& ts = m.tensors;
      const uint64_t tokens = TokensOf("siteA", r);
      if (style == 1) {
        WriteBatch b1, b2;
        ASSERT_TRUE(a.engine().PushRound(kJob, r, tokens, {ts[0]}, b1).ok());
        ASSERT_TRUE(a.engine().PushRound(kJob, r, tokens, {ts[1], ts[2]}, b2).ok());
      } else {
        WriteBatch b1;
        auto keep =
            std::make_shared<std::pair<decltype(m.deltas), decltype(m.bytes)>>(m.deltas, m.bytes);
        auto pushed = a.engine().PushRound(
            kJob, r, tokens, ts, b1, 0, style == 2 ? std::shared_ptr<const void>(keep) : nullptr);
        ASSERT_TRUE(pushed.ok()) << pushed.status().ToString();
        ASSERT_TRUE(a.engine().RunDeferred().ok());
      }
      ASSERT_NO_FATAL_FAILURE(ExpectSentAndCommitted(a, b, r, m.want));
      if (r == 2 || r == 5 || r == 7) a.Reopen();  // between checkpoints (3, 6) and after one
    }
    if (style == 2) {
      EXPECT_GT(a.engine().EarlyEncodes(), 0u);
    }
    auto st = a.engine().JobStatus(kJob);
    ASSERT_TRUE(st.ok());
    EXPECT_EQ(st->pipelines.at("by-worker"), 2u);  // round 8: two of three tensors
  }
}

// A close that writes the residuals (every sync.checkpoint_rounds) rewrites only those the
// shard changed since they were last written: a tensor only its workers encoded keeps its row
// (none at all if the shard never encoded it), and a start still recomputes every residual
// right: the shard's encodes after it are those of residuals kept on the side.
TEST(SyncEngineTest, AResidualOnlyWorkersEncodedIsNotRewrittenAtACheckpointClose) {
  const std::string codec = "topk:0.1+int4+zstd";
  Site a("siteA", {"siteB"}, codec);
  Site b("siteB", {"siteA"}, codec);
  a.options().checkpoint_rounds = 2;
  b.options().checkpoint_rounds = 2;
  a.Reopen();
  b.Reopen();
  SideResiduals side;
  // Round r with tensor i encoded by the shard when shard(i), by the worker otherwise.
  auto round = [&](uint64_t r, const std::function<bool(size_t)>& shard) {
    SCOPED_TRACE("round " + std::to_string(r));
    MixedRound m;
    ASSERT_NO_FATAL_FAILURE(MakeMixedRound(a, r, shard, side, &m));
    WriteBatch batch;
    ASSERT_TRUE(a.engine().PushRound(kJob, r, TokensOf("siteA", r), m.tensors, batch).ok());
    ASSERT_TRUE(a.engine().RunDeferred().ok());
    ASSERT_NO_FATAL_FAILURE(ExpectSentAndCommitted(a, b, r, m.want));
  };
  auto row = [&](size_t i) {
    auto v = a.store()->Get(Column::kState,
                            keys::StateKey(kJob, keys::StateKind::kResidual, kTensors[i].name));
    EXPECT_TRUE(v.ok());
    return v.ok() ? *v : std::nullopt;
  };
  auto floats = [](const std::vector<float>& v) {
    return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
  };
  ASSERT_GE(kTensors.size(), 3u);
  round(1, [](size_t i) { return i == 0; });
  round(2, [](size_t) { return false; });  // writes the residuals
  ASSERT_TRUE(row(0).has_value());
  EXPECT_EQ(*row(0), floats(side.shard[0]));
  EXPECT_FALSE(row(1).has_value());  // never encoded by the shard: zeros, no row
  EXPECT_FALSE(row(2).has_value());
  round(3, [](size_t i) { return i == 1; });
  const std::string row0 = *row(0);
  round(4, [](size_t) { return false; });  // writes the residuals
  ASSERT_TRUE(row(1).has_value());
  EXPECT_EQ(*row(1), floats(side.shard[1]));
  EXPECT_EQ(*row(0), row0);
  EXPECT_FALSE(row(2).has_value());
  // Round 5 by the shard alone, between checkpoints; then a start recomputes the residuals
  // from the rows and round 5's staged delta, and round 6 is encoded from them.
  round(5, [](size_t) { return true; });
  a.Reopen();
  round(6, [](size_t) { return true; });  // writes the residuals
  for (size_t i = 0; i < kTensors.size(); ++i) {
    ASSERT_TRUE(row(i).has_value()) << i;
    EXPECT_EQ(*row(i), floats(side.shard[i])) << i;
  }
}

// A worker-encoded delta that does not decode, or decodes to another tensor's size, is
// refused before anything is written; a round-less push takes no encoded delta.
TEST(SyncEngineTest, AnEncodedDeltaThatDoesNotDecodeToTheTensorIsRefusedWithNothingWritten) {
  Site a("siteA", {"siteB"}, "int8");
  const auto before = Dump(a.store());
  auto pipe = codec::ParsePipeline("int8");
  ASSERT_TRUE(pipe.ok());
  const auto bias = DeltaOf("siteA", 1, 1);  // 16 values
  const std::string small = codec::Encode(*pipe, bias, kTensors[1].shape);
  std::string damaged = small;
  damaged[damaged.size() / 2] ^= 0x5a;
  damaged.pop_back();
  for (const auto& [name, bytes] :
       std::vector<std::pair<std::string, std::string>>{{"a.weight", small},  // 16 of 128 values
                                                        {"b.bias", damaged},
                                                        {"b.bias", std::string()}}) {
    SyncPushTensor t{name, {}, name == "a.weight" ? kTensors[0].shape : kTensors[1].shape};
    t.encoded = bytes;
    WriteBatch b;
    auto pushed = a.engine().PushRound(kJob, 1, 10, {t}, b);
    EXPECT_EQ(pushed.status().code(), Code::kInvalidArgument) << name;
    EXPECT_NE(pushed.status().message().find("cannot be decoded"), std::string::npos)
        << pushed.status().ToString();
  }
  EXPECT_EQ(Dump(a.store()), before);
  // The same tensor well encoded is taken.
  SyncPushTensor good{"b.bias", {}, kTensors[1].shape};
  good.encoded = small;
  WriteBatch b;
  ASSERT_TRUE(a.engine().PushRound(kJob, 1, 10, {good}, b).ok());

  Site solo("solo", {}, "dense");
  WriteBatch b2;
  auto added = solo.engine().AddNow(kJob, {good}, b2);
  EXPECT_EQ(added.status().code(), Code::kInvalidArgument);
}

// The commit's buffers are recycled (TensorPool): the first commit takes none fresh, and a
// buffer of an older state that a reader still holds is never written, while the sites'
// digests stay the same.
TEST(SyncEngineTest, CommitsRecycleBuffersButNeverOneAReaderStillHolds) {
  auto sites = ThreeSites("", /*lr=*/0.7, /*mu=*/0.9);
  auto deep = [](const std::map<std::string, SyncTensor>& state) {
    std::map<std::string, std::vector<float>> out;
    for (const auto& [n, t] : state) out[n] = *t.data;
    return out;
  };
  // Site A's reader holds the states of rounds 0 and 2 (as a pull reply would).
  std::vector<std::map<std::string, SyncTensor>> held;
  std::vector<std::map<std::string, std::vector<float>>> values;
  auto hold = [&] {
    auto c = sites[0]->engine().Committed(kJob);
    ASSERT_TRUE(c.ok());
    held.push_back(*c);
    values.push_back(deep(*c));
  };
  hold();
  std::vector<TensorPool::Stats> start;  // after the start's own takes (the state moved in)
  for (auto& s : sites) start.push_back(s->engine().pool_stats());
  for (uint64_t r = 1; r <= 6; ++r) {
    for (auto& s : sites) ASSERT_TRUE(s->PushRound(r).ok());
    for (int a = 0; a < 3; ++a) {
      for (int b = 0; b < 3; ++b) {
        if (a != b) Deliver(*sites[a], *sites[b]);
      }
    }
    for (auto& s : sites) ASSERT_EQ(s->engine().CommittedRound(kJob), r) << s->name();
    EXPECT_EQ(sites[1]->Digests(), sites[0]->Digests());
    EXPECT_EQ(sites[2]->Digests(), sites[0]->Digests());
    if (r == 1) {
      // Round 1 took only the buffers reserved at the start.
      for (size_t i = 0; i < sites.size(); ++i) {
        const auto st = sites[i]->engine().pool_stats();
        const uint64_t taken = st.taken - start[i].taken;
        EXPECT_EQ(taken, 3 * kTensors.size()) << sites[i]->name();  // sum, theta, momentum
        EXPECT_EQ(st.recycled - start[i].recycled, taken) << sites[i]->name();
      }
    }
    auto now = sites[0]->engine().Committed(kJob);
    ASSERT_TRUE(now.ok());
    for (size_t h = 0; h < held.size(); ++h) {
      EXPECT_EQ(deep(held[h]), values[h]) << "state held since before round " << r;
      for (const auto& [n, t] : *now) EXPECT_NE(t.data.get(), held[h].at(n).data.get()) << n;
    }
    if (r == 2) hold();
  }
  // Site B, whose old states nobody held, recycled buffers in every commit.
  const auto b = sites[1]->engine().pool_stats();
  const uint64_t taken = b.taken - start[1].taken;
  const uint64_t recycled = b.recycled - start[1].recycled;
  EXPECT_EQ(taken, 6 * 3 * kTensors.size());
  EXPECT_EQ(recycled, taken);
  std::printf("site B: %llu of %llu commit buffers recycled\n",
              static_cast<unsigned long long>(recycled), static_cast<unsigned long long>(taken));
}

}  // namespace
}  // namespace isthmus
