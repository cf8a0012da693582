#include "ops/codec_worker.h"

#include <spdlog/spdlog.h>

#include <span>

#include "common/tensor.h"
#include "ops/codec.h"

namespace isthmus::codec {

Result<std::vector<std::string_view>> FeedbackEncoder::Encode(
    uint64_t round, const std::vector<TensorView>& deltas,
    const std::map<std::string, std::string>& pipelines) {
  if (round != round_) {
    if (round_ != 0 && round_ != done_ && !encoded_.empty()) {
      spdlog::warn(
          "round {} was encoded but never pushed to every shard; round {} starts from "
          "the residuals of round {}",
          round_, round, done_);
    }
    encoded_.clear();
    round_ = round;
  }
  // Everything is checked before anything is kept: a refused call leaves no half-made entry
  // that a retry would take for the round's bytes.
  std::vector<const TensorView*> todo;
  std::vector<Pipeline> pipes;
  for (const auto& d : deltas) {
    if (encoded_.count(d.name)) continue;  // a retried push: the bytes of the first time
    auto text = pipelines.find(d.name);
    if (text == pipelines.end()) {
      return Status::InvalidArgument("no pipeline given for tensor '" + d.name + "'");
    }
    ISTHMUS_ASSIGN_OR_RETURN(Pipeline pipe, ParsePipeline(text->second));
    pipes.push_back(pipe);
    const size_t n = static_cast<size_t>(NumElements(d.shape));
    if (auto res = residual_.find(d.name); res != residual_.end() && res->second.size() != n) {
      return Status::InvalidArgument("tensor '" + d.name + "' has " + std::to_string(n) +
                                     " values, its residual " + std::to_string(res->second.size()));
    }
    todo.push_back(&d);
  }
  std::vector<FeedbackTask> tasks;
  std::vector<Encoded*> outs;
  for (size_t i = 0; i < todo.size(); ++i) {
    const TensorView& d = *todo[i];
    const size_t n = static_cast<size_t>(NumElements(d.shape));
    std::vector<float>& res = residual_[d.name];
    if (res.empty()) res.assign(n, 0.0f);
    Encoded& e = encoded_[d.name];
    e.residual.resize(n);
    FeedbackTask& t = tasks.emplace_back();
    t.pipeline = pipes[i];
    t.delta = std::span<const float>(d.data, n);
    t.shape = d.shape;
    t.residual_in = res;
    t.residual_out = e.residual;
    outs.push_back(&e);
  }
  EncodeWithFeedbackMany(tasks, threads_);
  for (size_t i = 0; i < tasks.size(); ++i) outs[i]->bytes = std::move(tasks[i].bytes);
  std::vector<std::string_view> out;
  out.reserve(deltas.size());
  for (const auto& d : deltas) out.emplace_back(encoded_.at(d.name).bytes);
  return out;
}

void FeedbackEncoder::Done(uint64_t round) {
  if (round != round_ || done_ == round) return;
  for (auto& [name, e] : encoded_) residual_.at(name).swap(e.residual);
  done_ = round;
}

void FeedbackEncoder::SetResiduals(std::map<std::string, std::vector<float>> residuals) {
  residual_ = std::move(residuals);
  encoded_.clear();
  round_ = 0;
  done_ = 0;
}

}  // namespace isthmus::codec
