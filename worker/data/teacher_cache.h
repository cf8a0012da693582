// A frozen teacher's top-k logits over a task shard (word-level distillation, docs/DATA.md
// section 5): computed once per site by `isthmus-worker teach`, read beside the shard by
// `isthmus-worker train --teacher-topk`, so that training spares the teacher's compute
// every epoch and no teacher output ever leaves the site.
//
// File: "ISTHTOPK", a little-endian uint32 header length, the header (JSON: format, k,
// vocab_size, example_tokens, shard_digest, tokenizer, teacher, positions), then one record
// per position of the shard that has a target, window by window in shard order: k int32
// ids (distinct, the teacher's k largest logits in descending order) then the k fp32
// logits at them.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "worker/data/token_dataset.h"

namespace isthmus::data {

struct TeacherCacheInfo {
  int k = 0;
  int vocab_size = 0;          // the teacher's (= the student's) vocabulary
  int64_t example_tokens = 0;  // the shard's windows (seq_len)
  std::string shard_digest;    // TokenDataset::Digest() of the shard it was computed on
  std::string tokenizer;       // the shard's tokenizer, as its manifest names it
  std::string teacher;         // what the teacher was (its base hash and tensors), a record
  uint64_t positions = 0;      // records in the file
};

// The k largest of a row of `vocab_size` logits, largest first (ties: the lower id first):
// their ids and values.
void SelectTopK(const float* row, int vocab_size, int k, int32_t* ids, float* logits);

// The positions with a target in `dataset`'s windows before each window: entry w is the
// first record of window w, the last entry the total.
std::vector<uint64_t> TargetOffsets(const TokenDataset& dataset);

// Writes a cache: records are appended in order and the file gets its name only when
// Finish has seen exactly info.positions of them (PATH.tmp until then, fsynced and renamed
// durably), so a crash leaves no half cache under the name.
class TeacherCacheWriter {
 public:
  static Result<std::unique_ptr<TeacherCacheWriter>> Create(const std::string& path,
                                                            const TeacherCacheInfo& info);
  ~TeacherCacheWriter();
  // `rows` records of k ids and k logits each.
  Status Append(const int32_t* ids, const float* logits, uint64_t rows);
  Status Finish();

 private:
  TeacherCacheWriter(std::string path, TeacherCacheInfo info, std::FILE* file);
  std::string path_;
  TeacherCacheInfo info_;
  std::FILE* file_;
  uint64_t written_ = 0;
};

// A cache opened for one shard. Not thread-safe (one reader per rank); movable.
class TeacherCache {
 public:
  // Opens `path` for `dataset` and a student of `vocab_size` ids. Refused: a file that is
  // not a cache or is cut short (Corruption), a cache computed on another shard (its digest:
  // FailedPrecondition, saying to run teach again), for another vocabulary or window length
  // (InvalidArgument naming both), or a shard without a loss mask (InvalidArgument).
  static Result<TeacherCache> Open(const std::string& path, const TokenDataset& dataset,
                                   int vocab_size);
  TeacherCache(TeacherCache&&) noexcept;
  TeacherCache& operator=(TeacherCache&&) noexcept;
  ~TeacherCache();

  // The header alone (what `train --plan` needs: k), without the shard; refused as Open
  // refuses a file that is not a cache.
  static Result<TeacherCacheInfo> ReadInfo(const std::string& path);

  const TeacherCacheInfo& info() const { return info_; }

  // The teacher rows of `batch` (a batch of the shard it was opened for): [rows, k] ids and
  // logits, rows without a target zero. Corruption naming the cache and the position for a
  // record whose ids are out of range or repeated or whose logits are not finite.
  Status Fill(const Batch& batch, std::vector<int32_t>* ids, std::vector<float>* logits) const;

 private:
  TeacherCache() = default;
  std::string path_;
  TeacherCacheInfo info_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const char* records_ = nullptr;
  std::vector<uint64_t> offsets_;
};

}  // namespace isthmus::data
