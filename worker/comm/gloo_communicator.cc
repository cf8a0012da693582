// Communicator over Gloo's TCP transport. Gloo reports failures by throwing; this file is
// the boundary where those exceptions become Status, and where a failure marks the group
// broken (Gloo's pairs are unusable after an I/O error).
#include "worker/comm/gloo_communicator.h"

#include <cstring>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/context.h>
#include <gloo/transport/tcp/device.h>

#include "common/bf16.h"
#include "worker/comm/rendezvous.h"

namespace isthmus::comm {
namespace {

void SumFloats(void* out, const void* a, const void* b, size_t n) {
  float* o = static_cast<float*>(out);
  const float* x = static_cast<const float*>(a);
  const float* y = static_cast<const float*>(b);
  for (size_t i = 0; i < n; ++i) o[i] = x[i] + y[i];
}

// bf16 sums: each addition in fp32, the result rounded to bf16.
void SumBf16(void* out, const void* a, const void* b, size_t n) {
  uint16_t* o = static_cast<uint16_t*>(out);
  const uint16_t* x = static_cast<const uint16_t*>(a);
  const uint16_t* y = static_cast<const uint16_t*>(b);
  for (size_t i = 0; i < n; ++i)
    o[i] = FloatToBf16Bits(Bf16BitsToFloat(x[i]) + Bf16BitsToFloat(y[i]));
}

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(std::shared_ptr<gloo::Context> context, const GlooOptions& options)
      : context_(std::move(context)),
        timeout_(options.timeout),
        fusion_bytes_(options.fusion_bytes) {}

  // The connections close as the context goes, gently: the kernel still delivers what a
  // completed send left in its socket buffer (Gloo counts a send complete once its bytes are
  // there). Gloo's closeConnections() would reset them instead and drop those bytes, failing
  // a peer that had not read the last collective yet (a root leaving right after its
  // broadcast; comm_test's ARootThatLeavesRightAfterItsBroadcastLosesNothing).
  ~GlooCommunicator() override = default;

  int rank() const override { return context_->rank; }
  int world_size() const override { return context_->size; }

  Status AllReduceSum(float* data, size_t count) override {
    ISTHMUS_RETURN_IF_ERROR(Check("AllReduceSum", data, count));
    if (count == 0 || world_size() == 1) return Status::Ok();
    return Run("allreduce", [&] {
      gloo::AllreduceOptions opts(context_);
      opts.setOutput(data, count);
      opts.setReduceFunction(&SumFloats);
      opts.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
      opts.setTag(NextTag());
      opts.setTimeout(timeout_);
      gloo::allreduce(opts);
    });
  }

  Status AllReduceAverage(float* data, size_t count) override {
    ISTHMUS_RETURN_IF_ERROR(AllReduceSum(data, count));
    // Every rank divides the same bits by the same number: results stay identical.
    const float n = static_cast<float>(world_size());
    for (size_t i = 0; i < count; ++i) data[i] /= n;
    return Status::Ok();
  }
  using Communicator::AllReduceAverage;

  Status AllReduceAverageBf16(float* data, size_t count) override {
    ISTHMUS_RETURN_IF_ERROR(Check("AllReduceAverageBf16", data, count));
    if (count == 0 || world_size() == 1) return Status::Ok();
    bf16_.resize(count);
    for (size_t i = 0; i < count; ++i) bf16_[i] = FloatToBf16Bits(data[i]);
    ISTHMUS_RETURN_IF_ERROR(Run("allreduce (bf16)", [&] {
      gloo::AllreduceOptions opts(context_);
      opts.setOutput(bf16_.data(), count);
      opts.setReduceFunction(&SumBf16);
      opts.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
      opts.setTag(NextTag());
      opts.setTimeout(timeout_);
      gloo::allreduce(opts);
    }));
    const float n = static_cast<float>(world_size());
    for (size_t i = 0; i < count; ++i) data[i] = Bf16BitsToFloat(bf16_[i]) / n;
    return Status::Ok();
  }

  Status Broadcast(float* data, size_t count, int root) override {
    if (root < 0 || root >= world_size()) {
      return Status::InvalidArgument("Broadcast: root " + std::to_string(root) + " outside [0, " +
                                     std::to_string(world_size()) + ")");
    }
    ISTHMUS_RETURN_IF_ERROR(Check("Broadcast", data, count));
    if (count == 0 || world_size() == 1) return Status::Ok();
    return Run("broadcast", [&] {
      gloo::BroadcastOptions opts(context_);
      opts.setOutput(data, count);  // in place: the root's output doubles as its input
      opts.setRoot(root);
      opts.setTag(NextTag());
      opts.setTimeout(timeout_);
      gloo::broadcast(opts);
    });
  }

  Status Barrier() override {
    ISTHMUS_RETURN_IF_ERROR(Check("Barrier", nullptr, 0));
    if (world_size() == 1) return Status::Ok();
    return Run("barrier", [&] {
      gloo::BarrierOptions opts(context_);
      opts.setTag(NextTag());
      opts.setTimeout(timeout_);
      gloo::barrier(opts);
    });
  }

 protected:
  size_t FusionBytes() const override { return fusion_bytes_; }

 private:
  Status Check(const char* what, const float* data, size_t count) const {
    return CheckCall(what, broken_, data, count);
  }

  // Every rank issues collectives in the same order, so a counter gives matching tags; a
  // rank that skipped a call then waits on a tag nobody sends and times out instead of
  // mixing up two operations.
  uint32_t NextTag() { return next_tag_++; }

  template <typename Fn>
  Status Run(const char* what, Fn&& fn) {
    try {
      fn();
      return Status::Ok();
    } catch (const std::exception& e) {
      broken_ =
          StatusFromGlooException(std::string("gloo ") + what + " (rank " + std::to_string(rank()) +
                                      " of " + std::to_string(world_size()) + ")",
                                  e);
      return broken_;
    }
  }

  std::shared_ptr<gloo::Context> context_;
  const std::chrono::milliseconds timeout_;
  const size_t fusion_bytes_;
  uint32_t next_tag_ = 0;
  std::vector<uint16_t> bf16_;  // AllReduceAverageBf16's staging
  Status broken_;
};

}  // namespace

Result<std::unique_ptr<Communicator>> CreateGlooCommunicator(const GlooOptions& options) {
  if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size) {
    return Status::InvalidArgument("gloo: rank " + std::to_string(options.rank) +
                                   " and world size " + std::to_string(options.world_size) +
                                   " do not fit 0 <= rank < world_size");
  }
  if (options.timeout.count() <= 0) {
    return Status::InvalidArgument("gloo: timeout must be positive");
  }
  if (options.host.empty() && options.iface.empty()) {
    return Status::InvalidArgument("gloo: one of host and iface must be set");
  }
  ISTHMUS_ASSIGN_OR_RETURN(
      std::unique_ptr<Rendezvous> rendezvous,
      Rendezvous::Open(options.rendezvous, options.rank, options.prefix, options.timeout));
  ISTHMUS_RETURN_IF_ERROR(rendezvous->AgreeOnLaunch(options.rank, options.world_size));
  ISTHMUS_RETURN_IF_ERROR(
      AgreeOnKind(*rendezvous, options.rank, options.world_size, "gloo (--device cpu)"));
  if (!options.settings.empty()) {
    ISTHMUS_RETURN_IF_ERROR(
        AgreeOnSettings(*rendezvous, options.rank, options.world_size, options.settings));
  }

  const std::string where = "gloo rendezvous (rank " + std::to_string(options.rank) + " of " +
                            std::to_string(options.world_size) + ")";
  std::shared_ptr<gloo::rendezvous::Context> context;
  try {
    gloo::transport::tcp::attr attr;
    if (!options.iface.empty()) {
      attr.iface = options.iface;
    } else {
      attr.hostname = options.host;
    }
    std::shared_ptr<gloo::transport::Device> device = gloo::transport::tcp::CreateDevice(attr);
    context = std::make_shared<gloo::rendezvous::Context>(options.rank, options.world_size);
    context->setTimeout(options.timeout);
    context->connectFullMesh(rendezvous->store(), device);
  } catch (const std::exception& e) {
    return StatusFromGlooException(where, e);
  }

  auto comm = std::make_unique<GlooCommunicator>(context, options);
  // Everyone has finished reading the store once everyone is past this barrier; only then
  // may rank 0 stop serving it.
  ISTHMUS_RETURN_IF_ERROR(comm->Barrier());
  rendezvous.reset();
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace isthmus::comm
