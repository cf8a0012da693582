// The outer loop of isthmus-worker (see round_loop.h): start-up (communicator, model,
// data, shards, resume), the rounds, and the per-rank checkpoint.
#include "worker/round_loop.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <thread>

#include "common/check.h"
#include "common/durable.h"
#include "common/keys.h"
#include "common/round_driver.h"
#include "common/safetensors.h"
#include "ops/buffer.h"
#include "ops/codec_replica.h"
#include "ops/codec_worker.h"
#include "worker/comm/bucketed_all_reduce.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/nccl_communicator.h"
#include "worker/data/teacher_cache.h"
#include "worker/data/token_dataset.h"
#include "worker/data/tokenizer.h"
#include "worker/generation.h"
#include "worker/live_params.h"
#include "worker/progress.h"
#include "worker/telemetry.h"

namespace isthmus::worker {
namespace {

constexpr char kRefusedPrefix[] = "refused by shard: ";
constexpr char kDevicePrefix[] = "device: ";
constexpr char kUsagePrefix[] = "usage: ";
constexpr char kInterruptedPrefix[] = "interrupted: ";
using Clock = std::chrono::steady_clock;

// Integers travel through float collectives in 24-bit pieces (exact in fp32).
void PutInt(std::vector<float>& v, uint64_t x) {
  v.push_back(static_cast<float>(x & 0xFFFFFF));
  v.push_back(static_cast<float>((x >> 24) & 0xFFFFFF));
  v.push_back(static_cast<float>(x >> 48));
}
uint64_t GetInt(const std::vector<float>& v, size_t at) {
  return static_cast<uint64_t>(v[at]) | (static_cast<uint64_t>(v[at + 1]) << 24) |
         (static_cast<uint64_t>(v[at + 2]) << 48);
}

std::string MetaOr(const std::map<std::string, std::string>& m, const std::string& k,
                   const std::string& def) {
  auto it = m.find(k);
  return it == m.end() ? def : it->second;
}

bool IsOptimizerTensor(const std::string& name) { return name.rfind("opt.", 0) == 0; }
// Checkpoint tensors of a round not yet pushed: "unpushed.<name>" holds its delta.
constexpr char kUnpushedPrefix[] = "unpushed.";
// Checkpoint tensors of --encode-deltas (rank 0): "residual.<name>" holds the error-feedback
// residual later rounds start from, flat.
constexpr char kResidualPrefix[] = "residual.";
// A checkpoint tensor that is no trainable tensor nor optimizer state: the round's state.
bool IsRoundState(const std::string& name) {
  return name.rfind(kUnpushedPrefix, 0) == 0 || name.rfind(kResidualPrefix, 0) == 0;
}

std::string FormatFloat(float x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", x);
  return buf;
}

std::string JoinNames(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ",") + n;
  return out;
}

class RoundLoop {
 public:
  RoundLoop(const TrainSettings& s, const std::atomic<bool>& stop)
      : s_(s), stop_(stop), model_(s.model) {}

  Result<TrainSummary> Run() {
    ISTHMUS_RETURN_IF_ERROR(Setup());
    ISTHMUS_RETURN_IF_ERROR(Resume());
    ISTHMUS_RETURN_IF_ERROR(Loop());
    return Finish();
  }

 private:
  bool leader() const { return s_.rank == 0; }
  int world() const { return s_.world_size; }

  // A stop was asked: SIGTERM/SIGINT on this rank, or the site's stop vote. Also asked by
  // the round driver's thread (atomics only).
  bool Stopping() const { return stop_ || interrupted_; }
  // The site client's `interrupted`: waits on the shards end kStopGrace after a stop was first
  // seen, so that a live shard still answers the round's push and pull but a dead one
  // cannot hold the stop (a request would otherwise retry for minutes). Called from the
  // training thread and from the round driver's.
  bool GiveUp() {
    if (!Stopping()) return false;
    const int64_t now = Clock::now().time_since_epoch().count();
    int64_t seen = 0;
    if (stop_seen_.compare_exchange_strong(seen, now)) seen = now;
    return Clock::duration(now - seen) >= kStopGrace;
  }
  // `st` as an Interrupted() when it is a shard not answering after a stop was asked.
  Status AsInterrupted(const Status& st) const {
    const bool unanswered = st.code() == Code::kTimeout || st.code() == Code::kUnavailable;
    if (st.ok() || !unanswered || !Stopping() || IsInterrupted(st)) return st;
    return Interrupted(st.message());
  }

  Status Setup() {
    // The device first: a --device this machine cannot honour fails before any rendezvous.
    auto compute = OpenCompute(s_.compute, s_.rank);
    if (!compute.ok()) return DeviceError(compute.status());
    compute_ = std::move(compute).value();
    spdlog::info("rank {}: device {}, precision {}", s_.rank, compute_.ops->Describe(),
                 ops::DtypeName(compute_.precision));
    if (world() > 1) {
      std::string prefix = "isthmus-worker-" + s_.shards.job;
      std::replace(prefix.begin(), prefix.end(), '/', '_');
      auto group = [&](auto o) {
        o.rank = s_.rank;
        o.world_size = world();
        o.rendezvous = s_.rendezvous;
        o.timeout = std::chrono::seconds(s_.comm_timeout_s);
        o.prefix = prefix;
        o.settings = "--bucket-mb " + std::to_string(s_.bucket_mb) + " --reduce-precision " +
                     s_.reduce_precision + (s_.shard_optimizer ? " --shard-optimizer" : "");
        return o;
      };
      Result<std::unique_ptr<comm::Communicator>> comm = Status::Internal("no communicator");
      if (compute_.device_index >= 0) {
        comm::NcclOptions o = group(comm::NcclOptions{});
        o.device = compute_.device_index;
        comm = comm::CreateNcclCommunicator(o);
      } else {
        comm::GlooOptions o = group(comm::GlooOptions{});
        o.host = s_.comm_host;
        comm = comm::CreateGlooCommunicator(o);
      }
      // Ranks that disagree on the launch (world size, device kind, --bucket-mb, one GPU
      // for two ranks) were launched wrongly: a usage error, fixed by relaunching.
      if (!comm.ok() && comm.status().code() == Code::kFailedPrecondition) {
        return UsageError(comm.status().message());
      }
      ISTHMUS_ASSIGN_OR_RETURN(comm_, std::move(comm));
    }
    if (!s_.standalone) {
      ISTHMUS_ASSIGN_OR_RETURN(site_, ConnectSite(s_.shards, [this] { return GiveUp(); }));
      // From the first pull on (the one at start-up too), so that the copy it replays onto
      // is seeded before round 1 and round 1's pull replays instead of fetching the whole
      // state with its momentum (0.7 GB in full mode) inside the round.
      if (s_.pull_by_replay) site_->SetPuller(std::make_unique<codec::ReplayPuller>());
    }
    ISTHMUS_RETURN_IF_ERROR(AgreeOnModel());
    const model::Compute c = compute_.Model();
    // A configuration that cannot fit the GPU is refused before anything is allocated.
    ISTHMUS_ASSIGN_OR_RETURN(const int distill_k, TeacherCacheK(s_.teacher_topk));
    ISTHMUS_ASSIGN_OR_RETURN(
        TrainingPlan plan,
        PlanTraining(model_, c, s_.batch_size, !s_.standalone, distill_k, s_.OptimizerShards()));
    if (!plan.fits.ok()) return DeviceError(plan.fits);
    auto gpt = BuildModel(model_, c);
    if (!gpt.ok()) {
      return gpt.status().code() == Code::kResourceExhausted ? DeviceError(gpt.status())
                                                             : gpt.status();
    }
    gpt_ = std::move(gpt).value();
    if (Status st = gpt_->Reserve(s_.batch_size, model_.context); !st.ok()) {
      return DeviceError(st);
    }
    auto trainer = model::Trainer::Create(*gpt_, s_.Trainer());
    if (!trainer.ok()) {
      return trainer.status().code() == Code::kResourceExhausted ? DeviceError(trainer.status())
                                                                 : trainer.status();
    }
    trainer_ = std::move(trainer).value();
    if (comm_ && s_.shard_optimizer) {
      model::OptimizerShards shards;
      shards.rank = s_.rank;
      shards.world_size = world();
      shards.all_gather = [c = comm_.get()](float* data, const std::vector<size_t>& counts) {
        return c->AllGather(data, counts);
      };
      if (Status st = trainer_->ShardOptimizerState(std::move(shards)); !st.ok()) {
        return st.code() == Code::kResourceExhausted ? DeviceError(st) : st;
      }
      spdlog::info(
          "rank {}: AdamW moments sharded across {} ranks: this rank updates elements "
          "[{}, {}) of {} and all-gathers the parameters after each step",
          s_.rank, world(), trainer_->shard_begin(), trainer_->shard_end(),
          gpt_->TrainableElements());
    }
    const bool bf16 = s_.reduce_precision == "bf16";
    if (comm_ && s_.bucket_mb > 0) {
      const size_t bucket_bytes = static_cast<size_t>(s_.bucket_mb) << 20;
      buckets_ = std::make_unique<comm::BucketedAllReduce>(*comm_, bucket_bytes, bf16);
      trainer_->SetGradientSink(buckets_.get());
      spdlog::info("rank {}: gradient all-reduce ({}) in buckets of {} MiB during the backward",
                   s_.rank, s_.reduce_precision, s_.bucket_mb);
    } else if (comm_) {
      trainer_->SetGradHook(
          [this, hook = MakeAllReduceHook(comm_.get(), bf16)](float* grads, size_t count) {
            const auto t0 = Clock::now();
            Status st = hook(grads, count);
            allreduce_seconds_ = std::chrono::duration<double>(Clock::now() - t0).count();
            return st;
          });
      spdlog::info("rank {}: gradient all-reduce ({}): one all-reduce after the backward", s_.rank,
                   s_.reduce_precision);
    }

    data::DatasetOptions d;
    d.batch_size = s_.batch_size;
    d.seq_len = model_.context;
    d.rank = s_.rank;
    d.world_size = world();
    d.seed = s_.data_seed;
    d.vocab_size = gpt_->config().vocab_size;  // 256 for bytes, GPT-2's 50257 for its BPE
    auto ds = data::TokenDataset::Open(s_.data_dir + "/train.bin", d);
    if (!ds.ok()) return ds.status();
    dataset_ = std::make_unique<data::TokenDataset>(std::move(ds).value());
    for (const auto& e : s_.translate_sets) {  // refused now rather than at round N
      if (d.vocab_size != data::ByteTokenizer::kVocabSize) {
        return Status::InvalidArgument(
            "--translate-set translates with bytes, but the model has " +
            std::to_string(d.vocab_size) +
            " ids: translate after the run with isthmus-worker generate --translate "
            "--tokenizer");
      }
      auto pairs = ReadTranslationPairs(e.substr(e.find('=') + 1), 1);
      if (!pairs.ok())
        return Status(pairs.status().code(), "--translate-set: " + pairs.status().message());
    }
    if (!s_.teacher_topk.empty()) {
      auto cache = data::TeacherCache::Open(s_.teacher_topk, *dataset_, d.vocab_size);
      if (!cache.ok()) return cache.status();
      teacher_ = std::make_unique<data::TeacherCache>(std::move(cache).value());
      ISTHMUS_RETURN_IF_ERROR(
          gpt_->SetDistillation({teacher_->info().k, s_.distill_alpha, s_.distill_temperature}));
      if (leader()) {
        spdlog::info("distilling from {} (k {}, alpha {}, temperature {})", s_.teacher_topk,
                     teacher_->info().k, s_.distill_alpha, s_.distill_temperature);
      }
    }
    tokens_per_step_ =
        static_cast<uint64_t>(s_.batch_size) * s_.grad_accum * model_.context * world();

    base_hash_ = gpt_->BaseHash();
    if (!s_.standalone) {
      auto hellos = HelloSite(*site_, base_hash_);
      if (!hellos.ok()) return AsInterrupted(hellos.status());
      start_rounds_min_ = hellos->empty() ? 0 : INT64_MAX;
      for (const auto& h : *hellos) {
        start_rounds_max_ = std::max<int64_t>(start_rounds_max_, h.rounds.local_round);
        start_rounds_min_ = std::min<int64_t>(start_rounds_min_, h.rounds.local_round);
      }
      start_limit_ = hellos->empty() ? 0 : UINT64_MAX;
      for (const auto& h : *hellos) {
        start_limit_ = std::min<uint64_t>(start_limit_, h.rounds.max_rounds_ahead);
      }
      // Every rank knows where each tensor lives without pulling: the placement
      // isthmusctl gave the job (a pull checks it).
      std::vector<TensorView> trainable;
      for (const auto& p : gpt_->Trainable()) trainable.push_back({p.name, {p.numel}, nullptr});
      site_->SetPlacement(
          SiteClient::PlaceTensors(trainable, static_cast<int>(site_->num_shards())));
    }

    ProgressOptions po;
    po.live = s_.progress && IsTerminal(stderr);
    po.log_every = s_.log_every;
    po.total_steps = s_.max_steps > 0
                         ? s_.max_steps
                         : (s_.round_seconds > 0 ? 0 : s_.max_rounds * s_.StepsPerRound());
    progress_ = std::make_unique<Progress>(po);
    if (!s_.checkpoint_dir.empty()) {
      std::error_code ec;
      std::filesystem::create_directories(s_.checkpoint_dir, ec);
      if (ec) return Status::IoError("cannot create " + s_.checkpoint_dir + ": " + ec.message());
    }
    for (const auto& e : s_.eval_sets) {
      const std::string dir = e.substr(e.find('=') + 1);
      if (!std::filesystem::exists(dir + "/val.bin")) {
        return UsageError("--eval-set " + e + ": " + dir +
                          "/val.bin does not exist (make it with isthmus-data build)");
      }
    }
    if (leader()) {
      ISTHMUS_ASSIGN_OR_RETURN(telemetry_, Telemetry::Open(s_.metrics_listen, s_.events));
      if (telemetry_->metrics_port() > 0) {
        spdlog::info("rank 0: metrics at http://{}:{}/metrics",
                     s_.metrics_listen.substr(0, s_.metrics_listen.rfind(':')),
                     telemetry_->metrics_port());
      }
    } else {
      telemetry_ = Telemetry::Off();
      if (!s_.metrics_listen.empty() || !s_.events.empty()) {
        spdlog::info("rank {}: --metrics-listen and --events are served by rank 0 only", s_.rank);
      }
    }
    return Status::Ok();
  }

  // The settings that change what the trainable tensors mean (the mode; LoRA rank, alpha
  // and targets) are the job's, decided once by rank 0 before the model is built: the
  // job's tensors on the shards say the mode, rank and targets; rank 0's checkpoint
  // records all four (the alpha is recorded nowhere else); rank 0's flags say what neither
  // does. Every rank takes them. A rank whose flags (or checkpoint) say otherwise makes
  // every rank stop with a usage error (exit 2) naming both values before anything trains.
  Status AgreeOnModel() {
    enum Source { kFlags = 0, kCheckpoint = 1, kJob = 2 };
    // This rank's checkpoint, as far as it records the settings.
    std::optional<ModelSettings> mine;
    Status local = ReadCheckpointSettings(mine);
    // rank 0: status code, full, LoRA rank, alpha, target bits, source of the shape
    // settings, source of the alpha.
    std::vector<float> job(7, 0.0f);
    if (leader()) {
      ModelSettings decided = model_;
      Source shape_from = kFlags, alpha_from = kFlags;
      if (local.ok() && !s_.standalone) {
        local = AsInterrupted(PullJobAtStart(decided));
        if (local.ok()) shape_from = kJob;
      }
      if (local.ok() && mine) {
        if (shape_from == kJob && !SameShape(*mine, decided)) {
          local =
              UsageError("checkpoint " + CheckpointPath() + " records " + mine->DescribeTraining() +
                         ", but job '" + s_.shards.job + "' on the shards holds " +
                         decided.DescribeTraining() + ": it belongs to another job; move it away");
        } else {
          decided.mode = mine->mode;
          decided.lora_rank = mine->lora_rank;
          decided.lora_targets = mine->lora_targets;
          if (shape_from == kFlags) shape_from = kCheckpoint;
          if (!mine->lora_alpha_assumed) {
            decided.lora_alpha = mine->lora_alpha;
            alpha_from = kCheckpoint;
          } else if (decided.mode == "lora") {
            spdlog::warn(
                "checkpoint {} does not record the LoRA alpha (an older isthmus-worker "
                "wrote it): assuming {} ({})",
                CheckpointPath(), FormatFloat(decided.lora_alpha),
                model_.given.count("--lora-alpha") ? "--lora-alpha" : "the default");
          }
        }
      }
      if (local.ok() && shape_from == kJob && alpha_from == kFlags && decided.mode == "lora" &&
          !model_.given.count("--lora-alpha")) {
        spdlog::info(
            "LoRA alpha {} (the default): the shards keep no alpha and no checkpoint "
            "records one; give --lora-alpha if job '{}' was made with another",
            FormatFloat(decided.lora_alpha), s_.shards.job);
      }
      job = {static_cast<float>(ExitCodeFor(local)),
             decided.mode == "full" ? 1.0f : 0.0f,
             static_cast<float>(decided.lora_rank),
             decided.lora_alpha,
             static_cast<float>(decided.LoraTargetBits()),
             static_cast<float>(shape_from),
             static_cast<float>(alpha_from)};
    }
    ISTHMUS_RETURN_IF_ERROR(BroadcastHost(job.data(), job.size()));
    if (job[0] != 0) {
      if (leader()) return local;
      return StatusForExitCode(static_cast<int>(job[0]),
                               "rank 0 could not settle the model's settings: see its log");
    }
    ModelSettings decided = model_;
    decided.mode = job[1] > 0 ? "full" : "lora";
    decided.lora_rank = static_cast<int>(job[2]);
    decided.lora_alpha = job[3];
    decided.lora_targets = ModelSettings::LoraTargetsFromBits(static_cast<uint32_t>(job[4]));
    const auto shape_from = static_cast<Source>(job[5]);
    const auto alpha_from = static_cast<Source>(job[6]);
    auto from = [&](Source src) -> std::string {
      switch (src) {
        case kJob:
          return "job '" + s_.shards.job + "' on the shards holds";
        case kCheckpoint:
          return "rank 0's checkpoint (rank-0.safetensors in --checkpoint-dir) records";
        default:
          return "rank 0 was given (or defaults to)";
      }
    };
    auto remedy = [&](const std::string& flag, Source src, const std::string& theirs) {
      if (src == kFlags) return std::string(": give every rank the same model flags");
      return ": leave " + flag + " out (the " + (src == kJob ? "job" : "checkpoint") +
             " sets it) or give " + theirs + "; training with other settings needs a new job";
    };
    // This rank's flags against the job's settings.
    std::string conflict;
    auto check = [&](const std::string& flag, const std::string& ours, const std::string& theirs,
                     bool same, const std::string& what, Source src) {
      if (!conflict.empty() || !model_.given.count(flag) || same) return;
      conflict = "rank " + std::to_string(s_.rank) + ": " + flag + " " + ours +
                 " contradicts the job's " + what + " " + theirs + ", which " + from(src) +
                 remedy(flag, src, theirs);
    };
    check("--mode", model_.mode, decided.mode, model_.mode == decided.mode, "mode", shape_from);
    if (decided.mode == "lora") {
      check("--lora-rank", std::to_string(model_.lora_rank), std::to_string(decided.lora_rank),
            model_.lora_rank == decided.lora_rank, "LoRA rank", shape_from);
      check("--lora-targets", JoinNames(model_.lora_targets), JoinNames(decided.lora_targets),
            model_.LoraTargetBits() == decided.LoraTargetBits(), "LoRA targets", shape_from);
      check("--lora-alpha", FormatFloat(model_.lora_alpha), FormatFloat(decided.lora_alpha),
            model_.lora_alpha == decided.lora_alpha, "LoRA alpha", alpha_from);
    }
    if (conflict.empty() && local.ok() && mine && !leader() &&
        (!SameShape(*mine, decided) || (!mine->lora_alpha_assumed && decided.mode == "lora" &&
                                        mine->lora_alpha != decided.lora_alpha))) {
      conflict = "rank " + std::to_string(s_.rank) + ": checkpoint " + CheckpointPath() +
                 " records " + mine->DescribeTraining() + ", but the job's settings are " +
                 decided.DescribeTraining() +
                 " (rank 0's): move it away (this rank then starts from rank 0's state)";
    }
    if (!conflict.empty()) local = UsageError(conflict);
    Status shared;
    ISTHMUS_RETURN_IF_ERROR(ShareOutcome(
        local, "refused the model's settings (the job's: " + decided.DescribeTraining() + ")",
        &shared));
    ISTHMUS_RETURN_IF_ERROR(shared);
    model_.mode = decided.mode;
    model_.lora_rank = decided.lora_rank;
    model_.lora_alpha = decided.lora_alpha;
    model_.lora_targets = decided.lora_targets;
    return Status::Ok();
  }

  // Reads what this rank's checkpoint records about the model's settings into `out` (left
  // empty without a checkpoint). A file that cannot be read is a Corruption/IoError.
  Status ReadCheckpointSettings(std::optional<ModelSettings>& out) {
    if (s_.checkpoint_dir.empty() || !std::filesystem::exists(CheckpointPath())) {
      return Status::Ok();
    }
    auto info = ReadSafetensorsInfo(CheckpointPath());
    if (!info.ok()) return info.status();
    std::vector<Tensor> shapes;
    for (const auto& e : info->tensors) {
      if (!IsOptimizerTensor(e.name) && !IsRoundState(e.name)) {
        shapes.push_back({e.name, e.shape, {}});
      }
    }
    ModelSettings m = model_;
    m.given.clear();
    Status st = m.ResolveTrainable(shapes, info->metadata, "checkpoint " + CheckpointPath());
    if (!st.ok()) return Status::Corruption(st.message());
    out = std::move(m);
    return Status::Ok();
  }

  // Rank 0: the job's tensors from the shards (kept for the first pull) and the mode, LoRA
  // rank and targets they say, into `m`.
  Status PullJobAtStart(ModelSettings& m) {
    ISTHMUS_RETURN_IF_ERROR(HelloSite(*site_, "").status());
    ISTHMUS_ASSIGN_OR_RETURN(start_pull_, PullSite(*site_));
    const float alpha = m.lora_alpha;
    m.given.clear();
    Status st = m.ResolveTrainable(start_pull_, {}, "job '" + s_.shards.job + "' on the shards");
    m.lora_alpha = alpha;  // the shards keep no alpha: ResolveTrainable left it as it was
    return st.ok() ? st : UsageError(st.message());
  }

  static bool SameShape(const ModelSettings& a, const ModelSettings& b) {
    if (a.mode != b.mode) return false;
    return a.mode == "full" ||
           (a.lora_rank == b.lora_rank && a.LoraTargetBits() == b.LoraTargetBits());
  }

  // Every rank's `local` outcome for every rank, as exit codes, into *outcome: the site's
  // outcome is the most telling failure of any rank (a refusal or bad usage before an
  // interruption, an interruption before a shard that did not answer, before success). A
  // rank whose own outcome is that one gets `local`; the others a status with that exit
  // code saying "another rank of the site <what>". A collective; returns its own failure
  // (a rank gone from the site).
  Status ShareOutcome(const Status& local, const std::string& what, Status* outcome) {
    *outcome = local;
    if (!comm_) return Status::Ok();
    std::vector<float> codes(kExitOutOfMemory + 1, 0.0f);
    const int mine = std::clamp(ExitCodeFor(local), 0, kExitOutOfMemory);
    codes[mine] = 1;
    ISTHMUS_RETURN_IF_ERROR(
        HostCollective(*comm_, *compute_.ops, codes.data(), codes.size(), /*broadcast=*/false));
    for (int code : {kExitUsage, kExitRefused, kExitNotFound, kExitDamaged, kExitOutOfMemory,
                     kExitFailure, kExitInterrupted, kExitUnreachable}) {
      if (codes[code] == 0) continue;
      if (code == mine) return Status::Ok();
      if (!local.ok()) spdlog::warn("rank {}: {}", s_.rank, local.ToString());
      *outcome = StatusForExitCode(code, "another rank of the site " + what + ": see its log");
      return Status::Ok();
    }
    return Status::Ok();
  }

  // The merged model on the site's own validation data and on every --eval-set, recorded
  // by the telemetry (rank 0); every rank takes part in each evaluation.
  Status EvaluateSets() {
    std::vector<std::pair<std::string, std::string>> sets = {{"site", s_.data_dir}};
    for (const auto& e : s_.eval_sets) {
      const size_t eq = e.find('=');
      sets.emplace_back(e.substr(0, eq), e.substr(eq + 1));
    }
    std::string line;
    for (const auto& [name, dir] : sets) {
      auto v = ValidationLoss(*gpt_, dir + "/val.bin", s_.batch_size, s_.rank, world(),
                              s_.val_batches, comm_.get());
      if (!v.ok()) {
        const Code c = v.status().code();
        if (c == Code::kUnavailable || c == Code::kTimeout) return v.status();
        progress_->Message("evaluation on '" + name + "' skipped: " + v.status().ToString());
        continue;
      }
      telemetry_->OnValidation(round_, step_, name, *v);
      char buf[64];
      std::snprintf(buf, sizeof buf, "%s%s %.4f", line.empty() ? "" : ", ", name.c_str(), *v);
      line += buf;
    }
    if (leader() && !line.empty()) {
      progress_->Message("evaluation after round " + std::to_string(round_) + ": " + line);
    }
    if (leader()) ISTHMUS_RETURN_IF_ERROR(TranslateSets());
    return Status::Ok();
  }

  // --translate-set (rank 0): the merged model's greedy translations of each set's first
  // lines, written beside the events file; the other ranks wait for rank 0 at the next
  // collective.
  Status TranslateSets() {
    if (s_.translate_sets.empty()) return Status::Ok();
    const std::string dir = s_.events + ".translations";
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) return Status::IoError(dir + ": cannot create: " + ec.message());
    const TextCodec codec;  // bytes: Validate-time check of the vocabulary in Setup
    Generator generator(*gpt_, codec, {model_.context, 0.0, 0, 1});
    for (const auto& e : s_.translate_sets) {
      const size_t eq = e.find('=');
      const std::string lang = e.substr(0, eq), path = e.substr(eq + 1);
      ISTHMUS_ASSIGN_OR_RETURN(auto pairs,
                               ReadTranslationPairs(path, static_cast<size_t>(s_.translate_lines)));
      const std::string file = dir + "/" + lang + "-r" + std::to_string(round_) + ".jsonl";
      std::string text;
      for (const auto& pair : pairs) {
        ISTHMUS_ASSIGN_OR_RETURN(std::string t, generator.Translate(pair.source, lang));
        text += TranslationJsonLine(pair, t) + "\n";
      }
      ISTHMUS_RETURN_IF_ERROR(WriteFileDurably(file, text));
      telemetry_->OnTranslations(round_, step_, lang, file, static_cast<int64_t>(pairs.size()));
    }
    return Status::Ok();
  }

  std::string CheckpointPath() const {
    return s_.checkpoint_dir + "/rank-" + std::to_string(s_.rank) + ".safetensors";
  }
  // --checkpoint-state-every N > 1: the round in flight of the rounds between full
  // checkpoints, without the model and the optimizer state.
  std::string RoundCheckpointPath() const {
    return s_.checkpoint_dir + "/rank-" + std::to_string(s_.rank) + ".round.safetensors";
  }
  // --encode-deltas: the pipelines of the round rank 0 is encoding (FeedbackEncoder::Kept).
  std::string PipelinesPath() const { return s_.checkpoint_dir + "/rank-0.pipelines.json"; }

  // What a checkpoint holds, copied out of the backend at a step boundary: written by
  // WriteCheckpoint (on this thread, or on the round driver's with --overlap).
  struct CheckpointImage {
    std::string path;
    bool direct = false;     // --checkpoint-direct
    std::string supersedes;  // a round checkpoint removed once this full one is durable
    std::vector<Tensor> tensors;
    std::map<std::string, std::string> meta;
  };
  // The buffers of the last checkpoint image written, for the next (TakeCheckpoint).
  struct SpareImage {
    std::mutex mu;
    std::vector<Tensor> tensors;
  };

  // Copies the checkpoint out (nullopt without --checkpoint-dir), into the buffers of the
  // last image written (ReturnImage) when it is back, so the step boundary, which waits
  // for this copy, writes into memory the worker already has. In full mode the image is
  // the model and AdamW's moments (1.0 GB for GPT-2-small; with --overlap the round's
  // delta too); on a CPU its copy took 0.054-0.074 s refilled against 0.070-0.108 s into
  // fresh memory (docs/BENCHMARKS.md, "The checkpoint image").
  //
  // Without `with_state` (--checkpoint-state-every) the image is a round checkpoint: the
  // round in flight (its delta, which the caller has set in unpushed_), the residual, the
  // counters and the data position, with neither the trainable tensors nor the moments.
  Result<std::optional<CheckpointImage>> TakeCheckpoint(bool with_state = true) {
    if (s_.checkpoint_dir.empty()) return std::optional<CheckpointImage>();
    CheckpointImage c;
    c.path = with_state ? CheckpointPath() : RoundCheckpointPath();
    if (with_state && s_.CheckpointStateEvery() > 1) c.supersedes = RoundCheckpointPath();
    c.direct = s_.checkpoint_direct;
    {
      std::lock_guard<std::mutex> lock(spare_image_->mu);
      c.tensors = std::move(spare_image_->tensors);
      spare_image_->tensors.clear();
    }
    size_t i = 0;
    if (with_state) {
      ISTHMUS_ASSIGN_OR_RETURN(
          i, trainer_->ExportState(&c.tensors, gpt_->ExportTrainable(&c.tensors, 0)));
      // A failed backend copies nothing out: never replace a good checkpoint with that.
      ISTHMUS_RETURN_IF_ERROR(gpt_->ops().status());
    }
    auto add = [&](const std::string& name, const std::vector<int64_t>& shape,
                   const std::vector<float>& data) {
      std::copy(data.begin(), data.end(),
                RefillTensor(&c.tensors, i++, name, shape, static_cast<int64_t>(data.size())));
    };
    auto meta = gpt_->ConfigMetadata();
    meta.merge(model_.TrainableMetadata());  // what the tensors mean: mode, LoRA settings
    if (unpushed_) {
      // The round's delta the shards did not take: pushed first when training resumes.
      for (const auto& t : *unpushed_->delta) add(kUnpushedPrefix + t.name, t.shape, t.data);
      meta["unpushed_tokens"] = std::to_string(unpushed_->tokens);
      meta["unpushed_compute_ms"] = std::to_string(unpushed_->compute_ms);
    }
    if (encoder_) {
      // The residual after the last round every shard took (never one being pushed: this
      // runs while no round is in flight), which the unpushed round, if any, starts from.
      for (const auto& [name, r] : encoder_->residuals()) {
        add(kResidualPrefix + name, {static_cast<int64_t>(r.size())}, r);
      }
    }
    c.tensors.resize(i);
    if (!with_state) meta["holds"] = "round";
    meta["job"] = s_.shards.job;
    meta["round"] = std::to_string(round_);
    meta["step"] = std::to_string(step_);
    checkpoint_step_ = step_;
    meta["tokens"] = std::to_string(tokens_);
    meta["data_position"] = dataset_->position().ToString();
    meta["base_hash"] = base_hash_;
    meta["world_size"] = std::to_string(world());
    c.meta = std::move(meta);
    return std::optional<CheckpointImage>(std::move(c));
  }

  static Status WriteCheckpoint(const CheckpointImage& c) {
    ISTHMUS_RETURN_IF_ERROR(WriteSafetensors(c.path, c.tensors, c.meta, FileDtype::kF32, c.direct));
    if (!c.supersedes.empty()) {
      // Older than this file, it would be passed over at a restart anyway (LoadCheckpoint).
      std::error_code ec;
      std::filesystem::remove(c.supersedes, ec);
    }
    return Status::Ok();
  }

  // Keeps a written image's buffers for the next TakeCheckpoint (on any thread).
  static void ReturnImage(SpareImage& spare, CheckpointImage& c) {
    std::lock_guard<std::mutex> lock(spare.mu);
    spare.tensors = std::move(c.tensors);
  }

  Status SaveCheckpoint() {
    ISTHMUS_ASSIGN_OR_RETURN(auto c, TakeCheckpoint());
    if (!c) return Status::Ok();
    Status st = WriteCheckpoint(*c);
    ReturnImage(*spare_image_, *c);
    return st;
  }

  // Reads a checkpoint file of this rank, refusing one of another base model or job.
  Result<SafetensorsFile> ReadCheckpointFile(const std::string& path) {
    ISTHMUS_ASSIGN_OR_RETURN(auto file, ReadSafetensors(path));
    if (MetaOr(file.metadata, "base_hash", "") != base_hash_) {
      return Status::FailedPrecondition("checkpoint " + path +
                                        " was written for another base model; move it away");
    }
    if (MetaOr(file.metadata, "job", "") != s_.shards.job) {
      return Status::FailedPrecondition("checkpoint " + path + " belongs to job '" +
                                        MetaOr(file.metadata, "job", "") + "'");
    }
    return file;
  }

  // Loads this rank's checkpoint if there is one; returns whether it did. A round
  // checkpoint (--checkpoint-state-every) newer than the full one gives the round in flight,
  // the counters and the data position; the trainable tensors and the moments then come
  // from the full one (or stay as they start, without one), and Resume takes the
  // trainable tensors from the shards.
  Result<bool> LoadCheckpoint() {
    if (s_.checkpoint_dir.empty()) return false;
    std::optional<SafetensorsFile> full, round_file;
    if (std::filesystem::exists(CheckpointPath())) {
      ISTHMUS_ASSIGN_OR_RETURN(full, ReadCheckpointFile(CheckpointPath()));
    }
    if (std::filesystem::exists(RoundCheckpointPath())) {
      ISTHMUS_ASSIGN_OR_RETURN(round_file, ReadCheckpointFile(RoundCheckpointPath()));
      auto round_of = [](const SafetensorsFile& f, const std::string& p) -> Result<uint64_t> {
        auto r =
            ParseUint64(MetaOr(f.metadata, "round", "0"), "checkpoint " + p + " metadata round");
        if (!r.ok()) return Status::Corruption(r.status().message());
        return *r;
      };
      ISTHMUS_ASSIGN_OR_RETURN(uint64_t rr, round_of(*round_file, RoundCheckpointPath()));
      if (full) {
        ISTHMUS_ASSIGN_OR_RETURN(uint64_t fr, round_of(*full, CheckpointPath()));
        if (rr <= fr) round_file.reset();  // the full one is as new: this one is stale
      }
    }
    if (!full && !round_file) return false;
    const SafetensorsFile& file = round_file ? *round_file : *full;
    const std::string path = round_file ? RoundCheckpointPath() : CheckpointPath();
    std::vector<Tensor> unpushed_delta;
    Unpushed unpushed;
    resume_residuals_.clear();
    for (const auto& t : file.tensors) {
      if (t.name.rfind(kUnpushedPrefix, 0) == 0) {
        unpushed_delta.push_back({t.name.substr(std::strlen(kUnpushedPrefix)), t.shape, t.data});
      } else if (t.name.rfind(kResidualPrefix, 0) == 0) {
        resume_residuals_[t.name.substr(std::strlen(kResidualPrefix))] = t.data;
      }
    }
    if (round_file && unpushed_delta.empty()) {
      return Status::Corruption("checkpoint " + path +
                                " holds no round in flight, which a round checkpoint always "
                                "holds; move it away to resume from " +
                                CheckpointPath());
    }
    if (full) {
      std::vector<Tensor> trainable;
      for (const auto& t : full->tensors) {
        const bool other = t.name.rfind(kUnpushedPrefix, 0) == 0 ||
                           t.name.rfind(kResidualPrefix, 0) == 0 || IsOptimizerTensor(t.name);
        if (!other) trainable.push_back(t);
      }
      ISTHMUS_RETURN_IF_ERROR(gpt_->LoadTrainable(trainable, true));
      ISTHMUS_RETURN_IF_ERROR(trainer_->LoadState(full->tensors));
      if (trainer_->sharded() && leader()) {
        // The backend keeps this rank's part; the others get theirs from these at Resume.
        ISTHMUS_RETURN_IF_ERROR(trainer_->FlattenMoments(full->tensors, &resume_m_, &resume_v_));
      }
    }
    if (round_file) {
      spdlog::info(
          "rank {}: round checkpoint {} holds round {}; the trainable tensors come from the "
          "shards and AdamW's moments from {}",
          s_.rank, path, MetaOr(file.metadata, "round", "?"),
          full ? CheckpointPath() + " (round " + MetaOr(full->metadata, "round", "?") + ")"
               : std::string("nowhere (no full checkpoint: they start at zero)"));
    }
    ISTHMUS_ASSIGN_OR_RETURN(
        auto pos, data::DatasetPosition::Parse(MetaOr(file.metadata, "data_position", "")));
    ISTHMUS_RETURN_IF_ERROR(dataset_->Restore(pos));
    // A damaged checkpoint is a Corruption naming the file and the field, never a crash.
    const std::string what = "checkpoint " + path + " metadata ";
    auto round = ParseUint64(MetaOr(file.metadata, "round", "0"), what + "round");
    auto step = ParseUint64(MetaOr(file.metadata, "step", "0"), what + "step");
    auto tokens = ParseUint64(MetaOr(file.metadata, "tokens", "0"), what + "tokens");
    // Checkpoints from before the rank count was recorded: this run's.
    auto ckpt_world = ParseUint64(MetaOr(file.metadata, "world_size", std::to_string(world())),
                                  what + "world_size");
    auto u_tokens =
        ParseUint64(MetaOr(file.metadata, "unpushed_tokens", "0"), what + "unpushed_tokens");
    auto u_ms = ParseUint64(MetaOr(file.metadata, "unpushed_compute_ms", "0"),
                            what + "unpushed_compute_ms");
    for (const auto* r : {&round, &step, &tokens, &ckpt_world, &u_tokens, &u_ms}) {
      if (!r->ok() || **r > static_cast<uint64_t>(INT64_MAX)) {
        return Status::Corruption(r->ok() ? what + "holds a count out of range"
                                          : r->status().message());
      }
    }
    round_ = static_cast<int64_t>(*round);
    step_ = static_cast<int64_t>(*step);
    tokens_ = *tokens;
    checkpoint_world_ = static_cast<int64_t>(*ckpt_world);
    if (!unpushed_delta.empty()) {
      if (round_ < 1) return Status::Corruption(what + "round: 0 with an unpushed round");
      unpushed.delta = std::make_shared<const std::vector<Tensor>>(std::move(unpushed_delta));
      unpushed.tokens = *u_tokens;
      unpushed.compute_ms = *u_ms;
      unpushed_ = std::move(unpushed);
    }
    return true;
  }

  // Decides where training continues (rank 0 decides, every rank follows) and makes every
  // rank's trainable tensors and optimizer state bitwise equal to rank 0's.
  Status Resume() {
    ISTHMUS_ASSIGN_OR_RETURN(bool have_ckpt, LoadCheckpoint());
    if (have_ckpt) {
      spdlog::info("rank {}: checkpoint at round {} step {}", s_.rank, round_, step_);
    }
    ISTHMUS_RETURN_IF_ERROR(SetUpEncoder());
    bool load_pulled = false, push_unpushed = false;
    if (leader()) {
      if (s_.standalone) {
        if (!have_ckpt && !s_.init.empty()) {
          ISTHMUS_ASSIGN_OR_RETURN(auto init, ReadSafetensorsTensors(s_.init));
          ISTHMUS_RETURN_IF_ERROR(gpt_->LoadTrainable(init, true));
        }
      } else {
        // The shard wins, except right after a crash between pushing round R+1 and
        // checkpointing it: then round R+1 is redone from the checkpoint with the same
        // idempotency keys, so shards that got it answer duplicate and the rest apply it.
        const int64_t shard_round = start_rounds_max_;
        if (have_ckpt && unpushed_) {
          // The checkpoint holds round R, which the shards did not take before the worker
          // stopped: push it now (with its idempotency keys, so a shard that did take it
          // answers duplicate), then follow the shards. Shards anywhere but at R - 1 or R
          // have moved on without it: they win.
          if (start_rounds_min_ + 1 >= round_ && shard_round <= round_) {
            spdlog::info(
                "round {} was not pushed before the worker stopped: pushing it from the "
                "checkpoint",
                round_);
            push_unpushed = true;
          } else {
            spdlog::warn(
                "checkpoint holds round {}, never pushed, but the shards are at round {}: "
                "following the shards without it",
                round_, shard_round);
            round_ = shard_round;
          }
          load_pulled = true;
        } else if (!have_ckpt) {
          load_pulled = true;
          round_ = shard_round;
          step_ = shard_round * s_.StepsPerRound();
        } else if (shard_round == round_ + 1 && checkpoint_world_ != world()) {
          if (encoder_) {
            spdlog::warn(
                "round {} was encoded and pushed before the checkpoint kept its residual: "
                "what it left unsent is not known here, so the next rounds start from the "
                "residual before it",
                shard_round);
          }
          // Redoing round R+1 with another rank count would compute another delta than
          // the one the shards hold. Every shard has it: take theirs. Only some have it:
          // the ranks that pushed it must finish it first.
          if (start_rounds_min_ != shard_round) {
            return Refused("round " + std::to_string(shard_round) + " reached only some shards (" +
                           std::to_string(start_rounds_min_) + " to " +
                           std::to_string(shard_round) + ") and was computed by " +
                           std::to_string(checkpoint_world_) + " ranks: restart with " +
                           "--world-size " + std::to_string(checkpoint_world_) +
                           " to finish it, then change the number of ranks");
          }
          spdlog::info("shards hold round {} from {} ranks; following the shards", shard_round,
                       checkpoint_world_);
          load_pulled = true;
          round_ = shard_round;
          step_ = shard_round * s_.StepsPerRound();
        } else if (shard_round == round_ + 1) {
          spdlog::info("shards hold round {} already; redoing it from the checkpoint", shard_round);
        } else {
          if (shard_round != round_) {
            spdlog::warn("checkpoint at round {} but shards at round {}: following the shards",
                         round_, shard_round);
          }
          load_pulled = true;
          round_ = shard_round;
        }
      }
    }
    std::vector<float> plan;
    PutInt(plan, static_cast<uint64_t>(round_));
    PutInt(plan, static_cast<uint64_t>(step_));
    PutInt(plan, tokens_);
    plan.push_back(load_pulled ? 1.0f : 0.0f);
    plan.push_back(push_unpushed ? 1.0f : 0.0f);
    ISTHMUS_RETURN_IF_ERROR(BroadcastHost(plan.data(), plan.size()));
    round_ = static_cast<int64_t>(GetInt(plan, 0));
    step_ = static_cast<int64_t>(GetInt(plan, 3));
    tokens_ = GetInt(plan, 6);
    trainer_->SetStep(step_);
    if (plan[10] > 0) {
      ISTHMUS_RETURN_IF_ERROR(PushUnpushed());
      start_pull_ = {};  // from before the push
      if (encoder_) {    // the rounds' reports count from here
        reported_bytes_ = site_->pushed_bytes();
        reported_raw_bytes_ = site_->pushed_raw_bytes();
      }
    }
    unpushed_.reset();
    if (plan[9] > 0) {
      ISTHMUS_RETURN_IF_ERROR(PullAndShare());
    }
    start_pull_ = {};  // served start-up only: later pulls must see the rounds since
    if (comm_) {
      // Rank 0's optimizer state and tensors for everyone (a rank may have no checkpoint,
      // or one from a round earlier if the crash came between two ranks' writes).
      ISTHMUS_RETURN_IF_ERROR(BroadcastTrainable());
      ISTHMUS_RETURN_IF_ERROR(ShareMoments());
    }
    if (!s_.standalone && leader()) {
      progress_->Message("starting at round " + std::to_string(round_) + ", step " +
                         std::to_string(step_) + (plan[9] > 0 ? " from the shards' tensors" : ""));
    }
    RunInfo info;
    info.site = s_.shards.client_name.empty() ? "site" : s_.shards.client_name;
    info.job = s_.shards.job;
    info.device = compute_.ops->Describe();
    info.precision = ops::DtypeName(compute_.precision);
    info.mode = model::TrainModeName(gpt_->mode());
    info.world_size = world();
    info.steps_per_round = s_.round_seconds > 0 ? 0 : s_.StepsPerRound();
    info.standalone = s_.standalone;
    telemetry_->OnStart(info, round_, step_);
    return Status::Ok();
  }

  // --encode-deltas on rank 0: the site client encodes the rounds (every shard's, from rank
  // 0) with the checkpoint's residual and the pipelines kept beside it. Without the flag, a
  // residual in the checkpoint is dropped, saying so.
  Status SetUpEncoder() {
    if (!s_.encode_deltas || !leader() || !site_) {
      if (!resume_residuals_.empty()) {
        spdlog::warn(
            "checkpoint {} holds the residual of deltas this worker encoded (--encode-deltas); "
            "without the flag it is dropped, and the update it holds never reaches the other "
            "sites",
            CheckpointPath());
      }
      resume_residuals_.clear();
      return Status::Ok();
    }
    auto enc = std::make_unique<codec::FeedbackEncoder>(s_.encode_threads);
    const size_t kept = resume_residuals_.size();
    enc->SetResiduals(std::move(resume_residuals_));
    resume_residuals_.clear();
    // The first round's residual buffers now, not in round 1's encode.
    std::map<std::string, size_t> sizes;
    for (const auto& p : gpt_->Trainable()) sizes[p.name] = static_cast<size_t>(p.numel);
    enc->Reserve(sizes);
    if (!s_.checkpoint_dir.empty()) {
      ISTHMUS_RETURN_IF_ERROR(enc->KeepPipelinesIn(PipelinesPath()));
    }
    spdlog::info(
        "rank 0 encodes the rounds' deltas for every shard on {} threads (residuals of {} "
        "tensors from the checkpoint{})",
        s_.encode_threads, kept,
        enc->kept_round() > 0
            ? "; the pipelines of round " + std::to_string(enc->kept_round()) + " kept"
            : std::string());
    encoder_ = enc.get();
    site_->SetEncoder(std::move(enc));
    return Status::Ok();
  }

  // Rank 0 pulls every shard and loads the union; then every rank receives it. The pull
  // checks that every tensor is on the shard the placement says.
  // The tensors pulled at start-up (AgreeOnModel) serve Resume's pull.
  Status PullAndShare() {
    float code = 0;  // rank 0's exit code for its pull
    Status pulled;
    if (leader()) {
      Result<std::vector<Tensor>> tensors =
          start_pull_.empty() ? PullSite(*site_)
                              : Result<std::vector<Tensor>>(std::move(start_pull_));
      start_pull_.clear();
      if (!tensors.ok()) {
        pulled = tensors.status();
      } else {
        pulled = gpt_->LoadTrainable(*tensors, true);
        if (!pulled.ok()) {
          pulled = Refused("job '" + s_.shards.job +
                           "' does not hold this model's trainable tensors: " + pulled.message());
        }
      }
      pulled = AsInterrupted(pulled);
      code = static_cast<float>(ExitCodeFor(pulled));
    }
    if (comm_) {
      ISTHMUS_RETURN_IF_ERROR(BroadcastHost(&code, 1));
      if (code != 0 && !leader()) {
        return StatusForExitCode(static_cast<int>(code),
                                 "rank 0 could not pull from the shards: see its log");
      }
    }
    ISTHMUS_RETURN_IF_ERROR(pulled);
    return BroadcastTrainable();
  }

  // Rank 0 pushes the checkpoint's unpushed round to every shard (the round's keys do not
  // depend on which rank pushes); every rank learns how that went.
  Status PushUnpushed() {
    float code = 0;
    Status pushed;
    if (leader()) {
      pushed = AsInterrupted(PushDelta(*unpushed_->delta, unpushed_->tokens, unpushed_->compute_ms,
                                       /*rank=*/0, /*world=*/1));
      code = static_cast<float>(ExitCodeFor(pushed));
    }
    if (comm_) {
      ISTHMUS_RETURN_IF_ERROR(BroadcastHost(&code, 1));
      if (code != 0 && !leader()) {
        return StatusForExitCode(static_cast<int>(code),
                                 "rank 0 could not push the unpushed round: see its log");
      }
    }
    return pushed;
  }

  // Rank 0's trainable tensors for every rank, in place in backend memory.
  Status BroadcastTrainable() {
    if (!comm_) return Status::Ok();
    ISTHMUS_RETURN_IF_ERROR(gpt_->ops().Synchronize());
    ISTHMUS_RETURN_IF_ERROR(
        comm_->Broadcast(gpt_->TrainableData(), static_cast<size_t>(gpt_->TrainableElements()), 0));
    gpt_->TrainableChanged();
    return gpt_->ops().Synchronize();
  }

  // Rank 0's AdamW moments to every rank. Sharded, each rank keeps its part of the whole
  // moments rank 0 loaded (zeros when it had no checkpoint), sent through host memory.
  Status ShareMoments() {
    const size_t n = static_cast<size_t>(gpt_->TrainableElements());
    if (!trainer_->sharded()) {  // straight from backend memory
      ISTHMUS_RETURN_IF_ERROR(comm_->Broadcast(trainer_->MomentData(0), n, 0));
      return comm_->Broadcast(trainer_->MomentData(1), n, 0);
    }
    resume_m_.resize(n, 0.0f);
    resume_v_.resize(n, 0.0f);
    ISTHMUS_RETURN_IF_ERROR(BroadcastHost(resume_m_.data(), n));
    ISTHMUS_RETURN_IF_ERROR(BroadcastHost(resume_v_.data(), n));
    Status st = trainer_->LoadMoments(resume_m_.data(), resume_v_.data());
    resume_m_ = {};
    resume_v_ = {};
    return st;
  }

  Status BroadcastHost(float* data, size_t n) {
    if (!comm_) return Status::Ok();
    return HostCollective(*comm_, *compute_.ops, data, n, /*broadcast=*/true);
  }

  // Steps for the next round, the same on every rank.
  Result<int64_t> NextRoundSteps() {
    int64_t h = s_.StepsPerRound();
    if (s_.round_seconds > 0) {
      if (step_seconds_ > 0) {
        h = std::llround(s_.round_seconds / step_seconds_);
      } else if (s_.steps_per_round <= 0) {
        h = 10;  // first round: a short one that measures the step time
      }
      h = std::clamp<int64_t>(h, 1, 100000);
      float v = static_cast<float>(h);
      ISTHMUS_RETURN_IF_ERROR(BroadcastHost(&v, 1));
      h = static_cast<int64_t>(v);
    }
    if (s_.max_steps > 0) h = std::min<int64_t>(h, s_.max_steps - step_);
    return h;
  }

  Status Validate(const char* when) {
    auto v = ValidationLoss(*gpt_, s_.data_dir + "/val.bin", s_.batch_size, s_.rank, world(),
                            s_.val_batches, comm_.get());
    if (!v.ok()) {
      if (v.status().code() == Code::kUnavailable || v.status().code() == Code::kTimeout) {
        return v.status();
      }
      progress_->Message(std::string("validation skipped: ") + v.status().ToString());
      return Status::Ok();
    }
    val_loss_ = *v;
    val_loss_step_ = step_;
    telemetry_->OnValidation(round_ + in_round_, step_, "site", *v);
    if (leader()) {
      char buf[128];
      std::snprintf(buf, sizeof buf, "validation %s step %lld round %lld: loss %.4f", when,
                    static_cast<long long>(step_), static_cast<long long>(round_ + in_round_), *v);
      progress_->Message(buf);
    }
    return Status::Ok();
  }

  // Pushes round round_'s `delta` to the shards s with s % world == rank, with the site's
  // token count and this rank's compute time for it (the shards size adaptive codecs by
  // it). The idempotency keys name the round and the shard, whoever pushes.
  Status PushDelta(const std::vector<Tensor>& delta, uint64_t round_tokens, uint64_t compute_ms,
                   int rank, int world) {
    std::vector<TensorView> views;
    for (const auto& t : delta) views.push_back({t.name, t.shape, t.data.data()});
    ISTHMUS_ASSIGN_OR_RETURN(
        auto pushed, site_->PushRound(static_cast<uint64_t>(round_), round_tokens, compute_ms,
                                      views, rank, world));
    for (const auto& p : pushed) {
      if (p.duplicate) {
        spdlog::info("shard {} already had round {} (key {}): nothing applied twice", p.shard,
                     round_, p.key);
      }
    }
    return Status::Ok();
  }

  // --- The end of a round: common/round_driver.h ----------------------------------------

  // The per-step control value: this rank's stop vote, whether its round in flight failed,
  // and (rank 0) whether the round in flight is done, so that every rank merges it after
  // the same step. Encoded as digits in base world + 1 so that the ranks' sum (the
  // all-reduce averages it; times world it is exact for these small integers) keeps them.
  float EncodeControl() const {
    const float b = static_cast<float>(world() + 1);
    const bool failed = driver_ && driver_->Failed();
    const bool ready = leader() && driver_ && driver_->Ready();
    return (stop_ ? 1.0f : 0.0f) + (failed ? b : 0.0f) + (ready ? b * b : 0.0f);
  }
  struct Control {
    bool stop = false, failed = false, ready = false;
  };
  Control DecodeControl(float control) const {
    const int64_t b = world() + 1;
    const int64_t sum = std::llround(comm_ ? control * static_cast<float>(world()) : control);
    return {sum % b > 0, (sum / b) % b > 0, sum / (b * b) > 0};
  }

  // How every rank waits for the round in flight with several ranks: all poll together
  // (one small collective every 20 ms, as the serial wait did), rank 0's `done` counts, and
  // a stop on any rank ends the round's wait for the WAN on rank 0.
  Status AwaitTogether(const std::function<bool()>& done) {
    for (;;) {
      float v[2] = {leader() && done() ? 1.0f : 0.0f, Stopping() ? 1.0f : 0.0f};
      ISTHMUS_RETURN_IF_ERROR(HostCollective(*comm_, *compute_.ops, v, 2, /*broadcast=*/false));
      if (v[1] > 0) interrupted_ = true;
      if (v[0] > 0) return Status::Ok();
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }

  // The round driver of a synced run, once the live weights are where training starts.
  Status StartDriver() {
    ISTHMUS_ASSIGN_OR_RETURN(live_, ModelLiveParams::Create(*gpt_, comm_.get()));
    rounds_ = std::make_unique<SiteRounds>(*site_);
    RoundDriverOptions o;
    o.overlap = s_.overlap;
    o.rank = s_.rank;
    o.world = world();
    if (s_.encode_deltas) {  // rank 0 encodes and pushes every shard
      o.rank = 0;
      o.world = 1;
      o.push = leader();
    }
    o.pull = leader();
    o.stopping = [this] { return Stopping(); };
    // Every rank must decide alike at the end of a round whether K = 0 makes it wait (the
    // wait is collective): K as the shards said at start-up, not as each rank last heard.
    o.follow_limit = false;
    if (comm_) o.await = [this](const std::function<bool()>& done) { return AwaitTogether(done); };
    o.on_wan_wait = [this](const std::string& reason, double push_s) {
      // The push is done: metrics show it while the site waits.
      telemetry_->OnPush(push_s);
      push_reported_ = driver_->inflight() ? driver_->inflight()->round : 0;
      telemetry_->OnWanWaitBegin();
      if (leader()) progress_->Message(reason);
    };
    // Every rank's outcome of the round, for every rank (a collective).
    o.agree = [this](const Status& mine) {
      Status shared;
      Status st = ShareOutcome(AsInterrupted(mine),
                               "could not finish round " + std::to_string(ending_round_), &shared);
      if (!st.ok()) site_lost_ = true;
      return st.ok() ? shared : st;
    };
    const char* after_push = std::getenv("ISTHMUS_WORKER_FAULT_CRASH_AFTER_PUSH");
    const char* after_pull = std::getenv("ISTHMUS_WORKER_FAULT_CRASH_AFTER_PULL");
    const char* hang_push = std::getenv("ISTHMUS_WORKER_FAULT_HANG_BEFORE_PUSH");
    const int64_t crash_push = after_push && s_.overlap ? std::atoll(after_push) : -1;
    const int64_t crash_pull = after_pull ? std::atoll(after_pull) : -1;
    const int64_t hang = hang_push ? std::atoll(hang_push) : -1;
    if (crash_push > 0 || crash_pull > 0 || hang > 0) {
      o.fault = [crash_push, crash_pull, hang](const char* stage, uint64_t round) {
        const std::string at = stage;
        const auto r = static_cast<int64_t>(round);
        if (at == "pushing" && r == hang) {
          spdlog::error("fault injection: the background push of round {} hangs", round);
          for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
        }
        const bool push = at == "pushed" && r == crash_push;
        const bool pull = at == "pulled" && r == crash_pull;
        if (!push && !pull) return;
        spdlog::error("fault injection: exiting in the background after {} round {}",
                      push ? "pushing" : "pulling", round);
        std::fflush(nullptr);
        ::_exit(137);
      };
    }
    driver_ = std::make_unique<RoundDriver>(*rounds_, live_.get(), std::move(o));
    driver_->set_limit(start_limit_);
    return Status::Ok();
  }

  // Test hook: ISTHMUS_WORKER_RECORD_DELTAS=DIR makes rank 0 write each round's delta, as
  // pushed, to DIR/round-R.safetensors before the push.
  Status RecordDelta(const RoundInFlight& in) {
    static const char* dir = std::getenv("ISTHMUS_WORKER_RECORD_DELTAS");
    if (dir == nullptr || !leader()) return Status::Ok();
    return WriteSafetensors(
        std::string(dir) + "/round-" + std::to_string(in.round) + ".safetensors", *in.delta,
        {{"tokens", std::to_string(in.tokens)}});
  }

  // What a completed round tells the telemetry and the log.
  void ReportRound(const RoundReport& r) {
    if (r.round == 0) return;
    for (const auto& p : r.pushes) {
      if (p.duplicate) {
        spdlog::info("shard {} already had round {} (key {}): nothing applied twice", p.shard,
                     r.round, p.key);
      }
    }
    if (encoder_ && r.pushed) {
      // What --encode-deltas saved: the round's pushes against its fp32 deltas (the site
      // client's counters; its pushes ran on the driver's thread, done by now).
      const uint64_t bytes = site_->pushed_bytes() - reported_bytes_;
      const uint64_t raw = site_->pushed_raw_bytes() - reported_raw_bytes_;
      reported_bytes_ = site_->pushed_bytes();
      reported_raw_bytes_ = site_->pushed_raw_bytes();
      spdlog::info("round {}: pushed {:.2f} MB encoded for {:.2f} MB of fp32 deltas", r.round,
                   static_cast<double>(bytes) / 1e6, static_cast<double>(raw) / 1e6);
    }
    if (push_reported_ != r.round) telemetry_->OnPush(r.push_s);
    telemetry_->OnCheckpoint(r.first_s);
    push_reported_ = 0;
    telemetry_->OnWanWait(r.blocked_wan_s);
    telemetry_->OnPull(r.pull_s);
    telemetry_->OnBlocked(r.blocked_s);
    if (r.blocked_wan_s > 0 && leader()) {
      progress_->Message("WAN caught up after " + Progress::FormatDuration(r.blocked_wan_s));
    }
  }

  // A round that failed (its push, its wait or its pull, on any rank): it is kept in the
  // checkpoint (pushed again with its keys when training resumes: a shard that has it
  // answers duplicate), said in the log and the telemetry, and the run stops with the
  // status's exit code (a shard's refusal: exit 3); a stop that cut a wait on the shards
  // short ends the run as interrupted (exit 7). With --overlap the checkpoint holding the
  // round was written before its push, at the end of its round, and is left as it is (the
  // steps trained since are done again); without, it is written now.
  Status RoundFailed(Status st) {
    if (site_lost_) return st;  // a rank is gone: the in-site collective failed (as before)
    st = AsInterrupted(st);
    // Without overlap a refusal is not kept: the restart redoes the round from the last
    // checkpoint (as before the round driver); a shard that did not answer keeps it.
    const bool unanswered =
        IsInterrupted(st) || st.code() == Code::kTimeout || st.code() == Code::kUnavailable;
    if (!s_.overlap && !unanswered) {
      telemetry_->OnRoundFailure(pending_ ? static_cast<int64_t>(pending_->round) : round_,
                                 st.ToString());
      spdlog::error("round {} did not complete: {}", round_, st.ToString());
      return RefusedIfRefusal(st);
    }
    if (pending_) unpushed_ = Unpushed{pending_->delta, pending_->tokens, pending_->compute_ms};
    const int64_t round = pending_ ? static_cast<int64_t>(pending_->round) : round_;
    telemetry_->OnRoundFailure(round, st.ToString());
    if (checkpoint_failed_->exchange(false)) {
      // Nothing of the round was pushed, and the last checkpoint written stays: a restart
      // trains from it again (pushing the round it holds, if any, with its keys).
      spdlog::error("round {} was not pushed: {}; training resumes from the checkpoint before it",
                    round, st.ToString());
      return st;
    }
    if (!s_.overlap) ISTHMUS_RETURN_IF_ERROR(SaveCheckpoint());
    const std::string kept =
        s_.checkpoint_dir.empty()
            ? "round " + std::to_string(round) + " is lost (no --checkpoint-dir)"
            : "round " + std::to_string(round) +
                  " is kept in the checkpoint and pushed again when training resumes";
    if (IsInterrupted(st)) {
      interrupted_ = true;
      stop_note_ = "the shards did not answer; " + kept;
      progress_->Message("interrupted: " + stop_note_ +
                         (s_.checkpoint_dir.empty()
                              ? std::string()
                              : "; checkpointed at step " + std::to_string(checkpoint_step_)));
      return Status::Ok();
    }
    spdlog::error("round {} did not complete: {}; {}", round, st.ToString(), kept);
    return RefusedIfRefusal(st);
  }

  // A shard that refused a round (not one that did not answer) refused the worker: exit 3.
  Status RefusedIfRefusal(const Status& st) const {
    const Code c = st.code();
    if (c == Code::kFailedPrecondition || c == Code::kInvalidArgument || c == Code::kNotFound ||
        c == Code::kResourceExhausted || c == Code::kAlreadyExists) {
      return Refused(st.message());
    }
    return st;
  }

  // Completes the round in flight (waiting for it if need be) and merges its pulled state.
  Status CompleteInFlight() {
    if (!driver_ || !driver_->busy()) return Status::Ok();
    ending_round_ = driver_->inflight()->round;
    auto r = driver_->Complete();
    if (!r.ok()) return RoundFailed(r.status());
    ReportRound(*r);
    if (r->merged && steps_since_push_ > 0) {
      spdlog::info(
          "round {}: the pulled state merged after {} steps of round {}, their progress "
          "kept",
          r->round, steps_since_push_, r->round + 1);
    }
    pending_.reset();
    unpushed_.reset();
    return Status::Ok();
  }

  // The end of round round_ on a synced run: the round in flight completes, this round's
  // delta is taken on the backend (and, with overlap, checkpointed as the round in flight
  // before a byte is pushed), then pushed; without overlap it also waits and pulls here.
  Status EndOfRound(uint64_t round_tokens, uint64_t compute_ms) {
    ISTHMUS_RETURN_IF_ERROR(CompleteInFlight());
    if (interrupted_ && unpushed_) return Status::Ok();  // it failed: stop with it kept
    ending_round_ = static_cast<uint64_t>(round_);
    auto before_push = [&](RoundInFlight& in) -> Status {
      pending_ = in;
      ISTHMUS_RETURN_IF_ERROR(RecordDelta(in));
      if (!s_.overlap) return Status::Ok();
      unpushed_ = Unpushed{in.delta, in.tokens, in.compute_ms};
      // The checkpoint that holds the round is copied out here, at the step boundary, and
      // written on the driver's thread before the push: durable before a byte is pushed,
      // and off the training thread (in full mode it is the model and AdamW's moments;
      // with --checkpoint-state-every N only rounds 1, N + 1, ... hold them).
      const bool with_state =
          (in.round - 1) % static_cast<uint64_t>(s_.CheckpointStateEvery()) == 0;
      ISTHMUS_ASSIGN_OR_RETURN(auto image, TakeCheckpoint(with_state));
      if (!image) return Status::Ok();
      auto held = std::make_shared<CheckpointImage>(std::move(*image));
      in.first = [held, round = in.round, failed = checkpoint_failed_, spare = spare_image_,
                  &stop = stop_]() -> Status {
        Status st = WriteCheckpoint(*held);
        // A full disk: the round waits (it is pushed only once its checkpoint is durable)
        // and the write is retried every second until there is room, so freeing space is
        // enough; a stop keeps the checkpoint before it.
        auto next_note = Clock::now();
        while (st.code() == Code::kResourceExhausted && !stop) {
          if (Clock::now() >= next_note) {
            spdlog::warn(
                "round {}: cannot write the checkpoint that holds it before its push: {}; "
                "waiting for space, retrying every second (SIGTERM stops with the checkpoint "
                "before it)",
                round, st.message());
            next_note = Clock::now() + std::chrono::seconds(30);
          }
          for (int i = 0; i < 10 && !stop; ++i) {
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
          }
          st = WriteCheckpoint(*held);
          if (st.ok()) spdlog::info("round {}: checkpoint written, space is back", round);
        }
        ReturnImage(*spare, *held);  // `first` runs once: the image is not read again
        if (st.ok()) return st;
        failed->store(true);
        return Status(st.code(), "writing the checkpoint that holds round " +
                                     std::to_string(round) + " before its push: " + st.message());
      };
      return Status::Ok();
    };
    auto before = [&](RoundInFlight& in) {
      steps_since_push_ = 0;
      return before_push(in);
    };
    auto r = driver_->EndRound(static_cast<uint64_t>(round_), round_tokens, compute_ms, before);
    if (!r.ok()) return RoundFailed(r.status());
    ReportRound(*r);
    if (!s_.overlap) {
      pending_.reset();
      unpushed_.reset();
    }
    return Status::Ok();
  }

  Status Loop() {
    auto t0 = Clock::now();
    uint64_t tokens_here = 0;
    const char* fault = std::getenv("ISTHMUS_WORKER_FAULT_CRASH_AFTER_PUSH");
    const char* fault_before = std::getenv("ISTHMUS_WORKER_FAULT_CRASH_BEFORE_PUSH");
    if (!s_.standalone) ISTHMUS_RETURN_IF_ERROR(StartDriver());
    for (;;) {
      if (s_.max_rounds > 0 && round_ >= s_.max_rounds) break;
      if (s_.max_steps > 0 && step_ >= s_.max_steps) break;
      ISTHMUS_ASSIGN_OR_RETURN(int64_t h, NextRoundSteps());
      const auto round_t0 = Clock::now();
      uint64_t round_tokens = 0;
      double compute_s = 0;  // steps only: no validation, no WAN wait
      int64_t done = 0;
      for (; done < h; ++done) {
        auto step_t0 = Clock::now();
        auto batch = dataset_->Next();
        for (int k = 1; k < s_.grad_accum; ++k) {  // micro-batches, one after the other
          auto more = dataset_->Next();
          batch.tokens.insert(batch.tokens.end(), more.tokens.begin(), more.tokens.end());
          batch.targets.insert(batch.targets.end(), more.targets.begin(), more.targets.end());
          batch.windows.insert(batch.windows.end(), more.windows.begin(), more.windows.end());
          batch.batch_size += more.batch_size;
        }
        std::optional<model::TeacherTopK> teacher;
        if (teacher_) {
          ISTHMUS_RETURN_IF_ERROR(teacher_->Fill(batch, &teacher_ids_, &teacher_logits_));
          teacher = model::TeacherTopK{teacher_ids_.data(), teacher_logits_.data()};
        }
        ISTHMUS_ASSIGN_OR_RETURN(
            model::StepStats st,
            trainer_->Step(batch.tokens.data(), batch.targets.data(), s_.batch_size, model_.context,
                           EncodeControl(), s_.grad_accum, teacher ? &*teacher : nullptr));
        const double step_s = std::chrono::duration<double>(Clock::now() - step_t0).count();
        compute_s += step_s;
        telemetry_->OnStep(step_s, st.loss, tokens_per_step_, st.skipped);
        if (buckets_) {
          telemetry_->OnAllReduce(buckets_->last().reduce_seconds,
                                  buckets_->last().exposed_seconds);
        } else if (comm_) {
          telemetry_->OnAllReduce(allreduce_seconds_, allreduce_seconds_);
        }
        if (!trainer_->graph_error().empty() && !said_graphs_ && leader()) {
          progress_->Message("CUDA graphs off, launching kernels one by one: " +
                             trainer_->graph_error());
          said_graphs_ = true;
        }
        ++step_;
        round_tokens += tokens_per_step_;
        tokens_ += tokens_per_step_;
        tokens_here += tokens_per_step_;
        if (st.skipped)
          progress_->Message("step " + std::to_string(step_) + ": non-finite gradient, skipped");
        if (leader()) progress_->OnStep(step_, round_ + 1, st.loss, tokens_per_step_);
        const Control ctl = DecodeControl(st.control);
        if (driver_) {
          driver_->Stepped();
          ++steps_since_push_;
          // The round in flight is done (rank 0) or failed (any rank): every rank merges it
          // (or fails with it) after this same step, no earlier than the merge step
          // (--merge-after-steps; with --merge-wait exactly there, waiting if need be).
          const MergePolicy merge{s_.merge_after_steps, s_.merge_wait};
          const bool merge_now = merge.Now(steps_since_push_, h, driver_->busy(), ctl.ready);
          if (merge_now || ctl.failed) {
            if (ctl.failed && leader()) driver_->Cancel();
            ISTHMUS_RETURN_IF_ERROR(CompleteInFlight());
            if (interrupted_ && unpushed_) break;
          }
        }
        if (s_.val_every > 0 && step_ % s_.val_every == 0) {
          in_round_ = 1;
          ISTHMUS_RETURN_IF_ERROR(Validate("at"));
          in_round_ = 0;
          validated_step_ = step_;
        }
        if (ctl.stop) {
          interrupted_ = true;
          ++done;
          break;
        }
      }
      if (done > 0) {
        step_seconds_ = compute_s / static_cast<double>(done);
      }
      if (interrupted_ && unpushed_) break;  // a round in flight failed after a stop
      ++round_;
      if (!s_.standalone) {
        if (fault_before && std::atoll(fault_before) == round_) {
          spdlog::error("fault injection: exiting before pushing round {}", round_);
          std::fflush(nullptr);
          ::_exit(137);
        }
        ISTHMUS_RETURN_IF_ERROR(
            EndOfRound(round_tokens, static_cast<uint64_t>(compute_s * 1e3 + 0.5)));
        if (interrupted_ && unpushed_) break;  // checkpointed with the round kept
        if (fault && !s_.overlap && std::atoll(fault) == round_) {
          spdlog::error("fault injection: exiting after pushing round {}", round_);
          std::fflush(nullptr);
          ::_exit(137);
        }
      }
      telemetry_->OnRound(round_, step_, tokens_, compute_s, round_tokens,
                          std::chrono::duration<double>(Clock::now() - round_t0).count());
      if (s_.eval_every_rounds > 0 && round_ % s_.eval_every_rounds == 0 && !interrupted_) {
        ISTHMUS_RETURN_IF_ERROR(EvaluateSets());
      }
      if (interrupted_) break;
      // With overlap the round in flight was checkpointed before its push (EndOfRound).
      if (!s_.overlap || s_.standalone) {
        const auto c0 = Clock::now();
        ISTHMUS_RETURN_IF_ERROR(SaveCheckpoint());
        telemetry_->OnCheckpoint(std::chrono::duration<double>(Clock::now() - c0).count());
      }
    }
    if (!(interrupted_ && unpushed_) && driver_ && driver_->busy()) {
      // The last round: its push, wait (none after a stop) and pull, then the checkpoint.
      ISTHMUS_RETURN_IF_ERROR(CompleteInFlight());
    }
    if (!(interrupted_ && unpushed_) && (interrupted_ || s_.overlap)) {
      ISTHMUS_RETURN_IF_ERROR(SaveCheckpoint());
    }
    if (interrupted_ && stop_note_.empty()) {  // else RoundFailed said how it stopped
      progress_->Message("interrupted: round " + std::to_string(round_) + " step " +
                         std::to_string(step_) + " checkpointed");
    }
    seconds_ = std::chrono::duration<double>(Clock::now() - t0).count();
    rate_ = seconds_ > 0 ? static_cast<double>(tokens_here) / seconds_ : 0;
    return Status::Ok();
  }

  Result<TrainSummary> Finish() {
    if (!interrupted_ && validated_step_ != step_) ISTHMUS_RETURN_IF_ERROR(Validate("final,"));
    telemetry_->OnEnd(round_, step_, tokens_, interrupted_);
    progress_->Finish();
    TrainSummary sum;
    sum.val_loss = val_loss_;
    sum.steps = step_;
    sum.rounds = round_;
    sum.tokens = tokens_;
    sum.seconds = seconds_;
    sum.tokens_per_s = rate_;
    sum.interrupted = interrupted_;
    if (s_.standalone && leader() && !s_.save.empty()) {
      auto tensors = gpt_->ExportTrainable();
      ISTHMUS_RETURN_IF_ERROR(gpt_->ops().status());
      auto meta = gpt_->ConfigMetadata();
      meta.merge(model_.TrainableMetadata());
      ISTHMUS_RETURN_IF_ERROR(WriteSafetensors(s_.save, tensors, meta));
    }
    if (leader()) {
      // An interrupted run skips the final validation: its loss is the last one measured
      // (and at which step), or none.
      char val[96];
      if (!std::isfinite(val_loss_)) {
        std::snprintf(val, sizeof val, "val loss not evaluated%s",
                      interrupted_ ? " (interrupted)" : "");
      } else if (val_loss_step_ != step_) {
        std::snprintf(val, sizeof val, "val loss %.4f (at step %lld)", val_loss_,
                      static_cast<long long>(val_loss_step_));
      } else {
        std::snprintf(val, sizeof val, "val loss %.4f", val_loss_);
      }
      char buf[320];
      std::snprintf(buf, sizeof buf,
                    "%s: %lld rounds, %lld steps, %llu tokens, %.1f s, %.0f tok/s, %s",
                    interrupted_ ? "interrupted" : "done", static_cast<long long>(round_),
                    static_cast<long long>(step_), static_cast<unsigned long long>(tokens_),
                    seconds_, rate_, val);
      progress_->Message(buf);
      if (!s_.json_summary.empty()) {
        nlohmann::json j = {
            {"val_loss", std::isfinite(val_loss_) ? nlohmann::json(val_loss_) : nlohmann::json()},
            {"steps", step_},
            {"rounds", round_},
            {"tokens", tokens_},
            {"seconds", seconds_},
            {"tokens_per_s", rate_},
            {"interrupted", interrupted_.load()}};
        std::string tmp = s_.json_summary + ".tmp";
        std::ofstream out(tmp);
        out << j.dump(2) << "\n";
        out.close();
        if (!out || std::rename(tmp.c_str(), s_.json_summary.c_str()) != 0) {
          return Status::IoError("cannot write " + s_.json_summary);
        }
      }
    }
    return sum;
  }

  const TrainSettings& s_;
  const std::atomic<bool>& stop_;
  ModelSettings model_;  // s_.model with the job's settings agreed on (AgreeOnModel)
  // A round the shards did not take (they did not answer before the stop): its delta, the
  // site's tokens and this rank's compute time, kept in the checkpoint until pushed.
  // With --overlap also the round in flight, checkpointed before its push.
  struct Unpushed {
    std::shared_ptr<const std::vector<Tensor>> delta;
    uint64_t tokens = 0, compute_ms = 0;
  };
  std::optional<Unpushed> unpushed_;
  // When GiveUp first saw a stop (steady clock ticks; 0: not yet).
  std::atomic<int64_t> stop_seen_{0};
  std::string stop_note_;           // how a stop ended a wait on the shards, for the last message
  std::vector<Tensor> start_pull_;  // rank 0: the job's tensors pulled at start-up, until
                                    // Resume (which loads them when it follows the shards)
  OpenedCompute compute_;
  std::unique_ptr<comm::Communicator> comm_;
  // The gradient all-reduce in buckets during the backward (--bucket-mb > 0); it uses comm_
  // only inside a step, so it is declared after it and goes first.
  std::unique_ptr<comm::BucketedAllReduce> buckets_;
  // Sharded optimizer state: the whole moments rank 0 loaded from its checkpoint, until
  // ShareMoments hands each rank its part.
  std::vector<float> resume_m_, resume_v_;
  // --encode-deltas: the checkpoint's residuals until SetUpEncoder; rank 0's encoder (owned
  // by site_; used by the round driver's thread while a round is in flight, here otherwise).
  std::map<std::string, std::vector<float>> resume_residuals_;
  codec::FeedbackEncoder* encoder_ = nullptr;
  uint64_t reported_bytes_ = 0, reported_raw_bytes_ = 0;  // site_'s counters at the last report
  double allreduce_seconds_ = 0;  // the last step's all-reduce with --bucket-mb 0
  std::unique_ptr<model::Gpt> gpt_;
  std::unique_ptr<model::Trainer> trainer_;
  std::unique_ptr<data::TokenDataset> dataset_;
  std::unique_ptr<data::TeacherCache> teacher_;  // --teacher-topk
  std::vector<int32_t> teacher_ids_;             // the step's teacher rows
  std::vector<float> teacher_logits_;
  std::unique_ptr<SiteClient> site_;  // null when standalone
  // The end of a round (synced runs): the driver owns site_ while a round is in flight.
  std::unique_ptr<ModelLiveParams> live_;
  std::unique_ptr<SiteRounds> rounds_;
  std::unique_ptr<RoundDriver> driver_;   // declared after what it borrows: goes first
  std::optional<RoundInFlight> pending_;  // the round being pushed or in flight
  uint64_t ending_round_ = 0;             // the round being completed, for messages
  uint64_t start_limit_ = 0;              // K as the shards said at start-up
  bool site_lost_ = false;                // an in-site collective failed (a rank gone)
  int64_t steps_since_push_ = 0;          // steps since the last round's delta was taken
  uint64_t push_reported_ = 0;            // the round whose push the telemetry already has
  std::unique_ptr<Progress> progress_;
  std::unique_ptr<Telemetry> telemetry_;  // rank 0's metrics and events (no-op elsewhere)
  std::string base_hash_;
  int64_t start_rounds_max_ = 0;  // the highest and lowest local round among the shards
  int64_t start_rounds_min_ = 0;
  int64_t checkpoint_world_ = 0;  // ranks of the run that wrote the checkpoint
  int64_t round_ = 0, step_ = 0;
  int64_t checkpoint_step_ = 0;  // the step the last checkpoint holds
  // Set by the round driver's thread when the checkpoint of the round in flight could not
  // be written (--overlap writes it there, before the push).
  std::shared_ptr<std::atomic<bool>> checkpoint_failed_ = std::make_shared<std::atomic<bool>>();
  std::shared_ptr<SpareImage> spare_image_ = std::make_shared<SpareImage>();
  uint64_t tokens_ = 0, tokens_per_step_ = 0;
  double step_seconds_ = 0, seconds_ = 0, rate_ = 0;
  double val_loss_ = std::numeric_limits<double>::quiet_NaN();
  int64_t val_loss_step_ = -1;            // the step val_loss_ was measured at
  std::atomic<bool> interrupted_{false};  // read by the round driver's thread (Stopping)
  bool said_graphs_ = false;
  int64_t in_round_ = 0;         // 1 while validating inside a round (for the message)
  int64_t validated_step_ = -1;  // last step validated, so the end does not repeat it
};

}  // namespace

Status Refused(const std::string& message) {
  return Status::PermissionDenied(kRefusedPrefix + message);
}

Status UsageError(const std::string& message) {
  return Status::InvalidArgument(kUsagePrefix + message);
}

Status Interrupted(const std::string& message) {
  return Status::Unavailable(kInterruptedPrefix + message);
}

bool IsInterrupted(const Status& status) {
  return status.code() == Code::kUnavailable && status.message().rfind(kInterruptedPrefix, 0) == 0;
}

int ExitCodeFor(const Status& status) {
  if (status.ok()) return kExitOk;
  if (status.message().rfind(kUsagePrefix, 0) == 0) return kExitUsage;
  if (IsInterrupted(status)) return kExitInterrupted;
  if (status.code() == Code::kPermissionDenied && status.message().rfind(kRefusedPrefix, 0) == 0) {
    return kExitRefused;
  }
  if (status.message().rfind(kDevicePrefix, 0) == 0) {
    return status.code() == Code::kResourceExhausted ? kExitOutOfMemory : kExitUsage;
  }
  return ExitCodeForStatus(status);
}

Status StatusForExitCode(int code, const std::string& message) {
  switch (code) {
    case kExitOk:
      return Status::Ok();
    case kExitUsage:
      return UsageError(message);
    case kExitRefused:
      return Refused(message);
    case kExitNotFound:
      return Status::NotFound(message);
    case kExitUnreachable:
      return Status::Unavailable(message);
    case kExitDamaged:
      return Status::Corruption(message);
    case kExitInterrupted:
      return Interrupted(message);
    case kExitOutOfMemory:
      return DeviceError(Status::ResourceExhausted(message));
    default:
      return Status::Internal(message);
  }
}

model::Trainer::GradHook MakeAllReduceHook(comm::Communicator* comm, bool bf16) {
  return [comm, bf16](float* grads, size_t count) {
    return comm::ReduceGradient(*comm, grads, 0, count, count, bf16);
  };
}

Status HostCollective(comm::Communicator& comm, ops::Ops& ops, float* data, size_t n,
                      bool broadcast) {
  if (ops.HostMemory()) {
    return broadcast ? comm.Broadcast(data, n, 0) : comm.AllReduceSum(data, n);
  }
  ISTHMUS_ASSIGN_OR_RETURN(ops::Buffer staged, ops::Buffer::Allocate(ops, n * sizeof(float)));
  ops.Upload(staged.data(), data, n * sizeof(float));
  ISTHMUS_RETURN_IF_ERROR(ops.status());
  ISTHMUS_RETURN_IF_ERROR(broadcast ? comm.Broadcast(staged.as<float>(), n, 0)
                                    : comm.AllReduceSum(staged.as<float>(), n));
  ops.Download(data, staged.data(), n * sizeof(float));
  return ops.status();
}

Status DeviceError(const Status& status) {
  return Status(status.code(), kDevicePrefix + status.message());
}

Result<std::unique_ptr<model::Gpt>> BuildModel(const ModelSettings& m,
                                               const model::Compute& compute) {
  ISTHMUS_RETURN_IF_ERROR(m.Validate());
  ISTHMUS_ASSIGN_OR_RETURN(auto mode, model::ParseTrainMode(m.mode));
  auto config = m.Gpt();
  if (m.base.empty()) return model::Gpt::CreateRandom(config, mode, m.Lora(), m.seed, compute);
  return model::Gpt::LoadBase(m.base, m.heads, mode, m.Lora(), m.seed, &config, compute);
}

Result<int> TeacherCacheK(const std::string& teacher_topk) {
  if (teacher_topk.empty()) return 0;
  ISTHMUS_ASSIGN_OR_RETURN(auto info, data::TeacherCache::ReadInfo(teacher_topk));
  return info.k;
}

Result<TrainingPlan> PlanTraining(const ModelSettings& m, const model::Compute& compute, int B,
                                  bool synced, int distill_k, int optimizer_shards) {
  ISTHMUS_RETURN_IF_ERROR(m.Validate());
  ISTHMUS_ASSIGN_OR_RETURN(auto mode, model::ParseTrainMode(m.mode));
  TrainingPlan out;
  ISTHMUS_ASSIGN_OR_RETURN(
      out.plan, model::Gpt::PlanMemory(m.Gpt(), mode, m.Lora(), compute, B, m.context, synced,
                                       distill_k, optimizer_shards));
  const model::MemoryPlan& p = out.plan;
  auto gib = [](int64_t bytes) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%10.1f MiB", static_cast<double>(bytes) / (1 << 20));
    return std::string(buf);
  };
  ops::Ops& ops = compute.backend();
  const int64_t needed = p.backend_bytes() - p.backend_held;
  std::string t = "memory plan: " + std::to_string(m.layers) + " layers x " +
                  std::to_string(m.width) + ", vocabulary " + std::to_string(m.vocab_size) + ", " +
                  m.mode + ", " + ops::DtypeName(compute.precision) + ", batch " +
                  std::to_string(B) + " x " + std::to_string(m.context) +
                  (compute.recompute ? ", activation recompute" : "") + ", on " + ops.Describe() +
                  "\n";
  for (const auto& [what, bytes] : std::initializer_list<std::pair<const char*, int64_t>>{
           {"parameters (fp32)", p.parameters},
           {"bf16 weight copies", p.weight_copies},
           {"gradients (fp32)", p.gradients},
           {optimizer_shards > 1 ? "optimizer (moments, 1 part)" : "optimizer (AdamW moments)",
            p.optimizer},
           {"activations and batch", p.activations},
           {"round base and staging", p.round_buffers}}) {
    char line[96];
    std::snprintf(line, sizeof line, "  %-28s %s\n", what, gib(bytes).c_str());
    t += line;
  }
  char line[160];
  std::snprintf(line, sizeof line, "  %-28s %s\n  %-28s %s\n  %-28s %s  (of %s)\n",
                "training needs", gib(needed).c_str(), "held by the backend already",
                gib(p.backend_held).c_str(), "free on the device", gib(p.backend_free).c_str(),
                gib(p.backend_total).c_str());
  t += line;
  if (p.host_staging > 0) {
    std::snprintf(line, sizeof line, "  %-28s %s\n", "pinned host memory",
                  gib(p.host_staging).c_str());
    t += line;
  }
  if (p.host_masters > 0) {  // LoRA in bf16: the frozen base is bf16 on the device
    std::snprintf(line, sizeof line, "  %-28s %s\n", "host: frozen base fp32",
                  gib(p.host_masters).c_str());
    t += line;
  }
  out.table = t;
  out.fits = Status::Ok();
  if (!ops.HostMemory() && needed > p.backend_free) {
    out.fits = Status::ResourceExhausted(
        "training needs " + gib(needed) + " on " + ops.Describe() + " but " + gib(p.backend_free) +
        " is free: lower --batch-size or --context" +
        (compute.precision == ops::Dtype::kF32 ? ", use --precision bf16" : "") +
        (m.mode == "full" ? ", or train LoRA adapters (--mode lora)" : "") +
        " (isthmus-worker train --plan prints the parts)");
  }
  return out;
}

Result<std::unique_ptr<SiteClient>> ConnectSite(const ShardSettings& s,
                                                std::function<bool()> interrupted) {
  SiteOptions o;
  o.interrupted = std::move(interrupted);
  o.job = s.job;
  o.servers = s.servers;
  o.insecure_plaintext = s.insecure_plaintext;
  o.timeout_ms = s.timeout_ms;
  o.client_name = s.client_name.empty() ? "site" : s.client_name;
  if (!s.insecure_plaintext) {
    ISTHMUS_ASSIGN_OR_RETURN(o.client_keys, LoadKeyPairFile(s.key));
    for (const auto& file : s.server_keys) {
      ISTHMUS_ASSIGN_OR_RETURN(auto key, LoadPublicKeyFile(file));
      o.server_public_keys.push_back(std::move(key));
    }
    o.server_key_files = s.server_keys;  // a key rotation is followed (docs/DEPLOY.md)
  }
  return SiteClient::Connect(o);
}

Result<std::vector<HelloInfo>> HelloSite(SiteClient& site, const std::string& base_hash) {
  auto h = site.Hello(base_hash);
  if (!h.ok()) {
    const Code c = h.status().code();
    if (c == Code::kFailedPrecondition || c == Code::kPermissionDenied || c == Code::kNotFound) {
      return Refused(h.status().message());
    }
  }
  return h;
}

Result<std::vector<Tensor>> PullSite(SiteClient& site) {
  auto t = site.Pull();
  if (!t.ok() && t.status().code() == Code::kFailedPrecondition) {
    return Refused(t.status().message());
  }
  return t;
}

Result<double> ValidationLoss(model::Gpt& gpt, const std::string& path, int batch_size, int rank,
                              int world_size, int batches, comm::Communicator* comm) {
  // The batches are the first `batches` x world_size of one order that does not depend on
  // the ranks (rank r evaluates the r-th of every world_size), so a loss is the same
  // whatever the number of ranks that evaluate it, and equal to `isthmus-worker eval
  // --batches N` with N = batches x world_size (the demo's per-round curves and its
  // references are one measure).
  data::DatasetOptions d;
  d.batch_size = batch_size;
  d.seq_len = gpt.config().n_ctx;
  d.rank = 0;
  d.world_size = 1;
  d.seed = 0;
  d.vocab_size = gpt.config().vocab_size;
  auto ds = data::TokenDataset::Open(path, d);
  // Every rank must reach the collective below even when its file is unusable.
  float sums[2] = {0, 0};
  Status local;
  if (!ds.ok()) {
    local = ds.status();
  } else {
    const int world = std::max(world_size, 1);
    const int n = static_cast<int>(std::min<uint64_t>(
        static_cast<uint64_t>(batches) * static_cast<uint64_t>(world), ds->batches_per_epoch()));
    for (int i = 0; i < n; ++i) {
      auto b = ds->Next();
      if (i % world != rank) continue;
      sums[0] += gpt.Forward(b.tokens.data(), b.targets.data(), batch_size, d.seq_len);
      sums[1] += 1;
    }
    local = gpt.ops().status();
  }
  float failed = local.ok() ? 0.0f : 1.0f;
  if (comm) {
    float buf[3] = {sums[0], sums[1], failed};
    ISTHMUS_RETURN_IF_ERROR(HostCollective(*comm, gpt.ops(), buf, 3, /*broadcast=*/false));
    sums[0] = buf[0];
    sums[1] = buf[1];
    failed = buf[2];
  }
  if (!local.ok()) return local;
  if (failed > 0) return Status::FailedPrecondition("validation data unusable on another rank");
  if (sums[1] == 0) return Status::FailedPrecondition("no validation batches");
  return static_cast<double>(sums[0]) / sums[1];
}

Result<TrainSummary> RunTraining(const TrainSettings& settings, const std::atomic<bool>& stop) {
  ISTHMUS_RETURN_IF_ERROR(settings.Validate());
  RoundLoop loop(settings, stop);
  return loop.Run();
}

}  // namespace isthmus::worker
