// Request handlers of the shard. Pattern of every mutating handler: validate everything
// first, build new buffers and one WriteBatch, write it, and only then swap the new
// state into memory. A failed write leaves memory as it was.
#include "server/shard/shard.h"

#include <spdlog/spdlog.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <set>
#include <system_error>
#include <thread>

#include "common/crc32c.h"
#include "common/durable.h"
#include "common/names.h"
#include "common/safetensors.h"
#include "common/sanitizer.h"
#include "common/version.h"
#include "server/storage/keys.h"
#include "server/storage/records.h"

namespace isthmus {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

uint64_t NowUnix() { return static_cast<uint64_t>(std::time(nullptr)); }

std::string_view Bytes(const std::vector<float>& v) {
  return {reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float)};
}

// out = a + delta (delta: fp32 bytes, any alignment). Returns false if any sum is not
// finite. Fixed-size blocks with restrict pointers let the compiler vectorise at -O2; the
// check ORs "exponent all ones" flags instead of a serial float chain.
bool AddAllFiniteSerial(const float* a, const uint8_t* delta, float* out, size_t n) {
  constexpr size_t kBlock = 1024;
  uint32_t bad = 0;
  size_t i = 0;
  auto block = [&bad](const float* __restrict a, const uint8_t* __restrict d, float* __restrict o) {
    uint32_t flags = 0;
    for (size_t k = 0; k < kBlock; ++k) {
      float dv;
      std::memcpy(&dv, d + k * sizeof(float), sizeof(float));
      float sum = a[k] + dv;
      o[k] = sum;
      uint32_t bits;
      std::memcpy(&bits, &sum, sizeof(bits));
      flags |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
    }
    bad |= flags;
  };
  for (; i + kBlock <= n; i += kBlock) block(a + i, delta + i * sizeof(float), out + i);
  for (; i < n; ++i) {
    float dv;
    std::memcpy(&dv, delta + i * sizeof(float), sizeof(float));
    out[i] = a[i] + dv;
    bad |= static_cast<uint32_t>(!std::isfinite(out[i]));
  }
  return bad == 0;
}

// As AddAllFiniteSerial; tensors of 4 Mi elements (16 MiB) or more are split in two halves,
// one added on a helper thread, so a large push uses a second core's memory bandwidth. A
// thread per call costs tens of microseconds, nothing next to 16 MiB of adds.
bool AddAllFinite(const float* a, const uint8_t* delta, float* out, size_t n) {
  constexpr size_t kSplitAt = size_t{4} << 20;
  if (n < kSplitAt || std::thread::hardware_concurrency() < 2) {
    return AddAllFiniteSerial(a, delta, out, n);
  }
  const size_t half = (n / 2) & ~size_t{1023};
  bool second_ok = true;
  std::thread helper;
  try {
    helper = std::thread([&] {
      second_ok = AddAllFiniteSerial(a + half, delta + half * sizeof(float), out + half, n - half);
    });
  } catch (const std::system_error&) {  // no thread to be had: add it all here
    return AddAllFiniteSerial(a, delta, out, n);
  }
  const bool first_ok = AddAllFiniteSerial(a, delta, out, half);
  helper.join();
  return first_ok && second_ok;
}

// What a push is, as a checksum kept with its idempotency key (DedupRecord::content): its
// round and each tensor's name and shape, in the request's order. Not the values: a round
// redone from a checkpoint after a crash is the same push under the same key, and its
// recomputed values may differ in the last bits (or more, with another rank count); the
// first attempt's values are the ones applied, once.
std::string PushContent(const wire::PushRequest* req) {
  auto put = [](uint32_t crc, uint64_t v) { return Crc32cExtend(crc, &v, sizeof v); };
  uint32_t crc = put(0, req->round());
  uint64_t count = 0;
  if (req->tensors() != nullptr) {
    for (const auto* m : *req->tensors()) {
      const std::string name = m->name() ? m->name()->str() : "";
      crc = put(crc, name.size());
      crc = Crc32cExtend(crc, name.data(), name.size());
      const auto shape = ShapeOf(m);
      crc = put(crc, shape.size());
      for (int64_t d : shape) crc = put(crc, static_cast<uint64_t>(d));
      ++count;
    }
  }
  char out[48];
  std::snprintf(out, sizeof out, "r%llu/t%llu/crc32c:%08x",
                static_cast<unsigned long long>(req->round()),
                static_cast<unsigned long long>(count), crc);
  return out;
}

}  // namespace

// A plain push whose large tensors come in parts (Shard::BeginStreamedPush).
struct Shard::StreamedPush {
  struct Target {
    std::string name;
    // The values the sums start from: a push published meanwhile replaces the tensor's, and
    // the sums are then computed again from the parts.
    std::shared_ptr<const std::vector<float>> base;
    // base + delta, filled part by part; of a synced job's push, the delta
    std::shared_ptr<std::vector<float>> next;
    bool in_parts = false;
    size_t received = 0;             // bytes of its delta added so far (in parts)
    const uint8_t* frame = nullptr;  // the delta of a tensor that came in the request
  };
  // One received part: its target and bytes (owned by `messages`).
  struct Part {
    size_t target;
    size_t offset;
    const uint8_t* data;
    size_t size;
  };
  std::string job, key, content;
  std::string connection;  // the request's (Shard::Handle): its parts come on the same one
  // A synced job's push: the parts are copied into `next` whole (the delta itself), and the
  // last one hands the request to the engine (DoSyncPush) with `header`, its copy.
  bool synced = false;
  std::vector<uint8_t> header;
  uint64_t id = 0;  // the PushRequest's request id: the reply's
  uint64_t round = 0, tokens = 0;
  std::vector<Target> targets;  // the request's tensors, in its order
  std::vector<size_t> order;    // the targets that come in parts, in the order they come
  size_t current = 0;           // index into `order` of the target the next part adds to
  std::vector<Part> parts;
  std::vector<std::shared_ptr<const void>> messages;  // the request's and every part's
  std::vector<std::vector<uint8_t>> copies;           // their bytes, where no one owns them
  WriteBatch batch;                                   // the sums, op i = targets[i]
  std::unique_ptr<StagedWrite> staged;
  std::chrono::steady_clock::time_point last;  // the last part (or the request) came
};

Shard::Shard(ShardOptions options)
    : options_(std::move(options)), started_(std::chrono::steady_clock::now()) {}

Shard::~Shard() = default;

Result<std::unique_ptr<Shard>> Shard::Open(ShardOptions options) {
  std::unique_ptr<Shard> shard(new Shard(std::move(options)));
  ISTHMUS_ASSIGN_OR_RETURN(shard->store_, shard->options_.open_store());
  if (shard->options_.sync) {
    ISTHMUS_ASSIGN_OR_RETURN(shard->sync_,
                             SyncEngine::Create(shard->store_.get(), *shard->options_.sync));
    shard->sync_->SetDeferRoundWork(shard->options_.defer_round_work);
    Shard* self = shard.get();
    SyncEngine::JobHooks hooks;
    hooks.base_hash = [self](const std::string& job) {
      auto it = self->jobs_.find(job);
      return it == self->jobs_.end() ? std::string() : it->second.base_hash;
    };
    hooks.install = [self](const std::string& job, const std::string& base_hash,
                           const std::map<std::string, SyncTensor>& tensors, uint64_t version,
                           WriteBatch& batch) {
      return self->InstallJoinedJob(job, base_hash, tensors, version, batch);
    };
    shard->sync_->SetJobHooks(std::move(hooks));
  }
  ISTHMUS_RETURN_IF_ERROR(shard->Load());
  // A snapshot being created when the process died or the power went leaves its .tmp-
  // folder: never listed, it only holds disk space (and, through hard links, old slot
  // files). Nothing else runs yet, so none is in progress.
  if (!shard->options_.snapshot_dir.empty()) {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(shard->options_.snapshot_dir, ec)) {
      if (e.path().filename().string().rfind(".tmp-", 0) != 0) continue;
      spdlog::warn("removing '{}': a snapshot that was never finished", e.path().string());
      std::error_code rm;
      fs::remove_all(e.path(), rm);
      if (rm) spdlog::warn("cannot remove '{}': {}", e.path().string(), rm.message());
    }
  }
  return shard;
}

Status Shard::InstallJoinedJob(const std::string& name, const std::string& base_hash,
                               const std::map<std::string, SyncTensor>& tensors, uint64_t version,
                               WriteBatch& batch) {
  if (!IsValidName(name)) return Status::InvalidArgument("job name '" + name + "' is not valid");
  JobState job;
  if (auto old = jobs_.find(name); old != jobs_.end()) {
    // This site was removed and joins again: the members' state replaces its own, for the
    // same tensors (the job's counters and idempotency records stay).
    bool same = old->second.tensors.size() == tensors.size();
    for (const auto& [tname, t] : tensors) {
      auto it = old->second.tensors.find(tname);
      same = same && it != old->second.tensors.end() && it->second.shape == t.shape;
    }
    if (!same) {
      return Status::FailedPrecondition("job '" + name +
                                        "' is held here with other tensors than "
                                        "the members': this site cannot join it again");
    }
    static_cast<JobRecord&>(job) = old->second;
  }
  job.name = name;
  job.base_hash = base_hash;
  job.version = version;
  job.created_unix = NowUnix();
  job.create_hash = "joined";  // no job create request made it: none is answered as a retry
  for (const auto& [tname, t] : tensors) {
    batch.Put(Column::kTensors, keys::TensorKey(name, tname), Bytes(*t.data));
    batch.PutOwned(Column::kTensorMeta, keys::TensorKey(name, tname),
                   EncodeTensorRecord({t.shape, version}));
    job.tensors.emplace(tname, TensorState{t.shape, version, nullptr});
  }
  batch.PutOwned(Column::kJobs, name, EncodeJobRecord(job));
  ISTHMUS_RETURN_IF_ERROR(store_->Write(batch));
  jobs_[name] = std::move(job);
  spdlog::info("job '{}' from a member's state: {} tensors", name, tensors.size());
  return Status::Ok();
}

void Shard::ReleaseSyncedData(JobState& job) {
  // The sync engine owns a synced job's tensors; the shard keeps names and shapes only.
  for (auto& [_, t] : job.tensors) {
    t.data.reset();
    t.spare.reset();
  }
}

uint64_t Shard::JobBytes(const JobState& job) {
  uint64_t bytes = 0;
  for (const auto& [_, t] : job.tensors) bytes += NumElements(t.shape) * sizeof(float);
  return bytes;
}

Status Shard::Load() {
  DropStreamedPushes("the jobs are read again");
  jobs_.clear();
  store_reopens_ = store_->reopens();
  if (sync_) sync_->Reset(store_.get());
  Status status;
  ISTHMUS_RETURN_IF_ERROR(
      store_->Scan(Column::kJobs, "", [&](std::string_view k, std::string_view v) {
        auto rec = DecodeJobRecord(v, std::string(k));
        if (!rec.ok()) {
          status = rec.status();
          return false;
        }
        JobState job;
        static_cast<JobRecord&>(job) = std::move(*rec);
        job.name = std::string(k);
        jobs_.emplace(std::string(k), std::move(job));
        return true;
      }));
  ISTHMUS_RETURN_IF_ERROR(status);
  if (sync_) ISTHMUS_RETURN_IF_ERROR(CheckPlainJobs());
  if (!sync_) ISTHMUS_RETURN_IF_ERROR(CheckSyncJobsWritten());
  for (auto& entry : jobs_) {
    // Plain references, not structured bindings: lambdas below capture them.
    const std::string& name = entry.first;
    JobState& job = entry.second;
    std::string prefix = keys::JobPrefix(name);
    ISTHMUS_RETURN_IF_ERROR(
        store_->Scan(Column::kTensorMeta, prefix, [&](std::string_view k, std::string_view v) {
          std::string tname(k.substr(prefix.size()));
          auto rec = DecodeTensorRecord(v, "tensor record '" + tname + "' of job '" + name + "'");
          if (!rec.ok()) {
            status = rec.status();
            return false;
          }
          TensorState t;
          t.shape = std::move(rec->shape);
          t.version = rec->version;
          job.tensors.emplace(tname, std::move(t));
          return true;
        }));
    ISTHMUS_RETURN_IF_ERROR(status);
    for (auto& [tname, t] : job.tensors) {
      ISTHMUS_ASSIGN_OR_RETURN(auto bytes,
                               store_->Get(Column::kTensors, keys::TensorKey(name, tname)));
      int64_t numel = NumElements(t.shape);
      if (numel < 0 || !bytes || bytes->size() != static_cast<size_t>(numel) * sizeof(float)) {
        return Status::Corruption("tensor '" + tname + "' of job '" + name +
                                  "' is missing or has the wrong size in the store");
      }
      auto data = std::make_shared<std::vector<float>>(numel);
      std::memcpy(data->data(), bytes->data(), bytes->size());
      t.data = std::move(data);
    }
    if (sync_) {
      std::map<std::string, SyncTensor> tensors;
      for (const auto& [tname, t] : job.tensors) tensors[tname] = SyncTensor{t.shape, t.data};
      ISTHMUS_RETURN_IF_ERROR(sync_->AttachJob(name, std::move(tensors), job.version));
      ReleaseSyncedData(job);
    }
    spdlog::info("loaded job '{}': {} tensors, version {}", name, job.tensors.size(),
                 VersionOf(job));
  }
  return Status::Ok();
}

Status Shard::CheckSyncJobsWritten() const {
  for (const auto& [name, job] : jobs_) {
    ISTHMUS_ASSIGN_OR_RETURN(auto text, store_->Get(Column::kSync, keys::SyncRecordKey(name)));
    if (!text) continue;
    ISTHMUS_ASSIGN_OR_RETURN(SyncRecord rec, DecodeSyncRecord(*text, name));
    if (rec.state_round < rec.committed) {
      return Status::FailedPrecondition(
          "job '" + name + "' syncs across sites and its stored tensors are of round " +
          std::to_string(rec.state_round) + ", not of its committed round " +
          std::to_string(rec.committed) +
          " (sync.checkpoint_rounds): start this shard with its sync settings (sync.site), "
          "which replays the rounds since, not without them");
    }
  }
  return Status::Ok();
}

Status Shard::CheckPlainJobs() {
  std::vector<std::string> plain;
  for (const auto& [name, job] : jobs_) {
    ISTHMUS_ASSIGN_OR_RETURN(bool synced, sync_->HasSyncState(name));
    if (!synced) plain.push_back(name);
  }
  if (plain.empty()) return Status::Ok();
  std::string names;
  for (size_t i = 0; i < plain.size() && i < 5; ++i) names += (i ? ", '" : "'") + plain[i] + "'";
  if (plain.size() > 5) names += " and " + std::to_string(plain.size() - 5) + " more";
  if (options_.convert_plain_jobs) {
    spdlog::warn(
        "sync.convert_plain_jobs: job(s) {} created without sync join site {}'s round "
        "protocol now, their current tensors as round 0",
        names, options_.sync->site);
    return Status::Ok();
  }
  return Status::InvalidArgument(
      "job(s) " + names + " were created without cross-site sync, and sync.site is now '" +
      options_.sync->site +
      "': attaching them would make them sync jobs for good, their current tensors round 0. "
      "To convert them deliberately, start once with sync.convert_plain_jobs = true (every "
      "site must hold the same tensors: docs/SYNC.md, \"Jobs created without sync\"); to keep "
      "them plain, start this shard without sync.site");
}

std::string OpName(wire::Body body) {
  std::string name = wire::EnumNameBody(body);
  const std::string_view suffix = "Request";
  if (name.size() > suffix.size() && name.ends_with(suffix))
    name.resize(name.size() - suffix.size());
  std::string out;
  for (char c : name) {
    if (c >= 'A' && c <= 'Z') {
      if (!out.empty()) out += '_';
      out += static_cast<char>(c - 'A' + 'a');
    } else {
      out += c;
    }
  }
  return out.empty() ? "unknown" : out;
}

std::string RoleName(wire::Role role) {
  switch (role) {
    case wire::Role::Worker:
      return "worker";
    case wire::Role::Admin:
      return "admin";
    case wire::Role::Peer:
      return "peer";
  }
  return "unknown";
}

void Shard::CountBytes(wire::Role role, uint64_t in, uint64_t out) {
  bytes_in_ += in;
  bytes_out_ += out;
  auto& b = socket_bytes_[RoleName(role)];
  b.first += in;
  b.second += out;
}

void Shard::RecordRequest(wire::Role role, std::string_view op, Code outcome, double seconds) {
  const std::string socket = RoleName(role);
  ++request_counts_[{socket, std::string(op), std::string(CodeName(outcome))}];
  auto it = request_seconds_.find({socket, std::string(op)});
  if (it == request_seconds_.end()) {
    it = request_seconds_
             .emplace(std::make_pair(socket, std::string(op)),
                      metrics::Histogram(metrics::LatencyBuckets()))
             .first;
  }
  it->second.Observe(seconds);
}

void Shard::WriteMetrics(metrics::TextWriter& w) {
  using metrics::Type;
  w.Begin("isthmus_requests_total", Type::kCounter,
          "Requests answered, by socket (worker, admin), operation and outcome (OK or the error "
          "code).");
  for (const auto& [key, n] : request_counts_) {
    const auto& [socket, op, outcome] = key;
    w.Sample({{"socket", socket}, {"op", op}, {"outcome", outcome}}, static_cast<double>(n));
  }
  w.Begin("isthmus_request_duration_seconds", Type::kHistogram,
          "Time the shard took to handle a request (from its arrival to its reply being built; "
          "durable writes included), by socket and operation.");
  for (const auto& [key, h] : request_seconds_)
    h.Write(w, {{"socket", key.first}, {"op", key.second}});
  auto per_job = [&](const char* name, Type type, const char* help, auto value) {
    w.Begin(name, type, help);
    for (const auto& [job_name, job] : jobs_) {
      w.Sample({{"job", job_name}}, static_cast<double>(value(job)));
    }
  };
  per_job("isthmus_job_pushes_total", Type::kCounter,
          "Worker pushes applied to the job on this shard (duplicates not counted).",
          [](const JobState& j) { return j.pushes; });
  per_job("isthmus_job_duplicate_pushes_total", Type::kCounter,
          "Pushes answered as duplicates of an applied one since the server started (retries).",
          [](const JobState& j) { return j.duplicate_pushes; });
  per_job("isthmus_job_version", Type::kGauge,
          "The job's served version on this shard (it rises whenever pulled values change).",
          [this](const JobState& j) { return VersionOf(j); });
  per_job("isthmus_job_tensors", Type::kGauge, "Tensors of the job this shard owns.",
          [](const JobState& j) { return j.tensors.size(); });
  per_job("isthmus_job_size_bytes", Type::kGauge,
          "fp32 bytes of the job's tensors this shard owns.",
          [](const JobState& j) { return JobBytes(j); });
  if (!store_) return;
  const StoreMetrics m = store_->Metrics();
  w.Single("isthmus_store_disk_bytes", Type::kGauge,
           "Bytes of the live store's files on disk (RocksDB files and tensor slot files).",
           static_cast<double>(m.disk_bytes));
  if (!m.rocksdb) return;
  w.Single("isthmus_store_free_bytes", Type::kGauge,
           "Free space on the store's disk; writes are refused below storage.min_free_bytes.",
           static_cast<double>(m.free_bytes));
  w.Single("isthmus_store_write_refusals_total", Type::kCounter,
           "Writes refused for want of disk space since the store was opened (nothing written).",
           static_cast<double>(m.no_space_refusals));
  w.Single("isthmus_store_read_only", Type::kGauge,
           "1 while the store takes no writes for want of disk space (pulls are still served).",
           m.read_only ? 1.0 : 0.0);
  w.Single("isthmus_store_slot_file_bytes", Type::kGauge,
           "Bytes of large tensor values in use in slot files (kept outside RocksDB).",
           static_cast<double>(m.slot_bytes));
  w.Single("isthmus_rocksdb_sst_bytes", Type::kGauge, "Size of RocksDB's SST files.",
           static_cast<double>(m.sst_bytes));
  w.Single("isthmus_rocksdb_blob_bytes", Type::kGauge, "Size of RocksDB's blob files.",
           static_cast<double>(m.blob_bytes));
  w.Single("isthmus_rocksdb_memtable_bytes", Type::kGauge,
           "Size of RocksDB's memtables (active and not yet flushed).",
           static_cast<double>(m.memtable_bytes));
  w.Single("isthmus_rocksdb_live_data_bytes", Type::kGauge,
           "RocksDB's estimate of the live data it holds.", static_cast<double>(m.live_data_bytes));
  w.Single("isthmus_rocksdb_pending_compaction_bytes", Type::kGauge,
           "RocksDB's estimate of the bytes compaction still has to rewrite.",
           static_cast<double>(m.pending_compaction_bytes));
  w.Single("isthmus_rocksdb_write_stall_seconds_total", Type::kCounter,
           "Time RocksDB delayed or stopped writes (write stalls) since the store was opened.",
           static_cast<double>(m.write_stall_micros) / 1e6);
  w.Single("isthmus_rocksdb_write_stopped", Type::kGauge,
           "1 while RocksDB stops writes (too many level-0 files or pending compaction).",
           m.write_stopped ? 1.0 : 0.0);
  w.Single("isthmus_rocksdb_delayed_write_rate_bytes_per_second", Type::kGauge,
           "The rate RocksDB holds writes to while it delays them (0: not delayed).",
           static_cast<double>(m.delayed_write_rate));
}

Reply Shard::Handle(wire::Role role, const Frames& request, std::shared_ptr<const void> keepalive,
                    std::string_view connection) {
  ++requests_;
  connection_.assign(connection.data(), connection.size());
  const auto t0 = std::chrono::steady_clock::now();
  std::string op = "malformed";  // until the envelope parses
  Reply reply;
  uint64_t id = 0;
  Status s;
  if (store_ && store_->reopens() != store_reopens_) {
    // The store was reopened after a failed write, replaying what reached its log: read
    // the jobs again before anything is computed from the copy in memory.
    spdlog::warn("the store was reopened after a failed write: reading the jobs from it again");
    DropStreamedPushes("the store was reopened");
    if (Status loaded = Load(); !loaded.ok()) {
      spdlog::error("cannot read the jobs again: {}", loaded.ToString());
      store_.reset();
    }
  }
  if (!store_) {
    s = Status::Unavailable(
        "shard storage is closed after a failed restore or reload; restart "
        "the server");
  } else {
    auto env = ParseEnvelope(request.header, options_.limits, &id);
    if (!env.ok()) {
      s = env.status();
    } else {
      const wire::Envelope* e = *env;
      id = e->request_id();
      op = OpName(e->body_type());
      bool admin = role == wire::Role::Admin;
      auto need_admin = [&]() {
        return Status::PermissionDenied(std::string(wire::EnumNameBody(e->body_type())) +
                                        " is only allowed on the admin socket");
      };
      // Requests that carry no payload must not bring any.
      bool takes_payload = e->body_type() == wire::Body::PushRequest ||
                           e->body_type() == wire::Body::PushPart ||
                           e->body_type() == wire::Body::JobCreate;
      if (!takes_payload && !request.payload.empty()) {
        s = Status::InvalidArgument("this request takes no payload frames but " +
                                    std::to_string(request.payload.size()) + " were sent");
      } else {
        switch (e->body_type()) {
          case wire::Body::Hello:
            s = DoHello(role, e->body_as_Hello(), id, reply);
            break;
          case wire::Body::PullRequest:
            s = DoPull(e->body_as_PullRequest(), id, reply);
            break;
          case wire::Body::PushRequest:
            s = role == wire::Role::Worker
                    ? DoPush(e->body_as_PushRequest(), request, id, reply, std::move(keepalive))
                    : Status::PermissionDenied("pushes are only allowed on the worker socket");
            break;
          case wire::Body::PushPart:
            s = role == wire::Role::Worker
                    ? DoPushPart(e->body_as_PushPart(), request, id, reply, std::move(keepalive))
                    : Status::PermissionDenied("pushes are only allowed on the worker socket");
            break;
          case wire::Body::JobDescribe:
            s = DoJobDescribe(e->body_as_JobDescribe(), id, reply);
            break;
          case wire::Body::JobCreate:
            s = admin ? DoJobCreate(e->body_as_JobCreate(), request, id, reply) : need_admin();
            break;
          case wire::Body::StatsRequest:
            s = admin ? DoStats(id, reply) : need_admin();
            break;
          case wire::Body::SnapshotCreate:
            s = admin ? DoSnapshotCreate(e->body_as_SnapshotCreate(), id, reply) : need_admin();
            break;
          case wire::Body::SnapshotList:
            s = admin ? DoSnapshotList(id, reply) : need_admin();
            break;
          case wire::Body::SnapshotRestore:
            s = admin ? DoSnapshotRestore(e->body_as_SnapshotRestore(), id, reply) : need_admin();
            break;
          default:
            s = Status::InvalidArgument(std::string("unexpected message type ") +
                                        wire::EnumNameBody(e->body_type()));
        }
      }
    }
  }
  if (!s.ok()) {
    ++errors_;
    spdlog::warn("refused request {} from {} socket: {}", id, wire::EnumNameRole(role),
                 s.ToString());
    last_error_ = std::string(op) + " from " + RoleName(role) + " socket: " + s.ToString();
    last_error_at_ = std::chrono::steady_clock::now();
    reply.header.Clear();
    reply.payload.clear();
    BuildErrorReply(reply.header, id, s);
    reply.is_error = true;
    reply.send = true;
  }
  RecordRequest(role, op, s.code(),
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return reply;
}

Result<Shard::JobState*> Shard::FindJob(const flatbuffers::String* job) {
  std::string name = job ? job->str() : "";
  auto it = jobs_.find(name);
  if (it == jobs_.end()) {
    return Status::NotFound("job '" + name + "' does not exist on shard " + options_.shard_id +
                            " (create it with: isthmusctl job create)");
  }
  return &it->second;
}

flatbuffers::Offset<wire::RoundStatus> Shard::RoundStatusOf(flatbuffers::FlatBufferBuilder& fbb,
                                                            const JobState& job) {
  if (sync_ && sync_->HasJob(job.name)) {
    // A round whose deltas are durable counts as pushed, its close pending or not.
    return wire::CreateRoundStatus(fbb, sync_->PushedRound(job.name),
                                   sync_->CommittedRound(job.name), sync_->max_rounds_ahead());
  }
  return wire::CreateRoundStatus(fbb, job.last_round, job.last_round, 0);
}

uint64_t Shard::VersionOf(const JobState& job) const {
  return sync_ && sync_->HasJob(job.name) ? sync_->Version(job.name) : job.version;
}

Status Shard::DoHello(wire::Role role, const wire::Hello* req, uint64_t id, Reply& reply) {
  if (req->role() != role) {
    return Status::PermissionDenied(std::string("hello as ") + wire::EnumNameRole(req->role()) +
                                    " on the " + wire::EnumNameRole(role) + " socket");
  }
  uint64_t version = 0, count = 0;
  std::string base_hash;
  const JobState* job_found = nullptr;
  if (req->job() && req->job()->size() > 0) {
    ISTHMUS_ASSIGN_OR_RETURN(JobState * job, FindJob(req->job()));
    job_found = job;
    std::string want = req->base_hash() ? req->base_hash()->str() : "";
    if (!want.empty() && !job->base_hash.empty() && want != job->base_hash) {
      return Status::FailedPrecondition("base model hash " + want + " differs from job '" +
                                        req->job()->str() + "' base " + job->base_hash +
                                        ": the worker loaded a different base checkpoint");
    }
    if (role == wire::Role::Worker && sync_ && sync_->HasJob(job->name)) {
      // A site no longer counted in stops its workers instead of letting them wait for
      // commits that will not come.
      if (std::string why = sync_->membership().RemovedNotice(job->name); !why.empty()) {
        return Status::FailedPrecondition(why);
      }
    }
    version = VersionOf(*job);
    count = job->tensors.size();
    base_hash = job->base_hash;
  }
  flatbuffers::Offset<wire::RoundStatus> rounds;
  if (job_found) rounds = RoundStatusOf(reply.header, *job_found);
  // For a worker that encodes its own deltas: every tensor's pipeline of the site's next
  // round (docs/SYNC.md, "Deltas encoded by the worker").
  uint64_t pipes_round = 0;
  flatbuffers::Offset<flatbuffers::Vector<flatbuffers::Offset<wire::TensorPipeline>>> pipes;
  if (job_found && req->want_pipelines() && sync_ && sync_->HasJob(job_found->name)) {
    pipes_round = sync_->PushedRound(job_found->name) + 1;
    ISTHMUS_ASSIGN_OR_RETURN(
        auto chosen, sync_->RoundPipelines(job_found->name, pipes_round, req->compute_ms()));
    std::vector<flatbuffers::Offset<wire::TensorPipeline>> out;
    for (const auto& [name, pipe] : chosen) {
      out.push_back(wire::CreateTensorPipelineDirect(reply.header, name.c_str(), pipe.c_str()));
    }
    pipes = reply.header.CreateVector(out);
  }
  // The job takes its large pushes in parts (BeginStreamedPush), if so configured.
  const uint64_t part_bytes = !job_found ? 0
                              : sync_ && sync_->HasJob(job_found->name)
                                  ? options_.synced_push_part_bytes
                                  : options_.push_part_bytes;
  auto body = wire::CreateHelloReply(reply.header, reply.header.CreateString(options_.shard_id),
                                     reply.header.CreateString(kIsthmusVersion), version,
                                     reply.header.CreateString(base_hash), count, role, rounds,
                                     pipes_round, pipes, part_bytes);
  FinishEnvelope(reply.header, id, wire::Body::HelloReply, body.Union());
  return Status::Ok();
}

Status Shard::DoPull(const wire::PullRequest* req, uint64_t id, Reply& reply) {
  ISTHMUS_ASSIGN_OR_RETURN(JobState * job, FindJob(req->job()));
  if (req->replay() && sync_ && sync_->HasJob(job->name)) return DoReplayPull(req, *job, id, reply);
  // Synced jobs serve committed state plus the known uncommitted deltas; every tensor
  // carries the job's served version.
  std::map<std::string, TensorState> view;
  const std::map<std::string, TensorState>* served = &job->tensors;
  if (sync_ && sync_->HasJob(job->name)) {
    ISTHMUS_ASSIGN_OR_RETURN(auto v, sync_->View(job->name));
    const uint64_t version = sync_->Version(job->name);
    for (auto& [tname, t] : v) view[tname] = TensorState{t.shape, version, t.data};
    served = &view;
  }
  std::vector<std::pair<const std::string*, const TensorState*>> picked;
  if (req->names() && req->names()->size() > 0) {
    std::set<std::string> seen;
    for (const auto* n : *req->names()) {
      auto it = served->find(n->str());
      if (it == served->end()) {
        return Status::NotFound("tensor '" + n->str() + "' is not in job '" + req->job()->str() +
                                "'");
      }
      if (!seen.insert(n->str()).second) continue;
      if (it->second.version > req->newer_than()) picked.emplace_back(&it->first, &it->second);
    }
  } else {
    for (const auto& [name, t] : *served) {
      if (t.version > req->newer_than()) picked.emplace_back(&name, &t);
    }
  }
  std::vector<flatbuffers::Offset<wire::TensorMeta>> metas;
  uint64_t bytes = 0;
  for (size_t i = 0; i < picked.size(); ++i) {
    const auto& t = *picked[i].second;
    uint64_t nbytes = t.data->size() * sizeof(float);
    bytes += nbytes;
    metas.push_back(wire::CreateTensorMetaDirect(reply.header, picked[i].first->c_str(), &t.shape,
                                                 wire::DType::F32, static_cast<uint32_t>(i), nbytes,
                                                 t.version));
    reply.payload.push_back({t.data->data(), nbytes, t.data});
  }
  if (bytes > options_.limits.max_payload_bytes) {
    reply.payload.clear();
    return Status::ResourceExhausted("pull of " + std::to_string(bytes) +
                                     " bytes exceeds the message limit; pull fewer tensors");
  }
  auto metas_v = reply.header.CreateVector(metas);
  auto body = wire::CreatePullReply(reply.header, VersionOf(*job), metas_v,
                                    RoundStatusOf(reply.header, *job));
  FinishEnvelope(reply.header, id, wire::Body::PullReply, body.Union());
  return Status::Ok();
}

Status Shard::DoReplayPull(const wire::PullRequest* req, JobState& job, uint64_t id, Reply& reply) {
  const std::string digest = req->replay_digest() ? req->replay_digest()->str() : "";
  ISTHMUS_ASSIGN_OR_RETURN(ReplayPlan plan, sync_->Replay(job.name, req->replay_from(), digest));
  auto& fbb = reply.header;
  uint64_t bytes = 0;
  auto frame = [&](const void* data, uint64_t n, std::shared_ptr<const void> keep) {
    bytes += n;
    reply.payload.push_back({data, n, std::move(keep)});
    return static_cast<uint32_t>(reply.payload.size() - 1);
  };
  auto dense = [&](const std::string& name, const SyncTensor& t) {
    const uint64_t n = t.data->size() * sizeof(float);
    return wire::CreateTensorMetaDirect(fbb, name.c_str(), &t.shape, wire::DType::F32,
                                        frame(t.data->data(), n, t.data), n, 0);
  };
  std::vector<flatbuffers::Offset<wire::TensorMeta>> base, base_m;
  for (const auto& [name, t] : plan.theta) {
    base.push_back(dense(name, t));
    if (auto it = plan.momentum.find(name); it != plan.momentum.end()) {
      base_m.push_back(dense(name, SyncTensor{t.shape, it->second}));
    }
  }
  auto rounds = [&](const std::vector<ReplayPlan::Round>& in) {
    std::vector<flatbuffers::Offset<wire::ReplayRound>> out;
    for (const auto& r : in) {
      std::vector<flatbuffers::Offset<wire::ReplayDelta>> deltas;
      for (const auto& d : r.deltas) {
        std::vector<flatbuffers::Offset<wire::TensorMeta>> metas;
        for (const auto& t : d.delta->tensors) {
          metas.push_back(wire::CreateTensorMetaDirect(
              fbb, t.name.c_str(), &t.shape, wire::DType::F32,
              frame(t.bytes.data(), t.bytes.size(), d.delta), t.bytes.size(), 0));
        }
        deltas.push_back(wire::CreateReplayDeltaDirect(fbb, d.site.c_str(), d.tokens, &metas));
      }
      out.push_back(wire::CreateReplayRoundDirect(fbb, r.round, &deltas));
    }
    return out;
  };
  auto committed = rounds(plan.committed);
  auto view = rounds(plan.view);
  if (bytes > options_.limits.max_payload_bytes) {
    reply.payload.clear();
    return Status::ResourceExhausted("a pull by replay of " + std::to_string(bytes) +
                                     " bytes exceeds the message limit; pull without replay");
  }
  std::vector<flatbuffers::Offset<flatbuffers::String>> members;
  for (const auto& s : plan.members.sites) members.push_back(fbb.CreateString(s));
  auto replay = wire::CreateReplayDirect(
      fbb, plan.base_round, plan.whole ? &base : nullptr, plan.whole ? &base_m : nullptr,
      &committed, &view, plan.committed_round, plan.digest.c_str(), plan.members.epoch,
      plan.members.from_round, &members, plan.outer_lr, plan.outer_momentum, plan.check.c_str());
  std::vector<flatbuffers::Offset<wire::TensorMeta>> none;
  auto body = wire::CreatePullReply(fbb, VersionOf(job), fbb.CreateVector(none),
                                    RoundStatusOf(fbb, job), replay);
  FinishEnvelope(fbb, id, wire::Body::PullReply, body.Union());
  return Status::Ok();
}

Status Shard::RunDeferred() {
  if (!sync_ || !store_) return Status::Ok();
  return sync_->RunDeferred();
}

int Shard::DeferredRetryMs() const { return sync_ && store_ ? sync_->DeferredRetryMs() : -1; }

Status Shard::DoPush(const wire::PushRequest* req, const Frames& frames, uint64_t id, Reply& reply,
                     std::shared_ptr<const void> keepalive) {
  ISTHMUS_ASSIGN_OR_RETURN(JobState * job, FindJob(req->job()));
  const std::string job_name = req->job()->str();
  const std::string key = req->idempotency_key()->str();
  if (key.empty() || key.size() > options_.limits.max_name_bytes) {
    return Status::InvalidArgument("push needs an idempotency key of 1 to " +
                                   std::to_string(options_.limits.max_name_bytes) + " bytes");
  }
  ISTHMUS_RETURN_IF_ERROR(ValidateTensors(req->tensors(), frames.payload, options_.limits, false,
                                          true, req->streamed()));
  const std::string content = PushContent(req);
  ISTHMUS_ASSIGN_OR_RETURN(bool answered, AnsweredBefore(job, key, content, id, reply));
  if (answered) return Status::Ok();
  // No finiteness check in ValidateTensors (above): AddAllFinite checks the sums, and a
  // non-finite delta makes its sum non-finite.
  if (req->tensors() == nullptr || req->tensors()->size() == 0) {
    return Status::InvalidArgument("push carries no tensors");
  }
  const bool synced = sync_ && sync_->HasJob(job_name);
  for (const auto* m : *req->tensors()) {
    if (m->dtype() == wire::DType::Codec && (!synced || req->round() == 0)) {
      return Status::InvalidArgument(
          "tensor '" + m->name()->str() + "' comes encoded (dtype Codec), which only a round " +
          "push (round >= 1) of a synced job takes; job '" + job_name + "' " +
          (synced ? "is synced, but this push has no round" : "does not sync") +
          ": push its fp32 values");
    }
  }
  const bool streamed = req->streamed() != nullptr && req->streamed()->size() > 0;
  if (streamed && (synced ? options_.synced_push_part_bytes : options_.push_part_bytes) == 0) {
    return Status::InvalidArgument("job '" + job_name +
                                   "' takes its pushes whole (its Hello says push_part_bytes 0): "
                                   "send every tensor in the request");
  }
  if (streamed) {
    return BeginStreamedPush(job, req, frames, id, content, reply, std::move(keepalive));
  }
  if (synced) {
    std::vector<std::span<const uint8_t>> bytes;
    for (const auto* m : *req->tensors()) {
      const auto& frame = frames.payload[m->frame()];
      bytes.emplace_back(static_cast<const uint8_t*>(frame.data()), frame.size());
    }
    return DoSyncPush(job, req, bytes, id, content, reply, std::move(keepalive));
  }
  // Check every name and shape before touching anything.
  std::vector<std::pair<TensorState*, const wire::TensorMeta*>> targets;
  for (const auto* m : *req->tensors()) {
    auto it = job->tensors.find(m->name()->str());
    if (it == job->tensors.end()) {
      return Status::NotFound("tensor '" + m->name()->str() + "' is not in job '" + job_name + "'");
    }
    if (ShapeOf(m) != it->second.shape) {
      return Status::InvalidArgument("tensor '" + m->name()->str() +
                                     "': pushed shape differs from the job's shape");
    }
    targets.emplace_back(&it->second, m);
  }
  const uint64_t new_version = job->version + 1;
  std::vector<std::shared_ptr<std::vector<float>>> updated;
  WriteBatch batch;
  for (auto& [t, m] : targets) {
    const auto& frame = frames.payload[m->frame()];
    const size_t n = t->data->size();
    // The spare is scratch: no reply refers to it, and it is published only after the
    // write below succeeds.
    std::shared_ptr<std::vector<float>> next = std::move(t->spare);
    if (!next || next->size() != n) next = std::make_shared<std::vector<float>>(n);
    // A push may come while parts stream in on another connection (common/sanitizer.h).
    IgnoreReceivedReads received;
    if (!AddAllFinite(t->data->data(), static_cast<const uint8_t*>(frame.data()), next->data(),
                      n)) {
      t->spare = std::move(next);
      for (size_t i = 0; i < updated.size(); ++i) targets[i].first->spare = std::move(updated[i]);
      return Status::InvalidArgument("tensor '" + m->name()->str() +
                                     "': the delta is not finite or the sum overflows");
    }
    batch.Put(Column::kTensors, keys::TensorKey(job_name, m->name()->str()), Bytes(*next));
    batch.PutOwned(Column::kTensorMeta, keys::TensorKey(job_name, m->name()->str()),
                   EncodeTensorRecord({t->shape, new_version}));
    updated.push_back(std::move(next));
  }
  JobRecord next_job = *job;  // the durable part only
  next_job.version = new_version;
  next_job.pushes += 1;
  next_job.last_round = std::max(job->last_round, req->round());
  next_job.tokens += req->tokens();
  ISTHMUS_RETURN_IF_ERROR(AddDedup(job_name, key, new_version, content, next_job, batch));
  batch.PutOwned(Column::kJobs, job_name, EncodeJobRecord(next_job));
  Status written = store_->Write(batch);
  if (!written.ok()) {
    for (size_t i = 0; i < targets.size(); ++i) targets[i].first->spare = std::move(updated[i]);
    return written;
  }
  std::vector<std::pair<TensorState*, std::shared_ptr<std::vector<float>>>> sums;
  for (size_t i = 0; i < targets.size(); ++i) sums.emplace_back(targets[i].first, updated[i]);
  updated.clear();
  PublishSums(sums, new_version);
  static_cast<JobRecord&>(*job) = next_job;
  auto body =
      wire::CreatePushReply(reply.header, new_version, false, RoundStatusOf(reply.header, *job));
  FinishEnvelope(reply.header, id, wire::Body::PushReply, body.Union());
  return Status::Ok();
}

Result<bool> Shard::AnsweredBefore(JobState* job, const std::string& key,
                                   const std::string& content, uint64_t id, Reply& reply) {
  const std::string& job_name = job->name;
  ISTHMUS_ASSIGN_OR_RETURN(auto seen, store_->Get(Column::kDedup, keys::DedupKey(job_name, key)));
  if (!seen) return false;
  const auto rec = DecodeDedupRecord(*seen);
  if (rec && !rec->content.empty() && rec->content != content) {
    return Status::FailedPrecondition(
        "idempotency key '" + key + "' of job '" + job_name +
        "' was used before for a different push (" + rec->content + ", now " + content +
        ": another round or another set of tensors): a retry must resend the same round's "
        "tensors; a new push needs a new key");
  }
  const uint64_t v = rec ? rec->version : job->version;
  spdlog::info("push '{}' to job '{}' was applied before (version {}); not applied again", key,
               job_name, v);
  job->duplicate_pushes += 1;
  auto body = wire::CreatePushReply(reply.header, v, true, RoundStatusOf(reply.header, *job));
  FinishEnvelope(reply.header, id, wire::Body::PushReply, body.Union());
  return true;
}

Status Shard::AddRange(const std::string& name, const float* a, const void* delta, float* out,
                       size_t n) {
  if (AddAllFinite(a, static_cast<const uint8_t*>(delta), out, n)) return Status::Ok();
  return Status::InvalidArgument("tensor '" + name +
                                 "': the delta is not finite or the sum overflows");
}

void Shard::PublishSums(
    std::vector<std::pair<TensorState*, std::shared_ptr<std::vector<float>>>>& sums,
    uint64_t version) {
  // Durable: now publish in memory. The old buffer becomes the spare unless a pull reply
  // still holds it (use_count > 1; only this thread can add references).
  for (auto& [t, next] : sums) {
    std::shared_ptr<const std::vector<float>> old = std::move(t->data);
    t->data = std::move(next);
    t->version = version;
    if (old.use_count() == 1)
      t->spare = std::const_pointer_cast<std::vector<float>>(std::move(old));
  }
}

namespace {

// Bytes of a received frame that stay valid as long as `push`: the message itself kept
// (the server hands every request's ownership in), or a copy where no one owns it (a
// Shard driven by a test).
template <typename Push>
const uint8_t* KeepFrame(Push& push, const zmq::message_t& frame,
                         const std::shared_ptr<const void>& keepalive) {
  if (keepalive) {
    if (push.messages.empty() || push.messages.back() != keepalive) {
      push.messages.push_back(keepalive);
    }
    return static_cast<const uint8_t*>(frame.data());
  }
  const auto* p = static_cast<const uint8_t*>(frame.data());
  push.copies.emplace_back(p, p + frame.size());
  return push.copies.back().data();
}

}  // namespace

Status Shard::BeginStreamedPush(JobState* job, const wire::PushRequest* req, const Frames& frames,
                                uint64_t id, const std::string& content, Reply& reply,
                                std::shared_ptr<const void> keepalive) {
  const std::string key = req->idempotency_key()->str();
  auto push = std::make_unique<StreamedPush>();
  push->synced = sync_ && sync_->HasJob(job->name);
  if (push->synced) {
    const auto* h = static_cast<const uint8_t*>(frames.header.data());
    push->header.assign(h, h + frames.header.size());
  }
  push->job = job->name;
  push->key = key;
  push->connection = connection_;
  push->content = content;
  push->id = id;
  push->round = req->round();
  push->tokens = req->tokens();
  std::vector<bool> in_parts(req->tensors()->size(), false);
  for (uint32_t i : *req->streamed()) in_parts[i] = true;
  // Every name and shape before anything is taken (a synced job's shard keeps them too).
  for (size_t i = 0; i < req->tensors()->size(); ++i) {
    const auto* m = req->tensors()->Get(i);
    auto it = job->tensors.find(m->name()->str());
    if (it == job->tensors.end()) {
      return Status::NotFound("tensor '" + m->name()->str() + "' is not in job '" + job->name +
                              "'");
    }
    if (ShapeOf(m) != it->second.shape) {
      return Status::InvalidArgument("tensor '" + m->name()->str() +
                                     "': pushed shape differs from the job's shape");
    }
    StreamedPush::Target target;
    target.name = it->first;
    target.base = it->second.data;
    target.in_parts = in_parts[i];
    if (!target.in_parts) target.frame = KeepFrame(*push, frames.payload[m->frame()], keepalive);
    push->targets.push_back(std::move(target));
    if (in_parts[i]) push->order.push_back(i);
  }
  // The same push sent again (a client's retry on a new connection) starts over; pushes
  // left without parts, and the oldest past the bound, are dropped.
  const auto now = std::chrono::steady_clock::now();
  for (auto it = streamed_.begin(); it != streamed_.end();) {
    const bool again = (*it)->job == job->name && (*it)->key == key;
    if (!again && now - (*it)->last < std::chrono::milliseconds(options_.streamed_push_idle_ms)) {
      ++it;
      continue;
    }
    spdlog::warn("streamed push '{}' to job '{}' dropped: {}", (*it)->key, (*it)->job,
                 again ? "sent again" : "no part came for too long");
    it = streamed_.erase(it);
  }
  // Memory: the pushes waiting hold their tensors' sums (or deltas) in full, at most twice
  // the largest message's payload together.
  uint64_t bytes = 0;
  for (const auto& t : push->targets) {
    bytes += NumElements(job->tensors.at(t.name).shape) * sizeof(float);
  }
  auto held = [&] {
    uint64_t sum = 0;
    for (const auto& p : streamed_) {
      for (const auto& t : p->targets) sum += t.next ? t.next->size() * sizeof(float) : 0;
    }
    return sum;
  };
  while (!streamed_.empty() &&
         (streamed_.size() >= std::max<size_t>(1, options_.max_streamed_pushes) ||
          held() + bytes > 2 * options_.limits.max_payload_bytes)) {
    spdlog::warn("streamed push '{}' to job '{}' dropped: {} others wait for parts",
                 streamed_.front()->key, streamed_.front()->job, streamed_.size());
    streamed_.erase(streamed_.begin());
  }
  if (push->synced) {
    // The engine takes the request whole at the last part: the parts are only gathered.
    for (auto& target : push->targets) {
      if (!target.in_parts) continue;
      const size_t n = static_cast<size_t>(NumElements(job->tensors.at(target.name).shape));
      target.next = std::make_shared<std::vector<float>>(n);
    }
    push->last = now;
    streamed_.push_back(std::move(push));
    reply.send = false;
    return Status::Ok();
  }
  for (auto& target : push->targets) {
    TensorState& t = job->tensors.at(target.name);
    const size_t n = t.data->size();
    target.next = std::move(t.spare);
    if (!target.next || target.next->size() != n) {
      target.next = std::make_shared<std::vector<float>>(n);
    }
    if (!target.in_parts) {
      ISTHMUS_RETURN_IF_ERROR(
          AddRange(target.name, t.data->data(), target.frame, target.next->data(), n));
    }
    push->batch.Put(Column::kTensors, keys::TensorKey(job->name, target.name), Bytes(*target.next));
  }
  ISTHMUS_ASSIGN_OR_RETURN(push->staged, store_->Stage(push->batch));
  for (size_t i = 0; i < push->targets.size(); ++i) {
    if (push->targets[i].in_parts) continue;
    ISTHMUS_RETURN_IF_ERROR(
        push->staged->FillPrefix(i, push->targets[i].next->size() * sizeof(float)));
  }
  push->last = now;
  streamed_.push_back(std::move(push));
  reply.send = false;  // the last part's handling answers
  return Status::Ok();
}

Status Shard::DoPushPart(const wire::PushPart* req, const Frames& frames, uint64_t& id,
                         Reply& reply, std::shared_ptr<const void> keepalive) {
  const std::string job = req->job()->str(), key = req->idempotency_key()->str();
  auto it = std::find_if(streamed_.begin(), streamed_.end(), [&](const auto& p) {
    return p->job == job && p->key == key && p->connection == connection_;
  });
  if (it == streamed_.end()) {
    // Answered already (a duplicate, a refusal), dropped, or of an attempt the client gave
    // up on another connection: the client hears through the push's reply, or sends it again.
    spdlog::debug("part of push '{}' to job '{}' ignored: no such push waits for parts", key, job);
    reply.send = false;
    return Status::Ok();
  }
  StreamedPush& push = **it;
  id = push.id;  // from here on every outcome answers the push
  auto refuse = [&](Status s) {
    streamed_.erase(it);
    return s;
  };
  const size_t target = push.order[push.current];
  StreamedPush::Target& tg = push.targets[target];
  const size_t bytes = tg.next->size() * sizeof(float);
  const size_t size = frames.payload.size() == 1 ? frames.payload[0].size() : 0;
  if (req->tensor() != target || req->offset() != tg.received || size == 0 ||
      size % sizeof(float) != 0 || size > bytes - tg.received) {
    return refuse(Status::InvalidArgument(
        "push '" + key + "': a part of " + std::to_string(frames.payload.size()) + " frame(s), " +
        std::to_string(size) + " bytes for tensor #" + std::to_string(req->tensor()) + " at byte " +
        std::to_string(req->offset()) +
        ", where the push expects one frame of whole floats for tensor #" + std::to_string(target) +
        " ('" + tg.name + "', " + std::to_string(bytes) + " bytes) at byte " +
        std::to_string(tg.received)));
  }
  const size_t first = tg.received / sizeof(float), n = size / sizeof(float);
  if (push.synced) {
    IgnoreReceivedReads streamed_in;  // parts come back to back (common/sanitizer.h)
    std::memcpy(tg.next->data() + first, frames.payload[0].data(), size);
  } else {
    IgnoreReceivedReads streamed_in;
    const uint8_t* data = KeepFrame(push, frames.payload[0], keepalive);
    if (Status s = AddRange(tg.name, tg.base->data() + first, data, tg.next->data() + first, n);
        !s.ok()) {
      return refuse(s);
    }
    push.parts.push_back({target, tg.received, data, size});
  }
  tg.received += size;
  push.last = std::chrono::steady_clock::now();
  if (!push.synced) {
    if (Status s = push.staged->FillPrefix(target, tg.received); !s.ok()) return refuse(s);
  }
  if (tg.received == bytes) ++push.current;
  if (push.current < push.order.size()) {
    reply.send = false;
    return Status::Ok();
  }
  std::shared_ptr<StreamedPush> done = std::move(*it);
  streamed_.erase(it);
  return FinishStreamedPush(std::move(done), reply);
}

Status Shard::FinishStreamedPush(std::shared_ptr<StreamedPush> done, Reply& reply) {
  StreamedPush& push = *done;
  auto jt = jobs_.find(push.job);
  if (jt == jobs_.end()) {
    return Status::NotFound("job '" + push.job + "' went away while its push came in parts");
  }
  JobState* job = &jt->second;
  // Sent again whole meanwhile and applied: this copy is a duplicate.
  ISTHMUS_ASSIGN_OR_RETURN(bool answered,
                           AnsweredBefore(job, push.key, push.content, push.id, reply));
  if (answered) return Status::Ok();
  if (push.synced) {
    // The request as if it had come whole: the engine's checks, its dedup by round, its
    // keeping of the deltas until the round's close (this push holds them).
    const auto* req =
        flatbuffers::GetRoot<wire::Envelope>(push.header.data())->body_as_PushRequest();
    std::vector<std::span<const uint8_t>> bytes;
    for (const auto& tg : push.targets) {
      if (tg.in_parts) {
        bytes.emplace_back(reinterpret_cast<const uint8_t*>(tg.next->data()),
                           tg.next->size() * sizeof(float));
      } else {
        bytes.emplace_back(tg.frame, req->tensors()->Get(bytes.size())->nbytes());
      }
    }
    return DoSyncPush(job, req, bytes, push.id, push.content, reply, std::move(done));
  }
  std::vector<std::pair<TensorState*, std::shared_ptr<std::vector<float>>>> sums;
  bool same = true;
  for (auto& tg : push.targets) {
    auto tt = job->tensors.find(tg.name);
    if (tt == job->tensors.end() || !tt->second.data ||
        tt->second.data->size() != tg.next->size()) {
      return Status::FailedPrecondition("tensor '" + tg.name + "' of job '" + push.job +
                                        "' changed while its push came in parts: push again");
    }
    same = same && tt->second.data == tg.base;
    sums.emplace_back(&tt->second, tg.next);
  }
  const uint64_t new_version = job->version + 1;
  JobRecord next_job = *job;  // the durable part only
  next_job.version = new_version;
  next_job.pushes += 1;
  next_job.last_round = std::max(job->last_round, push.round);
  next_job.tokens += push.tokens;
  WriteBatch more;
  for (size_t i = 0; i < sums.size(); ++i) {
    more.PutOwned(Column::kTensorMeta, keys::TensorKey(push.job, push.targets[i].name),
                  EncodeTensorRecord({sums[i].first->shape, new_version}));
  }
  ISTHMUS_RETURN_IF_ERROR(AddDedup(push.job, push.key, new_version, push.content, next_job, more));
  more.PutOwned(Column::kJobs, push.job, EncodeJobRecord(next_job));
  Status written = Status::FailedPrecondition("another push to these tensors came first");
  if (same) written = store_->Apply(std::move(push.staged), more);
  if (written.code() == Code::kFailedPrecondition) {
    // Another push to these tensors was published (or staged) while this one came: the
    // sums again, from the values served now and the parts kept, in one plain write.
    push.staged.reset();
    WriteBatch all;
    for (size_t i = 0; i < push.targets.size(); ++i) {
      const auto& tg = push.targets[i];
      const float* a = sums[i].first->data->data();
      if (!tg.in_parts) {
        ISTHMUS_RETURN_IF_ERROR(AddRange(tg.name, a, tg.frame, tg.next->data(), tg.next->size()));
      }
      all.Put(Column::kTensors, keys::TensorKey(push.job, tg.name), Bytes(*tg.next));
    }
    {
      IgnoreReceivedReads streamed_in;  // the parts' bytes (common/sanitizer.h)
      for (const auto& part : push.parts) {
        const auto& tg = push.targets[part.target];
        const size_t first = part.offset / sizeof(float);
        ISTHMUS_RETURN_IF_ERROR(AddRange(tg.name, sums[part.target].first->data->data() + first,
                                         part.data, tg.next->data() + first,
                                         part.size / sizeof(float)));
      }
    }
    for (const auto& op : more.ops()) {
      if (op.is_delete) {
        all.Delete(op.column, op.key);
      } else {
        all.Put(op.column, op.key, op.value);
      }
    }
    written = store_->Write(all);
  }
  ISTHMUS_RETURN_IF_ERROR(written);
  for (auto& tg : push.targets) tg.base.reset();  // so the old values can become spares
  PublishSums(sums, new_version);
  static_cast<JobRecord&>(*job) = next_job;
  auto body =
      wire::CreatePushReply(reply.header, new_version, false, RoundStatusOf(reply.header, *job));
  FinishEnvelope(reply.header, push.id, wire::Body::PushReply, body.Union());
  return Status::Ok();
}

void Shard::DropStreamedPushes(const char* why) {
  if (streamed_.empty()) return;
  spdlog::warn("{} streamed push(es) waiting for parts dropped: {}", streamed_.size(), why);
  streamed_.clear();
}

Status Shard::AddDedup(const std::string& job_name, const std::string& key, uint64_t version,
                       const std::string& content, JobRecord& next, WriteBatch& batch) {
  const uint64_t seq = next.dedup_seq;
  batch.PutOwned(Column::kDedup, keys::DedupKey(job_name, key),
                 EncodeDedupRecord({version, content}));
  batch.PutOwned(Column::kDedupLog, keys::DedupLogKey(job_name, seq), key);
  next.dedup_seq = seq + 1;
  if (seq >= options_.dedup_window) {
    // Forget the oldest key so the window stays bounded.
    std::string old_log = keys::DedupLogKey(job_name, seq - options_.dedup_window);
    ISTHMUS_ASSIGN_OR_RETURN(auto old_key, store_->Get(Column::kDedupLog, old_log));
    if (old_key) batch.Delete(Column::kDedup, keys::DedupKey(job_name, *old_key));
    batch.Delete(Column::kDedupLog, old_log);
  }
  return Status::Ok();
}

Status Shard::DoSyncPush(JobState* job, const wire::PushRequest* req,
                         const std::vector<std::span<const uint8_t>>& bytes, uint64_t id,
                         const std::string& content, Reply& reply,
                         std::shared_ptr<const void> keepalive) {
  const std::string& job_name = job->name;
  const std::string key = req->idempotency_key()->str();
  // Frames that are not float-aligned are copied; these copies live as long as the request
  // (the keepalive) for the engine, which may keep the deltas until the round's close.
  struct Owned {
    std::shared_ptr<const void> request;
    std::vector<std::vector<float>> copies;
  };
  auto owned = std::make_shared<Owned>();
  owned->request = std::move(keepalive);
  std::vector<std::vector<float>>& copies = owned->copies;
  copies.reserve(req->tensors()->size());
  std::vector<SyncPushTensor> tensors;
  // Names and shapes are the engine's to check (it holds the synced job's tensors).
  for (size_t i = 0; i < req->tensors()->size(); ++i) {
    const auto* m = req->tensors()->Get(i);
    const std::span<const uint8_t> frame = bytes[i];
    if (m->dtype() == wire::DType::Codec) {
      // The codec's bytes, decoded (and so validated) by the engine; the frame lives as
      // long as the request.
      tensors.push_back(
          {m->name()->str(),
           {},
           ShapeOf(m),
           std::string_view(reinterpret_cast<const char*>(frame.data()), frame.size())});
      continue;
    }
    const size_t n = frame.size() / sizeof(float);
    const float* data = reinterpret_cast<const float*>(frame.data());
    if (reinterpret_cast<uintptr_t>(frame.data()) % alignof(float) != 0) {
      copies.emplace_back(n);
      std::memcpy(copies.back().data(), frame.data(), frame.size());
      data = copies.back().data();
    }
    tensors.push_back({m->name()->str(), std::span<const float>(data, n), ShapeOf(m)});
  }
  JobRecord next = *job;
  next.pushes += 1;
  next.last_round = std::max(job->last_round, req->round());
  next.tokens += req->tokens();
  WriteBatch batch;
  ISTHMUS_RETURN_IF_ERROR(AddDedup(job_name, key, sync_->Version(job_name), content, next, batch));
  batch.PutOwned(Column::kJobs, job_name, EncodeJobRecord(next));
  bool duplicate = false;
  if (req->round() == 0) {
    ISTHMUS_RETURN_IF_ERROR(sync_->AddNow(job_name, tensors, batch).status());
  } else {
    ISTHMUS_ASSIGN_OR_RETURN(
        SyncPushResult r,
        sync_->PushRound(job_name, req->round(), req->tokens(), tensors, batch, req->compute_ms(),
                         owned->request ? std::shared_ptr<const void>(owned) : nullptr));
    duplicate = r.duplicate;
    if (duplicate) {
      job->duplicate_pushes += 1;
      spdlog::info(
          "push '{}' to job '{}' is for round {}, which this site closed already; "
          "not applied again",
          key, job_name, req->round());
    }
  }
  if (!duplicate) static_cast<JobRecord&>(*job) = next;
  auto body = wire::CreatePushReply(reply.header, VersionOf(*job), duplicate,
                                    RoundStatusOf(reply.header, *job));
  FinishEnvelope(reply.header, id, wire::Body::PushReply, body.Union());
  return Status::Ok();
}

Status Shard::DoJobCreate(const wire::JobCreate* req, const Frames& frames, uint64_t id,
                          Reply& reply) {
  std::string name = req->job()->str();
  if (!IsValidName(name)) {
    return Status::InvalidArgument("job name '" + name +
                                   "' must be 1-64 characters of A-Z a-z 0-9 . _ - ");
  }
  ISTHMUS_RETURN_IF_ERROR(ValidateTensors(req->tensors(), frames.payload, options_.limits, true));
  if (req->tensors() == nullptr || req->tensors()->size() == 0) {
    return Status::InvalidArgument("a job needs at least one tensor");
  }
  // Beyond the wire's checks, a new job's tensors: names safe as file names of an export,
  // and at least one element each (jobs created before these rules are served as they are).
  for (const auto* m : *req->tensors()) {
    const std::string_view tname = m->name()->string_view();
    if (!IsValidTensorName(tname)) {
      return Status::InvalidArgument("tensor name '" + PrintableName(tname) + "' of job '" + name +
                                     "' is not valid: " + TensorNameRule());
    }
    const auto shape = ShapeOf(m);
    if (shape.empty()) {
      return Status::InvalidArgument("tensor '" + std::string(tname) + "' of job '" + name +
                                     "' has shape [] (a scalar): give it shape [1]");
    }
    if (std::find(shape.begin(), shape.end(), 0) != shape.end()) {
      std::string dims;
      for (size_t i = 0; i < shape.size(); ++i) dims += (i ? ", " : "") + std::to_string(shape[i]);
      return Status::InvalidArgument("tensor '" + std::string(tname) + "' of job '" + name +
                                     "' has shape [" + dims +
                                     "] with a zero dimension: it holds no value; leave it out "
                                     "of the job");
    }
  }
  JobState job;
  job.name = name;
  job.base_hash = req->base_hash() ? req->base_hash()->str() : "";
  job.version = 1;
  job.created_unix = NowUnix();
  WriteBatch batch;
  uint64_t total = 0;
  std::vector<Tensor> content;  // for the create hash
  for (const auto* m : *req->tensors()) {
    const auto& frame = frames.payload[m->frame()];
    auto data = std::make_shared<std::vector<float>>(frame.size() / sizeof(float));
    if (frame.size() > 0) std::memcpy(data->data(), frame.data(), frame.size());
    TensorState t{ShapeOf(m), 1, data};
    content.push_back(Tensor{m->name()->str(), t.shape, *data});
    batch.Put(Column::kTensors, keys::TensorKey(name, m->name()->str()), Bytes(*data));
    batch.PutOwned(Column::kTensorMeta, keys::TensorKey(name, m->name()->str()),
                   EncodeTensorRecord({t.shape, 1}));
    total += frame.size();
    job.tensors.emplace(m->name()->str(), std::move(t));
  }
  // What identifies this create: a retry of it (a lost reply) is answered as it was.
  job.create_hash = TensorsContentHash(content) + "/" + job.base_hash;
  const size_t count = job.tensors.size();
  if (auto existing = jobs_.find(name); existing != jobs_.end()) {
    if (existing->second.create_hash != job.create_hash) {
      return Status::AlreadyExists("job '" + name + "' already exists");
    }
    spdlog::info("job '{}' was created by this same request before: answered again", name);
    auto body = wire::CreateJobCreateReply(reply.header, 1, count, total);
    FinishEnvelope(reply.header, id, wire::Body::JobCreateReply, body.Union());
    return Status::Ok();
  }
  // The job, its tensors and (synced) its round-0 sync state: one write, all or nothing.
  std::map<std::string, SyncTensor> synced;
  if (sync_) {
    for (const auto& [tname, t] : job.tensors) synced[tname] = SyncTensor{t.shape, t.data};
    sync_->AddNewJob(name, synced, job.version, &batch);
  }
  batch.PutOwned(Column::kJobs, name, EncodeJobRecord(job));
  ISTHMUS_RETURN_IF_ERROR(store_->Write(batch));
  if (sync_) {
    sync_->AdoptNewJob(name, std::move(synced), job.version);
    ReleaseSyncedData(job);
  }
  jobs_.emplace(name, std::move(job));
  spdlog::info("created job '{}': {} tensors, {} bytes", name, count, total);
  auto body = wire::CreateJobCreateReply(reply.header, 1, count, total);
  FinishEnvelope(reply.header, id, wire::Body::JobCreateReply, body.Union());
  return Status::Ok();
}

Status Shard::DoJobDescribe(const wire::JobDescribe* req, uint64_t id, Reply& reply) {
  ISTHMUS_ASSIGN_OR_RETURN(JobState * job, FindJob(req->job()));
  std::vector<flatbuffers::Offset<wire::TensorMeta>> metas;
  // A synced job's tensors are versioned by the sync engine (every tensor carries the
  // served version, as pulls report it).
  const bool synced = sync_ && sync_->HasJob(job->name);
  for (const auto& [name, t] : job->tensors) {
    metas.push_back(wire::CreateTensorMetaDirect(reply.header, name.c_str(), &t.shape,
                                                 wire::DType::F32, 0, 0,
                                                 synced ? VersionOf(*job) : t.version));
  }
  auto v = reply.header.CreateVector(metas);
  auto body =
      wire::CreateJobDescribeReply(reply.header, reply.header.CreateString(req->job()->str()),
                                   reply.header.CreateString(job->base_hash), VersionOf(*job),
                                   job->pushes, job->created_unix, v);
  FinishEnvelope(reply.header, id, wire::Body::JobDescribeReply, body.Union());
  return Status::Ok();
}

namespace {
flatbuffers::Offset<wire::JobSummary> SummaryOf(flatbuffers::FlatBufferBuilder& fbb,
                                                const std::string& name, uint64_t version,
                                                uint64_t count, uint64_t bytes, uint64_t pushes,
                                                uint64_t duplicate_pushes = 0) {
  return wire::CreateJobSummaryDirect(fbb, name.c_str(), version, count, bytes, pushes,
                                      duplicate_pushes);
}
}  // namespace

Status Shard::DoStats(uint64_t id, Reply& reply) {
  auto& fbb = reply.header;
  std::vector<flatbuffers::Offset<wire::JobSummary>> jobs;
  for (const auto& [name, job] : jobs_) {
    jobs.push_back(SummaryOf(fbb, name, VersionOf(job), job.tensors.size(), JobBytes(job),
                             job.pushes, job.duplicate_pushes));
  }
  auto uptime =
      std::chrono::duration_cast<std::chrono::seconds>(std::chrono::steady_clock::now() - started_)
          .count();
  const uint64_t error_age = last_error_.empty()
                                 ? 0
                                 : std::chrono::duration_cast<std::chrono::seconds>(
                                       std::chrono::steady_clock::now() - last_error_at_)
                                       .count();
  auto body = wire::CreateStatsReply(
      fbb, fbb.CreateString(options_.shard_id), fbb.CreateString(kIsthmusVersion), uptime,
      requests_, errors_, bytes_in_, bytes_out_, store_->ApproximateBytes(), fbb.CreateVector(jobs),
      fbb.CreateString(last_error_), error_age);
  FinishEnvelope(reply.header, id, wire::Body::StatsReply, body.Union());
  return Status::Ok();
}

namespace {

// Reads <dir>/info.json of a snapshot into a wire SnapshotInfo.
Result<flatbuffers::Offset<wire::SnapshotInfo>> SnapshotInfoFrom(
    flatbuffers::FlatBufferBuilder& fbb, const fs::path& dir) {
  std::ifstream in(dir / "info.json");
  if (!in) return Status::NotFound("snapshot '" + dir.filename().string() + "' has no info.json");
  json info = json::parse(in, nullptr, false);
  if (info.is_discarded()) return Status::Corruption("snapshot info '" + dir.string() + "' is bad");
  std::vector<flatbuffers::Offset<wire::JobSummary>> jobs;
  for (const auto& j : info.value("jobs", json::array())) {
    jobs.push_back(SummaryOf(fbb, j.value("job", ""), j.value("version", uint64_t{0}),
                             j.value("tensor_count", uint64_t{0}),
                             j.value("total_bytes", uint64_t{0}), j.value("pushes", uint64_t{0})));
  }
  return wire::CreateSnapshotInfo(fbb, fbb.CreateString(dir.filename().string()),
                                  info.value("created_unix", uint64_t{0}), fbb.CreateVector(jobs),
                                  info.value("bytes", uint64_t{0}));
}

uint64_t FolderBytes(const fs::path& dir) {
  uint64_t total = 0;
  std::error_code ec;
  for (const auto& e : fs::recursive_directory_iterator(dir, ec)) {
    if (e.is_regular_file(ec)) total += e.file_size(ec);
  }
  return total;
}

}  // namespace

Status Shard::DoSnapshotCreate(const wire::SnapshotCreate* req, uint64_t id, Reply& reply) {
  if (options_.snapshot_dir.empty()) return Status::FailedPrecondition("snapshots are disabled");
  std::string name = req->name()->str();
  if (!IsValidName(name)) {
    return Status::InvalidArgument("snapshot name '" + name +
                                   "' must be 1-64 characters of A-Z a-z 0-9 . _ -");
  }
  fs::path final_dir = fs::path(options_.snapshot_dir) / name;
  fs::path tmp_dir = fs::path(options_.snapshot_dir) / (".tmp-" + name);
  std::error_code ec;
  if (fs::exists(final_dir, ec)) return Status::AlreadyExists("snapshot '" + name + "' exists");
  fs::remove_all(tmp_dir, ec);
  // The snapshots folder's own name must be durable too, or a finished snapshot could
  // vanish with it after a power loss.
  ISTHMUS_RETURN_IF_ERROR(CreateDirectoriesDurably(tmp_dir.string()));
  Status s = store_->Checkpoint((tmp_dir / "db").string());
  if (!s.ok()) {
    fs::remove_all(tmp_dir, ec);
    return s;
  }
  json jobs = json::array();
  for (const auto& [jname, job] : jobs_) {
    const uint64_t bytes = JobBytes(job);
    jobs.push_back({{"job", jname},
                    {"version", VersionOf(job)},
                    {"tensor_count", job.tensors.size()},
                    {"total_bytes", bytes},
                    {"pushes", job.pushes}});
  }
  json info{{"created_unix", NowUnix()},
            {"shard_id", options_.shard_id},
            {"bytes", FolderBytes(tmp_dir / "db")},
            {"jobs", jobs}};
  {
    std::ofstream out(tmp_dir / "info.json");
    out << info.dump(2) << "\n";
    out.close();
    if (!out) {
      fs::remove_all(tmp_dir, ec);
      return Status::IoError("cannot write snapshot info in '" + tmp_dir.string() + "'");
    }
  }
  // Whole on disk before it gets its name, and the name durable before it is reported
  // created: a power loss leaves the snapshot complete or absent (a leftover .tmp folder
  // is cleared by the next create).
  s = SyncTree(tmp_dir.string());
  if (!s.ok()) {
    fs::remove_all(tmp_dir, ec);
    return Status(s.code(), "cannot make snapshot '" + name + "' durable: " + s.message());
  }
  s = RenameDurably(tmp_dir.string(), final_dir.string());
  if (!s.ok()) return Status(s.code(), "cannot finish snapshot '" + name + "': " + s.message());
  spdlog::info("snapshot '{}' created", name);
  ISTHMUS_ASSIGN_OR_RETURN(auto snap, SnapshotInfoFrom(reply.header, final_dir));
  FinishEnvelope(reply.header, id, wire::Body::SnapshotCreateReply,
                 wire::CreateSnapshotCreateReply(reply.header, snap).Union());
  return Status::Ok();
}

Status Shard::DoSnapshotList(uint64_t id, Reply& reply) {
  std::vector<flatbuffers::Offset<wire::SnapshotInfo>> snaps;
  std::error_code ec;
  if (!options_.snapshot_dir.empty() && fs::is_directory(options_.snapshot_dir, ec)) {
    std::vector<fs::path> dirs;
    for (const auto& e : fs::directory_iterator(options_.snapshot_dir, ec)) {
      if (e.is_directory() && e.path().filename().string()[0] != '.') dirs.push_back(e.path());
    }
    std::sort(dirs.begin(), dirs.end());
    for (const auto& d : dirs) {
      auto info = SnapshotInfoFrom(reply.header, d);
      if (info.ok()) snaps.push_back(*info);
    }
  }
  FinishEnvelope(
      reply.header, id, wire::Body::SnapshotListReply,
      wire::CreateSnapshotListReply(reply.header, reply.header.CreateVector(snaps)).Union());
  return Status::Ok();
}

Status Shard::DoSnapshotRestore(const wire::SnapshotRestore* req, uint64_t id, Reply& reply) {
  if (options_.snapshot_dir.empty() || !options_.replace_store_files) {
    return Status::FailedPrecondition("snapshot restore is not available on this shard");
  }
  std::string name = req->name()->str();
  fs::path dir = fs::path(options_.snapshot_dir) / name;
  std::error_code ec;
  if (!IsValidName(name) || !fs::is_directory(dir / "db", ec)) {
    return Status::NotFound("snapshot '" + name +
                            "' does not exist (list them: isthmusctl snapshot list)");
  }
  if (sync_) sync_->DropStateWrites();  // they write into the store closed here
  DropStreamedPushes("a snapshot is restored");
  store_.reset();  // close the live database before its files are replaced
  Status s = options_.replace_store_files((dir / "db").string());
  auto reopened = options_.open_store();
  if (!reopened.ok()) {
    spdlog::error("cannot reopen the store after restore: {}", reopened.status().ToString());
    return reopened.status();
  }
  store_ = std::move(reopened).value();
  ISTHMUS_RETURN_IF_ERROR(s);  // replacing failed: the old store is back
  Status loaded = Load();
  if (!loaded.ok()) {
    store_.reset();
    return loaded;
  }
  spdlog::info("restored snapshot '{}'", name);
  ISTHMUS_ASSIGN_OR_RETURN(auto snap, SnapshotInfoFrom(reply.header, dir));
  FinishEnvelope(reply.header, id, wire::Body::SnapshotRestoreReply,
                 wire::CreateSnapshotRestoreReply(reply.header, snap).Union());
  return Status::Ok();
}

}  // namespace isthmus
