#include "app/train/fault_injection.h"

#include <chrono>
#include <csignal>
#include <filesystem>
#include <thread>
#include <cstdlib>
#include <limits>
#include <sstream>
#include <vector>

#include <ATen/core/grad_mode.h>

#include "app/io/checkpoint.h"
#include "app/train/checkpoint_writer.h"
#include "app/train/train_step.h"
#include "base/error.h"
#include "base/log.h"

namespace faceshard {

FaultPlan FaultPlan::parse(const std::string& spec) {
  FaultPlan plan;
  std::stringstream ss(spec);
  for (std::string item; std::getline(ss, item, ',');) {
    if (item.empty()) continue;
    const auto at = item.find('@'), colon = item.find(':');
    int rank = -1;
    long long step = -1;
    char tail = 0;
    if (at == std::string::npos || colon == std::string::npos || colon < at ||
        std::sscanf(item.c_str() + at + 1, "%d:%lld%c", &rank, &step, &tail) != 2 || rank < 0 || step < 1)
      throw usage_error("FACESHARD_FAULTS: '", item, "' is not KIND@RANK:STEP (rank >= 0, step >= 1)");
    const std::string kind = item.substr(0, at);
    if (kind == "inf_gradient") plan.inf_gradient = At{rank, step};
    else if (kind == "crash_in_save") plan.crash_in_save = At{rank, step};
    else if (kind == "hold_save") plan.hold_save = At{rank, step};
    else if (kind == "hold_write") plan.hold_write = At{rank, step};
    else if (kind == "hold_written") plan.hold_written = At{rank, step};
    else if (kind == "freeze_in_agreement") plan.freeze_in_agreement = At{rank, step};
    else
      throw usage_error("FACESHARD_FAULTS: unknown fault '", kind,
                        "' (inf_gradient, crash_in_save, hold_save, hold_write, hold_written or freeze_in_agreement)");
  }
  if (plan.hold_save || plan.hold_write || plan.hold_written) {
    const char* release = std::getenv("FACESHARD_FAULTS_RELEASE");
    if (!release || !*release)
      throw usage_error("FACESHARD_FAULTS: ", plan.hold_save ? "hold_save" : plan.hold_write ? "hold_write" : "hold_written",
                        " needs FACESHARD_FAULTS_RELEASE (the file whose creation ends the hold)");
    plan.release_file = release;
  }
  return plan;
}

FaultPlan FaultPlan::from_environment() {
  const char* v = std::getenv("FACESHARD_FAULTS");
  return v ? parse(v) : FaultPlan{};
}

namespace {

// Until the release file exists (the test creates it once it has seen what it waits for),
// five minutes at most.
void wait_for_release(const std::string& file) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::minutes(5);
  while (!std::filesystem::exists(file) && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
}

}  // namespace

void install_faults(const FaultPlan& plan, int rank, CheckpointManager& checkpoints, TrainStep& step,
                    const std::vector<at::Tensor>& backbone_params) {
  auto hits = [rank](const std::optional<FaultPlan::At>& at, int64_t s) { return at && at->rank == rank && at->step == s; };
  if (plan.crash_in_save || plan.hold_save)
    checkpoints.set_mid_save_hook([hits, plan](int64_t s) {
      if (hits(plan.crash_in_save, s)) std::raise(SIGKILL);
      if (hits(plan.hold_save, s)) wait_for_release(plan.release_file);
    });
  if (plan.inf_gradient)
    step.set_gradient_hook([hits, at = plan.inf_gradient, params = backbone_params](int64_t s) {
      if (!hits(at, s)) return;
      at::NoGradGuard ng;
      for (const auto& p : params)
        if (p.grad().defined()) {
          // Its first element, whatever the layout (channels-last gradients have no flat view).
          std::vector<at::indexing::TensorIndex> first(static_cast<size_t>(p.grad().dim()), 0);
          p.grad().index(first).fill_(std::numeric_limits<float>::infinity());
          return;
        }
    });
}

void install_writer_faults(const FaultPlan& plan, int rank, CheckpointWriter& writer) {
  const bool write = plan.hold_write && plan.hold_write->rank == rank;
  const bool written = plan.hold_written && plan.hold_written->rank == rank;
  const bool freeze = plan.freeze_in_agreement && plan.freeze_in_agreement->rank == rank;
  if (!write && !written && !freeze) return;
  auto* async = dynamic_cast<AsyncCheckpointWriter*>(&writer);
  if (!async)
    throw usage_error("FACESHARD_FAULTS: ", write ? "hold_write" : written ? "hold_written" : "freeze_in_agreement",
                      " holds a checkpoint written in the background; this run writes them synchronously "
                      "(train.checkpoint_async)");
  auto hold = [file = plan.release_file](int64_t at) {
    return [at, file](int64_t s) {
      if (s == at) wait_for_release(file);
    };
  };
  if (write) async->set_before_write_hook(hold(plan.hold_write->step));
  if (written) async->set_after_write_hook(hold(plan.hold_written->step));
  if (freeze)
    async->set_before_agreement_stage([rank, at = plan.freeze_in_agreement->step](int64_t s, int stage) {
      if (s != at || stage != SaveAgreement::kCommitStage) return;
      log_notice("fault: rank ", rank, " freezes (SIGSTOP) inside the commit stage of step ", s, "'s agreement");
      std::raise(SIGSTOP);
    });
}

}  // namespace faceshard
