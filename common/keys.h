// CURVE key pairs and key files. A key pair file holds the public and the secret key (Z85
// text, 40 characters each) and must be readable by its owner only (mode 0600 or
// stricter): loading refuses anything looser and says how to fix it. A public key file
// holds only the public key and may be world-readable. Allowlists are built from public
// key files, or from folders whose *.pub files are all read.
//
// File format (a subset of CZMQ's certificate format, so zcert tools can read it):
//   # comment lines
//   curve
//       public-key = "Z85..."
//       secret-key = "Z85..."      (key pair files only)
#pragma once

#include <string>
#include <vector>

#include "common/status.h"

namespace isthmus {

struct KeyPair {
  std::string public_key;  // Z85, 40 chars
  std::string secret_key;  // Z85, 40 chars; empty for a public-only key
};

// A fresh CURVE key pair from libzmq (libsodium underneath).
Result<KeyPair> GenerateKeyPair();

// InvalidArgument, saying what to give instead, for a prefix WriteKeyPairFiles refuses: an
// empty one, one ending in '/' (it would write hidden files ".key" and ".pub") and an
// existing folder.
Status CheckKeyPrefix(const std::string& prefix);

// Writes `<prefix>.key` (public + secret, mode 0600, created atomically with that mode)
// and `<prefix>.pub` (public only, mode 0644). Refuses to overwrite unless `overwrite`,
// and a prefix CheckKeyPrefix refuses.
Status WriteKeyPairFiles(const std::string& prefix, const KeyPair& pair, bool overwrite);

// Reads a key pair file. PermissionDenied if group or others can read or write it, or if
// this process may not read it (the message names the user it runs as and the chown that
// fixes it); NotFound if it does not exist.
Result<KeyPair> LoadKeyPairFile(const std::string& path);

// Reads the public key of a public key file or a key pair file (the first, if it lists
// several).
Result<std::string> LoadPublicKeyFile(const std::string& path);

// Every public key a file lists, in order, without repeats. A public key file may list
// several (`public-key = "..."` lines; `cat new.pub >> server.pub` appends one): while a
// server's own key is rotated, its clients and peers hold both (docs/DEPLOY.md, "Rotating
// a site's own key"), and an allowlist file admits every key it lists.
Result<std::vector<std::string>> LoadPublicKeyList(const std::string& path);

// What LoadPublicKeys says and refuses beyond its own rules, for an allowlist a server
// enforces.
struct AllowlistCheck {
  std::string setting;  // named in messages, e.g. "security.worker_keys"; empty: none
  std::string who;      // whose keys belong there, e.g. "workers" (for the empty-folder remedy)
  // A folder without a *.pub file is refused (PermissionDenied): nobody could connect.
  bool refuse_empty_folders = false;
};

// Reads every public key named by `sources`: each is a key file, or a folder whose
// "*.pub" files are read. Missing sources (NotFound) and malformed keys are errors. A
// source file or folder, or a *.pub file in a folder, that every user may write is refused
// (PermissionDenied, naming it and the chmod o-w that fixes it): anyone on the host could
// add a key. Group-writable ones are accepted: a group that may edit allowlists is a
// choice an operator makes (and the group of a user-private-group setup is its user
// alone); the folders above a source are not checked (keys may live under a sticky /tmp
// in tests, and /etc is root's).
Result<std::vector<std::string>> LoadPublicKeys(const std::vector<std::string>& sources,
                                                const AllowlistCheck& check = {});

// True if `key` is 40 characters of valid Z85 that decodes to 32 bytes.
bool IsValidZ85Key(const std::string& key);

}  // namespace isthmus
