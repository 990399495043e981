// Which data set something was computed on. faceshard-clean's reports name images and
// classes by number, and those numbers mean the same images only in the set they came from:
// the same folders re-packed in another order, or with one identity folder added, give the
// numbers to other images. So a report (and a run, for the data it trained on) carries the
// set's identity, and the tools that apply one compare it first.
//
// The identity: the number of images and of classes and a SHA-256 over the set's index, in
// image order: for an insightface .rec each image's record key and byte offset and, where
// the set has identity records, each class's key range (its labels); for an image folder
// each image's path under the folder and its class (its folder). Cheap to compute (no image
// is read): the .idx is already in memory, plus one small read per class.
#pragma once
#include <cstdint>
#include <optional>
#include <string>

#include "data/dataset.h"

namespace faceshard {

struct SetIdentity {
  std::string kind = "other";  // "rec" (insightface .rec), "folder" (an image folder) or "other"
  uint64_t images = 0;
  int64_t classes = -1;
  std::string digest;  // hex SHA-256; empty for a set without an index (synthetic)

  // "sha256:<64 hex> (KIND: N images, C classes)": the form reports and runs store.
  std::string text() const;
  // "KIND, N images, C classes, sha256 <first 12 hex>": the form messages print.
  std::string brief() const;
  bool same_as(const SetIdentity& o) const {
    return kind == o.kind && images == o.images && classes == o.classes && digest == o.digest;
  }
};

// The identity of `ds` (a RecordIODataset or ImageFolderDataset; any other set: its counts).
SetIdentity set_identity(const Dataset& ds);

// Parses text() (surrounding blanks allowed); nothing for anything else.
std::optional<SetIdentity> parse_set_identity(const std::string& text);

}  // namespace faceshard
