// AdamW inner steps over the model's trainable tensors, and their checkpoint format.
#include "worker/model/trainer.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <tuple>

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

// The trainer's backend state: moments, the AdamW chunk table, the step's scalars, their
// page-locked staging, and the recorded graphs of the current batch shape.
struct Trainer::Device {
  ops::Buffer m, v;
  ops::Buffer chunks;  // AdamWChunk[num_chunks]
  int num_chunks = 0;
  ops::Buffer scalars;   // AdamWScalars, then the gradient's sum of squares
  ops::HostBuffer host;  // AdamWScalars, control in, sum of squares out, control out
  std::unique_ptr<ops::Graph> forward_backward, optimizer;
  int graph_b = 0, graph_t = 0;
  uint64_t graph_layout = 0;
  bool graph_teacher = false;  // recorded with the distillation loss
  int eager_steps = 0;         // steps of this shape run without a graph (the first warms up)
  bool graphs_off = false;

  ops::AdamWScalars* h_scalars() const { return host.as<ops::AdamWScalars>(); }
  float* h_floats() const { return reinterpret_cast<float*>(h_scalars() + 1); }
  ops::AdamWScalars* d_scalars() const { return scalars.as<ops::AdamWScalars>(); }
  float* d_sumsq() const { return reinterpret_cast<float*>(d_scalars() + 1); }
};

Trainer::Trainer(Gpt& model, const TrainerConfig& config)
    : model_(model), config_(config), params_(model.Trainable()) {}

Trainer::~Trainer() = default;

Result<std::unique_ptr<Trainer>> Trainer::Create(Gpt& model, const TrainerConfig& config) {
  ISTHMUS_RETURN_IF_ERROR(config.Validate());
  std::unique_ptr<Trainer> t(new Trainer(model, config));
  ops::Ops& ops = model.ops();
  auto dev = std::make_unique<Device>();
  auto fail = [&](const Status& st) {
    return Status(st.code(),
                  "cannot hold the optimizer state on " + ops.Describe() + ": " + st.message());
  };
  auto sc = ops::Buffer::Allocate(ops, sizeof(ops::AdamWScalars) + sizeof(float));
  if (!sc.ok()) return fail(sc.status());
  auto host = ops::HostBuffer::Allocate(ops, sizeof(ops::AdamWScalars) + 3 * sizeof(float));
  if (!host.ok()) return fail(host.status());
  dev->scalars = std::move(sc).value();
  dev->host = std::move(host).value();
  t->dev_ = std::move(dev);
  ISTHMUS_RETURN_IF_ERROR(t->AllocateMoments(0, model.TrainableElements()));
  return t;
}

Status Trainer::AllocateMoments(int64_t lo, int64_t hi) {
  ops::Ops& ops = model_.ops();
  const size_t bytes = static_cast<size_t>(hi - lo) * sizeof(float);
  const std::vector<ops::AdamWChunk> chunks = ops::MakeAdamWChunks(model_.AdamWSegments(), lo, hi);
  auto fail = [&](const Status& st) {
    return Status(st.code(), "cannot hold the optimizer state (" + std::to_string(2 * bytes) +
                                 " bytes of moments) on " + ops.Describe() + ": " + st.message());
  };
  // The old moments go first: a shard's are what is meant to fit.
  dev_->m.Reset();
  dev_->v.Reset();
  dev_->chunks.Reset();
  dev_->optimizer.reset();
  auto m = ops::Buffer::Allocate(ops, std::max<size_t>(bytes, sizeof(float)));
  if (!m.ok()) return fail(m.status());
  auto v = ops::Buffer::Allocate(ops, std::max<size_t>(bytes, sizeof(float)));
  if (!v.ok()) return fail(v.status());
  auto c = ops::Buffer::Allocate(ops, std::max<size_t>(chunks.size(), 1) * sizeof(ops::AdamWChunk));
  if (!c.ok()) return fail(c.status());
  dev_->m = std::move(m).value();
  dev_->v = std::move(v).value();
  dev_->chunks = std::move(c).value();
  dev_->num_chunks = static_cast<int>(chunks.size());
  ops.Zero(dev_->m.data(), dev_->m.bytes());
  ops.Zero(dev_->v.data(), dev_->v.bytes());
  if (!chunks.empty()) {
    ops.Upload(dev_->chunks.data(), chunks.data(), chunks.size() * sizeof(ops::AdamWChunk));
  }
  shard_lo_ = lo;
  shard_hi_ = hi;
  return ops.Synchronize();
}

float* Trainer::MomentData(int which) const { return (which == 0 ? dev_->m : dev_->v).as<float>(); }

Status Trainer::ShardOptimizerState(OptimizerShards shards) {
  if (shards.world_size < 1 || shards.rank < 0 || shards.rank >= shards.world_size) {
    return Status::InvalidArgument("optimizer shards: rank " + std::to_string(shards.rank) +
                                   " outside [0, " + std::to_string(shards.world_size) + ")");
  }
  if (shards.world_size > 1 && !shards.all_gather) {
    return Status::InvalidArgument("optimizer shards: no all-gather for " +
                                   std::to_string(shards.world_size) + " ranks");
  }
  shards_ = std::move(shards);
  const std::vector<int64_t> bounds =
      ops::AdamWShardBounds(model_.TrainableElements(), shards_.world_size);
  return AllocateMoments(bounds[static_cast<size_t>(shards_.rank)],
                         bounds[static_cast<size_t>(shards_.rank) + 1]);
}

std::vector<size_t> Trainer::ShardCounts() const {
  const std::vector<int64_t> bounds =
      ops::AdamWShardBounds(model_.TrainableElements(), shards_.world_size);
  std::vector<size_t> counts(bounds.size() - 1);
  for (size_t r = 0; r + 1 < bounds.size(); ++r) {
    counts[r] = static_cast<size_t>(bounds[r + 1] - bounds[r]);
  }
  return counts;
}

Status Trainer::GatherParameters() {
  ISTHMUS_RETURN_IF_ERROR(shards_.all_gather(model_.TrainableData(), ShardCounts()));
  // The bf16 copies of the other ranks' parts (AdamW wrote this rank's).
  model_.TrainableChanged();
  return model_.ops().Synchronize();
}

void Trainer::EnqueueForwardBackward() {
  ops::Ops& ops = model_.ops();
  model_.ZeroGrad();
  ops.UploadAsync(model_.GradData() + model_.TrainableElements(), dev_->h_floats(), sizeof(float));
  model_.EnqueueForward(true);
  model_.Backward();
}

Status Trainer::BackwardIntoSink() {
  ops::Ops& ops = model_.ops();
  sink_->Begin(model_.GradData(), static_cast<size_t>(model_.GradElements()));
  model_.Backward([&](int64_t from) { sink_->Final(static_cast<size_t>(from), ops.Mark()); });
  return sink_->End();
}

void Trainer::EnqueueOptimizer() {
  ops::Ops& ops = model_.ops();
  const int64_t n = model_.TrainableElements();
  ops.UploadAsync(dev_->d_scalars(), dev_->h_scalars(), sizeof(ops::AdamWScalars));
  ops.SumSquares(model_.GradData(), n, dev_->d_sumsq());
  ops::AdamWConfig c;
  c.beta1 = config_.beta1;
  c.beta2 = config_.beta2;
  c.eps = config_.eps;
  c.weight_decay = config_.weight_decay;
  c.grad_clip = config_.grad_clip;
  ops.AdamW(model_.TrainableData(), model_.GradData(), dev_->m.as<float>(), dev_->v.as<float>(),
            model_.TrainableCopy(), dev_->chunks.as<ops::AdamWChunk>(), dev_->num_chunks,
            dev_->d_sumsq(), dev_->d_scalars(), c);
  ops.DownloadAsync(dev_->h_floats() + 1, dev_->d_sumsq(), sizeof(float));
  ops.DownloadAsync(dev_->h_floats() + 2, model_.GradData() + n, sizeof(float));
}

void Trainer::RunRecorded(std::unique_ptr<ops::Graph>* graph, void (Trainer::*enqueue)()) {
  ops::Ops& ops = model_.ops();
  if (!config_.graphs || !ops.SupportsGraphs() || dev_->graphs_off) {
    (this->*enqueue)();
    return;
  }
  if (*graph) {
    (*graph)->Replay();
    used_graph_ = true;
    return;
  }
  // The first step of a shape runs as it is (matmul plans and the like are made then).
  if (dev_->eager_steps == 0) {
    (this->*enqueue)();
    return;
  }
  Status st = ops.BeginCapture();
  if (st.ok()) {
    (this->*enqueue)();
    auto recorded = ops.EndCapture();
    if (recorded.ok()) {
      *graph = std::move(recorded).value();
      (*graph)->Replay();
      used_graph_ = true;
      return;
    }
    st = recorded.status();
  }
  // Recording failed: nothing ran, so run the work directly, now and from now on.
  dev_->graphs_off = true;
  graph_error_ = st.ToString();
  (this->*enqueue)();
}

Result<StepStats> Trainer::Step(const int32_t* tokens, const int32_t* targets, int B, int T,
                                float control, int micro_batches, const TeacherTopK* teacher) {
  ops::Ops& ops = model_.ops();
  if (micro_batches < 1) {
    return Status::InvalidArgument("micro_batches must be >= 1, got " +
                                   std::to_string(micro_batches));
  }
  ISTHMUS_RETURN_IF_ERROR(model_.Reserve(B, T));
  if (micro_batches == 1) model_.StageBatch(tokens, targets, B, T, 0, teacher);
  if (dev_->graph_b != B || dev_->graph_t != T || dev_->graph_layout != model_.layout_version() ||
      dev_->graph_teacher != (teacher != nullptr)) {
    dev_->forward_backward.reset();
    dev_->optimizer.reset();
    dev_->graph_b = B;
    dev_->graph_t = T;
    dev_->graph_layout = model_.layout_version();
    dev_->graph_teacher = teacher != nullptr;
    dev_->eager_steps = 0;
  }
  StepStats stats;
  stats.lr = ops::WarmupCosineLr(step_, config_.warmup_steps, config_.total_steps, config_.max_lr,
                                 config_.min_lr);
  const int64_t next = step_ + 1;
  ops::AdamWScalars* sc = dev_->h_scalars();
  sc->lr = stats.lr;
  sc->bias_correction1 =
      1.0f - static_cast<float>(std::pow(static_cast<double>(config_.beta1), next));
  sc->bias_correction2 =
      1.0f - static_cast<float>(std::pow(static_cast<double>(config_.beta2), next));
  sc->unused = 0.0f;
  dev_->h_floats()[0] = control;
  used_graph_ = false;

  double loss_sum = 0.0;
  int64_t positions = 0;
  if (micro_batches == 1 && sink_ != nullptr) {
    model_.ZeroGrad();
    ops.UploadAsync(model_.GradData() + model_.TrainableElements(), dev_->h_floats(),
                    sizeof(float));
    model_.EnqueueForward(true);
    ISTHMUS_RETURN_IF_ERROR(BackwardIntoSink());
  } else if (micro_batches == 1) {
    RunRecorded(&dev_->forward_backward, &Trainer::EnqueueForwardBackward);
  } else {
    // The mean over every position with a target in all micro-batches.
    const int64_t n = static_cast<int64_t>(B) * T;
    for (int64_t i = 0; i < n * micro_batches; ++i) positions += targets[i] >= 0;
    model_.ZeroGrad();
    ops.UploadAsync(model_.GradData() + model_.TrainableElements(), dev_->h_floats(),
                    sizeof(float));
    for (int k = 0; k < micro_batches; ++k) {
      // The staging is reused: the previous micro-batch must be done with it.
      if (k > 0) ISTHMUS_RETURN_IF_ERROR(ops.Synchronize());
      const int64_t rows = k * n * model_.distillation().k;
      const TeacherTopK part{teacher != nullptr ? teacher->ids + rows : nullptr,
                             teacher != nullptr ? teacher->logits + rows : nullptr};
      model_.StageBatch(tokens + k * n, targets + k * n, B, T, std::max<int64_t>(positions, 1),
                        teacher != nullptr ? &part : nullptr);
      model_.EnqueueForward(true);
      if (sink_ != nullptr && k == micro_batches - 1) {
        ISTHMUS_RETURN_IF_ERROR(BackwardIntoSink());
      } else {
        model_.Backward();
      }
      ISTHMUS_RETURN_IF_ERROR(ops.Synchronize());
      loss_sum += model_.StagedLoss() * static_cast<double>(model_.staged_positions());
    }
  }
  if (hook_ && sink_ == nullptr) {
    ISTHMUS_RETURN_IF_ERROR(ops.Synchronize());
    ISTHMUS_RETURN_IF_ERROR(hook_(model_.GradData(), static_cast<size_t>(model_.GradElements())));
  }
  RunRecorded(&dev_->optimizer, &Trainer::EnqueueOptimizer);
  ISTHMUS_RETURN_IF_ERROR(ops.Synchronize());
  if (!used_graph_) ++dev_->eager_steps;

  const float sumsq = dev_->h_floats()[1];
  stats.control = dev_->h_floats()[2];
  stats.loss = micro_batches == 1 ? static_cast<float>(model_.StagedLoss())
                                  : static_cast<float>(positions > 0 ? loss_sum / positions : 0.0);
  stats.grad_norm = std::sqrt(sumsq);
  if (!std::isfinite(sumsq)) {  // the same sum on every rank: all skip, none gathers
    stats.skipped = true;
    return stats;
  }
  if (sharded()) ISTHMUS_RETURN_IF_ERROR(GatherParameters());
  ++step_;
  return stats;
}

Result<std::vector<Tensor>> Trainer::ExportState() const {
  std::vector<Tensor> out;
  ISTHMUS_RETURN_IF_ERROR(ExportState(&out, 0).status());
  return out;
}

Result<size_t> Trainer::ExportState(std::vector<Tensor>* into, size_t at) const {
  ops::Ops& ops = model_.ops();
  const int64_t n = model_.TrainableElements();
  // Where each moment of the whole model is read from: the backend's own arrays, or,
  // sharded, the host copies gathered from every rank's part.
  std::vector<float> m, v;
  if (sharded()) {
    m.resize(static_cast<size_t>(n));
    v.resize(static_cast<size_t>(n));
    // Each moment in turn: this rank's part into a whole-sized buffer, then the others'.
    ISTHMUS_ASSIGN_OR_RETURN(ops::Buffer whole,
                             ops::Buffer::Allocate(ops, static_cast<size_t>(n) * sizeof(float)));
    const std::vector<size_t> counts = ShardCounts();
    const size_t part = static_cast<size_t>(shard_hi_ - shard_lo_) * sizeof(float);
    for (auto [from, to] : {std::pair{&dev_->m, &m}, std::pair{&dev_->v, &v}}) {
      ops.Copy(whole.as<float>() + shard_lo_, from->data(), part);
      ISTHMUS_RETURN_IF_ERROR(ops.Synchronize());
      ISTHMUS_RETURN_IF_ERROR(shards_.all_gather(whole.as<float>(), counts));
      ops.Download(to->data(), whole.data(), to->size() * sizeof(float));
    }
  }
  size_t i = at;
  for (const ParamView& p : params_) {
    for (auto [moment, host, prefix] :
         {std::tuple{&dev_->m, &m, "m."}, std::tuple{&dev_->v, &v, "v."}}) {
      float* dst = RefillTensor(into, i++, kOptPrefix + prefix + p.name, p.shape, p.numel);
      const size_t bytes = static_cast<size_t>(p.numel) * sizeof(float);
      if (sharded()) {
        std::memcpy(dst, host->data() + p.offset, bytes);
      } else {
        ops.Download(dst, moment->as<float>() + p.offset, bytes);
      }
    }
  }
  float* step = RefillTensor(into, i++, kOptPrefix + "step", {2}, 2);
  step[0] = static_cast<float>(step_ % kStepRadix);
  step[1] = static_cast<float>(step_ / kStepRadix);
  ISTHMUS_RETURN_IF_ERROR(ops.status());
  return i;
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

void Trainer::Flatten(const ParsedState& parsed, std::vector<float>* m,
                      std::vector<float>* v) const {
  const size_t n = static_cast<size_t>(model_.TrainableElements());
  m->assign(n, 0.0f);
  v->assign(n, 0.0f);
  for (size_t i = 0; i < params_.size(); ++i) {
    std::copy(parsed.m[i]->data.begin(), parsed.m[i]->data.end(), m->begin() + params_[i].offset);
    std::copy(parsed.v[i]->data.begin(), parsed.v[i]->data.end(), v->begin() + params_[i].offset);
  }
}

Status Trainer::ApplyState(const ParsedState& parsed) {
  std::vector<float> m, v;
  Flatten(parsed, &m, &v);
  step_ = parsed.step;
  return LoadMoments(m.data(), v.data());
}

Status Trainer::LoadMoments(const float* m, const float* v) {
  ops::Ops& ops = model_.ops();
  const size_t bytes = static_cast<size_t>(shard_hi_ - shard_lo_) * sizeof(float);
  ops.Upload(dev_->m.data(), m + shard_lo_, bytes);
  ops.Upload(dev_->v.data(), v + shard_lo_, bytes);
  return ops.status();
}

Status Trainer::FlattenMoments(const std::vector<Tensor>& tensors, std::vector<float>* m,
                               std::vector<float>* v) const {
  ParsedState parsed;
  ISTHMUS_RETURN_IF_ERROR(ParseState(tensors, &parsed));
  Flatten(parsed, m, v);
  return Status::Ok();
}

Status Trainer::LoadState(const std::vector<Tensor>& tensors) {
  ParsedState parsed;
  ISTHMUS_RETURN_IF_ERROR(ParseState(tensors, &parsed));
  return ApplyState(parsed);
}

Status Trainer::SaveCheckpoint(const std::string& path) const {
  std::vector<Tensor> tensors = model_.ExportTrainable();
  ISTHMUS_ASSIGN_OR_RETURN(std::vector<Tensor> state, ExportState());
  // A failed backend copies nothing out: never replace a good file with that.
  ISTHMUS_RETURN_IF_ERROR(model_.ops().status());
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
  return ApplyState(parsed);
}

}  // namespace isthmus::model
