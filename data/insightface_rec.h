// insightface's layout of a training .rec: record 0 is a header whose labels give the
// image-key range [1, label[0]) and the identity-record range [label[0], label[1]); each
// identity record's labels give that identity's image-key range. Plain C++ (ASan target).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "data/recordio.h"

namespace faceshard {

struct InsightFaceLayout {
  bool has_header = false;            // record 0 is a header (flag > 0), as MXFaceDataset tests
  std::vector<uint64_t> image_keys;   // the records that hold images, in key order
  uint64_t identity_begin = 0;        // identity records' keys [begin, end); empty when none
  uint64_t identity_end = 0;
  uint64_t num_identities() const { return identity_end - identity_begin; }
};

// Reads record 0 the way insightface's MXFaceDataset does: with a header, the image keys
// are [1, label[0]); otherwise (no key 0, or flag 0 as in a shuffled rec) every key of the
// index. Throws faceshard::Error when the header's ranges are not whole numbers, are
// inverted, or name image keys that the index lacks.
InsightFaceLayout read_insightface_layout(const IndexedRecordIO& rec);

// Reads identity record `key` and returns its image-key range [first, end).
std::pair<uint64_t, uint64_t> read_identity_range(const IndexedRecordIO& rec, uint64_t key);

// Writes a .rec/.idx pair in insightface's layout (the one face2rec2 produces): header
// record 0, image records 1..N with scalar class labels (flag 0, like rec_builder.py),
// then one identity record per class. Images must arrive grouped by class with class ids
// non-decreasing (classes without images get an empty range). Files appear under their
// final names only on commit().
class InsightFaceRecWriter {
 public:
  InsightFaceRecWriter(const std::string& rec_path, const std::string& idx_path);
  void add(int64_t class_id, const uint8_t* image, size_t size);
  void add(int64_t class_id, const std::vector<uint8_t>& image) { add(class_id, image.data(), image.size()); }
  // num_classes: total class count (>= highest class id + 1; -1: highest + 1).
  void commit(int64_t num_classes = -1);
  uint64_t num_images() const { return next_key_ - 1; }

 private:
  RecordIOWriter writer_;
  uint64_t header_offset_ = 0;
  uint64_t next_key_ = 1;
  std::vector<std::pair<uint64_t, uint64_t>> ranges_;  // per class [first key, end key)
};

}  // namespace faceshard
