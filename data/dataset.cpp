#include "data/dataset.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <random>

#include "data/image_record.h"
#include "data/index_check.h"
#include "partial_fc/runtime/error.h"

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
bool is_image(const fs::path& p) {
  std::string ext = p.extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  return ext == ".jpg" || ext == ".jpeg" || ext == ".png" || ext == ".bmp";
}
}  // namespace

ImageFolderDataset::ImageFolderDataset(const std::string& root) {
  std::error_code ec;
  if (!fs::is_directory(root, ec)) throw usage_error(root, ": not a directory (expected one sub-folder per identity)");
  std::vector<fs::path> dirs;
  for (const auto& e : fs::directory_iterator(root)) {
    if (e.is_directory()) dirs.push_back(e.path());
  }
  std::sort(dirs.begin(), dirs.end());
  for (const auto& d : dirs) {
    std::vector<fs::path> imgs;
    for (const auto& e : fs::directory_iterator(d)) {
      if (e.is_regular_file() && is_image(e.path())) imgs.push_back(e.path());
    }
    std::sort(imgs.begin(), imgs.end());
    if (imgs.empty()) continue;  // like torchvision's ImageFolder, empty folders are no class
    const int64_t label = int64_t(class_names_.size());
    class_names_.push_back(d.filename().string());
    for (const auto& f : imgs) {
      files_.push_back(f.string());
      labels_.push_back(label);
    }
  }
  if (files_.empty()) throw usage_error(root, ": no images found in its sub-folders");
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
                                      const RecordIndexOptions& index_options) {
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
  return std::make_shared<ImageFolderDataset>(path);
}

}  // namespace faceshard
