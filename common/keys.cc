// Key generation and the strict key-file rules of the security model.
#include "common/keys.h"

#include <fcntl.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <sstream>

#include "common/durable.h"

namespace isthmus {
namespace {

namespace fs = std::filesystem;

// The name of the user this process runs as, for messages (its uid without one).
std::string ThisUser() {
  const uid_t uid = ::geteuid();
  if (const passwd* pw = ::getpwuid(uid); pw != nullptr) return pw->pw_name;
  return std::to_string(uid);
}

// The status of a failed open/stat of key file `path` (errno `err`): NotFound when it is
// not there, PermissionDenied (exit 3, "a key or permission problem") when this user may
// not read it, IoError otherwise.
Status KeyFileError(const std::string& what, const std::string& path, int err) {
  const std::string why = what + " '" + path + "': " + std::strerror(err);
  if (err == ENOENT || err == ENOTDIR) return Status::NotFound(why);
  if (err == EACCES || err == EPERM) {
    return Status::PermissionDenied(why + " (this program runs as user '" + ThisUser() +
                                    "': make the file, and every folder above it, readable by "
                                    "that user, e.g. chown " +
                                    ThisUser() + " " + path + "; a key pair file stays mode 0600)");
  }
  return Status::IoError(why);
}

Status ReadWholeFile(const std::string& path, std::string* out) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return KeyFileError("cannot open key file", path, errno);
  std::string text;
  char buf[4096];
  while (true) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      return KeyFileError("cannot read key file", path, err);
    }
    if (n == 0) break;
    text.append(buf, static_cast<size_t>(n));
    if (text.size() > (1 << 20)) {
      ::close(fd);
      return Status::InvalidArgument("'" + path + "' is larger than 1 MiB: not a key file");
    }
  }
  ::close(fd);
  *out = std::move(text);
  return Status::Ok();
}

// PermissionDenied when every user may write `path` (a key file or an allowlist folder):
// anyone on the host could add a key to the allowlist.
Status CheckNotWorldWritable(const std::string& path, const struct stat& st,
                             const std::string& what, const std::string& label) {
  if ((st.st_mode & S_IWOTH) == 0) return Status::Ok();
  char mode[8];
  std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
  return Status::PermissionDenied(what + " '" + path + "'" + label + " has mode " + mode +
                                  ": every user of this host may write it, so anyone could add "
                                  "a key; fix it with: chmod o-w " +
                                  path);
}

// Finds `name = "value"` in a key file's text.
// The quoted values of every `name = "..."` line of `text`, in order ("" for a line
// without its quotes).
std::vector<std::string> FindFields(const std::string& text, const std::string& name) {
  std::vector<std::string> out;
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    auto first = line.find_first_not_of(" \t");
    if (first == std::string::npos || line[first] == '#') continue;
    if (line.compare(first, name.size(), name) != 0) continue;
    auto q1 = line.find('"', first + name.size());
    auto q2 = q1 == std::string::npos ? q1 : line.find('"', q1 + 1);
    out.push_back(q2 == std::string::npos ? "" : line.substr(q1 + 1, q2 - q1 - 1));
  }
  return out;
}

std::string FindField(const std::string& text, const std::string& name) {
  auto all = FindFields(text, name);
  return all.empty() ? "" : all.front();
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
  if (Status s = RenameDurably(tmp, path); !s.ok()) {
    ::unlink(tmp.c_str());
    return s;
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

Status CheckKeyPrefix(const std::string& prefix) {
  const std::string example = " (e.g. keys/worker writes keys/worker.key and keys/worker.pub)";
  if (prefix.empty()) {
    return Status::InvalidArgument("the key file prefix is empty: give a path prefix" + example);
  }
  if (prefix.back() == '/') {
    return Status::InvalidArgument("the key file prefix '" + prefix +
                                   "' ends in '/': it would write hidden files named .key and "
                                   ".pub; give a file name after the folder" +
                                   example);
  }
  std::error_code ec;
  if (fs::is_directory(prefix, ec)) {
    return Status::InvalidArgument("the key file prefix '" + prefix +
                                   "' is a folder: give a file name inside it" + example);
  }
  return Status::Ok();
}

Status WriteKeyPairFiles(const std::string& prefix, const KeyPair& pair, bool overwrite) {
  ISTHMUS_RETURN_IF_ERROR(CheckKeyPrefix(prefix));
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
    const int err = errno;
    if (err == ENOENT || err == ENOTDIR) {
      return Status::NotFound("secret key file '" + path + "' not found: " + std::strerror(err) +
                              " (create one with: isthmusctl keygen --out PREFIX)");
    }
    return KeyFileError("cannot read secret key file", path, err);
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
  ISTHMUS_ASSIGN_OR_RETURN(auto keys, LoadPublicKeyList(path));
  return keys.front();
}

Result<std::vector<std::string>> LoadPublicKeyList(const std::string& path) {
  std::string text;
  ISTHMUS_RETURN_IF_ERROR(ReadWholeFile(path, &text));
  std::vector<std::string> keys;
  for (auto& key : FindFields(text, "public-key")) {
    if (!IsValidZ85Key(key)) {
      return Status::InvalidArgument("'" + path +
                                     "' has a public-key line that is not 40 Z85 "
                                     "characters");
    }
    if (std::find(keys.begin(), keys.end(), key) == keys.end()) keys.push_back(std::move(key));
  }
  if (keys.empty()) return Status::InvalidArgument("'" + path + "' has no valid public-key line");
  return keys;
}

Result<std::vector<std::string>> LoadPublicKeys(const std::vector<std::string>& sources,
                                                const AllowlistCheck& check) {
  const std::string label = check.setting.empty() ? "" : " (" + check.setting + ")";
  std::vector<std::string> keys;
  for (const auto& src : sources) {
    struct stat st {};
    if (::stat(src.c_str(), &st) != 0) {
      const int err = errno;
      if (err == ENOENT || err == ENOTDIR) {
        return Status::NotFound("public key source '" + src + "'" + label + " does not exist");
      }
      return KeyFileError("cannot read public key source", src, err);
    }
    if (S_ISDIR(st.st_mode)) {
      ISTHMUS_RETURN_IF_ERROR(CheckNotWorldWritable(src, st, "allowlist folder", label));
      std::error_code ec;
      size_t found = 0;
      for (const auto& entry : fs::directory_iterator(src, ec)) {
        if (entry.path().extension() != ".pub") continue;
        const std::string file = entry.path().string();
        struct stat fst {};
        if (::stat(file.c_str(), &fst) != 0) return KeyFileError("cannot read", file, errno);
        ISTHMUS_RETURN_IF_ERROR(CheckNotWorldWritable(file, fst, "public key file", label));
        ISTHMUS_ASSIGN_OR_RETURN(auto listed, LoadPublicKeyList(file));
        keys.insert(keys.end(), listed.begin(), listed.end());
        ++found;
      }
      if (ec) {
        return ec.value() == EACCES
                   ? KeyFileError("cannot list key folder", src, ec.value())
                   : Status::IoError("cannot list key folder '" + src + "': " + ec.message());
      }
      if (found == 0 && check.refuse_empty_folders) {
        return Status::PermissionDenied(
            "allowlist folder '" + src + "'" + label +
            " holds no *.pub file, so no client could connect: copy the public key files (.pub, "
            "made by isthmusctl keygen) of the " +
            (check.who.empty() ? std::string("clients") : check.who) + " there");
      }
    } else {
      ISTHMUS_RETURN_IF_ERROR(CheckNotWorldWritable(src, st, "public key file", label));
      ISTHMUS_ASSIGN_OR_RETURN(auto listed, LoadPublicKeyList(src));
      keys.insert(keys.end(), listed.begin(), listed.end());
    }
  }
  return keys;
}

}  // namespace isthmus
