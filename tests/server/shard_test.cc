// The shard state machine in one process over the in-memory store: push/pull semantics,
// idempotency, refusal of bad input with state unchanged, and storage failures.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <map>
#include <tuple>

#include "common/client.h"
#include "server/shard/shard.h"
#include "server/storage/keys.h"
#include "server/storage/store.h"

namespace isthmus {
namespace {

// Builds request Frames from an envelope and float payloads.
Frames MakeFrames(const flatbuffers::FlatBufferBuilder& fbb,
                  const std::vector<std::vector<float>>& p = {}) {
  Frames f;
  f.header = zmq::message_t(fbb.GetBufferPointer(), fbb.GetSize());
  for (const auto& v : p) f.payload.emplace_back(v.data(), v.size() * sizeof(float));
  return f;
}

void Finish(flatbuffers::FlatBufferBuilder& fbb, wire::Body type, flatbuffers::Offset<void> body) {
  wire::FinishEnvelopeBuffer(fbb, wire::CreateEnvelope(fbb, 1, 1, type, body));
}

class ShardTest : public ::testing::Test {
 protected:
  void SetUp() override { Reopen(-1); }

  void Reopen(int fail_after, uint64_t dedup_window = 65536) {
    ShardOptions o;
    o.shard_id = "test";
    o.dedup_window = dedup_window;
    o.open_store = [fail_after]() -> Result<std::unique_ptr<Store>> {
      return NewMemStore(fail_after);
    };
    auto s = Shard::Open(o);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    shard_ = std::move(s).value();
  }

  Status Expect(const Reply& r, wire::Body type) {
    zmq::message_t m(r.header.GetBufferPointer(), r.header.GetSize());
    auto env = ParseEnvelope(m, WireLimits{});
    if (!env.ok()) return env.status();
    Status err = ErrorFromEnvelope(*env);
    if (!err.ok()) return err;
    return (*env)->body_type() == type ? Status::Ok() : Status::Internal("wrong reply type");
  }

  Status CreateJob(wire::Role role = wire::Role::Admin) {
    flatbuffers::FlatBufferBuilder fbb;
    std::vector<TensorView> v{{"w", {2, static_cast<int64_t>(w_.size()) / 2}, w_.data()},
                              {"b", {3}, b_.data()}};
    auto metas = BuildTensorMetas(fbb, v);
    Finish(fbb, wire::Body::JobCreate,
           wire::CreateJobCreate(fbb, fbb.CreateString("job"), fbb.CreateString("base1"), metas)
               .Union());
    return Expect(shard_->Handle(role, MakeFrames(fbb, {w_, b_})), wire::Body::JobCreateReply);
  }

  Result<bool> Push(const std::string& key,
                    std::vector<std::pair<std::string, std::vector<float>>> deltas,
                    wire::Role role = wire::Role::Worker) {
    flatbuffers::FlatBufferBuilder fbb;
    std::vector<TensorView> views;
    std::vector<std::vector<float>> payload;
    for (auto& [name, d] : deltas) {
      views.push_back({name, {static_cast<int64_t>(d.size())}, d.data()});
      if (name == "w") views.back().shape = {2, static_cast<int64_t>(d.size()) / 2};
      payload.push_back(d);
    }
    auto metas = BuildTensorMetas(fbb, views);
    Finish(
        fbb, wire::Body::PushRequest,
        wire::CreatePushRequest(fbb, fbb.CreateString("job"), fbb.CreateString(key), 1, 10, metas)
            .Union());
    Reply r = shard_->Handle(role, MakeFrames(fbb, payload));
    ISTHMUS_RETURN_IF_ERROR(Expect(r, wire::Body::PushReply));
    zmq::message_t m(r.header.GetBufferPointer(), r.header.GetSize());
    return (*ParseEnvelope(m, WireLimits{}))->body_as_PushReply()->duplicate();
  }

  Status DescribeStatus() {
    flatbuffers::FlatBufferBuilder fbb;
    Finish(fbb, wire::Body::JobDescribe,
           wire::CreateJobDescribe(fbb, fbb.CreateString("job")).Union());
    return Expect(shard_->Handle(wire::Role::Admin, MakeFrames(fbb, {})),
                  wire::Body::JobDescribeReply);
  }

  // name -> version, via JobDescribe.
  std::map<std::string, uint64_t> DescribeVersions() {
    flatbuffers::FlatBufferBuilder fbb;
    Finish(fbb, wire::Body::JobDescribe,
           wire::CreateJobDescribe(fbb, fbb.CreateString("job")).Union());
    Reply r = shard_->Handle(wire::Role::Admin, MakeFrames(fbb, {}));
    EXPECT_TRUE(Expect(r, wire::Body::JobDescribeReply).ok());
    zmq::message_t m(r.header.GetBufferPointer(), r.header.GetSize());
    std::map<std::string, uint64_t> out;
    for (const auto* t :
         *(*ParseEnvelope(m, WireLimits{}))->body_as_JobDescribeReply()->tensors()) {
      out[t->name()->str()] = t->version();
    }
    return out;
  }

  // name -> values, via a pull.
  std::map<std::string, std::vector<float>> Pull(uint64_t newer_than = 0,
                                                 uint64_t* version = nullptr) {
    flatbuffers::FlatBufferBuilder fbb;
    Finish(fbb, wire::Body::PullRequest,
           wire::CreatePullRequest(fbb, fbb.CreateString("job"), 0, newer_than).Union());
    Reply r = shard_->Handle(wire::Role::Worker, MakeFrames(fbb));
    EXPECT_TRUE(Expect(r, wire::Body::PullReply).ok());
    zmq::message_t m(r.header.GetBufferPointer(), r.header.GetSize());
    const auto* reply = (*ParseEnvelope(m, WireLimits{}))->body_as_PullReply();
    if (version) *version = reply->job_version();
    std::map<std::string, std::vector<float>> out;
    for (const auto* t : *reply->tensors()) {
      const auto& p = r.payload[t->frame()];
      const float* f = static_cast<const float*>(p.data);
      out[t->name()->str()] = std::vector<float>(f, f + p.size / 4);
    }
    return out;
  }

  // A push with a round number; returns the reply's RoundStatus (local, committed, K).
  // With `keep` the request is handed over as the server's loop does (Handle's keepalive).
  Result<std::array<uint64_t, 3>> PushRound(
      const std::string& key, uint64_t round,
      std::vector<std::pair<std::string, std::vector<float>>> deltas, bool keep = false) {
    flatbuffers::FlatBufferBuilder fbb;
    std::vector<TensorView> views;
    std::vector<std::vector<float>> payload;
    for (auto& [name, d] : deltas) {
      views.push_back(
          {name, name == "w" ? std::vector<int64_t>{2, 2} : std::vector<int64_t>{3}, d.data()});
      payload.push_back(d);
    }
    auto metas = BuildTensorMetas(fbb, views);
    Finish(fbb, wire::Body::PushRequest,
           wire::CreatePushRequest(fbb, fbb.CreateString("job"), fbb.CreateString(key), round, 10,
                                   metas)
               .Union());
    auto frames = std::make_shared<Frames>(MakeFrames(fbb, payload));
    Reply r = shard_->Handle(wire::Role::Worker, *frames, keep ? frames : nullptr);
    ISTHMUS_RETURN_IF_ERROR(Expect(r, wire::Body::PushReply));
    zmq::message_t m(r.header.GetBufferPointer(), r.header.GetSize());
    const auto* rs = (*ParseEnvelope(m, WireLimits{}))->body_as_PushReply()->rounds();
    return std::array<uint64_t, 3>{rs->local_round(), rs->committed_round(),
                                   rs->max_rounds_ahead()};
  }

  void OpenSynced(std::vector<std::string> peers, bool defer = false,
                  uint64_t synced_push_part_bytes = 0) {
    ShardOptions o;
    o.shard_id = "test";
    o.defer_round_work = defer;
    o.synced_push_part_bytes = synced_push_part_bytes;
    o.open_store = []() -> Result<std::unique_ptr<Store>> { return NewMemStore(); };
    SyncOptions so;
    so.site = "A";
    so.peer_sites = std::move(peers);
    so.outer_lr = 1.0;  // plain averaging: a commit adds the round's merged delta
    so.outer_momentum = 0.0;
    o.sync = so;
    auto s = Shard::Open(o);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    shard_ = std::move(s).value();
    ASSERT_NE(shard_->sync(), nullptr);
  }

  std::vector<float> w_{1, 2, 3, 4}, b_{0, 0, 0};
  std::unique_ptr<Shard> shard_;
};

TEST_F(ShardTest, PushAddsDeltaAndBumpsVersion) {
  ASSERT_TRUE(CreateJob().ok());
  uint64_t v0 = 0;
  EXPECT_EQ(Pull(0, &v0)["w"], w_);
  auto dup = Push("k1", {{"w", {0.5f, 0.5f, -1, 1}}});
  ASSERT_TRUE(dup.ok()) << dup.status().ToString();
  EXPECT_FALSE(*dup);
  uint64_t v1 = 0;
  auto now = Pull(0, &v1);
  EXPECT_EQ(now["w"], (std::vector<float>{1.5f, 2.5f, 2, 5}));
  EXPECT_EQ(now["b"], b_);
  EXPECT_EQ(v1, v0 + 1);
  auto newer = Pull(v0);
  EXPECT_EQ(newer.size(), 1u) << "only the changed tensor is newer";
  EXPECT_TRUE(newer.count("w"));
}

TEST_F(ShardTest, RetriedKeyIsAppliedOnce) {
  ASSERT_TRUE(CreateJob().ok());
  ASSERT_FALSE(*Push("same", {{"b", {1, 1, 1}}}));
  auto again = Push("same", {{"b", {1, 1, 1}}});
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(*again);
  EXPECT_EQ(Pull()["b"], (std::vector<float>{1, 1, 1}));
}

TEST_F(ShardTest, DedupWindowIsBounded) {
  Reopen(-1, 2);
  ASSERT_TRUE(CreateJob().ok());
  for (std::string k : {"k1", "k2", "k3"}) ASSERT_FALSE(*Push(k, {{"b", {1, 0, 0}}}));
  EXPECT_TRUE(*Push("k3", {{"b", {1, 0, 0}}}));   // still remembered
  EXPECT_FALSE(*Push("k1", {{"b", {1, 0, 0}}}));  // forgotten: applied again
  EXPECT_EQ(Pull()["b"][0], 4.0f);
}

TEST_F(ShardTest, BadPushesChangeNothing) {
  ASSERT_TRUE(CreateJob().ok());
  auto before = Pull();
  // NaN in one of two tensors: neither is applied.
  EXPECT_EQ(Push("nan", {{"b", {1, 1, 1}}, {"w", {0, std::nanf(""), 0, 0}}}).status().code(),
            Code::kInvalidArgument);
  EXPECT_EQ(Push("inf", {{"b", {INFINITY, 1, 1}}}).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(Push("shape", {{"b", {1, 1, 1, 1}}}).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(Push("name", {{"nope", {1}}}).status().code(), Code::kNotFound);
  EXPECT_EQ(Push("", {{"b", {1, 1, 1}}}).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(Push("admin", {{"b", {1, 1, 1}}}, wire::Role::Admin).status().code(),
            Code::kPermissionDenied);
  EXPECT_EQ(Pull(), before);
  // A refused key was not recorded: the same key with good data applies.
  EXPECT_FALSE(*Push("nan", {{"b", {1, 1, 1}}}));
  EXPECT_EQ(shard_->errors(), 6u);
}

// 5 Mi elements: past the size at which the shard splits the add over two threads. Every
// sum is exact, and a NaN in either half is refused with the state unchanged.
TEST_F(ShardTest, LargeTensorIsAddedExactlyAndCheckedInBothHalves) {
  const size_t n = size_t{5} << 20;
  w_.resize(n);
  for (size_t i = 0; i < n; ++i) w_[i] = static_cast<float>(i % 1000) * 0.25f;
  ASSERT_TRUE(CreateJob().ok());
  std::vector<float> d(n);
  for (size_t i = 0; i < n; ++i) d[i] = static_cast<float>(i % 7) - 3.0f;
  ASSERT_FALSE(*Push("k1", {{"w", d}}));
  const std::vector<float> after = Pull()["w"];
  ASSERT_EQ(after.size(), n);
  size_t wrong = 0;
  for (size_t i = 0; i < n; ++i) wrong += after[i] != w_[i] + d[i];
  EXPECT_EQ(wrong, 0u);
  for (size_t pos : {size_t{10}, n / 2 + 5, n - 1}) {
    auto bad = d;
    bad[pos] = std::nanf("");
    EXPECT_EQ(Push("nan" + std::to_string(pos), {{"w", bad}}).status().code(),
              Code::kInvalidArgument)
        << "NaN at " << pos;
    EXPECT_TRUE(Pull()["w"] == after) << "state changed by a refused push (NaN at " << pos << ")";
  }
}

TEST_F(ShardTest, DeltaThatOverflowsIsRefused) {
  ASSERT_TRUE(CreateJob().ok());
  ASSERT_FALSE(*Push("big", {{"w", {3e38f, 0, 0, 0}}}));
  auto before = Pull();
  EXPECT_EQ(Push("ovf", {{"w", {3e38f, 0, 0, 0}}}).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(Pull(), before);
}

TEST_F(ShardTest, GarbageHeaderGetsErrorReply) {
  ASSERT_TRUE(CreateJob().ok());
  Frames f;
  std::string junk = "definitely not a flatbuffer";
  f.header = zmq::message_t(junk.data(), junk.size());
  Reply r = shard_->Handle(wire::Role::Worker, f);
  EXPECT_TRUE(r.is_error);
  EXPECT_EQ(Expect(r, wire::Body::PushReply).code(), Code::kInvalidArgument);
}

TEST_F(ShardTest, StorageFailureLeavesMemoryUnchanged) {
  Reopen(1);  // the job create succeeds, the next write fails
  ASSERT_TRUE(CreateJob().ok());
  auto before = Pull();
  EXPECT_EQ(Push("k", {{"b", {1, 1, 1}}}).status().code(), Code::kIoError);
  EXPECT_EQ(Pull(), before);
}

TEST_F(ShardTest, AdminOnlyRequestsAreRefusedOnWorkerSocket) {
  EXPECT_EQ(CreateJob(wire::Role::Worker).code(), Code::kPermissionDenied);
  flatbuffers::FlatBufferBuilder fbb;
  Finish(fbb, wire::Body::StatsRequest, wire::CreateStatsRequest(fbb).Union());
  EXPECT_EQ(
      Expect(shard_->Handle(wire::Role::Worker, MakeFrames(fbb)), wire::Body::StatsReply).code(),
      Code::kPermissionDenied);
  EXPECT_TRUE(
      Expect(shard_->Handle(wire::Role::Admin, MakeFrames(fbb)), wire::Body::StatsReply).ok());
}

TEST_F(ShardTest, HelloChecksBaseHash) {
  ASSERT_TRUE(CreateJob().ok());
  auto hello = [&](const char* hash) {
    flatbuffers::FlatBufferBuilder fbb;
    Finish(fbb, wire::Body::Hello,
           wire::CreateHelloDirect(fbb, "job", wire::Role::Worker, hash, "t").Union());
    return Expect(shard_->Handle(wire::Role::Worker, MakeFrames(fbb)), wire::Body::HelloReply);
  };
  EXPECT_TRUE(hello("base1").ok());
  EXPECT_EQ(hello("other").code(), Code::kFailedPrecondition);
}

// A store that outlives the shards opened on it (each open borrows it).
struct Borrowed : Store {
  std::shared_ptr<Store> s;
  Status Write(const WriteBatch& b) override { return s->Write(b); }
  Result<std::optional<std::string>> Get(Column c, std::string_view k) override {
    return s->Get(c, k);
  }
  Status Scan(Column c, std::string_view p,
              const std::function<bool(std::string_view, std::string_view)>& f) override {
    return s->Scan(c, p, f);
  }
  Status Checkpoint(const std::string& d) override { return s->Checkpoint(d); }
  uint64_t ApproximateBytes() override { return 0; }
};

ShardOptions OnShared(std::shared_ptr<Store> shared) {
  ShardOptions o;
  o.open_store = [shared]() -> Result<std::unique_ptr<Store>> {
    auto b = std::make_unique<Borrowed>();
    b->s = shared;
    return std::unique_ptr<Store>(std::move(b));
  };
  return o;
}

// Every (column, key, value) of a store.
std::map<std::tuple<int, std::string>, std::string> Contents(Store& store) {
  std::map<std::tuple<int, std::string>, std::string> out;
  for (int c = 0; c < static_cast<int>(Column::kCount); ++c) {
    EXPECT_TRUE(store
                    .Scan(static_cast<Column>(c), "",
                          [&](std::string_view k, std::string_view v) {
                            out[{c, std::string(k)}] = std::string(v);
                            return true;
                          })
                    .ok());
  }
  return out;
}

TEST_F(ShardTest, StateSurvivesReopenOfTheSameStore) {
  std::shared_ptr<Store> shared(NewMemStore().release());
  ShardOptions o = OnShared(shared);
  shard_ = std::move(Shard::Open(o)).value();
  ASSERT_TRUE(CreateJob().ok());
  ASSERT_FALSE(*Push("k", {{"w", {1, 1, 1, 1}}}));
  auto before = Pull();
  shard_ = std::move(Shard::Open(o)).value();  // reload from the store alone
  EXPECT_EQ(Pull(), before);
  EXPECT_TRUE(*Push("k", {{"w", {1, 1, 1, 1}}})) << "idempotency keys persist";
}

// Each stored format, damaged, makes the shard's open fail with Corruption naming the
// record (never an exception or a crash), and the failed open writes nothing.
TEST_F(ShardTest, EachCorruptStoredRecordFailsTheOpenWithItsNameAndChangesNothing) {
  std::shared_ptr<Store> shared(NewMemStore().release());
  ShardOptions o = OnShared(shared);
  o.sync = SyncOptions{};
  o.sync->site = "A";
  shard_ = std::move(Shard::Open(o)).value();
  ASSERT_TRUE(CreateJob().ok());
  ASSERT_TRUE(PushRound("r1", 1, {{"w", {1, 1, 1, 1}}, {"b", {1, 1, 1}}}).ok());
  shard_.reset();
  const auto good = Contents(*shared);
  ASSERT_TRUE(good.count({static_cast<int>(Column::kSync), keys::JobKey("job", "job")}));

  struct Case {
    Column column;
    std::string key, value, named;
  };
  const std::vector<Case> cases = {
      {Column::kTensorMeta, keys::JobKey("job", "w"), "not json", "tensor record 'w'"},
      {Column::kTensorMeta, keys::JobKey("job", "w"), R"({"shape": "2x2"})", "tensor record 'w'"},
      {Column::kTensorMeta, keys::JobKey("job", "w"), R"({"shape": [4611686018427387904]})",
       "tensor record 'w'"},
      {Column::kTensorMeta, keys::JobKey("job", "w"), R"({"shape": [2, 2], "version": "v"})",
       "tensor record 'w'"},
      {Column::kTensors, keys::JobKey("job", "w"), "abc", "tensor 'w'"},
      {Column::kJobs, "job", "[1, 2]", "job record 'job'"},
      {Column::kJobs, "job", R"({"base_hash": 5})", "job record 'job'"},
      {Column::kSync, keys::JobKey("job", "job"), "{", "sync record of job 'job'"},
      {Column::kSync, keys::JobKey("job", "job"), R"({"committed": "one"})",
       "sync record of job 'job'"},
  };
  for (const auto& c : cases) {
    // Back to the good state, then damage one record.
    for (const auto& [ck, v] : good) {
      WriteBatch b;
      b.Put(static_cast<Column>(std::get<0>(ck)), std::get<1>(ck), v);
      ASSERT_TRUE(shared->Write(b).ok());
    }
    WriteBatch bad;
    bad.Put(c.column, c.key, c.value);
    ASSERT_TRUE(shared->Write(bad).ok());
    const auto damaged = Contents(*shared);
    auto s = Shard::Open(o);
    ASSERT_FALSE(s.ok()) << c.value;
    EXPECT_EQ(s.status().code(), Code::kCorruption) << c.value << ": " << s.status().ToString();
    EXPECT_NE(s.status().message().find(c.named), std::string::npos)
        << c.value << ": " << s.status().ToString();
    EXPECT_EQ(Contents(*shared), damaged) << c.value;
  }
}

// A synced job's tensors are held once, by the sync engine: describe reports the versions
// its commits made (it reported the creation's until a restart), as pulls do.
TEST_F(ShardTest, DescribeOfASyncedJobShowsTheCommittedVersions) {
  OpenSynced({});
  ASSERT_TRUE(CreateJob().ok());
  EXPECT_EQ(DescribeVersions(), (std::map<std::string, uint64_t>{{"b", 1}, {"w", 1}}));
  ASSERT_TRUE(PushRound("r1", 1, {{"w", {1, 1, 1, 1}}, {"b", {1, 1, 1}}}).ok());
  uint64_t served = 0;
  Pull(0, &served);
  ASSERT_GT(served, 1u);
  EXPECT_EQ(DescribeVersions(), (std::map<std::string, uint64_t>{{"b", served}, {"w", served}}));
}

// Creating a synced job is one write: when it fails nothing exists (no job record, no
// sync record); a retried create of the same job is answered as the first was, and a
// different create under the name is refused.
TEST_F(ShardTest, JobCreateIsAllOrNothingAndItsRetryIsIdempotent) {
  std::shared_ptr<Store> shared(NewMemStore(/*fail_after_writes=*/0).release());
  ShardOptions o = OnShared(shared);
  o.sync = SyncOptions{};
  o.sync->site = "A";
  shard_ = std::move(Shard::Open(o)).value();
  Status failed = CreateJob();
  EXPECT_EQ(failed.code(), Code::kIoError) << failed.ToString();
  EXPECT_TRUE(Contents(*shared).empty());
  EXPECT_FALSE(shard_->sync()->HasJob("job"));
  EXPECT_EQ(DescribeStatus().code(), Code::kNotFound);

  OpenSynced({});
  ASSERT_TRUE(CreateJob().ok());
  ASSERT_TRUE(PushRound("r1", 1, {{"w", {1, 1, 1, 1}}, {"b", {1, 1, 1}}}).ok());
  const auto after_round = Pull();
  EXPECT_TRUE(CreateJob().ok()) << "a retry (lost reply) of the same create";
  EXPECT_EQ(Pull(), after_round) << "the retry changed nothing";
  w_[0] += 1;  // another create under the same name
  EXPECT_EQ(CreateJob().code(), Code::kAlreadyExists);
}

// An idempotency key names one push: its retry is a duplicate (even with other values: a
// round redone from a checkpoint recomputes them, and the first attempt's count), the same
// key for another round or another set of tensors is refused and changes nothing. Seen
// before: a push that left out a tensor was staged, and the retry with the full set was
// answered "duplicate", so that shard never completed the round.
TEST_F(ShardTest, AKeyReusedForOtherContentIsRefusedNotTakenForARetry) {
  ASSERT_TRUE(CreateJob().ok());
  auto first = Push("k", {{"b", {1, 2, 3}}});
  ASSERT_TRUE(first.ok() && !*first) << first.status().ToString();
  auto retry = Push("k", {{"b", {1, 2, 3}}});
  ASSERT_TRUE(retry.ok() && *retry) << retry.status().ToString();
  auto redone = Push("k", {{"b", {1, 2, 4}}});
  ASSERT_TRUE(redone.ok() && *redone) << redone.status().ToString();
  auto other = Push("k", {{"b", {1, 2, 3}}, {"w", {1, 1, 1, 1}}});
  EXPECT_EQ(other.status().code(), Code::kFailedPrecondition) << other.status().ToString();
  EXPECT_NE(other.status().message().find("different push"), std::string::npos);
  EXPECT_EQ(Pull()["b"], (std::vector<float>{1, 2, 3}));

  OpenSynced({});
  ASSERT_TRUE(CreateJob().ok());
  ASSERT_TRUE(PushRound("r1", 1, {{"w", {1, 1, 1, 1}}}).ok());  // leaves out "b"
  auto full = PushRound("r1", 1, {{"w", {1, 1, 1, 1}}, {"b", {1, 1, 1}}});
  EXPECT_EQ(full.status().code(), Code::kFailedPrecondition) << full.status().ToString();
  EXPECT_NE(full.status().message().find("idempotency key 'r1'"), std::string::npos);
  // With its own key the rest completes the round.
  auto rest = PushRound("r1-b", 1, {{"b", {1, 1, 1}}});
  ASSERT_TRUE(rest.ok()) << rest.status().ToString();
  EXPECT_EQ((*rest)[1], 1u);
}

TEST_F(ShardTest, SyncWithoutPeersCommitsEachCompleteRound) {
  EXPECT_EQ(shard_->sync(), nullptr);  // off unless configured
  OpenSynced({});
  ASSERT_TRUE(CreateJob().ok());
  uint64_t v0 = 0;
  Pull(0, &v0);
  auto rs = PushRound("r1-w", 1, {{"w", {0.5f, 0.5f, -1, 1}}});
  ASSERT_TRUE(rs.ok()) << rs.status().ToString();
  EXPECT_EQ((*rs)[0], 0u);  // half a round: nothing closed
  uint64_t v = 0;
  EXPECT_EQ(Pull(0, &v)["w"], w_);
  EXPECT_EQ(v, v0);
  rs = PushRound("r1-b", 1, {{"b", {1, 2, 3}}});
  ASSERT_TRUE(rs.ok()) << rs.status().ToString();
  EXPECT_EQ((*rs)[0], 1u);
  EXPECT_EQ((*rs)[1], 1u);
  EXPECT_EQ((*rs)[2], SyncOptions{}.max_rounds_ahead);  // K, as configured
  auto now = Pull(0, &v);
  EXPECT_EQ(now["w"], (std::vector<float>{1.5f, 2.5f, 2, 5}));
  EXPECT_EQ(now["b"], (std::vector<float>{1, 2, 3}));
  EXPECT_GT(v, v0);
  EXPECT_TRUE(Pull(v).empty());
  // A retried key and a late push for a closed round are both duplicates.
  EXPECT_TRUE(*Push("r1-b", {{"b", {1, 2, 3}}}));
  EXPECT_TRUE(PushRound("other-key", 1, {{"b", {1, 2, 3}}}).ok());
  EXPECT_EQ(Pull()["b"], (std::vector<float>{1, 2, 3}));
  EXPECT_EQ(PushRound("r3", 3, {{"b", {1, 1, 1}}}).status().code(), Code::kFailedPrecondition);
  // Round 0 still adds at once without peers.
  ASSERT_TRUE(PushRound("r0", 0, {{"b", {1, 1, 1}}}).ok());
  EXPECT_EQ(Pull()["b"], (std::vector<float>{2, 3, 4}));
}

// A push in parts of "w" (key `key`, request id 1, `round`), and "b" in a frame when `b` is
// given: the request, which nothing answers until the last part.
Reply BeginPushInParts(Shard& shard, const std::string& key, uint64_t round = 0,
                       const std::vector<float>& b = {}) {
  flatbuffers::FlatBufferBuilder fbb;
  const std::vector<int64_t> shape{2, 2}, b_shape{3};
  std::vector<flatbuffers::Offset<wire::TensorMeta>> metas{
      wire::CreateTensorMetaDirect(fbb, "w", &shape, wire::DType::F32, 0, 16, 0)};
  if (!b.empty()) {
    metas.push_back(wire::CreateTensorMetaDirect(fbb, "b", &b_shape, wire::DType::F32, 0, 12, 0));
  }
  const std::vector<uint32_t> streamed{0};
  Finish(fbb, wire::Body::PushRequest,
         wire::CreatePushRequestDirect(fbb, "job", key.c_str(), round, 10, &metas, 0, &streamed)
             .Union());
  return shard.Handle(wire::Role::Worker,
                      MakeFrames(fbb, b.empty() ? std::vector<std::vector<float>>{}
                                                : std::vector<std::vector<float>>{b}));
}

// A part of "w" of the push under `key`, from element `first` on.
Reply PushPartOf(Shard& shard, const std::string& key, std::vector<float> values,
                 uint64_t first = 0) {
  flatbuffers::FlatBufferBuilder fbb;
  Finish(fbb, wire::Body::PushPart,
         wire::CreatePushPartDirect(fbb, "job", key.c_str(), 0, first * sizeof(float)).Union());
  return shard.Handle(wire::Role::Worker, MakeFrames(fbb, {values}));
}

uint64_t HelloPartBytes(Shard& shard) {
  flatbuffers::FlatBufferBuilder fbb;
  Finish(fbb, wire::Body::Hello,
         wire::CreateHelloDirect(fbb, "job", wire::Role::Worker, "", "t").Union());
  Reply r = shard.Handle(wire::Role::Worker, MakeFrames(fbb));
  zmq::message_t m(r.header.GetBufferPointer(), r.header.GetSize());
  auto env = ParseEnvelope(m, WireLimits{});
  EXPECT_TRUE(env.ok() && (*env)->body_type() == wire::Body::HelloReply);
  return env.ok() ? (*env)->body_as_HelloReply()->push_part_bytes() : 0;
}

// A synced job takes a round's push in parts when storage.synced_push_part_bytes says so:
// the engine gets it whole at the last part, and the round commits as the same push sent
// whole does (SyncWithoutPeersCommitsEachCompleteRound). By default its Hello says 0 (a
// plain job's says push_part_bytes) and parts are refused, naming what to do.
TEST_F(ShardTest, ASyncedJobTakesARoundInPartsWhenConfigured) {
  ASSERT_TRUE(CreateJob().ok());
  EXPECT_EQ(HelloPartBytes(*shard_), ShardOptions{}.push_part_bytes);
  EXPECT_GT(ShardOptions{}.push_part_bytes, 0u);
  OpenSynced({});
  ASSERT_TRUE(CreateJob().ok());
  EXPECT_EQ(HelloPartBytes(*shard_), 0u);
  Reply refused = BeginPushInParts(*shard_, "r1", 1, {1, 2, 3});
  EXPECT_TRUE(refused.send);
  Status s = Expect(refused, wire::Body::PushReply);
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("whole"), std::string::npos) << s.ToString();

  OpenSynced({}, false, 1024);
  ASSERT_TRUE(CreateJob().ok());
  EXPECT_EQ(HelloPartBytes(*shard_), 1024u);
  EXPECT_FALSE(BeginPushInParts(*shard_, "r1", 1, {1, 2, 3}).send);
  EXPECT_FALSE(PushPartOf(*shard_, "r1", {0.5f, 0.5f}).send);
  EXPECT_EQ(Pull()["w"], w_) << "nothing before the last part";
  Reply done = PushPartOf(*shard_, "r1", {-1, 1}, 2);
  ASSERT_TRUE(done.send);
  s = Expect(done, wire::Body::PushReply);
  ASSERT_TRUE(s.ok()) << s.ToString();
  auto now = Pull();
  EXPECT_EQ(now["w"], (std::vector<float>{1.5f, 2.5f, 2, 5}));
  EXPECT_EQ(now["b"], (std::vector<float>{1, 2, 3}));
  // The same round again, in parts: a duplicate at the request.
  Reply again = BeginPushInParts(*shard_, "r1", 1, {1, 2, 3});
  EXPECT_TRUE(again.send);
  EXPECT_TRUE(Expect(again, wire::Body::PushReply).ok());
  EXPECT_EQ(Pull()["b"], (std::vector<float>{1, 2, 3}));
}

// Pushes waiting for parts are bounded: past max_streamed_pushes the oldest is dropped, and
// its parts then answer nothing and change nothing; the others complete.
TEST_F(ShardTest, PushesWaitingForPartsAreBounded) {
  ASSERT_TRUE(CreateJob().ok());
  const size_t bound = ShardOptions{}.max_streamed_pushes;
  for (size_t i = 0; i <= bound; ++i) {
    Reply r = BeginPushInParts(*shard_, "k" + std::to_string(i));
    EXPECT_FALSE(r.send) << i << ": a push in parts is answered after its last part";
  }
  Reply dropped = PushPartOf(*shard_, "k0", {1, 1, 1, 1});
  EXPECT_FALSE(dropped.send);
  EXPECT_EQ(Pull()["w"], w_);
  Reply done = PushPartOf(*shard_, "k1", {1, 1, 1, 1});
  EXPECT_TRUE(done.send);
  ASSERT_TRUE(Expect(done, wire::Body::PushReply).ok());
  EXPECT_EQ(Pull()["w"], (std::vector<float>{2, 3, 4, 5}));
  // Its retry under the same key is a duplicate.
  Reply again = BeginPushInParts(*shard_, "k1");
  EXPECT_TRUE(again.send);
  ASSERT_TRUE(Expect(again, wire::Body::PushReply).ok());
  EXPECT_EQ(Pull()["w"], (std::vector<float>{2, 3, 4, 5}));

  // And by the bytes they hold: at most twice the largest payload (here 28 bytes: three
  // pushes of "w", 16 bytes each, fit in 56 and a fourth does not).
  ShardOptions o;
  o.limits.max_payload_bytes = 28;
  o.open_store = []() -> Result<std::unique_ptr<Store>> { return NewMemStore(); };
  auto small = Shard::Open(o);
  ASSERT_TRUE(small.ok());
  shard_ = std::move(small).value();
  ASSERT_TRUE(CreateJob().ok());
  for (const char* key : {"m0", "m1", "m2", "m3"}) {
    EXPECT_FALSE(BeginPushInParts(*shard_, key).send);
  }
  EXPECT_FALSE(PushPartOf(*shard_, "m0", {1, 1, 1, 1}).send) << "dropped for m3's bytes";
  EXPECT_EQ(Pull()["w"], w_);
  for (const char* key : {"m1", "m2", "m3"}) {
    Reply r = PushPartOf(*shard_, key, {1, 1, 1, 1});
    EXPECT_TRUE(r.send) << key;
    EXPECT_TRUE(Expect(r, wire::Body::PushReply).ok()) << key;
  }
  EXPECT_EQ(Pull()["w"], (std::vector<float>{4, 5, 6, 7}));
}

// With deferred round work (the server's mode) the push that completes a round is answered
// once the round is durable, as this site's (local round 1) but not closed or committed;
// RunDeferred then closes it from the request's own frames and commits, and pulls see it.
TEST_F(ShardTest, DeferredRoundWorkAnswersOnceDurableThenCloses) {
  OpenSynced({}, /*defer=*/true);
  ASSERT_TRUE(CreateJob().ok());
  auto rs = PushRound("r1", 1, {{"w", {0.5f, 0.5f, -1, 1}}, {"b", {1, 2, 3}}}, /*keep=*/true);
  ASSERT_TRUE(rs.ok()) << rs.status().ToString();
  EXPECT_EQ((*rs)[0], 1u);
  EXPECT_EQ((*rs)[1], 0u);
  EXPECT_EQ(shard_->sync()->LocalRound("job"), 0u);
  EXPECT_EQ(Pull()["w"], w_);
  EXPECT_EQ(shard_->DeferredRetryMs(), 0);
  ASSERT_TRUE(shard_->RunDeferred().ok());
  EXPECT_EQ(shard_->sync()->CommittedRound("job"), 1u);
  EXPECT_EQ(Pull()["w"], (std::vector<float>{1.5f, 2.5f, 2, 5}));
  EXPECT_EQ(Pull()["b"], (std::vector<float>{1, 2, 3}));
  EXPECT_EQ(shard_->DeferredRetryMs(), -1);
  // The retry of the same push is a duplicate; the next round goes on.
  EXPECT_TRUE(*Push("r1", {{"w", {0.5f, 0.5f, -1, 1}}, {"b", {1, 2, 3}}}));
  rs = PushRound("r2", 2, {{"w", {1, 1, 1, 1}}, {"b", {1, 1, 1}}}, /*keep=*/true);
  ASSERT_TRUE(rs.ok()) << rs.status().ToString();
  EXPECT_EQ((*rs)[0], 2u);
  ASSERT_TRUE(shard_->RunDeferred().ok());
  EXPECT_EQ(Pull()["b"], (std::vector<float>{2, 3, 4}));
}

TEST_F(ShardTest, SyncWithPeersWaitsForTheirDeltas) {
  OpenSynced({"B"});
  ASSERT_TRUE(CreateJob().ok());
  EXPECT_EQ(PushRound("r0", 0, {{"b", {1, 1, 1}}}).status().code(), Code::kFailedPrecondition);
  auto rs = PushRound("r1", 1, {{"w", {1, 1, 1, 1}}, {"b", {1, 1, 1}}});
  ASSERT_TRUE(rs.ok()) << rs.status().ToString();
  EXPECT_EQ((*rs)[0], 1u);
  EXPECT_EQ((*rs)[1], 0u);  // B's round 1 is not held
  EXPECT_EQ(shard_->sync()->OutboxHighRound("job"), 1u);
  auto st = shard_->sync()->JobStatus("job");
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->held.at("B"), 0u);
  // The optimistic view moves towards this site's own (encoded) delta.
  auto now = Pull();
  EXPECT_GT(now["w"][0] + now["w"][1] + now["w"][2] + now["w"][3], 10.0f);
}

}  // namespace
}  // namespace isthmus
