// Sockets, signals and the event loop around the Shard, and the crash-safe swap of the
// live database for a snapshot's files.
#include "server/server.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <filesystem>
#include <zmq.hpp>

#include "common/keys.h"
#include "common/transport.h"
#include "common/wire.h"
#include "server/shard.h"
#include "server/store.h"

namespace isthmus {
namespace {

namespace fs = std::filesystem;

// Restore swaps folders in three renames: copy -> db.restore, db -> db.old,
// db.restore -> db, then removes db.old. A crash between any two steps is finished here.
Status RecoverInterruptedRestore(const std::string& data_dir) {
  fs::path db = LiveDbDir(data_dir), restore = db.string() + ".restore", old = db.string() + ".old";
  std::error_code ec;
  if (!fs::exists(db, ec) && fs::exists(restore, ec)) {
    spdlog::warn("finishing a snapshot restore interrupted by a crash");
    fs::rename(restore, db, ec);
    if (ec) return Status::IoError("cannot finish interrupted restore: " + ec.message());
  }
  if (fs::exists(db, ec)) {
    fs::remove_all(restore, ec);
    fs::remove_all(old, ec);
  } else if (fs::exists(old, ec)) {
    fs::rename(old, db, ec);  // crashed before the copy was complete: keep the old state
  }
  return Status::Ok();
}

Status ReplaceDbFiles(const std::string& data_dir, const std::string& checkpoint) {
  fs::path db = LiveDbDir(data_dir), restore = db.string() + ".restore", old = db.string() + ".old";
  std::error_code ec;
  fs::remove_all(restore, ec);
  fs::copy(checkpoint, restore, fs::copy_options::recursive, ec);
  if (ec) {
    fs::remove_all(restore, ec);
    return Status::IoError("cannot copy snapshot files: " + ec.message());
  }
  fs::rename(db, old, ec);
  if (ec) return Status::IoError("cannot move the live database aside: " + ec.message());
  fs::rename(restore, db, ec);
  if (ec) {
    fs::rename(old, db, ec);
    return Status::IoError("cannot move the snapshot into place: " + ec.message());
  }
  fs::remove_all(old, ec);
  return Status::Ok();
}

}  // namespace

std::string LiveDbDir(const std::string& data_dir) { return (fs::path(data_dir) / "db").string(); }
std::string SnapshotDir(const std::string& data_dir) {
  return (fs::path(data_dir) / "snapshots").string();
}

struct ShardServer::Impl {
  ServerConfig config;
  int wake_fd = -1;
  std::unique_ptr<zmq::context_t> ctx;
  std::unique_ptr<ZapHandler> zap;
  std::unique_ptr<zmq::socket_t> worker, admin;
  std::unique_ptr<Shard> shard;
};

ShardServer::ShardServer(ServerConfig config) : impl_(std::make_unique<Impl>()) {
  impl_->config = std::move(config);
  impl_->wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
}

ShardServer::~ShardServer() {
  impl_->worker.reset();
  impl_->admin.reset();
  if (impl_->zap) impl_->zap->Stop();
  if (impl_->ctx) impl_->ctx->close();
  impl_->shard.reset();
  if (impl_->wake_fd >= 0) ::close(impl_->wake_fd);
}

void ShardServer::RequestStop() {
  uint64_t one = 1;
  ssize_t ignored = ::write(impl_->wake_fd, &one, sizeof one);
  (void)ignored;
}

Status ShardServer::Start() {
  auto& c = impl_->config;
  ISTHMUS_RETURN_IF_ERROR(ValidateServerConfig(c));
  if (impl_->wake_fd < 0) return Status::Internal("eventfd failed");
  ISTHMUS_RETURN_IF_ERROR(RecoverInterruptedRestore(c.data_dir));

  WireLimits limits;
  limits.max_payload_bytes = static_cast<uint64_t>(c.max_message_bytes);
  limits.max_header_bytes = static_cast<size_t>(c.max_header_bytes);
  limits.max_tensors = static_cast<uint32_t>(c.max_tensors);

  ShardOptions opts;
  opts.shard_id = c.shard_id;
  opts.snapshot_dir = SnapshotDir(c.data_dir);
  opts.limits = limits;
  opts.dedup_window = static_cast<uint64_t>(c.dedup_window);
  StoreOptions store_opts;
  store_opts.sync_writes = c.sync_writes;
  std::string db_dir = LiveDbDir(c.data_dir);
  opts.open_store = [db_dir, store_opts]() { return OpenRocksStore(db_dir, store_opts); };
  std::string data_dir = c.data_dir;
  opts.replace_store_files = [data_dir](const std::string& cp) { return ReplaceDbFiles(data_dir, cp); };
  ISTHMUS_ASSIGN_OR_RETURN(impl_->shard, Shard::Open(opts));

  KeyPair server_keys;
  if (c.insecure_plaintext) {
    spdlog::warn("security.insecure_plaintext is set: NO encryption and NO authentication on {} and {}",
                 c.listen_worker, c.listen_admin);
  } else {
    ISTHMUS_ASSIGN_OR_RETURN(server_keys, LoadKeyPairFile(c.secret_key));
  }
  impl_->ctx = std::make_unique<zmq::context_t>(static_cast<int>(c.io_threads));
  if (!c.insecure_plaintext) {
    impl_->zap = std::make_unique<ZapHandler>(*impl_->ctx);
    ISTHMUS_ASSIGN_OR_RETURN(auto worker_keys, LoadPublicKeys(c.worker_keys));
    ISTHMUS_ASSIGN_OR_RETURN(auto admin_keys, LoadPublicKeys(c.admin_keys));
    ISTHMUS_ASSIGN_OR_RETURN(auto peer_keys, LoadPublicKeys(c.peer_keys));
    if (admin_keys.empty()) {
      spdlog::warn("no admin keys configured (security.admin_keys): isthmusctl cannot connect");
    }
    impl_->zap->SetAllowlist(kDomainWorker, worker_keys);
    impl_->zap->SetAllowlist(kDomainAdmin, admin_keys);
    impl_->zap->SetAllowlist(kDomainPeer, peer_keys);
    ISTHMUS_RETURN_IF_ERROR(impl_->zap->Start());
    spdlog::info("allowlists: {} worker key(s), {} admin key(s), {} peer key(s)",
                 worker_keys.size(), admin_keys.size(), peer_keys.size());
  }
  auto make_socket = [&](const std::string& endpoint, const char* domain,
                         std::unique_ptr<zmq::socket_t>& out) -> Status {
    try {
      out = std::make_unique<zmq::socket_t>(*impl_->ctx, zmq::socket_type::router);
      out->set(zmq::sockopt::linger, 0);
      out->set(zmq::sockopt::sndhwm, 0);
      out->set(zmq::sockopt::rcvhwm, 0);
      // A frame beyond this drops the connection before it is buffered whole; smaller
      // excesses are answered with ResourceExhausted by the shard.
      out->set(zmq::sockopt::maxmsgsize, c.max_message_bytes + c.max_header_bytes);
      if (!c.insecure_plaintext) ConfigureCurveServer(*out, server_keys, domain);
      out->bind(endpoint);
    } catch (const zmq::error_t& e) {
      return Status::Unavailable("cannot bind " + std::string(domain) + " socket to '" + endpoint +
                                 "': " + e.what() + " (is the port in use? set listen." + domain + ")");
    }
    return Status::Ok();
  };
  ISTHMUS_RETURN_IF_ERROR(make_socket(c.listen_worker, kDomainWorker, impl_->worker));
  ISTHMUS_RETURN_IF_ERROR(make_socket(c.listen_admin, kDomainAdmin, impl_->admin));
  spdlog::info("shard {} serving workers on {} and admins on {} ({})", c.shard_id,
               c.listen_worker, c.listen_admin, c.insecure_plaintext ? "PLAINTEXT" : "CURVE");
  return Status::Ok();
}

Status ShardServer::Run() {
  if (!impl_->shard) return Status::FailedPrecondition("Start() first");
  zmq::socket_t* sockets[2] = {impl_->worker.get(), impl_->admin.get()};
  const wire::Role roles[2] = {wire::Role::Worker, wire::Role::Admin};
  while (true) {
    zmq::pollitem_t items[3] = {{sockets[0]->handle(), 0, ZMQ_POLLIN, 0},
                                {sockets[1]->handle(), 0, ZMQ_POLLIN, 0},
                                {nullptr, impl_->wake_fd, ZMQ_POLLIN, 0}};
    try {
      zmq::poll(items, 3, std::chrono::milliseconds(-1));
    } catch (const zmq::error_t& e) {
      if (e.num() == EINTR) continue;
      return Status::Internal(std::string("poll failed: ") + e.what());
    }
    if (items[2].revents & ZMQ_POLLIN) {
      spdlog::info("stop requested; shutting down");
      return Status::Ok();
    }
    for (int i = 0; i < 2; ++i) {
      if (!(items[i].revents & ZMQ_POLLIN)) continue;
      // Drain what is queued, a bounded number at a time, so neither socket starves.
      for (int n = 0; n < 64; ++n) {
        zmq::message_t routing_id;
        auto msg = ReceiveMessage(*sockets[i], &routing_id);
        if (!msg.ok()) {
          if (msg.status().code() == Code::kTimeout) break;
          spdlog::warn("dropped a message on the {} socket: {}", wire::EnumNameRole(roles[i]),
                       msg.status().ToString());
          continue;
        }
        Reply reply = impl_->shard->Handle(roles[i], *msg);
        uint64_t out_bytes = reply.header.GetSize();
        for (const auto& p : reply.payload) out_bytes += p.size;
        impl_->shard->CountBytes(msg->header.size() + msg->PayloadBytes(), out_bytes);
        Status s = SendMessage(*sockets[i], &routing_id, reply.header, reply.payload);
        if (!s.ok()) spdlog::warn("could not send a reply: {}", s.ToString());
      }
    }
  }
}

}  // namespace isthmus
