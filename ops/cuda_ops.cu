// The CUDA backend of ops/ops.h on one GPU: device memory, a non-blocking stream that
// every kernel and copy is ordered on, matmuls through cuBLASLt (fp32 compute; bf16 inputs
// on tensor cores), CUDA graphs, and the sticky error every CUDA and cuBLAS call feeds
// through one check macro. The kernels themselves come from ops/cuda_backend.h.
#include <cublasLt.h>
#include <cublas_v2.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <tuple>
#include <utility>

#include "ops/buffer.h"
#include "ops/cuda_backend.h"
#include "ops/device.h"

#ifndef ISTHMUS_CUDA_ARCHS
#define ISTHMUS_CUDA_ARCHS "unknown"
#endif

namespace isthmus::ops::cuda {
namespace {

constexpr size_t kLtWorkspaceBytes = size_t{32} << 20;  // cuBLASLt's advice for Hopper
constexpr size_t kBounceBytes = size_t{16} << 20;       // pinned staging for pageable copies

std::string Where(const char* file, int line) {
  const char* base = std::strrchr(file, '/');
  return std::string(base != nullptr ? base + 1 : file) + ":" + std::to_string(line);
}

std::string GiB(size_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(bytes) / (1 << 30));
  return buf;
}

cudaDataType_t CudaType(Dtype d) { return d == Dtype::kF32 ? CUDA_R_32F : CUDA_R_16BF; }

// Largest power of two (at most 16) that divides the address and the byte length of a
// row: what cuBLASLt may assume of every row of the operand.
uint32_t Alignment(const void* p, int64_t ld, size_t elem) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p) | static_cast<uintptr_t>(ld * elem);
  uint32_t align = 16;
  while (align > 1 && a % align != 0) align /= 2;
  return align;
}

// Checks a CUDA call inside a CudaOps method: on failure the error (with the call's text,
// file and line and CUDA's message) becomes the backend's sticky status and CUDA's own
// per-thread error is cleared.
#define ISTHMUS_CUDA_CHECK(call)                                                          \
  do {                                                                                    \
    const cudaError_t isthmus_err_ = (call);                                              \
    if (isthmus_err_ != cudaSuccess) {                                                    \
      cudaGetLastError();                                                                 \
      RecordError(std::string(#call) + ": " + cudaGetErrorString(isthmus_err_), __FILE__, \
                  __LINE__);                                                              \
    }                                                                                     \
  } while (0)

#define ISTHMUS_CUBLAS_CHECK(call)                                                      \
  do {                                                                                  \
    const cublasStatus_t isthmus_st_ = (call);                                          \
    if (isthmus_st_ != CUBLAS_STATUS_SUCCESS) {                                         \
      RecordError(std::string(#call) + ": " + cublasGetStatusName(isthmus_st_) + " (" + \
                      cublasGetStatusString(isthmus_st_) + ")",                         \
                  __FILE__, __LINE__);                                                  \
    }                                                                                   \
  } while (0)

// Does nothing; asking for its attributes tells whether this build has code for the device.
__global__ void ProbeKernel() {}

class CudaOps;

class CudaGraph final : public Graph {
 public:
  CudaGraph(CudaOps* ops, cudaGraph_t graph, cudaGraphExec_t exec)
      : ops_(ops), graph_(graph), exec_(exec) {}
  ~CudaGraph() override {
    cudaGraphExecDestroy(exec_);
    cudaGraphDestroy(graph_);
  }
  void Replay() override;

 private:
  CudaOps* ops_;
  cudaGraph_t graph_;
  cudaGraphExec_t exec_;
};

// A cached cuBLASLt problem: descriptors and the heuristic's algorithm.
struct MatmulPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool lt = false;  // false: no cuBLASLt algorithm; cublasGemmEx is used instead
};

using MatmulKey = std::tuple<int, int, int, bool, bool, Dtype, Dtype, uint32_t, uint32_t, uint32_t>;

class CudaOps final : public KernelOps {
 public:
  explicit CudaOps(int device) : device_(device) {}

  Status Init() {
    ISTHMUS_CUDA_CHECK(cudaSetDevice(device_));
    ISTHMUS_CUDA_CHECK(cudaGetDeviceProperties(&props_, device_));
    int optin = 0;
    ISTHMUS_CUDA_CHECK(
        cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device_));
    max_smem_ = static_cast<size_t>(optin);
    ISTHMUS_RETURN_IF_ERROR(error_);
    ISTHMUS_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    ISTHMUS_CUBLAS_CHECK(cublasLtCreate(&lt_));
    ISTHMUS_CUBLAS_CHECK(cublasCreate(&blas_));
    ISTHMUS_RETURN_IF_ERROR(error_);
    ISTHMUS_CUBLAS_CHECK(cublasSetStream(blas_, stream_));
    ISTHMUS_ASSIGN_OR_RETURN(lt_workspace_, Alloc(kLtWorkspaceBytes));
    ISTHMUS_ASSIGN_OR_RETURN(void* ws, Alloc(kWorkspaceFloats * sizeof(float)));
    workspace_ = static_cast<float*>(ws);
    ISTHMUS_ASSIGN_OR_RETURN(bounce_, AllocHost(kBounceBytes));
    // cuBLAS must not allocate while a graph is being captured: give it its workspace.
    ISTHMUS_CUBLAS_CHECK(cublasSetWorkspace(blas_, lt_workspace_, kLtWorkspaceBytes));
    ISTHMUS_RETURN_IF_ERROR(error_);
    // Is there code in this build for this device? Any kernel tells.
    cudaFuncAttributes attr;
    const cudaError_t probe =
        cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(&ProbeKernel));
    if (probe != cudaSuccess) {
      cudaGetLastError();
      return Status::FailedPrecondition(
          "cuda:" + std::to_string(device_) + " (" + props_.name + ") is sm_" +
          std::to_string(props_.major) + std::to_string(props_.minor) +
          " but this build's CUDA code targets " ISTHMUS_CUDA_ARCHS " (" +
          cudaGetErrorString(probe) + "); rebuild with -DCMAKE_CUDA_ARCHITECTURES=" +
          std::to_string(props_.major) + std::to_string(props_.minor));
    }
    return Status::Ok();
  }

  ~CudaOps() override {
    cudaSetDevice(device_);
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    for (auto& [key, plan] : plans_) {
      if (plan.a != nullptr) cublasLtMatrixLayoutDestroy(plan.a);
      if (plan.b != nullptr) cublasLtMatrixLayoutDestroy(plan.b);
      if (plan.c != nullptr) cublasLtMatrixLayoutDestroy(plan.c);
      if (plan.desc != nullptr) cublasLtMatmulDescDestroy(plan.desc);
    }
    // The handles go before the workspace they were given.
    if (blas_ != nullptr) cublasDestroy(blas_);
    if (lt_ != nullptr) cublasLtDestroy(lt_);
    if (bounce_ != nullptr) cudaFreeHost(bounce_);
    if (workspace_ != nullptr) cudaFree(workspace_);
    if (lt_workspace_ != nullptr) cudaFree(lt_workspace_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  const char* Name() const override { return "cuda"; }
  std::string Describe() const override {
    return "cuda:" + std::to_string(device_) + " (" + props_.name + ", " +
           GiB(props_.totalGlobalMem) + ", sm_" + std::to_string(props_.major) +
           std::to_string(props_.minor) + ")";
  }
  bool HostMemory() const override { return false; }

  Result<void*> Alloc(size_t bytes) override {
    ISTHMUS_RETURN_IF_ERROR(error_);
    if (bytes == 0) return static_cast<void*>(nullptr);
    if (capturing_) return Status::Internal("Alloc while capturing a graph");
    cudaSetDevice(device_);
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, bytes);
    if (err == cudaErrorMemoryAllocation) {
      cudaGetLastError();  // not sticky: the device is still usable
      size_t free = 0, total = 0;
      cudaMemGetInfo(&free, &total);
      return Status::ResourceExhausted("out of GPU memory on cuda:" + std::to_string(device_) +
                                       ": asked for " + GiB(bytes) + ", " + GiB(free) +
                                       " free of " + GiB(total));
    }
    ISTHMUS_CUDA_CHECK(err);
    ISTHMUS_RETURN_IF_ERROR(error_);
    counter_.Added(p, bytes);
    return p;
  }

  void Free(void* p) override {
    if (p == nullptr) return;
    counter_.Removed(p);
    ISTHMUS_CUDA_CHECK(cudaFree(p));
  }

  Result<void*> AllocHost(size_t bytes) override {
    ISTHMUS_RETURN_IF_ERROR(error_);
    if (bytes == 0) return static_cast<void*>(nullptr);
    cudaSetDevice(device_);
    void* p = nullptr;
    const cudaError_t err = cudaMallocHost(&p, bytes);
    if (err == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      return Status::ResourceExhausted("out of page-locked host memory: asked for " + GiB(bytes));
    }
    ISTHMUS_CUDA_CHECK(err);
    ISTHMUS_RETURN_IF_ERROR(error_);
    return p;
  }
  void FreeHost(void* p) override {
    if (p != nullptr) ISTHMUS_CUDA_CHECK(cudaFreeHost(p));
  }

  // Pageable host memory goes through the pinned bounce buffer in chunks, so that the
  // transfer runs at DMA speed and `src` is free again when this returns.
  void Upload(void* dst, const void* src, size_t bytes) override {
    if (!Ready("Upload")) return;
    for (size_t at = 0; at < bytes && !failed(); at += kBounceBytes) {
      const size_t n = std::min(kBounceBytes, bytes - at);
      std::memcpy(bounce_, static_cast<const char*>(src) + at, n);
      ISTHMUS_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(dst) + at, bounce_, n,
                                         cudaMemcpyHostToDevice, stream_));
      ISTHMUS_CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
  }
  void Download(void* dst, const void* src, size_t bytes) override {
    if (!Ready("Download")) return;
    for (size_t at = 0; at < bytes && !failed(); at += kBounceBytes) {
      const size_t n = std::min(kBounceBytes, bytes - at);
      ISTHMUS_CUDA_CHECK(cudaMemcpyAsync(bounce_, static_cast<const char*>(src) + at, n,
                                         cudaMemcpyDeviceToHost, stream_));
      ISTHMUS_CUDA_CHECK(cudaStreamSynchronize(stream_));
      if (!failed()) std::memcpy(static_cast<char*>(dst) + at, bounce_, n);
    }
  }
  void UploadAsync(void* dst, const void* src, size_t bytes) override {
    if (failed() || bytes == 0) return;
    ISTHMUS_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
  }
  void DownloadAsync(void* dst, const void* src, size_t bytes) override {
    if (failed() || bytes == 0) return;
    ISTHMUS_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
  }
  void Copy(void* dst, const void* src, size_t bytes) override {
    if (failed() || bytes == 0 || dst == src) return;
    ISTHMUS_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
  }
  void Zero(void* dst, size_t bytes) override {
    if (failed() || bytes == 0) return;
    ISTHMUS_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, stream_));
  }

  Status Synchronize() override {
    if (Ready("Synchronize")) ISTHMUS_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return error_;
  }
  Status status() const override { return error_; }

  std::function<Status()> Mark() override {
    Status now = error_;
    if (!now.ok() || capturing_) {
      if (now.ok()) now = Status::Internal("Mark while capturing a graph");
      return [now] { return now; };
    }
    // A blocking-sync event: the waiting thread sleeps instead of spinning on the CPU.
    cudaEvent_t event = nullptr;
    cudaError_t err =
        cudaEventCreateWithFlags(&event, cudaEventDisableTiming | cudaEventBlockingSync);
    if (err == cudaSuccess) err = cudaEventRecord(event, stream_);
    if (err != cudaSuccess) {
      if (event != nullptr) cudaEventDestroy(event);
      Status failed =
          Status::Internal(std::string("cudaEventRecord for a mark: ") + cudaGetErrorString(err));
      return [failed] { return failed; };
    }
    std::shared_ptr<CUevent_st> owned(event, [](cudaEvent_t e) { cudaEventDestroy(e); });
    const int device = device_;
    return [owned, device] {
      cudaSetDevice(device);  // the waiting thread then also works on this rank's device
      const cudaError_t e = cudaEventSynchronize(owned.get());
      if (e == cudaSuccess) return Status::Ok();
      return Status::Internal(std::string("waiting for a mark on cuda:") + std::to_string(device) +
                              ": " + cudaGetErrorString(e));
    };
  }

  MemoryInfo Memory() const override {
    MemoryInfo m;
    cudaSetDevice(device_);
    cudaMemGetInfo(&m.free, &m.total);
    counter_.Fill(&m);
    return m;
  }

  Status CheckAttention(int C, int H) const override {
    ISTHMUS_RETURN_IF_ERROR(KernelOps::CheckAttention(C, H));
    const size_t need = AttentionSharedBytes(C, H);
    if (need <= max_smem_) return Status::Ok();
    return Status::InvalidArgument(
        "attention with head size " + std::to_string(C / H) + " needs " +
        std::to_string(need / 1024) + " KiB of shared memory per block but " + props_.name +
        " allows " + std::to_string(max_smem_ / 1024) + " KiB: use a head size of 64");
  }

  bool SupportsGraphs() const override { return true; }

  // A failure while recording (a call that cannot be captured, say) does not poison the
  // backend: it is kept apart and returned by EndCapture, and the caller runs the work
  // without a graph.
  Status BeginCapture() override {
    ISTHMUS_RETURN_IF_ERROR(error_);
    if (capturing_) return Status::Internal("BeginCapture while capturing");
    cudaSetDevice(device_);
    const cudaError_t err = cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal);
    if (err != cudaSuccess) {
      cudaGetLastError();
      return Status::FailedPrecondition(std::string("cudaStreamBeginCapture: ") +
                                        cudaGetErrorString(err));
    }
    capturing_ = true;
    capture_error_ = Status::Ok();
    return Status::Ok();
  }

  Result<std::unique_ptr<Graph>> EndCapture() override {
    if (!capturing_) return Status::Internal("EndCapture without BeginCapture");
    capturing_ = false;
    cudaGraph_t graph = nullptr;
    cudaError_t err = cudaStreamEndCapture(stream_, &graph);
    cudaGraphExec_t exec = nullptr;
    if (err == cudaSuccess && capture_error_.ok()) err = cudaGraphInstantiate(&exec, graph, 0);
    // Uploading now makes a first launch that would not fit fail here, where the caller
    // falls back to launching kernels, rather than as a sticky error at Replay.
    if (err == cudaSuccess && capture_error_.ok()) err = cudaGraphUpload(exec, stream_);
    if (err != cudaSuccess || !capture_error_.ok()) {
      cudaGetLastError();
      if (exec != nullptr) cudaGraphExecDestroy(exec);
      if (graph != nullptr) cudaGraphDestroy(graph);
      Status why = capture_error_.ok()
                       ? Status::FailedPrecondition(std::string("recording a CUDA graph: ") +
                                                    cudaGetErrorString(err))
                       : capture_error_;
      capture_error_ = Status::Ok();
      return why;
    }
    return std::unique_ptr<Graph>(new CudaGraph(this, graph, exec));
  }

  void Replay(cudaGraphExec_t exec) {
    if (!failed()) ISTHMUS_CUDA_CHECK(cudaGraphLaunch(exec, stream_));
  }

  void Matmul(CRef a, CRef b, Ref c, int m, int n, int k, bool trans_a, bool trans_b, float alpha,
              float beta) override {
    if (failed() || m == 0 || n == 0) return;
    if (a.dtype != b.dtype) {
      RecordError("Matmul: operands of different dtypes", __FILE__, __LINE__);
      return;
    }
    if (a.dtype == Dtype::kF32 && c.dtype == Dtype::kBF16) {
      RecordError("Matmul: fp32 operands with a bf16 result (cuBLAS has no such kernel)", __FILE__,
                  __LINE__);
      return;
    }
    // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: hand cuBLAS the
    // operands swapped, each stored matrix read as its column-major transpose.
    const MatmulKey key{m,
                        n,
                        k,
                        trans_a,
                        trans_b,
                        a.dtype,
                        c.dtype,
                        Alignment(a.data, trans_a ? m : k, DtypeSize(a.dtype)),
                        Alignment(b.data, trans_b ? k : n, DtypeSize(b.dtype)),
                        Alignment(c.data, n, DtypeSize(c.dtype))};
    const MatmulPlan& plan = Plan(key);
    if (failed()) return;
    if (plan.lt) {
      ISTHMUS_CUBLAS_CHECK(cublasLtMatmul(lt_, plan.desc, &alpha, b.data, plan.a, a.data, plan.b,
                                          &beta, c.data, plan.c, c.data, plan.c, &plan.algo,
                                          lt_workspace_, kLtWorkspaceBytes, stream_));
      return;
    }
    ISTHMUS_CUBLAS_CHECK(cublasGemmEx(blas_, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                                      trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, n, m, k, &alpha, b.data,
                                      CudaType(b.dtype), trans_b ? k : n, a.data, CudaType(a.dtype),
                                      trans_a ? m : k, &beta, c.data, CudaType(c.dtype), n,
                                      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }

 protected:
  cudaStream_t stream() override { return stream_; }
  float* workspace() override { return workspace_; }
  bool failed() const override { return !error_.ok(); }
  void RecordError(const std::string& what, const char* file, int line) override {
    if (capturing_) {
      if (capture_error_.ok()) {
        capture_error_ = Status::FailedPrecondition(Where(file, line) + ": " + what);
      }
      return;
    }
    if (error_.ok()) {
      error_ = Status::Internal(Where(file, line) + ": " + what +
                                " (cuda:" + std::to_string(device_) + ")");
    }
  }

 private:
  // False (and the error recorded) when a host-synchronous call is made during capture.
  bool Ready(const char* what) {
    if (failed()) return false;
    if (capturing_) {
      RecordError(std::string(what) + " while capturing a graph", __FILE__, __LINE__);
      return false;
    }
    return true;
  }

  const MatmulPlan& Plan(const MatmulKey& key) {
    auto it = plans_.find(key);
    if (it != plans_.end()) return it->second;
    const auto [m, n, k, trans_a, trans_b, ab, cd, align_a, align_b, align_c] = key;
    MatmulPlan plan;
    const cublasOperation_t op_first = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // B^T side
    const cublasOperation_t op_second = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    ISTHMUS_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    ISTHMUS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA,
                                                        &op_first, sizeof op_first));
    ISTHMUS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB,
                                                        &op_second, sizeof op_second));
    // Stored shapes (column-major): first operand is b, second is a, output c^T [n,m].
    ISTHMUS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.a, CudaType(ab), trans_b ? k : n,
                                                    trans_b ? n : k, trans_b ? k : n));
    ISTHMUS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.b, CudaType(ab), trans_a ? m : k,
                                                    trans_a ? k : m, trans_a ? m : k));
    ISTHMUS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.c, CudaType(cd), n, m, n));
    cublasLtMatmulPreference_t pref = nullptr;
    ISTHMUS_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const size_t ws = kLtWorkspaceBytes;
    ISTHMUS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    ISTHMUS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_b, sizeof align_b));
    ISTHMUS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_a, sizeof align_a));
    ISTHMUS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c, sizeof align_c));
    ISTHMUS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c, sizeof align_c));
    if (cd == Dtype::kBF16) {
      // Split-K partial sums must not be kept in the bf16 output type ("accumulation is
      // fp32"): allow only reductions in the compute type.
      const uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
      ISTHMUS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
          pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &schemes, sizeof schemes));
    }
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    if (!failed()) {
      const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(
          lt_, plan.desc, plan.a, plan.b, plan.c, plan.c, pref, 1, &result, &found);
      plan.lt = st == CUBLAS_STATUS_SUCCESS && found > 0;
    }
    if (pref != nullptr) cublasLtMatmulPreferenceDestroy(pref);
    if (plan.lt) plan.algo = result.algo;
    return plans_.emplace(key, plan).first->second;
  }

  const int device_;
  cudaDeviceProp props_{};
  size_t max_smem_ = 0;  // dynamic shared memory one block may opt in to
  cudaStream_t stream_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  void* lt_workspace_ = nullptr;
  float* workspace_ = nullptr;
  void* bounce_ = nullptr;
  bool capturing_ = false;
  Status error_;          // the first failure; sticky
  Status capture_error_;  // the first failure while recording a graph
  std::map<MatmulKey, MatmulPlan> plans_;
  AllocationCounter counter_;
};

void CudaGraph::Replay() { ops_->Replay(exec_); }

}  // namespace
}  // namespace isthmus::ops::cuda

namespace isthmus::ops {

bool CudaBuilt() { return true; }

int CudaDeviceCount(std::string* why) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();
    if (why != nullptr) *why = cudaGetErrorString(err);
    return 0;
  }
  if (count == 0 && why != nullptr) *why = "zero devices visible";
  return count;
}

Result<std::unique_ptr<Ops>> CreateCudaOps(int device) {
  std::string why;
  const int count = CudaDeviceCount(&why);
  if (count == 0) return Status::FailedPrecondition("no CUDA device is usable: " + why);
  if (device < 0 || device >= count) {
    return Status::InvalidArgument("CUDA device " + std::to_string(device) + " does not exist (" +
                                   std::to_string(count) + " visible)");
  }
  auto ops = std::make_unique<cuda::CudaOps>(device);
  ISTHMUS_RETURN_IF_ERROR(ops->Init());
  return std::unique_ptr<Ops>(std::move(ops));
}

}  // namespace isthmus::ops
