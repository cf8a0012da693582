// The built-in model: a GPT-2-architecture decoder (pre-LN blocks, GELU MLP, tied
// embeddings) with optional LoRA adapters, its forward pass, loss and backward pass, on top
// of the kernel interface ops/ops.h. Tensor names follow GPT-2's so that a GPT-2 checkpoint
// in safetensors form can serve as the frozen base, and workers and shards agree on names.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/tensor.h"
#include "ops/ops.h"

namespace isthmus::model {

// Model shape. Defaults are a small model that trains on one CPU core in minutes.
struct GptConfig {
  int n_layer = 4;
  int n_embd = 256;      // C
  int n_head = 4;        // H; must divide n_embd
  int n_ctx = 256;       // maximum sequence length T (rows of wpe)
  int vocab_size = 256;  // V; 256 = the byte-level tokenizer

  // InvalidArgument unless every field is positive and n_head divides n_embd.
  Status Validate() const;
  bool operator==(const GptConfig&) const = default;
};

// The linear layers LoRA can adapt, by their GPT-2 name inside a block.
inline constexpr const char* kLoraTargetNames[] = {"attn.c_attn", "attn.c_proj", "mlp.c_fc",
                                                   "mlp.c_proj"};

struct LoraConfig {
  int rank = 16;
  float alpha = 32.0f;  // the adapter's output is scaled by alpha / rank (PEFT's convention)
  std::vector<std::string> targets = {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"};

  float Scale() const { return alpha / static_cast<float>(rank); }
  // InvalidArgument unless rank > 0 and targets is a non-empty subset of kLoraTargetNames
  // without duplicates.
  Status Validate() const;
};

// kLora: the base is frozen and only the LoRA factors train (the default of the system).
// kFull: every base tensor trains and there are no LoRA factors.
enum class TrainMode { kLora, kFull };

// "lora" / "full"; ParseTrainMode is the inverse (InvalidArgument on anything else).
const char* TrainModeName(TrainMode mode);
Result<TrainMode> ParseTrainMode(const std::string& name);

// A non-owning view of one trainable tensor and its gradient. The pointers stay valid for
// the life of the Gpt that produced the view (its buffers are never reallocated).
struct ParamView {
  std::string name;
  std::vector<int64_t> shape;
  float* data = nullptr;
  float* grad = nullptr;
  int64_t numel = 0;
};

// Names of the two LoRA factors of `target` in layer `layer`, e.g.
// "h.0.attn.c_attn.lora_A.weight" ([rank, in]) and "h.0.attn.c_attn.lora_B.weight"
// ([out, rank]).
std::string LoraAName(int layer, const std::string& target);
std::string LoraBName(int layer, const std::string& target);

// The decoder. Owns its parameters, gradients and activation buffers (host memory; the
// CPU backend of ops/ops.h is used). Not thread-safe: one thread drives a Gpt at a time,
// although the kernels themselves may use several threads internally.
class Gpt {
 public:
  // A model with GPT-2 initialisation from `seed`: wte and wpe and every linear weight
  // normal(0, 0.02), the two residual projections (attn.c_proj, mlp.c_proj) normal(0,
  // 0.02 / sqrt(2 * n_layer)), biases 0, layer-norm weights 1. Each tensor draws from its
  // own stream derived from (seed, name), so the base is identical in both modes and for
  // any LoRA config. LoRA A ~ uniform(-1/sqrt(in), 1/sqrt(in)) (PEFT's Kaiming-uniform
  // default) from the same (seed, name) rule, LoRA B = 0. Deterministic: the generator and the
  // normal transform are our own, so only libm's log/cos could differ between platforms.
  static Result<std::unique_ptr<Gpt>> CreateRandom(const GptConfig& config, TrainMode mode,
                                                   const LoraConfig& lora, uint64_t seed);

  // A model whose base is `tensors` (GPT-2 names; a leading "transformer." is stripped;
  // the attention-mask buffers "h.N.attn.bias"/"h.N.attn.masked_bias" of HF files and an
  // "lm_head.weight" equal in shape to wte are ignored). The shape is inferred from the
  // tensors; `n_head` is required because it cannot be inferred. Every tensor the
  // architecture needs must be present with the right shape and no unknown tensor may be
  // present (InvalidArgument naming it otherwise). LoRA factors are initialised from `seed`
  // as in CreateRandom.
  static Result<std::unique_ptr<Gpt>> FromBaseTensors(std::vector<Tensor> tensors, int n_head,
                                                      TrainMode mode, const LoraConfig& lora,
                                                      uint64_t seed);

  // FromBaseTensors on the tensors of a safetensors file. When the file's metadata carries
  // "n_head" (SaveBase writes it) that value is used and `n_head` may be 0; if both are
  // given they must agree (InvalidArgument). If `expected` is not null the inferred config
  // must equal it (FailedPrecondition otherwise).
  static Result<std::unique_ptr<Gpt>> LoadBase(const std::string& path, int n_head, TrainMode mode,
                                               const LoraConfig& lora, uint64_t seed,
                                               const GptConfig* expected = nullptr);

  ~Gpt();
  Gpt(const Gpt&) = delete;
  Gpt& operator=(const Gpt&) = delete;

  const GptConfig& config() const { return config_; }
  TrainMode mode() const { return mode_; }
  const LoraConfig& lora() const { return lora_; }

  // Runs the model on tokens [B,T] (values in [0, V)), T <= n_ctx. With targets [B,T]
  // (values in [0, V), or -1 to leave a position out of the loss) returns the mean
  // cross-entropy over the counted positions and keeps what Backward needs; with targets
  // == nullptr returns 0 and only computes logits. Activation buffers are sized for the
  // largest B*T seen so far: they are allocated on the first call (or when a later call
  // is larger) and reused after that. The token and target arrays are copied.
  // Out-of-range sizes, tokens or targets are programming errors: the process aborts with
  // a message rather than reading outside the tables.
  float Forward(const int32_t* tokens, const int32_t* targets, int B, int T);

  // The logits [B,T,V] of the last Forward; valid until the next Forward.
  const float* Logits() const;

  // Gradient of the last Forward's mean loss, ACCUMULATED into the gradients of the
  // trainable tensors (call ZeroGrad between steps). Requires a preceding Forward with
  // targets.
  void Backward();

  // Sets every trainable tensor's gradient to zero.
  void ZeroGrad();

  // The trainable tensors: the LoRA factors (kLora, ordered by layer then target, A before
  // B) or every base tensor (kFull, in base order). Stable order and pointers.
  std::vector<ParamView> Trainable();

  // The base tensors in GPT-2 order: wte, wpe, h.0.* ... h.{L-1}.*, ln_f.*. In kFull mode
  // these are what trains; in kLora mode they are frozen. Access by name returns null for
  // an unknown name.
  const std::vector<Tensor>& BaseTensors() const { return base_; }
  const Tensor* FindBase(const std::string& name) const;

  // Lower-case hex SHA-256 (TensorsContentHash) of the base tensors: what workers and
  // shards compare to check they hold the same base. Computed on each call (O(params)).
  std::string BaseHash() const;

  // Copies of the trainable tensors (names and shapes as in Trainable()).
  std::vector<Tensor> ExportTrainable() const;

  // Overwrites trainable tensors with `tensors`. Every given tensor must name a trainable
  // tensor and match its shape (InvalidArgument otherwise, and nothing is changed). With
  // require_all, every trainable tensor must be given. Gradients are left as they are.
  Status LoadTrainable(const std::vector<Tensor>& tensors, bool require_all = true);

  // Writes the base tensors to a safetensors file (atomic), with metadata recording the
  // config ("n_layer", "n_embd", "n_head", "n_ctx", "vocab_size") and "format" =
  // "isthmus-gpt2".
  Status SaveBase(const std::string& path) const;

  // Metadata SaveBase writes (also useful for adapter files).
  std::map<std::string, std::string> ConfigMetadata() const;

  // Writes the LoRA adapters in the layout Hugging Face PEFT loads onto a GPT-2 model:
  // `dir`/adapter_model.safetensors with names "base_model.model.transformer.<name>" and
  // `dir`/adapter_config.json (peft_type LORA, r, lora_alpha, target_modules,
  // fan_in_fan_out true for GPT-2's Conv1D). Creates `dir` if needed; each file is written
  // atomically. FailedPrecondition in kFull mode (there are no adapters), IoError on
  // filesystem failures.
  Status SavePeftAdapter(const std::string& dir) const;

 private:
  struct Layer;
  struct Activations;

  Gpt(const GptConfig& config, TrainMode mode, const LoraConfig& lora);
  void AddBase(const std::string& name, std::vector<int64_t> shape);
  Status BuildIndex();
  void InitLora(uint64_t seed);
  void InitRandomBase(uint64_t seed);
  void EnsureActivations(int B, int T);
  float* BaseGrad(int index);
  float* W(int index) { return base_[index].data.data(); }

  GptConfig config_;
  TrainMode mode_;
  LoraConfig lora_;
  ops::Ops& ops_;

  std::vector<Tensor> base_;
  std::vector<std::vector<float>> base_grad_;  // kFull only, parallel to base_
  std::vector<Tensor> lora_tensors_;           // kLora only
  std::vector<std::vector<float>> lora_grad_;  // parallel to lora_tensors_
  int wte_ = -1, wpe_ = -1, lnf_w_ = -1, lnf_b_ = -1;
  std::vector<Layer> layers_;

  std::unique_ptr<Activations> act_;
  int cur_b_ = 0, cur_t_ = 0;
  bool have_targets_ = false;
};

}  // namespace isthmus::model
