// Memory-mapped token shard reader with per-rank slices and a seeded per-epoch order.
#include "worker/data/token_dataset.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <utility>

#include "common/check.h"
#include "common/sha256.h"

namespace isthmus::data {
namespace {

// splitmix64: tiny, and unlike std::uniform_int_distribution it gives the same numbers
// with every standard library, which cross-machine reproducibility needs.
uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace

std::string DatasetPosition::ToString() const {
  return std::to_string(epoch) + ":" + std::to_string(batch);
}

Result<DatasetPosition> DatasetPosition::Parse(const std::string& text) {
  const size_t colon = text.find(':');
  DatasetPosition p;
  auto parse = [](std::string_view s, uint64_t* v) {
    auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), *v);
    return !s.empty() && ec == std::errc() && end == s.data() + s.size();
  };
  std::string_view sv(text);
  if (colon == std::string::npos || !parse(sv.substr(0, colon), &p.epoch) ||
      !parse(sv.substr(colon + 1), &p.batch)) {
    return Status::InvalidArgument("dataset position '" + text + "' is not 'epoch:batch'");
  }
  return p;
}

Result<TokenDataset> TokenDataset::Open(const std::string& path, const DatasetOptions& options) {
  if (options.batch_size <= 0 || options.seq_len <= 0 || options.world_size <= 0 ||
      options.rank < 0 || options.rank >= options.world_size || options.vocab_size <= 0) {
    return Status::InvalidArgument(
        "dataset options need batch_size > 0, seq_len > 0, 0 <= rank < world_size and "
        "vocab_size > 0");
  }
  const int width = TokenBytes(options.vocab_size);
  const char* dtype = width == 4 ? "uint32-le" : "uint16-le";
  // The manifest beside the shard names the width it was built with.
  const std::string manifest_path =
      std::filesystem::path(path).replace_filename("manifest.json").string();
  std::string mask_path;
  std::string tokenizer = "byte";
  if (std::ifstream m(manifest_path); m) {
    const auto manifest = nlohmann::json::parse(m, nullptr, false);
    // A task shard (isthmus-data parallel) holds one example per window of its
    // example_tokens and a loss mask beside it.
    if (manifest.is_object() && manifest.contains("loss_mask")) {
      const std::string file = std::filesystem::path(path).filename().string();
      for (const char* part : {"train", "val"}) {
        if (manifest.contains(part) && manifest[part].value("file", "") == file &&
            manifest["loss_mask"].contains(part)) {
          mask_path = std::filesystem::path(path)
                          .replace_filename(manifest["loss_mask"][part].value("file", ""))
                          .string();
        }
      }
      const int64_t example = manifest.value("example_tokens", int64_t{0});
      if (mask_path.empty()) {
        return Status::InvalidArgument(manifest_path + ": names loss masks but none for " + file);
      }
      if (example != options.seq_len) {
        return Status::InvalidArgument(
            path + ": its examples are " + std::to_string(example) +
            " tokens each, but the model reads windows of " + std::to_string(options.seq_len) +
            ": train with --context " + std::to_string(example) + " or rebuild the shards with " +
            "isthmus-data parallel --seq-len " + std::to_string(options.seq_len));
      }
    }
    if (manifest.is_object() && manifest.contains("tokenizer") &&
        manifest["tokenizer"].is_string()) {
      tokenizer = manifest["tokenizer"].get<std::string>();
    }
    if (manifest.is_object() && manifest.contains("token_dtype") &&
        manifest["token_dtype"] != dtype) {
      return Status::InvalidArgument(path + ": its manifest says the tokens are " +
                                     manifest["token_dtype"].dump() + " (vocabulary " +
                                     manifest.value("vocab_size", nlohmann::json()).dump() +
                                     "), but the model's vocabulary of " +
                                     std::to_string(options.vocab_size) + " ids needs " + dtype +
                                     " shards: build the shards with the model's tokenizer "
                                     "(isthmus-data build --tokenizer)");
    }
  }
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return Status::NotFound(path + ": no such file");
    return Status::IoError(path + ": cannot open: " + std::strerror(errno));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status::InvalidArgument(path + ": not a readable regular file");
  }
  const size_t bytes = static_cast<size_t>(st.st_size);
  if (bytes % width != 0) {
    ::close(fd);
    return Status::Corruption(path + ": size " + std::to_string(bytes) + " is no multiple of " +
                              std::to_string(width) + "; this vocabulary's shards hold " +
                              std::to_string(width) + "-byte tokens");
  }
  TokenDataset ds;
  ds.options_ = options;
  ds.width_ = width;
  ds.tokenizer_ = tokenizer;
  ds.num_tokens_ = bytes / width;
  if (bytes > 0) {
    void* map = ::mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) {
      ::close(fd);
      return Status::IoError(path + ": mmap failed: " + std::strerror(errno));
    }
    ds.map_ = map;
    ds.map_bytes_ = bytes;
    ds.bytes_ = static_cast<const uint8_t*>(map);
  }
  ::close(fd);  // the mapping stays valid

  for (uint64_t i = 0; i < ds.num_tokens_; ++i) {
    if (ds.token(i) >= static_cast<uint32_t>(options.vocab_size)) {
      return Status::Corruption(path + ": token " + std::to_string(ds.token(i)) + " at position " +
                                std::to_string(i) + " is >= vocab size " +
                                std::to_string(options.vocab_size));
    }
  }
  if (!mask_path.empty()) {
    std::ifstream mask(mask_path, std::ios::binary);
    if (!mask) return Status::NotFound(mask_path + ": the shard's loss mask is missing");
    ds.mask_.assign(std::istreambuf_iterator<char>(mask), std::istreambuf_iterator<char>());
    if (ds.mask_.size() != ds.num_tokens_) {
      return Status::Corruption(mask_path + ": " + std::to_string(ds.mask_.size()) +
                                " mask bytes for " + std::to_string(ds.num_tokens_) +
                                " tokens; rebuild the shards");
    }
  }
  const uint64_t t = static_cast<uint64_t>(options.seq_len);
  const uint64_t windows = ds.num_tokens_ > 0 ? (ds.num_tokens_ - 1) / t : 0;
  ds.windows_per_rank_ = windows / static_cast<uint64_t>(options.world_size);
  ds.first_window_ = ds.windows_per_rank_ * static_cast<uint64_t>(options.rank);
  ds.batches_per_epoch_ = ds.windows_per_rank_ / static_cast<uint64_t>(options.batch_size);
  if (ds.batches_per_epoch_ == 0) {
    return Status::FailedPrecondition(
        path + ": " + std::to_string(ds.num_tokens_) + " tokens are too few for batches of " +
        std::to_string(options.batch_size) + " x " + std::to_string(options.seq_len) + " on " +
        std::to_string(options.world_size) + " ranks");
  }
  ds.ShuffleForEpoch();
  return ds;
}

TokenDataset::TokenDataset(TokenDataset&& other) noexcept { *this = std::move(other); }

TokenDataset& TokenDataset::operator=(TokenDataset&& other) noexcept {
  if (this != &other) {
    if (map_ != nullptr) ::munmap(map_, map_bytes_);
    options_ = other.options_;
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
    bytes_ = std::exchange(other.bytes_, nullptr);
    width_ = other.width_;
    num_tokens_ = std::exchange(other.num_tokens_, 0);
    first_window_ = other.first_window_;
    windows_per_rank_ = other.windows_per_rank_;
    batches_per_epoch_ = other.batches_per_epoch_;
    epoch_ = other.epoch_;
    batch_ = other.batch_;
    order_ = std::move(other.order_);
    mask_ = std::move(other.mask_);
    tokenizer_ = std::move(other.tokenizer_);
  }
  return *this;
}

TokenDataset::~TokenDataset() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
}

void TokenDataset::ShuffleForEpoch() {
  order_.resize(windows_per_rank_);
  for (uint64_t i = 0; i < windows_per_rank_; ++i) order_[i] = first_window_ + i;
  uint64_t state = options_.seed ^ (0x5851f42d4c957f2dull * (epoch_ + 1)) ^
                   (0x14057b7ef767814full * static_cast<uint64_t>(options_.rank + 1));
  for (uint64_t i = windows_per_rank_; i > 1; --i) {
    // Multiply-shift maps 64 random bits onto [0, i); the bias (i / 2^64) is negligible.
    const uint64_t j =
        static_cast<uint64_t>((static_cast<unsigned __int128>(SplitMix64(state)) * i) >> 64);
    std::swap(order_[i - 1], order_[j]);
  }
}

void TokenDataset::FillRow(uint64_t window, uint64_t b, Batch& out) const {
  const uint64_t t = static_cast<uint64_t>(options_.seq_len);
  const uint64_t w = window * t;
  for (uint64_t i = 0; i < t; ++i) {
    out.tokens[b * t + i] = static_cast<int32_t>(token(w + i));
    out.targets[b * t + i] =
        mask_.empty() || mask_[w + i + 1] != 0 ? static_cast<int32_t>(token(w + i + 1)) : -1;
  }
  out.windows[b] = window;
}

Batch TokenDataset::Next() {
  if (batch_ >= batches_per_epoch_) {
    ++epoch_;
    batch_ = 0;
    ShuffleForEpoch();
  }
  const uint64_t b_size = static_cast<uint64_t>(options_.batch_size);
  Batch out{options_.batch_size, options_.seq_len, {}, {}, {}};
  out.tokens.resize(b_size * options_.seq_len);
  out.targets.resize(out.tokens.size());
  out.windows.resize(b_size);
  for (uint64_t b = 0; b < b_size; ++b) FillRow(order_[batch_ * b_size + b], b, out);
  ++batch_;
  return out;
}

uint64_t TokenDataset::num_windows() const {
  return num_tokens_ > 0 ? (num_tokens_ - 1) / static_cast<uint64_t>(options_.seq_len) : 0;
}

Batch TokenDataset::Windows(uint64_t first, uint64_t count) const {
  ISTHMUS_CHECK(first + count <= num_windows(), "TokenDataset::Windows past the shard's end");
  Batch out{static_cast<int64_t>(count), options_.seq_len, {}, {}, {}};
  out.tokens.resize(count * options_.seq_len);
  out.targets.resize(out.tokens.size());
  out.windows.resize(count);
  for (uint64_t b = 0; b < count; ++b) FillRow(first + b, b, out);
  return out;
}

std::string TokenDataset::Digest() const {
  Sha256 h;
  h.Update(bytes_, map_bytes_);
  h.Update(mask_.data(), mask_.size());
  return h.HexDigest();
}

Status TokenDataset::Restore(const DatasetPosition& position) {
  if (position.batch > batches_per_epoch_) {
    return Status::InvalidArgument("dataset position " + position.ToString() +
                                   " is past the end of an epoch of " +
                                   std::to_string(batches_per_epoch_) + " batches");
  }
  epoch_ = position.epoch;
  batch_ = position.batch;
  ShuffleForEpoch();
  return Status::Ok();
}

}  // namespace isthmus::data
