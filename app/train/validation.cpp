#include "app/train/validation.h"

#include <filesystem>

#include "base/error.h"
#include "base/log.h"

namespace faceshard {

Validation::Validation(TrainJob& job) : job_(job) {
  if (job.dist->rank() != 0) return;
  const std::string dir = job.cfg.data.verification_dir();
  for (const auto& t : job.cfg.data.val_targets) {
    const std::string p = dir + "/" + t + ".bin";
    // As arcface_torch: a set whose .bin is not there is skipped (a preset names LFW, CFP-FP
    // and AgeDB-30; your data may bring other sets), said in one warning line.
    if (!std::filesystem::exists(p)) {
      log_warn("data.val_targets: '", t, "' skipped: ", std::filesystem::absolute(p).lexically_normal().string(),
               " not found (put the .bin there, set data.val_dir, or leave it out of data.val_targets)");
      continue;
    }
    sets_.push_back(load_verification_data(p));
    check_verification_folds(sets_.back(), 10);  // before training, not at the first verification
    log_info("verification set ", t, ": ", sets_.back().issame.size(), " pairs");
  }
}

void Validation::run(int64_t step, std::map<std::string, double>& best, LogSinks& sinks) {
  if (!enabled()) return;
  for (auto& v : sets_) {
    VerificationResult r = evaluate_verification(*job_.backbone, v, 64, job_.device);
    double& b = best[v.name];
    b = std::max(b, r.kfold.accuracy_mean);
    sinks.validation(ValidationRecord{step, v.name, r.kfold.accuracy_mean, r.kfold.accuracy_std, b, r.xnorm,
                                      r.kfold.best_threshold});
  }
  job_.dist->barrier();
}

}  // namespace faceshard
