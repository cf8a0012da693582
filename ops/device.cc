// Parsing --device and picking a backend (ops/device.h); the CUDA half is in cuda_ops.cu
// or, in builds without CUDA, cuda_none.cc.
#include "ops/device.h"

#include <charconv>

namespace isthmus::ops {

Result<DeviceChoice> ParseDevice(std::string_view text) {
  DeviceChoice c;
  if (text == "auto") return c;
  if (text == "cpu") {
    c.kind = DeviceChoice::Kind::kCpu;
    return c;
  }
  if (text == "cuda") {
    c.kind = DeviceChoice::Kind::kCuda;
    return c;
  }
  if (text.starts_with("cuda:")) {
    const std::string_view digits = text.substr(5);
    int index = -1;
    auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), index);
    if (ec == std::errc() && end == digits.data() + digits.size() && !digits.empty() &&
        index >= 0) {
      c.kind = DeviceChoice::Kind::kCuda;
      c.index = index;
      return c;
    }
  }
  return Status::InvalidArgument("device \"" + std::string(text) +
                                 "\" is not one of auto, cpu, cuda, cuda:N");
}

std::string ToString(const DeviceChoice& choice) {
  switch (choice.kind) {
    case DeviceChoice::Kind::kAuto:
      return "auto";
    case DeviceChoice::Kind::kCpu:
      return "cpu";
    case DeviceChoice::Kind::kCuda:
      return choice.index < 0 ? "cuda" : "cuda:" + std::to_string(choice.index);
  }
  return "?";
}

Result<int> PickDevice(const DeviceChoice& choice, int rank, int local_rank, int count) {
  const std::string visible = std::to_string(count) + " CUDA device" + (count == 1 ? "" : "s") +
                              " visible (cuda:0 to cuda:" + std::to_string(count - 1) + ")";
  if (choice.index >= 0) {
    if (choice.index >= count) {
      return Status::InvalidArgument("--device " + ToString(choice) + ": only " + visible);
    }
    return choice.index;
  }
  if (local_rank >= 0) {
    if (local_rank >= count) {
      return Status::InvalidArgument("--local-rank " + std::to_string(local_rank) + " (rank " +
                                     std::to_string(rank) + "): only " + visible +
                                     ": start at most one rank per GPU on this node");
    }
    return local_rank;
  }
  return rank % count;
}

Result<DeviceChoice> ResolveDevice(const DeviceChoice& choice, int rank, int local_rank) {
  if (choice.kind == DeviceChoice::Kind::kCpu) return choice;
  std::string why;
  const int count = CudaDeviceCount(&why);
  if (choice.kind == DeviceChoice::Kind::kAuto && count == 0) {
    return DeviceChoice{DeviceChoice::Kind::kCpu, -1};
  }
  if (count == 0) {
    return Status::FailedPrecondition("--device " + ToString(choice) +
                                      ": no CUDA device is usable (" + why + "); use --device cpu");
  }
  ISTHMUS_ASSIGN_OR_RETURN(int index, PickDevice(choice, rank, local_rank, count));
  return DeviceChoice{DeviceChoice::Kind::kCuda, index};
}

Result<std::shared_ptr<Ops>> OpenBackend(const DeviceChoice& resolved) {
  if (resolved.kind != DeviceChoice::Kind::kCuda) {
    return std::shared_ptr<Ops>(&CpuOps(), [](Ops*) {});
  }
  auto ops = CreateCudaOps(resolved.index);
  if (!ops.ok()) {
    return Status(ops.status().code(),
                  "--device " + ToString(resolved) + ": " + ops.status().message());
  }
  return std::shared_ptr<Ops>(std::move(ops).value());
}

}  // namespace isthmus::ops
