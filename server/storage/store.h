// The shard's storage seam: an ordered key-value store with named columns and atomic
// multi-column write batches. Two implementations: RocksDB (the real one, one column
// family per column) and in-memory (for tests and fault injection). Every state change of
// a shard is exactly one Write() of one WriteBatch, so a crash leaves either all of a
// change or none of it.
//
// Threads: a Store is used by one thread (the shard's event loop) at a time; only a staged
// write's Fill (below) runs on another.
#pragma once

#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace isthmus {

// Column names. Adding one is compatible (RocksDB creates missing families on open). What
// each holds, key by key: keys.h; the records themselves: records.h.
enum class Column : int {
  kJobs = 0,        // the shard's job records
  kTensorMeta = 1,  // tensor records (shape, version)
  kTensors = 2,     // committed tensor values (fp32)
  kDedup = 3,       // push idempotency records
  kDedupLog = 4,    // their order (bounds kDedup)
  // The round protocol (server/sync/, docs/SYNC.md):
  kSync = 5,    // small records: rounds, held-delta index, digests
  kDeltas = 6,  // encoded round deltas (in/outbox)
  kState = 7,   // per-tensor fp32 state: staged delta, residual, momentum
  kCount = 8,
};
const char* ColumnName(Column c);

// Puts and deletes applied together. Values are referenced, not copied: they must stay
// valid until Store::Write returns.
class WriteBatch {
 public:
  struct Op {
    Column column;
    std::string key;
    std::string_view value;
    bool is_delete;
  };
  void Put(Column c, std::string key, std::string_view value) {
    ops_.push_back({c, std::move(key), value, false});
  }
  // Put that owns its value (small values: records, keys).
  void PutOwned(Column c, std::string key, std::string value) {
    owned_.push_back(std::make_unique<std::string>(std::move(value)));
    ops_.push_back({c, std::move(key), *owned_.back(), false});
  }
  void Delete(Column c, std::string key) { ops_.push_back({c, std::move(key), {}, true}); }
  const std::vector<Op>& ops() const { return ops_; }
  bool empty() const { return ops_.empty(); }

 private:
  std::vector<Op> ops_;
  std::vector<std::unique_ptr<std::string>> owned_;
};

struct StoreOptions {
  // fsync the write-ahead log before Write() returns. With false, an acknowledged write
  // survives a process crash (the OS holds it) but not a power loss.
  bool sync_writes = true;
  // Bound on the write-ahead logs kept on disk: past it RocksDB flushes the column families
  // that keep the oldest log alive. The small columns take a few bytes in every batch and
  // would otherwise pin every log until RocksDB's own bound, 4x all memtables (~6 GiB
  // here). Values of kSlotFileMinBytes or more never enter the log (slot files), so what it
  // bounds is the values under that size (a LoRA job's rounds, records).
  uint64_t max_wal_bytes = uint64_t{2} << 30;
  // Free space kept on the store's disk (RocksDB store only). A Write that would leave less
  // is refused with ResourceExhausted before anything is written; a store opened with less
  // opens read-only (reads work, writes are refused) and reopens for writing by itself at
  // the first write after space has returned. RocksDB stops for good on some write errors
  // (a failed log write cannot be retried in the same process), so the store never lets
  // it run out of space; an out-of-space error it still meets (another process filled the
  // disk between the check and the write) is refused the same way and recovered from with
  // DB::Resume once there is room again. 0: no reserve (writes run until the disk refuses).
  // isthmus-server sets it from storage.min_free_bytes.
  uint64_t min_free_bytes = 0;
  // With sync_writes, slot files (values of kSlotFileMinBytes or more) are written with
  // O_DIRECT, past the page cache (where the file system takes it; else as with false).
  // false: through the page cache, synced the same way.
  bool direct_slot_writes = true;
};

// What a store reports for monitoring (docs/METRICS.md); zeros where it has no such thing.
struct StoreMetrics {
  bool rocksdb = false;                   // the fields below the next line are RocksDB's
  uint64_t disk_bytes = 0;                // ApproximateBytes()
  uint64_t sst_bytes = 0;                 // SST files, every column family
  uint64_t blob_bytes = 0;                // blob files
  uint64_t memtable_bytes = 0;            // memtables, active and unflushed
  uint64_t live_data_bytes = 0;           // RocksDB's estimate of live data
  uint64_t pending_compaction_bytes = 0;  // estimate of bytes compaction still has to rewrite
  uint64_t slot_bytes = 0;                // large values kept in slot files (in use)
  uint64_t write_stall_micros = 0;        // time writes were delayed or stopped, since open
  bool write_stopped = false;             // writes are stopped now (too many files)
  uint64_t delayed_write_rate = 0;        // bytes/s writes are held to now (0: not delayed)
  uint64_t free_bytes = 0;                // free space on the store's disk (for the store's user)
  uint64_t no_space_refusals = 0;         // writes refused for want of space, since open
  bool read_only = false;                 // writes are refused until space returns
};

// A write whose large values go to disk away from the store's thread (Store::Stage).
class StagedWrite {
 public:
  virtual ~StagedWrite() = default;
  // Writes (and with sync_writes syncs) the large values: the slow part. Any thread, once;
  // the batch's values must stay valid and unchanged until it returns. Its outcome is
  // Apply's.
  virtual void Fill() = 0;
  // Optional, before Fill and on the store's thread: the first `ready` bytes of the value of
  // op number `op` of the batch are final (a value received in parts). A store that keeps
  // large values apart may write them now, so that Fill has only the rest left; the bytes
  // must not change after. `ready` only grows from call to call. Nothing becomes visible
  // before Apply. The default writes nothing.
  virtual Status FillPrefix(size_t op, size_t ready) {
    (void)op, (void)ready;
    return Status::Ok();
  }
};

class Store {
 public:
  virtual ~Store() = default;

  // Applies every op of `batch` atomically.
  virtual Status Write(const WriteBatch& batch) = 0;
  // A write in three steps, so that a batch of large values can be put on disk while the
  // store's thread goes on: Stage (store's thread) decides where its values go, the
  // result's Fill (any thread) writes them, and Apply (store's thread, once Fill returned)
  // applies `batch` with `more` atomically, as one Write of both would. Nothing of it is
  // visible before Apply, and a crash before loses all of it. `batch` must outlive Apply.
  // A write (or Stage) of a key `batch` holds before Apply waits for Fill and supersedes
  // it: Apply then writes nothing and answers FailedPrecondition. Dropping the result without Apply
  // (store's thread, Fill returned or never called) abandons it; the store must outlive
  // it. The default Stage and Fill do nothing and Apply is a Write of both batches.
  virtual Result<std::unique_ptr<StagedWrite>> Stage(const WriteBatch& batch);
  virtual Status Apply(std::unique_ptr<StagedWrite> staged, const WriteBatch& more);
  // The value, or nullopt if absent.
  virtual Result<std::optional<std::string>> Get(Column c, std::string_view key) = 0;
  // Calls `fn(key, value)` for every key starting with `prefix`, in key order, until it
  // returns false.
  virtual Status Scan(Column c, std::string_view prefix,
                      const std::function<bool(std::string_view, std::string_view)>& fn) = 0;
  // As Scan, keys only: a store that keeps large values apart (slot files) does not read
  // them.
  virtual Status ScanKeys(Column c, std::string_view prefix,
                          const std::function<bool(std::string_view)>& fn) {
    return Scan(c, prefix, [&](std::string_view k, std::string_view) { return fn(k); });
  }
  // A consistent point-in-time copy of the whole store in the new folder `dir`.
  virtual Status Checkpoint(const std::string& dir) = 0;
  // Approximate bytes on disk (0 for memory).
  virtual uint64_t ApproximateBytes() = 0;
  // Counts the times the store was reopened after a write failed (e.g. for want of space).
  // A write that failed may still be in the database's log, and a reopen replays it: what
  // the caller holds in memory may then be behind the store, so it reads its state again
  // when this changes. The write that reopens the store is refused (Unavailable), so the
  // caller sees the change before it writes anything computed from the old state.
  virtual uint64_t reopens() const { return 0; }
  // Sizes and write stalls for the metrics endpoint; cheap enough to call per scrape.
  virtual StoreMetrics Metrics() {
    StoreMetrics m;
    m.disk_bytes = ApproximateBytes();
    return m;
  }
};

// Values of at least this many bytes, in any column, are kept by the RocksDB store outside
// RocksDB (see OpenRocksStore); smaller ones go through RocksDB as usual.
inline constexpr size_t kSlotFileMinBytes = size_t{1} << 20;

// Opens (creating if needed) a RocksDB store in folder `dir`.
//
// Large values (>= kSlotFileMinBytes, any column: committed tensors, encoded deltas, the
// staged deltas, residuals and momentum of the round protocol) skip RocksDB's WAL and
// memtable: each (column, key) owns two slot files in <dir>/slots/, and a write fills the
// slot the committed state does not name (pwrite into the reused file), then commits a
// small pointer record {file, slot, size, crc32c} in the same RocksDB batch as the rest.
// With sync_writes every slot file of a batch is written (its writeback started) before
// they are all fdatasynced, and only then is the batch committed. A crash before that
// commit leaves the old slots and records intact, so the batch stays atomic. Get and Scan
// read the slot back and check its crc32c (Corruption on mismatch); Scan merges slot and
// inline values in key order. Checkpoint() hard-links (or copies) the slots in use into
// <checkpoint>/slots/; a slot file shared with a checkpoint is replaced, never rewritten
// in place. Copying a checkpoint folder recursively over `dir` restores it.
Result<std::unique_ptr<Store>> OpenRocksStore(const std::string& dir, const StoreOptions& options);

// A store in memory. Write() can be made to fail after `fail_after_writes` successful
// writes (fault injection for tests); -1 never fails.
std::unique_ptr<Store> NewMemStore(int fail_after_writes = -1);

}  // namespace isthmus
