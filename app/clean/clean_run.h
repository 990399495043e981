// faceshard-clean's pass over a training set with the run trained on it: every image
// embedded with the run's backbone (or read from a faceshard-extract file) and audited
// against the run's classifier centres and the other images (clean_audit.h), the test sets'
// identities embedded, and the TSV reports written to one folder. Everything that can be
// refused (the run, the data and whether the run trained on it, the test sets, the report
// folder, the embeddings file) is checked before the long pass.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "app/clean/clean_audit.h"
#include "app/eval/inference_model.h"

namespace faceshard {

// faceshard-clean's flags (its --help says each).
struct CleanRequest {
  ModelSpec spec;                 // --precision (the path is the checkpoint's)
  CleanThresholds t;
  std::string run, rec, images, output, tests_dir, embeddings, device_name = "auto";
  std::vector<std::string> bins;  // --bin
  int64_t subcenters = 0, limit = 0, chunk = 4096, batch = 64;
  bool flip = true;
};

// The request's values: a usage error naming the flag.
void check_clean_request(const CleanRequest& request);

// The whole pass; the reports' counts and thresholds.
CleanCounts run_clean(const CleanRequest& request);

}  // namespace faceshard
