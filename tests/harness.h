// Multi-rank test harness: a test body runs in N real processes of this test binary,
// connected over Gloo through a TCPStore hosted by the parent (as torchrun's agent does).
// The parent collects exit codes and output and fails the test, never hangs, when a rank
// dies, throws or times out.
#pragma once
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "partial_fc/distributed/distributed.h"

namespace faceshard::testing {

struct RankOptions {
  std::chrono::seconds timeout{180};                    // whole run
  std::chrono::milliseconds collective_timeout{60000};  // each collective inside the ranks
  std::vector<std::pair<std::string, std::string>> env;  // extra environment for the ranks
};

struct RankResult {
  int rank = 0;
  int exit_code = -1;  // -1 when killed by a signal
  int signal = 0;
  bool killed_by_harness = false;
  bool body_done = false;  // the rank printed the harness's line after its body returned cleanly
  std::string output;  // stdout + stderr
};

using RankBody = std::function<void(Distributed& dist)>;

// Runs body on `world` ranks and returns each rank's result (does not judge them).
std::vector<RankResult> spawn_ranks(int world, const RankBody& body, const RankOptions& opts = {});

// What is wrong with each rank of a run, one message per rank that did not exit 0 after
// running its body without a failure (a rank that exits 0 having run no body is one).
std::vector<std::string> rank_failures(const std::vector<RankResult>& results);

// Runs body on `world` ranks and adds a test failure, with the rank's output, for every
// rank that did not exit cleanly (including failed EXPECTs inside the body) or did not
// run its body.
void run_ranks(int world, const RankBody& body, const RankOptions& opts = {});

// How far `a` is from the reference `b`, relative to the reference, in float64:
// L2: ||a - b|| / ||b|| (Frobenius norms); Max: max|a - b| / max|b|. (A zero reference
// counts as a tiny one, so any difference from it is large.)
enum class ErrorNorm { L2, Max };
double relative_error(const at::Tensor& a, const at::Tensor& b, ErrorNorm norm = ErrorNorm::L2);

// True inside a rank process.
bool in_rank_process();

// Holds another thread back (e.g. a background checkpoint write, from the writer's thread)
// until the test opens it.
struct Gate {
  std::mutex m;
  std::condition_variable cv;
  bool opened = false;
  void wait() {
    std::unique_lock<std::mutex> lock(m);
    cv.wait(lock, [&] { return opened; });
  }
  void open() {
    {
      std::lock_guard<std::mutex> lock(m);
      opened = true;
    }
    cv.notify_all();
  }
};

// Path of a fresh temporary directory (removed at exit of the parent test process).
std::string temp_dir(const std::string& tag);
// Removes the folders temp_dir() made in this process (main() calls it before leaving).
void remove_temp_dirs();

// Whole files as text (empty when missing) and back.
std::string read_text(const std::string& path);
void write_text(const std::string& path, const std::string& text);

struct CommandResult {
  int status = -1;  // exit status; -1 when it did not exit normally
  std::string output;  // stdout + stderr
};
// Runs a shell command line and collects its exit status and output.
CommandResult run_command(const std::string& command);
// Runs build/bin/<tool> with an argument string (already quoted as needed).
CommandResult run_tool(const std::string& tool, const std::string& args);
// Writes `script` to dir/name and runs it with the project's Python (the virtual
// environment's, which has numpy) and the given arguments.
CommandResult run_python(const std::string& dir, const std::string& name, const std::string& script,
                         const std::vector<std::string>& args);

}  // namespace faceshard::testing
