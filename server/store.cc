// RocksDB and in-memory implementations of Store.
#include "server/store.h"

#include <rocksdb/db.h>
#include <rocksdb/utilities/checkpoint.h>
#include <rocksdb/write_batch.h>

#include <filesystem>

namespace isthmus {

const char* ColumnName(Column c) {
  switch (c) {
    case Column::kJobs: return "jobs";
    case Column::kTensorMeta: return "tensor_meta";
    case Column::kTensors: return "tensors";
    case Column::kDedup: return "dedup";
    case Column::kDedupLog: return "dedup_log";
    case Column::kCount: break;
  }
  return "?";
}

std::string JobKey(std::string_view job, std::string_view item) {
  std::string k;
  k.reserve(job.size() + 1 + item.size());
  k.append(job);
  k.push_back('\0');
  k.append(item);
  return k;
}

namespace {

Status FromRocks(const rocksdb::Status& s, const std::string& what) {
  if (s.ok()) return Status::Ok();
  if (s.IsCorruption()) return Status::Corruption(what + ": " + s.ToString());
  return Status::IoError(what + ": " + s.ToString());
}

class RocksStore : public Store {
 public:
  ~RocksStore() override {
    for (auto* h : handles_) db_->DestroyColumnFamilyHandle(h);
    if (db_) db_->Close();
  }

  static Result<std::unique_ptr<Store>> Open(const std::string& dir, const StoreOptions& options) {
    auto store = std::unique_ptr<RocksStore>(new RocksStore());
    store->write_options_.sync = options.sync_writes;
    rocksdb::DBOptions db_opts;
    db_opts.create_if_missing = true;
    db_opts.create_missing_column_families = true;
    db_opts.paranoid_checks = true;
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
      cfs.emplace_back(ColumnName(c), c == Column::kTensors ? large : small);
    }
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    rocksdb::DB* db = nullptr;
    std::vector<rocksdb::ColumnFamilyHandle*> handles;
    auto s = rocksdb::DB::Open(db_opts, dir, cfs, &handles, &db);
    if (!s.ok()) {
      return FromRocks(s, "cannot open RocksDB at '" + dir +
                              "' (is another isthmus-server using this data dir?)");
    }
    store->db_.reset(db);
    store->default_ = handles[0];
    store->handles_ = handles;
    store->dir_ = dir;
    return std::unique_ptr<Store>(std::move(store));
  }

  Status Write(const WriteBatch& batch) override {
    rocksdb::WriteBatch wb;
    for (const auto& op : batch.ops()) {
      auto* cf = Handle(op.column);
      rocksdb::Status s = op.is_delete ? wb.Delete(cf, op.key)
                                       : wb.Put(cf, op.key, rocksdb::Slice(op.value.data(),
                                                                           op.value.size()));
      if (!s.ok()) return FromRocks(s, "building write batch");
    }
    return FromRocks(db_->Write(write_options_, &wb), "RocksDB write");
  }

  Result<std::optional<std::string>> Get(Column c, std::string_view key) override {
    std::string value;
    auto s = db_->Get(rocksdb::ReadOptions(), Handle(c), rocksdb::Slice(key.data(), key.size()),
                      &value);
    if (s.IsNotFound()) return std::optional<std::string>();
    if (!s.ok()) return FromRocks(s, "RocksDB get");
    return std::optional<std::string>(std::move(value));
  }

  Status Scan(Column c, std::string_view prefix,
              const std::function<bool(std::string_view, std::string_view)>& fn) override {
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), Handle(c)));
    for (it->Seek(rocksdb::Slice(prefix.data(), prefix.size())); it->Valid(); it->Next()) {
      auto k = it->key();
      if (!k.starts_with(rocksdb::Slice(prefix.data(), prefix.size()))) break;
      if (!fn(std::string_view(k.data(), k.size()),
              std::string_view(it->value().data(), it->value().size()))) {
        break;
      }
    }
    return FromRocks(it->status(), "RocksDB scan");
  }

  Status Checkpoint(const std::string& dir) override {
    rocksdb::Checkpoint* cp = nullptr;
    ISTHMUS_RETURN_IF_ERROR(FromRocks(rocksdb::Checkpoint::Create(db_.get(), &cp), "checkpoint"));
    std::unique_ptr<rocksdb::Checkpoint> owner(cp);
    // log_size_for_flush = 0: flush memtables so the checkpoint needs no WAL replay.
    return FromRocks(cp->CreateCheckpoint(dir, 0), "creating checkpoint at '" + dir + "'");
  }

  uint64_t ApproximateBytes() override {
    uint64_t total = 0;
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(dir_, ec)) {
      if (e.is_regular_file(ec)) total += e.file_size(ec);
    }
    return total;
  }

 private:
  RocksStore() = default;
  rocksdb::ColumnFamilyHandle* Handle(Column c) { return handles_[1 + static_cast<int>(c)]; }

  std::unique_ptr<rocksdb::DB> db_;
  rocksdb::ColumnFamilyHandle* default_ = nullptr;
  std::vector<rocksdb::ColumnFamilyHandle*> handles_;
  rocksdb::WriteOptions write_options_;
  std::string dir_;
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
