// Hugging Face checkpoints, single-file or sharded with an index (see hf_checkpoint.h).
#include "common/hf_checkpoint.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "common/durable.h"

namespace isthmus {
namespace {

namespace fs = std::filesystem;

bool EndsWith(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// The index's shard files, each with the tensors the index places in it.
Result<std::map<std::string, std::set<std::string>>> ReadIndex(const std::string& index) {
  std::ifstream in(index);
  if (!in) return Status::NotFound(index + ": cannot open");
  const auto doc = nlohmann::json::parse(in, nullptr, false);
  if (doc.is_discarded() || !doc.is_object() || !doc.contains("weight_map") ||
      !doc["weight_map"].is_object() || doc["weight_map"].empty()) {
    return Status::Corruption(index +
                              ": not an index (a JSON object with a weight_map of "
                              "tensor name -> shard file)");
  }
  std::map<std::string, std::set<std::string>> shards;
  for (auto it = doc["weight_map"].begin(); it != doc["weight_map"].end(); ++it) {
    if (!it.value().is_string()) {
      return Status::Corruption(index + ": weight_map[" + it.key() + "] is not a file name");
    }
    const std::string file = it.value().get<std::string>();
    if (file.empty() || file.find('/') != std::string::npos || file == "." || file == "..") {
      return Status::Corruption(index + ": weight_map[" + it.key() + "] = \"" + file +
                                "\" is not a file name in the index's folder");
    }
    shards[file].insert(it.key());
  }
  return shards;
}

// Checks one shard's tensor names against the index's list for it, and across shards.
Status CheckShard(const std::string& index, const std::string& shard,
                  const std::set<std::string>& listed, const std::vector<std::string>& held,
                  std::set<std::string>* seen) {
  std::set<std::string> in_file;
  for (const auto& name : held) {
    if (!listed.count(name)) {
      return Status::Corruption(shard + ": holds tensor " + name + ", which " + index +
                                " does not place there");
    }
    if (!seen->insert(name).second) {
      return Status::Corruption(shard + ": tensor " + name + " is also in another shard");
    }
    in_file.insert(name);
  }
  for (const auto& name : listed) {
    if (!in_file.count(name)) {
      return Status::Corruption(index + ": places tensor " + name + " in " + shard +
                                ", which does not hold it");
    }
  }
  return Status::Ok();
}

template <typename Out, typename ReadOne, typename NameOf>
Result<Out> ReadSharded(const std::string& file, ReadOne read_one, NameOf name_of) {
  if (!EndsWith(file, ".json")) return read_one(file);
  ISTHMUS_ASSIGN_OR_RETURN(auto shards, ReadIndex(file));
  const fs::path folder = fs::path(file).parent_path();
  Out out;
  std::set<std::string> seen;
  bool first = true;
  for (const auto& [name, listed] : shards) {
    const std::string path = (folder / name).string();
    ISTHMUS_ASSIGN_OR_RETURN(Out part, read_one(path));
    std::vector<std::string> held;
    for (const auto& t : part.tensors) held.push_back(name_of(t));
    ISTHMUS_RETURN_IF_ERROR(CheckShard(file, path, listed, held, &seen));
    if (first) out.metadata = std::move(part.metadata);
    first = false;
    for (auto& t : part.tensors) out.tensors.push_back(std::move(t));
  }
  return out;
}

std::string ShardName(size_t k, size_t n) {
  char name[64];
  std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", k, n);
  return name;
}

}  // namespace

Result<std::string> FindHfCheckpoint(const std::string& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return path;
  for (const char* name : {kHfSingleFile, kHfIndexFile}) {
    if (fs::exists(fs::path(path) / name, ec)) return (fs::path(path) / name).string();
  }
  return Status::NotFound(path + ": no " + kHfSingleFile + " and no " + kHfIndexFile +
                          " (a Hugging Face model folder holds one of them)");
}

Result<SafetensorsFile> ReadHfCheckpoint(const std::string& file) {
  return ReadSharded<SafetensorsFile>(
      file, [](const std::string& p) { return ReadSafetensors(p); },
      [](const Tensor& t) { return t.name; });
}

Result<SafetensorsInfo> ReadHfCheckpointInfo(const std::string& file) {
  return ReadSharded<SafetensorsInfo>(
      file, [](const std::string& p) { return ReadSafetensorsInfo(p); },
      [](const SafetensorsInfo::Entry& t) { return t.name; });
}

Status WriteHfCheckpoint(const std::string& dir, const std::vector<Tensor>& tensors,
                         const std::map<std::string, std::string>& metadata,
                         uint64_t max_shard_bytes, FileDtype dtype) {
  if (max_shard_bytes == 0) return Status::InvalidArgument("the shard size must be > 0");
  // Tensors into shards, in order: a new shard when the next tensor would overflow this one.
  std::vector<std::vector<Tensor>> shards(1);
  uint64_t total = 0, in_shard = 0;
  for (const Tensor& t : tensors) {
    const uint64_t bytes = t.data.size() * FileDtypeSize(dtype);
    if (in_shard > 0 && in_shard + bytes > max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(t);
    in_shard += bytes;
    total += bytes;
  }
  std::set<std::string> written;
  if (shards.size() == 1) {
    ISTHMUS_RETURN_IF_ERROR(
        WriteSafetensors((fs::path(dir) / kHfSingleFile).string(), tensors, metadata, dtype));
    written.insert(kHfSingleFile);
  } else {
    nlohmann::ordered_json map = nlohmann::ordered_json::object();
    for (size_t k = 0; k < shards.size(); ++k) {
      const std::string name = ShardName(k + 1, shards.size());
      ISTHMUS_RETURN_IF_ERROR(
          WriteSafetensors((fs::path(dir) / name).string(), shards[k], metadata, dtype));
      for (const Tensor& t : shards[k]) map[t.name] = name;
      written.insert(name);
    }
    const nlohmann::ordered_json index = {{"metadata", {{"total_size", total}}},
                                          {"weight_map", map}};
    ISTHMUS_RETURN_IF_ERROR(
        WriteFileDurably((fs::path(dir) / kHfIndexFile).string(), index.dump(2) + "\n"));
    written.insert(kHfIndexFile);
  }
  // What an earlier write left in the other layout.
  std::error_code ec;
  std::vector<fs::path> stale;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    const bool ours = name == kHfSingleFile || name == kHfIndexFile ||
                      (name.rfind("model-", 0) == 0 && EndsWith(name, ".safetensors") &&
                       name.find("-of-") != std::string::npos);
    if (ours && !written.count(name)) stale.push_back(entry.path());
  }
  if (ec) return Status::IoError(dir + ": cannot list: " + ec.message());
  for (const auto& path : stale) {
    if (!fs::remove(path, ec) && ec) {
      return Status::IoError(path.string() + ": cannot remove: " + ec.message());
    }
  }
  const bool removed = !stale.empty();
  return removed ? SyncPath(dir) : Status::Ok();
}

}  // namespace isthmus
