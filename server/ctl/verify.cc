// sync verify's comparison of one shard's digests across sites, with the memberships that
// say which rounds are comparable (verify.h).
#include "server/ctl/verify.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <optional>

namespace isthmus::ctl {
namespace {

using json = nlohmann::json;

std::string Join(const std::vector<std::string>& items, const std::string& sep) {
  std::string out;
  for (const auto& s : items) out += (out.empty() ? "" : sep) + s;
  return out;
}

// The site as its shard names itself (sync.site); the --site name for a server that does
// not say.
std::string SiteId(const VerifySite& s) { return s.digests.site.empty() ? s.name : s.digests.site; }

bool IsMember(const DigestsInfo& d, const std::string& site) {
  return std::find(d.members.begin(), d.members.end(), site) != d.members.end();
}

// A site no longer a member, by the record of site `by` (itself, when it left).
struct Removal {
  uint64_t from_round = 0;
  size_t by = 0;
};

// The epoch of a committed round when the membership in effect is `epoch` from round `from`:
// that epoch from `from` on, epoch 0 at round 0 and before a first change; otherwise some
// earlier epoch (a shard keeps no history of them).
std::optional<uint64_t> EpochOf(uint64_t round, uint64_t epoch, uint64_t from) {
  if (epoch == 0 || round >= from) return epoch;
  if (round == 0 || epoch == 1) return 0;
  return std::nullopt;
}

}  // namespace

VerifyOutcome CompareDigests(size_t shard, const std::string& job,
                             const std::vector<VerifySite>& sites) {
  VerifyOutcome out;
  const std::string head = "shard " + std::to_string(shard) + " job " + job + ": ";
  // Who is no longer a member, by any site's record: a removed site does not know it, the
  // others do; a site that left records itself.
  std::map<size_t, Removal> removed;
  for (size_t k = 0; k < sites.size(); ++k) {
    const std::string id = SiteId(sites[k]);
    for (size_t t = 0; t < sites.size(); ++t) {
      const DigestsInfo& d = sites[t].digests;
      auto it = d.removed.find(id);
      if (!d.has_members || it == d.removed.end() || IsMember(d, id)) continue;
      auto [r, fresh] = removed.try_emplace(k, Removal{it->second, t});
      if (!fresh && it->second < r->second.from_round) r->second = {it->second, t};
    }
  }
  // The membership the compared rounds are described by: the first site still a member.
  size_t ref = 0;
  for (size_t k = 0; k < sites.size(); ++k) {
    if (!removed.count(k) && sites[k].digests.has_members) {
      ref = k;
      break;
    }
  }
  const DigestsInfo& rd = sites[ref].digests;

  // The rounds every site holds: from the latest first round held (a joined site holds none
  // before it joined) to the lowest committed round, and before any removal's cut.
  uint64_t first = 0, last = UINT64_MAX, lowest_committed = UINT64_MAX;
  size_t first_from = 0;
  std::vector<std::map<uint64_t, std::string>> maps;
  for (size_t k = 0; k < sites.size(); ++k) {
    const DigestsInfo& d = sites[k].digests;
    maps.emplace_back(d.digests.begin(), d.digests.end());
    const uint64_t held = d.digests.empty() ? d.committed_round + 1 : d.digests.front().first;
    if (held > first) {
      first = held;
      first_from = k;
    }
    lowest_committed = std::min(lowest_committed, d.committed_round);
  }
  last = lowest_committed;
  std::optional<uint64_t> cut;
  for (const auto& [k, r] : removed) cut = std::min(cut.value_or(UINT64_MAX), r.from_round);
  const bool any_round = first <= last && !(cut && *cut <= first);
  if (cut && *cut > 0) last = std::min(last, *cut - 1);

  std::optional<uint64_t> first_diff;
  uint64_t compared = 0;
  for (uint64_t r = first; any_round && r <= last && !first_diff; ++r) {
    auto it0 = maps[0].find(r);
    bool all_have = it0 != maps[0].end();
    for (size_t s = 1; s < maps.size() && all_have; ++s) {
      auto it = maps[s].find(r);
      if (it == maps[s].end()) {
        all_have = false;
      } else if (it->second != it0->second) {
        first_diff = r;
      }
    }
    if (all_have && !first_diff) ++compared;
  }

  // The epochs of the compared rounds, as far as the reference membership tells.
  std::string epochs_text = "epochs not reported by the shards";
  json epochs = {{"first", nullptr}, {"last", nullptr}};
  if (rd.has_members && any_round) {
    const uint64_t upto = first_diff ? *first_diff : last;
    const auto lo = EpochOf(first, rd.epoch, rd.members_from);
    const auto hi = EpochOf(upto, rd.epoch, rd.members_from);
    epochs = {{"first", lo ? json(*lo) : json(nullptr)}, {"last", hi ? json(*hi) : json(nullptr)}};
    if (lo && hi && *lo == *hi) {
      epochs_text = "epoch " + std::to_string(*lo);
    } else if (lo && hi) {
      epochs_text = "epochs " + std::to_string(*lo) + ".." + std::to_string(*hi);
    } else {
      epochs_text = "epochs up to " + (hi ? std::to_string(*hi) : std::to_string(rd.epoch - 1));
    }
    if (first < rd.members_from && rd.members_from <= upto && rd.epoch > 0) {
      epochs_text +=
          ", epoch " + std::to_string(rd.epoch) + " from round " + std::to_string(rd.members_from);
    }
  }

  json committed = json::object(), by_site = json::object(), joined = json::object();
  std::string committed_text;
  for (size_t k = 0; k < sites.size(); ++k) {
    const DigestsInfo& d = sites[k].digests;
    committed[sites[k].name] = d.committed_round;
    committed_text += (k ? ", " : "") + sites[k].name + " " + std::to_string(d.committed_round);
    by_site[sites[k].name] = d.has_members ? json{{"site", SiteId(sites[k])},
                                                  {"epoch", d.epoch},
                                                  {"members", d.members},
                                                  {"members_from", d.members_from}}
                                           : json(nullptr);
    for (const auto& v : sites) {
      auto it = v.digests.joined.find(SiteId(sites[k]));
      if (it != v.digests.joined.end()) joined[sites[k].name] = it->second;
    }
  }
  json removed_json = json::object();
  for (const auto& [k, r] : removed) {
    const DigestsInfo& by = sites[r.by].digests;
    removed_json[sites[k].name] = {{"from_round", r.from_round},
                                   {"by", sites[r.by].name},
                                   {"epoch", by.epoch},
                                   {"members", by.members},
                                   {"members_from", by.members_from}};
  }
  out.row = {{"shard", shard},
             {"job", job},
             {"common_round", lowest_committed},
             {"committed", committed},
             {"first_round", any_round ? json(first) : json(nullptr)},
             {"last_round", any_round ? json(last) : json(nullptr)},
             {"rounds_compared", compared},
             {"epoch", rd.has_members ? json(rd.epoch) : json(nullptr)},
             {"epoch_from_round", rd.has_members ? json(rd.members_from) : json(nullptr)},
             {"epochs", epochs},
             {"membership", by_site},
             {"removed", removed_json},
             {"joined", joined}};

  // What is not a member any more comes first: it decides what was compared.
  for (const auto& [k, r] : removed) {
    const std::string name = SiteId(sites[k]);
    const DigestsInfo& by = sites[r.by].digests;
    const std::string how = r.by == k ? "it left from round " : "removed from round ";
    out.lines.push_back(head + "site " + name + " is no longer a member: " + how +
                        std::to_string(r.from_round) + " (site " + SiteId(sites[r.by]) +
                        " stands at epoch " + std::to_string(by.epoch) + ", members " +
                        Join(by.members, ",") + " from round " + std::to_string(by.members_from) +
                        "); rounds from " + std::to_string(r.from_round) +
                        " on were merged without it and are not compared");
  }
  if (first_diff) {
    out.kind = VerifyOutcome::kDiffer;
    out.row["agree"] = false;
    out.row["first_differing_round"] = *first_diff;
    json d = json::object();
    for (size_t s = 0; s < sites.size(); ++s) d[sites[s].name] = maps[s][*first_diff];
    out.row["digests"] = d;
    out.lines.push_back(head + "DIFFER at round " + std::to_string(*first_diff) + " (rounds " +
                        std::to_string(first) + ".." + std::to_string(*first_diff) + "; " +
                        epochs_text + ")");
    for (size_t s = 0; s < sites.size(); ++s) {
      char buf[256];
      std::snprintf(buf, sizeof buf, "  %-12s %s", sites[s].name.c_str(),
                    maps[s][*first_diff].c_str());
      out.lines.push_back(buf);
    }
  } else {
    out.row["agree"] = true;
    if (any_round) {
      out.lines.push_back(head + std::to_string(sites.size()) + " sites agree on rounds " +
                          std::to_string(first) + ".." + std::to_string(last) + " (" +
                          std::to_string(compared) + " digests compared; " + epochs_text +
                          "; committed: " + committed_text + ")");
    } else {
      out.lines.push_back(head +
                          "no round that every site holds under one membership (committed: " +
                          committed_text + ")");
    }
  }
  if (first > 0 && any_round) {
    const std::string name = SiteId(sites[first_from]);
    auto it = joined.find(sites[first_from].name);
    out.lines.push_back("  rounds before " + std::to_string(first) + " are not compared: site " +
                        name + " holds none (" +
                        (it != joined.end() ? "it joined from round " + it->dump()
                                            : std::string("it joined or caught up")) +
                        ")");
  }
  // Sites still members that stand at different epochs: a change half-known, or sites that
  // were never configured with each other.
  std::map<uint64_t, std::vector<std::string>> at_epoch;
  for (size_t k = 0; k < sites.size(); ++k) {
    if (removed.count(k) || !sites[k].digests.has_members) continue;
    at_epoch[sites[k].digests.epoch].push_back(SiteId(sites[k]));
  }
  if (at_epoch.size() > 1) {
    std::string text;
    for (const auto& [e, names] : at_epoch) {
      text += (text.empty() ? "" : "; ") + Join(names, ",") + " at epoch " + std::to_string(e);
    }
    out.lines.push_back("  the sites stand at different epochs (" + text +
                        "): a membership change under way (see isthmusctl sync status)");
  }
  for (size_t k = 0; k < sites.size(); ++k) {
    if (removed.count(k)) continue;
    for (size_t t = 0; t < sites.size(); ++t) {
      const DigestsInfo& d = sites[t].digests;
      if (t == k || !d.has_members || IsMember(d, SiteId(sites[k]))) continue;
      out.lines.push_back("  site " + SiteId(sites[k]) + " is not a member at site " +
                          SiteId(sites[t]) + " (members " + Join(d.members, ",") + ", epoch " +
                          std::to_string(d.epoch) +
                          "): a join under way, or sites not "
                          "configured as each other's peers");
      break;
    }
  }
  if (!removed.empty()) {
    if (out.kind == VerifyOutcome::kAgree) out.kind = VerifyOutcome::kRemoved;
    std::vector<std::string> flags, names;
    for (const auto& [k, r] : removed) {
      flags.push_back("--site " + sites[k].name);
      names.push_back(SiteId(sites[k]));
    }
    const std::string member = SiteId(sites[ref]);
    out.lines.push_back(
        "  remedy: to compare the members on later rounds, run sync verify without " +
        Join(flags, " ") + "; for " + Join(names, ", ") +
        " to take part again, it joins like a new site, with a fresh store for its shards "
        "(on it: isthmusctl sync join --from " +
        member + " -j " + job + "; docs/SYNC.md, \"Membership\")");
  }
  return out;
}

}  // namespace isthmus::ctl
