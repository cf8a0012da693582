// Reading and writing safetensors files, the checkpoint format of isthmus (base models,
// exported adapters, snapshots exported by isthmusctl). Tensors are fp32 in memory, so F16
// and BF16 files are widened on read and every file we write is F32.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/tensor.h"

namespace isthmus {

// The whole content of one safetensors file.
struct SafetensorsFile {
  std::vector<Tensor> tensors;                  // in the order of their data offsets
  std::map<std::string, std::string> metadata;  // the "__metadata__" string map, if any
};

// Reads and fully validates `path`. Accepted dtypes are F32, F16 and BF16; all are
// converted to fp32. A file that breaks the format in any way (header length beyond the
// file, JSON that is not an object, unknown dtype, negative or overflowing shape, offsets
// out of range, overlapping or leaving gaps, byte length not equal to shape product times
// dtype size, duplicate names, non-string metadata) is refused with Corruption naming the
// file and the problem; a well-formed file with another dtype (I64, F64, ...) or a path
// that is not a regular file is InvalidArgument; a missing file is NotFound, a failing
// read IoError. Never crashes or over-allocates on a hostile file: allocation is bounded by the
// file size. Thread-safe (no shared state).
Result<SafetensorsFile> ReadSafetensors(const std::string& path);

// A file's tensor names and shapes and its metadata, without the tensor bytes: the same
// checks as ReadSafetensors except reading the data (so a huge file is cheap to inspect).
struct SafetensorsInfo {
  struct Entry {
    std::string name;
    std::vector<int64_t> shape;
  };
  std::vector<Entry> tensors;  // in the order of their data offsets
  std::map<std::string, std::string> metadata;
};
Result<SafetensorsInfo> ReadSafetensorsInfo(const std::string& path);

// Convenience: ReadSafetensors(path) without the metadata.
Result<std::vector<Tensor>> ReadSafetensorsTensors(const std::string& path);

// The element type a file is written in: F32 as held, or rounded to nearest-even BF16 or
// F16 (F16 overflows to infinity past 65504; NaN stays NaN).
enum class FileDtype { kF32, kBF16, kF16 };
// "F32" / "BF16" / "F16", and bytes per element.
const char* FileDtypeName(FileDtype d);
int FileDtypeSize(FileDtype d);
// "f32", "fp32", "float32", "bf16", "bfloat16", "f16", "fp16", "float16" (any case);
// InvalidArgument otherwise, listing them.
Result<FileDtype> ParseFileDtype(const std::string& name);

// Writes `tensors` in `dtype` (F32 unless asked) in the given order, with `metadata` as
// "__metadata__" (omitted when empty). Atomic: writes a temporary file in the same folder, fsyncs
// it, renames it over `path` and fsyncs the folder, so a reader sees the old file or the new one,
// never a torn one. Refuses (InvalidArgument) empty or duplicate names, the reserved name
// "__metadata__", and tensors whose data size does not match their shape. A full disk is
// ResourceExhausted. Thread-safe for distinct paths.
//
// `direct`: the file is written past the page cache (O_DIRECT, common/direct_file.h) where
// the file system takes it, else buffered. Off by default: for a worker's full-mode
// checkpoint (1.0 GB for GPT-2 small) direct writes were faster on one machine measured
// and slower on another (docs/BENCHMARKS.md, section 2, "The checkpoint image").
Status WriteSafetensors(const std::string& path, const std::vector<Tensor>& tensors,
                        const std::map<std::string, std::string>& metadata = {},
                        FileDtype dtype = FileDtype::kF32, bool direct = false);

// Lower-case hex SHA-256 of the tensors' content, independent of their order: the tensors
// are sorted by name and each contributes its name, its shape and its fp32 bytes
// (little-endian), each field prefixed by its length, so distinct sets never share an
// encoding. Two sets with equal names, shapes and bit-identical data hash equally; any
// change to a name, shape or value (including -0.0 vs 0.0 and NaN payloads) changes it.
std::string TensorsContentHash(const std::vector<Tensor>& tensors);

}  // namespace isthmus
