#include "common/direct_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

namespace isthmus {
namespace {

constexpr size_t kAlign = 4096;

// Buffers kept for the next writer, so that a store writing file after file (or a worker
// writing a checkpoint every round) does not map and fault in fresh pages each time.
class BufferPool {
 public:
  char* Take() {
    {
      std::lock_guard lk(m_);
      if (!free_.empty()) {
        char* b = free_.back();
        free_.pop_back();
        return b;
      }
    }
    return static_cast<char*>(std::aligned_alloc(kAlign, kDirectChunkBytes));
  }
  void Give(char* b) {
    if (b == nullptr) return;
    std::lock_guard lk(m_);
    if (free_.size() < kKept) {
      free_.push_back(b);
      return;
    }
    std::free(b);
  }

 private:
  static constexpr size_t kKept = 4;
  std::mutex m_;
  std::vector<char*> free_;
};

BufferPool& Pool() {
  static auto* pool = new BufferPool();  // never destroyed: writers may outlive statics
  return *pool;
}

// A write that failed: a full disk (or quota) is ResourceExhausted, saying so, not damage.
Status WriteError(const std::string& path) {
  const std::string why = std::strerror(errno);
  if (errno == ENOSPC || errno == EDQUOT) {
    return Status::ResourceExhausted(path + ": write failed: the disk is full (" + why +
                                     "): free space there or write elsewhere");
  }
  return Status::IoError(path + ": write failed: " + why);
}

}  // namespace

int OpenMaybeDirect(const std::string& path, int flags, mode_t mode, bool want_direct,
                    bool* direct) {
  if (want_direct) {
    const int fd = ::open(path.c_str(), flags | O_DIRECT, mode);
    if (fd >= 0 || errno != EINVAL) {
      *direct = fd >= 0;
      return fd;
    }
  }
  *direct = false;
  return ::open(path.c_str(), flags, mode);
}

DirectFileWriter::DirectFileWriter(int fd, std::string path, bool direct, off_t start)
    : fd_(fd),
      path_(std::move(path)),
      direct_(direct && start % static_cast<off_t>(kAlign) == 0),
      start_(start),
      off_(start),
      end_(start) {
  if (direct && !direct_) {
    // An unaligned start cannot be written directly: plain writes for this file.
    const int flags = ::fcntl(fd_, F_GETFL);
    if (flags >= 0) (void)::fcntl(fd_, F_SETFL, flags & ~O_DIRECT);
  }
}

DirectFileWriter::~DirectFileWriter() { Pool().Give(buf_); }

Status DirectFileWriter::BufferedWrite(const char* p, size_t n, off_t off) {
  while (n > 0) {
    const ssize_t w = ::pwrite(fd_, p, n, off);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return WriteError(path_);
    p += w, n -= static_cast<size_t>(w), off += w;
  }
  return Status::Ok();
}

Status DirectFileWriter::Append(const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  end_ += static_cast<off_t>(n);
  if (!direct_) return BufferedWrite(p, n, end_ - static_cast<off_t>(n));
  if (buf_ == nullptr) {
    buf_ = Pool().Take();
    if (buf_ == nullptr) return Status::ResourceExhausted("no memory to write '" + path_ + "'");
  }
  while (n > 0) {
    const size_t take = std::min(n, kDirectChunkBytes - fill_);
    std::memcpy(buf_ + fill_, p, take);
    fill_ += take, p += take, n -= take;
    if (fill_ == kDirectChunkBytes) ISTHMUS_RETURN_IF_ERROR(Flush(false));
    // A refused direct write turned direct_ off and wrote the buffer: the rest goes plain.
    if (!direct_) return BufferedWrite(p, n, end_ - static_cast<off_t>(n));
  }
  return Status::Ok();
}

Status DirectFileWriter::Flush(bool last) {
  if (fill_ == 0) return Status::Ok();
  const size_t padded = last ? (fill_ + kAlign - 1) / kAlign * kAlign : fill_;
  std::memset(buf_ + fill_, 0, padded - fill_);
  size_t done = 0;
  while (done < padded) {
    const ssize_t w = ::pwrite(fd_, buf_ + done, padded - done, off_ + static_cast<off_t>(done));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && errno != EINVAL) return WriteError(path_);
    if (w <= 0 || static_cast<size_t>(w) % kAlign != 0) {
      // Refused (EINVAL) or short: keep what whole blocks went out, write the rest plain.
      if (w > 0) done += static_cast<size_t>(w) / kAlign * kAlign;
      const int flags = ::fcntl(fd_, F_GETFL);
      if (flags < 0 || ::fcntl(fd_, F_SETFL, flags & ~O_DIRECT) != 0) {
        return Status::IoError("cannot write '" + path_ +
                               "' without O_DIRECT: " + std::strerror(errno));
      }
      direct_ = false;
      break;
    }
    done += static_cast<size_t>(w);
  }
  if (!direct_ && done < fill_) {
    ISTHMUS_RETURN_IF_ERROR(
        BufferedWrite(buf_ + done, fill_ - done, off_ + static_cast<off_t>(done)));
    done = fill_;
  }
  off_ += static_cast<off_t>(std::min(done, fill_));
  fill_ = 0;
  return Status::Ok();
}

Status DirectFileWriter::WriteOut() {
  if (!direct_ || fill_ < kAlign) return Status::Ok();
  const size_t whole = fill_ / kAlign * kAlign, rest = fill_ - whole;
  fill_ = whole;
  ISTHMUS_RETURN_IF_ERROR(Flush(false));
  if (!direct_ && rest > 0) {  // refused: from here on everything goes plain
    ISTHMUS_RETURN_IF_ERROR(BufferedWrite(buf_ + whole, rest, off_));
    off_ += static_cast<off_t>(rest);
    return Status::Ok();
  }
  std::memmove(buf_, buf_ + whole, rest);
  fill_ = rest;
  return Status::Ok();
}

Status DirectFileWriter::Finish() {
  if (direct_) ISTHMUS_RETURN_IF_ERROR(Flush(true));
  struct stat st;
  if (::fstat(fd_, &st) != 0) return WriteError(path_);
  if (st.st_size > end_ && ::ftruncate(fd_, end_) != 0) {
    return Status::IoError("cannot truncate '" + path_ + "': " + std::strerror(errno));
  }
  return Status::Ok();
}

}  // namespace isthmus
