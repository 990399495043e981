// faceshard-verify: insightface's 10-fold verification protocol on .bin sets (LFW,
// CFP-FP, AgeDB-30, ...) for an exported model, a checkpoint or a run folder. Prints
// accuracy +- std, the best threshold and TAR at FAR 1e-3 / 1e-4 per set; writes the ROC
// of each set as CSV and all of them in one PNG plot. The numbers are computed by the code
// the trainer uses, so they equal the trainer's final verification of the same model.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "app/io/checkpoint.h"
#include "app/eval/evaluation.h"
#include "app/eval/inference_model.h"
#include "app/io/metrics_log.h"
#include "app/eval/eval_flags.h"
#include "app/eval/verification_metrics.h"
#include "base/error.h"
#include "base/log.h"

using namespace faceshard;

namespace {

const char* kUsage =
    "usage: faceshard-verify --model PATH --bin FILE.bin [--bin FILE.bin ...] [options]\n"
    "  --model PATH          faceshard export (folder or model.pt), checkpoint step folder, run\n"
    "                        folder, or a state_dict file such as insightface's backbone.pth\n"
    "  --network NAME        backbone when the model has no metadata (r50, mbf, vit_t, ...: faceshard-flops lists all)\n"
    "  --embedding-size N    embedding size when the model has no metadata (default 512)\n"
    "  --bin FILE            an insightface verification set (.bin); repeatable\n"
    "  --batch N             images per forward pass (default 64)\n"
    "  --device D            auto | cpu | cuda | cuda:N (default auto)\n"
    "  --precision P         fp32 | bf16 | fp16 (default: the training precision from the metadata, else fp32)\n"
    "  --folds K             folds of the protocol (default 10; at most the pairs of each set)\n"
    "  --output DIR          where <set>_roc.csv and roc.png go (default verify_out)\n"
    "  --json FILE           also write the results as JSON\n";

}  // namespace

int main(int argc, char** argv) {
  return run_main("faceshard-verify", [&] {
    ModelSpec spec;
    std::vector<std::string> bins;
    int64_t batch = 64, folds = 10;
    std::string device_name = "auto", output = "verify_out", json;
    ToolArgs a(argc, argv);
    while (a.next()) {
      if (a.is("--help") || a.is("-h")) {
        std::fputs(kUsage, stdout);
        return 0;
      } else if (parse_model_flag(a, spec)) continue;
      else if (a.is("--bin")) bins.push_back(a.repeated_value());
      else if (a.is("--batch")) batch = a.integer(1);
      else if (a.is("--device")) device_name = a.value();
      else if (a.is("--folds")) folds = a.integer(2);
      else if (a.is("--output")) output = a.value();
      else if (a.is("--json")) json = a.value();
      else a.unknown();
    }
    if (spec.path.empty()) throw usage_error("--model is required (see --help)");
    if (bins.empty()) throw usage_error("at least one --bin is required (see --help)");
    for (const auto& b : bins)
      if (!std::filesystem::is_regular_file(b)) throw usage_error("--bin: '", b, "' is not a file");
    const torch::Device device = parse_eval_device(device_name, 0);
    InferenceModel model = load_inference_model(spec, device);
    log_info("model: ", model.description, " on ", device.str());
    std::error_code ec;
    std::filesystem::create_directories(output, ec);
    if (ec) throw usage_error("--output: cannot create '", output, "': ", ec.message());

    std::vector<std::pair<std::string, RocCurve>> curves;
    std::ostringstream js;
    js << "{\"model\": \"" << model.weights << "\", \"sets\": [";
    for (size_t i = 0; i < bins.size(); ++i) {
      const VerificationData data = load_verification_data(bins[i]);
      VerificationResult r = evaluate_verification(*model.backbone, data, batch, device, folds, /*progress=*/true);
      const double auc = roc_auc(r.roc);
      // The protocol's threshold is a squared L2 distance between unit embeddings (same
      // identity below it); the ROC's is the cosine similarity 1 - d/2 (same at or above).
      const double cosine = 1 - r.kfold.best_threshold / 2;
      // TAR at a FAR below 1/negatives is not measured by the set: said instead of a number.
      const int64_t negatives = std::count(data.issame.begin(), data.issame.end(), false);
      std::printf("%s: accuracy %.5f +- %.5f  best threshold: distance %.3f (squared L2) = cosine %.3f  "
                  "TAR@FAR=1e-3 %s  TAR@FAR=1e-4 %s  AUC %.5f  XNorm %.3f  (%zu pairs, %lld negatives)\n",
                  data.name.c_str(), r.kfold.accuracy_mean, r.kfold.accuracy_std, r.kfold.best_threshold, cosine,
                  tar_at_far_text(r.tar_at_far_1e3, 1e-3, negatives).c_str(),
                  tar_at_far_text(r.tar_at_far_1e4, 1e-4, negatives).c_str(), auc, r.xnorm, data.issame.size(),
                  static_cast<long long>(negatives));
      std::fflush(stdout);
      if (r.negative_cosine > 0.9)
        log_warn(data.name, ": different identities' embeddings have a mean cosine of ", std::round(r.negative_cosine * 1000) / 1000,
                 ": the embeddings have collapsed (an untrained or diverged model, or the wrong --network); the "
                 "accuracy says nothing about the model");
      write_roc_csv(r.roc, output + "/" + data.name + "_roc.csv");
      js << (i ? ", " : "") << "{\"name\": \"" << data.name << "\", \"pairs\": " << data.issame.size()
         << ", \"negative_pairs\": " << negatives
         << ", \"accuracy\": " << json_number(r.kfold.accuracy_mean) << ", \"accuracy_std\": " << json_number(r.kfold.accuracy_std)
         << ", \"best_threshold\": " << json_number(r.kfold.best_threshold)
         << ", \"best_threshold_unit\": \"squared_l2_distance\", \"best_threshold_cosine\": " << json_number(cosine)
         << ", \"negative_mean_cosine\": " << json_number(r.negative_cosine)
         << ", \"tar_at_far_1e-3\": " << tar_at_far_json(r.tar_at_far_1e3, 1e-3, negatives)
         << ", \"tar_at_far_1e-4\": " << tar_at_far_json(r.tar_at_far_1e4, 1e-4, negatives) << ", \"auc\": " << json_number(auc)
         << ", \"xnorm\": " << json_number(r.xnorm) << "}";
      curves.emplace_back(data.name, std::move(r.roc));
    }
    js << "]}\n";
    write_roc_png(curves, output + "/roc.png", "verification ROC");
    log_info("ROC curves: ", output, "/<set>_roc.csv, ", output, "/roc.png");
    if (!json.empty()) write_text_durably(js.str(), json);
    return 0;
  });
}
