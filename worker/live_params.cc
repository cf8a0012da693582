// The round driver's LiveParams on the model's compute backend (see live_params.h).
#include "worker/live_params.h"

#include <algorithm>
#include <map>

namespace isthmus::worker {

Result<std::unique_ptr<ModelLiveParams>> ModelLiveParams::Create(model::Gpt& gpt,
                                                                 comm::Communicator* comm) {
  std::unique_ptr<ModelLiveParams> p(new ModelLiveParams(gpt, comm));
  const size_t bytes = p->n() * sizeof(float);
  ISTHMUS_ASSIGN_OR_RETURN(p->base_, ops::Buffer::Allocate(gpt.ops(), bytes));
  ISTHMUS_ASSIGN_OR_RETURN(p->staging_, ops::Buffer::Allocate(gpt.ops(), bytes));
  ISTHMUS_RETURN_IF_ERROR(p->Reset());
  std::vector<size_t> sizes;
  for (const auto& t : gpt.Trainable()) sizes.push_back(static_cast<size_t>(t.numel));
  p->spare_.Reserve(sizes);
  return p;
}

Status ModelLiveParams::Reset() {
  ops::Ops& ops = gpt_.ops();
  ops.Copy(base_.data(), gpt_.TrainableData(), n() * sizeof(float));
  return ops.Synchronize();
}

Result<std::vector<Tensor>> ModelLiveParams::TakeDelta() {
  ops::Ops& ops = gpt_.ops();
  float* live = gpt_.TrainableData();
  float* base = base_.as<float>();
  float* minus = staging_.as<float>();
  const auto count = static_cast<int64_t>(n());
  ops.Subtract(live, base, minus, count);  // delta
  // Downloaded tensor by tensor into the round's buffers (a recycled delta's when there is
  // one: no new memory for the kernel to zero).
  const auto& trainable = gpt_.Trainable();
  std::vector<Tensor> out;
  out.reserve(trainable.size());
  for (size_t i = 0; i < trainable.size(); ++i) {
    const auto& p = trainable[i];
    Tensor t{p.name, p.shape, spare_.Take(i, static_cast<size_t>(p.numel))};
    ops.Download(t.data.data(), minus + p.offset, t.data.size() * sizeof(float));
    out.push_back(std::move(t));
  }
  // live := base + delta, as a shard adding it computes, with the backend's one subtraction:
  // base - live is exactly -delta (rounding is symmetric), and base - (-delta) is base +
  // delta. On the device, not a pass over the host copy on the caller's thread.
  ops.Subtract(base, live, minus, count);
  ops.Subtract(base, minus, live, count);
  ops.Copy(base, live, n() * sizeof(float));
  gpt_.TrainableChanged();
  ISTHMUS_RETURN_IF_ERROR(ops.Synchronize());
  return out;
}

Status ModelLiveParams::Rebase(const std::vector<Tensor>* pulled, bool progressed) {
  ops::Ops& ops = gpt_.ops();
  float* staged = staging_.as<float>();
  if (pulled != nullptr) {
    std::map<std::string, const Tensor*> by_name;
    for (const auto& t : *pulled) by_name[t.name] = &t;
    std::vector<const Tensor*> src;
    for (const auto& p : gpt_.Trainable()) {
      auto it = by_name.find(p.name);
      if (it == by_name.end()) {
        return Status::InvalidArgument("the pulled state has no tensor '" + p.name + "'");
      }
      if (it->second->shape != p.shape ||
          static_cast<int64_t>(it->second->data.size()) != p.numel) {
        return Status::InvalidArgument("the pulled tensor '" + p.name +
                                       "' has another shape than the model's");
      }
      src.push_back(it->second);
    }
    // Uploaded tensor by tensor; the alignment gaps between them (never trained) are zeros,
    // as in the live weights.
    std::vector<std::pair<int64_t, size_t>> spans;  // offset, tensor index
    for (size_t i = 0; i < src.size(); ++i) spans.emplace_back(gpt_.Trainable()[i].offset, i);
    std::sort(spans.begin(), spans.end());
    int64_t end = 0;  // the end of the last tensor uploaded
    for (const auto& [offset, i] : spans) {
      if (offset > end) ops.Zero(staged + end, static_cast<size_t>(offset - end) * sizeof(float));
      const Tensor& t = *src[i];
      ops.Upload(staged + offset, t.data.data(), t.data.size() * sizeof(float));
      end = offset + static_cast<int64_t>(t.data.size());
    }
    const auto total = static_cast<int64_t>(n());
    if (total > end) ops.Zero(staged + end, static_cast<size_t>(total - end) * sizeof(float));
  } else if (comm_ == nullptr) {
    return Status::InvalidArgument("no pulled state to merge");
  }
  if (comm_ != nullptr) {
    ISTHMUS_RETURN_IF_ERROR(ops.Synchronize());
    ISTHMUS_RETURN_IF_ERROR(comm_->Broadcast(staged, n(), 0));
  }
  float* live = gpt_.TrainableData();
  float* base = base_.as<float>();
  if (progressed) {
    const auto count = static_cast<int64_t>(n());
    ops.Subtract(base, staged, base, count);  // base - P
    ops.Subtract(live, base, live, count);    // live + (P - base)
  } else {
    ops.Copy(live, staged, n() * sizeof(float));
  }
  std::swap(base_, staging_);  // base := P
  gpt_.TrainableChanged();
  return ops.Synchronize();
}

}  // namespace isthmus::worker
