// Choosing the compute backend of a process: what `--device cpu|cuda|cuda:N|auto` names,
// whether this build and machine have a GPU, and creating the CUDA backend. Without CUDA
// in the build the same functions exist and say so, so callers need no #ifdef.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "common/status.h"
#include "ops/ops.h"

namespace isthmus::ops {

struct DeviceChoice {
  enum class Kind { kAuto, kCpu, kCuda };
  Kind kind = Kind::kAuto;
  int index = -1;  // kCuda: the device; -1 = chosen by rank (rank % visible devices)

  bool operator==(const DeviceChoice&) const = default;
};

// "auto", "cpu", "cuda" or "cuda:N" (N >= 0). InvalidArgument listing the forms otherwise.
Result<DeviceChoice> ParseDevice(std::string_view text);
std::string ToString(const DeviceChoice& choice);

// True when this build contains the CUDA backend.
bool CudaBuilt();

// Number of CUDA devices visible to this process; 0 (with the reason in *why when why is
// not null) when none is, or when the build has no CUDA.
int CudaDeviceCount(std::string* why = nullptr);

// A CUDA backend on `device` (its own stream, cuBLASLt handle and workspaces), current on
// the calling thread; use it from that thread. Errors: FailedPrecondition when the build
// has no CUDA, no device is visible, or the device's architecture is not one this build
// compiled for (the message says how to rebuild); InvalidArgument for an index out of
// range; ResourceExhausted when its workspaces do not fit.
Result<std::unique_ptr<Ops>> CreateCudaOps(int device);

// What `choice` means for rank `rank` of a site on this machine: kAuto becomes kCuda when a
// device is visible (and the build has CUDA), else kCpu; kCuda gets an index: its own,
// else `local_rank` (the rank's place on its node, >= 0 when known), else rank % visible
// devices. FailedPrecondition when kCuda is asked for and no device is usable,
// InvalidArgument when the index or the local rank is out of range; the messages name the
// --device or --local-rank value and what to do.
Result<DeviceChoice> ResolveDevice(const DeviceChoice& choice, int rank, int local_rank = -1);
// The index part of ResolveDevice for `count` visible devices (count > 0).
Result<int> PickDevice(const DeviceChoice& choice, int rank, int local_rank, int count);

// The backend of a resolved choice. The CPU backend comes back as a non-owning pointer to
// CpuOps(). Errors as CreateCudaOps, prefixed with the --device value.
Result<std::shared_ptr<Ops>> OpenBackend(const DeviceChoice& resolved);

}  // namespace isthmus::ops
