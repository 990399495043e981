#include "data/index_check.h"

#include <vector>

#include "base/error.h"

namespace faceshard {

void check_record_id(const ImageRecordView& record, uint64_t key, const std::string& where) {
  if (record.header.id != 0 && record.header.id != key) {
    throw runtime_error(where, ": the record's header id is ", record.header.id, ", not its key ", key,
                        " (the .idx points this key at another record)");
  }
}

void check_index_sample(const IndexedRecordIO& rec, const InsightFaceLayout& layout, uint64_t max_samples) {
  const uint64_t n = layout.num_images();
  if (n == 0 || max_samples == 0) return;
  const uint64_t samples = max_samples >= n ? n : max_samples;
  std::vector<uint8_t> buf;
  for (uint64_t j = 0; j < samples; ++j) {
    // Image j * (n - 1) / (samples - 1): 0 and n - 1 included, evenly spaced between.
    const uint64_t i = samples == 1 ? 0 : uint64_t((unsigned __int128)j * (n - 1) / (samples - 1));
    const uint64_t key = layout.image_key(rec, i);
    rec.read(key, buf);
    const std::string where = detail::concat(rec.file().path(), ": key ", key, " at offset ", rec.offset_of(key));
    check_record_id(unpack_image_record(buf, where), key, where);
  }
}

}  // namespace faceshard
