// Tests of the Gloo communicator: every collective for world sizes 1-4 and payloads from one
// float to 1M floats, ranks as threads over loopback TCP; then the failure contract (a rank
// that never joins, a peer that stops answering), the TCP rendezvous and a multi-process
// group made with fork().
#include "worker/comm/gloo_communicator.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <fstream>
#include <mutex>
#include <random>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include <thread>

#include "tests/comm/comm_test_util.h"
#include "tests/loopback.h"
#include "worker/comm/rendezvous.h"

namespace isthmus::comm {
namespace {

using std::chrono::milliseconds;
using testing::FirstBitMismatch;
using testing::RunRanks;
using testing::TempDir;

// The default timeout bounds every collective of a test: longer under sanitizers (a TSan
// run of 3 ranks gathering 1 Mi floats each took longer than 10 s at -j2).
GlooOptions Options(int rank, int world_size, const std::string& dir,
                    milliseconds timeout = milliseconds(10'000) * ::isthmus::testing::TimeScale()) {
  GlooOptions o;
  o.rank = rank;
  o.world_size = world_size;
  o.rendezvous = "file:" + dir;
  o.timeout = timeout;
  o.prefix = "test";
  return o;
}

uint16_t FreePort() { return static_cast<uint16_t>(::isthmus::testing::FreePort()); }

// Small integers: every partial sum is exact in float, so results can be checked exactly.
float IntValue(int rank, size_t i) { return static_cast<float>((rank + 1) * (i % 7 + 1)); }

class GlooCollectiveTest : public ::testing::TestWithParam<std::tuple<int, size_t>> {
 protected:
  int world_size() const { return std::get<0>(GetParam()); }
  size_t count() const { return std::get<1>(GetParam()); }

  // Creates rank's communicator and runs fn with it; fails the test on creation failure.
  void Run(const std::function<void(Communicator&)>& fn, size_t fusion_bytes = 0) {
    TempDir dir;
    RunRanks(world_size(), [&](int rank) {
      GlooOptions o = Options(rank, world_size(), dir.path());
      if (fusion_bytes > 0) o.fusion_bytes = fusion_bytes;
      auto comm = CreateGlooCommunicator(o);
      ASSERT_TRUE(comm.ok()) << "rank " << rank << ": " << comm.status().ToString();
      EXPECT_EQ((*comm)->rank(), rank);
      EXPECT_EQ((*comm)->world_size(), world_size());
      fn(**comm);
    });
  }
};

TEST_P(GlooCollectiveTest, AllReduceSumIsExact) {
  const int n = world_size();
  Run([&](Communicator& comm) {
    std::vector<float> data(count());
    for (size_t i = 0; i < data.size(); ++i) data[i] = IntValue(comm.rank(), i);
    ASSERT_TRUE(comm.AllReduceSum(data.data(), data.size()).ok());
    std::vector<float> expected(count());
    for (size_t i = 0; i < expected.size(); ++i) {
      expected[i] = static_cast<float>((i % 7 + 1) * n * (n + 1) / 2);
    }
    EXPECT_EQ(FirstBitMismatch(data.data(), expected.data(), count()), -1)
        << "rank " << comm.rank();
  });
}

TEST_P(GlooCollectiveTest, AllReduceAverageIsExact) {
  const int n = world_size();
  Run([&](Communicator& comm) {
    std::vector<float> data(count());
    for (size_t i = 0; i < data.size(); ++i) data[i] = IntValue(comm.rank(), i);
    ASSERT_TRUE(comm.AllReduceAverage(data.data(), data.size()).ok());
    std::vector<float> expected(count());
    for (size_t i = 0; i < expected.size(); ++i) {
      expected[i] = static_cast<float>((i % 7 + 1) * n * (n + 1) / 2) / static_cast<float>(n);
    }
    EXPECT_EQ(FirstBitMismatch(data.data(), expected.data(), count()), -1)
        << "rank " << comm.rank();
  });
}

TEST_P(GlooCollectiveTest, BroadcastCopiesRootToAll) {
  const int root = world_size() - 1;
  Run([&](Communicator& comm) {
    std::vector<float> expected(count());
    for (size_t i = 0; i < expected.size(); ++i) expected[i] = 0.25f * i + root;
    std::vector<float> data(count(), -1.0f);
    if (comm.rank() == root) data = expected;
    ASSERT_TRUE(comm.Broadcast(data.data(), data.size(), root).ok());
    EXPECT_EQ(FirstBitMismatch(data.data(), expected.data(), count()), -1)
        << "rank " << comm.rank();
  });
}

TEST_P(GlooCollectiveTest, BarrierWaitsForEveryRank) {
  std::atomic<int> arrived{0};
  Run([&](Communicator& comm) {
    // Later ranks arrive later; nobody may leave before the last one arrived.
    std::this_thread::sleep_for(milliseconds(20 * comm.rank()));
    arrived++;
    ASSERT_TRUE(comm.Barrier().ok());
    EXPECT_EQ(arrived.load(), world_size()) << "rank " << comm.rank();
  });
}

TEST_P(GlooCollectiveTest, MultiBufferAverageFusesAndMatches) {
  const int n = world_size();
  // A mix of sizes around the (small) fusion threshold: the big one goes alone, small ones
  // are packed, the empty one must be harmless.
  const std::vector<size_t> sizes = {count(), 3, 1, 0, count() / 2 + 1, 17, 5000};
  Run(
      [&](Communicator& comm) {
        std::vector<std::vector<float>> bufs;
        std::vector<std::pair<float*, size_t>> list;
        for (size_t b = 0; b < sizes.size(); ++b) {
          bufs.emplace_back(sizes[b]);
          for (size_t i = 0; i < sizes[b]; ++i) {
            bufs[b][i] = static_cast<float>((comm.rank() + 1) * (b + 1) + i % 5);
          }
        }
        for (auto& b : bufs) list.emplace_back(b.data(), b.size());
        ASSERT_TRUE(comm.AllReduceAverage(list).ok());
        for (size_t b = 0; b < sizes.size(); ++b) {
          std::vector<float> expected(sizes[b]);
          for (size_t i = 0; i < sizes[b]; ++i) {
            const size_t sum = (b + 1) * n * (n + 1) / 2 + n * (i % 5);
            expected[i] = static_cast<float>(sum) / static_cast<float>(n);
          }
          EXPECT_EQ(FirstBitMismatch(bufs[b].data(), expected.data(), sizes[b]), -1)
              << "rank " << comm.rank() << " buffer " << b;
        }
      },
      /*fusion_bytes=*/16 * 1024);
}

TEST_P(GlooCollectiveTest, AverageIsBitwiseIdenticalOnAllRanks) {
  // Values of mixed sign and magnitude, so the sum order matters for rounding; the
  // all-reduce must still leave every rank with the same bits.
  std::vector<std::vector<float>> results(world_size());
  Run([&](Communicator& comm) {
    std::mt19937 gen(1234 + comm.rank());
    std::normal_distribution<float> dist(0.0f, 1.0f);
    std::vector<float> data(count());
    for (auto& x : data) x = dist(gen) * std::exp2(static_cast<float>(gen() % 20) - 10.0f);
    std::vector<float> copy = data;
    ASSERT_TRUE(comm.AllReduceAverage(data.data(), data.size()).ok());
    std::vector<std::pair<float*, size_t>> list = {{copy.data(), copy.size()}};
    ASSERT_TRUE(comm.AllReduceAverage(list).ok());
    results[comm.rank()] = std::move(data);
  });
  ASSERT_EQ(results[0].size(), count());
  for (int r = 1; r < world_size(); ++r) {
    ASSERT_EQ(results[r].size(), count());
    EXPECT_EQ(FirstBitMismatch(results[0].data(), results[r].data(), count()), -1)
        << "rank " << r << " differs from rank 0";
  }
}

// The average in bf16: identical bits on every rank; small integers (exact in bf16, and
// every partial sum too) come back exact; random values within bf16 rounding of the fp32
// average: each rank's value rounded once (2^-9 relative), each partial sum once more.
TEST_P(GlooCollectiveTest, Bf16AverageIsIdenticalOnAllRanksAndWithinBf16Rounding) {
  const int n = world_size();
  std::vector<std::vector<float>> results(n), inputs(n);
  Run([&](Communicator& comm) {
    std::vector<float> ints(count());
    for (size_t i = 0; i < ints.size(); ++i) ints[i] = IntValue(comm.rank(), i);
    ASSERT_TRUE(comm.AllReduceAverageBf16(ints.data(), ints.size()).ok());
    for (size_t i = 0; i < ints.size(); ++i) {
      const float want = static_cast<float>((i % 7 + 1) * n * (n + 1) / 2) / static_cast<float>(n);
      ASSERT_EQ(ints[i], n == 1 ? IntValue(0, i) : want) << "element " << i;
    }
    std::mt19937 gen(99 + comm.rank());
    std::normal_distribution<float> dist(0.0f, 1.0f);
    std::vector<float> data(count());
    for (auto& x : data) x = dist(gen);
    inputs[comm.rank()] = data;
    ASSERT_TRUE(comm.AllReduceAverageBf16(data.data(), data.size()).ok());
    results[comm.rank()] = std::move(data);
  });
  for (int r = 0; r < n; ++r) ASSERT_EQ(results[r].size(), count()) << "rank " << r;
  for (int r = 1; r < n; ++r) {
    EXPECT_EQ(FirstBitMismatch(results[0].data(), results[r].data(), count()), -1)
        << "rank " << r << " differs from rank 0";
  }
  double worst = 0;
  for (size_t i = 0; i < count(); ++i) {
    double exact = 0, magnitude = 0;
    for (int r = 0; r < n; ++r) {
      exact += inputs[r][i];
      magnitude += std::abs(inputs[r][i]);
    }
    // n roundings of the inputs and n - 1 of partial sums, each at most 2^-9 relative.
    const double bound = (2.0 * n) * std::ldexp(1.0, -9) * magnitude / n + 1e-30;
    worst = std::max(worst, std::abs(results[0][i] - exact / n) / bound);
  }
  EXPECT_LE(worst, 1.0);
  if (n > 1 && count() >= 1000) {
    EXPECT_GT(worst, 0.0) << "bf16 rounded nothing";
  }
}

// The all-gather of unequal parts (one empty, as the last ZeRO-1 shard may be): every rank
// ends with every owner's bits, NaN payloads and negative zeros included (copied, not summed).
TEST_P(GlooCollectiveTest, AllGatherOfUnequalPartsCopiesEveryOwnersBits) {
  const int n = world_size();
  std::vector<size_t> counts(n);
  for (int r = 0; r < n; ++r) counts[r] = r == 1 ? 0 : count() + r;
  size_t total = 0;
  for (size_t c : counts) total += c;
  auto value = [](int owner, size_t i) {
    if (i == 0) return -0.0f;
    if (i == 1) return std::bit_cast<float>(0x7fc00000u + static_cast<uint32_t>(owner) + 1);
    return static_cast<float>(owner * 100000 + static_cast<int>(i % 99991)) + 0.25f;
  };
  std::vector<float> want;
  for (int r = 0; r < n; ++r) {
    for (size_t i = 0; i < counts[r]; ++i) want.push_back(value(r, i));
  }
  std::vector<std::vector<float>> results(n);
  Run([&](Communicator& comm) {
    std::vector<float> data(total, 7.0f);  // garbage outside this rank's part
    size_t offset = 0;
    for (int r = 0; r < comm.rank(); ++r) offset += counts[r];
    for (size_t i = 0; i < counts[comm.rank()]; ++i) data[offset + i] = value(comm.rank(), i);
    Status gathered = comm.AllGather(data.data(), counts);
    ASSERT_TRUE(gathered.ok()) << "rank " << comm.rank() << ": " << gathered.ToString();
    results[comm.rank()] = std::move(data);
    std::vector<size_t> wrong(n + 1, 1);
    EXPECT_EQ(comm.AllGather(data.data(), wrong).code(), Code::kInvalidArgument);
  });
  for (int r = 0; r < n; ++r) {
    ASSERT_EQ(results[r].size(), total) << "rank " << r << " did not gather";
    EXPECT_EQ(FirstBitMismatch(results[r].data(), want.data(), total), -1) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(WorldAndPayload, GlooCollectiveTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4),
                                            ::testing::Values(size_t{1}, size_t{1000},
                                                              size_t{1} << 20)),
                         [](const auto& info) {
                           return "ws" + std::to_string(std::get<0>(info.param)) + "_n" +
                                  std::to_string(std::get<1>(info.param));
                         });

TEST(GlooCommunicatorTest, SequenceOfMixedCollectivesStaysInStep) {
  TempDir dir;
  RunRanks(3, [&](int rank) {
    auto comm = CreateGlooCommunicator(Options(rank, 3, dir.path()));
    ASSERT_TRUE(comm.ok()) << comm.status().ToString();
    for (int step = 0; step < 20; ++step) {
      std::vector<float> g(100 + step, static_cast<float>(rank + step));
      ASSERT_TRUE((*comm)->AllReduceAverage(g.data(), g.size()).ok());
      EXPECT_EQ(g[0], static_cast<float>(1 + step));  // mean of step, step+1, step+2
      float root_value = static_cast<float>(rank == step % 3 ? step : -1);
      ASSERT_TRUE((*comm)->Broadcast(&root_value, 1, step % 3).ok());
      EXPECT_EQ(root_value, static_cast<float>(step));
    }
    ASSERT_TRUE((*comm)->Barrier().ok());
  });
}

TEST(GlooCommunicatorTest, RankThatNeverJoinsGivesTimeout) {
  TempDir dir;
  const milliseconds timeout(2000);
  RunRanks(2, [&](int rank) {  // world size 3: rank 2 never comes
    const auto start = std::chrono::steady_clock::now();
    auto comm = CreateGlooCommunicator(Options(rank, 3, dir.path(), timeout));
    const auto waited = std::chrono::steady_clock::now() - start;
    ASSERT_FALSE(comm.ok());
    EXPECT_EQ(comm.status().code(), Code::kTimeout) << comm.status().ToString();
    EXPECT_GE(waited, timeout - milliseconds(100));
    // The slack for scheduling grows with the sanitizers' slowdown.
    EXPECT_LT(waited, timeout + milliseconds(500) * ::isthmus::testing::TimeScale());
  });
}

TEST(GlooCommunicatorTest, PeerThatStopsCallingGivesTimeoutThenBroken) {
  TempDir dir;
  const milliseconds timeout(1500);
  std::atomic<bool> rank0_done{false};
  RunRanks(2, [&](int rank) {
    auto comm = CreateGlooCommunicator(Options(rank, 2, dir.path(), timeout));
    ASSERT_TRUE(comm.ok()) << comm.status().ToString();
    if (rank == 1) {
      // Alive and connected, but never enters the collective.
      while (!rank0_done) std::this_thread::sleep_for(milliseconds(10));
      return;
    }
    std::vector<float> data(1000, 1.0f);
    const auto start = std::chrono::steady_clock::now();
    Status s = (*comm)->AllReduceSum(data.data(), data.size());
    const auto waited = std::chrono::steady_clock::now() - start;
    EXPECT_EQ(s.code(), Code::kTimeout) << s.ToString();
    EXPECT_LT(waited, timeout + milliseconds(2000));
    Status again = (*comm)->Barrier();
    EXPECT_EQ(again.code(), Code::kFailedPrecondition) << again.ToString();
    rank0_done = true;
  });
}

TEST(GlooCommunicatorTest, PeerThatDiesGivesErrorNotHang) {
  TempDir dir;
  const milliseconds timeout(2000);
  RunRanks(2, [&](int rank) {
    auto comm = CreateGlooCommunicator(Options(rank, 2, dir.path(), timeout));
    ASSERT_TRUE(comm.ok()) << comm.status().ToString();
    if (rank == 1) {
      comm->reset();  // closes its connections, as a crashed process would
      return;
    }
    std::this_thread::sleep_for(milliseconds(100));
    std::vector<float> data(1000, 1.0f);
    const auto start = std::chrono::steady_clock::now();
    Status s = (*comm)->AllReduceSum(data.data(), data.size());
    EXPECT_FALSE(s.ok());
    EXPECT_TRUE(s.code() == Code::kTimeout || s.code() == Code::kUnavailable) << s.ToString();
    EXPECT_LT(std::chrono::steady_clock::now() - start, timeout + milliseconds(2000));
  });
}

TEST(GlooCommunicatorTest, TcpRendezvous) {
  const uint16_t port = FreePort();
  RunRanks(3, [&](int rank) {
    GlooOptions o;
    o.rank = rank;
    o.world_size = 3;
    o.rendezvous = "tcp:127.0.0.1:" + std::to_string(port);
    o.timeout = milliseconds(10'000);
    o.prefix = "tcpjob";
    // Rank 0 (the store server) starts last: clients must retry until it is up.
    if (rank == 0) std::this_thread::sleep_for(milliseconds(200));
    auto comm = CreateGlooCommunicator(o);
    ASSERT_TRUE(comm.ok()) << comm.status().ToString();
    std::vector<float> data(10, static_cast<float>(rank));
    ASSERT_TRUE((*comm)->AllReduceSum(data.data(), data.size()).ok());
    EXPECT_EQ(data[9], 3.0f);
  });
}

TEST(GlooCommunicatorTest, RejectsBadOptions) {
  TempDir dir;
  EXPECT_EQ(CreateGlooCommunicator(Options(2, 2, dir.path())).status().code(),
            Code::kInvalidArgument);
  EXPECT_EQ(CreateGlooCommunicator(Options(-1, 2, dir.path())).status().code(),
            Code::kInvalidArgument);
  EXPECT_EQ(CreateGlooCommunicator(Options(0, 1, dir.path() + "/missing")).status().code(),
            Code::kNotFound);
  GlooOptions o = Options(0, 1, dir.path());
  o.rendezvous = "redis:somewhere";
  EXPECT_EQ(CreateGlooCommunicator(o).status().code(), Code::kInvalidArgument);
  auto comm = CreateGlooCommunicator(Options(0, 1, dir.path()));
  ASSERT_TRUE(comm.ok());
  float x = 1.0f;
  EXPECT_EQ((*comm)->Broadcast(&x, 1, 1).code(), Code::kInvalidArgument);
  EXPECT_EQ((*comm)->AllReduceSum(nullptr, 4).code(), Code::kInvalidArgument);
}

TEST(RendezvousTest, ParsesSpecs) {
  auto file = ParseRendezvous("file:some/dir");
  ASSERT_TRUE(file.ok());
  EXPECT_EQ(file->kind, RendezvousSpec::Kind::kFile);
  EXPECT_EQ(file->dir, "some/dir");
  auto tcp = ParseRendezvous("tcp:10.0.0.1:29500");
  ASSERT_TRUE(tcp.ok());
  EXPECT_EQ(tcp->host, "10.0.0.1");
  EXPECT_EQ(tcp->port, 29500);
  auto v6 = ParseRendezvous("tcp:[::1]:7");
  ASSERT_TRUE(v6.ok());
  EXPECT_EQ(v6->host, "::1");
  EXPECT_EQ(v6->port, 7);
  for (const char* bad :
       {"", "file:", "tcp:host", "tcp::80", "tcp:h:", "tcp:h:99999", "tcp:h:8x", "http://h:1"}) {
    EXPECT_FALSE(ParseRendezvous(bad).ok()) << bad;
  }
}

TEST(RendezvousTest, TcpStoreSetGetAndTimeout) {
  const uint16_t port = FreePort();
  const std::string spec = "tcp:127.0.0.1:" + std::to_string(port);
  auto server_side = Rendezvous::Open(spec, 0, "job", milliseconds(500));
  ASSERT_TRUE(server_side.ok()) << server_side.status().ToString();
  auto client = Rendezvous::Open(spec, 1, "job", milliseconds(500));
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  auto other_job = Rendezvous::Open(spec, 1, "other", milliseconds(500));
  ASSERT_TRUE(other_job.ok());

  std::vector<char> value(100'000);
  for (size_t i = 0; i < value.size(); ++i) value[i] = static_cast<char>(i * 7);
  ASSERT_TRUE((*server_side)->Set("k", value).ok());
  auto got = (*client)->Get("k");
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, value);

  // Prefixes keep jobs apart: the other job does not see "k" and times out.
  const auto start = std::chrono::steady_clock::now();
  auto missing = (*other_job)->Get("k");
  EXPECT_EQ(missing.status().code(), Code::kTimeout) << missing.status().ToString();
  EXPECT_GE(std::chrono::steady_clock::now() - start, milliseconds(450));

  // After the server stops, clients fail instead of hanging.
  (*server_side)->StopServing();
  EXPECT_FALSE((*client)->Get("k").ok());
}

// A CPU rank (Gloo) and a GPU rank (NCCL) of one site meet at the same rendezvous: both
// must learn at once, from the kind each announces, that they cannot form a group.
TEST(RendezvousTest, RanksOfDifferentDeviceKindsRefuseEachOtherAtOnce) {
  TempDir dir;
  std::vector<Status> result(2);
  const char* kinds[2] = {"gloo (--device cpu)", "nccl (--device cuda)"};
  const auto start = std::chrono::steady_clock::now();
  RunRanks(2, [&](int rank) {
    auto r = Rendezvous::Open("file:" + dir.path(), rank, "job", milliseconds(10'000));
    if (!r.ok()) {
      result[rank] = r.status();
      return;
    }
    result[rank] = AgreeOnKind(**r, rank, 2, kinds[rank]);
  });
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(result[rank].code(), Code::kFailedPrecondition) << result[rank].ToString();
    EXPECT_NE(result[rank].message().find("same device kind"), std::string::npos);
    EXPECT_NE(result[rank].message().find(kinds[1 - rank]), std::string::npos)
        << result[rank].message();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(5'000)) << "not at once";
  // The same kind on both sides agrees.
  TempDir again;
  RunRanks(2, [&](int rank) {
    auto r = Rendezvous::Open("file:" + again.path(), rank, "job", milliseconds(10'000));
    result[rank] = r.ok() ? AgreeOnKind(**r, rank, 2, kinds[0]) : r.status();
  });
  EXPECT_TRUE(result[0].ok()) << result[0].ToString();
  EXPECT_TRUE(result[1].ok()) << result[1].ToString();
}

// A relaunch on a reused file store never reads the earlier launch's keys: launch 1 leaves
// "id" = "first"; in launch 2 rank 1 starts first and asks for "id" while rank 0 is still
// half a second away, and gets launch 2's "second", written after that. The ranks agree on
// a new launch id each time. (Without the agreement rank 1 read "first" at once.)
TEST(RendezvousTest, ARelaunchOnAReusedFileStoreNeverReadsTheEarlierLaunchsKeys) {
  TempDir dir;
  std::string ids[2][2];
  for (int launch = 0; launch < 2; ++launch) {
    std::string got[2];
    RunRanks(2, [&](int rank) {
      if (launch == 1 && rank == 0) std::this_thread::sleep_for(milliseconds(500));
      auto r = Rendezvous::Open("file:" + dir.path(), rank, "job", milliseconds(10'000));
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      const Status agreed = (*r)->AgreeOnLaunch(rank, 2);
      ASSERT_TRUE(agreed.ok()) << agreed.ToString();
      ids[launch][rank] = (*r)->launch_id();
      const std::string value = launch == 0 ? "first" : "second";
      if (rank == 0) {
        ASSERT_TRUE((*r)->Set("id", std::vector<char>(value.begin(), value.end())).ok());
      }
      auto v = (*r)->Get("id");
      ASSERT_TRUE(v.ok()) << v.status().ToString();
      got[rank].assign(v->begin(), v->end());
    });
    EXPECT_EQ(got[1], launch == 0 ? "first" : "second") << "launch " << launch;
    EXPECT_EQ(ids[launch][0], ids[launch][1]);
    EXPECT_EQ(ids[launch][0].size(), 32u);
  }
  EXPECT_NE(ids[0][0], ids[1][0]);
  // A rank that never comes is named when the others give up.
  TempDir lonely;
  auto r = Rendezvous::Open("file:" + lonely.path(), 0, "job", milliseconds(300));
  ASSERT_TRUE(r.ok());
  const Status st = (*r)->AgreeOnLaunch(0, 3);
  EXPECT_EQ(st.code(), Code::kTimeout);
  EXPECT_NE(st.message().find("rank(s) 1, 2 did not join"), std::string::npos) << st.ToString();
}

// Ranks launched with different --world-size values are told at the launch agreement,
// naming the setting, instead of waiting out the timeout for ranks that never come.
TEST(RendezvousTest, RanksWithDifferentWorldSizesAreRefusedNamingTheSetting) {
  TempDir dir;
  Status result[2];
  const auto start = std::chrono::steady_clock::now();
  RunRanks(2, [&](int rank) {
    auto r = Rendezvous::Open("file:" + dir.path(), rank, "job", milliseconds(10'000));
    ASSERT_TRUE(r.ok());
    result[rank] = (*r)->AgreeOnLaunch(rank, rank == 0 ? 2 : 3);
  });
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(result[rank].code(), Code::kFailedPrecondition) << result[rank].ToString();
    EXPECT_NE(result[rank].message().find("same --world-size"), std::string::npos);
  }
  EXPECT_NE(result[0].message().find("rank 1 was launched with --world-size 3 but rank 0 with 2"),
            std::string::npos)
      << result[0].message();
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(5'000)) << "not at once";
}

// Two ranks on one GPU are refused, naming both and the device, before any collective
// (the NCCL communicator passes host and GPU UUID; the check itself is the rendezvous's).
TEST(RendezvousTest, TwoRanksOnOneDeviceAreRefusedNamingBoth) {
  for (bool same : {false, true}) {
    TempDir dir;
    Status result[3];
    RunRanks(3, [&](int rank) {
      auto r = Rendezvous::Open("file:" + dir.path(), rank, "job", milliseconds(10'000));
      ASSERT_TRUE(r.ok());
      ASSERT_TRUE((*r)->AgreeOnLaunch(rank, 3).ok());
      const std::string device =
          "node-a GPU-" + std::to_string(same && rank == 2 ? 0 : rank);  // rank 2 on rank 0's
      result[rank] = AgreeOnDistinctDevices(**r, rank, 3, device);
    });
    if (!same) {
      for (const Status& st : result) EXPECT_TRUE(st.ok()) << st.ToString();
      continue;
    }
    for (int rank : {0, 1, 2}) {  // every rank stops, not only the pair
      EXPECT_EQ(result[rank].code(), Code::kFailedPrecondition);
      EXPECT_NE(result[rank].message().find("ranks 0 and 2 both use node-a GPU-0"),
                std::string::npos)
          << result[rank].ToString();
    }
  }
}

// Gloo groups launched twice on one file store: the second launch's all-reduce works (it
// would otherwise connect to the first launch's addresses, gone with its processes).
TEST(RendezvousTest, AGlooGroupRelaunchedOnTheSameFileStoreWorks) {
  TempDir dir;
  for (int launch = 0; launch < 2; ++launch) {
    std::vector<float> result[2];
    RunRanks(2, [&](int rank) {
      if (launch == 1 && rank == 1) std::this_thread::sleep_for(milliseconds(300));
      auto comm = CreateGlooCommunicator(Options(rank, 2, dir.path()));
      ASSERT_TRUE(comm.ok()) << "launch " << launch << " rank " << rank << ": "
                             << comm.status().ToString();
      std::vector<float> v(16, static_cast<float>(rank + 1 + launch));
      ASSERT_TRUE((*comm)->AllReduceSum(v.data(), v.size()).ok());
      result[rank] = v;
    });
    EXPECT_EQ(result[0], std::vector<float>(16, 3.0f + 2 * launch)) << "launch " << launch;
    EXPECT_EQ(result[1], result[0]);
  }
}

TEST(RendezvousTest, TcpStoreUnreachableTimesOut) {
  const uint16_t port = FreePort();
  auto client =
      Rendezvous::Open("tcp:127.0.0.1:" + std::to_string(port), 1, "job", milliseconds(300));
  EXPECT_EQ(client.status().code(), Code::kTimeout) << client.status().ToString();
}

// Ranks 1 and 2 are child processes (fork without exec: the children run the same code),
// rank 0 is this process; the group meets over the TCP store.
TEST(GlooCommunicatorTest, MultiProcessGroup) {
  const uint16_t port = FreePort();
  const int world_size = 3;
  auto run_rank = [&](int rank) -> bool {
    GlooOptions o;
    o.rank = rank;
    o.world_size = world_size;
    o.rendezvous = "tcp:127.0.0.1:" + std::to_string(port);
    o.timeout = milliseconds(10'000);
    o.prefix = "mp";
    auto comm = CreateGlooCommunicator(o);
    if (!comm.ok()) return false;
    std::vector<float> data(4096);
    for (size_t i = 0; i < data.size(); ++i) data[i] = IntValue(rank, i);
    if (!(*comm)->AllReduceAverage(data.data(), data.size()).ok()) return false;
    for (size_t i = 0; i < data.size(); ++i) {
      if (data[i] != static_cast<float>((i % 7 + 1) * 6) / 3.0f) return false;
    }
    return (*comm)->Barrier().ok();
  };
  std::vector<pid_t> children;
  for (int rank = 1; rank < world_size; ++rank) {
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) ::_exit(run_rank(rank) ? 0 : 1);
    children.push_back(pid);
  }
  EXPECT_TRUE(run_rank(0));
  for (pid_t pid : children) {
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  }
}

// The state letter of a process's main thread in /proc (R running, S sleeping, T stopped).
char ProcessState(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(in, line);
  const size_t paren = line.rfind(')');
  return paren == std::string::npos || paren + 2 >= line.size() ? '?' : line[paren + 2];
}

// A root that leaves right after its broadcast. Gloo counts a send complete once its bytes
// are in the kernel's socket buffer; what the receiver has not taken yet is still on its way
// when the root's communicator goes, and must arrive: closing the group may not reset the
// connections (which drops what is queued). The receiver, a child process, is stopped
// (SIGSTOP) once it waits in its receive (its receive posted) until the root has left, so
// the 512 KiB cannot have been read when the root closes: the root's kernel holds what the
// receiver's window (a fresh connection's, far smaller) did not take.
TEST(GlooCommunicatorTest, ARootThatLeavesRightAfterItsBroadcastLosesNothing) {
  const size_t count = size_t{1} << 19;
  auto value = [](size_t i) { return static_cast<float>(i % 4093) - 7.5f; };
  auto open = [&](int rank, uint16_t port) {
    GlooOptions o;
    o.rank = rank;
    o.world_size = 2;
    o.rendezvous = "tcp:127.0.0.1:" + std::to_string(port);
    o.timeout = milliseconds(20'000) * ::isthmus::testing::TimeScale();
    o.prefix = "leave";
    return CreateGlooCommunicator(o);
  };
  // Three times: a reset does not always catch bytes in flight.
  for (int trial = 0; trial < 3; ++trial) {
    const uint16_t port = FreePort();
    int ready[2];
    ASSERT_EQ(::pipe(ready), 0);
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      ::close(ready[0]);
      auto comm = open(1, port);
      if (!comm.ok()) ::_exit(3);
      std::vector<float> data(count, 0.0f);
      if (::write(ready[1], "r", 1) != 1) ::_exit(3);
      if (!(*comm)->Broadcast(data.data(), count, 0).ok()) ::_exit(1);
      for (size_t i = 0; i < count; ++i) {
        if (data[i] != value(i)) ::_exit(2);
      }
      ::_exit(0);
    }
    ::close(ready[1]);
    {
      auto comm = open(0, port);
      ASSERT_TRUE(comm.ok()) << comm.status().ToString();
      std::vector<float> data(count);
      for (size_t i = 0; i < count; ++i) data[i] = value(i);
      char byte = 0;
      ASSERT_EQ(::read(ready[0], &byte, 1), 1) << "the receiver did not join";
      // It is about to post its receive; then it sleeps in the wait for the data. Twice
      // asleep 20 ms apart: waiting, not a passing lock.
      int asleep = 0;
      for (int i = 0; i < 1000 && asleep < 2; ++i) {
        std::this_thread::sleep_for(milliseconds(20));
        asleep = ProcessState(child) == 'S' ? asleep + 1 : 0;
      }
      ASSERT_EQ(asleep, 2) << "the receiver never waited for the data";
      ASSERT_EQ(::kill(child, SIGSTOP), 0);
      EXPECT_TRUE((*comm)->Broadcast(data.data(), count, 0).ok());
    }  // the root's communicator goes here
    ::close(ready[0]);
    ASSERT_EQ(::kill(child, SIGCONT), 0);
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    ASSERT_TRUE(WIFEXITED(status)) << "child status " << status;
    EXPECT_EQ(WEXITSTATUS(status), 0)
        << "trial " << trial << ": the receiver "
        << (WEXITSTATUS(status) == 1   ? "got an error instead of the data"
            : WEXITSTATUS(status) == 2 ? "got other bits than were sent"
                                       : "could not join");
  }
}
}  // namespace
}  // namespace isthmus::comm
