// The built-in model: a decoder of one of two families, with optional LoRA adapters, its
// forward pass, loss and backward pass, on top of the compute backend ops/ops.h (CPU
// reference or CUDA). GPT-2 (pre-LN blocks, learned positions, GELU MLP, tied embeddings)
// and the Llama family (Llama 2/3, Qwen2, Mistral: RMS norm, rotary positions, SwiGLU MLP,
// grouped-query attention, tied or untied head) are two configurations of one code path.
// Tensor names follow the checkpoints' own (GPT-2's; Hugging Face's Llama names without the
// leading "model.") so that such a checkpoint can serve as the frozen base, and workers
// and shards agree on names.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/check.h"
#include "common/hf_checkpoint.h"
#include "common/status.h"
#include "common/tensor.h"
#include "ops/buffer.h"
#include "ops/ops.h"

namespace isthmus::model {

class Carver;

// The architecture a GptConfig describes.
enum class ModelFamily { kGpt2, kLlama };
// "gpt2" / "llama".
const char* ModelFamilyName(ModelFamily family);

// Llama 3's rescaling of the rotary frequencies (config.json's rope_scaling with rope_type
// "llama3"); factor 0 means none.
struct RopeScaling {
  double factor = 0;
  double low_freq_factor = 1;
  double high_freq_factor = 4;
  int original_context = 0;  // original_max_position_embeddings
  bool operator==(const RopeScaling&) const = default;
};

// Model shape. Defaults are a small GPT-2 that trains on one CPU core in minutes.
struct GptConfig {
  ModelFamily family = ModelFamily::kGpt2;
  int n_layer = 4;
  int n_embd = 256;      // C
  int n_head = 4;        // H; must divide n_embd (head size D = C / H)
  int n_ctx = 256;       // maximum sequence length T (rows of wpe, or of the rotary table)
  int vocab_size = 256;  // V; 256 = the byte-level tokenizer
  // The Llama family only (GPT-2 has n_kv_head = n_head, n_inner = 4C and no such options).
  int n_kv_head = 0;  // key/value heads, dividing n_head (grouped-query attention); 0: n_head
  int n_inner = 0;    // the MLP's hidden width (intermediate_size); 0: 4 * n_embd
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  float norm_eps = 1e-5f;       // the RMS norms' epsilon (GPT-2's layer norms use 1e-5)
  bool qkv_bias = false;        // q, k and v projections with biases (Qwen2)
  bool tied_embeddings = true;  // the head is the token embedding (GPT-2 always)

  int kv_heads() const { return n_kv_head > 0 ? n_kv_head : n_head; }
  int inner() const { return n_inner > 0 ? n_inner : 4 * n_embd; }
  int head_size() const { return n_embd / n_head; }
  // InvalidArgument naming the field unless every size is positive, n_head divides n_embd,
  // and for the Llama family n_kv_head divides n_head, the head size is even, rope_theta
  // and norm_eps are positive and the rope scaling is sound; GPT-2 takes none of the
  // Llama-only options.
  Status Validate() const;
  bool operator==(const GptConfig&) const = default;
};

// The model's shape from a Hugging Face config.json (its text; `source` names it in
// messages): model_type gpt2, llama, qwen2 or mistral. What the model cannot compute is
// refused naming the field: another model_type, hidden_act other than silu (gelu_new for
// GPT-2), a head_dim other than hidden_size / num_attention_heads, a rope_scaling other
// than llama3's, an active sliding window shorter than the context, MLP biases, o_proj
// biases, mixtures of experts, quantization.
Result<GptConfig> ParseHfConfig(const std::string& json_text, const std::string& source);

// The linear layers LoRA can adapt, by their name inside a block: GPT-2's...
inline constexpr const char* kLoraTargetNames[] = {"attn.c_attn", "attn.c_proj", "mlp.c_fc",
                                                   "mlp.c_proj"};
// ...and the Llama family's (PEFT's target_modules name them by their last part: q_proj).
inline constexpr const char* kLlamaLoraTargetNames[] = {
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj",    "mlp.up_proj",      "mlp.down_proj"};
// The family's target names, in block order.
std::vector<std::string> LoraTargetNames(ModelFamily family);

struct LoraConfig {
  int rank = 16;
  float alpha = 32.0f;  // the adapter's output is scaled by alpha / rank (PEFT's convention)
  std::vector<std::string> targets = {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"};

  float Scale() const { return alpha / static_cast<float>(rank); }
  // InvalidArgument unless rank > 0 and targets is a non-empty subset of the family's
  // target names (LoraTargetNames) without duplicates.
  Status Validate(ModelFamily family = ModelFamily::kGpt2) const;
};

// kLora: the base is frozen and only the LoRA factors train (the default of the system).
// kFull: every base tensor trains and there are no LoRA factors.
enum class TrainMode { kLora, kFull };

// "lora" / "full"; ParseTrainMode is the inverse (InvalidArgument on anything else).
const char* TrainModeName(TrainMode mode);
Result<TrainMode> ParseTrainMode(const std::string& name);

// How a model computes: the backend its tensors live on and the precision of its matmuls
// and activations.
struct Compute {
  ops::Ops* ops = &ops::CpuOps();           // never null; the CPU reference by default
  ops::Dtype precision = ops::Dtype::kF32;  // kBF16: bf16 matmul weight copies and
                                            // activations; fp32 masters and gradients
  // Activation recompute: the layers share one set of activations and keep only the
  // residual stream; the backward runs each block's forward again before its backward
  // (about a third more compute; the activation memory of one layer instead of all).
  bool recompute = false;
  ops::Ops& backend() const {
    ISTHMUS_CHECK(ops != nullptr, "model::Compute without a backend (ops::CpuOps() for the CPU)");
    return *ops;
  }
};

// "fp32" / "bf16"; InvalidArgument on anything else.
Result<ops::Dtype> ParsePrecision(const std::string& name);

// Bytes a training configuration holds, by part (Gpt::PlanMemory). Each buffer is counted
// rounded up to 256 bytes, as the backends allocate it.
struct MemoryPlan {
  int64_t parameters = 0;     // fp32 base and LoRA tensors (of a frozen bf16 base only the
                              // embeddings, norms and biases: its matrices are bf16 alone)
  int64_t weight_copies = 0;  // bf16 copies of them for the matmuls (bf16 precision)
  int64_t gradients = 0;      // fp32, one per trainable value
  int64_t optimizer = 0;      // AdamW's two moments, its chunk table and scalars
  int64_t activations = 0;    // the activation arena and the batch inputs for B x T
  int64_t round_buffers = 0;  // a synced run's round base and delta/pull staging (fp32
                              // copies of the trainable tensors, worker/live_params.h)
  int64_t host_staging = 0;   // pinned host memory for a batch (0 on the CPU: in the above)
  int64_t host_masters = 0;   // host memory: the frozen base's fp32 masters, when the backend
                              // holds that base in bf16 (LoRA mode, bf16 precision)
  int64_t backend_held = 0;   // what the backend held already (CUDA: its workspaces)
  int64_t backend_free = 0;   // free backend memory when planned (CPU: available RAM)
  int64_t backend_total = 0;  // the device's memory (CPU: physical RAM)
  // All of the above that lives in backend memory (host staging excluded).
  int64_t backend_bytes() const;
};

// A non-owning view of one trainable tensor and its gradient, in backend memory (host
// memory only on the CPU backend: see Ops::HostMemory). The pointers stay valid for the
// life of the Gpt that produced the view (its buffers are never reallocated). `offset` is
// the tensor's first element in the flat buffers (TrainableData, GradData).
struct ParamView {
  std::string name;
  std::vector<int64_t> shape;
  float* data = nullptr;
  float* grad = nullptr;
  int64_t numel = 0;
  int64_t offset = 0;
};

// A batch's teacher for word-level distillation (Gpt::SetDistillation): for each of the
// B x T positions, k ids (distinct within a position, in [0, V)) and the teacher's logits
// at them, row-major [B*T, k]. Rows of positions without a target are not read.
struct TeacherTopK {
  const int32_t* ids = nullptr;
  const float* logits = nullptr;
};

// Names of the two LoRA factors of `target` in layer `layer`, e.g.
// "h.0.attn.c_attn.lora_A.weight" ([rank, in]) and "h.0.attn.c_attn.lora_B.weight"
// ([out, rank]).
std::string LoraAName(int layer, const std::string& target);
std::string LoraBName(int layer, const std::string& target);
// The same for any family: the Llama family's blocks are "layers.N." instead of "h.N.".
std::string LoraAName(ModelFamily family, int layer, const std::string& target);
std::string LoraBName(ModelFamily family, int layer, const std::string& target);

// The decoder. Owns its parameters, gradients and activations, all in the memory of its
// backend (Compute): on a GPU they stay there for the whole run, and the host sees tensors
// only through the Export/Load calls below. Trainable tensors (and their gradients) form
// one flat buffer each, every tensor starting on a 64-element boundary, with zeros in the
// gaps, so that one all-reduce, one optimizer launch and one copy cover them all. Not
// thread-safe: one thread drives a Gpt (and its backend) at a time.
class Gpt {
 public:
  // A model with GPT-2 initialisation from `seed`: wte and wpe and every linear weight
  // normal(0, 0.02), the two residual projections (attn.c_proj, mlp.c_proj) normal(0,
  // 0.02 / sqrt(2 * n_layer)), biases 0, layer-norm weights 1. Each tensor draws from its
  // own stream derived from (seed, name), so the base is identical in both modes and for
  // any LoRA config. LoRA A ~ uniform(-1/sqrt(in), 1/sqrt(in)) (PEFT's Kaiming-uniform
  // default) from the same (seed, name) rule, LoRA B = 0. Deterministic: the generator and the
  // normal transform are our own, so only libm's log/cos could differ between platforms.
  // ResourceExhausted when the parameters do not fit in the backend's memory.
  static Result<std::unique_ptr<Gpt>> CreateRandom(const GptConfig& config, TrainMode mode,
                                                   const LoraConfig& lora, uint64_t seed,
                                                   const Compute& compute = {});

  // A model whose base is `tensors` (GPT-2 names; a leading "transformer." is stripped;
  // the attention-mask buffers "h.N.attn.bias"/"h.N.attn.masked_bias" of HF files and an
  // "lm_head.weight" equal in shape to wte are ignored). The shape is inferred from the
  // tensors; `n_head` is required because it cannot be inferred. Every tensor the
  // architecture needs must be present with the right shape and no unknown tensor may be
  // present (InvalidArgument naming it otherwise). LoRA factors are initialised from `seed`
  // as in CreateRandom.
  static Result<std::unique_ptr<Gpt>> FromBaseTensors(std::vector<Tensor> tensors, int n_head,
                                                      TrainMode mode, const LoraConfig& lora,
                                                      uint64_t seed, const Compute& compute = {});

  // A model of any family from the tensors of a Hugging Face checkpoint shaped by `config`
  // (ParseHfConfig of its config.json). GPT-2: as FromBaseTensors (the shape must equal
  // config's). The Llama family: Hugging Face's names ("model.embed_tokens.weight",
  // "model.layers.N.self_attn.q_proj.weight" [out, in], ..., "model.norm.weight",
  // "lm_head.weight" when untied; a "lm_head.weight" equal to the embedding is accepted
  // when tied). The linear weights are held transposed, [in, out], under the names without
  // "model." (ExportHfTensors gives them back as they came). Every tensor must be present
  // with its shape and none unknown (InvalidArgument naming it); nothing is allocated
  // before all are checked. LoRA factors are initialised from `seed` as in CreateRandom.
  static Result<std::unique_ptr<Gpt>> FromHfTensors(std::vector<Tensor> tensors,
                                                    const GptConfig& config, TrainMode mode,
                                                    const LoraConfig& lora, uint64_t seed,
                                                    const Compute& compute = {});
  // A Hugging Face folder: config.json and model.safetensors, or its shards and index
  // (FindHfCheckpoint), of either family.
  static Result<std::unique_ptr<Gpt>> LoadHfFolder(const std::string& dir, TrainMode mode,
                                                   const LoraConfig& lora, uint64_t seed,
                                                   const Compute& compute = {});

  // FromBaseTensors on the tensors of a safetensors file. When the file's metadata carries
  // "n_head" (SaveBase writes it) that value is used and `n_head` may be 0; if both are
  // given they must agree (InvalidArgument). A file with "hf_config" in its metadata (a
  // Llama-family base SaveBase wrote) is read as FromHfTensors with that config.json; a file
  // without it, when `expected` is a Llama-family config (a Hugging Face checkpoint whose
  // config.json the caller parsed), as FromHfTensors with `expected`. If `expected` is not
  // null the inferred config must equal it (FailedPrecondition otherwise).
  static Result<std::unique_ptr<Gpt>> LoadBase(const std::string& path, int n_head, TrainMode mode,
                                               const LoraConfig& lora, uint64_t seed,
                                               const GptConfig* expected = nullptr,
                                               const Compute& compute = {});

  ~Gpt();
  Gpt(const Gpt&) = delete;
  Gpt& operator=(const Gpt&) = delete;

  const GptConfig& config() const { return config_; }
  TrainMode mode() const { return mode_; }
  const LoraConfig& lora() const { return lora_; }
  ops::Ops& ops() const { return ops_; }
  ops::Dtype precision() const { return precision_; }
  bool recompute() const { return recompute_; }

  // Allocates the activations for batches of up to B x T tokens (once; they only grow).
  // ResourceExhausted naming the configuration and what to lower when they do not fit.
  // Forward reserves on its own, but dies if that fails: call Reserve first where
  // out-of-memory must be an error rather than the end of the process.
  Status Reserve(int B, int T);
  // Incremented whenever Reserve reallocates (recorded graphs then hold stale pointers).
  uint64_t layout_version() const { return layout_version_; }

  // Word-level distillation: batches staged with a teacher (TeacherTopK of `loss.k`
  // entries per position) are trained on ops::DistillCrossEntropy's loss instead of the
  // cross-entropy; batches without one still get the cross-entropy (evaluation). k = 0
  // turns it off. Reallocates the batch inputs on the next Reserve (layout_version()
  // changes). InvalidArgument for k outside [0, V], alpha outside [0, 1] or a temperature
  // that is not positive and finite.
  Status SetDistillation(const ops::DistillLoss& loss);
  const ops::DistillLoss& distillation() const { return distill_; }

  // Runs the model on tokens [B,T] (values in [0, V)), T <= n_ctx, and waits for it. With
  // targets [B,T] (values in [0, V), or -1 to leave a position out of the loss) returns the
  // mean cross-entropy over the counted positions (the distillation loss with a teacher)
  // and keeps what Backward needs; with targets == nullptr returns 0 and only computes
  // logits. Returns NaN when the backend failed (ops().status() says why). Out-of-range
  // sizes, tokens, targets or teacher ids are programming errors: the process aborts with a
  // message rather than reading outside the tables.
  float Forward(const int32_t* tokens, const int32_t* targets, int B, int T,
                const TeacherTopK* teacher = nullptr);

  // The logits [B,T,V] of the last Forward, copied to the host as fp32.
  std::vector<float> Logits() const;

  // Gradient of the last Forward's mean loss, ACCUMULATED into the gradients of the
  // trainable tensors (call ZeroGrad between steps). Requires a preceding Forward with
  // targets. Enqueued: it has run once the backend is synchronised.
  //
  // `final_from`, when given, is called as the gradient becomes final, piece by piece
  // from the end of the flat buffer down: after block l's backward is enqueued with the
  // offset from which every element of GradData() is then final (block l's tensors and
  // everything laid out after them: the later blocks, the final norm, the head), and last
  // with 0. The pieces are final in the backend's order: a caller hands them on with
  // ops().Mark(). The offsets depend only on the model's shape and mode, so every rank of
  // a site sees the same ones.
  void Backward(const std::function<void(int64_t from)>& final_from = nullptr);

  // Sets every trainable tensor's gradient to zero (enqueued).
  void ZeroGrad();

  // The staged form of Forward that Trainer::Step uses, in three parts so that the
  // device work can be recorded once as a graph and replayed: StageBatch checks the
  // batch and writes it to page-locked staging (host work only; the batch must fit what
  // was reserved); EnqueueForward copies the staging to the device and enqueues the
  // forward pass (and, with targets and `with_grad`, the gradient of the logits) and the
  // copy of the per-position losses back; StagedLoss reads the mean loss once the backend
  // has been synchronised.
  // `loss_positions` > 0: the loss gradient is that of a mean over this many positions
  // (a micro-batch of a larger batch) instead of this batch's own counted targets.
  // `teacher`: the batch's teacher (SetDistillation first), or null for the cross-entropy.
  void StageBatch(const int32_t* tokens, const int32_t* targets, int B, int T,
                  int64_t loss_positions = 0, const TeacherTopK* teacher = nullptr);
  // Positions of the staged batch with a target (>= 0): what StagedLoss averages over.
  int64_t staged_positions() const { return counted_; }
  void EnqueueForward(bool with_grad);
  double StagedLoss() const;

  // The trainable tensors: the LoRA factors (kLora, ordered by layer then target, A before
  // B) or every base tensor (kFull, in base order). Stable order and pointers.
  std::vector<ParamView> Trainable();
  // The trainable tensors as the multi-tensor AdamW's segments (matrices decay).
  std::vector<ops::AdamWSegment> AdamWSegments() const;

  // What training this configuration at batch B x T holds in backend memory, by part, as
  // the model and the trainer allocate it: sized without allocating anything (the
  // `--plan` of isthmus-worker). `distill_k`: the teacher's top-k per row when training
  // distils (SetDistillation), 0 otherwise. `optimizer_shards`: the ranks that split the
  // AdamW moments (Trainer::ShardOptimizerState; the plan counts the largest part, rank 0's).
  // InvalidArgument for a bad configuration or batch.
  static Result<MemoryPlan> PlanMemory(const GptConfig& config, TrainMode mode,
                                       const LoraConfig& lora, const Compute& compute, int B, int T,
                                       bool synced_rounds = false, int distill_k = 0,
                                       int optimizer_shards = 1);

  // The flat buffers behind Trainable(): TrainableElements() floats of parameters, and
  // GradElements() = TrainableElements() + 1 floats of gradients, whose last float belongs
  // to the caller (the trainer carries a control value through the gradient all-reduce in
  // it). TrainableCopy() is the bf16 copy the matmuls read (null in fp32): whoever changes
  // the parameters in place refreshes it (the optimizer writes it as it updates).
  float* TrainableData() const;
  // Refreshes the bf16 copies after the trainable tensors were written in place (e.g. by a
  // broadcast into TrainableData()); enqueued. A no-op in fp32.
  void TrainableChanged();
  float* GradData() const { return grads_.as<float>(); }
  int64_t TrainableElements() const;
  int64_t GradElements() const { return TrainableElements() + 1; }
  ops::Ref TrainableCopy() const;

  // Copies of the base tensors in GPT-2 order: wte, wpe, h.0.* ... h.{L-1}.*, ln_f.*. In
  // kFull mode these are what trains; in kLora mode they are frozen. FindBase returns
  // nothing for an unknown name.
  std::vector<Tensor> ExportBase() const;
  std::optional<Tensor> FindBase(const std::string& name) const;
  // The base tensors as a Hugging Face checkpoint of the family names and shapes them
  // (GPT-2: "transformer."-less as ExportBase; the Llama family: "model." names, linear
  // weights [out, in], "lm_head.weight" when untied): the inverse of FromHfTensors.
  std::vector<Tensor> ExportHfTensors() const;
  // Number of base elements (parameters of the architecture).
  int64_t BaseElements() const;

  // Lower-case hex SHA-256 (TensorsContentHash) of the base tensors: what workers and
  // shards compare to check they hold the same base. For the Llama family, of the tensors as
  // ExportHfTensors names and shapes them (the checkpoint's own, in fp32; a tied head's copy
  // and rotary buffers left out). Computed on each call (O(params)).
  std::string BaseHash() const;

  // Copies of the trainable tensors (names and shapes as in Trainable()): one copy from
  // the backend. The second form fills (*into)[at, at + n) and returns at + n, keeping the
  // buffers of the tensors already there (RefillTensor) and leaving those after them: a
  // caller that exports every round allocates once, and truncates *into itself.
  std::vector<Tensor> ExportTrainable() const;
  size_t ExportTrainable(std::vector<Tensor>* into, size_t at) const;

  // Overwrites trainable tensors with `tensors`. Every given tensor must name a trainable
  // tensor and match its shape (InvalidArgument otherwise, and nothing is changed). With
  // require_all, every trainable tensor must be given. Gradients are left as they are.
  Status LoadTrainable(const std::vector<Tensor>& tensors, bool require_all = true);

  // Writes the base tensors to a safetensors file (atomic), with metadata recording the
  // config ("n_layer", "n_embd", "n_head", "n_ctx", "vocab_size"), "format" = "pt" (what
  // every transformers version accepts) and "isthmus" = "gpt2". A Llama-family base is
  // written as ExportHfTensors names it, with "isthmus" = "llama" and its config.json as
  // "hf_config".
  Status SaveBase(const std::string& path) const;

  // Writes a Hugging Face folder that transformers' AutoModelForCausalLM opens directly:
  // `dir`/model.safetensors (the base tensors as ExportHfTensors names them: in full mode
  // the trained model), or above `max_shard_bytes` shards with model.safetensors.index.json
  // (WriteHfCheckpoint), and `dir`/config.json: GPT-2's (GPT2LMHeadModel, gelu_new,
  // layer_norm_epsilon 1e-5, tied embeddings, no dropout) or the Llama family's
  // (LlamaForCausalLM, or Qwen2ForCausalLM when q, k, v have biases; a Mistral base without
  // a sliding window is written as the Llama it computes as), torch_dtype of `dtype`. The tensors
  // are written in `dtype` (fp32 as held, or rounded to bf16 / fp16). Creates `dir`; each file is
  // written atomically.
  Status SaveHuggingFace(const std::string& dir, uint64_t max_shard_bytes = kHfDefaultShardBytes,
                         FileDtype dtype = FileDtype::kF32) const;

  // Metadata SaveBase writes (also useful for adapter files).
  std::map<std::string, std::string> ConfigMetadata() const;

  // Writes the LoRA adapters in the layout Hugging Face PEFT loads onto the model:
  // `dir`/adapter_model.safetensors with names "base_model.model.transformer.<name>" and
  // `dir`/adapter_config.json (peft_type LORA, r, lora_alpha, target_modules,
  // fan_in_fan_out true for GPT-2's Conv1D); for the Llama family the names are
  // "base_model.model.model.<name>", target_modules PEFT's short ones (q_proj) and
  // fan_in_fan_out false (nn.Linear). Creates `dir` if needed; each file is written
  // atomically. `base_dir`: the Hugging Face folder of the base (SaveHuggingFace), named
  // in adapter_config.json as base_model_name_or_path (made absolute) so that PEFT's
  // AutoPeftModelForCausalLM opens `dir` with no other argument; empty: null there.
  // FailedPrecondition in kFull mode (there are no adapters), IoError on filesystem
  // failures.
  Status SavePeftAdapter(const std::string& dir, const std::string& base_dir = "") const;

 private:
  struct Layer;
  struct Activations;
  void CarveActivations(Activations& a, int64_t N, Carver& arena, Carver& in, Carver& host) const;
  struct TensorSlot {
    std::string name;
    std::vector<int64_t> shape;
    int64_t numel = 0;
    int64_t offset = 0;  // in the flat buffer of its group
  };
  struct Group;  // a flat buffer of tensors: the base or the LoRA factors

  Gpt(const GptConfig& config, TrainMode mode, const LoraConfig& lora, const Compute& compute);
  void AddBase(const std::string& name, std::vector<int64_t> shape);
  Status BuildIndex();
  Status Allocate();
  std::vector<Tensor> InitialLora(uint64_t seed) const;
  std::vector<Tensor> RandomBase(uint64_t seed) const;
  std::vector<float> RopeTable() const;
  // Decides whether the base is held as a frozen bf16 base (Group::frozen_bf16) and lays
  // out its fp32 part; after BuildIndex, before Allocate.
  void SplitFrozenBase();
  // One block's forward (layer l, from the residual `input`), and the norm of a block.
  void ForwardBlock(int l, const float* input);
  void Norm(const float* x, int w, int b, ops::Ref out, float* mean, float* rstd);
  Status UploadGroup(Group& group, const std::vector<Tensor>& tensors);
  std::vector<Tensor> DownloadGroup(const Group& group) const;
  size_t DownloadGroup(const Group& group, std::vector<Tensor>* out, size_t at) const;
  void RefreshCopies(Group& group);
  Group& TrainableGroup() const;
  std::string ShapeForMessages(int B, int T) const;
  // Matmul view of a tensor (its bf16 copy in bf16) and its fp32 master.
  ops::CRef BaseM(int index) const;
  const float* BaseF(int index) const;
  ops::CRef LoraM(int index) const;
  float* BaseGrad(int index) const;
  float* LoraGrad(int index) const;

  GptConfig config_;
  TrainMode mode_;
  LoraConfig lora_;
  ops::Ops& ops_;
  ops::Dtype precision_;
  bool recompute_ = false;  // Compute::recompute

  std::unique_ptr<Group> base_;
  std::unique_ptr<Group> lora_tensors_;
  ops::Buffer grads_;  // TrainableElements() + 1
  int wte_ = -1, wpe_ = -1, lnf_w_ = -1, lnf_b_ = -1;
  // Per block, the first element of its trainable tensors in the flat gradient.
  std::vector<int64_t> block_grad_start_;
  int head_ = -1;     // the output head: wte_ when tied, else lm_head.weight
  ops::Buffer rope_;  // the Llama family's rotary table (RopeTable), in backend memory
  std::vector<Layer> layers_;

  std::unique_ptr<Activations> act_;
  uint64_t layout_version_ = 0;
  int cur_b_ = 0, cur_t_ = 0;
  int64_t counted_ = 0;  // positions with a target in the staged batch
  bool have_targets_ = false;
  ops::DistillLoss distill_{0, 1.0f, 1.0f};
  bool have_teacher_ = false;  // the staged batch came with a teacher
};

}  // namespace isthmus::model
