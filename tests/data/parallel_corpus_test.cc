// The translation task from gettext catalogues (worker/data/parallel_corpus.*, isthmus-data
// parallel): .mo files the test writes byte by byte in both byte orders (contexts, plurals,
// a header's charset, every kind of pair the cleaning drops), damaged ones, the shards and
// loss masks built from them as the dataset reader serves them, and the machine's own
// catalogues when it has them.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "tests/command.h"
#include "worker/data/parallel_corpus.h"
#include "worker/data/shard_builder.h"
#include "worker/data/token_dataset.h"
#include "worker/data/tokenizer.h"

namespace isthmus::data {
namespace {

// A .mo file of (original, translation) entries, sorted as msgfmt sorts them, in little-
// or big-endian words.
std::string MoBytes(std::vector<std::pair<std::string, std::string>> entries, bool big_endian) {
  std::sort(entries.begin(), entries.end());
  const uint32_t n = static_cast<uint32_t>(entries.size());
  const uint32_t originals = 28, translations = originals + 8 * n;
  uint32_t at = translations + 8 * n;
  std::string out(at, '\0');
  auto put = [&](uint32_t offset, uint32_t v) {
    if (big_endian) v = __builtin_bswap32(v);
    std::memcpy(out.data() + offset, &v, 4);
  };
  put(0, 0x950412de);
  put(4, 0);
  put(8, n);
  put(12, originals);
  put(16, translations);
  put(20, 0);  // no hash table
  put(24, 0);
  for (uint32_t table : {originals, translations}) {
    for (uint32_t i = 0; i < n; ++i) {
      const std::string& s = table == originals ? entries[i].first : entries[i].second;
      put(table + 8 * i, static_cast<uint32_t>(s.size()));
      put(table + 8 * i + 4, static_cast<uint32_t>(out.size()));
      out += s;
      out.push_back('\0');
    }
  }
  return out;
}

// A one-row batch of byte tokens as text, and the text of its learned targets (>= 0).
std::pair<std::string, std::string> TextAndLearned(const Batch& b) {
  std::vector<uint16_t> row(b.tokens.begin(), b.tokens.end()), learned;
  for (int32_t t : b.targets) {
    if (t >= 0) learned.push_back(static_cast<uint16_t>(t));
  }
  return {*ByteTokenizer::Decode(row), *ByteTokenizer::Decode(learned)};
}

const std::string kUtf8Header = "Content-Type: text/plain; charset=UTF-8\n";

class ParallelCorpus : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = ::testing::TempDir() + "/parallel-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::remove_all(root_);
  }
  void TearDown() override { std::filesystem::remove_all(root_); }

  void Write(const std::string& lang, const std::string& name, const std::string& bytes) {
    const std::string dir = root_ + "/locale/" + lang + "/LC_MESSAGES";
    std::filesystem::create_directories(dir);
    std::ofstream(dir + "/" + name, std::ios::binary) << bytes;
  }
  std::string locale() const { return root_ + "/locale"; }

  std::string root_;
};

TEST_F(ParallelCorpus, ReadsBothByteOrdersWithContextsPluralsAndTheHeadersCharset) {
  const std::vector<std::pair<std::string, std::string>> entries = {
      {"", kUtf8Header},
      {"Open file", "Datei öffnen"},
      {"menu\x04Quit", "Beenden"},
      {std::string("%d file\0%d files", 16), std::string("%d Datei\0%d Dateien", 19)},
  };
  for (bool big : {false, true}) {
    Write("de", big ? "big.mo" : "little.mo", MoBytes(entries, big));
    auto mo = ReadMoFile(root_ + "/locale/de/LC_MESSAGES/" + (big ? "big.mo" : "little.mo"));
    ASSERT_TRUE(mo.ok()) << mo.status().ToString();
    EXPECT_EQ(mo->charset, "UTF-8");
    std::map<std::string, std::string> got;
    for (const auto& p : mo->pairs) got[p.source] = p.target;
    const std::map<std::string, std::string> want = {{"Open file", "Datei öffnen"},
                                                     {"Quit", "Beenden"},
                                                     {"%d file", "%d Datei"},
                                                     {"%d files", "%d Dateien"}};
    EXPECT_EQ(got, want) << (big ? "big-endian" : "little-endian");
  }
}

TEST_F(ParallelCorpus, DamagedCataloguesAreRefusedNamingTheFileAndTheFault) {
  const std::string good = MoBytes({{"", kUtf8Header}, {"Yes", "Ja"}}, false);
  auto refused = [&](const std::string& bytes, const std::string& words) {
    Write("de", "bad.mo", bytes);
    const std::string path = root_ + "/locale/de/LC_MESSAGES/bad.mo";
    auto mo = ReadMoFile(path);
    ASSERT_FALSE(mo.ok()) << words;
    EXPECT_EQ(mo.status().code(), Code::kCorruption);
    EXPECT_NE(mo.status().message().find(path), std::string::npos) << mo.status().ToString();
    EXPECT_NE(mo.status().message().find(words), std::string::npos) << mo.status().ToString();
  };
  refused(good.substr(0, 12), "shorter than its 20-byte header");
  std::string bytes = good;
  bytes[0] = 'x';
  refused(bytes, "wrong magic number");
  bytes = good;
  bytes[8] = 100;  // 100 entries in a file that has room for 2
  refused(bytes, "run past the end");
  bytes = good;
  bytes[28 + 8 + 4] = static_cast<char>(0xf0);  // the second original's offset, far out
  refused(bytes, "string 1 lies outside the file");
  bytes = good;
  bytes[6] = 2;  // major revision 2
  refused(bytes, "unknown major revision 2");
  EXPECT_EQ(ReadMoFile(root_ + "/none.mo").status().code(), Code::kNotFound);
}

TEST_F(ParallelCorpus, CleaningDropsEachKindOfBadPairAndSkipsOtherCharsets) {
  Write("fr", "a.mo",
        MoBytes({{"", kUtf8Header},
                 {"Save", "Enregistrer"},
                 {"Cancel", ""},           // empty translation
                 {"OK", "OK"},             // untranslated
                 {"Bad", "Mauvais \xff"},  // not UTF-8
                 {"Line one\nline two", "Ligne un\nligne deux"}},
                false));
  Write("fr", "b.mo",
        MoBytes({{"", kUtf8Header}, {"Save", "Enregistrer"}, {"Save", "Sauver"}}, true));
  Write("fr", "c.mo",
        MoBytes({{"", "Content-Type: text/plain; charset=ISO-8859-1\n"}, {"No", "Non"}}, false));
  Write("fr", "notes.txt", "not a catalogue");
  auto fr = CollectPairs(locale(), "fr");
  ASSERT_TRUE(fr.ok()) << fr.status().ToString();
  EXPECT_EQ(fr->catalogues.size(), 2u);
  ASSERT_EQ(fr->not_utf8.size(), 1u);
  EXPECT_NE(fr->not_utf8[0].find("c.mo"), std::string::npos);
  EXPECT_EQ(fr->messages, 7u);
  EXPECT_EQ(fr->empty, 1u);
  EXPECT_EQ(fr->untranslated, 1u);
  EXPECT_EQ(fr->bad_utf8, 1u);
  EXPECT_EQ(fr->duplicates, 1u);
  std::set<std::pair<std::string, std::string>> got;
  for (const auto& p : fr->pairs) got.emplace(p.source, p.target);
  const std::set<std::pair<std::string, std::string>> want = {
      {"Line one\nline two", "Ligne un\nligne deux"}, {"Save", "Enregistrer"}, {"Save", "Sauver"}};
  EXPECT_EQ(got, want);

  auto none = CollectPairs(locale(), "xx");
  EXPECT_EQ(none.status().code(), Code::kNotFound);
  EXPECT_NE(none.status().message().find("apt-get install"), std::string::npos)
      << none.status().ToString();
  EXPECT_NE(none.status().message().find("'xx'"), std::string::npos);
}

// Shards of exactly one example per window, the loss on the translation only, the same
// held-out messages in every language, byte-identical when built again, and a reader with
// another window length refused.
TEST_F(ParallelCorpus, ShardsHoldOneExampleAWindowLearnedOnTheTranslationOnly) {
  std::vector<std::pair<std::string, std::string>> de = {{"", kUtf8Header}},
                                                   es = {{"", kUtf8Header}};
  for (int i = 0; i < 60; ++i) {
    const std::string n = std::to_string(i);
    de.push_back({"Message " + n, "Nachricht " + n});
    es.push_back({"Message " + n, "Mensaje " + n});
  }
  de.push_back({std::string(80, 'x'), std::string(80, 'y')});  // longer than T
  Write("de", "app.mo", MoBytes(de, false));
  Write("es", "app.mo", MoBytes(es, false));
  TranslationOptions options;
  options.locale_dir = locale();
  options.languages = {"de", "es"};
  options.out_dir = root_ + "/out";
  options.example_tokens = 64;
  options.val_fraction = 0.2;
  auto built = BuildTranslationShards(options);
  ASSERT_TRUE(built.ok()) << built.status().ToString();
  ASSERT_EQ(built->languages.size(), 2u);
  EXPECT_EQ(built->languages[0].too_long, 1u);
  EXPECT_EQ(built->languages[0].pairs, 61u);
  for (const auto& l : built->languages) {
    EXPECT_EQ(l.train + l.val + l.too_long, l.pairs);
    EXPECT_GT(l.val, 2u);  // 20% of 60
    EXPECT_GT(l.train, 30u);
  }
  EXPECT_EQ(built->languages[0].val, built->languages[1].val);  // the same messages held out

  // Held-out text names the same English messages in both languages.
  auto sources = [&](const std::string& lang) {
    std::set<std::string> s;
    std::ifstream in(options.out_dir + "/heldout-" + lang + ".jsonl");
    for (std::string line; std::getline(in, line);) {
      s.insert(nlohmann::json::parse(line)["source"].get<std::string>());
    }
    return s;
  };
  std::set<std::string> held_de = sources("de");
  held_de.erase(std::string(80, 'x'));  // held out or not, too long for a shard
  EXPECT_EQ(held_de, sources("es"));
  EXPECT_EQ(held_de.size(), built->languages[0].val);

  DatasetOptions read;
  read.batch_size = 1;
  read.seq_len = 64;
  auto ds = TokenDataset::Open(options.out_dir + "/train.bin", read);
  ASSERT_TRUE(ds.ok()) << ds.status().ToString();
  EXPECT_EQ(ds->num_tokens(), built->train.documents * 64 + 1);
  EXPECT_EQ(ds->batches_per_epoch(), built->train.documents);
  const std::set<std::string>& held = held_de;
  std::set<std::string> seen;
  for (uint64_t i = 0; i < ds->batches_per_epoch(); ++i) {
    const auto [text, target] = TextAndLearned(ds->Next());
    // "en: Message 7\nde: Nachricht 7\n\n" then padding; the loss on "Nachricht 7\n\n".
    ASSERT_TRUE(text.starts_with("en: Message ")) << text;
    const std::string number = text.substr(12, text.find('\n') - 12);
    const std::string lang = text.substr(text.find('\n') + 1, 2);
    const std::string want = (lang == "de" ? "Nachricht " : "Mensaje ") + number + "\n\n";
    EXPECT_EQ(target, want) << text;
    EXPECT_TRUE(text.find(lang + ": " + want) != std::string::npos) << text;
    EXPECT_EQ(held.count("Message " + number), 0u) << "held-out message " << number << " trains";
    seen.insert(lang + number);
  }
  EXPECT_EQ(seen.size(), built->train.documents);

  read.seq_len = 128;
  auto wrong = TokenDataset::Open(options.out_dir + "/train.bin", read);
  EXPECT_EQ(wrong.status().code(), Code::kInvalidArgument);
  EXPECT_NE(wrong.status().message().find("--context 64"), std::string::npos)
      << wrong.status().ToString();

  // Built again: the same bytes.
  const auto manifest = nlohmann::json::parse(std::ifstream(options.out_dir + "/manifest.json"));
  options.out_dir = root_ + "/again";
  ASSERT_TRUE(BuildTranslationShards(options).ok());
  const auto again = nlohmann::json::parse(std::ifstream(options.out_dir + "/manifest.json"));
  EXPECT_EQ(manifest["train"]["sha256"], again["train"]["sha256"]);
  EXPECT_EQ(manifest["loss_mask"], again["loss_mask"]);
  EXPECT_EQ(manifest["task"], "translate");

  // A mask cut short is refused, not read as "learn nothing".
  std::filesystem::resize_file(root_ + "/again/train.mask", 10);
  read.seq_len = 64;
  EXPECT_EQ(TokenDataset::Open(root_ + "/again/train.bin", read).status().code(),
            Code::kCorruption);
}

// Sequence-level distillation: a teacher's translations of train-<lang>.jsonl become the
// training targets; the held-out shard keeps the catalogue's references, byte for byte.
TEST_F(ParallelCorpus, TeacherTranslationsReplaceTheTrainingTargetsOnly) {
  std::vector<std::pair<std::string, std::string>> de = {{"", kUtf8Header}};
  for (int i = 0; i < 50; ++i)
    de.push_back({"Item " + std::to_string(i), "Ding " + std::to_string(i)});
  Write("de", "app.mo", MoBytes(de, false));
  TranslationOptions options;
  options.locale_dir = locale();
  options.languages = {"de"};
  options.out_dir = root_ + "/plain";
  options.example_tokens = 48;
  options.val_fraction = 0.2;
  auto plain = BuildTranslationShards(options);
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();

  // The teacher: "Teil N" for every training message, and an empty answer for one.
  std::ifstream train(root_ + "/plain/train-de.jsonl");
  std::ofstream teacher(root_ + "/teacher.jsonl");
  int lines = 0;
  std::string emptied;
  for (std::string line; std::getline(train, line); ++lines) {
    const auto row = nlohmann::json::parse(line);
    const std::string source = row["source"];
    std::string translation = "Teil " + source.substr(5);
    if (lines == 0) emptied = source, translation = "";
    teacher << nlohmann::json{{"source", source}, {"translation", translation}}.dump() << "\n";
  }
  teacher.close();
  EXPECT_EQ(static_cast<uint64_t>(lines), plain->languages[0].train);

  options.out_dir = root_ + "/taught";
  options.teacher_targets = {{"de", root_ + "/teacher.jsonl"}};
  auto taught = BuildTranslationShards(options);
  ASSERT_TRUE(taught.ok()) << taught.status().ToString();
  EXPECT_EQ(taught->languages[0].teacher_targets, static_cast<uint64_t>(lines - 1));
  EXPECT_EQ(taught->languages[0].teacher_dropped, 1u);
  EXPECT_EQ(taught->val.sha256, plain->val.sha256);  // references untouched
  DatasetOptions read;
  read.batch_size = 1;
  read.seq_len = 48;
  auto ds = TokenDataset::Open(options.out_dir + "/train.bin", read);
  ASSERT_TRUE(ds.ok()) << ds.status().ToString();
  for (uint64_t i = 0; i < ds->batches_per_epoch(); ++i) {
    const auto [text, target] = TextAndLearned(ds->Next());
    const std::string number = text.substr(9, text.find('\n') - 9);  // "en: Item N"
    EXPECT_EQ(target, "Teil " + number + "\n\n") << text;
    EXPECT_NE("Item " + number, emptied);
  }

  // A teacher file that misses a training message, or is not JSON lines, is refused.
  std::ofstream(root_ + "/short.jsonl")
      << nlohmann::json{{"source", "Item 1"}, {"translation", "x"}}.dump();
  options.out_dir = root_ + "/refused";
  options.teacher_targets = {{"de", root_ + "/short.jsonl"}};
  auto missing = BuildTranslationShards(options);
  EXPECT_EQ(missing.status().code(), Code::kInvalidArgument);
  EXPECT_NE(missing.status().message().find("lacks the teacher's translation of"),
            std::string::npos)
      << missing.status().ToString();
  std::ofstream(root_ + "/bad.jsonl") << "{\"source\": \"Item 1\"}\n";
  options.teacher_targets = {{"de", root_ + "/bad.jsonl"}};
  auto bad = BuildTranslationShards(options);
  EXPECT_NE(bad.status().message().find("bad.jsonl line 1"), std::string::npos)
      << bad.status().ToString();
  options.teacher_targets = {{"fr", root_ + "/teacher.jsonl"}};
  auto other = BuildTranslationShards(options);
  EXPECT_NE(other.status().message().find("add it to --lang"), std::string::npos)
      << other.status().ToString();
  EXPECT_FALSE(std::filesystem::exists(root_ + "/refused"));
}

TEST_F(ParallelCorpus, IsthmusDataParallelPrintsTheCountsAndRefusesAMissingLanguage) {
  std::vector<std::pair<std::string, std::string>> it = {{"", kUtf8Header}};
  for (int i = 0; i < 20; ++i)
    it.push_back({"Row " + std::to_string(i), "Riga " + std::to_string(i)});
  Write("it", "x.mo", MoBytes(it, true));
  const std::string bin = ISTHMUS_DATA_BIN;
  auto ok = testing::RunCommand(bin + " parallel --locale-dir " + locale() + " --lang it --out " +
                                root_ + "/out --seq-len 32 2>&1");
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  // The row of the table: language, catalogues, pairs, train, held-out, too long, words.
  const size_t row = ok.output.find("\nit ");
  ASSERT_NE(row, std::string::npos) << ok.output;
  std::istringstream fields(ok.output.substr(row + 4));
  uint64_t catalogues = 0, pairs = 0, train = 0, val = 0, too_long = 0, words = 0;
  fields >> catalogues >> pairs >> train >> val >> too_long >> words;
  EXPECT_EQ(catalogues, 1u);
  EXPECT_EQ(pairs, 20u);
  EXPECT_EQ(train + val, 20u);
  EXPECT_EQ(too_long, 0u);
  EXPECT_EQ(words, 40u);
  EXPECT_NE(ok.output.find("isthmus-worker train --context 32"), std::string::npos) << ok.output;
  EXPECT_TRUE(std::filesystem::exists(root_ + "/out/train.mask"));
  auto missing = testing::RunCommand(bin + " parallel --locale-dir " + locale() +
                                     " --lang it,de --out " + root_ + "/out2 2>&1");
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_NE(missing.output.find("no gettext catalogues for language 'de'"), std::string::npos)
      << missing.output;
  EXPECT_FALSE(std::filesystem::exists(root_ + "/out2"));  // nothing written
  auto help = testing::RunCommand(bin + " parallel --help");
  EXPECT_NE(help.output.find("--locale-dir"), std::string::npos);
}

// The catalogues Debian packages ship (issue: 54k-81k non-empty pairs per language on a
// machine with ~90 packages): every catalogue of the four demo languages reads.
TEST(ParallelCorpusOfThisMachine, TheInstalledCataloguesRead) {
  for (const char* lang : {"de", "fr", "es", "it"}) {
    auto pairs = CollectPairs("/usr/share/locale", lang);
    if (pairs.status().code() == Code::kNotFound) {
      GTEST_SKIP() << "this machine has no gettext catalogues for " << lang
                   << " (deploy/install-deps.sh installs packages that ship them)";
    }
    ASSERT_TRUE(pairs.ok()) << pairs.status().ToString();
    EXPECT_GT(pairs->pairs.size(), 1000u) << lang;
    EXPECT_EQ(pairs->empty + pairs->untranslated + pairs->duplicates + pairs->bad_utf8 +
                  pairs->pairs.size(),
              pairs->messages);
  }
}

}  // namespace
}  // namespace isthmus::data
