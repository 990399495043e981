// faceshard-bench: performance measurements as runnable benchmarks (never timed tests).
//   --mode classifier   the sharded classifier alone (gather, cosines, margin softmax,
//                       backward, shard optimiser) on random embeddings
// Reports the median time per step over several timed windows after warm-up, images/s,
// and peak memory (GPU: the caching allocator's peak; CPU: the process's peak RSS), as a
// one-line summary and, with --json FILE, a JSON object.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#ifdef FACESHARD_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include "partial_fc/dist_env.h"
#include "partial_fc/distributed.h"
#include "partial_fc/error.h"
#include "partial_fc/log.h"
#include "partial_fc/partial_fc.h"
#include "partial_fc/shard_optimizer.h"

using namespace faceshard;

namespace {

const char* kUsage =
    "usage: faceshard-bench --mode classifier [--classes-per-shard N] [--sample-rate R] [--batch B]\n"
    "                       [--dim D] [--steps K] [--windows N] [--warmup K] [--device cpu|cuda] [--json FILE]\n";

struct Args {
  std::string mode = "classifier";
  int64_t classes_per_shard = 100000, batch = 128, dim = 512, steps = 5, windows = 3, warmup = 2;
  double sample_rate = 1.0;
  std::string device = "cpu", json;
};

int64_t read_status_kb(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(key, 0) == 0) return std::atoll(line.c_str() + std::strlen(key));
  return -1;
}

void reset_peak_rss() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";  // resets the peak resident set size (VmHWM)
}

double peak_bytes(bool cuda) {
#ifdef FACESHARD_WITH_CUDA
  if (cuda) {
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(c10::cuda::current_device());
    return static_cast<double>(stats.allocated_bytes[0].peak);
  }
#endif
  return read_status_kb("VmHWM:") * 1024.0;
}

void reset_peak(bool cuda) {
#ifdef FACESHARD_WITH_CUDA
  if (cuda) {
    c10::cuda::CUDACachingAllocator::resetPeakStats(c10::cuda::current_device());
    return;
  }
#endif
  reset_peak_rss();
}

void sync_device(bool cuda) {
#ifdef FACESHARD_WITH_CUDA
  if (cuda) c10::cuda::device_synchronize();
#endif
}

int64_t parse_int(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end || x < 0) throw usage_error(flag, " expects a non-negative integer, got '", v, "'");
  return x;
}

int run_classifier(const Args& a, Distributed& dist) {
  const bool cuda = a.device == "cuda";
  torch::Device dev = cuda ? torch::Device(torch::kCUDA, dist.local_rank()) : torch::Device(torch::kCPU);
  PartialFCOptions o;
  o.num_classes = a.classes_per_shard * dist.world_size();
  o.embedding_size = a.dim;
  o.sample_rate = a.sample_rate;
  o.margin = CombinedMargin{1.0, 0.5, 0.0};
  PartialFC fc(dist, o, dev);
  ShardOptimizer opt(fc, ShardOptimizerOptions{});
  auto opts = torch::TensorOptions().device(dev);
  torch::manual_seed(dist.rank());
  at::Tensor emb = torch::randn({a.batch, a.dim}, opts).requires_grad_();
  at::Tensor labels = torch::randint(0, o.num_classes, {a.batch}, opts.dtype(torch::kLong));
  auto step = [&] {
    auto out = fc.forward(emb, labels);
    out.loss.backward();
    opt.step(0.1);
    emb.mutable_grad().reset();
  };
  for (int64_t i = 0; i < a.warmup; ++i) step();
  sync_device(cuda);
  reset_peak(cuda);
  std::vector<double> per_step;
  for (int64_t w = 0; w < a.windows; ++w) {
    dist.barrier();
    auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < a.steps; ++i) step();
    sync_device(cuda);
    per_step.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / a.steps);
  }
  std::sort(per_step.begin(), per_step.end());
  const double median = per_step[per_step.size() / 2];
  const double peak = peak_bytes(cuda);
  const double state_bytes = static_cast<double>(fc.weight().numel()) * 4 * 2;  // weight + momentum
  std::ostringstream js;
  js << "{\"mode\":\"classifier\",\"device\":\"" << a.device << "\",\"world_size\":" << dist.world_size()
     << ",\"classes_per_shard\":" << fc.shard().count << ",\"sample_rate\":" << a.sample_rate
     << ",\"sampled_classes\":" << fc.num_sample() << ",\"batch_per_rank\":" << a.batch << ",\"dim\":" << a.dim
     << ",\"step_ms\":" << median * 1e3 << ",\"images_per_s\":" << a.batch * dist.world_size() / median
     << ",\"peak_memory_mb\":" << peak / 1048576.0 << ",\"shard_state_mb\":" << state_bytes / 1048576.0 << "}";
  log_info("classifier: ", fc.shard().count, " classes/shard, sample rate ", a.sample_rate, " (", fc.num_sample(),
           " sampled), batch ", a.batch, "x", dist.world_size(), ", dim ", a.dim, " on ", a.device, ": ",
           median * 1e3, " ms/step, ", a.batch * dist.world_size() / median, " images/s, peak ",
           peak / 1048576.0, " MB (", cuda ? "GPU allocated" : "process RSS", "; shard weight+momentum ",
           state_bytes / 1048576.0, " MB)");
  if (!a.json.empty() && dist.rank() == 0) {
    std::string tmp = a.json + ".tmp";
    std::ofstream(tmp) << js.str() << "\n";
    std::rename(tmp.c_str(), a.json.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return run_main("faceshard-bench", [&] {
    Args a;
    for (int i = 1; i < argc; ++i) {
      std::string s = argv[i];
      auto value = [&]() -> std::string {
        if (i + 1 >= argc) throw usage_error(s, " needs a value");
        return argv[++i];
      };
      if (s == "--help" || s == "-h") {
        std::fputs(kUsage, stdout);
        return 0;
      } else if (s == "--mode") a.mode = value();
      else if (s == "--classes-per-shard") a.classes_per_shard = parse_int(s, value());
      else if (s == "--batch") a.batch = parse_int(s, value());
      else if (s == "--dim") a.dim = parse_int(s, value());
      else if (s == "--steps") a.steps = std::max<int64_t>(1, parse_int(s, value()));
      else if (s == "--windows") a.windows = std::max<int64_t>(1, parse_int(s, value()));
      else if (s == "--warmup") a.warmup = parse_int(s, value());
      else if (s == "--sample-rate") a.sample_rate = std::atof(value().c_str());
      else if (s == "--device") a.device = value();
      else if (s == "--json") a.json = value();
      else throw usage_error("unknown argument '", s, "' (see --help)");
    }
    if (a.device != "cpu" && a.device != "cuda") throw usage_error("--device must be cpu or cuda");
    if (a.sample_rate <= 0 || a.sample_rate > 1) throw usage_error("--sample-rate must be in (0, 1]");
    DistOptions dopts;
    dopts.use_cuda = a.device == "cuda";
    auto dist = Distributed::init(DistEnv::from_environment(), dopts);
    if (a.mode == "classifier") return run_classifier(a, *dist);
    throw usage_error("--mode '", a.mode, "' is not known (classifier)");
  });
}
