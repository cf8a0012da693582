// The exit codes of every isthmus program (isthmus-server, isthmusctl, isthmus-worker,
// isthmus-data), defined once. --help footers and the tables in docs/CLI.md and
// docs/WORKER.md are generated from this table (a test checks the docs).
#pragma once

#include <string>

#include "common/status.h"

namespace isthmus {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;      // the operation failed (runtime, I/O, other)
inline constexpr int kExitUsage = 2;        // bad flags, config or arguments
inline constexpr int kExitRefused = 3;      // a key or permission problem, or a shard refused
inline constexpr int kExitNotFound = 4;     // job, snapshot, peer site or file not found
inline constexpr int kExitUnreachable = 5;  // a shard or peer did not answer
inline constexpr int kExitDamaged = 6;      // stored data damaged or storage failing
inline constexpr int kExitInterrupted = 7;  // SIGINT/SIGTERM (worker: after checkpointing)
inline constexpr int kExitOutOfMemory = 8;  // out of memory on the compute device

// The exit code for a Status by its code alone: InvalidArgument 2, PermissionDenied 3,
// NotFound 4, Timeout/Unavailable 5, Corruption/IoError 6, others 1 (programs refine it:
// isthmus-worker maps a shard's refusals to 3 and out-of-device-memory to 8).
int ExitCodeForStatus(const Status& status);

// The table as Markdown (| code | meaning |), as docs/CLI.md and docs/WORKER.md show it.
std::string ExitCodesMarkdown();
// One paragraph for --help footers: "Exit codes: 0 ok, 1 ...".
std::string ExitCodesFooter();

}  // namespace isthmus
