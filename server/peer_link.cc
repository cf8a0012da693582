// Peer link state machines (handshake, windowed sends, acks, timeouts with backoff) and
// the receiving side's checks of who sent what.
#include "server/peer_link.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>
#include <set>

#include "common/transport.h"

namespace isthmus {

struct PeerLinks::Link {
  PeerLinkSpec spec;
  std::unique_ptr<zmq::socket_t> dealer;
  std::unique_ptr<zmq::socket_t> monitor;
  std::string monitor_endpoint;

  struct JobLink {
    uint64_t acked = 0;
    uint64_t next = 1;  // next round to send
  };
  struct InFlight {
    enum class Kind { kHello, kDelta, kPing };
    Kind kind = Kind::kHello;
    std::string job;  // kDelta
    uint64_t round = 0;
    uint64_t bytes = 0;
    Clock::time_point sent;
    bool resent = false;  // this round was sent before (its ack may answer that copy)
  };
  bool transport_up = false;
  bool reconnecting = false;  // the connection dropped: handshake again once it is back
  bool ready = false;         // the handshake was answered on the current connection
  bool paused = false;
  std::map<std::string, JobLink> jobs;  // jobs the peer syncs with us
  std::map<uint64_t, InFlight> inflight;
  uint64_t request_seq = 0;
  int failures = 0;              // consecutive timeouts / refusals: the backoff exponent
  Clock::time_point retry_at{};  // while not ready and nothing in flight: next handshake
  Clock::time_point last_progress{};
  std::map<std::string, uint64_t> high_sent;  // per job, the highest round ever sent
  std::optional<BandwidthMeter> meter;
  Clock::time_point last_traffic{};   // the last message sent or received on our connection
  std::string peer_connection;        // routing id of the peer's connection to our ROUTER
  // Jobs of ours the peer did not know at the last handshake: asked again after
  // job_probe_interval, which doubles up to backoff_max_ms (never a handshake per tick).
  Clock::time_point job_probe_at{};
  int job_probe_interval_ms = 0;
  size_t jobs_at_probe = 0;

  PeerLinkStats stats;
};

namespace {

constexpr int kMonitorEvents = ZMQ_EVENT_CONNECTED | ZMQ_EVENT_DISCONNECTED |
                               ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH |
                               ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                               ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL;
constexpr int kTickMs = 250;
// Tensors of a packed delta share a payload frame until it holds this much; a larger
// encoded tensor travels alone, without a copy.
constexpr uint64_t kPackFrameBytes = 64 * 1024;

uint64_t Numel(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

std::string Str(const flatbuffers::String* s) { return s ? s->str() : std::string(); }

void FinishEnvelope(flatbuffers::FlatBufferBuilder& fbb, uint64_t id, wire::Body type,
                    flatbuffers::Offset<void> body) {
  wire::EnvelopeBuilder env(fbb);
  env.add_request_id(id);
  env.add_body_type(type);
  env.add_body(body);
  fbb.Finish(env.Finish(), wire::EnvelopeIdentifier());
}

}  // namespace

int64_t InFlightBudgetMs(int64_t timeout_ms, uint64_t bytes_in_flight, double bandwidth_bps,
                         double min_bandwidth_bps) {
  double bw = std::max({bandwidth_bps, min_bandwidth_bps, 1.0});
  return timeout_ms + static_cast<int64_t>(2000.0 * static_cast<double>(bytes_in_flight) / bw);
}

std::optional<double> BandwidthMeter::OnAck(Clock::time_point sent, Clock::time_point acked,
                                            uint64_t bytes, bool resent) {
  if (resent) {
    // Its ack may answer an earlier copy still draining from a dropped connection.
    pool_bytes_ = 0;
    pool_start_ = acked;
    last_answer_ = std::max(last_answer_, acked);
    return std::nullopt;
  }
  if (sent >= last_answer_ || pool_bytes_ == 0) {
    // Sent onto an idle link (a new busy period), or the pool was just emptied.
    pool_start_ = std::max(sent, last_answer_);
    if (sent >= last_answer_) pool_bytes_ = 0;
  }
  pool_bytes_ += bytes;
  last_answer_ = std::max(last_answer_, acked);
  if (pool_bytes_ < min_sample_bytes_) return std::nullopt;
  double seconds = std::chrono::duration<double>(acked - pool_start_).count();
  uint64_t pooled = pool_bytes_;
  pool_bytes_ = 0;
  pool_start_ = acked;
  if (seconds <= 0) return std::nullopt;
  sum_bytes_ = (1.0 - weight_) * sum_bytes_ + static_cast<double>(pooled);
  sum_seconds_ = (1.0 - weight_) * sum_seconds_ + seconds;
  return sum_bytes_ / sum_seconds_;
}

void BandwidthMeter::OnOtherReply(Clock::time_point at) {
  last_answer_ = std::max(last_answer_, at);
}

void BandwidthMeter::Restart(Clock::time_point at) {
  pool_bytes_ = 0;
  pool_start_ = at;
  last_answer_ = at;
}

Result<PeerLinkSpec> ParsePeerLinkSpec(const std::string& text) {
  // Split at the first two '=' (as server/config.cc does): the key file path may hold '='.
  auto first = text.find('=');
  auto last = first == std::string::npos ? first : text.find('=', first + 1);
  if (first == std::string::npos || last == std::string::npos || first == 0 ||
      last + 1 == text.size()) {
    return Status::InvalidArgument("sync.peers entry '" + text +
                                   "' is not SITE=ENDPOINT=PUBKEYFILE");
  }
  PeerLinkSpec spec;
  spec.site = text.substr(0, first);
  spec.endpoint = text.substr(first + 1, last - first - 1);
  if (spec.endpoint.empty()) {
    return Status::InvalidArgument("sync.peers entry '" + text + "' has an empty endpoint");
  }
  auto key = LoadPublicKeyFile(text.substr(last + 1));
  if (!key.ok()) {
    return Status(key.status().code(),
                  "sync.peers entry for site '" + spec.site + "': " + key.status().message());
  }
  spec.public_key = *key;
  return spec;
}

Result<std::vector<PeerLinkSpec>> ParsePeerLinkSpecs(const std::vector<std::string>& texts) {
  std::vector<PeerLinkSpec> out;
  for (const auto& t : texts) {
    ISTHMUS_ASSIGN_OR_RETURN(auto spec, ParsePeerLinkSpec(t));
    out.push_back(std::move(spec));
  }
  return out;
}

PeerLinks::PeerLinks(zmq::context_t& ctx, PeerLinkOptions options, DeltaSource* source,
                     DeltaSink* sink)
    : ctx_(ctx), options_(std::move(options)), source_(source), sink_(sink) {}

PeerLinks::~PeerLinks() {
  for (auto& link : links_) CloseDealer(*link);
  router_.reset();
}

Status PeerLinks::Start() {
  std::set<std::string> sites, keys;
  for (const auto& p : options_.peers) {
    if (p.site.empty() || p.site == options_.site) {
      return Status::InvalidArgument("sync.peers: peer site '" + p.site +
                                     "' is empty or this site's own name");
    }
    if (!sites.insert(p.site).second) {
      return Status::InvalidArgument("sync.peers: site '" + p.site + "' is listed twice");
    }
    if (!options_.insecure_plaintext && !keys.insert(p.public_key).second) {
      return Status::InvalidArgument("sync.peers: two sites share the key of '" + p.site + "'");
    }
    auto link = std::make_unique<Link>();
    link->spec = p;
    link->stats.site = p.site;
    link->stats.endpoint = p.endpoint;
    link->meter.emplace(options_.min_sample_bytes, options_.bandwidth_ewma);
    by_key_[p.public_key] = link.get();
    links_.push_back(std::move(link));
  }
  if (!options_.listen_endpoint.empty()) {
    try {
      router_ = std::make_unique<zmq::socket_t>(ctx_, zmq::socket_type::router);
      router_->set(zmq::sockopt::linger, 0);
      router_->set(zmq::sockopt::sndhwm, 0);
      router_->set(zmq::sockopt::rcvhwm, 0);
      router_->set(zmq::sockopt::maxmsgsize,
                   static_cast<int64_t>(options_.limits.max_payload_bytes +
                                        options_.limits.max_header_bytes));
      if (!options_.insecure_plaintext) ConfigureCurveServer(*router_, options_.keys, kDomainPeer);
      router_->bind(options_.listen_endpoint);
    } catch (const zmq::error_t& e) {
      router_.reset();
      return Status::Unavailable("cannot bind the peer socket to '" + options_.listen_endpoint +
                                 "': " + e.what() + " (is the port in use? set listen.peer)");
    }
  }
  for (auto& link : links_) ISTHMUS_RETURN_IF_ERROR(OpenDealer(*link));
  return Status::Ok();
}

Status PeerLinks::OpenDealer(Link& link) {
  CloseDealer(link);
  try {
    link.dealer = std::make_unique<zmq::socket_t>(ctx_, zmq::socket_type::dealer);
    link.dealer->set(zmq::sockopt::linger, 0);
    // The window bounds what is queued; sends must never block the event loop.
    link.dealer->set(zmq::sockopt::sndhwm, 0);
    link.dealer->set(zmq::sockopt::rcvhwm, 0);
    link.dealer->set(zmq::sockopt::reconnect_ivl, std::min(100, options_.backoff_max_ms));
    link.dealer->set(zmq::sockopt::reconnect_ivl_max, options_.backoff_max_ms);
    if (!options_.insecure_plaintext) {
      ConfigureCurveClient(*link.dealer, options_.keys, link.spec.public_key);
    }
    link.monitor_endpoint = "inproc://isthmus-peer-monitor-" +
                            std::to_string(reinterpret_cast<uintptr_t>(this)) + "-" +
                            std::to_string(++monitor_seq_);
    if (zmq_socket_monitor(link.dealer->handle(), link.monitor_endpoint.c_str(), kMonitorEvents) !=
        0) {
      return Status::Internal("cannot monitor the peer socket: " +
                              std::string(zmq_strerror(zmq_errno())));
    }
    link.monitor = std::make_unique<zmq::socket_t>(ctx_, zmq::socket_type::pair);
    link.monitor->set(zmq::sockopt::linger, 0);
    link.monitor->connect(link.monitor_endpoint);
    link.dealer->connect(link.spec.endpoint);
  } catch (const zmq::error_t& e) {
    return Status::InvalidArgument("cannot connect to peer '" + link.spec.site + "' at '" +
                                   link.spec.endpoint + "': " + e.what());
  }
  link.transport_up = false;
  link.reconnecting = false;
  link.ready = false;
  link.inflight.clear();
  if (link.meter) link.meter->Restart(Clock::now());
  SendHello(link);
  return Status::Ok();
}

void PeerLinks::CountSent(Link& link, const flatbuffers::FlatBufferBuilder& header,
                          const std::vector<PayloadRef>& payload) {
  std::vector<uint64_t> sizes;
  for (const auto& p : payload) sizes.push_back(p.size);
  const uint64_t w = ZmtpMessageWireBytes(header.GetSize(), sizes, !options_.insecure_plaintext);
  link.stats.wire_bytes_sent += w;
  link.stats.tcp_bytes_estimate += TcpIpBytesEstimate(w, 1);
  ++link.stats.messages_sent;
}

void PeerLinks::CountReceived(Link& link, const Frames& msg) {
  std::vector<uint64_t> sizes;
  for (const auto& p : msg.payload) sizes.push_back(p.size());
  const uint64_t w =
      ZmtpMessageWireBytes(msg.header.size(), sizes, !options_.insecure_plaintext);
  link.stats.wire_bytes_received += w;
  link.stats.tcp_bytes_estimate += TcpIpBytesEstimate(w, 1);
  ++link.stats.messages_received;
}

void PeerLinks::CountConnection(Link& link, bool client_side) {
  const bool curve = !options_.insecure_plaintext;
  link.stats.wire_bytes_sent += HandshakeWireBytes(client_side, curve);
  link.stats.wire_bytes_received += HandshakeWireBytes(!client_side, curve);
  link.stats.tcp_bytes_estimate += kTcpConnectionBytesEstimate;
  ++link.stats.connections;
}

void PeerLinks::CloseDealer(Link& link) {
  if (link.dealer) zmq_socket_monitor(link.dealer->handle(), nullptr, 0);
  link.monitor.reset();
  link.dealer.reset();
  link.transport_up = false;
  link.ready = false;
  link.stats.connected = false;
}

int PeerLinks::CurrentTimeoutMs(const Link& link) const {
  int64_t t = options_.resend_ms;
  for (int i = 0; i < link.failures && t < options_.backoff_max_ms; ++i) t *= 2;
  return static_cast<int>(
      std::min<int64_t>(t, std::max(options_.backoff_max_ms, options_.resend_ms)));
}

PeerLinks::Clock::time_point PeerLinks::Deadline(const Link& link) const {
  if (link.inflight.empty()) return Clock::time_point::max();
  // Counted from the later of the oldest send and the last answer: a link that keeps
  // answering is draining its queue, however slowly.
  Clock::time_point oldest = Clock::time_point::max();
  uint64_t bytes = 0;
  for (const auto& [id, f] : link.inflight) {
    oldest = std::min(oldest, f.sent);
    bytes += f.bytes;
  }
  Clock::time_point anchor = std::max(oldest, link.last_progress);
  return anchor +
         std::chrono::milliseconds(InFlightBudgetMs(
             CurrentTimeoutMs(link), bytes, link.stats.bandwidth_bps, options_.min_bandwidth_bps));
}

void PeerLinks::SendHello(Link& link) {
  if (!link.dealer || link.paused) return;
  flatbuffers::FlatBufferBuilder fbb;
  std::vector<flatbuffers::Offset<wire::PeerJob>> jobs;
  for (const auto& job : source_->SyncJobs()) {
    std::string digest = options_.initial_digest ? options_.initial_digest(job) : "";
    jobs.push_back(wire::CreatePeerJob(fbb, fbb.CreateString(job), fbb.CreateString(digest), 0));
  }
  auto body = wire::CreatePeerHello(fbb, fbb.CreateString(options_.site), options_.shard_index,
                                    fbb.CreateVector(jobs));
  uint64_t id = ++link.request_seq;
  FinishEnvelope(fbb, id, wire::Body::PeerHello, body.Union());
  Status s = SendMessage(*link.dealer, nullptr, fbb, {});
  if (!s.ok()) {
    link.stats.last_error = s.ToString();
    return;
  }
  CountSent(link, fbb, {});
  link.ready = false;
  link.inflight.clear();
  link.last_traffic = Clock::now();
  link.inflight[id] = Link::InFlight{Link::InFlight::Kind::kHello, "", 0, 0, Clock::now()};
}

void PeerLinks::SendPing(Link& link) {
  flatbuffers::FlatBufferBuilder fbb;
  auto body = wire::CreatePeerPing(fbb, fbb.CreateString(options_.site));
  uint64_t id = ++link.request_seq;
  FinishEnvelope(fbb, id, wire::Body::PeerPing, body.Union());
  Status s = SendMessage(*link.dealer, nullptr, fbb, {});
  if (!s.ok()) {
    link.stats.last_error = s.ToString();
    return;
  }
  CountSent(link, fbb, {});
  ++link.stats.keepalives;
  link.last_traffic = Clock::now();
  link.inflight[id] = Link::InFlight{Link::InFlight::Kind::kPing, "", 0, 0, Clock::now()};
}

void PeerLinks::Reset(Link& link, const std::string& why, bool reopen) {
  ++link.failures;
  ++link.stats.resends;
  link.stats.last_error = why;
  link.ready = false;
  link.inflight.clear();
  link.retry_at = Clock::now() + std::chrono::milliseconds(CurrentTimeoutMs(link));
  if (reopen) {
    // A fresh socket drops whatever the stalled connection still queues.
    Status s = OpenDealer(link);
    if (!s.ok()) link.stats.last_error = s.ToString();
  }
  spdlog::info("peer {}: {} (retry in {} ms)", link.spec.site, why, CurrentTimeoutMs(link));
}

void PeerLinks::Pump(Link& link) {
  if (!link.dealer || link.paused || !link.ready) return;
  for (auto& [job, jl] : link.jobs) {
    uint64_t high = source_->OutboxHighRound(job);
    while (link.inflight.size() < static_cast<size_t>(std::max(1, options_.window)) &&
           jl.next <= high) {
      auto delta = source_->OutboxDelta(job, jl.next);
      if (!delta.ok()) {
        link.stats.last_error = "outbox round " + std::to_string(jl.next) + " of job '" + job +
                                "' unavailable: " + delta.status().ToString();
        break;
      }
      std::shared_ptr<const EncodedDelta> d = *delta;
      // Packed layout (schemas/isthmus.fbs, PeerDelta): byte counts in name order, the
      // bytes end to end; small tensors share a frame (one copy), large ones go alone
      // without a copy.
      std::vector<size_t> order(d->tensors.size());
      for (size_t i = 0; i < order.size(); ++i) order[i] = i;
      std::sort(order.begin(), order.end(),
                [&](size_t a, size_t b) { return d->tensors[a].name < d->tensors[b].name; });
      flatbuffers::FlatBufferBuilder fbb;
      std::vector<uint32_t> sizes, frame_ends;
      std::vector<PayloadRef> payload;
      std::shared_ptr<std::string> packing;
      auto close_packing = [&] {
        if (!packing) return;
        payload.push_back(PayloadRef{packing->data(), packing->size(), packing});
        frame_ends.push_back(static_cast<uint32_t>(sizes.size()));
        packing.reset();
      };
      uint64_t raw = 0;
      for (size_t i : order) {
        const auto& t = d->tensors[i];
        sizes.push_back(static_cast<uint32_t>(t.bytes.size()));
        raw += Numel(t.shape) * sizeof(float);
        if (t.bytes.size() >= kPackFrameBytes) {
          close_packing();
          // Zero-copy: the frame borrows the outbox's bytes and keeps the delta alive.
          payload.push_back(PayloadRef{t.bytes.data(), t.bytes.size(),
                                       std::shared_ptr<const void>(d, t.bytes.data())});
          frame_ends.push_back(static_cast<uint32_t>(sizes.size()));
          continue;
        }
        if (!packing) packing = std::make_shared<std::string>();
        packing->append(t.bytes);
        if (packing->size() >= kPackFrameBytes) close_packing();
      }
      close_packing();
      auto body = wire::CreatePeerDelta(fbb, fbb.CreateString(job), fbb.CreateString(options_.site),
                                        jl.next, d->tokens, 0, fbb.CreateVector(sizes),
                                        fbb.CreateVector(frame_ends));
      uint64_t id = ++link.request_seq;
      FinishEnvelope(fbb, id, wire::Body::PeerDelta, body.Union());
      Status s = SendMessage(*link.dealer, nullptr, fbb, payload);
      if (!s.ok()) {
        link.stats.last_error = s.ToString();
        return;
      }
      CountSent(link, fbb, payload);
      link.last_traffic = Clock::now();
      uint64_t& high = link.high_sent[job];
      link.inflight[id] = Link::InFlight{Link::InFlight::Kind::kDelta, job, jl.next,
                                         d->WireBytes(), Clock::now(), jl.next <= high};
      high = std::max(high, jl.next);
      link.stats.bytes_sent += d->WireBytes();
      link.stats.raw_bytes_sent += raw;
      ++link.stats.deltas_sent;
      ++jl.next;
    }
  }
}

void PeerLinks::OnDealerReadable(Link& link) {
  for (int n = 0; n < 64 && link.dealer; ++n) {
    auto msg = ReceiveMessage(*link.dealer, nullptr);
    if (!msg.ok()) {
      if (msg.status().code() != Code::kTimeout) link.stats.last_error = msg.status().ToString();
      return;
    }
    CountReceived(link, *msg);
    link.last_traffic = Clock::now();
    auto env = ParseEnvelope(msg->header, options_.limits);
    if (!env.ok()) {
      link.stats.last_error = "bad reply from peer: " + env.status().ToString();
      continue;
    }
    auto it = link.inflight.find((*env)->request_id());
    if (it == link.inflight.end()) continue;  // a reply to a request we gave up on
    Link::InFlight sent = it->second;
    link.inflight.erase(it);
    auto now = Clock::now();
    Status err = ErrorFromEnvelope(*env);
    if (!err.ok()) {
      // The peer refused (paused, digest mismatch, malformed): back off and handshake again.
      ++link.stats.refused;
      const char* what = sent.kind == Link::InFlight::Kind::kHello ? "the handshake"
                         : sent.kind == Link::InFlight::Kind::kPing ? "a keep-alive"
                                                                    : nullptr;
      Reset(link,
            "peer refused " + (what ? std::string(what) : "round " + std::to_string(sent.round)) +
                ": " + err.ToString(),
            false);
      return;
    }
    link.last_progress = now;
    link.failures = 0;
    if (sent.kind != Link::InFlight::Kind::kDelta) link.meter->OnOtherReply(now);
    if ((*env)->body_type() == wire::Body::PeerPong && sent.kind == Link::InFlight::Kind::kPing) {
      continue;
    }
    if ((*env)->body_type() == wire::Body::PeerHelloReply &&
        sent.kind == Link::InFlight::Kind::kHello) {
      const auto* reply = (*env)->body_as_PeerHelloReply();
      std::map<std::string, Link::JobLink> jobs;
      std::string mismatch;
      if (reply->jobs()) {
        for (const auto* pj : *reply->jobs()) {
          std::string job = pj->job()->str();
          std::string ours = options_.initial_digest ? options_.initial_digest(job) : "";
          std::string theirs = Str(pj->initial_digest());
          if (!ours.empty() && !theirs.empty() && ours != theirs) {
            mismatch = job;
            continue;
          }
          Link::JobLink jl;
          jl.acked = pj->held_round();
          jl.next = jl.acked + 1;
          jobs[job] = jl;
          source_->OnPeerAck(link.spec.site, job, jl.acked);
        }
      }
      link.jobs = std::move(jobs);
      link.ready = true;
      // Jobs of ours the peer did not know are asked for again later, the wait doubling
      // (up to backoff_max_ms) while our job set stays the same.
      const size_t ours = source_->SyncJobs().size();
      link.job_probe_interval_ms =
          ours != link.jobs_at_probe || link.job_probe_interval_ms == 0
              ? options_.resend_ms
              : std::min(2 * link.job_probe_interval_ms,
                         std::max(options_.backoff_max_ms, options_.resend_ms));
      link.jobs_at_probe = ours;
      link.job_probe_at = now + std::chrono::milliseconds(link.job_probe_interval_ms);
      link.stats.connected = true;
      link.stats.last_error = mismatch.empty() ? ""
                                               : "initial state of job '" + mismatch +
                                                     "' differs from the peer's; not syncing it";
    } else if ((*env)->body_type() == wire::Body::PeerAck &&
               sent.kind == Link::InFlight::Kind::kDelta) {
      const auto* ack = (*env)->body_as_PeerAck();
      auto jit = link.jobs.find(sent.job);
      if (jit == link.jobs.end()) continue;
      auto& jl = jit->second;
      jl.acked = std::max(jl.acked, ack->held_round());
      // The peer lacks an earlier round it should hold (it lost state): send from there.
      if (ack->held_round() < sent.round) jl.next = std::min(jl.next, ack->held_round() + 1);
      ++link.stats.deltas_acked;
      source_->OnPeerAck(link.spec.site, sent.job, jl.acked);
      if (auto estimate = link.meter->OnAck(sent.sent, now, sent.bytes, sent.resent)) {
        double& bw = link.stats.bandwidth_bps;
        bw = *estimate;
        source_->OnLinkBandwidth(link.spec.site, bw);
      }
    } else {
      link.stats.last_error = "unexpected reply type from peer";
    }
  }
}

void PeerLinks::OnMonitorReadable(Link& link) {
  while (link.monitor) {
    zmq::message_t event, addr;
    if (!link.monitor->recv(event, zmq::recv_flags::dontwait)) return;
    if (event.more()) (void)link.monitor->recv(addr, zmq::recv_flags::none);
    if (event.size() < 6) continue;
    uint16_t id;
    uint32_t value;
    std::memcpy(&id, event.data(), 2);
    std::memcpy(&value, static_cast<const char*>(event.data()) + 2, 4);
    switch (id) {
      case ZMQ_EVENT_HANDSHAKE_SUCCEEDED:
        CountConnection(link, /*client_side=*/true);
        link.transport_up = true;
        // A new connection: whatever was in flight on the old one may be lost.
        if (link.reconnecting) SendHello(link);
        link.reconnecting = false;
        break;
      case ZMQ_EVENT_DISCONNECTED:
        link.transport_up = false;
        link.reconnecting = true;
        link.ready = false;
        link.stats.connected = false;
        break;
      case ZMQ_EVENT_HANDSHAKE_FAILED_AUTH:
        CountConnection(link, /*client_side=*/true);
        ++link.stats.auth_failures;
        link.stats.connected = false;
        link.stats.last_error = "peer refused our key (status " + std::to_string(value) +
                                "): is it on the peer's security.peer_keys allowlist?";
        break;
      case ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL:
      case ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        link.stats.connected = false;
        link.stats.last_error = "handshake with the peer failed (wrong server key in sync.peers?)";
        break;
      default:
        break;
    }
  }
}

void PeerLinks::OnRouterReadable() {
  for (int n = 0; n < 64 && router_; ++n) {
    zmq::message_t routing_id;
    auto msg = ReceiveMessage(*router_, &routing_id);
    if (!msg.ok()) {
      if (msg.status().code() == Code::kTimeout) return;
      ++refused_unknown_;
      continue;
    }
    std::string user_id;
    if (!options_.insecure_plaintext) {
      const char* uid = zmq_msg_gets(msg->header.handle(), "User-Id");
      if (uid != nullptr) user_id = uid;
    }
    flatbuffers::FlatBufferBuilder reply;
    Link* from = nullptr;
    Status s = HandlePeerMessage(user_id, *msg, reply, &from);
    if (!s.ok()) {
      uint64_t id = 0;
      if (auto env = ParseEnvelope(msg->header, options_.limits); env.ok())
        id = (*env)->request_id();
      reply.Clear();
      BuildErrorReply(reply, id, s);
      spdlog::warn("refused a peer message: {}", s.ToString());
    }
    Status sent = SendMessage(*router_, &routing_id, reply, {});
    if (!sent.ok()) spdlog::warn("could not answer a peer: {}", sent.ToString());
    if (from != nullptr) {
      // A routing id we have not seen from this peer is a new connection of theirs: its
      // handshake crossed the wire too.
      std::string connection(static_cast<const char*>(routing_id.data()), routing_id.size());
      if (connection != from->peer_connection) {
        from->peer_connection = std::move(connection);
        CountConnection(*from, /*client_side=*/false);
      }
      CountReceived(*from, *msg);
      if (sent.ok()) CountSent(*from, reply, {});
    }
  }
}

Status PeerLinks::HandlePeerMessage(const std::string& user_id, const Frames& msg,
                                    flatbuffers::FlatBufferBuilder& reply) {
  return HandlePeerMessage(user_id, msg, reply, nullptr);
}

Status PeerLinks::HandlePeerMessage(const std::string& user_id, const Frames& msg,
                                    flatbuffers::FlatBufferBuilder& reply, Link** from_out) {
  auto env_or = ParseEnvelope(msg.header, options_.limits);
  if (!env_or.ok()) {
    ++refused_unknown_;
    return env_or.status();
  }
  const wire::Envelope* env = *env_or;
  std::string claimed;
  if (env->body_type() == wire::Body::PeerHello) claimed = env->body_as_PeerHello()->site()->str();
  if (env->body_type() == wire::Body::PeerDelta) claimed = env->body_as_PeerDelta()->site()->str();
  if (env->body_type() == wire::Body::PeerPing) claimed = Str(env->body_as_PeerPing()->site());
  Link* from = nullptr;
  if (options_.insecure_plaintext) {
    from = FindLink(claimed);
  } else {
    auto it = by_key_.find(user_id);
    if (it != by_key_.end()) from = it->second;
  }
  if (from == nullptr) {
    ++refused_unknown_;
    return Status::PermissionDenied("this key is not configured for any site in sync.peers");
  }
  if (from_out != nullptr) *from_out = from;
  const bool ping = env->body_type() == wire::Body::PeerPing;
  Status s;
  if (env->body_type() != wire::Body::PeerHello && env->body_type() != wire::Body::PeerDelta &&
      !ping) {
    s = Status::InvalidArgument("not a peer message");
  } else if (claimed != from->spec.site) {
    s = Status::PermissionDenied("message claims site '" + claimed + "' but the key is site '" +
                                 from->spec.site + "'s");
  } else if (from->paused) {
    s = Status::Unavailable("the link to site '" + from->spec.site + "' is paused here");
  } else if (env->body_type() == wire::Body::PeerHello) {
    s = HandleHello(*from, env->body_as_PeerHello(), env->request_id(), reply);
  } else if (ping) {
    FinishEnvelope(reply, env->request_id(), wire::Body::PeerPong,
                   wire::CreatePeerPong(reply).Union());
  } else {
    s = HandleDelta(*from, env->body_as_PeerDelta(), msg, env->request_id(), reply);
  }
  if (!s.ok()) ++from->stats.refused;
  return s;
}

Status PeerLinks::HandleHello(Link& from, const wire::PeerHello* hello, uint64_t id,
                              flatbuffers::FlatBufferBuilder& reply) {
  if (hello->shard_index() >= 0 && options_.shard_index >= 0 &&
      hello->shard_index() != options_.shard_index) {
    return Status::FailedPrecondition("peer shard " + std::to_string(hello->shard_index()) +
                                      " connected to shard " +
                                      std::to_string(options_.shard_index) + " (check sync.peers)");
  }
  std::map<std::string, std::string> theirs;
  if (hello->jobs()) {
    for (const auto* pj : *hello->jobs()) theirs[pj->job()->str()] = Str(pj->initial_digest());
  }
  std::vector<flatbuffers::Offset<wire::PeerJob>> jobs;
  for (const auto& job : source_->SyncJobs()) {
    auto it = theirs.find(job);
    if (it == theirs.end()) continue;
    std::string ours = options_.initial_digest ? options_.initial_digest(job) : "";
    if (!ours.empty() && !it->second.empty() && ours != it->second) {
      return Status::FailedPrecondition("job '" + job + "': initial state differs between site '" +
                                        options_.site + "' and site '" + from.spec.site + "'");
    }
    jobs.push_back(wire::CreatePeerJob(reply, reply.CreateString(job), reply.CreateString(ours),
                                       sink_->HeldFrom(from.spec.site, job)));
  }
  auto body = wire::CreatePeerHelloReply(reply, reply.CreateString(options_.site),
                                         options_.shard_index, reply.CreateVector(jobs));
  FinishEnvelope(reply, id, wire::Body::PeerHelloReply, body.Union());
  return Status::Ok();
}

// A delta in the listed layout (one PeerTensor per tensor, each with its own frame).
Status PeerLinks::UnlistDelta(const wire::PeerDelta* req, const Frames& msg,
                              EncodedDelta* delta) const {
  const auto& lim = options_.limits;
  const auto* metas = req->tensors();
  size_t count = metas ? metas->size() : 0;
  if (count > lim.max_tensors) return Status::ResourceExhausted("too many tensors in a peer delta");
  if (count != msg.payload.size()) {
    return Status::InvalidArgument("peer delta lists " + std::to_string(count) +
                                   " tensors but has " + std::to_string(msg.payload.size()) +
                                   " payload frames");
  }
  std::vector<bool> used(count, false);
  std::set<std::string> names;
  for (size_t i = 0; i < count; ++i) {
    const auto* m = metas->Get(i);
    std::string name = m->name()->str();
    if (name.empty() || name.size() > lim.max_name_bytes || !names.insert(name).second) {
      return Status::InvalidArgument("peer delta tensor name empty, too long or repeated");
    }
    if (m->frame() >= count || used[m->frame()]) {
      return Status::InvalidArgument("tensor '" + name + "' names a bad or reused payload frame");
    }
    used[m->frame()] = true;
    const auto& frame = msg.payload[m->frame()];
    if (m->nbytes() != frame.size()) {
      return Status::InvalidArgument("tensor '" + name + "': nbytes does not match its frame");
    }
    EncodedTensor t;
    t.name = std::move(name);
    if (m->shape()) {
      if (m->shape()->size() > lim.max_dims) return Status::InvalidArgument("too many dims");
      uint64_t numel = 1;
      for (int64_t d : *m->shape()) {
        if (d < 0 || d > (int64_t{1} << 40)) return Status::InvalidArgument("bad dimension");
        numel *= static_cast<uint64_t>(d);
        if (numel > lim.max_payload_bytes) return Status::InvalidArgument("tensor too large");
      }
      t.shape.assign(m->shape()->begin(), m->shape()->end());
    }
    t.bytes.assign(static_cast<const char*>(frame.data()), frame.size());
    delta->tensors.push_back(std::move(t));
  }
  return Status::Ok();
}

// A packed delta: byte counts in the job's tensor order, the bytes end to end over the
// frames (schemas/isthmus.fbs). Every count and boundary is checked against the frames
// before a byte is read.
Status PeerLinks::UnpackDelta(const wire::PeerDelta* req, const Frames& msg,
                              EncodedDelta* delta) const {
  if (req->tensors() != nullptr && req->tensors()->size() > 0) {
    return Status::InvalidArgument("peer delta has both listed and packed tensors");
  }
  ISTHMUS_ASSIGN_OR_RETURN(auto layout, sink_->JobTensors(delta->job));
  const auto* sizes = req->sizes();
  const auto* ends = req->frame_ends();
  if (sizes->size() != layout.size()) {
    return Status::InvalidArgument("packed delta has " + std::to_string(sizes->size()) +
                                   " tensors, job '" + delta->job + "' has " +
                                   std::to_string(layout.size()) + " here");
  }
  const size_t frames = ends ? ends->size() : 0;
  if (frames != msg.payload.size()) {
    return Status::InvalidArgument("packed delta describes " + std::to_string(frames) +
                                   " frames but has " + std::to_string(msg.payload.size()));
  }
  size_t tensor = 0;
  for (size_t f = 0; f < frames; ++f) {
    const uint32_t end = ends->Get(f);
    if (end < tensor || end > layout.size()) {
      return Status::InvalidArgument("packed delta frame boundaries out of order");
    }
    const auto& frame = msg.payload[f];
    uint64_t at = 0;
    for (; tensor < end; ++tensor) {
      const uint64_t n = sizes->Get(static_cast<flatbuffers::uoffset_t>(tensor));
      if (n > frame.size() - at) {
        return Status::InvalidArgument("packed delta tensor runs past its frame");
      }
      EncodedTensor t;
      t.name = layout[tensor].first;
      t.shape = layout[tensor].second;
      t.bytes.assign(static_cast<const char*>(frame.data()) + at, n);
      at += n;
      delta->tensors.push_back(std::move(t));
    }
    if (at != frame.size()) {
      return Status::InvalidArgument("packed delta frame " + std::to_string(f) +
                                     " holds bytes no tensor claims");
    }
  }
  if (tensor != layout.size()) {
    return Status::InvalidArgument("packed delta frames end before its last tensor");
  }
  return Status::Ok();
}

Status PeerLinks::HandleDelta(Link& from, const wire::PeerDelta* req, const Frames& msg,
                              uint64_t id, flatbuffers::FlatBufferBuilder& reply) {
  const auto& lim = options_.limits;
  if (req->round() == 0) return Status::InvalidArgument("peer delta with round 0");
  if (req->job()->size() > lim.max_name_bytes) return Status::InvalidArgument("job name too long");
  if (msg.PayloadBytes() > lim.max_payload_bytes) {
    return Status::ResourceExhausted("peer delta payload over limits.max_message_bytes");
  }
  EncodedDelta delta;
  delta.job = req->job()->str();
  delta.site = req->site()->str();
  delta.round = req->round();
  delta.tokens = req->tokens();
  if (req->sizes() != nullptr) {
    ISTHMUS_RETURN_IF_ERROR(UnpackDelta(req, msg, &delta));
  } else {
    ISTHMUS_RETURN_IF_ERROR(UnlistDelta(req, msg, &delta));
  }
  from.stats.bytes_received += msg.PayloadBytes();
  ISTHMUS_ASSIGN_OR_RETURN(uint64_t held, sink_->ReceiveDelta(from.spec.site, delta));
  auto body = wire::CreatePeerAck(reply, reply.CreateString(delta.job),
                                  reply.CreateString(delta.site), delta.round, held);
  FinishEnvelope(reply, id, wire::Body::PeerAck, body.Union());
  return Status::Ok();
}

size_t PeerLinks::PollItemCount() const { return (router_ ? 1 : 0) + 2 * links_.size(); }

void PeerLinks::FillPollItems(zmq::pollitem_t* items) {
  poll_map_.clear();
  size_t k = 0;
  if (router_) {
    items[k++] = {router_->handle(), 0, ZMQ_POLLIN, 0};
    poll_map_.push_back(-1);
  }
  for (size_t i = 0; i < links_.size(); ++i) {
    auto& l = *links_[i];
    // A link between sockets (cannot happen after Start) is polled on nothing.
    items[k++] = {l.dealer ? l.dealer->handle() : nullptr, -1,
                  static_cast<short>(l.dealer ? ZMQ_POLLIN : 0), 0};
    poll_map_.push_back(static_cast<int>(2 * i));
    items[k++] = {l.monitor ? l.monitor->handle() : nullptr, -1,
                  static_cast<short>(l.monitor ? ZMQ_POLLIN : 0), 0};
    poll_map_.push_back(static_cast<int>(2 * i + 1));
  }
}

void PeerLinks::OnPoll(const zmq::pollitem_t* items) {
  for (size_t k = 0; k < poll_map_.size(); ++k) {
    if (!(items[k].revents & ZMQ_POLLIN)) continue;
    int m = poll_map_[k];
    if (m < 0) {
      OnRouterReadable();
    } else if (m % 2 == 0) {
      OnDealerReadable(*links_[m / 2]);
    } else {
      OnMonitorReadable(*links_[m / 2]);
    }
  }
}

void PeerLinks::Tick() {
  auto now = Clock::now();
  std::set<std::string> sync_jobs;
  bool jobs_known = false;
  for (auto& lp : links_) {
    Link& link = *lp;
    if (link.paused || !link.dealer) continue;
    // Timeouts: no answer for the current interval plus the expected transfer time.
    if (auto deadline = Deadline(link); now >= deadline) {
      Reset(link,
            "no answer from the peer within " + std::to_string(CurrentTimeoutMs(link)) +
                " ms after the expected transfer time",
            true);
      continue;
    }
    if (!link.ready && link.inflight.empty() && now >= link.retry_at) {
      SendHello(link);
      continue;
    }
    if (link.ready) {
      // A job created after the handshake: handshake again to learn the peer's ack.
      if (!jobs_known) {
        auto v = source_->SyncJobs();
        sync_jobs.insert(v.begin(), v.end());
        jobs_known = true;
      }
      bool unknown = false;
      for (const auto& j : sync_jobs) unknown |= link.jobs.count(j) == 0;
      if (unknown && link.inflight.empty()) {
        if (sync_jobs.size() != link.jobs_at_probe) link.job_probe_at = now;  // a new job here
        if (now >= link.job_probe_at) {
          SendHello(link);
          continue;
        }
      }
      Pump(link);
      // An idle link costs one small ping per keep-alive interval (backoff_max_ms), which
      // also notices a dead connection while there is nothing to send.
      if (link.inflight.empty() &&
          now - link.last_traffic >= std::chrono::milliseconds(options_.backoff_max_ms)) {
        SendPing(link);
      }
    }
  }
}

int PeerLinks::NextTimeoutMs() const {
  auto now = Clock::now();
  int64_t best = kTickMs;
  for (const auto& lp : links_) {
    const Link& link = *lp;
    if (link.paused) continue;
    if (auto deadline = Deadline(link); deadline != Clock::time_point::max()) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now);
      best = std::min<int64_t>(best, std::max<int64_t>(0, left.count()));
    }
    if (!link.ready && link.inflight.empty()) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(link.retry_at - now);
      best = std::min<int64_t>(best, std::max<int64_t>(0, left.count()));
    }
  }
  return static_cast<int>(best);
}

void PeerLinks::PollOnce(int max_wait_ms) {
  std::vector<zmq::pollitem_t> items(PollItemCount());
  FillPollItems(items.data());
  int wait = std::min(max_wait_ms, NextTimeoutMs());
  try {
    zmq::poll(items.data(), items.size(), std::chrono::milliseconds(wait));
    OnPoll(items.data());
  } catch (const zmq::error_t& e) {
    if (e.num() != EINTR) spdlog::warn("peer poll failed: {}", e.what());
  }
  Tick();
}

PeerLinks::Link* PeerLinks::FindLink(const std::string& site) {
  for (auto& l : links_) {
    if (l->spec.site == site) return l.get();
  }
  return nullptr;
}

Result<std::vector<PeerLinks::Link*>> PeerLinks::Select(const std::string& site) {
  std::vector<Link*> out;
  if (site.empty()) {
    for (auto& l : links_) out.push_back(l.get());
    return out;
  }
  Link* l = FindLink(site);
  if (l == nullptr) return Status::NotFound("no peer link to site '" + site + "'");
  out.push_back(l);
  return out;
}

Result<std::vector<std::string>> PeerLinks::SyncNow(const std::string& site) {
  ISTHMUS_ASSIGN_OR_RETURN(auto links, Select(site));
  std::vector<std::string> names;
  for (Link* l : links) {
    names.push_back(l->spec.site);
    if (l->paused) continue;
    l->failures = 0;
    l->retry_at = Clock::now();
    // The handshake re-reads the peer's acknowledgement; everything above it follows.
    SendHello(*l);
  }
  return names;
}

Result<std::vector<std::string>> PeerLinks::Pause(const std::string& site) {
  ISTHMUS_ASSIGN_OR_RETURN(auto links, Select(site));
  std::vector<std::string> names;
  for (Link* l : links) {
    names.push_back(l->spec.site);
    l->paused = true;
    l->ready = false;
    l->inflight.clear();
  }
  return names;
}

Result<std::vector<std::string>> PeerLinks::Resume(const std::string& site) {
  ISTHMUS_ASSIGN_OR_RETURN(auto links, Select(site));
  for (Link* l : links) l->paused = false;
  return SyncNow(site);
}

std::vector<PeerLinkStats> PeerLinks::Stats() const {
  std::vector<PeerLinkStats> out;
  auto jobs = source_->SyncJobs();
  for (const auto& lp : links_) {
    PeerLinkStats s = lp->stats;
    s.connected = lp->ready && !lp->paused;
    s.paused = lp->paused;
    for (const auto& job : jobs) {
      PeerLinkStats::Job j;
      j.job = job;
      auto it = lp->jobs.find(job);
      if (it != lp->jobs.end()) j.acked_round = it->second.acked;
      j.outbox_round = source_->OutboxHighRound(job);
      s.jobs.push_back(j);
    }
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace isthmus
