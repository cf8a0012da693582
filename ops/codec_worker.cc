#include "ops/codec_worker.h"

#include <spdlog/spdlog.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <span>

#include "common/durable.h"
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
    // The buffers of the round before are the next residuals' (a full-mode round's are
    // hundreds of MB: fresh memory would cost the kernel's zeroing every round).
    for (auto& [name, e] : encoded_) spare_[name] = std::move(e.residual);
    encoded_.clear();
    round_ = round;
  }
  if (!kept_path_.empty() && kept_round_ != round) {
    kept_.clear();
    kept_round_ = round;
  }
  // Everything is checked before anything is kept: a refused call leaves no half-made entry
  // that a retry would take for the round's bytes.
  std::vector<const TensorView*> todo;
  std::vector<Pipeline> pipes;
  // What is kept of the round: every pipeline given (the shard's dense tensors too, so that
  // Kept covers the shard's whole push), those kept before winning: a tensor an attempt
  // before a restart encoded is encoded with its pipeline again.
  std::map<std::string, std::string> keep = kept_;
  if (!kept_path_.empty()) keep.insert(pipelines.begin(), pipelines.end());
  const auto& chosen = kept_path_.empty() ? pipelines : keep;
  for (const auto& d : deltas) {
    if (encoded_.count(d.name)) continue;  // a retried push: the bytes of the first time
    auto text = chosen.find(d.name);
    if (text == chosen.end()) {
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
  if (!kept_path_.empty() && keep != kept_) {
    // Durable before a byte encoded with them can reach a shard.
    nlohmann::json doc = {{"round", round}, {"pipelines", keep}};
    if (Status st = WriteFileDurably(kept_path_, doc.dump() + "\n"); !st.ok()) {
      return Status(st.code(), "cannot keep the pipelines of round " + std::to_string(round) +
                                   " before encoding it: " + st.message());
    }
    kept_ = std::move(keep);
  }
  std::vector<FeedbackTask> tasks;
  std::vector<Encoded*> outs;
  for (size_t i = 0; i < todo.size(); ++i) {
    const TensorView& d = *todo[i];
    const size_t n = static_cast<size_t>(NumElements(d.shape));
    std::vector<float>& res = residual_[d.name];
    if (res.empty()) res.assign(n, 0.0f);
    Encoded& e = encoded_[d.name];
    if (auto sp = spare_.find(d.name); sp != spare_.end()) {
      e.residual = std::move(sp->second);
      spare_.erase(sp);
    }
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

bool FeedbackEncoder::Kept(uint64_t round, const std::vector<TensorView>& deltas,
                           std::map<std::string, std::string>* pipelines) const {
  if (kept_path_.empty() || round != kept_round_ || deltas.empty()) return false;
  for (const auto& d : deltas) {
    if (!kept_.count(d.name)) return false;
  }
  *pipelines = kept_;
  return true;
}

Status FeedbackEncoder::KeepPipelinesIn(std::string path) {
  kept_path_ = std::move(path);
  kept_round_ = 0;
  kept_.clear();
  std::ifstream in(kept_path_);
  if (!in) return Status::Ok();  // nothing kept yet
  const auto doc = nlohmann::json::parse(in, nullptr, false);
  const bool ok = doc.is_object() && doc.contains("round") && doc["round"].is_number_unsigned() &&
                  doc.contains("pipelines") && doc["pipelines"].is_object();
  std::map<std::string, std::string> kept;
  bool strings = ok;
  if (ok) {
    for (const auto& [name, text] : doc["pipelines"].items()) {
      if (!text.is_string() || !ParsePipeline(text.get<std::string>()).ok()) strings = false;
      if (strings) kept[name] = text.get<std::string>();
    }
  }
  if (!strings) {
    return Status::Corruption(kept_path_ +
                              " is not a file of the pipelines of a round this worker encoded "
                              "(a round number and a pipeline per tensor): move it away");
  }
  kept_round_ = doc["round"].get<uint64_t>();
  kept_ = std::move(kept);
  return Status::Ok();
}

void FeedbackEncoder::Reserve(const std::map<std::string, size_t>& sizes) {
  for (const auto& [name, n] : sizes) {
    std::vector<float>& res = residual_[name];
    if (res.empty()) res.assign(n, 0.0f);
    if (encoded_.count(name)) continue;  // its next residual's buffer is taken
    std::vector<float>& next = spare_[name];
    if (next.size() < n) next.assign(n, 0.0f);
  }
}

void FeedbackEncoder::SetResiduals(std::map<std::string, std::vector<float>> residuals) {
  residual_ = std::move(residuals);
  encoded_.clear();
  spare_.clear();
  round_ = 0;
  done_ = 0;
}

}  // namespace isthmus::codec
