// Tests of common/direct_file: every byte appended reads back, in pieces of any size and
// alignment, written out piece by piece or not, with O_DIRECT and without, over an older
// longer file, from a non-zero start.
#include "common/direct_file.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "tests/test_dir.h"

namespace isthmus {
namespace {

class DirectFileTest : public testing::TestWithDir {
 protected:
  DirectFileTest() : TestWithDir("isthmus_direct") {}

  static std::string Random(size_t n, uint32_t seed) {
    std::mt19937_64 rng(seed);
    std::string s(n, '\0');
    for (size_t i = 0; i < n; i += 8) {
      const uint64_t r = rng();
      std::memcpy(s.data() + i, &r, std::min<size_t>(8, n - i));
    }
    return s;
  }
  static std::string ReadAll(const std::string& path) {
    std::ifstream f(path, std::ios::binary | std::ios::ate);
    std::string s(static_cast<size_t>(f.tellg()), '\0');
    f.seekg(0);
    f.read(s.data(), static_cast<std::streamsize>(s.size()));
    return s;
  }
  // Appends `data` in pieces whose sizes cycle through `pieces`; with `write_out`, each
  // piece's whole blocks are written out at once (WriteOut).
  static Status AppendInPieces(DirectFileWriter& w, const std::string& data,
                               const std::vector<size_t>& pieces, bool write_out = false) {
    size_t at = 0;
    for (size_t i = 0; at < data.size(); ++i) {
      const size_t n = std::min(pieces[i % pieces.size()], data.size() - at);
      ISTHMUS_RETURN_IF_ERROR(w.Append(data.data() + at, n));
      if (write_out) ISTHMUS_RETURN_IF_ERROR(w.WriteOut());
      at += n;
    }
    return w.Finish();
  }
};

TEST_F(DirectFileTest, EveryByteReadsBackDirectAndBuffered) {
  // Sizes around the block and the buffer: empty, under a block, a buffer exactly, three
  // buffers and a bit; pieces from 1 byte to more than a buffer.
  const std::vector<size_t> sizes = {
      0, 1, 4095, 4096, 4097, kDirectChunkBytes, 3 * kDirectChunkBytes + 12345};
  const std::vector<std::vector<size_t>> piecings = {
      {kDirectChunkBytes * 4}, {1, 7, 4096, 100000}, {kDirectChunkBytes + 3, 5}};
  // Each case's bytes: a different stretch of one random pool.
  const std::string pool = Random(sizes.back() + 97 * 100, 1);  // 84 cases, 97 apart
  int case_no = 0;
  for (const bool want_direct : {true, false}) {
    for (const size_t size : sizes) {
      for (const auto& pieces : piecings) {
        for (const bool write_out : {false, true}) {
          const std::string path = (dir_ / ("f" + std::to_string(case_no))).string();
          const std::string data = pool.substr(static_cast<size_t>(++case_no) * 97, size);
          ASSERT_EQ(data.size(), size) << "the pool is too short for case " << case_no;
          bool direct = false;
          const int fd = OpenMaybeDirect(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644,
                                         want_direct, &direct);
          ASSERT_GE(fd, 0) << path;
          if (!want_direct) {
            EXPECT_FALSE(direct);
          } else {
            // This suite's folder is on a disk that takes O_DIRECT (ext4 here); where it does
            // not, the writer's buffered writes are what is tested.
            EXPECT_EQ((::fcntl(fd, F_GETFL) & O_DIRECT) != 0, direct);
          }
          DirectFileWriter w(fd, path, direct);
          Status s = AppendInPieces(w, data, pieces, write_out);
          ::close(fd);
          ASSERT_TRUE(s.ok()) << s.ToString();
          EXPECT_EQ(w.bytes(), size);
          const std::string back = ReadAll(path);
          ASSERT_EQ(back.size(), size) << "direct " << want_direct << " size " << size;
          EXPECT_TRUE(back == data)
              << "direct " << want_direct << " size " << size << " write_out " << write_out;
        }
      }
    }
  }
}

TEST_F(DirectFileTest, AnOlderLongerFileIsCutAndAStartOffsetKeepsTheHead) {
  const std::string path = (dir_ / "reused").string();
  const std::string old = Random(2 * kDirectChunkBytes + 999, 7);
  for (const off_t start : {off_t{0}, off_t{8192}, off_t{100}}) {  // 100: not aligned
    { std::ofstream(path, std::ios::binary) << old; }
    const std::string data = Random(kDirectChunkBytes + 5000, static_cast<uint32_t>(start + 1));
    bool direct = false;
    const int fd = OpenMaybeDirect(path, O_WRONLY | O_CLOEXEC, 0644, true, &direct);
    ASSERT_GE(fd, 0);
    DirectFileWriter w(fd, path, direct, start);
    if (start % 4096 != 0) {
      EXPECT_FALSE(w.direct()) << "an unaligned start is written plain";
    }
    Status s = AppendInPieces(w, data, {333, 70000});
    ::close(fd);
    ASSERT_TRUE(s.ok()) << s.ToString();
    const std::string back = ReadAll(path);
    ASSERT_EQ(back.size(), static_cast<size_t>(start) + data.size()) << "start " << start;
    EXPECT_TRUE(back.substr(static_cast<size_t>(start)) == data) << "start " << start;
    EXPECT_TRUE(back.substr(0, static_cast<size_t>(start)) ==
                old.substr(0, static_cast<size_t>(start)))
        << "the bytes before the start are kept, start " << start;
  }
}

TEST_F(DirectFileTest, AFullDiskIsResourceExhaustedNamingTheFile) {
  // /dev/full refuses every write with ENOSPC.
  const int fd = ::open("/dev/full", O_WRONLY | O_CLOEXEC);
  if (fd < 0) GTEST_SKIP() << "no /dev/full here";
  for (const size_t n : {size_t{10}, kDirectChunkBytes + 10}) {
    DirectFileWriter w(fd, "the-file", false);
    Status s = w.Append(Random(n, 3).data(), n);
    if (s.ok()) s = w.Finish();
    EXPECT_EQ(s.code(), Code::kResourceExhausted) << s.ToString();
    EXPECT_NE(s.message().find("the-file"), std::string::npos) << s.ToString();
    EXPECT_NE(s.message().find("the disk is full"), std::string::npos) << s.ToString();
  }
  ::close(fd);
}

}  // namespace
}  // namespace isthmus
