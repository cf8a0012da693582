// The inner training step of a worker: forward, backward, a hook where the in-site
// communicator averages gradients across ranks, global gradient-norm clipping and AdamW
// with a warmup-cosine learning rate. Its state (moments and step) is a set of named
// tensors so that it checkpoints next to the weights.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

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

  // InvalidArgument on negative or non-finite values, betas outside [0,1), eps <= 0,
  // warmup_steps > total_steps.
  Status Validate() const;
};

struct StepStats {
  float loss = 0.0f;       // this rank's mean loss on its batch (not averaged across ranks)
  float grad_norm = 0.0f;  // global L2 norm after the hook and before clipping
  float lr = 0.0f;         // learning rate used (or that would have been used, if skipped)
  bool skipped = false;    // true when the norm was not finite: parameters, moments and the
                           // step counter are left untouched
};

// Owns the AdamW moments of every trainable tensor of `model`, which it borrows: the model
// must outlive the trainer and its mode must not change. Not thread-safe; the hook runs on
// the calling thread.
class Trainer {
 public:
  // Called after Backward and before clipping with every trainable tensor; it may change
  // gradients in place (e.g. all-reduce and divide by the world size). It must not change
  // parameters or hold on to the views after returning.
  using GradHook = std::function<void(std::vector<ParamView>&)>;

  // Precondition: config.Validate() is OK (checked; aborts otherwise).
  Trainer(Gpt& model, const TrainerConfig& config);

  void SetGradHook(GradHook hook) { hook_ = std::move(hook); }

  // One optimizer step on tokens/targets [B,T]: zero gradients, Forward, Backward, hook,
  // clip, AdamW with lr = WarmupCosineLr(step()), then step() += 1.
  StepStats Step(const int32_t* tokens, const int32_t* targets, int B, int T);

  // Number of optimizer steps taken (or loaded).
  int64_t step() const { return step_; }
  const TrainerConfig& config() const { return config_; }

  // The optimizer state as tensors: "opt.m.<param>" and "opt.v.<param>" for every
  // trainable tensor (its shape), and "opt.step", shape [2], holding step() exactly as
  // {step mod 2^24, step / 2^24}.
  std::vector<Tensor> ExportState() const;

  // Restores ExportState() output. Every moment tensor of the model must be present with
  // the right shape, and no other "opt." tensor may be (InvalidArgument; nothing changed).
  // Tensors whose name does not start with "opt." are ignored, so one checkpoint file
  // can hold weights and state together.
  Status LoadState(const std::vector<Tensor>& tensors);

  // One safetensors file with the trainable tensors and the optimizer state, plus the
  // model's config metadata and "train_mode". Atomic (see WriteSafetensors).
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
  Status ParseState(const std::vector<Tensor>& tensors, ParsedState* parsed) const;
  void ApplyState(const ParsedState& parsed);

  Gpt& model_;
  TrainerConfig config_;
  GradHook hook_;
  std::vector<ParamView> params_;
  std::vector<std::vector<float>> m_, v_;
  int64_t step_ = 0;
};

}  // namespace isthmus::model
