// RocksDB and in-memory implementations of Store. The RocksDB one keeps large values (of
// any column) in per-key A/B slot files next to the database (see store.h) so a push or a
// round writes each once instead of through the WAL, the memtable and a later flush.
#include "server/storage/store.h"

#include <fcntl.h>
#include <rocksdb/db.h>
#include <rocksdb/statistics.h>
#include <rocksdb/utilities/checkpoint.h>
#include <rocksdb/write_batch.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <set>

#include "common/crc32c.h"
#include "common/direct_file.h"
#include "common/durable.h"

namespace isthmus {

const char* ColumnName(Column c) {
  switch (c) {
    case Column::kJobs:
      return "jobs";
    case Column::kTensorMeta:
      return "tensor_meta";
    case Column::kTensors:
      return "tensors";
    case Column::kDedup:
      return "dedup";
    case Column::kDedupLog:
      return "dedup_log";
    case Column::kSync:
      return "sync";
    case Column::kDeltas:
      return "deltas";
    case Column::kState:
      return "sync_state";
    case Column::kCount:
      break;
  }
  return "?";
}

namespace {

// The default staged write: the batch, applied by Apply.
struct DeferredWrite : StagedWrite {
  explicit DeferredWrite(const WriteBatch& b) : batch(&b) {}
  void Fill() override {}
  const WriteBatch* batch;
};

}  // namespace

Result<std::unique_ptr<StagedWrite>> Store::Stage(const WriteBatch& batch) {
  return std::unique_ptr<StagedWrite>(std::make_unique<DeferredWrite>(batch));
}

Status Store::Apply(std::unique_ptr<StagedWrite> staged, const WriteBatch& more) {
  auto* w = dynamic_cast<DeferredWrite*>(staged.get());
  if (w == nullptr) return Status::Internal("a staged write applied to another store");
  WriteBatch both;
  for (const auto* b : {w->batch, &more}) {
    for (const auto& op : b->ops()) {
      if (op.is_delete) {
        both.Delete(op.column, op.key);
      } else {
        both.Put(op.column, op.key, op.value);
      }
    }
  }
  return Write(both);
}

namespace {

namespace fs = std::filesystem;

// Where a large value lives: slot file <id>.<a|b> in <db>/slots/.
struct SlotRef {
  uint64_t id = 0;
  uint32_t slot = 0;  // 0 = a, 1 = b
  uint64_t size = 0;
  uint32_t crc = 0;
};

constexpr char kSlotMagic[4] = {'I', 'S', 'L', '1'};
constexpr size_t kSlotRecordBytes = 4 + 8 + 4 + 8 + 4;

std::string EncodeSlotRef(const SlotRef& r) {
  std::string s(kSlotRecordBytes, '\0');
  char* p = s.data();
  std::memcpy(p, kSlotMagic, 4);
  std::memcpy(p + 4, &r.id, 8);
  std::memcpy(p + 12, &r.slot, 4);
  std::memcpy(p + 16, &r.size, 8);
  std::memcpy(p + 24, &r.crc, 4);
  return s;
}

std::optional<SlotRef> DecodeSlotRef(std::string_view s) {
  if (s.size() != kSlotRecordBytes || std::memcmp(s.data(), kSlotMagic, 4) != 0) return {};
  SlotRef r;
  std::memcpy(&r.id, s.data() + 4, 8);
  std::memcpy(&r.slot, s.data() + 12, 4);
  std::memcpy(&r.size, s.data() + 16, 8);
  std::memcpy(&r.crc, s.data() + 24, 4);
  if (r.slot > 1) return {};
  return r;
}

std::string SlotFileName(uint64_t id, uint32_t slot) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%016llx.%c", static_cast<unsigned long long>(id),
                slot == 0 ? 'a' : 'b');
  return buf;
}

// Parses a slot file name; nullopt for anything else.
std::optional<uint64_t> SlotFileId(const std::string& name) {
  if (name.size() != 18 || name[16] != '.' || (name[17] != 'a' && name[17] != 'b')) return {};
  uint64_t id = 0;
  for (int i = 0; i < 16; ++i) {
    char c = name[i];
    int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (d < 0) return {};
    id = id * 16 + static_cast<uint64_t>(d);
  }
  return id;
}

// A value held in a slot file: its column and key.
using SlotKey = std::pair<int, std::string>;

// The key of a slot's pointer record in the default column family. kTensors keys are
// stored as they are (the layout from before other columns had slot files, so existing
// stores read on); other columns' keys carry a tag byte that no job name starts with
// (keys.h) and the column's number.
constexpr char kSlotColumnTag = '\xff';

std::string SlotRecordKey(Column c, std::string_view key) {
  if (c == Column::kTensors) return std::string(key);
  std::string k;
  k.reserve(key.size() + 2);
  k.push_back(kSlotColumnTag);
  k.push_back(static_cast<char>(c));
  k.append(key);
  return k;
}

std::optional<SlotKey> ParseSlotRecordKey(std::string_view k) {
  if (k.empty() || k[0] != kSlotColumnTag) {
    return SlotKey{static_cast<int>(Column::kTensors), std::string(k)};
  }
  if (k.size() < 2) return {};
  const int c = static_cast<unsigned char>(k[1]);
  if (c >= static_cast<int>(Column::kCount) || c == static_cast<int>(Column::kTensors)) return {};
  return SlotKey{c, std::string(k.substr(2))};
}

Status Errno(const std::string& what) {
  return Status::IoError(what + ": " + std::strerror(errno));
}

Status FromRocks(const rocksdb::Status& s, const std::string& what) {
  if (s.ok()) return Status::Ok();
  if (s.IsCorruption()) return Status::Corruption(what + ": " + s.ToString());
  return Status::IoError(what + ": " + s.ToString());
}

// The pid of another process holding the LOCK file of the RocksDB in `dir` (RocksDB takes a
// POSIX record lock on it), or 0. Call it only when this process does not hold that lock
// itself: closing any descriptor of a file drops the closing process's record locks on it.
pid_t LockHolder(const std::string& dir) {
  const int fd = ::open((dir + "/LOCK").c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  struct flock fl {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  pid_t pid = 0;
  if (::fcntl(fd, F_GETLK, &fl) == 0 && fl.l_type != F_UNLCK) pid = fl.l_pid;
  ::close(fd);
  return pid;
}

// RocksDB's own log lines go to the shard's log (journal or stderr), not to a LOG file in
// the database folder: on a full disk a failed append to that file left its writer in an
// error state, and RocksDB's next line (the one reporting the error) aborted the process
// (Debian's RocksDB 7.8 asserts that a failed writer is not used again). Warnings and
// errors at those levels; the rest, which is verbose, at debug.
class RocksLogToSpdlog : public rocksdb::Logger {
 public:
  explicit RocksLogToSpdlog(std::string dir)
      : rocksdb::Logger(rocksdb::InfoLogLevel::INFO_LEVEL), dir_(std::move(dir)) {}
  using rocksdb::Logger::Logv;
  void Logv(const char* format, va_list ap) override {
    Logv(rocksdb::InfoLogLevel::INFO_LEVEL, format, ap);
  }
  void Logv(const rocksdb::InfoLogLevel level, const char* format, va_list ap) override {
    char line[1024];
    std::vsnprintf(line, sizeof line, format, ap);
    if (level >= rocksdb::InfoLogLevel::ERROR_LEVEL &&
        level != rocksdb::InfoLogLevel::HEADER_LEVEL) {
      spdlog::error("rocksdb '{}': {}", dir_, line);
    } else if (level == rocksdb::InfoLogLevel::WARN_LEVEL) {
      spdlog::warn("rocksdb '{}': {}", dir_, line);
    } else {
      spdlog::debug("rocksdb '{}': {}", dir_, line);
    }
  }

 private:
  std::string dir_;
};

class RocksStore : public Store {
 public:
  ~RocksStore() override { CloseDb(); }

  static Result<std::unique_ptr<Store>> Open(const std::string& dir, const StoreOptions& options) {
    auto store = std::unique_ptr<RocksStore>(new RocksStore());
    store->options_ = options;
    store->write_options_.sync = options.sync_writes;
    store->dir_ = dir;
    store->sync_ = options.sync_writes;
    store->slot_dir_ = (fs::path(dir) / "slots").string();
    // The database folder's name durable before anything is written in it (RocksDB syncs
    // the folder's contents, never the folder above it).
    ISTHMUS_RETURN_IF_ERROR(CreateDirectoriesDurably(dir));
    // On a disk without the reserve RocksDB's recovery (a new log, a flush, the manifest)
    // could fail half-way: open read-only and serve reads until space returns.
    const bool full = options.min_free_bytes > 0 && store->FreeBytes() < options.min_free_bytes;
    ISTHMUS_RETURN_IF_ERROR(store->OpenDb(/*read_only=*/full));
    return std::unique_ptr<Store>(std::move(store));
  }

  Status Write(const WriteBatch& batch) override {
    Staged w(this, batch);
    ISTHMUS_RETURN_IF_ERROR(Reserve(w));
    w.Fill();
    return Commit(w, nullptr);
  }

  Result<std::unique_ptr<StagedWrite>> Stage(const WriteBatch& batch) override {
    auto w = std::make_unique<Staged>(this, batch);
    w->paced = true;
    ISTHMUS_RETURN_IF_ERROR(Reserve(*w));
    for (const auto& [key, ref] : w->refs) staged_[key] = w.get();
    return std::unique_ptr<StagedWrite>(std::move(w));
  }

  Status Apply(std::unique_ptr<StagedWrite> staged, const WriteBatch& more) override {
    auto* w = dynamic_cast<Staged*>(staged.get());
    if (w == nullptr || w->store != this) {
      return Status::Internal("a staged write applied to another store than staged it");
    }
    for (const auto& op : more.ops()) {
      if (IsLarge(op)) {
        return Status::Internal("a staged write's small ops hold a large value ('" + op.key + "')");
      }
    }
    w->Fill();  // unless it has run (or runs now): then it waits below
    w->WaitFilled();
    {
      std::lock_guard<std::mutex> lock(w->mu);
      if (w->superseded) {
        return Status::FailedPrecondition(
            "a later write of the same keys superseded the staged write");
      }
    }
    Release(*w);
    return Commit(*w, &more);
  }

  Result<std::optional<std::string>> Get(Column c, std::string_view key) override {
    if (!db_)
      return Status::IoError("store '" + dir_ + "' could not be reopened: restart the shard");
    auto it = slots_.find(SlotKey{static_cast<int>(c), std::string(key)});
    if (it != slots_.end()) {
      ISTHMUS_ASSIGN_OR_RETURN(std::string v, ReadSlotFile(it->second));
      return std::optional<std::string>(std::move(v));
    }
    std::string value;
    auto s =
        db_->Get(rocksdb::ReadOptions(), Handle(c), rocksdb::Slice(key.data(), key.size()), &value);
    if (s.IsNotFound()) return std::optional<std::string>();
    if (!s.ok()) return FromRocks(s, "RocksDB get");
    return std::optional<std::string>(std::move(value));
  }

  Status Scan(Column c, std::string_view prefix,
              const std::function<bool(std::string_view, std::string_view)>& fn) override {
    return ScanMerged(c, prefix, fn, /*read_slots=*/true);
  }
  Status ScanKeys(Column c, std::string_view prefix,
                  const std::function<bool(std::string_view)>& fn) override {
    return ScanMerged(
        c, prefix, [&](std::string_view k, std::string_view) { return fn(k); },
        /*read_slots=*/false);
  }
  // The column's keys under `prefix`, RocksDB's and the slot files', in key order; the
  // values of slot-file keys are read only when `read_slots` (else fn gets an empty one).
  Status ScanMerged(Column c, std::string_view prefix,
                    const std::function<bool(std::string_view, std::string_view)>& fn,
                    bool read_slots) {
    if (!db_)
      return Status::IoError("store '" + dir_ + "' could not be reopened: restart the shard");
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), Handle(c)));
    // Merge the column's keys held in slot files, in key order.
    auto slot = slots_.lower_bound(SlotKey{static_cast<int>(c), std::string(prefix)});
    auto slot_in_range = [&] {
      return slot != slots_.end() && slot->first.first == static_cast<int>(c) &&
             std::string_view(slot->first.second).starts_with(prefix);
    };
    it->Seek(rocksdb::Slice(prefix.data(), prefix.size()));
    while (true) {
      bool db_valid =
          it->Valid() && it->key().starts_with(rocksdb::Slice(prefix.data(), prefix.size()));
      if (!db_valid && !slot_in_range()) break;
      if (slot_in_range() &&
          (!db_valid || std::string_view(slot->first.second) <
                            std::string_view(it->key().data(), it->key().size()))) {
        std::string v;
        if (read_slots) {
          ISTHMUS_ASSIGN_OR_RETURN(v, ReadSlotFile(slot->second));
        }
        if (!fn(slot->first.second, v)) break;
        ++slot;
        continue;
      }
      auto k = it->key();
      if (!fn(std::string_view(k.data(), k.size()),
              std::string_view(it->value().data(), it->value().size()))) {
        break;
      }
      it->Next();
    }
    return FromRocks(it->status(), "RocksDB scan");
  }

  Status Checkpoint(const std::string& dir) override {
    ISTHMUS_RETURN_IF_ERROR(MakeRoomFor(0));  // a checkpoint flushes the memtables first
    rocksdb::Checkpoint* cp = nullptr;
    ISTHMUS_RETURN_IF_ERROR(FromRocks(rocksdb::Checkpoint::Create(db_.get(), &cp), "checkpoint"));
    std::unique_ptr<rocksdb::Checkpoint> owner(cp);
    // log_size_for_flush = 0: flush memtables so the checkpoint needs no WAL replay.
    ISTHMUS_RETURN_IF_ERROR(
        FromRocks(cp->CreateCheckpoint(dir, 0), "creating checkpoint at '" + dir + "'"));
    if (slots_.empty()) return Status::Ok();
    // The store's single user is not writing now, so slots_ is what the checkpoint names.
    const fs::path out = fs::path(dir) / "slots";
    std::error_code ec;
    fs::create_directories(out, ec);
    if (ec) return Status::IoError("cannot create '" + out.string() + "': " + ec.message());
    for (const auto& [key, ref] : slots_) {
      const std::string name = SlotFileName(ref.id, ref.slot);
      fs::create_hard_link(fs::path(slot_dir_) / name, out / name, ec);
      if (ec) {  // another filesystem: copy
        ec.clear();
        fs::copy_file(fs::path(slot_dir_) / name, out / name, ec);
        if (ec) return Status::IoError("cannot copy slot file into checkpoint: " + ec.message());
      }
    }
    return SyncPath(out.string());
  }

  uint64_t reopens() const override { return reopens_; }

  uint64_t ApproximateBytes() override {
    uint64_t total = 0;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(dir_, ec)) {
      if (e.is_regular_file(ec)) total += e.file_size(ec);
    }
    for (const auto& e : fs::directory_iterator(slot_dir_, ec)) {
      if (e.is_regular_file(ec)) total += e.file_size(ec);
    }
    return total;
  }

  StoreMetrics Metrics() override {
    StoreMetrics m;
    if (!db_) return m;
    m.rocksdb = true;
    m.disk_bytes = ApproximateBytes();
    auto sum = [&](const char* property) {
      uint64_t v = 0;
      return db_->GetAggregatedIntProperty(property, &v) ? v : uint64_t{0};
    };
    m.sst_bytes = sum(rocksdb::DB::Properties::kTotalSstFilesSize.c_str());
    m.blob_bytes = sum(rocksdb::DB::Properties::kTotalBlobFileSize.c_str());
    m.memtable_bytes = sum(rocksdb::DB::Properties::kCurSizeAllMemTables.c_str());
    m.live_data_bytes = sum(rocksdb::DB::Properties::kEstimateLiveDataSize.c_str());
    m.pending_compaction_bytes =
        sum(rocksdb::DB::Properties::kEstimatePendingCompactionBytes.c_str());
    uint64_t v = 0;
    if (db_->GetIntProperty(rocksdb::DB::Properties::kIsWriteStopped, &v)) m.write_stopped = v != 0;
    if (db_->GetIntProperty(rocksdb::DB::Properties::kActualDelayedWriteRate, &v)) {
      m.delayed_write_rate = v;
    }
    if (statistics_) m.write_stall_micros = statistics_->getTickerCount(rocksdb::STALL_MICROS);
    for (const auto& [key, ref] : slots_) m.slot_bytes += ref.size;
    m.free_bytes = FreeBytes();
    m.no_space_refusals = no_space_refusals_;
    m.read_only = read_only_ || needs_reopen_;
    return m;
  }

 private:
  RocksStore() = default;
  rocksdb::ColumnFamilyHandle* Handle(Column c) { return handles_[1 + static_cast<int>(c)]; }

  // Opens (or reopens) the database in dir_: read-write, or read-only (nothing written:
  // no new log, no flush, no slot-file clean-up) when the disk is full.
  Status OpenDb(bool read_only) {
    CloseDb();
    rocksdb::DBOptions db_opts;
    db_opts.create_if_missing = true;
    db_opts.create_missing_column_families = true;
    db_opts.paranoid_checks = true;
    db_opts.info_log = std::make_shared<RocksLogToSpdlog>(dir_);
    db_opts.max_total_wal_size = options_.max_wal_bytes;
    // Tickers only (no per-operation timers): write stalls for the metrics endpoint.
    db_opts.statistics = rocksdb::CreateDBStatistics();
    db_opts.statistics->set_stats_level(rocksdb::StatsLevel::kExceptTimers);
    // Tensors are large values: big memtables keep a 64 MiB tensor from forcing a flush
    // per write, and blob files keep compaction from rewriting them.
    rocksdb::ColumnFamilyOptions small;
    rocksdb::ColumnFamilyOptions large;
    large.write_buffer_size = 256 << 20;
    large.enable_blob_files = true;
    large.min_blob_size = 4096;
    large.enable_blob_garbage_collection = true;
    std::vector<rocksdb::ColumnFamilyDescriptor> cfs;
    cfs.emplace_back(rocksdb::kDefaultColumnFamilyName, small);
    for (int i = 0; i < static_cast<int>(Column::kCount); ++i) {
      auto c = static_cast<Column>(i);
      // Encoded deltas and fp32 sync state are tensor-sized too.
      const bool big = c == Column::kTensors || c == Column::kDeltas || c == Column::kState;
      cfs.emplace_back(ColumnName(c), big ? large : small);
    }
    rocksdb::DB* db = nullptr;
    std::vector<rocksdb::ColumnFamilyHandle*> handles;
    auto s = read_only ? rocksdb::DB::OpenForReadOnly(db_opts, dir_, cfs, &handles, &db)
                       : rocksdb::DB::Open(db_opts, dir_, cfs, &handles, &db);
    if (!s.ok() && read_only && s.IsInvalidArgument()) {
      // A store that does not exist yet cannot be opened read-only; nor created on a full
      // disk.
      return Status::ResourceExhausted(NoSpaceText(0));
    }
    if (!s.ok()) {
      // RocksDB refuses a database whose LOCK another open holds: one of this process
      // (it says so; the lock must not be probed then) or of another.
      if (s.ToString().find("lock hold by current process") != std::string::npos) {
        return Status::IoError("cannot open RocksDB at '" + dir_ +
                               "': this process has it open already: " + s.ToString());
      }
      if (const pid_t holder = LockHolder(dir_); holder > 0) {
        return Status::IoError("cannot open RocksDB at '" + dir_ + "': process " +
                               std::to_string(holder) +
                               " holds its LOCK (another isthmus-server with this "
                               "shard.data_dir?): stop it, or give this shard its own folder");
      }
      if (s.IsNoSpace()) return Status::ResourceExhausted(NoSpaceText(0) + ": " + s.ToString());
      return FromRocks(s, "cannot open RocksDB at '" + dir_ + "'");
    }
    statistics_ = db_opts.statistics;
    db_.reset(db);
    default_ = handles[0];
    handles_ = handles;
    read_only_ = read_only;
    needs_reopen_ = false;
    if (read_only) {
      spdlog::warn(
          "store '{}': {} bytes free, less than storage.min_free_bytes ({}): opened read-only; "
          "pulls are served, writes are refused until space returns",
          dir_, FreeBytes(), options_.min_free_bytes);
    }
    return LoadSlots();
  }

  void CloseDb() {
    for (auto* h : handles_) db_->DestroyColumnFamilyHandle(h);
    handles_.clear();
    if (db_) db_->Close();
    db_.reset();
    slots_.clear();
  }

  // Free bytes on the store's disk for an unprivileged writer (0 when unknown).
  uint64_t FreeBytes() const {
    struct statvfs s {};
    if (::statvfs(dir_.c_str(), &s) != 0) return 0;
    return uint64_t{s.f_bavail} * s.f_frsize;
  }

  std::string NoSpaceText(uint64_t need) const {
    return "disk full: " + std::to_string(FreeBytes()) + " bytes free on the disk of '" + dir_ +
           "'" + (need > 0 ? ", this write needs " + std::to_string(need) : std::string()) +
           " and storage.min_free_bytes keeps " + std::to_string(options_.min_free_bytes) +
           " free; free space there (nothing was written; the shard takes writes again by "
           "itself once there is room)";
  }

  // Refuses a write of `bytes` that would leave less than the reserve, and gets a store
  // that stopped for want of space writing again once there is room (reopening a read-only
  // one, resuming RocksDB after an out-of-space error). Nothing is written when refused.
  Status MakeRoomFor(uint64_t bytes) {
    const uint64_t need = bytes + options_.min_free_bytes;
    const bool stopped = read_only_ || needs_reopen_;
    if ((options_.min_free_bytes > 0 || stopped) && FreeBytes() < need) {
      ++no_space_refusals_;
      return Status::ResourceExhausted(NoSpaceText(bytes));
    }
    if (stopped) SupersedeAll();  // a reopen removes the slot files no record names
    if (read_only_) {
      if (Status s = OpenDb(/*read_only=*/false); !s.ok()) {
        // Keep serving reads as before; the next write tries again.
        ISTHMUS_RETURN_IF_ERROR(OpenDb(/*read_only=*/true));
        ++no_space_refusals_;
        return Status::ResourceExhausted(NoSpaceText(bytes) +
                                         " (reopening for writes failed: " + s.ToString() + ")");
      }
      spdlog::info("store '{}': space is back ({} bytes free): writing again", dir_, FreeBytes());
    } else if (needs_reopen_) {
      // Reopened, not DB::Resume(): resuming writes through the log writer that failed is
      // what RocksDB before 9.x does, and (Debian's 7.8 asserts) it must not be used again.
      // Reopening replays the log into a new one, and with it any write that failed after
      // reaching the log: callers read their state again (reopens()) before writing.
      ++reopens_;
      if (Status s = OpenDb(/*read_only=*/false); !s.ok()) {
        needs_reopen_ = true;
        ISTHMUS_RETURN_IF_ERROR(OpenDb(/*read_only=*/true));
        ++no_space_refusals_;
        return Status::ResourceExhausted(NoSpaceText(bytes) +
                                         " (reopening for writes failed: " + s.ToString() + ")");
      }
      spdlog::info("store '{}': space is back ({} bytes free): reopened for writes", dir_,
                   FreeBytes());
      return Status::Unavailable(
          "the store was reopened after a failed write and the shard reads its state again; "
          "retry the request");
    }
    return Status::Ok();
  }

  // A write failed with `s`: when for want of space, say so (and recover at a later
  // write); otherwise pass it on.
  Status NoteWriteError(const Status& s, uint64_t bytes) {
    const bool no_space = s.message().find("No space left") != std::string::npos ||
                          s.message().find("NoSpace") != std::string::npos;
    if (!no_space) return s;
    ++no_space_refusals_;
    needs_reopen_ = true;
    spdlog::warn("store '{}': {}", dir_, s.ToString());
    return Status::ResourceExhausted(NoSpaceText(bytes) + " [" + s.message() + "]");
  }

  static bool IsLarge(const WriteBatch::Op& op) {
    return !op.is_delete && op.value.size() >= kSlotFileMinBytes;
  }

  std::string SlotPath(uint64_t id, uint32_t slot) const {
    return (fs::path(slot_dir_) / SlotFileName(id, slot)).string();
  }

  // Reads the pointer records (default column family) and removes slot files no record
  // names: leftovers of batches that never committed.
  Status LoadSlots() {
    ISTHMUS_RETURN_IF_ERROR(CreateDirectoriesDurably(slot_dir_));
    std::error_code ec;
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), default_));
    for (it->SeekToFirst(); it->Valid(); it->Next()) {
      auto ref = DecodeSlotRef(std::string_view(it->value().data(), it->value().size()));
      auto key = ParseSlotRecordKey(std::string_view(it->key().data(), it->key().size()));
      if (!ref || !key) {
        return Status::Corruption("bad slot record for key '" + it->key().ToString() + "'");
      }
      slots_[*key] = *ref;
      next_slot_id_ = std::max(next_slot_id_, ref->id + 1);
    }
    ISTHMUS_RETURN_IF_ERROR(FromRocks(it->status(), "reading slot records"));
    std::set<uint64_t> used;
    for (const auto& [key, ref] : slots_) used.insert(ref.id);
    for (const auto& e : fs::directory_iterator(slot_dir_, ec)) {
      auto id = SlotFileId(e.path().filename().string());
      if (!id) continue;
      next_slot_id_ = std::max(next_slot_id_, *id + 1);
      if (!used.count(*id) && !read_only_) fs::remove(e.path(), ec);
    }
    return Status::Ok();
  }

  // Opens the slot file `ref` names for writing, reusing the file; one shared with a
  // checkpoint (hard link) is replaced instead, and *fresh set when a directory entry was
  // created (the caller syncs the folder). `synced`: the write will be synced, so it is made
  // with O_DIRECT where the options ask for it (*direct says whether it was).
  Result<int> OpenSlotFile(const SlotRef& ref, bool synced, bool* fresh, bool* direct) {
    const std::string path = SlotPath(ref.id, ref.slot);
    const bool want_direct = synced && options_.direct_slot_writes;
    int fd = OpenMaybeDirect(path, O_WRONLY | O_CLOEXEC, 0644, want_direct, direct);
    if (fd >= 0) {
      struct stat st;
      if (::fstat(fd, &st) != 0 || st.st_nlink > 1) {
        ::close(fd);
        fd = -1;
        if (::unlink(path.c_str()) != 0) return Errno("cannot replace '" + path + "'");
      }
    }
    if (fd < 0) {
      fd = OpenMaybeDirect(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644, want_direct,
                           direct);
      if (fd < 0) return Errno("cannot create slot file '" + path + "'");
      *fresh = true;
    }
    return fd;
  }

  // Writes `value` into the slot file `ref` names, reusing the file. A file shared with a
  // checkpoint (hard link) is replaced instead. Sets *fresh when a directory entry was
  // created (the caller syncs the folder). With `unsynced`, the file's writeback is started
  // and its open descriptor handed over for the caller to fdatasync and close; without it
  // the file is not synced. `paced` (a staged write's Fill, with `unsynced`): every 8 MiB
  // written is also waited for, so the disk's queue holds little of it and a write the
  // store's thread makes meanwhile (a push's fdatasync) does not queue behind all of it.
  //
  // A synced store writes the file with O_DIRECT (StoreOptions::direct_slot_writes;
  // common/direct_file.h): 8 MiB at a time through an aligned buffer straight to the disk,
  // instead of the kernel copying
  // every page into its page cache, writing it back later and dropping it after the sync.
  // A full-mode checkpoint (683 MB a shard) spent most of a second of CPU in that copy, and
  // this machine's disk takes direct writes about three times as fast as buffered ones
  // with fdatasync (docs/BENCHMARKS.md, section 7). The last block is padded with zeros and
  // the file cut back to the value's size; the fdatasync that follows still makes the
  // size and the disk's cache durable. A file system that refuses O_DIRECT (EINVAL, at the
  // open or at a write) gets buffered writes, as with the option off.
  Status WriteSlotFile(const SlotRef& ref, std::string_view value, bool* fresh, int* unsynced,
                       bool paced = false) {
    const std::string path = SlotPath(ref.id, ref.slot);
    bool direct = false;
    ISTHMUS_ASSIGN_OR_RETURN(int fd, OpenSlotFile(ref, unsynced != nullptr, fresh, &direct));
    Status s;
    if (direct) {  // the writer falls back to buffered writes itself
      DirectFileWriter writer(fd, path, true);
      s = writer.Append(value.data(), value.size());
      if (s.ok()) s = writer.Finish();
    }
    const char* p = value.data();
    size_t left = direct ? 0 : value.size();
    off_t off = 0;
    constexpr size_t kPaceBytes = size_t{8} << 20;
    off_t paced_to = off;
    while (left > 0 && s.ok()) {
      ssize_t n = ::pwrite(fd, p, paced ? std::min(left, kPaceBytes) : left, off);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        s = Errno("cannot write slot file '" + path + "'");
        break;
      }
      p += n, left -= static_cast<size_t>(n), off += n;
      if (paced && unsynced != nullptr && (off - paced_to >= off_t{kPaceBytes} || left == 0)) {
        (void)::sync_file_range(
            fd, paced_to, off - paced_to,
            SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
        paced_to = off;
      }
    }
    struct stat st;
    if (s.ok() && ::fstat(fd, &st) == 0 && static_cast<uint64_t>(st.st_size) > value.size() &&
        ::ftruncate(fd, static_cast<off_t>(value.size())) != 0) {
      s = Errno("cannot truncate slot file '" + path + "'");
    }
    if (s.ok() && unsynced != nullptr) {
      // Start writing it out now; the caller waits for it once every value is written.
      (void)::sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE);
      *unsynced = fd;
      return s;
    }
    ::close(fd);
    return s;
  }

  Result<std::string> ReadSlotFile(const SlotRef& ref) const {
    const std::string path = SlotPath(ref.id, ref.slot);
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0)
      return Status::Corruption("slot file '" + path + "' is missing: " + std::strerror(errno));
    std::string v(ref.size, '\0');
    size_t got = 0;
    while (got < v.size()) {
      ssize_t n = ::pread(fd, v.data() + got, v.size() - got, static_cast<off_t>(got));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      got += static_cast<size_t>(n);
    }
    ::close(fd);
    if (got != v.size()) return Status::Corruption("slot file '" + path + "' is too short");
    if (Crc32c(v.data(), v.size()) != ref.crc) {
      return Status::Corruption("slot file '" + path + "' fails its checksum");
    }
    return v;
  }

  // A batch on its way to the store (Write, or Stage, Fill and Apply): the slot each large
  // value fills, chosen by Reserve (store's thread), and Fill's outcome.
  struct Staged : StagedWrite {
    Staged(RocksStore* s, const WriteBatch& b) : store(s), batch(&b) {}
    ~Staged() override {
      for (auto& [op, part] : prefixes) {
        if (part.fd >= 0) ::close(part.fd);
      }
      if (!reserved) return;
      store->Release(*this);
      for (uint64_t id : created) store->RemoveSlotFiles(id);
    }
    Status FillPrefix(size_t op, size_t ready) override {
      {
        std::lock_guard<std::mutex> lock(mu);
        // Fill writes the rest (or wrote it all), or a later write holds the keys now.
        if (started || superseded) return Status::Ok();
      }
      return store->FillSlotPrefix(*this, op, ready);
    }
    void Fill() override {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (started) return;
        started = true;
        if (superseded) {
          filled = true;
          return;
        }
      }
      Status s = store->FillSlots(*this);
      std::lock_guard<std::mutex> lock(mu);
      fill_status = std::move(s);
      filled = true;
      cv.notify_all();
    }
    // Store's thread: Fill has returned, or will not write (superseded first).
    void WaitFilled() {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return filled || !started; });
    }
    // A large value FillPrefix began: its open file, its writer and the crc32c of the
    // bytes it took.
    struct Prefix {
      int fd = -1;
      std::unique_ptr<DirectFileWriter> writer;
      uint32_t crc = 0;
      size_t done = 0;
    };
    RocksStore* store;
    const WriteBatch* batch;
    std::vector<std::optional<SlotRef>> op_refs;  // per op: the slot its large value fills
    std::map<size_t, Prefix> prefixes;            // per op index, those FillPrefix began
    std::map<SlotKey, SlotRef> refs;              // the large values' keys
    std::vector<uint64_t> created;                // ids of slot files created for it
    uint64_t bytes = 0;
    bool reserved = false;  // Reserve succeeded; Commit or the destructor releases it
    bool paced = false;     // staged (Stage): filled while the store's thread writes too
    bool new_dirent = false;
    std::mutex mu;
    std::condition_variable cv;
    bool started = false, filled = false, superseded = false;  // under mu
    Status fill_status;                                        // under mu
  };

  // Store's thread: room for the batch, and the slot of each large value (the one the
  // committed record does not name). Supersedes a staged write that holds one of its keys.
  Status Reserve(Staged& w) {
    for (const auto& op : w.batch->ops()) w.bytes += op.key.size() + op.value.size();
    for (const auto& op : w.batch->ops()) Supersede(SlotKey{static_cast<int>(op.column), op.key});
    ISTHMUS_RETURN_IF_ERROR(MakeRoomFor(w.bytes));
    std::map<SlotKey, std::optional<SlotRef>> changed;  // within the batch, in op order
    for (const auto& op : w.batch->ops()) {
      SlotKey sk{static_cast<int>(op.column), op.key};
      if (!IsLarge(op)) {
        w.op_refs.emplace_back();
        if (slots_.count(sk) > 0 || changed.count(sk) > 0) changed[sk] = std::nullopt;
        continue;
      }
      SlotRef ref;
      auto committed = slots_.find(sk);
      if (committed != slots_.end()) {
        ref.id = committed->second.id;
        ref.slot = 1 - committed->second.slot;
      } else {
        auto pending = changed.find(sk);
        if (pending != changed.end() && pending->second) {
          ref.id = pending->second->id;
        } else {
          ref.id = next_slot_id_++;
          w.created.push_back(ref.id);
        }
      }
      ref.size = op.value.size();
      w.op_refs.push_back(ref);
      changed[sk] = ref;
      w.refs[sk] = ref;
    }
    w.reserved = true;
    return Status::Ok();
  }

  // Any thread: writes the large values into their slots, every file's writeback started
  // before the first is waited for, so a batch of many large values pays for one wait on
  // the disk rather than one per value. Touches only the files Reserve chose.
  Status FillSlots(Staged& w) {
    std::vector<std::pair<int, std::string>> unsynced;
    struct CloseAll {
      std::vector<std::pair<int, std::string>>& fds;
      ~CloseAll() {
        for (auto& [fd, path] : fds) ::close(fd);
      }
    } close_all{unsynced};
    const auto& ops = w.batch->ops();
    for (size_t i = 0; i < ops.size(); ++i) {
      auto& ref = w.op_refs[i];
      if (!ref) continue;
      if (auto p = w.prefixes.find(i); p != w.prefixes.end() && p->second.fd >= 0) {
        // FillPrefix wrote the start: the rest through the same writer.
        Status s = FillSlotPrefix(w, i, ops[i].value.size());
        if (s.ok()) s = p->second.writer->Finish();
        ref->crc = p->second.crc;
        p->second.writer.reset();
        if (sync_) {
          (void)::sync_file_range(p->second.fd, 0, 0, SYNC_FILE_RANGE_WRITE);
          unsynced.emplace_back(p->second.fd, SlotPath(ref->id, ref->slot));
        } else {
          ::close(p->second.fd);
        }
        p->second.fd = -1;
        ISTHMUS_RETURN_IF_ERROR(s);
        continue;
      }
      ref->crc = Crc32c(ops[i].value.data(), ops[i].value.size());
      bool fresh = false;
      int fd = -1;
      ISTHMUS_RETURN_IF_ERROR(
          WriteSlotFile(*ref, ops[i].value, &fresh, sync_ ? &fd : nullptr, w.paced));
      if (fd >= 0) unsynced.emplace_back(fd, SlotPath(ref->id, ref->slot));
      w.new_dirent |= fresh;
    }
    for (auto& [fd, path] : unsynced) {
      if (::fdatasync(fd) != 0) return Errno("cannot sync slot file '" + path + "'");
      // The file is read back only by a start or an attach (the shard serves from memory):
      // its now clean pages leave the page cache, so that a full-mode state's hundreds of MB
      // a checkpoint do not push other memory out (advice: an error changes nothing).
      (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    }
    if (w.new_dirent && sync_) ISTHMUS_RETURN_IF_ERROR(SyncPath(slot_dir_));
    return Status::Ok();
  }

  // Writes bytes [done, ready) of op `op`'s large value into its slot, opening the file at
  // the first call (Staged::FillPrefix; FillSlots for the rest). Small values: nothing.
  Status FillSlotPrefix(Staged& w, size_t op, size_t ready) {
    const auto& ops = w.batch->ops();
    if (op >= ops.size() || !w.op_refs[op]) return Status::Ok();
    const SlotRef& ref = *w.op_refs[op];
    ready = std::min(ready, ops[op].value.size());
    Staged::Prefix& p = w.prefixes[op];
    if (p.fd < 0) {
      bool fresh = false, direct = false;
      ISTHMUS_ASSIGN_OR_RETURN(p.fd, OpenSlotFile(ref, sync_, &fresh, &direct));
      w.new_dirent |= fresh;
      p.writer = std::make_unique<DirectFileWriter>(p.fd, SlotPath(ref.id, ref.slot), direct);
    }
    if (ready <= p.done) return Status::Ok();
    const char* from = ops[op].value.data() + p.done;
    const size_t n = ready - p.done;
    p.crc = Crc32cExtend(p.crc, from, n);
    ISTHMUS_RETURN_IF_ERROR(p.writer->Append(from, n));
    // On disk now, not when 8 MiB have gathered: the last part leaves the least to write.
    if (ready < ops[op].value.size()) ISTHMUS_RETURN_IF_ERROR(p.writer->WriteOut());
    p.done = ready;
    return Status::Ok();
  }

  // Store's thread, after Fill: commits the pointer records with the batch's small ops and
  // `more`'s in one RocksDB batch, then updates the slot map.
  Status Commit(Staged& w, const WriteBatch* more) {
    w.reserved = false;
    Status s;
    {
      std::lock_guard<std::mutex> lock(w.mu);
      s = w.fill_status;
    }
    size_t reserve = 64;
    for (const auto& op : w.batch->ops()) {
      if (!IsLarge(op)) reserve += op.key.size() + op.value.size() + 24;
    }
    rocksdb::WriteBatch wb(reserve);
    // Slot refs this batch changes (nullopt: the key leaves the slot files).
    std::map<SlotKey, std::optional<SlotRef>> changed;
    auto add = [&](const WriteBatch::Op& op, const std::optional<SlotRef>& large) -> Status {
      auto* cf = Handle(op.column);
      rocksdb::Slice key(op.key.data(), op.key.size());
      SlotKey sk{static_cast<int>(op.column), op.key};
      rocksdb::Status rs;
      if (large) {
        const std::string rec = EncodeSlotRef(*large);
        rs =
            wb.Put(default_, rocksdb::Slice(SlotRecordKey(op.column, op.key)), rocksdb::Slice(rec));
        // A key is in one place: drop an inline value it may have had.
        if (rs.ok() && slots_.count(sk) == 0) rs = wb.Delete(cf, key);
        changed[sk] = *large;
      } else {
        const bool in_slots = slots_.count(sk) > 0 || changed.count(sk) > 0;
        rs = op.is_delete ? wb.Delete(cf, key)
                          : wb.Put(cf, key, rocksdb::Slice(op.value.data(), op.value.size()));
        if (rs.ok() && in_slots) {
          rs = wb.Delete(default_, rocksdb::Slice(SlotRecordKey(op.column, op.key)));
          changed[sk] = std::nullopt;
        }
      }
      return FromRocks(rs, "building write batch");
    };
    const auto& ops = w.batch->ops();
    for (size_t i = 0; i < ops.size() && s.ok(); ++i) s = add(ops[i], w.op_refs[i]);
    if (more != nullptr) {
      for (const auto& op : more->ops()) {
        if (!s.ok()) break;
        s = add(op, std::nullopt);
      }
    }
    if (s.ok()) s = FromRocks(db_->Write(write_options_, &wb), "RocksDB write");
    if (!s.ok()) {
      // Nothing committed: files of keys that did not exist before are garbage.
      for (uint64_t id : w.created) RemoveSlotFiles(id);
      uint64_t bytes = w.bytes;
      if (more != nullptr) {
        for (const auto& op : more->ops()) bytes += op.key.size() + op.value.size();
      }
      return NoteWriteError(s, bytes);
    }
    for (auto& [key, ref] : changed) {
      if (ref) {
        slots_[key] = *ref;
        continue;
      }
      auto it = slots_.find(key);
      if (it != slots_.end()) {
        RemoveSlotFiles(it->second.id);
        slots_.erase(it);
      }
    }
    // Ids created and then dropped again within the batch.
    for (uint64_t id : w.created) {
      bool used = false;
      for (const auto& [key, ref] : changed) used |= ref && ref->id == id;
      if (!used) RemoveSlotFiles(id);
    }
    return Status::Ok();
  }

  // Store's thread: a staged write's keys are free again.
  void Release(Staged& w) {
    for (const auto& [key, ref] : w.refs) {
      auto it = staged_.find(key);
      if (it != staged_.end() && it->second == &w) staged_.erase(it);
    }
  }

  // Store's thread: a write of `key` comes while a staged write holds it. The staged write
  // finishes its files (the slots this write fills too) and is dropped: its Apply writes
  // nothing.
  void Supersede(const SlotKey& key) {
    auto it = staged_.find(key);
    if (it == staged_.end()) return;
    Staged& w = *it->second;
    {
      std::lock_guard<std::mutex> lock(w.mu);
      w.superseded = true;
    }
    w.WaitFilled();
    Release(w);
    w.reserved = false;
    for (uint64_t id : w.created) RemoveSlotFiles(id);
  }

  // Store's thread: before the database is reopened (which removes slot files no record
  // names), every staged write is dropped.
  void SupersedeAll() {
    while (!staged_.empty()) Supersede(staged_.begin()->first);
  }

  void RemoveSlotFiles(uint64_t id) {
    std::error_code ec;
    fs::remove(SlotPath(id, 0), ec);
    fs::remove(SlotPath(id, 1), ec);
  }

  std::shared_ptr<rocksdb::Statistics> statistics_;
  std::unique_ptr<rocksdb::DB> db_;
  rocksdb::ColumnFamilyHandle* default_ = nullptr;
  std::vector<rocksdb::ColumnFamilyHandle*> handles_;
  rocksdb::WriteOptions write_options_;
  std::string dir_;
  bool sync_ = true;
  std::string slot_dir_;
  StoreOptions options_;
  bool read_only_ = false;     // opened read-only on a full disk
  uint64_t reopens_ = 0;       // reopens after a failed write (reopens())
  bool needs_reopen_ = false;  // a write failed for want of space: reopen before writing
  uint64_t no_space_refusals_ = 0;
  // Committed pointer records ((column, key) of every value held in slot files), mirrored
  // from the default column family, which holds nothing else.
  std::map<SlotKey, SlotRef> slots_;
  uint64_t next_slot_id_ = 1;
  // Keys of staged writes not yet applied (Stage), and the write that holds each.
  std::map<SlotKey, Staged*> staged_;
};

class MemStore : public Store {
 public:
  explicit MemStore(int fail_after_writes) : fail_after_(fail_after_writes) {}

  Status Write(const WriteBatch& batch) override {
    if (fail_after_ == 0) return Status::IoError("injected write failure");
    if (fail_after_ > 0) --fail_after_;
    for (const auto& op : batch.ops()) {
      auto& col = cols_[static_cast<int>(op.column)];
      if (op.is_delete) {
        col.erase(op.key);
      } else {
        col[op.key] = std::string(op.value);
      }
    }
    return Status::Ok();
  }

  Result<std::optional<std::string>> Get(Column c, std::string_view key) override {
    auto& col = cols_[static_cast<int>(c)];
    auto it = col.find(std::string(key));
    if (it == col.end()) return std::optional<std::string>();
    return std::optional<std::string>(it->second);
  }

  Status Scan(Column c, std::string_view prefix,
              const std::function<bool(std::string_view, std::string_view)>& fn) override {
    auto& col = cols_[static_cast<int>(c)];
    for (auto it = col.lower_bound(std::string(prefix)); it != col.end(); ++it) {
      if (!std::string_view(it->first).starts_with(prefix)) break;
      if (!fn(it->first, it->second)) break;
    }
    return Status::Ok();
  }

  Status Checkpoint(const std::string& dir) override {
    return Status::FailedPrecondition("the in-memory store cannot take checkpoints");
  }
  uint64_t ApproximateBytes() override { return 0; }

 private:
  int fail_after_;
  std::map<std::string, std::string> cols_[static_cast<int>(Column::kCount)];
};

}  // namespace

Result<std::unique_ptr<Store>> OpenRocksStore(const std::string& dir, const StoreOptions& options) {
  return RocksStore::Open(dir, options);
}

std::unique_ptr<Store> NewMemStore(int fail_after_writes) {
  return std::make_unique<MemStore>(fail_after_writes);
}

}  // namespace isthmus
