// The settings of isthmus-worker, declared once: each field has its default here and one
// flag (with its help line) in worker_config.cc. A TOML file given with --config sets the
// same names as flat keys (`layers = 6`, `server = ["tcp://..."]`); flags given on the
// command line override the file.
#pragma once

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/tensor.h"
#include "ops/ops.h"
#include "worker/model/gpt.h"
#include "worker/model/trainer.h"

namespace isthmus::worker {

// The largest --bucket-mb: a bucket beyond a GiB no longer overlaps anything.
inline constexpr int kMaxBucketMb = 1024;

// The model: shape, LoRA and where the frozen base comes from.
struct ModelSettings {
  int layers = 4;
  int width = 256;
  int heads = 4;
  int context = 256;  // n_ctx, and the sequence length T of every batch
  int lora_rank = 16;
  float lora_alpha = 32.0f;
  std::vector<std::string> lora_targets = {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"};
  std::string mode = "lora";    // lora | full
  std::string base;             // safetensors file of the base, or a Hugging Face GPT-2 folder
  uint64_t seed = 1;            // LoRA init and, without --base, the random base
  std::set<std::string> given;  // the shape flags set on the command line or in --config
  std::string given_base;       // --base as given (ResolveBaseShape may point it into a folder)
  int vocab_size = 256;         // bytes; a base's own vocabulary (ResolveBaseShape)
  // Set by ResolveTrainable when neither --lora-alpha nor the tensors' source said the LoRA
  // alpha (a file written before it was recorded, or tensors pulled from the shards, which
  // keep tensors only): lora_alpha is then the default, an assumption.
  bool lora_alpha_assumed = false;
  // The architecture beyond the five shape fields above: GPT-2 unless the base is a
  // Llama-family checkpoint (ResolveBaseShape takes its config.json).
  model::GptConfig arch;

  // With a base: takes the model's shape from it (n_layer from its blocks, n_embd from
  // wte, n_ctx from wpe, n_head from its metadata or the folder's config.json) and makes
  // `base` the safetensors file when it named a folder. A shape flag that was given and
  // contradicts the base is an InvalidArgument naming the flag and both values; so is a
  // base that records no head count when --heads was not given. No-op without a base.
  Status ResolveBaseShape();
  // ResolveBaseShape for a Llama-family base (its config.json parsed; `source` names the
  // base): the shape fields (a given flag that contradicts them is refused), `arch`, and the
  // LoRA targets (all the family's linears unless --lora-targets was given; PEFT's short
  // names such as q_proj taken for the family's).
  Status TakeLlamaShape(const model::GptConfig& config, const std::string& source);
  // Sets a shape field from the base (`source` names it); a flag given with another value is
  // an InvalidArgument naming the flag and both values.
  Status TakeFromBase(const char* flag, int& field, int64_t value, const std::string& source);
  // Takes what a set of trainable tensors (a file: init --out, train --save, a checkpoint,
  // an export; or the job's tensors pulled from the shards, with no metadata) says about
  // the training setup, for flags that were not given: the mode (full when it holds
  // wte.weight), the LoRA rank (from the lora_A shapes), targets (from the names) and alpha
  // (from its "lora_alpha" metadata). Only the names and shapes of `tensors` are read. A
  // given flag that contradicts them is an InvalidArgument naming the flag and both
  // values; so is a "lora_alpha" that is not a positive number. When the alpha is neither
  // given nor recorded (LoRA mode), lora_alpha_assumed is set and, if `note` is not null,
  // *note says so, naming `source` (e.g. the file) and the value assumed.
  Status ResolveTrainable(const std::vector<Tensor>& tensors,
                          const std::map<std::string, std::string>& metadata,
                          const std::string& source = "the trainable tensors",
                          std::string* note = nullptr);
  // The metadata files of trainable tensors carry (what ResolveTrainable reads back):
  // "train_mode", "lora_rank", "lora_alpha", "lora_targets" (comma-separated).
  std::map<std::string, std::string> TrainableMetadata() const;
  // The LoRA targets as a set of bits: bit i for kLoraTargetNames[i], then bit 4 + j for
  // kLlamaLoraTargetNames[j] (0 for a name that is none of them: Validate refuses those).
  uint32_t LoraTargetBits() const;
  // The inverse, in the canonical order.
  static std::vector<std::string> LoraTargetsFromBits(uint32_t bits);

  // "lora, rank 4, alpha 16, targets attn.c_attn,mlp.c_fc" or "full": for messages.
  std::string DescribeTraining() const;

  model::GptConfig Gpt() const;
  model::LoraConfig Lora() const;
  // InvalidArgument for a bad shape, LoRA config or mode.
  Status Validate() const;
};

// Where the model computes: the backend, the precision of matmuls and activations, and
// whether steps are recorded as CUDA graphs.
struct ComputeSettings {
  std::string device = "auto";     // auto | cpu | cuda | cuda:N (auto: cuda when a GPU is visible)
  std::string precision = "auto";  // auto | fp32 | bf16 (auto: bf16 on cuda, fp32 on cpu)
  bool cuda_graphs = true;
  bool recompute = false;  // activation recompute (model::Compute::recompute)
  int local_rank = -1;     // this rank's place on its node (--local-rank or LOCAL_RANK); -1: none

  // InvalidArgument for a malformed --device or --precision.
  Status Validate() const;
};

// The backend `c` names for rank `rank` and the precision it resolves to. Errors are the
// backend's (no GPU, a device out of range, a build without CUDA), with the flag named.
struct OpenedCompute {
  std::shared_ptr<ops::Ops> ops;
  ops::Dtype precision = ops::Dtype::kF32;
  int device_index = -1;   // the CUDA device, -1 on the CPU
  bool recompute = false;  // ComputeSettings::recompute
  // How a model computes on it.
  model::Compute Model() const { return {ops.get(), precision, recompute}; }
};
Result<OpenedCompute> OpenCompute(const ComputeSettings& c, int rank);

// Where the shards are and how to reach them.
struct ShardSettings {
  std::string job = "default";
  std::vector<std::string> servers;      // worker endpoints, in shard order
  std::vector<std::string> server_keys;  // one public key file per server, or one for all
  std::string key;                       // this worker's key pair file (mode 0600)
  bool insecure_plaintext = false;
  std::string client_name;  // goes into idempotency keys; default "site"
  int timeout_ms = 30000;   // per request attempt
};

// Everything `train` needs.
struct TrainSettings {
  ModelSettings model;
  ComputeSettings compute;
  ShardSettings shards;
  std::string data_dir;  // holds train.bin and val.bin (isthmus-data build)
  int rank = 0;
  int world_size = 1;
  std::string rendezvous;  // "tcp:HOST:PORT" or "file:DIR"; needed when world_size > 1
  std::string comm_host = "127.0.0.1";
  int comm_timeout_s = 300;  // bound on every in-site collective
  int steps_per_round = 0;   // H; 0 means 80 unless round_seconds is set
  double round_seconds = 0;  // > 0: adapt H each round to take about this long
  // The round boundary in the background (docs/SYNC.md, "The overlapped round"): the next
  // round trains while the round's push, wait for the WAN and pull run, and the pulled state
  // is merged at a step boundary. On by default: it matches or beats synchronous rounds on
  // quality (docs/BENCHMARKS.md, section 8) and hides the boundary (section 7).
  bool overlap = true;
  // Pull the rounds committed since the last pull as the sites' encoded deltas and replay
  // them here (ops/codec_replica.h; docs/SYNC.md, "Pulling by replay") instead of every
  // tensor: a few MB a round where full mode's state is hundreds.
  bool pull_by_replay = true;
  // With overlap: merge the round in flight no earlier than this many steps into the next
  // round, then as soon as it is done (-1, the default: a tenth of the round; 0: on
  // arrival); with merge_wait, at exactly that step, waiting for it there
  // (common/round_driver.h, MergePolicy).
  int merge_after_steps = -1;
  bool merge_wait = false;
  // Rank 0 encodes each round's delta itself with the pipelines the shards choose, with
  // error feedback in a residual kept in its checkpoint, and pushes the encoded bytes to
  // every shard (docs/SYNC.md, "Deltas encoded by the worker"), on encode_threads threads.
  bool encode_deltas = false;
  int encode_threads = 4;
  int64_t max_rounds = 0;  // 0: no bound
  int64_t max_steps = 0;   // 0: no bound (one of the two must be set)
  float lr = 3e-4f;
  float min_lr = 3e-5f;
  int64_t warmup_steps = 100;
  float weight_decay = 0.0f;
  float grad_clip = 1.0f;
  int batch_size = 8;
  int grad_accum = 1;  // batches of batch_size whose gradients one optimizer step sums
  // The in-site gradient all-reduce in buckets of this many MiB, started while the backward
  // runs (comm/bucketed_all_reduce.h); 0: one all-reduce of the whole gradient after it.
  int bucket_mb = 25;
  // The in-site all-reduce's values on the wire: "fp32", or "bf16" (half the bytes; sums
  // rounded to bf16 between hops, the average formed in fp32).
  std::string reduce_precision = "fp32";
  // ZeRO-1: the site's ranks split the AdamW moments, each updating its part of the
  // parameters and all-gathering them after the step (model::OptimizerShards).
  bool shard_optimizer = false;
  // The ranks the AdamW moments are split across: world_size with shard_optimizer, else 1.
  int OptimizerShards() const { return shard_optimizer ? std::max(world_size, 1) : 1; }
  // Word-level distillation from a teacher cache (isthmus-worker teach) beside the data:
  // loss = alpha CE + (1 - alpha) T^2 KL(teacher_T || student_T); empty: cross-entropy only.
  std::string teacher_topk;
  float distill_alpha = 0.5f;
  float distill_temperature = 2.0f;
  uint64_t data_seed = 0;
  int64_t val_every = 0;   // 0: validation only at the end
  int val_batches = 8;     // batches per rank per validation
  int64_t log_every = 10;  // plain log line every N steps when stderr is not a terminal
  std::string checkpoint_dir;
  bool checkpoint_direct = false;  // write the checkpoint with O_DIRECT (common/direct_file.h)
  // With --overlap on a synced run: the model and AdamW's moments go into the checkpoint
  // every N rounds; the rounds between write only the round in flight (rank-R.round file).
  // 0: CheckpointStateEvery() decides.
  int64_t checkpoint_state_every = 0;
  bool standalone = false;  // no shards: plain local training
  std::string init;         // standalone: optional trainable tensors to start from
  std::string save;         // standalone: write the final trainable tensors here (in full
                            // mode they are the whole model); `export --trainable` reads it
  std::string json_summary;
  // Telemetry of rank 0 (docs/METRICS.md, docs/WORKER.md): a Prometheus endpoint, a JSON
  // Lines log of rounds and validations, and validation sets evaluated every N rounds.
  std::string metrics_listen;          // HOST:PORT; empty: off
  std::string events;                  // file the JSON Lines go to (appended); empty: off
  std::vector<std::string> eval_sets;  // NAME=DIR, DIR holding val.bin (isthmus-data build)
  int64_t eval_every_rounds = 0;       // 0: off; else after the pull of every Nth round
  // LANG=FILE (a heldout-LANG.jsonl): at each evaluation rank 0 also translates the first
  // translate_lines sources greedily and writes them beside the events file, for chrF by
  // round (deploy/report.py).
  std::vector<std::string> translate_sets;
  int translate_lines = 50;
  std::string log_level = "info";
  bool progress = true;  // the live line on a terminal (false: plain lines always)
  bool plan = false;     // print the memory the configuration needs per device, and stop

  // Effective H for a fixed-H run.
  int StepsPerRound() const { return steps_per_round > 0 ? steps_per_round : 80; }
  // --checkpoint-state-every, or its default: 4 in full mode with --overlap on a synced run
  // (where the state is 12 bytes a value to rewrite), else 1.
  int64_t CheckpointStateEvery() const {
    if (checkpoint_state_every > 0) return checkpoint_state_every;
    return model.mode == "full" && overlap && !standalone ? 4 : 1;
  }
  model::TrainerConfig Trainer() const;
  // InvalidArgument naming the first bad or missing setting.
  Status Validate() const;
};

// Registers the flags of each group on `app`. The structs must outlive the parse.
void AddModelFlags(CLI::App& app, ModelSettings& m);
void AddComputeFlags(CLI::App& app, ComputeSettings& c);
void AddShardFlags(CLI::App& app, ShardSettings& s);
void AddTrainFlags(CLI::App& app, TrainSettings& t);

}  // namespace isthmus::worker
