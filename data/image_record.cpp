#include "data/image_record.h"

#include <cmath>
#include <cstring>

#include "base/error.h"

namespace faceshard {

namespace {
template <typename T>
void put(std::vector<uint8_t>& out, T v) {
  uint8_t b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // x86 and ARM Linux are little-endian, as MXNet writes
  out.insert(out.end(), b, b + sizeof(T));
}
template <typename T>
T get(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}
}  // namespace

std::vector<uint8_t> pack_image_record(float label, const std::vector<float>& labels, uint64_t id, uint64_t id2,
                                       const uint8_t* image, size_t image_size) {
  std::vector<uint8_t> out;
  out.reserve(kImageHeaderSize + labels.size() * 4 + image_size);
  put<uint32_t>(out, uint32_t(labels.size()));
  put<float>(out, labels.empty() ? label : 0.f);
  put<uint64_t>(out, id);
  put<uint64_t>(out, id2);
  for (float l : labels) put<float>(out, l);
  if (image_size > 0) out.insert(out.end(), image, image + image_size);
  return out;
}

ImageRecordView unpack_image_record(const std::vector<uint8_t>& record, const std::string& where) {
  if (record.size() < kImageHeaderSize) {
    throw runtime_error(where, ": record of ", record.size(), " bytes is shorter than the 24-byte image header");
  }
  ImageRecordView v;
  const uint8_t* p = record.data();
  v.header.flag = get<uint32_t>(p);
  v.header.label = get<float>(p + 4);
  v.header.id = get<uint64_t>(p + 8);
  v.header.id2 = get<uint64_t>(p + 16);
  const uint64_t label_bytes = uint64_t(v.header.flag) * 4;
  if (label_bytes > record.size() - kImageHeaderSize) {
    throw runtime_error(where, ": image header announces ", v.header.flag, " labels (", label_bytes,
                        " bytes) but only ", record.size() - kImageHeaderSize, " bytes follow");
  }
  v.labels.resize(v.header.flag);
  for (uint32_t i = 0; i < v.header.flag; ++i) v.labels[i] = get<float>(p + kImageHeaderSize + 4 * i);
  v.image = p + kImageHeaderSize + label_bytes;
  v.image_size = record.size() - kImageHeaderSize - size_t(label_bytes);
  return v;
}

int64_t label_to_class(float label, const std::string& where) {
  if (!std::isfinite(label) || label < 0.f || label >= 2147483648.f || std::floor(label) != label) {
    throw runtime_error(where, ": label ", label, " is not a class index (a whole number >= 0)");
  }
  return int64_t(label);
}

}  // namespace faceshard
