#include "app/train/train_state.h"

#include <mutex>
#include <sstream>

#include "partial_fc/runtime/error.h"
#include "partial_fc/runtime/log.h"

namespace faceshard {
namespace {

at::Tensor scalar_long(int64_t v) { return torch::tensor({v}, torch::kLong); }

// Entries of `sd` whose names start with `prefix`, with the prefix removed.
StateDict with_prefix(const StateDict& sd, const std::string& prefix, torch::Device device) {
  StateDict out;
  for (const auto& kv : sd)
    if (kv.first.rfind(prefix, 0) == 0) out.emplace_back(kv.first.substr(prefix.size()), kv.second.to(device));
  return out;
}

}  // namespace

void TrainState::save(CheckpointManager& checkpoints) const {
  const TrainJob& j = job_;
  const TrainProgress& p = progress_;
  StateDict ts;
  ts.emplace_back("step", scalar_long(p.step));
  ts.emplace_back("world_size", scalar_long(j.dist->world_size()));
  // Where the data stands, in global samples: a resume on another number of ranks or batch
  // size continues the same epoch at the same point.
  ts.emplace_back("data.epoch", scalar_long(p.epoch));
  ts.emplace_back("data.epoch_samples", scalar_long(p.batch_in_epoch * j.cfg.data.batch_size * j.dist->world_size()));
  for (auto& kv : j.opt->state()) ts.emplace_back("opt/" + kv.first, kv.second.cpu());
  for (auto& kv : j.scaler->state()) ts.emplace_back("scaler/" + kv.first, kv.second.cpu());
  for (auto& kv : p.best_accuracy) ts.emplace_back("best/" + kv.first, torch::tensor({kv.second}, torch::kDouble));
  // The head's state is the same on every rank: rank 0's file holds it.
  for (auto& kv : j.fc->head().state()) ts.emplace_back("head/" + kv.first, kv.second.cpu());

  StateDict shard;
  shard.emplace_back("rows.start", scalar_long(j.fc->shard().start));
  shard.emplace_back("rows.count", scalar_long(j.fc->shard().count));
  for (auto& kv : j.fc->state()) shard.emplace_back("rows/" + kv.first, kv.second.cpu());
  shard.emplace_back("rng.cpu", at::detail::getDefaultCPUGenerator().get_state());
  if (j.device.is_cuda()) shard.emplace_back("rng.cuda", at::globalContext().defaultGenerator(j.device).get_state());

  checkpoints.save(p.step, j.cfg.data.num_classes, j.backbone->state_dict(), ts, shard);
  log_info("checkpoint saved: ", checkpoints.root(), " step ", p.step);
}

void TrainState::load(const std::string& dir) {
  TrainJob& j = job_;
  TrainProgress& p = progress_;
  CheckpointInfo info = read_checkpoint_info(dir);
  if (info.num_classes != j.cfg.data.num_classes)
    throw usage_error("checkpoint '", dir, "' has ", info.num_classes, " classes but data.num_classes is ",
                      j.cfg.data.num_classes);
  j.backbone->load_state_dict(read_checkpoint_file(info, "backbone.pt"), dir + "/backbone.pt");

  const std::string tsrc = dir + "/train_state.pt";
  StateDict ts = read_checkpoint_file(info, "train_state.pt");
  p.step = state_get(ts, "step", tsrc).item<int64_t>();
  j.opt->load_state(with_prefix(ts, "opt/", j.device), tsrc);
  j.scaler->load_state(with_prefix(ts, "scaler/", j.device), tsrc);
  for (auto& kv : with_prefix(ts, "best/", torch::kCPU)) p.best_accuracy[kv.first] = kv.second.item<double>();
  for (auto& kv : with_prefix(ts, "head/", j.device)) j.fc->head().load_state(kv.first, kv.second, tsrc);

  StateDict shard = read_resharded_rows(info, j.fc->shard().start, j.fc->shard().count, j.dist->rank());
  const std::string ssrc = "checkpoint '" + dir + "'";
  j.fc->load_state(with_prefix(shard, "rows/", j.device), ssrc);
  // The RNG streams continue only on the same ranks (their number decides who draws what).
  if (info.world_size == j.dist->world_size()) {
    for (const auto& kv : shard) {
      if (kv.first != "rng.cpu" && !(kv.first == "rng.cuda" && j.device.is_cuda())) continue;
      at::Generator gen = kv.first == "rng.cpu" ? at::detail::getDefaultCPUGenerator()
                                                : at::globalContext().defaultGenerator(j.device);
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(kv.second);
    }
  }
  // The sampling RNG counts forwards: micro-batches.
  j.fc->set_forwards(p.step * j.micro);

  // The data position: saved in global samples, converted to this job's micro-batches
  // (exact when the ranks and the batch size are those of the saved run).
  const int64_t per_batch = j.cfg.data.batch_size * j.dist->world_size();
  bool has_data_state = false;
  for (const auto& kv : ts) has_data_state |= kv.first == "data.epoch";
  if (has_data_state) {
    p.epoch = state_get(ts, "data.epoch", tsrc).item<int64_t>();
    const int64_t samples = state_get(ts, "data.epoch_samples", tsrc).item<int64_t>();
    p.batch_in_epoch = samples / per_batch / j.micro * j.micro;
    if (samples % (per_batch * j.micro) != 0)
      log_info("resume: ", samples, " samples of epoch ", p.epoch, " were used; continuing at the nearest full step (",
               p.batch_in_epoch * per_batch, " samples)");
  } else {  // checkpoints without the data position: derive it from the step
    p.epoch = p.step / j.steps_per_epoch;
    p.batch_in_epoch = (p.step % j.steps_per_epoch) * j.micro;
  }
  if (p.batch_in_epoch >= j.steps_per_epoch * j.micro) {
    p.epoch++;
    p.batch_in_epoch = 0;
  }
  log_info("resumed from ", dir, " at step ", p.step,
           info.world_size != j.dist->world_size() ? " (classifier resharded from " + std::to_string(info.world_size) +
                                                         " to " + std::to_string(j.dist->world_size()) + " ranks)"
                                                   : "");
}

void export_model(const TrainJob& j, int64_t step) {
  if (j.dist->rank() != 0) return;
  const std::string out = j.cfg.output + "/model.pt";
  write_state_dict_durably(j.backbone->state_dict(), out);
  std::ostringstream js;
  js << "{\"backbone\": \"" << j.cfg.model.backbone << "\", \"embedding_size\": " << j.cfg.model.embedding_size
     << ", \"input_size\": [112, 112], \"input\": \"RGB, (x / 255 - 0.5) / 0.5, CHW\", \"step\": " << step
     << ", \"num_classes\": " << j.cfg.data.num_classes << ", \"precision\": \"" << j.cfg.train.precision << "\"}\n";
  write_text_durably(js.str(), j.cfg.output + "/model.json");
  log_info("exported backbone: ", out, " (+ model.json)");
}

}  // namespace faceshard
