// Cross-checks of a .idx against the records it points at, beyond what parsing the .idx
// can see (offsets inside the file, distinct offsets and keys: record_index.h). insightface's
// writers (im2rec, face2rec2, rec_builder) store each image record's key in its header's id
// field; faceshard's writer does too. An index whose keys point at the wrong records (keys
// swapped, every key at one record) therefore shows as a record whose id is another key.
// Plain C++ (ASan target).
#pragma once
#include <cstdint>
#include <string>

#include "data/image_record.h"
#include "data/insightface_rec.h"
#include "data/recordio.h"

namespace faceshard {

// Throws faceshard::Error (prefixed with `where`) when the record read at `key` carries a
// non-zero id that is not `key` (writers that leave the id at 0 are not checked).
void check_record_id(const ImageRecordView& record, uint64_t key, const std::string& where);

// Reads up to `max_samples` image records spread evenly over the layout's image keys (the
// first and the last included; every image when max_samples >= their number) and checks
// each one's id against its key. What training runs at start: O(max_samples) reads.
void check_index_sample(const IndexedRecordIO& rec, const InsightFaceLayout& layout, uint64_t max_samples);

}  // namespace faceshard
