// faceshard-extract: embeddings of a list of images, an image folder or a .rec into a
// NumPy .npy file (float32, N x E) plus a text file with one name per row, for use from
// Python (np.load). Images should be aligned 112x112 faces; other sizes are resized.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>


#include "app/io/checkpoint.h"
#include "app/eval/evaluation.h"
#include "app/eval/inference_model.h"
#include "app/io/npy.h"
#include "app/eval/eval_flags.h"
#include "data/dataset.h"
#include "data/image_transform.h"
#include "base/error.h"
#include "base/log.h"

using namespace faceshard;
namespace fs = std::filesystem;

namespace {

const char* kUsage =
    "usage: faceshard-extract --model PATH (--list FILE | --images DIR | --rec DIR) --output PREFIX [options]\n"
    "  --model PATH          faceshard export, checkpoint, run folder or state_dict file (see faceshard-verify)\n"
    "  --network NAME        backbone when the model has no metadata\n"
    "  --embedding-size N    embedding size when the model has no metadata (default 512)\n"
    "  --list FILE           one image path per line (relative to the list's folder); extra\n"
    "                        fields after whitespace are ignored, '#' starts a comment\n"
    "  --images DIR          every .jpg/.jpeg/.png/.bmp under DIR, in sorted path order\n"
    "  --rec DIR             DIR/train.rec + train.idx (names: <index> <label>)\n"
    "  --output PREFIX       writes PREFIX.npy (float32 N x E) and PREFIX.txt (N names); a PREFIX ending in\n"
    "                        .npy is taken without it\n"
    "  --no-flip             embed the image only (default: image + mirrored image, summed)\n"
    "  --no-normalize        keep the raw embeddings (default: rows L2-normalised)\n"
    "  --batch N             images per forward pass (default 64)\n"
    "  --device D            auto | cpu | cuda | cuda:N (default auto)\n"
    "  --precision P         fp32 | bf16 | fp16 (default: the training precision from the metadata, else fp32)\n";

struct Source {
  std::vector<std::string> names;
  ImageSource load;
  std::function<void(std::vector<std::string>&)> finish_names;  // names known only after loading
};

Source from_files(std::vector<std::string> paths, std::vector<std::string> names) {
  Source s;
  s.names = std::move(names);
  auto shared = std::make_shared<std::vector<std::string>>(std::move(paths));
  s.load = [shared](int64_t i) {
    const std::string& p = (*shared)[size_t(i)];
    std::ifstream f(p, std::ios::binary);
    if (!f) throw usage_error(p, ": cannot open image");
    std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    return decode_image(bytes.data(), bytes.size(), p);
  };
  return s;
}

Source from_list(const std::string& list) {
  std::ifstream f(list);
  if (!f) throw usage_error("--list: cannot open '", list, "'");
  const fs::path base = fs::path(list).parent_path();
  std::vector<std::string> paths, names;
  std::string line;
  int64_t no = 0;
  while (std::getline(f, line)) {
    ++no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    const size_t hash = line.find('#');
    if (hash != std::string::npos) line.resize(hash);
    const size_t b = line.find_first_not_of(" \t");
    if (b == std::string::npos) continue;
    const std::string name = line.substr(b, line.find_first_of(" \t", b) - b);
    const fs::path p = fs::path(name).is_absolute() ? fs::path(name) : base / name;
    if (!fs::is_regular_file(p)) throw usage_error(list, ":", no, ": image '", p.string(), "' does not exist");
    paths.push_back(p.string());
    names.push_back(name);
  }
  if (paths.empty()) throw usage_error(list, ": no images listed");
  return from_files(std::move(paths), std::move(names));
}

Source from_folder(const std::string& dir) {
  if (!fs::is_directory(dir)) throw usage_error("--images: '", dir, "' is not a folder");
  std::vector<std::string> rel;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    std::string ext = e.path().extension().string();
    for (auto& c : ext) c = char(std::tolower(static_cast<unsigned char>(c)));
    if (ext == ".jpg" || ext == ".jpeg" || ext == ".png" || ext == ".bmp")
      rel.push_back(fs::relative(e.path(), dir).generic_string());
  }
  if (rel.empty()) throw usage_error("--images: no .jpg/.jpeg/.png/.bmp files under '", dir, "'");
  std::sort(rel.begin(), rel.end());
  std::vector<std::string> paths;
  for (const auto& r : rel) paths.push_back((fs::path(dir) / r).string());
  return from_files(std::move(paths), std::move(rel));
}

Source from_rec(const std::string& dir) {
  if (!fs::exists(fs::path(dir) / "train.rec")) throw usage_error("--rec: '", dir, "' has no train.rec");
  std::shared_ptr<Dataset> ds = open_dataset(dir);
  Source s;
  s.names.resize(ds->size());
  // The labels for the names are read with the images (one pass over the file).
  auto labels = std::make_shared<std::vector<int64_t>>(ds->size(), -1);
  s.load = [ds, labels](int64_t i) {
    RawSample r;
    ds->read(uint64_t(i), r);
    (*labels)[size_t(i)] = r.label;
    return decode_image(r.bytes.data(), r.bytes.size(), ds->describe(uint64_t(i)));
  };
  s.finish_names = [labels](std::vector<std::string>& names) {
    for (size_t i = 0; i < names.size(); ++i) names[i] = std::to_string(i) + " " + std::to_string((*labels)[i]);
  };
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  return run_main("faceshard-extract", [&] {
    ModelSpec spec;
    std::string list, images, rec, output, device_name = "auto";
    int64_t batch = 64;
    bool flip = true, normalize = true;
    ToolArgs a(argc, argv);
    while (a.next()) {
      if (a.is("--help") || a.is("-h")) {
        std::fputs(kUsage, stdout);
        return 0;
      } else if (parse_model_flag(a, spec)) continue;
      else if (a.is("--list")) list = a.value();
      else if (a.is("--images")) images = a.value();
      else if (a.is("--rec")) rec = a.value();
      else if (a.is("--output")) output = a.value();
      else if (a.is("--no-flip")) flip = false;
      else if (a.is("--no-normalize")) normalize = false;
      else if (a.is("--batch")) batch = a.integer(1);
      else if (a.is("--device")) device_name = a.value();
      else a.unknown();
    }
    if (spec.path.empty()) throw usage_error("--model is required (see --help)");
    if (int(!list.empty()) + int(!images.empty()) + int(!rec.empty()) != 1)
      throw usage_error("give exactly one of --list, --images, --rec (see --help)");
    if (output.empty()) throw usage_error("--output PREFIX is required (see --help)");
    // "--output emb.npy" means the prefix "emb": the files are emb.npy and emb.txt.
    if (output.size() > 4 && output.compare(output.size() - 4, 4, ".npy") == 0) output.resize(output.size() - 4);
    const fs::path parent = fs::path(output).parent_path();
    if (!parent.empty() && !fs::is_directory(parent))
      throw usage_error("--output: folder '", parent.string(), "' does not exist");
    Source src = !list.empty() ? from_list(list) : !images.empty() ? from_folder(images) : from_rec(rec);
    const torch::Device device = parse_eval_device(device_name, 0);
    InferenceModel model = load_inference_model(spec, device);
    log_info("model: ", model.description, " on ", device.str(), "; ", src.names.size(), " images");
    const at::Tensor emb =
        embed_images(*model.backbone, int64_t(src.names.size()), src.load, batch, device, flip, normalize, true);
    if (src.finish_names) src.finish_names(src.names);
    std::string names;
    for (const auto& n : src.names) names += n + "\n";
    write_npy_float32(emb, output + ".npy");
    write_text_durably(names, output + ".txt");
    log_info("wrote ", output, ".npy (", emb.size(0), " x ", emb.size(1), " float32) and ", output, ".txt");
    return 0;
  });
}
