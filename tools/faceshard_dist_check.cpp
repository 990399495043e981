// faceshard-dist-check: checks that the ranks of a job really communicate. Every round
// all-reduces, all-gathers and broadcasts known values and verifies the closed-form
// results; a rank that dies or hangs makes the others exit non-zero naming it. With
// --trace DIR it reads the collective traces a run's ranks wrote (a training run's
// <output>/trace) and names the ranks that never entered the collective the others waited in.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>

#include "partial_fc/distributed/collective_trace.h"
#include "partial_fc/distributed/dist_env.h"
#include "partial_fc/distributed/distributed.h"
#include "base/error.h"
#include "base/log.h"
#include "base/tool_args.h"

using namespace faceshard;

namespace {

bool holds_trace_files(const std::filesystem::path& dir) {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("rank", 0) == 0 && name.size() > 10 && name.substr(name.size() - 6) == ".jsonl") return true;
  }
  return false;
}

// --trace takes the folder of the trace files or the folder a run wrote them under (its
// output folder, whose trace/ holds them): the user names the run, not its layout.
std::string trace_folder(const std::string& dir) {
  const std::filesystem::path inner = std::filesystem::path(dir) / "trace";
  std::error_code ec;
  if (std::filesystem::is_directory(dir, ec) && !holds_trace_files(dir)) {
    if (std::filesystem::is_directory(inner, ec) && holds_trace_files(inner)) return inner.string();
    throw usage_error("--trace '", dir, "': no trace files (rank<r>.jsonl) in it or in its trace/ folder");
  }
  return dir;
}

const char* kUsage =
    "usage: faceshard-dist-check [--rounds N] [--interval-ms MS] [--timeout-s S] [--rendezvous-timeout-s S]\n"
    "                            [--numel N] [--cuda] [--output DIR]\n"
    "       faceshard-dist-check --trace DIR\n"
    "Start it with tools/launch.sh --nproc N, torchrun --no-python or srun; alone it runs one rank.\n"
    "  --output DIR   each rank writes its collective trace to DIR/trace/rank<r>.jsonl when a\n"
    "                 collective fails or hangs, or on SIGUSR1\n"
    "  --trace DIR    read the trace files in DIR (rank<r>.jsonl), or in DIR/trace (a run's output\n"
    "                 folder, or this tool's --output), and print the verdict: the\n"
    "                 collective some ranks waited in and the ranks (hosts) that never entered it\n";

double parse_num(const char* flag, const std::string& text) {
  const char* v = text.c_str();
  char* end = nullptr;
  double x = std::strtod(v, &end);
  if (!v[0] || *end || x < 0) throw usage_error(flag, " expects a non-negative number, got '", v, "'");
  return x;
}

}  // namespace

int main(int argc, char** argv) {
  return run_main("faceshard-dist-check", [&] {
    int64_t rounds = 20, numel = 1 << 16;
    double interval_ms = 100, timeout_s = 30, rendezvous_timeout_s = 300;
    bool cuda = false;
    std::string output, trace;
    ToolArgs args(argc, argv);
    while (args.next()) {
      const std::string a = args.flag();
      auto value = [&]() { return args.value(); };
      if (a == "--help" || a == "-h") {
        std::fputs(kUsage, stdout);
        return 0;
      } else if (a == "--rounds") rounds = static_cast<int64_t>(parse_num("--rounds", value()));
      else if (a == "--interval-ms") interval_ms = parse_num("--interval-ms", value());
      else if (a == "--timeout-s") timeout_s = parse_num("--timeout-s", value());
      else if (a == "--rendezvous-timeout-s") rendezvous_timeout_s = parse_num("--rendezvous-timeout-s", value());
      else if (a == "--numel") numel = std::max<int64_t>(1, static_cast<int64_t>(parse_num("--numel", value())));
      else if (a == "--cuda") cuda = true;
      else if (a == "--output") output = value();
      else if (a == "--trace") trace = value();
      else args.unknown();
    }
    if (!trace.empty()) {
      for (const std::string& line : trace_verdict(read_run_traces(trace_folder(trace)))) std::printf("%s\n", line.c_str());
      return 0;
    }
    DistOptions opts;
    opts.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
    opts.rendezvous_timeout = std::chrono::milliseconds(static_cast<int64_t>(rendezvous_timeout_s * 1000));
    opts.use_cuda = cuda;
    auto dist = Distributed::init(DistEnv::from_environment(), opts);
    const int W = dist->world_size(), r = dist->rank();
    if (!output.empty()) dist->set_trace_dir(output + "/trace");
    std::vector<double> round_s;
    log_info("faceshard-dist-check: ", dist->env().describe(), ", ", rounds, " rounds");
    auto dev = cuda ? torch::Device(torch::kCUDA, dist->local_rank()) : torch::Device(torch::kCPU);
    auto t0 = std::chrono::steady_clock::now();
    for (int64_t k = 0; k < rounds; ++k) {
      // Each round is a step: after five, hangs are judged against the median round.
      const auto t_round = std::chrono::steady_clock::now();
      dist->set_context(k + 1, "step");
      at::Tensor x = torch::full({numel}, static_cast<float>(r + 1 + k), torch::TensorOptions().device(dev));
      dist->all_reduce(x);
      const double expect = W * (W + 1) / 2.0 + static_cast<double>(W) * k;
      if (x.min().item<double>() != expect || x.max().item<double>() != expect)
        throw runtime_error("round ", k, ": all_reduce gave ", x.max().item<double>(), ", expected ", expect);
      at::Tensor g = dist->all_gather(torch::full({1}, static_cast<float>(r), torch::TensorOptions().device(dev)));
      at::Tensor ranks = torch::arange(W, torch::TensorOptions().dtype(torch::kFloat).device(dev));
      if (!torch::equal(g, ranks)) throw runtime_error("round ", k, ": all_gather returned the wrong ranks");
      at::Tensor b = torch::full({1}, static_cast<float>(r == k % W ? 1000 + k : -1), torch::TensorOptions().device(dev));
      dist->broadcast(b, static_cast<int>(k % W));
      if (b.item<double>() != 1000 + k) throw runtime_error("round ", k, ": broadcast from rank ", k % W, " failed");
      if ((k + 1) % std::max<int64_t>(1, rounds / 5) == 0 || k + 1 == rounds)
        log_info("round ", k + 1, "/", rounds, " ok: all_reduce of ", numel, " floats over ", W, " ranks = ", expect);
      std::this_thread::sleep_for(std::chrono::microseconds(static_cast<int64_t>(interval_ms * 1000)));
      round_s.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t_round).count());
      if (round_s.size() >= 5) {
        std::vector<double> v(round_s.end() - std::min<size_t>(round_s.size(), 51), round_s.end());
        std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
        dist->set_step_seconds(v[v.size() / 2]);
      }
    }
    dist->set_context(rounds, "finish");
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    dist->shutdown();
    log_info("faceshard-dist-check: all ", rounds, " rounds verified on ", W, " ranks in ", secs, " s");
    return 0;
  });
}
