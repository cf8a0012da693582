// The round driver's LiveParams on the model's compute backend (see live_params.h).
#include "worker/live_params.h"

#include <map>

namespace isthmus::worker {

Result<std::unique_ptr<ModelLiveParams>> ModelLiveParams::Create(model::Gpt& gpt,
                                                                 comm::Communicator* comm) {
  std::unique_ptr<ModelLiveParams> p(new ModelLiveParams(gpt, comm));
  const size_t bytes = p->n() * sizeof(float);
  ISTHMUS_ASSIGN_OR_RETURN(p->base_, ops::Buffer::Allocate(gpt.ops(), bytes));
  ISTHMUS_ASSIGN_OR_RETURN(p->staging_, ops::Buffer::Allocate(gpt.ops(), bytes));
  ISTHMUS_RETURN_IF_ERROR(p->Reset());
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
  ops.Subtract(base, live, minus, count);  // -delta
  std::vector<float> flat(n());
  ops.Download(flat.data(), minus, flat.size() * sizeof(float));
  ops.Subtract(base, minus, live, count);  // base + delta, as a shard adding it computes
  ops.Copy(base, live, n() * sizeof(float));
  gpt_.TrainableChanged();
  ISTHMUS_RETURN_IF_ERROR(ops.Synchronize());
  std::vector<Tensor> out;
  for (const auto& p : gpt_.Trainable()) {
    Tensor t{p.name, p.shape, std::vector<float>(static_cast<size_t>(p.numel))};
    const float* src = flat.data() + p.offset;
    for (size_t i = 0; i < t.data.size(); ++i) t.data[i] = -src[i];
    out.push_back(std::move(t));
  }
  return out;
}

Status ModelLiveParams::Rebase(const std::vector<Tensor>* pulled, bool progressed) {
  ops::Ops& ops = gpt_.ops();
  float* staged = staging_.as<float>();
  if (pulled != nullptr) {
    std::map<std::string, const Tensor*> by_name;
    for (const auto& t : *pulled) by_name[t.name] = &t;
    std::vector<float> flat(n(), 0.0f);
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
      std::copy(it->second->data.begin(), it->second->data.end(), flat.begin() + p.offset);
    }
    ops.Upload(staged, flat.data(), flat.size() * sizeof(float));
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
