#include "app/eval/inference_model.h"

#include <filesystem>

#include <yaml-cpp/yaml.h>

#include "app/io/checkpoint.h"
#include "models/backbone_registry.h"
#include "base/error.h"

namespace faceshard {

namespace fs = std::filesystem;

namespace {

struct Meta {
  std::string network;
  int64_t embedding_size = 0;
  std::string precision;
  std::string source;  // where the metadata came from ("" when none)
};

// model.json (an export) or config.yaml (a run); JSON is read as YAML.
Meta read_meta(const fs::path& file, bool is_run_config) {
  Meta m;
  YAML::Node root;
  try {
    root = YAML::LoadFile(file.string());
  } catch (const std::exception& e) {
    throw usage_error(file.string(), ": cannot parse model metadata: ", one_line(e));
  }
  const YAML::Node node = is_run_config ? root["model"] : root;
  try {
    if (node && node["backbone"]) m.network = node["backbone"].as<std::string>();
    if (node && node["embedding_size"]) m.embedding_size = node["embedding_size"].as<int64_t>();
    const YAML::Node prec = is_run_config ? (root["train"] ? root["train"]["precision"] : YAML::Node()) : root["precision"];
    if (prec && prec.IsScalar()) m.precision = prec.as<std::string>();
  } catch (const std::exception& e) {
    throw usage_error(file.string(), ": bad model metadata: ", one_line(e));
  }
  if (m.network.empty()) throw usage_error(file.string(), ": no backbone name in the model metadata");
  m.source = file.string();
  return m;
}

}  // namespace

InferenceModel load_inference_model(const ModelSpec& spec, torch::Device device) {
  if (spec.path.empty()) throw usage_error("--model: a model file or folder is required");
  fs::path p(spec.path);
  std::error_code ec;
  if (!fs::exists(p, ec)) throw usage_error("--model: '", spec.path, "' does not exist");
  fs::path weights;
  Meta meta;
  auto checkpoint = [&](const fs::path& dir) {
    read_checkpoint_info(dir.string());  // validates the marker
    weights = dir / "backbone.pt";
    const fs::path cfg = dir.parent_path().parent_path() / "config.yaml";
    if (fs::exists(cfg)) meta = read_meta(cfg, true);
  };
  if (fs::is_directory(p)) {
    if (fs::exists(p / "COMMITTED") || fs::exists(p / "backbone.pt")) {
      checkpoint(p);  // an uncommitted step folder is an error naming it
    } else if (fs::exists(p / "model.pt")) {
      weights = p / "model.pt";
      if (fs::exists(p / "model.json")) meta = read_meta(p / "model.json", false);
    } else if (fs::is_directory(p / "checkpoints")) {
      const std::string newest = latest_checkpoint((p / "checkpoints").string());
      if (newest.empty()) throw usage_error("--model: '", spec.path, "' has no model.pt and no committed checkpoint");
      checkpoint(newest);
    } else {
      throw usage_error("--model: '", spec.path,
                        "' is a folder without model.pt, COMMITTED or checkpoints/ (not a faceshard run or export)");
    }
  } else {
    weights = p;
    const fs::path dir = p.parent_path().empty() ? fs::path(".") : p.parent_path();
    fs::path sidecar = p;
    sidecar.replace_extension(".json");
    if (fs::exists(sidecar)) meta = read_meta(sidecar, false);
    else if (fs::exists(dir / "model.json")) meta = read_meta(dir / "model.json", false);
    else if (fs::exists(dir / "COMMITTED")) checkpoint(dir);
  }
  if (!fs::is_regular_file(weights)) throw usage_error("--model: weights file '", weights.string(), "' is missing");

  BackboneOptions o;
  o.name = !spec.network.empty() ? spec.network : meta.network;
  if (o.name.empty())
    throw usage_error("--model: '", spec.path,
                      "' carries no metadata (model.json or the run's config.yaml); name the network with --network");
  o.embedding_size = spec.embedding_size > 0 ? spec.embedding_size : meta.embedding_size > 0 ? meta.embedding_size : 512;
  // A run's "auto" as its trainer ran it on this device.
  const std::string precision = resolve_precision(
      !spec.precision.empty() ? spec.precision : !meta.precision.empty() ? meta.precision : "fp32", device_has_bf16(device));
  o.precision = parse_body_precision(precision);
  InferenceModel m;
  m.backbone = make_backbone(o);
  load_backbone_weights(*m.backbone, weights.string());
  m.backbone->to(device);
  m.backbone->eval();
  m.weights = weights.string();
  m.metadata = meta.source;
  m.description = o.name + ", " + std::to_string(o.embedding_size) + "-d, " + precision + ", from " +
                  weights.string() + (meta.source.empty() ? "" : " (metadata: " + meta.source + ")");
  return m;
}

}  // namespace faceshard
