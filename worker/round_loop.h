// The worker's outer loop: H inner steps with gradients averaged inside the site every
// step, then the round's change pushed to the site's shards and the merged tensors pulled
// back, with its own resumable checkpoint after each round. Also the pieces `eval` and
// `export` share with it (building the model, talking to every shard, validation loss).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/client.h"
#include "common/exit_codes.h"
#include "common/site_client.h"
#include "common/status.h"
#include "common/tensor.h"
#include "worker/comm/communicator.h"
#include "worker/model/gpt.h"
#include "worker/model/trainer.h"
#include "worker/worker_config.h"

namespace isthmus::worker {

// Process exit codes: the shared table (common/exit_codes.h, docs/WORKER.md).

// A refusal by a shard (kPermissionDenied, message prefixed "refused by shard: ").
Status Refused(const std::string& message);
// A problem with how isthmus-worker was called (message prefixed "usage: "): exit code 2.
Status UsageError(const std::string& message);
// A wait given up because the worker was asked to stop (message prefixed "interrupted: "):
// exit code 7. IsInterrupted tells such a status.
Status Interrupted(const std::string& message);
bool IsInterrupted(const Status& status);
// A problem with the compute device (message prefixed "device: "): one --device cannot
// name here, or out of memory.
Status DeviceError(const Status& status);
// kExitRefused for Refused() statuses; kExitUsage for UsageError() ones; kExitInterrupted
// for Interrupted() ones; for DeviceError() statuses kExitOutOfMemory when out of memory,
// else kExitUsage; otherwise the shared mapping of the status code (ExitCodeForStatus).
int ExitCodeFor(const Status& status);
// A status with `message` for which ExitCodeFor gives `code` (another rank's outcome,
// shared as its exit code). Ok for kExitOk.
Status StatusForExitCode(int code, const std::string& message);

// How long waits on the shards go on once a stop was asked (SIGTERM on this rank, or the
// site's stop vote): a push or pull a live shard answers completes, a dead one gives up.
inline constexpr std::chrono::milliseconds kStopGrace{3000};

struct TrainSummary {
  double val_loss = 0;      // NaN when no validation could run
  int64_t steps = 0;        // optimizer steps taken in total (including before a resume)
  int64_t rounds = 0;       // rounds completed in total
  uint64_t tokens = 0;      // tokens the whole site trained on, in total
  double seconds = 0;       // wall time of this process's training
  double tokens_per_s = 0;  // site tokens per second during this process's steps
  bool interrupted = false;
};

// Runs `train` to the end. Returns the summary (interrupted when `stop` became true: the
// step in flight finished, the partial round was pushed and the checkpoint written; when
// the shards did not answer within kStopGrace of the stop, the round is kept in the
// checkpoint instead and pushed when training resumes). Errors: refusals as Refused(), a
// stop before training began (waiting for the shards) as Interrupted(), everything else
// as its own Status. Uses every rank of the site collectively: all ranks call it with the
// same settings apart from --rank.
Result<TrainSummary> RunTraining(const TrainSettings& settings, const std::atomic<bool>& stop);

// The gradient hook of a multi-rank site: averages the model's flat gradient buffer (with
// the trainer's control value in its last float) over `comm` in one all-reduce, in the
// backend's memory; with `bf16` the values travel in bf16, the control value in fp32
// (comm::ReduceGradient). `comm` is borrowed and must outlive the hook.
model::Trainer::GradHook MakeAllReduceHook(comm::Communicator* comm, bool bf16 = false);

// A broadcast from rank 0 (broadcast) or a sum (else) of n host floats over `comm`, staged
// through backend memory when `ops` is not host memory (NCCL works on device buffers).
Status HostCollective(comm::Communicator& comm, ops::Ops& ops, float* data, size_t n,
                      bool broadcast);

// The model of `m` on `compute`: its base from m.base (LoadBase, shape checked against the
// flags), or a fresh random base from m.seed when m.base is empty.
Result<std::unique_ptr<model::Gpt>> BuildModel(const ModelSettings& m,
                                               const model::Compute& compute = {});

// The memory training `m` at batch B x `m.context` needs on `compute`'s device
// (model::Gpt::PlanMemory), as a table of its parts against the device's free memory; the
// status is ResourceExhausted, with the numbers, when it does not fit a GPU (on the CPU the
// kernel's free-page count leaves out reclaimable cache, so the table only informs).
struct TrainingPlan {
  model::MemoryPlan plan;
  std::string table;
  Status fits;
};
// `synced`: the run pushes rounds (not --standalone), which holds two more copies of the
// trainable tensors. `distill_k`: the teacher cache's k (--teacher-topk), 0 without one.
// `optimizer_shards`: the ranks that split the AdamW moments (--shard-optimizer), else 1.
Result<TrainingPlan> PlanTraining(const ModelSettings& m, const model::Compute& compute, int B,
                                  bool synced, int distill_k = 0, int optimizer_shards = 1);
// The k of the teacher cache at `teacher_topk` (its header), 0 for none ("").
Result<int> TeacherCacheK(const std::string& teacher_topk);

// The site client for --server/--server-key/--key (CURVE unless insecure); `interrupted`
// ends its waits early (SiteOptions::interrupted).
Result<std::unique_ptr<SiteClient>> ConnectSite(const ShardSettings& s,
                                                std::function<bool()> interrupted = {});

// Hello to every shard as a worker with `base_hash`; a refusal (another base, a key not
// allowed, no such job) is a Refused().
Result<std::vector<HelloInfo>> HelloSite(SiteClient& site, const std::string& base_hash);

// Pulls the job's tensors from every shard and returns their union (shard order); a
// tensor on another shard than the site's placement says is a Refused().
Result<std::vector<Tensor>> PullSite(SiteClient& site);

// Mean loss of `gpt` over the first `batches` x world_size batches (B x T) of `path` in one
// order that does not depend on the ranks, rank r taking every world_size-th from the r-th,
// averaged over `comm`'s ranks when comm is not null (a collective then). The same figure
// as one process evaluating batches x world_size batches (`isthmus-worker eval`).
Result<double> ValidationLoss(model::Gpt& gpt, const std::string& path, int batch_size, int rank,
                              int world_size, int batches, comm::Communicator* comm);

}  // namespace isthmus::worker
