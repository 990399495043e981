// What faceshard-pack packs: the images of a folder with one sub-folder per identity, or of
// an image list (.lst) as insightface's and MXNet's tools write them, with every problem
// found in one pass (empty identity folders, list lines that do not parse, files that are
// no image of the expected size) instead of one at a time.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace faceshard {

struct PackItem {
  std::string path;
  int64_t label = 0;  // into PackSource::identities
};

struct PackProblem {
  std::string path;  // the file, folder or "list:line"
  std::string what;
};

struct PackSource {
  std::vector<PackItem> items;            // in label order, then file name order
  std::vector<std::string> identities;    // label -> the identity's folder name
  std::vector<PackProblem> problems;      // found while listing (empty folders, bad list lines)
  uint64_t ignored_files = 0;             // files without an image extension (.jpg .jpeg .png .bmp; folders aside)
};

// A folder: identities are its sub-folders in name order (an empty one is a problem and no
// class; one that holds folders is a problem naming them, their images are not read). A .lst file: lines "index<TAB>label<TAB>path" (MXNet's im2rec) or
// "aligned<TAB>path<TAB>label[<TAB>...]" (insightface's face2rec2); paths relative to the
// list's folder; labels are whole numbers >= 0, renumbered 0..C-1 in increasing order, the
// identity's name the folder of its first image. Usage error when the source is missing.
PackSource list_pack_source(const std::string& source);

// The check pack makes of every file by default, cheap (no pixel decoded): a JPEG, PNG or
// BMP whose header declares size x size, and whose data is not cut short (a JPEG's end
// marker, a PNG's IEND chunk, a BMP's pixel rows). "" when fine, else what is wrong.
std::string check_image_bytes(const std::vector<uint8_t>& bytes, int size);

// Drops the items whose index is in `bad` (sorted) and renumbers the labels so that an
// identity left without images is no class; returns the names of those identities.
std::vector<std::string> drop_items(PackSource& source, const std::vector<uint64_t>& bad);

}  // namespace faceshard
