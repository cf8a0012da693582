// The exit code table (see exit_codes.h).
#include "common/exit_codes.h"

#include <string_view>

namespace isthmus {
namespace {

struct Row {
  int code;
  std::string_view brief;    // for --help
  std::string_view meaning;  // for the docs
};

constexpr Row kRows[] = {
    {kExitOk, "ok", "success; `isthmusctl sync verify`: every compared digest agrees"},
    {kExitFailure, "failed",
     "the operation failed (a runtime failure, a refusal not listed below); `isthmusctl sync "
     "verify`: a round's digests differ"},
    {kExitUsage, "bad usage",
     "bad usage: flags, config or arguments (a model flag that contradicts `--base` or a file "
     "of trainable tensors, a `--device` this machine lacks)"},
    {kExitRefused, "refused",
     "refused: a key or permission problem (key file mode, key not on an allowlist), or a "
     "shard refused the worker (base hash, no such job, tensor placement), or a site refused a "
     "membership change (`isthmusctl sync remove/leave`); `isthmusctl sync verify`: a site is "
     "no longer a member of a job (removed or left; the rounds before agree)"},
    {kExitNotFound, "not found", "not found (job, snapshot, peer site, file)"},
    {kExitUnreachable, "unreachable", "a shard or peer did not answer (timeout, unavailable)"},
    {kExitDamaged, "damaged data",
     "stored data is damaged or storage failed (a corrupt record, checkpoint or file; an I/O "
     "error)"},
    {kExitInterrupted, "interrupted",
     "interrupted by SIGINT/SIGTERM (isthmus-worker: the step in flight finished and the "
     "checkpoint written, with the partial round pushed or, when the shards did not answer, "
     "kept in it for the next start)"},
    {kExitOutOfMemory, "out of device memory",
     "out of memory on the compute device (the message names the configuration, what was "
     "asked for and what was free, and what to lower)"},
};

}  // namespace

int ExitCodeForStatus(const Status& status) {
  switch (status.code()) {
    case Code::kOk:
      return kExitOk;
    case Code::kInvalidArgument:
      return kExitUsage;
    case Code::kPermissionDenied:
      return kExitRefused;
    case Code::kNotFound:
      return kExitNotFound;
    case Code::kTimeout:
    case Code::kUnavailable:
      return kExitUnreachable;
    case Code::kCorruption:
    case Code::kIoError:
      return kExitDamaged;
    default:
      return kExitFailure;
  }
}

std::string ExitCodesMarkdown() {
  std::string out = "| code | meaning |\n|---|---|\n";
  for (const Row& r : kRows) {
    out += "| " + std::to_string(r.code) + " | " + std::string(r.meaning) + " |\n";
  }
  return out;
}

std::string ExitCodesFooter() {
  std::string out = "Exit codes:";
  for (const Row& r : kRows) {
    out +=
        std::string(r.code == 0 ? " " : ", ") + std::to_string(r.code) + " " + std::string(r.brief);
  }
  return out + " (docs/CLI.md).";
}

}  // namespace isthmus
