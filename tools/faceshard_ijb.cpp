// faceshard-ijb: the IJB-B / IJB-C 1:1 verification protocol (insightface's eval_ijbc.py)
// on the published meta files: every face aligned to the ArcFace template from its five
// landmarks, embedded with the flip test (image + mirror, summed), weighted by its
// faceness score, averaged per media and summed per template, L2-normalised; the cosine
// score of every template pair; TAR at FAR 1e-6 .. 1e-1 and the ROC (CSV + PNG).
// Launched with several ranks (tools/launch.sh, torchrun, srun) the images are split
// across them and the features gathered; then the ranks leave the job and rank 0 scores.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "app/io/checkpoint.h"
#include "app/eval/evaluation.h"
#include "app/eval/ijb.h"
#include "app/eval/inference_model.h"
#include "app/io/metrics_log.h"
#include "app/io/npy.h"
#include "app/eval/eval_flags.h"
#include "app/eval/verification_metrics.h"
#include "data/face_align.h"
#include "data/image_transform.h"
#include "partial_fc/distributed/dist_env.h"
#include "partial_fc/distributed/distributed.h"
#include "base/error.h"
#include "base/log.h"

using namespace faceshard;
namespace fs = std::filesystem;

namespace {

const char* kUsage =
    "usage: faceshard-ijb --model PATH --root DIR [--target IJBC|IJBB] [options]\n"
    "  --model PATH          faceshard export, checkpoint, run folder or state_dict file (see faceshard-verify)\n"
    "  --network NAME        backbone when the model has no metadata\n"
    "  --embedding-size N    embedding size when the model has no metadata (default 512)\n"
    "  --root DIR            IJB folder with loose_crop/ and meta/<ijbc|ijbb>_*.txt\n"
    "  --target T            IJBC (default) or IJBB\n"
    "  --batch N             images per forward pass (default 128)\n"
    "  --device D            auto | cpu | cuda (default auto: the local rank's GPU when there is one)\n"
    "  --precision P         fp32 | bf16 | fp16 (default: the training precision from the metadata, else fp32)\n"
    "  --no-flip             image embedding only (default: image + mirror, summed)\n"
    "  --no-faceness         do not weight image features by the faceness score\n"
    "  --output DIR          <target>_roc.csv, <target>_roc.png, <target>_scores.npy (default ijb_out)\n"
    "  --image-features F    also write the per-image features (before weighting) as F (.npy)\n"
    "  --json FILE           also write TAR@FAR as JSON\n";

}  // namespace

int main(int argc, char** argv) {
  return run_main("faceshard-ijb", [&] {
    ModelSpec spec;
    std::string root, target = "IJBC", device_name = "auto", output = "ijb_out", feature_file, json;
    int64_t batch = 128;
    bool flip = true, faceness = true;
    ToolArgs a(argc, argv);
    while (a.next()) {
      if (a.is("--help") || a.is("-h")) {
        std::fputs(kUsage, stdout);
        return 0;
      } else if (parse_model_flag(a, spec)) continue;
      else if (a.is("--root")) root = a.value();
      else if (a.is("--target")) target = a.value();
      else if (a.is("--batch")) batch = a.integer(1);
      else if (a.is("--device")) device_name = a.value();
      else if (a.is("--no-flip")) flip = false;
      else if (a.is("--no-faceness")) faceness = false;
      else if (a.is("--output")) output = a.value();
      else if (a.is("--image-features")) feature_file = a.value();
      else if (a.is("--json")) json = a.value();
      else a.unknown();
    }
    if (spec.path.empty()) throw usage_error("--model is required (see --help)");
    if (root.empty()) throw usage_error("--root is required (see --help)");
    // Everything a rank can check alone happens before the ranks meet.
    const IjbMeta meta = read_ijb_meta(root, target);
    const fs::path crops = fs::path(root) / "loose_crop";
    if (!fs::is_directory(crops)) throw usage_error("--root: '", crops.string(), "' is not a folder");
    check_ijb_images(meta, crops.string());
    // The output folder too: embedding IJB-C takes hours, a bad --output must fail first.
    std::error_code ec;
    fs::create_directories(output, ec);
    if (ec) throw usage_error("--output: cannot create '", output, "': ", ec.message());
    const DistEnv env = DistEnv::from_environment();
    const torch::Device device = parse_eval_device(device_name, env.local_rank);
    InferenceModel model = load_inference_model(spec, device);
    DistOptions dopts;
    dopts.use_cuda = device.is_cuda();
    auto dist = Distributed::init(env, dopts);
    const int rank = dist->rank(), world = dist->world_size();
    const int64_t n = int64_t(meta.images.size());
    const int64_t lo = n * rank / world, hi = n * (rank + 1) / world;
    log_info(meta.target, ": ", n, " images, ", meta.pair_t1.size(), " template pairs; model ", model.description,
             " on ", device.str(), "; this rank embeds images ", lo, "..", hi - 1);

    const ImageSource load = [&](int64_t i) {
      const std::string path = (crops / meta.images[size_t(lo + i)]).string();
      std::ifstream f(path, std::ios::binary);
      if (!f) throw usage_error(path, ": cannot open image (listed in the ", meta.target, " meta files)");
      std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
      return align_face(decode_image(bytes.data(), bytes.size(), path), meta.landmarks[size_t(lo + i)]);
    };
    at::Tensor mine = embed_images(*model.backbone, hi - lo, load, batch, device, flip, false, true);
    at::Tensor features = world > 1 ? dist->all_gather(device.is_cuda() ? mine.to(device) : mine).cpu() : mine;
    // The ranks part here: rank 0 scores the pairs alone, which on IJB-C takes longer than
    // a collective's timeout, so no rank may wait for it in a barrier.
    dist->shutdown();
    if (rank != 0) return 0;
    if (!feature_file.empty()) write_npy_float32(features, feature_file);
    std::vector<int64_t> templates;
    const at::Tensor tf = ijb_template_features(features, meta, &templates, faceness);
    const std::vector<double> scores = ijb_pair_scores(tf, templates, meta);
    const RocCurve roc = roc_curve(scores, meta.pair_label);
    const std::string stem = output + "/" + meta.target;
    write_npy_float32(at::from_blob(const_cast<double*>(scores.data()), {int64_t(scores.size())}, at::kDouble), stem + "_scores.npy");
    write_roc_csv(roc, stem + "_roc.csv");
    write_roc_png({{meta.target, roc}}, stem + "_roc.png", meta.target + " 1:1 verification");
    std::ostringstream js;
    js << "{\"target\": \"" << meta.target << "\", \"images\": " << n << ", \"templates\": " << templates.size()
       << ", \"pairs\": " << scores.size();
    // TAR at a FAR below 1/negatives is not measured by these pairs: said instead of a number.
    const int64_t negatives = std::count(meta.pair_label.begin(), meta.pair_label.end(), 0);
    js << ", \"negative_pairs\": " << negatives << ", \"auc\": " << json_number(roc_auc(roc)) << ", \"tar_at_far\": {";
    // Fractions, as faceshard-verify prints them and both JSON files hold them.
    std::printf("%s  TAR@FAR: ", meta.target.c_str());
    const double fars[] = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1};
    for (int k = 0; k < 6; ++k) {
      const double tar = tar_at_far(roc, fars[k]);
      std::printf("%s1e-%d %s", k ? "  " : "", 6 - k, tar_at_far_text(tar, fars[k], negatives).c_str());
      js << (k ? ", " : "") << "\"1e-" << 6 - k << "\": " << tar_at_far_json(tar, fars[k], negatives);
    }
    js << "}}\n";
    std::printf("  (AUC %.5f, %zu pairs, %lld negatives)\n", roc_auc(roc), scores.size(), static_cast<long long>(negatives));
    std::fflush(stdout);
    if (!json.empty()) write_text_durably(js.str(), json);
    log_info("wrote ", stem, "_roc.csv, ", stem, "_roc.png, ", stem, "_scores.npy");
    return 0;
  });
}
