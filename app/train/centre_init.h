// loss.init_centres: a run whose classifier centres start from another run's instead of
// random ones. The step of Sub-center ArcFace's recipe after the cleaning: a model trained
// with K sub-centres per class on the noisy set, the set cleaned (faceshard-clean, then
// faceshard-pack clean), and the training continued with one centre per class, each class
// keeping its dominant sub-centre (the one most of its images are nearest: faceshard-clean's
// dropped_subcenters.tsv, loss.init_centres_report) and the others dropped.
//
// Which class is which: a cleaned set renumbers its classes and merges some, and says so in
// the labels.tsv beside its .rec (source_classes, data/source_classes.h); a class takes the
// centre of its source class, of a merged one the source class with the most images at its
// dominant sub-centre (the first one listed without a report). Without that file the run's
// classes must be the checkpoint's, one for one. The centres' optimiser state starts at
// zero, as a fresh classifier's; the backbone comes from model.init (a checkpoint's
// backbone.pt), the schedule starts at step 0.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "app/config/config.h"
#include "app/io/checkpoint.h"
#include "partial_fc/classifier/partial_fc.h"

namespace faceshard {

struct CentreInitPlan {
  CheckpointInfo checkpoint;        // the step folder the centres come from
  int64_t saved_subcenters = 1;     // its K
  int64_t subcenters = 1;           // this run's K
  std::vector<int64_t> source;      // by class of this run: the checkpoint's class
  // By class of this run, with saved_subcenters > subcenters = 1: the saved sub-centre kept.
  // Empty when the run's K is the checkpoint's (all K rows of the class are taken).
  std::vector<int64_t> subcenter;
  int64_t merged = 0;               // classes of this run made of several source classes
  int64_t without_images = 0;       // classes kept at sub-centre 0: the report saw none of their images
  std::string mapping;              // how classes were matched, for the log line
};

// The plan for `num_classes` classes and loss.subcenters K of `cfg` (loss.init_centres set).
// Usage errors name the key and what does not fit: no committed checkpoint there, K > 1
// saved into K = 1 without a report (or a report of another run or step), another K, other
// classes without a source_classes table, a table that does not fit the checkpoint.
CentreInitPlan plan_centre_init(const Config& cfg, int64_t num_classes, int64_t subcenters);

// Fills `fc` (built without initialise_rows) with its classes' centres from the plan's
// checkpoint, read a window of classes at a time (on any number of ranks: each rank reads
// the saved rows of its own classes' sources), and its optimiser state with zeros.
void init_centres(PartialFC& fc, const CentreInitPlan& plan);

// One line for the log: "loss.init_centres: 100 classes from <step folder> (step 12, ...)".
std::string describe(const CentreInitPlan& plan);

}  // namespace faceshard
