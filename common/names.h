// The rules for names an operator or a peer chooses: jobs and snapshots. One rule, used by
// the shard that stores them and by isthmusctl before it sends them, so both refuse the
// same names with the same words.
#pragma once

#include <string>

namespace isthmus {

// Jobs and snapshots: 1-64 of [A-Za-z0-9._-], not starting with '.'. Such a name is safe as
// a file name and as a key prefix (no '/', no NUL).
bool IsValidName(const std::string& name);
// What the rule says, for error messages: "1-64 characters of A-Z a-z 0-9 . _ -, not
// starting with '.'".
const char* ValidNameRule();

}  // namespace isthmus
