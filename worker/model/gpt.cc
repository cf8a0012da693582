// The decoder's forward and backward over ops::Ops, parameter layout, initialisation and
// loading, for both families. GPT-2's layer loop mirrors llm.c's train_gpt2.c; the Llama
// family's block runs the same loop with RMS norms, the rotary/grouped-query packing before
// the attention kernel and a SwiGLU MLP. LoRA adapts any of the block's linears. All tensors
// live in the backend's memory, in flat buffers (parameters) and one arena (activations).
#include "worker/model/gpt.h"

#include "common/check.h"
#include "common/durable.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numbers>
#include <set>

#include <nlohmann/json.hpp>

#include "common/safetensors.h"

namespace isthmus::model {

// Hands out 256-byte-aligned pieces of one buffer; over a null buffer it only measures.
class Carver {
 public:
  explicit Carver(char* base) : base_(base) {}
  template <typename T>
  T* Take(int64_t n) {
    offset_ = (offset_ + 255) / 256 * 256;
    T* p = base_ != nullptr ? reinterpret_cast<T*>(base_ + offset_) : nullptr;
    offset_ += static_cast<size_t>(n) * sizeof(T);
    return p;
  }
  ops::Ref Take(int64_t n, ops::Dtype d) {
    offset_ = (offset_ + 255) / 256 * 256;
    void* p = base_ != nullptr ? base_ + offset_ : nullptr;
    offset_ += static_cast<size_t>(n) * ops::DtypeSize(d);
    return {p, d};
  }
  size_t size() const { return offset_; }

 private:
  char* base_;
  size_t offset_ = 0;
};

namespace {

// Writes `value` as indented JSON to `path` atomically (a temporary file renamed over it).
Status WriteJsonFile(const std::string& path, const nlohmann::json& value) {
  return WriteFileDurably(path, value.dump(2) + "\n");
}

// A block's linears, indexed by their place in the family's target list (LoraTargetNames).
constexpr int kCAttn = 0, kAttnProj = 1, kFc = 2, kMlpProj = 3;               // GPT-2
constexpr int kQ = 0, kK = 1, kV = 2, kO = 3, kGate = 4, kUp = 5, kDown = 6;  // Llama
constexpr int kNumTargets = 7;  // the most of any family

// A small, fully specified generator (splitmix64) so that initial weights do not depend on
// the standard library's distribution implementations.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in (0, 1].
  double Uniform() { return (static_cast<double>(Next() >> 11) + 1.0) * 0x1.0p-53; }
  double Normal() {
    const double u1 = Uniform(), u2 = Uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
  }

 private:
  uint64_t state_;
};

uint64_t StreamSeed(uint64_t seed, const std::string& name) {
  uint64_t h = 0xCBF29CE484222325ull;  // FNV-1a
  for (unsigned char c : name) h = (h ^ c) * 0x100000001B3ull;
  Rng mix(seed ^ h);
  return mix.Next();
}

// A block's tensor names start "h.N." in GPT-2 and "layers.N." in the Llama family.
std::string BlockName(ModelFamily family, int layer, const std::string& suffix) {
  return (family == ModelFamily::kGpt2 ? "h." : "layers.") + std::to_string(layer) + "." + suffix;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? "," : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

struct Gpt::Layer {
  int ln1_w = -1, ln1_b = -1, ln2_w = -1, ln2_b = -1;  // norm slots (no biases in Llama's)
  struct Linear {
    int w = -1, b = -1;            // base slot indices
    int lora_a = -1, lora_b = -1;  // LoRA slot indices, -1 when not adapted
    int in = 0, out = 0;
  } lin[kNumTargets];
};

struct Gpt::Group {
  std::vector<TensorSlot> slots;
  int64_t elements = 0;  // the flat length, gaps included
  ops::Buffer data;      // fp32 masters (of a frozen bf16 base: only those kernels read)
  ops::Buffer copy;      // bf16 copies for the matmuls (bf16 precision only)
  // A frozen base in bf16 (LoRA mode, bf16 precision: SplitFrozenBase): the backend holds
  // the bf16 copy of every tensor, and fp32 only of those the kernels read in fp32 (the
  // embeddings, norms and biases), at f32_offset in `data` (-1: not held); the fp32 masters
  // of all of them stay in host memory (`host`, flat like `copy`), where ExportBase reads.
  bool frozen_bf16 = false;
  std::vector<int64_t> f32_offset;
  int64_t f32_elements = 0;
  std::vector<float> host;

  float* F(int i) const {
    if (!frozen_bf16) return data.as<float>() + slots[i].offset;
    return f32_offset[i] < 0 ? nullptr : data.as<float>() + f32_offset[i];
  }
  int64_t DataElements() const { return frozen_bf16 ? f32_elements : elements; }
  ops::Bf16* C(int i) const { return copy.as<ops::Bf16>() + slots[i].offset; }
  // Appends a slot at the next 64-element boundary and returns its index.
  int Add(const std::string& name, std::vector<int64_t> shape) {
    TensorSlot t{name, std::move(shape), 0, 0};
    t.numel = NumElements(t.shape);
    t.offset = (elements + kAlign - 1) / kAlign * kAlign;
    elements = t.offset + t.numel;
    slots.push_back(std::move(t));
    return static_cast<int>(slots.size()) - 1;
  }
  int Find(const std::string& name) const {
    for (size_t i = 0; i < slots.size(); ++i) {
      if (slots[i].name == name) return static_cast<int>(i);
    }
    return -1;
  }
  static constexpr int64_t kAlign = 64;  // 256 bytes of fp32: aligned for every kernel
};

// Every activation and scratch buffer of one batch shape, carved from one allocation, plus
// the step's inputs on the backend and their page-locked staging copy.
struct Gpt::Activations {
  struct PerLayer {
    ops::Ref ln1, qkv, atty, ln2, fch, fch_gelu;
    ops::Ref q, k, v;  // the Llama family: q, k, v before RoPE (qkv is then their packing)
    ops::Ref up;       // and the up projection (fch is the gate's, fch_gelu the SwiGLU's)
    ops::Ref xa[kNumTargets];
    float *ln1_mean, *ln1_rstd, *lse, *res2, *ln2_mean, *ln2_rstd, *res3;
  };
  int64_t cap_n = 0;  // rows B*T the buffers hold
  ops::Buffer arena;
  std::vector<PerLayer> layers;
  float *encoded, *lnf_mean, *lnf_rstd, *losses;
  ops::Ref lnf, logits, dlogits;
  // Backward scratch; dres_act is dres converted for the matmuls (dres itself in fp32).
  float *dres, *att_scratch;
  ops::Ref dres_act, dln, dqkv, datty, dfch, dxa;
  ops::Ref dq, dk, dv, dgate, dup;  // the Llama family
  // Inputs: tokens[cap_n], targets[cap_n], order[cap_n], starts[V+1], then the loss scale,
  // contiguous so that one copy moves them; `staging` holds the same block, then losses.
  ops::Buffer inputs;
  ops::HostBuffer staging;
  size_t inputs_bytes = 0;
  // With distillation, the teacher's top-k (ids, logits) for every row follow.
  int32_t *tokens, *targets, *order, *starts, *teacher_ids;
  float *dloss, *teacher_logits;
  int32_t *h_tokens, *h_targets, *h_order, *h_starts, *h_teacher_ids;
  float *h_dloss, *h_losses, *h_teacher_logits;
};

namespace {

// Hands out 256-byte aligned pieces of one block; with a null base it only measures.
std::string GiB(size_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(bytes) / (1 << 30));
  return buf;
}

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "Gpt: %s\n", what.c_str());
  std::abort();
}

}  // namespace

const char* TrainModeName(TrainMode mode) { return mode == TrainMode::kLora ? "lora" : "full"; }

Result<TrainMode> ParseTrainMode(const std::string& name) {
  if (name == "lora") return TrainMode::kLora;
  if (name == "full") return TrainMode::kFull;
  return Status::InvalidArgument("train mode must be \"lora\" or \"full\", got \"" + name + "\"");
}

const char* ModelFamilyName(ModelFamily family) {
  return family == ModelFamily::kGpt2 ? "gpt2" : "llama";
}

Status GptConfig::Validate() const {
  if (n_layer <= 0 || n_embd <= 0 || n_head <= 0 || n_ctx <= 0 || vocab_size <= 0) {
    return Status::InvalidArgument("GptConfig fields must be positive");
  }
  if (n_embd % n_head != 0) {
    return Status::InvalidArgument("n_head " + std::to_string(n_head) + " does not divide n_embd " +
                                   std::to_string(n_embd));
  }
  if (n_kv_head < 0 || n_inner < 0) {
    return Status::InvalidArgument("n_kv_head and n_inner must not be negative");
  }
  if (family == ModelFamily::kGpt2) {
    if (n_kv_head != 0 && n_kv_head != n_head) {
      return Status::InvalidArgument("GPT-2 has no grouped-query attention (n_kv_head " +
                                     std::to_string(n_kv_head) + ")");
    }
    if (n_inner != 0 && n_inner != 4 * n_embd) {
      return Status::InvalidArgument("GPT-2's MLP is 4 x n_embd wide (n_inner " +
                                     std::to_string(n_inner) + ")");
    }
    if (qkv_bias || !tied_embeddings || rope_scaling.factor != 0) {
      return Status::InvalidArgument(
          "GPT-2 takes none of the Llama family's options (qkv_bias, untied embeddings, "
          "rope_scaling)");
    }
    return Status::Ok();
  }
  if (n_head % kv_heads() != 0) {
    return Status::InvalidArgument("n_kv_head " + std::to_string(kv_heads()) +
                                   " does not divide n_head " + std::to_string(n_head));
  }
  if (head_size() % 2 != 0) {
    return Status::InvalidArgument("the head size " + std::to_string(head_size()) +
                                   " must be even for rotary positions");
  }
  if (!(rope_theta > 0) || !std::isfinite(rope_theta)) {
    return Status::InvalidArgument("rope_theta must be positive");
  }
  if (!(norm_eps > 0) || !std::isfinite(norm_eps)) {
    return Status::InvalidArgument("rms_norm_eps must be positive");
  }
  const RopeScaling& r = rope_scaling;
  if (r.factor != 0 && (!(r.factor >= 1) || !(r.low_freq_factor > 0) ||
                        !(r.high_freq_factor > r.low_freq_factor) || r.original_context <= 0)) {
    return Status::InvalidArgument(
        "rope_scaling needs factor >= 1, 0 < low_freq_factor < high_freq_factor and "
        "original_max_position_embeddings > 0");
  }
  return Status::Ok();
}

std::vector<std::string> LoraTargetNames(ModelFamily family) {
  if (family == ModelFamily::kGpt2) {
    return {std::begin(kLoraTargetNames), std::end(kLoraTargetNames)};
  }
  return {std::begin(kLlamaLoraTargetNames), std::end(kLlamaLoraTargetNames)};
}

Status LoraConfig::Validate(ModelFamily family) const {
  if (rank <= 0) return Status::InvalidArgument("LoRA rank must be positive");
  if (!std::isfinite(alpha)) return Status::InvalidArgument("LoRA alpha must be finite");
  if (targets.empty()) return Status::InvalidArgument("LoRA needs at least one target");
  const std::vector<std::string> allowed = LoraTargetNames(family);
  std::set<std::string> seen;
  for (const std::string& t : targets) {
    if (std::find(allowed.begin(), allowed.end(), t) == allowed.end()) {
      std::string list;
      for (const std::string& a : allowed) list += (list.empty() ? "" : ", ") + a;
      return Status::InvalidArgument("unknown LoRA target \"" + t + "\" for " +
                                     ModelFamilyName(family) + " (allowed: " + list + ")");
    }
    if (!seen.insert(t).second) return Status::InvalidArgument("duplicate LoRA target " + t);
  }
  return Status::Ok();
}

std::string LoraAName(int layer, const std::string& target) {
  return LoraAName(ModelFamily::kGpt2, layer, target);
}
std::string LoraBName(int layer, const std::string& target) {
  return LoraBName(ModelFamily::kGpt2, layer, target);
}
std::string LoraAName(ModelFamily family, int layer, const std::string& target) {
  return BlockName(family, layer, target + ".lora_A.weight");
}
std::string LoraBName(ModelFamily family, int layer, const std::string& target) {
  return BlockName(family, layer, target + ".lora_B.weight");
}

Result<GptConfig> ParseHfConfig(const std::string& json_text, const std::string& source) {
  const nlohmann::json j = nlohmann::json::parse(json_text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return Status::InvalidArgument(source + " is not a JSON object");
  }
  auto refuse = [&](const std::string& field, const std::string& why) {
    return Status::InvalidArgument(source + ": " + field + " " + why);
  };
  // A string field of `object`; `fallback` when absent or null; another JSON type as its
  // JSON text (which no accepted value equals: refused below, naming it).
  auto text = [](const nlohmann::json& object, const char* field, const std::string& fallback) {
    if (!object.contains(field) || object[field].is_null()) return fallback;
    return object[field].is_string() ? object[field].get<std::string>() : object[field].dump();
  };
  const std::string type = text(j, "model_type", "");
  // An integer field; `fallback` < 0: required.
  auto integer = [&](const char* field, int64_t fallback, int64_t* out) -> Status {
    if (!j.contains(field) || j[field].is_null()) {
      if (fallback < 0) return refuse(field, "is missing");
      *out = fallback;
      return Status::Ok();
    }
    if (!j[field].is_number_integer() || j[field].get<int64_t>() <= 0 ||
        j[field].get<int64_t>() > (int64_t{1} << 30)) {
      return refuse(field, "must be a positive integer, got " + j[field].dump());
    }
    *out = j[field].get<int64_t>();
    return Status::Ok();
  };
  auto number = [&](const char* field, double fallback, double* out) -> Status {
    if (!j.contains(field) || j[field].is_null()) {
      *out = fallback;
      return Status::Ok();
    }
    if (!j[field].is_number()) return refuse(field, "must be a number, got " + j[field].dump());
    *out = j[field].get<double>();
    return Status::Ok();
  };
  auto flag = [&](const char* field, bool fallback) {
    return j.contains(field) && j[field].is_boolean() ? j[field].get<bool>() : fallback;
  };
  GptConfig c;
  int64_t v = 0;
  if (type == "gpt2") {
    ISTHMUS_RETURN_IF_ERROR(integer("n_layer", -1, &v));
    c.n_layer = static_cast<int>(v);
    ISTHMUS_RETURN_IF_ERROR(integer("n_embd", -1, &v));
    c.n_embd = static_cast<int>(v);
    ISTHMUS_RETURN_IF_ERROR(integer("n_head", -1, &v));
    c.n_head = static_cast<int>(v);
    ISTHMUS_RETURN_IF_ERROR(integer("n_positions", -1, &v));
    c.n_ctx = static_cast<int>(v);
    ISTHMUS_RETURN_IF_ERROR(integer("vocab_size", -1, &v));
    c.vocab_size = static_cast<int>(v);
    const std::string act = text(j, "activation_function", "gelu_new");
    if (act != "gelu_new") return refuse("activation_function", "\"" + act + "\" is not gelu_new");
    ISTHMUS_RETURN_IF_ERROR(c.Validate());
    return c;
  }
  if (type != "llama" && type != "qwen2" && type != "mistral") {
    return refuse("model_type", "\"" + type +
                                    "\" is not one this worker computes (gpt2, llama, qwen2, "
                                    "mistral)");
  }
  c.family = ModelFamily::kLlama;
  ISTHMUS_RETURN_IF_ERROR(integer("num_hidden_layers", -1, &v));
  c.n_layer = static_cast<int>(v);
  ISTHMUS_RETURN_IF_ERROR(integer("hidden_size", -1, &v));
  c.n_embd = static_cast<int>(v);
  ISTHMUS_RETURN_IF_ERROR(integer("num_attention_heads", -1, &v));
  c.n_head = static_cast<int>(v);
  ISTHMUS_RETURN_IF_ERROR(integer("num_key_value_heads", c.n_head, &v));
  c.n_kv_head = static_cast<int>(v);
  ISTHMUS_RETURN_IF_ERROR(integer("intermediate_size", -1, &v));
  c.n_inner = static_cast<int>(v);
  ISTHMUS_RETURN_IF_ERROR(integer("max_position_embeddings", -1, &v));
  c.n_ctx = static_cast<int>(v);
  ISTHMUS_RETURN_IF_ERROR(integer("vocab_size", -1, &v));
  c.vocab_size = static_cast<int>(v);
  double d = 0;
  ISTHMUS_RETURN_IF_ERROR(number("rope_theta", 10000.0, &c.rope_theta));
  ISTHMUS_RETURN_IF_ERROR(number("rms_norm_eps", 1e-6, &d));
  c.norm_eps = static_cast<float>(d);
  c.tied_embeddings = flag("tie_word_embeddings", type == "qwen2");
  c.qkv_bias = type == "qwen2" || flag("attention_bias", false);
  const std::string act = text(j, "hidden_act", "silu");
  if (act != "silu") return refuse("hidden_act", "\"" + act + "\" is not silu");
  if (c.n_embd % c.n_head == 0 && j.contains("head_dim") && !j["head_dim"].is_null() &&
      j["head_dim"] != c.n_embd / c.n_head) {
    return refuse("head_dim", j["head_dim"].dump() + " differs from hidden_size / " +
                                  "num_attention_heads (" + std::to_string(c.n_embd / c.n_head) +
                                  "), which this worker needs");
  }
  if (type == "llama" && flag("attention_bias", false)) {
    return refuse("attention_bias", "true (biases on o_proj) is not supported");
  }
  if (flag("mlp_bias", false)) return refuse("mlp_bias", "true is not supported");
  for (const char* moe : {"num_local_experts", "num_experts", "num_experts_per_tok"}) {
    if (j.contains(moe) && !j[moe].is_null()) {
      return refuse(moe, "is set: mixtures of experts are not supported");
    }
  }
  if (j.contains("quantization_config")) {
    return refuse("quantization_config", "is set: quantized checkpoints are not supported");
  }
  const bool window_on = type == "mistral" || flag("use_sliding_window", false);
  if (window_on && j.contains("sliding_window") && j["sliding_window"].is_number_integer() &&
      j["sliding_window"].get<int64_t>() < c.n_ctx) {
    return refuse("sliding_window", j["sliding_window"].dump() +
                                        " is shorter than the context: sliding-window attention "
                                        "is not supported");
  }
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) {
    const nlohmann::json& r = j["rope_scaling"];
    const std::string rope_type = r.is_object() ? text(r, "rope_type", text(r, "type", "")) : "";
    if (rope_type != "llama3" && rope_type != "default") {
      return refuse("rope_scaling", r.dump() + " is not supported (only rope_type llama3)");
    }
    if (rope_type == "llama3") {
      auto field = [&](const char* name, double* out) -> Status {
        if (!r.contains(name) || !r[name].is_number()) {
          return refuse(std::string("rope_scaling.") + name, "is missing or not a number");
        }
        *out = r[name].get<double>();
        return Status::Ok();
      };
      double orig = 0;
      ISTHMUS_RETURN_IF_ERROR(field("factor", &c.rope_scaling.factor));
      ISTHMUS_RETURN_IF_ERROR(field("low_freq_factor", &c.rope_scaling.low_freq_factor));
      ISTHMUS_RETURN_IF_ERROR(field("high_freq_factor", &c.rope_scaling.high_freq_factor));
      ISTHMUS_RETURN_IF_ERROR(field("original_max_position_embeddings", &orig));
      c.rope_scaling.original_context = static_cast<int>(orig);
    }
  }
  if (Status st = c.Validate(); !st.ok())
    return Status::InvalidArgument(source + ": " + st.message());
  return c;
}

Result<ops::Dtype> ParsePrecision(const std::string& name) {
  if (name == "fp32") return ops::Dtype::kF32;
  if (name == "bf16") return ops::Dtype::kBF16;
  return Status::InvalidArgument("precision must be \"fp32\" or \"bf16\", got \"" + name + "\"");
}

Gpt::Gpt(const GptConfig& config, TrainMode mode, const LoraConfig& lora, const Compute& compute)
    : config_(config),
      mode_(mode),
      lora_(lora),
      ops_(compute.backend()),
      precision_(compute.precision),
      recompute_(compute.recompute),
      base_(std::make_unique<Group>()),
      lora_tensors_(std::make_unique<Group>()) {}

Gpt::~Gpt() = default;

// Lays out the base slots in the checkpoint's order, the layer indices and the LoRA slots.
Status Gpt::BuildIndex() {
  const int64_t C = config_.n_embd;
  const bool llama = config_.family == ModelFamily::kLlama;
  Group& g = *base_;
  layers_.assign(config_.n_layer, Layer{});
  wte_ = g.Add(llama ? "embed_tokens.weight" : "wte.weight", {config_.vocab_size, C});
  if (!llama) wpe_ = g.Add("wpe.weight", {config_.n_ctx, C});
  for (int l = 0; l < config_.n_layer; ++l) {
    Layer& L = layers_[l];
    auto add = [&](const std::string& suffix, std::vector<int64_t> shape) {
      return g.Add(BlockName(config_.family, l, suffix), std::move(shape));
    };
    // Weights [in, out] (GPT-2's Conv1D layout; a Hugging Face Llama checkpoint's
    // nn.Linear [out, in] is transposed on the way in and out).
    auto linear = [&](const std::string& name, int64_t in, int64_t out, bool bias) {
      Layer::Linear lin;
      lin.w = add(name + ".weight", {in, out});
      if (bias) lin.b = add(name + ".bias", {out});
      lin.in = static_cast<int>(in);
      lin.out = static_cast<int>(out);
      return lin;
    };
    if (llama) {
      const int64_t kv = static_cast<int64_t>(config_.kv_heads()) * config_.head_size();
      const int64_t I = config_.inner();
      const bool qb = config_.qkv_bias;
      L.ln1_w = add("input_layernorm.weight", {C});
      L.lin[kQ] = linear("self_attn.q_proj", C, C, qb);
      L.lin[kK] = linear("self_attn.k_proj", C, kv, qb);
      L.lin[kV] = linear("self_attn.v_proj", C, kv, qb);
      L.lin[kO] = linear("self_attn.o_proj", C, C, false);
      L.ln2_w = add("post_attention_layernorm.weight", {C});
      L.lin[kGate] = linear("mlp.gate_proj", C, I, false);
      L.lin[kUp] = linear("mlp.up_proj", C, I, false);
      L.lin[kDown] = linear("mlp.down_proj", I, C, false);
      continue;
    }
    L.ln1_w = add("ln_1.weight", {C});
    L.ln1_b = add("ln_1.bias", {C});
    L.lin[kCAttn] = linear("attn.c_attn", C, 3 * C, true);
    L.lin[kAttnProj] = linear("attn.c_proj", C, C, true);
    L.ln2_w = add("ln_2.weight", {C});
    L.ln2_b = add("ln_2.bias", {C});
    L.lin[kFc] = linear("mlp.c_fc", C, 4 * C, true);
    L.lin[kMlpProj] = linear("mlp.c_proj", 4 * C, C, true);
  }
  lnf_w_ = g.Add(llama ? "norm.weight" : "ln_f.weight", {C});
  if (!llama) lnf_b_ = g.Add("ln_f.bias", {C});
  head_ = config_.tied_embeddings ? wte_ : g.Add("lm_head.weight", {config_.vocab_size, C});
  block_grad_start_.assign(config_.n_layer, 0);
  if (mode_ == TrainMode::kFull) {
    // Each block's first tensor is its first norm's weight.
    for (int l = 0; l < config_.n_layer; ++l) {
      block_grad_start_[l] = g.slots[layers_[l].ln1_w].offset;
    }
    return Status::Ok();
  }
  const int r = lora_.rank;
  const std::vector<std::string> names = LoraTargetNames(config_.family);
  for (int l = 0; l < config_.n_layer; ++l) {
    // The factors are laid out block after block: block l starts where block l-1 ended.
    block_grad_start_[l] = lora_tensors_->elements;
    for (size_t k = 0; k < names.size(); ++k) {
      const std::string& target = names[k];
      if (std::find(lora_.targets.begin(), lora_.targets.end(), target) == lora_.targets.end()) {
        continue;
      }
      Layer::Linear& lin = layers_[l].lin[k];
      lin.lora_a = lora_tensors_->Add(LoraAName(config_.family, l, target), {r, lin.in});
      lin.lora_b = lora_tensors_->Add(LoraBName(config_.family, l, target), {lin.out, r});
    }
  }
  return Status::Ok();
}

// The rotary table of the Llama family: per position t < n_ctx, the cos and then the sin of
// the D/2 angles t * inv_freq[i], inv_freq[i] = theta^(-2i/D) (with Llama 3's rescaling), as
// Hugging Face computes them: inv_freq in fp32, the angle and its cos/sin in fp32.
std::vector<float> Gpt::RopeTable() const {
  const int D = config_.head_size(), half = D / 2;
  std::vector<float> inv(half);
  for (int i = 0; i < half; ++i) {
    inv[i] = static_cast<float>(
        1.0 / std::pow(config_.rope_theta, static_cast<double>(2 * i) / static_cast<double>(D)));
  }
  const RopeScaling& r = config_.rope_scaling;
  if (r.factor != 0) {  // transformers' _compute_llama3_parameters
    const double low_wavelen = r.original_context / r.low_freq_factor;
    const double high_wavelen = r.original_context / r.high_freq_factor;
    for (float& f : inv) {
      const double wavelen = 2.0 * std::numbers::pi / f;
      if (wavelen > low_wavelen) {
        f = static_cast<float>(f / r.factor);
      } else if (wavelen >= high_wavelen) {
        const double smooth = (r.original_context / wavelen - r.low_freq_factor) /
                              (r.high_freq_factor - r.low_freq_factor);
        f = static_cast<float>((1 - smooth) * f / r.factor + smooth * f);
      }
    }
  }
  std::vector<float> table(static_cast<size_t>(config_.n_ctx) * D);
  for (int t = 0; t < config_.n_ctx; ++t) {
    for (int i = 0; i < half; ++i) {
      const float angle = static_cast<float>(t) * inv[i];
      table[static_cast<size_t>(t) * D + i] = std::cos(angle);
      table[static_cast<size_t>(t) * D + half + i] = std::sin(angle);
    }
  }
  return table;
}

// Allocates the parameter, copy and gradient buffers on the backend.
Status Gpt::Allocate() {
  ISTHMUS_RETURN_IF_ERROR(ops_.CheckAttention(config_.n_embd, config_.n_head));
  auto out_of_memory = [&](const Status& st, const char* what) {
    return Status(st.code(), std::string("cannot hold the model's ") + what + " (" +
                                 std::to_string(config_.n_layer) + " layers x " +
                                 std::to_string(config_.n_embd) + ", " + TrainModeName(mode_) +
                                 ", " + ops::DtypeName(precision_) + ") on " + ops_.Describe() +
                                 ": " + st.message() + "; use a smaller model or another device");
  };
  SplitFrozenBase();
  for (Group* g : {base_.get(), lora_tensors_.get()}) {
    auto data = ops::Buffer::Allocate(ops_, g->DataElements() * sizeof(float));
    if (!data.ok()) return out_of_memory(data.status(), "parameters");
    g->data = std::move(data).value();
    ops_.Zero(g->data.data(), g->data.bytes());
    if (precision_ == ops::Dtype::kBF16) {
      auto copy = ops::Buffer::Allocate(ops_, g->elements * sizeof(ops::Bf16));
      if (!copy.ok()) return out_of_memory(copy.status(), "bf16 weight copies");
      g->copy = std::move(copy).value();
    }
  }
  auto grads = ops::Buffer::Allocate(ops_, GradElements() * sizeof(float));
  if (!grads.ok()) return out_of_memory(grads.status(), "gradients");
  grads_ = std::move(grads).value();
  ops_.Zero(grads_.data(), grads_.bytes());
  if (config_.family == ModelFamily::kLlama) {
    const std::vector<float> table = RopeTable();
    auto rope = ops::Buffer::Allocate(ops_, table.size() * sizeof(float));
    if (!rope.ok()) return out_of_memory(rope.status(), "rotary table");
    rope_ = std::move(rope).value();
    ops_.Upload(rope_.data(), table.data(), table.size() * sizeof(float));
  }
  return ops_.status();
}

std::vector<Tensor> Gpt::InitialLora(uint64_t seed) const {
  std::vector<Tensor> out;
  for (const TensorSlot& s : lora_tensors_->slots) {
    Tensor t{s.name, s.shape, std::vector<float>(static_cast<size_t>(s.numel), 0.0f)};
    if (t.name.find(".lora_A.") != std::string::npos) {  // B stays 0
      Rng rng(StreamSeed(seed, t.name));
      const double bound = 1.0 / std::sqrt(static_cast<double>(t.shape[1]));
      for (float& x : t.data) x = static_cast<float>((2.0 * rng.Uniform() - 1.0) * bound);
    }
    out.push_back(std::move(t));
  }
  return out;
}

std::vector<Tensor> Gpt::RandomBase(uint64_t seed) const {
  const double proj_std = 0.02 / std::sqrt(2.0 * config_.n_layer);
  std::vector<Tensor> out;
  for (const TensorSlot& s : base_->slots) {
    Tensor t{s.name, s.shape, std::vector<float>(static_cast<size_t>(s.numel), 0.0f)};
    const std::string& n = t.name;
    if (n.ends_with(".bias")) {
      // zeros
    } else if (n.find("ln_") != std::string::npos || n.ends_with("norm.weight")) {
      std::fill(t.data.begin(), t.data.end(), 1.0f);  // GPT-2's ln_*, Llama's *norm
    } else {
      const bool residual_proj = n.ends_with("attn.c_proj.weight") ||
                                 n.ends_with("mlp.c_proj.weight") || n.ends_with("o_proj.weight") ||
                                 n.ends_with("down_proj.weight");
      const double stdev = residual_proj ? proj_std : 0.02;
      Rng rng(StreamSeed(seed, n));
      for (float& x : t.data) x = static_cast<float>(stdev * rng.Normal());
    }
    out.push_back(std::move(t));
  }
  return out;
}

void Gpt::SplitFrozenBase() {
  Group& g = *base_;
  g.frozen_bf16 = mode_ == TrainMode::kLora && precision_ == ops::Dtype::kBF16;
  if (!g.frozen_bf16) return;
  g.f32_offset.assign(g.slots.size(), -1);
  g.f32_elements = 0;
  for (size_t i = 0; i < g.slots.size(); ++i) {
    const bool embedding = static_cast<int>(i) == wte_ || static_cast<int>(i) == wpe_;
    if (g.slots[i].shape.size() != 1 && !embedding) continue;  // a matrix: bf16 only
    g.f32_offset[i] = (g.f32_elements + Group::kAlign - 1) / Group::kAlign * Group::kAlign;
    g.f32_elements = g.f32_offset[i] + g.slots[i].numel;
  }
}

// `tensors` are the group's tensors in slot order. One copy to the backend (a frozen bf16
// base: its bf16 copy and the fp32 tensors the kernels read, rounded on the host as
// ops::Cast rounds, to nearest even).
Status Gpt::UploadGroup(Group& group, const std::vector<Tensor>& tensors) {
  std::vector<float> flat(static_cast<size_t>(group.elements), 0.0f);
  for (size_t i = 0; i < tensors.size(); ++i) {
    std::copy(tensors[i].data.begin(), tensors[i].data.end(), flat.begin() + group.slots[i].offset);
  }
  if (!group.frozen_bf16) {
    ops_.Upload(group.data.data(), flat.data(), flat.size() * sizeof(float));
    RefreshCopies(group);
    return ops_.status();
  }
  std::vector<float> f32(static_cast<size_t>(group.f32_elements), 0.0f);
  for (size_t i = 0; i < group.slots.size(); ++i) {
    if (group.f32_offset[i] < 0) continue;
    const auto from = flat.begin() + group.slots[i].offset;
    std::copy(from, from + group.slots[i].numel, f32.begin() + group.f32_offset[i]);
  }
  ops_.Upload(group.data.data(), f32.data(), f32.size() * sizeof(float));
  std::vector<ops::Bf16> bf16(flat.size());
  for (size_t i = 0; i < flat.size(); ++i) bf16[i] = ops::ToBf16(flat[i]);
  ops_.Upload(group.copy.data(), bf16.data(), bf16.size() * sizeof(ops::Bf16));
  group.host = std::move(flat);
  return ops_.status();
}

std::vector<Tensor> Gpt::DownloadGroup(const Group& group) const {
  std::vector<Tensor> out;
  DownloadGroup(group, &out, 0);
  return out;
}

size_t Gpt::DownloadGroup(const Group& group, std::vector<Tensor>* out, size_t at) const {
  // Each tensor straight into its own buffer (reused when *out already holds it), with no
  // flat copy of the whole group in between.
  for (size_t i = 0; i < group.slots.size(); ++i) {
    const TensorSlot& s = group.slots[i];
    float* dst = RefillTensor(out, at + i, s.name, s.shape, s.numel);
    if (group.frozen_bf16) {
      std::copy_n(group.host.begin() + s.offset, s.numel, dst);
    } else {
      ops_.Download(dst, group.data.as<float>() + s.offset,
                    static_cast<size_t>(s.numel) * sizeof(float));
    }
  }
  return at + group.slots.size();
}

void Gpt::RefreshCopies(Group& group) {
  // A frozen bf16 base holds fp32 for a few tensors only; its copy is written at upload.
  ISTHMUS_CHECK(!group.frozen_bf16, "RefreshCopies on a frozen bf16 base");
  if (precision_ == ops::Dtype::kBF16 && group.elements > 0) {
    ops_.Cast(group.data.as<float>(), ops::Ref(group.copy.data(), ops::Dtype::kBF16),
              group.elements);
  }
}

Gpt::Group& Gpt::TrainableGroup() const {
  return mode_ == TrainMode::kFull ? *base_ : *lora_tensors_;
}

Result<std::unique_ptr<Gpt>> Gpt::CreateRandom(const GptConfig& config, TrainMode mode,
                                               const LoraConfig& lora, uint64_t seed,
                                               const Compute& compute) {
  ISTHMUS_RETURN_IF_ERROR(config.Validate());
  if (mode == TrainMode::kLora) ISTHMUS_RETURN_IF_ERROR(lora.Validate(config.family));
  std::unique_ptr<Gpt> gpt(new Gpt(config, mode, lora, compute));
  ISTHMUS_RETURN_IF_ERROR(gpt->BuildIndex());
  ISTHMUS_RETURN_IF_ERROR(gpt->Allocate());
  ISTHMUS_RETURN_IF_ERROR(gpt->UploadGroup(*gpt->base_, gpt->RandomBase(seed)));
  ISTHMUS_RETURN_IF_ERROR(gpt->UploadGroup(*gpt->lora_tensors_, gpt->InitialLora(seed)));
  return gpt;
}

Result<std::unique_ptr<Gpt>> Gpt::FromBaseTensors(std::vector<Tensor> tensors, int n_head,
                                                  TrainMode mode, const LoraConfig& lora,
                                                  uint64_t seed, const Compute& compute) {
  static const std::string kPrefix = "transformer.";
  std::map<std::string, Tensor*> by_name;
  for (Tensor& t : tensors) {
    if (t.name.rfind(kPrefix, 0) == 0) t.name = t.name.substr(kPrefix.size());
    if (!by_name.emplace(t.name, &t).second) {
      return Status::InvalidArgument("base tensor \"" + t.name + "\" appears twice");
    }
  }
  auto find = [&](const std::string& name) -> Tensor* {
    auto it = by_name.find(name);
    return it == by_name.end() ? nullptr : it->second;
  };
  const Tensor* wte = find("wte.weight");
  const Tensor* wpe = find("wpe.weight");
  if (wte == nullptr || wpe == nullptr) {
    return Status::InvalidArgument("base lacks wte.weight or wpe.weight");
  }
  if (wte->shape.size() != 2 || wpe->shape.size() != 2 || wte->shape[1] != wpe->shape[1]) {
    return Status::InvalidArgument("wte " + ShapeString(wte->shape) + " and wpe " +
                                   ShapeString(wpe->shape) + " must be [V,C] and [n_ctx,C]");
  }
  GptConfig config;
  config.vocab_size = static_cast<int>(wte->shape[0]);
  config.n_embd = static_cast<int>(wte->shape[1]);
  config.n_ctx = static_cast<int>(wpe->shape[0]);
  config.n_head = n_head;
  config.n_layer = 0;
  while (find(BlockName(ModelFamily::kGpt2, config.n_layer, "ln_1.weight")) != nullptr) {
    ++config.n_layer;
  }
  ISTHMUS_RETURN_IF_ERROR(config.Validate());
  if (mode == TrainMode::kLora) ISTHMUS_RETURN_IF_ERROR(lora.Validate());

  std::unique_ptr<Gpt> gpt(new Gpt(config, mode, lora, compute));
  ISTHMUS_RETURN_IF_ERROR(gpt->BuildIndex());
  std::vector<Tensor> ordered;
  std::set<std::string> used;
  for (const TensorSlot& dst : gpt->base_->slots) {
    Tensor* src = find(dst.name);
    if (src == nullptr) return Status::InvalidArgument("base lacks tensor \"" + dst.name + "\"");
    if (src->shape != dst.shape) {
      return Status::InvalidArgument("base tensor \"" + dst.name + "\" has shape " +
                                     ShapeString(src->shape) + ", expected " +
                                     ShapeString(dst.shape));
    }
    if (static_cast<int64_t>(src->data.size()) != dst.numel) {
      return Status::InvalidArgument("base tensor \"" + dst.name + "\" data size mismatch");
    }
    ordered.push_back(std::move(*src));
    used.insert(dst.name);
  }
  for (const auto& [name, t] : by_name) {
    if (used.count(name)) continue;
    const bool mask_buffer = name.starts_with("h.") &&
                             (name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias"));
    const bool tied_head = name == "lm_head.weight" && t->shape == gpt->base_->slots[0].shape;
    if (mask_buffer || tied_head) continue;
    return Status::InvalidArgument("unknown base tensor \"" + name + "\" " + ShapeString(t->shape));
  }
  ISTHMUS_RETURN_IF_ERROR(gpt->Allocate());
  ISTHMUS_RETURN_IF_ERROR(gpt->UploadGroup(*gpt->base_, ordered));
  ISTHMUS_RETURN_IF_ERROR(gpt->UploadGroup(*gpt->lora_tensors_, gpt->InitialLora(seed)));
  return gpt;
}

namespace {

// [rows, cols] -> [cols, rows].
Tensor Transposed(Tensor t) {
  const int64_t rows = t.shape[0], cols = t.shape[1];
  std::vector<float> out(t.data.size());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) out[c * rows + r] = t.data[r * cols + c];
  }
  return {std::move(t.name), {cols, rows}, std::move(out)};
}

// A Llama-family base tensor held transposed (a linear's weight).
bool HeldTransposed(const std::string& name) { return name.ends_with("_proj.weight"); }

}  // namespace

Result<std::unique_ptr<Gpt>> Gpt::FromHfTensors(std::vector<Tensor> tensors,
                                                const GptConfig& config, TrainMode mode,
                                                const LoraConfig& lora, uint64_t seed,
                                                const Compute& compute) {
  if (config.family == ModelFamily::kGpt2) {
    ISTHMUS_ASSIGN_OR_RETURN(
        std::unique_ptr<Gpt> gpt,
        FromBaseTensors(std::move(tensors), config.n_head, mode, lora, seed, compute));
    if (!(gpt->config() == config)) {
      return Status::InvalidArgument(
          "the checkpoint's tensors do not have the shape its config.json gives (layers, "
          "width, context or vocabulary)");
    }
    return gpt;
  }
  ISTHMUS_RETURN_IF_ERROR(config.Validate());
  if (mode == TrainMode::kLora) ISTHMUS_RETURN_IF_ERROR(lora.Validate(config.family));
  std::unique_ptr<Gpt> gpt(new Gpt(config, mode, lora, compute));
  ISTHMUS_RETURN_IF_ERROR(gpt->BuildIndex());
  std::map<std::string, Tensor*> by_name;
  for (Tensor& t : tensors) {
    if (t.name.starts_with("model.")) t.name.erase(0, 6);
    if (!by_name.emplace(t.name, &t).second) {
      return Status::InvalidArgument("base tensor \"" + t.name + "\" appears twice");
    }
  }
  std::vector<Tensor> ordered;
  std::set<std::string> used;
  for (const TensorSlot& dst : gpt->base_->slots) {
    auto it = by_name.find(dst.name);
    const std::string hf_name = dst.name == "lm_head.weight" ? dst.name : "model." + dst.name;
    if (it == by_name.end()) {
      return Status::InvalidArgument("the checkpoint lacks tensor \"" + hf_name + "\"");
    }
    Tensor& src = *it->second;
    std::vector<int64_t> want = dst.shape;
    if (HeldTransposed(dst.name)) std::swap(want[0], want[1]);
    if (src.shape != want || static_cast<int64_t>(src.data.size()) != dst.numel) {
      return Status::InvalidArgument("tensor \"" + hf_name + "\" has shape " +
                                     ShapeString(src.shape) + ", the config.json gives " +
                                     ShapeString(want));
    }
    ordered.push_back(HeldTransposed(dst.name) ? Transposed(std::move(src)) : std::move(src));
    used.insert(dst.name);
  }
  for (const auto& [name, t] : by_name) {
    if (used.count(name)) continue;
    // A tied checkpoint may still carry the head (a copy of the embedding).
    const bool tied_head = name == "lm_head.weight" && config.tied_embeddings &&
                           t->shape == gpt->base_->slots[gpt->wte_].shape;
    // Rotary frequencies some checkpoints store: recomputed from config.json.
    const bool rotary = name.ends_with("rotary_emb.inv_freq");
    if (tied_head || rotary) continue;
    return Status::InvalidArgument("unknown tensor \"" + name + "\" " + ShapeString(t->shape) +
                                   " for a " + ModelFamilyName(config.family) + " of this shape");
  }
  ISTHMUS_RETURN_IF_ERROR(gpt->Allocate());
  ISTHMUS_RETURN_IF_ERROR(gpt->UploadGroup(*gpt->base_, ordered));
  ISTHMUS_RETURN_IF_ERROR(gpt->UploadGroup(*gpt->lora_tensors_, gpt->InitialLora(seed)));
  return gpt;
}

Result<std::unique_ptr<Gpt>> Gpt::LoadHfFolder(const std::string& dir, TrainMode mode,
                                               const LoraConfig& lora, uint64_t seed,
                                               const Compute& compute) {
  const std::string config_path = dir + "/config.json";
  std::ifstream in(config_path);
  if (!in) return Status::NotFound(config_path + ": no such file (a Hugging Face folder has one)");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ISTHMUS_ASSIGN_OR_RETURN(GptConfig config, ParseHfConfig(text, config_path));
  ISTHMUS_ASSIGN_OR_RETURN(std::string file, FindHfCheckpoint(dir));
  ISTHMUS_ASSIGN_OR_RETURN(SafetensorsFile checkpoint, ReadHfCheckpoint(file));
  return FromHfTensors(std::move(checkpoint.tensors), config, mode, lora, seed, compute);
}

std::vector<Tensor> Gpt::ExportHfTensors() const {
  std::vector<Tensor> out = ExportBase();
  if (config_.family == ModelFamily::kGpt2) return out;
  for (Tensor& t : out) {
    if (HeldTransposed(t.name)) t = Transposed(std::move(t));
    if (t.name != "lm_head.weight") t.name = "model." + t.name;
  }
  return out;
}

namespace {

// config.json of a Llama-family model: Qwen2's when its q, k, v projections have biases,
// else Llama's (a Mistral checkpoint without a sliding window computes as a Llama one).
nlohmann::json LlamaFamilyConfig(const GptConfig& c, const char* torch_dtype) {
  const bool qwen2 = c.qkv_bias;
  nlohmann::json j = {{"architectures", {qwen2 ? "Qwen2ForCausalLM" : "LlamaForCausalLM"}},
                      {"model_type", qwen2 ? "qwen2" : "llama"},
                      {"vocab_size", c.vocab_size},
                      {"hidden_size", c.n_embd},
                      {"intermediate_size", c.inner()},
                      {"num_hidden_layers", c.n_layer},
                      {"num_attention_heads", c.n_head},
                      {"num_key_value_heads", c.kv_heads()},
                      {"max_position_embeddings", c.n_ctx},
                      {"hidden_act", "silu"},
                      {"rms_norm_eps", c.norm_eps},
                      {"rope_theta", c.rope_theta},
                      {"rope_scaling", nullptr},
                      {"tie_word_embeddings", c.tied_embeddings},
                      {"attention_dropout", 0.0},
                      {"use_cache", true},
                      {"bos_token_id", nullptr},
                      {"eos_token_id", nullptr},
                      {"torch_dtype", torch_dtype}};
  if (c.rope_scaling.factor != 0) {
    j["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", c.rope_scaling.factor},
                         {"low_freq_factor", c.rope_scaling.low_freq_factor},
                         {"high_freq_factor", c.rope_scaling.high_freq_factor},
                         {"original_max_position_embeddings", c.rope_scaling.original_context}};
  }
  if (qwen2) {
    j["use_sliding_window"] = false;
    j["sliding_window"] = nullptr;
    j["max_window_layers"] = c.n_layer;
  } else {
    j["attention_bias"] = false;
    j["mlp_bias"] = false;
  }
  return j;
}

}  // namespace

Result<std::unique_ptr<Gpt>> Gpt::LoadBase(const std::string& path, int n_head, TrainMode mode,
                                           const LoraConfig& lora, uint64_t seed,
                                           const GptConfig* expected, const Compute& compute) {
  ISTHMUS_ASSIGN_OR_RETURN(SafetensorsFile file, ReadHfCheckpoint(path));
  auto hf = file.metadata.find("hf_config");  // a Llama-family base SaveBase wrote
  if (hf != file.metadata.end()) {
    ISTHMUS_ASSIGN_OR_RETURN(GptConfig config, ParseHfConfig(hf->second, path + " (hf_config)"));
    if (expected != nullptr && !(*expected == config)) {
      return Status::FailedPrecondition(path + ": the base's shape is not the configured one");
    }
    return FromHfTensors(std::move(file.tensors), config, mode, lora, seed, compute);
  }
  if (expected != nullptr && expected->family == ModelFamily::kLlama) {
    // A Hugging Face checkpoint whose config.json the caller parsed.
    return FromHfTensors(std::move(file.tensors), *expected, mode, lora, seed, compute);
  }
  auto it = file.metadata.find("n_head");
  if (it != file.metadata.end()) {
    auto parsed = ParseInt64(it->second, path + ": metadata n_head");
    if (!parsed.ok() || *parsed <= 0 || *parsed > 4096) {
      return Status::InvalidArgument(path + ": metadata n_head \"" + it->second +
                                     "\" is not a head count");
    }
    const int from_file = static_cast<int>(*parsed);
    if (n_head != 0 && n_head != from_file) {
      return Status::InvalidArgument(path + ": n_head " + std::to_string(n_head) +
                                     " requested but the file says " + it->second);
    }
    n_head = from_file;
  }
  if (n_head <= 0) {
    return Status::InvalidArgument(path + ": n_head not in the file's metadata; pass it");
  }
  ISTHMUS_ASSIGN_OR_RETURN(
      std::unique_ptr<Gpt> gpt,
      FromBaseTensors(std::move(file.tensors), n_head, mode, lora, seed, compute));
  if (expected != nullptr && !(*expected == gpt->config())) {
    const GptConfig& c = gpt->config();
    return Status::FailedPrecondition(
        path + ": base has n_layer=" + std::to_string(c.n_layer) +
        " n_embd=" + std::to_string(c.n_embd) + " n_head=" + std::to_string(c.n_head) +
        " n_ctx=" + std::to_string(c.n_ctx) + " vocab_size=" + std::to_string(c.vocab_size) +
        ", not the configured shape");
  }
  return gpt;
}

std::map<std::string, std::string> Gpt::ConfigMetadata() const {
  if (config_.family == ModelFamily::kLlama) {
    return {{"format", "pt"},
            {"isthmus", ModelFamilyName(config_.family)},
            {"hf_config", LlamaFamilyConfig(config_, "float32").dump()}};
  }
  return {{"format", "pt"},
          {"isthmus", "gpt2"},
          {"n_layer", std::to_string(config_.n_layer)},
          {"n_embd", std::to_string(config_.n_embd)},
          {"n_head", std::to_string(config_.n_head)},
          {"n_ctx", std::to_string(config_.n_ctx)},
          {"vocab_size", std::to_string(config_.vocab_size)}};
}

Status Gpt::SaveBase(const std::string& path) const {
  std::vector<Tensor> base = ExportHfTensors();
  ISTHMUS_RETURN_IF_ERROR(ops_.status());
  return WriteSafetensors(path, base, ConfigMetadata());
}

Status Gpt::SavePeftAdapter(const std::string& dir, const std::string& base_dir) const {
  if (mode_ != TrainMode::kLora) {
    return Status::FailedPrecondition("full-mode model has no LoRA adapters to export");
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::IoError("cannot create " + dir + ": " + ec.message());
  std::vector<Tensor> named = ExportTrainable();
  ISTHMUS_RETURN_IF_ERROR(ops_.status());
  const bool llama = config_.family == ModelFamily::kLlama;
  // PEFT wraps the model: GPT2LMHeadModel keeps its blocks under "transformer.",
  // LlamaForCausalLM (and Qwen2's) under "model.".
  for (Tensor& t : named) {
    t.name = std::string("base_model.model.") + (llama ? "model." : "transformer.") + t.name;
  }
  ISTHMUS_RETURN_IF_ERROR(WriteSafetensors(dir + "/adapter_model.safetensors", named));
  // PEFT's target_modules name a module by its last part (q_proj); GPT-2's are
  // distinguished by their parent (attn.c_proj, mlp.c_proj), as given.
  std::vector<std::string> modules = lora_.targets;
  if (llama) {
    for (std::string& m : modules) m = m.substr(m.find('.') + 1);
  }

  nlohmann::json config = {
      {"peft_type", "LORA"},
      {"task_type", "CAUSAL_LM"},
      {"base_model_name_or_path",
       base_dir.empty() ? nlohmann::json(nullptr)
                        : nlohmann::json(std::filesystem::absolute(base_dir).string())},
      {"r", lora_.rank},
      {"lora_alpha", lora_.alpha},
      {"lora_dropout", 0.0},
      {"bias", "none"},
      {"fan_in_fan_out", !llama},  // GPT-2's Conv1D holds [in, out]; nn.Linear [out, in]
      {"inference_mode", true},
      {"target_modules", modules}};
  return WriteJsonFile(dir + "/adapter_config.json", config);
}

Status Gpt::SaveHuggingFace(const std::string& dir, uint64_t max_shard_bytes,
                            FileDtype dtype) const {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::IoError("cannot create " + dir + ": " + ec.message());
  std::vector<Tensor> base = ExportHfTensors();
  ISTHMUS_RETURN_IF_ERROR(ops_.status());
  ISTHMUS_RETURN_IF_ERROR(WriteHfCheckpoint(dir, base, {{"format", "pt"}}, max_shard_bytes, dtype));
  const char* torch_dtype = dtype == FileDtype::kBF16  ? "bfloat16"
                            : dtype == FileDtype::kF16 ? "float16"
                                                       : "float32";
  if (config_.family == ModelFamily::kLlama) {
    return WriteJsonFile(dir + "/config.json", LlamaFamilyConfig(config_, torch_dtype));
  }
  nlohmann::json config = {{"architectures", {"GPT2LMHeadModel"}},
                           {"model_type", "gpt2"},
                           {"vocab_size", config_.vocab_size},
                           {"n_positions", config_.n_ctx},
                           {"n_ctx", config_.n_ctx},
                           {"n_embd", config_.n_embd},
                           {"n_layer", config_.n_layer},
                           {"n_head", config_.n_head},
                           {"n_inner", nullptr},
                           {"activation_function", "gelu_new"},
                           {"layer_norm_epsilon", 1e-5},
                           {"resid_pdrop", 0.0},
                           {"embd_pdrop", 0.0},
                           {"attn_pdrop", 0.0},
                           {"scale_attn_weights", true},
                           {"tie_word_embeddings", true},
                           {"use_cache", true},
                           {"torch_dtype", torch_dtype}};
  // GPT-2's vocabulary ends with <|endoftext|>; a byte-level model has no special token.
  const nlohmann::json special =
      config_.vocab_size == 50257 ? nlohmann::json(50256) : nlohmann::json(nullptr);
  config["bos_token_id"] = special;
  config["eos_token_id"] = special;
  return WriteJsonFile(dir + "/config.json", config);
}

std::vector<Tensor> Gpt::ExportBase() const { return DownloadGroup(*base_); }

std::optional<Tensor> Gpt::FindBase(const std::string& name) const {
  const int i = base_->Find(name);
  if (i < 0) return std::nullopt;
  const TensorSlot& s = base_->slots[i];
  if (base_->frozen_bf16) {
    const auto from = base_->host.begin() + s.offset;
    return Tensor{s.name, s.shape, std::vector<float>(from, from + s.numel)};
  }
  Tensor t{s.name, s.shape, std::vector<float>(static_cast<size_t>(s.numel))};
  ops_.Download(t.data.data(), base_->F(i), t.data.size() * sizeof(float));
  return t;
}

int64_t Gpt::BaseElements() const {
  int64_t n = 0;
  for (const TensorSlot& s : base_->slots) n += s.numel;
  return n;
}

std::string Gpt::BaseHash() const {
  // A Llama-family base hashes as its Hugging Face checkpoint names and shapes it, so a site
  // that reads the folder itself (isthmus.tensors_hash) computes the same hash.
  return TensorsContentHash(config_.family == ModelFamily::kLlama ? ExportHfTensors()
                                                                  : ExportBase());
}

ops::CRef Gpt::BaseM(int index) const {
  if (precision_ == ops::Dtype::kBF16) return base_->C(index);
  return base_->F(index);
}
const float* Gpt::BaseF(int index) const { return index < 0 ? nullptr : base_->F(index); }
ops::CRef Gpt::LoraM(int index) const {
  if (precision_ == ops::Dtype::kBF16) return lora_tensors_->C(index);
  return lora_tensors_->F(index);
}
float* Gpt::BaseGrad(int index) const {
  if (index < 0) return nullptr;  // a tensor the family does not have (Llama's biases)
  return mode_ == TrainMode::kFull ? GradData() + base_->slots[index].offset : nullptr;
}
float* Gpt::LoraGrad(int index) const {
  return mode_ == TrainMode::kLora ? GradData() + lora_tensors_->slots[index].offset : nullptr;
}

float* Gpt::TrainableData() const { return TrainableGroup().data.as<float>(); }
void Gpt::TrainableChanged() { RefreshCopies(TrainableGroup()); }
int64_t Gpt::TrainableElements() const { return TrainableGroup().elements; }
ops::Ref Gpt::TrainableCopy() const {
  if (precision_ != ops::Dtype::kBF16) return nullptr;
  return ops::Ref(TrainableGroup().copy.data(), ops::Dtype::kBF16);
}

std::vector<ParamView> Gpt::Trainable() {
  std::vector<ParamView> views;
  const Group& g = TrainableGroup();
  views.reserve(g.slots.size());
  for (size_t i = 0; i < g.slots.size(); ++i) {
    const TensorSlot& s = g.slots[i];
    views.push_back(
        {s.name, s.shape, g.F(static_cast<int>(i)), GradData() + s.offset, s.numel, s.offset});
  }
  return views;
}

void Gpt::ZeroGrad() { ops_.Zero(grads_.data(), TrainableElements() * sizeof(float)); }

std::vector<Tensor> Gpt::ExportTrainable() const { return DownloadGroup(TrainableGroup()); }
size_t Gpt::ExportTrainable(std::vector<Tensor>* into, size_t at) const {
  return DownloadGroup(TrainableGroup(), into, at);
}

Status Gpt::LoadTrainable(const std::vector<Tensor>& tensors, bool require_all) {
  Group& g = TrainableGroup();
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < g.slots.size(); ++i) index[g.slots[i].name] = i;
  std::vector<size_t> dst(tensors.size());
  std::set<size_t> seen;
  for (size_t i = 0; i < tensors.size(); ++i) {
    auto it = index.find(tensors[i].name);
    if (it == index.end()) {
      return Status::InvalidArgument("\"" + tensors[i].name + "\" is not a trainable tensor (" +
                                     TrainModeName(mode_) + " mode)");
    }
    const TensorSlot& want = g.slots[it->second];
    if (tensors[i].shape != want.shape ||
        static_cast<int64_t>(tensors[i].data.size()) != want.numel) {
      return Status::InvalidArgument("\"" + tensors[i].name + "\" has shape " +
                                     ShapeString(tensors[i].shape) + ", expected " +
                                     ShapeString(want.shape));
    }
    if (!seen.insert(it->second).second) {
      return Status::InvalidArgument("\"" + tensors[i].name + "\" given twice");
    }
    dst[i] = it->second;
  }
  if (require_all && seen.size() != g.slots.size()) {
    for (size_t i = 0; i < g.slots.size(); ++i) {
      if (!seen.count(i))
        return Status::InvalidArgument("missing trainable \"" + g.slots[i].name + "\"");
    }
  }
  // One copy back and forth; the buffers (and so every ParamView pointer) stay in place.
  std::vector<float> flat(static_cast<size_t>(g.elements), 0.0f);
  if (seen.size() != g.slots.size()) {
    ops_.Download(flat.data(), g.data.data(), flat.size() * sizeof(float));
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    std::copy(tensors[i].data.begin(), tensors[i].data.end(),
              flat.begin() + g.slots[dst[i]].offset);
  }
  ops_.Upload(g.data.data(), flat.data(), flat.size() * sizeof(float));
  RefreshCopies(g);
  return ops_.Synchronize();
}

std::string Gpt::ShapeForMessages(int B, int T) const {
  return "batch " + std::to_string(B) + " x context " + std::to_string(T) + ", " +
         std::to_string(config_.n_layer) + " layers x " + std::to_string(config_.n_embd) + ", " +
         TrainModeName(mode_) + ", " + ops::DtypeName(precision_);
}

// Carves the activations of N = B x T tokens out of `arena` (device), the inputs out of `in`
// (device) and their staging out of `host` (pinned host); carvers over null measure only.
void Gpt::CarveActivations(Activations& a, int64_t N, Carver& arena, Carver& in,
                           Carver& host) const {
  const int64_t C = config_.n_embd, H = config_.n_head, V = config_.vocab_size;
  const int64_t R = mode_ == TrainMode::kLora ? lora_.rank : 0;
  const int64_t I = config_.inner();  // 4C in GPT-2
  const int64_t KV = static_cast<int64_t>(config_.kv_heads()) * config_.head_size();
  const bool llama = config_.family == ModelFamily::kLlama;
  const ops::Dtype d = precision_;
  auto carve = [&](Carver& k) {
    a.layers.assign(config_.n_layer, {});
    for (int l = 0; l < config_.n_layer; ++l) {
      Activations::PerLayer& L = a.layers[l];
      if (recompute_ && l > 0) {  // one shared set; only the residual stream per layer
        L = a.layers[0];
        L.res2 = k.Take<float>(N * C);
        L.res3 = k.Take<float>(N * C);
        continue;
      }
      L.ln1 = k.Take(N * C, d);
      L.ln1_mean = llama ? nullptr : k.Take<float>(N);  // RMS norms keep rstd only
      L.ln1_rstd = k.Take<float>(N);
      if (llama) {
        L.q = k.Take(N * C, d);
        L.k = k.Take(N * KV, d);
        L.v = k.Take(N * KV, d);
      }
      L.qkv = k.Take(N * 3 * C, d);
      L.atty = k.Take(N * C, d);
      L.lse = k.Take<float>(N * H);
      L.res2 = k.Take<float>(N * C);
      L.ln2 = k.Take(N * C, d);
      L.ln2_mean = llama ? nullptr : k.Take<float>(N);
      L.ln2_rstd = k.Take<float>(N);
      L.fch = k.Take(N * I, d);
      if (llama) L.up = k.Take(N * I, d);
      L.fch_gelu = k.Take(N * I, d);
      L.res3 = k.Take<float>(N * C);
      for (int t = 0; t < kNumTargets; ++t) {
        L.xa[t] = layers_[l].lin[t].lora_a >= 0 ? k.Take(N * R, d) : ops::Ref();
      }
    }
    a.encoded = k.Take<float>(N * C);
    a.lnf = k.Take(N * C, d);
    a.lnf_mean = k.Take<float>(N);
    a.lnf_rstd = k.Take<float>(N);
    a.logits = k.Take(N * V, d);
    a.dlogits = k.Take(N * V, d);
    a.losses = k.Take<float>(N);
    a.dres = k.Take<float>(N * C);
    a.dres_act = d == ops::Dtype::kF32 ? ops::Ref(a.dres) : k.Take(N * C, d);
    a.dln = k.Take(N * C, d);
    a.dqkv = k.Take(N * 3 * C, d);
    a.datty = k.Take(N * C, d);
    a.dfch = k.Take(N * I, d);
    if (llama) {
      a.dq = k.Take(N * C, d);
      a.dk = k.Take(N * KV, d);
      a.dv = k.Take(N * KV, d);
      a.dgate = k.Take(N * I, d);
      a.dup = k.Take(N * I, d);
    }
    a.dxa = k.Take(std::max<int64_t>(N * R, 1), d);
    a.att_scratch = k.Take<float>(N * H);  // AttentionScratchFloats for any B x T = N
  };
  auto inputs = [&](Carver& k, bool host) {
    int32_t* tokens = k.Take<int32_t>(N);
    int32_t* targets = k.Take<int32_t>(N);
    int32_t* order = k.Take<int32_t>(N);
    int32_t* starts = k.Take<int32_t>(V + 1);
    float* dloss = k.Take<float>(1);
    const int64_t topk = N * distill_.k;
    int32_t* teacher_ids = topk > 0 ? k.Take<int32_t>(topk) : nullptr;
    float* teacher_logits = topk > 0 ? k.Take<float>(topk) : nullptr;
    if (host) {
      a.h_tokens = tokens, a.h_targets = targets, a.h_order = order, a.h_starts = starts;
      a.h_dloss = dloss;
      a.h_teacher_ids = teacher_ids, a.h_teacher_logits = teacher_logits;
      a.h_losses = k.Take<float>(N);
    } else {
      a.tokens = tokens, a.targets = targets, a.order = order, a.starts = starts;
      a.dloss = dloss;
      a.teacher_ids = teacher_ids, a.teacher_logits = teacher_logits;
      a.inputs_bytes = k.size();
    }
  };
  carve(arena);
  inputs(in, false);
  inputs(host, true);
}

std::vector<ops::AdamWSegment> Gpt::AdamWSegments() const {
  std::vector<ops::AdamWSegment> segments;
  for (const TensorSlot& s : TrainableGroup().slots) {
    segments.push_back({s.offset, s.numel, s.shape.size() >= 2});
  }
  return segments;
}

int64_t MemoryPlan::backend_bytes() const {
  return backend_held + parameters + weight_copies + gradients + optimizer + activations +
         round_buffers;
}

Result<MemoryPlan> Gpt::PlanMemory(const GptConfig& config, TrainMode mode, const LoraConfig& lora,
                                   const Compute& compute, int B, int T, bool synced_rounds,
                                   int distill_k, int optimizer_shards) {
  ISTHMUS_RETURN_IF_ERROR(config.Validate());
  if (mode == TrainMode::kLora) ISTHMUS_RETURN_IF_ERROR(lora.Validate(config.family));
  if (B <= 0 || T <= 0 || T > config.n_ctx) {
    return Status::InvalidArgument("batch " + std::to_string(B) + " x " + std::to_string(T) +
                                   " does not fit the model (context " +
                                   std::to_string(config.n_ctx) + ")");
  }
  // The model's layout alone: nothing is allocated.
  Gpt gpt(config, mode, lora, compute);
  ISTHMUS_RETURN_IF_ERROR(gpt.BuildIndex());
  gpt.distill_.k = distill_k;  // the teacher's rows beside the batch's inputs
  // Each buffer as the backends allocate it: rounded up to 256 bytes.
  auto rounded = [](int64_t bytes) { return (bytes + 255) / 256 * 256; };
  MemoryPlan p;
  const ops::MemoryInfo held = compute.backend().Memory();
  p.backend_held = static_cast<int64_t>(held.allocated);
  p.backend_free = static_cast<int64_t>(held.free);
  p.backend_total = static_cast<int64_t>(held.total);
  gpt.SplitFrozenBase();
  if (gpt.base_->frozen_bf16) {  // the frozen base's fp32 masters, in host memory
    p.host_masters = gpt.base_->elements * static_cast<int64_t>(sizeof(float));
  }
  for (const Group* g : {gpt.base_.get(), gpt.lora_tensors_.get()}) {
    p.parameters += rounded(g->DataElements() * static_cast<int64_t>(sizeof(float)));
    if (compute.precision == ops::Dtype::kBF16) {
      p.weight_copies += rounded(g->elements * static_cast<int64_t>(sizeof(ops::Bf16)));
    }
  }
  if (config.family == ModelFamily::kLlama) {  // the rotary table
    p.parameters += rounded(static_cast<int64_t>(config.n_ctx) * config.head_size() *
                            static_cast<int64_t>(sizeof(float)));
  }
  p.gradients = rounded(gpt.GradElements() * static_cast<int64_t>(sizeof(float)));
  const int64_t moments = rounded(gpt.TrainableElements() * static_cast<int64_t>(sizeof(float)));
  if (synced_rounds) p.round_buffers = 2 * moments;  // ModelLiveParams: base and staging
  // Rank 0's part of the moments: the largest when they are sharded across ranks.
  const std::vector<int64_t> part =
      ops::AdamWShardBounds(gpt.TrainableElements(), std::max(optimizer_shards, 1));
  const size_t chunks = ops::MakeAdamWChunks(gpt.AdamWSegments(), part[0], part[1]).size();
  p.optimizer = 2 * rounded((part[1] - part[0]) * static_cast<int64_t>(sizeof(float))) +
                rounded(static_cast<int64_t>(chunks * sizeof(ops::AdamWChunk))) +
                rounded(sizeof(ops::AdamWScalars) + sizeof(float));
  p.host_staging += rounded(sizeof(ops::AdamWScalars) + 3 * sizeof(float));
  Activations a;
  Carver arena(nullptr), in(nullptr), host(nullptr);
  gpt.CarveActivations(a, static_cast<int64_t>(B) * T, arena, in, host);
  p.activations =
      rounded(static_cast<int64_t>(arena.size())) + rounded(static_cast<int64_t>(in.size()));
  p.host_staging += rounded(static_cast<int64_t>(host.size()));
  // On the CPU the staging is host memory like the rest.
  if (compute.backend().HostMemory()) {
    p.activations += p.host_staging;
    p.host_staging = 0;
  }
  return p;
}

Status Gpt::Reserve(int B, int T) {
  if (B <= 0 || T <= 0 || T > config_.n_ctx) {
    return Status::InvalidArgument("batch " + std::to_string(B) + " x " + std::to_string(T) +
                                   " does not fit the model (context " +
                                   std::to_string(config_.n_ctx) + ")");
  }
  const int64_t n = static_cast<int64_t>(B) * T;
  if (act_ && n <= act_->cap_n) return Status::Ok();
  auto a = std::make_unique<Activations>();
  Carver measure(nullptr), measure_in(nullptr), measure_host(nullptr);
  CarveActivations(*a, n, measure, measure_in, measure_host);
  auto fail = [&](const Status& st) {
    return Status(
        st.code(),
        "out of memory for activations (" + ShapeForMessages(B, T) + ", " + GiB(measure.size()) +
            "): " + st.message() + "; lower --batch-size or --context" +
            (precision_ == ops::Dtype::kF32 && !ops_.HostMemory() ? ", or use --precision bf16"
                                                                  : ""));
  };
  act_.reset();  // the old buffers go first, so that their memory can be reused
  auto arena = ops::Buffer::Allocate(ops_, measure.size());
  if (!arena.ok()) return fail(arena.status());
  auto in = ops::Buffer::Allocate(ops_, measure_in.size());
  if (!in.ok()) return fail(in.status());
  auto staging = ops::HostBuffer::Allocate(ops_, measure_host.size());
  if (!staging.ok()) return fail(staging.status());
  a->arena = std::move(arena).value();
  a->inputs = std::move(in).value();
  a->staging = std::move(staging).value();
  Carver real(a->arena.as<char>()), real_in(a->inputs.as<char>()), real_host(a->staging.as<char>());
  CarveActivations(*a, n, real, real_in, real_host);
  a->cap_n = n;
  act_ = std::move(a);
  ++layout_version_;
  return ops_.status();
}

Status Gpt::SetDistillation(const ops::DistillLoss& loss) {
  if (loss.k < 0 || loss.k > config_.vocab_size) {
    return Status::InvalidArgument("distillation: k must be in [0, " +
                                   std::to_string(config_.vocab_size) + "] (the vocabulary), got " +
                                   std::to_string(loss.k));
  }
  if (!(loss.alpha >= 0.0f && loss.alpha <= 1.0f)) {
    return Status::InvalidArgument("distillation: alpha must be in [0, 1], got " +
                                   std::to_string(loss.alpha));
  }
  if (!(loss.temperature > 0.0f && std::isfinite(loss.temperature))) {
    return Status::InvalidArgument("distillation: the temperature must be positive, got " +
                                   std::to_string(loss.temperature));
  }
  if (loss.k != distill_.k) act_.reset();  // the inputs are carved again on Reserve
  distill_ = loss;
  return Status::Ok();
}

void Gpt::StageBatch(const int32_t* tokens, const int32_t* targets, int B, int T,
                     int64_t loss_positions, const TeacherTopK* teacher) {
  // Programming errors, not input errors: callers size batches and tokenize from the config.
  if (B <= 0 || T <= 0 || T > config_.n_ctx) Die("Forward: B, T out of range");
  const int64_t n = static_cast<int64_t>(B) * T;
  for (int64_t i = 0; i < n; ++i) {
    if (tokens[i] < 0 || tokens[i] >= config_.vocab_size) Die("Forward: token out of range");
    if (targets != nullptr && (targets[i] < -1 || targets[i] >= config_.vocab_size)) {
      Die("Forward: target out of range");
    }
  }
  if (!act_ || n > act_->cap_n) Die("StageBatch: batch larger than reserved (call Reserve)");
  Activations& a = *act_;
  cur_b_ = B;
  cur_t_ = T;
  have_targets_ = targets != nullptr;
  std::copy(tokens, tokens + n, a.h_tokens);
  ops::GroupByToken(tokens, static_cast<int>(n), config_.vocab_size, a.h_order, a.h_starts);
  counted_ = 0;
  if (targets != nullptr) {
    std::copy(targets, targets + n, a.h_targets);
    for (int64_t i = 0; i < n; ++i) counted_ += targets[i] >= 0;
  }
  have_teacher_ = teacher != nullptr && targets != nullptr;
  if (have_teacher_) {
    if (distill_.k == 0) Die("StageBatch: a teacher without SetDistillation");
    const int64_t entries = n * distill_.k;
    for (int64_t i = 0; i < entries; ++i) {
      if (teacher->ids[i] < 0 || teacher->ids[i] >= config_.vocab_size) {
        Die("StageBatch: teacher id out of range");
      }
    }
    std::copy(teacher->ids, teacher->ids + entries, a.h_teacher_ids);
    std::copy(teacher->logits, teacher->logits + entries, a.h_teacher_logits);
  }
  const int64_t over = loss_positions > 0 ? loss_positions : counted_;
  *a.h_dloss = over > 0 ? 1.0f / static_cast<float>(over) : 0.0f;
}

double Gpt::StagedLoss() const {
  if (!have_targets_ || counted_ == 0) return 0.0;
  double sum = 0.0;
  const int64_t n = static_cast<int64_t>(cur_b_) * cur_t_;
  for (int64_t i = 0; i < n; ++i) sum += act_->h_losses[i];
  return sum / static_cast<double>(counted_);
}

float Gpt::Forward(const int32_t* tokens, const int32_t* targets, int B, int T,
                   const TeacherTopK* teacher) {
  if (B <= 0 || T <= 0 || T > config_.n_ctx) Die("Forward: B, T out of range");
  if (Status st = Reserve(B, T); !st.ok()) Die("Forward: " + st.ToString());
  StageBatch(tokens, targets, B, T, 0, teacher);
  EnqueueForward(true);
  if (!ops_.Synchronize().ok()) return std::numeric_limits<float>::quiet_NaN();
  return static_cast<float>(StagedLoss());
}

// One block's forward from `input` (the residual stream entering layer l) into the layer's
// activations, ending with its output residual res3. Backward calls it again for a layer
// whose activations were not kept (activation recompute).
void Gpt::ForwardBlock(int l, const float* input) {
  Activations& a = *act_;
  const int B = cur_b_, T = cur_t_, N = B * T, C = config_.n_embd, H = config_.n_head;
  const float scale = lora_.Scale();
  auto linear = [&](const Layer::Linear& lin, ops::CRef x, const float* residual, ops::Ref out,
                    ops::Ref xa) {
    if (lin.lora_a >= 0) {
      ops_.LoraLinearForward(x, BaseM(lin.w), BaseF(lin.b), LoraM(lin.lora_a), LoraM(lin.lora_b),
                             scale, residual, out, xa, N, lin.in, lin.out, lora_.rank);
    } else {
      ops_.LinearForward(x, BaseM(lin.w), BaseF(lin.b), residual, out, N, lin.in, lin.out);
    }
  };
  const bool llama = config_.family == ModelFamily::kLlama;
  const int Hkv = config_.kv_heads(), D = config_.head_size();
  const int64_t NI = static_cast<int64_t>(N) * config_.inner();
  const Layer& L = layers_[l];
  Activations::PerLayer& A = a.layers[l];
  Norm(input, L.ln1_w, L.ln1_b, A.ln1, A.ln1_mean, A.ln1_rstd);
  if (llama) {  // q, k, v, then the rotary positions and the kv heads' sharing
    linear(L.lin[kQ], A.ln1, nullptr, A.q, A.xa[kQ]);
    linear(L.lin[kK], A.ln1, nullptr, A.k, A.xa[kK]);
    linear(L.lin[kV], A.ln1, nullptr, A.v, A.xa[kV]);
    ops_.RopeGqaForward(A.q, A.k, A.v, rope_.as<float>(), A.qkv, B, T, H, Hkv, D);
  } else {
    linear(L.lin[kCAttn], A.ln1, nullptr, A.qkv, A.xa[kCAttn]);
  }
  ops_.AttentionForward(A.qkv, A.atty, A.lse, B, T, C, H);
  // The residual add is fused into the projection: res2 = input + atty W + b.
  const int proj = llama ? kO : kAttnProj;
  linear(L.lin[proj], A.atty, input, A.res2, A.xa[proj]);
  Norm(A.res2, L.ln2_w, L.ln2_b, A.ln2, A.ln2_mean, A.ln2_rstd);
  if (llama) {  // SwiGLU: silu(gate) * up
    linear(L.lin[kGate], A.ln2, nullptr, A.fch, A.xa[kGate]);
    linear(L.lin[kUp], A.ln2, nullptr, A.up, A.xa[kUp]);
    ops_.SwigluForward(A.fch, A.up, A.fch_gelu, NI);
  } else {
    linear(L.lin[kFc], A.ln2, nullptr, A.fch, A.xa[kFc]);
    ops_.GeluForward(A.fch, A.fch_gelu, NI);
  }
  const int down = llama ? kDown : kMlpProj;
  linear(L.lin[down], A.fch_gelu, A.res2, A.res3, A.xa[down]);
}

// A block's norm: RMS in the Llama family, layer norm in GPT-2.
void Gpt::Norm(const float* x, int w, int b, ops::Ref out, float* mean, float* rstd) {
  const int N = cur_b_ * cur_t_, C = config_.n_embd;
  if (config_.family == ModelFamily::kLlama) {
    ops_.RmsNormForward(x, BaseF(w), out, rstd, N, C, config_.norm_eps);
  } else {
    ops_.LayerNormForward(x, BaseF(w), BaseF(b), out, mean, rstd, N, C);
  }
}

void Gpt::EnqueueForward(bool with_grad) {
  Activations& a = *act_;
  const int B = cur_b_, T = cur_t_, N = B * T, C = config_.n_embd;
  const int V = config_.vocab_size;
  ops_.UploadAsync(a.inputs.data(), a.staging.data(), a.inputs_bytes);
  ops_.EmbeddingForward(a.tokens, BaseF(wte_), BaseF(wpe_), a.encoded, B, T, C);
  const float* residual = a.encoded;
  for (int l = 0; l < config_.n_layer; ++l) {
    ForwardBlock(l, residual);
    residual = a.layers[l].res3;
  }
  Norm(residual, lnf_w_, lnf_b_, a.lnf, a.lnf_mean, a.lnf_rstd);
  // logits = lnf head^T (the head is wte when tied).
  ops_.Matmul(a.lnf, BaseM(head_), a.logits, N, V, C, false, true, 1.0f, 0.0f);
  if (!have_targets_) return;
  if (have_teacher_) {
    ops_.DistillCrossEntropy(a.logits, a.targets, a.teacher_ids, a.teacher_logits, distill_,
                             a.losses, with_grad ? a.dlogits : ops::Ref(), a.dloss, N, V);
  } else {
    ops_.SoftmaxCrossEntropy(a.logits, a.targets, a.losses, with_grad ? a.dlogits : ops::Ref(),
                             a.dloss, N, V);
  }
  ops_.DownloadAsync(a.h_losses, a.losses, static_cast<size_t>(N) * sizeof(float));
}

std::vector<float> Gpt::Logits() const {
  if (!act_) return {};
  const int64_t n = static_cast<int64_t>(cur_b_) * cur_t_ * config_.vocab_size;
  std::vector<float> out(static_cast<size_t>(n));
  if (precision_ == ops::Dtype::kF32) {
    ops_.Download(out.data(), act_->logits.data, out.size() * sizeof(float));
    return out;
  }
  std::vector<ops::Bf16> raw(static_cast<size_t>(n));
  ops_.Download(raw.data(), act_->logits.data, raw.size() * sizeof(ops::Bf16));
  for (int64_t i = 0; i < n; ++i) out[i] = ops::FromBf16(raw[i]);
  return out;
}

void Gpt::Backward(const std::function<void(int64_t from)>& final_from) {
  if (!act_ || !have_targets_) Die("Backward needs a preceding Forward with targets");
  Activations& a = *act_;
  const int B = cur_b_, T = cur_t_, N = B * T, C = config_.n_embd, H = config_.n_head;
  const int V = config_.vocab_size;
  const int64_t NC = static_cast<int64_t>(N) * C;
  const float scale = lora_.Scale();

  // The residual stream's gradient as the matmuls read it (a bf16 copy in bf16).
  auto dres_for_matmul = [&]() -> ops::CRef {
    if (precision_ == ops::Dtype::kF32) return a.dres;
    ops_.Cast(a.dres, a.dres_act, NC);
    return a.dres_act;
  };
  auto linear_back = [&](const Layer::Linear& lin, ops::CRef dout, ops::CRef x, ops::CRef xa,
                         ops::Ref dx) {
    if (lin.lora_a >= 0) {
      ops_.LoraLinearBackward(dout, x, BaseM(lin.w), LoraM(lin.lora_a), LoraM(lin.lora_b), scale,
                              xa, dx, BaseGrad(lin.w), BaseGrad(lin.b), LoraGrad(lin.lora_a),
                              LoraGrad(lin.lora_b), a.dxa, N, lin.in, lin.out, lora_.rank);
    } else {
      ops_.LinearBackward(dout, x, BaseM(lin.w), dx, BaseGrad(lin.w), BaseGrad(lin.b), N, lin.in,
                          lin.out);
    }
  };

  const bool llama = config_.family == ModelFamily::kLlama;
  const int Hkv = config_.kv_heads(), D = config_.head_size();
  const int64_t NI = static_cast<int64_t>(N) * config_.inner();
  // The norm's backward adds into a.dres. It is linear in dout, so a norm feeding several
  // linears (Llama's q, k, v and gate, up) takes one call per linear's dx: the sum of the
  // calls is the backward of the summed gradient, and no elementwise add is needed.
  auto norm_back = [&](ops::CRef dout, const float* x, int w, int b, const float* mean,
                       const float* rstd) {
    if (llama) {
      ops_.RmsNormBackward(dout, x, BaseF(w), rstd, a.dres, BaseGrad(w), N, C);
    } else {
      ops_.LayerNormBackward(dout, x, BaseF(w), mean, rstd, a.dres, BaseGrad(w), BaseGrad(b), N, C);
    }
  };

  // Head (the logits' gradient came with the forward): dlnf = dlogits head; dhead +=
  // dlogits^T lnf (the head is wte when tied).
  ops_.Matmul(a.dlogits, BaseM(head_), a.dln, N, C, V, false, false, 1.0f, 0.0f);
  if (float* dhead = BaseGrad(head_)) {
    ops_.Matmul(a.dlogits, a.lnf, dhead, V, C, N, true, false, 1.0f, 1.0f);
  }
  const float* last = config_.n_layer > 0 ? a.layers.back().res3 : a.encoded;
  ops_.Zero(a.dres, NC * sizeof(float));
  norm_back(a.dln, last, lnf_w_, lnf_b_, a.lnf_mean, a.lnf_rstd);

  // a.dres holds dLoss/d(residual stream) and flows down through both residual adds.
  for (int l = config_.n_layer - 1; l >= 0; --l) {
    const Layer& L = layers_[l];
    Activations::PerLayer& A = a.layers[l];
    const float* input = l == 0 ? a.encoded : a.layers[l - 1].res3;
    // With activation recompute the layers share one set of activations (the residual
    // stream aside), which hold the last layer's after the forward: others run again.
    if (recompute_ && l != config_.n_layer - 1) ForwardBlock(l, input);
    if (llama) {  // MLP branch: down, SwiGLU, then gate and up
      linear_back(L.lin[kDown], dres_for_matmul(), A.fch_gelu, A.xa[kDown], a.dfch);
      ops_.SwigluBackward(a.dfch, A.fch, A.up, a.dgate, a.dup, NI);
      linear_back(L.lin[kGate], a.dgate, A.ln2, A.xa[kGate], a.dln);
      norm_back(a.dln, A.res2, L.ln2_w, L.ln2_b, A.ln2_mean, A.ln2_rstd);
      linear_back(L.lin[kUp], a.dup, A.ln2, A.xa[kUp], a.dln);
      norm_back(a.dln, A.res2, L.ln2_w, L.ln2_b, A.ln2_mean, A.ln2_rstd);
    } else {  // MLP branch; the GELU's backward runs in place
      linear_back(L.lin[kMlpProj], dres_for_matmul(), A.fch_gelu, A.xa[kMlpProj], a.dfch);
      ops_.GeluBackward(a.dfch, A.fch, a.dfch, NI);
      linear_back(L.lin[kFc], a.dfch, A.ln2, A.xa[kFc], a.dln);
      norm_back(a.dln, A.res2, L.ln2_w, L.ln2_b, A.ln2_mean, A.ln2_rstd);
    }
    // Attention branch.
    const int proj = llama ? kO : kAttnProj;
    linear_back(L.lin[proj], dres_for_matmul(), A.atty, A.xa[proj], a.datty);
    ops_.AttentionBackward(a.datty, A.qkv, A.atty, A.lse, a.dqkv, a.att_scratch, B, T, C, H);
    if (llama) {
      ops_.RopeGqaBackward(a.dqkv, rope_.as<float>(), a.dq, a.dk, a.dv, B, T, H, Hkv, D);
      const std::pair<int, ops::Ref> branches[] = {{kQ, a.dq}, {kK, a.dk}, {kV, a.dv}};
      for (const auto& [target, dout] : branches) {
        linear_back(L.lin[target], dout, A.ln1, A.xa[target], a.dln);
        norm_back(a.dln, input, L.ln1_w, L.ln1_b, A.ln1_mean, A.ln1_rstd);
      }
    } else {
      linear_back(L.lin[kCAttn], a.dqkv, A.ln1, A.xa[kCAttn], a.dln);
      norm_back(a.dln, input, L.ln1_w, L.ln1_b, A.ln1_mean, A.ln1_rstd);
    }
    if (final_from && l > 0) final_from(block_grad_start_[l]);
  }
  if (mode_ == TrainMode::kFull) {
    ops_.EmbeddingBackward(a.dres, a.order, a.starts, BaseGrad(wte_), BaseGrad(wpe_), B, T, C, V);
  }
  if (final_from) final_from(0);
}

}  // namespace isthmus::model
