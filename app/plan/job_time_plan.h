// How long a training job takes and what it needs besides device memory, from its settings
// and measured step rates: images/s per GPU (a measured faceshard-bench step: the GPU check's
// figures in docs/benchmarks, compiled in, or the user's own `faceshard-bench --mode step
// --json` file), hours for the schedule, the decode rate the loader must sustain on a host,
// the checkpoint's size on disk (the files TrainState::save writes), and whether the
// learning rate needs scaling for the job's global batch. faceshard-plan prints them.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "app/plan/activation_table.h"
#include "app/plan/job_memory_plan.h"

namespace faceshard {

// One measured training step of faceshard (faceshard-bench --mode step).
struct StepRate {
  std::string network;
  std::string precision;
  int64_t batch_per_rank = 0;
  bool channels_last = false;
  int64_t classes = 0;
  double sample_rate = 1.0;
  int world_size = 1;
  double images_per_s_per_gpu = 0;
  std::string card;  // e.g. "NVIDIA H200"; "cuda:0" when the file does not name the card
};

class StepRateTable {
 public:
  // The figures compiled into the binary: the GPU check's report named in app/CMakeLists.txt
  // (docs/benchmarks/<card>_<date>_<run>.json).
  static StepRateTable shipped();
  // A faceshard-bench --mode step --json FILE (one step), or a GPU check report (its
  // "records": faceshard's own are taken, arcface_torch's are not).
  static StepRateTable from_file(const std::string& path);
  static StepRateTable parse(const std::string& json, const std::string& source);

  // The figure for the network and precision, the layout the network trains in by default
  // (channels-last for the convolutional ones) preferred, then the batch nearest `batch`;
  // nullptr when there is none.
  const StepRate* find(const std::string& network, const std::string& precision, int64_t batch) const;
  const std::vector<StepRate>& entries() const { return entries_; }
  const std::string& source() const { return source_; }
  // The measured card's memory (GiB), where the report says it (a GPU check's env.gpus);
  // 0: not said.
  double card_memory_gib() const { return card_memory_gib_; }

 private:
  std::vector<StepRate> entries_;
  std::string source_;
  double card_memory_gib_ = 0;
};

// A warning line when the planned device memory (bytes) is not the measured card's (more than
// 25% apart): the hours are then another card's. Empty when they agree or either is unknown.
std::string card_mismatch_warning(const StepRateTable& rates, double device_bytes);

struct TimePlanInputs {
  int64_t images = 0;                 // per epoch (data.num_images or the data set's count); 0: unknown
  int64_t epochs = 20;                // optim.epochs
  std::optional<int64_t> total_steps; // optim.total_steps
  int gpus_per_host = 0;              // 0: min(ranks, 8)
};

struct TimePlan {
  int64_t global_batch = 0;     // batch per rank x ranks x micro-batches
  int64_t steps_per_epoch = 0;  // max(1, images / global batch), as the trainer's schedule
  int64_t total_steps = 0;
  int gpus_per_host = 0;
  std::optional<StepRate> rate;  // the figure used; unset: none measured for this job
  // No figure of this network and precision: `rate` is another network's in the same
  // precision, its images/s scaled by the two networks' MACs per image (an estimate).
  bool estimated = false;
  double macs = 0, reference_macs = 0;  // per image, of the job's network and of the rate's
  std::string rate_note;         // what the figure is, or why there is none
  double images_per_s_per_gpu = 0;
  double hours = 0;              // total_steps x global batch / (images/s per GPU x ranks) / 3600
  double decode_per_host = 0;    // images/s per GPU x GPUs per host: what the host's loaders must decode
  // The classifier's GEMMs on rank 0 (the largest shard) per step: the logits [global batch,
  // sampled rows x K] and the two products of their backward, 2 x rows x columns x E FLOPs
  // each, over the micro-batches. K sub-centres make the columns, and these FLOPs, K times
  // as many. The measured step rates are of K = 1 steps: `measured_classifier_gemm_flops`
  // is the measured step's own (its classes, sample rate, batch and ranks at K = 1).
  int64_t classifier_columns = 0;        // rank 0's sampled rows x K
  double classifier_gemm_flops = 0;      // 6 x global batch x columns x E x micro-batches
  double measured_classifier_gemm_flops = 0;
};

// 6 x (batch per rank x ranks) x (rank 0's sampled rows x K) x E x micro-batches: the
// classifier GEMMs' FLOPs per step on rank 0 (see TimePlan); `columns`, when given, gets
// rank 0's sampled rows x K.
double classifier_gemm_flops(const JobSettings& job, int64_t* columns = nullptr);

// Usage error (naming --images / --epochs) when the counts are not positive.
TimePlan plan_job_time(const JobSettings& job, const TimePlanInputs& in, const StepRateTable& rates);

// The files one checkpoint writes (checkpoints/step_<N>/) and their bytes: backbone.pt (the
// backbone's state_dict: fp32 parameters and BatchNorm's running statistics),
// train_state.pt (the backbone optimiser's state and a few counters), fc_shard_<r>.pt per
// rank (its classifier rows and their optimiser state).
struct CheckpointFilePlan {
  std::string name;
  double bytes = 0;
  std::string how;
};
struct CheckpointPlan {
  std::vector<CheckpointFilePlan> files;  // backbone.pt, train_state.pt, the shards together
  double bytes = 0;       // one checkpoint
  int64_t keep = 3;       // train.keep_checkpoints
  double model_bytes = 0; // <output>/model.pt at the end (the backbone's state_dict)
  // The run folder's checkpoints at their most: keep + 1 (a new one is committed before the
  // oldest is removed), and model.pt.
  double disk_bytes() const { return double(keep + 1) * bytes + model_bytes; }
};
CheckpointPlan plan_checkpoint(const JobSettings& job, const ActivationTable& table, int64_t keep = 3);

// What a backbone's state_dict holds beyond its trainable parameters' fp32 bytes, in bytes:
// BatchNorm's running statistics (fp32 means and variances, an int64 count per layer) and the
// frozen parameters; -1 for a network it does not know.
double backbone_buffer_bytes(const std::string& network);

// The global batch a preset's learning rate is set for, from the preset's own files: the
// ranks it was run on (arcface_torch's job, or the authors') x its batch per rank x its
// micro-batches. `config` is a training config; the preset is the first file of its base
// chain (itself first) that states itself a preset in a comment line of its own (configs/'s
// presets: `# preset: ranks=8; data=MS1MV3; images=5179510; classes=93431`), so that a new
// preset is a YAML file and nothing else.
struct LrReference {
  std::string preset;        // its file name, "" when the config derives from no preset
  std::string optimizer;     // the preset's backbone optimiser
  double lr = 0;             // the preset's optim.lr
  int ranks = 0;
  int64_t global_batch = 0;  // 0: the preset scales no rate with the batch (AdamW)
  int64_t images = 0;        // the preset's data set as published (0: unknown)
  int64_t classes = 0;
  std::string dataset;
};
std::optional<LrReference> lr_reference(const std::string& config_path);

// One line when the job's global batch differs from the reference's and the rate scales
// with it (SGD): the factor and the learning rate for this batch; "" otherwise. With AdamW
// the line says that the rate is not scaled (arcface_torch's recipe).
std::string lr_scaling_reminder(const LrReference& ref, int64_t global_batch, double job_lr);

}  // namespace faceshard
