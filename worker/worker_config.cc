// Flags of isthmus-worker and the checks run before any work starts.
#include "worker/worker_config.h"

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/check.h"
#include "common/hf_checkpoint.h"
#include "common/metrics.h"
#include "common/safetensors.h"
#include "ops/device.h"

namespace isthmus::worker {

model::GptConfig ModelSettings::Gpt() const {
  model::GptConfig c = arch;
  c.n_layer = layers;
  c.n_embd = width;
  c.n_head = heads;
  c.n_ctx = context;
  c.vocab_size = vocab_size;
  return c;
}

model::LoraConfig ModelSettings::Lora() const {
  model::LoraConfig l;
  l.rank = lora_rank;
  l.alpha = lora_alpha;
  l.targets = lora_targets;
  return l;
}

Status ModelSettings::Validate() const {
  ISTHMUS_RETURN_IF_ERROR(Gpt().Validate());
  ISTHMUS_RETURN_IF_ERROR(model::ParseTrainMode(mode).status());
  if (mode == "lora") ISTHMUS_RETURN_IF_ERROR(Lora().Validate(arch.family));
  return Status::Ok();
}

Status ModelSettings::TakeFromBase(const char* flag, int& field, int64_t value,
                                   const std::string& source) {
  if (given.count(flag) && field != value) {
    return Status::InvalidArgument(std::string(flag) + " " + std::to_string(field) +
                                   " contradicts the base " + source + ", which has " +
                                   std::to_string(value) + ": leave " + flag +
                                   " out (the base sets it) or use another base");
  }
  field = static_cast<int>(value);
  return Status::Ok();
}

Status ModelSettings::TakeLlamaShape(const model::GptConfig& config, const std::string& source) {
  auto take = [&](const char* flag, int& field, int64_t value) {
    return TakeFromBase(flag, field, value, source);
  };
  ISTHMUS_RETURN_IF_ERROR(take("--layers", layers, config.n_layer));
  ISTHMUS_RETURN_IF_ERROR(take("--width", width, config.n_embd));
  ISTHMUS_RETURN_IF_ERROR(take("--heads", heads, config.n_head));
  ISTHMUS_RETURN_IF_ERROR(take("--context", context, config.n_ctx));
  vocab_size = config.vocab_size;
  arch = config;
  // PEFT names a Llama target by its last part (q_proj); every linear by default.
  const std::vector<std::string> names = model::LoraTargetNames(config.family);
  if (!given.count("--lora-targets")) {
    lora_targets = names;
  } else {
    for (std::string& t : lora_targets) {
      for (const std::string& n : names) {
        if (n.ends_with("." + t)) t = n;
      }
    }
  }
  return Status::Ok();
}

Status ModelSettings::ResolveBaseShape() {
  if (base.empty()) return Status::Ok();
  given_base = base;
  std::error_code ec;
  std::string heads_from;  // where the head count came from
  int file_heads = 0;
  if (std::filesystem::is_directory(base, ec)) {
    // A Hugging Face GPT-2 folder: config.json and model.safetensors, or its shards and
    // their index.
    const std::string config_path = base + "/config.json";
    std::ifstream in(config_path);
    if (!in) return Status::InvalidArgument("--base " + base + ": no config.json in the folder");
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    auto config = nlohmann::json::parse(text, nullptr, false);
    if (config.is_discarded() || !config.is_object()) {
      return Status::InvalidArgument(config_path + " is not a JSON object");
    }
    const bool gpt2 = !config.contains("model_type") ||
                      (config["model_type"].is_string() && config["model_type"] == "gpt2");
    if (!gpt2) {  // the Llama family, or a type ParseHfConfig refuses by name
      ISTHMUS_ASSIGN_OR_RETURN(model::GptConfig parsed, model::ParseHfConfig(text, config_path));
      auto file = FindHfCheckpoint(base);
      if (!file.ok()) return Status::InvalidArgument("--base " + file.status().message());
      base = *file;
      return TakeLlamaShape(parsed, given_base);
    }
    if (config.contains("n_head") && config["n_head"].is_number_integer()) {
      file_heads = config["n_head"].get<int>();
      heads_from = config_path;
    }
    auto file = FindHfCheckpoint(base);
    if (!file.ok()) return Status::InvalidArgument("--base " + file.status().message());
    base = *file;
  }
  ISTHMUS_ASSIGN_OR_RETURN(SafetensorsInfo info, ReadHfCheckpointInfo(base));
  if (auto hf = info.metadata.find("hf_config"); hf != info.metadata.end()) {
    // A Llama-family base written by isthmus (Gpt::SaveBase): its config.json inside.
    ISTHMUS_ASSIGN_OR_RETURN(model::GptConfig parsed,
                             model::ParseHfConfig(hf->second, base + " (hf_config)"));
    return TakeLlamaShape(parsed, base);
  }
  // transformers' save_pretrained writes GPT2LMHeadModel's tensors as "transformer.<name>".
  for (auto& t : info.tensors) {
    if (t.name.rfind("transformer.", 0) == 0) t.name.erase(0, 12);
  }
  auto find = [&](const std::string& name) -> const std::vector<int64_t>* {
    for (const auto& t : info.tensors) {
      if (t.name == name) return &t.shape;
    }
    return nullptr;
  };
  const auto* wte = find("wte.weight");
  const auto* wpe = find("wpe.weight");
  if (wte == nullptr || wpe == nullptr || wte->size() != 2 || wpe->size() != 2) {
    return Status::InvalidArgument("--base " + base +
                                   ": not a GPT-2 base (needs wte.weight [V, C] and "
                                   "wpe.weight [n_ctx, C])");
  }
  int64_t layers_in_file = 0;
  for (const auto& t : info.tensors) {
    if (t.name.rfind("h.", 0) != 0) continue;
    const int64_t l = std::strtoll(t.name.c_str() + 2, nullptr, 10);
    layers_in_file = std::max(layers_in_file, l + 1);
  }
  auto it = info.metadata.find("n_head");
  if (it != info.metadata.end()) {
    auto parsed = ParseInt64(it->second, base + ": metadata n_head");
    if (!parsed.ok() || *parsed <= 0 || *parsed > 4096) {
      return Status::InvalidArgument(base + ": metadata n_head \"" + it->second +
                                     "\" is not a head count");
    }
    file_heads = static_cast<int>(*parsed);
    heads_from = base + " (metadata)";
  }
  auto take = [&](const char* flag, int& field, int64_t value) {
    return TakeFromBase(flag, field, value, base);
  };
  vocab_size = static_cast<int>((*wte)[0]);
  ISTHMUS_RETURN_IF_ERROR(take("--layers", layers, layers_in_file));
  ISTHMUS_RETURN_IF_ERROR(take("--width", width, (*wte)[1]));
  ISTHMUS_RETURN_IF_ERROR(take("--context", context, (*wpe)[0]));
  if (file_heads > 0) {
    ISTHMUS_RETURN_IF_ERROR(take("--heads", heads, file_heads));
  } else if (!given.count("--heads")) {
    return Status::InvalidArgument("--base " + base +
                                   " does not record its number of attention heads: give --heads");
  }
  return Status::Ok();
}

namespace {

std::string FormatAlpha(float alpha) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", alpha);
  return buf;
}

std::string JoinTargets(const std::vector<std::string>& targets) {
  std::string out;
  for (const auto& t : targets) out += (out.empty() ? "" : ",") + t;
  return out;
}

}  // namespace

Status ModelSettings::ResolveTrainable(const std::vector<Tensor>& tensors,
                                       const std::map<std::string, std::string>& metadata,
                                       const std::string& source, std::string* note) {
  auto contradiction = [&](const std::string& flag, const std::string& ours,
                           const std::string& theirs) {
    return Status::InvalidArgument(flag + " " + ours + " contradicts " + source + ", which say " +
                                   theirs + ": leave " + flag + " out or give " + theirs);
  };
  bool full = false;
  int rank = 0;
  std::set<std::string> targets;
  for (const auto& t : tensors) {
    if (t.name == "wte.weight" || t.name == "embed_tokens.weight") full = true;
    const auto at = t.name.find(".lora_A.weight");
    if (at == std::string::npos || t.shape.size() != 2) continue;
    rank = static_cast<int>(t.shape[0]);
    // "h.N.<target>" (GPT-2) or "layers.N.<target>" (the Llama family).
    const auto number = t.name.find('.');
    const auto layer_end = number == std::string::npos ? number : t.name.find('.', number + 1);
    if (layer_end != std::string::npos && layer_end < at) {
      targets.insert(t.name.substr(layer_end + 1, at - layer_end - 1));
    }
  }
  const std::string file_mode = full ? "full" : "lora";
  if (given.count("--mode") && mode != file_mode) return contradiction("--mode", mode, file_mode);
  mode = file_mode;
  lora_alpha_assumed = false;
  if (full) return Status::Ok();
  if (rank > 0) {
    if (given.count("--lora-rank") && lora_rank != rank) {
      return contradiction("--lora-rank", std::to_string(lora_rank), std::to_string(rank));
    }
    lora_rank = rank;
  }
  if (!targets.empty()) {
    // In the canonical order, as the flag's default lists them.
    std::vector<std::string> ordered;
    for (const std::string& name : model::LoraTargetNames(arch.family)) {
      if (targets.count(name)) ordered.push_back(name);
    }
    const std::set<std::string> ours(lora_targets.begin(), lora_targets.end());
    if (given.count("--lora-targets") && ours != targets) {
      return contradiction("--lora-targets", JoinTargets(lora_targets), JoinTargets(ordered));
    }
    lora_targets = ordered;
  }
  auto it = metadata.find("lora_alpha");
  if (it != metadata.end()) {
    char* end = nullptr;
    const float alpha = std::strtof(it->second.c_str(), &end);
    if (it->second.empty() || *end != '\0' || !std::isfinite(alpha) || alpha <= 0) {
      return Status::InvalidArgument(source + ": metadata lora_alpha \"" + it->second +
                                     "\" is not a positive number");
    }
    if (given.count("--lora-alpha") && lora_alpha != alpha) {
      return contradiction("--lora-alpha", FormatAlpha(lora_alpha), FormatAlpha(alpha));
    }
    lora_alpha = alpha;
  } else if (!given.count("--lora-alpha")) {
    lora_alpha_assumed = true;
    if (note != nullptr) {
      *note = source + " carry no record of the LoRA alpha: assuming --lora-alpha " +
              FormatAlpha(lora_alpha) + " (the default); give --lora-alpha if they were " +
              "trained with another";
    }
  }
  return Status::Ok();
}

std::map<std::string, std::string> ModelSettings::TrainableMetadata() const {
  return {{"train_mode", mode},
          {"lora_rank", std::to_string(lora_rank)},
          {"lora_alpha", FormatAlpha(lora_alpha)},
          {"lora_targets", JoinTargets(lora_targets)}};
}

namespace {

// Every family's targets, GPT-2's first: bit i of the job's target bits is name i.
std::vector<std::string> AllTargetNames() {
  std::vector<std::string> all = model::LoraTargetNames(model::ModelFamily::kGpt2);
  for (const std::string& n : model::LoraTargetNames(model::ModelFamily::kLlama)) all.push_back(n);
  return all;
}

}  // namespace

uint32_t ModelSettings::LoraTargetBits() const {
  const std::vector<std::string> all = AllTargetNames();
  uint32_t bits = 0;
  for (const auto& t : lora_targets) {
    for (size_t i = 0; i < all.size(); ++i) {
      if (t == all[i]) bits |= 1u << i;
    }
  }
  return bits;
}

std::vector<std::string> ModelSettings::LoraTargetsFromBits(uint32_t bits) {
  const std::vector<std::string> all = AllTargetNames();
  std::vector<std::string> out;
  for (size_t i = 0; i < all.size(); ++i) {
    if (bits & (1u << i)) out.push_back(all[i]);
  }
  return out;
}

std::string ModelSettings::DescribeTraining() const {
  if (mode == "full") return "mode full";
  return "mode lora, LoRA rank " + std::to_string(lora_rank) + ", alpha " +
         FormatAlpha(lora_alpha) + ", targets " + JoinTargets(lora_targets);
}

Status ComputeSettings::Validate() const {
  ISTHMUS_RETURN_IF_ERROR(ops::ParseDevice(device).status());
  if (precision != "auto") ISTHMUS_RETURN_IF_ERROR(model::ParsePrecision(precision).status());
  return Status::Ok();
}

Result<OpenedCompute> OpenCompute(const ComputeSettings& c, int rank) {
  ISTHMUS_RETURN_IF_ERROR(c.Validate());
  ISTHMUS_ASSIGN_OR_RETURN(ops::DeviceChoice choice, ops::ParseDevice(c.device));
  ISTHMUS_ASSIGN_OR_RETURN(ops::DeviceChoice resolved,
                           ops::ResolveDevice(choice, rank, c.local_rank));
  OpenedCompute out;
  ISTHMUS_ASSIGN_OR_RETURN(out.ops, ops::OpenBackend(resolved));
  out.device_index = resolved.kind == ops::DeviceChoice::Kind::kCuda ? resolved.index : -1;
  out.recompute = c.recompute;
  if (c.precision == "auto") {
    out.precision = out.ops->HostMemory() ? ops::Dtype::kF32 : ops::Dtype::kBF16;
  } else {
    ISTHMUS_ASSIGN_OR_RETURN(out.precision, model::ParsePrecision(c.precision));
  }
  return out;
}

model::TrainerConfig TrainSettings::Trainer() const {
  model::TrainerConfig c;
  c.max_lr = lr;
  c.min_lr = min_lr;
  c.weight_decay = weight_decay;
  c.grad_clip = grad_clip;
  int64_t total = max_steps > 0 ? max_steps : max_rounds * StepsPerRound();
  if (total <= 0) total = 1;
  c.total_steps = total;
  c.warmup_steps = std::min(warmup_steps, total);
  c.graphs = compute.cuda_graphs;
  return c;
}

Status TrainSettings::Validate() const {
  ISTHMUS_RETURN_IF_ERROR(model.Validate());
  ISTHMUS_RETURN_IF_ERROR(compute.Validate());
  if (data_dir.empty()) return Status::InvalidArgument("--data is required");
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return Status::InvalidArgument("--rank must be in [0, --world-size)");
  }
  if (world_size > 1 && rendezvous.empty()) {
    return Status::InvalidArgument("--rendezvous is required when --world-size > 1");
  }
  if (max_rounds <= 0 && max_steps <= 0) {
    return Status::InvalidArgument("give --max-rounds or --max-steps");
  }
  if (steps_per_round < 0 || round_seconds < 0 || !std::isfinite(round_seconds)) {
    return Status::InvalidArgument("--steps-per-round and --round-seconds must be >= 0");
  }
  if (merge_after_steps < -1) {
    return Status::InvalidArgument(
        "--merge-after-steps must be >= 0 (0: merge on arrival; leave it out for a tenth of "
        "the round)");
  }
  if (merge_wait && merge_after_steps == 0) {
    return Status::InvalidArgument(
        "--merge-wait needs a merge step: give --merge-after-steps M > 0 (or leave it out for "
        "a tenth of the round)");
  }
  if (encode_threads < 1 || encode_threads > 256) {
    return Status::InvalidArgument("--encode-threads must be in [1, 256], got " +
                                   std::to_string(encode_threads));
  }
  if (batch_size < 1 || val_batches < 1 || log_every < 1 || comm_timeout_s < 1) {
    return Status::InvalidArgument(
        "--batch-size, --val-batches, --log-every and --comm-timeout must be >= 1");
  }
  if (!(distill_alpha >= 0.0f && distill_alpha <= 1.0f)) {
    return Status::InvalidArgument("--distill-alpha must be in [0, 1], got " +
                                   std::to_string(distill_alpha));
  }
  if (!(distill_temperature > 0.0f && distill_temperature <= 100.0f)) {
    return Status::InvalidArgument("--distill-temperature must be in (0, 100], got " +
                                   std::to_string(distill_temperature));
  }
  if (bucket_mb < 0 || bucket_mb > kMaxBucketMb) {
    return Status::InvalidArgument("--bucket-mb must be in [0, " + std::to_string(kMaxBucketMb) +
                                   "] (0: one all-reduce after the backward), got " +
                                   std::to_string(bucket_mb));
  }
  if (reduce_precision != "fp32" && reduce_precision != "bf16") {
    return Status::InvalidArgument("--reduce-precision must be fp32 or bf16, got \"" +
                                   reduce_precision + "\"");
  }
  if (grad_accum < 1 || grad_accum > 4096) {
    return Status::InvalidArgument("--grad-accum must be in [1, 4096], got " +
                                   std::to_string(grad_accum));
  }
  if (!standalone) {
    if (shards.servers.empty()) {
      return Status::InvalidArgument("give at least one --server, or --standalone");
    }
    if (!shards.insecure_plaintext) {
      if (shards.key.empty())
        return Status::InvalidArgument("--key is required (or --insecure-plaintext)");
      if (shards.server_keys.size() != 1 && shards.server_keys.size() != shards.servers.size()) {
        return Status::InvalidArgument("give one --server-key per --server, or one for all");
      }
    }
    if (!init.empty() || !save.empty()) {
      return Status::InvalidArgument("--init and --save are for --standalone runs");
    }
  }
  if (checkpoint_state_every < 0 || checkpoint_state_every > 1000000) {
    return Status::InvalidArgument("--checkpoint-state-every must be in [1, 1000000], got " +
                                   std::to_string(checkpoint_state_every));
  }
  if (checkpoint_state_every > 1 && (standalone || !overlap)) {
    return Status::InvalidArgument(
        "--checkpoint-state-every N > 1 is for synced runs with --overlap, whose checkpoint "
        "holds the round in flight; leave it out with --standalone or --no-overlap");
  }
  if (eval_every_rounds < 0) return Status::InvalidArgument("--eval-every-rounds must be >= 0");
  for (const auto& e : eval_sets) {
    const size_t eq = e.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == e.size()) {
      return Status::InvalidArgument("--eval-set '" + e + "' is not NAME=DIR");
    }
  }
  if (!eval_sets.empty() && eval_every_rounds == 0) {
    return Status::InvalidArgument("--eval-set needs --eval-every-rounds N (N >= 1)");
  }
  for (const auto& e : translate_sets) {
    const size_t eq = e.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == e.size()) {
      return Status::InvalidArgument("--translate-set '" + e + "' is not LANG=FILE");
    }
  }
  if (!translate_sets.empty() && (eval_every_rounds == 0 || events.empty())) {
    return Status::InvalidArgument(
        "--translate-set needs --eval-every-rounds N (N >= 1) and --events FILE (the "
        "translations are written beside it)");
  }
  if (translate_lines < 1 || translate_lines > 100000) {
    return Status::InvalidArgument("--translate-lines must be in [1, 100000], got " +
                                   std::to_string(translate_lines));
  }
  if (!metrics_listen.empty()) {
    auto hp = metrics::ParseHostPort(metrics_listen, "--metrics-listen");
    if (!hp.ok()) return hp.status();
  }
  return Trainer().Validate();
}

void AddModelFlags(CLI::App& app, ModelSettings& m) {
  auto note = [&m](const char* flag) {
    return [&m, flag](const std::string&) { m.given.insert(flag); };
  };
  const char* from_base = " (with --base: the base's)";
  app.add_option("--layers", m.layers, std::string("transformer blocks") + from_base)
      ->capture_default_str()
      ->each(note("--layers"));
  app.add_option("--width", m.width, std::string("embedding width C") + from_base)
      ->capture_default_str()
      ->each(note("--width"));
  app.add_option("--heads", m.heads,
                 "attention heads, dividing --width (with --base: the base's, when it "
                 "records them)")
      ->capture_default_str()
      ->each(note("--heads"));
  app.add_option("--context", m.context,
                 std::string("context length (and sequence length per row)") + from_base)
      ->capture_default_str()
      ->each(note("--context"));
  const char* from_file = " (with a file of trainable tensors: the file's)";
  app.add_option("--lora-rank", m.lora_rank, std::string("LoRA rank r") + from_file)
      ->capture_default_str()
      ->each(note("--lora-rank"));
  app.add_option("--lora-alpha", m.lora_alpha,
                 std::string("LoRA alpha (scale alpha / r)") + from_file)
      ->capture_default_str()
      ->each(note("--lora-alpha"));
  app.add_option(
         "--lora-targets", m.lora_targets,
         std::string("adapted layers: attn.c_attn attn.c_proj mlp.c_fc mlp.c_proj (GPT-2); for a "
                     "Llama-family base q_proj k_proj v_proj o_proj gate_proj up_proj "
                     "down_proj, all of them by default") +
             from_file)
      ->capture_default_str()
      ->each(note("--lora-targets"));
  app.add_option("--mode", m.mode,
                 std::string("lora (base frozen) or full (every tensor trains)") + from_file)
      ->check(CLI::IsMember({"lora", "full"}))
      ->capture_default_str()
      ->each(note("--mode"));
  app.add_option("--base", m.base,
                 "base model: a safetensors file (from `init --write-base` or a GPT-2 file) "
                 "or a Hugging Face GPT-2 folder (config.json + model.safetensors, or "
                 "sharded: model-0000k-of-0000n.safetensors + model.safetensors.index.json; "
                 "F32, F16 or BF16); the model's shape is read from it");
  app.add_option("--seed", m.seed, "seed of LoRA init and of a random base")->capture_default_str();
}

void AddComputeFlags(CLI::App& app, ComputeSettings& c) {
  app.add_option("--device", c.device,
                 "cpu, cuda, cuda:N, or auto (cuda when a GPU is visible; cuda alone picks "
                 "GPU --local-rank, else GPU rank % visible GPUs)")
      ->capture_default_str();
  app.add_option("--local-rank", c.local_rank,
                 "this rank's place on its node, the GPU that --device cuda or auto picks "
                 "(default: the LOCAL_RANK environment variable, as torchrun sets it; else "
                 "rank % visible GPUs); nodes may hold different numbers of GPUs")
      ->envname("LOCAL_RANK")
      ->check(CLI::Range(0, 1023));
  app.add_option("--precision", c.precision,
                 "fp32 or bf16 (bf16 matmuls and activations, fp32 master weights and "
                 "optimizer); auto is bf16 on cuda, fp32 on cpu")
      ->check(CLI::IsMember({"auto", "fp32", "bf16"}))
      ->capture_default_str();
  app.add_flag("!--no-cuda-graphs", c.cuda_graphs,
               "launch every kernel of a step instead of replaying a recorded CUDA graph");
  app.add_flag("--recompute", c.recompute,
               "activation recompute: keep only each block's input and run its forward again "
               "in the backward (about a third more compute, one block's activations instead "
               "of all; --plan shows the difference)");
}

void AddShardFlags(CLI::App& app, ShardSettings& s) {
  app.add_option("--job", s.job, "job name on the shards")->capture_default_str();
  app.add_option("--server", s.servers, "shard worker endpoint, repeated in shard order");
  app.add_option("--server-key", s.server_keys,
                 "shard public key file, one per --server (or one for all)");
  app.add_option("--key", s.key, "this worker's key pair file (mode 0600)");
  app.add_flag("--insecure-plaintext", s.insecure_plaintext,
               "no CURVE (only against a shard started the same way)");
  app.add_option("--client-name", s.client_name,
                 "site or client name used in idempotency keys (default: site)");
  app.add_option("--request-timeout-ms", s.timeout_ms, "per shard request attempt")
      ->capture_default_str();
}

void AddTrainFlags(CLI::App& app, TrainSettings& t) {
  AddModelFlags(app, t.model);
  AddComputeFlags(app, t.compute);
  AddShardFlags(app, t.shards);
  app.add_option("--data", t.data_dir, "folder with train.bin and val.bin (isthmus-data build)");
  app.add_flag("--plan", t.plan,
               "print the memory this rank's device needs for the model, its gradients, the "
               "optimizer and the activations of --batch-size x --context, against what the "
               "device has free, and stop (exit 0 when it fits, 8 when it does not); nothing "
               "else is needed (no --data, shards or rounds)");
  app.add_option("--rank", t.rank, "this rank in the site")->capture_default_str();
  app.add_option("--world-size", t.world_size, "ranks in the site")->capture_default_str();
  app.add_option("--rendezvous", t.rendezvous, "tcp:HOST:PORT or file:DIR (world-size > 1)");
  app.add_option("--comm-host", t.comm_host, "address this rank's Gloo connections use")
      ->capture_default_str();
  app.add_option("--comm-timeout", t.comm_timeout_s, "seconds before an in-site collective fails")
      ->capture_default_str();
  app.add_option("--steps-per-round", t.steps_per_round, "inner steps per round H (default 80)");
  app.add_option("--round-seconds", t.round_seconds,
                 "target round duration; adapts H each round from the measured step time");
  app.add_flag("--overlap,!--no-overlap", t.overlap,
               "push, wait for the WAN and pull in the background while the next round "
               "trains; the pulled state is merged at a step boundary (default on)");
  app.add_flag("--pull-by-replay,!--no-pull-by-replay", t.pull_by_replay,
               "pull each round as the sites' encoded deltas and replay the commits here, "
               "checked against the shard's digest, instead of pulling every tensor (default "
               "on; the first pull, and one after more than sync.replay_rounds rounds, brings "
               "the whole state)");
  app.add_option("--merge-after-steps", t.merge_after_steps,
                 "with --overlap: merge the pulled state no earlier than this many steps into "
                 "the next round, then as soon as it has arrived (default: a tenth of the "
                 "round's steps, at least 1; 0: as soon as it arrives)");
  app.add_flag("--merge-wait", t.merge_wait,
               "with --overlap: merge at exactly the --merge-after-steps step, waiting for "
               "the pulled state there if it has not arrived (reproducible runs; a stall "
               "when the WAN is slower)");
  app.add_flag("--encode-deltas,!--no-encode-deltas", t.encode_deltas,
               "rank 0 encodes each round's delta with the pipelines the shards choose "
               "(error feedback in a residual kept in its checkpoint) and pushes the few MB "
               "the WAN carries to every shard, instead of every rank pushing its shards the "
               "fp32 delta (default off; a job that does not sync gets the fp32 delta)");
  app.add_option("--encode-threads", t.encode_threads,
                 "with --encode-deltas: threads rank 0 encodes a round's tensors on")
      ->capture_default_str();
  app.add_option("--max-rounds", t.max_rounds, "stop after this many rounds (0: no bound)");
  app.add_option("--max-steps", t.max_steps, "stop after this many steps (0: no bound)");
  app.add_option("--lr", t.lr, "peak learning rate")->capture_default_str();
  app.add_option("--min-lr", t.min_lr, "floor of the cosine decay")->capture_default_str();
  app.add_option("--warmup-steps", t.warmup_steps, "linear warmup steps")->capture_default_str();
  app.add_option("--weight-decay", t.weight_decay, "AdamW decoupled weight decay")
      ->capture_default_str();
  app.add_option("--grad-clip", t.grad_clip, "global gradient-norm bound (0: off)")
      ->capture_default_str();
  app.add_option("--batch-size", t.batch_size,
                 "sequences per rank per forward and backward (x --grad-accum per step)")
      ->capture_default_str();
  app.add_option("--grad-accum", t.grad_accum,
                 "gradient accumulation: each optimizer step sums the gradients of this many "
                 "batches of --batch-size, run one after the other (activations for one), as "
                 "one step on a batch this many times larger")
      ->capture_default_str();
  app.add_option("--bucket-mb", t.bucket_mb,
                 "with --world-size > 1: average the gradient across the site's ranks in "
                 "buckets of this many MiB, each started as soon as the backward has "
                 "finished it, so the all-reduce overlaps with the rest of the backward; 0: "
                 "one all-reduce after the backward. Every rank must give the same value")
      ->capture_default_str();
  app.add_option("--reduce-precision", t.reduce_precision,
                 "with --world-size > 1: the gradient all-reduce's values on the wire, fp32 or "
                 "bf16 (half the bytes, as PyTorch DDP's bf16 compression hook: sums rounded "
                 "to bf16 between ranks, the average formed in fp32). Every rank must give the "
                 "same value")
      ->capture_default_str();
  app.add_flag("--shard-optimizer", t.shard_optimizer,
               "with --world-size > 1: split the AdamW moments across the site's ranks (ZeRO-1): "
               "each rank keeps and updates 1/world-size of them and the ranks all-gather the "
               "parameters after every step; the same steps as without, bit for bit, in less "
               "memory. Checkpoints keep the whole moments. Every rank must give it or none")
      ->capture_default_str();
  app.add_option("--teacher-topk", t.teacher_topk,
                 "word-level distillation: a teacher's top-k logits over the training shard "
                 "(isthmus-worker teach writes DATA/train.topk); the loss becomes alpha * CE + "
                 "(1 - alpha) * T^2 * KL(teacher || student) on the learned positions. The "
                 "cache must have been computed on this very shard (its digest) with the "
                 "student's vocabulary; validation stays cross-entropy");
  app.add_option("--distill-alpha", t.distill_alpha,
                 "with --teacher-topk: weight of the cross-entropy on the reference, in [0, 1]")
      ->capture_default_str();
  app.add_option("--distill-temperature", t.distill_temperature,
                 "with --teacher-topk: softmax temperature T of teacher and student, > 0")
      ->capture_default_str();
  app.add_option("--data-seed", t.data_seed, "seed of the per-epoch data order")
      ->capture_default_str();
  app.add_option("--val-every", t.val_every, "validation every N steps (0: only at the end)")
      ->capture_default_str();
  app.add_option("--val-batches", t.val_batches,
                 "validation batches per rank (the ranks together take the first "
                 "val-batches x ranks of one order)")
      ->capture_default_str();
  app.add_option("--log-every", t.log_every, "plain progress line every N steps (not a TTY)")
      ->capture_default_str();
  app.add_option("--checkpoint-dir", t.checkpoint_dir, "own resumable checkpoint (rank-N files)");
  app.add_option("--checkpoint-state-every", t.checkpoint_state_every,
                 "with --overlap on a synced run: write the model and AdamW's moments into the "
                 "checkpoint every N rounds (round 1, N + 1, ...); the rounds between write "
                 "only what their push needs (the round's delta, the residual, the counters "
                 "and the data position) to rank-R.round.safetensors. After a crash the round "
                 "kept is pushed, the model comes from the shards and the moments from the "
                 "last full checkpoint (up to N - 1 rounds old). Default: 4 in full mode "
                 "with --overlap on a synced run, else 1");
  app.add_flag("--checkpoint-direct", t.checkpoint_direct,
               "write the checkpoint past the page cache (O_DIRECT; buffered where the file "
               "system refuses it): faster and lighter on the CPU on some disks, slower on "
               "others; `bench_train --checkpoint-images 3 --checkpoint-dir DIR` compares the "
               "two on yours");
  app.add_flag("--standalone", t.standalone, "no shards: plain local training");
  app.add_option("--init", t.init, "standalone: trainable tensors to start from");
  app.add_option("--save", t.save, "standalone: write final trainable tensors here");
  app.add_option("--json-summary", t.json_summary, "write final figures as JSON here");
  app.add_option("--metrics-listen", t.metrics_listen,
                 "rank 0 serves Prometheus metrics at http://HOST:PORT/metrics (plain HTTP: "
                 "loopback or a monitoring network)");
  app.add_option("--events", t.events,
                 "rank 0 appends one JSON line per round and per validation to this file");
  app.add_option("--eval-set", t.eval_sets,
                 "NAME=DIR: a validation set (DIR/val.bin) evaluated with --eval-every-rounds; "
                 "repeatable (e.g. one per language)");
  app.add_option("--translate-set", t.translate_sets,
                 "LANG=FILE (a heldout-LANG.jsonl of isthmus-data parallel): at each evaluation "
                 "(--eval-every-rounds) rank 0 also translates the first --translate-lines "
                 "sources greedily and writes them to EVENTS.translations/LANG-rROUND.jsonl "
                 "(what deploy/chrf.py scores; deploy/report.py plots chrF by round); "
                 "byte-level models; repeatable");
  app.add_option("--translate-lines", t.translate_lines, "lines per --translate-set")
      ->capture_default_str();
  app.add_option("--eval-every-rounds", t.eval_every_rounds,
                 "after the pull of every Nth round, evaluate the merged model on the site's "
                 "own validation data and every --eval-set (0: off)")
      ->capture_default_str();
  app.add_option("--log-level", t.log_level, "trace debug info warn error off")
      ->capture_default_str();
  app.add_flag("!--no-progress", t.progress, "plain log lines even on a terminal");
}

}  // namespace isthmus::worker
