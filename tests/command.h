// Runs a shell command for a test and captures what it prints (stdout, and stderr where the
// command redirects it with 2>&1).
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <string>

namespace isthmus::testing {

struct CommandResult {
  int exit_code = -1;  // -1 when it could not run or did not exit normally
  std::string output;
};

inline CommandResult RunCommand(const std::string& cmd) {
  CommandResult r;
  FILE* f = ::popen(cmd.c_str(), "r");
  if (f == nullptr) return r;
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof buf, f)) r.output.append(buf, n);
  const int status = ::pclose(f);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

}  // namespace isthmus::testing
