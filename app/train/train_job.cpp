#include "app/train/train_job.h"

#include <unistd.h>

#ifdef FACESHARD_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "app/config/job_settings.h"
#include "app/train/centre_init.h"
#include "app/train/data_counts.h"
#include "app/train/sync_bn.h"
#include "data/sampler.h"
#include "models/backbone_registry.h"
#include "models/prelu.h"
#include "base/cpu_block_cache.h"
#include "partial_fc/distributed/dist_env.h"
#include "base/error.h"
#include "base/log.h"

namespace faceshard {
namespace {

CudaBackend cuda_backend_of(const Config& cfg) {
  return cfg.dist.backend == "gloo" ? CudaBackend::Gloo : CudaBackend::Nccl;
}

torch::Device pick_device(const Config& cfg, const DistEnv& env) {
  const bool cuda_ok = nccl_compiled() && torch::cuda::is_available();
  if (cfg.dist.device == "cuda" && !cuda_ok)
    throw_config_error(cfg, "dist.device", std::string("cuda requested but ") +
                                               (nccl_compiled() ? "no GPU is visible" : "this build has no CUDA"));
  if (cfg.dist.backend == "nccl" && !cuda_ok)
    throw_config_error(cfg, "dist.backend", std::string("nccl needs a GPU but ") +
                                                (nccl_compiled() ? "no GPU is visible" : "this build has no CUDA"));
  if (cfg.dist.device == "cuda" || (cfg.dist.device == "auto" && cuda_ok))
    return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(cuda_device_of(env, cuda_backend_of(cfg))));
  return torch::kCPU;
}

// data.global_batch_size keeps the global batch what the config says on any number of ranks
// (an elastic run stays one experiment): the per-rank batch follows the world size. A resume
// keeps its checkpoint's global batch the same way, unless the config changes it on purpose
// (data.global_batch_size set to another value, or data.batch_size other than the
// checkpoint's per-rank batch): the schedule's length and the learning rate at each step
// depend on it (TrainState::load says in one line what such a change changes).
void adapt_batch_to_world(Config& cfg, const Distributed& d, const std::optional<CheckpointBatch>& resumed) {
  const int64_t acc = cfg.optim.grad_accumulation, w = d.world_size();
  if (resumed && resumed->global_batch > 0 && !cfg.data.global_batch_size &&
      cfg.data.batch_size == resumed->batch_size) {
    const CheckpointBatch& ck = *resumed;
    const int64_t g = ck.global_batch;
    if (g % (w * acc) != 0)
      throw_config_error(
          cfg, "data.batch_size",
          detail::concat(cfg.data.batch_size, " is the checkpoint's per-rank batch, and its global batch ", g, " (",
                         ck.batch_size, " x ", ck.world_size, " ranks x ", ck.grad_accumulation, " micro-batches, ",
                         ck.checkpoint, ") cannot be split evenly over ", w, " ranks x ", acc,
                         " micro-batches (optim.grad_accumulation): resume on a number of ranks that divides it, or "
                         "change the global batch on purpose with data.global_batch_size (a multiple of ",
                         w * acc, ")"));
    cfg.data.batch_size = g / (w * acc);
    if (d.rank() == 0 && (w != ck.world_size || acc != ck.grad_accumulation))
      log_info("resume: the checkpoint's global batch ", g, " kept: ", cfg.data.batch_size, " images per rank x ", acc,
               " micro-batches on ", w, " ranks (it trained with ", ck.batch_size, " x ", ck.grad_accumulation, " on ",
               ck.world_size, "); data.global_batch_size changes it");
    return;
  }
  if (!cfg.data.global_batch_size) return;
  const int64_t per_rank = batch_per_rank(cfg, d.world_size());
  if (d.rank() == 0)
    log_info("data.global_batch_size ", *cfg.data.global_batch_size, ": ", per_rank,
             " images per rank and micro-batch on ", w, " ranks x ", acc, " micro-batches (data.batch_size ",
             cfg.data.batch_size, " is not used)");
  cfg.data.batch_size = per_rank;
}

// The data's counts (data_counts.h), said on rank 0.
void resolve_job_data_counts(TrainJob& j) {
  if (const std::optional<std::string> said = resolve_data_counts(j.cfg, *j.dataset); said && j.dist->rank() == 0)
    log_info(*said);
}

void build_data(TrainJob& j) {
  const Config& cfg = j.cfg;
  Distributed& d = *j.dist;
  RecordIndexOptions index = default_record_index_options();
  if (cfg.data.index_cache) index.cache_dir = *cfg.data.index_cache == "off" ? "" : *cfg.data.index_cache;
  // An image folder is checked whole before training, as faceshard-pack checks it.
  ImageFolderOptions folder;
  folder.check_images = true;
  folder.image_size = LoaderOptions().image_size;
  folder.threads = static_cast<int>(cfg.data.num_workers);
  folder.skip_bad = cfg.data.skip_bad;
  folder.report = d.rank() == 0;
  j.dataset = open_dataset(cfg.data.rec, cfg.data.num_classes.value_or(0), 1000000, index, folder);
  if (const auto* rec = dynamic_cast<const RecordIODataset*>(j.dataset.get())) {
    const RecordIndex& idx = rec->records().index();
    if (idx.cache_failed()) {
      // Training does not need the cache: one warning, the index held in memory.
      log_warn("data: index cache not used (", idx.cache_problem(),
               "); the index of ", rec->records().num_entries(), " records is held in memory");
    } else if (d.rank() == 0) {
      log_info("data: ", rec->size(), " images, index of ", rec->records().num_entries(), " records from ",
               idx.source());
    }
  }
  resolve_job_data_counts(j);
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
  lo.num_classes = *cfg.data.num_classes;
  lo.device = j.device;
  j.loader = std::make_unique<DataLoader>(
      j.dataset, DistributedSampler(j.dataset->size(), d.world_size(), d.rank(), static_cast<uint64_t>(cfg.seed)), lo);
  j.micro = cfg.optim.grad_accumulation;
  j.steps_per_epoch = static_cast<int64_t>(j.loader->batches_per_epoch()) / j.micro;
  if (j.steps_per_epoch < 1)
    throw usage_error("data: ", j.dataset->size(), " images on ", d.world_size(), " ranks make no full step of batch ",
                      cfg.data.batch_size, " x ", j.micro, " micro-batches");
  const int64_t num_images = cfg.data.num_images.value_or(static_cast<int64_t>(j.dataset->size()));
  const int64_t sched_steps_per_epoch = std::max<int64_t>(1, num_images / j.global_batch());
  j.total_steps = cfg.optim.total_steps.value_or(sched_steps_per_epoch * cfg.optim.epochs);
  j.warmup_steps =
      cfg.optim.warmup_steps.value_or(static_cast<int64_t>(cfg.optim.warmup_epochs * sched_steps_per_epoch));
  j.last_step = std::min(j.total_steps, cfg.train.max_steps.value_or(j.total_steps));
}

void build_model(TrainJob& j, ClassifierStart start) {
  const Config& cfg = j.cfg;
  Distributed& d = *j.dist;
  BackboneOptions bo;
  bo.name = cfg.model.backbone;
  bo.embedding_size = cfg.model.embedding_size;
  bo.dropout = cfg.model.dropout;
  bo.channels_last = with_config_keys(cfg, {{"backbone", "model.backbone"}}, [&] {
    return cfg.model.channels_last.value_or(backbone_default_channels_last(cfg.model.backbone));
  });
  bo.checkpointing = cfg.model.checkpointing;
  bo.precision = parse_body_precision(cfg.train.precision);
  set_prelu_own_pass(cfg.model.prelu_kernel);
  torch::manual_seed(cfg.seed);
  j.backbone = with_config_keys(cfg, {{"backbone", "model.backbone"}, {"embedding_size", "model.embedding_size"},
                                      {"dropout", "model.dropout"}, {"checkpointing", "model.checkpointing"}},
                                [&] { return make_backbone(bo); });
  if (j.backbone->checkpointing())
    log_info("activation checkpointing: ", cfg.model.backbone, " recomputes its blocks in backward");
  if (cfg.model.init) {
    const std::string path = std::filesystem::absolute(*cfg.model.init).lexically_normal().string();
    const StateDictLoad load = load_backbone_weights(*j.backbone, *cfg.model.init);
    if (d.rank() == 0)
      log_info("model.init: ", describe_load(*j.backbone, path, load),
               cfg.loss.init_centres ? "; the classifier's centres from loss.init_centres" : "; the classifier starts fresh",
               start == ClassifierStart::FromCheckpoint ? " (the checkpoint resumed replaces both)" : "");
  }
  j.backbone->to(j.device);
  if (bo.channels_last) j.backbone->to_channels_last();
  if (cfg.model.sync_bn) log_info("SyncBatchNorm: ", convert_sync_batchnorm(*j.backbone, d), " layers");
  DdpOptions ddo;
  ddo.bucket_mb = cfg.dist.bucket_mb;
  ddo.find_unused_parameters = cfg.dist.find_unused_parameters;
  for (auto& p : j.backbone->parameters())
    if (p.requires_grad()) j.backbone_params.push_back(p);
  j.freeze = with_config_keys(cfg, {{"freeze_stages", "optim.freeze_stages"}}, [&] {
    return BackboneFreeze(*j.backbone, j.backbone_params, cfg.optim.freeze_backbone_steps, cfg.optim.freeze_stages);
  });
  if (cfg.optim.fused && cfg.dist.find_unused_parameters)
    log_info("optim.fused: off with dist.find_unused_parameters (a parameter without a gradient must not move)");
  if (cfg.optim.fused && !cfg.dist.find_unused_parameters) {
    j.flat = std::make_unique<FlatParameters>(j.backbone_params, cfg.dist.bucket_mb, j.freeze.partition());
    ddo.flat = j.flat.get();
  } else {
    ddo.partition = j.freeze.partition();
  }
  j.ddp = std::make_unique<DataParallel>(j.backbone, d, ddo);

  // The classifier's options on the one road from the config (job_settings.h), with this
  // job's world size, per-rank batch (adapted to the world and the resumed checkpoint) and
  // its device's body precision.
  JobSettings settings = job_settings(cfg, d.world_size());
  settings.batch_per_rank = cfg.data.batch_size;
  settings.num_classes = *cfg.data.num_classes;
  settings.precision = bo.precision == BodyPrecision::BFloat16 ? "bf16"
                       : bo.precision == BodyPrecision::Float16 ? "fp16"
                                                                : "fp32";
  if (settings.margin.mode == MarginMode::ArcfaceTorch && settings.margin.m3 > 0 &&
      (settings.margin.m1 != 1.0 || settings.margin.m2 != 0.0))
    log_info("loss.margin_mode arcface_torch: with m3 > 0 arcface_torch applies the cosine margin m3 alone (m1 = ",
             settings.margin.m1, " and m2 = ", settings.margin.m2, " are ignored, as there)");
  // Centres from another run (loss.init_centres) fill the rows instead of the random draw.
  const bool centres_from_run = start == ClassifierStart::Fresh && cfg.loss.init_centres.has_value();
  std::vector<std::pair<std::string, std::string>> keys = {
      {"num_classes", "data.num_classes"}, {"sample_rate", "loss.sample_rate"}, {"margin", "loss.margin"},
      {"margin_mode", "loss.margin_mode"}, {"embedding_size", "model.embedding_size"},
      {"optimizer", "optim.fc_optimizer"}, {"head", "loss.head"}, {"fc_state_dtype", "optim.fc_state_dtype"},
      {"fc_weight_dtype", "optim.fc_weight_dtype"}, {"subcenters", "loss.subcenters"},
      {"fc_weight_rounding", "optim.fc_weight_rounding"}, {"logits", "loss.logits"},
      {"grad_accumulation", "optim.grad_accumulation"}, {"precision", "train.precision"}};
  if (const HeadInfo* h = find_head_info(cfg.loss.head))
    for (const HeadParam& p : h->params) keys.emplace_back(p.name, "loss." + h->name + "." + p.name);
  PartialFCOptions po = with_config_keys(cfg, keys, [&] { return classifier_options(settings); });
  po.initialise_rows = start == ClassifierStart::Fresh && !centres_from_run;
  ClassifierMemoryPlan fc_plan;
  j.fc = with_config_keys(cfg, keys, [&] {
    // Before anything of the classifier is allocated: a shard that cannot fit is a config
    // error naming the keys that size it, not the allocator's message deep in training.
    fc_plan = classifier_memory_plan(po, d.world_size(), d.rank(), cfg.data.batch_size, j.device.is_cuda());
    if (const auto available = device_available_memory(j.device))
      check_classifier_fits(cfg, fc_plan, d.world_size(), d.rank(), *available, j.device);
    return std::make_unique<PartialFC>(d, po, j.device);
  });
  if (d.rank() == 0) log_info(describe_shard_memory(*j.fc, fc_plan, settings));
  if (centres_from_run) {
    const CentreInitPlan plan = plan_centre_init(cfg, po.num_classes, po.subcenters);
    init_centres(*j.fc, plan);
    if (d.rank() == 0) log_info(describe(plan));
  }

  BackboneOptimizerOptions boo;
  boo.kind = cfg.optim.optimizer;
  boo.momentum = cfg.optim.momentum;
  boo.weight_decay = cfg.optim.weight_decay;
  boo.beta1 = cfg.optim.betas[0];
  boo.beta2 = cfg.optim.betas[1];
  boo.eps = cfg.optim.eps;
  j.opt = j.flat ? std::make_unique<BackboneOptimizer>(*j.flat, boo)
                 : std::make_unique<BackboneOptimizer>(j.backbone_params, boo);
  j.schedule = PolyWarmupSchedule{cfg.optim.lr, j.warmup_steps, j.total_steps, cfg.optim.power};
  j.fc_schedule = PolyWarmupSchedule{cfg.optim.classifier_lr(), j.warmup_steps, j.total_steps, cfg.optim.power};
  j.schedule.validate();
  j.fc_schedule.validate();
  LossScalerOptions lso;
  lso.init_scale = cfg.train.loss_scale_init;
  lso.growth_interval = cfg.train.loss_scale_growth_interval;
  j.loss_scaling = cfg.train.loss_scaling == "on" || (cfg.train.loss_scaling == "auto" && cfg.train.precision == "fp16");
  lso.enabled = j.loss_scaling;
  j.scaler = std::make_unique<LossScaler>(lso, j.device);
}

}  // namespace

namespace {

// A number of bytes from a cgroup file ("max" or unreadable: nothing).
std::optional<double> cgroup_bytes(const std::string& path) {
  std::ifstream f(path);
  std::string v;
  if (!(f >> v) || v.empty() || !std::isdigit(static_cast<unsigned char>(v[0]))) return std::nullopt;
  return std::strtod(v.c_str(), nullptr);
}

}  // namespace

std::optional<AvailableMemory> device_available_memory(torch::Device dev) {
#ifdef FACESHARD_WITH_CUDA
  if (dev.is_cuda()) {
    const c10::DeviceIndex index = dev.has_index() ? dev.index() : c10::cuda::current_device();
    const auto [free, total] = c10::cuda::CUDACachingAllocator::get()->getMemoryInfo(index);
    (void)total;
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(index);
    const double cached = static_cast<double>(stats.reserved_bytes[0].current - stats.allocated_bytes[0].current);
    return AvailableMemory{static_cast<double>(free) + cached, "free on cuda:" + std::to_string(index)};
  }
#endif
  if (!dev.is_cpu()) return std::nullopt;
  std::optional<AvailableMemory> out;
  std::ifstream meminfo("/proc/meminfo");
  for (std::string key; meminfo >> key;) {
    double kb = 0;
    meminfo >> kb;
    if (key == "MemAvailable:") out = AvailableMemory{kb * 1024, "MemAvailable"};
    meminfo.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
  }
  // A container's limit: cgroup v2, else v1.
  struct Cgroup {
    const char* limit;
    const char* usage;
    const char* what;
  };
  for (const Cgroup& c : {Cgroup{"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "cgroup memory.max"},
                          Cgroup{"/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                 "/sys/fs/cgroup/memory/memory.usage_in_bytes", "cgroup memory.limit_in_bytes"}}) {
    const auto limit = cgroup_bytes(c.limit), usage = cgroup_bytes(c.usage);
    if (!limit || !usage) continue;
    const double left = std::max(0.0, *limit - *usage);
    if (!out || left < out->bytes) out = AvailableMemory{left, std::string(c.what) + " less usage"};
    break;
  }
  return out;
}

std::string describe_shard_memory(const PartialFC& fc, const ClassifierMemoryPlan& plan, const JobSettings& s) {
  // The bytes the built shard holds, counted from its tensors (not from the plan's formula).
  double weight = 0, state = 0;
  for (const auto& [name, t] : fc.state()) (name == "weight" ? weight : state) += double(t.nbytes());
  const PartialFCOptions& o = fc.options();
  std::ostringstream os;
  os << "classifier shard (rank 0 of " << s.world_size << "): " << plan.rows << " classes";
  if (plan.subcenters > 1) os << " x " << plan.subcenters << " sub-centres";
  os << " x " << plan.embedding_size << "; centres " << static_cast<long long>(weight) << " bytes ("
     << s.fc_weight_dtype << "), optimiser state " << static_cast<long long>(state) << " bytes (" << o.optimizer.kind
     << ", " << s.fc_state_dtype << "), as allocated; " << fc.num_sample() << " classes take part in a step; logits "
     << (o.streamed_logits ? std::string("streamed (no buffer)")
                           : "buffered: " + std::to_string(static_cast<long long>(plan.logits_bytes)) + " bytes")
     << " (global batch " << plan.global_batch << ", " << s.precision << " GEMMs)";
  return os.str();
}

void check_classifier_fits(const Config& cfg, const ClassifierMemoryPlan& p, int world_size, int rank,
                           const AvailableMemory& available, torch::Device device) {
  if (p.total_bytes() <= available.bytes) return;
  auto bytes = [](double b) { return std::to_string(static_cast<long long>(std::min(b, 9.2e18))); };
  std::ostringstream os;
  os << *cfg.data.num_classes << " classes do not fit: rank " << rank << "'s classifier shard needs at least "
     << bytes(p.total_bytes()) << " bytes (" << p.rows << " rows x " << p.embedding_size << " fp32: weight "
     << bytes(p.weight_bytes) << ", optimiser state " << bytes(p.state_bytes) << ", gradient " << bytes(p.gradient_bytes)
     << ", logits " << p.global_batch << " x " << p.sampled_rows << " x 4 B = " << bytes(p.logits_bytes)
     << ", chunk temporaries " << bytes(p.chunk_bytes) << ") with loss.sample_rate " << cfg.loss.sample_rate << ", data.batch_size " << cfg.data.batch_size
     << " and world size " << world_size << ", but " << device.str() << " has " << bytes(available.bytes)
     << " bytes available (" << available.what << ")";
  throw_config_error(cfg, "data.num_classes", os.str());
}

std::optional<double> device_peak_memory_gb(torch::Device dev) {
#ifdef FACESHARD_WITH_CUDA
  if (dev.is_cuda()) {
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(dev.index());
    return static_cast<double>(stats.allocated_bytes[0].peak) / (1 << 30);
  }
#endif
  return std::nullopt;
}

void check_model_config(const Config& cfg) {
  BackboneOptions bo;
  bo.name = cfg.model.backbone;
  bo.embedding_size = cfg.model.embedding_size;
  bo.dropout = cfg.model.dropout;
  bo.checkpointing = cfg.model.checkpointing;
  with_config_keys(cfg, {{"backbone", "model.backbone"}, {"embedding_size", "model.embedding_size"},
                         {"dropout", "model.dropout"}, {"checkpointing", "model.checkpointing"}},
                   [&] { check_backbone_options(bo); });
  check_freeze_config(cfg);
}

TrainJob build_train_job(const Config& cfg, ClassifierStart start, const std::optional<CheckpointBatch>& resumed) {
  check_model_config(cfg);
  DistOptions dopts;
  dopts.timeout = std::chrono::milliseconds(static_cast<int64_t>(cfg.dist.timeout_s * 1000));
  dopts.rendezvous_timeout = std::chrono::milliseconds(static_cast<int64_t>(cfg.dist.rendezvous_timeout_s * 1000));
  dopts.hang_floor = std::chrono::milliseconds(static_cast<int64_t>(cfg.dist.hang_floor_s * 1000));
  DistEnv env = DistEnv::from_environment();
  dopts.use_cuda = pick_device(cfg, env).is_cuda();
  dopts.cuda_backend = cuda_backend_of(cfg);
  std::shared_ptr<Distributed> dist = Distributed::init(env, dopts);
  log_info("job: ", env.describe(), ", device ", pick_device(cfg, env).str());
  return build_train_job(cfg, std::move(dist), start, resumed);
}

// The CPU block cache's budget (train.cpu_cache_gb; unset: a quarter of the machine's
// memory, shared by the ranks on it), set before the job allocates anything.
void configure_cpu_block_cache(const Config& cfg, const DistEnv& env) {
  double bytes = 0;
  if (cfg.train.cpu_cache_gb) {
    bytes = *cfg.train.cpu_cache_gb * 1e9;
  } else {
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    if (pages > 0 && page > 0) bytes = double(pages) * double(page) / 4 / std::max(1, env.local_world_size);
  }
  CpuBlockCache::install();
  CpuBlockCache::set_limit(static_cast<int64_t>(bytes));
}

TrainJob build_train_job(const Config& cfg, std::shared_ptr<Distributed> dist, ClassifierStart start,
                         const std::optional<CheckpointBatch>& resumed) {
  configure_cpu_block_cache(cfg, DistEnv::from_environment());
  TrainJob j;
  j.cfg = cfg;
  j.device = pick_device(cfg, DistEnv::from_environment());
#ifdef FACESHARD_WITH_CUDA
  // The job's GPU current for this thread before anything of the job exists, whatever the
  // backend: NCCL's set-up does it, Gloo's does not, and a capture (train.cuda_graph) on
  // another device than the current one is refused.
  if (j.device.is_cuda()) c10::cuda::set_device(j.device.index());
#endif
  j.stream = std::make_shared<TrainingStream>(j.device);
  j.dist = std::move(dist);
  j.cfg.train.precision = resolve_precision(cfg.train.precision, device_has_bf16(j.device));
  if (cfg.train.precision == "auto") log_info("train.precision auto: ", j.cfg.train.precision, " on ", j.device.str());
  if (j.device.is_cuda() && cfg.train.cudnn_benchmark) at::globalContext().setBenchmarkCuDNN(true);
  if (j.device.is_cuda()) {
    at::globalContext().setAllowTF32CuBLAS(cfg.train.tf32);
    at::globalContext().setAllowTF32CuDNN(cfg.train.tf32);
  }
  adapt_batch_to_world(j.cfg, *j.dist, resumed);
  build_data(j);
  build_model(j, start);
  return j;
}

}  // namespace faceshard
