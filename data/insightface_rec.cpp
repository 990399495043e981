#include "data/insightface_rec.h"

#include <algorithm>
#include <algorithm>
#include <cmath>

#include "data/image_record.h"
#include "base/error.h"

namespace faceshard {

namespace {

// Past 2^48 a label cannot be a key of any file (and the search for its keys would be long).
constexpr uint64_t kMaxLabelKey = uint64_t(1) << 48;

uint64_t label_to_key(float v, const std::string& where, const char* what) {
  if (!std::isfinite(v) || v < 0.f || std::floor(v) != v || double(v) > double(kMaxLabelKey)) {
    throw runtime_error(where, ": ", what, " ", v, " is not a record key (a whole number in [0, 2^48])");
  }
  return uint64_t(v);
}

// The keys that round to v: one key where v is exact, an interval of a few around v past
// 2^bits; only keys in [lo_key, hi_key] can be the answer (the window is clamped to them,
// so a huge label in a small file costs nothing).
struct KeyWindow {
  uint64_t lo, hi;  // inclusive; empty when lo > hi
  bool exact = false;
};
KeyWindow keys_rounding_to(uint64_t v, int bits, uint64_t lo_key, uint64_t hi_key) {
  KeyWindow w{v, v, true};
  if (v >= (uint64_t(1) << bits)) {  // 2^bits + 1 rounds down to 2^bits
    int top = 63;
    while (!(v >> top)) --top;
    const uint64_t ulp = uint64_t(1) << (top + 1 - bits);
    // Just below a power of two the spacing is half as wide.
    w.lo = v - ((v & (v - 1)) == 0 ? ulp / 4 : ulp / 2);
    w.hi = v + ulp / 2;
    while (w.lo <= w.hi && round_key_to_bits(w.lo, bits) != v) ++w.lo;
    while (w.hi >= w.lo && round_key_to_bits(w.hi, bits) != v) --w.hi;
    w.exact = false;
  }
  if (!w.exact) {
    w.lo = std::max(w.lo, lo_key);
    w.hi = std::min(w.hi, hi_key);
  }
  return w;
}

// What a record is, as far as the layout is concerned: image records carry an encoded
// image; identity records carry two labels and no image.
struct Probe {
  bool image = false, identity = false;
  int64_t klass = 0;
};
Probe probe(const IndexedRecordIO& rec, uint64_t key) {
  Probe p;
  if (!rec.contains(key)) return p;
  std::vector<uint8_t> buf;
  rec.read(key, buf);
  const std::string where = detail::concat(rec.file().path(), ": key ", key);
  const ImageRecordView v = unpack_image_record(buf, where);
  p.image = v.image_size > 0;
  p.identity = v.header.flag >= 2 && v.image_size == 0;
  if (p.image) p.klass = label_to_class(v.class_label(), where);
  return p;
}

// The first key of the window for which `is_boundary` holds; throws `fail()` when none does.
template <typename Pred, typename Fail>
uint64_t find_boundary(const KeyWindow& w, Pred is_boundary, Fail fail) {
  for (uint64_t k = w.lo; k <= w.hi; ++k)
    if (is_boundary(k)) return k;
  throw fail();
}

std::string window_text(const KeyWindow& w, uint64_t v, int bits) {
  if (w.lo > w.hi) return detail::concat("no key of the file rounds to ", v, " at ", bits, "-bit precision, so none");
  return detail::concat("none of the keys [", w.lo, ", ", w.hi, "] that round to ", v, " at ", bits,
                        "-bit precision");
}

}  // namespace

uint64_t round_key_to_bits(uint64_t k, int bits) {
  if (bits >= 64 || k <= (uint64_t(1) << bits)) return k;
  int top = 63;
  while (!(k >> top)) --top;
  const int drop = top + 1 - bits;
  uint64_t q = k >> drop;
  const uint64_t r = k & ((uint64_t(1) << drop) - 1), half = uint64_t(1) << (drop - 1);
  if (r > half || (r == half && (q & 1))) ++q;
  return q << drop;
}

InsightFaceLayout read_insightface_layout(const IndexedRecordIO& rec, int label_bits) {
  InsightFaceLayout layout;
  layout.label_bits = label_bits;
  std::vector<uint8_t> buf;
  if (rec.contains(0)) {
    rec.read(0, buf);
    const std::string where = detail::concat(rec.file().path(), ": key 0 (header record)");
    const ImageRecordView v = unpack_image_record(buf, where);
    if (v.header.flag > 0) {
      layout.has_header = true;
      const uint64_t v0 = label_to_key(v.labels[0], where, "image-key end label[0]");
      if (v0 < 1) throw runtime_error(where, ": image-key end label[0] = 0 (must be >= 1)");
      const RecordIndex& index = rec.index();
      const uint64_t last_key = index.size() ? index.max_key() : 0;
      const KeyWindow w0 = keys_rounding_to(v0, label_bits, 2, last_key + 1);
      const uint64_t end = w0.exact ? v0 : find_boundary(
          w0, [&](uint64_t k) { return k >= 2 && probe(rec, k - 1).image && !probe(rec, k).image; },
          [&] {
            return runtime_error(where, ": image-key end label[0] ", v0, " is not where the image records end: ",
                                 window_text(w0, v0, label_bits), " follows the last image record");
          });
      // Every image key must be in the index (contiguous keys: a range test, not 40M lookups).
      uint64_t missing = RecordIndex::kNone;
      if (index.keys_contiguous()) {
        if (index.min_key() > 1) missing = 1;
        else if (index.min_key() + index.size() < end) missing = index.min_key() + index.size();
      } else {
        for (uint64_t k = 1; k < end && missing == RecordIndex::kNone; ++k)
          if (!rec.contains(k)) missing = k;
      }
      if (missing != RecordIndex::kNone) {
        throw runtime_error(where, ": header says image keys are [1, ", end, ") but key ", missing, " is not in ",
                            rec.idx_path());
      }
      layout.image_begin = 1;
      layout.image_end = end;
      layout.identity_begin = layout.identity_end = end;
      if (v.labels.size() >= 2) {
        const uint64_t v1 = label_to_key(v.labels[1], where, "identity-key end label[1]");
        const KeyWindow w1 = keys_rounding_to(v1, label_bits, end, last_key + 1);
        const uint64_t id_end = w1.exact ? v1 : find_boundary(
            w1,
            [&](uint64_t k) { return k >= end && (k == end || probe(rec, k - 1).identity) && !probe(rec, k).identity; },
            [&] {
              return runtime_error(where, ": identity-key end label[1] ", v1,
                                   " is not where the identity records end: ", window_text(w1, v1, label_bits),
                                   " follows the last identity record after key ", end);
            });
        if (id_end < end) {
          throw runtime_error(where, ": identity-key range [", end, ", ", id_end, ") is inverted");
        }
        layout.identity_end = id_end;
      }
      return layout;
    }
  }
  layout.image_begin = 0;
  layout.image_end = rec.num_entries();
  return layout;
}

std::pair<uint64_t, uint64_t> read_identity_range(const IndexedRecordIO& rec, const InsightFaceLayout& layout,
                                                  uint64_t key) {
  std::vector<uint8_t> buf;
  rec.read(key, buf);
  const std::string where = detail::concat(rec.file().path(), ": key ", key, " (identity record)");
  const ImageRecordView v = unpack_image_record(buf, where);
  if (v.labels.size() < 2) throw runtime_error(where, ": expected 2 labels [first, end), got ", v.labels.size());
  uint64_t bounds[2] = {label_to_key(v.labels[0], where, "label[0]"), label_to_key(v.labels[1], where, "label[1]")};
  // A rounded bound is the key where the images of this identity's class begin (end):
  // the class of the image records changes there from below to at least (above) it.
  const bool ranged = layout.has_header && key >= layout.identity_begin && key < layout.identity_end;
  const int64_t c = ranged ? int64_t(key - layout.identity_begin) : -1;
  auto class_at = [&](uint64_t k) -> int64_t {
    if (k < layout.image_begin) return INT64_MIN;
    if (k >= layout.image_end) return INT64_MAX;
    return probe(rec, k).klass;
  };
  for (int i = 0; i < 2; ++i) {
    const KeyWindow w = keys_rounding_to(bounds[i], layout.label_bits, layout.image_begin, layout.image_end);
    if (w.exact) continue;
    if (!ranged) {
      throw runtime_error(where, ": label[", i, "] ", bounds[i], " is rounded and the record is not an identity record ",
                          "of the header's range");
    }
    bounds[i] = find_boundary(
        w,
        [&](uint64_t k) {
          const int64_t before = class_at(k - 1), at = class_at(k);
          return i == 0 ? (before < c && at >= c) : (before <= c && at > c);
        },
        [&] {
          return runtime_error(where, ": label[", i, "] ", bounds[i], " is not where the images of class ", c,
                               i == 0 ? " begin: " : " end: ", window_text(w, bounds[i], layout.label_bits),
                               " is such a boundary");
        });
  }
  if (bounds[1] < bounds[0]) throw runtime_error(where, ": image range [", bounds[0], ", ", bounds[1], ") is inverted");
  return {bounds[0], bounds[1]};
}

InsightFaceRecWriter::InsightFaceRecWriter(const std::string& rec_path, const std::string& idx_path, int label_bits)
    : writer_(rec_path, idx_path), label_bits_(label_bits) {
  // Placeholder with the final record's size (two float labels, no image).
  const std::vector<uint8_t> header = pack_image_record(0.f, {0.f, 0.f}, 0, 0, nullptr, 0);
  header_offset_ = writer_.write(0, header);
}

void InsightFaceRecWriter::add(int64_t class_id, const uint8_t* image, size_t size) {
  if (class_id < 0) throw usage_error("insightface rec: negative class id ", class_id);
  // Class labels are float32 too, and must stay exact.
  if (class_id >= (int64_t(1) << kLabelBits)) throw usage_error("insightface rec: class id ", class_id, " >= 2^24");
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
  auto label = [&](uint64_t key) { return float(round_key_to_bits(key, label_bits_)); };
  uint64_t key = id_begin;
  for (const auto& r : ranges_) {
    writer_.write(key++, pack_image_record(0.f, {label(r.first), label(r.second)}, 0, 0, nullptr, 0));
  }
  writer_.overwrite(header_offset_, pack_image_record(0.f, {label(id_begin), label(id_end)}, 0, 0, nullptr, 0));
  writer_.commit();
}

}  // namespace faceshard
