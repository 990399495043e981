// faceshard-plan: what one rank of a training job needs in device memory, part by part
// (backbone parameters, gradients, optimiser state, activations; the classifier shard's rows,
// optimiser state, gradient and logits; DataParallel's buckets and the embedding all-gather),
// whether that fits a device, the largest number of identities and the largest batch per rank
// that do; how long the job takes (measured step rates, app/plan/job_time_plan.h), the decode
// rate its loaders must sustain, its checkpoints' size on disk and whether its learning rate
// needs scaling for its global batch. The formulas
// are app/plan/job_memory_plan.h (the classifier's are classifier_memory_plan(), the ones the
// trainer checks before it allocates); the activations come from the measured table
// app/plan/activations.json (faceshard-bench --mode activations).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>

#include "app/config/cli.h"
#include "app/plan/activation_table.h"
#include "app/plan/job_memory_plan.h"
#include "app/plan/checkpoint_staging_plan.h"
#include "app/plan/job_time_plan.h"
#include "app/train/data_counts.h"
#include "base/error.h"
#include "base/tool_args.h"

using namespace faceshard;

namespace {

const char* kUsage =
    "usage: faceshard-plan [--config FILE [--set key=value ...]] [--network NAME] [--batch B]\n"
    "                      [--precision fp32|bf16|fp16] [--checkpointing on|off] [--classes C] [--ranks W]\n"
    "                      [--sample-rate R] [--subcenters K] [--optimizer sgd|adamw] [--fc-optimizer sgd|adamw]\n"
    "                      [--fc-update sampled|all] [--fc-state-dtype fp32|bf16] [--fc-weight-dtype fp32|bf16]\n"
    "                      [--logits auto|buffer|streamed] [--grad-accumulation K] [--cuda-graph on|off]\n"
    "                      [--device-memory SIZE] [--reserve SIZE] [--activations FILE] [--json FILE]\n"
    "                      [--images N] [--epochs E] [--gpus-per-host G] [--bench FILE] [--keep-checkpoints K]\n"
    "  --config FILE        a training config gives the settings (model.backbone, data.batch_size or\n"
    "                       data.global_batch_size, train.precision, model.checkpointing, data.num_classes,\n"
    "                       loss.sample_rate, optim.*); the flags override it. Defaults: r50, batch 128,\n"
    "                       fp32, the network's checkpointing, 1 rank, sample rate 1.0, sgd\n"
    "  --batch B            images per rank (per micro-batch)\n"    "  --cuda-graph on|off  the backbone's CUDA graphs (train.cuda_graph) and the static tensors they keep\n"
    "  --classes C          identities, e.g. 2059906, 125k, 1.4M, 29M\n"
    "  --subcenters K       centres per class (loss.subcenters, Sub-center ArcFace; default 1): K x the rows,\n"
    "                       their state and the classifier GEMMs' columns\n"
    "  --ranks W            ranks (GPUs) the classifier is sharded over (default 1)\n"
    "  --device-memory SIZE one device's memory, e.g. 80GB (10^9 B), 80GiB (2^30 B), 32510MiB: says whether\n"
    "                       the job fits and finds the largest number of classes that does\n"
    "  --reserve SIZE       kept aside for what the plan does not count: CUDA context, NCCL and cuDNN\n"
    "                       workspaces, allocator fragmentation (default 1GiB)\n"
    "  --activations FILE   an activations table from faceshard-bench --mode activations --json FILE\n"
    "                       (default: the one built in, app/plan/activations.json)\n"
    "  --images N           images per epoch (default: data.num_images, or the preset's data set as published):\n"
    "                       with it the plan says how long the job takes\n"
    "  --epochs E           epochs (default: optim.epochs, 20)\n"
    "  --gpus-per-host G    GPUs (ranks) per host, for the decode rate a host's loaders must sustain\n"
    "                       (default: the ranks, at most 8)\n"
    "  --bench FILE         step rates from faceshard-bench --mode step --json FILE run on your card, or a GPU\n"
    "                       check report (default: the built-in figures, measured on an NVIDIA H200)\n"
    "  --keep-checkpoints K checkpoints kept (default: train.keep_checkpoints, 3), for the disk they take\n";

// "80GB", "79.6GiB", "32510MiB", "1e9": bytes.
double parse_size(const std::string& flag, const std::string& v) {
  static const std::map<std::string, double> units = {
      {"", 1},        {"B", 1},        {"KB", 1e3},     {"MB", 1e6},      {"GB", 1e9},          {"TB", 1e12},
      {"KiB", 1024.}, {"MiB", 1048576.}, {"GiB", 1073741824.}, {"TiB", 1099511627776.}};
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  const auto u = end ? units.find(std::string(end)) : units.end();
  if (v.empty() || end == v.c_str() || u == units.end() || !(x >= 0) || !std::isfinite(x))
    throw usage_error(flag, " '", faceshard::detail::printable(v), "': expected a size such as 80GB, 79.6GiB or 32510MiB");
  return x * u->second;
}

// "2059906", "125k", "1.4M", "29M": a whole number.
int64_t parse_count(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  double x = std::strtod(v.c_str(), &end);
  const std::string unit = end ? end : "";
  if (unit == "k" || unit == "K") x *= 1e3;
  else if (unit == "M") x *= 1e6;
  else if (unit == "G") x *= 1e9;
  else if (!unit.empty()) x = -1;
  if (v.empty() || end == v.c_str() || !(x >= 0 && x < 9e15) || std::nearbyint(x) != x)
    throw usage_error(flag, " '", faceshard::detail::printable(v), "': expected a whole number such as 2059906, 125k or 1.4M");
  return static_cast<int64_t>(x);
}

double parse_rate(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end || !(x > 0 && x <= 1)) throw usage_error(flag, " '", faceshard::detail::printable(v), "': expected a number in (0, 1]");
  return x;
}

std::string choice(const std::string& flag, const std::string& v, std::initializer_list<const char*> allowed) {
  std::string list;
  for (const char* a : allowed) {
    if (v == a) return v;
    list += (list.empty() ? "" : ", ") + std::string(a);
  }
  throw usage_error(flag, " '", faceshard::detail::printable(v), "': expected one of ", list);
}

// An option error of the plan, in the flag's name.
[[noreturn]] void rethrow_as_flag(const Error& e) {
  static const std::map<std::string, std::string> flags = {
      {"backbone", "--network"},       {"network", "--network"},        {"precision", "--precision"},
      {"checkpointing", "--checkpointing"}, {"batch", "--batch"},      {"ranks", "--ranks"},
      {"classes", "--classes"},        {"num_classes", "--classes"},    {"sample_rate", "--sample-rate"},
      {"optimizer", "--optimizer"},    {"fc_state_dtype", "--fc-state-dtype"},
      {"fc_weight_dtype", "--fc-weight-dtype"}, {"logits", "--logits"},
      {"grad_accumulation", "--grad-accumulation"}, {"subcenters", "--subcenters"}, {"embedding_size", "--embedding (model.embedding_size)"}};
  const auto f = flags.find(e.option());
  if (f == flags.end()) throw e;
  throw usage_error(f->second, ": ", e.detail());
}

std::string mib(double bytes) {
  char b[64];
  std::snprintf(b, sizeof b, "%.1f", bytes / 1048576.0);
  return b;
}

std::string json_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o.push_back('\\');
    o.push_back(c);
  }
  return o;
}

// One faceshard-plan call: its flags and config, and each part of the plan printed in turn.
struct PlanCall {
  PlanCall(int argc, char** argv) : args(parse_config_args(argc, argv)) {}
  bool has(const char* f) const { return flag.count(f) > 0; }
  // Flags first (the config's batch split needs --ranks), then config < flags.
  void read_settings();
  // The device, the tables, the schedule's inputs, the checkpoints kept.
  void read_inputs();
  // The memory plan (at the largest class count that fits when none is given), the largest
  // class count and batch.
  void plan_memory();
  void print_memory();
  void print_device();
  void print_time();
  void print_checkpoint();
  void write_json() const;

  ConfigArgs args;
  std::map<std::string, std::string> flag;
  int ranks = 1;
  JobSettings in;
  std::optional<Config> cfg;
  std::optional<double> device;
  double reserve = 0;
  ActivationTable table = ActivationTable::shipped();
  StepRateTable rates = StepRateTable::shipped();
  std::optional<LrReference> ref;
  TimePlanInputs tin;
  std::string images_from;
  int64_t keep = 3;
  double job_lr = 0.1;
  JobMemoryPlan plan;
  int64_t max_classes = -1, max_batch = -1;
  std::string fc_opt;
  bool fits = true;
  std::optional<TimePlan> time;
  CheckpointPlan ck;
  CheckpointStagingPlan staging;
  std::string lr_line;
};

void PlanCall::read_settings() {
  // Flags first (the config's batch split needs --ranks), then config < flags.
  ToolArgs rest(args.rest);
  while (rest.next()) {
    const std::string s = rest.flag();
    static const char* known[] = {"--network", "--batch", "--precision", "--checkpointing", "--classes",
                                  "--ranks", "--sample-rate", "--subcenters", "--optimizer", "--fc-optimizer", "--fc-update",
                                  "--fc-state-dtype", "--fc-weight-dtype", "--logits", "--grad-accumulation", "--cuda-graph",
                                  "--device-memory", "--reserve",
                                  "--activations", "--json", "--images", "--epochs", "--gpus-per-host",
                                  "--bench", "--keep-checkpoints"};
    if (std::find(std::begin(known), std::end(known), s) == std::end(known)) rest.unknown();
    flag[s] = rest.value();
  }
  if (args.print_config) throw usage_error("--print-config: use faceshard-config");
  ranks = has("--ranks") ? static_cast<int>(std::min<int64_t>(parse_count("--ranks", flag["--ranks"]), 1 << 20)) : 1;
  if (!args.config.empty()) {
    cfg = load_config_from_args(args);
    // The classes and images of data.rec, counted as the trainer counts them (unless --classes
    // and --images say them).
    if (!(flag.count("--classes") && flag.count("--images")))
      if (const std::optional<std::string> counted = count_config_data(*cfg)) std::printf("%s\n", counted->c_str());
    in = job_settings(*cfg, ranks);
  } else if (!args.overrides.empty()) {
    throw usage_error("--set needs --config FILE");
  }
  in.world_size = ranks;
  if (has("--network")) in.network = flag["--network"];
  if (has("--batch")) in.batch_per_rank = parse_count("--batch", flag["--batch"]);
  if (has("--precision")) in.precision = choice("--precision", flag["--precision"], {"fp32", "bf16", "fp16"});
  if (has("--checkpointing")) in.checkpointing = choice("--checkpointing", flag["--checkpointing"], {"on", "off"}) == "on";
  if (has("--classes")) in.num_classes = parse_count("--classes", flag["--classes"]);
  if (has("--sample-rate")) in.sample_rate = parse_rate("--sample-rate", flag["--sample-rate"]);
  if (has("--subcenters")) {
    in.subcenters = parse_count("--subcenters", flag["--subcenters"]);
    if (in.subcenters < 1) throw usage_error("--subcenters: expected at least 1 centre per class");
  }
  if (has("--optimizer")) {
    in.optimizer = choice("--optimizer", flag["--optimizer"], {"sgd", "adamw"});
    if (args.config.empty()) in.fc_optimizer.clear();  // the classifier follows unless told
  }
  if (has("--fc-optimizer")) in.fc_optimizer = choice("--fc-optimizer", flag["--fc-optimizer"], {"sgd", "adamw"});
  if (has("--fc-update")) in.fc_update_all = choice("--fc-update", flag["--fc-update"], {"sampled", "all"}) == "all";
  if (has("--fc-state-dtype")) in.fc_state_dtype = choice("--fc-state-dtype", flag["--fc-state-dtype"], {"fp32", "bf16"});
  if (has("--fc-weight-dtype"))
    in.fc_weight_dtype = choice("--fc-weight-dtype", flag["--fc-weight-dtype"], {"fp32", "bf16"});
  if (has("--logits")) in.logits = choice("--logits", flag["--logits"], {"auto", "buffer", "streamed"});
  if (has("--grad-accumulation")) in.grad_accumulation = parse_count("--grad-accumulation", flag["--grad-accumulation"]);
  if (has("--cuda-graph")) in.cuda_graph = choice("--cuda-graph", flag["--cuda-graph"], {"on", "off"}) == "on";
}

void PlanCall::read_inputs() {
  device = has("--device-memory") ? std::optional<double>(parse_size("--device-memory", flag["--device-memory"])) : std::nullopt;
  reserve = has("--reserve") ? parse_size("--reserve", flag["--reserve"]) : 1073741824.0;
  table =
      has("--activations") ? ActivationTable::from_file(flag["--activations"]) : ActivationTable::shipped();
  rates = has("--bench") ? StepRateTable::from_file(flag["--bench"]) : StepRateTable::shipped();
  // The schedule: flags, else the config, else the preset's data set as published.
  if (cfg) {
    ref = lr_reference(args.config);
  } else {  // flags alone: base.yaml's rate, arcface_torch's SGD lr 0.1 for 8 ranks x 128
    ref = LrReference{"base.yaml", "sgd", 0.1, 8, 1024, 0, 0, ""};
  }
  if (ref) ref->optimizer = in.optimizer;  // the job's backbone optimiser decides whether the rate scales
  if (has("--images")) {
    tin.images = parse_count("--images", flag["--images"]);
    if (tin.images < 1) throw usage_error("--images: expected at least 1 image");
    images_from = "--images";
  } else if (cfg && cfg->data.num_images) {
    tin.images = *cfg->data.num_images;
    images_from = cfg->data.rec != "synthetic" && std::filesystem::exists(cfg->data.rec) ? "data.rec" : "data.num_images";
  } else if (ref && ref->images > 0) {
    tin.images = ref->images;
    images_from = ref->dataset + " as published, from " + ref->preset + "; --images N for yours";
  }
  tin.epochs = cfg ? cfg->optim.epochs : 20;
  if (cfg) tin.total_steps = cfg->optim.total_steps;
  if (has("--epochs")) {
    tin.epochs = parse_count("--epochs", flag["--epochs"]);
    if (tin.epochs < 1) throw usage_error("--epochs: expected at least 1 epoch");
    tin.total_steps.reset();
  }
  if (has("--gpus-per-host")) {
    const int64_t g = parse_count("--gpus-per-host", flag["--gpus-per-host"]);
    if (g < 1 || g > 1024) throw usage_error("--gpus-per-host: expected 1 to 1024");
    tin.gpus_per_host = static_cast<int>(g);
  }
  keep = cfg ? cfg->train.keep_checkpoints : 3;
  if (has("--keep-checkpoints")) keep = parse_count("--keep-checkpoints", flag["--keep-checkpoints"]);
  job_lr = cfg ? cfg->optim.lr : 0.1;
}

void PlanCall::plan_memory() {
  // No class count (a preset leaves it to the data): with a device, the plan is made at the
  // largest count that fits; without one there is nothing to plan the classifier for.
  const bool classes_given = in.num_classes != 0;
  if (!classes_given) {
    if (!device)
      throw usage_error("give --classes C (or a --config with data.num_classes), or --device-memory SIZE to find the "
                        "largest number of classes that fits");
    try {
      in.num_classes = std::max<int64_t>(in.world_size, max_classes_that_fit(in, table, *device - reserve));
    } catch (const Error& e) {
      if (!e.option().empty()) rethrow_as_flag(e);
      throw;
    }
    std::printf("classes: none given; planned at the largest number that fits the device\n");
  }

  try {
    plan = plan_job_memory(in, table);
    if (device) max_classes = max_classes_that_fit(in, table, *device - reserve);
    if (device) max_batch = max_batch_that_fits(in, table, *device - reserve);
  } catch (const Error& e) {
    if (!e.option().empty()) rethrow_as_flag(e);
    throw;
  }
}

void PlanCall::print_memory() {
  fc_opt = in.fc_optimizer.empty() ? in.optimizer : in.fc_optimizer;
  const ClassifierMemoryPlan& c = plan.classifier;
  const std::string k = in.subcenters > 1 ? " x " + std::to_string(in.subcenters) + " sub-centres" : "";
  std::printf("faceshard-plan: %s, %s%s, activation checkpointing %s; %lld images per rank x %d ranks%s; %lld classes%s "
              "(%lld on rank 0, %lld per step), head %s, sample rate %g; optimisers %s (backbone), %s %s (classifier), "
              "centres %s\n",
              in.network.c_str(), in.precision.c_str(),
              in.precision_auto ? " (train.precision auto: bf16, as on a GPU with bf16 arithmetic)" : "",
              plan.checkpointing ? "on" : "off", static_cast<long long>(in.batch_per_rank), in.world_size,
              in.grad_accumulation > 1 ? (" x " + std::to_string(in.grad_accumulation) + " micro-batches").c_str() : "",
              static_cast<long long>(in.num_classes), k.c_str(), static_cast<long long>(c.rows),
              static_cast<long long>(c.sampled_rows), in.head.c_str(), in.sample_rate, in.optimizer.c_str(),
              fc_opt.c_str(), in.fc_state_dtype.c_str(), in.fc_weight_dtype.c_str());
  std::printf("per-rank memory (rank 0, the largest shard)          MiB\n");
  std::string group;
  for (const PlanPart& p : plan.parts) {
    std::printf("  %-14s %-26s %11s   %s\n", p.group == group ? "" : p.group.c_str(), p.name.c_str(),
                mib(p.bytes).c_str(), p.how.c_str());
    group = p.group;
  }
  for (const char* g : {"backbone", "classifier", "communication"})
    std::printf("  %-41s %11s\n", (std::string(g) + " in all").c_str(), mib(plan.group_bytes(g)).c_str());
  std::printf("  %-41s %11s   (%.2f GiB)\n", "total", mib(plan.total_bytes()).c_str(), plan.total_bytes() / 1073741824.0);
  std::printf("activations: %s (%s)\n", table.measured_on().empty() ? "measured" : ("measured on " + table.measured_on()).c_str(),
              table.source().c_str());
}

void PlanCall::print_device() {
  if (device) {
    fits = plan.total_bytes() + reserve <= *device;
    std::printf("device: %s MiB, reserve %s MiB (CUDA context, NCCL and cuDNN workspaces, fragmentation): %s, %s MiB %s\n",
                mib(*device).c_str(), mib(reserve).c_str(), fits ? "fits" : "does NOT fit",
                mib(std::abs(*device - reserve - plan.total_bytes())).c_str(), fits ? "to spare" : "short");
    if (max_classes > 0) {
      JobSettings at = in;
      at.num_classes = max_classes;
      const JobMemoryPlan mp = plan_job_memory(at, table);
      std::printf("largest number of classes that fits: %lld (%lld on rank 0; %s MiB planned)\n",
                  static_cast<long long>(max_classes), static_cast<long long>(mp.classifier.rows),
                  mib(mp.total_bytes()).c_str());
    } else {
      std::printf("largest number of classes that fits: none (the backbone alone needs more than the device less the "
                  "reserve)\n");
    }
  }
  if (device) {
    if (max_batch > 0) {
      JobSettings at = in;
      at.batch_per_rank = max_batch;
      const JobMemoryPlan bp = plan_job_memory(at, table);
      std::printf("largest batch per rank that fits: %lld (global %lld; %s MiB planned%s)\n",
                  static_cast<long long>(max_batch),
                  static_cast<long long>(max_batch * in.world_size * in.grad_accumulation), mib(bp.total_bytes()).c_str(),
                  bp.classifier.streamed && !plan.classifier.streamed ? ", streamed logits" : "");
    } else {
      std::printf("largest batch per rank that fits: none (2 images per rank do not fit)\n");
    }
  }
}

void PlanCall::print_time() {
  if (tin.images > 0) {
    time = plan_job_time(in, tin, rates);
    const TimePlan& t = *time;
    std::printf("time: %lld images (%s) x %s, global batch %lld (%lld x %d ranks%s): %lld steps\n",
                static_cast<long long>(tin.images), images_from.c_str(),
                tin.total_steps ? ("optim.total_steps " + std::to_string(*tin.total_steps)).c_str()
                                : (std::to_string(tin.epochs) + " epochs of " + std::to_string(t.steps_per_epoch) +
                                   " steps").c_str(),
                static_cast<long long>(t.global_batch), static_cast<long long>(in.batch_per_rank), in.world_size,
                in.grad_accumulation > 1 ? (" x " + std::to_string(in.grad_accumulation) + " micro-batches").c_str() : "",
                static_cast<long long>(t.total_steps));
    if (device)
      if (const std::string w = card_mismatch_warning(rates, *device); !w.empty()) std::printf("  %s\n", w.c_str());
    if (t.rate) {
      std::printf("  speed: %.0f images/s per GPU (%s)\n", t.images_per_s_per_gpu, t.rate_note.c_str());
      std::printf("  hours: %.1f on %d GPUs (the %s GPU's rate x %d; the communication between GPUs and a "
                  "batch other than the measured one are not counted)%s\n",
                  t.hours, in.world_size, t.estimated ? "estimated" : "measured", in.world_size,
                  t.estimated ? ": an estimate" : "");
      std::printf("  loader: %.0f images/s to decode per host (%d GPUs x %.0f images/s; faceshard-bench --mode data "
                  "measures a host's rate)\n",
                  t.decode_per_host, t.gpus_per_host, t.images_per_s_per_gpu);
    } else {
      std::printf("  speed: %s\n", t.rate_note.c_str());
    }
    if (t.classifier_gemm_flops > 0) {
      std::printf("  classifier GEMMs: %.4g GFLOP per step on rank 0 (6 x %lld images x %lld columns x %lld%s; "
                  "columns: sampled rows x %lld sub-centre%s)",
                  t.classifier_gemm_flops / 1e9, static_cast<long long>(in.batch_per_rank * in.world_size),
                  static_cast<long long>(t.classifier_columns), static_cast<long long>(in.embedding_size),
                  in.grad_accumulation > 1 ? (" x " + std::to_string(in.grad_accumulation) + " micro-batches").c_str() : "",
                  static_cast<long long>(in.subcenters), in.subcenters > 1 ? "s" : "");
      if (t.rate && t.measured_classifier_gemm_flops > 0)
        std::printf("; the measured step's: %.4g GFLOP (K = 1)%s", t.measured_classifier_gemm_flops / 1e9,
                    in.subcenters > 1 ? ": the hours above are of K = 1 steps and leave out the extra GEMMs" : "");
      std::printf("\n");
    }
  } else {
    std::printf("time: give --images N (images per epoch) to plan the hours\n");
  }
}

void PlanCall::print_checkpoint() {
  ck = plan_checkpoint(in, table, keep);
  {
    std::string files;
    for (const auto& f : ck.files) files += (files.empty() ? "" : ", ") + f.name + " " + mib(f.bytes) + " MiB";
    std::printf("checkpoint: %s MiB each (%s); %lld kept, %lld during a save: %s GiB on disk with model.pt\n",
                mib(ck.bytes).c_str(), files.c_str(), static_cast<long long>(keep), static_cast<long long>(keep + 1),
                faceshard::detail::concat(std::round(ck.disk_bytes() / 1073741824.0 * 100) / 100).c_str());
  }
  const int per_host = tin.gpus_per_host > 0 ? tin.gpus_per_host : std::min(in.world_size, 8);
  staging = plan_checkpoint_staging(ck, in, per_host);
  std::printf("checkpoint staging (train.checkpoint_async, host memory): %s MiB on rank 0 (backbone, optimiser state, "
              "its shard), %s MiB on each other rank; %s MiB on a host of %d rank%s (rank 0's); the trainer saves "
              "synchronously where half the host's available memory cannot hold it\n",
              mib(staging.rank0_bytes).c_str(), mib(staging.other_bytes).c_str(), mib(staging.host_bytes).c_str(),
              staging.ranks_per_host, staging.ranks_per_host > 1 ? "s" : "");
  if (ref) lr_line = lr_scaling_reminder(*ref, in.batch_per_rank * in.world_size * in.grad_accumulation, job_lr);
  if (!lr_line.empty()) std::printf("%s\n", lr_line.c_str());
}

void PlanCall::write_json() const {
  {
    std::ostringstream js;
    js.precision(15);
    js << "{\"network\":\"" << json_escape(in.network) << "\",\"precision\":\"" << in.precision
       << "\",\"checkpointing\":" << (plan.checkpointing ? "true" : "false") << ",\"batch_per_rank\":" << in.batch_per_rank
       << ",\"ranks\":" << in.world_size << ",\"classes\":" << in.num_classes << ",\"sample_rate\":" << in.sample_rate << ",\"subcenters\":" << in.subcenters
       << ",\"optimizer\":\"" << in.optimizer << "\",\"fc_optimizer\":\"" << fc_opt << "\",\"fc_state_dtype\":\""
       << in.fc_state_dtype << "\",\"fc_weight_dtype\":\"" << in.fc_weight_dtype << "\",\"logits\":\""
       << (plan.classifier.streamed ? "streamed" : "buffer") << "\",\"parameters\":"
       << plan.parameters << ",\"activation_bytes_per_image\":" << plan.activation_bytes_per_image
       << ",\"shard_rows\":" << plan.classifier.rows << ",\"sampled_rows\":" << plan.classifier.sampled_rows << ",\"parts\":[";
    for (size_t i = 0; i < plan.parts.size(); ++i)
      js << (i ? "," : "") << "{\"group\":\"" << plan.parts[i].group << "\",\"name\":\""
         << json_escape(plan.parts[i].name) << "\",\"bytes\":" << plan.parts[i].bytes << "}";
    js << "],\"backbone_bytes\":" << plan.group_bytes("backbone") << ",\"classifier_bytes\":"
       << plan.group_bytes("classifier") << ",\"communication_bytes\":" << plan.group_bytes("communication")
       << ",\"total_bytes\":" << plan.total_bytes();
    if (device)
      js << ",\"device_memory_bytes\":" << *device << ",\"reserve_bytes\":" << reserve << ",\"fits\":"
         << (fits ? "true" : "false") << ",\"max_classes\":" << std::max<int64_t>(0, max_classes)
         << ",\"max_batch_per_rank\":" << std::max<int64_t>(0, max_batch);
    if (time) {
      const TimePlan& t = *time;
      js << ",\"time\":{\"images\":" << tin.images << ",\"epochs\":" << tin.epochs << ",\"global_batch\":"
         << t.global_batch << ",\"steps_per_epoch\":" << t.steps_per_epoch << ",\"total_steps\":" << t.total_steps
         << ",\"gpus_per_host\":" << t.gpus_per_host << ",\"classifier_columns\":" << t.classifier_columns
         << ",\"classifier_gemm_flops\":" << t.classifier_gemm_flops;
      if (t.rate) js << ",\"measured_classifier_gemm_flops\":" << t.measured_classifier_gemm_flops;
      if (t.rate) js << ",\"estimated\":" << (t.estimated ? "true" : "false");
      if (t.rate)
        js << ",\"images_per_s_per_gpu\":" << t.images_per_s_per_gpu << ",\"measured_on\":\""
           << json_escape(t.rate->card) << "\",\"measured_batch\":" << t.rate->batch_per_rank << ",\"hours\":" << t.hours
           << ",\"decode_images_per_s_per_host\":" << t.decode_per_host;
      js << ",\"rate\":\"" << json_escape(t.rate_note) << "\"}";
    }
    js << ",\"checkpoint\":{\"bytes\":" << ck.bytes << ",\"keep\":" << keep << ",\"disk_bytes\":" << ck.disk_bytes()
       << ",\"staging\":{\"rank0_bytes\":" << staging.rank0_bytes << ",\"other_rank_bytes\":" << staging.other_bytes
       << ",\"ranks_per_host\":" << staging.ranks_per_host << ",\"host_bytes\":" << staging.host_bytes << "}"
       << ",\"model_bytes\":" << ck.model_bytes << ",\"files\":[";
    for (size_t i = 0; i < ck.files.size(); ++i)
      js << (i ? "," : "") << "{\"name\":\"" << json_escape(ck.files[i].name) << "\",\"bytes\":" << ck.files[i].bytes
         << "}";
    js << "]}";
    if (!lr_line.empty()) js << ",\"lr_reminder\":\"" << json_escape(lr_line) << "\"";
    js << "}\n";
    std::ofstream out(flag.at("--json"));
    if (!(out << js.str())) throw runtime_error(flag.at("--json"), ": cannot write");
  }
}

}  // namespace

int main(int argc, char** argv) {
  return run_main("faceshard-plan", [&] {
    PlanCall call(argc, argv);
    if (call.args.help) {
      std::fputs(kUsage, stdout);
      return 0;
    }
    call.read_settings();
    call.read_inputs();
    call.plan_memory();
    call.print_memory();
    call.print_device();
    call.print_time();
    call.print_checkpoint();
    if (call.has("--json")) call.write_json();
    return 0;
  });
}
