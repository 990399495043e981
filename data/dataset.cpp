#include "data/dataset.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>

#include "data/image_check.h"
#include "data/image_record.h"
#include "data/index_check.h"
#include "data/pack_source.h"
#include "base/error.h"
#include "base/log.h"

namespace faceshard {

namespace fs = std::filesystem;

// ---------------------------------------------------------------------------------------
// RecordIODataset

RecordIODataset::RecordIODataset(const std::string& rec_path, const std::string& idx_path,
                                 const RecordIndexOptions& index_options, int label_bits)
    : rec_(rec_path, idx_path, index_options), layout_(read_insightface_layout(rec_, label_bits)) {
  if (layout_.num_images() == 0) throw usage_error(rec_path, ": no image records");
  // A corrupt .idx (keys pointing at other keys' records) caught at start, not as a run on
  // the wrong images: 256 reads however large the file.
  check_index_sample(rec_, layout_, 256);
}

int64_t RecordIODataset::num_classes() const {
  return layout_.num_identities() > 0 ? int64_t(layout_.num_identities()) : -1;
}

void RecordIODataset::read(uint64_t index, RawSample& out) const {
  const uint64_t k = key(index);
  thread_local std::vector<uint8_t> buf;
  rec_.read(k, buf);
  // The parsers prefix their messages with `where`; it is built only on failure (an empty
  // prefix, then describe() in front) since read() runs for every image of every epoch.
  ImageRecordView v;
  try {
    v = unpack_image_record(buf, "");
    check_record_id(v, k, "");
  } catch (const Error& e) {
    throw runtime_error(describe(index), e.what());
  }
  try {
    out.label = label_to_class(v.class_label(), "");
  } catch (const Error& e) {
    throw LabelError(describe(index) + e.what());
  }
  out.bytes.assign(v.image, v.image + v.image_size);
}

std::string RecordIODataset::describe(uint64_t index) const {
  const uint64_t k = key(index);
  return detail::concat(rec_.file().path(), ": key ", k, " at offset ", rec_.offset_of(k));
}

// ---------------------------------------------------------------------------------------
// ImageFolderDataset

namespace {

std::string absolute_text(const std::string& p) {
  std::error_code ec;
  const fs::path a = fs::absolute(p, ec);
  return ec ? p : a.lexically_normal().string();
}

// The problems of a folder, bounded: the first kMaxListedProblems one line each, then how
// many more. `prefix` starts each line.
void log_problems(const std::vector<PackProblem>& problems, LogLevel level, const std::string& prefix) {
  for (size_t k = 0; k < problems.size() && k < kMaxListedProblems; ++k)
    log_message(level, prefix + problems[k].path + ": " + problems[k].what);
  if (problems.size() > kMaxListedProblems)
    log_message(level, detail::concat(prefix, "... and ", problems.size() - kMaxListedProblems, " more (",
                                      problems.size(), " problems in all)"));
}

}  // namespace

ImageFolderDataset::ImageFolderDataset(const std::string& root, const ImageFolderOptions& o) {
  std::error_code ec;
  if (!fs::is_directory(root, ec)) throw usage_error(root, ": not a directory (expected one sub-folder per identity)");
  const std::string abs = absolute_text(root);
  // Listed as faceshard-pack lists it: the same classes, the same problems.
  PackSource src = list_pack_source(abs);
  std::vector<PackProblem> problems = src.problems;
  std::vector<uint64_t> bad;
  if (o.check_images) {
    const auto t0 = std::chrono::steady_clock::now();
    bad = check_source_images(src, o.image_size, o.threads, problems);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (o.report)
      log_info("data: checked ", src.items.size(), " images of '", abs, "' in ", format_sig(s), " s (every file's ",
               o.image_size, "x", o.image_size, " header and end, ", o.threads, o.threads == 1 ? " thread)" : " threads)");
  }
  std::stable_sort(problems.begin(), problems.end(),
                   [](const PackProblem& a, const PackProblem& b) { return a.path < b.path; });
  if (!problems.empty() && !o.skip_bad) {
    const std::string fix = "; fix them, or set data.skip_bad: true to leave those files and folders out";
    if (problems.size() == 1)
      throw usage_error("data.rec '", abs, "': ", problems[0].path, ": ", problems[0].what,
                        "; fix it, or set data.skip_bad: true to leave it out");
    if (o.report) log_problems(problems, LogLevel::Error, "data: ");
    throw usage_error("data.rec '", abs, "': ", problems.size(), " problems in the image folder (",
                      problems.size() > kMaxListedProblems ? detail::concat("the first ", kMaxListedProblems)
                                                           : std::string("each"),
                      " listed above)", fix);
  }
  const size_t folders = problems.size() - bad.size();
  const std::vector<std::string> emptied = drop_items(src, bad);
  if (!problems.empty() && o.report) {
    log_problems(problems, LogLevel::Warn, "data.skip_bad: left out ");
    log_warn("data.skip_bad: left out ", bad.size(), bad.size() == 1 ? " bad image" : " bad images", " and ", folders,
             folders == 1 ? " folder" : " folders", " (empty, or inside an identity folder) of '", abs, "'",
             emptied.empty() ? std::string()
                             : detail::concat("; ", emptied.size(), emptied.size() == 1 ? " identity" : " identities",
                                              " lost every image and ", emptied.size() == 1 ? "is" : "are", " no class"),
             "; training on ", src.items.size(), " images of ", src.identities.size(), " identities");
  }
  if (src.items.empty())
    throw usage_error("data.rec '", abs, "': no image to train on (expected one sub-folder per identity holding "
                      ".jpg, .jpeg, .png or .bmp files)");
  class_names_ = std::move(src.identities);
  for (PackItem& it : src.items) {
    files_.push_back(std::move(it.path));
    labels_.push_back(it.label);
  }
}

void ImageFolderDataset::read(uint64_t index, RawSample& out) const {
  const std::string& p = files_.at(index);
  std::ifstream in(p, std::ios::binary | std::ios::ate);
  if (!in) throw runtime_error(p, ": cannot open image");
  const std::streamoff n = in.tellg();
  if (n < 0) throw runtime_error(p, ": cannot read image");
  out.bytes.resize(size_t(n));
  in.seekg(0);
  if (n > 0 && !in.read(reinterpret_cast<char*>(out.bytes.data()), n)) throw runtime_error(p, ": read error");
  out.label = labels_[index];
}

// ---------------------------------------------------------------------------------------
// SyntheticDataset

SyntheticDataset::SyntheticDataset(uint64_t size, int64_t num_classes, int image_size, uint64_t seed)
    : size_(size), num_classes_(num_classes), image_size_(image_size) {
  if (size == 0 || num_classes <= 0 || image_size <= 0) {
    throw usage_error("synthetic data set: size, num_classes and image_size must be positive");
  }
  std::mt19937_64 g(seed);
  pixels_.resize(size_t(image_size) * image_size * 3);
  for (auto& p : pixels_) p = uint8_t(g() & 0xff);
}

void SyntheticDataset::read(uint64_t index, RawSample& out) const {
  if (index >= size_) throw runtime_error("synthetic data set: index ", index, " out of range");
  out.label = int64_t(index % uint64_t(num_classes_));
  out.bytes = pixels_;
}

std::string SyntheticDataset::describe(uint64_t index) const { return detail::concat("synthetic sample ", index); }

std::shared_ptr<Dataset> open_dataset(const std::string& path, int64_t synthetic_classes, uint64_t synthetic_size,
                                      const RecordIndexOptions& index_options, const ImageFolderOptions& folder_options) {
  if (path == "synthetic") return std::make_shared<SyntheticDataset>(synthetic_size, synthetic_classes);
  const fs::path root(path);
  const fs::path rec = root / "train.rec", idx = root / "train.idx";
  std::error_code ec;
  const std::string abs = fs::absolute(root, ec).lexically_normal().string();
  if (!fs::exists(root, ec))
    throw usage_error("data.rec '", abs, "': does not exist (expected a folder holding train.rec and train.idx, or one "
                      "sub-folder per identity)");
  if (!fs::is_directory(root, ec)) {
    if (root.extension() == ".rec")
      throw usage_error("data.rec '", abs, "': is the .rec file itself; data.rec is the folder that holds train.rec and "
                        "train.idx: ", fs::absolute(root, ec).parent_path().lexically_normal().string());
    throw usage_error("data.rec '", abs, "': is a file; expected a folder holding train.rec and train.idx, or one "
                      "sub-folder per identity");
  }
  if (fs::exists(rec, ec)) {
    if (!fs::exists(idx, ec)) {
      throw usage_error(idx.string(), ": missing index for ", rec.string(),
                        " (rebuild it with: faceshard-pack index ", rec.string(), ")");
    }
    return std::make_shared<RecordIODataset>(rec.string(), idx.string(), index_options);
  }
  for (const auto& e : fs::directory_iterator(root, ec)) {
    if (e.path().extension() == ".rec")
      throw usage_error("data.rec '", abs, "': holds ", e.path().filename().string(),
                        " but no train.rec; faceshard reads DIR/train.rec and DIR/train.idx (rename them, or pack with "
                        "faceshard-pack pack IMAGES DIR/train)");
  }
  return std::make_shared<ImageFolderDataset>(path, folder_options);
}

}  // namespace faceshard
