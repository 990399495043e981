#include "data/insightface_rec.h"

#include <algorithm>
#include <cmath>

#include "data/image_record.h"
#include "partial_fc/runtime/error.h"

namespace faceshard {

namespace {

// float32 holds every whole number up to 2^24 exactly; keys beyond cannot be stored in
// insightface's float labels.
constexpr uint64_t kMaxExactFloat = uint64_t(1) << 24;

uint64_t label_to_key(float v, const std::string& where, const char* what) {
  if (!std::isfinite(v) || v < 0.f || std::floor(v) != v || v > float(kMaxExactFloat)) {
    throw runtime_error(where, ": ", what, " ", v, " is not a record key (a whole number in [0, 2^24])");
  }
  return uint64_t(v);
}

}  // namespace

InsightFaceLayout read_insightface_layout(const IndexedRecordIO& rec) {
  InsightFaceLayout layout;
  std::vector<uint8_t> buf;
  if (rec.contains(0)) {
    rec.read(0, buf);
    const std::string where = detail::concat(rec.file().path(), ": key 0 (header record)");
    const ImageRecordView v = unpack_image_record(buf, where);
    if (v.header.flag > 0) {
      layout.has_header = true;
      const uint64_t end = label_to_key(v.labels[0], where, "image-key end label[0]");
      if (end < 1) throw runtime_error(where, ": image-key end label[0] = 0 (must be >= 1)");
      // A header may claim up to 2^24 keys in a file of a few bytes: reserve no more than
      // the index holds (the loop below stops at the first key the index lacks, which with
      // unique keys comes within entries() + 1 steps).
      layout.image_keys.reserve(std::min<uint64_t>(end - 1, rec.entries().size()));
      for (uint64_t k = 1; k < end; ++k) {
        if (!rec.contains(k)) {
          throw runtime_error(where, ": header says image keys are [1, ", end, ") but key ", k, " is not in ",
                              rec.idx_path());
        }
        layout.image_keys.push_back(k);
      }
      if (v.labels.size() >= 2) {
        const uint64_t id_end = label_to_key(v.labels[1], where, "identity-key end label[1]");
        if (id_end < end) {
          throw runtime_error(where, ": identity-key range [", end, ", ", id_end, ") is inverted");
        }
        layout.identity_begin = end;
        layout.identity_end = id_end;
      }
      return layout;
    }
  }
  layout.image_keys.reserve(rec.entries().size());
  for (const auto& e : rec.entries()) layout.image_keys.push_back(e.key);
  return layout;
}

std::pair<uint64_t, uint64_t> read_identity_range(const IndexedRecordIO& rec, uint64_t key) {
  std::vector<uint8_t> buf;
  rec.read(key, buf);
  const std::string where = detail::concat(rec.file().path(), ": key ", key, " (identity record)");
  const ImageRecordView v = unpack_image_record(buf, where);
  if (v.labels.size() < 2) throw runtime_error(where, ": expected 2 labels [first, end), got ", v.labels.size());
  const uint64_t a = label_to_key(v.labels[0], where, "label[0]");
  const uint64_t b = label_to_key(v.labels[1], where, "label[1]");
  if (b < a) throw runtime_error(where, ": image range [", a, ", ", b, ") is inverted");
  return {a, b};
}

InsightFaceRecWriter::InsightFaceRecWriter(const std::string& rec_path, const std::string& idx_path)
    : writer_(rec_path, idx_path) {
  // Placeholder with the final record's size (two float labels, no image).
  const std::vector<uint8_t> header = pack_image_record(0.f, {0.f, 0.f}, 0, 0, nullptr, 0);
  header_offset_ = writer_.write(0, header);
}

void InsightFaceRecWriter::add(int64_t class_id, const uint8_t* image, size_t size) {
  if (class_id < 0) throw usage_error("insightface rec: negative class id ", class_id);
  if (!ranges_.empty() && uint64_t(class_id) + 1 < ranges_.size()) {
    throw usage_error("insightface rec: images must be grouped by class in increasing order (class ", class_id,
                      " after class ", ranges_.size() - 1, ")");
  }
  while (ranges_.size() <= uint64_t(class_id)) ranges_.push_back({next_key_, next_key_});
  const uint64_t key = next_key_++;
  writer_.write(key, pack_image_record(float(class_id), {}, key, 0, image, size));
  ranges_.back().second = next_key_;
}

void InsightFaceRecWriter::commit(int64_t num_classes) {
  if (num_classes >= 0) {
    if (uint64_t(num_classes) < ranges_.size()) {
      throw usage_error("insightface rec: num_classes ", num_classes, " < highest class id + 1 = ", ranges_.size());
    }
    while (ranges_.size() < uint64_t(num_classes)) ranges_.push_back({next_key_, next_key_});
  }
  const uint64_t id_begin = next_key_;
  const uint64_t id_end = id_begin + ranges_.size();
  if (id_end > kMaxExactFloat) {
    throw usage_error("insightface rec: ", id_end, " records exceed what the float labels of the header can address");
  }
  uint64_t key = id_begin;
  for (const auto& r : ranges_) {
    writer_.write(key++, pack_image_record(0.f, {float(r.first), float(r.second)}, 0, 0, nullptr, 0));
  }
  writer_.overwrite(header_offset_, pack_image_record(0.f, {float(id_begin), float(id_end)}, 0, 0, nullptr, 0));
  writer_.commit();
}

}  // namespace faceshard
