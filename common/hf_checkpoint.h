// Hugging Face model checkpoints as folders hold them: one `model.safetensors`, or shards
// `model-00001-of-00003.safetensors`, ... with `model.safetensors.index.json`
// ({"metadata": {"total_size": bytes}, "weight_map": {tensor name: shard file}}), the layout
// transformers' save_pretrained writes above its shard size. Reading widens F16 and BF16 to
// fp32 as ReadSafetensors does.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/safetensors.h"
#include "common/status.h"

namespace isthmus {

inline constexpr char kHfSingleFile[] = "model.safetensors";
inline constexpr char kHfIndexFile[] = "model.safetensors.index.json";

// The checkpoint file of `path`: `path` itself when it is a file (.safetensors or
// .index.json), else the folder's model.safetensors, else its model.safetensors.index.json.
// NotFound naming both when the folder has neither.
Result<std::string> FindHfCheckpoint(const std::string& path);

// Reads a .safetensors file or, for an .index.json, every shard it names. The tensors come in
// the shards' order (file names sorted), each shard's in its data order; the metadata is the
// first shard's. Corruption, naming the file, for an index that is not an object with a
// weight_map of strings, a shard name with a folder in it, a tensor the index places in a
// shard that does not hold it, a shard tensor the index does not list, or a name held twice;
// errors of ReadSafetensors for a shard.
Result<SafetensorsFile> ReadHfCheckpoint(const std::string& file);
// The same checks without reading tensor data.
Result<SafetensorsInfo> ReadHfCheckpointInfo(const std::string& file);

// Writes `tensors` (in `dtype`) into folder `dir`: model.safetensors when they take at most
// `max_shard_bytes`, else shards of at most that size (a tensor larger than it gets a shard
// of its own) named model-0000k-of-0000n.safetensors, in tensor order, and the index; each
// file atomically and durably, the index last. Files of the other layout (or of more shards)
// left by an earlier write are removed after, so a loader never finds two checkpoints.
Status WriteHfCheckpoint(const std::string& dir, const std::vector<Tensor>& tensors,
                         const std::map<std::string, std::string>& metadata,
                         uint64_t max_shard_bytes, FileDtype dtype = FileDtype::kF32);

// transformers' default shard size (save_pretrained's max_shard_size, "5GB").
inline constexpr uint64_t kHfDefaultShardBytes = 5'000'000'000ull;

}  // namespace isthmus
