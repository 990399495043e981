// Each class's dominant sub-centre as faceshard-clean found it (dropped_subcenters.tsv of a
// report folder: the non-dominant sub-centres of each class, each row naming its class's
// dominant one and how many of the class's images are nearest it). Sub-center ArcFace keeps
// the dominant sub-centre of each class and drops the others: what a run with one centre per
// class that starts from a K > 1 run's centres reads (loss.init_centres).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace faceshard {

struct DominantSubcenters {
  std::string file;                 // the dropped_subcenters.tsv read
  int64_t step = -1;                // the step of the checkpoint audited (its "# run:" line)
  std::vector<int64_t> dominant;    // by class: the dominant sub-centre, -1 for a class without images
  std::vector<int64_t> images;      // by class: its images nearest the dominant sub-centre
  int64_t classes_without_images = 0;
};

// Reads `folder`/dropped_subcenters.tsv, which must have been made of a checkpoint of
// `classes` classes with `subcenters` (> 1) sub-centres each (its "# images: ..., classes:
// C, sub-centres per class: K" line). Usage errors name the file (and line): missing, made
// for other counts, a class or sub-centre out of range, a class whose rows name two dominant
// sub-centres or name the dominant one as dropped.
DominantSubcenters read_dominant_subcenters(const std::string& folder, int64_t classes, int64_t subcenters);

}  // namespace faceshard
