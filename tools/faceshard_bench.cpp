// faceshard-bench: performance measurements as runnable benchmarks (never timed tests).
//   --mode classifier   the sharded classifier alone (gather, cosines, margin softmax,
//                       backward, shard optimiser) on random embeddings
//   --mode step         one whole training step (app/train/train_step.h, the trainer's own):
//                       data wait, backbone + classifier forward, backward with DDP, the
//                       optimisers; on the synthetic data set unless --config names a job
//   --mode data         the training data loader alone (read, JPEG decode, flip, normalise,
//                       batch) for several worker counts; --data a folder with train.rec/idx
//                       (default: a synthetic face set written to a temporary folder),
//                       after a single-threaded "decode+normalise only" baseline (no loader)
//   --mode activations  each backbone's activation memory per image (forward + backward,
//                       app/plan/activation_probe.h) for every precision x checkpointing:
//                       the table faceshard-plan ships (app/plan/activations.json)
// Reports the median time per step over several timed windows after warm-up, images/s,
// and peak memory (GPU: the caching allocator's peak; CPU: the process's peak RSS, and the
// peak of the tensors' bytes counted at c10's CPU allocator, app/plan/allocation_meter.h),
// as a one-line summary and, with --json FILE, a JSON object.
#include <algorithm>
#include <functional>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <sstream>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <malloc.h>
#include <unistd.h>

#include <torch/version.h>

#include <ATen/CPUGeneratorImpl.h>

#ifdef FACESHARD_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include "app/config/config.h"
#include "app/io/checkpoint.h"
#include "app/io/metrics_log.h"
#include "app/plan/activation_probe.h"
#include "app/plan/activation_table.h"
#include "app/plan/allocation_meter.h"
#include "models/backbone_registry.h"
#include "app/train/graph_status.h"
#include "app/train/train_job.h"
#include "app/train/train_step.h"
#include "data/dataset.h"
#include "data/image_transform.h"
#include "data/loader.h"
#include "data/sampler.h"
#include "data/synthetic_faces.h"
#include "base/cpu_block_cache.h"
#include "partial_fc/distributed/dist_env.h"
#include "partial_fc/distributed/distributed.h"
#include "base/error.h"
#include "partial_fc/distributed/network.h"
#include "base/log.h"
#include "partial_fc/classifier/partial_fc.h"
#include "base/op_counter.h"
#include "base/tool_args.h"

using namespace faceshard;

namespace {

const char* kUsage =
    "usage: faceshard-bench --mode classifier [--classes-per-shard LIST] [--sample-rate LIST] [--precision LIST]\n"
    "                       [--batch B] [--dim D] [--steps K] [--windows N] [--warmup K]\n"
    "                       [--heads LIST] [--fc-state-dtype LIST] [--fc-weight-dtype LIST] [--logits LIST]\n"
    "                       [--row-update LIST] [--chunking LIST] [--chunk-budget-mib M] [--chunk-rows N]\n"
    "                       [--device cpu|cuda] [--json FILE]\n"
    "       faceshard-bench --mode step [--network NAME] [--batch B] [--classes C] [--sample-rate R]\n"
    "                       [--precision fp32|bf16|fp16] [--device cpu|cuda] [--config FILE] [--set key=value ...]\n"
    "                       [--steps K] [--windows N] [--warmup K] [--json FILE]\n"
    "       faceshard-bench --mode data [--data DIR] [--workers LIST] [--batch B] [--epochs E]\n"
    "                       [--identities N] [--images-per-identity M] [--json FILE]\n"
    "       faceshard-bench --mode data --open-only --data DIR [--index-cache DIR|off] [--json FILE]\n"
    "       faceshard-bench --mode storage [--identities N] [--dim D] [--epochs E] [--batch B] [--seeds LIST]\n"
    "                       [--json FILE]\n"
    "       faceshard-bench --mode activations [--network LIST] [--precision LIST] [--checkpointing LIST]\n"
    "                       [--batches LIST] [--json FILE]\n"
    "  --network LIST   (activations) networks, default mbf,mbf_small,r18,r50,vit_t\n"
    "  --checkpointing LIST  (activations) off,on (default both; MobileFaceNet has none)\n"
    "  --batches LIST   (activations) batch sizes; the slope between the first and the last (default 2,6)\n"
    "  --mode storage   does the classifier still learn with bf16 centres? The classifier alone on\n"
    "                   fixed synthetic embeddings (N identities, each a random prototype; 5 noisy\n"
    "                   views per identity to train on, 5 fresh ones to test), SGD with the learning\n"
    "                   rate decaying linearly to 1% of its peak: fp32 centres, bf16 with stochastic\n"
    "                   rounding, bf16 rounded to nearest, each seed of --seeds (default 1,2,3); final\n"
    "                   loss, test accuracy and the share of updates rounding lost\n"
    "  --open-only      open DIR's train.rec/.idx, look every image key up once, read the\n"
    "                   records at the layout's boundaries; report time and memory\n"
    "  --workers LIST   comma-separated decoding thread counts; 'all' = every core (default 1,2,all)\n"
    "  --fc-state-dtype LIST  the classifier's optimiser state: fp32, bf16 (default fp32)\n"
    "  --fc-weight-dtype LIST  the classifier's centres: fp32, bf16 (stochastic rounding; default fp32)\n"
    "  --logits LIST    the margin softmax: buffer (the logits held), streamed (never held); default buffer\n"
    "  --row-update LIST  the step's update of the rows: onepass (SGD on the CPU: one pass over each row\n"
    "                   where it lives), generic (gather, update, scatter); default onepass\n"
    "  --chunking LIST  the classifier's chunks: auto (the device's), cache (the CPU's), budget (a GPU's: chunk\n"
    "                   temporaries of --chunk-budget-mib, default 2048); on the CPU, budget counts the\n"
    "                   operators (ops_per_step) a GPU would launch\n"
    "  --chunk-rows N   every chunk N rows whatever the policy (0: the policy's)\n";

struct Args {
  std::string mode = "classifier";
  int64_t batch = 128, dim = 512, steps = 5, windows = 3, warmup = 2;
  double sample_rate = 1.0;
  // --mode classifier: comma-separated lists, every combination is measured
  std::string classes_list = "100000", rates = "1.0", precisions = "fp32", heads = "combined", states = "fp32",
              updates = "onepass", weights = "fp32", logits = "buffer", chunking = "auto";
  int64_t chunk_budget_mib = 0, chunk_rows = 0;
  std::string device = "cpu", json, seeds = "1,2,3";
  // --mode data
  std::string data, workers = "1,2,all";
  int64_t epochs = 2, identities = 200, images_per_identity = 25;
  bool batch_given = false, open_only = false;
  std::optional<std::string> index_cache;
  // --mode step: settings given on the command line (others: the config's or its defaults)
  std::optional<std::string> network, precision;
  std::optional<int64_t> classes;
  bool sample_rate_given = false, device_given = false;
  std::string config;
  std::vector<std::string> overrides;
  // --mode activations
  std::string checkpointing = "off,on", batches = "2,6";
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

// A --json file that cannot be written is an error (one line, exit 1), never a silent loss
// of the measurement: written whole under a temporary name, synced, renamed.
void write_json(const std::string& path, const std::string& text) {
  if (path.empty()) return;
  faceshard::write_text_durably(text + "\n", path);
}

// Does the classifier still learn with its centres in bf16? The classifier alone, trained on
// fixed embeddings: identity c is a random unit prototype p_c, an image of it the unit vector
// of p_c + noise (per dimension N(0, 3 / sqrt(d)): hard enough that the centres need many
// small updates late in the schedule). Three storages, the same data, batches and
// schedule: fp32 centres; bf16 stochastically rounded; bf16 rounded to nearest.
int run_storage(const Args& a) {
  auto dist = Distributed::init(DistEnv{});
  const int64_t C = a.identities, d = a.dim, views = 5, B = a.batch;
  struct Row {
    std::string storage;
    int64_t seed;
    double loss, accuracy, lost;
  };
  std::vector<Row> rows;
  for (const std::string& seed_text : split_list(a.seeds)) {
    const int64_t seed = parse_int("--seeds", seed_text);
    torch::manual_seed(seed);
    namespace F = torch::nn::functional;
    const at::Tensor protos = F::normalize(torch::randn({C, d}), F::NormalizeFuncOptions().dim(1));
    auto views_of = [&](int64_t n) {
      const at::Tensor y = torch::arange(C, torch::kLong).repeat_interleave(n);
      const at::Tensor x = protos.index_select(0, y) + torch::randn({C * n, d}) * (3.0 / std::sqrt(double(d)));
      return std::make_pair(F::normalize(x, F::NormalizeFuncOptions().dim(1)) * 20.0, y);
    };
    const auto [train_x, train_y] = views_of(views);
    const auto [test_x, test_y] = views_of(views);
    const int64_t steps_per_epoch = train_x.size(0) / B, total = steps_per_epoch * a.epochs;
    for (const std::string storage : {"fp32", "bf16_stochastic", "bf16_nearest"}) {
      PartialFCOptions o;
      o.num_classes = C;
      o.embedding_size = d;
      o.margin = CombinedMargin{1.0, 0.0, 0.35};
      o.margin.scale = 32;
      o.seed = static_cast<uint64_t>(seed);
      o.optimizer = ShardOptimizerOptions{"sgd", 0.9, 5e-4};
      o.weight_dtype = storage == "fp32" ? at::kFloat : at::kBFloat16;
      o.weight_round_nearest = storage == "bf16_nearest";
      PartialFC fc(*dist, o);
      at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(seed) * 31 + 7);
      double last_epoch_loss = 0;
      int64_t step = 0;
      double lost = 0;
      int64_t lost_reads = 0;
      for (int64_t e = 0; e < a.epochs; ++e) {
        const at::Tensor order = at::randperm(train_x.size(0), gen);
        last_epoch_loss = 0;
        for (int64_t i = 0; i < steps_per_epoch; ++i, ++step) {
          const at::Tensor idx = order.narrow(0, i * B, B);
          const double lr = 0.1 * (0.01 + 0.99 * (1.0 - static_cast<double>(step) / static_cast<double>(total)));
          fc.arm_step(lr);
          at::Tensor loss = fc.forward(train_x.index_select(0, idx), train_y.index_select(0, idx)).loss;
          loss.backward();
          fc.step(lr);
          last_epoch_loss += loss.item<double>() / static_cast<double>(steps_per_epoch);
        }
        // The share lost over this epoch (the last one is the late, small-update one).
        const auto taken = fc.take_lost_updates();
        if (e + 1 == a.epochs) lost = taken.first, lost_reads = taken.second;
      }
      (void)lost_reads;
      const at::Tensor w = F::normalize(fc.weight().to(at::kFloat), F::NormalizeFuncOptions().dim(1));
      const at::Tensor pred = std::get<1>(torch::mm(test_x, w.t()).max(1));
      const double acc = (pred == test_y).to(at::kDouble).mean().item<double>();
      rows.push_back({storage, seed, last_epoch_loss, acc, lost});
      log_info("storage ", storage, ", seed ", seed, ": ", C, " identities, ", total, " steps; last epoch's loss ",
               last_epoch_loss, ", test accuracy ", acc, o.weight_dtype == at::kBFloat16 ? ", updates lost in the last epoch " : "",
               o.weight_dtype == at::kBFloat16 ? std::to_string(lost) : "");
    }
  }
  std::ostringstream js;
  js << "{\"mode\":\"storage\",\"identities\":" << C << ",\"dim\":" << d << ",\"epochs\":" << a.epochs
     << ",\"batch\":" << B << ",\"runs\":[";
  for (size_t i = 0; i < rows.size(); ++i)
    js << (i ? "," : "") << "{\"storage\":\"" << rows[i].storage << "\",\"seed\":" << rows[i].seed
       << ",\"loss\":" << rows[i].loss << ",\"accuracy\":" << rows[i].accuracy << ",\"lost_updates\":" << rows[i].lost
       << "}";
  js << "]}";
  write_json(a.json, js.str());
  return 0;
}

// The bytes a classifier step must move with S sampled rows of d, a global batch of N, centres
// of wb bytes an element and optimiser state (SGD momentum) of sb (docs/performance.md, "The
// classifier's floor"): the centres are read by the forward's GEMM and by backward's dL/dE
// GEMM, and read and written by the update (4 wb), the momentum read and written (2 sb), the
// raw gradient G'^T E written and read (8); the fp32 logits [N, S] are written by the GEMM,
// read and written by the softmax, read and written into the gradient G' and read by the two
// backward GEMMs (6 passes of 4 B), one more write and read where they are streamed (the
// recomputation). The embeddings and the per-row vectors are small beside them.
double classifier_step_bytes(int64_t S, int64_t N, int64_t d, int wb, int sb, bool streamed) {
  const double rows = static_cast<double>(S) * static_cast<double>(d) * (4.0 * wb + 2.0 * sb + 8.0);
  const double logits = static_cast<double>(N) * static_cast<double>(S) * 4.0 * (streamed ? 8.0 : 6.0);
  return rows + logits;
}

// The classifier step alone, at every shard size x sample rate x precision asked for: median
// time per step, the three GEMMs alone for comparison, and peak memory. Peak memory at two
// shard sizes gives the bytes per class (the slope).
int run_classifier(const Args& a, Distributed& dist) {
  const bool cuda = a.device == "cuda";
  const torch::Device dev = cuda ? torch::Device(torch::kCUDA, dist.local_rank()) : torch::Device(torch::kCPU);
  const auto opts = torch::TensorOptions().device(dev);
  struct Row {
    std::string head, precision, state, update, weight, logits, chunking;
    int64_t classes;
    double rate, step_ms, gemm_ms, peak_mb, tensor_mb;
    int64_t ops = 0;                 // ATen operators of one step (op_counter.h)
    double bytes = 0, floor_ms = 0;  // the step's memory traffic and its floor
  };
  std::vector<Row> rows;
  auto time_windows = [&](const std::function<void()>& step) {
    for (int64_t i = 0; i < a.warmup; ++i) step();
    std::vector<double> per_step;
    for (int64_t w = 0; w < a.windows; ++w) {
      dist.barrier();
      sync_device(cuda);
      auto t0 = std::chrono::steady_clock::now();
      for (int64_t i = 0; i < a.steps; ++i) step();
      sync_device(cuda);
      per_step.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / a.steps);
    }
    std::sort(per_step.begin(), per_step.end());
    return per_step[per_step.size() / 2] * 1e3;
  };
  // The device's memory bandwidth in this run: a device-to-device copy of 256 MiB (read and
  // written), timed as the steps are.
  double bandwidth = 0;
  {
    at::Tensor src = torch::ones({int64_t(64) << 20}, opts.dtype(at::kFloat)), dst = torch::empty_like(src);
    const double ms = time_windows([&] { dst.copy_(src); });
    bandwidth = 2.0 * static_cast<double>(src.numel()) * 4.0 / (ms * 1e-3);
    log_info("classifier: memory bandwidth ", bandwidth / 1e9, " GB/s (a 256 MiB copy on ", a.device, ")");
  }
  // The storage and pass settings, every combination.
  struct Variant {
    std::string state, update, weight, logits, chunking;
  };
  std::vector<Variant> variants;
  for (const std::string& state : split_list(a.states))
    for (const std::string& update : split_list(a.updates))
      for (const std::string& weight : split_list(a.weights))
        for (const std::string& logits : split_list(a.logits))
        for (const std::string& chunking : split_list(a.chunking)) {
          parse_chunk_policy(chunking);  // a usage error naming the policy
          if (state != "fp32" && state != "bf16")
            throw usage_error("--fc-state-dtype entries must be fp32 or bf16, got '", state, "'");
          if (weight != "fp32" && weight != "bf16")
            throw usage_error("--fc-weight-dtype entries must be fp32 or bf16, got '", weight, "'");
          if (update != "onepass" && update != "generic")
            throw usage_error("--row-update entries must be onepass or generic, got '", update, "'");
          if (logits != "buffer" && logits != "streamed")
            throw usage_error("--logits entries must be buffer or streamed, got '", logits, "'");
          variants.push_back({state, update, weight, logits, chunking});
        }
  for (const std::string& head : split_list(a.heads))
  for (const std::string& cps : split_list(a.classes_list)) {
    const int64_t classes = parse_int("--classes-per-shard", cps) * dist.world_size();
    for (const std::string& rs : split_list(a.rates)) {
      const double rate = std::atof(rs.c_str());
      if (!(rate > 0 && rate <= 1)) throw usage_error("--sample-rate entries must be in (0, 1], got '", rs, "'");
      for (const std::string& prec : split_list(a.precisions))
      for (const Variant& v : variants) {
        const std::string &state = v.state, &update = v.update;
        const at::ScalarType dt = prec == "fp32" ? at::kFloat : prec == "bf16" ? at::kBFloat16 : prec == "fp16" ? at::kHalf
                                                                                                 : at::kLong;
        if (dt == at::kLong) throw usage_error("--precision entries must be fp32, bf16 or fp16, got '", prec, "'");
        torch::manual_seed(dist.rank());
        at::Tensor emb = torch::randn({a.batch, a.dim}, opts).requires_grad_();
        at::Tensor labels = torch::randint(0, classes, {a.batch}, torch::kLong);
        sync_device(cuda);
        reset_peak(cuda);
        AllocationMeter::reset_peak();
        const int64_t tensors_before = AllocationMeter::current_bytes();
        PartialFCOptions o;
        o.num_classes = classes;
        o.embedding_size = a.dim;
        o.sample_rate = rate;
        o.margin = CombinedMargin{1.0, 0.5, 0.0};
        o.head.name = head;
        o.gemm_dtype = dt;
        o.optimizer.state_dtype = state == "bf16" ? at::kBFloat16 : at::kFloat;
        o.optimizer.fused_cpu_rows = update == "onepass";
        o.weight_dtype = v.weight == "bf16" ? at::kBFloat16 : at::kFloat;
        o.streamed_logits = v.logits == "streamed";
        o.chunking = parse_chunk_policy(v.chunking);
        o.chunk_budget_bytes = a.chunk_budget_mib << 20;
        o.update_chunk_rows = a.chunk_rows;
        PartialFC fc(dist, o, dev);
        const int64_t sampled = fc.num_sample();
        auto one_step = [&] {
          fc.arm_step(0.1);  // as the trainer steps (used by streamed logits)
          fc.forward(emb, labels).loss.backward();
          fc.step(0.1);
          emb.mutable_grad().reset();
        };
        const double step_ms = time_windows(one_step);
        int64_t ops = 0;
        {
          sync_device(cuda);
          OpCounter counter;
          one_step();
          ops = counter.count();
        }
        const double peak = peak_bytes(cuda) / 1048576.0;
        // CPU: the peak of the tensors the classifier allocated (what faceshard-plan plans).
        const double tensor_peak =
            cuda ? peak : static_cast<double>(AllocationMeter::peak_bytes() - tensors_before) / 1048576.0;
        // The step's GEMMs alone, at the same sizes and type: forward N x S x d, grad(W)
        // S x N x d, grad(E) N x S x d, and with streamed logits the recomputation of the
        // logits (N x S x d once more).
        const int64_t S = sampled, N = a.batch * dist.world_size();
        at::Tensor e = torch::randn({N, a.dim}, opts).to(dt), w = torch::randn({S, a.dim}, opts).to(dt);
        at::Tensor g = torch::randn({N, S}, opts).to(dt);
        const bool streamed = v.logits == "streamed";
        const double gemm_ms = time_windows([&] {
          at::mm(e, w.t());
          if (streamed) at::mm(e, w.t());
          at::mm(g.t(), e);
          at::mm(g, w);
        });
        const double bytes = classifier_step_bytes(S, N, a.dim, v.weight == "bf16" ? 2 : 4, state == "bf16" ? 2 : 4,
                                                   streamed);
        const double floor_ms = std::max(gemm_ms, bytes / bandwidth * 1e3);
        rows.push_back({head, prec, state, update, v.weight, v.logits, v.chunking, classes / dist.world_size(), rate,
                        step_ms, gemm_ms, peak, tensor_peak, ops, bytes, floor_ms});
        log_info("classifier: ", head, ", ", classes / dist.world_size(), " classes/shard, rate ", rate, " (", S,
                 " per step), ", prec, ", weight ", v.weight, ", state ", state, ", ", update, ", logits ", v.logits,
                 ", batch ", a.batch, "x", dist.world_size(), ", dim ", a.dim, ": ", step_ms,
                 " ms/step, GEMMs alone ", gemm_ms, " ms (x", step_ms / gemm_ms, "), floor ", floor_ms, " ms (x",
                 step_ms / floor_ms, "), ", ops, " operators a step (chunking ", v.chunking, "), peak ", peak, " MB (",
                 cuda ? "GPU allocated" : "process RSS", ")", cuda ? "" : ", tensors ",
                 cuda ? "" : std::to_string(tensor_peak), cuda ? "" : " MB");
      }
    }
  }
  // Bytes per class: the slope of peak memory between the smallest and the largest shard of
  // each rate and precision.
  std::ostringstream js;
  js << std::setprecision(17);  // the floor's figures as computed (a reader recomputes them)
  js << "{\"mode\":\"classifier\",\"device\":\"" << a.device << "\",\"world_size\":" << dist.world_size()
     << ",\"batch_per_rank\":" << a.batch << ",\"dim\":" << a.dim << ",\"runs\":[";
  for (size_t i = 0; i < rows.size(); ++i)
    js << (i ? "," : "") << "{\"head\":\"" << rows[i].head << "\",\"precision\":\"" << rows[i].precision
       << "\",\"fc_state_dtype\":\"" << rows[i].state << "\",\"fc_weight_dtype\":\"" << rows[i].weight
       << "\",\"logits\":\"" << rows[i].logits << "\",\"row_update\":\"" << rows[i].update
       << "\",\"classes_per_shard\":" << rows[i].classes << ",\"sample_rate\":" << rows[i].rate
       << ",\"chunking\":\"" << rows[i].chunking << "\",\"ops_per_step\":" << rows[i].ops
       << ",\"bytes_per_step\":" << rows[i].bytes << ",\"bandwidth_gbs\":" << bandwidth / 1e9
       << ",\"floor_ms\":" << rows[i].floor_ms << ",\"step_over_floor\":" << rows[i].step_ms / rows[i].floor_ms
       << ",\"step_ms\":" << rows[i].step_ms << ",\"gemm_ms\":" << rows[i].gemm_ms
       << ",\"peak_memory_mb\":" << rows[i].peak_mb << ",\"peak_tensor_mb\":" << rows[i].tensor_mb << "}";
  js << "],\"bytes_per_class\":[";
  bool first = true;
  for (size_t i = 0; i < rows.size(); ++i)
    for (size_t k = i + 1; k < rows.size(); ++k) {
      const Row &lo = rows[i], &hi = rows[k];
      if (lo.head != hi.head || lo.precision != hi.precision || lo.state != hi.state || lo.update != hi.update ||
          lo.weight != hi.weight || lo.logits != hi.logits || lo.chunking != hi.chunking || lo.rate != hi.rate ||
          hi.classes == lo.classes)
        continue;
      const double slope = (hi.peak_mb - lo.peak_mb) * 1048576.0 / static_cast<double>(hi.classes - lo.classes);
      const double tensor_slope =
          (hi.tensor_mb - lo.tensor_mb) * 1048576.0 / static_cast<double>(hi.classes - lo.classes);
      log_info("bytes per class, ", lo.head, ", ", lo.precision, ", weight ", lo.weight, ", state ", lo.state, ", ",
               lo.update, ", logits ", lo.logits, ", rate ", lo.rate, ": ", slope, " (peak ", lo.peak_mb,
               " MB at ", lo.classes, ", ", hi.peak_mb, " MB at ", hi.classes, " classes/shard)");
      js << (first ? "" : ",") << "{\"head\":\"" << lo.head << "\",\"precision\":\"" << lo.precision
         << "\",\"fc_state_dtype\":\"" << lo.state << "\",\"fc_weight_dtype\":\"" << lo.weight
         << "\",\"logits\":\"" << lo.logits << "\",\"row_update\":\"" << lo.update
         << "\",\"sample_rate\":" << lo.rate << ",\"from\":" << lo.classes << ",\"to\":" << hi.classes
         << ",\"bytes_per_class\":" << slope << ",\"tensor_bytes_per_class\":" << tensor_slope << "}";
      first = false;
    }
  js << "]}";
  if (dist.rank() == 0) write_json(a.json, js.str());
  return 0;
}

// One whole training step, exactly as faceshard-train runs it (same TrainJob, same
// TrainStep), timed per phase.
int run_step(const Args& a) {
  std::vector<std::string> ov;
  if (a.config.empty()) ov = {"data.rec=synthetic", "train.tensorboard=false", "data.num_workers=2"};
  if (a.network) ov.push_back("model.backbone=" + *a.network);
  if (a.classes) ov.push_back("data.num_classes=" + std::to_string(*a.classes));
  else if (a.config.empty()) ov.push_back("data.num_classes=100000");
  if (a.batch_given) ov.push_back("data.batch_size=" + std::to_string(a.batch));
  if (a.sample_rate_given) ov.push_back("loss.sample_rate=" + std::to_string(a.sample_rate));
  if (a.precision) ov.push_back("train.precision=" + *a.precision);
  if (a.device_given) ov.push_back("dist.device=" + a.device);
  ov.insert(ov.end(), a.overrides.begin(), a.overrides.end());
  const Config cfg = a.config.empty() ? load_config_text("", "faceshard-bench", ov) : load_config(a.config, ov);
  TrainJob job = build_train_job(cfg);
  Distributed& dist = *job.dist;
  const bool cuda = job.device.is_cuda();
  // Throughput from untimed steps (a GPU step then never waits for the device); the split
  // into phases from one window of timed steps after them.
  TrainStep step(job);
  uint64_t epoch = 0, in_epoch = 0;
  int64_t taken = 0;  // images this rank's steps took from the loader
  const uint64_t per_epoch = uint64_t(job.steps_per_epoch * job.micro);
  job.loader->start_epoch(0);
  BatchSource next = [&]() -> Batch {
    if (in_epoch == per_epoch) job.loader->start_epoch(++epoch), in_epoch = 0;
    in_epoch++;
    Batch b = std::move(*job.loader->next());
    taken += b.images.size(0);
    return b;
  };
  job.backbone->train();
  int64_t k = 0;
  // Every step's loss, kept on the device and read after the timing (no host sync inside
  // it): the JSON's "losses" let a cell with CUDA graphs be compared with its eager cell.
  std::vector<at::Tensor> losses;
  auto run_one = [&]() -> StepResult {
    StepResult r = step.run(next, k++);
    losses.push_back(r.loss.detach());
    return r;
  };
  for (int64_t i = 0; i < a.warmup; ++i) run_one();
  sync_device(cuda);
  reset_peak(cuda);
  AllocationMeter::reset_peak();
  std::vector<double> rate;
  // Each timed window's images (counted from the batches its steps took, times the ranks)
  // and seconds: the JSON's images_per_s is the median window's images / seconds.
  std::vector<std::pair<int64_t, double>> timed;
  StepTimes sum;
  const int64_t hits0 = CpuBlockCache::hits(), misses0 = CpuBlockCache::misses();
  for (int64_t w = 0; w < a.windows; ++w) {
    dist.barrier();
    const int64_t taken0 = taken;
    auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < a.steps; ++i) run_one();
    sync_device(cuda);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    timed.emplace_back((taken - taken0) * dist.world_size(), s);
    rate.push_back(double(timed.back().first) / s);
  }
  step.set_timing(true);  // one window more
  for (int64_t i = 0; i < a.steps; ++i) {
    StepResult r = run_one();
    sum.data += r.times.data, sum.forward += r.times.forward, sum.backward += r.times.backward;
    sum.optimizer += r.times.optimizer;
  }
  std::sort(rate.begin(), rate.end());
  const double median = rate[rate.size() / 2], peak = peak_bytes(cuda) / 1048576.0;
  // CPU: every tensor alive at the peak (parameters, optimiser state, classifier, the
  // loader's batches...), counted at c10's allocator; on a GPU the allocator's peak is that.
  const double tensor_peak = cuda ? peak : static_cast<double>(AllocationMeter::peak_bytes()) / 1048576.0;
  const double n = double(a.steps), total = sum.total();
  auto pct = [&](double x) { return total > 0 ? 100.0 * x / total : 0.0; };
  log_info("step: ", cfg.model.backbone, ", batch ", cfg.data.batch_size, "x", dist.world_size(), " x ", job.micro,
           " micro-batches, ", *job.cfg.data.num_classes, " classes (", job.fc->num_sample(), " per step on this rank), ",
           job.cfg.train.precision, " on ", job.device.str(), ": ", median, " images/s (median of ", a.windows,
           " windows of ", a.steps, " steps), peak ", peak, " MB (", cuda ? "GPU allocated" : "process RSS",
           cuda ? "" : "; tensors ", cuda ? "" : std::to_string(tensor_peak), cuda ? "" : " MB",
           "); per step ", total / n * 1e3, " ms = data ", pct(sum.data), "%, forward ", pct(sum.forward),
           "%, backward ", pct(sum.backward), "%, optimiser ", pct(sum.optimizer), "%");
  // What train.cuda_graph came to: a cell that asked for CUDA graphs measured them only
  // where they were captured and every step replayed them.
  const GraphStatus graphs = job.graph_status();
  if (graphs.asked)
    log_info("step: train.cuda_graph ", graphs.captured ? "captured" : "not captured",
             graphs.reason.empty() ? "" : ": " + graphs.reason, ", ", graphs.eager_calls, " eager calls");
  const int64_t hits = CpuBlockCache::hits() - hits0, misses = CpuBlockCache::misses() - misses0;
  if (CpuBlockCache::installed())
    log_info("CPU block cache (limit ", CpuBlockCache::limit() / 1e9, " GB): ", hits, " blocks reused, ", misses,
             " from the system while timed; ", CpuBlockCache::cached_bytes() / 1048576.0, " MB kept now");
  std::ostringstream js;
  js << std::setprecision(9);  // the split's phases add up to step_ms at the written precision
  js << "{\"mode\":\"step\",\"network\":\"" << cfg.model.backbone << "\",\"device\":\"" << job.device.str()
     << "\",\"world_size\":" << dist.world_size() << ",\"batch_per_rank\":" << cfg.data.batch_size
     << ",\"micro_batches\":" << job.micro << ",\"classes\":" << *job.cfg.data.num_classes << ",\"precision\":\""
     << job.cfg.train.precision << "\",\"sample_rate\":" << cfg.loss.sample_rate
     << ",\"channels_last\":"
     << (cfg.model.channels_last.value_or(backbone_default_channels_last(cfg.model.backbone)) ? "true" : "false")
     << ",\"images_per_s\":" << median << ",\"steps_per_window\":" << a.steps << ",\"windows\":[";
  for (size_t w = 0; w < timed.size(); ++w)
    js << (w ? "," : "") << "{\"images\":" << timed[w].first << ",\"seconds\":" << timed[w].second << "}";
  js << "],\"peak_memory_mb\":" << peak
     << ",\"peak_tensor_mb\":" << tensor_peak << ",\"cpu_cache\":{\"installed\":"
     << (CpuBlockCache::installed() ? "true" : "false") << ",\"limit_bytes\":" << CpuBlockCache::limit()
     << ",\"reused\":" << hits << ",\"from_system\":" << misses << "}"
     << ",\"step_ms\":" << total / n * 1e3 << ",\"split_ms\":{\"data\":" << sum.data / n * 1e3
     << ",\"forward\":" << sum.forward / n * 1e3 << ",\"backward\":" << sum.backward / n * 1e3
     << ",\"optimizer\":" << sum.optimizer / n * 1e3 << "}"
     << ",\"cuda_graph\":{\"asked\":" << (graphs.asked ? "true" : "false")
     << ",\"captured\":" << (graphs.captured ? "true" : "false") << ",\"reason\":\"" << json_escape(graphs.reason) << "\""
     << ",\"eager_calls\":" << graphs.eager_calls << "},\"losses\":[";
  const at::Tensor loss_values = losses.empty() ? at::Tensor() : torch::stack(losses).to(torch::kCPU, torch::kDouble);
  for (int64_t i = 0; i < int64_t(losses.size()); ++i) {
    js << (i ? "," : "") << json_number(loss_values[i].item<double>());  // null where not finite
  }
  js << "]}";
  if (dist.rank() == 0) write_json(a.json, js.str());
  dist.shutdown();
  return 0;
}

// Decoding thread counts from "1,2,all"; duplicates (e.g. all == 2) are measured once.
std::vector<int> parse_workers(const std::string& list) {
  const int cores = std::max(1u, std::thread::hardware_concurrency());
  std::vector<int> out;
  std::stringstream ss(list);
  std::string item;
  while (std::getline(ss, item, ',')) {
    int n = item == "all" ? cores : int(parse_int("--workers", item));
    if (n < 1) throw usage_error("--workers entries must be >= 1 or 'all', got '", item, "'");
    if (std::find(out.begin(), out.end(), n) == out.end()) out.push_back(n);
  }
  if (out.empty()) throw usage_error("--workers needs at least one entry");
  return out;
}

// Opening a .rec of real size: time, peak RSS, and what the index costs this process in
// anonymous (private) memory and in file-backed pages (shared by the ranks of a host).
int run_open(const Args& a) {
  if (a.data.empty()) throw usage_error("--open-only needs --data DIR (a folder with train.rec and train.idx)");
  RecordIndexOptions o = default_record_index_options();
  if (a.index_cache) o.cache_dir = *a.index_cache == "off" ? "" : *a.index_cache;
  const double mb = 1.0 / 1024;
  reset_peak_rss();
  const int64_t anon0 = read_status_kb("RssAnon:"), file0 = read_status_kb("RssFile:"),
                hwm0 = read_status_kb("VmHWM:");
  const auto t0 = std::chrono::steady_clock::now();
  const RecordIODataset ds(a.data + "/train.rec", a.data + "/train.idx", o);
  const double open_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int64_t anon1 = read_status_kb("RssAnon:"), hwm1 = read_status_kb("VmHWM:");
  // An epoch looks every image key up once (in shuffled order; the pages touched are the same).
  const auto t1 = std::chrono::steady_clock::now();
  uint64_t sum = 0;
  for (uint64_t i = 0; i < ds.size(); ++i) sum += ds.records().offset_of(ds.key(i));
  const double lookup_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  const int64_t anon2 = read_status_kb("RssAnon:"), file2 = read_status_kb("RssFile:"),
                hwm2 = read_status_kb("VmHWM:");
  const InsightFaceLayout& l = ds.layout();
  log_info("open: ", a.data, ": ", ds.size(), " images, ", l.num_identities(), " identities, ",
           ds.records().num_entries(), " index entries from ", ds.records().index().source(), " (",
           ds.records().index().bytes() / 1048576.0, " MB)");
  log_info("open: ", open_s, " s; peak RSS ", hwm1 * mb, " MB (", hwm0 * mb, " before); private (anonymous) +",
           (anon1 - anon0) * mb, " MB");
  log_info("open: every image key looked up in ", lookup_s, " s (checksum ", sum % 1000, "): peak RSS ", hwm2 * mb,
           " MB, private +", (anon2 - anon0) * mb, " MB, file-backed +", (file2 - file0) * mb, " MB");
  // The records on both sides of each boundary the header draws.
  RawSample sample;
  for (uint64_t i : {uint64_t(0), ds.size() - 2, ds.size() - 1}) {
    ds.read(i, sample);
    log_info("open: image ", i, ": key ", ds.key(i), ", class ", sample.label, ", ", sample.bytes.size(), " bytes");
  }
  for (uint64_t k : {l.identity_begin, l.identity_end - 1}) {
    if (l.num_identities() == 0) break;
    const auto r = read_identity_range(ds.records(), l, k);
    log_info("open: identity record ", k, " (class ", k - l.identity_begin, "): images [", r.first, ", ", r.second, ")");
  }
  std::ostringstream js;
  js << "{\"mode\":\"data-open\",\"data\":\"" << a.data << "\",\"images\":" << ds.size()
     << ",\"identities\":" << l.num_identities() << ",\"index_bytes\":" << ds.records().index().bytes()
     << ",\"open_s\":" << open_s << ",\"peak_rss_mb\":" << hwm2 * mb << ",\"rss_before_mb\":" << hwm0 * mb
     << ",\"private_mb\":" << (anon2 - anon0) * mb << ",\"file_backed_mb\":" << (file2 - file0) * mb << "}";
  write_json(a.json, js.str());
  return 0;
}

int run_data(const Args& a) {
  namespace fs = std::filesystem;
  const std::vector<int> worker_counts = parse_workers(a.workers);
  std::string dir = a.data;
  fs::path temp;
  if (dir.empty()) {
    temp = fs::temp_directory_path() / ("faceshard-bench-data-" + std::to_string(::getpid()));
    SynthDatasetSpec spec;
    spec.identities = uint64_t(a.identities);
    spec.images_per_identity = uint64_t(a.images_per_identity);
    spec.holdout_identities = 2;
    spec.pairs = 2;
    log_info("writing a synthetic data set (", spec.identities, " x ", spec.images_per_identity,
             " JPEG images, 112x112) to ", temp.string());
    write_synthetic_dataset(temp.string(), spec);
    dir = temp.string();
  }
  struct Cleanup {
    fs::path p;
    ~Cleanup() {
      std::error_code ec;
      if (!p.empty()) fs::remove_all(p, ec);
    }
  } cleanup{temp};
  auto ds = open_dataset(dir);
  const int64_t batch = a.batch_given ? a.batch : 128;
  if (int64_t(ds->size()) < batch) throw usage_error("the data set has ", ds->size(), " images, fewer than --batch ", batch);
  const int cores = std::max(1u, std::thread::hardware_concurrency());
  std::ostringstream js;
  js << "{\"mode\":\"data\",\"data\":\"" << (a.data.empty() ? "synthetic" : a.data) << "\",\"images\":" << ds->size()
     << ",\"batch\":" << batch << ",\"cores\":" << cores;
  const DistributedSampler sampler(ds->size(), 1, 0, 0);
  {
    // Baseline: a worker's per-image work (read, decode, normalise) in a plain loop on one
    // thread over the same images, without the loader. The 1-worker row's time per image
    // minus this one's is the loader's own overhead (threads, queue, batching, checks).
    const uint64_t per_epoch = sampler.size() / uint64_t(batch) * uint64_t(batch);
    RawSample sample;
    std::vector<float> dst;
    auto epoch = [&](uint64_t e) {
      const std::vector<uint64_t> order = sampler.indices(e);
      for (uint64_t i = 0; i < per_epoch; ++i) {
        ds->read(order[i], sample);
        if (ds->raw_pixels()) {
          const int n = ds->raw_size();
          dst.resize(size_t(3) * n * n);
          rgb_to_normalized_chw(sample.bytes.data(), n, n, false, dst.data());
        } else {
          cv::Mat bgr;
          try {  // the sample's name is built on failure only, as in the loader
            bgr = decode_image(sample.bytes.data(), sample.bytes.size(), "");
          } catch (const Error& e) {
            throw runtime_error(ds->describe(order[i]), e.what());
          }
          dst.resize(size_t(3) * bgr.rows * bgr.cols);
          bgr_to_normalized_chw(bgr, false, dst.data());
        }
      }
      return per_epoch;
    };
    epoch(0);  // warm-up, as for the loader rows
    const auto t0 = std::chrono::steady_clock::now();
    uint64_t images = 0;
    for (int64_t e = 1; e <= a.epochs; ++e) images += epoch(uint64_t(e));
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    log_info("data: decode+normalise only (1 thread, no loader): ", images / s, " images/s (", images, " images in ",
             s, " s)");
    js << ",\"baseline\":{\"what\":\"decode+normalise only\",\"threads\":1,\"images_per_s\":" << images / s
       << ",\"images\":" << images << ",\"seconds\":" << s << "}";
  }
  js << ",\"results\":[";
  bool first = true;
  for (int workers : worker_counts) {
    LoaderOptions o;
    o.batch_size = batch;
    o.num_workers = workers;
    o.prefetch_batches = std::max(4, 2 * workers);
    DataLoader loader(ds, sampler, o);
    auto epoch = [&](uint64_t e) {
      uint64_t n = 0;
      loader.start_epoch(e);
      while (auto b = loader.next()) n += uint64_t(b->images.size(0));
      return n;
    };
    epoch(0);  // warm-up: page cache, allocator, thread start
    const auto t0 = std::chrono::steady_clock::now();
    uint64_t images = 0;
    for (int64_t e = 1; e <= a.epochs; ++e) images += epoch(uint64_t(e));
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    log_info("data: ", workers, " worker(s) of ", cores, " cores: ", images / s, " images/s (", images,
             " images in ", s, " s, batch ", batch, ", bad samples ", loader.bad_samples(), ")");
    js << (first ? "" : ",") << "{\"workers\":" << workers << ",\"images_per_s\":" << images / s
       << ",\"images\":" << images << ",\"seconds\":" << s << "}";
    first = false;
  }
  js << "]}";
  write_json(a.json, js.str());
  return 0;
}

// Each backbone's activation memory per image for every precision x checkpointing asked
// for (MobileFaceNet has no checkpointing: skipped), on the CPU: the table faceshard-plan
// ships. --json is rewritten after every measurement, so a long run keeps what it has.
int run_activations(const Args& a) {
  if (a.device != "cpu") throw usage_error("--mode activations measures on the CPU (--device cpu)");
  std::vector<int64_t> batches;
  for (const std::string& b : split_list(a.batches)) batches.push_back(parse_int("--batches", b));
  const std::vector<std::string> networks = split_list(a.network.value_or("mbf,mbf_small,r18,r50,vit_t"));
  const std::vector<std::string> precisions = split_list(a.precision.value_or("fp32,bf16,fp16"));
  std::vector<bool> checkpointing;
  for (const std::string& c : split_list(a.checkpointing)) {
    if (c != "off" && c != "on") throw usage_error("--checkpointing entries must be off or on, got '", c, "'");
    checkpointing.push_back(c == "on");
  }
  for (const std::string& p : precisions) parse_body_precision(p);  // names checked before hours of work
  for (const std::string& n : networks) backbone_default_checkpointing(n);
  const std::string measured_on = "cpu, torch " + std::to_string(TORCH_VERSION_MAJOR) + "." +
                                  std::to_string(TORCH_VERSION_MINOR) + "." + std::to_string(TORCH_VERSION_PATCH);
  std::vector<ActivationMeasurement> done;
  for (const std::string& net : networks)
    for (const std::string& prec : precisions)
      for (const bool ckpt : checkpointing) {
        if (ckpt && !backbone_traits(net).supports_checkpointing) continue;
        const ActivationMeasurement m = measure_activations(net, parse_body_precision(prec), ckpt, batches);
        std::ostringstream peaks;
        for (size_t i = 0; i < m.batches.size(); ++i)
          peaks << (i ? ", " : "") << m.peak_bytes[i] / 1048576.0 << " MB at batch " << m.batches[i];
        log_info("activations: ", net, ", ", prec, ", checkpointing ", ckpt ? "on" : "off", ": ",
                 m.bytes_per_image / 1048576.0, " MB per image, fixed ", m.fixed_bytes / 1048576.0, " MB (peak ",
                 peaks.str(), "), ", m.parameters, " parameters, ", m.seconds, " s");
        done.push_back(m);
        write_json(a.json, activation_table_json(done, measured_on));
      }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return run_main("faceshard-bench", [&] {
    Args a;
    ToolArgs args(argc, argv);
    while (args.next()) {
      const std::string s = args.flag();
      auto value = [&]() { return args.value(); };
      if (s == "--help" || s == "-h") {
        std::fputs(kUsage, stdout);
        return 0;
      } else if (s == "--mode") a.mode = value();
      else if (s == "--classes-per-shard") a.classes_list = value();
      else if (s == "--batch") a.batch = parse_int(s, value()), a.batch_given = true;
      else if (s == "--data") a.data = value();
      else if (s == "--workers") a.workers = value();
      else if (s == "--open-only") a.open_only = true;
      else if (s == "--index-cache") a.index_cache = value();
      else if (s == "--epochs") a.epochs = std::max<int64_t>(1, parse_int(s, value()));
      else if (s == "--identities") a.identities = std::max<int64_t>(1, parse_int(s, value()));
      else if (s == "--images-per-identity") a.images_per_identity = std::max<int64_t>(1, parse_int(s, value()));
      else if (s == "--dim") a.dim = parse_int(s, value());
      else if (s == "--steps") a.steps = std::max<int64_t>(1, parse_int(s, value()));
      else if (s == "--windows") a.windows = std::max<int64_t>(1, parse_int(s, value()));
      else if (s == "--warmup") a.warmup = parse_int(s, value());
      else if (s == "--sample-rate") a.rates = value(), a.sample_rate = std::atof(a.rates.c_str()), a.sample_rate_given = true;
      else if (s == "--device") a.device = value(), a.device_given = true;
      else if (s == "--network") a.network = value();
      else if (s == "--classes") a.classes = parse_int(s, value());
      else if (s == "--precision") a.precision = value(), a.precisions = *a.precision;
      else if (s == "--heads") a.heads = value();
      else if (s == "--fc-state-dtype") a.states = value();
      else if (s == "--fc-weight-dtype") a.weights = value();
      else if (s == "--logits") a.logits = value();
      else if (s == "--checkpointing") a.checkpointing = value();
      else if (s == "--batches") a.batches = value();
      else if (s == "--config") a.config = value();
      else if (s == "--set") a.overrides.push_back(args.repeated_value());
      else if (s == "--json") a.json = value();
      else if (s == "--row-update") a.updates = value();
      else if (s == "--chunking") a.chunking = value();
      else if (s == "--chunk-budget-mib") a.chunk_budget_mib = parse_int(s, value());
      else if (s == "--chunk-rows") a.chunk_rows = parse_int(s, value());
      else if (s == "--seeds") a.seeds = value();
      else args.unknown();
    }
    if (a.device != "cpu" && a.device != "cuda") throw usage_error("--device must be cpu or cuda");
    if (a.mode != "classifier" && (a.sample_rate <= 0 || a.sample_rate > 1))
      throw usage_error("--sample-rate must be in (0, 1]");
    if (a.mode != "classifier" && a.mode != "data" && a.mode != "step" && a.mode != "activations" &&
        a.mode != "storage")
      throw usage_error("--mode '", a.mode, "' is not known (classifier, step, data, activations, storage)");
    // CPU memory of tensors counted at c10's allocator (before any tensor of the run exists).
    // The step allocates as faceshard-train does: on the CPU block cache (its limit from the
    // job's config), which the meter, installed after it, sits above.
    if (a.mode == "step") CpuBlockCache::install();
    if (a.device == "cpu" && a.mode != "data") AllocationMeter::install();
    if (a.mode == "activations") return run_activations(a);
    if (a.mode == "storage") return run_storage(a);
    // The step mode allocates as faceshard-train does, so that its rate is the trainer's.
    if (a.mode == "step") return run_step(a);
    // Classifier mode: CPU peak memory is read as the process's peak RSS. With a fixed mmap
    // threshold every block of 4 MB or more (the per-class tensors) is mapped on its own and
    // unmapped when freed (glibc would otherwise raise the threshold after the first large
    // free and keep later blocks in its heap), so the RSS follows the live tensors; smaller
    // blocks (chunk temporaries) stay in the heap and are reused without page faults.
    mallopt(M_MMAP_THRESHOLD, 4 * 1024 * 1024);
    if (a.mode == "data") {
      if (a.batch < 1) throw usage_error("--batch must be >= 1");
      return a.open_only ? run_open(a) : run_data(a);
    }
    DistOptions dopts;
    dopts.use_cuda = a.device == "cuda";
    auto dist = Distributed::init(DistEnv::from_environment(), dopts);
    return run_classifier(a, *dist);
  });
}
