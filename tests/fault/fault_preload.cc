// A fault layer for tests, loaded into the program under test with LD_PRELOAD. Two faults,
// each on when its folder is set:
//
// Power loss (ISTHMUS_FAULT_SHADOW): the recorder of the model in powerloss_model.h. It
// wraps fsync, fdatasync, syncfs and sync: after the real call succeeds, and before the
// program sees it return, it copies what the call made durable into the shadow folder (a
// file's bytes, a directory's entries). Writes, renames and unlinks reach the disk as
// usual; only the shadow says which of them would survive a power loss (powerloss.h
// rebuilds the tree from it). At load, when the shadow holds no baseline yet, the whole
// tree is recorded as durable.
//
// Disk full (ISTHMUS_FAULT_CONTROL): while the file `full` exists in that folder, every
// write, pwrite, writev, pwritev, fallocate, posix_fallocate, fsync and fdatasync on a file
// in the tree fails with ENOSPC, writing nothing, and appends "CALL KIND" to `hits` there
// (KIND: wal, table, manifest, options, current, slot, or the file's name), so a
// test can say which write sites it reached. Removing `full` frees the space.
//
// ISTHMUS_FAULT_ROOT is the tree under test (e.g. a shard's data dir); calls on files
// outside it pass through untouched.
//
// Limits: O_SYNC/O_DSYNC writes, mmap writes and msync are not modelled (isthmus and
// RocksDB do not use them). A file over 1 MiB whose recorded head and end of its synced
// part are unchanged is taken to have been appended to since (RocksDB's logs, tables and
// manifests only grow), and only its new tail is copied.
#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "tests/fault/powerloss_model.h"

namespace {

using SyncFn = int (*)(int);

// Set by Init, which may run before this file's dynamic initializers: so these are
// constant-initialized (a std::string here could be reset after Init had set it).
char g_root_buf[PATH_MAX], g_shadow_buf[PATH_MAX], g_full_buf[PATH_MAX + 8],
    g_hits_buf[PATH_MAX + 8];
std::string_view g_root, g_shadow;
bool g_inject = false;  // the disk-full fault is configured
std::mutex g_mu;
std::atomic<uint64_t> g_counter{0};

SyncFn Real(const char* name) { return reinterpret_cast<SyncFn>(::dlsym(RTLD_NEXT, name)); }

bool Enabled() { return !g_root.empty() && !g_shadow.empty(); }

std::string PathOfFd(int fd) {
  char link[64], buf[PATH_MAX];
  std::snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  const ssize_t n = ::readlink(link, buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

bool UnderRoot(std::string_view path) {
  return path == g_root ||
         (path.size() > g_root.size() && path.compare(0, g_root.size(), g_root) == 0 &&
          path[g_root.size()] == '/');
}

bool WriteAll(int fd, const char* p, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

// Copies `len` bytes of `from` starting at `offset` to the end of `to`.
bool CopyRange(int from, off_t offset, off_t len, int to) {
  std::vector<char> buf(1 << 20);
  while (len > 0) {
    const ssize_t r =
        ::pread(from, buf.data(), std::min<off_t>(len, static_cast<off_t>(buf.size())), offset);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    if (!WriteAll(to, buf.data(), static_cast<size_t>(r))) return false;
    offset += r;
    len -= r;
  }
  return true;
}

// Replaces shadow file `name` with `data` (a temporary file renamed over it: a process
// killed meanwhile leaves the previous record whole).
void WriteRecord(const std::string& name, const std::string& data) {
  const std::string tmp = std::string(g_shadow) + "/.tmp-" + std::to_string(::getpid()) + "-" +
                          std::to_string(g_counter.fetch_add(1));
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return;
  const bool ok = WriteAll(fd, data.data(), data.size());
  ::close(fd);
  if (ok)
    ::rename(tmp.c_str(), (std::string(g_shadow) + "/" + name).c_str());
  else
    ::unlink(tmp.c_str());
}

bool SameBytes(int a, int b, off_t offset, size_t n) {
  std::vector<char> x(n), y(n);
  return ::pread(a, x.data(), n, offset) == static_cast<ssize_t>(n) &&
         ::pread(b, y.data(), n, offset) == static_cast<ssize_t>(n) && x == y;
}

// Records the bytes of the open regular file `fd` as durable.
void RecordFile(int fd) {
  const std::string id = isthmus::powerloss::IdentityOf(fd);
  if (id.empty()) return;
  // Read through /proc: the program's descriptor may be write-only.
  char link[64];
  std::snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  const int in = ::open(link, O_RDONLY | O_CLOEXEC);
  if (in < 0) return;
  struct stat st {};
  ::fstat(in, &st);
  const std::string record = std::string(g_shadow) + "/f-" + id;
  const int old = ::open(record.c_str(), O_RDWR | O_APPEND | O_CLOEXEC);
  struct stat ost {};
  constexpr off_t kAppendCheck = 4096;
  if (old >= 0 && ::fstat(old, &ost) == 0 && ost.st_size > (1 << 20) && st.st_size >= ost.st_size &&
      SameBytes(old, in, 0, kAppendCheck) &&
      SameBytes(old, in, ost.st_size - kAppendCheck, kAppendCheck)) {
    CopyRange(in, ost.st_size, st.st_size - ost.st_size, old);
    ::close(old);
    ::close(in);
    return;
  }
  if (old >= 0) ::close(old);
  const std::string tmp = std::string(g_shadow) + "/.tmp-" + std::to_string(::getpid()) + "-" +
                          std::to_string(g_counter.fetch_add(1));
  const int out = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (out >= 0) {
    const bool ok = CopyRange(in, 0, st.st_size, out);
    ::close(out);
    if (ok)
      ::rename(tmp.c_str(), record.c_str());
    else
      ::unlink(tmp.c_str());
  }
  ::close(in);
}

// Records the entries of directory `path` (open as `dirfd`) as durable.
void RecordDir(int dirfd, const std::string& path) {
  const std::string id = isthmus::powerloss::IdentityOf(dirfd);
  DIR* d = ::opendir(path.c_str());
  if (id.empty() || d == nullptr) {
    if (d) ::closedir(d);
    return;
  }
  std::string lines;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    struct statx sx {};
    if (::statx(::dirfd(d), name.c_str(), AT_SYMLINK_NOFOLLOW, STATX_TYPE | STATX_MODE, &sx) != 0) {
      continue;
    }
    const unsigned mode = sx.stx_mode;
    if (S_ISLNK(mode)) {
      char target[PATH_MAX];
      const ssize_t n = ::readlinkat(::dirfd(d), name.c_str(), target, sizeof target - 1);
      if (n > 0) lines += isthmus::powerloss::EntryLine('l', mode, std::string(target, n), name);
      continue;
    }
    if (!S_ISDIR(mode) && !S_ISREG(mode)) continue;
    const int fd = ::openat(::dirfd(d), name.c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) continue;
    const std::string eid = isthmus::powerloss::IdentityOf(fd);
    ::close(fd);
    if (!eid.empty()) {
      lines += isthmus::powerloss::EntryLine(S_ISDIR(mode) ? 'd' : 'f', mode, eid, name);
    }
  }
  ::closedir(d);
  WriteRecord("d-" + id, lines);
}

void Record(int fd) {
  const std::string path = PathOfFd(fd);
  if (!UnderRoot(path)) return;
  struct stat st {};
  if (::fstat(fd, &st) != 0) return;
  std::lock_guard<std::mutex> lock(g_mu);
  if (S_ISDIR(st.st_mode))
    RecordDir(fd, path);
  else if (S_ISREG(st.st_mode))
    RecordFile(fd);
}

// Records everything under `path` as durable (the baseline, and sync()); `seen` holds the
// identities recorded so far, so a file hard-linked under several names (snapshots link
// slot files) is copied once.
void RecordTree(const std::string& path, std::set<std::string>& seen) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  RecordDir(fd, path);
  ::close(fd);
  DIR* d = ::opendir(path.c_str());
  if (d == nullptr) return;
  std::vector<std::pair<std::string, bool>> children;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    struct stat st {};
    if (::fstatat(::dirfd(d), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
    if (S_ISDIR(st.st_mode))
      children.emplace_back(path + "/" + name, true);
    else if (S_ISREG(st.st_mode))
      children.emplace_back(path + "/" + name, false);
  }
  ::closedir(d);
  for (const auto& [child, is_dir] : children) {
    if (is_dir) {
      RecordTree(child, seen);
    } else {
      const int f = ::open(child.c_str(), O_RDONLY | O_CLOEXEC);
      if (f >= 0) {
        if (seen.insert(isthmus::powerloss::IdentityOf(f)).second) RecordFile(f);
        ::close(f);
      }
    }
  }
}

void RecordWholeTree() {
  std::lock_guard<std::mutex> lock(g_mu);
  std::set<std::string> seen;
  RecordTree(std::string(g_root), seen);
}

// What kind of file a disk-full hit fell on, from its name.
const char* KindOf(std::string_view path) {
  const size_t slash = path.rfind('/');
  const std::string_view name = path.substr(slash + 1);
  const std::string_view dir = slash == std::string_view::npos ? "" : path.substr(0, slash);
  auto ends = [&](std::string_view x) {
    return name.size() >= x.size() && name.substr(name.size() - x.size()) == x;
  };
  if (dir.size() >= 6 && dir.substr(dir.size() - 6) == "/slots") return "slot";
  if (ends(".log")) return "wal";
  if (ends(".sst")) return "table";
  if (name.substr(0, 9) == "MANIFEST-") return "manifest";
  if (name.substr(0, 8) == "OPTIONS-") return "options";
  if (name == "CURRENT" || ends(".dbtmp")) return "current";
  return nullptr;
}

// True, having logged the hit, when the disk is "full" and `fd` is a file in the tree.
bool DiskFull(int fd, const char* call) {
  if (!g_inject || ::access(g_full_buf, F_OK) != 0) return false;
  const std::string path = PathOfFd(fd);
  if (!UnderRoot(path)) return false;
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) return false;
  const char* kind = KindOf(path);
  std::string line =
      std::string(call) + " " + (kind ? kind : path.substr(path.rfind('/') + 1)) + "\n";
  static const auto real_write =
      reinterpret_cast<ssize_t (*)(int, const void*, size_t)>(::dlsym(RTLD_NEXT, "write"));
  const int out = ::open(g_hits_buf, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  if (out >= 0) {
    real_write(out, line.data(), line.size());
    ::close(out);
  }
  return true;
}

bool SetPath(const char* env, char* buf) {
  const char* v = std::getenv(env);
  char real[PATH_MAX];
  if (v == nullptr || ::realpath(v, real) == nullptr) return false;
  std::memcpy(buf, real, sizeof real);
  return true;
}

__attribute__((constructor)) void Init() {
  if (!SetPath("ISTHMUS_FAULT_ROOT", g_root_buf)) return;
  g_root = g_root_buf;
  char control[PATH_MAX];
  if (SetPath("ISTHMUS_FAULT_CONTROL", control)) {
    std::snprintf(g_full_buf, sizeof g_full_buf, "%s/full", control);
    std::snprintf(g_hits_buf, sizeof g_hits_buf, "%s/hits", control);
    g_inject = true;
  }
  if (!SetPath("ISTHMUS_FAULT_SHADOW", g_shadow_buf)) return;
  g_shadow = g_shadow_buf;
  const std::string marker = std::string(g_shadow) + "/baseline";
  if (::access(marker.c_str(), F_OK) == 0) return;
  const int fd = ::open(g_root_buf, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  WriteRecord("root", isthmus::powerloss::IdentityOf(fd));
  ::close(fd);
  RecordWholeTree();
  WriteRecord("baseline", "");
}

}  // namespace

#define ISTHMUS_FAIL_IF_FULL(fd, call, failed) \
  do {                                         \
    if (DiskFull(fd, call)) {                  \
      errno = ENOSPC;                          \
      return failed;                           \
    }                                          \
  } while (0)

template <typename Fn>
Fn Next(const char* name) {
  return reinterpret_cast<Fn>(::dlsym(RTLD_NEXT, name));
}

extern "C" {

ssize_t write(int fd, const void* buf, size_t n) {
  static const auto real = Next<ssize_t (*)(int, const void*, size_t)>("write");
  ISTHMUS_FAIL_IF_FULL(fd, "write", -1);
  return real(fd, buf, n);
}

ssize_t pwrite(int fd, const void* buf, size_t n, off_t offset) {
  static const auto real = Next<ssize_t (*)(int, const void*, size_t, off_t)>("pwrite");
  ISTHMUS_FAIL_IF_FULL(fd, "pwrite", -1);
  return real(fd, buf, n, offset);
}

ssize_t pwrite64(int fd, const void* buf, size_t n, off64_t offset) {
  static const auto real = Next<ssize_t (*)(int, const void*, size_t, off64_t)>("pwrite64");
  ISTHMUS_FAIL_IF_FULL(fd, "pwrite", -1);
  return real(fd, buf, n, offset);
}

ssize_t writev(int fd, const struct iovec* iov, int count) {
  static const auto real = Next<ssize_t (*)(int, const struct iovec*, int)>("writev");
  ISTHMUS_FAIL_IF_FULL(fd, "writev", -1);
  return real(fd, iov, count);
}

ssize_t pwritev(int fd, const struct iovec* iov, int count, off_t offset) {
  static const auto real = Next<ssize_t (*)(int, const struct iovec*, int, off_t)>("pwritev");
  ISTHMUS_FAIL_IF_FULL(fd, "pwritev", -1);
  return real(fd, iov, count, offset);
}

int fallocate(int fd, int mode, off_t offset, off_t len) {
  static const auto real = Next<int (*)(int, int, off_t, off_t)>("fallocate");
  ISTHMUS_FAIL_IF_FULL(fd, "fallocate", -1);
  return real(fd, mode, offset, len);
}

int fallocate64(int fd, int mode, off64_t offset, off64_t len) {
  static const auto real = Next<int (*)(int, int, off64_t, off64_t)>("fallocate64");
  ISTHMUS_FAIL_IF_FULL(fd, "fallocate", -1);
  return real(fd, mode, offset, len);
}

// posix_fallocate returns the error rather than setting errno.
int posix_fallocate(int fd, off_t offset, off_t len) {
  static const auto real = Next<int (*)(int, off_t, off_t)>("posix_fallocate");
  if (DiskFull(fd, "posix_fallocate")) return ENOSPC;
  return real(fd, offset, len);
}

int posix_fallocate64(int fd, off64_t offset, off64_t len) {
  static const auto real = Next<int (*)(int, off64_t, off64_t)>("posix_fallocate64");
  if (DiskFull(fd, "posix_fallocate")) return ENOSPC;
  return real(fd, offset, len);
}

int fsync(int fd) {
  static const SyncFn real = Real("fsync");
  ISTHMUS_FAIL_IF_FULL(fd, "fsync", -1);
  const int r = real(fd);
  if (r == 0 && Enabled()) {
    const int saved = errno;
    Record(fd);
    errno = saved;
  }
  return r;
}

int fdatasync(int fd) {
  static const SyncFn real = Real("fdatasync");
  ISTHMUS_FAIL_IF_FULL(fd, "fdatasync", -1);
  const int r = real(fd);
  if (r == 0 && Enabled()) {
    const int saved = errno;
    Record(fd);
    errno = saved;
  }
  return r;
}

int syncfs(int fd) {
  static const SyncFn real = Real("syncfs");
  const int r = real(fd);
  if (r == 0 && Enabled()) RecordWholeTree();
  return r;
}

void sync() {
  static const auto real = reinterpret_cast<void (*)()>(::dlsym(RTLD_NEXT, "sync"));
  real();
  if (Enabled()) RecordWholeTree();
}

}  // extern "C"
