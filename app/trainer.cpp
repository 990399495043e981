#include "app/trainer.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <limits>
#include <memory>
#include <mutex>
#include <sstream>

#ifdef FACESHARD_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include "app/backbone_optimizer.h"
#include "app/checkpoint.h"
#include "app/evaluation.h"
#include "app/grad_clip.h"
#include "app/loss_scaler.h"
#include "app/lr_schedule.h"
#include "app/metrics_log.h"
#include "app/sync_bn.h"
#include "app/tensorboard_writer.h"
#include "data/dataset.h"
#include "data/loader.h"
#include "data/sampler.h"
#include "models/backbone_registry.h"
#include "partial_fc/ddp.h"
#include "partial_fc/dist_env.h"
#include "partial_fc/distributed.h"
#include "partial_fc/error.h"
#include "partial_fc/log.h"
#include "partial_fc/partial_fc.h"
#include "partial_fc/shard_optimizer.h"

namespace fs = std::filesystem;

namespace faceshard {
namespace {

std::atomic<int> g_stop_signal{0};
extern "C" void on_stop_signal(int sig) { g_stop_signal = sig; }

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const int64_t t = static_cast<int64_t>(s);
  std::ostringstream os;
  if (t >= 3600) os << t / 3600 << "h";
  os << std::setw(t >= 3600 ? 2 : 1) << std::setfill('0') << (t % 3600) / 60 << "m" << std::setw(2) << t % 60 << "s";
  return os.str();
}

double gpu_memory_gb(torch::Device dev) {
#ifdef FACESHARD_WITH_CUDA
  if (dev.is_cuda()) {
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(dev.index());
    return static_cast<double>(stats.allocated_bytes[0].peak) / (1 << 30);
  }
#endif
  return 0;
}

at::Tensor scalar_long(int64_t v) { return torch::tensor({v}, torch::kLong); }

// Everything a step needs, built once.
struct Job {
  Config cfg;
  std::shared_ptr<Distributed> dist;
  torch::Device device = torch::kCPU;
  std::shared_ptr<Dataset> dataset;
  std::unique_ptr<DataLoader> loader;
  std::shared_ptr<Backbone> backbone;
  std::unique_ptr<DataParallel> ddp;
  std::unique_ptr<PartialFC> fc;
  std::unique_ptr<ShardOptimizer> fc_opt;
  std::unique_ptr<BackboneOptimizer> opt;
  std::unique_ptr<LossScaler> scaler;
  PolyWarmupSchedule schedule{0.1, 0, 1, 1.0};
  PolyWarmupSchedule fc_schedule{0.1, 0, 1, 1.0};
  std::vector<at::Tensor> backbone_params;
  int64_t steps_per_epoch = 0, total_steps = 0, micro = 1;
  std::vector<VerificationData> val_sets;
  std::unique_ptr<CheckpointManager> ckpt;
  std::unique_ptr<MetricsLog> metrics;
  std::unique_ptr<TensorBoardWriter> tb;
  std::map<std::string, double> best_accuracy;
  int64_t step = 0;            // optimiser steps done
  int64_t epoch = 0;           // the loader's epoch
  int64_t batch_in_epoch = 0;  // micro-batches this rank consumed in that epoch
};

torch::Device pick_device(const Config& cfg, const DistEnv& env) {
  const bool cuda_ok = nccl_compiled() && torch::cuda::is_available();
  if (cfg.dist.device == "cuda" && !cuda_ok)
    throw usage_error("dist.device: cuda requested but ", nccl_compiled() ? "no GPU is visible" : "this build has no CUDA");
  if (cfg.dist.device == "cuda" || (cfg.dist.device == "auto" && cuda_ok))
    return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank));
  return torch::kCPU;
}

StateDict backbone_state(Backbone& b) { return b.state_dict(); }

StateDict train_state(Job& j) {
  StateDict s;
  s.emplace_back("step", scalar_long(j.step));
  s.emplace_back("world_size", scalar_long(j.dist->world_size()));
  // Where the data stands, in global samples: a resume on another number of ranks or batch
  // size continues the same epoch at the same point.
  s.emplace_back("data.epoch", scalar_long(j.epoch));
  s.emplace_back("data.epoch_samples", scalar_long(j.batch_in_epoch * j.cfg.data.batch_size * j.dist->world_size()));
  for (auto& kv : j.opt->state()) s.emplace_back("opt/" + kv.first, kv.second.cpu());
  for (auto& kv : j.scaler->state()) s.emplace_back("scaler/" + kv.first, kv.second.cpu());
  for (auto& kv : j.best_accuracy) s.emplace_back("best/" + kv.first, torch::tensor({kv.second}, torch::kDouble));
  return s;
}

StateDict shard_state(Job& j) {
  StateDict s;
  s.emplace_back("rows.start", scalar_long(j.fc->shard().start));
  s.emplace_back("rows.count", scalar_long(j.fc->shard().count));
  s.emplace_back("rows/weight", j.fc->weight().detach().cpu());
  for (auto& kv : j.fc_opt->state()) s.emplace_back("rows/opt." + kv.first, kv.second.cpu());
  s.emplace_back("rng.cpu", at::detail::getDefaultCPUGenerator().get_state());
  if (j.device.is_cuda()) s.emplace_back("rng.cuda", at::globalContext().defaultGenerator(j.device).get_state());
  return s;
}

void save_checkpoint(Job& j) {
  j.ckpt->save(j.step, j.cfg.data.num_classes, backbone_state(*j.backbone), train_state(j), shard_state(j));
  log_info("checkpoint saved: ", j.ckpt->root(), " step ", j.step);
}

void load_checkpoint(Job& j, const std::string& dir) {
  CheckpointInfo info = read_checkpoint_info(dir);
  if (info.num_classes != j.cfg.data.num_classes)
    throw usage_error("checkpoint '", dir, "' has ", info.num_classes, " classes but data.num_classes is ",
                      j.cfg.data.num_classes);
  StateDict bb = read_checkpoint_file(info, "backbone.pt");
  j.backbone->load_state_dict(bb, dir + "/backbone.pt");
  StateDict ts = read_checkpoint_file(info, "train_state.pt");
  const std::string tsrc = dir + "/train_state.pt";
  j.step = state_get(ts, "step", tsrc).item<int64_t>();
  StateDict opt, sc;
  for (auto& kv : ts) {
    if (kv.first.rfind("opt/", 0) == 0) opt.emplace_back(kv.first.substr(4), kv.second.to(j.device));
    if (kv.first.rfind("scaler/", 0) == 0) sc.emplace_back(kv.first.substr(7), kv.second.to(j.device));
    if (kv.first.rfind("best/", 0) == 0) j.best_accuracy[kv.first.substr(5)] = kv.second.item<double>();
  }
  j.opt->load_state(opt, tsrc);
  j.scaler->load_state(sc, tsrc);
  StateDict rows = read_resharded_rows(info, j.fc->shard().start, j.fc->shard().count, j.dist->rank());
  {
    torch::NoGradGuard ng;
    auto fc_state = j.fc_opt->state();
    for (auto& kv : rows) {
      if (kv.first == "rows/weight") j.fc->weight().copy_(kv.second);
      else if (kv.first.rfind("rows/opt.", 0) == 0) {
        auto it = fc_state.find(kv.first.substr(9));
        if (it == fc_state.end())
          throw usage_error("checkpoint '", dir, "': classifier optimiser state '", kv.first.substr(9),
                            "' does not match optim.fc_optimizer");
        it->second.copy_(kv.second);
      } else if ((kv.first == "rng.cpu" || (kv.first == "rng.cuda" && j.device.is_cuda())) &&
                 info.world_size == j.dist->world_size()) {
        at::Generator gen = kv.first == "rng.cpu" ? at::detail::getDefaultCPUGenerator()
                                                  : at::globalContext().defaultGenerator(j.device);
        std::lock_guard<std::mutex> lock(gen.mutex());
        gen.set_state(kv.second);
      }
    }
  }
  // The sampling RNG counts forwards: micro-batches.
  j.fc->set_step(j.step * j.micro);
  // The data position: saved in global samples, converted to this job's micro-batches
  // (exact when the ranks and the batch size are those of the saved run).
  const int64_t per_batch = j.cfg.data.batch_size * j.dist->world_size();
  bool has_data_state = false;
  for (const auto& kv : ts) has_data_state |= kv.first == "data.epoch";
  if (has_data_state) {
    j.epoch = state_get(ts, "data.epoch", tsrc).item<int64_t>();
    const int64_t samples = state_get(ts, "data.epoch_samples", tsrc).item<int64_t>();
    j.batch_in_epoch = samples / per_batch / j.micro * j.micro;
    if (samples % (per_batch * j.micro) != 0)
      log_info("resume: ", samples, " samples of epoch ", j.epoch, " were used; continuing at the nearest full step (",
               j.batch_in_epoch * per_batch, " samples)");
  } else {  // checkpoints without the data position: derive it from the step
    j.epoch = j.step / j.steps_per_epoch;
    j.batch_in_epoch = (j.step % j.steps_per_epoch) * j.micro;
  }
  if (j.batch_in_epoch >= j.steps_per_epoch * j.micro) {
    j.epoch++;
    j.batch_in_epoch = 0;
  }
  log_info("resumed from ", dir, " at step ", j.step, info.world_size != j.dist->world_size()
                                                          ? " (classifier resharded from " + std::to_string(info.world_size) +
                                                                " to " + std::to_string(j.dist->world_size()) + " ranks)"
                                                          : "");
}

void verify(Job& j, bool final_round) {
  // The sets live on rank 0 only; every rank takes part in the barrier.
  if (j.cfg.data.val_targets.empty()) return;
  if (j.dist->rank() == 0) {
    for (auto& v : j.val_sets) {
      VerificationResult r = evaluate_verification(*j.backbone, v, 64, j.device);
      double& best = j.best_accuracy[v.name];
      best = std::max(best, r.kfold.accuracy_mean);
      std::ostringstream os;
      os << std::fixed << std::setprecision(5) << "[" << v.name << "][" << j.step << "] Accuracy-Flip: " << r.kfold.accuracy_mean
         << "+-" << r.kfold.accuracy_std << "  Accuracy-Highest: " << best << "  XNorm: " << r.xnorm
         << "  threshold: " << r.kfold.best_threshold;
      log_info(os.str());
      j.metrics->write({{"step", static_cast<double>(j.step)}, {"val/" + v.name + "/accuracy", r.kfold.accuracy_mean},
                        {"val/" + v.name + "/accuracy_std", r.kfold.accuracy_std},
                        {"val/" + v.name + "/best_accuracy", best}});
      if (j.tb) j.tb->add_scalar("val/" + v.name + "/accuracy", r.kfold.accuracy_mean, j.step);
    }
    if (j.tb) j.tb->flush();
  }
  j.dist->barrier();
}

void export_model(Job& j) {
  if (j.dist->rank() != 0) return;
  const std::string out = j.cfg.output + "/model.pt";
  write_state_dict_durably(j.backbone->state_dict(), out);
  std::ostringstream js;
  js << "{\"backbone\": \"" << j.cfg.model.backbone << "\", \"embedding_size\": " << j.cfg.model.embedding_size
     << ", \"input_size\": [112, 112], \"input\": \"RGB, (x / 255 - 0.5) / 0.5, CHW\", \"step\": " << j.step
     << ", \"num_classes\": " << j.cfg.data.num_classes << ", \"precision\": \"" << j.cfg.train.precision << "\"}\n";
  write_text_durably(js.str(), j.cfg.output + "/model.json");
  log_info("exported backbone: ", out, " (+ model.json)");
}

void build(Job& j, const TrainRequest& req) {
  Config& cfg = j.cfg;
  DistOptions dopts;
  dopts.timeout = std::chrono::milliseconds(static_cast<int64_t>(cfg.dist.timeout_s * 1000));
  DistEnv env = DistEnv::from_environment();
  j.device = pick_device(cfg, env);
  dopts.use_cuda = j.device.is_cuda();
  j.dist = Distributed::init(env, dopts);
  Distributed& d = *j.dist;
  log_info("faceshard-train: ", env.describe(), ", device ", j.device.str());
  if (j.device.is_cuda() && cfg.train.cudnn_benchmark) at::globalContext().setBenchmarkCuDNN(true);

  if (d.rank() == 0) {
    fs::create_directories(cfg.output);
    write_text_durably(req.config_text, cfg.output + "/config.yaml");
  }
  d.barrier();

  // Data
  j.dataset = open_dataset(cfg.data.rec, cfg.data.num_classes);
  if (j.dataset->num_classes() > cfg.data.num_classes)
    throw usage_error("data.num_classes is ", cfg.data.num_classes, " but '", cfg.data.rec, "' has ",
                      j.dataset->num_classes(), " classes");
  LoaderOptions lo;
  lo.batch_size = cfg.data.batch_size;
  lo.num_workers = static_cast<int>(cfg.data.num_workers);
  lo.prefetch_batches = static_cast<int>(cfg.data.prefetch);
  lo.flip = cfg.data.flip;
  lo.extra.gray_prob = cfg.data.augment_gray_prob;
  lo.extra.blur_prob = cfg.data.augment_blur_prob;
  lo.extra.downscale_prob = cfg.data.augment_downscale_prob;
  lo.seed = static_cast<uint64_t>(cfg.seed);
  lo.max_bad_fraction = cfg.data.max_bad_fraction;
  lo.num_classes = cfg.data.num_classes;
  lo.device = j.device;
  j.loader = std::make_unique<DataLoader>(
      j.dataset, DistributedSampler(j.dataset->size(), d.world_size(), d.rank(), static_cast<uint64_t>(cfg.seed)), lo);
  j.micro = cfg.optim.grad_accumulation;
  j.steps_per_epoch = static_cast<int64_t>(j.loader->batches_per_epoch()) / j.micro;
  if (j.steps_per_epoch < 1)
    throw usage_error("data: ", j.dataset->size(), " images on ", d.world_size(), " ranks make no full step of batch ",
                      cfg.data.batch_size, " x ", j.micro, " micro-batches");
  const int64_t num_images = cfg.data.num_images > 0 ? cfg.data.num_images : static_cast<int64_t>(j.dataset->size());
  const int64_t global_batch = cfg.data.batch_size * d.world_size() * j.micro;
  const int64_t sched_steps_per_epoch = std::max<int64_t>(1, num_images / global_batch);
  j.total_steps = cfg.optim.total_steps > 0 ? cfg.optim.total_steps : sched_steps_per_epoch * cfg.optim.epochs;
  const int64_t warmup = cfg.optim.warmup_steps >= 0
                             ? cfg.optim.warmup_steps
                             : static_cast<int64_t>(cfg.optim.warmup_epochs * sched_steps_per_epoch);

  // Model
  BackboneOptions bo;
  bo.name = cfg.model.backbone;
  bo.embedding_size = cfg.model.embedding_size;
  bo.dropout = cfg.model.dropout;
  bo.channels_last = cfg.model.channels_last;
  bo.precision = parse_body_precision(cfg.train.precision == "fp32" ? "fp32" : cfg.train.precision);
  torch::manual_seed(cfg.seed);
  j.backbone = make_backbone(bo);
  if (!cfg.model.init.empty()) load_backbone_weights(*j.backbone, cfg.model.init);
  j.backbone->to(j.device);
  if (cfg.model.channels_last) j.backbone->to_channels_last();
  if (cfg.model.sync_bn) log_info("SyncBatchNorm: ", convert_sync_batchnorm(*j.backbone, d), " layers");
  DdpOptions ddo;
  ddo.bucket_mb = cfg.dist.bucket_mb;
  ddo.find_unused_parameters = cfg.dist.find_unused_parameters;
  j.ddp = std::make_unique<DataParallel>(j.backbone, d, ddo);
  for (auto& p : j.backbone->parameters())
    if (p.requires_grad()) j.backbone_params.push_back(p);

  PartialFCOptions po;
  po.num_classes = cfg.data.num_classes;
  po.embedding_size = cfg.model.embedding_size;
  po.sample_rate = cfg.loss.sample_rate;
  po.margin = CombinedMargin{cfg.loss.margin[0], cfg.loss.margin[1], cfg.loss.margin[2], cfg.loss.scale,
                             cfg.loss.interclass_filtering_threshold};
  po.seed = static_cast<uint64_t>(cfg.seed);
  j.fc = std::make_unique<PartialFC>(d, po, j.device);

  BackboneOptimizerOptions boo;
  boo.kind = cfg.optim.optimizer;
  boo.momentum = cfg.optim.momentum;
  boo.weight_decay = cfg.optim.weight_decay;
  boo.beta1 = cfg.optim.betas[0];
  boo.beta2 = cfg.optim.betas[1];
  boo.eps = cfg.optim.eps;
  j.opt = std::make_unique<BackboneOptimizer>(j.backbone_params, boo);
  ShardOptimizerOptions so;
  so.kind = cfg.optim.fc_optimizer.empty() ? cfg.optim.optimizer : cfg.optim.fc_optimizer;
  so.momentum = cfg.optim.momentum;
  so.weight_decay = cfg.optim.fc_weight_decay >= 0 ? cfg.optim.fc_weight_decay : cfg.optim.weight_decay;
  so.beta1 = cfg.optim.betas[0];
  so.beta2 = cfg.optim.betas[1];
  so.eps = cfg.optim.eps;
  j.fc_opt = std::make_unique<ShardOptimizer>(*j.fc, so);
  j.schedule = PolyWarmupSchedule{cfg.optim.lr, warmup, j.total_steps, cfg.optim.power};
  j.fc_schedule = PolyWarmupSchedule{cfg.optim.fc_lr > 0 ? cfg.optim.fc_lr : cfg.optim.lr, warmup, j.total_steps,
                                     cfg.optim.power};
  LossScalerOptions lso;
  lso.init_scale = cfg.train.loss_scale_init;
  lso.growth_interval = cfg.train.loss_scale_growth_interval;
  lso.enabled = cfg.train.loss_scaling == "on" || (cfg.train.loss_scaling == "auto" && cfg.train.precision == "fp16");
  j.scaler = std::make_unique<LossScaler>(lso, j.device);

  // Outputs
  j.ckpt = std::make_unique<CheckpointManager>(cfg.output + "/checkpoints", d, cfg.train.keep_checkpoints);
  if (d.rank() == 0) {
    j.metrics = std::make_unique<MetricsLog>(cfg.output + "/metrics.jsonl", req.resume || !req.resume_from.empty());
    if (cfg.train.tensorboard) j.tb = std::make_unique<TensorBoardWriter>(cfg.output + "/tensorboard");
    const std::string vdir = cfg.data.val_dir.empty() ? cfg.data.rec : cfg.data.val_dir;
    for (const auto& t : cfg.data.val_targets) {
      const std::string p = vdir + "/" + t + ".bin";
      if (!fs::exists(p)) throw usage_error("data.val_targets: '", t, "' has no file ", p);
      j.val_sets.push_back(load_verification_data(p));
      log_info("verification set ", t, ": ", j.val_sets.back().issame.size(), " pairs");
    }
  }

  std::string from = req.resume_from;
  if (from.empty() && req.resume) from = j.ckpt->latest();
  if (req.resume && from.empty()) log_info("--resume: no committed checkpoint under ", j.ckpt->root(), ", starting fresh");
  if (!from.empty()) load_checkpoint(j, from);

  log_info("data: '", cfg.data.rec, "', ", j.dataset->size(), " images; ", j.steps_per_epoch, " steps/epoch, global batch ", global_batch,
           "; schedule: ", j.total_steps, " steps, warm-up ", warmup);
  log_info("model: ", cfg.model.backbone, " (", j.backbone_params.size(), " tensors in ", j.ddp->num_buckets(),
           " gradient buckets), classifier ", cfg.data.num_classes, " classes, ", j.fc->shard().count,
           " on this rank, ", j.fc->num_sample(), " per step; precision ", cfg.train.precision);
}

// Test hook: FACESHARD_INJECT_INF=<rank>:<step> puts an inf into one backbone gradient of
// that rank at that step, counted from 1 as in the logs (the fp16 loss scaler must then
// skip the step on every rank; without it, the loss of the next step is NaN).
void maybe_inject_inf(Job& j) {
  static const char* v = std::getenv("FACESHARD_INJECT_INF");
  if (!v) return;
  int r = -1;
  long long s = -1;
  if (std::sscanf(v, "%d:%lld", &r, &s) != 2 || r != j.dist->rank() || s != j.step + 1) return;
  for (auto& p : j.backbone_params)
    if (p.grad().defined()) {
      torch::NoGradGuard ng;
      p.mutable_grad().view({-1})[0] = std::numeric_limits<float>::infinity();
      return;
    }
}

}  // namespace

int run_training(const TrainRequest& req) {
  Job j;
  j.cfg = req.config;
  build(j, req);
  Config& cfg = j.cfg;
  Distributed& d = *j.dist;
  std::signal(SIGTERM, on_stop_signal);
  std::signal(SIGINT, on_stop_signal);

  const int64_t last_step = cfg.train.max_steps > 0 ? std::min(j.total_steps, cfg.train.max_steps) : j.total_steps;
  // With loss scaling, non-finite gradients skip the step; without, a non-finite loss stops the run.
  const bool fp16 = cfg.train.loss_scaling == "on" || (cfg.train.loss_scaling == "auto" && cfg.train.precision == "fp16");
  const bool tty = d.rank() == 0 && isatty(STDOUT_FILENO);
  at::Tensor loss_sum = torch::zeros({}, torch::TensorOptions().device(j.device));
  at::Tensor acc_sum = torch::zeros({}, torch::TensorOptions().device(j.device));
  at::Tensor first_bad = torch::full({}, -1, torch::TensorOptions().device(j.device).dtype(torch::kLong));
  int64_t logged_steps = 0, skipped = 0;
  auto t_log = Clock::now();
  auto t_start = Clock::now();
  const int64_t start_step = j.step;
  // An epoch is steps_per_epoch whole steps: micro-batches left over at its end (batches
  // per epoch not a multiple of grad_accumulation) are never read, so no gradient of them
  // leaks into the next step.
  const int64_t batches_per_epoch = j.steps_per_epoch * j.micro;
  j.loader->start_epoch(static_cast<uint64_t>(j.epoch), static_cast<uint64_t>(j.batch_in_epoch));
  j.backbone->train();
  // The starting point of the verification curve (chance for a fresh model).
  if (cfg.train.verify_every > 0 && j.step == 0 && last_step > 0) verify(j, false);

  auto check_finite = [&] {
    const int64_t bad = first_bad.item<int64_t>();
    if (bad >= 0) {
      const std::string last = j.ckpt->latest();
      throw runtime_error("the loss became NaN/inf at step ", bad + 1, "; stopping. Last good checkpoint: ",
                          last.empty() ? "none" : last);
    }
  };

  while (j.step < last_step) {
    if (j.batch_in_epoch == batches_per_epoch) {
      j.epoch++;
      j.batch_in_epoch = 0;
      j.loader->start_epoch(static_cast<uint64_t>(j.epoch), 0);
    }
    std::optional<Batch> batch = j.loader->next();
    if (!batch) throw runtime_error("data loader: epoch ", j.epoch, " ended after ", j.batch_in_epoch, " of ", batches_per_epoch, " batches");
    j.batch_in_epoch++;
    const bool sync_step = j.batch_in_epoch % j.micro == 0;
    auto out = j.fc->forward(j.backbone->forward(batch->images), batch->labels);
    at::Tensor loss = j.micro > 1 ? out.loss / static_cast<double>(j.micro) : out.loss;
    at::Tensor scaled = j.scaler->scale(loss).reshape(loss.sizes());
    j.ddp->prepare_for_backward({scaled});
    if (sync_step) {
      scaled.backward();
    } else {
      auto guard = j.ddp->no_sync();
      scaled.backward();
    }
    {
      torch::NoGradGuard ng;
      loss_sum.add_(out.loss.detach());
      acc_sum.add_(out.accuracy.detach());
      if (!fp16) {
        at::Tensor nonfinite = (~torch::isfinite(out.loss.detach())) & (first_bad < 0);
        first_bad.masked_fill_(nonfinite, j.step);
      }
    }
    if (j.device.is_cpu() && !fp16) check_finite();  // free on CPU: stop at the very step
    const double lr = j.schedule.lr(j.step), fc_lr = j.fc_schedule.lr(j.step);
    if (!sync_step) {
      // The classifier's sampled rows change every micro-batch: keep their gradient.
      j.fc_opt->accumulate();
      continue;
    }

    maybe_inject_inf(j);
    bool skip = false;
    if (fp16) {
      j.fc_opt->merge_accumulated();
      std::vector<at::Tensor> all = j.backbone_params;
      if (j.fc->sampled_weight().defined()) all.push_back(j.fc->sampled_weight());
      at::Tensor found_inf = j.scaler->unscale_(all);
      // Every rank must take the same decision (the shards' gradients differ).
      at::Tensor f = found_inf.to(torch::kCPU).to(torch::kFloat).reshape({1}).clone();
      d.all_reduce(f, ReduceOp::Max);
      skip = j.scaler->update(f.to(found_inf.device()));
    }
    if (skip) {
      skipped++;
      j.opt->zero_grad();
      j.fc_opt->zero_grad();
      log_info("loss scaling: non-finite gradients at step ", j.step + 1, ", step skipped; loss scale now ",
               j.scaler->current_scale());
    } else {
      if (cfg.optim.grad_clip > 0) clip_grad_norm(j.backbone_params, cfg.optim.grad_clip);
      j.opt->step(lr);
      j.fc_opt->step(fc_lr);
      j.opt->zero_grad();
    }
    j.step++;
    logged_steps++;

    if (tty && j.step % cfg.train.log_every != 0) {
      const int width = 30;
      const int filled = static_cast<int>(width * j.step / std::max<int64_t>(1, last_step));
      std::printf("\r[%s%s] %lld/%lld", std::string(filled, '#').c_str(), std::string(width - filled, ' ').c_str(),
                  static_cast<long long>(j.step), static_cast<long long>(last_step));
      std::fflush(stdout);
    }
    if (j.step % cfg.train.log_every == 0 || j.step == last_step) {
      if (!fp16) check_finite();
      const double secs = seconds_since(t_log);
      const double loss_v = loss_sum.item<double>() / (logged_steps * j.micro);
      const double acc_v = acc_sum.item<double>() / (logged_steps * j.micro);
      const double sps = logged_steps * j.micro * cfg.data.batch_size * d.world_size() / std::max(secs, 1e-9);
      const double per_step = seconds_since(t_start) / std::max<int64_t>(1, j.step - start_step);
      std::ostringstream os;
      os << std::fixed << "step " << j.step << "/" << last_step << "  epoch " << j.epoch
         << std::setprecision(4) << "  loss " << loss_v << "  acc " << acc_v << std::setprecision(6) << "  lr " << lr
         << std::setprecision(1) << "  " << sps << " samples/s  ETA " << format_duration(per_step * (last_step - j.step));
      if (fp16) os << "  loss scale " << j.scaler->current_scale();
      if (j.device.is_cuda()) os << std::setprecision(2) << "  mem " << gpu_memory_gb(j.device) << " GB";
      if (tty) std::printf("\r");
      log_info(os.str());
      if (j.metrics) {
        std::vector<std::pair<std::string, double>> f{{"step", static_cast<double>(j.step)},
                                                      {"epoch", static_cast<double>(j.epoch)},
                                                      {"loss", loss_v},
                                                      {"accuracy", acc_v},
                                                      {"lr", lr},
                                                      {"samples_per_sec", sps}};
        if (fp16) f.emplace_back("loss_scale", j.scaler->current_scale());
        j.metrics->write(f);
      }
      if (j.tb) {
        j.tb->add_scalar("loss", loss_v, j.step);
        j.tb->add_scalar("accuracy", acc_v, j.step);
        j.tb->add_scalar("learning_rate", lr, j.step);
        j.tb->add_scalar("samples_per_sec", sps, j.step);
        if (fp16) j.tb->add_scalar("loss_scale", j.scaler->current_scale(), j.step);
        j.tb->flush();
      }
      loss_sum.zero_();
      acc_sum.zero_();
      logged_steps = 0;
      t_log = Clock::now();
    }
    if (cfg.train.verify_every > 0 && j.step % cfg.train.verify_every == 0 && j.step != last_step) verify(j, false);
    const bool epoch_end = j.batch_in_epoch == batches_per_epoch;
    const bool want_ckpt = cfg.train.checkpoint_every > 0 ? j.step % cfg.train.checkpoint_every == 0 : epoch_end;
    // SIGTERM/SIGINT on any rank: every rank learns it at the same step.
    at::Tensor stop = torch::tensor({static_cast<float>(g_stop_signal.load() != 0)});
    d.all_reduce(stop, ReduceOp::Max);
    if (stop.item<float>() > 0) {
      if (!fp16) check_finite();
      log_info("stop requested (signal): checkpointing at step ", j.step, " and exiting");
      save_checkpoint(j);
      d.shutdown();
      return 0;
    }
    if (want_ckpt && j.step != last_step) {
      if (!fp16) check_finite();
      save_checkpoint(j);
    }
  }
  if (!fp16) check_finite();
  if (skipped) log_info("loss scaling: ", skipped, " steps skipped for non-finite gradients");
  verify(j, true);
  save_checkpoint(j);
  export_model(j);
  d.shutdown();
  log_info("done: ", j.step, " steps in ", format_duration(seconds_since(t_start)));
  return 0;
}

}  // namespace faceshard
