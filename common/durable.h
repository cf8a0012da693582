// Durability of the files isthmus writes itself (keys, checkpoints, snapshots, data shards,
// exported models): what a power loss may take. A file's data is durable once fsynced; its
// name (a create, a rename) once the folder holding it is fsynced. Writers here fsync the
// file before it gets its final name, rename, then fsync the folder, so after a power loss
// a reader finds the old file or the new one whole, and a name that was reported written
// is still there.
#pragma once

#include <string>

#include "common/status.h"

namespace isthmus {

// fsyncs a file or a folder (opened read-only).
Status SyncPath(const std::string& path);
// fsyncs the folder that holds `path` ("." for a bare name).
Status SyncParent(const std::string& path);
// fsyncs every file and folder under `root`, and `root` (a copied or hard-linked tree that
// must be whole on disk before it is renamed into place).
Status SyncTree(const std::string& root);
// Creates `path` and any missing folders above it, fsyncing the folder that holds each one
// it created, so the new folders' names survive a power loss (a database opened inside a
// folder whose name was never synced can vanish whole).
Status CreateDirectoriesDurably(const std::string& path);
// Renames `from` to `to` and fsyncs the folders holding both (one when it is the same).
Status RenameDurably(const std::string& from, const std::string& to);
// Writes `text` to `path` whole or not at all: PATH.tmp, fsynced, renamed over `path`
// durably. IoError naming the file.
Status WriteFileDurably(const std::string& path, const std::string& text);

}  // namespace isthmus
