// Communicator over NCCL. The NCCL communicator runs in non-blocking mode so that a peer
// that never joins or never answers is noticed by polling against a deadline (and the
// communicator aborted) instead of hanging the rank forever. Without NCCL in the build only
// the stub factory at the bottom is compiled.
#include "worker/comm/nccl_communicator.h"

#include <string>

#if ISTHMUS_HAVE_NCCL

#include <cuda_runtime.h>
#include <nccl.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include "worker/comm/nccl_bf16.h"
#include "worker/comm/rendezvous.h"

namespace isthmus::comm {
namespace {

using Clock = std::chrono::steady_clock;

Status CudaStatus(const char* what, cudaError_t err) {
  if (err == cudaSuccess) return Status::Ok();
  cudaGetLastError();  // clear the sticky error of this thread
  return Status::Internal(std::string(what) + ": " + cudaGetErrorString(err));
}

Status NcclStatus(const char* what, ncclResult_t r) {
  if (r == ncclSuccess || r == ncclInProgress) return Status::Ok();
  std::string message = std::string(what) + ": " + ncclGetErrorString(r);
  if (r == ncclRemoteError || r == ncclSystemError) return Status::Unavailable(message);
  if (r == ncclInvalidArgument || r == ncclInvalidUsage) {
    return Status::InvalidArgument(message);
  }
  return Status::Internal(message);
}

#define ISTHMUS_CUDA_RETURN_IF_ERROR(call) ISTHMUS_RETURN_IF_ERROR(CudaStatus(#call, (call)))
#define ISTHMUS_NCCL_RETURN_IF_ERROR(call) ISTHMUS_RETURN_IF_ERROR(NcclStatus(#call, (call)))

// Waits until `comm` has finished its pending non-blocking call (initialisation, group
// end). Aborts nothing; the caller decides.
Status WaitComm(ncclComm_t comm, Clock::time_point deadline, const char* what) {
  while (true) {
    ncclResult_t state = ncclSuccess;
    ISTHMUS_NCCL_RETURN_IF_ERROR(ncclCommGetAsyncError(comm, &state));
    if (state == ncclSuccess) return Status::Ok();
    if (state != ncclInProgress) return NcclStatus(what, state);
    if (Clock::now() >= deadline) return Status::Timeout(std::string(what) + ": timed out");
    std::this_thread::yield();
  }
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(int rank, int world_size, int device, std::chrono::milliseconds timeout)
      : rank_(rank), world_size_(world_size), device_(device), timeout_(timeout) {}

  ~NcclCommunicator() override {
    cudaSetDevice(device_);
    if (comm_ != nullptr) {
      // A clean finalize needs every peer; if they are gone, abort rather than wait.
      ncclResult_t r = broken_.ok() ? ncclCommFinalize(comm_) : ncclInternalError;
      const bool finalized = (r == ncclSuccess || r == ncclInProgress) &&
                             WaitComm(comm_, Clock::now() + timeout_, "ncclCommFinalize").ok();
      if (finalized) {
        ncclCommDestroy(comm_);
      } else {
        ncclCommAbort(comm_);
      }
    }
    if (scratch_ != nullptr) cudaFree(scratch_);
    if (bf16_ != nullptr) cudaFree(bf16_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  Status Init(const ncclUniqueId& id) {
    ISTHMUS_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    ISTHMUS_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    ISTHMUS_CUDA_RETURN_IF_ERROR(cudaMalloc(&scratch_, sizeof(float)));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ISTHMUS_NCCL_RETURN_IF_ERROR(ncclCommInitRankConfig(&comm_, world_size_, id, rank_, &config));
    Status s = WaitComm(comm_, Clock::now() + timeout_, "ncclCommInitRankConfig");
    if (!s.ok()) broken_ = s;
    return s;
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }

  Status AllReduceSum(float* data, size_t count) override {
    return AllReduce("ncclAllReduce(sum)", data, count, ncclSum);
  }
  Status AllReduceAverage(float* data, size_t count) override {
    return AllReduce("ncclAllReduce(avg)", data, count, ncclAvg);
  }

  Status AllReduceAverageBf16(float* data, size_t count) override {
    ISTHMUS_RETURN_IF_ERROR(Check("AllReduceAverageBf16", data, count));
    if (count == 0 || world_size_ == 1) return Status::Ok();
    ISTHMUS_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    if (bf16_capacity_ < count) {
      if (bf16_ != nullptr) cudaFree(bf16_);
      bf16_ = nullptr;
      bf16_capacity_ = 0;
      ISTHMUS_CUDA_RETURN_IF_ERROR(cudaMalloc(&bf16_, count * 2));
      bf16_capacity_ = count;
    }
    const float scale = 1.0f / static_cast<float>(world_size_);
    // Sum in bf16 (NCCL adds in fp32 and rounds), then the average in fp32: an average
    // formed in bf16 would round once more.
    return Launch("ncclAllReduce(bf16 sum)", [&]() -> ncclResult_t {
      if (LaunchToBf16(data, bf16_, count, stream_) != cudaSuccess) return ncclUnhandledCudaError;
      const ncclResult_t r =
          ncclAllReduce(bf16_, bf16_, count, ncclBfloat16, ncclSum, comm_, stream_);
      if (r != ncclSuccess && r != ncclInProgress) return r;
      if (LaunchFromBf16(bf16_, data, count, scale, stream_) != cudaSuccess) {
        return ncclUnhandledCudaError;
      }
      return r;
    });
  }

  Status AllReduceAverage(std::vector<std::pair<float*, size_t>> buffers) override {
    for (const auto& [ptr, count] : buffers) {
      ISTHMUS_RETURN_IF_ERROR(Check("AllReduceAverage", ptr, count));
    }
    return Launch("grouped ncclAllReduce(avg)", [&]() -> ncclResult_t {
      ncclResult_t r = ncclGroupStart();
      if (r != ncclSuccess) return r;
      for (const auto& [ptr, count] : buffers) {
        if (count == 0) continue;
        r = ncclAllReduce(ptr, ptr, count, ncclFloat, ncclAvg, comm_, stream_);
        if (r != ncclSuccess && r != ncclInProgress) {
          ncclGroupEnd();
          return r;
        }
      }
      return ncclGroupEnd();
    });
  }

  Status Broadcast(float* data, size_t count, int root) override {
    if (root < 0 || root >= world_size_) {
      return Status::InvalidArgument("Broadcast: root " + std::to_string(root) + " out of range");
    }
    ISTHMUS_RETURN_IF_ERROR(Check("Broadcast", data, count));
    if (count == 0) return Status::Ok();
    return Launch("ncclBroadcast", [&] {
      return ncclBroadcast(data, data, count, ncclFloat, root, comm_, stream_);
    });
  }

  Status AllGather(float* data, const std::vector<size_t>& counts) override {
    ISTHMUS_RETURN_IF_ERROR(CheckGatherCounts(counts));
    size_t total = 0;
    for (size_t c : counts) total += c;
    ISTHMUS_RETURN_IF_ERROR(Check("AllGather", data, total));
    if (total == 0 || world_size_ == 1) return Status::Ok();
    // One broadcast per owner, as a group: the parts travel at once (ncclAllGather needs
    // equal parts).
    return Launch("grouped ncclBroadcast (all-gather)", [&]() -> ncclResult_t {
      ncclResult_t r = ncclGroupStart();
      if (r != ncclSuccess) return r;
      size_t offset = 0;
      for (int root = 0; root < world_size_; ++root) {
        const size_t count = counts[root];
        if (count > 0) {
          r = ncclBroadcast(data + offset, data + offset, count, ncclFloat, root, comm_, stream_);
          if (r != ncclSuccess && r != ncclInProgress) {
            ncclGroupEnd();
            return r;
          }
        }
        offset += count;
      }
      return ncclGroupEnd();
    });
  }

  Status Barrier() override {
    // NCCL has no barrier; a one-element all-reduce completes only when every rank joined.
    ISTHMUS_RETURN_IF_ERROR(Check("Barrier", nullptr, 0));
    return Launch("barrier", [&] {
      return ncclAllReduce(scratch_, scratch_, 1, ncclFloat, ncclSum, comm_, stream_);
    });
  }

 private:
  Status Check(const char* what, const float* data, size_t count) const {
    return CheckCall(what, broken_, data, count);
  }

  Status AllReduce(const char* what, float* data, size_t count, ncclRedOp_t op) {
    ISTHMUS_RETURN_IF_ERROR(Check(what, data, count));
    if (count == 0) return Status::Ok();
    return Launch(what,
                  [&] { return ncclAllReduce(data, data, count, ncclFloat, op, comm_, stream_); });
  }

  // Enqueues with `enqueue`, then waits for the stream against the deadline. Any failure
  // aborts the NCCL communicator (the only way to stop kernels waiting on a dead peer) and
  // marks this object broken. The wait polls (a blocking wait could not be abandoned at
  // the deadline): yielding at first, for the short collectives of small gradients, then
  // sleeping between polls, up to 100 us, so that a long all-reduce (a bucket in flight
  // during the backward) does not hold a core.
  template <typename Enqueue>
  Status Launch(const char* what, Enqueue&& enqueue) {
    const auto deadline = Clock::now() + timeout_;
    Status s = CudaStatus("cudaSetDevice", cudaSetDevice(device_));
    if (s.ok()) s = NcclStatus(what, enqueue());
    if (s.ok()) s = WaitComm(comm_, deadline, what);
    constexpr int kYieldPolls = 200;
    constexpr std::chrono::microseconds kMaxNap{100};
    std::chrono::microseconds nap{5};
    int polls = 0;
    while (s.ok()) {
      cudaError_t err = cudaStreamQuery(stream_);
      if (err == cudaSuccess) break;
      if (err != cudaErrorNotReady) {
        s = CudaStatus(what, err);
        break;
      }
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm_, &async);
      if (async != ncclSuccess && async != ncclInProgress) {
        s = NcclStatus(what, async);
        break;
      }
      if (Clock::now() >= deadline) {
        s = Status::Timeout(std::string(what) + " (rank " + std::to_string(rank_) + " of " +
                            std::to_string(world_size_) + "): no completion within " +
                            std::to_string(timeout_.count()) + " ms");
        break;
      }
      if (++polls < kYieldPolls) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(nap);
        nap = std::min(nap * 2, kMaxNap);
      }
    }
    if (!s.ok()) {
      broken_ = s;
      ncclCommAbort(comm_);
      comm_ = nullptr;
    }
    return s;
  }

  const int rank_;
  const int world_size_;
  const int device_;
  const std::chrono::milliseconds timeout_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  float* scratch_ = nullptr;  // device float for Barrier
  void* bf16_ = nullptr;      // AllReduceAverageBf16's staging, bf16_capacity_ values
  size_t bf16_capacity_ = 0;
  Status broken_;
};

}  // namespace

bool NcclAvailable() { return true; }

Result<std::unique_ptr<Communicator>> CreateNcclCommunicator(const NcclOptions& options) {
  if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size) {
    return Status::InvalidArgument("nccl: rank " + std::to_string(options.rank) +
                                   " and world size " + std::to_string(options.world_size) +
                                   " do not fit 0 <= rank < world_size");
  }
  if (options.timeout.count() <= 0)
    return Status::InvalidArgument("nccl: timeout must be positive");
  int devices = 0;
  cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess || devices == 0) {
    cudaGetLastError();
    return Status::FailedPrecondition(
        std::string("nccl: no CUDA device: ") +
        (err != cudaSuccess ? cudaGetErrorString(err) : "zero devices visible"));
  }
  const int device = options.device >= 0 ? options.device : options.rank % devices;
  if (device >= devices) {
    return Status::InvalidArgument("nccl: device " + std::to_string(device) + " but only " +
                                   std::to_string(devices) + " visible");
  }

  ISTHMUS_ASSIGN_OR_RETURN(
      std::unique_ptr<Rendezvous> rendezvous,
      Rendezvous::Open(options.rendezvous, options.rank, options.prefix, options.timeout));
  ISTHMUS_RETURN_IF_ERROR(rendezvous->AgreeOnLaunch(options.rank, options.world_size));
  ISTHMUS_RETURN_IF_ERROR(
      AgreeOnKind(*rendezvous, options.rank, options.world_size, "nccl (--device cuda)"));
  if (!options.settings.empty()) {
    ISTHMUS_RETURN_IF_ERROR(
        AgreeOnSettings(*rendezvous, options.rank, options.world_size, options.settings));
  }
  {
    // Two ranks on one GPU are refused before NCCL sees them.
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    cudaDeviceProp prop{};
    char uuid[64] = "?";
    if (cudaGetDeviceProperties(&prop, device) == cudaSuccess) {
      const auto* u = reinterpret_cast<const unsigned char*>(prop.uuid.bytes);
      std::snprintf(uuid, sizeof uuid,
                    "%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0],
                    u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12],
                    u[13], u[14], u[15]);
    }
    ISTHMUS_RETURN_IF_ERROR(AgreeOnDistinctDevices(*rendezvous, options.rank, options.world_size,
                                                   std::string(host) + " GPU-" + uuid));
  }
  ncclUniqueId id;
  const std::string key = "nccl_unique_id";
  if (options.rank == 0) {
    ISTHMUS_NCCL_RETURN_IF_ERROR(ncclGetUniqueId(&id));
    std::vector<char> bytes(sizeof(id.internal));
    std::memcpy(bytes.data(), id.internal, sizeof(id.internal));
    ISTHMUS_RETURN_IF_ERROR(rendezvous->Set(key, bytes));
  } else {
    ISTHMUS_ASSIGN_OR_RETURN(std::vector<char> bytes, rendezvous->Get(key));
    if (bytes.size() != sizeof(id.internal)) {
      return Status::Corruption("nccl: unique id in the store has " + std::to_string(bytes.size()) +
                                " bytes");
    }
    std::memcpy(id.internal, bytes.data(), sizeof(id.internal));
  }

  auto comm =
      std::make_unique<NcclCommunicator>(options.rank, options.world_size, device, options.timeout);
  ISTHMUS_RETURN_IF_ERROR(comm->Init(id));
  // Initialisation completes only once every rank joined, so all have read the id.
  rendezvous.reset();
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace isthmus::comm

#else  // !ISTHMUS_HAVE_NCCL

namespace isthmus::comm {

bool NcclAvailable() { return false; }

Result<std::unique_ptr<Communicator>> CreateNcclCommunicator(const NcclOptions&) {
  return Status::FailedPrecondition("nccl: this build has no NCCL (configure with CUDA and NCCL)");
}

}  // namespace isthmus::comm

#endif  // ISTHMUS_HAVE_NCCL
