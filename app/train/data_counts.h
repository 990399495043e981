// The data decides what the data knows: identities and images are counted from it (the
// .rec's identity records, the folder's sub-folders), as faceshard-train counts them at
// start-up; a config that names them must agree, and spare classifier classes are asked for
// by data.spare_classes. Synthetic data has only the config's numbers. The trainer and the
// tools that plan a job (faceshard-plan, faceshard-config) share this one computation.
#pragma once
#include <optional>
#include <string>

#include "app/config/config.h"
#include "data/dataset.h"

namespace faceshard {

// Fills cfg.data.num_classes (counted + data.spare_classes) and checks a data.num_images
// that is set against `ds`, the data set cfg.data.rec opened; config errors name the key and the data.
// Returns what was counted, for a log line ("16 identities counted in '/data/x'"), or
// nothing when the config's own number was kept (synthetic data, a .rec without identity
// records with data.num_classes set).
std::optional<std::string> resolve_data_counts(Config& cfg, const Dataset& ds);

// For the planning tools: where cfg.data.rec names data on this machine (not "synthetic")
// and data.num_classes or data.num_images is not set, the data is opened (its index only:
// no image is read) and counted as the trainer counts it (data.num_images filled too). Returns the line to print
// ("data: 93 identities, 1,150 images counted in '...' (as faceshard-train counts them)"),
// or nothing when nothing was counted (the numbers set, synthetic data, or no data at that
// path: the tools then plan from their flags).
std::optional<std::string> count_config_data(Config& cfg);

}  // namespace faceshard
