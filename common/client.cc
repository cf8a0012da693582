// Request/reply over a DEALER socket with timeouts, retries, zero-copy payloads, and a
// socket monitor that follows the connection: a refused CURVE handshake becomes
// PermissionDenied at once, and a shard that cannot be reached (or drops the connection)
// ends the attempt without waiting for the reply timeout.
#include "common/client.h"

#include <spdlog/spdlog.h>
#include <zmq.h>

#include <cerrno>
#include <cstring>
#include "common/transport.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <random>

namespace isthmus {
namespace {

// Counts payload frames ZeroMQ still holds; Wait() returns when it has released them all.
class ReleaseLatch {
 public:
  std::shared_ptr<const void> Token() {
    std::lock_guard lk(mu_);
    ++outstanding_;
    return std::shared_ptr<const void>(this, [](const void* p) {
      auto* self = const_cast<ReleaseLatch*>(static_cast<const ReleaseLatch*>(p));
      std::lock_guard lk(self->mu_);
      if (--self->outstanding_ == 0) self->cv_.notify_all();
    });
  }
  void Wait() {
    std::unique_lock lk(mu_);
    cv_.wait(lk, [this] { return outstanding_ == 0; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int outstanding_ = 0;  // GUARDED_BY(mu_)
};

JobInfo JobFromSummary(const wire::JobSummary* s) {
  JobInfo j;
  if (s->job()) j.job = s->job()->str();
  j.version = s->version();
  j.tensor_count = s->tensor_count();
  j.total_bytes = s->total_bytes();
  j.pushes = s->pushes();
  j.duplicate_pushes = s->duplicate_pushes();
  return j;
}

SnapshotInfo SnapshotFromWire(const wire::SnapshotInfo* s) {
  SnapshotInfo info;
  if (s == nullptr) return info;
  if (s->name()) info.name = s->name()->str();
  info.created_unix = s->created_unix();
  info.bytes = s->bytes();
  if (s->jobs()) {
    for (const auto* j : *s->jobs()) info.jobs.push_back(JobFromSummary(j));
  }
  return info;
}

// The bytes a tensor's payload frame carries: its floats, or the codec's bytes.
std::span<const char> PayloadOf(const TensorView& t) {
  if (t.encoded) return {t.encoded->data(), t.encoded->size()};
  return {reinterpret_cast<const char*>(t.data),
          static_cast<size_t>(NumElements(t.shape)) * sizeof(float)};
}
}  // namespace

Status CheckTensorViews(const std::vector<TensorView>& tensors) {
  for (const auto& t : tensors) {
    if (t.name.empty()) return Status::InvalidArgument("a tensor has an empty name");
    const int64_t numel = NumElements(t.shape);
    if (numel < 0) {
      return Status::InvalidArgument("tensor '" + t.name + "' has a negative or huge shape");
    }
    if (t.encoded ? t.encoded->empty() : numel > 0 && t.data == nullptr) {
      return Status::InvalidArgument("tensor '" + t.name + "' has no data");
    }
  }
  return Status::Ok();
}

flatbuffers::Offset<flatbuffers::Vector<flatbuffers::Offset<wire::TensorMeta>>> BuildTensorMetas(
    flatbuffers::FlatBufferBuilder& fbb, const std::vector<TensorView>& tensors) {
  std::vector<flatbuffers::Offset<wire::TensorMeta>> metas;
  metas.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    metas.push_back(wire::CreateTensorMetaDirect(fbb, t.name.c_str(), &t.shape,
                                                 t.encoded ? wire::DType::Codec : wire::DType::F32,
                                                 static_cast<uint32_t>(i), PayloadOf(t).size(), 0));
  }
  return fbb.CreateVector(metas);
}

ShardClient::ShardClient(const ClientOptions& options)
    : options_(options), ctx_(1), request_seq_(std::random_device{}() * uint64_t{0x9E3779B9}) {}

ShardClient::~ShardClient() {
  CloseSocket();
  ctx_.close();
}

void ShardClient::CloseSocket() {
  if (socket_) zmq_socket_monitor(socket_->handle(), nullptr, 0);
  monitor_.reset();
  socket_.reset();
  ready_ = false;
  tcp_connected_ = false;
}

Result<std::unique_ptr<ShardClient>> ShardClient::Connect(const ClientOptions& options) {
  if (options.endpoint.empty()) return Status::InvalidArgument("no server endpoint given");
  if (options.timeout_ms <= 0 || options.connect_timeout_ms <= 0) {
    return Status::InvalidArgument("timeout_ms and connect_timeout_ms must be positive (got " +
                                   std::to_string(options.timeout_ms) + " and " +
                                   std::to_string(options.connect_timeout_ms) + ")");
  }
  std::vector<std::string> server_keys;
  if (!options.insecure_plaintext) {
    if (!options.server_key_file.empty()) {
      ISTHMUS_ASSIGN_OR_RETURN(server_keys, LoadPublicKeyList(options.server_key_file));
    }
    if (!options.server_public_key.empty() &&
        std::find(server_keys.begin(), server_keys.end(), options.server_public_key) ==
            server_keys.end()) {
      server_keys.insert(server_keys.begin(), options.server_public_key);
    }
    if (server_keys.empty() || !IsValidZ85Key(server_keys.front())) {
      return Status::InvalidArgument(
          "the server's public key is missing or not 40 Z85 characters (pass its .pub file)");
    }
    if (!IsValidZ85Key(options.client_keys.secret_key)) {
      return Status::InvalidArgument("no client key pair given (create one: isthmusctl keygen)");
    }
  }
  std::unique_ptr<ShardClient> client(new ShardClient(options));
  client->server_keys_ = std::move(server_keys);
  ISTHMUS_RETURN_IF_ERROR(client->OpenSocket());
  return client;
}

Status ShardClient::OpenSocket() {
  try {
    socket_ = std::make_unique<zmq::socket_t>(ctx_, zmq::socket_type::dealer);
    socket_->set(zmq::sockopt::linger, 0);
    socket_->set(zmq::sockopt::sndhwm, 0);
    socket_->set(zmq::sockopt::rcvhwm, 0);
    if (options_.limits.max_payload_bytes > 0) {
      socket_->set(zmq::sockopt::maxmsgsize,
                   static_cast<int64_t>(options_.limits.max_payload_bytes +
                                        options_.limits.max_header_bytes));
    }
    if (!options_.insecure_plaintext) {
      ConfigureCurveClient(*socket_, options_.client_keys, server_keys_[key_index_]);
    }
    // The monitor lives as long as the socket (setting one up per call costs more than a
    // small request) and reports the connection coming up, dropping, and a handshake the
    // server refused.
    std::string mon_ep = "inproc://isthmus-client-mon-" + std::to_string(++monitor_seq_);
    if (zmq_socket_monitor(socket_->handle(), mon_ep.c_str(),
                           ZMQ_EVENT_CONNECTED | ZMQ_EVENT_HANDSHAKE_SUCCEEDED |
                               ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH |
                               ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                               ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL) != 0) {
      throw zmq::error_t();
    }
    monitor_ = std::make_unique<zmq::socket_t>(ctx_, zmq::socket_type::pair);
    monitor_->set(zmq::sockopt::linger, 0);
    monitor_->connect(mon_ep);
    socket_->connect(options_.endpoint);
  } catch (const zmq::error_t& e) {
    CloseSocket();
    return Status::InvalidArgument("cannot connect to '" + options_.endpoint + "': " + e.what());
  }
  return Status::Ok();
}

Status ShardClient::ReadMonitor(bool* lost) {
  while (true) {
    zmq::message_t ev;
    if (!monitor_->recv(ev, zmq::recv_flags::dontwait)) return Status::Ok();
    uint16_t event = 0;
    uint32_t value = 0;
    if (ev.size() >= 6) {
      std::memcpy(&event, ev.data(), 2);
      std::memcpy(&value, static_cast<const char*>(ev.data()) + 2, 4);
    }
    if (ev.more()) {
      zmq::message_t addr;
      (void)monitor_->recv(addr);
    }
    switch (event) {
      case ZMQ_EVENT_CONNECTED:
        tcp_connected_ = true;
        break;
      case ZMQ_EVENT_HANDSHAKE_SUCCEEDED:
        ready_ = true;
        break;
      case ZMQ_EVENT_DISCONNECTED:
        if (ready_) *lost = true;
        ready_ = false;
        break;
      case ZMQ_EVENT_HANDSHAKE_FAILED_AUTH:
        return Status::PermissionDenied(
            "server at " + options_.endpoint + " refused this client's key (status " +
            std::to_string(value) + "): add its .pub file to the server's allowlist for this role");
      case ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL:
      case ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        // Not final: a server SIGKILLed while a connection was in its handshake looks like
        // this too. The attempt ends as lost (nothing was sent before the handshake); the
        // next one tells, and Call reports a key problem only if the last attempt failed
        // this way as well.
        handshake_failed_ = true;
        ready_ = false;
        *lost = true;
        break;
      default:
        break;
    }
  }
}

bool ShardClient::NextServerKey() {
  if (options_.insecure_plaintext) return false;
  if (!options_.server_key_file.empty()) {
    auto listed = LoadPublicKeyList(options_.server_key_file);
    if (listed.ok()) {
      const std::string current = server_keys_[key_index_];
      server_keys_ = std::move(listed).value();
      auto it = std::find(server_keys_.begin(), server_keys_.end(), current);
      // A key no longer listed: the next one is the file's first.
      key_index_ = it == server_keys_.end() ? server_keys_.size() - 1 : it - server_keys_.begin();
    }
  }
  if (server_keys_.size() < 2) return false;
  key_index_ = (key_index_ + 1) % server_keys_.size();
  spdlog::info("client: the CURVE handshake with {} failed: trying the server's next listed key {}",
               options_.endpoint, server_keys_[key_index_].substr(0, 8));
  return true;
}

Result<Frames> ShardClient::Call(uint64_t request_id, const flatbuffers::FlatBufferBuilder& fbb,
                                 const std::vector<TensorView>& payload,
                                 const std::vector<Part>* parts) {
  using Clock = std::chrono::steady_clock;
  // How often an interruptible call asks options_.interrupted while it waits.
  constexpr auto kSlice = std::chrono::milliseconds(100);
  const int attempts = 1 + std::max(0, options_.retries);
  bool last_lost = false;         // why the last attempt ended: the connection dropped ...
  bool last_unconnected = false;  // ... or never came up (else: no reply in time)
  bool last_tcp = false;          // a TCP connection was made in that attempt
  bool last_ready = false;        // the connection was up when it ended
  bool last_handshake = false;    // a CURVE handshake failed in it
  size_t key_switches = 0;        // to another listed server key, after a failed handshake
  for (int attempt = 0; attempt < attempts; ++attempt) {
    if (!socket_) ISTHMUS_RETURN_IF_ERROR(OpenSocket());
    bool lost = false;
    Status failure = ReadMonitor(&lost);  // what happened since the last call
    handshake_failed_ = false;
    if (!failure.ok()) {
      CloseSocket();
      return failure;
    }
    ReleaseLatch latch;
    {
      std::vector<PayloadRef> refs;
      refs.reserve(payload.size());
      for (const auto& t : payload) {
        const std::span<const char> bytes = PayloadOf(t);
        refs.push_back({bytes.data(), bytes.size(), latch.Token()});
      }
      Status s = SendMessage(*socket_, nullptr, fbb, refs);
      for (size_t i = 0; parts != nullptr && i < parts->size() && s.ok(); ++i) {
        const Part& p = (*parts)[i];
        s = SendMessage(*socket_, nullptr, p.header, {{p.data, p.size, latch.Token()}});
      }
      if (!s.ok()) {
        CloseSocket();
        latch.Wait();
        return s;
      }
    }
    const auto start = Clock::now();
    const auto deadline = start + std::chrono::milliseconds(options_.timeout_ms);
    const auto connect_deadline = start + std::chrono::milliseconds(options_.connect_timeout_ms);
    lost = false;
    bool unconnected = false, interrupted = false;
    while (true) {
      const auto now = Clock::now();
      if (now >= deadline) break;
      if (!ready_ && now >= connect_deadline) {
        unconnected = true;
        break;
      }
      auto until = ready_ ? deadline : std::min(deadline, connect_deadline);
      if (options_.interrupted) until = std::min(until, now + kSlice);
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - now) +
                        std::chrono::milliseconds(1);
      zmq::pollitem_t items[] = {{socket_->handle(), 0, ZMQ_POLLIN, 0},
                                 {monitor_->handle(), 0, ZMQ_POLLIN, 0}};
      bool eintr = false;
      try {
        zmq::poll(items, 2, left);
      } catch (const zmq::error_t& e) {
        // A signal (e.g. the SIGTERM that asks a worker to checkpoint and stop) interrupts
        // the wait: ask the caller, then wait on. cppzmq throws on EINTR.
        if (e.num() != EINTR) {
          failure = Status::Internal(std::string("waiting for a reply failed: ") + e.what());
          break;
        }
        eintr = true;
      }
      if (options_.interrupted && options_.interrupted()) {
        interrupted = true;
        break;
      }
      if (eintr) continue;
      if (items[1].revents & ZMQ_POLLIN) {
        failure = ReadMonitor(&lost);
        if (!failure.ok() || lost) break;
      }
      if (!(items[0].revents & ZMQ_POLLIN)) continue;
      auto msg = ReceiveMessage(*socket_, nullptr);
      if (!msg.ok()) continue;
      auto env = ParseEnvelope(msg->header, options_.limits);
      if (!env.ok()) {
        failure = Status(env.status().code(), "bad reply from server: " + env.status().message());
        break;
      }
      if ((*env)->request_id() != request_id) continue;  // stale reply of an older attempt
      latch.Wait();
      Status err = ErrorFromEnvelope(*env);
      if (!err.ok()) return err;
      return std::move(msg).value();
    }
    last_tcp = tcp_connected_;
    last_ready = ready_;
    last_handshake = handshake_failed_;
    CloseSocket();  // drops queued requests and any late reply
    latch.Wait();
    if (!failure.ok()) return failure;
    if (interrupted) {
      return Status::Unavailable("interrupted while waiting for " + options_.endpoint +
                                 " (the caller asked to stop; a push may or may not have been "
                                 "applied: retry it with the same key)");
    }
    last_lost = lost;
    last_unconnected = unconnected;
    // Nothing reached the server before a failed handshake: another key it may hold (a
    // rotation) is tried without counting the attempt.
    if (last_handshake && key_switches < server_keys_.size() && NextServerKey()) {
      ++key_switches;
      --attempt;
      continue;
    }
    spdlog::debug("client: attempt {}/{} to {} ended: {}", attempt + 1, attempts, options_.endpoint,
                  lost          ? "connection lost"
                  : unconnected ? "no connection"
                                : "no reply");
  }
  const std::string tries = std::to_string(attempts) + " attempt(s)";
  if (last_handshake) {
    return Status::PermissionDenied(
        "CURVE handshake with " + options_.endpoint + " failed (" + tries +
        "): check the server public key and that both sides use CURVE (a server that stopped "
        "during the handshake looks the same)");
  }
  if (last_unconnected) {
    if (last_tcp) {
      return Status::Unavailable(
          options_.endpoint + " accepted TCP connections but completed no ZeroMQ handshake in " +
          std::to_string(options_.connect_timeout_ms) + " ms (" + tries +
          "): is the process listening there isthmus-server, and is it running (not stopped "
          "or overloaded)?");
    }
    return Status::Unavailable(
        "cannot connect to " + options_.endpoint + ": no connection in " +
        std::to_string(options_.connect_timeout_ms) + " ms (" + tries +
        "): is isthmus-server running there, is the endpoint (host and port) right, and is "
        "the port reachable from here?");
  }
  if (last_lost) {
    return Status::Unavailable("the connection to " + options_.endpoint +
                               " dropped before the reply (" + tries +
                               "): did isthmus-server stop or restart there? Check its log");
  }
  const std::string prefix = "no reply from " + options_.endpoint + " after " + tries + " of " +
                             std::to_string(options_.timeout_ms) + " ms: ";
  if (last_ready) {
    return Status::Timeout(prefix +
                           "the shard is connected but did not answer in time (is it stopped, "
                           "hung or overloaded? a large request may need a longer timeout)");
  }
  return Status::Timeout(
      prefix +
      (last_tcp ? "connected, but the handshake did not finish" : "no connection was made") +
      " (is isthmus-server running there, and is the endpoint right?)");
}

namespace {

RoundInfo RoundInfoOf(const wire::RoundStatus* r) {
  RoundInfo info;
  if (r) info = RoundInfo{r->local_round(), r->committed_round(), r->max_rounds_ahead()};
  return info;
}

RoundPipelines PipelinesOf(
    uint64_t round,
    const flatbuffers::Vector<flatbuffers::Offset<wire::TensorPipeline>>* pipelines) {
  RoundPipelines out;
  if (pipelines == nullptr || pipelines->size() == 0) return out;
  out.round = round;
  for (const auto* p : *pipelines) out.pipelines[p->name()->str()] = p->pipeline()->str();
  return out;
}

template <typename T>
Result<const T*> BodyAs(const Frames& reply, const WireLimits& limits, wire::Body expect) {
  auto env = ParseEnvelope(reply.header, limits);
  if (!env.ok()) return env.status();
  if ((*env)->body_type() != expect) {
    return Status::Internal(std::string("unexpected reply type ") +
                            wire::EnumNameBody((*env)->body_type()));
  }
  return static_cast<const T*>((*env)->body());
}

std::vector<TensorInfo> InfosFrom(
    const flatbuffers::Vector<flatbuffers::Offset<wire::TensorMeta>>* v) {
  std::vector<TensorInfo> out;
  if (v == nullptr) return out;
  for (const auto* m : *v) out.push_back({m->name()->str(), ShapeOf(m), m->version()});
  return out;
}

}  // namespace

Result<HelloInfo> ShardClient::Hello(const std::string& job, wire::Role role,
                                     const std::string& base_hash, const std::string& client_name,
                                     bool want_pipelines, uint64_t compute_ms) {
  flatbuffers::FlatBufferBuilder fbb;
  uint64_t id = NextRequestId();
  auto body = wire::CreateHelloDirect(fbb, job.c_str(), role, base_hash.c_str(),
                                      client_name.c_str(), want_pipelines, compute_ms);
  FinishEnvelope(fbb, id, wire::Body::Hello, body.Union());
  ISTHMUS_ASSIGN_OR_RETURN(Frames reply, Call(id, fbb, {}));
  ISTHMUS_ASSIGN_OR_RETURN(
      auto* r, BodyAs<wire::HelloReply>(reply, options_.limits, wire::Body::HelloReply));
  HelloInfo info;
  if (r->shard_id()) info.shard_id = r->shard_id()->str();
  if (r->server_version()) info.server_version = r->server_version()->str();
  if (r->base_hash()) info.base_hash = r->base_hash()->str();
  info.job_version = r->job_version();
  info.tensor_count = r->tensor_count();
  info.rounds = RoundInfoOf(r->rounds());
  info.pipelines = PipelinesOf(r->pipelines_round(), r->pipelines());
  info.push_part_bytes = r->push_part_bytes();
  if (!job.empty()) push_part_bytes_[job] = info.push_part_bytes;
  return info;
}

Result<Frames> ShardClient::CallPull(const std::string& job, const std::vector<std::string>& names,
                                     uint64_t newer_than, const wire::PullReply** body_out) {
  flatbuffers::FlatBufferBuilder fbb;
  uint64_t id = NextRequestId();
  auto body = wire::CreatePullRequestDirect(fbb, job.c_str(), nullptr, newer_than);
  if (!names.empty()) {
    auto v = fbb.CreateVectorOfStrings(names);
    auto jobs = fbb.CreateString(job);
    body = wire::CreatePullRequest(fbb, jobs, v, newer_than);
  }
  FinishEnvelope(fbb, id, wire::Body::PullRequest, body.Union());
  ISTHMUS_ASSIGN_OR_RETURN(Frames reply, Call(id, fbb, {}));
  ISTHMUS_ASSIGN_OR_RETURN(auto* r,
                           BodyAs<wire::PullReply>(reply, options_.limits, wire::Body::PullReply));
  ISTHMUS_RETURN_IF_ERROR(ValidateTensors(r->tensors(), reply.payload, options_.limits, false));
  // The body points into reply.header, whose buffer stays put when `reply` is moved.
  *body_out = r;
  return reply;
}

namespace {

// A plain pull's reply (tensor metas already checked against the frames), copied out.
PullResult PullResultOf(const wire::PullReply* r, const Frames& reply) {
  PullResult out;
  out.job_version = r->job_version();
  out.rounds = RoundInfoOf(r->rounds());
  if (r->tensors()) {
    for (const auto* m : *r->tensors()) {
      Tensor t;
      t.name = m->name()->str();
      t.shape = ShapeOf(m);
      const auto& frame = reply.payload[m->frame()];
      const size_t n = frame.size() / sizeof(float);
      if (reinterpret_cast<uintptr_t>(frame.data()) % alignof(float) == 0) {
        // One pass over the fresh memory (resize would zero-fill it first).
        const auto* f = static_cast<const float*>(frame.data());
        t.data.assign(f, f + n);
      } else {
        t.data.resize(n);
        std::memcpy(t.data.data(), frame.data(), n * sizeof(float));
      }
      out.tensors.push_back(std::move(t));
      out.versions.push_back(m->version());
    }
  }
  return out;
}

}  // namespace

Result<PullResult> ShardClient::Pull(const std::string& job, const std::vector<std::string>& names,
                                     uint64_t newer_than) {
  const wire::PullReply* r = nullptr;
  ISTHMUS_ASSIGN_OR_RETURN(Frames reply, CallPull(job, names, newer_than, &r));
  return PullResultOf(r, reply);
}

namespace {

// The tensors of `metas`, each the whole of the payload frame it names; `fp32`: the frame
// holds the tensor's fp32 values (its length is 4 x the shape's elements).
Result<std::vector<ReplayTensor>> ReplayTensorsOf(
    const flatbuffers::Vector<flatbuffers::Offset<wire::TensorMeta>>* metas, const Frames& reply,
    bool fp32) {
  std::vector<ReplayTensor> out;
  if (metas == nullptr) return out;
  for (const auto* m : *metas) {
    if (m->frame() >= reply.payload.size() || reply.payload[m->frame()].size() != m->nbytes()) {
      return Status::InvalidArgument("pull by replay: tensor '" + m->name()->str() +
                                     "' names a payload frame that is absent or of another size");
    }
    ReplayTensor t{m->name()->str(), ShapeOf(m), {}};
    const auto& f = reply.payload[m->frame()];
    t.bytes = std::string_view(static_cast<const char*>(f.data()), f.size());
    const int64_t numel = NumElements(t.shape);
    if (numel < 0 || (fp32 && t.bytes.size() != static_cast<uint64_t>(numel) * sizeof(float))) {
      return Status::InvalidArgument("pull by replay: tensor '" + t.name +
                                     "' has a shape that does not match its bytes");
    }
    out.push_back(std::move(t));
  }
  return out;
}

Result<std::vector<ReplayRoundDeltas>> ReplayRoundsOf(
    const flatbuffers::Vector<flatbuffers::Offset<wire::ReplayRound>>* rounds,
    const Frames& reply) {
  std::vector<ReplayRoundDeltas> out;
  if (rounds == nullptr) return out;
  for (const auto* r : *rounds) {
    ReplayRoundDeltas round{r->round(), {}};
    if (r->deltas()) {
      for (const auto* d : *r->deltas()) {
        ISTHMUS_ASSIGN_OR_RETURN(auto tensors, ReplayTensorsOf(d->tensors(), reply, false));
        round.deltas.push_back({d->site()->str(), d->tokens(), std::move(tensors)});
      }
    }
    out.push_back(std::move(round));
  }
  return out;
}

}  // namespace

Result<ReplayReply> ShardClient::PullReplay(const std::string& job, uint64_t from,
                                            const std::string& digest) {
  flatbuffers::FlatBufferBuilder fbb;
  uint64_t id = NextRequestId();
  auto body =
      wire::CreatePullRequestDirect(fbb, job.c_str(), nullptr, 0, true, from, digest.c_str());
  FinishEnvelope(fbb, id, wire::Body::PullRequest, body.Union());
  ISTHMUS_ASSIGN_OR_RETURN(Frames reply, Call(id, fbb, {}));
  ISTHMUS_ASSIGN_OR_RETURN(auto* r,
                           BodyAs<wire::PullReply>(reply, options_.limits, wire::Body::PullReply));
  ReplayReply out;
  out.job_version = r->job_version();
  out.rounds = RoundInfoOf(r->rounds());
  for (const auto& f : reply.payload) out.payload_bytes += f.size();
  const wire::Replay* rp = r->replay();
  if (rp == nullptr) {
    // Not synced there: a plain pull's reply.
    ISTHMUS_RETURN_IF_ERROR(ValidateTensors(r->tensors(), reply.payload, options_.limits, false));
    out.plain = PullResultOf(r, reply);
    return out;
  }
  out.replayed = true;
  out.base_round = rp->base_round();
  out.whole = rp->base() != nullptr;
  ISTHMUS_ASSIGN_OR_RETURN(out.base, ReplayTensorsOf(rp->base(), reply, true));
  ISTHMUS_ASSIGN_OR_RETURN(out.base_momentum, ReplayTensorsOf(rp->base_momentum(), reply, true));
  ISTHMUS_ASSIGN_OR_RETURN(out.committed, ReplayRoundsOf(rp->committed(), reply));
  ISTHMUS_ASSIGN_OR_RETURN(out.view, ReplayRoundsOf(rp->view(), reply));
  out.committed_round = rp->committed_round();
  out.digest = rp->digest() ? rp->digest()->str() : "";
  out.check = rp->check() ? rp->check()->str() : "";
  out.epoch = rp->epoch();
  out.members_from = rp->members_from();
  if (rp->members()) {
    for (const auto* s : *rp->members()) out.members.push_back(s->str());
  }
  out.outer_lr = rp->outer_lr();
  out.outer_momentum = rp->outer_momentum();
  out.frames_ = std::move(reply);
  return out;
}

Result<PullView> ShardClient::PullInPlace(const std::string& job,
                                          const std::vector<std::string>& names,
                                          uint64_t newer_than) {
  const wire::PullReply* r = nullptr;
  ISTHMUS_ASSIGN_OR_RETURN(Frames reply, CallPull(job, names, newer_than, &r));
  PullView out;
  out.job_version = r->job_version();
  out.rounds = RoundInfoOf(r->rounds());
  if (r->tensors()) {
    for (const auto* m : *r->tensors()) {
      PulledTensor t;
      t.name = m->name()->str();
      t.shape = ShapeOf(m);
      t.version = m->version();
      const auto& frame = reply.payload[m->frame()];
      const size_t n = frame.size() / sizeof(float);
      if (reinterpret_cast<uintptr_t>(frame.data()) % alignof(float) == 0) {
        t.data = std::span<const float>(static_cast<const float*>(frame.data()), n);
      } else {
        // Small frames can share ZeroMQ's receive buffer at any offset.
        auto& copy = out.realigned_.emplace_back(n);
        std::memcpy(copy.data(), frame.data(), n * sizeof(float));
        t.data = std::span<const float>(copy.data(), n);
      }
      out.tensors.push_back(std::move(t));
    }
  }
  out.frames_ = std::move(reply);
  return out;
}

Result<PushResult> ShardClient::Push(const std::string& job, const std::string& idempotency_key,
                                     uint64_t round, uint64_t tokens,
                                     const std::vector<TensorView>& deltas, uint64_t compute_ms) {
  ISTHMUS_RETURN_IF_ERROR(CheckTensorViews(deltas));
  flatbuffers::FlatBufferBuilder fbb;
  uint64_t id = NextRequestId();
  // Large fp32 tensors in parts, where the job's Hello offered it; whole parts of floats.
  uint64_t part = 0;
  if (auto it = push_part_bytes_.find(job);
      options_.push_in_parts && it != push_part_bytes_.end()) {
    part = it->second & ~uint64_t{3};
  }
  std::vector<uint32_t> streamed;
  std::vector<TensorView> framed;  // the rest, sent as the request's payload frames
  std::vector<flatbuffers::Offset<wire::TensorMeta>> metas;
  for (size_t i = 0; i < deltas.size(); ++i) {
    const TensorView& t = deltas[i];
    const uint64_t bytes = PayloadOf(t).size();
    const bool in_parts = part > 0 && !t.encoded && bytes >= 2 * part;
    if (in_parts) streamed.push_back(static_cast<uint32_t>(i));
    metas.push_back(wire::CreateTensorMetaDirect(
        fbb, t.name.c_str(), &t.shape, t.encoded ? wire::DType::Codec : wire::DType::F32,
        in_parts ? 0 : static_cast<uint32_t>(framed.size()), bytes, 0));
    if (!in_parts) framed.push_back(t);
  }
  auto metas_v = fbb.CreateVector(metas);
  auto job_s = fbb.CreateString(job);
  auto key_s = fbb.CreateString(idempotency_key);
  auto streamed_v = streamed.empty() ? 0 : fbb.CreateVector(streamed);
  auto body =
      wire::CreatePushRequest(fbb, job_s, key_s, round, tokens, metas_v, compute_ms, streamed_v);
  FinishEnvelope(fbb, id, wire::Body::PushRequest, body.Union());
  std::vector<Part> parts;
  for (uint32_t i : streamed) {
    const std::span<const char> bytes = PayloadOf(deltas[i]);
    for (uint64_t off = 0; off < bytes.size(); off += part) {
      Part& p = parts.emplace_back();
      auto pj = p.header.CreateString(job);
      auto pk = p.header.CreateString(idempotency_key);
      FinishEnvelope(p.header, NextRequestId(), wire::Body::PushPart,
                     wire::CreatePushPart(p.header, pj, pk, i, off).Union());
      p.data = bytes.data() + off;
      p.size = std::min<uint64_t>(part, bytes.size() - off);
    }
  }
  ISTHMUS_ASSIGN_OR_RETURN(Frames reply, Call(id, fbb, framed, parts.empty() ? nullptr : &parts));
  ISTHMUS_ASSIGN_OR_RETURN(auto* r,
                           BodyAs<wire::PushReply>(reply, options_.limits, wire::Body::PushReply));
  return PushResult{r->job_version(), r->duplicate(), RoundInfoOf(r->rounds())};
}

Result<JobInfo> ShardClient::CreateJob(const std::string& job, const std::string& base_hash,
                                       const std::vector<TensorView>& tensors) {
  ISTHMUS_RETURN_IF_ERROR(CheckTensorViews(tensors));
  flatbuffers::FlatBufferBuilder fbb;
  uint64_t id = NextRequestId();
  auto metas = BuildTensorMetas(fbb, tensors);
  auto job_s = fbb.CreateString(job);
  auto hash_s = fbb.CreateString(base_hash);
  auto body = wire::CreateJobCreate(fbb, job_s, hash_s, metas);
  FinishEnvelope(fbb, id, wire::Body::JobCreate, body.Union());
  ISTHMUS_ASSIGN_OR_RETURN(Frames reply, Call(id, fbb, tensors));
  ISTHMUS_ASSIGN_OR_RETURN(
      auto* r, BodyAs<wire::JobCreateReply>(reply, options_.limits, wire::Body::JobCreateReply));
  JobInfo info;
  info.job = job;
  info.base_hash = base_hash;
  info.version = r->job_version();
  info.tensor_count = r->tensor_count();
  info.total_bytes = r->total_bytes();
  return info;
}

Result<JobInfo> ShardClient::DescribeJob(const std::string& job) {
  flatbuffers::FlatBufferBuilder fbb;
  uint64_t id = NextRequestId();
  auto body = wire::CreateJobDescribeDirect(fbb, job.c_str());
  FinishEnvelope(fbb, id, wire::Body::JobDescribe, body.Union());
  ISTHMUS_ASSIGN_OR_RETURN(Frames reply, Call(id, fbb, {}));
  ISTHMUS_ASSIGN_OR_RETURN(auto* r, BodyAs<wire::JobDescribeReply>(reply, options_.limits,
                                                                   wire::Body::JobDescribeReply));
  JobInfo info;
  if (r->job()) info.job = r->job()->str();
  if (r->base_hash()) info.base_hash = r->base_hash()->str();
  info.version = r->version();
  info.pushes = r->pushes();
  info.created_unix = r->created_unix();
  info.tensors = InfosFrom(r->tensors());
  info.tensor_count = info.tensors.size();
  for (const auto& t : info.tensors) info.total_bytes += NumElements(t.shape) * sizeof(float);
  return info;
}

Result<ShardStats> ShardClient::Stats() {
  flatbuffers::FlatBufferBuilder fbb;
  uint64_t id = NextRequestId();
  auto body = wire::CreateStatsRequest(fbb);
  FinishEnvelope(fbb, id, wire::Body::StatsRequest, body.Union());
  ISTHMUS_ASSIGN_OR_RETURN(Frames reply, Call(id, fbb, {}));
  ISTHMUS_ASSIGN_OR_RETURN(
      auto* r, BodyAs<wire::StatsReply>(reply, options_.limits, wire::Body::StatsReply));
  ShardStats s;
  if (r->shard_id()) s.shard_id = r->shard_id()->str();
  if (r->server_version()) s.server_version = r->server_version()->str();
  s.uptime_s = r->uptime_s();
  s.requests = r->requests();
  s.errors = r->errors();
  s.bytes_in = r->bytes_in();
  s.bytes_out = r->bytes_out();
  s.db_bytes = r->db_bytes();
  s.last_error = r->last_error() ? r->last_error()->str() : "";
  s.last_error_age_s = r->last_error_age_s();
  if (r->jobs()) {
    for (const auto* j : *r->jobs()) s.jobs.push_back(JobFromSummary(j));
  }
  return s;
}

Result<SnapshotInfo> ShardClient::CreateSnapshot(const std::string& name) {
  flatbuffers::FlatBufferBuilder fbb;
  uint64_t id = NextRequestId();
  auto body = wire::CreateSnapshotCreateDirect(fbb, name.c_str());
  FinishEnvelope(fbb, id, wire::Body::SnapshotCreate, body.Union());
  ISTHMUS_ASSIGN_OR_RETURN(Frames reply, Call(id, fbb, {}));
  ISTHMUS_ASSIGN_OR_RETURN(auto* r, BodyAs<wire::SnapshotCreateReply>(
                                        reply, options_.limits, wire::Body::SnapshotCreateReply));
  return SnapshotFromWire(r->snapshot());
}

Result<std::vector<SnapshotInfo>> ShardClient::ListSnapshots() {
  flatbuffers::FlatBufferBuilder fbb;
  uint64_t id = NextRequestId();
  auto body = wire::CreateSnapshotList(fbb);
  FinishEnvelope(fbb, id, wire::Body::SnapshotList, body.Union());
  ISTHMUS_ASSIGN_OR_RETURN(Frames reply, Call(id, fbb, {}));
  ISTHMUS_ASSIGN_OR_RETURN(auto* r, BodyAs<wire::SnapshotListReply>(reply, options_.limits,
                                                                    wire::Body::SnapshotListReply));
  std::vector<SnapshotInfo> out;
  if (r->snapshots()) {
    for (const auto* s : *r->snapshots()) out.push_back(SnapshotFromWire(s));
  }
  return out;
}

Result<SnapshotInfo> ShardClient::RestoreSnapshot(const std::string& name) {
  flatbuffers::FlatBufferBuilder fbb;
  uint64_t id = NextRequestId();
  auto body = wire::CreateSnapshotRestoreDirect(fbb, name.c_str());
  FinishEnvelope(fbb, id, wire::Body::SnapshotRestore, body.Union());
  ISTHMUS_ASSIGN_OR_RETURN(Frames reply, Call(id, fbb, {}));
  ISTHMUS_ASSIGN_OR_RETURN(auto* r, BodyAs<wire::SnapshotRestoreReply>(
                                        reply, options_.limits, wire::Body::SnapshotRestoreReply));
  return SnapshotFromWire(r->snapshot());
}

// --- cross-site sync administration -----------------------------------------------------

Result<SyncStatusInfo> ShardClient::SyncStatus() {
  flatbuffers::FlatBufferBuilder fbb;
  uint64_t id = NextRequestId();
  auto body = wire::CreateSyncStatusRequest(fbb);
  FinishEnvelope(fbb, id, wire::Body::SyncStatusRequest, body.Union());
  ISTHMUS_ASSIGN_OR_RETURN(Frames reply, Call(id, fbb, {}));
  ISTHMUS_ASSIGN_OR_RETURN(
      auto* r, BodyAs<wire::SyncStatusReply>(reply, options_.limits, wire::Body::SyncStatusReply));
  auto str = [](const flatbuffers::String* s) { return s ? s->str() : std::string(); };
  SyncStatusInfo out;
  out.site = str(r->site());
  out.shard_index = r->shard_index();
  out.enabled = r->enabled();
  out.refused_unknown = r->refused_unknown();
  if (r->links()) {
    for (const auto* l : *r->links()) {
      PeerLinkReport p;
      p.site = str(l->site());
      p.endpoint = str(l->endpoint());
      p.connected = l->connected();
      p.paused = l->paused();
      p.last_error = str(l->last_error());
      if (l->jobs()) {
        for (const auto* j : *l->jobs()) {
          p.jobs.push_back({str(j->job()), j->acked_round(), j->outbox_round(), j->lag_rounds()});
        }
      }
      p.bytes_sent = l->bytes_sent();
      p.bytes_received = l->bytes_received();
      p.raw_bytes_sent = l->raw_bytes_sent();
      p.compression_ratio = l->compression_ratio();
      p.bandwidth_bps = l->bandwidth_bps();
      p.deltas_sent = l->deltas_sent();
      p.deltas_acked = l->deltas_acked();
      p.resends = l->resends();
      p.auth_failures = l->auth_failures();
      p.refused = l->refused();
      p.wire_bytes_sent = l->wire_bytes_sent();
      p.wire_bytes_received = l->wire_bytes_received();
      p.tcp_bytes_estimate = l->tcp_bytes_estimate();
      p.wire_ratio = l->wire_ratio();
      p.messages_sent = l->messages_sent();
      p.messages_received = l->messages_received();
      p.connections = l->connections();
      p.keepalives = l->keepalives();
      p.dials = l->dials();
      p.silent_seconds = l->silent_seconds();
      out.links.push_back(std::move(p));
    }
  }
  if (r->jobs()) {
    for (const auto* j : *r->jobs()) {
      SyncJobReport rep;
      rep.job = str(j->job());
      rep.local_round = j->local_round();
      rep.committed_round = j->committed_round();
      rep.max_rounds_ahead = j->max_rounds_ahead();
      rep.detail = str(j->detail());
      if (const auto* m = j->members()) {
        rep.epoch = m->epoch();
        rep.members_from = m->from_round();
        if (m->sites()) {
          for (const auto* site : *m->sites()) rep.members.push_back(site->str());
        }
      }
      if (j->removed()) {
        for (const auto* r : *j->removed()) rep.removed[str(r->site())] = r->from_round();
      }
      rep.change = str(j->change());
      rep.change_pending = j->change_pending();
      if (j->pipelines()) {
        for (const auto* u : *j->pipelines()) rep.pipelines[str(u->pipeline())] = u->tensors();
      }
      if (j->held()) {
        for (const auto* h : *j->held()) rep.held[str(h->site())] = h->round();
      }
      rep.round_work_pending = j->round_work_pending();
      rep.round_work_failures = j->round_work_failures();
      rep.round_work_error = str(j->round_work_error());
      out.jobs.push_back(std::move(rep));
    }
  }
  return out;
}

Result<std::vector<std::string>> ShardClient::SyncControl(wire::SyncAction action,
                                                          const std::string& peer) {
  flatbuffers::FlatBufferBuilder fbb;
  uint64_t id = NextRequestId();
  auto body = wire::CreateSyncControl(fbb, action, fbb.CreateString(peer));
  FinishEnvelope(fbb, id, wire::Body::SyncControl, body.Union());
  ISTHMUS_ASSIGN_OR_RETURN(Frames reply, Call(id, fbb, {}));
  ISTHMUS_ASSIGN_OR_RETURN(auto* r, BodyAs<wire::SyncControlReply>(reply, options_.limits,
                                                                   wire::Body::SyncControlReply));
  std::vector<std::string> out;
  if (r->peers()) {
    for (const auto* p : *r->peers()) out.push_back(p->str());
  }
  return out;
}

Result<std::map<std::string, uint64_t>> ShardClient::MembershipControl(
    wire::MembershipAction action, const std::string& site, const std::string& job,
    uint64_t seconds, bool revoke_key) {
  flatbuffers::FlatBufferBuilder fbb;
  uint64_t id = NextRequestId();
  auto body = wire::CreateMembershipControl(fbb, action, fbb.CreateString(site),
                                            fbb.CreateString(job), seconds, revoke_key);
  FinishEnvelope(fbb, id, wire::Body::MembershipControl, body.Union());
  ISTHMUS_ASSIGN_OR_RETURN(Frames reply, Call(id, fbb, {}));
  ISTHMUS_ASSIGN_OR_RETURN(
      auto* r, BodyAs<wire::MembershipControlReply>(reply, options_.limits,
                                                    wire::Body::MembershipControlReply));
  std::map<std::string, uint64_t> out;
  if (r->jobs() && r->epochs() && r->jobs()->size() == r->epochs()->size()) {
    for (uint32_t i = 0; i < r->jobs()->size(); ++i) {
      out[r->jobs()->Get(i)->str()] = r->epochs()->Get(i);
    }
  }
  return out;
}

Result<DigestsInfo> ShardClient::Digests(const std::string& job, uint64_t from_round) {
  flatbuffers::FlatBufferBuilder fbb;
  uint64_t id = NextRequestId();
  auto body = wire::CreateDigestsRequest(fbb, fbb.CreateString(job), from_round);
  FinishEnvelope(fbb, id, wire::Body::DigestsRequest, body.Union());
  ISTHMUS_ASSIGN_OR_RETURN(Frames reply, Call(id, fbb, {}));
  ISTHMUS_ASSIGN_OR_RETURN(
      auto* r, BodyAs<wire::DigestsReply>(reply, options_.limits, wire::Body::DigestsReply));
  DigestsInfo out;
  out.job = r->job() ? r->job()->str() : job;
  out.committed_round = r->committed_round();
  if (r->digests()) {
    for (const auto* d : *r->digests()) {
      out.digests.emplace_back(d->round(), d->digest() ? d->digest()->str() : std::string());
    }
  }
  out.site = r->site() ? r->site()->str() : std::string();
  if (const auto* m = r->members()) {
    out.has_members = true;
    out.epoch = m->epoch();
    out.members_from = m->from_round();
    if (m->sites()) {
      for (const auto* site : *m->sites()) out.members.push_back(site->str());
    }
  }
  if (r->removed()) {
    for (const auto* x : *r->removed()) {
      out.removed[x->site() ? x->site()->str() : std::string()] = x->from_round();
    }
  }
  if (r->joined()) {
    for (const auto* x : *r->joined()) {
      out.joined[x->site() ? x->site()->str() : std::string()] = x->round();
    }
  }
  return out;
}

}  // namespace isthmus
