// isthmusctl top: samples every shard of a site (Stats + SyncStatus) once per interval and
// shows rounds, links and rates: redrawn in place on a terminal, as plain snapshots under a
// timestamp line otherwise, or as JSON Lines. Stopping with SIGINT/SIGTERM is the normal
// end of the view: the handler only sets a flag, which the loop reads between requests.
#include "server/ctl/top.h"

#include <signal.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <thread>

#include "common/exit_codes.h"

namespace isthmus::ctl {
namespace {

using json = nlohmann::json;

constexpr size_t kColumns = 120;

volatile sig_atomic_t g_stop = 0;
void OnStopSignal(int) { g_stop = 1; }

double SteadySeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double UnixSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::optional<double> PerSecond(uint64_t now, uint64_t before, double dt) {
  if (now < before || dt <= 0) return std::nullopt;
  return static_cast<double>(now - before) / dt;
}

json OrNull(const std::optional<double>& v) { return v ? json(*v) : json(nullptr); }

const ShardSample* PreviousOf(const TopSample* prev, size_t i) {
  return prev != nullptr && i < prev->shards.size() ? &prev->shards[i] : nullptr;
}

// `text` cut to `width` columns, "..." marking the cut.
std::string Clip(const std::string& text, size_t width) {
  if (text.size() <= width) return text;
  if (width <= 3) return text.substr(0, width);
  return text.substr(0, width - 3) + "...";
}

std::string Printf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string Printf(const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return buf;
}

std::string Duration(uint64_t s) {
  if (s < 60) return std::to_string(s) + "s";
  if (s < 3600)
    return Printf("%llum%02llus", (unsigned long long)(s / 60), (unsigned long long)(s % 60));
  if (s < 86400) {
    return Printf("%lluh%02llum", (unsigned long long)(s / 3600),
                  (unsigned long long)(s % 3600 / 60));
  }
  return Printf("%llud%02lluh", (unsigned long long)(s / 86400),
                (unsigned long long)(s % 86400 / 3600));
}

std::string RateText(const std::optional<double>& bytes_per_s) {
  if (!bytes_per_s) return "-";
  return HumanBytes(static_cast<uint64_t>(*bytes_per_s)) + "/s";
}

std::string PushesText(const std::optional<double>& v) {
  return v ? Printf("%.2f", *v) : std::string("-");
}

std::string TimestampText(double unix_time) {
  const auto whole = static_cast<uint64_t>(unix_time);
  const auto ms = static_cast<int>((unix_time - static_cast<double>(whole)) * 1000);
  return TimeText(whole) + Printf(".%03d", std::clamp(ms, 0, 999)) + " UTC";
}

// `text` as lines of at most kColumns, broken at spaces; lines after the first start with
// `indent`.
void AppendWrapped(std::vector<std::string>& lines, const std::string& text,
                   const std::string& indent) {
  const size_t lead = std::min(text.find_first_not_of(' '), text.size());
  std::string line = text.substr(0, lead);  // the text's own indentation stays
  bool fresh = true;                        // nothing but indentation on `line` yet
  size_t start = lead;
  while (start < text.size()) {
    size_t end = text.find(' ', start);
    if (end == std::string::npos) end = text.size();
    const std::string word = text.substr(start, end - start);
    if (!fresh && line.size() + 1 + word.size() > kColumns) {
      lines.push_back(line);
      line = indent;
      fresh = true;
    }
    line += (fresh ? "" : " ") + word;
    fresh = false;
    start = end + 1;
  }
  if (!fresh) lines.push_back(line);
}

// "2/2", rounds ahead of the last commit and the limit, with " WAIT" once workers wait.
std::string AheadText(const SyncJobReport& r) {
  const uint64_t ahead = r.local_round > r.committed_round ? r.local_round - r.committed_round : 0;
  return std::to_string(ahead) + "/" + std::to_string(r.max_rounds_ahead) +
         (WaitingForWan(r) ? " WAIT" : "");
}

std::string PipelinesText(const std::map<std::string, uint64_t>& pipelines) {
  std::string out;
  for (const auto& [pipe, tensors] : pipelines) {
    out += (out.empty() ? "" : ", ") + pipe + " " + std::to_string(tensors);
  }
  return out.empty() ? "-" : out;
}

void AppendShard(std::vector<std::string>& lines, size_t index, const ShardSample& s,
                 const ShardRates& rates) {
  if (!s.status.ok()) {
    AppendWrapped(
        lines,
        "shard " + std::to_string(index) + "  DOWN  " + s.endpoint + "  " + s.status.ToString(),
        "    ");
    return;
  }
  const ShardStats& st = *s.stats;
  const SyncStatusInfo& sync = *s.sync;
  lines.push_back(
      Printf("shard %zu  %s  up  %s  site %s  uptime %s  requests %llu  errors %llu  "
             "db %s",
             index, st.shard_id.c_str(), s.endpoint.c_str(),
             sync.site.empty() ? "- (sync off)" : sync.site.c_str(), Duration(st.uptime_s).c_str(),
             (unsigned long long)st.requests, (unsigned long long)st.errors,
             HumanBytes(st.db_bytes).c_str()));
  if (!st.last_error.empty()) {
    AppendWrapped(
        lines,
        "  last refused request (" + Duration(st.last_error_age_s) + " ago): " + st.last_error,
        "    ");
  }
  if (!st.jobs.empty()) {
    lines.push_back(Printf("  %-16s %6s %9s %-8s %9s %5s %-20s %s", "JOB", "ROUND", "COMMITTED",
                           "AHEAD/K", "PUSHES/S", "EPOCH", "MEMBERS",
                           "CODEC (TENSORS, LAST ROUND)"));
    for (const auto& j : st.jobs) {
      auto it = std::find_if(sync.jobs.begin(), sync.jobs.end(),
                             [&](const SyncJobReport& r) { return r.job == j.job; });
      const SyncJobReport* r = it == sync.jobs.end() ? nullptr : &*it;
      std::string members = "-";
      if (r != nullptr) {
        members.clear();
        for (const auto& m : r->members) members += (members.empty() ? "" : ",") + m;
      }
      auto pushes = rates.job_pushes.find(j.job);
      std::string line = Printf(
          "  %-16s %6s %9s %-8s %9s %5s %-20s ", Clip(j.job, 16).c_str(),
          r ? std::to_string(r->local_round).c_str() : "-",
          r ? std::to_string(r->committed_round).c_str() : "-", r ? AheadText(*r).c_str() : "-",
          PushesText(pushes == rates.job_pushes.end() ? std::nullopt : pushes->second).c_str(),
          r ? std::to_string(r->epoch).c_str() : "-", Clip(members, 20).c_str());
      line += r ? PipelinesText(r->pipelines) : "-";
      lines.push_back(line);
      if (r != nullptr && !r->round_work_error.empty()) {
        AppendWrapped(lines,
                      "  " + j.job + ": round work after a push failed " +
                          std::to_string(r->round_work_failures) +
                          " times, retrying: " + r->round_work_error,
                      "    ");
      }
    }
  }
  if (sync.links.empty()) return;
  lines.push_back(Printf("  %-12s %-9s %6s %-10s %4s %6s %11s %10s %11s %10s %11s %7s", "PEER",
                         "STATE", "SILENT", "JOB", "LAG", "ACKED", "BANDWIDTH", "WIRE SENT",
                         "SENT/S", "WIRE RECV", "RECV/S", "RESENDS"));
  for (const auto& l : sync.links) {
    const std::string silent = Duration(static_cast<uint64_t>(std::max(0.0, l.silent_seconds)));
    if (const auto removed = PeerRemovedFrom(sync, l.site)) {
      // Still in sync.peers, but a member of no job here: its link carries nothing.
      lines.push_back(Printf("  %-12s removed (round %llu), silent %s: a member of no job here",
                             Clip(l.site, 12).c_str(), (unsigned long long)*removed,
                             silent.c_str()));
      continue;
    }
    const char* state = l.paused ? "paused" : l.connected ? "connected" : "down";
    const auto lr = rates.links.find(l.site);
    const ShardRates::Link link_rates = lr == rates.links.end() ? ShardRates::Link{} : lr->second;
    std::vector<PeerLinkReport::Job> jobs = l.jobs;
    if (jobs.empty()) jobs.push_back({"-", 0, 0, 0});
    for (size_t k = 0; k < jobs.size(); ++k) {
      const auto& j = jobs[k];
      const bool has_job = !l.jobs.empty();
      std::string head =
          Printf("  %-12s %-9s %6s %-10s %4s %6s", Clip(l.site, 12).c_str(), k == 0 ? state : "",
                 k == 0 ? silent.c_str() : "", Clip(j.job, 10).c_str(),
                 has_job ? std::to_string(j.lag_rounds).c_str() : "-",
                 has_job ? std::to_string(j.acked_round).c_str() : "-");
      if (k == 0) {
        head +=
            Printf(" %11s %10s %11s %10s %11s %7llu", Rate(l.bandwidth_bps).c_str(),
                   HumanBytes(l.wire_bytes_sent).c_str(), RateText(link_rates.sent_per_s).c_str(),
                   HumanBytes(l.wire_bytes_received).c_str(),
                   RateText(link_rates.received_per_s).c_str(), (unsigned long long)l.resends);
      }
      lines.push_back(head);
    }
    if (!l.last_error.empty()) {
      AppendWrapped(lines, "  " + l.site + " last error: " + l.last_error, "    ");
    }
  }
}

}  // namespace

ShardRates RatesOf(const ShardSample& now, const ShardSample* prev) {
  ShardRates r;
  if (now.stats) {
    for (const auto& j : now.stats->jobs) r.job_pushes[j.job] = std::nullopt;
  }
  if (now.sync) {
    for (const auto& l : now.sync->links) r.links[l.site] = {};
  }
  if (prev == nullptr || !now.stats || !prev->stats ||
      prev->stats->shard_id != now.stats->shard_id) {
    return r;
  }
  const double dt = now.at_s - prev->at_s;
  if (dt <= 0) return r;
  double total = 0;
  bool total_known = true;
  for (const auto& j : now.stats->jobs) {
    auto it = std::find_if(prev->stats->jobs.begin(), prev->stats->jobs.end(),
                           [&](const JobInfo& p) { return p.job == j.job; });
    // A job created since the previous sample had no pushes then.
    auto v = PerSecond(j.pushes, it == prev->stats->jobs.end() ? 0 : it->pushes, dt);
    r.job_pushes[j.job] = v;
    if (v) {
      total += *v;
    } else {
      total_known = false;
    }
  }
  if (total_known) r.pushes_per_s = total;
  // Link counters live in the process: after a restart they start again from zero.
  const bool restarted = now.stats->uptime_s < prev->stats->uptime_s;
  if (restarted || !now.sync || !prev->sync) return r;
  for (const auto& l : now.sync->links) {
    auto it = std::find_if(prev->sync->links.begin(), prev->sync->links.end(),
                           [&](const PeerLinkReport& p) { return p.site == l.site; });
    if (it == prev->sync->links.end()) continue;
    r.links[l.site] = {PerSecond(l.wire_bytes_sent, it->wire_bytes_sent, dt),
                       PerSecond(l.wire_bytes_received, it->wire_bytes_received, dt)};
  }
  return r;
}

json TopJson(const TopSample& now, const TopSample* prev, double interval_s) {
  json shards = json::array();
  for (size_t i = 0; i < now.shards.size(); ++i) {
    const ShardSample& s = now.shards[i];
    json row{{"shard", i}, {"endpoint", s.endpoint}, {"reachable", s.status.ok()}};
    if (!s.status.ok()) row["error"] = s.status.ToString();
    row["stats"] = s.stats ? StatsJson(*s.stats) : json(nullptr);
    row["sync"] = s.sync ? SyncStatusJson(*s.sync) : json(nullptr);
    const ShardRates r = RatesOf(s, PreviousOf(prev, i));
    json links = json::object(), jobs = json::object();
    for (const auto& [site, l] : r.links) {
      links[site] = {{"wire_sent_bytes_per_s", OrNull(l.sent_per_s)},
                     {"wire_received_bytes_per_s", OrNull(l.received_per_s)}};
    }
    for (const auto& [job, v] : r.job_pushes) jobs[job] = {{"pushes_per_s", OrNull(v)}};
    row["rates"] = {{"pushes_per_s", OrNull(r.pushes_per_s)}, {"links", links}, {"jobs", jobs}};
    shards.push_back(std::move(row));
  }
  return {{"time", now.unix_time},
          {"interval_s", interval_s},
          {"elapsed_s", prev != nullptr ? json(now.unix_time - prev->unix_time) : json(nullptr)},
          {"shards", shards}};
}

std::vector<std::string> TopText(const TopSample& now, const TopSample* prev, double interval_s) {
  std::string site;
  size_t up = 0;
  for (const auto& s : now.shards) {
    if (!s.status.ok()) continue;
    ++up;
    if (site.empty() && s.sync) site = s.sync->site;
  }
  std::vector<std::string> lines;
  lines.push_back(Printf(
      "=== %s  site %s  %zu of %zu shards up  every %g s ===", TimestampText(now.unix_time).c_str(),
      site.empty() ? "-" : site.c_str(), up, now.shards.size(), interval_s));
  for (size_t i = 0; i < now.shards.size(); ++i) {
    AppendShard(lines, i, now.shards[i], RatesOf(now.shards[i], PreviousOf(prev, i)));
  }
  for (auto& l : lines) l = Clip(l, kColumns);
  return lines;
}

void AddTopFlags(CLI::App* cmd, TopOptions& o) {
  cmd->add_option("--interval", o.interval_s, "seconds between refreshes")
      ->check(CLI::Range(0.1, 86400.0))
      ->capture_default_str();
  cmd->add_option("--count", o.count, "refreshes before exiting (0: until Ctrl-C or SIGTERM)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_flag("--json", o.json,
                "one JSON object per refresh, one per line (JSON Lines), flushed each time");
  if (CLI::Option* t = cmd->get_option_no_throw("--timeout-ms")) {
    t->description(
         "per-request timeout, one attempt (default: the longer of 2000 and the interval, at most "
         "30000)")
        ->default_str("");
  }
  cmd->footer(
      "Ends with exit 0 on Ctrl-C or SIGTERM; after --count refreshes, with the code of the last "
      "one (0, or 5 when a shard did not answer). Fields: docs/CLI.md, \"top\".\n" +
      ExitCodesFooter());
}

namespace {

TopSample Sample(std::vector<std::unique_ptr<ShardClient>>& clients,
                 const std::vector<std::string>& servers) {
  TopSample out;
  out.unix_time = UnixSeconds();
  for (size_t i = 0; i < clients.size(); ++i) {
    ShardSample s;
    s.endpoint = servers[i];
    auto st = clients[i]->Stats();
    if (st.ok()) {
      s.stats = std::move(*st);
      auto sync = clients[i]->SyncStatus();
      if (sync.ok()) {
        s.sync = std::move(*sync);
      } else {
        s.status = sync.status();
      }
    } else {
      s.status = st.status();
    }
    s.at_s = SteadySeconds();
    out.shards.push_back(std::move(s));
  }
  return out;
}

// Draws `lines` from the top left of the terminal, each cut to its width, clearing what the
// previous frame left beyond them.
void DrawFrame(const std::vector<std::string>& lines, bool first) {
  winsize ws{};
  size_t cols = kColumns, rows = 0;
  if (::ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) {
    cols = ws.ws_col;
    rows = ws.ws_row;
  }
  std::string frame = first ? "\x1b[H\x1b[2J" : "\x1b[H";
  const size_t shown = rows > 1 ? std::min(lines.size(), rows - 1) : lines.size();
  for (size_t i = 0; i < shown; ++i) {
    frame += (i == 0 ? lines[i] + "  (Ctrl-C quits)" : lines[i]).substr(0, cols);
    frame += "\x1b[K\n";
  }
  frame += "\x1b[J";
  std::fwrite(frame.data(), 1, frame.size(), stdout);
  std::fflush(stdout);
}

}  // namespace

int CmdTop(Connection c, const TopOptions& o, bool timeout_given) {
  if (!timeout_given) {
    c.timeout_ms = static_cast<int>(std::clamp(o.interval_s * 1000, 2000.0, 30000.0));
  }
  c.retries = 0;  // the next refresh asks again
  auto clients = ConnectAll(c);
  if (!clients.ok()) return Fail(clients.status());

  struct sigaction sa {};
  sa.sa_handler = OnStopSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;  // no SA_RESTART: a sleep ends at once
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);

  const bool terminal = !o.json && ::isatty(STDOUT_FILENO) == 1;
  if (terminal) std::fputs("\x1b[?25l", stdout);  // hide the cursor while redrawing
  std::optional<TopSample> prev;
  int code = kExitOk;
  for (int n = 0; !g_stop; ++n) {
    const double started = SteadySeconds();
    TopSample now = Sample(*clients, c.servers);
    if (g_stop) break;
    code = kExitOk;
    for (const auto& s : now.shards) {
      if (!s.status.ok()) {
        code = ExitCodeForStatus(s.status);
        break;
      }
    }
    const TopSample* before = prev ? &*prev : nullptr;
    if (o.json) {
      std::printf("%s\n", TopJson(now, before, o.interval_s).dump().c_str());
      std::fflush(stdout);
    } else if (terminal) {
      DrawFrame(TopText(now, before, o.interval_s), n == 0);
    } else {
      for (const auto& line : TopText(now, before, o.interval_s)) std::printf("%s\n", line.c_str());
      std::fflush(stdout);
    }
    prev = std::move(now);
    if (o.count > 0 && n + 1 >= o.count) break;
    const double next = started + o.interval_s;
    for (double left = next - SteadySeconds(); left > 0 && !g_stop; left = next - SteadySeconds()) {
      std::this_thread::sleep_for(std::chrono::duration<double>(std::min(left, 0.05)));
    }
  }
  if (terminal) {
    std::fputs("\x1b[?25h", stdout);  // the cursor again
    std::fflush(stdout);
  }
  return g_stop ? kExitOk : code;
}

}  // namespace isthmus::ctl
