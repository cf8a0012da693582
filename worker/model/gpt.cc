// GPT-2 forward and backward over ops::Ops, parameter layout, initialisation and
// loading. The layer loop mirrors llm.c's train_gpt2.c, with LoRA on the four linears; all
// tensors live in the backend's memory, in flat buffers (parameters) and one arena
// (activations).
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

enum Target { kCAttn = 0, kAttnProj = 1, kFc = 2, kMlpProj = 3, kNumTargets = 4 };

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

std::string LayerName(int layer, const char* suffix) {
  return "h." + std::to_string(layer) + "." + suffix;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? "," : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

struct Gpt::Layer {
  int ln1_w, ln1_b, ln2_w, ln2_b;
  struct Linear {
    int w = -1, b = -1;            // base slot indices
    int lora_a = -1, lora_b = -1;  // LoRA slot indices, -1 when not adapted
    int in = 0, out = 0;
  } lin[kNumTargets];
};

struct Gpt::Group {
  std::vector<TensorSlot> slots;
  int64_t elements = 0;  // the flat length, gaps included
  ops::Buffer data;      // fp32 masters
  ops::Buffer copy;      // bf16 copies for the matmuls (bf16 precision only)

  float* F(int i) const { return data.as<float>() + slots[i].offset; }
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

Status GptConfig::Validate() const {
  if (n_layer <= 0 || n_embd <= 0 || n_head <= 0 || n_ctx <= 0 || vocab_size <= 0) {
    return Status::InvalidArgument("GptConfig fields must be positive");
  }
  if (n_embd % n_head != 0) {
    return Status::InvalidArgument("n_head " + std::to_string(n_head) + " does not divide n_embd " +
                                   std::to_string(n_embd));
  }
  return Status::Ok();
}

Status LoraConfig::Validate() const {
  if (rank <= 0) return Status::InvalidArgument("LoRA rank must be positive");
  if (!std::isfinite(alpha)) return Status::InvalidArgument("LoRA alpha must be finite");
  if (targets.empty()) return Status::InvalidArgument("LoRA needs at least one target");
  std::set<std::string> seen;
  for (const std::string& t : targets) {
    if (std::find(std::begin(kLoraTargetNames), std::end(kLoraTargetNames), t) ==
        std::end(kLoraTargetNames)) {
      return Status::InvalidArgument(
          "unknown LoRA target \"" + t +
          "\" (allowed: attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj)");
    }
    if (!seen.insert(t).second) return Status::InvalidArgument("duplicate LoRA target " + t);
  }
  return Status::Ok();
}

std::string LoraAName(int layer, const std::string& target) {
  return "h." + std::to_string(layer) + "." + target + ".lora_A.weight";
}
std::string LoraBName(int layer, const std::string& target) {
  return "h." + std::to_string(layer) + "." + target + ".lora_B.weight";
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
      base_(std::make_unique<Group>()),
      lora_tensors_(std::make_unique<Group>()) {}

Gpt::~Gpt() = default;

// Lays out the base slots in GPT-2 order, the layer indices and the LoRA slots.
Status Gpt::BuildIndex() {
  const int64_t C = config_.n_embd;
  Group& g = *base_;
  layers_.assign(config_.n_layer, Layer{});
  wte_ = g.Add("wte.weight", {config_.vocab_size, C});
  wpe_ = g.Add("wpe.weight", {config_.n_ctx, C});
  for (int l = 0; l < config_.n_layer; ++l) {
    Layer& L = layers_[l];
    auto add = [&](const char* suffix, std::vector<int64_t> shape) {
      return g.Add(LayerName(l, suffix), std::move(shape));
    };
    auto linear = [&](const char* name, int64_t in, int64_t out) {
      Layer::Linear lin;
      lin.w = add((std::string(name) + ".weight").c_str(), {in, out});
      lin.b = add((std::string(name) + ".bias").c_str(), {out});
      lin.in = static_cast<int>(in);
      lin.out = static_cast<int>(out);
      return lin;
    };
    L.ln1_w = add("ln_1.weight", {C});
    L.ln1_b = add("ln_1.bias", {C});
    L.lin[kCAttn] = linear("attn.c_attn", C, 3 * C);
    L.lin[kAttnProj] = linear("attn.c_proj", C, C);
    L.ln2_w = add("ln_2.weight", {C});
    L.ln2_b = add("ln_2.bias", {C});
    L.lin[kFc] = linear("mlp.c_fc", C, 4 * C);
    L.lin[kMlpProj] = linear("mlp.c_proj", 4 * C, C);
  }
  lnf_w_ = g.Add("ln_f.weight", {C});
  lnf_b_ = g.Add("ln_f.bias", {C});
  if (mode_ == TrainMode::kFull) return Status::Ok();
  const int r = lora_.rank;
  for (int l = 0; l < config_.n_layer; ++l) {
    for (int k = 0; k < kNumTargets; ++k) {
      const std::string target = kLoraTargetNames[k];
      if (std::find(lora_.targets.begin(), lora_.targets.end(), target) == lora_.targets.end()) {
        continue;
      }
      Layer::Linear& lin = layers_[l].lin[k];
      lin.lora_a = lora_tensors_->Add(LoraAName(l, target), {r, lin.in});
      lin.lora_b = lora_tensors_->Add(LoraBName(l, target), {lin.out, r});
    }
  }
  return Status::Ok();
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
  for (Group* g : {base_.get(), lora_tensors_.get()}) {
    auto data = ops::Buffer::Allocate(ops_, g->elements * sizeof(float));
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
    } else if (n.find("ln_") != std::string::npos) {
      std::fill(t.data.begin(), t.data.end(), 1.0f);
    } else {
      const double stdev =
          (n.ends_with("attn.c_proj.weight") || n.ends_with("mlp.c_proj.weight")) ? proj_std : 0.02;
      Rng rng(StreamSeed(seed, n));
      for (float& x : t.data) x = static_cast<float>(stdev * rng.Normal());
    }
    out.push_back(std::move(t));
  }
  return out;
}

// `tensors` are the group's tensors in slot order. One copy to the backend.
Status Gpt::UploadGroup(Group& group, const std::vector<Tensor>& tensors) {
  std::vector<float> flat(static_cast<size_t>(group.elements), 0.0f);
  for (size_t i = 0; i < tensors.size(); ++i) {
    std::copy(tensors[i].data.begin(), tensors[i].data.end(), flat.begin() + group.slots[i].offset);
  }
  ops_.Upload(group.data.data(), flat.data(), flat.size() * sizeof(float));
  RefreshCopies(group);
  return ops_.status();
}

std::vector<Tensor> Gpt::DownloadGroup(const Group& group) const {
  std::vector<float> flat(static_cast<size_t>(group.elements));
  ops_.Download(flat.data(), group.data.data(), flat.size() * sizeof(float));
  std::vector<Tensor> out;
  out.reserve(group.slots.size());
  for (const TensorSlot& s : group.slots) {
    out.push_back({s.name, s.shape,
                   std::vector<float>(flat.begin() + s.offset, flat.begin() + s.offset + s.numel)});
  }
  return out;
}

void Gpt::RefreshCopies(Group& group) {
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
  if (mode == TrainMode::kLora) ISTHMUS_RETURN_IF_ERROR(lora.Validate());
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
  while (find(LayerName(config.n_layer, "ln_1.weight")) != nullptr) ++config.n_layer;
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

Result<std::unique_ptr<Gpt>> Gpt::LoadBase(const std::string& path, int n_head, TrainMode mode,
                                           const LoraConfig& lora, uint64_t seed,
                                           const GptConfig* expected, const Compute& compute) {
  ISTHMUS_ASSIGN_OR_RETURN(SafetensorsFile file, ReadHfCheckpoint(path));
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
  return {{"format", "pt"},
          {"isthmus", "gpt2"},
          {"n_layer", std::to_string(config_.n_layer)},
          {"n_embd", std::to_string(config_.n_embd)},
          {"n_head", std::to_string(config_.n_head)},
          {"n_ctx", std::to_string(config_.n_ctx)},
          {"vocab_size", std::to_string(config_.vocab_size)}};
}

Status Gpt::SaveBase(const std::string& path) const {
  std::vector<Tensor> base = ExportBase();
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
  for (Tensor& t : named) t.name = "base_model.model.transformer." + t.name;
  ISTHMUS_RETURN_IF_ERROR(WriteSafetensors(dir + "/adapter_model.safetensors", named));

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
      {"fan_in_fan_out", true},
      {"inference_mode", true},
      {"target_modules", lora_.targets}};
  return WriteJsonFile(dir + "/adapter_config.json", config);
}

Status Gpt::SaveHuggingFace(const std::string& dir, uint64_t max_shard_bytes,
                            FileDtype dtype) const {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::IoError("cannot create " + dir + ": " + ec.message());
  std::vector<Tensor> base = ExportBase();
  ISTHMUS_RETURN_IF_ERROR(ops_.status());
  ISTHMUS_RETURN_IF_ERROR(WriteHfCheckpoint(dir, base, {{"format", "pt"}}, max_shard_bytes, dtype));
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
                           {"torch_dtype", dtype == FileDtype::kBF16  ? "bfloat16"
                                           : dtype == FileDtype::kF16 ? "float16"
                                                                      : "float32"}};
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
  Tensor t{s.name, s.shape, std::vector<float>(static_cast<size_t>(s.numel))};
  ops_.Download(t.data.data(), base_->F(i), t.data.size() * sizeof(float));
  return t;
}

int64_t Gpt::BaseElements() const {
  int64_t n = 0;
  for (const TensorSlot& s : base_->slots) n += s.numel;
  return n;
}

std::string Gpt::BaseHash() const { return TensorsContentHash(ExportBase()); }

ops::CRef Gpt::BaseM(int index) const {
  if (precision_ == ops::Dtype::kBF16) return base_->C(index);
  return base_->F(index);
}
const float* Gpt::BaseF(int index) const { return base_->F(index); }
ops::CRef Gpt::LoraM(int index) const {
  if (precision_ == ops::Dtype::kBF16) return lora_tensors_->C(index);
  return lora_tensors_->F(index);
}
float* Gpt::BaseGrad(int index) const {
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
  const ops::Dtype d = precision_;
  auto carve = [&](Carver& k) {
    a.layers.assign(config_.n_layer, {});
    for (int l = 0; l < config_.n_layer; ++l) {
      Activations::PerLayer& L = a.layers[l];
      L.ln1 = k.Take(N * C, d);
      L.ln1_mean = k.Take<float>(N);
      L.ln1_rstd = k.Take<float>(N);
      L.qkv = k.Take(N * 3 * C, d);
      L.atty = k.Take(N * C, d);
      L.lse = k.Take<float>(N * H);
      L.res2 = k.Take<float>(N * C);
      L.ln2 = k.Take(N * C, d);
      L.ln2_mean = k.Take<float>(N);
      L.ln2_rstd = k.Take<float>(N);
      L.fch = k.Take(N * 4 * C, d);
      L.fch_gelu = k.Take(N * 4 * C, d);
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
    a.dfch = k.Take(N * 4 * C, d);
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
                                   int distill_k) {
  ISTHMUS_RETURN_IF_ERROR(config.Validate());
  if (mode == TrainMode::kLora) ISTHMUS_RETURN_IF_ERROR(lora.Validate());
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
  for (const Group* g : {gpt.base_.get(), gpt.lora_tensors_.get()}) {
    p.parameters += rounded(g->elements * static_cast<int64_t>(sizeof(float)));
    if (compute.precision == ops::Dtype::kBF16) {
      p.weight_copies += rounded(g->elements * static_cast<int64_t>(sizeof(ops::Bf16)));
    }
  }
  p.gradients = rounded(gpt.GradElements() * static_cast<int64_t>(sizeof(float)));
  const int64_t moments = rounded(gpt.TrainableElements() * static_cast<int64_t>(sizeof(float)));
  if (synced_rounds) p.round_buffers = 2 * moments;  // ModelLiveParams: base and staging
  const size_t chunks = ops::MakeAdamWChunks(gpt.AdamWSegments()).size();
  p.optimizer = 2 * moments + rounded(static_cast<int64_t>(chunks * sizeof(ops::AdamWChunk))) +
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

void Gpt::EnqueueForward(bool with_grad) {
  Activations& a = *act_;
  const int B = cur_b_, T = cur_t_, N = B * T, C = config_.n_embd, H = config_.n_head;
  const int V = config_.vocab_size;
  const float scale = lora_.Scale();
  ops_.UploadAsync(a.inputs.data(), a.staging.data(), a.inputs_bytes);

  auto linear = [&](const Layer::Linear& lin, ops::CRef x, const float* residual, ops::Ref out,
                    ops::Ref xa) {
    if (lin.lora_a >= 0) {
      ops_.LoraLinearForward(x, BaseM(lin.w), BaseF(lin.b), LoraM(lin.lora_a), LoraM(lin.lora_b),
                             scale, residual, out, xa, N, lin.in, lin.out, lora_.rank);
    } else {
      ops_.LinearForward(x, BaseM(lin.w), BaseF(lin.b), residual, out, N, lin.in, lin.out);
    }
  };

  ops_.EmbeddingForward(a.tokens, BaseF(wte_), BaseF(wpe_), a.encoded, B, T, C);
  const float* residual = a.encoded;
  for (int l = 0; l < config_.n_layer; ++l) {
    const Layer& L = layers_[l];
    Activations::PerLayer& A = a.layers[l];
    ops_.LayerNormForward(residual, BaseF(L.ln1_w), BaseF(L.ln1_b), A.ln1, A.ln1_mean, A.ln1_rstd,
                          N, C);
    linear(L.lin[kCAttn], A.ln1, nullptr, A.qkv, A.xa[kCAttn]);
    ops_.AttentionForward(A.qkv, A.atty, A.lse, B, T, C, H);
    // The residual add is fused into the projection: res2 = residual + atty W + b.
    linear(L.lin[kAttnProj], A.atty, residual, A.res2, A.xa[kAttnProj]);
    ops_.LayerNormForward(A.res2, BaseF(L.ln2_w), BaseF(L.ln2_b), A.ln2, A.ln2_mean, A.ln2_rstd, N,
                          C);
    linear(L.lin[kFc], A.ln2, nullptr, A.fch, A.xa[kFc]);
    ops_.GeluForward(A.fch, A.fch_gelu, static_cast<int64_t>(N) * 4 * C);
    linear(L.lin[kMlpProj], A.fch_gelu, A.res2, A.res3, A.xa[kMlpProj]);
    residual = A.res3;
  }
  ops_.LayerNormForward(residual, BaseF(lnf_w_), BaseF(lnf_b_), a.lnf, a.lnf_mean, a.lnf_rstd, N,
                        C);
  // Tied head: logits = lnf wte^T.
  ops_.Matmul(a.lnf, BaseM(wte_), a.logits, N, V, C, false, true, 1.0f, 0.0f);
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

void Gpt::Backward() {
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

  // Head (the logits' gradient came with the forward): dlnf = dlogits wte; dwte +=
  // dlogits^T lnf.
  ops_.Matmul(a.dlogits, BaseM(wte_), a.dln, N, C, V, false, false, 1.0f, 0.0f);
  if (float* dwte = BaseGrad(wte_)) {
    ops_.Matmul(a.dlogits, a.lnf, dwte, V, C, N, true, false, 1.0f, 1.0f);
  }
  const float* last = config_.n_layer > 0 ? a.layers.back().res3 : a.encoded;
  ops_.Zero(a.dres, NC * sizeof(float));
  ops_.LayerNormBackward(a.dln, last, BaseF(lnf_w_), a.lnf_mean, a.lnf_rstd, a.dres,
                         BaseGrad(lnf_w_), BaseGrad(lnf_b_), N, C);

  // a.dres holds dLoss/d(residual stream) and flows down through both residual adds.
  for (int l = config_.n_layer - 1; l >= 0; --l) {
    const Layer& L = layers_[l];
    Activations::PerLayer& A = a.layers[l];
    const float* input = l == 0 ? a.encoded : a.layers[l - 1].res3;
    // MLP branch; the GELU's backward runs in place.
    linear_back(L.lin[kMlpProj], dres_for_matmul(), A.fch_gelu, A.xa[kMlpProj], a.dfch);
    ops_.GeluBackward(a.dfch, A.fch, a.dfch, 4 * NC);
    linear_back(L.lin[kFc], a.dfch, A.ln2, A.xa[kFc], a.dln);
    ops_.LayerNormBackward(a.dln, A.res2, BaseF(L.ln2_w), A.ln2_mean, A.ln2_rstd, a.dres,
                           BaseGrad(L.ln2_w), BaseGrad(L.ln2_b), N, C);
    // Attention branch.
    linear_back(L.lin[kAttnProj], dres_for_matmul(), A.atty, A.xa[kAttnProj], a.datty);
    ops_.AttentionBackward(a.datty, A.qkv, A.atty, A.lse, a.dqkv, a.att_scratch, B, T, C, H);
    linear_back(L.lin[kCAttn], a.dqkv, A.ln1, A.xa[kCAttn], a.dln);
    ops_.LayerNormBackward(a.dln, input, BaseF(L.ln1_w), A.ln1_mean, A.ln1_rstd, a.dres,
                           BaseGrad(L.ln1_w), BaseGrad(L.ln1_b), N, C);
  }
  if (mode_ == TrainMode::kFull) {
    ops_.EmbeddingBackward(a.dres, a.order, a.starts, BaseGrad(wte_), BaseGrad(wpe_), B, T, C, V);
  }
}

}  // namespace isthmus::model
