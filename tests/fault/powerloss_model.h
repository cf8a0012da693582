// The power-loss model shared by the preloaded recorder (fault_preload.cc, inside the
// program under test) and the test that simulates the loss (powerloss.h): what a disk
// holds after the power fails is, for every directory, its entries as of its last fsync
// and, for every file, its bytes as of its last fsync or fdatasync. Everything else that
// was written is lost. This is the POSIX worst case (ext4 often keeps more), the model of
// RocksDB's own fault-injection file system.
//
// The recorder keeps that durable image in a shadow folder as the program runs:
//   baseline          the tree was recorded once at the program's start (all durable)
//   root              the identity of the tree's top directory
//   d-<identity>      a directory's durable entries, one per line: kind, mode, identity, name
//   f-<identity>      a file's durable bytes
// An identity is an inode number and its birth time, so a reused inode number is a new
// identity. Hard links (snapshots link slot files) are two entries with one identity.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <string>

namespace isthmus::powerloss {

// The identity of an open file or directory; empty when it cannot be read.
inline std::string IdentityOf(int fd) {
  struct statx sx {};
  if (::statx(fd, "", AT_EMPTY_PATH, STATX_INO | STATX_BTIME, &sx) != 0) return "";
  char buf[64];
  if (sx.stx_mask & STATX_BTIME) {
    std::snprintf(buf, sizeof buf, "%llx-%llx.%x", static_cast<unsigned long long>(sx.stx_ino),
                  static_cast<unsigned long long>(sx.stx_btime.tv_sec), sx.stx_btime.tv_nsec);
  } else {
    std::snprintf(buf, sizeof buf, "%llx", static_cast<unsigned long long>(sx.stx_ino));
  }
  return buf;
}

// One line of a directory record. Kinds: 'd' directory, 'f' regular file, 'l' symbolic link
// (identity holds the link's target), anything else is not recorded.
inline std::string EntryLine(char kind, unsigned mode, const std::string& identity,
                             const std::string& name) {
  char head[32];
  std::snprintf(head, sizeof head, "%c\t%o\t", kind, mode & 07777);
  return head + identity + "\t" + name + "\n";
}

}  // namespace isthmus::powerloss
