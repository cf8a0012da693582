// What a power loss may take from the files isthmus writes itself, read from a system-call
// trace of the real programs (strace -f -y, which names the file behind each descriptor):
// a file or folder gets its final name only after its data (for a tree: every file and
// folder in it) was fsynced, and the folder that holds the name is fsynced after the rename,
// before the operation is reported done. Without the second, a power loss right after the
// reply can take the name back (the snapshot, the restored database, the key file is gone);
// without the first, the name can point at a file whose data never reached the disk.
// Needs strace (deploy/install-deps.sh) and ptrace; skips, saying so, without them.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/command.h"
#include "tests/integration/server_process.h"

namespace isthmus {
namespace {

using testing::RunCommand;
using testing::ServerProcess;
namespace fs = std::filesystem;

const char* kTraced = "fsync,fdatasync,rename,renameat,renameat2";

bool HaveStrace() { return RunCommand("strace -V 2>/dev/null").exit_code == 0; }

std::vector<std::string> Lines(const fs::path& file) {
  std::ifstream in(file);
  std::vector<std::string> out;
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

// Attaches strace to a running process until Stop().
class Trace {
 public:
  Trace(pid_t pid, fs::path out) : out_(std::move(out)) {
    pid_ = ::fork();
    if (pid_ == 0) {
      const std::string p = std::to_string(pid);
      ::execlp("strace", "strace", "-f", "-y", "-qq", "-e", kTraced, "-o", out_.c_str(), "-p",
               p.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    // Attached once the kernel names a tracer for the process.
    for (int i = 0; i < 200 * testing::TimeScale() && !attached_; ++i) {
      std::ifstream st("/proc/" + std::to_string(pid) + "/status");
      for (std::string line; std::getline(st, line);) {
        if (line.rfind("TracerPid:", 0) == 0 && std::stoi(line.substr(10)) != 0) attached_ = true;
      }
      if (!attached_) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  ~Trace() { Stop(); }
  bool attached() const { return attached_; }
  std::vector<std::string> Stop() {
    if (pid_ > 0) {
      ::kill(pid_, SIGINT);  // strace detaches and flushes its output
      int status = 0;
      ::waitpid(pid_, &status, 0);
      pid_ = -1;
    }
    return Lines(out_);
  }

 private:
  fs::path out_;
  pid_t pid_ = -1;
  bool attached_ = false;
};

// The index of the first line that holds every one of `parts`; -1 if none does.
int Find(const std::vector<std::string>& lines, const std::vector<std::string>& parts,
         int from = 0) {
  for (int i = from; i < static_cast<int>(lines.size()); ++i) {
    bool all = true;
    for (const auto& p : parts) all = all && lines[i].find(p) != std::string::npos;
    if (all) return i;
  }
  return -1;
}

// An fsync of exactly `path` (strace -y prints the descriptor's path in <...>).
std::vector<std::string> SyncOf(const fs::path& path) {
  return {"fsync(", "<" + path.string() + ">"};
}

std::string Dump(const std::vector<std::string>& lines) {
  std::string s;
  for (const auto& l : lines) s += l + "\n";
  return s;
}

class DurabilityTrace : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveStrace()) GTEST_SKIP() << "strace is not installed (deploy/install-deps.sh)";
    ASSERT_TRUE(server_.Start());
    auto admin = server_.AdminClient();
    std::vector<float> a(32, 1.0f);
    auto r = admin->CreateJob("j", "base-hash-1", {{"a", {4, 8}, a.data()}});
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    auto w = server_.WorkerClient();
    ASSERT_TRUE(w->Push("j", "p1", 0, 1, {{"a", {4, 8}, a.data()}}).ok());
  }
  // Starts tracing the server; skips when ptrace is not allowed here.
  std::unique_ptr<Trace> TraceServer() {
    auto t = std::make_unique<Trace>(server_.pid(), server_.dir() / "trace.txt");
    return t;
  }
  ServerProcess server_;
};

TEST_F(DurabilityTrace, SnapshotIsWholeOnDiskBeforeItsNameAndItsNameBeforeTheReply) {
  auto trace = TraceServer();
  if (!trace->attached()) GTEST_SKIP() << "cannot attach strace (ptrace not permitted here)";
  auto snap = server_.AdminClient()->CreateSnapshot("s1");
  ASSERT_TRUE(snap.ok()) << snap.status().ToString();
  const auto lines = trace->Stop();
  const fs::path snaps = server_.dir() / "data" / "snapshots";
  const fs::path tmp = snaps / ".tmp-s1";
  const int rename = Find(lines, {"rename", "\"" + tmp.string() + "\"", (snaps / "s1").string()});
  ASSERT_GE(rename, 0) << "no rename of the snapshot folder:\n" << Dump(lines);
  const int info = Find(lines, SyncOf(tmp / "info.json"));
  const int folder = Find(lines, SyncOf(tmp));
  const int db_folder = Find(lines, SyncOf(tmp / "db"));
  EXPECT_TRUE(info >= 0 && info < rename) << "info.json not synced before the rename\n"
                                          << Dump(lines);
  EXPECT_TRUE(folder >= 0 && folder < rename) << "the folder not synced before the rename\n"
                                              << Dump(lines);
  EXPECT_TRUE(db_folder >= 0 && db_folder < rename) << "db/ not synced before the rename\n"
                                                    << Dump(lines);
  EXPECT_GT(Find(lines, SyncOf(snaps), rename + 1), rename)
      << "the snapshots folder not synced after the rename\n"
      << Dump(lines);
}

TEST_F(DurabilityTrace, RestoreSyncsTheCopyBeforeTheSwapAndEachRenameBeforeTheNext) {
  auto admin = server_.AdminClient();
  ASSERT_TRUE(admin->CreateSnapshot("s1").ok());
  auto trace = TraceServer();
  if (!trace->attached()) GTEST_SKIP() << "cannot attach strace (ptrace not permitted here)";
  auto restored = admin->RestoreSnapshot("s1");
  ASSERT_TRUE(restored.ok()) << restored.status().ToString();
  const auto lines = trace->Stop();
  const fs::path data = server_.dir() / "data";
  const fs::path db = data / "db", copy = data / "db.restore", old = data / "db.old";
  const int aside = Find(lines, {"rename", "\"" + db.string() + "\"", old.string()});
  const int in_place =
      Find(lines, {"rename", "\"" + copy.string() + "\"", "\"" + db.string() + "\""});
  ASSERT_GE(aside, 0) << Dump(lines);
  ASSERT_GT(in_place, aside) << Dump(lines);
  const int copy_synced = Find(lines, SyncOf(copy));
  const int a_file = Find(lines, {"fsync(", "<" + copy.string() + "/"});
  EXPECT_TRUE(copy_synced >= 0 && copy_synced < aside) << "the copy not synced first\n"
                                                       << Dump(lines);
  EXPECT_TRUE(a_file >= 0 && a_file < aside) << "no file of the copy synced first\n" << Dump(lines);
  const int between = Find(lines, SyncOf(data), aside + 1);
  EXPECT_TRUE(between > aside && between < in_place)
      << "the first rename not durable before the second\n"
      << Dump(lines);
  EXPECT_GT(Find(lines, SyncOf(data), in_place + 1), in_place)
      << "the data folder not synced after the swap\n"
      << Dump(lines);
}

TEST(DurabilityTraceCtl, KeygenSyncsEachFileBeforeItsNameAndTheFolderAfter) {
  if (!HaveStrace()) GTEST_SKIP() << "strace is not installed (deploy/install-deps.sh)";
  const fs::path dir =
      fs::temp_directory_path() / ("isthmus-keygen-trace-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fs::path out = dir / "trace.txt";
  const auto r =
      RunCommand(std::string("strace -f -y -qq -e ") + kTraced + " -o " + out.string() + " " +
                 ISTHMUS_CTL_BIN + " keygen --out " + (dir / "k").string() + " 2>&1");
  if (r.exit_code != 0 && r.output.find("ptrace") != std::string::npos) {
    fs::remove_all(dir);
    GTEST_SKIP() << "cannot run strace here: " << r.output;
  }
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto lines = Lines(out);
  for (const char* name : {"k.key", "k.pub"}) {
    const fs::path file = dir / name;
    const int rename =
        Find(lines, {"rename", "\"" + file.string() + ".tmp\"", "\"" + file.string() + "\""});
    ASSERT_GE(rename, 0) << name << "\n" << Dump(lines);
    const int data = Find(lines, {"fsync(", "<" + file.string() + ".tmp>"});
    EXPECT_TRUE(data >= 0 && data < rename) << name << " not synced before its name\n"
                                            << Dump(lines);
    EXPECT_GT(Find(lines, SyncOf(dir), rename + 1), rename)
        << "the folder not synced after " << name << "\n"
        << Dump(lines);
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace isthmus
