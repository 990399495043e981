#include "tests/harness.h"
#include "tests/test_paths.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "base/error.h"
#include "base/log.h"

namespace faceshard::testing {
namespace {

std::string current_test() {
  auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return std::string(info->test_suite_name()) + "." + info->name();
}

// Which run_ranks/spawn_ranks call of the current test this is (children count the same way).
int next_call_index() {
  static std::map<std::string, int> calls;
  return calls[current_test()]++;
}

const char* env_or_null(const char* k) {
  const char* v = std::getenv(k);
  return (v && *v) ? v : nullptr;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Printed by a rank process after its body returned without a failure; the parent requires
// it from every rank, so a rank that ran no body (a filter or call index that selects
// nothing) cannot pass for one that did.
constexpr const char* kBodyDone = "[harness] rank body done: call ";

[[noreturn]] void run_child(const RankBody& body, const RankOptions& opts, int call) {
  int code = 0;
  try {
    DistOptions dopts;
    dopts.timeout = opts.collective_timeout;
    dopts.rendezvous_timeout = std::chrono::seconds(60);
    dopts.heartbeat_interval = std::chrono::milliseconds(200);
    auto dist = Distributed::init(DistEnv::from_environment(), dopts);
    body(*dist);
    if (::testing::Test::HasFailure()) {
      dist->publish_failure("test assertion failed");
      code = 1;
    } else {
      dist->shutdown();
      std::printf("%s%d\n", kBodyDone, call);
    }
  } catch (const std::exception& e) {
    report_fatal("faceshard_tests", one_line(e));
    code = 1;
  }
  std::fflush(stdout);
  std::fflush(stderr);
  _exit(code);
}

}  // namespace

double relative_error(const at::Tensor& a, const at::Tensor& b, ErrorNorm norm) {
  const at::Tensor x = a.detach().to(at::kDouble), y = b.detach().to(at::kDouble);
  if (norm == ErrorNorm::Max)
    return (x - y).abs().max().item<double>() / std::max(y.abs().max().item<double>(), 1e-12);
  return (x - y).norm().item<double>() / std::max(y.norm().item<double>(), 1e-20);
}

bool in_rank_process() { return env_or_null("FS_HARNESS_CALL") != nullptr; }

namespace {
// Folders made by temp_dir() in this process, removed when it exits normally (rank
// processes leave through _exit and keep theirs for the parent to read).
struct TempDirs {
  std::mutex mu;
  std::vector<std::string> paths;
  void remove() {
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& p : paths) {
      std::error_code ec;
      std::filesystem::remove_all(p, ec);
    }
    paths.clear();
  }
  ~TempDirs() { remove(); }
};
TempDirs& temp_dirs() {
  static TempDirs dirs;
  return dirs;
}
}  // namespace

std::string temp_dir(const std::string& tag) {
  std::string tmpl = (env_or_null("TMPDIR") ? std::string(env_or_null("TMPDIR")) : std::string("/tmp")) +
                     "/faceshard-test-" + tag + "-XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (!mkdtemp(buf.data())) throw std::runtime_error("mkdtemp failed for " + tmpl);
  std::string path(buf.data());
  TempDirs& dirs = temp_dirs();
  std::lock_guard<std::mutex> lock(dirs.mu);
  dirs.paths.push_back(path);
  return path;
}

void remove_temp_dirs() { temp_dirs().remove(); }

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream os;
  os << f.rdbuf();
  return os.str();
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
  if (!f) throw std::runtime_error("cannot write " + path);
}

CommandResult run_command(const std::string& command) {
  CommandResult r;
  std::FILE* p = ::popen((command + " 2>&1").c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.output.append(buf, n);
  const int st = ::pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

CommandResult run_tool(const std::string& tool, const std::string& args) {
  return run_command(std::string("\"") + FACESHARD_BIN_DIR + "/" + tool + "\" " + args);
}

CommandResult run_python(const std::string& dir, const std::string& name, const std::string& script,
                         const std::vector<std::string>& args) {
  const std::string path = dir + "/" + name;
  write_text(path, script);
  std::string cmd = std::string("\"") + FACESHARD_PYTHON + "\" \"" + path + "\"";
  for (const auto& a : args) cmd += " \"" + a + "\"";
  return run_command(cmd);
}

std::vector<RankResult> spawn_ranks(int world, const RankBody& body, const RankOptions& opts) {
  const int call = next_call_index();
  if (in_rank_process()) {
    if (std::atoi(env_or_null("FS_HARNESS_CALL")) == call) run_child(body, opts, call);
    return {};  // another call of this test runs in this process; skip this one
  }

  // The parent hosts the store on an ephemeral port, like torchrun's agent.
  c10d::TCPStoreOptions so;
  so.port = 0;
  so.isServer = true;
  so.waitWorkers = false;
  so.multiTenant = true;
  auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
  const int port = store->getPort();

  const std::string dir = temp_dir("ranks");
  std::vector<pid_t> pids(world, -1);
  std::vector<RankResult> results(world);
  for (int r = 0; r < world; ++r) {
    results[r].rank = r;
    const std::string out = dir + "/rank" + std::to_string(r) + ".log";
    pid_t pid = fork();
    if (pid < 0) throw std::runtime_error("fork failed");
    if (pid == 0) {
      int fd = open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      dup2(fd, 1);
      dup2(fd, 2);
      close(fd);
      setenv("FS_HARNESS_CALL", std::to_string(call).c_str(), 1);
      setenv("RANK", std::to_string(r).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      setenv("LOCAL_WORLD_SIZE", std::to_string(world).c_str(), 1);
      setenv("MASTER_ADDR", "127.0.0.1", 1);
      setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1);
      setenv("TORCHELASTIC_RESTART_COUNT", "0", 1);
      setenv("FACESHARD_LOG_ALL_RANKS", "1", 1);
      setenv("OMP_NUM_THREADS", "1", 1);
      for (auto& kv : opts.env) setenv(kv.first.c_str(), kv.second.c_str(), 1);
      std::string filter = "--gtest_filter=" + current_test();
      execl("/proc/self/exe", "faceshard_tests", filter.c_str(), "--gtest_brief=1", (char*)nullptr);
      _exit(127);
    }
    pids[r] = pid;
  }

  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + opts.timeout;
  auto grace_deadline = Clock::time_point::max();
  int alive = world;
  while (alive > 0) {
    for (int r = 0; r < world; ++r) {
      if (pids[r] < 0) continue;
      int status = 0;
      pid_t w = waitpid(pids[r], &status, WNOHANG);
      if (w == pids[r]) {
        pids[r] = -1;
        alive--;
        if (WIFEXITED(status)) results[r].exit_code = WEXITSTATUS(status);
        if (WIFSIGNALED(status)) results[r].signal = WTERMSIG(status);
        if (results[r].exit_code != 0 && grace_deadline == Clock::time_point::max()) {
          // The others must notice within their collective timeout (plus diagnosis).
          grace_deadline = Clock::now() + opts.collective_timeout + std::chrono::seconds(5);
        }
      }
    }
    if (alive == 0) break;
    if (Clock::now() > deadline || Clock::now() > grace_deadline) {
      for (int r = 0; r < world; ++r)
        if (pids[r] > 0) {
          kill(pids[r], SIGKILL);
          waitpid(pids[r], nullptr, 0);
          results[r].killed_by_harness = true;
          results[r].signal = SIGKILL;
          pids[r] = -1;
        }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (int r = 0; r < world; ++r) {
    results[r].output = read_file(dir + "/rank" + std::to_string(r) + ".log");
    results[r].body_done = results[r].output.find(kBodyDone + std::to_string(call) + "\n") != std::string::npos;
    std::remove((dir + "/rank" + std::to_string(r) + ".log").c_str());
  }
  rmdir(dir.c_str());
  return results;
}

std::vector<std::string> rank_failures(const std::vector<RankResult>& results) {
  std::vector<std::string> failures;
  for (const auto& r : results) {
    if (r.exit_code == 0 && r.signal == 0 && r.body_done) continue;
    std::string tail = r.output.size() > 4000 ? r.output.substr(r.output.size() - 4000) : r.output;
    failures.push_back("rank " + std::to_string(r.rank) + "/" + std::to_string(results.size()) +
                       (r.killed_by_harness ? " was killed after the time limit"
                        : r.signal          ? " died with signal " + std::to_string(r.signal)
                        : r.exit_code != 0  ? " exited with status " + std::to_string(r.exit_code)
                                            : " exited 0 without running its body") +
                       "; its output:\n" + tail);
  }
  return failures;
}

void run_ranks(int world, const RankBody& body, const RankOptions& opts) {
  for (const std::string& f : rank_failures(spawn_ranks(world, body, opts))) ADD_FAILURE() << f;
}

}  // namespace faceshard::testing
