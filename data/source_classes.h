// Where the classes of a cleaned set came from: faceshard-pack clean writes
// OUT_PREFIX.labels.tsv beside OUT_PREFIX.rec with a `source_classes` column, the classes of
// the set it was cleaned from that each new class holds (several when merged, comma-
// separated). A run that starts from a model trained on the source set (its classifier
// centres: loss.init_centres) maps each class to its source classes through it.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace faceshard {

// The source classes of each of the `classes` classes of the set whose .rec is `rec_path`
// (labels_path_of), each below `source_classes`. Nothing when there is no labels file
// beside it or its header has no `source_classes` column (a set packed from photos). A file
// with that column that does not list each class once, or names a source class out of
// range, twice, or not at all, is a usage error naming the file and line.
std::optional<std::vector<std::vector<int64_t>>> source_classes_beside(const std::string& rec_path, int64_t classes,
                                                                       int64_t source_classes);

}  // namespace faceshard
