// bench_server: how close a shard's push and pull come to raw ZeroMQ over loopback (CURVE
// off and on, fsync on and off) and to a ps-lite-style in-memory parameter server, where a
// 64 MiB push spends its time inside the server, what a snapshot of a 1 GiB job costs in
// time and disk, and what a full-model round boundary costs two peered shards (push
// acknowledged, round committed on both, pull). A program that prints figures, not a test:
// it talks only to 127.0.0.1, runs the shards in-process on their own threads, bounds its
// own runtime, and removes its data folders when done.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include <spdlog/spdlog.h>
#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>
#include <zmq.hpp>

#include "common/client.h"
#include "common/keys.h"
#include "common/status.h"
#include "common/tensor.h"
#include "common/transport.h"
#include "common/wire.h"
#include "server/config/config.h"
#include "server/shard/server.h"
#include "server/shard/shard.h"
#include "server/storage/keys.h"
#include "server/storage/store.h"

namespace isthmus::bench {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr uint64_t kKiB = 1024, kMiB = kKiB * 1024, kGiB = kMiB * 1024;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

std::string SizeLabel(uint64_t bytes) {
  char buf[32];
  if (bytes >= kGiB && bytes % kGiB == 0) {
    std::snprintf(buf, sizeof buf, "%" PRIu64 " GiB", bytes / kGiB);
  } else if (bytes >= kMiB && bytes % kMiB == 0) {
    std::snprintf(buf, sizeof buf, "%" PRIu64 " MiB", bytes / kMiB);
  } else if (bytes >= kKiB && bytes % kKiB == 0) {
    std::snprintf(buf, sizeof buf, "%" PRIu64 " KiB", bytes / kKiB);
  } else {
    std::snprintf(buf, sizeof buf, "%" PRIu64 " B", bytes);
  }
  return buf;
}

// "4K", "64K", "1M", "1G" or a byte count; a multiple of 4 (fp32 tensors).
Result<uint64_t> ParseSize(const std::string& text) {
  if (text.empty()) return Status::InvalidArgument("empty size");
  char* end = nullptr;
  unsigned long long v = std::strtoull(text.c_str(), &end, 10);
  std::string unit(end);
  uint64_t mul = 1;
  if (unit == "K" || unit == "KiB")
    mul = kKiB;
  else if (unit == "M" || unit == "MiB")
    mul = kMiB;
  else if (unit == "G" || unit == "GiB")
    mul = kGiB;
  else if (!unit.empty())
    return Status::InvalidArgument("bad size '" + text + "'");
  uint64_t bytes = v * mul;
  if (bytes == 0 || bytes % 4 != 0) {
    return Status::InvalidArgument("size '" + text + "' must be a positive multiple of 4 bytes");
  }
  return bytes;
}

// A folder removed with everything in it when this goes away.
class TempDir {
 public:
  static Result<TempDir> Make(const std::string& parent, const std::string& stem) {
    std::string tmpl = (fs::path(parent) / (stem + "-XXXXXX")).string();
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (::mkdtemp(buf.data()) == nullptr) {
      return Status::IoError("cannot create a temporary folder under '" + parent +
                             "': " + std::strerror(errno) + " (pick another with --dir)");
    }
    return TempDir(buf.data());
  }
  TempDir(TempDir&& o) noexcept : path_(std::move(o.path_)) { o.path_.clear(); }
  TempDir& operator=(TempDir&&) = delete;
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  explicit TempDir(std::string p) : path_(std::move(p)) {}
  std::string path_;
};

// An unused TCP port on 127.0.0.1 (the kernel picks it; a tiny race with other programs
// is possible between here and the server's bind).
Result<int> FreePort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return Status::IoError("socket() failed");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    ::close(fd);
    return Status::IoError("cannot find a free loopback port");
  }
  int port = ntohs(addr.sin_port);
  ::close(fd);
  return port;
}

// The three key pairs of a CURVE run, written as files the server config names.
struct BenchKeys {
  KeyPair server, worker, admin;
  std::string server_key_file, worker_pub_file, admin_pub_file;
};

Result<BenchKeys> MakeKeys(const std::string& dir) {
  BenchKeys k;
  ISTHMUS_ASSIGN_OR_RETURN(k.server, GenerateKeyPair());
  ISTHMUS_ASSIGN_OR_RETURN(k.worker, GenerateKeyPair());
  ISTHMUS_ASSIGN_OR_RETURN(k.admin, GenerateKeyPair());
  ISTHMUS_RETURN_IF_ERROR(WriteKeyPairFiles(dir + "/server", k.server, false));
  ISTHMUS_RETURN_IF_ERROR(WriteKeyPairFiles(dir + "/worker", k.worker, false));
  ISTHMUS_RETURN_IF_ERROR(WriteKeyPairFiles(dir + "/admin", k.admin, false));
  k.server_key_file = dir + "/server.key";
  k.worker_pub_file = dir + "/worker.pub";
  k.admin_pub_file = dir + "/admin.pub";
  return k;
}

// A ShardServer serving on its own thread, stopped and its data removed on destruction.
class RunningServer {
 public:
  // `extra` settings are applied last (they may replace the ones made here).
  static Result<std::unique_ptr<RunningServer>> Start(
      const std::string& parent, bool curve, bool sync_writes, const BenchKeys& keys,
      const std::map<std::string, std::string>& extra = {}) {
    ISTHMUS_ASSIGN_OR_RETURN(TempDir dir, TempDir::Make(parent, "isthmus-bench-shard"));
    ISTHMUS_ASSIGN_OR_RETURN(int worker_port, FreePort());
    ISTHMUS_ASSIGN_OR_RETURN(int admin_port, FreePort());
    std::string worker_ep = "tcp://127.0.0.1:" + std::to_string(worker_port);
    std::string admin_ep = "tcp://127.0.0.1:" + std::to_string(admin_port);
    std::map<std::string, std::string> settings = {
        {"shard.id", "bench"},
        {"shard.data_dir", dir.path()},
        {"listen.worker", worker_ep},
        {"listen.admin", admin_ep},
        {"storage.sync_writes", sync_writes ? "true" : "false"},
        {"security.insecure_plaintext", curve ? "false" : "true"},
        {"log.level", "error"},
    };
    if (curve) {
      settings["security.secret_key"] = keys.server_key_file;
      settings["security.worker_keys"] = keys.worker_pub_file;
      settings["security.admin_keys"] = keys.admin_pub_file;
    }
    for (const auto& [k, v] : extra) settings[k] = v;
    ISTHMUS_ASSIGN_OR_RETURN(ServerConfig cfg, LoadServerConfig("", settings));
    std::unique_ptr<RunningServer> rs(new RunningServer(std::move(dir)));
    rs->config_ = cfg;
    rs->worker_ep_ = worker_ep;
    rs->admin_ep_ = admin_ep;
    rs->server_ = std::make_unique<ShardServer>(cfg);
    ISTHMUS_RETURN_IF_ERROR(rs->server_->Start());
    rs->thread_ = std::thread([s = rs->server_.get(), r = rs.get()] { r->run_status_ = s->Run(); });
    return rs;
  }
  ~RunningServer() {
    if (thread_.joinable()) {
      server_->RequestStop();
      thread_.join();
    }
    if (!run_status_.ok()) std::fprintf(stderr, "server: %s\n", run_status_.ToString().c_str());
    server_.reset();  // closes RocksDB before TempDir removes its files
  }

  // `server_key`: the server's public key when it is not keys.server's.
  ClientOptions Options(bool admin, bool curve, const BenchKeys& keys,
                        const std::string& server_key = "") const {
    ClientOptions o;
    o.endpoint = admin ? admin_ep_ : worker_ep_;
    o.insecure_plaintext = !curve;
    if (curve) {
      o.server_public_key = server_key.empty() ? keys.server.public_key : server_key;
      o.client_keys = admin ? keys.admin : keys.worker;
    }
    o.timeout_ms = 180000;  // a 1 GiB CreateJob with fsync can take a while on a slow disk
    o.retries = 0;          // a timed-out measurement is a failure, not something to retry
    return o;
  }
  const std::string& data_dir() const { return dir_.path(); }
  const ServerConfig& config() const { return config_; }

 private:
  explicit RunningServer(TempDir dir) : dir_(std::move(dir)) {}
  TempDir dir_;  // declared first: destroyed last
  ServerConfig config_;
  std::string worker_ep_, admin_ep_;
  std::unique_ptr<ShardServer> server_;
  std::thread thread_;
  Status run_status_;
};

// ---------------------------------------------------------------------------------------
// Measurement cells.

struct Plan {
  int reps = 0;    // timed operations (upper bound; the time cap may stop earlier)
  int warmup = 0;  // untimed operations before them
};

// More repetitions for small sizes: about 512 MiB moved per cell, 8 to 2000 operations.
Plan PlanFor(uint64_t bytes) {
  Plan p;
  p.reps = static_cast<int>(std::clamp<uint64_t>(512 * kMiB / bytes, 8, 2000));
  p.warmup = std::clamp(p.reps / 20, 2, 20);
  return p;
}

struct Cell {
  std::string op;  // raw-zmq, push, pull
  bool curve = false;
  std::string sync;  // "true", "false" or "-" (not applicable)
  uint64_t bytes = 0;
  int reps = 0;
  double seconds = 0;    // total timed wall time
  double median_ms = 0;  // per operation; for raw-zmq the mean (a stream has no per-op time)
  double MBps() const { return seconds > 0 ? bytes * double(reps) / seconds / 1e6 : 0; }
};

// Runs `op` plan.warmup times untimed, then up to plan.reps times timed, stopping early
// once `cap_s` seconds of timed work have passed (at least 3 timed runs).
Status Measure(const Plan& plan, double cap_s, const std::function<Status()>& op, Cell& cell) {
  for (int i = 0; i < plan.warmup; ++i) ISTHMUS_RETURN_IF_ERROR(op());
  std::vector<double> per_op;
  per_op.reserve(plan.reps);
  double total = 0;
  for (int i = 0; i < plan.reps; ++i) {
    auto t0 = Clock::now();
    ISTHMUS_RETURN_IF_ERROR(op());
    double s = Seconds(t0, Clock::now());
    per_op.push_back(s);
    total += s;
    if (total > cap_s && i + 1 >= 3) break;
  }
  cell.reps = static_cast<int>(per_op.size());
  cell.seconds = total;
  cell.median_ms = Median(per_op) * 1e3;
  return Status::Ok();
}

void NoFree(void*, void*) {}

// Raw ZeroMQ baseline: `count` messages of `bytes` each, PUSH -> PULL over tcp loopback,
// sent zero-copy from one buffer, in two contexts (as two processes would have), the
// receiver with 2 I/O threads like the server. Times the first send to the last receive.
Status RawZmqStream(uint64_t bytes, const Plan& plan, bool curve, const BenchKeys& keys,
                    Cell& cell) {
  std::vector<char> buf(bytes, 1);
  try {
    zmq::context_t rx_ctx(2), tx_ctx(1);
    zmq::socket_t rx(rx_ctx, zmq::socket_type::pull), tx(tx_ctx, zmq::socket_type::push);
    rx.set(zmq::sockopt::linger, 0);
    tx.set(zmq::sockopt::linger, 0);
    if (curve) {
      rx.set(zmq::sockopt::curve_server, true);
      rx.set(zmq::sockopt::curve_secretkey, keys.server.secret_key);
      ConfigureCurveClient(tx, keys.worker, keys.server.public_key);
    }
    rx.bind("tcp://127.0.0.1:*");
    tx.connect(rx.get(zmq::sockopt::last_endpoint));
    auto send = [&](int n) {
      for (int i = 0; i < n; ++i) {
        zmq::message_t m(buf.data(), bytes, NoFree, nullptr);
        tx.send(m, zmq::send_flags::none);
      }
    };
    auto receive = [&](int n) -> bool {
      for (int i = 0; i < n; ++i) {
        zmq::message_t m;
        if (!rx.recv(m) || m.size() != bytes) return false;
      }
      return true;
    };
    send(plan.warmup);  // also completes the TCP and CURVE handshakes
    if (!receive(plan.warmup)) return Status::Internal("raw zmq: bad warm-up message");
    bool ok = true;
    Clock::time_point t0 = Clock::now(), t1;
    std::thread receiver([&] {
      ok = receive(plan.reps);
      t1 = Clock::now();
    });
    send(plan.reps);
    receiver.join();
    if (!ok) return Status::Internal("raw zmq: bad message");
    cell.reps = plan.reps;
    cell.seconds = Seconds(t0, t1);
    cell.median_ms = cell.seconds / plan.reps * 1e3;
  } catch (const zmq::error_t& e) {
    return Status::Internal(std::string("raw zmq: ") + e.what());
  }
  return Status::Ok();
}

// Raw ZeroMQ request/reply: DEALER sends one message of `bytes` (zero-copy), ROUTER on
// its own thread answers with 8 bytes, one exchange at a time -- the transport part of a
// push with no server work. Same contexts and I/O threads as RawZmqStream.
Status RawZmqRequestReply(uint64_t bytes, const Plan& plan, double cap_s, bool curve,
                          const BenchKeys& keys, Cell& cell) {
  std::vector<char> buf(bytes, 1);
  try {
    zmq::context_t srv_ctx(2), cli_ctx(1);
    zmq::socket_t srv(srv_ctx, zmq::socket_type::router), cli(cli_ctx, zmq::socket_type::dealer);
    srv.set(zmq::sockopt::linger, 0);
    cli.set(zmq::sockopt::linger, 0);
    cli.set(zmq::sockopt::rcvtimeo, 60000);
    if (curve) {
      srv.set(zmq::sockopt::curve_server, true);
      srv.set(zmq::sockopt::curve_secretkey, keys.server.secret_key);
      ConfigureCurveClient(cli, keys.worker, keys.server.public_key);
    }
    srv.bind("tcp://127.0.0.1:*");
    cli.connect(srv.get(zmq::sockopt::last_endpoint));
    const int total = plan.warmup + plan.reps;
    std::thread server([&] {
      for (int i = 0; i < total; ++i) {
        zmq::message_t id, body;
        if (!srv.recv(id) || !srv.recv(body)) return;
        zmq::message_t ack(8);
        srv.send(id, zmq::send_flags::sndmore);
        srv.send(ack, zmq::send_flags::none);
      }
    });
    int done = 0;
    Status st = Measure(
        plan, cap_s,
        [&]() -> Status {
          zmq::message_t m(buf.data(), bytes, NoFree, nullptr);
          cli.send(m, zmq::send_flags::none);
          zmq::message_t reply;
          if (!cli.recv(reply) || reply.size() != 8) return Status::Internal("raw rr: bad reply");
          ++done;
          return Status::Ok();
        },
        cell);
    // Measure may stop early on its time cap: feed the server thread what it still waits for.
    for (; done < total; ++done) {
      zmq::message_t m(1);
      cli.send(m, zmq::send_flags::none);
      zmq::message_t reply;
      (void)cli.recv(reply);
    }
    server.join();
    ISTHMUS_RETURN_IF_ERROR(st);
  } catch (const zmq::error_t& e) {
    return Status::Internal(std::string("raw zmq rr: ") + e.what());
  }
  return Status::Ok();
}

// A ps-lite-style in-memory push, the baseline the issue names: what ps-lite's ZMQVan and a
// KVServer with a "store += pushed values" handle do with one tensor per key. The worker
// side sends a small meta frame and the values zero-copy on a DEALER (ps-lite sends meta
// and data frames with zmq_msg_init_data); the server side, on its own thread with its own
// context (2 I/O threads, as the shard), receives on a ROUTER, adds the values into its
// in-memory array in one pass on that thread (ps-lite's handle runs on the customer thread,
// no persistence, no finiteness check) and answers with a small frame; the worker waits for
// the answer (KVWorker::Wait), one push at a time. CURVE as for the shard when `curve`.
Status PsLitePush(uint64_t bytes, const Plan& plan, double cap_s, bool curve, const BenchKeys& keys,
                  Cell& cell) {
  std::vector<char> buf(bytes);
  {
    std::vector<float> d(bytes / sizeof(float), 1e-6f);
    std::memcpy(buf.data(), d.data(), bytes);
  }
  try {
    zmq::context_t srv_ctx(2), cli_ctx(1);
    zmq::socket_t srv(srv_ctx, zmq::socket_type::router), cli(cli_ctx, zmq::socket_type::dealer);
    srv.set(zmq::sockopt::linger, 0);
    cli.set(zmq::sockopt::linger, 0);
    cli.set(zmq::sockopt::rcvtimeo, 60000);
    if (curve) {
      srv.set(zmq::sockopt::curve_server, true);
      srv.set(zmq::sockopt::curve_secretkey, keys.server.secret_key);
      ConfigureCurveClient(cli, keys.worker, keys.server.public_key);
    }
    srv.bind("tcp://127.0.0.1:*");
    cli.connect(srv.get(zmq::sockopt::last_endpoint));
    const int total = plan.warmup + plan.reps;
    std::thread server([&] {
      std::vector<float> store(bytes / sizeof(float), 0.5f);
      std::vector<float> unaligned;
      for (int i = 0; i < total; ++i) {
        zmq::message_t id, meta, data;
        if (!srv.recv(id) || !srv.recv(meta)) return;
        if (meta.more() && !srv.recv(data)) return;
        const float* v = static_cast<const float*>(data.data());
        const size_t n = std::min(store.size(), data.size() / sizeof(float));
        if (reinterpret_cast<uintptr_t>(data.data()) % alignof(float) != 0) {
          unaligned.resize(n);
          std::memcpy(unaligned.data(), data.data(), n * sizeof(float));
          v = unaligned.data();
        }
        float* s = store.data();
        for (size_t k = 0; k < n; ++k) s[k] += v[k];
        zmq::message_t ack(16);
        srv.send(id, zmq::send_flags::sndmore);
        srv.send(ack, zmq::send_flags::none);
      }
    });
    int done = 0;
    Status st = Measure(
        plan, cap_s,
        [&]() -> Status {
          zmq::message_t meta(64);
          zmq::message_t m(buf.data(), bytes, NoFree, nullptr);
          cli.send(meta, zmq::send_flags::sndmore);
          cli.send(m, zmq::send_flags::none);
          zmq::message_t reply;
          if (!cli.recv(reply) || reply.size() != 16) return Status::Internal("ps-lite: bad reply");
          ++done;
          return Status::Ok();
        },
        cell);
    for (; done < total; ++done) {  // Measure may stop early: feed the server what it waits for
      zmq::message_t meta(64);
      cli.send(meta, zmq::send_flags::none);
      zmq::message_t reply;
      (void)cli.recv(reply);
    }
    server.join();
    ISTHMUS_RETURN_IF_ERROR(st);
  } catch (const zmq::error_t& e) {
    return Status::Internal(std::string("ps-lite baseline: ") + e.what());
  }
  return Status::Ok();
}

std::string JobName(uint64_t bytes) { return "size-" + std::to_string(bytes); }

// Creates one job per size (one tensor "w"), then measures pushes and, when asked, pulls.
Status MeasureServer(RunningServer& server, bool curve, bool sync, bool do_push, bool do_pull,
                     const std::vector<uint64_t>& sizes, const BenchKeys& keys, double cap_s,
                     std::vector<Cell>& cells) {
  ISTHMUS_ASSIGN_OR_RETURN(auto admin, ShardClient::Connect(server.Options(true, curve, keys)));
  ISTHMUS_ASSIGN_OR_RETURN(auto worker, ShardClient::Connect(server.Options(false, curve, keys)));
  static uint64_t key_seq = 0;
  for (uint64_t bytes : sizes) {
    const int64_t n = static_cast<int64_t>(bytes / sizeof(float));
    std::vector<float> base(n, 0.5f), delta(n, 1e-6f);
    TensorView base_view{"w", {n}, base.data()};
    TensorView delta_view{"w", {n}, delta.data()};
    ISTHMUS_RETURN_IF_ERROR(admin->CreateJob(JobName(bytes), "", {base_view}).status());
    Plan plan = PlanFor(bytes);
    if (do_push) {
      // As a worker does: the Hello says whether the job takes large pushes in parts.
      ISTHMUS_RETURN_IF_ERROR(
          worker->Hello(JobName(bytes), wire::Role::Worker, "", "bench_server").status());
      Cell cell{"push", curve, sync ? "true" : "false", bytes};
      std::string prefix =
          "bench-" + std::to_string(::getpid()) + "-" + std::to_string(bytes) + "-";
      ISTHMUS_RETURN_IF_ERROR(Measure(
          plan, cap_s,
          [&]() -> Status {
            ISTHMUS_ASSIGN_OR_RETURN(
                PushResult r, worker->Push(JobName(bytes), prefix + std::to_string(++key_seq), 1, 1,
                                           {delta_view}));
            if (r.duplicate) return Status::Internal("push was reported as a duplicate");
            return Status::Ok();
          },
          cell));
      cells.push_back(cell);
    }
    if (do_pull) {
      // "pull": PullInPlace, tensors read from the received frames. "pull-copy": Pull,
      // which copies each tensor into a Tensor's std::vector.
      Cell cell{"pull", curve, "-", bytes};
      ISTHMUS_RETURN_IF_ERROR(Measure(
          plan, cap_s,
          [&]() -> Status {
            ISTHMUS_ASSIGN_OR_RETURN(PullView r, worker->PullInPlace(JobName(bytes), {"w"}));
            if (r.tensors.size() != 1 || r.tensors[0].data.size() != static_cast<size_t>(n)) {
              return Status::Internal("pull returned the wrong tensor");
            }
            return Status::Ok();
          },
          cell));
      cells.push_back(cell);
      Cell copy_cell{"pull-copy", curve, "-", bytes};
      ISTHMUS_RETURN_IF_ERROR(Measure(
          plan, cap_s,
          [&]() -> Status {
            ISTHMUS_ASSIGN_OR_RETURN(PullResult r, worker->Pull(JobName(bytes), {"w"}));
            if (r.tensors.size() != 1 || r.tensors[0].data.size() != static_cast<size_t>(n)) {
              return Status::Internal("pull returned the wrong tensor");
            }
            return Status::Ok();
          },
          copy_cell));
      cells.push_back(copy_cell);
      // Both client paths must see the same bytes.
      ISTHMUS_ASSIGN_OR_RETURN(PullView in_place, worker->PullInPlace(JobName(bytes), {"w"}));
      ISTHMUS_ASSIGN_OR_RETURN(PullResult copied, worker->Pull(JobName(bytes), {"w"}));
      if (in_place.tensors.size() != 1 || copied.tensors.size() != 1 ||
          in_place.tensors[0].data.size() != copied.tensors[0].data.size() ||
          std::memcmp(in_place.tensors[0].data.data(), copied.tensors[0].data.data(), bytes) != 0 ||
          in_place.tensors[0].version != copied.versions[0] ||
          in_place.job_version != copied.job_version) {
        return Status::Internal("PullInPlace and Pull disagree");
      }
    }
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------
// Server-side breakdown of one push: Shard::Handle driven directly (no sockets), and the
// pieces DoPush is made of, timed one by one on the same data.

struct Part {
  std::string what;
  double ms = 0;
};

zmq::message_t HeaderFrame(const flatbuffers::FlatBufferBuilder& fbb) {
  return zmq::message_t(fbb.GetBufferPointer(), fbb.GetSize());
}

Frames JobCreateFrames(const TensorView& t, const std::string& job) {
  flatbuffers::FlatBufferBuilder fbb;
  auto metas = BuildTensorMetas(fbb, {t});
  auto body = wire::CreateJobCreate(fbb, fbb.CreateString(job), fbb.CreateString(""), metas);
  FinishEnvelope(fbb, 1, wire::Body::JobCreate, body.Union());
  Frames f;
  f.header = HeaderFrame(fbb);
  f.payload.emplace_back(t.data, NumElements(t.shape) * sizeof(float));
  return f;
}

zmq::message_t PushHeader(const TensorView& t, const std::string& job, const std::string& key) {
  flatbuffers::FlatBufferBuilder fbb;
  auto metas = BuildTensorMetas(fbb, {t});
  auto body =
      wire::CreatePushRequest(fbb, fbb.CreateString(job), fbb.CreateString(key), 1, 1, metas);
  FinishEnvelope(fbb, 2, wire::Body::PushRequest, body.Union());
  return HeaderFrame(fbb);
}

zmq::message_t PullHeader(const std::string& job) {
  flatbuffers::FlatBufferBuilder fbb;
  auto body = wire::CreatePullRequestDirect(fbb, job.c_str(), nullptr, 0);
  FinishEnvelope(fbb, 3, wire::Body::PullRequest, body.Union());
  return HeaderFrame(fbb);
}

// Median milliseconds of `reps` runs of `fn` (after one untimed run).
template <typename Fn>
double MedianMs(int reps, Fn&& fn) {
  fn();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    auto t0 = Clock::now();
    fn();
    t.push_back(Seconds(t0, Clock::now()) * 1e3);
  }
  return Median(t);
}

Result<std::vector<Part>> Breakdown(const std::string& parent, uint64_t bytes, int reps) {
  std::vector<Part> parts;
  const int64_t n = static_cast<int64_t>(bytes / sizeof(float));
  std::vector<float> base(n, 0.5f), delta(n, 1e-6f);
  TensorView base_view{"w", {n}, base.data()};
  TensorView delta_view{"w", {n}, delta.data()};
  const std::string job = "breakdown";

  struct Variant {
    std::string label;
    int store;  // 0 memory, 1 RocksDB sync, 2 RocksDB no sync
  };
  for (const Variant& v : {Variant{"Shard::Handle(push), RocksDB sync_writes=true", 1},
                           Variant{"Shard::Handle(push), RocksDB sync_writes=false", 2},
                           Variant{"Shard::Handle(push), in-memory store", 0}}) {
    ISTHMUS_ASSIGN_OR_RETURN(TempDir dir, TempDir::Make(parent, "isthmus-bench-breakdown"));
    ShardOptions opts;
    opts.shard_id = "breakdown";
    std::string db = dir.path() + "/db";
    StoreOptions so;
    so.sync_writes = v.store == 1;
    if (v.store == 0) {
      opts.open_store = []() -> Result<std::unique_ptr<Store>> { return NewMemStore(); };
    } else {
      opts.open_store = [db, so]() { return OpenRocksStore(db, so); };
    }
    ISTHMUS_ASSIGN_OR_RETURN(auto shard, Shard::Open(opts));
    Reply created = shard->Handle(wire::Role::Admin, JobCreateFrames(base_view, job));
    if (created.is_error) return Status::Internal("breakdown: job create failed");
    Frames push;
    push.payload.emplace_back(delta.data(), bytes);
    uint64_t seq = 0;
    bool failed = false;
    // Headers are built outside the timed region: only Handle() is timed.
    std::vector<double> t;
    for (int i = 0; i < reps + 1; ++i) {
      push.header = PushHeader(delta_view, job, "k" + std::to_string(++seq));
      auto t0 = Clock::now();
      Reply r = shard->Handle(wire::Role::Worker, push);
      double ms = Seconds(t0, Clock::now()) * 1e3;
      failed |= r.is_error;
      if (i > 0) t.push_back(ms);
    }
    if (failed) return Status::Internal("breakdown: a push was refused");
    parts.push_back({v.label, Median(t)});
    if (v.store == 1) {
      Frames pull;
      double ms = MedianMs(reps, [&] {
        pull.header = PullHeader(job);
        Reply r = shard->Handle(wire::Role::Worker, pull);
        failed |= r.is_error || r.payload.size() != 1;
      });
      if (failed) return Status::Internal("breakdown: a pull was refused");
      parts.push_back({"Shard::Handle(pull) (reply refers to the tensor, no copy)", ms});
    }
  }

  // The pieces of DoPush, in its order.
  volatile bool sink = false;
  flatbuffers::FlatBufferBuilder meta_fbb;
  meta_fbb.Finish(BuildTensorMetas(meta_fbb, {delta_view}));
  auto* metas = flatbuffers::GetRoot<flatbuffers::Vector<flatbuffers::Offset<wire::TensorMeta>>>(
      meta_fbb.GetBufferPointer());
  std::vector<zmq::message_t> frames;
  frames.emplace_back(delta.data(), bytes);
  parts.push_back(
      {"  ValidateTensors on the frame (check_finite=false, as DoPush)",
       MedianMs(reps, [&] { sink = ValidateTensors(metas, frames, WireLimits{}, false).ok(); })});
  double frame_copy = MedianMs(reps, [&] {
    zmq::message_t m(delta.data(), bytes);
    sink = static_cast<const char*>(m.data())[0] != 0;
  });
  // The same loop as DoPush's fused add + finiteness check, into a reused buffer.
  auto next = std::make_shared<std::vector<float>>(base);
  parts.push_back({"  out = old + delta, finiteness flags, reused buffer", MedianMs(reps, [&] {
                     constexpr int64_t kBlock = 1024;
                     uint32_t bad = 0;
                     const float* a = base.data();
                     const float* d = delta.data();
                     float* out = next->data();
                     for (int64_t i = 0; i + kBlock <= n; i += kBlock) {
                       const float* __restrict ab = a + i;
                       const float* __restrict db = d + i;
                       float* __restrict ob = out + i;
                       uint32_t flags = 0;
                       for (int64_t k = 0; k < kBlock; ++k) {
                         float sum = ab[k] + db[k];
                         ob[k] = sum;
                         uint32_t bits;
                         std::memcpy(&bits, &sum, 4);
                         flags |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
                       }
                       bad |= flags;
                     }
                     sink = bad == 0;
                   })});
  parts.push_back({"  (before) copy the old tensor into a fresh buffer", MedianMs(reps, [&] {
                     auto fresh = std::make_shared<std::vector<float>>(base);
                     sink = (*fresh)[0] != 0;
                   })});
  for (bool sync : {true, false}) {
    ISTHMUS_ASSIGN_OR_RETURN(TempDir dir, TempDir::Make(parent, "isthmus-bench-store"));
    StoreOptions so;
    so.sync_writes = sync;
    ISTHMUS_ASSIGN_OR_RETURN(auto store, OpenRocksStore(dir.path() + "/db", so));
    Status st;
    std::string_view value(reinterpret_cast<const char*>(next->data()), bytes);
    double ms = MedianMs(reps, [&] {
      WriteBatch b;
      b.Put(Column::kTensors, keys::JobKey("j", "w"), value);
      Status s = store->Write(b);
      if (!s.ok()) st = s;
    });
    ISTHMUS_RETURN_IF_ERROR(st);
    parts.push_back({std::string("  Store::Write of the tensor (slot file), sync_writes=") +
                         (sync ? "true" : "false"),
                     ms});
  }
  std::vector<float> warm(n, 0.0f);
  parts.push_back(
      {"  (for scale) memcpy of the tensor into already-touched memory", MedianMs(reps, [&] {
         std::memcpy(warm.data(), delta.data(), bytes);
         sink = warm[0] != 0;
       })});
  parts.push_back(
      {"client Pull (copying API): assign the frame into a new Tensor::data", MedianMs(reps, [&] {
         std::vector<float> t(delta.data(), delta.data() + n);
         sink = t[0] != 0;
       })});
  parts.push_back(
      {"receive-side frame allocation + copy (zmq::message_t(data, size))", frame_copy});
  return parts;
}

// ---------------------------------------------------------------------------------------
// Snapshot of a large job.

struct SnapshotFigures {
  bool skipped = false;
  std::string skip_reason;
  uint64_t job_bytes = 0;
  int tensors = 0, jobs = 0;
  double create_job_s = 0;
  double snapshot1_s = 0, snapshot2_s = 0;
  uint64_t reported_bytes = 0;  // SnapshotInfo.bytes (the server's own count)
  uint64_t file_bytes = 0;      // sum of file sizes in the snapshot folder
  uint64_t shared_bytes = 0;    // of which in files hard-linked with the live database
  uint64_t live_db_bytes = 0;
};

// Sums file sizes under `dir`; `shared` gets those of files with more than one link.
uint64_t DirBytes(const fs::path& dir, uint64_t* shared) {
  uint64_t total = 0;
  std::error_code ec;
  for (const auto& e : fs::recursive_directory_iterator(dir, ec)) {
    struct stat st;
    if (::lstat(e.path().c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    total += st.st_size;
    if (shared != nullptr && st.st_nlink > 1) *shared += st.st_size;
  }
  return total;
}

Result<SnapshotFigures> MeasureSnapshot(const std::string& parent, uint64_t total_bytes, bool curve,
                                        const BenchKeys& keys) {
  SnapshotFigures f;
  std::error_code ec;
  auto space = fs::space(parent, ec);
  if (ec) return Status::IoError("cannot read free space of '" + parent + "': " + ec.message());
  if (space.available < 5 * kGiB) {
    f.skipped = true;
    f.skip_reason = "only " + std::to_string(space.available / kMiB) + " MiB free under '" +
                    parent + "' (needs 5 GiB)";
    return f;
  }
  ISTHMUS_ASSIGN_OR_RETURN(auto server, RunningServer::Start(parent, curve, true, keys));
  ISTHMUS_ASSIGN_OR_RETURN(auto admin, ShardClient::Connect(server->Options(true, curve, keys)));
  const uint64_t tensor_bytes = std::min<uint64_t>(64 * kMiB, total_bytes);
  const int count = static_cast<int>(total_bytes / tensor_bytes);
  const int64_t n = static_cast<int64_t>(tensor_bytes / sizeof(float));
  // One buffer of random values serves as every tensor's data (views only read it).
  std::vector<float> data(n);
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 0.02f);
  for (auto& x : data) x = dist(rng);
  // As many tensors per CreateJob as the server's message limit allows; more jobs if not.
  const uint64_t limit = static_cast<uint64_t>(server->config().max_message_bytes);
  std::vector<std::vector<TensorView>> groups(1);
  uint64_t in_group = 0;
  for (int i = 0; i < count; ++i) {
    if (in_group + tensor_bytes > limit) {
      groups.emplace_back();
      in_group = 0;
    }
    groups.back().push_back({"h." + std::to_string(i) + ".w", {n}, data.data()});
    in_group += tensor_bytes;
  }
  auto t0 = Clock::now();
  for (size_t g = 0; g < groups.size(); ++g) {
    ISTHMUS_RETURN_IF_ERROR(admin->CreateJob("big" + std::to_string(g), "", groups[g]).status());
  }
  f.create_job_s = Seconds(t0, Clock::now());
  f.job_bytes = tensor_bytes * count;
  f.tensors = count;
  f.jobs = static_cast<int>(groups.size());

  t0 = Clock::now();
  ISTHMUS_ASSIGN_OR_RETURN(SnapshotInfo info, admin->CreateSnapshot("bench-1"));
  f.snapshot1_s = Seconds(t0, Clock::now());
  t0 = Clock::now();
  ISTHMUS_RETURN_IF_ERROR(admin->CreateSnapshot("bench-2").status());
  f.snapshot2_s = Seconds(t0, Clock::now());
  f.reported_bytes = info.bytes;
  f.file_bytes = DirBytes(fs::path(SnapshotDir(server->data_dir())) / "bench-1", &f.shared_bytes);
  f.live_db_bytes = DirBytes(LiveDbDir(server->data_dir()), nullptr);
  return f;
}

// ---------------------------------------------------------------------------------------
// The round boundary of a full-model job: two sites, one shard each, peered over loopback.

struct RoundFigures {
  uint64_t values = 0;  // per site and round
  int tensors = 0, rounds = 0;
  double create_s = 0;
  // Per counted round (the first is left out as warm-up), the worse of the two sites:
  std::vector<double> push_s;    // the push's request/reply
  std::vector<double> commit_s;  // push sent -> the round committed on both shards
  std::vector<double> pull_s;    // PullInPlace of the committed state after the commit
};

// The byte-level GPT at GPT-2-small's shape that docs/BENCHMARKS.md section 7 runs in full
// mode (vocabulary 256, context 128, 12 layers of width 768): 85,350,912 values.
std::vector<std::pair<std::string, std::vector<int64_t>>> FullModelShapes(int layers) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> t;
  const int64_t d = 768;
  t.push_back({"wte", {256, d}});
  t.push_back({"wpe", {128, d}});
  for (int l = 0; l < layers; ++l) {
    const std::string h = "h." + std::to_string(l) + ".";
    t.push_back({h + "ln_1.weight", {d}});
    t.push_back({h + "ln_1.bias", {d}});
    t.push_back({h + "attn.c_attn.weight", {d, 3 * d}});
    t.push_back({h + "attn.c_attn.bias", {3 * d}});
    t.push_back({h + "attn.c_proj.weight", {d, d}});
    t.push_back({h + "attn.c_proj.bias", {d}});
    t.push_back({h + "ln_2.weight", {d}});
    t.push_back({h + "ln_2.bias", {d}});
    t.push_back({h + "mlp.c_fc.weight", {d, 4 * d}});
    t.push_back({h + "mlp.c_fc.bias", {4 * d}});
    t.push_back({h + "mlp.c_proj.weight", {4 * d, d}});
    t.push_back({h + "mlp.c_proj.bias", {d}});
  }
  t.push_back({"ln_f.weight", {d}});
  t.push_back({"ln_f.bias", {d}});
  return t;
}

// Two shards (sites alpha and beta, CURVE peer link over loopback, storage.sync_writes and
// every sync setting at its default: topk:0.05+int2+zstd, K = 2) hold the same full-model
// job. Each round, two threads push each site's round delta at the same time (as two sites'
// workers would), then the program waits until both shards report the round committed, then
// both pull. Between rounds nothing waits: this is the boundary's cost alone.
Result<RoundFigures> MeasureRounds(const std::string& parent, int layers, int rounds,
                                   const BenchKeys& keys,
                                   const std::map<std::string, std::string>& settings,
                                   bool serial_pushes) {
  RoundFigures f;
  ISTHMUS_ASSIGN_OR_RETURN(TempDir key_dir, TempDir::Make(parent, "isthmus-bench-round-keys"));
  ISTHMUS_ASSIGN_OR_RETURN(KeyPair beta_key, GenerateKeyPair());
  ISTHMUS_RETURN_IF_ERROR(WriteKeyPairFiles(key_dir.path() + "/beta", beta_key, false));
  ISTHMUS_RETURN_IF_ERROR(WriteKeyPairFiles(key_dir.path() + "/alpha", keys.server, false));
  ISTHMUS_ASSIGN_OR_RETURN(int alpha_peer, FreePort());
  ISTHMUS_ASSIGN_OR_RETURN(int beta_peer, FreePort());
  auto ep = [](int port) { return "tcp://127.0.0.1:" + std::to_string(port); };
  std::map<std::string, std::string> alpha_cfg = {
      {"shard.id", "alpha-0"},
      {"sync.site", "alpha"},
      {"listen.peer", ep(alpha_peer)},
      {"sync.peers", "beta=" + ep(beta_peer) + "=" + key_dir.path() + "/beta.pub"},
      {"security.peer_keys", key_dir.path() + "/beta.pub"},
      {"log.level", "warn"}};
  std::map<std::string, std::string> beta_cfg = {
      {"shard.id", "beta-0"},
      {"sync.site", "beta"},
      {"listen.peer", ep(beta_peer)},
      {"sync.peers", "alpha=" + ep(alpha_peer) + "=" + key_dir.path() + "/alpha.pub"},
      {"security.peer_keys", key_dir.path() + "/alpha.pub"},
      {"security.secret_key", key_dir.path() + "/beta.key"},
      {"log.level", "warn"}};
  for (const auto& [k, v] : settings) alpha_cfg[k] = beta_cfg[k] = v;
  ISTHMUS_ASSIGN_OR_RETURN(auto alpha, RunningServer::Start(parent, true, true, keys, alpha_cfg));
  ISTHMUS_ASSIGN_OR_RETURN(auto beta, RunningServer::Start(parent, true, true, keys, beta_cfg));
  RunningServer* servers[2] = {alpha.get(), beta.get()};
  const std::string server_keys[2] = {keys.server.public_key, beta_key.public_key};
  std::unique_ptr<ShardClient> admin[2], worker[2];
  for (int i = 0; i < 2; ++i) {
    auto o = servers[i]->Options(true, true, keys, server_keys[i]);
    o.timeout_ms = 600000;
    ISTHMUS_ASSIGN_OR_RETURN(admin[i], ShardClient::Connect(o));
    o = servers[i]->Options(false, true, keys, server_keys[i]);
    o.timeout_ms = 600000;
    ISTHMUS_ASSIGN_OR_RETURN(worker[i], ShardClient::Connect(o));
  }
  const auto shapes = FullModelShapes(layers);
  std::vector<std::vector<float>> init(shapes.size());
  std::vector<std::vector<std::vector<float>>> delta(
      2, std::vector<std::vector<float>>(shapes.size()));
  std::mt19937 rng(11);
  std::normal_distribution<float> w0(0.0f, 0.02f), dd(0.0f, 1e-3f);
  std::vector<TensorView> init_views, delta_views[2];
  for (size_t t = 0; t < shapes.size(); ++t) {
    const size_t n = static_cast<size_t>(NumElements(shapes[t].second));
    f.values += n;
    init[t].resize(n);
    for (auto& x : init[t]) x = w0(rng);
    init_views.push_back({shapes[t].first, shapes[t].second, init[t].data()});
    for (int i = 0; i < 2; ++i) {
      delta[i][t].resize(n);
      for (auto& x : delta[i][t]) x = dd(rng);
      delta_views[i].push_back({shapes[t].first, shapes[t].second, delta[i][t].data()});
    }
  }
  f.tensors = static_cast<int>(shapes.size());
  auto t0 = Clock::now();
  for (int i = 0; i < 2; ++i) {
    ISTHMUS_RETURN_IF_ERROR(admin[i]->CreateJob("full", "", init_views).status());
  }
  f.create_s = Seconds(t0, Clock::now());
  for (auto& w : worker) {  // as a worker starts: the Hello says how the shard takes pushes
    ISTHMUS_RETURN_IF_ERROR(w->Hello("full", wire::Role::Worker, "", "b").status());
  }
  for (int r = 1; r <= rounds; ++r) {
    double push_s[2] = {0, 0};
    Status push_status[2];
    const auto start = Clock::now();
    std::thread pushers[2];
    for (int i = 0; i < 2; ++i) {
      pushers[i] = std::thread([&, i] {
        const auto p0 = Clock::now();
        auto res = worker[i]->Push("full", "round-" + std::to_string(r), static_cast<uint64_t>(r),
                                   1000, delta_views[i], 3000);
        push_s[i] = Seconds(p0, Clock::now());
        push_status[i] = res.status();
      });
      if (serial_pushes) pushers[i].join();
    }
    for (auto& th : pushers) {
      if (th.joinable()) th.join();
    }
    for (const auto& st : push_status) ISTHMUS_RETURN_IF_ERROR(st);
    for (int i = 0; i < 2; ++i) {
      for (;;) {
        ISTHMUS_ASSIGN_OR_RETURN(HelloInfo h,
                                 worker[i]->Hello("full", wire::Role::Worker, "", "b"));
        if (h.rounds.committed_round >= static_cast<uint64_t>(r)) break;
        if (Seconds(start, Clock::now()) > 600) return Status::Timeout("round never committed");
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
    const double commit = Seconds(start, Clock::now());
    double pull = 0;
    for (int i = 0; i < 2; ++i) {
      const auto p0 = Clock::now();
      ISTHMUS_ASSIGN_OR_RETURN(PullView v, worker[i]->PullInPlace("full"));
      if (v.tensors.size() != shapes.size()) return Status::Internal("pull: wrong tensor count");
      pull = std::max(pull, Seconds(p0, Clock::now()));
    }
    std::printf("  round %d: push %.2f / %.2f s, committed on both after %.2f s, pull %.2f s\n", r,
                push_s[0], push_s[1], commit, pull);
    std::fflush(stdout);
    if (r == 1) continue;  // warm-up: first allocations, first handshake
    f.push_s.push_back(std::max(push_s[0], push_s[1]));
    f.commit_s.push_back(commit);
    f.pull_s.push_back(pull);
  }
  f.rounds = static_cast<int>(f.push_s.size());
  return f;
}

// ---------------------------------------------------------------------------------------
// Output.

std::string ReadFirstLine(const std::string& path, const std::string& prefix = "") {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (prefix.empty()) return line;
    if (line.rfind(prefix, 0) == 0) {
      auto p = line.find(':');
      return p == std::string::npos ? line : line.substr(p + 2);
    }
  }
  return "?";
}

const Cell* Find(const std::vector<Cell>& cells, const std::string& op, bool curve,
                 const std::string& sync, uint64_t bytes) {
  for (const auto& c : cells) {
    if (c.op == op && c.curve == curve && c.sync == sync && c.bytes == bytes) return &c;
  }
  return nullptr;
}

std::string Pct(double num, double den) {
  if (den <= 0) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.0f%%", 100.0 * num / den);
  return buf;
}

int Main(int argc, char** argv) {
  CLI::App app{
      "bench_server: shard push/pull throughput over loopback vs raw ZeroMQ, the server-side\n"
      "cost of a push, and snapshot time/size of a large job. Runs a shard in-process; talks\n"
      "only to 127.0.0.1. MB/s = 10^6 bytes per second."};
  std::vector<std::string> size_args = {"4K", "64K", "1M", "16M", "64M"};
  std::string curve_arg = "both", json_path, dir = fs::temp_directory_path().string();
  std::vector<std::string> modes = {"raw", "pslite", "push", "pull", "breakdown", "snapshot"};
  double cap_s = 1.2;
  std::string breakdown_size = "64M", snapshot_size = "1G";
  int breakdown_reps = 5;
  int round_layers = 12, rounds = 5;
  app.add_option("--sizes", size_args, "tensor sizes (4K, 64K, 1M, ...)")->delimiter(',');
  app.add_option("--curve", curve_arg, "off, on or both")
      ->check(CLI::IsMember({"off", "on", "both"}));
  app.add_option("--modes", modes, "any of raw,pslite,push,pull,breakdown,snapshot,round")
      ->delimiter(',')
      ->check(CLI::IsMember({"raw", "pslite", "push", "pull", "breakdown", "snapshot", "round"}));
  app.add_option("--cell-seconds", cap_s, "time cap of one measured cell (at least 3 ops run)");
  app.add_option("--breakdown-size", breakdown_size, "tensor size of the server-side breakdown");
  app.add_option("--breakdown-reps", breakdown_reps, "runs per breakdown item (median)");
  app.add_option("--snapshot-size", snapshot_size, "total size of the snapshotted job");
  app.add_option("--round-layers", round_layers,
                 "round mode: transformer layers of the full-model job (12: 85.35 M values)")
      ->check(CLI::Range(1, 48));
  app.add_option("--rounds", rounds, "round mode: rounds to run (the first is not counted)")
      ->check(CLI::Range(2, 100));
  bool serial_pushes = false;
  app.add_flag("--round-serial-pushes", serial_pushes,
               "round mode: the two sites push one after the other (each push timed alone, as "
               "on sites with hosts of their own), not at the same time");
  app.add_option("--dir", dir, "parent folder for the shard data (needs 5 GiB free for snapshot)");
  app.add_option("--json", json_path, "also write the results as JSON to this file (- = stdout)");
  std::vector<std::string> setting_args;
  app.add_option(
      "--setting", setting_args,
      "KEY=VALUE: a setting of the shards that push, pull and round measure, over the bench's "
      "own (repeatable; e.g. storage.direct_writes=false)");
  CLI11_PARSE(app, argc, argv);
  std::map<std::string, std::string> settings;
  for (const auto& kv : setting_args) {
    const auto eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) {
      std::fprintf(stderr, "bench_server: --setting wants KEY=VALUE, got '%s'\n", kv.c_str());
      return 2;
    }
    settings[kv.substr(0, eq)] = kv.substr(eq + 1);
  }

  auto has_mode = [&](const char* m) {
    return std::find(modes.begin(), modes.end(), m) != modes.end();
  };
  std::vector<uint64_t> sizes;
  for (const auto& s : size_args) {
    auto v = ParseSize(s);
    if (!v.ok()) {
      std::fprintf(stderr, "%s\n", v.status().ToString().c_str());
      return 2;
    }
    sizes.push_back(*v);
  }
  auto bd_bytes = ParseSize(breakdown_size);
  auto snap_bytes = ParseSize(snapshot_size);
  if (!bd_bytes.ok() || !snap_bytes.ok()) {
    std::fprintf(stderr, "bad --breakdown-size or --snapshot-size\n");
    return 2;
  }
  std::vector<bool> curves;
  if (curve_arg != "on") curves.push_back(false);
  if (curve_arg != "off") curves.push_back(true);
  spdlog::set_level(spdlog::level::err);

  auto fail = [](const std::string& what, const Status& s) {
    std::fprintf(stderr, "bench_server: %s: %s\n", what.c_str(), s.ToString().c_str());
    return 1;
  };
  auto key_dir = TempDir::Make(dir, "isthmus-bench-keys");
  if (!key_dir.ok()) return fail("keys", key_dir.status());
  auto keys = MakeKeys(key_dir->path());
  if (!keys.ok()) return fail("keys", keys.status());

  int major = 0, minor = 0, patch = 0;
  zmq_version(&major, &minor, &patch);
  const long nproc = ::sysconf(_SC_NPROCESSORS_ONLN);
  const std::string cpu = ReadFirstLine("/proc/cpuinfo", "model name");
  const std::string load_before = ReadFirstLine("/proc/loadavg");
  std::printf("bench_server: isthmus shard over tcp://127.0.0.1, shard in-process\n");
  std::printf("machine: nproc=%ld, cpu: %s, loadavg at start: %s\n", nproc, cpu.c_str(),
              load_before.c_str());
  std::printf(
      "libzmq %d.%d.%d; server runtime.io_threads=2 (default), client 1 I/O thread; "
      "storage.dedup_window default; data under %s\n",
      major, minor, patch, dir.c_str());
  std::printf(
      "each cell: warm-up, then up to N ops (more for small sizes), stopped after "
      "%.1f s (>= 3 ops); push/pull MB/s = bytes x ops / total time of the "
      "request/reply calls, one at a time\n",
      cap_s);
  std::printf(
      "raw-zmq: the same N messages of the same size, PUSH->PULL, zero-copy sends, "
      "streamed (not request/reply); CURVE on = curve_server on the PULL side\n");
  std::printf(
      "raw-rr: DEALER->ROUTER, the message then an 8-byte reply, one at a time (a push's "
      "transport with no server work); %%raw columns compare with raw-zmq\n");
  std::printf(
      "push: ShardClient::Push after a Hello, as a worker pushes: in parts of the shard's "
      "storage.push_part_bytes (1 MiB unless --setting says otherwise) when the tensor has "
      "twice that or more\n");
  std::printf(
      "ps-lite: a ps-lite-style in-memory push (meta + values frames, ROUTER thread adds them "
      "into an in-memory array, small reply; no persistence); 'x ps-lite' = push MB/s / ps-lite "
      "MB/s, same size and CURVE setting\n");
  std::printf(
      "pull: ShardClient::PullInPlace (tensors read in the received frames); pull-copy: "
      "ShardClient::Pull (copies into Tensor::data)\n\n");
  std::fflush(stdout);

  auto started = Clock::now();
  std::vector<Cell> cells;
  for (bool curve : curves) {
    if (has_mode("raw")) {
      for (uint64_t b : sizes) {
        Cell cell{"raw-zmq", curve, "-", b};
        Status s = RawZmqStream(b, PlanFor(b), curve, *keys, cell);
        if (!s.ok()) return fail("raw zmq", s);
        cells.push_back(cell);
        Cell rr{"raw-rr", curve, "-", b};
        s = RawZmqRequestReply(b, PlanFor(b), cap_s, curve, *keys, rr);
        if (!s.ok()) return fail("raw zmq request/reply", s);
        cells.push_back(rr);
      }
    }
    if (has_mode("pslite")) {
      for (uint64_t b : sizes) {
        Cell cell{"ps-lite", curve, "-", b};
        Status s = PsLitePush(b, PlanFor(b), cap_s, curve, *keys, cell);
        if (!s.ok()) return fail("ps-lite baseline", s);
        cells.push_back(cell);
      }
    }
    for (bool sync : {true, false}) {
      bool do_push = has_mode("push");
      bool do_pull = has_mode("pull") && sync;  // pulls do not depend on fsync
      if (!do_push && !do_pull) continue;
      auto server = RunningServer::Start(dir, curve, sync, *keys, settings);
      if (!server.ok()) return fail("start server", server.status());
      Status s = MeasureServer(**server, curve, sync, do_push, do_pull, sizes, *keys, cap_s, cells);
      if (!s.ok()) return fail("server measurement", s);
    }
  }
  double throughput_s = Seconds(started, Clock::now());

  // The table.
  std::printf("%-9s %-5s %-5s %8s %6s %10s %9s %9s %9s %9s\n", "op", "curve", "sync", "size", "ops",
              "median ms", "MB/s", "%raw off", "%raw on", "x ps-lite");
  std::string last_key;
  for (bool curve : curves) {
    for (uint64_t b : sizes) {
      const Cell* raw_off = Find(cells, "raw-zmq", false, "-", b);
      const Cell* raw_on = Find(cells, "raw-zmq", true, "-", b);
      const Cell* pslite = Find(cells, "ps-lite", curve, "-", b);
      for (const auto& [op, sync] :
           std::vector<std::pair<std::string, std::string>>{{"raw-zmq", "-"},
                                                            {"raw-rr", "-"},
                                                            {"ps-lite", "-"},
                                                            {"push", "true"},
                                                            {"push", "false"},
                                                            {"pull", "-"},
                                                            {"pull-copy", "-"}}) {
        const Cell* c = Find(cells, op, curve, sync, b);
        if (c == nullptr) continue;
        std::string off = raw_off ? Pct(c->MBps(), raw_off->MBps()) : "-";
        std::string on = curve && raw_on ? Pct(c->MBps(), raw_on->MBps()) : "-";
        std::string vs = "-";
        if (op == "push" && pslite != nullptr && pslite->MBps() > 0) {
          char buf[32];
          std::snprintf(buf, sizeof buf, "%.2fx", c->MBps() / pslite->MBps());
          vs = buf;
        }
        std::printf("%-9s %-5s %-5s %8s %6d %10.3f %9.1f %9s %9s %9s\n", op.c_str(),
                    curve ? "on" : "off", sync.c_str(), SizeLabel(b).c_str(), c->reps, c->median_ms,
                    c->MBps(), off.c_str(), on.c_str(), vs.c_str());
      }
    }
    std::printf("\n");
  }
  std::printf("(throughput section: %.1f s)\n", throughput_s);

  // The target.
  json target;
  {
    const uint64_t b = 64 * kMiB;
    const Cell* raw = Find(cells, "raw-zmq", false, "-", b);
    const Cell* push = Find(cells, "push", false, "true", b);
    const Cell* push_ns = Find(cells, "push", false, "false", b);
    const Cell* pull = Find(cells, "pull", false, "-", b);
    if (raw && push && pull) {
      double rp = push->MBps() / raw->MBps(), rl = pull->MBps() / raw->MBps();
      double rn = push_ns ? push_ns->MBps() / raw->MBps() : 0;
      bool met = rp >= 0.8 && rl >= 0.8;
      std::printf(
          "target (CURVE off, 64 MiB, push and pull >= 80%% of raw ZeroMQ): push "
          "sync=true %.0f%%, push sync=false %.0f%%, pull %.0f%% -> %s\n\n",
          100 * rp, 100 * rn, 100 * rl, met ? "MET" : "NOT MET");
      target = {
          {"push_sync_ratio", rp}, {"push_nosync_ratio", rn}, {"pull_ratio", rl}, {"met", met}};
    } else {
      std::printf("target: not evaluated (needs raw, push and pull at 64M with CURVE off)\n\n");
    }
  }
  // Issue 22's targets against the ps-lite-style baseline: push >= 1.5x its throughput
  // without fsync, >= 1.0x with it.
  json vs_pslite = json::array();
  for (bool curve : curves) {
    for (uint64_t b : sizes) {
      const Cell* base = Find(cells, "ps-lite", curve, "-", b);
      const Cell* ns = Find(cells, "push", curve, "false", b);
      const Cell* fs = Find(cells, "push", curve, "true", b);
      if (!base || !ns || !fs || base->MBps() <= 0) continue;
      const double rn = ns->MBps() / base->MBps(), rf = fs->MBps() / base->MBps();
      std::printf(
          "vs ps-lite (CURVE %s, %s): push sync=false %.2fx (target 1.5x: %s), sync=true %.2fx "
          "(target 1.0x: %s)\n",
          curve ? "on" : "off", SizeLabel(b).c_str(), rn, rn >= 1.5 ? "met" : "not met", rf,
          rf >= 1.0 ? "met" : "not met");
      json row = {
          {"curve", curve}, {"bytes", b}, {"push_nosync_ratio", rn}, {"push_sync_ratio", rf}};
      // The transport's ceiling for one message: raw-rr moves the same message and a small
      // reply with no server work at all, so no push sent whole can beat it. A push in parts
      // (storage.push_part_bytes) overlaps the sender's encryption, the transfer, the
      // receiver's decryption and the shard's work, and can.
      if (const Cell* rr = Find(cells, "raw-rr", curve, "-", b); rr && rr->MBps() > 0) {
        const double ceiling = rr->MBps() / base->MBps();
        std::printf(
            "  ceiling (CURVE %s, %s): one message and its reply alone (raw-rr, no server "
            "work) is %.2fx ps-lite, the most a push sent whole can reach\n",
            curve ? "on" : "off", SizeLabel(b).c_str(), ceiling);
        row["transport_ceiling_ratio"] = ceiling;
      }
      vs_pslite.push_back(std::move(row));
    }
  }
  std::printf("\n");
  std::fflush(stdout);

  json breakdown = json::array();
  if (has_mode("breakdown")) {
    std::printf(
        "server-side breakdown of one %s push/pull, in-process (Shard::Handle, no "
        "sockets), median of %d:\n",
        SizeLabel(*bd_bytes).c_str(), breakdown_reps);
    auto parts = Breakdown(dir, *bd_bytes, breakdown_reps);
    if (!parts.ok()) return fail("breakdown", parts.status());
    for (const auto& p : *parts) {
      std::printf("  %-68s %9.1f ms\n", p.what.c_str(), p.ms);
      breakdown.push_back({{"what", p.what}, {"ms", p.ms}});
    }
    std::printf("\n");
    std::fflush(stdout);
  }

  json snapshot;
  if (has_mode("snapshot")) {
    bool curve = curves.back();
    auto f = MeasureSnapshot(dir, *snap_bytes, curve, *keys);
    if (!f.ok()) return fail("snapshot", f.status());
    if (f->skipped) {
      std::printf("snapshot: SKIPPED: %s\n", f->skip_reason.c_str());
      snapshot = {{"skipped", true}, {"reason", f->skip_reason}};
    } else {
      std::printf(
          "snapshot of a %s job (%d tensors of %s in %d CreateJob call(s)), CURVE %s, "
          "sync_writes=true:\n",
          SizeLabel(f->job_bytes).c_str(), f->tensors, SizeLabel(f->job_bytes / f->tensors).c_str(),
          f->jobs, curve ? "on" : "off");
      std::printf("  CreateJob over the admin socket      %8.2f s\n", f->create_job_s);
      std::printf("  CreateSnapshot (first, flushes)      %8.2f s\n", f->snapshot1_s);
      std::printf("  CreateSnapshot (second, no changes)  %8.2f s\n", f->snapshot2_s);
      std::printf(
          "  snapshot size: %.1f MiB in files (server reports %.1f MiB); %.1f MiB of it "
          "hard-linked with the live db (%.1f MiB)\n\n",
          f->file_bytes / double(kMiB), f->reported_bytes / double(kMiB),
          f->shared_bytes / double(kMiB), f->live_db_bytes / double(kMiB));
      snapshot = {{"job_bytes", f->job_bytes},
                  {"tensors", f->tensors},
                  {"create_jobs", f->jobs},
                  {"curve", curve},
                  {"create_job_s", f->create_job_s},
                  {"snapshot_first_s", f->snapshot1_s},
                  {"snapshot_second_s", f->snapshot2_s},
                  {"snapshot_file_bytes", f->file_bytes},
                  {"snapshot_reported_bytes", f->reported_bytes},
                  {"snapshot_hardlinked_bytes", f->shared_bytes},
                  {"live_db_bytes", f->live_db_bytes}};
    }
  }
  json round;
  if (has_mode("round")) {
    std::printf(
        "round boundary of a full-model job: 2 sites x 1 shard, CURVE peer link over loopback, "
        "sync_writes=true, default sync settings; %d layers, %d rounds (the first not counted), "
        "pushes %s:\n",
        round_layers, rounds, serial_pushes ? "one after the other" : "at the same time");
    std::fflush(stdout);
    auto f = MeasureRounds(dir, round_layers, rounds, *keys, settings, serial_pushes);
    if (!f.ok()) return fail("round", f.status());
    auto stats = [](const std::vector<double>& v) {
      auto sorted = v;
      std::sort(sorted.begin(), sorted.end());
      return std::array<double, 3>{sorted.front(), Median(v), sorted.back()};
    };
    const auto push = stats(f->push_s), commit = stats(f->commit_s), pull = stats(f->pull_s);
    std::printf(
        "  %llu values (%.1f MB fp32) in %d tensors per site and round; CreateJob %.1f s for "
        "both\n",
        static_cast<unsigned long long>(f->values), f->values * 4 / 1e6, f->tensors, f->create_s);
    std::printf("  push (acknowledged)          median %6.2f s (min %.2f, max %.2f)\n", push[1],
                push[0], push[2]);
    std::printf("  push -> committed on both    median %6.2f s (min %.2f, max %.2f)\n", commit[1],
                commit[0], commit[2]);
    std::printf("  pull after the commit        median %6.2f s (min %.2f, max %.2f)\n\n", pull[1],
                pull[0], pull[2]);
    round = {{"values", f->values},         {"tensors", f->tensors},       {"layers", round_layers},
             {"rounds_counted", f->rounds}, {"create_job_s", f->create_s}, {"push_s", f->push_s},
             {"commit_s", f->commit_s},     {"pull_s", f->pull_s}};
  }

  double total_s = Seconds(started, Clock::now());
  std::printf("total %.1f s; loadavg at end: %s\n", total_s,
              ReadFirstLine("/proc/loadavg").c_str());

  if (!json_path.empty()) {
    json out;
    out["machine"] = {{"nproc", nproc},
                      {"cpu", cpu},
                      {"loadavg_start", load_before},
                      {"loadavg_end", ReadFirstLine("/proc/loadavg")}};
    out["settings"] = {{"libzmq", std::to_string(major) + "." + std::to_string(minor) + "." +
                                      std::to_string(patch)},
                       {"cell_seconds", cap_s},
                       {"server_io_threads", 2},
                       {"client_io_threads", 1}};
    json jc = json::array();
    for (const auto& c : cells) {
      jc.push_back({{"op", c.op},
                    {"curve", c.curve},
                    {"sync", c.sync},
                    {"bytes", c.bytes},
                    {"ops", c.reps},
                    {"seconds", c.seconds},
                    {"median_ms", c.median_ms},
                    {"MBps", c.MBps()}});
    }
    out["cells"] = jc;
    out["target_64MiB_curve_off"] = target;
    out["breakdown"] = breakdown;
    out["snapshot"] = snapshot;
    out["vs_pslite"] = vs_pslite;
    out["round"] = round;
    out["total_s"] = total_s;
    if (json_path == "-") {
      std::cout << out.dump(2) << "\n";
    } else {
      std::ofstream f(json_path);
      f << out.dump(2) << "\n";
      if (!f) return fail("json", Status::IoError("cannot write '" + json_path + "'"));
    }
  }
  return 0;
}

}  // namespace
}  // namespace isthmus::bench

int main(int argc, char** argv) { return isthmus::bench::Main(argc, argv); }
