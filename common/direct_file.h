// Large files written past the page cache (O_DIRECT): the shard's slot files and the
// worker's checkpoints. A buffered write copies every page into the kernel's page cache,
// writes it back later and, after the fsync, leaves hundreds of MB of clean pages that push
// other memory out. Measured (docs/BENCHMARKS.md): the shard's synced slot files reached
// the disk about three times as fast direct as buffered with their fdatasync (section 7);
// a worker's 1 GB checkpoint was written faster direct on one machine and slower on
// another (section 2, "The checkpoint image"), so WriteSafetensors does it only when
// asked. The bytes go through an aligned buffer of kDirectChunkBytes, so callers append
// from anywhere in any sizes; the last block is padded with zeros and the file cut back to
// the bytes appended. A file system that refuses O_DIRECT (at the open, or at a write:
// EINVAL or a short write) gets plain buffered writes from there on, with the same bytes.
//
// Durability is the caller's: the writer neither fsyncs nor closes the file.
//
// Threads: one writer is used by one thread at a time; writers on different threads are
// independent (their buffers come from a small shared pool).
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/status.h"

namespace isthmus {

inline constexpr size_t kDirectChunkBytes = size_t{8} << 20;

// ::open(path, flags | O_DIRECT, mode) when `want_direct`, retried without O_DIRECT if the
// file system refuses it (EINVAL); *direct says which was opened. Returns the descriptor or
// -1 with errno set.
int OpenMaybeDirect(const std::string& path, int flags, mode_t mode, bool want_direct,
                    bool* direct);

class DirectFileWriter {
 public:
  // Writes to `fd` from byte `start` on (a multiple of 4096 for direct writes); `direct`:
  // whether fd was opened with O_DIRECT (else every write is buffered). `path` names the
  // file in errors. The descriptor stays the caller's.
  DirectFileWriter(int fd, std::string path, bool direct, off_t start = 0);
  ~DirectFileWriter();
  DirectFileWriter(const DirectFileWriter&) = delete;
  DirectFileWriter& operator=(const DirectFileWriter&) = delete;

  // Appends n bytes (copied; p may be reused when this returns). IoError naming the file.
  Status Append(const void* p, size_t n);
  // Writes the whole 4096-byte blocks buffered now instead of when the buffer is full (a
  // value whose bytes come in parts: less is left for Finish when the last one comes).
  Status WriteOut();
  // Writes what is buffered, the last block padded, and cuts the file to the bytes written
  // from `start` on when padding or an older, longer file left more. Call once, last.
  Status Finish();

  // False once the file system refused a direct write (or it was never direct).
  bool direct() const { return direct_; }
  uint64_t bytes() const { return static_cast<uint64_t>(end_ - start_); }

 private:
  // Writes buf_[0, fill_) at off_; `last` pads a direct write's final block.
  Status Flush(bool last);
  Status BufferedWrite(const char* p, size_t n, off_t off);

  int fd_;
  std::string path_;
  bool direct_;
  off_t start_, off_, end_;  // first byte, where buf_ goes, bytes appended so far
  char* buf_ = nullptr;      // kDirectChunkBytes, 4096-aligned, from the pool
  size_t fill_ = 0;
};

}  // namespace isthmus
