// One table of exit codes for every program (common/exit_codes.h): the docs carry it
// verbatim, --help footers come from it, and statuses map onto it one way everywhere.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "common/exit_codes.h"

namespace isthmus {
namespace {

std::string ReadDoc(const std::string& name) {
  std::ifstream in(std::string(ISTHMUS_SOURCE_DIR) + "/docs/" + name);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(ExitCodes, TheDocsCarryTheTableVerbatim) {
  const std::string table = ExitCodesMarkdown();
  for (const char* doc : {"CLI.md", "WORKER.md"}) {
    EXPECT_NE(ReadDoc(doc).find(table), std::string::npos)
        << "docs/" << doc << " lacks the exit code table; paste this under '## Exit codes':\n"
        << table;
  }
}

TEST(ExitCodes, StatusesMapTheSameWayEverywhere) {
  EXPECT_EQ(ExitCodeForStatus(Status::Ok()), kExitOk);
  EXPECT_EQ(ExitCodeForStatus(Status::InvalidArgument("x")), kExitUsage);
  EXPECT_EQ(ExitCodeForStatus(Status::PermissionDenied("x")), kExitRefused);
  EXPECT_EQ(ExitCodeForStatus(Status::NotFound("x")), kExitNotFound);
  EXPECT_EQ(ExitCodeForStatus(Status::Timeout("x")), kExitUnreachable);
  EXPECT_EQ(ExitCodeForStatus(Status::Unavailable("x")), kExitUnreachable);
  EXPECT_EQ(ExitCodeForStatus(Status::Corruption("x")), kExitDamaged);
  EXPECT_EQ(ExitCodeForStatus(Status::IoError("x")), kExitDamaged);
  EXPECT_EQ(ExitCodeForStatus(Status::Internal("x")), kExitFailure);
  const std::string footer = ExitCodesFooter();
  for (int code = 0; code <= kExitOutOfMemory; ++code) {
    EXPECT_NE(footer.find(std::to_string(code) + " "), std::string::npos) << footer;
  }
}

}  // namespace
}  // namespace isthmus
