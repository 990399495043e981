// The training configuration: YAML files with inheritance ("base: other.yaml", later keys
// override), command-line overrides ("--set section.key=value"), and one typed, validated
// struct. Errors name the file (or "--set") and the full key path, and exit with status 2.
#pragma once
#include <map>
#include <optional>
#include <string>
#include <vector>

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
};

struct DataConfig {
  std::string rec = "synthetic";  // folder with train.rec/train.idx, an image folder, or "synthetic"
  int64_t num_classes = 0;
  int64_t num_images = 0;  // 0: count from the data set
  int64_t batch_size = 128;  // per rank
  int64_t num_workers = 2;
  std::vector<std::string> val_targets;
  std::string val_dir;  // where <target>.bin live; default: the rec folder
  bool flip = true;
  double max_bad_fraction = 0.001;
  int64_t prefetch = 4;
  // data.augment.*: probabilities of the optional extra augmentations (grayscale,
  // Gaussian blur, downscale-then-upscale); all 0, i.e. off, as in arcface_torch.
  double augment_gray_prob = 0.0;
  double augment_blur_prob = 0.0;
  double augment_downscale_prob = 0.0;
};

struct ModelConfig {
  std::string backbone = "r50";
  int64_t embedding_size = 512;
  double dropout = 0.0;
  bool sync_bn = false;
  bool channels_last = false;
  std::string init;  // optional state_dict file to start the backbone from
};

struct LossConfig {
  std::vector<double> margin{1.0, 0.5, 0.0};  // (m1, m2, m3): s * (cos(m1*theta + m2) - m3)
  double scale = 64.0;
  double interclass_filtering_threshold = 0.0;
  double sample_rate = 1.0;
};

struct OptimConfig {
  std::string optimizer = "sgd";  // backbone: sgd | adamw
  double lr = 0.1;
  double momentum = 0.9;
  double weight_decay = 5e-4;
  std::vector<double> betas{0.9, 0.999};
  double eps = 1e-8;
  // Classifier shard: optimizer/lr/weight decay, empty or negative = same as the backbone.
  std::string fc_optimizer;
  double fc_lr = -1;
  double fc_weight_decay = -1;
  int64_t epochs = 20;
  double warmup_epochs = 0;
  int64_t total_steps = 0;   // 0: derived from images, global batch and epochs
  int64_t warmup_steps = -1; // -1: derived from warmup_epochs
  double power = 1.0;        // polynomial decay exponent
  double grad_clip = 5.0;    // max norm of the backbone gradient, 0 = off
  int64_t grad_accumulation = 1;
};

struct TrainConfig {
  std::string precision = "fp32";  // fp32 | bf16 | fp16
  int64_t log_every = 10;
  int64_t verify_every = 2000;
  int64_t checkpoint_every = 0;  // steps, 0: at the end of every epoch
  int64_t keep_checkpoints = 3;
  int64_t max_steps = 0;         // stop early (demo, tests); 0 = run the schedule
  // Dynamic loss scaling: "auto" = on exactly for fp16; "on" also scales fp32/bf16 losses
  // (useful to test the scaler without half-precision arithmetic).
  std::string loss_scaling = "auto";
  double loss_scale_init = 65536.0;
  int64_t loss_scale_growth_interval = 100;
  bool tensorboard = true;
  bool cudnn_benchmark = true;
};

struct DistConfig {
  std::string device = "auto";  // auto | cpu | cuda
  double timeout_s = 600;
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

  void visit(FieldVisitor& v);
  // Checks that involve several fields (the per-field ones come from FieldSpec).
  void validate_relations() const;
};

// Loads `path` with its bases, applies "key.path=value" overrides, and fills a Config.
Config load_config(const std::string& path, const std::vector<std::string>& overrides = {});
// The same from YAML text (tests); `name` stands for the file name in errors.
Config load_config_text(const std::string& yaml, const std::string& name,
                        const std::vector<std::string>& overrides = {});
// The complete configuration as YAML (every key, defaults included).
std::string config_to_yaml(Config cfg);

// Merge machinery, exposed for tests.
struct MergedYaml;
std::string merged_origin(const MergedYaml& m, const std::string& path);

}  // namespace faceshard
