// isthmus-worker: one process per rank of a site. Subcommands: init (initial trainable
// tensors for `isthmusctl job create`), train (the round loop), eval (validation loss),
// export (a job's tensors as safetensors, a Hugging Face folder or a PEFT adapter),
// generate (sample text from a model) and teach (a teacher's top-k logits over a task
// shard, for distillation).
#include <unistd.h>
#include <CLI/CLI.hpp>
#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>

#include "common/durable.h"
#include "common/hf_checkpoint.h"
#include "common/log.h"
#include "common/safetensors.h"
#include "worker/data/bpe_tokenizer.h"
#include "worker/data/teacher_cache.h"
#include "worker/data/token_dataset.h"
#include "worker/data/tokenizer.h"
#include "worker/generation.h"
#include "worker/round_loop.h"

namespace {

using namespace isthmus;
using namespace isthmus::worker;

std::atomic<bool> g_stop{false};

extern "C" void OnSignal(int) { g_stop.store(true); }  // lock-free atomic: signal-safe

const std::string kExitCodes = ExitCodesFooter();

int Fail(const char* what, const Status& st) {
  std::fprintf(stderr, "isthmus-worker %s: %s\n", what, st.ToString().c_str());
  return ExitCodeFor(st);
}

// CLI11 reads a config file only for the top-level command, so the file of `train --config
// FILE` would be ignored. This reads it into `t` with a parser of its own before the
// command line is parsed (so a flag on the command line wins) and refuses a key that is no
// flag of train. Returns kExitOk, or kExitUsage after saying why.
int ReadTrainConfig(int argc, char** argv, TrainSettings& t) {
  if (argc < 2 || std::string_view(argv[1]) != "train") return kExitOk;
  std::string path;
  for (int i = 2; i < argc; ++i) {
    std::string_view arg = argv[i];
    if (arg == "--config" && i + 1 < argc) {
      path = argv[i + 1];
    } else if (arg.starts_with("--config=")) {
      path = std::string(arg.substr(9));
    }
  }
  if (path.empty()) return kExitOk;
  CLI::App file_app{"isthmus-worker train --config"};
  file_app.set_config("--config", "", "", /*config_required=*/true);
  file_app.allow_config_extras(CLI::config_extras_mode::error);
  AddTrainFlags(file_app, t);
  std::string flag = "--config=" + path;
  char* args[] = {argv[0], flag.data()};
  try {
    file_app.parse(2, args);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "isthmus-worker train: --config %s: %s\n", path.c_str(), e.what());
    return kExitUsage;
  }
  return kExitOk;
}

struct InitArgs {
  ModelSettings model;
  std::string out;
  std::string write_base;
};

int RunInit(InitArgs& a) {
  if (!a.model.base.empty() && !a.write_base.empty()) {
    std::fprintf(stderr, "isthmus-worker init: give --base or --write-base, not both\n");
    return kExitUsage;
  }
  if (a.model.base.empty() && a.write_base.empty()) {
    std::fprintf(stderr, "isthmus-worker init: give --base FILE or --write-base FILE\n");
    return kExitUsage;
  }
  auto gpt = BuildModel(a.model);
  if (!gpt.ok()) return Fail("init", gpt.status());
  if (!a.write_base.empty()) {
    if (auto st = (*gpt)->SaveBase(a.write_base); !st.ok()) return Fail("init", st);
  }
  auto meta = (*gpt)->ConfigMetadata();
  meta.merge(a.model.TrainableMetadata());
  if (auto st = WriteSafetensors(a.out, (*gpt)->ExportTrainable(), meta); !st.ok()) {
    return Fail("init", st);
  }
  std::printf("%s\n", (*gpt)->BaseHash().c_str());
  std::fprintf(stderr, "wrote %s (%zu trainable tensors)%s%s; base hash above\n", a.out.c_str(),
               (*gpt)->Trainable().size(), a.write_base.empty() ? "" : " and base ",
               a.write_base.c_str());
  return kExitOk;
}

// train --plan: the memory table of this rank's configuration; exit 0 when it fits.
int RunPlan(TrainSettings& t) {
  Status st = t.model.Validate();
  if (st.ok()) st = t.compute.Validate();
  if (st.ok() && t.batch_size < 1) st = Status::InvalidArgument("--batch-size must be >= 1");
  if (!st.ok()) return Fail("train --plan", UsageError(st.message()));
  auto compute = OpenCompute(t.compute, t.rank);
  if (!compute.ok()) return Fail("train --plan", compute.status());
  auto distill_k = TeacherCacheK(t.teacher_topk);
  if (!distill_k.ok()) return Fail("train --plan", distill_k.status());
  auto plan = PlanTraining(t.model, compute->Model(), t.batch_size, !t.standalone, *distill_k,
                           t.OptimizerShards());
  if (!plan.ok()) return Fail("train --plan", plan.status());
  std::printf("%s", plan->table.c_str());
  if (!plan->fits.ok()) {
    std::printf("does not fit: %s\n", plan->fits.message().c_str());
    return kExitOutOfMemory;
  }
  std::printf("fits\n");
  return kExitOk;
}

// SIGINT and SIGTERM set g_stop: the running command stops at its next safe point.
void StopOnSignals() {
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

int RunTrain(TrainSettings& t) {
  if (t.plan) return RunPlan(t);
  if (auto st = InitLogging("isthmus-worker", t.log_level); !st.ok()) return Fail("train", st);
  if (auto st = t.Validate(); !st.ok()) {
    std::fprintf(stderr, "isthmus-worker train: %s\n", st.message().c_str());
    return kExitUsage;
  }
  StopOnSignals();
  auto r = RunTraining(t, g_stop);
  if (!r.ok()) return Fail("train", r.status());
  return r->interrupted ? kExitInterrupted : kExitOk;
}

struct EvalArgs {
  ModelSettings model;
  ComputeSettings compute;
  ShardSettings shards;
  std::string trainable;  // safetensors; empty: pull from --server
  std::string data_dir;
  int batch_size = 8;
  int batches = 16;
  bool json = false;
};

// How notes and errors name where trainable tensors came from.
std::string TrainableSource(const std::string& path) { return "the trainable tensors in " + path; }
std::string JobSource(const std::string& job) {
  return "the tensors of job '" + job + "' on the shards";
}

// Prints a note of `what` on stderr (something assumed), unless empty.
void Note(const char* what, const std::string& note) {
  if (!note.empty()) std::fprintf(stderr, "isthmus-worker %s: note: %s\n", what, note.c_str());
}

// A job's tensors pulled from its shards, and the base hash the job was created with.
struct PulledJob {
  std::vector<Tensor> tensors;
  std::string base_hash;  // empty when the job records none
};

// The job's tensors from the shards of --server (a hello that leaves the base unchecked,
// then a pull); the model flags not given are taken from them (mode, LoRA rank and
// targets; the shards keep no LoRA alpha: `note` says what is assumed). The caller checks
// the base with CheckJobBase once its model is built.
Result<PulledJob> PullJob(const ShardSettings& shards, ModelSettings& model, std::string* note) {
  ISTHMUS_ASSIGN_OR_RETURN(auto site, ConnectSite(shards));
  ISTHMUS_ASSIGN_OR_RETURN(auto hellos, HelloSite(*site, ""));
  PulledJob out;
  for (const auto& h : hellos) {
    if (out.base_hash.empty()) out.base_hash = h.base_hash;
  }
  ISTHMUS_ASSIGN_OR_RETURN(out.tensors, PullSite(*site));
  Status st = model.ResolveTrainable(out.tensors, {}, JobSource(shards.job), note);
  if (!st.ok()) return UsageError(st.message());
  return out;
}

// A refusal when the job was created for another base than `gpt`'s (what a shard's hello
// would refuse; PullJob did not ask it to check).
Status CheckJobBase(const PulledJob& job, const model::Gpt& gpt, const std::string& name) {
  const std::string ours = gpt.BaseHash();
  if (job.base_hash.empty() || job.base_hash == ours) return Status::Ok();
  return Refused("job '" + name + "' was created for another base model (" + job.base_hash +
                 ") than --base (" + ours + "): give the job's base");
}

// The tensors of a trainable-tensors file (init --out, train --save, a checkpoint or an
// export), without optimizer state; the model flags not given are taken from it, and
// `note` says what is assumed (an older file without the LoRA alpha).
Result<std::vector<Tensor>> ReadTrainable(const std::string& path, ModelSettings& model,
                                          std::string* note) {
  ISTHMUS_ASSIGN_OR_RETURN(SafetensorsFile file, ReadHfCheckpoint(path));
  std::vector<Tensor> tensors;
  for (auto& t : file.tensors) {
    // Not the optimizer state, nor a checkpoint's round state: a round not yet pushed
    // ("unpushed.") and --encode-deltas' residual ("residual.").
    if (t.name.rfind("opt.", 0) != 0 && t.name.rfind("unpushed.", 0) != 0 &&
        t.name.rfind("residual.", 0) != 0) {
      tensors.push_back(std::move(t));
    }
  }
  Status st = model.ResolveTrainable(tensors, file.metadata, TrainableSource(path), note);
  if (!st.ok()) return UsageError(st.message());
  return tensors;
}

// A model to evaluate or sample from, and the backend it lives on (which must outlive it).
struct LoadedModel {
  OpenedCompute compute;
  std::unique_ptr<model::Gpt> gpt;
};

// eval's and generate's model: the base on the chosen device with activations for
// `batch` rows of n_ctx, plus trainable tensors from `trainable` (a file), else pulled from
// the shards of `shards`, else none (the base alone). `what` names the subcommand in notes.
Result<LoadedModel> LoadModel(const char* what, ModelSettings& m, const ComputeSettings& c,
                              const ShardSettings& shards, const std::string& trainable,
                              int batch) {
  std::vector<Tensor> tensors;
  std::optional<PulledJob> pulled;
  std::string note;
  if (!trainable.empty()) {
    ISTHMUS_ASSIGN_OR_RETURN(tensors, ReadTrainable(trainable, m, &note));
  } else if (!shards.servers.empty()) {
    ISTHMUS_ASSIGN_OR_RETURN(pulled, PullJob(shards, m, &note));
    tensors = std::move(pulled->tensors);
  }
  Note(what, note);
  LoadedModel out;
  auto compute = OpenCompute(c, 0);
  if (!compute.ok()) return DeviceError(compute.status());
  out.compute = std::move(compute).value();
  ISTHMUS_ASSIGN_OR_RETURN(out.gpt, BuildModel(m, {out.compute.ops.get(), out.compute.precision}));
  if (auto st = out.gpt->Reserve(batch, out.gpt->config().n_ctx); !st.ok()) {
    return DeviceError(st);
  }
  if (pulled) ISTHMUS_RETURN_IF_ERROR(CheckJobBase(*pulled, *out.gpt, shards.job));
  if (!tensors.empty()) ISTHMUS_RETURN_IF_ERROR(out.gpt->LoadTrainable(tensors, true));
  return out;
}

int RunEval(EvalArgs& a) {
  auto loaded = LoadModel("eval", a.model, a.compute, a.shards, a.trainable, a.batch_size);
  if (!loaded.ok()) return Fail("eval", loaded.status());
  auto& gpt = loaded->gpt;
  auto loss = ValidationLoss(*gpt, a.data_dir + "/val.bin", a.batch_size, 0, 1, a.batches, nullptr);
  if (!loss.ok()) return Fail("eval", loss.status());
  if (a.json) {
    std::printf("%s\n", nlohmann::json({{"val_loss", *loss}}).dump().c_str());
  } else {
    std::printf("val loss %.4f\n", *loss);
  }
  return kExitOk;
}

struct ExportArgs {
  ModelSettings model;
  ShardSettings shards;
  std::string trainable;  // offline source; else the shards
  std::string out;
  std::string hf_dir;
  std::string peft_dir;
  double max_shard_mb = kHfDefaultShardBytes / 1e6;  // --hf-dir shards above this size
  std::string dtype = "fp32";                        // of --hf-dir's tensors
};

int RunExport(ExportArgs& a) {
  auto usage = [](const std::string& m) {
    std::fprintf(stderr, "isthmus-worker export: %s\n", m.c_str());
    return kExitUsage;
  };
  if (a.out.empty() && a.hf_dir.empty() && a.peft_dir.empty()) {
    return usage("nothing to write: give --out FILE, --hf-dir DIR and/or --peft-dir DIR");
  }
  auto dtype = ParseFileDtype(a.dtype);
  if (!dtype.ok()) return usage("--dtype: " + dtype.status().message());
  if (a.trainable.empty() && a.shards.servers.empty()) {
    return usage("no tensors to export: give --trainable FILE (offline) or --server (shards)");
  }
  if (!a.trainable.empty() && !a.shards.servers.empty()) {
    return usage("give --trainable FILE or --server, not both");
  }
  for (const auto& [flag, dir] : {std::pair{"--hf-dir", &a.hf_dir}, {"--peft-dir", &a.peft_dir}}) {
    if (!dir->empty() && a.model.base.empty()) {
      return usage(std::string(flag) + " needs --base (the base model the folder is written from)");
    }
  }
  std::vector<Tensor> tensors;
  std::optional<PulledJob> pulled;
  std::string note;  // not printed: export says what it does without the alpha
  const std::string source =
      a.trainable.empty() ? JobSource(a.shards.job) : TrainableSource(a.trainable);
  if (!a.trainable.empty()) {
    auto t = ReadTrainable(a.trainable, a.model, &note);
    if (!t.ok()) return Fail("export", t.status());
    tensors = std::move(t).value();
  } else {
    auto p = PullJob(a.shards, a.model, &note);
    if (!p.ok()) return Fail("export", p.status());
    pulled = std::move(p).value();
    tensors = std::move(pulled->tensors);
  }
  if (!a.peft_dir.empty() && a.model.mode == "full") {
    return usage("--peft-dir: a full-mode job has no adapters; --hf-dir writes the model");
  }
  // An adapter's alpha is part of what it means: never written on an assumption.
  if (!a.peft_dir.empty() && a.model.lora_alpha_assumed) {
    return usage(source +
                 " carry no record of the LoRA alpha, which a PEFT adapter needs: give "
                 "--lora-alpha (the job's: worker checkpoints and `init --out` files record it "
                 "as metadata lora_alpha)");
  }
  std::unique_ptr<model::Gpt> gpt;
  if (!a.model.base.empty()) {
    auto g = BuildModel(a.model);
    if (!g.ok()) return Fail("export", g.status());
    gpt = std::move(g).value();
    if (pulled) {
      if (auto st = CheckJobBase(*pulled, *gpt, a.shards.job); !st.ok()) return Fail("export", st);
    }
    // The tensors must fit the base's model: checked before anything is written.
    if (auto st = gpt->LoadTrainable(tensors, true); !st.ok()) return Fail("export", st);
  }
  if (!a.out.empty()) {
    std::map<std::string, std::string> meta = a.model.TrainableMetadata();
    if (a.model.lora_alpha_assumed) {
      meta.erase("lora_alpha");  // not known: the file says nothing rather than a guess
      Note("export", source + " carry no record of the LoRA alpha, and neither does " + a.out +
                         " (give --lora-alpha to record it)");
    }
    if (gpt) meta.merge(gpt->ConfigMetadata());
    if (pulled) meta["job"] = a.shards.job;
    if (auto st = WriteSafetensors(a.out, tensors, meta); !st.ok()) return Fail("export", st);
    std::fprintf(stderr, "wrote %s (%zu tensors)\n", a.out.c_str(), tensors.size());
  }
  if (a.hf_dir.empty() && a.peft_dir.empty()) return kExitOk;  // --out alone: no folder
  // LoRA: the HF folder holds the frozen base the adapter applies to; full: the model.
  std::string hf_dir = a.hf_dir;
  if (hf_dir.empty()) hf_dir = a.peft_dir + "/base";
  const auto shard_bytes = static_cast<uint64_t>(a.max_shard_mb * 1e6);
  if (auto st = gpt->SaveHuggingFace(hf_dir, shard_bytes, *dtype); !st.ok()) {
    return Fail("export", st);
  }
  // The base folder's tokenizer goes with the model, so the folder is whole for
  // AutoTokenizer too.
  std::string tokenizer_files;
  for (const char* name : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                           "vocab.json", "merges.txt", "generation_config.json"}) {
    const std::string from = a.model.given_base + "/" + name;
    std::error_code ec;
    if (!std::filesystem::is_regular_file(from, ec)) continue;
    std::ifstream in(from, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (!in.good() && !in.eof()) return Fail("export", Status::IoError("cannot read " + from));
    if (auto st = WriteFileDurably(hf_dir + "/" + name, bytes); !st.ok()) return Fail("export", st);
    tokenizer_files += std::string(", ") + name;
  }
  std::fprintf(stderr, "wrote Hugging Face %s folder %s (config.json, %s%s)\n",
               a.model.mode == "full" ? "model" : "base", hf_dir.c_str(),
               std::filesystem::exists(hf_dir + "/" + kHfIndexFile)
                   ? "model-*-of-*.safetensors and their index"
                   : kHfSingleFile,
               tokenizer_files.c_str());
  if (!a.peft_dir.empty()) {
    if (auto st = gpt->SavePeftAdapter(a.peft_dir, hf_dir); !st.ok()) return Fail("export", st);
    std::fprintf(stderr, "wrote PEFT adapter %s (its base: %s)\n", a.peft_dir.c_str(),
                 hf_dir.c_str());
  }
  return kExitOk;
}

struct GenerateArgs {
  ModelSettings model;
  ComputeSettings compute;
  ShardSettings shards;
  std::string trainable;  // else pulled from --server, else the base alone
  std::string tokenizer;  // BPE folder or tokenizer.json; default: the base folder's, or bytes
  std::string prompt;
  int tokens = 200;
  double temperature = 0.8;
  int top_k = 40;
  uint64_t seed = 1;
  // Translation (a model fine-tuned on isthmus-data parallel's task): the target language;
  // the prompt (or each "source" of --input) is English.
  std::string translate;
  std::string input;   // JSON lines with "source" (and "target", kept as the reference)
  std::string output;  // where --input's translations go (JSON lines); default stdout
  bool temperature_given = false;
};

// Samples text from the model: the prompt's tokens, then one token at a time from the
// softmax of the last position's logits (temperature, top-k; temperature 0 takes the most
// likely token), the window sliding over the last n_ctx tokens.
int RunGenerate(GenerateArgs& a) {
  auto usage = [](const std::string& m) {
    std::fprintf(stderr, "isthmus-worker generate: %s\n", m.c_str());
    return kExitUsage;
  };
  if (a.model.base.empty()) return usage("give --base (the model to sample from)");
  if (a.tokens < 0 || a.temperature < 0 || a.top_k < 0) {
    return usage("--tokens, --temperature and --top-k must not be negative");
  }
  if (a.translate.empty() && (!a.input.empty() || !a.output.empty())) {
    return usage("--input and --output translate a file: give --translate LANGUAGE too");
  }
  if (a.input.empty() && a.prompt.empty()) {
    return usage("give --prompt (or, with --translate, --input FILE)");
  }
  // Translations are greedy unless a temperature is asked for.
  if (!a.translate.empty() && !a.temperature_given) a.temperature = 0;
  std::vector<TranslationPair> inputs;
  if (!a.input.empty()) {
    auto pairs = ReadTranslationPairs(a.input);
    if (!pairs.ok()) {
      if (pairs.status().code() == Code::kNotFound) return Fail("generate", pairs.status());
      return usage(pairs.status().message());
    }
    inputs = std::move(pairs).value();
  }
  auto loaded = LoadModel("generate", a.model, a.compute, a.shards, a.trainable, /*batch=*/1);
  if (!loaded.ok()) return Fail("generate", loaded.status());
  auto& gpt = loaded->gpt;
  const int vocab = gpt->config().vocab_size;
  // The tokenizer: --tokenizer, else a Hugging Face base folder's own files, else bytes.
  std::string tok_dir = a.tokenizer;
  std::error_code ec;
  if (tok_dir.empty() && (std::filesystem::exists(a.model.given_base + "/tokenizer.json", ec) ||
                          std::filesystem::exists(a.model.given_base + "/vocab.json", ec))) {
    tok_dir = a.model.given_base;
  }
  std::unique_ptr<data::BpeTokenizer> bpe;
  if (!tok_dir.empty()) {
    auto b = data::BpeTokenizer::LoadPath(tok_dir);
    if (!b.ok()) return Fail("generate", UsageError(b.status().message()));
    bpe = std::move(b).value();
  }
  const TextCodec codec(std::move(bpe));
  const int tok_vocab = codec.vocab_size();
  if (tok_dir.empty() && vocab != tok_vocab) {
    return usage("the model has " + std::to_string(vocab) +
                 " tokens, not 256 bytes: give --tokenizer (its tokenizer.json or BPE folder)");
  }
  if (tok_vocab > vocab) {
    return usage("the tokenizer has " + std::to_string(tok_vocab) + " tokens but the model " +
                 std::to_string(vocab));
  }
  Generator generator(*gpt, codec, {a.tokens, a.temperature, a.top_k, a.seed});

  if (!a.translate.empty()) {
    if (inputs.empty()) {
      auto text = generator.Translate(a.prompt, a.translate);
      if (!text.ok()) return Fail("generate", text.status());
      std::printf("%s\n", text->c_str());
      return kExitOk;
    }
    std::ofstream file;
    if (!a.output.empty()) {
      file.open(a.output, std::ios::trunc);
      if (!file) return Fail("generate", Status::IoError(a.output + ": cannot create"));
    }
    std::ostream& out = a.output.empty() ? std::cout : file;
    for (const auto& pair : inputs) {
      auto text = generator.Translate(pair.source, a.translate);
      if (!text.ok()) return Fail("generate", text.status());
      out << TranslationJsonLine(pair, *text) << "\n";
    }
    out.flush();
    if (!out) return Fail("generate", Status::IoError(a.output + ": write failed"));
    std::fprintf(stderr, "translated %zu lines into %s\n", inputs.size(), a.translate.c_str());
    return kExitOk;
  }

  auto encoded = codec.Encode(a.prompt);
  if (!encoded.ok()) return Fail("generate", encoded.status());
  std::vector<int32_t> ids = std::move(encoded).value();
  if (ids.empty()) return usage("give a --prompt of at least one character");
  const size_t prompt_len = ids.size();
  if (auto st = generator.Extend(ids, /*stop_at_blank_line=*/false); !st.ok()) {
    return Fail("generate", st);
  }
  auto text = codec.Decode(ids);
  if (!text.ok()) return Fail("generate", text.status());
  std::fwrite(text->data(), 1, text->size(), stdout);
  std::fputc('\n', stdout);
  std::fprintf(stderr, "generated %zu tokens after a prompt of %zu\n", ids.size() - prompt_len,
               prompt_len);
  return kExitOk;
}

}  // namespace

struct TeachArgs {
  ModelSettings model;  // the teacher
  ComputeSettings compute;
  ShardSettings shards;
  std::string trainable;  // the teacher's trained tensors; else pulled, else the base alone
  std::string data_dir;   // a task shard (isthmus-data parallel)
  std::string out;        // default DATA/train.topk
  int k = 32;
  int batch_size = 8;
};

// Runs the frozen teacher over every window of the training shard once and writes, for each
// position the student learns, the teacher's k largest logits (data/teacher_cache.h).
int RunTeach(TeachArgs& a) {
  auto usage = [](const std::string& m) {
    std::fprintf(stderr, "isthmus-worker teach: %s\n", m.c_str());
    return kExitUsage;
  };
  const std::string manifest_path = a.data_dir + "/manifest.json";
  std::ifstream mf(manifest_path);
  if (!mf)
    return usage(manifest_path + ": cannot open; give --data a folder of isthmus-data parallel");
  const auto manifest = nlohmann::json::parse(mf, nullptr, false);
  if (!manifest.is_object() || !manifest.contains("loss_mask")) {
    return usage(a.data_dir +
                 " holds no task shard with a loss mask: distillation reads "
                 "isthmus-data parallel's shards");
  }
  const int shard_vocab = manifest.value("vocab_size", 0);
  const std::string tokenizer = manifest.value("tokenizer", std::string("byte"));
  const int64_t seq_len = manifest.value("example_tokens", int64_t{0});
  auto loaded = LoadModel("teach", a.model, a.compute, a.shards, a.trainable, a.batch_size);
  if (!loaded.ok()) return Fail("teach", loaded.status());
  model::Gpt& gpt = *loaded->gpt;
  const int V = gpt.config().vocab_size;
  if (V != shard_vocab) {
    return Fail("teach", Status::InvalidArgument("the teacher's vocabulary (" + std::to_string(V) +
                                                 " ids) is not that of the shard's tokenizer (" +
                                                 tokenizer + ", " + std::to_string(shard_vocab) +
                                                 " ids): teacher and student must "
                                                 "use the tokenizer the shards were built with"));
  }
  if (a.k < 1 || a.k > V) {
    return usage("--k must be in [1, " + std::to_string(V) + "] (the vocabulary), got " +
                 std::to_string(a.k));
  }
  if (seq_len > gpt.config().n_ctx) {
    return usage("the shard's examples are " + std::to_string(seq_len) +
                 " tokens, longer than the teacher's context " +
                 std::to_string(gpt.config().n_ctx));
  }
  data::DatasetOptions d;
  d.batch_size = 1;
  d.seq_len = seq_len;
  d.vocab_size = V;
  auto ds = data::TokenDataset::Open(a.data_dir + "/train.bin", d);
  if (!ds.ok()) return Fail("teach", ds.status());
  const std::vector<uint64_t> offsets = data::TargetOffsets(*ds);
  data::TeacherCacheInfo info;
  info.k = a.k;
  info.vocab_size = V;
  info.example_tokens = seq_len;
  info.shard_digest = ds->Digest();
  info.tokenizer = tokenizer;
  info.teacher = "base " + gpt.BaseHash() +
                 (a.trainable.empty() ? "" : ", trainable " + a.trainable) +
                 (a.trainable.empty() && !a.shards.servers.empty() ? ", job " + a.shards.job : "");
  info.positions = offsets.back();
  const std::string out = a.out.empty() ? a.data_dir + "/train.topk" : a.out;
  StopOnSignals();  // a stop leaves no cache (the writer removes OUT.tmp)
  auto writer = data::TeacherCacheWriter::Create(out, info);
  if (!writer.ok()) return Fail("teach", writer.status());
  const uint64_t windows = ds->num_windows();
  const int T = static_cast<int>(seq_len);
  std::vector<int32_t> ids;
  std::vector<float> values;
  const auto t0 = std::chrono::steady_clock::now();
  for (uint64_t first = 0; first < windows && !g_stop.load(); first += a.batch_size) {
    const uint64_t count = std::min<uint64_t>(a.batch_size, windows - first);
    const data::Batch b = ds->Windows(first, count);
    gpt.Forward(b.tokens.data(), nullptr, static_cast<int>(count), T);
    if (Status st = gpt.ops().status(); !st.ok()) return Fail("teach", DeviceError(st));
    const std::vector<float> logits = gpt.Logits();
    ids.clear();
    values.clear();
    for (size_t i = 0; i < b.targets.size(); ++i) {
      if (b.targets[i] < 0) continue;
      ids.resize(ids.size() + a.k);
      values.resize(values.size() + a.k);
      data::SelectTopK(logits.data() + i * V, V, a.k, ids.data() + ids.size() - a.k,
                       values.data() + values.size() - a.k);
    }
    if (Status st = (*writer)->Append(ids.data(), values.data(), ids.size() / a.k); !st.ok()) {
      return Fail("teach", st);
    }
    if ((first / a.batch_size) % 200 == 0) {
      std::fprintf(stderr, "teach: window %llu of %llu\n", static_cast<unsigned long long>(first),
                   static_cast<unsigned long long>(windows));
    }
  }
  if (g_stop.load()) return Fail("teach", Interrupted("stopped before the cache was whole"));
  if (Status st = (*writer)->Finish(); !st.ok()) return Fail("teach", st);
  std::fprintf(stderr, "wrote %s: %llu positions x top-%d of %d windows in %.1f s (%.1f MB)\n",
               out.c_str(), static_cast<unsigned long long>(info.positions), a.k,
               static_cast<int>(windows),
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
               static_cast<double>(info.positions) * a.k * 8 / 1e6);
  return kExitOk;
}

int main(int argc, char** argv) {
  // OpenMP workers that spin between kernels take cores from the other ranks and from Gloo
  // (30x slower steps were measured on a loaded 2-core machine). libgomp reads the policy
  // when it is loaded, before main, so set it and start again once, unless the caller
  // chose a policy.
  if (std::getenv("OMP_WAIT_POLICY") == nullptr) {
    ::setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
    ::execv("/proc/self/exe", argv);  // returns only on failure; then run as we are
  }
  CLI::App app{"isthmus-worker: trains one rank of a site and syncs rounds with the shards"};
  app.footer(kExitCodes);
  app.require_subcommand(1);

  InitArgs init;
  auto* init_cmd =
      app.add_subcommand("init", "write the initial trainable tensors; print the base hash");
  AddModelFlags(*init_cmd, init.model);
  init_cmd
      ->add_option("--out", init.out, "trainable tensors (safetensors) for isthmusctl job create")
      ->required();
  init_cmd->add_option("--write-base", init.write_base, "also write a fresh random base here");

  TrainSettings train;
  auto* train_cmd = app.add_subcommand("train", "train this rank (see docs/WORKER.md)");
  train_cmd->set_config("--config", "", "TOML file with the same keys as the flags (flags win)");
  AddTrainFlags(*train_cmd, train);
  train_cmd->footer(kExitCodes);
  if (int rc = ReadTrainConfig(argc, argv, train); rc != kExitOk) return rc;

  EvalArgs eval;
  auto* eval_cmd = app.add_subcommand("eval", "validation loss of a model");
  AddModelFlags(*eval_cmd, eval.model);
  AddComputeFlags(*eval_cmd, eval.compute);
  AddShardFlags(*eval_cmd, eval.shards);
  eval_cmd->add_option("--trainable", eval.trainable,
                       "trainable tensors (else pulled from --server)");
  eval_cmd->add_option("--data", eval.data_dir, "folder with val.bin")->required();
  eval_cmd->add_option("--batch-size", eval.batch_size, "sequences per batch")
      ->capture_default_str();
  eval_cmd->add_option("--batches", eval.batches, "batches to evaluate")->capture_default_str();
  eval_cmd->add_flag("--json", eval.json, "print {\"val_loss\": ...}");

  ExportArgs exp;
  auto* export_cmd = app.add_subcommand(
      "export",
      "write a job's tensors (pulled from the shards, or from a file offline) as safetensors, "
      "a Hugging Face model folder and/or a PEFT adapter folder");
  AddModelFlags(*export_cmd, exp.model);
  AddShardFlags(*export_cmd, exp.shards);
  export_cmd->add_option("--trainable", exp.trainable,
                         "offline: trainable tensors from a file (train --save, init --out, a "
                         "checkpoint or an export) instead of --server");
  export_cmd->add_option("--out", exp.out, "safetensors file of the job's tensors");
  export_cmd->add_option("--hf-dir", exp.hf_dir,
                         "Hugging Face folder (config.json + model.safetensors, or shards "
                         "model-0000k-of-0000n.safetensors + model.safetensors.index.json "
                         "above --max-shard-mb) that AutoModelForCausalLM opens: the trained "
                         "model in full mode, the base in LoRA mode (needs --base)");
  export_cmd
      ->add_option("--max-shard-mb", exp.max_shard_mb,
                   "largest safetensors file of --hf-dir, in MB (10^6 bytes; transformers' "
                   "5GB default); a bigger model is written as shards with an index")
      ->check(CLI::Range(0.001, 1e9))
      ->capture_default_str();
  export_cmd
      ->add_option("--dtype", exp.dtype,
                   "element type of --hf-dir's tensors: fp32 (as trained), bf16 or fp16 "
                   "(rounded to nearest even; half the size; config.json's torch_dtype says "
                   "which)")
      ->capture_default_str();
  export_cmd->add_option("--peft-dir", exp.peft_dir,
                         "LoRA: PEFT adapter folder that AutoPeftModelForCausalLM opens; its "
                         "adapter_config.json names --hf-dir, or PEFT_DIR/base written for it "
                         "(needs --base)");
  export_cmd->footer(kExitCodes);

  GenerateArgs gen;
  auto* gen_cmd = app.add_subcommand(
      "generate",
      "sample text from a model (the base, plus trainable tensors from a file or "
      "the shards) to see what training did");
  AddModelFlags(*gen_cmd, gen.model);
  AddComputeFlags(*gen_cmd, gen.compute);
  AddShardFlags(*gen_cmd, gen.shards);
  gen_cmd->add_option("--trainable", gen.trainable,
                      "trainable tensors (else pulled from --server, else the base alone)");
  gen_cmd->add_option("--tokenizer", gen.tokenizer,
                      "a Hugging Face folder (tokenizer.json, else vocab.json + merges.txt) or "
                      "a tokenizer.json file; default: the --base folder's, or one token per "
                      "byte. Added tokens in the prompt (<|endoftext|>) become their ids");
  gen_cmd->add_option("--prompt", gen.prompt,
                      "text to continue (with --translate: the English text to translate)");
  gen_cmd->add_option("--tokens", gen.tokens, "tokens to generate")->capture_default_str();
  gen_cmd
      ->add_option("--temperature", gen.temperature,
                   "softmax temperature; 0 takes the most likely token every time")
      ->capture_default_str();
  gen_cmd->add_option("--top-k", gen.top_k, "sample among the k most likely tokens (0: all)")
      ->capture_default_str();
  gen_cmd->add_option("--sample-seed", gen.seed, "seed of the sampling")->capture_default_str();
  gen_cmd->add_option(
      "--translate", gen.translate,
      "translate into this language (de, fr, ...) with a model fine-tuned on isthmus-data "
      "parallel's task: the prompt \"en: <text>\\n<language>: \", greedy unless "
      "--temperature is given, up to the blank line that ends a translation (or --tokens); "
      "prints the translation only");
  gen_cmd
      ->add_option("--input", gen.input,
                   "with --translate: JSON lines with a \"source\" each (isthmus-data "
                   "parallel's heldout-<language>.jsonl), each translated")
      ->check(CLI::ExistingFile);
  gen_cmd->add_option("--output", gen.output,
                      "with --input: write {\"source\", \"translation\", \"reference\"} JSON "
                      "lines here (default: standard output); deploy/chrf.py scores them");
  gen_cmd->footer(kExitCodes);

  TeachArgs teach;
  auto* teach_cmd = app.add_subcommand(
      "teach",
      "run a frozen teacher over a task shard once and write its top-k logits for every "
      "learned position (DATA/train.topk), for train --teacher-topk (word-level "
      "distillation)");
  AddModelFlags(*teach_cmd, teach.model);
  AddComputeFlags(*teach_cmd, teach.compute);
  AddShardFlags(*teach_cmd, teach.shards);
  teach_cmd->add_option("--trainable", teach.trainable,
                        "the teacher's trained tensors (a LoRA or full checkpoint, train "
                        "--save, an export); else pulled from --server, else the base alone "
                        "(the pre-trained model as teacher)");
  teach_cmd->add_option("--data", teach.data_dir, "folder of isthmus-data parallel's shards")
      ->required();
  teach_cmd->add_option("--out", teach.out, "the cache (default: DATA/train.topk)");
  teach_cmd->add_option("--k", teach.k, "logits kept per position (the teacher's largest)")
      ->capture_default_str();
  teach_cmd->add_option("--batch-size", teach.batch_size, "windows per forward pass")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  teach_cmd->footer(kExitCodes);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int rc = app.exit(e);
    return rc == 0 ? kExitOk : kExitUsage;
  }
  // The model's shape comes from --base when there is one.
  auto resolve = [](const char* what, ModelSettings& m) {
    Status st = m.ResolveBaseShape();
    if (st.ok()) return kExitOk;
    if (st.code() != Code::kInvalidArgument) return Fail(what, st);
    return Fail(what, UsageError(st.message()));
  };
  if (init_cmd->parsed()) {
    if (int rc = resolve("init", init.model); rc != kExitOk) return rc;
    return RunInit(init);
  }
  if (train_cmd->parsed()) {
    if (int rc = resolve("train", train.model); rc != kExitOk) return rc;
    if (train.standalone && !train.init.empty()) {
      // The LoRA settings (or full mode) of the tensors it starts from.
      std::string note;
      auto t = ReadTrainable(train.init, train.model, &note);
      if (!t.ok()) return Fail("train", t.status());
      Note("train", note);
    }
    return RunTrain(train);
  }
  if (eval_cmd->parsed()) {
    if (int rc = resolve("eval", eval.model); rc != kExitOk) return rc;
    return RunEval(eval);
  }
  if (gen_cmd->parsed()) {
    if (int rc = resolve("generate", gen.model); rc != kExitOk) return rc;
    gen.temperature_given = gen_cmd->count("--temperature") > 0;
    return RunGenerate(gen);
  }
  if (teach_cmd->parsed()) {
    if (int rc = resolve("teach", teach.model); rc != kExitOk) return rc;
    return RunTeach(teach);
  }
  if (export_cmd->parsed()) {
    if (int rc = resolve("export", exp.model); rc != kExitOk) return rc;
    return RunExport(exp);
  }
  return kExitUsage;
}
