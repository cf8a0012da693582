// What every test of the fault layer (fault_preload.cc) needs: the layer's library, the
// environment that loads it into a program, and whether this build can load it at all.
// ISTHMUS_FAULT_LIB must be defined (the tests' CMake gives the built library's path).
#pragma once

#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>

namespace isthmus::fault {

// The layer's library; the environment variable ISTHMUS_FAULT_LIB names another (a test
// run away from its build tree).
inline std::string FaultLibrary() {
  const char* v = std::getenv("ISTHMUS_FAULT_LIB");
  return v != nullptr ? v : ISTHMUS_FAULT_LIB;
}

// A sanitized program wants its runtime loaded first; a preloaded library comes before it,
// and the runtime refuses that. The tests skip there, saying so.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kSanitizedBuild = true;
#else
inline constexpr bool kSanitizedBuild = false;
#endif
inline constexpr char kSanitizedSkip[] =
    "the fault layer is preloaded before the sanitizer runtime, which refuses that; runs in "
    "the plain build";

// The layer on the tree `root`, failing its writes with ENOSPC while `control`/full exists.
inline std::map<std::string, std::string> DiskFullEnv(const std::filesystem::path& root,
                                                      const std::filesystem::path& control) {
  std::filesystem::create_directories(root);
  std::filesystem::create_directories(control);
  return {{"LD_PRELOAD", FaultLibrary()},
          {"ISTHMUS_FAULT_ROOT", root.string()},
          {"ISTHMUS_FAULT_CONTROL", control.string()}};
}

}  // namespace isthmus::fault
