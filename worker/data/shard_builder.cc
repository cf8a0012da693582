// Builds train/val token shards and their manifest from text files.
#include "worker/data/shard_builder.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>

#include "common/durable.h"
#include "worker/data/bpe_tokenizer.h"
#include "worker/data/token_dataset.h"
#include "worker/data/tokenizer.h"

namespace isthmus::data {
namespace {

static_assert(std::endian::native == std::endian::little,
              "shards are little-endian; a big-endian port needs byte swaps here");

constexpr uint64_t kMaxTextBytes = uint64_t{4} << 30;

std::string ErrnoText() { return std::strerror(errno); }

class Sha256 {
 public:
  Sha256() : ctx_(EVP_MD_CTX_new(), EVP_MD_CTX_free) {
    // Fails only when out of memory; nothing sensible remains to do then.
    if (!ctx_ || EVP_DigestInit_ex(ctx_.get(), EVP_sha256(), nullptr) != 1) std::abort();
  }
  void Update(const void* p, size_t n) { EVP_DigestUpdate(ctx_.get(), p, n); }
  std::array<unsigned char, 32> Digest() {
    std::array<unsigned char, 32> d{};
    unsigned int len = 0;
    EVP_DigestFinal_ex(ctx_.get(), d.data(), &len);
    return d;
  }
  std::string HexDigest() {
    static constexpr char kHex[] = "0123456789abcdef";
    std::string hex;
    for (unsigned char c : Digest()) {
      hex.push_back(kHex[c >> 4]);
      hex.push_back(kHex[c & 0xf]);
    }
    return hex;
  }

 private:
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx_;
};

Status ReadRawFile(const std::string& path, std::string* bytes) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return Status::NotFound(path + ": no such file");
  if (!std::filesystem::is_regular_file(path, ec)) {
    return Status::InvalidArgument(path + ": not a regular file");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::IoError(path + ": cannot open: " + ErrnoText());
  bytes->assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  if (in.bad()) return Status::IoError(path + ": read failed");
  return Status::Ok();
}

Result<std::string> Gunzip(const std::string& path, const std::string& compressed) {
  std::string out;
  z_stream zs{};
  // 15 + 32: accept a zlib or gzip header, detected automatically.
  if (inflateInit2(&zs, 15 + 32) != Z_OK) return Status::Internal("inflateInit2 failed");
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(compressed.data()));
  zs.avail_in = static_cast<uInt>(compressed.size());
  char buf[1 << 16];
  int rc = Z_OK;
  while (true) {
    zs.next_out = reinterpret_cast<Bytef*>(buf);
    zs.avail_out = sizeof(buf);
    rc = inflate(&zs, Z_NO_FLUSH);
    if (rc != Z_OK && rc != Z_STREAM_END) break;
    out.append(buf, sizeof(buf) - zs.avail_out);
    if (out.size() > kMaxTextBytes) {
      inflateEnd(&zs);
      return Status::ResourceExhausted(path + ": more than 4 GiB of text after gunzip");
    }
    if (rc == Z_STREAM_END) {
      if (zs.avail_in == 0) break;
      // Another gzip member follows (as `cat a.gz b.gz` makes).
      if (inflateReset(&zs) != Z_OK) break;
    } else if (zs.avail_in == 0 && zs.avail_out != 0) {
      rc = Z_BUF_ERROR;  // input ended inside a stream
      break;
    }
  }
  inflateEnd(&zs);
  if (rc != Z_STREAM_END) {
    return Status::Corruption(path + ": damaged or truncated gzip data");
  }
  return out;
}

Status WriteFileAtomic(const std::string& path, const void* data, size_t size) {
  std::string tmp = path + ".tmp.XXXXXX";
  int fd = ::mkstemp(tmp.data());
  if (fd < 0) return Status::IoError(path + ": cannot create temporary file: " + ErrnoText());
  Status s;
  const auto* p = static_cast<const char*>(data);
  size_t left = size;
  while (s.ok() && left > 0) {
    ssize_t n = ::write(fd, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) s = Status::IoError(tmp + ": write failed: " + ErrnoText());
    if (n > 0) {
      p += n;
      left -= static_cast<size_t>(n);
    }
  }
  if (s.ok() && ::fchmod(fd, 0644) != 0) s = Status::IoError(tmp + ": chmod: " + ErrnoText());
  if (s.ok() && ::fsync(fd) != 0) s = Status::IoError(tmp + ": fsync: " + ErrnoText());
  if (::close(fd) != 0 && s.ok()) s = Status::IoError(tmp + ": close: " + ErrnoText());
  if (s.ok()) s = RenameDurably(tmp, path);
  if (!s.ok()) ::unlink(tmp.c_str());
  return s;
}

bool IsBlank(std::string_view line) {
  return line.find_first_not_of(" \t\r") == std::string_view::npos;
}

// Text -> token ids: bytes, or the BPE when `bpe` is set.
struct Encoder {
  BpeTokenizer* bpe = nullptr;

  Status Append(std::string_view text, std::vector<uint32_t>* out) const {
    if (bpe == nullptr) {
      std::vector<uint16_t> t = ByteTokenizer::Encode(text);
      out->insert(out->end(), t.begin(), t.end());
      return Status::Ok();
    }
    ISTHMUS_ASSIGN_OR_RETURN(std::vector<int32_t> ids, bpe->Encode(text));
    out->insert(out->end(), ids.begin(), ids.end());
    return Status::Ok();
  }
};

struct ShardBuffer {
  std::vector<uint32_t> tokens;
  uint64_t documents = 0;

  Status Add(std::string_view doc, const Encoder& encoder) {
    if (documents > 0) ISTHMUS_RETURN_IF_ERROR(encoder.Append(kDocumentSeparator, &tokens));
    ISTHMUS_RETURN_IF_ERROR(encoder.Append(doc, &tokens));
    ++documents;
    return Status::Ok();
  }
};

}  // namespace

Result<std::string> ReadTextFile(const std::string& path, std::string* raw_sha256) {
  // An out-parameter rather than a Result: GCC 12 warns falsely about moving the string
  // out of the variant.
  std::string raw;
  ISTHMUS_RETURN_IF_ERROR(ReadRawFile(path, &raw));
  if (raw_sha256 != nullptr) {
    Sha256 h;
    h.Update(raw.data(), raw.size());
    *raw_sha256 = h.HexDigest();
  }
  if (std::string_view(raw).starts_with("\x1f\x8b")) {  // gzip magic
    return Gunzip(path, raw);
  }
  if (raw.size() > kMaxTextBytes) {
    return Status::ResourceExhausted(path + ": more than 4 GiB of text");
  }
  return raw;
}

std::vector<std::string_view> SplitDocuments(std::string_view text) {
  std::vector<std::string_view> docs;
  size_t doc_start = std::string_view::npos;
  size_t doc_end = 0;  // end of the last non-blank line of the open document
  size_t pos = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    const size_t line_end = nl == std::string_view::npos ? text.size() : nl;
    std::string_view line = text.substr(pos, line_end - pos);
    if (IsBlank(line)) {
      if (doc_start != std::string_view::npos) {
        docs.push_back(text.substr(doc_start, doc_end - doc_start));
        doc_start = std::string_view::npos;
      }
    } else {
      if (doc_start == std::string_view::npos) doc_start = pos;
      doc_end = line_end;
      // Keep the document free of a trailing '\r' from CRLF text.
      if (doc_end > doc_start && text[doc_end - 1] == '\r') --doc_end;
    }
    pos = nl == std::string_view::npos ? text.size() : nl + 1;
  }
  if (doc_start != std::string_view::npos)
    docs.push_back(text.substr(doc_start, doc_end - doc_start));
  return docs;
}

bool IsValidationDocument(std::string_view document, uint64_t seed, double val_fraction) {
  if (val_fraction <= 0.0) return false;
  if (val_fraction >= 1.0) return true;
  Sha256 h;
  h.Update(&seed, 8);
  h.Update(document.data(), document.size());
  const auto d = h.Digest();
  uint64_t v = 0;
  std::memcpy(&v, d.data(), 8);
  // 2^64 * fraction computed in long double keeps 64 bits of precision on x86-64.
  const long double threshold = static_cast<long double>(val_fraction) * 18446744073709551616.0L;
  return static_cast<long double>(v) < threshold;
}

Result<BuildSummary> BuildShards(const BuildOptions& options) {
  if (options.inputs.empty()) return Status::InvalidArgument("no input files given");
  if (!(options.val_fraction >= 0.0 && options.val_fraction <= 1.0)) {
    return Status::InvalidArgument("val_fraction must be in [0, 1], got " +
                                   std::to_string(options.val_fraction));
  }
  std::error_code ec;
  std::filesystem::create_directories(options.out_dir, ec);
  if (ec) return Status::IoError(options.out_dir + ": cannot create folder: " + ec.message());

  BuildSummary summary;
  Encoder encoder;
  std::unique_ptr<BpeTokenizer> bpe;
  if (!options.tokenizer_dir.empty()) {
    ISTHMUS_ASSIGN_OR_RETURN(bpe, BpeTokenizer::LoadPath(options.tokenizer_dir));
    encoder.bpe = bpe.get();
  }
  ShardBuffer train;
  ShardBuffer val;
  nlohmann::ordered_json sources = nlohmann::ordered_json::array();
  for (const std::string& input : options.inputs) {
    std::string raw_sha;
    ISTHMUS_ASSIGN_OR_RETURN(std::string text, ReadTextFile(input, &raw_sha));
    uint64_t docs = 0;
    for (std::string_view doc : SplitDocuments(text)) {
      ISTHMUS_RETURN_IF_ERROR(
          (IsValidationDocument(doc, options.seed, options.val_fraction) ? val : train)
              .Add(doc, encoder));
      ++docs;
    }
    summary.source_bytes += text.size();
    sources.push_back({{"path", input},
                       {"bytes", std::filesystem::file_size(input, ec)},
                       {"text_bytes", text.size()},
                       {"documents", docs},
                       {"sha256", raw_sha}});
  }

  const int vocab_size = bpe ? bpe->vocab_size() : ByteTokenizer::kVocabSize;
  const int width = TokenBytes(vocab_size);
  auto write_shard = [&](const ShardBuffer& b, const char* name, ShardStats* stats) -> Status {
    stats->tokens = b.tokens.size();
    stats->documents = b.documents;
    std::vector<uint16_t> narrow;
    const void* data = b.tokens.data();
    if (width == 2) {
      narrow.assign(b.tokens.begin(), b.tokens.end());
      data = narrow.data();
    }
    const size_t bytes = b.tokens.size() * width;
    Sha256 h;
    h.Update(data, bytes);
    stats->sha256 = h.HexDigest();
    return WriteFileAtomic(options.out_dir + "/" + name, data, bytes);
  };
  ISTHMUS_RETURN_IF_ERROR(write_shard(train, "train.bin", &summary.train));
  ISTHMUS_RETURN_IF_ERROR(write_shard(val, "val.bin", &summary.val));

  auto shard_json = [](const char* file, const ShardStats& s) {
    return nlohmann::ordered_json{
        {"file", file}, {"tokens", s.tokens}, {"documents", s.documents}, {"sha256", s.sha256}};
  };
  nlohmann::ordered_json manifest = {
      {"format", kShardFormat},
      {"tokenizer", bpe ? bpe->kind() : "byte"},
      {"vocab_size", vocab_size},
      {"token_dtype", width == 4 ? "uint32-le" : "uint16-le"},
      {"document_separator", kDocumentSeparator},
      {"seed", options.seed},
      {"val_fraction", options.val_fraction},
      {"train", shard_json("train.bin", summary.train)},
      {"val", shard_json("val.bin", summary.val)},
      {"sources", sources},
  };
  const std::string text = manifest.dump(2) + "\n";
  ISTHMUS_RETURN_IF_ERROR(
      WriteFileAtomic(options.out_dir + "/manifest.json", text.data(), text.size()));
  // Make the renames durable.
  int dfd = ::open(options.out_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0 || ::fsync(dfd) != 0) {
    if (dfd >= 0) ::close(dfd);
    return Status::IoError(options.out_dir + ": fsync of the folder failed: " + ErrnoText());
  }
  ::close(dfd);
  return summary;
}

}  // namespace isthmus::data
