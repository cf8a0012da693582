// Both Store implementations: atomic batches, gets, prefix scans, persistence across
// reopen (RocksDB), checkpoints.
#include <gtest/gtest.h>

#include "server/store.h"
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
  b.Put(Column::kTensors, JobKey("j", "w"), big);
  b.PutOwned(Column::kJobs, "j", "{}");
  ASSERT_TRUE(store().Write(b).ok());
  auto v = store().Get(Column::kTensors, JobKey("j", "w"));
  ASSERT_TRUE(v.ok());
  ASSERT_TRUE(v->has_value());
  EXPECT_EQ(**v, big);
  EXPECT_FALSE(store().Get(Column::kTensors, "j")->has_value()) << "columns are separate";
  WriteBatch d;
  d.Delete(Column::kJobs, "j");
  ASSERT_TRUE(store().Write(d).ok());
  EXPECT_FALSE(store().Get(Column::kJobs, "j")->has_value());
}

TEST_P(StoreTest, ScanStopsAtPrefixEnd) {
  WriteBatch b;
  for (const char* k : {"a", "b", "c"}) b.PutOwned(Column::kTensorMeta, JobKey("job1", k), k);
  b.PutOwned(Column::kTensorMeta, JobKey("job10", "z"), "z");  // shares "job1" as text prefix
  ASSERT_TRUE(store().Write(b).ok());
  std::vector<std::string> seen;
  ASSERT_TRUE(store().Scan(Column::kTensorMeta, JobKey("job1", ""), [&](auto k, auto v) {
    seen.emplace_back(v);
    return true;
  }).ok());
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
