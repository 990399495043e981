// Distributed runtime: environment parsing, collectives against closed forms on W = 1..4
// real processes, and failure reporting (a rank that throws, dies or hangs is named).
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <random>
#include <thread>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "tests/test_paths.h"
#include "partial_fc/distributed/dist_env.h"
#include "partial_fc/distributed/collective_trace.h"
#include "partial_fc/distributed/distributed.h"
#include "base/error.h"
#include "partial_fc/distributed/guard_store.h"
#include "partial_fc/distributed/network.h"
#include "partial_fc/distributed/straggler_monitor.h"
#include "tests/harness.h"
#include "tests/test_files.h"

namespace faceshard {
namespace {

using testing::RankOptions;
using testing::run_ranks;
using testing::spawn_ranks;

TEST(DistEnv, SingleProcessWhenNothingIsSet) {
  auto d = DistEnv::from_map({});
  EXPECT_EQ(d.rank, 0);
  EXPECT_EQ(d.world_size, 1);
  EXPECT_EQ(d.source, "single");
}

TEST(DistEnv, Torchrun) {
  auto d = DistEnv::from_map({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"},
                              {"GROUP_RANK", "1"}, {"MASTER_ADDR", "10.1.2.3"}, {"MASTER_PORT", "1234"},
                              {"TORCHELASTIC_RUN_ID", "x"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                              {"TORCHELASTIC_RESTART_COUNT", "2"}, {"TORCHELASTIC_MAX_RESTARTS", "3"}});
  EXPECT_EQ(d.rank, 5);
  EXPECT_EQ(d.world_size, 8);
  EXPECT_EQ(d.local_rank, 1);
  EXPECT_EQ(d.local_world_size, 4);
  EXPECT_EQ(d.node_rank, 1);
  EXPECT_EQ(d.master_addr, "10.1.2.3");
  EXPECT_EQ(d.master_port, 1234);
  EXPECT_TRUE(d.agent_store);
  EXPECT_EQ(d.restart_count, 2);
  EXPECT_EQ(d.max_restarts, 3);
  EXPECT_EQ(d.source, "torchrun");
  EXPECT_NE(d.describe().find("rank 5/8 (local 1/4, node 1) via torchrun (restart 2 of at most 3)"), std::string::npos)
      << d.describe();
}

TEST(DistEnv, Slurm) {
  auto d = DistEnv::from_map({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "1"},
                              {"SLURM_NTASKS_PER_NODE", "2(x2)"}, {"SLURM_NODEID", "1"},
                              {"SLURM_JOB_NODELIST", "gpu[07-08]"}, {"SLURM_JOB_ID", "123"},
                              {"SLURM_RESTART_COUNT", "1"}});
  EXPECT_EQ(d.rank, 3);
  EXPECT_EQ(d.world_size, 4);
  EXPECT_EQ(d.local_rank, 1);
  EXPECT_EQ(d.local_world_size, 2);
  EXPECT_EQ(d.master_addr, "gpu07");
  EXPECT_EQ(d.master_port, 20123);
  EXPECT_FALSE(d.agent_store);
  EXPECT_EQ(d.slurm_restart_count, 1);
  EXPECT_NE(d.describe().find("via slurm (requeue 1)"), std::string::npos) << d.describe();
}

TEST(DistEnv, SlurmNodeList) {
  EXPECT_EQ(slurm_first_host("node1"), "node1");
  EXPECT_EQ(slurm_first_host("a[3,5-7],b2"), "a3");
  EXPECT_EQ(slurm_first_host("rack1-n[010-020]x"), "rack1-n010x");
}

TEST(DistEnv, InconsistentVariablesAreUsageErrors) {
  try {
    DistEnv::from_map({{"RANK", "4"}, {"WORLD_SIZE", "4"}});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.exit_code(), 2);
    EXPECT_NE(std::string(e.what()).find("rank 4"), std::string::npos) << e.what();
  }
  EXPECT_THROW(DistEnv::from_map({{"RANK", "x"}, {"WORLD_SIZE", "2"}}), Error);
  EXPECT_THROW(DistEnv::from_map({{"RANK", "0"}}), Error);
  EXPECT_THROW(DistEnv::from_map({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}}), Error);
}

class Collectives : public ::testing::TestWithParam<int> {};

TEST_P(Collectives, MatchClosedForms) {
  const int W = GetParam();
  run_ranks(W, [W](Distributed& d) {
    ASSERT_EQ(d.world_size(), W);
    const int r = d.rank();
    // all_reduce SUM / MAX / MIN of (r+1) * [1, 2, 3]
    for (auto op : {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min}) {
      at::Tensor t = torch::tensor({1.0, 2.0, 3.0}) * (r + 1);
      d.all_reduce(t, op);
      const double f = op == ReduceOp::Sum ? W * (W + 1) / 2.0 : op == ReduceOp::Max ? W : 1.0;
      EXPECT_TRUE(torch::allclose(t, torch::tensor({1.0, 2.0, 3.0}) * f)) << t;
    }
    // broadcast from the last rank
    at::Tensor b = torch::full({4}, static_cast<float>(r));
    d.broadcast(b, W - 1);
    EXPECT_TRUE(torch::equal(b, torch::full({4}, static_cast<float>(W - 1))));
    // all_gather with equal rows: rank r contributes rows filled with r
    at::Tensor g = d.all_gather(torch::full({2, 3}, static_cast<float>(r)));
    ASSERT_EQ(g.size(0), 2 * W);
    for (int q = 0; q < W; ++q)
      EXPECT_TRUE(torch::equal(g.narrow(0, 2 * q, 2), torch::full({2, 3}, static_cast<float>(q))));
    // all_gather with unequal rows (rank r has r+1 rows; also a rank with zero rows when W > 1)
    const int64_t mine = (W > 1 && r == 1) ? 0 : r + 1;
    std::vector<int64_t> counts;
    at::Tensor u = d.all_gather(torch::full({mine, 2}, static_cast<float>(r)), &counts);
    int64_t off = 0;
    for (int q = 0; q < W; ++q) {
      const int64_t n = (W > 1 && q == 1) ? 0 : q + 1;
      ASSERT_EQ(counts[q], n);
      EXPECT_TRUE(torch::equal(u.narrow(0, off, n), torch::full({n, 2}, static_cast<float>(q))));
      off += n;
    }
    EXPECT_EQ(u.size(0), off);
    // reduce_scatter: every rank sends block q filled with (r+1)*(q+1), block q has q+1 rows;
    // rank q receives sum_r (r+1)*(q+1) = (q+1) W(W+1)/2.
    std::vector<int64_t> rs_counts;
    std::vector<at::Tensor> blocks;
    for (int q = 0; q < W; ++q) {
      rs_counts.push_back(q + 1);
      blocks.push_back(torch::full({q + 1, 2}, static_cast<float>((r + 1) * (q + 1))));
    }
    at::Tensor s = d.reduce_scatter(torch::cat(blocks), rs_counts);
    EXPECT_TRUE(torch::equal(s, torch::full({r + 1, 2}, static_cast<float>((r + 1) * W * (W + 1) / 2))));
    // async all_reduce
    at::Tensor a = torch::ones({8}) * (r + 1);
    if (W > 1) {
      auto work = d.all_reduce_async(a);
      d.wait(work, "all_reduce");
    }
    EXPECT_TRUE(torch::equal(a, torch::ones({8}) * (W * (W + 1) / 2)));
    d.barrier();
  });
}

INSTANTIATE_TEST_SUITE_P(World, Collectives, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "W" + std::to_string(info.param); });

// The harness itself: ranks that ran their body pass; a rank process whose call index
// selects no body (here FS_HARNESS_CALL points past the test's calls) exits 0 all the same,
// and that is a failure, not a pass.
TEST(Harness, RankThatRunsNoBodyIsAFailure) {
  auto ran = spawn_ranks(2, [](Distributed& d) { d.barrier(); });
  RankOptions o;
  o.env = {{"FS_HARNESS_CALL", "99"}};
  auto none = spawn_ranks(2, [](Distributed& d) { d.barrier(); }, o);
  if (testing::in_rank_process()) return;
  ASSERT_EQ(ran.size(), 2u);
  ASSERT_EQ(none.size(), 2u);
  EXPECT_TRUE(testing::rank_failures(ran).empty());
  for (const auto& r : none) {
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_FALSE(r.body_done) << r.output;
  }
  const auto f = testing::rank_failures(none);
  ASSERT_EQ(f.size(), 2u);
  EXPECT_NE(f[0].find("exited 0 without running its body"), std::string::npos) << f[0];
}

// A rank that throws: the others fail quickly with a message naming it and its error.
TEST(DistFailure, RankThatThrowsIsNamed) {
  RankOptions o;
  o.collective_timeout = std::chrono::seconds(20);
  auto t0 = std::chrono::steady_clock::now();
  auto res = spawn_ranks(3, [](Distributed& d) {
    at::Tensor t = torch::ones({4});
    d.all_reduce(t);
    if (d.rank() == 1) throw runtime_error("injected failure in the data loader");
    for (int i = 0; i < 100; ++i) d.all_reduce(t);
  }, o);
  if (testing::in_rank_process()) return;
  auto secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(secs, 20.0) << "ranks must not wait for the collective timeout when a peer is gone";
  ASSERT_EQ(res.size(), 3u);
  EXPECT_NE(res[1].exit_code, 0);
  EXPECT_NE(res[1].output.find("injected failure"), std::string::npos) << res[1].output;
  for (int r : {0, 2}) {
    EXPECT_NE(res[r].exit_code, 0) << res[r].output;
    EXPECT_FALSE(res[r].killed_by_harness);
    EXPECT_NE(res[r].output.find("rank 1 failed: "), std::string::npos) << res[r].output;
    EXPECT_NE(res[r].output.find("injected failure"), std::string::npos) << res[r].output;
  }
}

// A rank that dies without a word (like SIGKILL): the others name it.
TEST(DistFailure, RankThatDiesIsNamed) {
  RankOptions o;
  o.collective_timeout = std::chrono::seconds(20);
  auto res = spawn_ranks(3, [](Distributed& d) {
    at::Tensor t = torch::ones({4});
    d.all_reduce(t);
    if (d.rank() == 2) raise(SIGKILL);
    for (int i = 0; i < 100; ++i) d.all_reduce(t);
  }, o);
  if (testing::in_rank_process()) return;
  EXPECT_EQ(res[2].signal, SIGKILL);
  for (int r : {0, 1}) {
    EXPECT_NE(res[r].exit_code, 0) << res[r].output;
    EXPECT_FALSE(res[r].killed_by_harness) << res[r].output;
    EXPECT_NE(res[r].output.find("rank 2 died"), std::string::npos) << res[r].output;
  }
}

// A rank that hangs outside the collective: the others time out and name it.
// A peer that joined the store and then died while the others wait in the rendezvous (for
// NCCL's communicator that wait has no end): its heartbeat stops, and the waiting rank
// exits within seconds naming it, long before its rendezvous timeout (60 s here). Rank 0 is
// faceshard-dist-check; rank 1 is played by this process, which writes one heartbeat into
// rank 0's store and goes silent.
TEST(DistFailure, PeerThatDiesDuringRendezvousIsNamed) {
  const std::string dir = testing::temp_dir("rdzv");
  const int port = [] {  // a free port for rank 0's store
    c10d::TCPStoreOptions so;
    so.port = 0;
    so.isServer = true;
    so.waitWorkers = false;
    return static_cast<int>(c10d::TCPStore("127.0.0.1", so).getPort());
  }();
  const std::string log_path = dir + "/rank0.log", bin = std::string(FACESHARD_BIN_DIR) + "/faceshard-dist-check";
  const std::string port_env = "MASTER_PORT=" + std::to_string(port);
  const auto t0 = std::chrono::steady_clock::now();
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {  // only exec-safe calls between fork and exec
    const int fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    const char* env[] = {"RANK=0", "WORLD_SIZE=2", "LOCAL_WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1", port_env.c_str(),
                         "OMP_NUM_THREADS=1", nullptr};
    execle(bin.c_str(), "faceshard-dist-check", "--rendezvous-timeout-s", "60", (char*)nullptr, env);
    _exit(127);
  }
  {
    faceshard::GuardStore peer("127.0.0.1", port, "", std::chrono::seconds(30));  // retries until rank 0 listens
    peer.set("faceshard/fs/hb/1", std::vector<uint8_t>{'1', ' ', '0'});
  }
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(40)) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      FAIL() << "rank 0 did not stop: " << testing::read_text(log_path);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string log = testing::read_text(log_path);
  ASSERT_TRUE(WIFEXITED(status)) << log;
  EXPECT_EQ(WEXITSTATUS(status), 1) << log;
  EXPECT_NE(log.find("faceshard-dist-check: error: rendezvous at 127.0.0.1:" + std::to_string(port) +
                     " failed on rank 0 (Gloo full mesh): rank 1 died (its heartbeat stopped)"),
            std::string::npos)
      << log;
  EXPECT_LT(secs, 30.0) << log;
}

TEST(DistFailure, RankThatHangsIsNamedAfterTimeout) {
  RankOptions o;
  o.collective_timeout = std::chrono::seconds(3);
  auto t0 = std::chrono::steady_clock::now();
  auto res = spawn_ranks(2, [](Distributed& d) {
    at::Tensor t = torch::ones({4});
    d.all_reduce(t);
    if (d.rank() == 1) std::this_thread::sleep_for(std::chrono::seconds(30));
    d.all_reduce(t);
  }, o);
  if (testing::in_rank_process()) return;
  auto secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(res[0].exit_code, 0);
  EXPECT_FALSE(res[0].killed_by_harness);
  EXPECT_NE(res[0].output.find("rank 1 did not join collective"), std::string::npos) << res[0].output;
  EXPECT_LT(secs, 30.0);
}

// --- the collective trace --------------------------------------------------------------

TEST(CollectiveTrace, RingKeepsTheLastAndKnowsWhatIsPending) {
  CollectiveTrace t(4);
  t.set_context(7, "backward");
  for (int64_t seq = 1; seq <= 6; ++seq) t.begin(seq, "all_reduce", "gloo", "Float", seq * 10);
  for (int64_t seq : {1, 2, 3, 4, 6}) t.end(seq);
  t.end(99);  // unknown: nothing happens
  const auto rs = t.records();
  ASSERT_EQ(rs.size(), 4u);
  for (size_t k = 0; k < 4; ++k) {
    EXPECT_EQ(rs[k].seq, static_cast<int64_t>(k + 3));
    EXPECT_EQ(rs[k].numel, rs[k].seq * 10);
    EXPECT_EQ(rs[k].step, 7);
    EXPECT_EQ(rs[k].phase, "backward");
  }
  EXPECT_FALSE(rs[0].pending());
  EXPECT_TRUE(rs[2].pending());  // #5 never ended
  ASSERT_TRUE(t.oldest_pending().has_value());
  EXPECT_EQ(t.oldest_pending()->seq, 5);
  t.end(5);
  EXPECT_FALSE(t.oldest_pending().has_value());
}

TEST(CollectiveTrace, FileRoundTripAndBadFilesNamed) {
  testing::TempDir dir;
  CollectiveTrace t;
  t.set_context(3, "forward");
  t.begin(1, "all_gather", "nccl", "BFloat16", 4096);
  t.end(1);
  t.set_context(3, "backward");
  t.begin(2, "all_reduce", "gloo", "Float", 2);
  const std::string path = dir.path + "/rank1.jsonl";
  ASSERT_TRUE(t.write(path, 1, 3, "host-b", "a \"quoted\" reason\nwith a line break"));
  const RankTrace back = read_rank_trace(path);
  EXPECT_EQ(back.rank, 1);
  EXPECT_EQ(back.world_size, 3);
  EXPECT_EQ(back.host, "host-b");
  EXPECT_EQ(back.reason, "a \"quoted\" reason\nwith a line break");
  ASSERT_EQ(back.records.size(), 2u);
  EXPECT_EQ(back.records[0].kind, "all_gather");
  EXPECT_EQ(back.records[0].backend, "nccl");
  EXPECT_EQ(back.records[0].dtype, "BFloat16");
  EXPECT_EQ(back.records[0].numel, 4096);
  EXPECT_FALSE(back.records[0].pending());
  EXPECT_TRUE(back.records[1].pending());
  EXPECT_EQ(back.records[1].phase, "backward");
  // No folder to write to: false, and no file.
  EXPECT_FALSE(t.write(dir.path + "/no/such/rank0.jsonl", 0, 3, "h", ""));
  EXPECT_FALSE(std::filesystem::exists(dir.path + "/no"));
  // Bad files: one line naming the file (and the line).
  auto error_of = [](const std::string& p) {
    try {
      read_rank_trace(p);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string bad = dir.path + "/bad.jsonl";
  testing::write_text(bad, "");
  EXPECT_NE(error_of(bad).find("empty trace file"), std::string::npos) << error_of(bad);
  testing::write_text(bad, "{\"rank\":5,\"world_size\":3}\n");
  EXPECT_NE(error_of(bad).find("bad.jsonl:1: rank 5 of 3"), std::string::npos) << error_of(bad);
  testing::write_text(bad, "{\"rank\":0,\"world_size\":3}\n{\"seq\":1,\"kind\":\"x\"\n");
  EXPECT_NE(error_of(bad).find("bad.jsonl:2: not a trace line"), std::string::npos) << error_of(bad);
  testing::write_text(bad, "{\"rank\":0,\"world_size\":3}\n{\"seq\":1,\"numel\":1,\"step\":1,\"issued_ms\":1}\n");
  EXPECT_NE(error_of(bad).find("without 'finished_ms'"), std::string::npos) << error_of(bad);
  testing::write_text(bad, "{\"rank\":0,\"world_size\":3}\n{\"seq\":nan,\"numel\":1}\n");
  EXPECT_NE(error_of(bad).find("'seq' is not a number"), std::string::npos) << error_of(bad);
  EXPECT_NE(error_of(dir.path + "/missing.jsonl").find("cannot read the trace file"), std::string::npos);
}

// Three ranks' traces: ranks 0 and 2 wait in #7, rank 1 finished #6 and never entered #7.
std::vector<RankTrace> hung_run(bool rank1_wrote) {
  std::vector<RankTrace> out;
  for (int r = 0; r < 3; ++r) {
    if (r == 1 && !rank1_wrote) continue;
    RankTrace t;
    t.rank = r;
    t.world_size = 3;
    t.host = "h" + std::to_string(r);
    for (int64_t seq = 1; seq <= (r == 1 ? 6 : 7); ++seq) {
      CollectiveRecord c;
      c.seq = seq;
      c.kind = seq == 7 ? "all_gather" : "all_reduce";
      c.step = 2;
      c.phase = "forward";
      c.issued_ms = 1000.0 * seq;
      c.finished_ms = seq == 7 ? -1 : 1000.0 * seq + 5;
      t.records.push_back(c);
    }
    out.push_back(t);
  }
  return out;
}

TEST(CollectiveTrace, VerdictNamesTheRankThatNeverEntered) {
  auto v = trace_verdict(hung_run(true));
  ASSERT_FALSE(v.empty());
  EXPECT_NE(v[0].find("collective #7 all_gather at step 2 (forward): ranks 0,2 entered it and waited; never entered "
                      "by rank 1 (host h1), whose last was #6 all_reduce"),
            std::string::npos)
      << v[0];
  v = trace_verdict(hung_run(false));
  EXPECT_NE(v[0].find("never entered by rank 1 (no trace file"), std::string::npos) << v[0];
  // Nothing pending: said so, and no rank named.
  auto done = hung_run(true);
  for (auto& t : done)
    for (auto& c : t.records) c.finished_ms = c.issued_ms + 1;
  v = trace_verdict(done);
  EXPECT_NE(v[0].find("no collective was pending"), std::string::npos) << v[0];
  EXPECT_EQ(v[0].find("rank 1"), std::string::npos) << v[0];
  // Every rank entered it: a link, not a rank.
  auto all_in = hung_run(true);
  CollectiveRecord c = all_in[0].records.back();
  all_in[1].records.push_back(c);
  v = trace_verdict(all_in);
  EXPECT_NE(v[0].find("every rank entered it"), std::string::npos) << v[0];
}

// --- stragglers ---------------------------------------------------------------------------

TEST(Stragglers, ScoreIsTheFastestPaceOverThisRanks) {
  // Rank 2 computes 1.6x as long; every data wait is small against a step.
  const auto s = straggler_scores({{1.0, 0.0}, {1.02, 0.001}, {1.6, 0.0}});
  EXPECT_NEAR(s[0][0], 1.0, 1e-12);
  EXPECT_NEAR(s[2][0], (1.0 + 0.05) / (1.6 + 0.05), 1e-12);
  EXPECT_LT(s[2][0], StragglerMonitor::kThreshold);
  EXPECT_GT(s[1][0], StragglerMonitor::kThreshold);
  for (int r = 0; r < 3; ++r) EXPECT_GT(s[r][1], 0.95) << r;
  // A rank that waits for its data a third of a step is slow in data.
  const auto d = straggler_scores({{1.0, 0.0}, {1.0, 0.4}});
  EXPECT_LT(d[1][1], StragglerMonitor::kThreshold);
  EXPECT_NEAR(d[1][0], 1.0, 1e-12);
}

// Rank 0's monitor judges in a thread of its own: waits (bounded) until it has judged n
// windows, and for the reports of the last one.
bool judged(StragglerMonitor& m, int64_t n) {
  for (int i = 0; i < 500 && m.windows_judged() < n; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  return m.windows_judged() >= n;
}
std::vector<StragglerReport> reports_of(StragglerMonitor& m) {
  std::vector<StragglerReport> got;
  for (int i = 0; i < 300 && got.empty(); ++i) {
    got = m.take_reports();
    if (got.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return got;
}

// Three ranks' monitors over one store: a rank slowed for two windows is reported once the
// second ends, with its host and phase; jitter of +-10% on every rank is never reported.
TEST(Stragglers, TwoSlowWindowsAreReportedCleanRunsNever) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  const int64_t window = 5;
  std::vector<std::unique_ptr<StragglerMonitor>> m;
  for (int r = 0; r < 3; ++r)
    m.push_back(std::make_unique<StragglerMonitor>(store, r, 3, std::vector<std::string>{"a", "b", "c"}, window));
  std::mt19937 gen(5);
  std::uniform_real_distribution<double> jitter(0.9, 1.1);
  int64_t step = StragglerMonitor::kWarmupSteps;  // the warm-up steps are not timed
  auto run_windows = [&](int n, int slow_rank) {
    for (int w = 0; w < n; ++w)
      for (int64_t k = 0; k < window; ++k) {
        ++step;
        for (int r = 0; r < 3; ++r) {
          const double work = (r == slow_rank ? 1.5 : 1.0) * jitter(gen);
          // The fast ranks wait for the slow one in their collectives.
          const double blocked = slow_rank >= 0 && r != slow_rank ? 0.5 : 0.0;
          m[r]->add_step(step, work + blocked + 0.01, 0.01, blocked);
        }
      }
  };
  run_windows(4, -1);
  ASSERT_TRUE(judged(*m[0], 4));
  EXPECT_TRUE(m[0]->take_reports().empty());  // jitter is not a straggler
  EXPECT_EQ(m[0]->last_scores().size(), 3u);
  run_windows(1, 2);
  ASSERT_TRUE(judged(*m[0], 5));
  EXPECT_TRUE(m[0]->take_reports().empty());  // one slow window is not enough
  EXPECT_LT(m[0]->last_scores()[2][0], 0.75);
  run_windows(1, 2);
  ASSERT_TRUE(judged(*m[0], 6));
  const std::vector<StragglerReport> got = reports_of(*m[0]);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].rank, 2);
  EXPECT_EQ(got[0].host, "c");
  EXPECT_EQ(got[0].phase, "compute");
  EXPECT_LT(got[0].score, 0.75);
  EXPECT_EQ(got[0].last_step, step);
  EXPECT_EQ(got[0].first_step, step - 2 * window + 1);
}

// A rank whose heartbeat round trip to the store is long against the fastest rank's (its
// host's link to the store's host is slow) is reported with the phase "link" after two
// such windows; a healthy spread of round trips (0.05-3 ms) never is.
TEST(Stragglers, SlowLinkIsNamedAfterTwoWindows) {
  const auto flags = slow_links({0.05, 0.3, 60.0, -1.0, 9.0, 14.5});
  EXPECT_EQ(flags, (std::vector<char>{0, 0, 1, 0, 0, 1}));  // 9 ms: below 10 ms
  // A rank whose own work is slow has a starved CPU, which delays its heartbeat too.
  EXPECT_EQ(slow_links({0.05, 60.0}, {0, 1}), (std::vector<char>{0, 0}));
  EXPECT_EQ(slow_links({10.0, 60.0}), (std::vector<char>{0, 0}));  // 60 < 10 x (10 + 1)
  EXPECT_EQ(slow_links({-1.0, -1.0}), (std::vector<char>{0, 0}));  // nothing measured
  // The fastest rank is the one with the lowest baseline (its median), 0.1 ms here: 40 ms is
  // slow against it, not against the 5 ms of its 90th percentile.
  EXPECT_EQ(slow_links({5.0, 40.0}, {}, {0.1, 10.0}), (std::vector<char>{0, 1}));
  EXPECT_EQ(slow_links({5.0, 40.0}), (std::vector<char>{0, 0}));
  auto store = c10::make_intrusive<c10d::HashStore>();
  const int64_t window = 4;
  std::vector<std::unique_ptr<StragglerMonitor>> m;
  for (int r = 0; r < 2; ++r)
    m.push_back(std::make_unique<StragglerMonitor>(store, r, 2, std::vector<std::string>{"a", "b"}, window));
  std::mt19937 gen(9);
  std::uniform_real_distribution<double> jitter(0.05, 3.0);
  int64_t step = StragglerMonitor::kWarmupSteps;  // the warm-up steps are not timed
  auto run_windows = [&](int n, double rank1_ms) {
    for (int w = 0; w < n; ++w)
      for (int64_t k = 0; k < window; ++k) {
        ++step;
        m[0]->add_step(step, 1.0, 0.0, 0.5, {0.05});
        m[1]->add_step(step, 1.0, 0.0, 0.5, {rank1_ms > 0 ? rank1_ms * (0.9 + 0.1 * jitter(gen)) : jitter(gen)});
      }
  };
  run_windows(5, 0);
  ASSERT_TRUE(judged(*m[0], 5));
  EXPECT_TRUE(m[0]->take_reports().empty());
  run_windows(2, 400);
  ASSERT_TRUE(judged(*m[0], 7));
  const std::vector<StragglerReport> got = reports_of(*m[0]);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].rank, 1);
  EXPECT_EQ(got[0].host, "b");
  EXPECT_EQ(got[0].phase, "link");
  EXPECT_GT(got[0].median_s, 0.35);
  EXPECT_NEAR(got[0].fastest_s, 0.05e-3, 1e-9);
  EXPECT_EQ(got[0].first_step, step - 2 * window + 1);
  auto phases = [](double forward, double backward) {
    StepPhases ph;
    ph.forward = forward;
    ph.backward = backward;
    ph.optimizer = 0.05;
    return ph;
  };
  // A rank whose work is slow (a starved CPU: its heartbeat is late too) is a straggler, named
  // for its forward pass: no link is blamed.
  for (int w = 0; w < 2; ++w)
    for (int64_t k = 0; k < window; ++k) {
      ++step;
      m[0]->add_step(step, 1.0, 0.0, 0.5, {0.05}, phases(0.2, 0.2));
      m[1]->add_step(step, 3.0, 0.0, 0.5, {40.0}, phases(0.6, 0.6));
    }
  ASSERT_TRUE(judged(*m[0], 9));
  const std::vector<StragglerReport> busy = reports_of(*m[0]);
  ASSERT_FALSE(busy.empty());
  bool forward = false;
  for (const auto& r : busy) {
    EXPECT_EQ(r.rank, 1);
    EXPECT_NE(r.phase, "link");
    forward = forward || r.phase == "forward";
  }
  EXPECT_TRUE(forward);
}

// A rate-limited link delays the heartbeats that meet its queue while a collective sends
// and not the others: the window's median stays fast, its 90th percentile does not. One
// late heartbeat in twenty (a busy moment) is not a slow link.
TEST(Stragglers, BurstyLinkIsNamedByTheUpperTailOfItsRoundTrips) {
  for (size_t n : {1u, 2u, 9u, 10u, 11u, 20u, 37u}) {
    std::vector<double> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = double((i * 7919) % n);  // a permutation of 0..n-1
    std::vector<double> sorted = v;
    std::sort(sorted.begin(), sorted.end());
    const size_t rank = (9 * n + 9) / 10;  // ceil(0.9 n), nearest rank
    EXPECT_EQ(round_trip_figure(v), sorted[rank - 1]) << n;
  }
  EXPECT_EQ(round_trip_figure({}), -1.0);
  auto store = c10::make_intrusive<c10d::HashStore>();
  const int64_t window = 4;
  std::vector<std::unique_ptr<StragglerMonitor>> m;
  for (int r = 0; r < 2; ++r)
    m.push_back(std::make_unique<StragglerMonitor>(store, r, 2, std::vector<std::string>{"a", "b"}, window));
  int64_t step = StragglerMonitor::kWarmupSteps;
  // Five heartbeats a step; `late` of every 20 in a window (one step in four has them) take 35 ms.
  auto run_windows = [&](int n, int late) {
    for (int w = 0; w < n; ++w)
      for (int64_t k = 0; k < window; ++k) {
        ++step;
        std::vector<double> rt(5, 0.2);
        for (int i = 0; i < 5; ++i)
          if (int(k) * 5 + i < late) rt[i] = 35.0;
        // The store's own host: one late heartbeat a step (its 90th percentile is 9 ms, its
        // median 0.06 ms) does not raise the bar.
        m[0]->add_step(step, 1.0, 0.0, 0.5, {0.05, 0.06, 9.0});
        m[1]->add_step(step, 1.0, 0.0, 0.5, rt);
      }
  };
  run_windows(3, 1);
  ASSERT_TRUE(judged(*m[0], 3));
  EXPECT_TRUE(m[0]->take_reports().empty());
  run_windows(2, 4);  // 4 of 20 late: the median is 0.2 ms, the 90th percentile 35 ms
  ASSERT_TRUE(judged(*m[0], 5));
  const std::vector<StragglerReport> got = reports_of(*m[0]);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].rank, 1);
  EXPECT_EQ(got[0].phase, "link");
  EXPECT_NEAR(got[0].median_s, 35e-3, 1e-12);
  EXPECT_NEAR(got[0].fastest_s, 0.06e-3, 1e-12);
}

// With the phases measured, a rank slow in its backward pass is named for "backward" (not
// for "compute", their sum); a phase one rank did not measure scores 1 for all.
TEST(Stragglers, SlowPhaseIsNamedByItsName) {
  const auto s = straggler_scores({{1.0, 0.0, 0.3, 0.6, 0.1}, {1.6, 0.0, 0.3, 1.2, 0.1}, {1.0, 0.0, -1, 0.6, 0.1}});
  EXPECT_NEAR(s[1][3], (0.6 + 0.1) / (1.2 + 0.1), 1e-12);  // 10% of the fastest step (1.0 s)
  for (int r = 0; r < 3; ++r) EXPECT_EQ(s[r][2], 1.0) << r;  // rank 2 did not time its forward
  auto store = c10::make_intrusive<c10d::HashStore>();
  const int64_t window = 3;
  std::vector<std::unique_ptr<StragglerMonitor>> m;
  for (int r = 0; r < 2; ++r)
    m.push_back(std::make_unique<StragglerMonitor>(store, r, 2, std::vector<std::string>{"a", "b"}, window));
  int64_t step = StragglerMonitor::kWarmupSteps;  // the warm-up steps are not timed
  for (int w = 0; w < 4; ++w)
    for (int64_t k = 0; k < window; ++k) {
      ++step;
      const bool slow = w >= 2;  // rank 1's backward takes 3x as long in windows 2 and 3
      for (int r = 0; r < 2; ++r) {
        StepPhases ph;
        ph.forward = 0.3;
        ph.backward = r == 1 && slow ? 1.8 : 0.6;
        ph.optimizer = 0.1;
        const double work = ph.forward + ph.backward + ph.optimizer;
        const double blocked = slow && r == 0 ? 1.2 : 0.0;  // rank 0 waits for rank 1
        m[r]->add_step(step, work + blocked + 0.01, 0.01, blocked, {0.1}, ph);
      }
    }
  ASSERT_TRUE(judged(*m[0], 4));
  const std::vector<StragglerReport> got = reports_of(*m[0]);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].rank, 1);
  EXPECT_EQ(got[0].phase, "backward");
  EXPECT_NEAR(got[0].median_s, 1.8, 1e-9);
  EXPECT_NEAR(got[0].fastest_s, 0.6, 1e-9);
}

// What the heartbeat thread saw while collectives waited, as the trainer reports a stall.
TEST(LinkWatch, StallNamesTheSilentPeersAndTheStore) {
  LinkWatch w;
  EXPECT_EQ(w.last_answer_ms(), 0);
  EXPECT_TRUE(w.take_round_trips_ms().empty());
  for (double t : {5.0, 1.0, 3.0, 2.0, 400.0}) w.store_answered(1000, t);
  EXPECT_EQ(w.last_answer_ms(), 1000);
  EXPECT_EQ(w.take_round_trips_ms(), (std::vector<double>{5.0, 1.0, 3.0, 2.0, 400.0}));  // as they came
  EXPECT_TRUE(w.take_round_trips_ms().empty());  // taken
  w.silent(2, 1.25);
  w.silent(2, 2.5);
  w.silent(2, 1.5);  // the longest silence is kept
  w.silent(-1, 2.0);
  const LinkWatch::Stall st = w.take_stall();
  ASSERT_EQ(st.silent_s.size(), 2u);
  EXPECT_DOUBLE_EQ(st.silent_s.at(2), 2.5);
  const std::string text = describe_stall(st, [](int r) { return "h" + std::to_string(r); }, "h0");
  EXPECT_EQ(text, "the rendezvous store (host h0) did not answer for 2.0 s; rank 2 (host h2) was silent for 2.5 s");
  EXPECT_TRUE(w.take_stall().empty());
  EXPECT_NE(describe_stall(w.take_stall(), [](int) { return ""; }, "").find("every rank kept beating"), std::string::npos);
  EXPECT_FALSE(is_stall(5.0, 0.0));   // no pace yet
  EXPECT_FALSE(is_stall(0.9, 0.1));   // under a second
  EXPECT_FALSE(is_stall(2.0, 0.7));   // under 3 x the median step
  EXPECT_TRUE(is_stall(2.1, 0.7));
  EXPECT_TRUE(is_stall(1.2, 0.7, /*someone_silent=*/true));   // a silence needs no pace
  EXPECT_FALSE(is_stall(0.9, 0.0, /*someone_silent=*/true));  // but a second's wait
}

}  // namespace
// The network choice's fixed points (the several-hosts cases run in tests/e2e/multihost.sh):
// one host talks over loopback, a user's GLOO_SOCKET_IFNAME wins, a route is the kernel's.
TEST(NetworkPlan, OneHostLoopbackUserVariablesWin) {
  DistEnv one_host = DistEnv::from_map({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "4"},
                                        {"MASTER_ADDR", "10.1.2.3"}});
  NetworkPlan p = plan_network(one_host, nullptr, "");
  EXPECT_EQ(p.gloo_address, "127.0.0.1");
  EXPECT_TRUE(p.gloo_interfaces.empty());
  EXPECT_EQ(p.nccl_interface, "");
  p = plan_network(one_host, "eth1,eth2", nullptr);
  EXPECT_EQ(p.gloo_interfaces, (std::vector<std::string>{"eth1", "eth2"}));
  EXPECT_NE(p.reason.find("GLOO_SOCKET_IFNAME=eth1,eth2"), std::string::npos) << p.reason;
  const LocalInterface lo = route_to("127.0.0.1");
  EXPECT_EQ(lo.address, "127.0.0.1");
  EXPECT_EQ(lo.name, "lo");
  EXPECT_EQ(resolve_ipv4("127.0.0.1"), "127.0.0.1");
  EXPECT_TRUE(is_loopback_ipv4("127.0.1.1"));
  EXPECT_FALSE(is_loopback_ipv4("10.78.0.1"));
  DistEnv two_hosts = DistEnv::from_map({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "2"},
                                         {"MASTER_ADDR", "no-such-host.invalid"}});
  try {
    plan_network(two_hosts, nullptr, nullptr);
    ADD_FAILURE() << "an unresolvable MASTER_ADDR was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("MASTER_ADDR 'no-such-host.invalid' does not resolve"), std::string::npos)
        << e.what();
  }
}

// A window closes after `window` steps or once its steps add up to window_s seconds,
// whichever comes first. At the defaults (50 steps, 10 s), two ranks stepping at 0.1 s close
// windows by their count; rank 1 slowed to 1.5 s a step (rank 0 waiting for it) for 60 s, 40
// steps, is named after two windows of 7 steps (10.5 s each), well within the slowdown, with
// the steps of those two windows, and rank 0 is never named. Counted in steps alone (the
// control: window_s beyond reach) the same slowdown ends before the first slow window.
TEST(Stragglers, WindowClosesAfterItsStepsOrItsSecondsWhicheverFirst) {
  struct Seen {
    std::vector<StragglerReport> reports;
    int64_t judged = 0;
  };
  // windows: how many the run closes (2 healthy; then 7-step windows to step 145, or one of
  // 50 steps to step 160).
  auto run = [](double window_s, int64_t windows) {
    auto store = c10::make_intrusive<c10d::HashStore>();
    const int64_t window = 50;
    std::vector<std::unique_ptr<StragglerMonitor>> m;
    for (int r = 0; r < 2; ++r)
      m.push_back(
          std::make_unique<StragglerMonitor>(store, r, 2, std::vector<std::string>{"a", "b"}, window, window_s));
    std::mt19937 gen(3);
    std::uniform_real_distribution<double> jitter(0.95, 1.05);
    int64_t step = StragglerMonitor::kWarmupSteps;
    Seen seen;
    auto steps = [&](int64_t n, double slow_s) {
      for (int64_t k = 0; k < n; ++k) {
        ++step;
        const double fast = 0.1 * jitter(gen), slow = slow_s > 0 ? slow_s * jitter(gen) : fast;
        m[0]->add_step(step, slow + 0.001, 0.001, slow - fast);  // rank 0 waits for rank 1 in its collectives
        m[1]->add_step(step, slow + 0.001, 0.001, 0.0);
      }
    };
    steps(100, 0);  // 10 s of healthy steps: two windows of 50
    EXPECT_TRUE(judged(*m[0], 2));
    EXPECT_EQ(m[0]->windows_judged(), 2) << "a healthy window closed before its 50 steps";
    EXPECT_TRUE(m[0]->take_reports().empty());
    steps(40, 1.5);  // 60 s at 1.5 s a step
    steps(20, 0);
    EXPECT_TRUE(judged(*m[0], windows));
    seen.judged = m[0]->windows_judged();
    seen.reports = m[0]->take_reports();
    return seen;
  };
  const Seen timed = run(StragglerMonitor::kWindowSeconds, 7);
  EXPECT_EQ(timed.judged, 7);
  ASSERT_FALSE(timed.reports.empty()) << "rank 1, slowed to 1.5 s a step for 60 s, was never named";
  for (const auto& r : timed.reports) EXPECT_EQ(r.rank, 1) << "rank " << r.rank << " named for " << r.phase;
  const StragglerReport& first = timed.reports.front();
  EXPECT_EQ(first.phase, "compute");
  // The slow steps are 111-150: 7-step windows (10.5 s >= 10 s) from step 111, named at the
  // end of the second, step 124.
  EXPECT_EQ(first.first_step, 111);
  EXPECT_EQ(first.last_step, 124);
  EXPECT_NEAR(first.median_s, 1.5, 0.08);
  const Seen counted = run(1e9, 3);
  EXPECT_EQ(counted.judged, 3);
  EXPECT_TRUE(counted.reports.empty()) << "windows of 50 steps named a 40-step slowdown";
}

}  // namespace faceshard
