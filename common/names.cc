// Name rules (see names.h).
#include "common/names.h"

#include <cctype>

namespace isthmus {

bool IsValidName(const std::string& name) {
  if (name.empty() || name.size() > 64 || name[0] == '.') return false;
  for (char c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') {
      return false;
    }
  }
  return true;
}

const char* ValidNameRule() {
  return "1-64 characters of A-Z a-z 0-9 . _ -, not starting with '.'";
}

}  // namespace isthmus
