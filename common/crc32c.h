// crc32c (Castagnoli): the checksum of the shard's slot files and of pushes remembered for
// their idempotency keys. Uses the SSE4.2 instruction where the CPU has it (~10 ms for
// 64 MiB), a table otherwise; both give the same value.
#pragma once

#include <cstddef>
#include <cstdint>

namespace isthmus {

// The crc32c of `n` bytes at `data`.
uint32_t Crc32c(const void* data, size_t n);
// The crc32c of the bytes covered by `crc` followed by these `n` (Crc32cExtend(Crc32c(a), b)
// == Crc32c(a + b); start from 0 for the empty string).
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n);

}  // namespace isthmus
