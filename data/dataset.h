// Training data sets as the loader sees them: a sized, thread-safe source of (class,
// encoded image) samples. RecordIO (insightface .rec/.idx), an image folder (one
// sub-folder per identity) and a synthetic set (fixed pixels, no decoding) for benchmarks.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "data/insightface_rec.h"
#include "data/recordio.h"
#include "base/error.h"

namespace faceshard {

struct RawSample {
  int64_t label = -1;
  std::vector<uint8_t> bytes;  // encoded image, or HWC RGB pixels when raw_pixels()
};

// A record whose label is not a class index. Unlike a sample that cannot be read or
// decoded (the loader replaces and counts those), a wrong label means the data set itself
// is mislabelled, so the loader stops on it. Still a faceshard::Error for every other caller.
class LabelError : public Error {
 public:
  explicit LabelError(const std::string& msg) : Error(ErrorKind::Runtime, msg) {}
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual uint64_t size() const = 0;
  // Number of classes the data set declares (-1 when it does not know without a scan).
  virtual int64_t num_classes() const = 0;
  // Reads sample `index` (0 <= index < size()); safe to call from several threads.
  // Throws LabelError for a label that is not a class index, Error for anything else.
  virtual void read(uint64_t index, RawSample& out) const = 0;
  // Names a sample in messages: "<file> key 17" or the image path.
  virtual std::string describe(uint64_t index) const = 0;
  // True when read() yields raw RGB pixels of raw_size() x raw_size() (no decoding).
  virtual bool raw_pixels() const { return false; }
  virtual int raw_size() const { return 0; }
};

// insightface .rec/.idx. Image keys follow MXFaceDataset (header record 0 when present).
class RecordIODataset : public Dataset {
 public:
  // label_bits: see InsightFaceLayout (24, float32's, except to simulate large files).
  RecordIODataset(const std::string& rec_path, const std::string& idx_path,
                  const RecordIndexOptions& index_options = default_record_index_options(),
                  int label_bits = kLabelBits);
  uint64_t size() const override { return layout_.num_images(); }
  int64_t num_classes() const override;
  void read(uint64_t index, RawSample& out) const override;
  std::string describe(uint64_t index) const override;
  uint64_t key(uint64_t index) const {
    if (index >= size()) throw runtime_error(rec_.file().path(), ": image ", index, " is past the ", size(), " images");
    return layout_.image_key(rec_, index);
  }
  const InsightFaceLayout& layout() const { return layout_; }
  const IndexedRecordIO& records() const { return rec_; }

 private:
  IndexedRecordIO rec_;
  InsightFaceLayout layout_;
};

// How an image folder is opened: what faceshard-pack checks before it packs, checked
// before training.
struct ImageFolderOptions {
  // Every file read and its header and end checked (check_source_images) at start.
  bool check_images = false;
  int image_size = 112;
  int threads = 1;
  // false: any problem (a bad file, an empty identity folder, one that holds folders)
  // refuses to open the folder, every problem listed (the first kMaxListedProblems);
  // true: bad files and folders are left out, and a line says how many.
  bool skip_bad = false;
  // Log the problems (one process of a job does; the others only throw).
  bool report = true;
};
constexpr size_t kMaxListedProblems = 20;

// root/<identity>/<image>: identities in sorted name order are classes 0..C-1; files
// with an image extension (.jpg .jpeg .png .bmp), sorted by name. The folder is listed as
// faceshard-pack lists it (list_pack_source), so both number the classes alike and name
// the same problems.
class ImageFolderDataset : public Dataset {
 public:
  explicit ImageFolderDataset(const std::string& root, const ImageFolderOptions& options = {});
  uint64_t size() const override { return files_.size(); }
  int64_t num_classes() const override { return int64_t(class_names_.size()); }
  void read(uint64_t index, RawSample& out) const override;
  std::string describe(uint64_t index) const override { return files_.at(index); }
  const std::string& path(uint64_t index) const { return files_.at(index); }
  int64_t label(uint64_t index) const { return labels_.at(index); }
  const std::vector<std::string>& class_names() const { return class_names_; }

 private:
  std::vector<std::string> files_;
  std::vector<int64_t> labels_;
  std::vector<std::string> class_names_;
};

// Random pixels generated once and handed out for every index (label = index % classes),
// so a benchmark measures the pipeline without disk or JPEG decoding, like arcface_torch's
// SyntheticDataset.
class SyntheticDataset : public Dataset {
 public:
  SyntheticDataset(uint64_t size, int64_t num_classes, int image_size = 112, uint64_t seed = 0);
  uint64_t size() const override { return size_; }
  int64_t num_classes() const override { return num_classes_; }
  void read(uint64_t index, RawSample& out) const override;
  std::string describe(uint64_t index) const override;
  bool raw_pixels() const override { return true; }
  int raw_size() const override { return image_size_; }

 private:
  uint64_t size_;
  int64_t num_classes_;
  int image_size_;
  std::vector<uint8_t> pixels_;
};

// arcface_torch's selection: "synthetic" -> SyntheticDataset(synthetic_size, classes);
// a folder with train.rec -> RecordIODataset (a missing train.idx is an error);
// any other folder -> ImageFolderDataset.
std::shared_ptr<Dataset> open_dataset(const std::string& path, int64_t synthetic_classes = 1000,
                                      uint64_t synthetic_size = 1000000,
                                      const RecordIndexOptions& index_options = default_record_index_options(),
                                      const ImageFolderOptions& folder_options = {});

}  // namespace faceshard
