// GPT-2 forward and backward over ops::Ops, parameter layout, initialisation and
// loading. The layer loop mirrors llm.c's train_gpt2.c, with LoRA on the four linears.
#include "worker/model/gpt.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numbers>
#include <set>

#include <nlohmann/json.hpp>

#include "common/safetensors.h"

namespace isthmus::model {
namespace {

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
    int w = -1, b = -1;            // base_ indices
    int lora_a = -1, lora_b = -1;  // lora_tensors_ indices, -1 when not adapted
    int in = 0, out = 0;
  } lin[kNumTargets];
};

struct Gpt::Activations {
  struct PerLayer {
    std::vector<float> ln1, ln1_mean, ln1_rstd, qkv, atty, att, res2, ln2, ln2_mean, ln2_rstd, fch,
        fch_gelu, res3;
    std::vector<float> xa[kNumTargets];
  };
  int64_t cap_n = 0, cap_att = 0;  // rows B*T and B*T*T the buffers hold
  std::vector<PerLayer> layers;
  std::vector<float> encoded, lnf, lnf_mean, lnf_rstd, logits, probs, losses;
  std::vector<int32_t> tokens, targets;
  // Backward scratch.
  std::vector<float> dres, dln, dqkv, datty, dfch, dfch_gelu, datt, dxa, dlogits;
};

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

Gpt::Gpt(const GptConfig& config, TrainMode mode, const LoraConfig& lora)
    : config_(config), mode_(mode), lora_(lora), ops_(ops::CpuOps()) {}

Gpt::~Gpt() = default;

void Gpt::AddBase(const std::string& name, std::vector<int64_t> shape) {
  Tensor t;
  t.name = name;
  t.shape = std::move(shape);
  t.data.assign(static_cast<size_t>(NumElements(t.shape)), 0.0f);
  base_.push_back(std::move(t));
}

// Lays out base_ in GPT-2 order with zeros, sets the indices, and creates LoRA tensors.
Status Gpt::BuildIndex() {
  const int64_t C = config_.n_embd;
  base_.clear();
  layers_.assign(config_.n_layer, Layer{});
  AddBase("wte.weight", {config_.vocab_size, C});
  wte_ = 0;
  AddBase("wpe.weight", {config_.n_ctx, C});
  wpe_ = 1;
  for (int l = 0; l < config_.n_layer; ++l) {
    Layer& L = layers_[l];
    auto add = [&](const char* suffix, std::vector<int64_t> shape) {
      AddBase(LayerName(l, suffix), std::move(shape));
      return static_cast<int>(base_.size()) - 1;
    };
    L.ln1_w = add("ln_1.weight", {C});
    L.ln1_b = add("ln_1.bias", {C});
    L.lin[kCAttn] = {add("attn.c_attn.weight", {C, 3 * C}),
                     add("attn.c_attn.bias", {3 * C}),
                     -1,
                     -1,
                     static_cast<int>(C),
                     static_cast<int>(3 * C)};
    L.lin[kAttnProj] = {add("attn.c_proj.weight", {C, C}),
                        add("attn.c_proj.bias", {C}),
                        -1,
                        -1,
                        static_cast<int>(C),
                        static_cast<int>(C)};
    L.ln2_w = add("ln_2.weight", {C});
    L.ln2_b = add("ln_2.bias", {C});
    L.lin[kFc] = {add("mlp.c_fc.weight", {C, 4 * C}),
                  add("mlp.c_fc.bias", {4 * C}),
                  -1,
                  -1,
                  static_cast<int>(C),
                  static_cast<int>(4 * C)};
    L.lin[kMlpProj] = {add("mlp.c_proj.weight", {4 * C, C}),
                       add("mlp.c_proj.bias", {C}),
                       -1,
                       -1,
                       static_cast<int>(4 * C),
                       static_cast<int>(C)};
  }
  AddBase("ln_f.weight", {C});
  lnf_w_ = static_cast<int>(base_.size()) - 1;
  AddBase("ln_f.bias", {C});
  lnf_b_ = static_cast<int>(base_.size()) - 1;

  lora_tensors_.clear();
  lora_grad_.clear();
  base_grad_.clear();
  if (mode_ == TrainMode::kFull) {
    for (const Tensor& t : base_) base_grad_.emplace_back(t.data.size(), 0.0f);
    return Status::Ok();
  }
  const int r = lora_.rank;
  for (int l = 0; l < config_.n_layer; ++l) {
    for (int k = 0; k < kNumTargets; ++k) {
      const std::string target = kLoraTargetNames[k];
      if (std::find(lora_.targets.begin(), lora_.targets.end(), target) == lora_.targets.end()) {
        continue;
      }
      Layer::Linear& lin = layers_[l].lin[k];
      Tensor a{LoraAName(l, target), {r, lin.in}, {}};
      a.data.assign(static_cast<size_t>(r) * lin.in, 0.0f);
      Tensor b{LoraBName(l, target), {lin.out, r}, {}};
      b.data.assign(static_cast<size_t>(r) * lin.out, 0.0f);
      lin.lora_a = static_cast<int>(lora_tensors_.size());
      lora_tensors_.push_back(std::move(a));
      lin.lora_b = static_cast<int>(lora_tensors_.size());
      lora_tensors_.push_back(std::move(b));
    }
  }
  for (const Tensor& t : lora_tensors_) lora_grad_.emplace_back(t.data.size(), 0.0f);
  return Status::Ok();
}

void Gpt::InitLora(uint64_t seed) {
  for (Tensor& t : lora_tensors_) {
    if (t.name.find(".lora_A.") == std::string::npos) continue;  // B stays 0
    Rng rng(StreamSeed(seed, t.name));
    const double bound = 1.0 / std::sqrt(static_cast<double>(t.shape[1]));
    for (float& x : t.data) x = static_cast<float>((2.0 * rng.Uniform() - 1.0) * bound);
  }
}

void Gpt::InitRandomBase(uint64_t seed) {
  const double proj_std = 0.02 / std::sqrt(2.0 * config_.n_layer);
  for (Tensor& t : base_) {
    const std::string& n = t.name;
    auto ends_with = [&](const char* s) {
      const size_t len = std::strlen(s);
      return n.size() >= len && n.compare(n.size() - len, len, s) == 0;
    };
    if (ends_with(".bias")) continue;  // zeros
    if (n.find("ln_") != std::string::npos) {
      std::fill(t.data.begin(), t.data.end(), 1.0f);
      continue;
    }
    const double stdev =
        (ends_with("attn.c_proj.weight") || ends_with("mlp.c_proj.weight")) ? proj_std : 0.02;
    Rng rng(StreamSeed(seed, n));
    for (float& x : t.data) x = static_cast<float>(stdev * rng.Normal());
  }
}

Result<std::unique_ptr<Gpt>> Gpt::CreateRandom(const GptConfig& config, TrainMode mode,
                                               const LoraConfig& lora, uint64_t seed) {
  ISTHMUS_RETURN_IF_ERROR(config.Validate());
  if (mode == TrainMode::kLora) ISTHMUS_RETURN_IF_ERROR(lora.Validate());
  std::unique_ptr<Gpt> gpt(new Gpt(config, mode, lora));
  ISTHMUS_RETURN_IF_ERROR(gpt->BuildIndex());
  gpt->InitRandomBase(seed);
  gpt->InitLora(seed);
  return gpt;
}

Result<std::unique_ptr<Gpt>> Gpt::FromBaseTensors(std::vector<Tensor> tensors, int n_head,
                                                  TrainMode mode, const LoraConfig& lora,
                                                  uint64_t seed) {
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

  std::unique_ptr<Gpt> gpt(new Gpt(config, mode, lora));
  ISTHMUS_RETURN_IF_ERROR(gpt->BuildIndex());
  std::set<std::string> used;
  for (Tensor& dst : gpt->base_) {
    Tensor* src = find(dst.name);
    if (src == nullptr) return Status::InvalidArgument("base lacks tensor \"" + dst.name + "\"");
    if (src->shape != dst.shape) {
      return Status::InvalidArgument("base tensor \"" + dst.name + "\" has shape " +
                                     ShapeString(src->shape) + ", expected " +
                                     ShapeString(dst.shape));
    }
    if (static_cast<int64_t>(src->data.size()) != NumElements(src->shape)) {
      return Status::InvalidArgument("base tensor \"" + dst.name + "\" data size mismatch");
    }
    dst.data = std::move(src->data);
    used.insert(dst.name);
  }
  for (const auto& [name, t] : by_name) {
    if (used.count(name)) continue;
    const bool mask_buffer = name.starts_with("h.") &&
                             (name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias"));
    const bool tied_head = name == "lm_head.weight" && t->shape == gpt->base_[gpt->wte_].shape;
    if (mask_buffer || tied_head) continue;
    return Status::InvalidArgument("unknown base tensor \"" + name + "\" " + ShapeString(t->shape));
  }
  gpt->InitLora(seed);
  return gpt;
}

Result<std::unique_ptr<Gpt>> Gpt::LoadBase(const std::string& path, int n_head, TrainMode mode,
                                           const LoraConfig& lora, uint64_t seed,
                                           const GptConfig* expected) {
  ISTHMUS_ASSIGN_OR_RETURN(SafetensorsFile file, ReadSafetensors(path));
  auto it = file.metadata.find("n_head");
  if (it != file.metadata.end()) {
    int from_file = 0;
    try {
      from_file = std::stoi(it->second);
    } catch (...) {
      return Status::InvalidArgument(path + ": metadata n_head \"" + it->second +
                                     "\" is not a number");
    }
    if (n_head != 0 && n_head != from_file) {
      return Status::InvalidArgument(path + ": n_head " + std::to_string(n_head) +
                                     " requested but the file says " + it->second);
    }
    n_head = from_file;
  }
  if (n_head <= 0) {
    return Status::InvalidArgument(path + ": n_head not in the file's metadata; pass it");
  }
  ISTHMUS_ASSIGN_OR_RETURN(std::unique_ptr<Gpt> gpt,
                           FromBaseTensors(std::move(file.tensors), n_head, mode, lora, seed));
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
  return {{"format", "isthmus-gpt2"},
          {"n_layer", std::to_string(config_.n_layer)},
          {"n_embd", std::to_string(config_.n_embd)},
          {"n_head", std::to_string(config_.n_head)},
          {"n_ctx", std::to_string(config_.n_ctx)},
          {"vocab_size", std::to_string(config_.vocab_size)}};
}

Status Gpt::SaveBase(const std::string& path) const {
  return WriteSafetensors(path, base_, ConfigMetadata());
}

Status Gpt::SavePeftAdapter(const std::string& dir) const {
  if (mode_ != TrainMode::kLora) {
    return Status::FailedPrecondition("full-mode model has no LoRA adapters to export");
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::IoError("cannot create " + dir + ": " + ec.message());
  std::vector<Tensor> named = lora_tensors_;
  for (Tensor& t : named) t.name = "base_model.model.transformer." + t.name;
  ISTHMUS_RETURN_IF_ERROR(WriteSafetensors(dir + "/adapter_model.safetensors", named));

  nlohmann::json config = {{"peft_type", "LORA"},
                           {"task_type", "CAUSAL_LM"},
                           {"base_model_name_or_path", nullptr},
                           {"r", lora_.rank},
                           {"lora_alpha", lora_.alpha},
                           {"lora_dropout", 0.0},
                           {"bias", "none"},
                           {"fan_in_fan_out", true},
                           {"inference_mode", true},
                           {"target_modules", lora_.targets}};
  const std::string path = dir + "/adapter_config.json";
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << config.dump(2) << "\n";
    out.close();
    if (!out) return Status::IoError("cannot write " + tmp);
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) return Status::IoError("cannot rename " + tmp + ": " + ec.message());
  return Status::Ok();
}

const Tensor* Gpt::FindBase(const std::string& name) const {
  for (const Tensor& t : base_) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

std::string Gpt::BaseHash() const { return TensorsContentHash(base_); }

float* Gpt::BaseGrad(int index) {
  return mode_ == TrainMode::kFull ? base_grad_[index].data() : nullptr;
}

std::vector<ParamView> Gpt::Trainable() {
  std::vector<ParamView> views;
  std::vector<Tensor>& ts = mode_ == TrainMode::kFull ? base_ : lora_tensors_;
  std::vector<std::vector<float>>& gs = mode_ == TrainMode::kFull ? base_grad_ : lora_grad_;
  views.reserve(ts.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    views.push_back({ts[i].name, ts[i].shape, ts[i].data.data(), gs[i].data(), ts[i].numel()});
  }
  return views;
}

void Gpt::ZeroGrad() {
  for (auto& g : mode_ == TrainMode::kFull ? base_grad_ : lora_grad_) {
    std::fill(g.begin(), g.end(), 0.0f);
  }
}

std::vector<Tensor> Gpt::ExportTrainable() const {
  return mode_ == TrainMode::kFull ? base_ : lora_tensors_;
}

Status Gpt::LoadTrainable(const std::vector<Tensor>& tensors, bool require_all) {
  std::vector<Tensor>& ts = mode_ == TrainMode::kFull ? base_ : lora_tensors_;
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < ts.size(); ++i) index[ts[i].name] = i;
  std::vector<size_t> dst(tensors.size());
  std::set<size_t> seen;
  for (size_t i = 0; i < tensors.size(); ++i) {
    auto it = index.find(tensors[i].name);
    if (it == index.end()) {
      return Status::InvalidArgument("\"" + tensors[i].name + "\" is not a trainable tensor (" +
                                     TrainModeName(mode_) + " mode)");
    }
    const Tensor& want = ts[it->second];
    if (tensors[i].shape != want.shape || tensors[i].data.size() != want.data.size()) {
      return Status::InvalidArgument("\"" + tensors[i].name + "\" has shape " +
                                     ShapeString(tensors[i].shape) + ", expected " +
                                     ShapeString(want.shape));
    }
    if (!seen.insert(it->second).second) {
      return Status::InvalidArgument("\"" + tensors[i].name + "\" given twice");
    }
    dst[i] = it->second;
  }
  if (require_all && seen.size() != ts.size()) {
    for (size_t i = 0; i < ts.size(); ++i) {
      if (!seen.count(i))
        return Status::InvalidArgument("missing trainable \"" + ts[i].name + "\"");
    }
  }
  // std::copy keeps the buffers (and so every ParamView pointer) in place.
  for (size_t i = 0; i < tensors.size(); ++i) {
    std::copy(tensors[i].data.begin(), tensors[i].data.end(), ts[dst[i]].data.begin());
  }
  return Status::Ok();
}

void Gpt::EnsureActivations(int B, int T) {
  if (!act_) act_ = std::make_unique<Activations>();
  Activations& a = *act_;
  const int64_t n = static_cast<int64_t>(B) * T;
  const int64_t att = n * T;
  if (n <= a.cap_n && att <= a.cap_att) return;
  a.cap_n = std::max(a.cap_n, n);
  a.cap_att = std::max(a.cap_att, att);
  const size_t N = a.cap_n, C = config_.n_embd, V = config_.vocab_size;
  const size_t ATT = a.cap_att * config_.n_head;
  const size_t R = mode_ == TrainMode::kLora ? lora_.rank : 0;
  // resize() to a larger size; shrink_to_fit is never called, so buffers only grow.
  a.layers.resize(config_.n_layer);
  for (auto& L : a.layers) {
    L.ln1.resize(N * C), L.ln1_mean.resize(N), L.ln1_rstd.resize(N), L.qkv.resize(N * 3 * C);
    L.atty.resize(N * C), L.att.resize(ATT), L.res2.resize(N * C), L.ln2.resize(N * C);
    L.ln2_mean.resize(N), L.ln2_rstd.resize(N), L.fch.resize(N * 4 * C);
    L.fch_gelu.resize(N * 4 * C), L.res3.resize(N * C);
    for (auto& xa : L.xa) xa.resize(N * R);
  }
  a.encoded.resize(N * C), a.lnf.resize(N * C), a.lnf_mean.resize(N), a.lnf_rstd.resize(N);
  a.logits.resize(N * V), a.probs.resize(N * V), a.losses.resize(N);
  a.tokens.resize(N), a.targets.resize(N);
  a.dres.resize(N * C), a.dln.resize(N * C), a.dqkv.resize(N * 3 * C), a.datty.resize(N * C);
  a.dfch.resize(N * 4 * C), a.dfch_gelu.resize(N * 4 * C), a.datt.resize(ATT);
  a.dxa.resize(N * R), a.dlogits.resize(N * V);
}

float Gpt::Forward(const int32_t* tokens, const int32_t* targets, int B, int T) {
  // Programming errors, not input errors: callers size batches and tokenize from the config.
  auto die = [](const char* what) {
    std::fprintf(stderr, "Gpt::Forward: %s\n", what);
    std::abort();
  };
  if (B <= 0 || T <= 0 || T > config_.n_ctx) die("B, T out of range");
  const int64_t n = static_cast<int64_t>(B) * T;
  for (int64_t i = 0; i < n; ++i) {
    if (tokens[i] < 0 || tokens[i] >= config_.vocab_size) die("token out of range");
    if (targets != nullptr && (targets[i] < -1 || targets[i] >= config_.vocab_size)) {
      die("target out of range");
    }
  }
  EnsureActivations(B, T);
  Activations& a = *act_;
  const int N = B * T, C = config_.n_embd, H = config_.n_head, V = config_.vocab_size;
  const float scale = lora_.Scale();
  cur_b_ = B;
  cur_t_ = T;
  have_targets_ = targets != nullptr;
  std::copy(tokens, tokens + N, a.tokens.begin());
  if (targets != nullptr) std::copy(targets, targets + N, a.targets.begin());

  auto linear = [&](const Layer::Linear& lin, const float* x, float* out, float* xa) {
    if (lin.lora_a >= 0) {
      ops_.LoraLinearForward(x, W(lin.w), W(lin.b), lora_tensors_[lin.lora_a].data.data(),
                             lora_tensors_[lin.lora_b].data.data(), scale, out, xa, N, lin.in,
                             lin.out, lora_.rank);
    } else {
      ops_.LinearForward(x, W(lin.w), W(lin.b), out, N, lin.in, lin.out);
    }
  };

  ops_.EmbeddingForward(a.tokens.data(), W(wte_), W(wpe_), a.encoded.data(), B, T, C);
  const float* residual = a.encoded.data();
  for (int l = 0; l < config_.n_layer; ++l) {
    const Layer& L = layers_[l];
    Activations::PerLayer& A = a.layers[l];
    ops_.LayerNormForward(residual, W(L.ln1_w), W(L.ln1_b), A.ln1.data(), A.ln1_mean.data(),
                          A.ln1_rstd.data(), N, C);
    linear(L.lin[kCAttn], A.ln1.data(), A.qkv.data(), A.xa[kCAttn].data());
    ops_.AttentionForward(A.qkv.data(), A.atty.data(), A.att.data(), B, T, C, H);
    linear(L.lin[kAttnProj], A.atty.data(), A.res2.data(), A.xa[kAttnProj].data());
    ops_.Add(residual, A.res2.data(), A.res2.data(), static_cast<int64_t>(N) * C);
    ops_.LayerNormForward(A.res2.data(), W(L.ln2_w), W(L.ln2_b), A.ln2.data(), A.ln2_mean.data(),
                          A.ln2_rstd.data(), N, C);
    linear(L.lin[kFc], A.ln2.data(), A.fch.data(), A.xa[kFc].data());
    ops_.GeluForward(A.fch.data(), A.fch_gelu.data(), static_cast<int64_t>(N) * 4 * C);
    linear(L.lin[kMlpProj], A.fch_gelu.data(), A.res3.data(), A.xa[kMlpProj].data());
    ops_.Add(A.res2.data(), A.res3.data(), A.res3.data(), static_cast<int64_t>(N) * C);
    residual = A.res3.data();
  }
  ops_.LayerNormForward(residual, W(lnf_w_), W(lnf_b_), a.lnf.data(), a.lnf_mean.data(),
                        a.lnf_rstd.data(), N, C);
  // Tied head: logits = lnf wte^T.
  ops_.Matmul(a.lnf.data(), W(wte_), a.logits.data(), N, V, C, false, true, 1.0f, 0.0f);
  if (targets == nullptr) return 0.0f;
  return ops_.CrossEntropyForward(a.logits.data(), a.targets.data(), a.probs.data(),
                                  a.losses.data(), N, V);
}

const float* Gpt::Logits() const { return act_ ? act_->logits.data() : nullptr; }

void Gpt::Backward() {
  if (!act_ || !have_targets_) std::abort();  // Backward needs a Forward with targets
  Activations& a = *act_;
  const int B = cur_b_, T = cur_t_, N = B * T, C = config_.n_embd, H = config_.n_head;
  const int V = config_.vocab_size;
  const int64_t NC = static_cast<int64_t>(N) * C;
  const float scale = lora_.Scale();
  auto zero = [](std::vector<float>& v, int64_t n) { std::fill_n(v.begin(), n, 0.0f); };

  // dx must be zeroed by the caller (kernels accumulate); the input x is the layer input.
  auto linear_back = [&](const Layer::Linear& lin, const float* dout, const float* x,
                         const float* xa, float* dx) {
    if (lin.lora_a >= 0) {
      ops_.LoraLinearBackward(dout, x, W(lin.w), lora_tensors_[lin.lora_a].data.data(),
                              lora_tensors_[lin.lora_b].data.data(), scale, xa, dx, BaseGrad(lin.w),
                              BaseGrad(lin.b), lora_grad_[lin.lora_a].data(),
                              lora_grad_[lin.lora_b].data(), a.dxa.data(), N, lin.in, lin.out,
                              lora_.rank);
    } else {
      ops_.LinearBackward(dout, x, W(lin.w), dx, BaseGrad(lin.w), BaseGrad(lin.b), N, lin.in,
                          lin.out);
    }
  };

  zero(a.dlogits, static_cast<int64_t>(N) * V);
  ops_.CrossEntropyBackward(a.probs.data(), a.targets.data(), a.dlogits.data(), N, V);
  // dlnf = dlogits wte; dwte += dlogits^T lnf.
  ops_.Matmul(a.dlogits.data(), W(wte_), a.dln.data(), N, C, V, false, false, 1.0f, 0.0f);
  if (float* dwte = BaseGrad(wte_)) {
    ops_.Matmul(a.dlogits.data(), a.lnf.data(), dwte, V, C, N, true, false, 1.0f, 1.0f);
  }
  const float* last = config_.n_layer > 0 ? a.layers.back().res3.data() : a.encoded.data();
  zero(a.dres, NC);
  ops_.LayerNormBackward(a.dln.data(), last, W(lnf_w_), a.lnf_mean.data(), a.lnf_rstd.data(),
                         a.dres.data(), BaseGrad(lnf_w_), BaseGrad(lnf_b_), N, C);

  // a.dres holds dLoss/d(residual stream) and flows down through both residual adds.
  for (int l = config_.n_layer - 1; l >= 0; --l) {
    const Layer& L = layers_[l];
    Activations::PerLayer& A = a.layers[l];
    const float* input = l == 0 ? a.encoded.data() : a.layers[l - 1].res3.data();
    // MLP branch.
    zero(a.dfch_gelu, 4 * NC);
    linear_back(L.lin[kMlpProj], a.dres.data(), A.fch_gelu.data(), A.xa[kMlpProj].data(),
                a.dfch_gelu.data());
    zero(a.dfch, 4 * NC);
    ops_.GeluBackward(a.dfch_gelu.data(), A.fch.data(), a.dfch.data(), 4 * NC);
    zero(a.dln, NC);
    linear_back(L.lin[kFc], a.dfch.data(), A.ln2.data(), A.xa[kFc].data(), a.dln.data());
    ops_.LayerNormBackward(a.dln.data(), A.res2.data(), W(L.ln2_w), A.ln2_mean.data(),
                           A.ln2_rstd.data(), a.dres.data(), BaseGrad(L.ln2_w), BaseGrad(L.ln2_b),
                           N, C);
    // Attention branch.
    zero(a.datty, NC);
    linear_back(L.lin[kAttnProj], a.dres.data(), A.atty.data(), A.xa[kAttnProj].data(),
                a.datty.data());
    zero(a.dqkv, 3 * NC);
    ops_.AttentionBackward(a.datty.data(), A.qkv.data(), A.att.data(), a.dqkv.data(), a.datt.data(),
                           B, T, C, H);
    zero(a.dln, NC);
    linear_back(L.lin[kCAttn], a.dqkv.data(), A.ln1.data(), A.xa[kCAttn].data(), a.dln.data());
    ops_.LayerNormBackward(a.dln.data(), input, W(L.ln1_w), A.ln1_mean.data(), A.ln1_rstd.data(),
                           a.dres.data(), BaseGrad(L.ln1_w), BaseGrad(L.ln1_b), N, C);
  }
  if (mode_ == TrainMode::kFull) {
    ops_.EmbeddingBackward(a.dres.data(), a.tokens.data(), BaseGrad(wte_), BaseGrad(wpe_), B, T, C);
  }
}

}  // namespace isthmus::model
