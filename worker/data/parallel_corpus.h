// A parallel corpus from the gettext catalogues a Debian machine already has: each
// package's /usr/share/locale/<lang>/LC_MESSAGES/<package>.mo maps English messages (the
// msgids) to their translations. ReadMoFile reads one catalogue; CollectPairs gathers a
// language's pairs from every catalogue of a locale folder, cleaned (see there).
//
// The .mo format (GNU gettext manual, "The Format of GNU MO Files"): a header of 32-bit
// words in the writer's byte order (magic 0x950412de, revision, N, offset of the
// originals' table, offset of the translations' table), each table N (length, offset)
// pairs pointing at NUL-terminated strings. An original may carry a context
// ("context\x04msgid") and a plural ("msgid\0msgid_plural"); a translation of a plural
// holds its forms separated by NULs. The entry with the empty msgid is the header, whose
// "Content-Type: ...; charset=X" says how the strings are encoded.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace isthmus::data {

struct MessagePair {
  std::string source;  // the English message, without its context
  std::string target;  // its translation
};

struct MoCatalogue {
  std::string charset;             // from the header entry; "" when it names none
  std::vector<MessagePair> pairs;  // in file order; a plural gives (msgid, form 0) and
                                   // (msgid_plural, form 1) when the forms are there
};

// Reads a .mo file. NotFound / IoError for the file; Corruption (naming the file and what
// is wrong) for a bad magic number, an unknown major revision, or a table or string that
// lies outside the file.
Result<MoCatalogue> ReadMoFile(const std::string& path);

struct LanguagePairs {
  std::string language;                 // e.g. "de"
  std::vector<MessagePair> pairs;       // cleaned, in catalogue (file name) then file order
  std::vector<std::string> catalogues;  // the .mo files read, sorted by name
  std::vector<std::string> not_utf8;    // catalogues skipped: their charset is not UTF-8
  uint64_t messages = 0;                // pairs found before cleaning
  uint64_t empty = 0;                   // dropped: empty source or translation
  uint64_t untranslated = 0;            // dropped: the translation equals the source
  uint64_t duplicates = 0;              // dropped: the same (source, target) seen before
  uint64_t bad_utf8 = 0;                // dropped: bytes that are not UTF-8
};

// Every catalogue in <locale_dir>/<language>/LC_MESSAGES/*.mo, cleaned: pairs with an
// empty side, a translation equal to its source, invalid UTF-8, or an exact (source,
// target) repeat are dropped (counted by reason); catalogues in another charset than
// UTF-8 are skipped (listed). Format strings, markup and inner newlines stay as they are.
// NotFound when the language has no catalogue, saying which packages ship them and how to
// install them; Corruption from ReadMoFile.
Result<LanguagePairs> CollectPairs(const std::string& locale_dir, const std::string& language);

}  // namespace isthmus::data
