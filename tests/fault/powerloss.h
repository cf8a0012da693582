// Simulated power loss for tests: a program runs with the recorder preloaded
// (PowerLossEnv), is killed with SIGKILL at a random moment, and SimulatePowerLoss replaces
// its tree by what the disk would hold had the power failed at that moment instead
// (powerloss_model.h): every directory as of its last fsync, every file as of its last
// fsync or fdatasync, and, when `tear` is given, a random part of the first unsynced page
// of every file that had grown since (a torn write). The shadow is then emptied, so the next
// start records the recovered tree as its baseline.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>

#include "tests/fault/fault_env.h"
#include "tests/fault/powerloss_model.h"

namespace isthmus::powerloss {

struct LossStats {
  int dirs = 0;             // directories rebuilt
  int files = 0;            // files rebuilt
  int emptied = 0;          // files whose name was durable but none of their bytes
  int torn = 0;             // files given part of an unsynced page
  uint64_t lost_bytes = 0;  // bytes the tree held that the disk would not have
};

// The layer recording `root`'s durable image in `shadow` (created empty), for the program
// under test.
inline std::map<std::string, std::string> PowerLossEnv(const std::filesystem::path& root,
                                                       const std::filesystem::path& shadow) {
  std::filesystem::remove_all(shadow);
  std::filesystem::create_directories(shadow);
  std::filesystem::create_directories(root);
  return {{"LD_PRELOAD", fault::FaultLibrary()},
          {"ISTHMUS_FAULT_ROOT", root.string()},
          {"ISTHMUS_FAULT_SHADOW", shadow.string()}};
}

namespace internal {

inline std::string ReadFile(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

inline std::string IdentityAtPath(const std::filesystem::path& p) {
  const int fd = ::open(p.c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return "";
  std::string id = IdentityOf(fd);
  ::close(fd);
  return id;
}

struct Rebuild {
  std::filesystem::path shadow;
  std::mt19937* tear = nullptr;
  std::map<std::string, std::filesystem::path> linked;  // identity -> first rebuilt path
  LossStats stats;
  std::string error;

  // Rebuilds directory `id` at `out`; `live` is where the program left it (for tearing).
  void Dir(const std::string& id, const std::filesystem::path& out,
           const std::filesystem::path& live) {
    ++stats.dirs;
    const auto record = shadow / ("d-" + id);
    if (!std::filesystem::exists(record)) return;  // never synced: empty
    std::istringstream lines(ReadFile(record));
    std::string line;
    while (std::getline(lines, line)) {
      std::istringstream f(line);
      std::string kind, mode_s, eid, name;
      if (!std::getline(f, kind, '\t') || !std::getline(f, mode_s, '\t') ||
          !std::getline(f, eid, '\t') || !std::getline(f, name)) {
        error = "bad record line in " + record.string() + ": " + line;
        return;
      }
      const auto mode = static_cast<std::filesystem::perms>(std::stoul(mode_s, nullptr, 8));
      const auto path = out / name;
      if (kind == "l") {
        std::filesystem::create_symlink(eid, path);
      } else if (kind == "d") {
        std::filesystem::create_directory(path);
        Dir(eid, path, live / name);
        std::filesystem::permissions(path, mode);
      } else if (auto it = linked.find(eid); it != linked.end()) {
        std::filesystem::create_hard_link(it->second, path);
      } else {
        File(eid, path, live / name);
        std::filesystem::permissions(path, mode);
        linked[eid] = path;
      }
      if (!error.empty()) return;
    }
  }

  void File(const std::string& id, const std::filesystem::path& out,
            const std::filesystem::path& live) {
    ++stats.files;
    const auto record = shadow / ("f-" + id);
    std::string bytes;
    if (std::filesystem::exists(record))
      bytes = ReadFile(record);
    else
      ++stats.emptied;
    // What the program had written that the disk would not hold.
    std::string now;
    const bool same_file = IdentityAtPath(live) == id;
    if (same_file) {
      now = ReadFile(live);
      if (now.size() > bytes.size()) stats.lost_bytes += now.size() - bytes.size();
    }
    if (tear != nullptr && same_file && now.size() > bytes.size() &&
        now.compare(0, bytes.size(), bytes) == 0) {
      const size_t page_left = 4096 - bytes.size() % 4096;
      const size_t most = std::min(page_left, now.size() - bytes.size());
      const size_t keep = 1 + (*tear)() % most;
      bytes.append(now, bytes.size(), keep);
      ++stats.torn;
    }
    std::ofstream(out, std::ios::binary)
        .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
};

}  // namespace internal

// Replaces `root` by its durable image in `shadow` (see above). Returns "" or what went
// wrong. The program must not be running.
inline std::string SimulatePowerLoss(const std::filesystem::path& root,
                                     const std::filesystem::path& shadow, std::mt19937* tear,
                                     LossStats* stats = nullptr) {
  const std::string root_id = internal::ReadFile(shadow / "root");
  if (root_id.empty()) return "no baseline in " + shadow.string() + ": was the recorder loaded?";
  const auto out = std::filesystem::path(root.string() + ".powerloss");
  std::filesystem::remove_all(out);
  std::filesystem::create_directory(out);
  std::filesystem::permissions(out, std::filesystem::status(root).permissions());
  internal::Rebuild rebuild;
  rebuild.shadow = shadow;
  rebuild.tear = tear;
  rebuild.Dir(root_id, out, root);
  if (!rebuild.error.empty()) return rebuild.error;
  std::filesystem::remove_all(root);
  std::filesystem::rename(out, root);
  std::filesystem::remove_all(shadow);
  std::filesystem::create_directories(shadow);
  if (stats != nullptr) *stats = rebuild.stats;
  return "";
}

}  // namespace isthmus::powerloss
