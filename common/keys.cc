// Key generation and the strict key-file rules of the security model.
#include "common/keys.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace isthmus {
namespace {

namespace fs = std::filesystem;

Status ReadWholeFile(const std::string& path, std::string* out) {
  std::ifstream in(path);
  if (!in) return Status::NotFound("cannot open key file '" + path + "': " + std::strerror(errno));
  std::stringstream ss;
  ss << in.rdbuf();
  *out = ss.str();
  return Status::Ok();
}

// Finds `name = "value"` in a key file's text.
std::string FindField(const std::string& text, const std::string& name) {
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    auto first = line.find_first_not_of(" \t");
    if (first == std::string::npos || line[first] == '#') continue;
    if (line.compare(first, name.size(), name) != 0) continue;
    auto q1 = line.find('"', first + name.size());
    auto q2 = q1 == std::string::npos ? q1 : line.find('"', q1 + 1);
    if (q2 == std::string::npos) return "";
    return line.substr(q1 + 1, q2 - q1 - 1);
  }
  return "";
}

Status WriteFileWithMode(const std::string& path, const std::string& text, mode_t mode,
                         bool overwrite) {
  std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
  if (fd < 0) return Status::IoError("cannot create '" + tmp + "': " + std::strerror(errno));
  ::fchmod(fd, mode);  // umask may have narrowed it; never widens past `mode`
  bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()) &&
            ::fsync(fd) == 0;
  ::close(fd);
  if (!ok) {
    ::unlink(tmp.c_str());
    return Status::IoError("cannot write '" + tmp + "': " + std::strerror(errno));
  }
  if (!overwrite && fs::exists(path)) {
    ::unlink(tmp.c_str());
    return Status::AlreadyExists("'" + path + "' exists; pass --force to overwrite it");
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    return Status::IoError("cannot rename onto '" + path + "': " + std::strerror(errno));
  }
  return Status::Ok();
}

}  // namespace

bool IsValidZ85Key(const std::string& key) {
  if (key.size() != 40) return false;
  uint8_t raw[32];
  return zmq_z85_decode(raw, key.c_str()) != nullptr;
}

Result<KeyPair> GenerateKeyPair() {
  char pub[41], sec[41];
  if (zmq_curve_keypair(pub, sec) != 0) {
    return Status::Internal(std::string("zmq_curve_keypair failed: ") + zmq_strerror(errno) +
                            " (libzmq built without CURVE?)");
  }
  return KeyPair{pub, sec};
}

Status WriteKeyPairFiles(const std::string& prefix, const KeyPair& pair, bool overwrite) {
  const std::string header = "# isthmus CURVE key, written by isthmusctl keygen\ncurve\n";
  std::string secret_text = header + "    public-key = \"" + pair.public_key + "\"\n" +
                            "    secret-key = \"" + pair.secret_key + "\"\n";
  std::string public_text = header + "    public-key = \"" + pair.public_key + "\"\n";
  ISTHMUS_RETURN_IF_ERROR(WriteFileWithMode(prefix + ".key", secret_text, 0600, overwrite));
  return WriteFileWithMode(prefix + ".pub", public_text, 0644, overwrite);
}

Result<KeyPair> LoadKeyPairFile(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    return Status::NotFound("secret key file '" + path + "' not found: " + std::strerror(errno) +
                            " (create one with: isthmusctl keygen --out PREFIX)");
  }
  if ((st.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", st.st_mode & 07777);
    return Status::PermissionDenied("secret key file '" + path + "' has mode " + mode +
                                    "; it must be readable by its owner only: chmod 600 " + path);
  }
  std::string text;
  ISTHMUS_RETURN_IF_ERROR(ReadWholeFile(path, &text));
  KeyPair pair{FindField(text, "public-key"), FindField(text, "secret-key")};
  if (!IsValidZ85Key(pair.public_key) || !IsValidZ85Key(pair.secret_key)) {
    return Status::InvalidArgument("'" + path +
                                   "' is not a key pair file (needs public-key and secret-key "
                                   "lines of 40 Z85 characters)");
  }
  char derived[41];
  if (zmq_curve_public(derived, pair.secret_key.c_str()) != 0 || pair.public_key != derived) {
    return Status::InvalidArgument("'" + path + "': public key does not match the secret key");
  }
  return pair;
}

Result<std::string> LoadPublicKeyFile(const std::string& path) {
  std::string text;
  ISTHMUS_RETURN_IF_ERROR(ReadWholeFile(path, &text));
  std::string key = FindField(text, "public-key");
  if (!IsValidZ85Key(key)) {
    return Status::InvalidArgument("'" + path + "' has no valid public-key line");
  }
  return key;
}

Result<std::vector<std::string>> LoadPublicKeys(const std::vector<std::string>& sources) {
  std::vector<std::string> keys;
  for (const auto& src : sources) {
    std::error_code ec;
    if (fs::is_directory(src, ec)) {
      for (const auto& entry : fs::directory_iterator(src, ec)) {
        if (entry.path().extension() != ".pub") continue;
        ISTHMUS_ASSIGN_OR_RETURN(std::string key, LoadPublicKeyFile(entry.path().string()));
        keys.push_back(std::move(key));
      }
      if (ec) return Status::IoError("cannot list key folder '" + src + "': " + ec.message());
    } else if (fs::exists(src, ec)) {
      ISTHMUS_ASSIGN_OR_RETURN(std::string key, LoadPublicKeyFile(src));
      keys.push_back(std::move(key));
    } else {
      return Status::NotFound("public key source '" + src + "' does not exist");
    }
  }
  return keys;
}

}  // namespace isthmus
