// Both Store implementations: atomic batches, gets, prefix scans, persistence across
// reopen (RocksDB), checkpoints; the RocksDB store's slot files for large values of every
// column (reopen, checkpoint and restore, checksums, a batch that fails half-way) and its
// crash consistency under SIGKILL.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <set>
#include <thread>

#include "server/storage/keys.h"
#include "server/storage/store.h"
#include "tests/server/test_util.h"

namespace isthmus {
namespace {

class StoreTest : public ::testing::TestWithParam<bool> {  // true = RocksDB
 protected:
  std::unique_ptr<Store> OpenRocks() {
    auto s = OpenRocksStore((dir_.path() / "db").string(), StoreOptions{});
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return std::move(s).value();
  }
  Store& store() {
    if (!store_) store_ = GetParam() ? OpenRocks() : NewMemStore();
    return *store_;
  }
  testing::TempDir dir_;
  std::unique_ptr<Store> store_;
};

TEST_P(StoreTest, BatchPutGetDelete) {
  WriteBatch b;
  std::string big(1 << 20, 'x');
  b.Put(Column::kTensors, keys::JobKey("j", "w"), big);
  b.PutOwned(Column::kJobs, "j", "{}");
  ASSERT_TRUE(store().Write(b).ok());
  auto v = store().Get(Column::kTensors, keys::JobKey("j", "w"));
  ASSERT_TRUE(v.ok());
  ASSERT_TRUE(v->has_value());
  EXPECT_EQ(**v, big);
  EXPECT_FALSE(store().Get(Column::kTensors, "j")->has_value()) << "columns are separate";
  WriteBatch d;
  d.Delete(Column::kJobs, "j");
  ASSERT_TRUE(store().Write(d).ok());
  EXPECT_FALSE(store().Get(Column::kJobs, "j")->has_value());
}

// Stage, Fill and Apply write the batch and the small ops given at Apply as one write.
TEST_P(StoreTest, AStagedWriteIsAppliedWithTheOpsGivenAtApply) {
  WriteBatch old;
  old.PutOwned(Column::kTensors, keys::JobKey("j", "w"), std::string(1 << 20, 'o'));
  ASSERT_TRUE(store().Write(old).ok());
  WriteBatch b;
  const std::string big(1 << 20, 'n');
  b.Put(Column::kTensors, keys::JobKey("j", "w"), big);
  b.PutOwned(Column::kTensorMeta, keys::JobKey("j", "w"), "meta");
  auto staged = store().Stage(b);
  ASSERT_TRUE(staged.ok()) << staged.status().ToString();
  (*staged)->Fill();
  EXPECT_EQ(**store().Get(Column::kTensors, keys::JobKey("j", "w")), std::string(1 << 20, 'o'))
      << "nothing is visible before Apply";
  EXPECT_FALSE(store().Get(Column::kTensorMeta, keys::JobKey("j", "w"))->has_value());
  WriteBatch more;
  more.PutOwned(Column::kJobs, "j", "record");
  ASSERT_TRUE(store().Apply(std::move(*staged), more).ok());
  EXPECT_EQ(**store().Get(Column::kTensors, keys::JobKey("j", "w")), big);
  EXPECT_EQ(**store().Get(Column::kTensorMeta, keys::JobKey("j", "w")), "meta");
  EXPECT_EQ(**store().Get(Column::kJobs, "j"), "record");
}

TEST_P(StoreTest, ScanStopsAtPrefixEnd) {
  WriteBatch b;
  for (const char* k : {"a", "b", "c"}) b.PutOwned(Column::kTensorMeta, keys::JobKey("job1", k), k);
  b.PutOwned(Column::kTensorMeta, keys::JobKey("job10", "z"), "z");  // shares "job1" as text prefix
  ASSERT_TRUE(store().Write(b).ok());
  std::vector<std::string> seen;
  ASSERT_TRUE(store()
                  .Scan(Column::kTensorMeta, keys::JobKey("job1", ""),
                        [&](auto k, auto v) {
                          seen.emplace_back(v);
                          return true;
                        })
                  .ok());
  EXPECT_EQ(seen, (std::vector<std::string>{"a", "b", "c"}));
}

TEST_P(StoreTest, RocksStatePersistsAndCheckpoints) {
  if (!GetParam()) {
    EXPECT_EQ(store().Checkpoint(dir_.str() + "/cp").code(), Code::kFailedPrecondition);
    return;
  }
  WriteBatch b;
  b.PutOwned(Column::kJobs, "j", "v1");
  ASSERT_TRUE(store().Write(b).ok());
  ASSERT_TRUE(store().Checkpoint((dir_.path() / "cp").string()).ok());
  WriteBatch b2;
  b2.PutOwned(Column::kJobs, "j", "v2");
  ASSERT_TRUE(store().Write(b2).ok());
  store_.reset();
  store_ = OpenRocks();
  EXPECT_EQ(**store_->Get(Column::kJobs, "j"), "v2");
  auto cp = OpenRocksStore((dir_.path() / "cp").string(), StoreOptions{});
  ASSERT_TRUE(cp.ok());
  EXPECT_EQ(**(*cp)->Get(Column::kJobs, "j"), "v1");
  EXPECT_GT(store_->ApproximateBytes(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Impl, StoreTest, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "Rocks" : "Mem"; });

// `n` bytes from `rng`.
std::string RandomBytes(std::mt19937& rng, size_t n) {
  std::string v(n, '\0');
  for (auto& c : v) c = static_cast<char>(rng() & 0xff);
  return v;
}

// A synced RocksDB store in `db`, its slot files written with O_DIRECT or buffered; null
// (and a failed expectation) when it does not open.
std::unique_ptr<Store> OpenSynced(const std::filesystem::path& db, bool direct) {
  StoreOptions o;
  o.direct_slot_writes = direct;
  auto s = OpenRocksStore(db.string(), o);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return s.ok() ? std::move(s).value() : nullptr;
}

// A value of `bytes` bytes, every byte derived from `tag`.
std::string Pattern(size_t bytes, int tag) {
  std::string v(bytes, '\0');
  for (size_t i = 0; i < bytes; ++i) v[i] = static_cast<char>((tag * 131 + i / 4096) & 0xff);
  return v;
}

std::unique_ptr<Store> MustOpen(const std::string& dir, bool sync = true) {
  StoreOptions o;
  o.sync_writes = sync;
  auto s = OpenRocksStore(dir, o);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return s.ok() ? std::move(s).value() : nullptr;
}

Status PutTensor(Store& s, const std::string& key, const std::string& value) {
  WriteBatch b;
  b.Put(Column::kTensors, key, value);
  return s.Write(b);
}

int CountSlotFiles(const std::filesystem::path& db) {
  int n = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(db / "slots", ec))
    n += e.is_regular_file();
  return n;
}

const size_t kBig = 2 * kSlotFileMinBytes;

TEST(RocksSlotTest, LargeValuesSurviveReopenAndAlternateSlots) {
  testing::TempDir dir;
  const std::string db = (dir.path() / "db").string();
  auto store = MustOpen(db);
  for (int v = 1; v <= 3; ++v)
    ASSERT_TRUE(PutTensor(*store, keys::JobKey("j", "w"), Pattern(kBig, v)).ok());
  EXPECT_EQ(**store->Get(Column::kTensors, keys::JobKey("j", "w")), Pattern(kBig, 3));
  EXPECT_EQ(CountSlotFiles(db), 2) << "one key uses two slot files, reused";
  EXPECT_GE(store->ApproximateBytes(), 2 * kBig);
  store.reset();
  store = MustOpen(db);
  EXPECT_EQ(**store->Get(Column::kTensors, keys::JobKey("j", "w")), Pattern(kBig, 3));
  ASSERT_TRUE(PutTensor(*store, keys::JobKey("j", "w"), Pattern(kBig, 4)).ok());
  store.reset();
  store = MustOpen(db);
  EXPECT_EQ(**store->Get(Column::kTensors, keys::JobKey("j", "w")), Pattern(kBig, 4));
  // Shrinking below the threshold moves the value back inline and frees the slots.
  ASSERT_TRUE(PutTensor(*store, keys::JobKey("j", "w"), "small").ok());
  EXPECT_EQ(**store->Get(Column::kTensors, keys::JobKey("j", "w")), "small");
  EXPECT_EQ(CountSlotFiles(db), 0);
  ASSERT_TRUE(PutTensor(*store, keys::JobKey("j", "w"), Pattern(kBig, 5)).ok());
  EXPECT_EQ(**store->Get(Column::kTensors, keys::JobKey("j", "w")), Pattern(kBig, 5));
  WriteBatch d;
  d.Delete(Column::kTensors, keys::JobKey("j", "w"));
  ASSERT_TRUE(store->Write(d).ok());
  EXPECT_FALSE(store->Get(Column::kTensors, keys::JobKey("j", "w"))->has_value());
  EXPECT_EQ(CountSlotFiles(db), 0);
  store.reset();
  store = MustOpen(db);
  EXPECT_FALSE(store->Get(Column::kTensors, keys::JobKey("j", "w"))->has_value());
}

// A synced store writes slot files with O_DIRECT through an aligned buffer, 8 MiB at a time,
// the last block padded and the file cut back; without direct writes it goes through the
// page cache. Either way every byte reads back, before and after a reopen: values whose
// sizes are no multiple of the 4096-byte block, one over two buffers long, and a slot file
// reused by a shorter value (cut back to it, not left with the longer one's tail).
// A value written in prefixes as it is computed (StagedWrite::FillPrefix, a push that comes
// in parts), the rest by Fill, reads back whole with its checksum, direct and buffered, over
// pieces that do not fall on the writer's blocks; dropped half-way or superseded half-way it
// leaves the old value, in the process and after a reopen.
TEST(RocksSlotTest, AValueFilledInPrefixesReadsBackWhole) {
  std::mt19937 rng(5);
  auto random_value = [&](size_t n) { return RandomBytes(rng, n); };
  for (bool direct : {true, false}) {
    SCOPED_TRACE(direct ? "direct" : "buffered");
    testing::TempDir dir;
    const std::filesystem::path db = dir.path() / "db";
    auto open = [&] { return OpenSynced(db, direct); };
    const std::string key = keys::JobKey("j", "t"), small_key = keys::JobKey("j", "m");
    const std::string v1 = random_value(kSlotFileMinBytes + 77);
    auto store = open();
    ASSERT_NE(store, nullptr);
    {
      WriteBatch w;
      w.Put(Column::kTensors, key, v1);
      ASSERT_TRUE(store->Write(w).ok());
    }
    // Written in three prefixes and the rest (9 MiB + 3: past one 8 MiB block).
    const std::string v2 = random_value((size_t{9} << 20) + 3);
    {
      WriteBatch b;
      b.PutOwned(Column::kJobs, "j", "small, inline");
      b.Put(Column::kTensors, key, v2);
      auto staged = store->Stage(b);
      ASSERT_TRUE(staged.ok()) << staged.status().ToString();
      for (size_t ready : {size_t{4093}, size_t{5} << 20, (size_t{8} << 20) + 1}) {
        ASSERT_TRUE((*staged)->FillPrefix(1, ready).ok());
        ASSERT_TRUE((*staged)->FillPrefix(0, ready).ok()) << "a small value: nothing to do";
      }
      WriteBatch more;
      more.PutOwned(Column::kTensorMeta, small_key, "meta");
      ASSERT_TRUE(store->Apply(std::move(*staged), more).ok());
    }
    EXPECT_EQ(**store->Get(Column::kTensors, key), v2);
    EXPECT_EQ(**store->Get(Column::kTensorMeta, small_key), "meta");
    // Dropped after a prefix: the old value.
    const std::string v3 = random_value(size_t{3} << 20);
    {
      WriteBatch b;
      b.Put(Column::kTensors, key, v3);
      auto staged = store->Stage(b);
      ASSERT_TRUE(staged.ok());
      ASSERT_TRUE((*staged)->FillPrefix(0, size_t{1} << 20).ok());
    }
    EXPECT_EQ(**store->Get(Column::kTensors, key), v2);
    // Superseded after a prefix: the later write's value, and further prefixes write
    // nothing over it.
    const std::string v4 = random_value(size_t{2} << 20), v5 = random_value(size_t{2} << 20);
    {
      WriteBatch b;
      b.Put(Column::kTensors, key, v4);
      auto staged = store->Stage(b);
      ASSERT_TRUE(staged.ok());
      ASSERT_TRUE((*staged)->FillPrefix(0, size_t{1} << 20).ok());
      WriteBatch later;
      later.Put(Column::kTensors, key, v5);
      ASSERT_TRUE(store->Write(later).ok());
      ASSERT_TRUE((*staged)->FillPrefix(0, v4.size()).ok());
      EXPECT_EQ(store->Apply(std::move(*staged), WriteBatch{}).code(), Code::kFailedPrecondition);
    }
    EXPECT_EQ(**store->Get(Column::kTensors, key), v5);
    store.reset();
    store = open();
    ASSERT_NE(store, nullptr);
    EXPECT_EQ(**store->Get(Column::kTensors, key), v5);
    EXPECT_EQ(**store->Get(Column::kTensorMeta, small_key), "meta");
  }
}

TEST(RocksSlotTest, DirectAndBufferedSlotWritesReadBackEveryByte) {
  std::mt19937 rng(11);
  auto random_value = [&](size_t n) { return RandomBytes(rng, n); };
  for (bool direct : {true, false}) {
    SCOPED_TRACE(direct ? "direct" : "buffered");
    testing::TempDir dir;
    const std::filesystem::path db = dir.path() / "db";
    auto open = [&] { return OpenSynced(db, direct); };
    auto store = open();
    ASSERT_NE(store, nullptr);
    const std::string a = random_value(kSlotFileMinBytes + 123);
    const std::string b = random_value((size_t{17} << 20) + 5);  // three 8 MiB pieces
    std::string c;
    std::set<uint64_t> sizes;
    for (int round = 0; round < 3; ++round) {
      // The key alternates between two slot files: round 2 reuses round 0's, which held b.
      c = round == 2 ? random_value(kSlotFileMinBytes + 4095) : round == 0 ? b : a;
      WriteBatch w;
      w.Put(Column::kTensors, keys::JobKey("j", "x"), c);
      w.Put(Column::kTensors, keys::JobKey("j", "y"), round == 1 ? b : a);
      ASSERT_TRUE(store->Write(w).ok());
      EXPECT_EQ(**store->Get(Column::kTensors, keys::JobKey("j", "x")), c) << "round " << round;
      EXPECT_EQ(**store->Get(Column::kTensors, keys::JobKey("j", "y")), round == 1 ? b : a);
    }
    store.reset();
    store = open();
    ASSERT_NE(store, nullptr);
    EXPECT_EQ(**store->Get(Column::kTensors, keys::JobKey("j", "x")), c);
    EXPECT_EQ(**store->Get(Column::kTensors, keys::JobKey("j", "y")), a);
    // The files hold the values' bytes and no padding.
    for (const auto& e : std::filesystem::directory_iterator(db / "slots")) {
      if (e.is_regular_file()) sizes.insert(e.file_size());
    }
    EXPECT_TRUE(sizes.count(c.size()) == 1 && sizes.count(a.size()) == 1) << sizes.size();
    for (uint64_t n : sizes) {
      EXPECT_TRUE(n == a.size() || n == b.size() || n == c.size()) << n << " bytes";
    }
  }
}

// Rounds of tensor-sized state with a few bytes of bookkeeping in each batch (as a sync
// round writes them) keep the write-ahead logs near StoreOptions::max_wal_bytes: the
// bookkeeping columns are flushed instead of pinning every log.
TEST(RocksStoreWal, LogsStayNearTheirBoundUnderLargeBatches) {
  testing::TempDir dir;
  const std::filesystem::path db = dir.path() / "db";
  StoreOptions o;
  o.sync_writes = false;
  const uint64_t limit = uint64_t{4} << 20;
  o.max_wal_bytes = limit;
  auto opened = OpenRocksStore(db.string(), o);
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  auto store = std::move(opened).value();
  // Under kSlotFileMinBytes, so the values go through the log (larger ones go to slot files).
  const size_t value = kSlotFileMinBytes / 2;
  static_assert(kSlotFileMinBytes / 2 >= (256 << 10));
  const int rounds = 40;  // 20 MiB written, far under a large column's 256 MiB memtable
  for (int r = 0; r < rounds; ++r) {
    WriteBatch b;
    b.PutOwned(Column::kState, "e/w", Pattern(value, r));
    b.PutOwned(Column::kSync, "round", std::to_string(r));
    ASSERT_TRUE(store->Write(b).ok());
  }
  auto wal_bytes = [&] {
    uint64_t n = 0;
    for (const auto& e : std::filesystem::directory_iterator(db)) {
      if (e.path().extension() == ".log") n += e.file_size();
    }
    return n;
  };
  // RocksDB checks the bound before a write, and old logs go when the background flush it
  // starts ends; batches written while a flush is slow (a busy disk) stay above the bound
  // until the next write checks again. A server writes bookkeeping every round, so the
  // test does the same while it waits (up to 10 s): each tiny write re-checks the bound.
  const uint64_t bound = limit + 3 * value;
  uint64_t wal = wal_bytes();
  for (int i = 0; i < 200 && wal > bound; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    WriteBatch tick;
    tick.PutOwned(Column::kSync, "tick", std::to_string(i));
    ASSERT_TRUE(store->Write(tick).ok());
    wal = wal_bytes();
  }
  EXPECT_LE(wal, bound) << "write-ahead logs: " << wal << " bytes after " << rounds * value
                        << " written";
  EXPECT_EQ(**store->Get(Column::kState, "e/w"), Pattern(value, rounds - 1));
  EXPECT_EQ(**store->Get(Column::kSync, "round"), std::to_string(rounds - 1));
  store.reset();
  store = MustOpen(db.string(), false);
  EXPECT_EQ(**store->Get(Column::kState, "e/w"), Pattern(value, rounds - 1));
}

TEST(RocksSlotTest, ScanMergesSlotAndInlineValuesInKeyOrder) {
  testing::TempDir dir;
  auto store = MustOpen((dir.path() / "db").string(), false);
  WriteBatch b;
  std::string big_b = Pattern(kBig, 7), big_d = Pattern(kBig, 8);
  b.Put(Column::kTensors, keys::JobKey("j", "a"), "inline-a");
  b.Put(Column::kTensors, keys::JobKey("j", "b"), big_b);
  b.Put(Column::kTensors, keys::JobKey("j", "c"), "inline-c");
  b.Put(Column::kTensors, keys::JobKey("j", "d"), big_d);
  b.Put(Column::kTensors, keys::JobKey("k", "a"), big_d);  // other prefix
  ASSERT_TRUE(store->Write(b).ok());
  std::vector<std::string> keys;
  std::vector<size_t> sizes;
  ASSERT_TRUE(store
                  ->Scan(Column::kTensors, keys::JobKey("j", ""),
                         [&](auto k, auto v) {
                           keys.emplace_back(k.substr(2));
                           sizes.push_back(v.size());
                           return true;
                         })
                  .ok());
  EXPECT_EQ(keys, (std::vector<std::string>{"a", "b", "c", "d"}));
  EXPECT_EQ(sizes, (std::vector<size_t>{8, kBig, 8, kBig}));
  // Other columns never see slot records.
  int jobs = 0;
  ASSERT_TRUE(store->Scan(Column::kJobs, "", [&](auto, auto) { return ++jobs, true; }).ok());
  EXPECT_EQ(jobs, 0);
}

TEST(RocksSlotTest, CheckpointKeepsItsSlotsWhileTheLiveStoreMovesOn) {
  testing::TempDir dir;
  const auto db = dir.path() / "db";
  auto store = MustOpen(db.string());
  ASSERT_TRUE(PutTensor(*store, keys::JobKey("j", "w"), Pattern(kBig, 1)).ok());
  ASSERT_TRUE(store->Checkpoint((dir.path() / "cp").string()).ok());
  // Two more writes touch both slots, including the one the checkpoint links to.
  ASSERT_TRUE(PutTensor(*store, keys::JobKey("j", "w"), Pattern(kBig, 2)).ok());
  ASSERT_TRUE(PutTensor(*store, keys::JobKey("j", "w"), Pattern(kBig, 3)).ok());
  EXPECT_EQ(**store->Get(Column::kTensors, keys::JobKey("j", "w")), Pattern(kBig, 3));
  {
    auto cp = MustOpen((dir.path() / "cp").string());
    EXPECT_EQ(**cp->Get(Column::kTensors, keys::JobKey("j", "w")), Pattern(kBig, 1));
  }
  // Restore as the server does: copy the checkpoint folder over the live one.
  store.reset();
  std::filesystem::remove_all(db);
  std::filesystem::copy(dir.path() / "cp", db, std::filesystem::copy_options::recursive);
  store = MustOpen(db.string());
  EXPECT_EQ(**store->Get(Column::kTensors, keys::JobKey("j", "w")), Pattern(kBig, 1));
  ASSERT_TRUE(PutTensor(*store, keys::JobKey("j", "w"), Pattern(kBig, 4)).ok());
  EXPECT_EQ(**store->Get(Column::kTensors, keys::JobKey("j", "w")), Pattern(kBig, 4));
}

TEST(RocksSlotTest, DamagedSlotFileIsCorruption) {
  testing::TempDir dir;
  const auto db = dir.path() / "db";
  auto store = MustOpen(db.string());
  ASSERT_TRUE(PutTensor(*store, keys::JobKey("j", "w"), Pattern(kBig, 1)).ok());
  store.reset();
  int damaged = 0;
  for (const auto& e : std::filesystem::directory_iterator(db / "slots")) {
    std::fstream f(e.path(), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(12345);
    f.put('\x5a');
    ++damaged;
  }
  ASSERT_EQ(damaged, 1);
  store = MustOpen(db.string());
  auto v = store->Get(Column::kTensors, keys::JobKey("j", "w"));
  EXPECT_EQ(v.status().code(), Code::kCorruption);
}

// The round protocol's large values (residuals, staged deltas, momentum in kState; encoded
// deltas in kDeltas) go to slot files as kTensors' do: not through the write-ahead log,
// back after a reopen, and their files gone with the key.
TEST(RocksSlotTest, SyncColumnsKeepLargeValuesInSlotFiles) {
  testing::TempDir dir;
  const auto db = dir.path() / "db";
  auto store = MustOpen(db.string());
  auto wal_bytes = [&] {
    uint64_t n = 0;
    for (const auto& e : std::filesystem::directory_iterator(db)) {
      if (e.path().extension() == ".log") n += e.file_size();
    }
    return n;
  };
  const uint64_t wal_before = wal_bytes();
  for (int r = 1; r <= 3; ++r) {
    WriteBatch b;
    b.PutOwned(Column::kState, keys::StateKey("j", keys::StateKind::kResidual, "w"),
               Pattern(kBig, r));
    b.PutOwned(Column::kDeltas, keys::DeltaKey("j", "alpha", r), Pattern(kBig, 10 + r));
    b.PutOwned(Column::kSync, keys::SyncRecordKey("j"), std::to_string(r));
    if (r > 1) b.Delete(Column::kDeltas, keys::DeltaKey("j", "alpha", r - 1));
    ASSERT_TRUE(store->Write(b).ok());
  }
  EXPECT_LT(wal_bytes() - wal_before, kSlotFileMinBytes) << "large values went through the log";
  // The residual's two reused slots and the one live delta's.
  EXPECT_EQ(CountSlotFiles(db), 3);
  EXPECT_EQ(store->Metrics().slot_bytes, 2 * kBig);
  store.reset();
  store = MustOpen(db.string());
  EXPECT_EQ(**store->Get(Column::kState, keys::StateKey("j", keys::StateKind::kResidual, "w")),
            Pattern(kBig, 3));
  EXPECT_EQ(**store->Get(Column::kDeltas, keys::DeltaKey("j", "alpha", 3)), Pattern(kBig, 13));
  EXPECT_FALSE(store->Get(Column::kDeltas, keys::DeltaKey("j", "alpha", 2))->has_value());
  // The same key in another column is another value.
  EXPECT_FALSE(store->Get(Column::kTensors, keys::DeltaKey("j", "alpha", 3))->has_value());
  WriteBatch d;
  d.Delete(Column::kDeltas, keys::DeltaKey("j", "alpha", 3));
  d.Delete(Column::kState, keys::StateKey("j", keys::StateKind::kResidual, "w"));
  ASSERT_TRUE(store->Write(d).ok());
  EXPECT_EQ(CountSlotFiles(db), 0);
  store.reset();
  store = MustOpen(db.string());
  EXPECT_FALSE(store->Get(Column::kDeltas, keys::DeltaKey("j", "alpha", 3))->has_value());
  EXPECT_EQ(store->Metrics().slot_bytes, 0u);
}

// A batch whose second large value cannot be written (its slot file's path is blocked)
// changes nothing: the first value's new slot was written but never committed, so every
// key reads its old value, before and after a reopen; once the path is free it goes
// through.
TEST(RocksSlotTest, BatchFailingHalfWayLeavesTheOldValues) {
  testing::TempDir dir;
  const auto db = dir.path() / "db";
  auto store = MustOpen(db.string());
  const std::string e_key = keys::StateKey("j", keys::StateKind::kResidual, "w");
  const std::string m_key = keys::StateKey("j", keys::StateKind::kMomentum, "w");
  auto round = [&](int r) {
    WriteBatch b;
    b.PutOwned(Column::kState, e_key, Pattern(kBig, r));
    b.PutOwned(Column::kState, m_key, Pattern(kBig, 100 + r));
    b.PutOwned(Column::kDeltas, keys::DeltaKey("j", "alpha", r), Pattern(kBig, 200 + r));
    b.PutOwned(Column::kSync, keys::SyncRecordKey("j"), std::to_string(r));
    return store->Write(b);
  };
  auto expect_round = [&](int r) {
    EXPECT_EQ(**store->Get(Column::kSync, keys::SyncRecordKey("j")), std::to_string(r));
    EXPECT_EQ(**store->Get(Column::kState, e_key), Pattern(kBig, r));
    EXPECT_EQ(**store->Get(Column::kState, m_key), Pattern(kBig, 100 + r));
    EXPECT_FALSE(store->Get(Column::kDeltas, keys::DeltaKey("j", "alpha", r + 1))->has_value());
  };
  ASSERT_TRUE(round(1).ok());
  // Slot ids follow the batch's order: e is file 1, m file 2. Round 2 writes their "b"
  // slots; block m's, so e's is written and m's fails.
  const auto blocker = db / "slots" / "0000000000000002.b";
  std::filesystem::create_directory(blocker);
  const Status failed = round(2);
  EXPECT_FALSE(failed.ok());
  expect_round(1);
  store.reset();
  store = MustOpen(db.string());
  expect_round(1);
  std::filesystem::remove(blocker);
  ASSERT_TRUE(round(2).ok());
  expect_round(2);
  EXPECT_EQ(**store->Get(Column::kDeltas, keys::DeltaKey("j", "alpha", 2)), Pattern(kBig, 202));
}

// A staged write's large values are filled on another thread while the store's thread
// writes, reads and checkpoints other keys; the staged keys read their old values (or
// none) until Apply, which commits them with its record; after a reopen they are there.
TEST(RocksSlotTest, AStagedWriteFillsOnAnotherThreadWhileTheStoreGoesOn) {
  testing::TempDir dir;
  const auto db = dir.path() / "db";
  auto store = MustOpen(db.string());
  const std::string t_key = keys::JobKey("j", "t"), m_key = keys::JobKey("j", "m");
  const std::string other = keys::JobKey("j", "other");
  ASSERT_TRUE(PutTensor(*store, t_key, Pattern(kBig, 1)).ok());
  WriteBatch b;
  const std::string t2 = Pattern(kBig, 2), m2 = Pattern(3 * kBig, 3);
  b.Put(Column::kTensors, t_key, t2);
  b.Put(Column::kState, m_key, m2);  // a key with no value yet
  auto staged = store->Stage(b);
  ASSERT_TRUE(staged.ok()) << staged.status().ToString();
  std::thread filler([&] { (*staged)->Fill(); });
  for (int v = 10; v < 14; ++v) ASSERT_TRUE(PutTensor(*store, other, Pattern(kBig, v)).ok());
  EXPECT_EQ(**store->Get(Column::kTensors, t_key), Pattern(kBig, 1));
  EXPECT_FALSE(store->Get(Column::kState, m_key)->has_value());
  ASSERT_TRUE(store->Checkpoint((dir.path() / "cp").string()).ok());
  filler.join();
  EXPECT_EQ(**store->Get(Column::kTensors, t_key), Pattern(kBig, 1)) << "filled, not applied";
  WriteBatch more;
  more.PutOwned(Column::kJobs, "j", "2");
  ASSERT_TRUE(store->Apply(std::move(*staged), more).ok());
  EXPECT_EQ(**store->Get(Column::kTensors, t_key), t2);
  EXPECT_EQ(**store->Get(Column::kState, m_key), m2);
  EXPECT_EQ(**store->Get(Column::kTensors, other), Pattern(kBig, 13));
  store.reset();
  store = MustOpen(db.string());
  EXPECT_EQ(**store->Get(Column::kTensors, t_key), t2);
  EXPECT_EQ(**store->Get(Column::kState, m_key), m2);
  EXPECT_EQ(**store->Get(Column::kJobs, "j"), "2");
  EXPECT_EQ(CountSlotFiles(db), 2 + 1 + 2) << "t's two slots, m's one, other's two";
  // The checkpoint taken while it filled holds the old values.
  auto cp = MustOpen((dir.path() / "cp").string());
  EXPECT_EQ(**cp->Get(Column::kTensors, t_key), Pattern(kBig, 1));
  EXPECT_FALSE(cp->Get(Column::kState, m_key)->has_value());
}

// Helper of AStagedWriteNotAppliedLeavesTheOldValues, run in a process of its own: stages
// and fills that test's batch in the store it names, and exits without applying it.
TEST(RocksSlotTest, StagedChild) {
  const char* db = std::getenv("ISTHMUS_STAGED_CHILD_DIR");
  if (db == nullptr)
    GTEST_SKIP() << "helper of RocksSlotTest.AStagedWriteNotAppliedLeavesTheOldValues";
  auto store = MustOpen(db);
  if (store == nullptr) std::_Exit(2);
  const std::string t2 = Pattern(kBig, 2), n2 = Pattern(kBig, 3);
  WriteBatch b;
  b.Put(Column::kTensors, keys::JobKey("j", "t"), t2);
  b.Put(Column::kTensors, keys::JobKey("j", "new"), n2);
  auto staged = store->Stage(b);
  if (!staged.ok()) std::_Exit(3);
  (*staged)->Fill();
  std::_Exit(42);  // filled: the parent checks for this code
}

// A staged write dropped before Apply (filled or not), or lost with its process after the
// fill, leaves the old values and no slot file of its own; a write of one of its keys in
// between supersedes it: Apply then writes nothing.
TEST(RocksSlotTest, AStagedWriteNotAppliedLeavesTheOldValues) {
  testing::TempDir dir;
  const auto db = dir.path() / "db";
  const std::string t_key = keys::JobKey("j", "t"), n_key = keys::JobKey("j", "new");
  {
    auto store = MustOpen(db.string());
    ASSERT_TRUE(PutTensor(*store, t_key, Pattern(kBig, 1)).ok());
  }
  const int files = CountSlotFiles(db);
  WriteBatch b;
  const std::string t2 = Pattern(kBig, 2), n2 = Pattern(kBig, 3);
  b.Put(Column::kTensors, t_key, t2);
  b.Put(Column::kTensors, n_key, n2);
  auto expect_old = [&](const char* what) {
    auto store = MustOpen(db.string());
    EXPECT_EQ(**store->Get(Column::kTensors, t_key), Pattern(kBig, 1)) << what;
    EXPECT_FALSE(store->Get(Column::kTensors, n_key)->has_value()) << what;
    EXPECT_EQ(CountSlotFiles(db), files + 1) << what << ": t's other slot stays, new's goes";
  };
  for (bool fill : {false, true}) {
    auto store = MustOpen(db.string());
    auto staged = store->Stage(b);
    ASSERT_TRUE(staged.ok());
    if (fill) (*staged)->Fill();
    staged->reset();
  }
  expect_old("dropped");
  // The process dies after the fill, before Apply (as a SIGKILL would): a fresh process
  // (RocksSlotTest.StagedChild) stages the same batch, fills it and exits.
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::setenv("ISTHMUS_STAGED_CHILD_DIR", db.c_str(), 1);
    ::execl("/proc/self/exe", "staged_child", "--gtest_filter=RocksSlotTest.StagedChild",
            static_cast<char*>(nullptr));
    std::_Exit(127);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 42)
      << "the child did not fill: " << status;
  expect_old("lost with its process");
  // Superseded: a later write of t, while the fill runs or after it.
  for (bool filled_first : {false, true}) {
    auto store = MustOpen(db.string());
    auto staged = store->Stage(b);
    ASSERT_TRUE(staged.ok());
    std::thread filler;
    if (filled_first) {
      (*staged)->Fill();
    } else {
      filler = std::thread([&] { (*staged)->Fill(); });
    }
    ASSERT_TRUE(PutTensor(*store, t_key, Pattern(kBig, 4)).ok());
    if (filler.joinable()) filler.join();
    const Status applied = store->Apply(std::move(*staged), WriteBatch{});
    EXPECT_EQ(applied.code(), Code::kFailedPrecondition) << applied.ToString();
    EXPECT_EQ(**store->Get(Column::kTensors, t_key), Pattern(kBig, 4));
    EXPECT_FALSE(store->Get(Column::kTensors, n_key)->has_value());
    store.reset();
    store = MustOpen(db.string());
    EXPECT_EQ(**store->Get(Column::kTensors, t_key), Pattern(kBig, 4));
    EXPECT_FALSE(store->Get(Column::kTensors, n_key)->has_value());
    EXPECT_EQ(CountSlotFiles(db), files + 1);
  }
}

TEST(RocksSlotTest, CheckpointKeepsTheSyncColumnsSlots) {
  testing::TempDir dir;
  const auto db = dir.path() / "db";
  auto store = MustOpen(db.string());
  const std::string e_key = keys::StateKey("j", keys::StateKind::kResidual, "w");
  auto put = [&](int v) {
    WriteBatch b;
    b.PutOwned(Column::kState, e_key, Pattern(kBig, v));
    b.PutOwned(Column::kDeltas, keys::DeltaKey("j", "alpha", 1), Pattern(kBig, 50 + v));
    return store->Write(b);
  };
  ASSERT_TRUE(put(1).ok());
  ASSERT_TRUE(store->Checkpoint((dir.path() / "cp").string()).ok());
  ASSERT_TRUE(put(2).ok());
  ASSERT_TRUE(put(3).ok());
  WriteBatch d;
  d.Delete(Column::kDeltas, keys::DeltaKey("j", "alpha", 1));
  ASSERT_TRUE(store->Write(d).ok());
  EXPECT_EQ(**store->Get(Column::kState, e_key), Pattern(kBig, 3));
  auto cp = MustOpen((dir.path() / "cp").string());
  EXPECT_EQ(**cp->Get(Column::kState, e_key), Pattern(kBig, 1));
  EXPECT_EQ(**cp->Get(Column::kDeltas, keys::DeltaKey("j", "alpha", 1)), Pattern(kBig, 51));
}

// Scans of every column merge its slot-held and inline values in key order and see no
// other column's.
TEST(RocksSlotTest, ScanOfASyncColumnMergesSlotAndInlineValues) {
  testing::TempDir dir;
  auto store = MustOpen((dir.path() / "db").string(), false);
  WriteBatch b;
  const std::string big = Pattern(kBig, 9);
  for (int r = 1; r <= 4; ++r) {
    // Rounds 2 and 4 large, 1 and 3 inline.
    b.PutOwned(Column::kDeltas, keys::DeltaKey("j", "alpha", r),
               r % 2 == 0 ? big : "small-" + std::to_string(r));
  }
  b.PutOwned(Column::kDeltas, keys::DeltaKey("j", "beta", 1), big);    // other prefix
  b.PutOwned(Column::kTensors, keys::DeltaKey("j", "alpha", 5), big);  // other column
  b.PutOwned(Column::kState, keys::DeltaKey("j", "alpha", 6), big);    // other column
  ASSERT_TRUE(store->Write(b).ok());
  std::vector<uint64_t> rounds;
  std::vector<size_t> sizes;
  const std::string prefix = keys::DeltaPrefix("j", "alpha");
  ASSERT_TRUE(store
                  ->Scan(Column::kDeltas, prefix,
                         [&](std::string_view k, std::string_view v) {
                           rounds.push_back(keys::FromBigEndian64(k.substr(prefix.size())));
                           sizes.push_back(v.size());
                           return true;
                         })
                  .ok());
  EXPECT_EQ(rounds, (std::vector<uint64_t>{1, 2, 3, 4}));
  EXPECT_EQ(sizes, (std::vector<size_t>{7, kBig, 7, kBig}));
  // ScanKeys: the same keys in the same order, stopping when told, without the values.
  std::vector<uint64_t> keys_only;
  ASSERT_TRUE(store
                  ->ScanKeys(Column::kDeltas, prefix,
                             [&](std::string_view k) {
                               keys_only.push_back(keys::FromBigEndian64(k.substr(prefix.size())));
                               return keys_only.size() < 3;
                             })
                  .ok());
  EXPECT_EQ(keys_only, (std::vector<uint64_t>{1, 2, 3}));
}

// The writer half of the crash test, run in a child process started by the test below
// (ISTHMUS_STORE_CRASH_DIR names its store). Skipped when run on its own.
TEST(RocksSlotCrashTest, ChildWriter) {
  const char* db = std::getenv("ISTHMUS_STORE_CRASH_DIR");
  if (db == nullptr) GTEST_SKIP() << "helper of RocksSlotCrashTest.KillMidWrites";
  auto store = MustOpen(db);
  ASSERT_NE(store, nullptr);
  int i = 0;
  auto rec = store->Get(Column::kJobs, "j");
  if (rec.ok() && rec->has_value()) i = std::stoi(**rec);
  while (true) {
    ++i;
    // As a round writes them: a tensor, a residual, a new delta and the removal of an old
    // one, with a small record, in one batch.
    std::string value = Pattern(kBig, i), counter = std::to_string(i);
    std::string residual = Pattern(kBig, 1000 + i), delta = Pattern(kBig, 2000 + i);
    WriteBatch b;
    b.Put(Column::kTensors, keys::JobKey("j", "w"), value);
    b.Put(Column::kState, keys::StateKey("j", keys::StateKind::kResidual, "w"), residual);
    b.Put(Column::kDeltas, keys::DeltaKey("j", "alpha", i), delta);
    if (i > 2) b.Delete(Column::kDeltas, keys::DeltaKey("j", "alpha", i - 2));
    b.Put(Column::kJobs, "j", counter);
    if (!store->Write(b).ok()) std::_Exit(3);
    // Acknowledge: this write is durable from here on.
    if (::write(3, &i, sizeof(i)) != sizeof(i)) std::_Exit(4);
  }
}

TEST(RocksSlotCrashTest, KillMidWrites) {
  testing::TempDir dir;
  const std::string db = (dir.path() / "db").string();
  int last_acked = 0;
  for (int round = 0; round < 4; ++round) {
    int fds[2];
    ASSERT_EQ(::pipe(fds), 0);
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::dup2(fds[1], 3);
      int null_fd = ::open("/dev/null", O_WRONLY);
      if (null_fd >= 0) ::dup2(null_fd, 1);
      ::setenv("ISTHMUS_STORE_CRASH_DIR", db.c_str(), 1);
      ::execl("/proc/self/exe", "store_crash_child",
              "--gtest_filter=RocksSlotCrashTest.ChildWriter", static_cast<char*>(nullptr));
      std::_Exit(127);
    }
    ::close(fds[1]);
    // Let it acknowledge a few writes, then kill it at a varying point of the next one.
    int acked = 0, v = 0;
    while (acked < 3 + round && ::read(fds[0], &v, sizeof(v)) == sizeof(v)) ++acked, last_acked = v;
    std::this_thread::sleep_for(std::chrono::microseconds(700 * round));
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    while (::read(fds[0], &v, sizeof(v)) == sizeof(v)) last_acked = v;
    ::close(fds[0]);
    ASSERT_TRUE(WIFSIGNALED(status)) << "the writer exited by itself: " << status;
    ASSERT_GE(acked, 3 + round) << "the writer acknowledged too few writes";

    auto store = MustOpen(db);
    ASSERT_NE(store, nullptr);
    auto rec = store->Get(Column::kJobs, "j");
    ASSERT_TRUE(rec.ok() && rec->has_value());
    int committed = std::stoi(**rec);
    EXPECT_GE(committed, last_acked) << "an acknowledged write was lost";
    EXPECT_LE(committed, last_acked + 1);
    auto value = store->Get(Column::kTensors, keys::JobKey("j", "w"));
    ASSERT_TRUE(value.ok()) << value.status().ToString();
    ASSERT_TRUE(value->has_value());
    EXPECT_TRUE(**value == Pattern(kBig, committed)) << "tensor and record of one batch differ";
    auto residual =
        store->Get(Column::kState, keys::StateKey("j", keys::StateKind::kResidual, "w"));
    ASSERT_TRUE(residual.ok() && residual->has_value()) << residual.status().ToString();
    EXPECT_TRUE(**residual == Pattern(kBig, 1000 + committed)) << "residual and record differ";
    std::vector<uint64_t> held;
    ASSERT_TRUE(store
                    ->Scan(Column::kDeltas, keys::DeltaPrefix("j", "alpha"),
                           [&](std::string_view k, std::string_view v) {
                             const uint64_t r = keys::FromBigEndian64(k.substr(k.size() - 8));
                             EXPECT_TRUE(v == Pattern(kBig, 2000 + static_cast<int>(r)));
                             held.push_back(r);
                             return true;
                           })
                    .ok());
    std::vector<uint64_t> want;
    for (int r = std::max(1, committed - 1); r <= committed; ++r) want.push_back(r);
    EXPECT_EQ(held, want) << "the deltas of the committed batch, and only those";
  }
}

TEST(MemStoreTest, InjectedFailureAppliesNothing) {
  auto s = NewMemStore(1);
  WriteBatch ok;
  ok.PutOwned(Column::kJobs, "a", "1");
  ASSERT_TRUE(s->Write(ok).ok());
  WriteBatch fail;
  fail.PutOwned(Column::kJobs, "a", "2");
  fail.PutOwned(Column::kJobs, "b", "2");
  EXPECT_EQ(s->Write(fail).code(), Code::kIoError);
  EXPECT_EQ(**s->Get(Column::kJobs, "a"), "1");
  EXPECT_FALSE(s->Get(Column::kJobs, "b")->has_value());
}

}  // namespace
}  // namespace isthmus
