// Rebuilding a clean .rec from faceshard-clean's reports or from a keep-list (faceshard-pack
// clean): the images to drop and the classes to merge become a plan, and the kept images are
// copied, bytes as stored, into a new .rec whose classes are numbered 0..C'-1 again, with a
// table of where each new class came from.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "data/dataset.h"
#include "data/source_paths.h"
#include "data/set_identity.h"

namespace faceshard {

struct CleanPlan {
  std::vector<bool> drop;        // by image index
  std::vector<int64_t> merge_into;  // by source class: the class it joins (itself when none)
  uint64_t dropped_mislabeled = 0, dropped_near_duplicates = 0;
  int64_t overlap_classes = 0, merged_classes = 0;  // merge_into is -1 for a class dropped
  // Rows of mislabeled.tsv kept because the class they are nearest to (within the report's
  // angle: its "relabel C" suggestion) merges with their own: one person filed under two
  // labels, whose images lie near either label's centre; once merged they are correctly filed.
  uint64_t kept_mislabeled_merged = 0;
  // The identities made of more than two classes by duplicate_identities.tsv's pairs (a chain
  // of pairs), each its classes in increasing order: worth a look before training.
  std::vector<std::vector<int64_t>> merge_chains;
};

struct CleanPackOptions {
  bool drop_mislabeled = true;       // every image of mislabeled.tsv
  bool drop_near_duplicates = true;  // image b of every near_duplicates.tsv row
  bool drop_overlap = true;          // every image of each class of overlap.tsv
  bool merge_identities = false;     // the classes of each duplicate_identities.tsv pair become one
};

// The plan of faceshard-clean's report folder for a set of `images` images in `classes`
// classes. Usage errors name the report and line (a missing report, a missing column, an
// image or class out of range).
CleanPlan plan_from_reports(const std::string& folder, uint64_t images, int64_t classes, const CleanPackOptions& o);

// Reports name images and classes by number, which mean the same images only in the set the
// reports were made from: every report the options read must say (its "# set:" line, as
// faceshard-clean writes it) that it was made from `set`. A usage error naming the report and
// both sets otherwise, or when a report says nothing of its set.
void check_reports_set(const std::string& folder, const SetIdentity& set, const CleanPackOptions& o);

// A keep-list that names its set (a "# set: sha256:..." comment, as a list written from a
// report carries it) must name `set`; one without such a line is taken as it is.
void check_keep_list_set(const std::string& file, const SetIdentity& set);

// A keep-list: image indices separated by white space or lines ('#' starts a comment);
// every other image dropped.
CleanPlan plan_from_keep_list(const std::string& file, uint64_t images, int64_t classes);

struct CleanPackResult {
  uint64_t kept = 0, dropped = 0;
  int64_t classes = 0;
};

// Writes OUT_PREFIX.rec/.idx (insightface layout, classes renumbered in order of their
// first source class, classes left without images removed) and OUT_PREFIX.labels.tsv
// (label, source classes, images). `src` must be the set the reports were made from.
CleanPackResult write_clean_rec(const Dataset& src, const CleanPlan& plan, const std::string& out_prefix);

// What a packed source set may carry beside its .rec (data/source_paths.h): its classes'
// identity names (its labels.tsv) and each image's photo (its sources.tsv). With them, the
// clean copy's labels.tsv gains an `identities` column (the names of the classes each new
// one holds) and OUT_PREFIX.sources.tsv lists each kept image's photo in the new order.
struct CleanPackNames {
  std::vector<std::string> identities;  // by source class; empty: none known
  const SourcePaths* sources = nullptr;
};
CleanPackResult write_clean_rec(const Dataset& src, const CleanPlan& plan, const std::string& out_prefix,
                                const CleanPackNames& names);

}  // namespace faceshard
