// The training configuration: YAML files with inheritance ("base: other.yaml", later keys
// override), command-line overrides ("--set section.key=value"), and one typed, validated
// struct. Errors name the file (or "--set") and the full key path, and exit with status 2.
#pragma once
#include <initializer_list>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "base/error.h"

namespace YAML {
class Node;
}

namespace faceshard {

// Constraints of one field.
struct FieldSpec {
  bool required = false;
  std::optional<double> min, max;         // numeric range (inclusive)
  bool min_exclusive = false;
  std::vector<std::string> choices;       // allowed strings
  int list_length = -1;                   // exact length of a list, -1 = any
  std::string doc;
};

// Every config struct lists its fields once through this interface; reading, validation
// and printing all use that list.
class FieldVisitor {
 public:
  virtual ~FieldVisitor() = default;
  virtual void field(const std::string& path, std::string& v, const FieldSpec& s) = 0;
  virtual void field(const std::string& path, int64_t& v, const FieldSpec& s) = 0;
  virtual void field(const std::string& path, double& v, const FieldSpec& s) = 0;
  virtual void field(const std::string& path, bool& v, const FieldSpec& s) = 0;
  virtual void field(const std::string& path, std::vector<std::string>& v, const FieldSpec& s) = 0;
  virtual void field(const std::string& path, std::vector<double>& v, const FieldSpec& s) = 0;
  // Optional settings: absent (or null in YAML) means "derived", see the accessors below.
  virtual void field(const std::string& path, std::optional<std::string>& v, const FieldSpec& s) = 0;
  virtual void field(const std::string& path, std::optional<int64_t>& v, const FieldSpec& s) = 0;
  virtual void field(const std::string& path, std::optional<double>& v, const FieldSpec& s) = 0;
  virtual void field(const std::string& path, std::optional<bool>& v, const FieldSpec& s) = 0;
};

struct DataConfig {
  std::string rec = "synthetic";  // folder with train.rec/train.idx, an image folder, or "synthetic"
  // Unset: counted from the data at start-up (the .rec's identity records or the folder's
  // sub-folders); set: must agree with the data. The classifier has num_classes +
  // spare_classes classes; the schedule follows num_images (unset: the data's count).
  std::optional<int64_t> num_classes;
  std::optional<int64_t> num_images;
  int64_t spare_classes = 0;
  int64_t batch_size = 128;  // per rank
  // When set: the global batch, whatever the number of ranks (the per-rank batch becomes
  // global_batch_size / (ranks x optim.grad_accumulation) and data.batch_size is not used).
  std::optional<int64_t> global_batch_size;
  int64_t num_workers = 2;
  std::vector<std::string> val_targets;
  std::optional<std::string> val_dir;  // where <target>.bin live; default: the rec folder
  // Folder of the compact .rec indexes shared by a host's ranks; "off": each rank builds
  // its own in memory; unset: $FACESHARD_INDEX_CACHE or ~/.cache/faceshard/rec-index.
  std::optional<std::string> index_cache;
  bool flip = true;
  double max_bad_fraction = 0.001;
  int64_t prefetch = 4;
  // data.augment.*: probabilities of the optional extra augmentations (grayscale,
  // Gaussian blur, downscale-then-upscale); all 0, i.e. off, as in arcface_torch.
  double augment_gray_prob = 0.0;
  double augment_blur_prob = 0.0;
  double augment_downscale_prob = 0.0;
  // An image folder is checked before training (every file's header and end, every identity
  // folder): false refuses to start while anything is wrong, listing it; true leaves the bad
  // files and folders out and says how many (faceshard-pack's --skip-bad).
  bool skip_bad = false;

  std::string verification_dir() const { return val_dir.value_or(rec); }
};

struct ModelConfig {
  std::string backbone = "r50";
  int64_t embedding_size = 512;
  double dropout = 0.0;
  bool sync_bn = false;
  // NHWC activations and conv weights; unset: the network's default
  // (backbone_default_channels_last: on for the iresnets and MobileFaceNets).
  std::optional<bool> channels_last;
  // PReLU's backward by faceshard's own pass (the CPU's vectorised loop, the GPU's CUDA
  // kernel) or by ATen's (false: the comparison).
  bool prelu_kernel = true;
  // Recompute activations in backward (ViT blocks, iresnet stages 2-3); unset: the network's
  // default, on for vit_b*, vit_l*, vit_h and r2060 as in arcface_torch.
  std::optional<bool> checkpointing;
  std::optional<std::string> init;  // a state_dict file to start the backbone from
};

struct LossConfig {
  std::vector<double> margin{1.0, 0.5, 0.0};  // (m1, m2, m3): s * (cos(m1*theta + m2) - m3)
  // exact | arcface_torch: how the margin is computed and differentiated (margin.h).
  std::string margin_mode = "exact";
  double scale = 64.0;
  double interclass_filtering_threshold = 0.0;
  double sample_rate = 1.0;
  // Centres per class (Sub-center ArcFace): a class's cosine is the best of its K, then the
  // head's margin applies (partial_fc/classifier/subcenter.h). 1: one centre per class.
  int64_t subcenters = 1;
  // A run or checkpoint folder whose classifier centres start this run's (app/train/
  // centre_init.h): the same K, or K = 1 from K > 1 keeping each class's dominant sub-centre,
  // which init_centres_report (faceshard-clean's --output folder of that checkpoint) names.
  std::optional<std::string> init_centres;
  std::optional<std::string> init_centres_report;
  // auto | buffer | streamed: whether the classifier holds the global batch's logits against
  // its (sampled) centres in one fp32 buffer, or streams through the centres chunk by chunk
  // and recomputes them in backward (streamed_softmax.h): no memory that grows with the
  // ranks, one more GEMM per step. auto: streamed where the buffer would take more memory
  // than the centres and their state (streamed_logits_pay).
  std::string logits = "auto";
  // The margin head: combined (loss.margin and loss.scale) or any head of the catalogue
  // (partial_fc/classifier/head_catalogue.h; faceshard-head --list prints it).
  std::string head = "combined";
  // loss.<head>.<parameter> as the heads' authors name them ("adaface.m" -> value); unset:
  // the head's default. Yes/no parameters are flags.
  std::map<std::string, std::optional<double>> head_params;
  std::map<std::string, std::optional<bool>> head_flags;
  // The parameters of `head` that the config sets, flags as 1/0.
  std::map<std::string, double> chosen_head_params() const;
};

struct OptimConfig {
  std::string optimizer = "sgd";  // backbone: sgd | adamw
  double lr = 0.1;
  double momentum = 0.9;
  double weight_decay = 5e-4;
  std::vector<double> betas{0.9, 0.999};
  double eps = 1e-8;
  // Classifier shard: optimizer/lr/weight decay, default: the backbone's.
  std::optional<std::string> fc_optimizer;
  std::optional<double> fc_lr;
  std::optional<double> fc_weight_decay;
  // With loss.sample_rate < 1: "sampled" moves only the sampled rows; "all" steps every row
  // of the shard (zero gradient where unsampled), as arcface_torch's PartialFC_V2.
  std::string fc_update = "sampled";
  // The classifier's optimiser state (SGD momentum, AdamW's moments): fp32, or bf16 to halve
  // it (the weight stays fp32 and the update's arithmetic is fp32; each row is rounded to
  // bf16 when stored back).
  std::string fc_state_dtype = "fp32";
  // The classifier's centres: fp32, or bf16 (half the bytes; updated in fp32 and stored back
  // with stochastic rounding, so that updates smaller than a bf16 step still count on
  // average).
  std::string fc_weight_dtype = "fp32";
  // How bf16 centres are stored back: stochastic (unbiased), or nearest (the control that
  // drops every update below half a bf16 step: for comparisons, not for training).
  std::string fc_weight_rounding = "stochastic";
  // The backbone's parameters and gradients in flat buffers that DDP's buckets are ranges
  // of, stepped by one fused kernel (off: one multi-tensor pass per op over the params).
  // Not with dist.find_unused_parameters (a param without a gradient must not move).
  bool fused = true;
  int64_t epochs = 20;
  double warmup_epochs = 0;
  std::optional<int64_t> total_steps;   // default: derived from images, global batch and epochs
  std::optional<int64_t> warmup_steps;  // default: derived from warmup_epochs
  double power = 1.0;        // polynomial decay exponent
  double grad_clip = 5.0;    // max norm of the backbone gradient, 0 = off
  // Fine-tuning: for the first freeze_backbone_steps steps (0: off) the frozen part of the
  // backbone gets no update (no gradient, weight decay or momentum) and its BatchNorm layers
  // run in eval mode; freeze_stages: that part is the stem and the first K stages (unset:
  // the whole backbone, its embedding head included).
  int64_t freeze_backbone_steps = 0;
  std::optional<int64_t> freeze_stages;
  // A warm-up at the thaw: the backbone's learning rate rises linearly over the first
  // thaw_warmup_steps steps after the freeze (1/N of the schedule's at the first, N/N at the
  // N-th), so that momentum-free layers meeting a trained classifier do not take full steps
  // at once (0: off; the classifier's rate is not changed).
  int64_t thaw_warmup_steps = 0;
  int64_t grad_accumulation = 1;

  const std::string& classifier_optimizer() const { return fc_optimizer ? *fc_optimizer : optimizer; }
  double classifier_lr() const { return fc_lr.value_or(lr); }
  double classifier_weight_decay() const { return fc_weight_decay.value_or(weight_decay); }
};

struct TrainConfig {
  // auto | fp32 | bf16 | fp16. auto: bf16 autocast (no loss scaler) on a GPU that has bf16
  // arithmetic (compute capability 8.0 and later), fp32 elsewhere (resolve_precision).
  std::string precision = "auto";
  // fp32 matrix products and convolutions on the GPU in TF32 (10-bit mantissa inputs, fp32
  // accumulation), as cuDNN's convolutions already are by default.
  bool tf32 = true;
  int64_t log_every = 10;
  int64_t verify_every = 2000;
  int64_t checkpoint_every = 0;  // steps, 0: at the end of every epoch
  // Also checkpoint once this many seconds have passed since the last one (0: off), so that
  // the work a lost machine costs is bounded in time whatever the step time.
  double checkpoint_every_s = 0;
  // off | auto: continue from the newest committed checkpoint under `output` when there is
  // one, start fresh when there is none (what a scheduler that reruns the command needs).
  std::string resume = "off";
  int64_t keep_checkpoints = 3;
  // Checkpoints that fail to save (a full disk, a quota, an I/O error) in a row before the
  // run stops (exit status 3); fewer cost nothing committed and training goes on.
  int64_t max_failed_checkpoints = 3;
  // auto | on | off. Checkpoints staged in host memory at their step and written by a
  // background thread while training goes on (app/train/checkpoint_writer.h); auto: on where
  // the host's available memory holds the staging of all of its ranks, off elsewhere.
  std::string checkpoint_async = "auto";
  // wait | skip. A checkpoint due while the previous one is still being written in the
  // background: the training waits for that write (wait), or this checkpoint is skipped, said
  // in one line, and the next interval tries again (skip; the run's last one is always waited for).
  std::string checkpoint_when_busy = "wait";
  std::optional<int64_t> max_steps;  // stop early (demo, tests); default: run the schedule
  // Dynamic loss scaling: "auto" = on exactly for fp16; "on" also scales fp32/bf16 losses
  // (useful to test the scaler without half-precision arithmetic).
  std::string loss_scaling = "auto";
  double loss_scale_init = 65536.0;
  int64_t loss_scale_growth_interval = 100;
  bool tensorboard = true;
  bool cudnn_benchmark = true;
  // CUDA graphs: the backbone's forward and backward captured once and replayed every step
  // (app/train/graphed_backbone.h); where capture is impossible the steps run eagerly, with
  // one log line saying why.
  bool cuda_graph = false;
  // Host memory the CPU block cache may keep for reuse (base/cpu_block_cache.h),
  // GB per rank; unset: a quarter of the machine's memory shared by its local ranks; 0: off.
  std::optional<double> cpu_cache_gb;
};

struct DistConfig {
  std::string device = "auto";  // auto | cpu | cuda
  // What carries CUDA tensors: auto | nccl | gloo (gloo: several ranks may share a GPU).
  std::string backend = "auto";
  double timeout_s = 600;              // each collective
  double rendezvous_timeout_s = 300;  // all ranks joining the job
  // Once 10 steps are measured: a collective that waits longer than 3 x the median step +
  // 5 s (at least this, at most timeout_s) for a rank that has stopped beating ends the run
  // naming that rank and its host.
  double hang_floor_s = 5;
  // Steps per window of the straggler monitor (0: off; a window also closes once its steps
  // add up to StragglerMonitor::kWindowSeconds): a rank whose compute or data wait is below
  // 0.75 of the fastest rank's pace in two consecutive windows is reported.
  int64_t straggler_window = 50;
  double bucket_mb = 25;
  bool find_unused_parameters = false;
};

struct Config {
  std::string output = "work_dirs/faceshard";
  int64_t seed = 2048;
  DataConfig data;
  ModelConfig model;
  LossConfig loss;
  OptimConfig optim;
  TrainConfig train;
  DistConfig dist;

  // Which file (or "--set") gave each key, and on which line, for errors found after
  // loading.
  std::map<std::string, std::string> origins;
  std::map<std::string, int> origin_lines;
  std::string top_file;

  void visit(FieldVisitor& v);
  // Checks that involve several fields (the per-field ones come from FieldSpec).
  void validate_relations() const;
  // "file:line" (or "--set") that set `key`, or set its nearest section; the top file for
  // defaults.
  std::string origin(const std::string& key) const;
};

// Components name their options in their own terms (Error::option(), "sample_rate");
// run `build` and turn such an error into a config error naming the file and the key
// given for that option ({"sample_rate", "loss.sample_rate"}). Other errors pass.
struct OptionKey {
  const char* option;
  const char* key;
};
template <typename F>
auto with_config_keys(const Config& cfg, std::initializer_list<OptionKey> keys, F&& build) -> decltype(build());
[[noreturn]] void throw_config_error(const Config& cfg, const std::string& key, const std::string& what);

// Loads `path` with its bases, applies "key.path=value" overrides, and fills a Config.
Config load_config(const std::string& path, const std::vector<std::string>& overrides = {});
// The same from YAML text (tests); `name` stands for the file name in errors.
Config load_config_text(const std::string& yaml, const std::string& name,
                        const std::vector<std::string>& overrides = {});
// The complete configuration as YAML (every key, defaults included).
std::string config_to_yaml(Config cfg);

// The same with keys known only at run time (a head's parameters).
template <typename F>
auto with_config_keys(const Config& cfg, const std::vector<std::pair<std::string, std::string>>& keys, F&& build)
    -> decltype(build()) {
  try {
    return build();
  } catch (const Error& e) {
    for (const auto& k : keys)
      if (!e.option().empty() && e.option() == k.first) throw_config_error(cfg, k.second, e.detail());
    throw;
  }
}

template <typename F>
auto with_config_keys(const Config& cfg, std::initializer_list<OptionKey> keys, F&& build) -> decltype(build()) {
  std::vector<std::pair<std::string, std::string>> named;
  for (const auto& k : keys) named.emplace_back(k.option, k.key);
  return with_config_keys(cfg, named, std::forward<F>(build));
}

}  // namespace faceshard
