// A shard on a disk that fills up, as an operator meets it: its data dir is a small tmpfs
// (root only: the test mounts it itself and skips, saying so, elsewhere). Pushes are
// acknowledged until the disk is nearly full, then refused cleanly (ResourceExhausted
// naming the disk and the remedy, counted in the metrics); the shard stays up and serves
// pulls with every acknowledged push in them; it restarts on the still-full disk; and once
// space is freed it takes pushes again by itself, without a restart. Once with small
// tensors (through RocksDB's log) and once with tensors that live in slot files.
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "common/status.h"
#include "tests/integration/server_process.h"

namespace isthmus {
namespace {

using testing::ServerProcess;

uint64_t FreeBytes(const std::filesystem::path& p) {
  struct statvfs s {};
  return ::statvfs(p.c_str(), &s) == 0 ? uint64_t{s.f_bavail} * s.f_frsize : 0;
}

class DiskFullTest : public ::testing::TestWithParam<int64_t> {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root to mount a small tmpfs for the data dir";
    data_ = server_.dir() / "data";
    std::filesystem::create_directories(data_);
    const std::string opts = "size=" + std::to_string(kDiskBytes);
    if (::mount("tmpfs", data_.c_str(), "tmpfs", 0, opts.c_str()) != 0) {
      GTEST_SKIP() << "cannot mount a tmpfs here: " << std::strerror(errno);
    }
    mounted_ = true;
    server_.set_extra("[storage]\nmin_free_bytes = " + std::to_string(kMinFree) + "\n");
  }
  void TearDown() override {
    server_.Kill(SIGKILL);
    if (mounted_) ::umount2(data_.c_str(), MNT_DETACH);
  }

  static constexpr int64_t kDiskBytes = 24 << 20;
  static constexpr int64_t kMinFree = 1 << 20;
  ServerProcess server_;
  std::filesystem::path data_;
  bool mounted_ = false;
};

TEST_P(DiskFullTest, RefusesCleanlyServesPullsRestartsAndResumesWhenSpaceReturns) {
  const int64_t n = GetParam();  // elements per tensor
  ASSERT_TRUE(server_.Start());
  std::vector<float> zeros(static_cast<size_t>(n), 0.0f), ones(static_cast<size_t>(n), 1.0f);
  ASSERT_TRUE(server_.AdminClient()->CreateJob("j", "", {{"t", {n}, zeros.data()}}).ok());
  // Fill the disk but for a little room, with a file the test deletes later to give space
  // back: small tensors get about a hundred pushes' worth of log, a slot-file tensor less
  // than its second slot.
  const int64_t tensor_bytes = n * 4;
  const int64_t headroom = tensor_bytes < (1 << 20) ? (2 << 20) : kMinFree + tensor_bytes / 2;
  const int64_t filler = static_cast<int64_t>(FreeBytes(data_)) - headroom;
  ASSERT_GT(filler, 0);
  std::ofstream(data_ / "filler", std::ios::binary)
      << std::string(static_cast<size_t>(filler), 'x');
  auto w = server_.WorkerClient(10000, 0);
  // Push +1 with distinct keys until the shard refuses (bounded: the disk holds far fewer).
  int acked = 0;
  Status refused;
  for (int i = 0; i < 4000 && refused.ok(); ++i) {
    auto r = w->Push("j", "k" + std::to_string(i), 0, 1, {{"t", {n}, ones.data()}});
    if (r.ok()) {
      ++acked;
    } else {
      refused = r.status();
    }
  }
  ASSERT_FALSE(refused.ok()) << "the disk never filled after " << acked << " pushes";
  if (tensor_bytes < (1 << 20)) {
    EXPECT_GT(acked, 0);
  }
  EXPECT_EQ(refused.code(), Code::kResourceExhausted) << refused.ToString();
  EXPECT_NE(refused.message().find("disk"), std::string::npos) << refused.ToString();
  EXPECT_NE(refused.message().find("min_free_bytes"), std::string::npos) << refused.ToString();
  // Still up, and every acknowledged push is there (each added 1).
  auto check = [&](ShardClient& c, int expect) {
    auto p = c.Pull("j");
    ASSERT_TRUE(p.ok()) << p.status().ToString() << "\n" << server_.Log();
    ASSERT_EQ(p->tensors.size(), 1u);
    EXPECT_EQ(p->tensors[0].data.front(), static_cast<float>(expect));
    EXPECT_EQ(p->tensors[0].data.back(), static_cast<float>(expect));
  };
  check(*w, acked);
  // Refused again, the same way, not a crash.
  auto again = w->Push("j", "again", 0, 1, {{"t", {n}, ones.data()}});
  EXPECT_EQ(again.status().code(), Code::kResourceExhausted) << again.status().ToString();
  // A restart on a disk with less than the reserve left: it starts (read-only), serves
  // pulls, and still refuses.
  EXPECT_EQ(server_.Kill(SIGTERM), 0) << server_.Log();
  const int64_t topup = static_cast<int64_t>(FreeBytes(data_)) - kMinFree / 2;
  if (topup > 0) {
    std::ofstream(data_ / "filler2", std::ios::binary)
        << std::string(static_cast<size_t>(topup), 'x');
  }
  ASSERT_LT(FreeBytes(data_), static_cast<uint64_t>(kMinFree));
  ASSERT_TRUE(server_.Start()) << server_.Log();
  w = server_.WorkerClient(10000, 0);
  check(*w, acked);
  auto after = w->Push("j", "after-restart", 0, 1, {{"t", {n}, ones.data()}});
  EXPECT_EQ(after.status().code(), Code::kResourceExhausted) << after.status().ToString();
  // Space returns: pushes are taken again without a restart.
  std::filesystem::remove(data_ / "filler");
  std::filesystem::remove(data_ / "filler2");
  ASSERT_GT(FreeBytes(data_), static_cast<uint64_t>(kMinFree));
  auto resumed = w->Push("j", "resumed", 0, 1, {{"t", {n}, ones.data()}});
  ASSERT_TRUE(resumed.ok()) << resumed.status().ToString() << "\n" << server_.Log();
  check(*w, acked + 1);
  // The second start opened the store read-only, and the push after the space returned
  // reopened it for writes, each saying so in the log.
  const std::string log = server_.Log();
  EXPECT_NE(log.find("opened read-only"), std::string::npos) << log;
  EXPECT_NE(log.find("space is back"), std::string::npos) << log;
}

// 16 KiB tensors go through RocksDB's log and memtable; 2 MiB ones into slot files.
INSTANTIATE_TEST_SUITE_P(Sizes, DiskFullTest, ::testing::Values(int64_t{4096}, int64_t{1} << 19),
                         [](const auto& info) { return "n" + std::to_string(info.param); });

}  // namespace
}  // namespace isthmus
