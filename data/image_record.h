// The payload of one image record in an MXNet/insightface .rec: the 24-byte IRHeader
// (struct 'IfQQ': flag, label, id, id2), `flag` extra float32 labels when flag > 0, then
// the encoded image. Plain C++ (parses untrusted bytes; also in the ASan target).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace faceshard {

struct ImageHeader {
  uint32_t flag = 0;   // number of float labels that follow the header (0: scalar label)
  float label = 0.f;   // the scalar label when flag == 0
  uint64_t id = 0;
  uint64_t id2 = 0;
};
constexpr size_t kImageHeaderSize = 24;

// A parsed record; `image` points into the buffer passed to unpack_image_record.
struct ImageRecordView {
  ImageHeader header;
  std::vector<float> labels;  // the `flag` extra labels
  const uint8_t* image = nullptr;
  size_t image_size = 0;

  // What insightface's MXFaceDataset uses as the class: labels[0] if present, else label.
  float class_label() const { return labels.empty() ? header.label : labels[0]; }
};

// mxnet.recordio.pack: labels empty -> flag 0 and `label` stored in the header;
// otherwise flag = labels.size(), header label 0, labels prepended to the image.
std::vector<uint8_t> pack_image_record(float label, const std::vector<float>& labels, uint64_t id, uint64_t id2,
                                       const uint8_t* image, size_t image_size);

// mxnet.recordio.unpack. Throws faceshard::Error (prefixed with `where`) when the record
// is shorter than the header or than the labels its flag announces.
ImageRecordView unpack_image_record(const std::vector<uint8_t>& record, const std::string& where);

// Converts a float label to a class index; throws unless it is a finite whole number in
// [0, 2^31).
int64_t label_to_class(float label, const std::string& where);

}  // namespace faceshard
