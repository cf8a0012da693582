// gettext .mo catalogues -> English/translation message pairs.
#include "worker/data/parallel_corpus.h"

#include <unicode/utf8.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string_view>
#include <utility>

namespace isthmus::data {
namespace {

constexpr uint32_t kMoMagic = 0x950412de;

bool IsUtf8(std::string_view s) {
  int32_t i = 0;
  const auto n = static_cast<int32_t>(s.size());
  while (i < n) {
    UChar32 c;
    U8_NEXT(s.data(), i, n, c);
    if (c < 0) return false;
  }
  return true;
}

// "text/plain; charset=UTF-8" in the header entry -> "UTF-8".
std::string CharsetOf(std::string_view header) {
  const size_t at = header.find("charset=");
  if (at == std::string_view::npos) return "";
  std::string_view rest = header.substr(at + 8);
  const size_t end = rest.find_first_of(" ;\n\r\t");
  return std::string(rest.substr(0, end));
}

bool IsUtf8Charset(std::string charset) {
  std::transform(charset.begin(), charset.end(), charset.begin(),
                 [](unsigned char c) { return std::tolower(c); });
  return charset == "utf-8" || charset == "utf8";
}

// The NUL-separated parts of a string ("a\0b" -> {"a", "b"}).
std::vector<std::string_view> Parts(std::string_view s) {
  std::vector<std::string_view> out;
  size_t start = 0;
  while (true) {
    const size_t nul = s.find('\0', start);
    out.push_back(s.substr(start, nul == std::string_view::npos ? nul : nul - start));
    if (nul == std::string_view::npos) return out;
    start = nul + 1;
  }
}

}  // namespace

Result<MoCatalogue> ReadMoFile(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return Status::NotFound(path + ": no such file");
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::IoError(path + ": cannot open");
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) return Status::IoError(path + ": read failed");
  auto bad = [&](const std::string& what) {
    return Status::Corruption(path + ": not a gettext .mo catalogue: " + what);
  };
  if (bytes.size() < 20) return bad("shorter than its 20-byte header");
  uint32_t magic;
  std::memcpy(&magic, bytes.data(), 4);
  const bool swap = magic == __builtin_bswap32(kMoMagic);
  if (magic != kMoMagic && !swap) return bad("wrong magic number");
  auto word = [&](size_t at) {
    uint32_t v;
    std::memcpy(&v, bytes.data() + at, 4);
    return swap ? __builtin_bswap32(v) : v;
  };
  const uint32_t revision = word(4), n = word(8), originals = word(12), translations = word(16);
  if ((revision >> 16) > 1) return bad("unknown major revision " + std::to_string(revision >> 16));
  auto table_fits = [&](uint64_t offset) { return offset + uint64_t{n} * 8 <= bytes.size(); };
  if (!table_fits(originals) || !table_fits(translations)) {
    return bad("its string tables (" + std::to_string(n) + " entries) run past the end");
  }
  // The string of table entry i: length then offset; the NUL after it must be in the file.
  auto string_at = [&](uint32_t table, uint32_t i, std::string_view* out) {
    const uint64_t length = word(table + 8 * i), offset = word(table + 8 * i + 4);
    if (offset + length >= bytes.size()) return false;
    *out = std::string_view(bytes).substr(offset, length);
    return true;
  };
  MoCatalogue catalogue;
  for (uint32_t i = 0; i < n; ++i) {
    std::string_view original, translation;
    if (!string_at(originals, i, &original) || !string_at(translations, i, &translation)) {
      return bad("string " + std::to_string(i) + " lies outside the file");
    }
    if (original.empty()) {  // the header entry
      catalogue.charset = CharsetOf(translation);
      continue;
    }
    if (const size_t eot = original.find('\x04'); eot != std::string_view::npos) {
      original.remove_prefix(eot + 1);  // drop the context
    }
    const auto sources = Parts(original);
    const auto targets = Parts(translation);
    for (size_t k = 0; k < sources.size() && k < 2 && k < targets.size(); ++k) {
      catalogue.pairs.push_back({std::string(sources[k]), std::string(targets[k])});
    }
  }
  return catalogue;
}

Result<LanguagePairs> CollectPairs(const std::string& locale_dir, const std::string& language) {
  LanguagePairs out;
  out.language = language;
  const std::filesystem::path folder = std::filesystem::path(locale_dir) / language / "LC_MESSAGES";
  std::error_code ec;
  for (std::filesystem::directory_iterator it(folder, ec), end; !ec && it != end;
       it.increment(ec)) {
    if (it->path().extension() == ".mo" && it->is_regular_file(ec)) {
      out.catalogues.push_back(it->path().string());
    }
  }
  std::sort(out.catalogues.begin(), out.catalogues.end());
  if (out.catalogues.empty()) {
    return Status::NotFound(
        "no gettext catalogues for language '" + language + "' in " + folder.string() +
        ": install packages that ship translations, e.g. `apt-get install coreutils git apt "
        "dpkg bash gettext libglib2.0-data`, and check that dpkg does not leave out "
        "/usr/share/locale (a 'path-exclude' line in /etc/dpkg/dpkg.cfg.d/); or name another "
        "folder with --locale-dir");
  }
  std::set<std::pair<std::string, std::string>> seen;
  std::vector<std::string> read;
  for (const std::string& path : out.catalogues) {
    ISTHMUS_ASSIGN_OR_RETURN(MoCatalogue catalogue, ReadMoFile(path));
    if (!catalogue.charset.empty() && !IsUtf8Charset(catalogue.charset)) {
      out.not_utf8.push_back(path);
      continue;
    }
    read.push_back(path);
    for (MessagePair& p : catalogue.pairs) {
      ++out.messages;
      if (p.source.empty() || p.target.empty()) {
        ++out.empty;
      } else if (p.source == p.target) {
        ++out.untranslated;
      } else if (!IsUtf8(p.source) || !IsUtf8(p.target)) {
        ++out.bad_utf8;
      } else if (!seen.emplace(p.source, p.target).second) {
        ++out.duplicates;
      } else {
        out.pairs.push_back(std::move(p));
      }
    }
  }
  out.catalogues = std::move(read);
  return out;
}

}  // namespace isthmus::data
