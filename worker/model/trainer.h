// The inner training step of a worker: forward, backward, a hook where the in-site
// communicator averages gradients across ranks, global gradient-norm clipping and AdamW
// with a warmup-cosine learning rate, all enqueued on the model's backend so that a GPU
// step touches the host only for the batch in and three numbers out. Its state (moments
// and step) is a set of named tensors so that it checkpoints next to the weights.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/gradient_sink.h"
#include "common/status.h"
#include "common/tensor.h"
#include "worker/model/gpt.h"

namespace isthmus::model {

struct TrainerConfig {
  float max_lr = 3e-4f;         // peak learning rate, reached after warmup_steps
  float min_lr = 3e-5f;         // floor of the cosine decay, held after total_steps
  int64_t warmup_steps = 100;   // linear warmup from 0
  int64_t total_steps = 10000;  // end of the cosine decay
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  // Decoupled weight decay, applied only to tensors with two or more dims: linear weights,
  // wte, wpe and both LoRA factors. Biases and layer-norm parameters are never decayed.
  float weight_decay = 0.0f;
  float grad_clip = 1.0f;  // global L2 norm bound; <= 0 disables clipping
  // Record each step's device work as a CUDA graph and replay it (backends with graphs).
  bool graphs = true;

  // InvalidArgument on negative or non-finite values, betas outside [0,1), eps <= 0,
  // warmup_steps > total_steps.
  Status Validate() const;
};

// ZeRO-1 (Rajbhandari et al. 2020, stage 1): the site's ranks split the AdamW moments, each
// keeping and updating only its part of the trainable elements, and share the updated
// parameters with an all-gather after every step. Every rank still holds the whole
// averaged gradient and computes the same global norm, so the step is the unsharded one.
struct OptimizerShards {
  int rank = 0;
  int world_size = 1;
  // The communicator's AllGather on backend memory: data holds world_size parts of counts[r]
  // elements; each rank's own part goes to every rank (comm::Communicator::AllGather).
  std::function<Status(float* data, const std::vector<size_t>& counts)> all_gather;
};

struct StepStats {
  float loss = 0.0f;       // this rank's mean loss on its batch (not averaged across ranks)
  float grad_norm = 0.0f;  // global L2 norm after the hook and before clipping
  float lr = 0.0f;         // learning rate used (or that would have been used, if skipped)
  bool skipped = false;    // true when the norm was not finite: parameters, moments and the
                           // step counter are left untouched
  float control = 0.0f;    // the control value after the hook (see Step)
};

// Owns the AdamW moments of every trainable tensor of `model`, which it borrows: the model
// must outlive the trainer and its mode must not change. The moments live in the model's
// backend, flat like the parameters, and one multi-tensor AdamW launch updates them all.
// Not thread-safe; the hook runs on the calling thread.
class Trainer {
 public:
  // Called after the backward pass, with the backend idle, on the model's flat gradient
  // buffer (backend memory: GradData(), GradElements() floats, the last of which holds the
  // step's control value). It may change the gradients in place (e.g. all-reduce and
  // divide by the world size); an error fails the step.
  using GradHook = std::function<Status(float* grads, size_t count)>;

  // InvalidArgument for a bad config; ResourceExhausted when the optimizer state does not
  // fit in the backend's memory.
  static Result<std::unique_ptr<Trainer>> Create(Gpt& model, const TrainerConfig& config);
  ~Trainer();

  void SetGradHook(GradHook hook) { hook_ = std::move(hook); }
  // Instead of the hook: hands the gradient to `sink` piece by piece while the backward
  // runs (Gpt::Backward's final_from), so that its reduction across ranks overlaps with the
  // rest of the backward, and waits for sink->End() before clipping and AdamW. The sink
  // must outlive the trainer or be unset (nullptr). With a sink the forward and backward
  // are never recorded as a graph (the optimizer still is). With gradient accumulation only
  // the last micro-batch's backward overlaps: the earlier ones' gradients are not final.
  void SetGradientSink(GradientSink* sink) { sink_ = sink; }

  // Splits the optimizer state across the site's ranks (OptimizerShards): from now on this
  // trainer holds the moments of its part [shard_begin(), shard_end()) only, updates only
  // those parameters, and every Step ends with the all-gather of the parameters, which
  // makes Step, ExportState, SaveCheckpoint collective: every rank calls them together.
  // The parts are ops::AdamWShardBounds.
  // Call it before the first Step or LoadState: the moments start again from zero.
  // InvalidArgument for a rank outside [0, world_size) or no all_gather; ResourceExhausted
  // when even the part does not fit.
  Status ShardOptimizerState(OptimizerShards shards);
  bool sharded() const { return shards_.world_size > 1; }
  int64_t shard_begin() const { return shard_lo_; }
  int64_t shard_end() const { return shard_hi_; }

  // One optimizer step on tokens/targets [B,T]: zero gradients, forward, backward, hook,
  // clip, AdamW with lr = WarmupCosineLr(step()), then step() += 1 (unless skipped).
  // `control` travels through the hook in the gradient buffer's last float and comes back
  // in StepStats::control (averaged over the ranks by the all-reduce hook: the worker's
  // "some rank wants to stop" flag). Where the backend has graphs (CUDA) and
  // config.graphs is set, the step's device work is recorded once per batch shape and
  // replayed after that. Errors: the backend's (a CUDA failure, with where it happened),
  // the hook's, or ResourceExhausted when activations for B x T do not fit.
  //
  // Gradient accumulation: with `micro_batches` M > 1, tokens/targets hold M batches of
  // [B,T] one after the other; each is run forward and backward in turn (activations for
  // B x T only), their gradients add up, scaled so that the step is that of the mean loss
  // over all M x B x T positions, and the hook and optimizer run once. The result equals
  // one step on the [M*B,T] batch up to the order of the sums (the tests hold it to 1e-5).
  // Accumulated steps launch their forward and backward kernels directly (not as a graph).
  //
  // Distillation: with `teacher` (the model's SetDistillation first) the step trains on the
  // distillation loss; its rows follow tokens (M x B x T rows of k entries).
  Result<StepStats> Step(const int32_t* tokens, const int32_t* targets, int B, int T,
                         float control = 0.0f, int micro_batches = 1,
                         const TeacherTopK* teacher = nullptr);

  // Number of optimizer steps taken (or loaded).
  int64_t step() const { return step_; }
  const TrainerConfig& config() const { return config_; }
  // Whether the last Step ran from a recorded graph, and why recording was given up (empty
  // while it works or was never tried).
  bool used_graph() const { return used_graph_; }
  const std::string& graph_error() const { return graph_error_; }

  // Sets the step counter (the position in the learning-rate schedule).
  void SetStep(int64_t step) { step_ = step; }

  // The optimizer state as tensors: "opt.m.<param>" and "opt.v.<param>" for every
  // trainable tensor (its shape), and "opt.step", shape [2], holding step() exactly as
  // {step mod 2^24, step / 2^24}. Sharded, the same whole tensors, gathered from every
  // rank's part (a collective; it borrows one moment's worth of backend memory), so a
  // checkpoint does not depend on how many ranks wrote it. The second form fills
  // (*into)[at, ...) as Gpt::ExportTrainable(into, at) does, and returns the index after.
  Result<std::vector<Tensor>> ExportState() const;
  Result<size_t> ExportState(std::vector<Tensor>* into, size_t at) const;

  // Restores ExportState() output. Every moment tensor of the model must be present with
  // the right shape, and no other "opt." tensor may be (InvalidArgument; nothing changed).
  // Tensors whose name does not start with "opt." are ignored, so one checkpoint file
  // can hold weights and state together. Sharded, this rank keeps its part.
  Status LoadState(const std::vector<Tensor>& tensors);

  // The moments of ExportState-style tensors as two flat host arrays of
  // TrainableElements() floats (InvalidArgument as LoadState), and back: LoadMoments takes
  // such arrays (host memory) and keeps this rank's part. Ranks share one rank's state
  // through these (the moments of the backend hold only a part when sharded).
  Status FlattenMoments(const std::vector<Tensor>& tensors, std::vector<float>* m,
                        std::vector<float>* v) const;
  Status LoadMoments(const float* m, const float* v);

  // The backend buffers of the moments: shard_end() - shard_begin() floats each (all the
  // trainable elements unless sharded), for collectives that make every rank's state equal.
  float* MomentData(int which) const;

  // One safetensors file with the trainable tensors and the optimizer state, plus the
  // model's config metadata and "train_mode". Atomic (see WriteSafetensors). Collective
  // when sharded (ExportState).
  Status SaveCheckpoint(const std::string& path) const;
  // Loads SaveCheckpoint output into the model and the trainer. The base (frozen in kLora
  // mode) is not in the file; load it with Gpt::LoadBase. FailedPrecondition when the file's
  // train_mode differs from the model's.
  Status LoadCheckpoint(const std::string& path);

 private:
  struct ParsedState {
    std::vector<const Tensor*> m, v;  // parallel to params_
    int64_t step = 0;
  };
  struct Device;

  Trainer(Gpt& model, const TrainerConfig& config);
  Status ParseState(const std::vector<Tensor>& tensors, ParsedState* parsed) const;
  void Flatten(const ParsedState& parsed, std::vector<float>* m, std::vector<float>* v) const;
  Status ApplyState(const ParsedState& parsed);
  // Moments for [lo, hi) of the trainable elements and the AdamW chunks over it.
  Status AllocateMoments(int64_t lo, int64_t hi);
  // The all-gather of the updated parameters after a sharded step.
  Status GatherParameters();
  // Part sizes of the sharded buffers (ops::AdamWShardBounds as counts).
  std::vector<size_t> ShardCounts() const;
  void EnqueueForwardBackward();
  // Backward of the staged batch, its gradient handed to sink_ as it becomes final.
  Status BackwardIntoSink();
  void EnqueueOptimizer();
  // Runs `enqueue` through the graph in *graph, recording it first when that pays.
  void RunRecorded(std::unique_ptr<ops::Graph>* graph, void (Trainer::*enqueue)());

  Gpt& model_;
  TrainerConfig config_;
  GradHook hook_;
  GradientSink* sink_ = nullptr;
  std::vector<ParamView> params_;
  std::unique_ptr<Device> dev_;
  int64_t step_ = 0;
  OptimizerShards shards_;
  int64_t shard_lo_ = 0, shard_hi_ = 0;  // this rank's part of the trainable elements
  bool used_graph_ = false;
  std::string graph_error_;
};

}  // namespace isthmus::model
