// For fuzz targets whose code reads a path: the input as a file (a memfd), by its path.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace isthmus::fuzz {

class InputFile {
 public:
  InputFile(const uint8_t* data, size_t size) : fd_(::memfd_create("fuzz-input", 0)) {
    if (fd_ >= 0) {
      for (size_t done = 0; done < size;) {
        const ssize_t n = ::write(fd_, data + done, size - done);
        if (n <= 0) break;
        done += static_cast<size_t>(n);
      }
    }
  }
  ~InputFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  bool ok() const { return fd_ >= 0; }
  std::string path() const { return "/proc/self/fd/" + std::to_string(fd_); }

 private:
  int fd_;
};

}  // namespace isthmus::fuzz
