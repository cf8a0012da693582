// AdamW inner steps over the model's trainable tensors, and their checkpoint format.
#include "worker/model/trainer.h"

#include <cmath>
#include <cstdlib>
#include <map>

#include "common/safetensors.h"

namespace isthmus::model {
namespace {

constexpr int64_t kStepRadix = int64_t{1} << 24;  // floats hold integers below 2^24 exactly
const std::string kOptPrefix = "opt.";

}  // namespace

Status TrainerConfig::Validate() const {
  auto bad = [](const char* what) {
    return Status::InvalidArgument(std::string("trainer: ") + what);
  };
  if (!std::isfinite(max_lr) || !std::isfinite(min_lr) || max_lr < 0 || min_lr < 0) {
    return bad("learning rates must be finite and >= 0");
  }
  if (warmup_steps < 0 || total_steps < 0 || warmup_steps > total_steps) {
    return bad("need 0 <= warmup_steps <= total_steps");
  }
  if (!(beta1 >= 0 && beta1 < 1) || !(beta2 >= 0 && beta2 < 1))
    return bad("betas must be in [0,1)");
  if (!(eps > 0) || !std::isfinite(eps)) return bad("eps must be finite and > 0");
  if (!(weight_decay >= 0) || !std::isfinite(weight_decay)) return bad("weight_decay must be >= 0");
  if (!std::isfinite(grad_clip)) return bad("grad_clip must be finite");
  return Status::Ok();
}

Trainer::Trainer(Gpt& model, const TrainerConfig& config)
    : model_(model), config_(config), params_(model.Trainable()) {
  if (!config_.Validate().ok()) std::abort();
  for (const ParamView& p : params_) {
    m_.emplace_back(p.numel, 0.0f);
    v_.emplace_back(p.numel, 0.0f);
  }
}

StepStats Trainer::Step(const int32_t* tokens, const int32_t* targets, int B, int T) {
  ops::Ops& ops = ops::CpuOps();
  StepStats stats;
  model_.ZeroGrad();
  stats.loss = model_.Forward(tokens, targets, B, T);
  model_.Backward();
  if (hook_) hook_(params_);

  double sum_sq = 0.0;
  for (const ParamView& p : params_) sum_sq += ops.SumSquares(p.grad, p.numel);
  const double norm = std::sqrt(sum_sq);
  stats.grad_norm = static_cast<float>(norm);
  stats.lr = ops::WarmupCosineLr(step_, config_.warmup_steps, config_.total_steps, config_.max_lr,
                                 config_.min_lr);
  if (!std::isfinite(norm)) {
    stats.skipped = true;
    return stats;
  }
  if (config_.grad_clip > 0 && norm > config_.grad_clip) {
    const float s = static_cast<float>(config_.grad_clip / (norm + 1e-6));
    for (ParamView& p : params_) ops.Scale(p.grad, p.numel, s);
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    ParamView& p = params_[i];
    const float wd = p.shape.size() >= 2 ? config_.weight_decay : 0.0f;
    ops.AdamWStep(p.data, p.grad, m_[i].data(), v_[i].data(), p.numel, stats.lr, config_.beta1,
                  config_.beta2, config_.eps, wd, step_ + 1);
  }
  ++step_;
  return stats;
}

std::vector<Tensor> Trainer::ExportState() const {
  std::vector<Tensor> out;
  out.reserve(2 * params_.size() + 1);
  for (size_t i = 0; i < params_.size(); ++i) {
    out.push_back({kOptPrefix + "m." + params_[i].name, params_[i].shape, m_[i]});
    out.push_back({kOptPrefix + "v." + params_[i].name, params_[i].shape, v_[i]});
  }
  out.push_back({kOptPrefix + "step",
                 {2},
                 {static_cast<float>(step_ % kStepRadix), static_cast<float>(step_ / kStepRadix)}});
  return out;
}

Status Trainer::ParseState(const std::vector<Tensor>& tensors, ParsedState* parsed) const {
  std::map<std::string, const Tensor*> opt;
  for (const Tensor& t : tensors) {
    if (t.name.rfind(kOptPrefix, 0) != 0) continue;
    if (!opt.emplace(t.name, &t).second) {
      return Status::InvalidArgument("optimizer state \"" + t.name + "\" given twice");
    }
  }
  auto get = [&](const std::string& name, const std::vector<int64_t>& shape,
                 const Tensor** out) -> Status {
    auto it = opt.find(name);
    if (it == opt.end()) return Status::InvalidArgument("optimizer state lacks \"" + name + "\"");
    if (it->second->shape != shape ||
        static_cast<int64_t>(it->second->data.size()) != NumElements(shape)) {
      return Status::InvalidArgument("optimizer state \"" + name + "\" has the wrong shape");
    }
    *out = it->second;
    return Status::Ok();
  };
  const Tensor* step = nullptr;
  ISTHMUS_RETURN_IF_ERROR(get(kOptPrefix + "step", {2}, &step));
  const float lo = step->data[0], hi = step->data[1];
  if (!(lo >= 0 && lo < kStepRadix && lo == std::floor(lo) && hi >= 0 && hi < kStepRadix &&
        hi == std::floor(hi))) {
    return Status::InvalidArgument("optimizer state \"opt.step\" is not a step count");
  }
  parsed->m.assign(params_.size(), nullptr);
  parsed->v.assign(params_.size(), nullptr);
  for (size_t i = 0; i < params_.size(); ++i) {
    ISTHMUS_RETURN_IF_ERROR(
        get(kOptPrefix + "m." + params_[i].name, params_[i].shape, &parsed->m[i]));
    ISTHMUS_RETURN_IF_ERROR(
        get(kOptPrefix + "v." + params_[i].name, params_[i].shape, &parsed->v[i]));
  }
  if (opt.size() != 2 * params_.size() + 1) {
    return Status::InvalidArgument("optimizer state has tensors this model does not train");
  }
  parsed->step = static_cast<int64_t>(hi) * kStepRadix + static_cast<int64_t>(lo);
  return Status::Ok();
}

void Trainer::ApplyState(const ParsedState& parsed) {
  for (size_t i = 0; i < params_.size(); ++i) {
    m_[i] = parsed.m[i]->data;
    v_[i] = parsed.v[i]->data;
  }
  step_ = parsed.step;
}

Status Trainer::LoadState(const std::vector<Tensor>& tensors) {
  ParsedState parsed;
  ISTHMUS_RETURN_IF_ERROR(ParseState(tensors, &parsed));
  ApplyState(parsed);
  return Status::Ok();
}

Status Trainer::SaveCheckpoint(const std::string& path) const {
  std::vector<Tensor> tensors = model_.ExportTrainable();
  std::vector<Tensor> state = ExportState();
  tensors.insert(tensors.end(), std::make_move_iterator(state.begin()),
                 std::make_move_iterator(state.end()));
  std::map<std::string, std::string> meta = model_.ConfigMetadata();
  meta["format"] = "isthmus-checkpoint";
  meta["train_mode"] = TrainModeName(model_.mode());
  return WriteSafetensors(path, tensors, meta);
}

Status Trainer::LoadCheckpoint(const std::string& path) {
  ISTHMUS_ASSIGN_OR_RETURN(SafetensorsFile file, ReadSafetensors(path));
  auto it = file.metadata.find("train_mode");
  if (it == file.metadata.end() || it->second != TrainModeName(model_.mode())) {
    return Status::FailedPrecondition(path + ": checkpoint train_mode is not \"" +
                                      TrainModeName(model_.mode()) + "\"");
  }
  std::vector<Tensor> weights, state;
  for (Tensor& t : file.tensors) {
    (t.name.rfind(kOptPrefix, 0) == 0 ? state : weights).push_back(std::move(t));
  }
  // Check the optimizer state before touching the model so that a bad file changes nothing.
  ParsedState parsed;
  ISTHMUS_RETURN_IF_ERROR(ParseState(state, &parsed));
  ISTHMUS_RETURN_IF_ERROR(model_.LoadTrainable(weights, /*require_all=*/true));
  ApplyState(parsed);
  return Status::Ok();
}

}  // namespace isthmus::model
