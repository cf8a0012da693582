#include "worker/data/teacher_cache.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <utility>

#include "common/durable.h"

namespace isthmus::data {
namespace {

constexpr char kMagic[8] = {'I', 'S', 'T', 'H', 'T', 'O', 'P', 'K'};
constexpr int kFormat = 1;

uint64_t RecordBytes(int k) { return static_cast<uint64_t>(k) * 8; }

// The header of a cache whose first `size` bytes are `bytes`; *records_start is where the
// records begin. Corruption for a file that is not a cache or whose header is cut short.
Result<TeacherCacheInfo> ParseHeader(const std::string& path, const char* bytes, size_t size,
                                     size_t* records_start) {
  if (size < sizeof kMagic + 4) return Status::Corruption(path + ": too short for a teacher cache");
  if (std::memcmp(bytes, kMagic, sizeof kMagic) != 0) {
    return Status::Corruption(path + ": not a teacher cache (isthmus-worker teach writes them)");
  }
  uint32_t len = 0;
  std::memcpy(&len, bytes + sizeof kMagic, 4);
  const size_t start = sizeof kMagic + 4 + static_cast<size_t>(len);
  if (start > size) return Status::Corruption(path + ": header cut short");
  const auto h = nlohmann::json::parse(bytes + sizeof kMagic + 4, bytes + start, nullptr, false);
  if (!h.is_object() || h.value("format", 0) != kFormat) {
    return Status::Corruption(path + ": unreadable header (format " + std::to_string(kFormat) +
                              " expected)");
  }
  TeacherCacheInfo i;
  try {
    i.k = h.at("k").get<int>();
    i.vocab_size = h.at("vocab_size").get<int>();
    i.example_tokens = h.at("example_tokens").get<int64_t>();
    i.shard_digest = h.at("shard_digest").get<std::string>();
    i.tokenizer = h.at("tokenizer").get<std::string>();
    i.teacher = h.at("teacher").get<std::string>();
    i.positions = h.at("positions").get<uint64_t>();
  } catch (const nlohmann::json::exception& e) {
    return Status::Corruption(path + ": header: " + e.what());
  }
  if (i.k <= 0 || i.k > i.vocab_size) {
    return Status::Corruption(path + ": k " + std::to_string(i.k) + " is outside [1, " +
                              std::to_string(i.vocab_size) + "]");
  }
  *records_start = start;
  return i;
}

}  // namespace

std::vector<uint64_t> TargetOffsets(const TokenDataset& dataset) {
  const uint64_t windows = dataset.num_windows();
  std::vector<uint64_t> offsets(windows + 1, 0);
  constexpr uint64_t kChunk = 256;
  for (uint64_t first = 0; first < windows; first += kChunk) {
    const uint64_t count = std::min(kChunk, windows - first);
    const Batch b = dataset.Windows(first, count);
    const uint64_t t = static_cast<uint64_t>(b.seq_len);
    for (uint64_t r = 0; r < count; ++r) {
      uint64_t n = 0;
      for (uint64_t i = 0; i < t; ++i) n += b.targets[r * t + i] >= 0;
      offsets[first + r + 1] = offsets[first + r] + n;
    }
  }
  return offsets;
}

TeacherCacheWriter::TeacherCacheWriter(std::string path, TeacherCacheInfo info, std::FILE* file)
    : path_(std::move(path)), info_(std::move(info)), file_(file) {}

TeacherCacheWriter::~TeacherCacheWriter() {
  if (file_ != nullptr) {
    std::fclose(file_);
    std::remove((path_ + ".tmp").c_str());
  }
}

Result<std::unique_ptr<TeacherCacheWriter>> TeacherCacheWriter::Create(
    const std::string& path, const TeacherCacheInfo& info) {
  const std::string header =
      nlohmann::ordered_json{
          {"format", kFormat},
          {"k", info.k},
          {"vocab_size", info.vocab_size},
          {"example_tokens", info.example_tokens},
          {"shard_digest", info.shard_digest},
          {"tokenizer", info.tokenizer},
          {"teacher", info.teacher},
          {"positions", info.positions},
      }
          .dump();
  std::FILE* f = std::fopen((path + ".tmp").c_str(), "wb");
  if (f == nullptr) {
    return Status::IoError(path + ".tmp: cannot create: " + std::strerror(errno));
  }
  std::unique_ptr<TeacherCacheWriter> w(new TeacherCacheWriter(path, info, f));
  const uint32_t len = static_cast<uint32_t>(header.size());
  if (std::fwrite(kMagic, 1, sizeof kMagic, f) != sizeof kMagic ||
      std::fwrite(&len, 4, 1, f) != 1 || std::fwrite(header.data(), 1, len, f) != len) {
    return Status::IoError(path + ".tmp: write failed: " + std::strerror(errno));
  }
  return w;
}

Status TeacherCacheWriter::Append(const int32_t* ids, const float* logits, uint64_t rows) {
  const size_t k = static_cast<size_t>(info_.k);
  for (uint64_t r = 0; r < rows; ++r) {
    if (std::fwrite(ids + r * k, 4, k, file_) != k ||
        std::fwrite(logits + r * k, 4, k, file_) != k) {
      return Status::IoError(path_ + ".tmp: write failed: " + std::strerror(errno));
    }
  }
  written_ += rows;
  return Status::Ok();
}

Status TeacherCacheWriter::Finish() {
  if (written_ != info_.positions) {
    return Status::Internal(path_ + ": " + std::to_string(written_) + " records written for " +
                            std::to_string(info_.positions) + " positions");
  }
  const std::string tmp = path_ + ".tmp";
  const bool ok = std::fflush(file_) == 0 && ::fsync(::fileno(file_)) == 0;
  const int err = errno;
  std::fclose(file_);
  file_ = nullptr;
  if (!ok) {
    std::remove(tmp.c_str());
    return Status::IoError(tmp + ": write failed: " + std::strerror(err));
  }
  return RenameDurably(tmp, path_);
}

TeacherCache::TeacherCache(TeacherCache&& o) noexcept { *this = std::move(o); }

TeacherCache& TeacherCache::operator=(TeacherCache&& o) noexcept {
  if (this != &o) {
    if (map_ != nullptr) ::munmap(map_, map_bytes_);
    path_ = std::move(o.path_);
    info_ = std::move(o.info_);
    map_ = std::exchange(o.map_, nullptr);
    map_bytes_ = std::exchange(o.map_bytes_, 0);
    records_ = std::exchange(o.records_, nullptr);
    offsets_ = std::move(o.offsets_);
  }
  return *this;
}

TeacherCache::~TeacherCache() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
}

Result<TeacherCacheInfo> TeacherCache::ReadInfo(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {  // as Open says it
    if (errno == ENOENT) {
      return Status::NotFound(path + ": no such file; write it with isthmus-worker teach");
    }
    return Status::IoError(path + ": cannot open: " + std::strerror(errno));
  }
  // The magic and the length, then the header (at most 1 MiB of it: a longer one is
  // reported as cut short).
  constexpr size_t kPrefix = sizeof kMagic + 4;
  std::string head(kPrefix, '\0');
  in.read(head.data(), static_cast<std::streamsize>(kPrefix));
  head.resize(static_cast<size_t>(in.gcount()));
  if (head.size() == kPrefix) {
    uint32_t len = 0;
    std::memcpy(&len, head.data() + sizeof kMagic, 4);
    head.resize(kPrefix + std::min<uint32_t>(len, 1u << 20));
    in.read(head.data() + kPrefix, static_cast<std::streamsize>(head.size() - kPrefix));
    head.resize(kPrefix + static_cast<size_t>(in.gcount()));
  }
  size_t start = 0;
  return ParseHeader(path, head.data(), head.size(), &start);
}

Result<TeacherCache> TeacherCache::Open(const std::string& path, const TokenDataset& dataset,
                                        int vocab_size) {
  if (!dataset.has_mask()) {
    return Status::InvalidArgument(
        path +
        ": distillation needs a task shard with a loss mask (isthmus-data parallel); "
        "this shard has none");
  }
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) {
      return Status::NotFound(path + ": no such file; write it with isthmus-worker teach");
    }
    return Status::IoError(path + ": cannot open: " + std::strerror(errno));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status::InvalidArgument(path + ": not a readable regular file");
  }
  TeacherCache c;
  c.path_ = path;
  c.map_bytes_ = static_cast<size_t>(st.st_size);
  if (c.map_bytes_ < sizeof kMagic + 4) {
    ::close(fd);
    return Status::Corruption(path + ": too short for a teacher cache");
  }
  c.map_ = ::mmap(nullptr, c.map_bytes_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (c.map_ == MAP_FAILED) {
    c.map_ = nullptr;
    return Status::IoError(path + ": mmap failed: " + std::strerror(errno));
  }
  const char* bytes = static_cast<const char*>(c.map_);
  size_t start = 0;
  ISTHMUS_ASSIGN_OR_RETURN(c.info_, ParseHeader(path, bytes, c.map_bytes_, &start));
  const TeacherCacheInfo& i = c.info_;
  if (c.map_bytes_ - start != i.positions * RecordBytes(i.k)) {
    return Status::Corruption(path + ": " + std::to_string(c.map_bytes_ - start) +
                              " bytes of records where " + std::to_string(i.positions) +
                              " positions of k " + std::to_string(i.k) + " need " +
                              std::to_string(i.positions * RecordBytes(i.k)) +
                              " (cut short or padded?): run isthmus-worker teach again");
  }
  if (i.vocab_size != vocab_size) {
    return Status::InvalidArgument(path + ": the teacher's vocabulary (" +
                                   std::to_string(i.vocab_size) + " ids, tokenizer " + i.tokenizer +
                                   ") is not the student's (" + std::to_string(vocab_size) +
                                   " ids): teacher and student must share a tokenizer");
  }
  if (i.example_tokens != dataset.seq_len()) {
    return Status::InvalidArgument(
        path + ": computed on examples of " + std::to_string(i.example_tokens) +
        " tokens, the shard is read in windows of " + std::to_string(dataset.seq_len()));
  }
  const std::string digest = dataset.Digest();
  if (i.shard_digest != digest) {
    return Status::FailedPrecondition(
        path + ": computed on another shard (digest " + i.shard_digest.substr(0, 16) +
        "...) than the one being trained on (" + digest.substr(0, 16) +
        "...): run isthmus-worker teach again for this shard; a cache is never reused for "
        "another shard");
  }
  c.offsets_ = TargetOffsets(dataset);
  if (c.offsets_.back() != i.positions) {
    return Status::Corruption(path + ": " + std::to_string(i.positions) +
                              " records for a shard with " + std::to_string(c.offsets_.back()) +
                              " positions to learn");
  }
  c.records_ = bytes + start;
  return c;
}

Status TeacherCache::Fill(const Batch& batch, std::vector<int32_t>* ids,
                          std::vector<float>* logits) const {
  const int k = info_.k;
  const uint64_t t = static_cast<uint64_t>(batch.seq_len);
  const uint64_t rows = static_cast<uint64_t>(batch.batch_size) * t;
  ids->assign(rows * k, 0);
  logits->assign(rows * k, 0.0f);
  std::vector<int32_t> sorted(k);
  for (uint64_t b = 0; b < static_cast<uint64_t>(batch.batch_size); ++b) {
    uint64_t record = offsets_[batch.windows[b]];
    for (uint64_t i = 0; i < t; ++i) {
      if (batch.targets[b * t + i] < 0) continue;
      const char* rec = records_ + record * RecordBytes(k);
      int32_t* row_ids = ids->data() + (b * t + i) * k;
      float* row_logits = logits->data() + (b * t + i) * k;
      std::memcpy(row_ids, rec, 4 * static_cast<size_t>(k));
      std::memcpy(row_logits, rec + 4 * static_cast<size_t>(k), 4 * static_cast<size_t>(k));
      sorted.assign(row_ids, row_ids + k);
      std::sort(sorted.begin(), sorted.end());
      const bool ids_ok = sorted.front() >= 0 && sorted.back() < info_.vocab_size &&
                          std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end();
      const bool finite =
          std::all_of(row_logits, row_logits + k, [](float x) { return std::isfinite(x); });
      if (!ids_ok || !finite) {
        return Status::Corruption(
            path_ + ": record " + std::to_string(record) + " (window " +
            std::to_string(batch.windows[b]) + ") holds " +
            (ids_ok ? "a logit that is not finite" : "an id out of range or repeated") +
            ": run isthmus-worker teach again");
      }
      ++record;
    }
  }
  return Status::Ok();
}

void SelectTopK(const float* row, int vocab_size, int k, int32_t* ids, float* logits) {
  std::vector<int32_t> order(vocab_size);
  for (int j = 0; j < vocab_size; ++j) order[j] = j;
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [row](int32_t a, int32_t b) {
    return row[a] > row[b] || (row[a] == row[b] && a < b);
  });
  for (int e = 0; e < k; ++e) {
    ids[e] = order[e];
    logits[e] = row[order[e]];
  }
}

}  // namespace isthmus::data
