// Peer link state machines (handshake, windowed sends, acks, timeouts with backoff) and
// the receiving side's checks of who sent what.
#include "server/sync/peer_link.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>
#include <thread>

#include "common/transport.h"
#include "common/varint.h"

namespace isthmus {

struct PeerLinks::Link {
  PeerLinkSpec spec;
  bool dials = true;  // we open the connection (DEALER); else the peer connects to our ROUTER
  std::unique_ptr<zmq::socket_t> dealer;
  std::unique_ptr<zmq::socket_t> monitor;
  std::string monitor_endpoint;

  struct JobLink {
    uint64_t acked = 0;
    uint64_t next = 1;  // next round to send
  };
  struct InFlight {
    enum class Kind { kHello, kDelta, kPing, kMembership };
    Kind kind = Kind::kHello;
    std::string job;  // kDelta
    uint64_t round = 0;
    uint64_t bytes = 0;
    Clock::time_point sent;
    bool resent = false;           // this round was sent before (its ack may answer that copy)
    MembershipRequest membership;  // kMembership
  };
  bool transport_up = false;
  bool key_refused = false;             // the last CURVE handshake failed on the peer's allowlist
  Clock::time_point key_switched_at{};  // the last move to another listed key of the peer
  bool reconnecting = false;            // the connection dropped: handshake again once it is back
  bool ready = false;                   // the handshake was answered on the current connection
  bool paused = false;
  std::map<std::string, JobLink> jobs;  // jobs the peer syncs with us
  std::map<uint64_t, InFlight> inflight;
  // Our acknowledgements of the peer's deltas, held to ride in our next delta to it
  // (PeerDelta.ack_delay_ms); each is sent on its own at `due` at the latest.
  struct HeldAck {
    uint64_t request_id = 0;
    std::string job;
    Clock::time_point received, due;
    bool on_dealer = false;  // the delta came on our DEALER, else on `connection`
    std::string connection;
  };
  std::vector<HeldAck> held_acks;
  uint64_t request_seq = 0;
  int failures = 0;              // consecutive timeouts / refusals: the backoff exponent
  Clock::time_point retry_at{};  // while not ready and nothing in flight: next handshake
  Clock::time_point last_progress{};
  std::map<std::string, uint64_t> high_sent;  // per job, the highest round ever sent
  std::optional<BandwidthMeter> meter;
  Clock::time_point last_traffic{};  // the last message sent or received on our connection
  std::string peer_connection;       // routing id of the peer's connection to our ROUTER
  // When the peer dials: the connection its last handshake came on, which carries our
  // requests too (empty until then, and after a send found it gone).
  std::string channel;
  // Jobs of ours the peer did not know at the last handshake: asked again after
  // job_probe_interval, which doubles up to backoff_max_ms (never a handshake per tick).
  Clock::time_point job_probe_at{};
  int job_probe_interval_ms = 0;
  size_t jobs_at_probe = 0;
  Clock::time_point membership_at{};            // next look for membership requests to send
  Clock::time_point last_heard = Clock::now();  // the last message from the peer (or start)

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
// Bounds on acknowledgements held for piggybacking, whatever a peer asks for.
constexpr int64_t kMaxAckHoldMs = 60000;
constexpr size_t kMaxHeldAcks = 64;
constexpr uint64_t kMaxAckDelayUs = uint64_t{kMaxAckHoldMs} * 1000;

uint64_t Numel(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

std::string Str(const flatbuffers::String* s) { return s ? s->str() : std::string(); }

// What a peer asks of us; every other body is an answer to a request of ours.
bool IsPeerRequest(wire::Body type) {
  return type == wire::Body::PeerHello || type == wire::Body::PeerDelta ||
         type == wire::Body::PeerPing || type == wire::Body::PeerMembership;
}

flatbuffers::Offset<wire::MembershipState> WriteMembership(flatbuffers::FlatBufferBuilder& fbb,
                                                           const Membership& m) {
  std::vector<flatbuffers::Offset<flatbuffers::String>> sites;
  for (const auto& s : m.sites) sites.push_back(fbb.CreateString(s));
  return wire::CreateMembershipState(fbb, m.epoch, fbb.CreateVector(sites), m.from_round);
}

// A membership as a peer sent it; InvalidArgument unless its sites are sorted, distinct,
// non-empty names within the limits.
Result<Membership> ReadMembership(const wire::MembershipState* m, const WireLimits& lim) {
  if (m == nullptr || m->sites() == nullptr || m->sites()->size() == 0 ||
      m->sites()->size() > 4096) {
    return Status::InvalidArgument("membership without sites");
  }
  Membership out;
  out.epoch = m->epoch();
  out.from_round = m->from_round();
  for (const auto* s : *m->sites()) {
    if (s->size() == 0 || s->size() > lim.max_name_bytes ||
        (!out.sites.empty() && s->str() <= out.sites.back())) {
      return Status::InvalidArgument("membership sites are not sorted, distinct names");
    }
    out.sites.push_back(s->str());
  }
  return out;
}

wire::MembershipStepKind StepToWire(MembershipStep s) {
  switch (s) {
    case MembershipStep::kPrepare:
      return wire::MembershipStepKind::Prepare;
    case MembershipStep::kQuery:
      return wire::MembershipStepKind::Query;
    case MembershipStep::kJoin:
      return wire::MembershipStepKind::Join;
    case MembershipStep::kFetch:
      return wire::MembershipStepKind::Fetch;
    case MembershipStep::kDigest:
      return wire::MembershipStepKind::Digest;
  }
  return wire::MembershipStepKind::Prepare;
}

Result<MembershipStep> StepFromWire(wire::MembershipStepKind s) {
  switch (s) {
    case wire::MembershipStepKind::Prepare:
      return MembershipStep::kPrepare;
    case wire::MembershipStepKind::Query:
      return MembershipStep::kQuery;
    case wire::MembershipStepKind::Join:
      return MembershipStep::kJoin;
    case wire::MembershipStepKind::Fetch:
      return MembershipStep::kFetch;
    case wire::MembershipStepKind::Digest:
      return MembershipStep::kDigest;
  }
  return Status::InvalidArgument("unknown membership step");
}

// A joining site's view of a member's committed state: shapes and sizes checked against
// the limits and the payload, values copied out of the frames.
Result<std::shared_ptr<const JobImage>> ReadImage(const wire::JobImageMsg* m, const Frames& msg,
                                                  const WireLimits& lim) {
  if (m->tensors() == nullptr || m->members() == nullptr) {
    return Status::InvalidArgument("job image without tensors or members");
  }
  auto image = std::make_shared<JobImage>();
  image->round = m->round();
  image->digest = Str(m->digest());
  image->version = m->version();
  image->base_hash = Str(m->base_hash());
  ISTHMUS_ASSIGN_OR_RETURN(image->members, ReadMembership(m->members(), lim));
  const auto* mf = m->momentum_frames();
  if (mf != nullptr && mf->size() != m->tensors()->size()) {
    return Status::InvalidArgument("job image: momentum frames do not match its tensors");
  }
  auto frame_floats = [&](uint32_t f,
                          uint64_t numel) -> Result<std::shared_ptr<const std::vector<float>>> {
    if (f >= msg.payload.size() || msg.payload[f].size() != numel * sizeof(float)) {
      return Status::InvalidArgument("job image frame " + std::to_string(f) +
                                     " has the wrong size");
    }
    auto v = std::make_shared<std::vector<float>>(numel);
    if (numel > 0) std::memcpy(v->data(), msg.payload[f].data(), numel * sizeof(float));
    for (float x : *v) {
      if (!std::isfinite(x)) return Status::InvalidArgument("job image value is not finite");
    }
    return std::shared_ptr<const std::vector<float>>(std::move(v));
  };
  for (uint32_t i = 0; i < m->tensors()->size(); ++i) {
    const auto* t = m->tensors()->Get(i);
    ImageTensor it;
    it.name = t->name()->str();
    if (it.name.empty() || it.name.size() > lim.max_name_bytes ||
        (!image->tensors.empty() && it.name <= image->tensors.back().name)) {
      return Status::InvalidArgument("job image tensor names are not sorted, distinct names");
    }
    uint64_t numel = 1;
    if (t->shape() == nullptr || t->shape()->size() > 8) {
      return Status::InvalidArgument("job image tensor '" + it.name + "' has no usable shape");
    }
    for (int64_t d : *t->shape()) {
      if (d < 0 || d > int64_t{1} << 40 ||
          (d > 0 && numel > (uint64_t{1} << 40) / static_cast<uint64_t>(d))) {
        return Status::InvalidArgument("job image tensor '" + it.name + "' is too large");
      }
      it.shape.push_back(d);
      numel *= static_cast<uint64_t>(d);
    }
    ISTHMUS_ASSIGN_OR_RETURN(it.theta, frame_floats(t->frame(), numel));
    if (mf != nullptr) {
      ISTHMUS_ASSIGN_OR_RETURN(it.momentum, frame_floats(mf->Get(i), numel));
    }
    image->tensors.push_back(std::move(it));
  }
  return std::shared_ptr<const JobImage>(std::move(image));
}

// A delta in the packed layout (schemas/isthmus.fbs, PeerDelta): byte counts in name
// order, the bytes end to end; small tensors share a frame (one copy), a large one goes
// alone without a copy, its frame keeping the outbox's delta alive.
struct PackedDelta {
  std::string sizes;  // varints
  std::vector<uint32_t> frame_ends;
  std::vector<PayloadRef> payload;
  bool inline_first = false;  // payload[0] is a shared frame (may travel in the header)
  uint64_t raw_bytes = 0;     // fp32 size
};

PackedDelta PackDelta(const std::shared_ptr<const EncodedDelta>& d) {
  std::vector<size_t> order(d->tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return d->tensors[a].name < d->tensors[b].name; });
  PackedDelta out;
  size_t count = 0;
  std::shared_ptr<std::string> packing;
  auto close_packing = [&] {
    if (!packing) return;
    if (out.payload.empty()) out.inline_first = true;
    out.payload.push_back(PayloadRef{packing->data(), packing->size(), packing});
    out.frame_ends.push_back(static_cast<uint32_t>(count));
    packing.reset();
  };
  for (size_t i : order) {
    const auto& t = d->tensors[i];
    PutVarint(&out.sizes, t.bytes.size());
    out.raw_bytes += Numel(t.shape) * sizeof(float);
    const bool alone = t.bytes.size() >= kPackFrameBytes;
    if (alone) close_packing();  // the shared frame ends before this tensor
    ++count;
    if (alone) {
      out.payload.push_back(PayloadRef{t.bytes.data(), t.bytes.size(),
                                       std::shared_ptr<const void>(d, t.bytes.data())});
      out.frame_ends.push_back(static_cast<uint32_t>(count));
      continue;
    }
    if (!packing) packing = std::make_shared<std::string>();
    packing->append(t.bytes);
    if (packing->size() >= kPackFrameBytes) close_packing();
  }
  close_packing();
  return out;
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

Result<PeerDial> ParsePeerDial(const std::string& text) {
  if (text == "auto") return PeerDial::kAuto;
  if (text == "always") return PeerDial::kAlways;
  if (text == "never") return PeerDial::kNever;
  return Status::InvalidArgument("sync.dial is '" + text + "'; use auto, always or never");
}

Result<PeerLinkSpec> ParsePeerLinkSpec(const std::string& text) {
  // Split at the first two '=' (as server/config/config.cc does): the key file path may hold '='.
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
  spec.key_file = text.substr(last + 1);
  auto keys = LoadPublicKeyList(spec.key_file);
  if (!keys.ok()) {
    return Status(keys.status().code(),
                  "sync.peers entry for site '" + spec.site + "': " + keys.status().message());
  }
  spec.public_keys = std::move(keys).value();
  spec.public_key = spec.public_keys.front();
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
    for (const auto& k :
         p.public_keys.empty() ? std::vector<std::string>{p.public_key} : p.public_keys) {
      if (!options_.insecure_plaintext && !keys.insert(k).second) {
        return Status::InvalidArgument("sync.peers: two sites share the key of '" + p.site + "'");
      }
    }
    auto link = std::make_unique<Link>();
    link->spec = p;
    // Without a listener of our own nobody can reach us: we dial.
    link->dials = options_.listen_endpoint.empty() || options_.dial == PeerDial::kAlways ||
                  (options_.dial == PeerDial::kAuto && options_.site < p.site);
    link->stats.dials = link->dials;
    link->stats.site = p.site;
    link->stats.endpoint = p.endpoint;
    link->meter.emplace(options_.min_sample_bytes, options_.bandwidth_ewma);
    if (link->spec.public_keys.empty()) link->spec.public_keys = {p.public_key};
    for (const auto& k : link->spec.public_keys) by_key_[k] = link.get();
    links_.push_back(std::move(link));
  }
  if (!options_.listen_endpoint.empty()) {
    ISTHMUS_RETURN_IF_ERROR(BindRouter(options_.listen_endpoint));
  }
  for (auto& link : links_) {
    if (link->dials) ISTHMUS_RETURN_IF_ERROR(OpenDealer(*link));
  }
  return Status::Ok();
}

Status PeerLinks::BindRouter(const std::string& endpoint) {
  try {
    router_ = std::make_unique<zmq::socket_t>(ctx_, zmq::socket_type::router);
    router_->set(zmq::sockopt::linger, 0);
    router_->set(zmq::sockopt::sndhwm, 0);
    router_->set(zmq::sockopt::rcvhwm, 0);
    // A send to a connection that has gone fails instead of vanishing (Transmit).
    router_->set(zmq::sockopt::router_mandatory, true);
    router_->set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(options_.limits.max_payload_bytes +
                                                                options_.limits.max_header_bytes));
    if (!options_.insecure_plaintext) ConfigureCurveServer(*router_, options_.keys, kDomainPeer);
    router_->bind(endpoint);
  } catch (const zmq::error_t& e) {
    router_.reset();
    return Status::Unavailable("cannot bind the peer socket to '" + endpoint + "': " + e.what() +
                               " (is the port in use? set listen.peer)");
  }
  return Status::Ok();
}

Status PeerLinks::OpenDealer(Link& link) {
  CloseDealer(link);
  try {
    link.dealer = std::make_unique<zmq::socket_t>(ctx_, zmq::socket_type::dealer);
    link.dealer->set(zmq::sockopt::linger, 0);
    // The window bounds what is queued; sends must never block the event loop (without a
    // connection, e.g. after the peer refused our key, a DEALER would block: fail instead).
    link.dealer->set(zmq::sockopt::sndhwm, 0);
    link.dealer->set(zmq::sockopt::sndtimeo, 0);
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

// What an error on a link whose last handshake failed on the peer's allowlist adds.
std::string PeerLinks::KeyHint(const Link& link) {
  return link.key_refused
             ? " (the peer refused our key: is it on the peer's security.peer_keys allowlist?)"
             : "";
}

bool PeerLinks::CanSend(const Link& link) const {
  return link.dials ? link.dealer != nullptr : router_ != nullptr && !link.channel.empty();
}

Status PeerLinks::Transmit(Link& link, const flatbuffers::FlatBufferBuilder& header,
                           const std::vector<PayloadRef>& payload) {
  if (!CanSend(link)) return Status::Unavailable("no connection to peer '" + link.spec.site + "'");
  Status s;
  if (link.dials) {
    s = SendMessage(*link.dealer, nullptr, header, payload);
  } else {
    zmq::message_t to(link.channel.data(), link.channel.size());
    s = SendMessage(*router_, &to, header, payload);
    if (!s.ok()) {
      // Gone (the peer closed it, or a new connection of theirs replaced it): wait for
      // the peer to dial again; its handshake names the new connection.
      link.channel.clear();
      link.ready = false;
      link.inflight.clear();
      link.stats.connected = false;
    }
  }
  if (!s.ok()) {
    link.stats.last_error = s.ToString() + KeyHint(link);
    return s;
  }
  CountSent(link, header, payload);
  link.last_traffic = Clock::now();
  return s;
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
  const uint64_t w = ZmtpMessageWireBytes(msg.header.size(), sizes, !options_.insecure_plaintext);
  link.stats.wire_bytes_received += w;
  link.stats.tcp_bytes_estimate += TcpIpBytesEstimate(w, 1);
  ++link.stats.messages_received;
  link.last_heard = Clock::now();
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
  bool deltas = false;
  for (const auto& [id, f] : link.inflight) {
    oldest = std::min(oldest, f.sent);
    bytes += f.bytes;
    deltas |= f.kind == Link::InFlight::Kind::kDelta;
  }
  Clock::time_point anchor = std::max(oldest, link.last_progress);
  // The peer may hold a delta's ack (ack_delay_ms) before it answers.
  if (deltas) anchor += std::chrono::milliseconds(std::max(0, options_.ack_delay_ms));
  return anchor +
         std::chrono::milliseconds(InFlightBudgetMs(
             CurrentTimeoutMs(link), bytes, link.stats.bandwidth_bps, options_.min_bandwidth_bps));
}

void PeerLinks::SendHello(Link& link) {
  if (!CanSend(link) || link.paused) return;
  const auto our_jobs = source_->SyncJobs();
  if (our_jobs.empty()) {
    // Nothing to sync yet: the handshake waits for the first job (looked for every tick).
    link.ready = false;
    link.inflight.clear();
    link.retry_at = Clock::now() + std::chrono::milliseconds(kTickMs);
    return;
  }
  flatbuffers::FlatBufferBuilder fbb;
  std::vector<flatbuffers::Offset<wire::PeerJob>> jobs;
  for (const auto& job : our_jobs) {
    std::string digest = options_.initial_digest ? options_.initial_digest(job) : "";
    jobs.push_back(wire::CreatePeerJob(fbb, fbb.CreateString(job), fbb.CreateString(digest),
                                       sink_->HeldFrom(link.spec.site, job),
                                       sink_->RemovedFrom(link.spec.site, job)));
  }
  auto body = wire::CreatePeerHello(fbb, fbb.CreateString(options_.site), options_.shard_index,
                                    fbb.CreateVector(jobs));
  uint64_t id = ++link.request_seq;
  FinishEnvelope(fbb, id, wire::Body::PeerHello, body.Union());
  spdlog::debug("peer {}: handshake sent ({} job(s))", link.spec.site, our_jobs.size());
  if (!Transmit(link, fbb, {}).ok()) {
    link.retry_at = Clock::now() + std::chrono::milliseconds(CurrentTimeoutMs(link));
    return;
  }
  link.ready = false;
  link.inflight.clear();
  link.inflight[id] =
      Link::InFlight{Link::InFlight::Kind::kHello, "", 0, 0, Clock::now(), false, {}};
}

void PeerLinks::SendMembership(Link& link, Clock::time_point now) {
  if (now < link.membership_at) return;
  for (const auto& [id, f] : link.inflight) {
    if (f.kind == Link::InFlight::Kind::kMembership) return;  // one at a time
  }
  link.membership_at = now + std::chrono::milliseconds(options_.resend_ms);
  auto requests = source_->MembershipRequests(link.spec.site);
  if (requests.empty()) return;
  // One per look, the next look a resend interval later: changes are rare and small.
  const MembershipRequest& req = requests.front();
  flatbuffers::FlatBufferBuilder fbb;
  auto body = wire::CreatePeerMembership(
      fbb, options_.insecure_plaintext ? fbb.CreateString(options_.site) : 0,
      fbb.CreateString(req.job), StepToWire(req.step), WriteMembership(fbb, req.change.next),
      fbb.CreateString(req.change.coordinator));
  uint64_t id = ++link.request_seq;
  FinishEnvelope(fbb, id, wire::Body::PeerMembership, body.Union());
  if (!Transmit(link, fbb, {}).ok()) return;
  spdlog::debug("peer {}: membership {} for job '{}' sent (request {})", link.spec.site,
                MembershipStepName(req.step), req.job, id);
  Link::InFlight f;
  f.kind = Link::InFlight::Kind::kMembership;
  f.sent = now;
  f.membership = req;
  link.inflight[id] = std::move(f);
}

Status PeerLinks::HandleMembership(Link& from, const wire::PeerMembership* req, uint64_t id,
                                   flatbuffers::FlatBufferBuilder& reply) {
  MembershipRequest r;
  r.job = req->job()->str();
  if (r.job.size() > options_.limits.max_name_bytes) {
    return Status::InvalidArgument("job name too long");
  }
  ISTHMUS_ASSIGN_OR_RETURN(r.step, StepFromWire(req->step()));
  ISTHMUS_ASSIGN_OR_RETURN(r.change.next, ReadMembership(req->next(), options_.limits));
  r.change.coordinator = Str(req->coordinator());
  const MembershipAnswer a = sink_->OnMembershipRequest(from.spec.site, r);
  spdlog::debug("peer {}: membership {} for job '{}' (request {}) answered {}{}", from.spec.site,
                MembershipStepName(r.step), r.job, id, MembershipVoteName(a.vote),
                a.reason.empty() ? "" : ": " + a.reason);
  wire::MembershipVoteKind vote = wire::MembershipVoteKind::Refused;
  switch (a.vote) {
    case MembershipVote::kPrepared:
      vote = wire::MembershipVoteKind::Prepared;
      break;
    case MembershipVote::kApplied:
      vote = wire::MembershipVoteKind::Applied;
      break;
    case MembershipVote::kPending:
      vote = wire::MembershipVoteKind::Pending;
      break;
    case MembershipVote::kAbandoned:
      vote = wire::MembershipVoteKind::Abandoned;
      break;
    case MembershipVote::kRefused:
      break;
  }
  flatbuffers::Offset<wire::JobImageMsg> image = 0;
  if (a.image) {
    // The values travel as payload frames, without a copy; the reply keeps them alive.
    std::vector<flatbuffers::Offset<wire::PeerTensor>> tensors;
    std::vector<uint32_t> momentum;
    for (const auto& t : a.image->tensors) {
      const uint32_t frame = static_cast<uint32_t>(reply_payload_.size());
      reply_payload_.push_back({t.theta->data(), t.theta->size() * sizeof(float), t.theta});
      tensors.push_back(wire::CreatePeerTensor(reply, reply.CreateString(t.name),
                                               reply.CreateVector(t.shape), frame,
                                               t.theta->size() * sizeof(float)));
      if (t.momentum) {
        momentum.push_back(static_cast<uint32_t>(reply_payload_.size()));
        reply_payload_.push_back(
            {t.momentum->data(), t.momentum->size() * sizeof(float), t.momentum});
      }
    }
    if (!momentum.empty() && momentum.size() != a.image->tensors.size()) {
      return Status::Internal("job image has momentum for some tensors only");
    }
    image =
        wire::CreateJobImageMsg(reply, a.image->round, reply.CreateString(a.image->digest),
                                WriteMembership(reply, a.image->members), a.image->version,
                                reply.CreateString(a.image->base_hash), reply.CreateVector(tensors),
                                momentum.empty() ? 0 : reply.CreateVector(momentum));
  }
  auto body = wire::CreatePeerMembershipReply(reply, vote, reply.CreateString(a.reason),
                                              reply.CreateString(a.digest), image, a.committed);
  FinishEnvelope(reply, id, wire::Body::PeerMembershipReply, body.Union());
  return Status::Ok();
}

void PeerLinks::SendPing(Link& link) {
  flatbuffers::FlatBufferBuilder fbb;
  auto body =
      wire::CreatePeerPing(fbb, options_.insecure_plaintext ? fbb.CreateString(options_.site) : 0);
  uint64_t id = ++link.request_seq;
  FinishEnvelope(fbb, id, wire::Body::PeerPing, body.Union());
  if (!Transmit(link, fbb, {}).ok()) return;
  ++link.stats.keepalives;
  link.inflight[id] =
      Link::InFlight{Link::InFlight::Kind::kPing, "", 0, 0, Clock::now(), false, {}};
}

void PeerLinks::Reset(Link& link, const std::string& why, bool reopen) {
  ++link.failures;
  ++link.stats.resends;
  link.stats.last_error = why + KeyHint(link);
  link.ready = false;
  link.inflight.clear();
  link.retry_at = Clock::now() + std::chrono::milliseconds(CurrentTimeoutMs(link));
  if (reopen && link.dials) {
    // A fresh socket drops whatever the stalled connection still queues.
    Status s = OpenDealer(link);
    if (!s.ok()) link.stats.last_error = s.ToString();
  }
  spdlog::info("peer {}: {} (retry in {} ms)", link.spec.site, why, CurrentTimeoutMs(link));
}

void PeerLinks::Pump(Link& link) {
  if (!CanSend(link) || link.paused || !link.ready) return;
  for (auto& [job, jl] : link.jobs) {
    const uint64_t first = source_->FirstRoundTo(link.spec.site, job);
    if (first == 0) continue;  // a member no more (or not yet)
    jl.next = std::max(jl.next, first);
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
      PackedDelta packed = PackDelta(d);
      flatbuffers::FlatBufferBuilder fbb;
      // A leading shared frame travels inside the header: one frame and box fewer.
      flatbuffers::Offset<flatbuffers::Vector<uint8_t>> data;
      if (packed.inline_first) {
        data = fbb.CreateVector(static_cast<const uint8_t*>(packed.payload.front().data),
                                packed.payload.front().size);
        packed.payload.erase(packed.payload.begin());
      }
      // Our held acknowledgements of the peer's deltas ride along.
      std::vector<wire::PeerHeld> acks;
      const auto now = Clock::now();
      for (const auto& h : link.held_acks) {
        auto held_us = std::chrono::duration_cast<std::chrono::microseconds>(now - h.received);
        acks.emplace_back(h.request_id, sink_->HeldFrom(link.spec.site, h.job),
                          static_cast<uint64_t>(held_us.count()));
      }
      link.held_acks.clear();
      // Under CURVE the key names the sender; the site travels only in plaintext.
      auto body = wire::CreatePeerDelta(
          fbb, fbb.CreateString(job),
          options_.insecure_plaintext ? fbb.CreateString(options_.site) : 0, jl.next, d->tokens, 0,
          packed.frame_ends.size() == 1 ? 0 : fbb.CreateVector(packed.frame_ends), data,
          static_cast<uint32_t>(std::max(0, options_.ack_delay_ms)),
          acks.empty() ? 0 : fbb.CreateVectorOfStructs(acks),
          fbb.CreateVector(reinterpret_cast<const uint8_t*>(packed.sizes.data()),
                           packed.sizes.size()));
      const uint64_t raw = packed.raw_bytes;
      const std::vector<PayloadRef>& payload = packed.payload;
      uint64_t id = ++link.request_seq;
      FinishEnvelope(fbb, id, wire::Body::PeerDelta, body.Union());
      if (!Transmit(link, fbb, payload).ok()) return;
      uint64_t& high = link.high_sent[job];
      link.inflight[id] = Link::InFlight{Link::InFlight::Kind::kDelta,
                                         job,
                                         jl.next,
                                         d->WireBytes(),
                                         Clock::now(),
                                         jl.next <= high,
                                         {}};
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
    link.last_traffic = Clock::now();
    auto env = ParseEnvelope(msg->header, options_.limits);
    if (env.ok() && IsPeerRequest((*env)->body_type())) {
      // The peer's own traffic over our connection: the CURVE server we dialled proved
      // its key, so the message is the peer's.
      Answer(*link.dealer, nullptr, options_.insecure_plaintext ? "" : link.spec.public_key, env,
             (*env)->request_id(), *msg);
      continue;
    }
    CountReceived(link, *msg);
    if (!env.ok()) {
      link.stats.last_error = "bad reply from peer: " + env.status().ToString();
      continue;
    }
    OnReply(link, *env, *msg);
  }
}

void PeerLinks::OnReply(Link& link, const wire::Envelope* env, const Frames& msg) {
  auto it = link.inflight.find(env->request_id());
  if (it == link.inflight.end()) return;  // a reply to a request we gave up on
  auto now = Clock::now();
  Status err = ErrorFromEnvelope(env);
  if (err.ok() && env->body_type() == wire::Body::PeerAck &&
      it->second.kind == Link::InFlight::Kind::kDelta) {
    const auto* ack = env->body_as_PeerAck();
    OnAcked(link, env->request_id(), ack->held_round(),
            now - std::chrono::microseconds(std::min<uint64_t>(ack->delay_us(), kMaxAckDelayUs)));
    return;
  }
  Link::InFlight sent = it->second;
  link.inflight.erase(it);
  if (!err.ok()) {
    // The peer refused (paused, digest mismatch, malformed): back off and handshake again.
    ++link.stats.refused;
    const char* what = sent.kind == Link::InFlight::Kind::kHello  ? "the handshake"
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
  if (env->body_type() == wire::Body::PeerPong && sent.kind == Link::InFlight::Kind::kPing) {
    return;
  }
  if (env->body_type() == wire::Body::PeerMembershipReply &&
      sent.kind == Link::InFlight::Kind::kMembership) {
    const auto* r = env->body_as_PeerMembershipReply();
    MembershipAnswer answer;
    answer.reason = Str(r->reason());
    answer.digest = Str(r->digest());
    answer.committed = r->committed();
    if (r->image() != nullptr) {
      auto image = ReadImage(r->image(), msg, options_.limits);
      if (!image.ok()) {
        link.stats.last_error = "bad job image from the peer: " + image.status().ToString();
        return;
      }
      answer.image = *image;
    }
    switch (r->vote()) {
      case wire::MembershipVoteKind::Prepared:
        answer.vote = MembershipVote::kPrepared;
        break;
      case wire::MembershipVoteKind::Applied:
        answer.vote = MembershipVote::kApplied;
        break;
      case wire::MembershipVoteKind::Pending:
        answer.vote = MembershipVote::kPending;
        break;
      case wire::MembershipVoteKind::Abandoned:
        answer.vote = MembershipVote::kAbandoned;
        break;
      default:
        answer.vote = MembershipVote::kRefused;
    }
    spdlog::debug("peer {}: membership {} for job '{}' got {}{}", link.spec.site,
                  MembershipStepName(sent.membership.step), sent.membership.job,
                  MembershipVoteName(answer.vote),
                  answer.reason.empty() ? "" : ": " + answer.reason);
    source_->OnMembershipAnswer(link.spec.site, sent.membership, answer);
    return;
  }
  if (env->body_type() == wire::Body::PeerHelloReply && sent.kind == Link::InFlight::Kind::kHello) {
    const auto* reply = env->body_as_PeerHelloReply();
    std::map<std::string, uint64_t> held;
    std::string mismatch;
    if (reply->jobs()) {
      for (const auto* pj : *reply->jobs()) {
        // The peer checked our digests; one it states anyway must match too.
        std::string job = pj->job()->str();
        if (pj->removed_from() > 0) {  // the peer no longer counts this site in
          source_->OnRemovedNotice(link.spec.site, job, pj->removed_from());
          continue;
        }
        std::string ours = options_.initial_digest ? options_.initial_digest(job) : "";
        std::string theirs = Str(pj->initial_digest());
        if (!ours.empty() && !theirs.empty() && ours != theirs) {
          mismatch = job;
          continue;
        }
        held[job] = pj->held_round();
      }
    }
    spdlog::debug("peer {}: handshake answered, {} job(s) synced", link.spec.site, held.size());
    Adopt(link, held, /*fresh=*/true);
    if (!mismatch.empty()) {
      link.stats.last_error =
          "initial state of job '" + mismatch + "' differs from the peer's; not syncing it";
    }
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
  } else {
    link.stats.last_error = "unexpected reply type from peer";
  }
}

void PeerLinks::OnAcked(Link& link, uint64_t request_id, uint64_t held, Clock::time_point at) {
  auto it = link.inflight.find(request_id);
  if (it == link.inflight.end() || it->second.kind != Link::InFlight::Kind::kDelta) return;
  const Link::InFlight sent = it->second;
  link.inflight.erase(it);
  link.last_progress = Clock::now();
  link.failures = 0;
  auto jit = link.jobs.find(sent.job);
  if (jit == link.jobs.end()) return;
  auto& jl = jit->second;
  jl.acked = std::max(jl.acked, held);
  // The peer lacks an earlier round it should hold (it lost state): send from there.
  if (held < sent.round) jl.next = std::min(jl.next, held + 1);
  ++link.stats.deltas_acked;
  source_->OnPeerAck(link.spec.site, sent.job, jl.acked);
  // A held ack is timed from when the peer had the delta, not from when it answered.
  at = std::max(at, sent.sent);
  if (auto estimate = link.meter->OnAck(sent.sent, at, sent.bytes, sent.resent)) {
    double& bw = link.stats.bandwidth_bps;
    bw = *estimate;
    spdlog::debug(
        "link to {}: round {} of job '{}' ({} bytes) acknowledged {:.0f} ms after it "
        "was sent; bandwidth estimate {:.0f} B/s",
        link.spec.site, sent.round, sent.job, sent.bytes,
        std::chrono::duration<double, std::milli>(at - sent.sent).count(), bw);
    source_->OnLinkBandwidth(link.spec.site, bw);
  }
}

void PeerLinks::FlushAcks(Link& link, bool all) {
  const auto now = Clock::now();
  auto keep = link.held_acks.begin();
  for (auto& h : link.held_acks) {
    if (!all && now < h.due) {
      if (&*keep != &h) *keep = std::move(h);
      ++keep;
      continue;
    }
    flatbuffers::FlatBufferBuilder fbb;
    auto delay = std::chrono::duration_cast<std::chrono::microseconds>(now - h.received);
    auto body = wire::CreatePeerAck(fbb, 0, 0, 0, sink_->HeldFrom(link.spec.site, h.job),
                                    static_cast<uint64_t>(delay.count()));
    FinishEnvelope(fbb, h.request_id, wire::Body::PeerAck, body.Union());
    // On the connection the delta came on; if that is gone, so is the sender's copy of
    // the request, and it sends the round again.
    Status sent;
    if (h.on_dealer) {
      sent = link.dealer ? SendMessage(*link.dealer, nullptr, fbb, {})
                         : Status::Unavailable("connection closed");
    } else if (router_) {
      zmq::message_t to(h.connection.data(), h.connection.size());
      sent = SendMessage(*router_, &to, fbb, {});
    }
    if (sent.ok()) {
      CountSent(link, fbb, {});
      link.last_traffic = now;
    }
  }
  link.held_acks.erase(keep, link.held_acks.end());
}

void PeerLinks::Adopt(Link& link, const std::map<std::string, uint64_t>& held, bool fresh) {
  if (fresh) link.jobs.clear();
  for (const auto& [job, round] : held) {
    auto [it, added] = link.jobs.try_emplace(job);
    Link::JobLink& jl = it->second;
    jl.acked = std::max(fresh || added ? 0 : jl.acked, round);
    if (fresh || added) jl.next = jl.acked + 1;
    source_->OnPeerAck(link.spec.site, job, jl.acked);
  }
  link.ready = true;
  link.stats.connected = true;
  link.last_progress = Clock::now();
  link.failures = 0;
  link.stats.last_error.clear();
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
        link.key_refused = false;
        link.transport_up = true;
        // A new connection: whatever was in flight on the old one may be lost. A socket
        // opened while the peer refused our key could not queue a handshake: send it now.
        if (link.reconnecting || (!link.ready && link.inflight.empty())) SendHello(link);
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
        link.key_refused = true;
        link.stats.connected = false;
        link.stats.last_error = "peer refused our key (status " + std::to_string(value) +
                                "): is it on the peer's security.peer_keys allowlist?";
        break;
      case ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL:
      case ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL: {
        link.stats.connected = false;
        link.stats.last_error = "handshake with the peer failed (wrong server key in sync.peers?)";
        // The peer may have rotated its key: its file lists the new one too. Move to the
        // next, at most once per backoff_max_ms (two wrong keys must not spin).
        const auto now = Clock::now();
        if (link.spec.public_keys.size() > 1 &&
            now - link.key_switched_at >= std::chrono::milliseconds(options_.backoff_max_ms)) {
          auto it = std::find(link.spec.public_keys.begin(), link.spec.public_keys.end(),
                              link.spec.public_key);
          const size_t at =
              it == link.spec.public_keys.end() ? 0 : it - link.spec.public_keys.begin();
          link.spec.public_key = link.spec.public_keys[(at + 1) % link.spec.public_keys.size()];
          link.key_switched_at = now;
          spdlog::info("peer {}: the handshake failed; dialling again with its next listed key {}",
                       link.spec.site, link.spec.public_key.substr(0, 8));
          if (Status st = OpenDealer(link); !st.ok()) link.stats.last_error = st.ToString();
          return;  // the monitor was replaced with the socket
        }
        break;
      }
      default:
        break;
    }
  }
}

void PeerLinks::ReloadPeerKeys() {
  for (auto& link : links_) {
    if (link->spec.key_file.empty()) continue;
    auto keys = LoadPublicKeyList(link->spec.key_file);
    if (!keys.ok()) {
      spdlog::error("reload: peer {}: {}; its keys stay as they were", link->spec.site,
                    keys.status().ToString());
      continue;
    }
    if (*keys == link->spec.public_keys) continue;
    for (const auto& k : link->spec.public_keys) by_key_.erase(k);
    link->spec.public_keys = std::move(keys).value();
    for (const auto& k : link->spec.public_keys) by_key_[k] = link.get();
    spdlog::info("reload: peer {}: {} key(s) listed", link->spec.site,
                 link->spec.public_keys.size());
    const auto& listed = link->spec.public_keys;
    if (std::find(listed.begin(), listed.end(), link->spec.public_key) == listed.end()) {
      link->spec.public_key = listed.front();
      if (link->dials) {
        if (Status st = OpenDealer(*link); !st.ok()) link->stats.last_error = st.ToString();
      }
    }
  }
}

std::map<std::string, std::vector<std::string>> PeerLinks::PeerKeys() const {
  std::map<std::string, std::vector<std::string>> out;
  for (const auto& link : links_) out[link->spec.site] = link->spec.public_keys;
  return out;
}

Status PeerLinks::SetOwnKeys(const KeyPair& keys) {
  options_.keys = keys;
  if (router_) {
    const std::string endpoint = router_->get(zmq::sockopt::last_endpoint);
    router_.reset();
    for (auto& link : links_) {
      link->peer_connection.clear();
      link->channel.clear();
    }
    // ZeroMQ releases the old listener's port on its own threads, a moment later.
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    Status bound;
    while (!(bound = BindRouter(endpoint)).ok() && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ISTHMUS_RETURN_IF_ERROR(bound);
  }
  for (auto& link : links_) {
    if (link->dials) ISTHMUS_RETURN_IF_ERROR(OpenDealer(*link));
  }
  return Status::Ok();
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
    std::string connection(static_cast<const char*>(routing_id.data()), routing_id.size());
    uint64_t request_id = 0;
    auto env = ParseEnvelope(msg->header, options_.limits, &request_id);
    if (env.ok() && !IsPeerRequest((*env)->body_type())) {
      // A reply to a request of ours that went over a connection the peer dialled.
      Link* link = nullptr;
      for (auto& l : links_) {
        if (!l->dials && l->channel == connection) link = l.get();
      }
      if (link == nullptr) {
        ++refused_unknown_;
        continue;
      }
      CountReceived(*link, *msg);
      link->last_traffic = Clock::now();
      OnReply(*link, *env, *msg);
      continue;
    }
    std::string user_id;
    if (!options_.insecure_plaintext) {
      user_id = msg->user_id;
    }
    Link* from = Answer(*router_, &routing_id, user_id, env, request_id, *msg);
    // A routing id we have not seen from this peer is a new connection of theirs: its
    // handshake crossed the wire too.
    if (from != nullptr && connection != from->peer_connection) {
      from->peer_connection = std::move(connection);
      CountConnection(*from, /*client_side=*/false);
    }
  }
}

PeerLinks::Link* PeerLinks::Answer(zmq::socket_t& socket, const zmq::message_t* routing_id,
                                   const std::string& user_id,
                                   const Result<const wire::Envelope*>& env, uint64_t request_id,
                                   const Frames& msg) {
  flatbuffers::FlatBufferBuilder reply;
  Link* from = nullptr;
  std::string connection;
  if (routing_id != nullptr) {
    connection.assign(static_cast<const char*>(routing_id->data()), routing_id->size());
  }
  reply_payload_.clear();
  Status s = HandlePeerMessage(user_id, env, msg, reply, &from, routing_id ? &connection : nullptr);
  if (!s.ok()) {
    reply.Clear();
    BuildErrorReply(reply, request_id, s);
    spdlog::warn("refused a peer message: {}", s.ToString());
  } else if (from != nullptr && env.ok() && (*env)->body_type() == wire::Body::PeerDelta &&
             (*env)->body_as_PeerDelta()->ack_delay_ms() > 0) {
    // The sender lets us hold the ack: it rides in our next delta to it, or goes alone
    // when its time is up (Tick). At most a window's worth waits per link.
    const auto now = Clock::now();
    const int64_t hold_ms =
        std::min<int64_t>((*env)->body_as_PeerDelta()->ack_delay_ms(), kMaxAckHoldMs);
    Link::HeldAck h;
    h.request_id = (*env)->request_id();
    h.job = (*env)->body_as_PeerDelta()->job()->str();
    h.received = now;
    h.due = now + std::chrono::milliseconds(hold_ms);
    h.on_dealer = routing_id == nullptr;
    h.connection = connection;
    CountReceived(*from, msg);
    from->last_traffic = now;
    from->held_acks.push_back(std::move(h));
    if (from->held_acks.size() > kMaxHeldAcks) FlushAcks(*from, /*all=*/true);
    return from;
  }
  if (!s.ok()) reply_payload_.clear();
  Status sent = SendMessage(socket, routing_id, reply, reply_payload_);
  if (!sent.ok()) spdlog::warn("could not answer a peer: {}", sent.ToString());
  if (from != nullptr) {
    CountReceived(*from, msg);
    if (sent.ok()) CountSent(*from, reply, reply_payload_);
    from->last_traffic = Clock::now();
  }
  return from;
}

Status PeerLinks::HandlePeerMessage(const std::string& user_id, const Frames& msg,
                                    flatbuffers::FlatBufferBuilder& reply) {
  return HandlePeerMessage(user_id, ParseEnvelope(msg.header, options_.limits), msg, reply, nullptr,
                           nullptr);
}

Status PeerLinks::HandlePeerMessage(const std::string& user_id,
                                    const Result<const wire::Envelope*>& env_or, const Frames& msg,
                                    flatbuffers::FlatBufferBuilder& reply, Link** from_out,
                                    const std::string* connection) {
  if (!env_or.ok()) {
    ++refused_unknown_;
    return env_or.status();
  }
  const wire::Envelope* env = *env_or;
  std::string claimed;
  if (env->body_type() == wire::Body::PeerHello) claimed = env->body_as_PeerHello()->site()->str();
  if (env->body_type() == wire::Body::PeerDelta) claimed = Str(env->body_as_PeerDelta()->site());
  if (env->body_type() == wire::Body::PeerPing) claimed = Str(env->body_as_PeerPing()->site());
  if (env->body_type() == wire::Body::PeerMembership) {
    claimed = Str(env->body_as_PeerMembership()->site());
  }
  Link* from = nullptr;
  if (options_.insecure_plaintext) {
    from = FindLink(claimed);
  } else {
    auto it = by_key_.find(user_id);
    if (it != by_key_.end()) from = it->second;
  }
  if (from == nullptr) {
    ++refused_unknown_;
    return Status::PermissionDenied(
        options_.insecure_plaintext
            ? "site '" + claimed + "' is not configured in sync.peers"
            : std::string("this key is not configured for any site in sync.peers"));
  }
  if (from_out != nullptr) *from_out = from;
  // Under CURVE a delta or ping need not name its site: the key does.
  if (claimed.empty() && !options_.insecure_plaintext &&
      env->body_type() != wire::Body::PeerHello) {
    claimed = from->spec.site;
  }
  const bool ping = env->body_type() == wire::Body::PeerPing;
  Status s;
  if (!IsPeerRequest(env->body_type())) {
    s = Status::InvalidArgument("not a peer message");
  } else if (claimed != from->spec.site) {
    s = Status::PermissionDenied("message claims site '" + claimed + "' but the key is site '" +
                                 from->spec.site + "'s");
  } else if (from->paused) {
    s = Status::Unavailable("the link to site '" + from->spec.site + "' is paused here");
  } else if (env->body_type() == wire::Body::PeerHello) {
    s = HandleHello(*from, env->body_as_PeerHello(), env->request_id(), reply, connection);
  } else if (ping && !from->dials && connection != nullptr &&
             (!from->ready || *connection != from->channel)) {
    // The peer dials us, and our rounds travel on the connection its handshake named: this
    // one has none (it never handshook on it, or our send on the old one failed and we
    // dropped it). A pong would tell the peer all is well, and, idle, it would never
    // handshake again: our rounds would wait for ever. Ask for the handshake instead.
    s = Status::FailedPrecondition("no handshake on this connection: handshake again");
  } else if (ping) {
    FinishEnvelope(reply, env->request_id(), wire::Body::PeerPong,
                   wire::CreatePeerPong(reply).Union());
  } else if (env->body_type() == wire::Body::PeerMembership) {
    s = HandleMembership(*from, env->body_as_PeerMembership(), env->request_id(), reply);
  } else {
    s = HandleDelta(*from, env->body_as_PeerDelta(), msg, env->request_id(), reply);
  }
  if (!s.ok()) {
    // Shown on this side too: with one connection per pair, the peer's side of a refused
    // handshake may be the only one that ever sends one.
    ++from->stats.refused;
    from->stats.last_error = "refused a message from the peer: " + s.ToString();
  }
  return s;
}

Status PeerLinks::HandleHello(Link& from, const wire::PeerHello* hello, uint64_t id,
                              flatbuffers::FlatBufferBuilder& reply,
                              const std::string* connection) {
  if (hello->shard_index() >= 0 && options_.shard_index >= 0 &&
      hello->shard_index() != options_.shard_index) {
    return Status::FailedPrecondition("peer shard " + std::to_string(hello->shard_index()) +
                                      " connected to shard " +
                                      std::to_string(options_.shard_index) + " (check sync.peers)");
  }
  std::map<std::string, const wire::PeerJob*> theirs;
  if (hello->jobs()) {
    for (const auto* pj : *hello->jobs()) theirs[pj->job()->str()] = pj;
  }
  std::vector<flatbuffers::Offset<wire::PeerJob>> jobs;
  std::map<std::string, uint64_t> their_held;  // what the peer holds of our rounds
  std::string refusal;                         // why a job the peer named is not synced with it
  for (const auto& job : source_->SyncJobs()) {
    auto it = theirs.find(job);
    if (it == theirs.end()) continue;
    if (it->second->removed_from() > 0) {  // the peer no longer counts this site in
      source_->OnRemovedNotice(from.spec.site, job, it->second->removed_from());
      continue;
    }
    if (const uint64_t removed = sink_->RemovedFrom(from.spec.site, job); removed > 0) {
      // Not synced with it, but told so instead of refused: it learns it was removed, and
      // the link stays up for it to ask to join again.
      jobs.push_back(wire::CreatePeerJob(reply, reply.CreateString(job), 0, 0, removed));
      continue;
    }
    if (std::string why = sink_->RefusesPeer(from.spec.site, job); !why.empty()) {
      refusal = why;
      continue;
    }
    std::string ours = options_.initial_digest ? options_.initial_digest(job) : "";
    std::string digest = Str(it->second->initial_digest());
    if (!ours.empty() && !digest.empty() && ours != digest) {
      return Status::FailedPrecondition("job '" + job + "': initial state differs between site '" +
                                        options_.site + "' and site '" + from.spec.site + "'");
    }
    their_held[job] = it->second->held_round();
    // Digests were checked here; the reply carries only the acknowledgement.
    jobs.push_back(wire::CreatePeerJob(reply, reply.CreateString(job), 0,
                                       sink_->HeldFrom(from.spec.site, job)));
  }
  spdlog::debug("peer {}: handshake received, {} job(s) synced{}", from.spec.site, jobs.size(),
                refusal.empty() ? "" : ", refused: " + refusal);
  if (jobs.empty() && !refusal.empty()) return Status::PermissionDenied(refusal);
  auto body = wire::CreatePeerHelloReply(reply, 0, options_.shard_index, reply.CreateVector(jobs));
  FinishEnvelope(reply, id, wire::Body::PeerHelloReply, body.Union());
  if (!from.dials && connection != nullptr) {
    // The peer dials us: its handshake opens (or re-opens) the connection our own deltas
    // travel on, and its held rounds are our acknowledgements. A new connection loses
    // whatever was in flight on the old one.
    const bool fresh = *connection != from.channel || !from.ready;
    if (fresh) {
      from.channel = *connection;
      from.inflight.clear();
      from.meter->Restart(Clock::now());
    }
    Adopt(from, their_held, fresh);
  }
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
      t.shape = ShapeFrom(m->shape());
      const int64_t numel = NumElements(t.shape);
      if (numel < 0 || static_cast<uint64_t>(numel) > lim.max_payload_bytes) {
        return Status::InvalidArgument("tensor '" + t.name + "' has a negative or huge shape");
      }
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
  std::vector<uint64_t> sizes;
  const uint8_t* at = req->packed_sizes()->data();
  const uint8_t* stop = at + req->packed_sizes()->size();
  while (at < stop && sizes.size() <= layout.size()) {
    uint64_t n = 0;
    if (!ReadVarint(&at, stop, &n)) return Status::InvalidArgument("packed delta: bad size varint");
    sizes.push_back(n);
  }
  const auto* ends = req->frame_ends();
  if (at != stop || sizes.size() != layout.size()) {
    return Status::InvalidArgument("packed delta has " + std::string(at != stop ? "over " : "") +
                                   std::to_string(sizes.size()) + " tensors, job '" + delta->job +
                                   "' has " + std::to_string(layout.size()) + " here");
  }
  // The frames: `data` inside the header first, when present, then the payload frames.
  std::vector<std::pair<const char*, uint64_t>> spans;
  if (req->data() != nullptr) {
    spans.emplace_back(reinterpret_cast<const char*>(req->data()->data()), req->data()->size());
  }
  for (const auto& p : msg.payload) {
    spans.emplace_back(static_cast<const char*>(p.data()), p.size());
  }
  // No `frame_ends`: one frame holds every tensor.
  const size_t frames = ends ? ends->size() : layout.empty() ? 0 : 1;
  if (frames != spans.size()) {
    return Status::InvalidArgument("packed delta describes " + std::to_string(frames) +
                                   " frames but has " + std::to_string(spans.size()));
  }
  size_t tensor = 0;
  for (size_t f = 0; f < frames; ++f) {
    const uint32_t end = ends ? ends->Get(static_cast<flatbuffers::uoffset_t>(f))
                              : static_cast<uint32_t>(layout.size());
    if (end < tensor || end > layout.size()) {
      return Status::InvalidArgument("packed delta frame boundaries out of order");
    }
    const auto [frame, frame_size] = spans[f];
    uint64_t at = 0;
    for (; tensor < end; ++tensor) {
      const uint64_t n = sizes[tensor];
      if (n > frame_size - at) {
        return Status::InvalidArgument("packed delta tensor runs past its frame");
      }
      EncodedTensor t;
      t.name = layout[tensor].first;
      t.shape = layout[tensor].second;
      t.bytes.assign(frame + at, n);
      at += n;
      delta->tensors.push_back(std::move(t));
    }
    if (at != frame_size) {
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
  // The peer's acknowledgements of our deltas come first: they stand whatever becomes of
  // this delta.
  if (req->acks() != nullptr) {
    const auto now = Clock::now();
    // Copied out byte-wise: the verifier checks a vector's alignment for its length, not
    // for its 8-byte structs, so a hostile header may place them at any offset.
    const uint8_t* raw = req->acks()->Data();
    for (uint32_t i = 0; i < req->acks()->size(); ++i) {
      wire::PeerHeld a;
      std::memcpy(&a, raw + size_t{i} * sizeof(wire::PeerHeld), sizeof(wire::PeerHeld));
      OnAcked(from, a.request_id(), a.held_round(),
              now - std::chrono::microseconds(std::min<uint64_t>(a.delay_us(), kMaxAckDelayUs)));
    }
  }
  if (req->round() == 0) return Status::InvalidArgument("peer delta with round 0");
  if (req->job()->size() > lim.max_name_bytes) return Status::InvalidArgument("job name too long");
  if (msg.PayloadBytes() > lim.max_payload_bytes) {
    return Status::ResourceExhausted("peer delta payload over limits.max_message_bytes");
  }
  EncodedDelta delta;
  delta.job = req->job()->str();
  delta.site = from.spec.site;  // checked against any site the message claims
  delta.round = req->round();
  delta.tokens = req->tokens();
  if (req->packed_sizes() != nullptr) {
    ISTHMUS_RETURN_IF_ERROR(UnpackDelta(req, msg, &delta));
  } else if (req->data() != nullptr) {
    return Status::InvalidArgument("peer delta has inline data but no packed sizes");
  } else {
    ISTHMUS_RETURN_IF_ERROR(UnlistDelta(req, msg, &delta));
  }
  from.stats.bytes_received += msg.PayloadBytes() + (req->data() ? req->data()->size() : 0);
  ISTHMUS_ASSIGN_OR_RETURN(uint64_t held, sink_->ReceiveDelta(from.spec.site, delta));
  auto body = wire::CreatePeerAck(reply, 0, 0, delta.round, held);
  FinishEnvelope(reply, id, wire::Body::PeerAck, body.Union());
  return Status::Ok();
}

size_t PeerLinks::PollItemCount() const {
  size_t n = router_ ? 1 : 0;
  for (const auto& l : links_) n += (l->dealer ? 1 : 0) + (l->monitor ? 1 : 0);
  return n;
}

void PeerLinks::FillPollItems(zmq::pollitem_t* items) {
  poll_map_.clear();
  size_t k = 0;
  if (router_) {
    items[k++] = {router_->handle(), 0, ZMQ_POLLIN, 0};
    poll_map_.push_back(-1);
  }
  for (size_t i = 0; i < links_.size(); ++i) {
    auto& l = *links_[i];
    if (l.dealer) {
      items[k++] = {l.dealer->handle(), -1, ZMQ_POLLIN, 0};
      poll_map_.push_back(static_cast<int>(2 * i));
    }
    if (l.monitor) {
      items[k++] = {l.monitor->handle(), -1, ZMQ_POLLIN, 0};
      poll_map_.push_back(static_cast<int>(2 * i + 1));
    }
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
    FlushAcks(link, /*all=*/false);
    // A peer that dials us and has not yet: nothing to do until its handshake arrives.
    if (link.paused || !CanSend(link)) continue;
    // Timeouts: no answer for the current interval plus the expected transfer time.
    if (auto deadline = Deadline(link); now >= deadline) {
      Reset(link,
            "no answer from the peer within " + std::to_string(CurrentTimeoutMs(link)) +
                " ms after the expected transfer time",
            true);
      continue;
    }
    if (link.dials && link.key_refused && !link.transport_up && link.inflight.empty() &&
        now >= link.retry_at) {
      // ZeroMQ does not dial again after the peer refused our key. A fresh socket does,
      // at the backoff's pace: the peer's operator may have added our key since.
      ++link.failures;
      if (Status s = OpenDealer(link); !s.ok()) link.stats.last_error = s.ToString();
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
      // The dialling side probes; its handshakes tell the other side too.
      if (link.dials && unknown && link.inflight.empty()) {
        if (sync_jobs.size() != link.jobs_at_probe) link.job_probe_at = now;  // a new job here
        if (now >= link.job_probe_at) {
          SendHello(link);
          continue;
        }
      }
      Pump(link);
      SendMembership(link, now);
      // An idle link costs one small ping per keep-alive interval (backoff_max_ms), which
      // also notices a dead connection while there is nothing to send; the dialling side
      // pings, and reconnects if it goes unanswered.
      if (link.dials && link.inflight.empty() &&
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
    for (const auto& h : link.held_acks) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(h.due - now);
      best = std::min<int64_t>(best, std::max<int64_t>(0, left.count()));
    }
    if (link.paused) continue;
    if (auto deadline = Deadline(link); deadline != Clock::time_point::max()) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now);
      best = std::min<int64_t>(best, std::max<int64_t>(0, left.count()));
    }
    if (!link.ready && link.inflight.empty() && CanSend(link)) {
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
    s.silent_seconds = std::chrono::duration<double>(Clock::now() - lp->last_heard).count();
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
