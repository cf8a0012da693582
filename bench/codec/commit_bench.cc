// bench_commit: what a round's commit arithmetic costs a shard (and a worker that replays the
// round) on a full-mode state: the merge of every site's encoded delta and the outer step,
// each timed the way it was done before (decode each site's delta into a zeroed buffer and
// add it; copy theta and momentum, step them in place, scan for non-finite values) and the
// way the engine does it now (codec::DecodeAddWeighted straight into the sum;
// codec::ApplyOuterStepTo into new buffers, checking finiteness in the same pass), in the
// same run, with both results checked equal bit for bit. The state digest (SHA-256 over
// theta and momentum) is timed beside them, for the share of the commit it leaves, and the
// whole commit is timed again pipelined as the engine runs it (SyncEngine::CommitStep: each
// tensor merged and stepped while a second thread hashes the tensors before it),
// wall time against the three passes in turn, same bits and digest.
//
// The deltas are real: recorded full-mode training rounds (bench/wan/record.sh), one folder
// per site; a site's round-1 delta is its contribution, round-0 of the first the state.
#include <time.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bench/wan/wan_load.h"
#include "common/pipelined.h"
#include "common/safetensors.h"
#include "common/state_digest.h"
#include "ops/codec.h"
#include "ops/codec_outer.h"

namespace isthmus::codec {
namespace {

using State = std::map<std::string, std::shared_ptr<std::vector<float>>>;

struct Seconds {
  double cpu = 0, wall = 0;
};

double ThreadCpu() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

template <typename F>
Seconds Time(F&& f) {
  const double c0 = ThreadCpu();
  const auto w0 = std::chrono::steady_clock::now();
  f();
  return {ThreadCpu() - c0,
          std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count()};
}

struct Site {
  float weight;
  std::map<std::string, std::string> bytes;  // tensor -> encoded delta
};

// Before: every site's tensor decoded into a zeroed buffer, then added with its weight.
std::map<std::string, std::vector<float>> MergeBefore(const std::vector<Tensor>& shapes,
                                                      const std::vector<Site>& sites) {
  std::map<std::string, std::vector<float>> merged;
  for (const auto& t : shapes) merged[t.name].assign(t.data.size(), 0.0f);
  std::vector<float> decoded;
  for (const auto& s : sites) {
    for (auto& [name, sum] : merged) {
      decoded.assign(sum.size(), 0.0f);
      if (!Decode(s.bytes.at(name), decoded).ok()) std::abort();
      AddWeighted(sum, s.weight, decoded);
    }
  }
  return merged;
}

std::map<std::string, std::vector<float>> MergeNow(const std::vector<Tensor>& shapes,
                                                   const std::vector<Site>& sites) {
  std::map<std::string, std::vector<float>> merged;
  for (const auto& t : shapes) merged[t.name].assign(t.data.size(), 0.0f);
  for (const auto& s : sites) {
    for (auto& [name, sum] : merged) {
      if (!DecodeAddWeighted(s.bytes.at(name), s.weight, sum).ok()) std::abort();
    }
  }
  return merged;
}

// Before: copies of theta and momentum stepped in place, then a scan for non-finite values.
std::pair<State, State> StepBefore(const State& theta, const State& mom,
                                   const std::map<std::string, std::vector<float>>& g, float lr,
                                   float mu) {
  State t_out, m_out;
  for (const auto& [name, gv] : g) {
    auto th = std::make_shared<std::vector<float>>(*theta.at(name));
    auto m = std::make_shared<std::vector<float>>(*mom.at(name));
    ApplyOuterStep(th->data(), m->data(), gv.data(), gv.size(), lr, mu);
    for (float f : *th)
      if (!std::isfinite(f)) std::abort();
    t_out[name] = std::move(th);
    m_out[name] = std::move(m);
  }
  return {std::move(t_out), std::move(m_out)};
}

std::pair<State, State> StepNow(const State& theta, const State& mom,
                                const std::map<std::string, std::vector<float>>& g, float lr,
                                float mu) {
  State t_out, m_out;
  for (const auto& [name, gv] : g) {
    auto th = std::make_shared<std::vector<float>>(gv.size());
    auto m = std::make_shared<std::vector<float>>(gv.size());
    if (!ApplyOuterStepTo(theta.at(name)->data(), mom.at(name)->data(), gv.data(), th->data(),
                          m->data(), gv.size(), lr, mu))
      std::abort();
    t_out[name] = std::move(th);
    m_out[name] = std::move(m);
  }
  return {std::move(t_out), std::move(m_out)};
}

// Now, as the engine commits (SyncEngine::CommitStep): tensor i merged and stepped here
// while a helper thread hashes the tensors before it, in name order.
struct Piped {
  State theta, mom;
  std::string digest;
};
Piped CommitPipelined(const std::vector<Tensor>& shapes, const State& theta, const State& mom,
                      const std::vector<Site>& sites, float lr, float mu) {
  std::vector<const Tensor*> order;
  for (const auto& t : shapes) order.push_back(&t);
  std::sort(order.begin(), order.end(),
            [](const Tensor* a, const Tensor* b) { return a->name < b->name; });
  const size_t n = order.size();
  std::vector<std::shared_ptr<std::vector<float>>> th(n), m(n);
  StateDigester digester(1);
  Status st = Pipelined(
      n,
      [&](size_t i) -> Status {
        const Tensor& t = *order[i];
        std::vector<float> g(t.data.size(), 0.0f);
        for (const auto& s : sites) {
          ISTHMUS_RETURN_IF_ERROR(DecodeAddWeighted(s.bytes.at(t.name), s.weight, g));
        }
        th[i] = std::make_shared<std::vector<float>>(g.size());
        m[i] = std::make_shared<std::vector<float>>(g.size());
        if (!ApplyOuterStepTo(theta.at(t.name)->data(), mom.at(t.name)->data(), g.data(),
                              th[i]->data(), m[i]->data(), g.size(), lr, mu)) {
          return Status::FailedPrecondition("non-finite");
        }
        return Status::Ok();
      },
      [&](size_t i) {
        digester.Add({order[i]->name, order[i]->shape, *th[i], *m[i]});
      });
  if (!st.ok()) std::abort();
  Piped out;
  for (size_t i = 0; i < n; ++i) {
    out.theta[order[i]->name] = std::move(th[i]);
    out.mom[order[i]->name] = std::move(m[i]);
  }
  out.digest = digester.Finish(0, 0, {"A", "B"});
  return out;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

int Run(int argc, char** argv) {
  CLI::App app{
      "bench_commit: a commit's merge and outer step on recorded full-mode deltas, the way "
      "before and the way now, CPU seconds and their ratio, results checked bit for bit"};
  std::vector<std::string> dirs;
  std::string pipeline_text = "topk:0.01+int4+zstd";
  int reps = 3;
  app.add_option("dirs", dirs,
                 "each site's recorded rounds (bench/wan/record.sh), e.g. "
                 "demo-out/wan-deltas/full/A demo-out/wan-deltas/full/B")
      ->required();
  app.add_option("--pipeline", pipeline_text,
                 "the sites' WAN codec (one of the top-k rungs adaptive sizing takes for GPT-2 "
                 "small at 20 Mbit/s)")
      ->capture_default_str();
  app.add_option("--reps", reps,
                 "repetitions, each timing both ways, after one warm-up repetition (printed as "
                 "rep 0, not counted)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  auto fail = [](const std::string& what) {
    std::fprintf(stderr, "bench_commit: %s\n", what.c_str());
    return 2;
  };
  auto pipeline = ParsePipeline(pipeline_text);
  if (!pipeline.ok()) return fail(pipeline.status().ToString());
  auto start = ReadSafetensorsTensors(dirs[0] + "/round-0.safetensors");
  if (!start.ok()) return fail(start.status().ToString());
  // The state: theta from the first site's start, momentum from its second round's delta
  // (real values of the right scale), lr and mu the server's defaults.
  auto first = wanload::LoadRecordedDeltas(dirs[0], 2);
  if (!first.ok()) return fail(first.status().ToString());
  State theta, mom;
  uint64_t numel = 0;
  for (size_t i = 0; i < start->size(); ++i) {
    const Tensor& t = (*start)[i];
    theta[t.name] = std::make_shared<std::vector<float>>(t.data);
    const auto& rounds = first->rounds;
    mom[t.name] = std::make_shared<std::vector<float>>(rounds[rounds.size() - 1][i].data);
    numel += t.data.size();
  }
  std::vector<Site> sites;
  for (const auto& dir : dirs) {
    auto d = wanload::LoadRecordedDeltas(dir, 1);
    if (!d.ok()) return fail(d.status().ToString());
    Site s{1.0f / static_cast<float>(dirs.size()), {}};
    uint64_t bytes = 0;
    for (const auto& t : d->rounds[0]) {
      if (!theta.count(t.name) || theta[t.name]->size() != t.data.size())
        return fail(dir + ": tensor '" + t.name + "' is not in " + dirs[0] + "'s start");
      s.bytes[t.name] = Encode(*pipeline, t.data, t.shape);
      bytes += s.bytes[t.name].size();
    }
    if (s.bytes.size() != theta.size()) return fail(dir + " holds other tensors than " + dirs[0]);
    std::printf("# site %s: %zu tensors, %.2f MB encoded with %s\n", dir.c_str(), s.bytes.size(),
                bytes / 1e6, ToString(*pipeline).c_str());
    sites.push_back(std::move(s));
  }
  std::printf("# state: %zu tensors, %.2f M values (theta and momentum %.0f MB), %zu sites\n",
              theta.size(), numel / 1e6, 8.0 * numel / 1e6, sites.size());
  const float lr = 1.25f, mu = 0.6f;

  std::printf("%-4s %-12s %12s %12s %12s %12s %10s\n", "rep", "part", "before cpu s", "now cpu s",
              "before wall", "now wall", "before/now");
  std::vector<double> merge_ratio, step_ratio, commit_ratio, pipe_ratio;
  bool equal = true;
  // Rep 0 warms the allocator and the page tables (the first touch of ~2 GB of fresh memory
  // costs more than either way's arithmetic; a shard that has committed before has its
  // memory mapped): printed, not counted.
  for (int r = 0; r <= reps; ++r) {
    std::map<std::string, std::vector<float>> mb, mn;
    // Alternate which way goes first, so neither always meets a warm allocator.
    Seconds merge_before, merge_now;
    if (r % 2) {
      merge_before = Time([&] { mb = MergeBefore(*start, sites); });
      merge_now = Time([&] { mn = MergeNow(*start, sites); });
    } else {
      merge_now = Time([&] { mn = MergeNow(*start, sites); });
      merge_before = Time([&] { mb = MergeBefore(*start, sites); });
    }
    for (const auto& [name, v] : mb) equal &= SameBits(v, mn.at(name));
    std::pair<State, State> sb, sn;
    Seconds step_before, step_now;
    if (r % 2) {
      step_before = Time([&] { sb = StepBefore(theta, mom, mb, lr, mu); });
      step_now = Time([&] { sn = StepNow(theta, mom, mn, lr, mu); });
    } else {
      step_now = Time([&] { sn = StepNow(theta, mom, mn, lr, mu); });
      step_before = Time([&] { sb = StepBefore(theta, mom, mb, lr, mu); });
    }
    for (const auto& [name, v] : sb.first) equal &= SameBits(*v, *sn.first.at(name));
    for (const auto& [name, v] : sb.second) equal &= SameBits(*v, *sn.second.at(name));
    std::vector<DigestTensor> dt;
    for (const auto& t : *start)
      dt.push_back({t.name, t.shape, *sn.first.at(t.name), *sn.second.at(t.name)});
    std::sort(dt.begin(), dt.end(),
              [](const DigestTensor& a, const DigestTensor& b) { return a.name < b.name; });
    std::string digest;
    const Seconds dig = Time([&] { digest = StateDigestOf(1, dt, 0, 0, {"A", "B"}); });
    // The whole commit pipelined (a second thread), against the three passes in turn.
    sb = {};
    Piped piped;
    const Seconds pipe = Time([&] { piped = CommitPipelined(*start, theta, mom, sites, lr, mu); });
    equal &= piped.digest == digest;
    for (const auto& [name, v] : sn.first) equal &= SameBits(*v, *piped.theta.at(name));
    for (const auto& [name, v] : sn.second) equal &= SameBits(*v, *piped.mom.at(name));
    auto row = [&](const char* part, Seconds b, Seconds n) {
      std::printf("%-4d %-12s %12.3f %12.3f %12.3f %12.3f %9.2fx\n", r, part, b.cpu, n.cpu, b.wall,
                  n.wall, b.cpu / n.cpu);
    };
    row("merge", merge_before, merge_now);
    row("outer step", step_before, step_now);
    std::printf("%-4d %-12s %12.3f %12s %12.3f\n", r, "digest", dig.cpu, "", dig.wall);
    const double before = merge_before.cpu + step_before.cpu + dig.cpu;
    const double now = merge_now.cpu + step_now.cpu + dig.cpu;
    std::printf("%-4d %-12s %12.3f %12.3f %12s %12s %9.2fx\n", r, "commit", before, now, "", "",
                before / now);
    const double serial_wall = merge_now.wall + step_now.wall + dig.wall;
    std::printf("%-4d %-12s %12s %12s %12.3f %12.3f %9.2fx  (wall: in turn / pipelined)\n", r,
                "pipelined", "", "", serial_wall, pipe.wall, serial_wall / pipe.wall);
    if (r == 0) continue;
    merge_ratio.push_back(merge_before.cpu / merge_now.cpu);
    step_ratio.push_back(step_before.cpu / step_now.cpu);
    commit_ratio.push_back(before / now);
    pipe_ratio.push_back(serial_wall / pipe.wall);
  }
  auto range = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.2f-%.2fx", v.front(), v.back());
    return std::string(buf);
  };
  std::printf(
      "# CPU time before / now over %d reps: merge %s, outer step %s, commit with digest %s\n",
      reps, range(merge_ratio).c_str(), range(step_ratio).c_str(), range(commit_ratio).c_str());
  std::printf(
      "# wall time of the commit (merge, outer step, digest), in turn / pipelined on a second "
      "thread: %s\n",
      range(pipe_ratio).c_str());
  std::printf("# results bit for bit equal (and the pipelined digest the same): %s\n",
              equal ? "yes" : "NO");
  return equal ? 0 : 1;
}

}  // namespace
}  // namespace isthmus::codec

int main(int argc, char** argv) { return isthmus::codec::Run(argc, argv); }
