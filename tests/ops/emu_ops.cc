// The emulated CUDA backend of tests/ops/emu_ops.h: KernelOps (compiled here by the host
// compiler against the emulator) over the CPU reference's memory calls and Matmul.
#include "tests/ops/emu_ops.h"

#include <string>
#include <vector>

#include "ops/cuda_backend.h"

namespace isthmus::ops {
namespace cuda_emu {
namespace {

class EmulatedCudaOps final : public KernelOps {
 public:
  EmulatedCudaOps() : workspace_(static_cast<size_t>(kWorkspaceFloats)) {}

  const char* Name() const override { return "cuda-emulated"; }
  std::string Describe() const override { return "the CUDA kernels on the CPU emulator"; }
  bool HostMemory() const override { return true; }
  Result<void*> Alloc(size_t bytes) override { return cpu().Alloc(bytes); }
  void Free(void* p) override { cpu().Free(p); }
  Result<void*> AllocHost(size_t bytes) override { return cpu().AllocHost(bytes); }
  void FreeHost(void* p) override { cpu().FreeHost(p); }
  void Upload(void* d, const void* s, size_t n) override { cpu().Upload(d, s, n); }
  void Download(void* d, const void* s, size_t n) override { cpu().Download(d, s, n); }
  void UploadAsync(void* d, const void* s, size_t n) override { cpu().UploadAsync(d, s, n); }
  void DownloadAsync(void* d, const void* s, size_t n) override { cpu().DownloadAsync(d, s, n); }
  void Copy(void* d, const void* s, size_t n) override { cpu().Copy(d, s, n); }
  void Zero(void* d, size_t n) override { cpu().Zero(d, n); }
  Status Synchronize() override { return error_; }
  Status status() const override { return error_; }
  MemoryInfo Memory() const override { return cpu().Memory(); }

  void Matmul(CRef a, CRef b, Ref c, int m, int n, int k, bool trans_a, bool trans_b, float alpha,
              float beta) override {
    if (!failed()) cpu().Matmul(a, b, c, m, n, k, trans_a, trans_b, alpha, beta);
  }

 protected:
  cudaStream_t stream() override { return nullptr; }
  float* workspace() override { return workspace_.data(); }
  bool failed() const override { return !error_.ok(); }
  void RecordError(const std::string& what, const char* file, int line) override {
    if (error_.ok())
      error_ = Status::Internal(std::string(file) + ":" + std::to_string(line) + ": " + what);
  }

 private:
  static Ops& cpu() { return CpuOps(); }
  std::vector<float> workspace_;
  Status error_;
};

}  // namespace
}  // namespace cuda_emu

std::unique_ptr<Ops> CreateEmulatedCudaOps() {
  return std::make_unique<cuda_emu::EmulatedCudaOps>();
}

}  // namespace isthmus::ops
