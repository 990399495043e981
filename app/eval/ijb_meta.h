// The IJB-B / IJB-C meta files as insightface distributes them (<t>_name_5pts_score.txt,
// <t>_face_tid_mid.txt, <t>_template_pair_label.txt). Plain C++ (no LibTorch, no OpenCV):
// it parses untrusted files, so it is also built into the AddressSanitizer tests and a
// fuzz target.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace faceshard {

struct IjbMeta {
  std::string target;                           // "IJBC" or "IJBB"
  std::vector<std::string> images;              // file names under <root>/loose_crop
  std::vector<size_t> image_lines;              // line of each image in <t>_name_5pts_score.txt
  std::vector<std::array<float, 10>> landmarks; // x1 y1 ... x5 y5 per image
  std::vector<double> faceness;                 // detector score per image
  std::vector<int64_t> templates, medias;       // per image
  std::vector<int64_t> pair_t1, pair_t2;        // template pairs
  std::vector<int> pair_label;                  // 1 genuine, 0 impostor
};

// One meta file's text and the name its errors give (the path).
struct IjbMetaText {
  std::string name;
  std::string text;
};

// Parses the three files' text. The first two list the same images in the same order;
// every template of a pair must have images; image names are relative paths without a
// '..' component (they stay inside loose_crop/); landmarks are finite and faceness scores
// finite and > 0. Usage errors name file, line (as an editor
// counts it, blank lines included) and what is wrong. Lines are read one at a time, so
// memory is the text plus what IjbMeta keeps per line (about 120 bytes per image, 24 per
// pair), whatever the lines hold.
IjbMeta parse_ijb_meta(const std::string& target, const IjbMetaText& landmarks, const IjbMetaText& templates,
                       const IjbMetaText& pairs);

// Reads <root>/meta/<t>_name_5pts_score.txt, <t>_face_tid_mid.txt and
// <t>_template_pair_label.txt (t = ijbc | ijbb) and parses them.
IjbMeta read_ijb_meta(const std::string& root, const std::string& target);

}  // namespace faceshard
