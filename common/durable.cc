#include "common/durable.h"

#include <fstream>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <vector>

namespace isthmus {
namespace fs = std::filesystem;

Status SyncPath(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return Status::IoError("cannot open '" + path + "' to sync it: " + std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return Status::IoError("fsync of '" + path + "' failed: " + std::strerror(err));
  return Status::Ok();
}

Status SyncParent(const std::string& path) {
  const fs::path parent = fs::path(path).parent_path();
  return SyncPath(parent.empty() ? std::string(".") : parent.string());
}

Status SyncTree(const std::string& root) {
  std::error_code ec;
  for (fs::recursive_directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const auto type = it->symlink_status(ec).type();
    if (type == fs::file_type::regular || type == fs::file_type::directory) {
      ISTHMUS_RETURN_IF_ERROR(SyncPath(it->path().string()));
    }
  }
  if (ec) return Status::IoError("cannot list '" + root + "' to sync it: " + ec.message());
  return SyncPath(root);
}

Status CreateDirectoriesDurably(const std::string& path) {
  std::vector<fs::path> missing;  // deepest first
  std::error_code ec;
  for (fs::path p = fs::path(path).lexically_normal(); !p.empty() && !fs::exists(p, ec);
       p = p.parent_path()) {
    missing.push_back(p);
    if (p == p.root_path()) break;
  }
  if (missing.empty()) return Status::Ok();
  fs::create_directories(path, ec);
  if (ec) return Status::IoError("cannot create '" + path + "': " + ec.message());
  for (auto it = missing.rbegin(); it != missing.rend(); ++it) {
    ISTHMUS_RETURN_IF_ERROR(SyncParent(it->string()));
  }
  return Status::Ok();
}

Status RenameDurably(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) {
    return Status::IoError("cannot rename '" + from + "' to '" + to + "': " + std::strerror(errno));
  }
  ISTHMUS_RETURN_IF_ERROR(SyncParent(to));
  const fs::path a = fs::path(from).parent_path(), b = fs::path(to).parent_path();
  if (a != b) ISTHMUS_RETURN_IF_ERROR(SyncParent(from));
  return Status::Ok();
}

Status WriteFileDurably(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc | std::ios::binary);
    out << text;
    out.close();
    if (!out) return Status::IoError("cannot write " + tmp);
  }
  ISTHMUS_RETURN_IF_ERROR(SyncPath(tmp));
  return RenameDurably(tmp, path);
}

}  // namespace isthmus
