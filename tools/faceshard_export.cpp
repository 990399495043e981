// faceshard-export: a trained backbone (a run, a checkpoint, model.pt or insightface's
// backbone.pth) as an ONNX model that onnxruntime and insightface's model_zoo.get_model run:
// input "data" [N,3,112,112] float32 RGB, (x / 255 - 0.5) / 0.5; output "embedding" [N, E].
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <c10/util/hash.h>

#include "app/eval/inference_model.h"
#include "app/eval/eval_flags.h"
#include "app/export/onnx_export.h"
#include "base/error.h"
#include "base/log.h"

using namespace faceshard;
namespace fs = std::filesystem;

namespace {

const char* kUsage =
    "usage: faceshard-export --model PATH --onnx OUT.onnx [options]\n"
    "  --model PATH          faceshard export (folder or model.pt), checkpoint step folder, run\n"
    "                        folder, or a state_dict file such as insightface's backbone.pth\n"
    "  --network NAME        backbone when the model has no metadata (r50, mbf, vit_t, ...: faceshard-flops lists all)\n"
    "  --embedding-size N    embedding size when the model has no metadata (default 512)\n"
    "  --onnx FILE           the ONNX model to write (atomically: nothing is left there on failure;\n"
    "                        a model with a tensor the export does not lower is refused, exit 1)\n"
    "  --opset N             ONNX opset, 13 to 21 (default 17)\n"
    "  --batch B             dynamic (default; the dimension is named 'batch') or a fixed batch size\n"
    "  --precision P         fp32 (default) | fp16: fp16 weights and compute, float32 input and output\n"
    "  --external-data       weights in FILE.data beside the model (automatic past protobuf's 2 GiB)\n";

int64_t parse_int(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end) throw usage_error(flag, " expects an integer, got '", v, "'");
  return x;
}

// sha1 of the run's config.yaml (`sha1sum config.yaml` prints the same): the one the metadata
// came from, else the one beside the weights (a run folder holds model.pt and config.yaml).
std::string config_sha1(const InferenceModel& m) {
  fs::path cfg;
  if (fs::path(m.metadata).filename() == "config.yaml") cfg = m.metadata;
  else if (fs::exists(fs::path(m.weights).parent_path() / "config.yaml")) cfg = fs::path(m.weights).parent_path() / "config.yaml";
  if (cfg.empty()) return "unknown (no config.yaml with the model)";
  std::ifstream f(cfg, std::ios::binary);
  std::ostringstream text;
  text << f.rdbuf();
  if (!f || text.str().empty()) return "unknown (" + cfg.string() + " is empty or unreadable)";
  return c10::sha1(text.str()).str();
}

std::string megabytes(uint64_t bytes) {
  std::ostringstream os;
  os.precision(1);
  os << std::fixed << static_cast<double>(bytes) / 1e6 << " MB";
  return os.str();
}

}  // namespace

int main(int argc, char** argv) {
  return run_main("faceshard-export", [&] {
    ModelSpec spec;
    std::string onnx;
    OnnxExportOptions o;
    ToolArgs a(argc, argv);
    while (a.next()) {
      if (a.is("--help") || a.is("-h")) {
        std::fputs(kUsage, stdout);
        return 0;
      } else if (a.is("--precision")) {  // the export's precision, not the model's (parse_model_flag's)
        const std::string p = a.value();
        if (p == "fp32") o.dtype = at::kFloat;
        else if (p == "fp16") o.dtype = at::kHalf;
        else throw usage_error("--precision must be fp32 or fp16, got '", p, "'");
      } else if (parse_model_flag(a, spec)) continue;
      else if (a.is("--onnx")) onnx = a.value();
      else if (a.is("--opset")) o.opset = parse_int("--opset", a.value());
      else if (a.is("--batch")) {
        const std::string b = a.value();
        o.batch = b == "dynamic" ? 0 : parse_int("--batch", b);
        if (b != "dynamic" && o.batch < 1) throw usage_error("--batch must be 'dynamic' or a batch size >= 1, got '", b, "'");
      } else if (a.is("--external-data")) o.external_data = true;
      else a.unknown();
    }
    if (spec.path.empty()) throw usage_error("--model is required (see --help)");
    if (onnx.empty()) throw usage_error("--onnx OUT.onnx is required (see --help)");
    check_onnx_export_options(o);
    // Refuse an output that cannot be written before spending the time to load the model.
    const fs::path out(onnx);
    const fs::path dir = out.parent_path().empty() ? fs::path(".") : out.parent_path();
    if (!fs::is_directory(dir)) throw usage_error("--onnx: folder '", dir.string(), "' does not exist");
    if (::access(dir.c_str(), W_OK) != 0) throw usage_error("--onnx: folder '", dir.string(), "' is not writable");
    if (fs::is_directory(out)) throw usage_error("--onnx: '", onnx, "' is a folder");

    const auto t0 = std::chrono::steady_clock::now();
    spec.precision = "fp32";  // the weights as trained; the forward's autocast does not matter here
    const InferenceModel model = load_inference_model(spec, torch::kCPU);
    o.metadata = {{"training_config_sha1", config_sha1(model)},
                  {"weights", fs::path(model.weights).filename().string()}};
    const OnnxExportResult r = export_onnx(*model.backbone, o, onnx);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    log_info("wrote ", onnx, " (", megabytes(r.files.model_bytes), ")",
             r.files.data_path.empty() ? "" : " + " + r.files.data_path + " (" + megabytes(r.files.data_bytes) + ")",
             ": ", model.backbone->options().name, ", ", model.backbone->embedding_size(), "-d, opset ", o.opset,
             ", batch ", o.batch > 0 ? std::to_string(o.batch) : "dynamic", ", ", o.dtype == at::kHalf ? "fp16" : "fp32",
             ", ", r.nodes, " nodes, ", r.initializers, " weights (from ", r.tensors.read, " of the model's ",
             r.tensors.total, " tensors; ", r.tensors.exempt, " need none), in ", seconds, " s");
    return 0;
  });
}
