// insightface's layout of a training .rec: record 0 is a header whose labels give the
// image-key range [1, label[0]) and the identity-record range [label[0], label[1]); each
// identity record's labels give that identity's image-key range. Plain C++ (ASan target).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "data/recordio.h"

namespace faceshard {

// insightface stores record keys in float32 labels: exact up to 2^24 (kLabelBits bits of
// significand), rounded to the nearest representable value beyond (Glint360K has 17.1M
// images, WebFace42M 42.5M). A rounded label stands for every key that rounds to it; the
// true key is found among those from the records themselves. `label_bits` is a parameter
// so that small files can simulate the rounding of large ones in tests.
constexpr int kLabelBits = 24;
// k rounded to `bits` significant bits, nearest, ties to even (what float32 does for bits=24).
uint64_t round_key_to_bits(uint64_t k, int bits);

struct InsightFaceLayout {
  bool has_header = false;            // record 0 is a header (flag > 0), as MXFaceDataset tests
  // With a header the image keys are [image_begin, image_end); without one, the keys of
  // the index in file order (image_end - image_begin of them).
  uint64_t image_begin = 0, image_end = 0;
  uint64_t identity_begin = 0;        // identity records' keys [begin, end); empty when none
  uint64_t identity_end = 0;
  int label_bits = kLabelBits;
  uint64_t num_images() const { return image_end - image_begin; }
  uint64_t num_identities() const { return identity_end - identity_begin; }
  // The key of image i (0 <= i < num_images()).
  uint64_t image_key(const IndexedRecordIO& rec, uint64_t i) const {
    return has_header ? image_begin + i : rec.entry(i).key;
  }
};

// Reads record 0 the way insightface's MXFaceDataset does: with a header, the image keys
// are [1, label[0]); otherwise (no key 0, or flag 0 as in a shuffled rec) every key of the
// index. Where label[0] or label[1] is past 2^label_bits, the true boundary is the one key
// among those that round to it where image records end (identity records end). Throws
// faceshard::Error naming the key and values when the header's ranges are not whole
// numbers, are inverted, name image keys the index lacks, or are off by more than rounding.
InsightFaceLayout read_insightface_layout(const IndexedRecordIO& rec, int label_bits = kLabelBits);

// Reads identity record `key` and returns its image-key range [first, end); bounds past
// 2^label_bits are resolved from the class labels of the image records around them.
std::pair<uint64_t, uint64_t> read_identity_range(const IndexedRecordIO& rec, const InsightFaceLayout& layout,
                                                  uint64_t key);

// Writes a .rec/.idx pair in insightface's layout (the one face2rec2 produces): header
// record 0, image records 1..N with scalar class labels (flag 0, like rec_builder.py),
// then one identity record per class. Images must arrive grouped by class with class ids
// non-decreasing (classes without images get an empty range). Key labels are rounded to
// float32 as insightface's tools store them. Files appear under their final names only on
// commit().
class InsightFaceRecWriter {
 public:
  // label_bits: the precision the header and identity labels are rounded to (float32's 24
  // as insightface's tools write them; fewer only to simulate large files in tests).
  InsightFaceRecWriter(const std::string& rec_path, const std::string& idx_path, int label_bits = kLabelBits);
  void add(int64_t class_id, const uint8_t* image, size_t size);
  void add(int64_t class_id, const std::vector<uint8_t>& image) { add(class_id, image.data(), image.size()); }
  // num_classes: total class count (>= highest class id + 1; -1: highest + 1).
  void commit(int64_t num_classes = -1);
  uint64_t num_images() const { return next_key_ - 1; }

 private:
  RecordIOWriter writer_;
  int label_bits_;
  uint64_t header_offset_ = 0;
  uint64_t next_key_ = 1;
  std::vector<std::pair<uint64_t, uint64_t>> ranges_;  // per class [first key, end key)
};

}  // namespace faceshard
