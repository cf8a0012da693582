// safetensors reader, atomic writer and the order-independent content hash. The reader
// treats every file as hostile: each size and offset is checked against the real file size
// before anything is allocated or read.
#include "common/safetensors.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <set>

#include "common/bf16.h"
#include "common/direct_file.h"
#include "common/durable.h"

namespace isthmus {
namespace {

static_assert(std::endian::native == std::endian::little,
              "safetensors is little-endian; a big-endian port needs byte swaps here");

// The reference implementation refuses headers above 100 MB; so do we.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;
// A valid header nests at most 3 deep (root, tensor entry, shape array).
constexpr int kMaxJsonDepth = 3;

enum class Dtype { kF32, kF16, kBF16 };

struct Entry {
  std::string name;
  Dtype dtype;
  std::vector<int64_t> shape;
  uint64_t begin;
  uint64_t end;
};

std::string ErrnoText() { return std::strerror(errno); }

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) {
      if (fd_ >= 0) ::close(fd_);
      fd_ = other.Release();
    }
    return *this;
  }
  int get() const { return fd_; }
  int Release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

Status PreadAll(int fd, void* buf, size_t len, uint64_t offset, const std::string& path) {
  auto* p = static_cast<char*>(buf);
  while (len > 0) {
    ssize_t n = ::pread(fd, p, len, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Status::IoError(path + ": read failed: " + ErrnoText());
    if (n == 0) return Status::Corruption(path + ": file shrank while being read");
    p += n;
    len -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return Status::Ok();
}

// A write that failed: a full disk (or quota) is ResourceExhausted, saying so, not damage.
Status WriteError(const std::string& what) {
  if (errno == ENOSPC || errno == EDQUOT) {
    return Status::ResourceExhausted(what + ": the disk is full (" + ErrnoText() +
                                     "): free space there or write elsewhere");
  }
  return Status::IoError(what + ": " + ErrnoText());
}

// Rejects nesting deeper than kMaxJsonDepth before the JSON parser sees the text, so a
// header of a million '[' costs nothing.
bool JsonDepthWithin(const std::string& text, int max_depth) {
  int depth = 0;
  bool in_string = false;
  bool escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > max_depth) return false;
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return true;
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);  // inf or NaN (payload kept)
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {
    // Subnormal half: normalise into an fp32 normal.
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400u) == 0);
    bits = sign | static_cast<uint32_t>(112 - e) << 23 | ((mant & 0x3ffu) << 13);
  }
  return std::bit_cast<float>(bits);
}

size_t DtypeSize(Dtype d) { return d == Dtype::kF32 ? 4 : 2; }

// Parses the header JSON into entries and metadata; checks everything that does not need
// the file size.
Status ParseHeader(const std::string& path, const std::string& text, std::vector<Entry>* entries,
                   std::map<std::string, std::string>* metadata) {
  using nlohmann::json;
  if (!JsonDepthWithin(text, kMaxJsonDepth)) {
    return Status::Corruption(path + ": header JSON nests too deep");
  }
  // nlohmann keeps the last of duplicate keys silently; the callback sees every key.
  std::vector<std::set<std::string>> keys_stack;
  std::string duplicate;
  json::parser_callback_t cb = [&](int /*depth*/, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
        keys_stack.emplace_back();
        break;
      case json::parse_event_t::object_end:
        if (!keys_stack.empty()) keys_stack.pop_back();
        break;
      case json::parse_event_t::key:
        if (!keys_stack.empty() && parsed.is_string() &&
            !keys_stack.back().insert(parsed.get<std::string>()).second && duplicate.empty()) {
          duplicate = parsed.get<std::string>();
        }
        break;
      default:
        break;
    }
    return true;
  };
  json header = json::parse(text, cb, /*allow_exceptions=*/false);
  if (header.is_discarded()) return Status::Corruption(path + ": header is not valid JSON");
  if (!header.is_object()) return Status::Corruption(path + ": header is not a JSON object");
  if (!duplicate.empty()) {
    return Status::Corruption(path + ": duplicate key '" + duplicate + "' in header");
  }
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) return Status::Corruption(path + ": __metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) {
          return Status::Corruption(path + ": __metadata__ value for '" + m.key() +
                                    "' is not a string");
        }
        (*metadata)[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string what = path + ": tensor '" + name + "': ";
    if (name.empty()) return Status::Corruption(path + ": tensor with an empty name");
    if (!v.is_object()) return Status::Corruption(what + "entry is not an object");
    if (!v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets")) {
      return Status::Corruption(what + "entry lacks dtype, shape or data_offsets");
    }
    const json& dt = v["dtype"];
    if (!dt.is_string()) return Status::Corruption(what + "dtype is not a string");
    Entry e;
    e.name = name;
    const std::string dts = dt.get<std::string>();
    if (dts == "F32") {
      e.dtype = Dtype::kF32;
    } else if (dts == "F16") {
      e.dtype = Dtype::kF16;
    } else if (dts == "BF16") {
      e.dtype = Dtype::kBF16;
    } else {
      return Status::InvalidArgument(what + "dtype " + dts +
                                     " is not supported (only F32, F16, BF16)");
    }
    const json& shape = v["shape"];
    if (!shape.is_array()) return Status::Corruption(what + "shape is not an array");
    for (const json& d : shape) {
      if (!d.is_number_integer() || (d.is_number_unsigned() && d.get<uint64_t>() > INT64_MAX)) {
        return Status::Corruption(what + "shape holds a non-integer or huge dimension");
      }
      e.shape.push_back(d.get<int64_t>());
    }
    const int64_t numel = NumElements(e.shape);
    if (numel < 0) return Status::Corruption(what + "shape is negative or overflows");
    const json& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
        !off[1].is_number_unsigned()) {
      return Status::Corruption(what + "data_offsets is not a pair of non-negative integers");
    }
    e.begin = off[0].get<uint64_t>();
    e.end = off[1].get<uint64_t>();
    if (e.end < e.begin) return Status::Corruption(what + "data_offsets end before begin");
    // numel <= kMaxElements, so the product cannot wrap.
    const uint64_t want = static_cast<uint64_t>(numel) * DtypeSize(e.dtype);
    if (e.end - e.begin != want) {
      return Status::Corruption(what + "byte length " + std::to_string(e.end - e.begin) +
                                " does not match shape x dtype size " + std::to_string(want));
    }
    entries->push_back(std::move(e));
  }
  return Status::Ok();
}

// Opens `path` and checks its header and the layout of its data buffer (everything but
// the tensor bytes). On success `fd` is open, `entries` are sorted by offset and
// `data_start` is the file offset of the data buffer.
Status OpenAndCheck(const std::string& path, Fd& fd, std::vector<Entry>* entries,
                    std::map<std::string, std::string>* metadata, uint64_t* data_start) {
  fd = Fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    if (errno == ENOENT) return Status::NotFound(path + ": no such file");
    return Status::IoError(path + ": cannot open: " + ErrnoText());
  }
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return Status::IoError(path + ": stat failed: " + ErrnoText());
  if (!S_ISREG(st.st_mode)) return Status::InvalidArgument(path + ": not a regular file");
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  if (file_size < 8) {
    return Status::Corruption(path + ": file of " + std::to_string(file_size) +
                              " bytes is too short for a safetensors header");
  }
  uint64_t header_len = 0;
  ISTHMUS_RETURN_IF_ERROR(PreadAll(fd.get(), &header_len, 8, 0, path));
  if (header_len > file_size - 8) {
    return Status::Corruption(path + ": header length " + std::to_string(header_len) +
                              " exceeds the file size " + std::to_string(file_size));
  }
  if (header_len > kMaxHeaderBytes) {
    return Status::Corruption(path + ": header length " + std::to_string(header_len) +
                              " exceeds the 100 MB limit");
  }
  if (header_len < 2) return Status::Corruption(path + ": header too short");
  std::string text(header_len, '\0');
  ISTHMUS_RETURN_IF_ERROR(PreadAll(fd.get(), text.data(), header_len, 8, path));
  if (text[0] != '{') return Status::Corruption(path + ": header does not start with '{'");

  ISTHMUS_RETURN_IF_ERROR(ParseHeader(path, text, entries, metadata));

  // The byte buffer must be covered exactly: sorted by offset, each tensor starts where the
  // previous ended (this also rules out overlap), and the last ends at the end of the file.
  std::sort(entries->begin(), entries->end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  *data_start = 8 + header_len;
  const uint64_t data_len = file_size - *data_start;
  uint64_t expect = 0;
  for (const Entry& e : *entries) {
    if (e.begin != expect) {
      return Status::Corruption(path + ": tensor '" + e.name + "' data_offsets [" +
                                std::to_string(e.begin) + ", " + std::to_string(e.end) +
                                (e.begin < expect ? ") overlap the previous tensor"
                                                  : ") leave a gap after the previous tensor"));
    }
    if (e.end > data_len) {
      return Status::Corruption(path + ": tensor '" + e.name + "' ends at " +
                                std::to_string(e.end) + ", beyond the data buffer of " +
                                std::to_string(data_len) + " bytes");
    }
    expect = e.end;
  }
  if (expect != data_len) {
    return Status::Corruption(path + ": " + std::to_string(data_len - expect) +
                              " trailing bytes after the last tensor");
  }

  return Status::Ok();
}

}  // namespace

Result<SafetensorsFile> ReadSafetensors(const std::string& path) {
  Fd fd(-1);
  SafetensorsFile out;
  std::vector<Entry> entries;
  uint64_t data_start = 0;
  ISTHMUS_RETURN_IF_ERROR(OpenAndCheck(path, fd, &entries, &out.metadata, &data_start));
  out.tensors.reserve(entries.size());
  std::vector<uint16_t> half;
  for (Entry& e : entries) {
    Tensor t;
    t.name = std::move(e.name);
    t.shape = std::move(e.shape);
    const size_t numel = static_cast<size_t>(NumElements(t.shape));
    t.data.resize(numel);
    if (e.dtype == Dtype::kF32) {
      ISTHMUS_RETURN_IF_ERROR(
          PreadAll(fd.get(), t.data.data(), numel * 4, data_start + e.begin, path));
    } else {
      half.resize(numel);
      ISTHMUS_RETURN_IF_ERROR(
          PreadAll(fd.get(), half.data(), numel * 2, data_start + e.begin, path));
      for (size_t i = 0; i < numel; ++i) {
        t.data[i] = e.dtype == Dtype::kF16 ? HalfToFloat(half[i]) : Bf16BitsToFloat(half[i]);
      }
    }
    out.tensors.push_back(std::move(t));
  }
  return out;
}

Result<SafetensorsInfo> ReadSafetensorsInfo(const std::string& path) {
  Fd fd(-1);
  SafetensorsInfo out;
  std::vector<Entry> entries;
  uint64_t data_start = 0;
  ISTHMUS_RETURN_IF_ERROR(OpenAndCheck(path, fd, &entries, &out.metadata, &data_start));
  for (Entry& e : entries) out.tensors.push_back({std::move(e.name), std::move(e.shape)});
  return out;
}

Result<std::vector<Tensor>> ReadSafetensorsTensors(const std::string& path) {
  ISTHMUS_ASSIGN_OR_RETURN(SafetensorsFile f, ReadSafetensors(path));
  return std::move(f.tensors);
}

namespace {

uint16_t FloatToHalf(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (x >> 16) & 0x8000u, abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u)
    return static_cast<uint16_t>(sign | (abs > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520: infinity
  if (abs < 0x38800000u) {  // below 2^-14: a subnormal half (or zero), in units of 2^-24
    const float units = std::bit_cast<float>(abs) * 16777216.0f;  // exact: a power of two
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(units)));
  }
  const uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);  // nearest, ties even
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

}  // namespace

const char* FileDtypeName(FileDtype d) {
  return d == FileDtype::kBF16 ? "BF16" : d == FileDtype::kF16 ? "F16" : "F32";
}
int FileDtypeSize(FileDtype d) { return d == FileDtype::kF32 ? 4 : 2; }

Result<FileDtype> ParseFileDtype(const std::string& name) {
  std::string n = name;
  for (char& c : n) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (n == "f32" || n == "fp32" || n == "float32") return FileDtype::kF32;
  if (n == "bf16" || n == "bfloat16") return FileDtype::kBF16;
  if (n == "f16" || n == "fp16" || n == "float16") return FileDtype::kF16;
  return Status::InvalidArgument("dtype \"" + name + "\" is not one of fp32, bf16, fp16");
}

Status WriteSafetensors(const std::string& path, const std::vector<Tensor>& tensors,
                        const std::map<std::string, std::string>& metadata, FileDtype dtype,
                        bool direct) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    header["__metadata__"] = std::move(m);
  }
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const Tensor& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__") {
      return Status::InvalidArgument(path + ": invalid tensor name '" + t.name + "'");
    }
    if (!names.insert(t.name).second) {
      return Status::InvalidArgument(path + ": duplicate tensor name '" + t.name + "'");
    }
    const int64_t numel = NumElements(t.shape);
    if (numel < 0 || numel != t.numel()) {
      return Status::InvalidArgument(path + ": tensor '" + t.name + "' has " +
                                     std::to_string(t.numel()) +
                                     " values, which does not match its shape");
    }
    const uint64_t bytes = static_cast<uint64_t>(numel) * FileDtypeSize(dtype);
    header[t.name] = {{"dtype", FileDtypeName(dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t header_len = text.size();

  std::string tmp = path + ".tmp.XXXXXX";
  Fd fd(::mkstemp(tmp.data()));
  if (fd.get() < 0) return WriteError(path + ": cannot create temporary file");
  auto fail = [&](Status s) {
    ::unlink(tmp.c_str());
    return s;
  };
  if (::fchmod(fd.get(), 0644) != 0) {
    return fail(Status::IoError(tmp + ": chmod failed: " + ErrnoText()));
  }
  if (direct) {
    // mkstemp opens without O_DIRECT; a file system that refuses it keeps buffered writes.
    const int flags = ::fcntl(fd.get(), F_GETFL);
    direct = flags >= 0 && ::fcntl(fd.get(), F_SETFL, flags | O_DIRECT) == 0;
  }
  DirectFileWriter out(fd.get(), tmp, direct);
  Status s = out.Append(&header_len, 8);
  if (s.ok()) s = out.Append(text.data(), text.size());
  std::vector<uint16_t> narrow;
  for (size_t i = 0; s.ok() && i < tensors.size(); ++i) {
    const std::vector<float>& v = tensors[i].data;
    if (dtype == FileDtype::kF32) {
      s = out.Append(v.data(), v.size() * 4);
      continue;
    }
    narrow.resize(v.size());
    for (size_t j = 0; j < v.size(); ++j) {
      narrow[j] = dtype == FileDtype::kBF16 ? FloatToBf16Bits(v[j]) : FloatToHalf(v[j]);
    }
    s = out.Append(narrow.data(), narrow.size() * 2);
  }
  if (s.ok()) s = out.Finish();
  if (!s.ok()) return fail(s);
  if (::fsync(fd.get()) != 0) return fail(WriteError(tmp + ": fsync failed"));
  if (::close(fd.Release()) != 0) return fail(WriteError(tmp + ": close failed"));
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    return fail(Status::IoError(path + ": rename failed: " + ErrnoText()));
  }
  return SyncParent(path);
}

std::string TensorsContentHash(const std::vector<Tensor>& tensors) {
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), 0);
  // Ties on name (only possible for sets that are not valid checkpoints) break on shape and
  // bytes so that the hash stays independent of order even then.
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const Tensor& x = tensors[a];
    const Tensor& y = tensors[b];
    if (x.name != y.name) return x.name < y.name;
    if (x.shape != y.shape) return x.shape < y.shape;
    if (x.data.size() != y.data.size()) return x.data.size() < y.data.size();
    return !x.data.empty() && std::memcmp(x.data.data(), y.data.data(), x.data.size() * 4) < 0;
  });
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  // OpenSSL fails here only on allocation failure; nothing sensible can be returned then.
  if (!ctx || EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) != 1) std::abort();
  auto put = [&](const void* p, size_t n) { EVP_DigestUpdate(ctx.get(), p, n); };
  auto put_u64 = [&](uint64_t v) { put(&v, 8); };
  static constexpr char kDomain[] = "isthmus.tensors.v1";
  put(kDomain, sizeof(kDomain) - 1);
  put_u64(tensors.size());
  for (size_t i : order) {
    const Tensor& t = tensors[i];
    put_u64(t.name.size());
    put(t.name.data(), t.name.size());
    put_u64(t.shape.size());
    for (int64_t d : t.shape) put_u64(static_cast<uint64_t>(d));
    put_u64(t.data.size() * 4);
    put(t.data.data(), t.data.size() * 4);
  }
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_DigestFinal_ex(ctx.get(), digest, &len);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  hex.reserve(len * 2);
  for (unsigned int i = 0; i < len; ++i) {
    hex.push_back(kHex[digest[i] >> 4]);
    hex.push_back(kHex[digest[i] & 0xf]);
  }
  return hex;
}

}  // namespace isthmus
