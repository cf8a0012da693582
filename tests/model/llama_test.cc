// Tests of the Llama family (worker/model/gpt.h, ModelFamily::kLlama) on the CPU reference
// backend: loss and every gradient against a from-scratch PyTorch model of the same
// architecture (tests/model/llama_reference.py, float64) for Llama, Qwen2 and Mistral
// checkpoints it writes in Hugging Face's layout, tied and untied, with Llama 3's rotary
// rescaling, in full and LoRA mode; the checkpoint and the PEFT adapter round trips; the
// memory plan; training; and the config.json fields that are refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/hf_checkpoint.h"
#include "common/safetensors.h"
#include "tests/test_dir.h"
#include "worker/model/gpt.h"
#include "worker/model/trainer.h"

namespace isthmus::model {
namespace {

namespace fs = std::filesystem;

std::vector<int32_t> ReadInts(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<int32_t> out;
  int32_t v = 0;
  while (in.read(reinterpret_cast<char*>(&v), sizeof v)) out.push_back(v);
  return out;
}

std::string ReadText(const fs::path& path) {
  std::ifstream in(path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// The internal name and layout of a Hugging Face tensor name: "model." dropped, PEFT's
// "base_model.model.model." too; linear weights are held [in, out].
std::string InternalName(std::string name) {
  for (const char* prefix : {"base_model.model.model.", "model."}) {
    if (name.starts_with(prefix)) return name.substr(std::string(prefix).size());
  }
  return name;
}

std::vector<float> TransposedData(const Tensor& t) {
  const int64_t rows = t.shape[0], cols = t.shape[1];
  std::vector<float> out(t.data.size());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) out[c * rows + r] = t.data[r * cols + c];
  }
  return out;
}

// A Llama-family shape for the tests below (rope_theta 10000, eps 1e-5, no biases).
GptConfig TinyLlama(int layers, int width, int heads, int kv_heads, int inner, int context,
                    int vocab, bool tied) {
  GptConfig c;
  c.family = ModelFamily::kLlama;
  c.n_layer = layers;
  c.n_embd = width;
  c.n_head = heads;
  c.n_kv_head = kv_heads;
  c.n_inner = inner;
  c.n_ctx = context;
  c.vocab_size = vocab;
  c.tied_embeddings = tied;
  return c;
}

struct Variant {
  std::string name;
  std::string args;  // llama_reference.py's flags
  TrainMode mode = TrainMode::kFull;
  int lora_rank = 0;
  std::vector<std::string> lora_targets;
};

std::ostream& operator<<(std::ostream& os, const Variant& v) { return os << v.name; }

// A folder of its own per test, where the reference writes its checkpoint.
class LlamaFolders : public isthmus::testing::TestWithDir {
 protected:
  LlamaFolders() : TestWithDir("isthmus-llama") {}

  // Runs the reference for `args` into dir_.
  void WriteReference(const std::string& args) {
    const std::string cmd = std::string("/usr/bin/python3 ") + LLAMA_REFERENCE_PY + " " +
                            dir_.string() + " " + args + " > " + (dir_ / "ref.log").string();
    ASSERT_EQ(std::system(cmd.c_str()), 0)
        << cmd << " failed (python3-torch and python3-numpy are needed: deploy/install-deps.sh): "
        << ReadText(dir_ / "ref.log");
  }
};

class LlamaReference : public LlamaFolders, public ::testing::WithParamInterface<Variant> {};

// The isthmus loss and gradients of the checkpoint equal PyTorch's (float64) to fp32
// rounding: the loss within 2e-6 relative, each gradient tensor within 1e-4 of its largest
// element (a few hundred fp32 operations per value, each rounding by 6e-8).
TEST_P(LlamaReference, LossAndGradientsMatchPyTorch) {
  const Variant& v = GetParam();
  ASSERT_NO_FATAL_FAILURE(WriteReference(v.args));
  LoraConfig lora;
  if (v.mode == TrainMode::kLora) {
    lora.rank = v.lora_rank;
    lora.alpha = 2.0f * v.lora_rank;  // the reference's lora_alpha
    lora.targets = v.lora_targets;
  }
  auto gpt = Gpt::LoadHfFolder((dir_ / "hf").string(), v.mode, lora, 1);
  ASSERT_TRUE(gpt.ok()) << gpt.status().ToString();
  Gpt& model = **gpt;
  EXPECT_EQ(model.config().family, ModelFamily::kLlama);
  if (v.mode == TrainMode::kLora) {
    auto adapter = ReadSafetensors((dir_ / "adapter.safetensors").string());
    ASSERT_TRUE(adapter.ok()) << adapter.status().ToString();
    for (Tensor& t : adapter->tensors) t.name = InternalName(t.name);
    ASSERT_TRUE(model.LoadTrainable(adapter->tensors).ok());
  }
  const std::vector<int32_t> tokens = ReadInts(dir_ / "tokens.i32");
  const std::vector<int32_t> targets = ReadInts(dir_ / "targets.i32");
  const int T = 7, B = static_cast<int>(tokens.size()) / T;
  ASSERT_EQ(tokens.size(), targets.size());
  auto expected = ReadSafetensors((dir_ / "expected.safetensors").string());
  ASSERT_TRUE(expected.ok()) << expected.status().ToString();
  std::map<std::string, const Tensor*> want;
  for (const Tensor& t : expected->tensors) want[t.name] = &t;
  ASSERT_TRUE(want.count("loss"));

  model.ZeroGrad();
  const float loss = model.Forward(tokens.data(), targets.data(), B, T);
  model.Backward();
  ASSERT_TRUE(model.ops().Synchronize().ok());
  const double want_loss = want["loss"]->data[0];
  EXPECT_NEAR(loss, want_loss, 2e-6 * want_loss) << v.name;

  int compared = 0;
  for (const ParamView& p : model.Trainable()) {
    const Tensor* ref = nullptr;
    for (const auto& [name, t] : want) {
      if (name != "loss" && InternalName(name) == p.name) ref = t;
    }
    ASSERT_NE(ref, nullptr) << "the reference has no gradient for " << p.name;
    const bool transposed = p.name.ends_with("_proj.weight");  // held [in, out]
    const std::vector<float> ref_data = transposed ? TransposedData(*ref) : ref->data;
    ASSERT_EQ(static_cast<int64_t>(ref_data.size()), p.numel) << p.name;
    double worst = 0, largest = 0;
    for (int64_t i = 0; i < p.numel; ++i) {
      worst = std::max(worst, std::abs(static_cast<double>(p.grad[i]) - ref_data[i]));
      largest = std::max(largest, std::abs(static_cast<double>(ref_data[i])));
    }
    EXPECT_GT(largest, 0.0) << p.name << ": a zero gradient compares nothing";
    EXPECT_LE(worst, 1e-4 * largest) << v.name << " " << p.name << " largest " << largest;
    ++compared;
  }
  EXPECT_EQ(compared, static_cast<int>(want.size()) - 1) << "every reference gradient compared";
}

INSTANTIATE_TEST_SUITE_P(
    Families, LlamaReference,
    ::testing::Values(
        Variant{"llama_gqa", "--family llama", TrainMode::kFull, 0, {}},
        Variant{"llama_tied", "--family llama --tied", TrainMode::kFull, 0, {}},
        Variant{"llama3_rope_scaling", "--family llama --rope-scaling", TrainMode::kFull, 0, {}},
        Variant{"llama_multi_query", "--family llama --kv-heads 1", TrainMode::kFull, 0, {}},
        Variant{"qwen2_qkv_bias", "--family qwen2", TrainMode::kFull, 0, {}},
        Variant{"mistral", "--family mistral", TrainMode::kFull, 0, {}},
        Variant{"llama_lora",
                "--family llama --lora-rank 4 --lora-targets q_proj,v_proj,down_proj",
                TrainMode::kLora,
                4,
                {"self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"}},
        Variant{"qwen2_lora_all",
                "--family qwen2 --tied --lora-rank 3 --lora-targets "
                "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                TrainMode::kLora,
                3,
                {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}}),
    [](const ::testing::TestParamInfo<Variant>& info) { return info.param.name; });

// Import, export and import again: the tensors come back bitwise under their own names and
// shapes, config.json gives the same shape, and the PEFT adapter carries PEFT's names.
TEST_F(LlamaFolders, ImportExportRoundTripsBitwise) {
  ASSERT_NO_FATAL_FAILURE(WriteReference("--family llama --rope-scaling"));
  LoraConfig lora;
  lora.rank = 2;
  lora.targets = {"self_attn.q_proj", "mlp.up_proj"};
  auto gpt = Gpt::LoadHfFolder((dir_ / "hf").string(), TrainMode::kLora, lora, 5);
  ASSERT_TRUE(gpt.ok()) << gpt.status().ToString();
  auto original = ReadHfCheckpoint((dir_ / "hf" / "model.safetensors").string());
  ASSERT_TRUE(original.ok());
  const std::vector<Tensor> exported = (*gpt)->ExportHfTensors();
  ASSERT_EQ(exported.size(), original->tensors.size());
  // The base hash is the checkpoint's own: what a site reading the folder computes.
  EXPECT_EQ((*gpt)->BaseHash(), TensorsContentHash(original->tensors));
  std::map<std::string, const Tensor*> by_name;
  for (const Tensor& t : original->tensors) by_name[t.name] = &t;
  for (const Tensor& t : exported) {
    ASSERT_TRUE(by_name.count(t.name)) << t.name;
    EXPECT_EQ(t.shape, by_name[t.name]->shape) << t.name;
    EXPECT_EQ(t.data, by_name[t.name]->data) << t.name;
  }

  const fs::path out = dir_ / "out";
  ASSERT_TRUE((*gpt)->SaveHuggingFace(out.string(), /*max_shard_bytes=*/20000).ok());
  EXPECT_TRUE(fs::exists(out / kHfIndexFile)) << "above the shard size: shards and an index";
  auto again = Gpt::LoadHfFolder(out.string(), TrainMode::kLora, lora, 5);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ((*again)->config(), (*gpt)->config());
  EXPECT_EQ((*again)->BaseHash(), (*gpt)->BaseHash());
  const auto config = nlohmann::json::parse(ReadText(out / "config.json"));
  EXPECT_EQ(config["model_type"], "llama");
  EXPECT_EQ(config["architectures"][0], "LlamaForCausalLM");
  EXPECT_EQ(config["rope_scaling"]["rope_type"], "llama3");
  EXPECT_EQ(config["num_key_value_heads"], 2);

  // In bf16 (transformers' usual dtype): read back, each value is the original rounded to
  // bf16, and config.json says so.
  const fs::path half = dir_ / "bf16";
  ASSERT_TRUE((*gpt)->SaveHuggingFace(half.string(), kHfDefaultShardBytes, FileDtype::kBF16).ok());
  EXPECT_EQ(nlohmann::json::parse(ReadText(half / "config.json"))["torch_dtype"], "bfloat16");
  auto rounded = Gpt::LoadHfFolder(half.string(), TrainMode::kLora, lora, 5);
  ASSERT_TRUE(rounded.ok()) << rounded.status().ToString();
  for (const Tensor& t : (*rounded)->ExportHfTensors()) {
    const Tensor& want = *by_name[t.name];
    ASSERT_EQ(t.data.size(), want.data.size()) << t.name;
    for (size_t i = 0; i < t.data.size(); ++i) {
      ASSERT_EQ(t.data[i], ops::RoundBf16(want.data[i])) << t.name << "[" << i << "]";
    }
  }

  const fs::path peft = dir_ / "peft";
  ASSERT_TRUE((*gpt)->SavePeftAdapter(peft.string(), out.string()).ok());
  const auto adapter_config = nlohmann::json::parse(ReadText(peft / "adapter_config.json"));
  EXPECT_EQ(adapter_config["target_modules"], nlohmann::json({"q_proj", "up_proj"}));
  EXPECT_EQ(adapter_config["fan_in_fan_out"], false);
  auto adapter = ReadSafetensors((peft / "adapter_model.safetensors").string());
  ASSERT_TRUE(adapter.ok());
  std::vector<std::string> names;
  for (const Tensor& t : adapter->tensors) names.push_back(t.name);
  EXPECT_TRUE(std::find(names.begin(), names.end(),
                        "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight") !=
              names.end());
  for (const Tensor& t : adapter->tensors) {
    if (t.name.ends_with("q_proj.lora_A.weight")) {
      EXPECT_EQ(t.shape, (std::vector<int64_t>{2, 32}));
    }
    if (t.name.ends_with("up_proj.lora_B.weight")) {
      EXPECT_EQ(t.shape, (std::vector<int64_t>{40, 2}));
    }
  }
}

TEST_F(LlamaFolders, MissingOrMisshapenTensorsAreNamed) {
  ASSERT_NO_FATAL_FAILURE(WriteReference("--family llama"));
  auto file = ReadHfCheckpoint((dir_ / "hf" / "model.safetensors").string());
  ASSERT_TRUE(file.ok());
  auto config = ParseHfConfig(ReadText(dir_ / "hf" / "config.json"), "config.json");
  ASSERT_TRUE(config.ok()) << config.status().ToString();

  std::vector<Tensor> missing = file->tensors;
  missing.erase(std::remove_if(missing.begin(), missing.end(),
                               [](const Tensor& t) {
                                 return t.name == "model.layers.1.self_attn.k_proj.weight";
                               }),
                missing.end());
  auto r = Gpt::FromHfTensors(missing, *config, TrainMode::kFull, {}, 1);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("model.layers.1.self_attn.k_proj.weight"), std::string::npos)
      << r.status().ToString();

  std::vector<Tensor> wrong = file->tensors;
  for (Tensor& t : wrong) {
    if (t.name == "model.layers.0.mlp.down_proj.weight") std::swap(t.shape[0], t.shape[1]);
  }
  r = Gpt::FromHfTensors(wrong, *config, TrainMode::kFull, {}, 1);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("model.layers.0.mlp.down_proj.weight"), std::string::npos)
      << r.status().ToString();

  std::vector<Tensor> extra = file->tensors;
  extra.push_back({"model.layers.0.mlp.experts.0.weight", {2}, {0.0f, 0.0f}});
  r = Gpt::FromHfTensors(extra, *config, TrainMode::kFull, {}, 1);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("experts"), std::string::npos) << r.status().ToString();
}

// A config.json the model cannot compute is refused naming the field.
TEST(LlamaConfig, UnsupportedFieldsAreRefusedByName) {
  const nlohmann::json base = {{"model_type", "llama"},         {"hidden_size", 64},
                               {"intermediate_size", 128},      {"num_hidden_layers", 2},
                               {"num_attention_heads", 4},      {"num_key_value_heads", 2},
                               {"max_position_embeddings", 32}, {"vocab_size", 100},
                               {"rms_norm_eps", 1e-5},          {"rope_theta", 10000.0}};
  auto ok = ParseHfConfig(base.dump(), "c.json");
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->family, ModelFamily::kLlama);
  EXPECT_EQ(ok->kv_heads(), 2);
  EXPECT_EQ(ok->inner(), 128);
  EXPECT_FALSE(ok->tied_embeddings);

  const std::vector<std::pair<nlohmann::json, std::string>> bad = {
      {{{"model_type", "gpt_neox"}}, "model_type"},
      {{{"hidden_act", "gelu"}}, "hidden_act"},
      {{{"head_dim", 32}}, "head_dim"},
      {{{"rope_scaling", {{"rope_type", "yarn"}, {"factor", 4.0}}}}, "rope_scaling"},
      {{{"model_type", "mistral"}, {"sliding_window", 16}}, "sliding_window"},
      {{{"num_local_experts", 8}}, "num_local_experts"},
      {{{"mlp_bias", true}}, "mlp_bias"},
      {{{"attention_bias", true}}, "attention_bias"},
      {{{"num_key_value_heads", 3}}, "n_kv_head"},
      {{{"quantization_config", {{"bits", 4}}}}, "quantization_config"},
      {{{"model_type", 7}}, "model_type"},  // not a string: refused, not thrown
      {{{"hidden_act", nullptr}, {"rope_scaling", {{"rope_type", 3}}}}, "rope_scaling"},
      {{{"num_hidden_layers", "2"}}, "num_hidden_layers"},
  };
  for (const auto& [patch, field] : bad) {
    nlohmann::json c = base;
    c.update(patch);
    auto r = ParseHfConfig(c.dump(), "c.json");
    ASSERT_FALSE(r.ok()) << patch.dump();
    EXPECT_NE(r.status().message().find(field), std::string::npos)
        << patch.dump() << ": " << r.status().ToString();
  }
  // A window no shorter than the context changes nothing, and Qwen2's is off by default.
  nlohmann::json wide = base;
  wide.update({{"model_type", "mistral"}, {"sliding_window", 32}});
  EXPECT_TRUE(ParseHfConfig(wide.dump(), "c.json").ok());
  nlohmann::json qwen = base;
  qwen.update({{"model_type", "qwen2"}, {"sliding_window", 4}, {"use_sliding_window", false}});
  auto q = ParseHfConfig(qwen.dump(), "c.json");
  ASSERT_TRUE(q.ok()) << q.status().ToString();
  EXPECT_TRUE(q->qkv_bias);
}

// The memory plan of a Llama-shaped model equals what a training step holds, as GPT-2's.
TEST(LlamaMemoryPlan, EqualsWhatTrainingAllocates) {
  const GptConfig c = TinyLlama(2, 32, 4, 2, 48, 16, 64, /*tied=*/false);
  LoraConfig lora;
  lora.rank = 4;
  lora.targets = {"self_attn.q_proj", "self_attn.v_proj", "mlp.gate_proj"};
  for (TrainMode mode : {TrainMode::kLora, TrainMode::kFull}) {
    for (ops::Dtype precision : {ops::Dtype::kF32, ops::Dtype::kBF16}) {
      const Compute compute{&ops::CpuOps(), precision};
      auto plan = Gpt::PlanMemory(c, mode, lora, compute, 2, 16);
      ASSERT_TRUE(plan.ok()) << plan.status().ToString();
      auto gpt = Gpt::CreateRandom(c, mode, lora, 3, compute);
      ASSERT_TRUE(gpt.ok()) << gpt.status().ToString();
      auto trainer = Trainer::Create(**gpt, TrainerConfig{});
      ASSERT_TRUE(trainer.ok());
      std::vector<int32_t> tokens(32), targets(32);
      for (int i = 0; i < 32; ++i) tokens[i] = i % 64, targets[i] = (i * 7) % 64;
      ASSERT_TRUE((*trainer)->Step(tokens.data(), targets.data(), 2, 16).ok());
      EXPECT_EQ(static_cast<int64_t>(ops::CpuOps().Memory().allocated), plan->backend_bytes())
          << TrainModeName(mode) << " " << ops::DtypeName(precision);
    }
  }
}

// LoRA in bf16 holds the frozen base's matrices in bf16 alone on the backend (fp32 only for
// the embeddings and norms the kernels read so); its fp32 masters stay in host memory, so
// the base exports, hashes and is found bitwise as loaded.
TEST(LlamaMemoryPlan, AFrozenBf16BaseKeepsItsFp32MastersOnTheHost) {
  const GptConfig c = TinyLlama(2, 64, 4, 2, 160, 16, 32, /*tied=*/false);
  LoraConfig lora;
  lora.rank = 4;
  lora.targets = {"self_attn.q_proj"};
  auto fp32 = Gpt::CreateRandom(c, TrainMode::kLora, lora, 3);
  ASSERT_TRUE(fp32.ok());
  const Compute bf16{&ops::CpuOps(), ops::Dtype::kBF16};
  auto frozen = Gpt::FromHfTensors((*fp32)->ExportHfTensors(), c, TrainMode::kLora, lora, 3, bf16);
  ASSERT_TRUE(frozen.ok()) << frozen.status().ToString();
  EXPECT_EQ((*frozen)->BaseHash(), (*fp32)->BaseHash());
  EXPECT_EQ((*frozen)->FindBase("layers.1.mlp.up_proj.weight")->data,
            (*fp32)->FindBase("layers.1.mlp.up_proj.weight")->data);

  auto lora_plan = Gpt::PlanMemory(c, TrainMode::kLora, lora, bf16, 2, 16);
  auto full_plan = Gpt::PlanMemory(c, TrainMode::kFull, lora, bf16, 2, 16);
  ASSERT_TRUE(lora_plan.ok() && full_plan.ok());
  const int64_t base_bytes = (*fp32)->BaseElements() * 4;
  EXPECT_GE(lora_plan->host_masters, base_bytes);
  EXPECT_EQ(full_plan->host_masters, 0);  // a base that trains keeps its masters on the device
  EXPECT_GE(full_plan->parameters, base_bytes);
  // The matrices are most of the base: fp32 on the backend for the embedding and norms only.
  const int64_t matrices = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 160) * 4;
  EXPECT_LE(lora_plan->parameters, full_plan->parameters - matrices);

  // Its loss is the fp32 model's to bf16 rounding.
  std::vector<int32_t> tokens(32), targets(32);
  for (int i = 0; i < 32; ++i) tokens[i] = (i * 3) % 32, targets[i] = (i * 5) % 32;
  const float a = (*frozen)->Forward(tokens.data(), targets.data(), 2, 16);
  EXPECT_TRUE(std::isfinite(a));
  EXPECT_NEAR(a, (*fp32)->Forward(tokens.data(), targets.data(), 2, 16), 0.02 * a);
}

// What training Llama 3 8B's shape holds, planned without allocating (its config.json's
// sizes): LoRA in bf16 at one 2,048-token sequence fits an 80 GB GPU; full training in fp32
// does not come close (the parameters, gradients and AdamW moments alone are 16 bytes each).
TEST(LlamaMemoryPlan, Llama3EightBillionLoraInBf16FitsEightyGigabytes) {
  const nlohmann::json config = {{"model_type", "llama"},
                                 {"hidden_size", 4096},
                                 {"intermediate_size", 14336},
                                 {"num_hidden_layers", 32},
                                 {"num_attention_heads", 32},
                                 {"num_key_value_heads", 8},
                                 {"max_position_embeddings", 8192},
                                 {"vocab_size", 128256},
                                 {"rms_norm_eps", 1e-5},
                                 {"rope_theta", 500000.0},
                                 {"tie_word_embeddings", false}};
  auto c = ParseHfConfig(config.dump(), "llama3-8b/config.json");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  LoraConfig lora;
  lora.rank = 16;
  lora.targets = LoraTargetNames(ModelFamily::kLlama);
  // The CPU backend plans the same buffers a GPU would hold (its own workspaces aside).
  const Compute bf16{&ops::CpuOps(), ops::Dtype::kBF16};
  auto plan = Gpt::PlanMemory(*c, TrainMode::kLora, lora, bf16, 1, 2048, /*synced_rounds=*/true);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  const int64_t gib = int64_t{1} << 30;
  const int64_t device = plan->backend_bytes() - plan->backend_held;
  std::printf(
      "[llama3-8b lora r16 bf16, 1 x 2048] parameters %.1f GiB, bf16 copies %.1f GiB, "
      "activations %.1f GiB, device total %.1f GiB, host fp32 base %.1f GiB\n",
      static_cast<double>(plan->parameters) / gib, static_cast<double>(plan->weight_copies) / gib,
      static_cast<double>(plan->activations) / gib, static_cast<double>(device) / gib,
      static_cast<double>(plan->host_masters) / gib);
  EXPECT_LT(device, 80 * gib);
  EXPECT_GT(plan->weight_copies, 14 * gib);  // 8.0e9 parameters in bf16
  auto full = Gpt::PlanMemory(*c, TrainMode::kFull, lora, {}, 1, 2048);
  ASSERT_TRUE(full.ok());
  EXPECT_GT(full->backend_bytes() - full->backend_held, 120 * gib);
}

// Activation recompute gives the same loss and gradients bit for bit (the block's forward
// runs again with the same kernels on the same inputs), for both families, in fp32 and
// bf16, and its plan (equal to what a step holds) keeps one layer's activations.
TEST(ActivationRecompute, SameGradientsBitwiseAndLessMemory) {
  const GptConfig llama = TinyLlama(3, 32, 4, 2, 48, 16, 64, /*tied=*/true);
  GptConfig gpt2;
  gpt2.n_layer = 3;
  gpt2.n_embd = 32;
  gpt2.n_head = 2;
  gpt2.n_ctx = 16;
  gpt2.vocab_size = 64;
  const int B = 2, T = 16;
  std::vector<int32_t> tokens(B * T), targets(B * T);
  for (int i = 0; i < B * T; ++i) tokens[i] = (i * 7) % 64, targets[i] = (i * 11 + 3) % 64;
  for (const GptConfig& c : {llama, gpt2}) {
    LoraConfig lora;
    lora.rank = 4;
    lora.targets = LoraTargetNames(c.family);
    for (TrainMode mode : {TrainMode::kFull, TrainMode::kLora}) {
      for (ops::Dtype precision : {ops::Dtype::kF32, ops::Dtype::kBF16}) {
        const std::string what = std::string(ModelFamilyName(c.family)) + " " +
                                 TrainModeName(mode) + " " + ops::DtypeName(precision);
        std::vector<std::vector<float>> grads;
        std::vector<float> losses;
        std::vector<int64_t> activations;
        for (bool recompute : {false, true}) {
          const Compute compute{&ops::CpuOps(), precision, recompute};
          auto plan = Gpt::PlanMemory(c, mode, lora, compute, B, T);
          ASSERT_TRUE(plan.ok()) << plan.status().ToString();
          activations.push_back(plan->activations);
          auto gpt = Gpt::CreateRandom(c, mode, lora, 9, compute);
          ASSERT_TRUE(gpt.ok()) << gpt.status().ToString();
          if (mode == TrainMode::kLora) {  // B = 0 at the start: give the adapters a value
            std::vector<Tensor> t = (*gpt)->ExportTrainable();
            for (Tensor& x : t) {
              for (size_t i = 0; i < x.data.size(); ++i) x.data[i] = 0.01f * ((i * 7) % 13) - 0.06f;
            }
            ASSERT_TRUE((*gpt)->LoadTrainable(t).ok());
          }
          (*gpt)->ZeroGrad();
          losses.push_back((*gpt)->Forward(tokens.data(), targets.data(), B, T));
          (*gpt)->Backward();
          ASSERT_TRUE((*gpt)->ops().Synchronize().ok());
          const float* g = (*gpt)->GradData();
          grads.emplace_back(g, g + (*gpt)->TrainableElements());
          auto trainer = Trainer::Create(**gpt, TrainerConfig{});
          ASSERT_TRUE(trainer.ok());
          ASSERT_TRUE((*trainer)->Step(tokens.data(), targets.data(), B, T).ok());
          EXPECT_EQ(static_cast<int64_t>(ops::CpuOps().Memory().allocated), plan->backend_bytes())
              << what << (recompute ? " recompute" : "");
        }
        EXPECT_EQ(losses[0], losses[1]) << what;
        EXPECT_TRUE(grads[0] == grads[1]) << what << ": gradients differ";
        // Three layers' activations become one layer's plus the residual stream.
        EXPECT_LT(activations[1], activations[0] * 3 / 4) << what;
      }
    }
  }
}

// A random Llama-shaped model learns a token mapping in full mode, then LoRA adapters on
// that trained base learn another one, in fp32 and bf16 (a uniform guess is ln 64 = 4.16).
// LoRA starts from the trained base because a random one's frozen embeddings and norms
// bound its logits (to about 0.6 here) and with them how far any adapter can lower the loss.
TEST(LlamaTraining, FullThenLoraLearnTokenMappings) {
  const GptConfig c = TinyLlama(2, 32, 4, 1, 64, 16, 64, /*tied=*/true);
  LoraConfig lora;
  lora.rank = 8;
  lora.alpha = 8;
  lora.targets = LoraTargetNames(ModelFamily::kLlama);
  const int B = 4, T = 16;
  // Each row a stride-5 walk through the vocabulary; the target is the token `shift` on.
  auto batch = [&](int shift, std::vector<int32_t>* tokens, std::vector<int32_t>* targets) {
    tokens->resize(B * T);
    targets->resize(B * T);
    for (int i = 0; i < B * T; ++i) {
      (*tokens)[i] = (i * 5 + i / T) % 64;
      (*targets)[i] = ((*tokens)[i] + shift) % 64;
    }
  };
  auto train = [&](Gpt& gpt, int shift, float lr, int steps) {
    std::vector<int32_t> tokens, targets;
    batch(shift, &tokens, &targets);
    TrainerConfig tc;
    tc.max_lr = tc.min_lr = lr;
    tc.warmup_steps = 0;
    auto trainer = Trainer::Create(gpt, tc);
    EXPECT_TRUE(trainer.ok());
    std::pair<float, float> first_last{0, 0};
    for (int step = 0; step < steps; ++step) {
      auto s = (*trainer)->Step(tokens.data(), targets.data(), B, T);
      EXPECT_TRUE(s.ok()) << s.status().ToString();
      if (!s.ok()) break;
      if (step == 0) first_last.first = s->loss;
      first_last.second = s->loss;
    }
    return first_last;
  };
  for (ops::Dtype precision : {ops::Dtype::kF32, ops::Dtype::kBF16}) {
    const Compute compute{&ops::CpuOps(), precision};
    auto full = Gpt::CreateRandom(c, TrainMode::kFull, lora, 7, compute);
    ASSERT_TRUE(full.ok()) << full.status().ToString();
    const auto [full_first, full_last] = train(**full, 5, 3e-3f, 150);
    std::printf("[llama full %s] loss %.3f -> %.3f\n", ops::DtypeName(precision), full_first,
                full_last);
    EXPECT_GT(full_first, 3.5f);
    EXPECT_LT(full_last, 0.1f) << ops::DtypeName(precision);

    auto adapted =
        Gpt::FromHfTensors((*full)->ExportHfTensors(), c, TrainMode::kLora, lora, 7, compute);
    ASSERT_TRUE(adapted.ok()) << adapted.status().ToString();
    const auto [lora_first, lora_last] = train(**adapted, 7, 1e-2f, 300);
    std::printf("[llama lora %s] loss %.3f -> %.3f\n", ops::DtypeName(precision), lora_first,
                lora_last);
    EXPECT_GT(lora_first, 3.0f) << "the new mapping is not the base's";
    EXPECT_LT(lora_last, 1.0f) << ops::DtypeName(precision);
  }
}

}  // namespace
}  // namespace isthmus::model
