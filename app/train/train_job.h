// Everything a training run builds once from its config: the ranks (Distributed), the data
// (data set, loader), the backbone under DataParallel (optionally SyncBatchNorm), the
// sharded classifier with its optimiser state, the backbone's optimiser, the loss scaler
// and the LR schedules. faceshard-train runs its loop on it; faceshard-bench's step mode
// times the very same parts. Errors of the parts name their own options; here they become
// config errors naming the file and key.
#pragma once
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "app/config/config.h"
#include "app/train/backbone_optimizer.h"
#include "app/train/fine_tune.h"
#include "app/train/graph_status.h"
#include "app/train/loss_scaler.h"
#include "app/train/lr_schedule.h"
#include "app/train/training_stream.h"
#include "data/dataset.h"
#include "data/loader.h"
#include "models/backbone.h"
#include "partial_fc/classifier/partial_fc.h"
#include "partial_fc/data_parallel/ddp.h"
#include "partial_fc/distributed/distributed.h"

namespace faceshard {

struct TrainJob {
  // First, so that it is made current before, and given back after, everything below: on a
  // GPU the job's one stream (training_stream.h).
  std::shared_ptr<TrainingStream> stream;
  Config cfg;
  std::shared_ptr<Distributed> dist;
  torch::Device device = torch::kCPU;
  std::shared_ptr<Dataset> dataset;
  std::unique_ptr<DataLoader> loader;
  std::shared_ptr<Backbone> backbone;
  std::unique_ptr<FlatParameters> flat;  // optim.fused: the buffers ddp and opt work on
  std::unique_ptr<DataParallel> ddp;
  std::unique_ptr<PartialFC> fc;
  std::unique_ptr<BackboneOptimizer> opt;
  std::unique_ptr<LossScaler> scaler;
  PolyWarmupSchedule schedule, fc_schedule;
  std::vector<at::Tensor> backbone_params;  // those that train
  BackboneFreeze freeze;  // optim.freeze_backbone_steps: applied at the start of each step
  int64_t micro = 1;            // micro-batches per step (optim.grad_accumulation)
  int64_t steps_per_epoch = 0;  // whole steps of this rank's share of the data
  int64_t total_steps = 0;      // the schedule's length
  int64_t last_step = 0;        // where this run stops (train.max_steps or the schedule's end)
  int64_t warmup_steps = 0;
  bool loss_scaling = false;    // fp16: scaled loss, non-finite gradients skip the step
  // What train.cuda_graph came to: set by make_backbone_run (the step's), read when asked.
  GraphStatusReader graph_status = eager_graph_status(false, "");

  int64_t global_batch() const { return cfg.data.batch_size * dist->world_size() * micro; }
};

// How the classifier starts: its initial centres drawn, or (a resume) its rows only
// allocated, because the caller reads a checkpoint into them next (TrainState::load):
// nothing is drawn or zeroed only to be overwritten.
enum class ClassifierStart { Fresh, FromCheckpoint };

// The batch a checkpoint was trained with (its train_state.pt: data.global_batch,
// data.batch_size, optim.grad_accumulation, world_size). A resume keeps its global batch on
// any number of ranks (the per-rank batch follows, as with data.global_batch_size) unless
// the config changes it on purpose: data.global_batch_size set to another value, or
// data.batch_size other than the checkpoint's per-rank batch (see TrainState::load's line).
struct CheckpointBatch {
  std::string checkpoint;  // the step folder it was read from
  int64_t global_batch = 0, batch_size = 0, grad_accumulation = 1, world_size = 1;
};

// What the trainer checks of a config before it joins any rank or reads any data (the
// backbone's name and options for that network): config errors naming the key.
// faceshard-config makes the same checks.
void check_model_config(const Config& cfg);

// Joins the job's ranks (the environment's), then builds the rest. On rank 0, creates
// cfg.output. Collective.
// `resumed`: the batch of the checkpoint a resume starts from.
TrainJob build_train_job(const Config& cfg, ClassifierStart start = ClassifierStart::Fresh,
                         const std::optional<CheckpointBatch>& resumed = std::nullopt);
// The same on ranks that have joined already (its device must be what cfg.dist.device
// picks for them); tests build several jobs over one set of ranks this way.
TrainJob build_train_job(const Config& cfg, std::shared_ptr<Distributed> dist,
                         ClassifierStart start = ClassifierStart::Fresh,
                         const std::optional<CheckpointBatch>& resumed = std::nullopt);

// Bytes a new allocation can take on `device`: for a GPU, the driver's free memory plus
// what LibTorch's caching allocator holds unused; for the CPU, /proc/meminfo's
// MemAvailable, or less when the process's cgroup has a smaller limit left. `what` says
// which ("MemAvailable", "cgroup memory.max", "free on cuda:0"). Nothing when unknown.
struct AvailableMemory {
  double bytes = 0;
  std::string what;
};
std::optional<AvailableMemory> device_available_memory(torch::Device device);

// Throws a config error naming data.num_classes (with loss.sample_rate, the batch and the
// world size) when `plan` needs more than `available`: one line with both byte counts.
void check_classifier_fits(const Config& cfg, const ClassifierMemoryPlan& plan, int world_size, int rank,
                           const AvailableMemory& available, torch::Device device);

// The start-up line of rank 0's classifier shard: its classes (and sub-centres), the bytes its
// centres and optimiser state hold as allocated (summed over its tensors), the classes a step
// samples and the logits' buffer as planned (or streamed). faceshard-config and faceshard-plan
// print the same figures from the same options (job_settings.h).
struct JobSettings;
std::string describe_shard_memory(const PartialFC& fc, const ClassifierMemoryPlan& plan, const JobSettings& settings);

// The GPU allocator's peak in GB for a CUDA device, nothing for the CPU.
std::optional<double> device_peak_memory_gb(torch::Device device);

}  // namespace faceshard
