#include "app/train/train_state.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <sstream>

#include "app/io/resharded_rows.h"
#include "partial_fc/classifier/head_catalogue.h"
#include "partial_fc/classifier/margin_head.h"
#include "base/cpu_block_cache.h"
#include "base/error.h"
#include "base/log.h"

namespace faceshard {
namespace {

at::Tensor scalar_long(int64_t v) { return torch::tensor({v}, torch::kLong); }

at::Tensor name_bytes(const std::string& name) {
  at::Tensor t = at::empty({static_cast<int64_t>(name.size())}, at::kByte);
  if (!name.empty()) std::memcpy(t.data_ptr<uint8_t>(), name.data(), name.size());
  return t;
}

// The heads of the catalogue whose state has `key` ("adaface"; "" when none).
std::string heads_with_state(const std::string& key) {
  std::string out;
  for (const HeadInfo& h : head_catalogue()) {
    try {
      HeadSpec spec;
      spec.name = h.name;
      for (const auto& kv : make_margin_head(spec, CombinedMargin{})->state())
        if (kv.first == key) out += (out.empty() ? "" : " or ") + h.name;
    } catch (const Error&) {
      // A head that needs parameters to be built has no default state to compare.
    }
  }
  return out;
}

// A generator's state from entry i of a checkpoint file: the bytes LibTorch's get_state
// gives for this generator (their type and number checked from the file before reading),
// tried on a scratch generator first, so that a state LibTorch rejects, or a CPU
// (Mersenne Twister) state whose position lies outside its table, names the file and key
// and leaves the job's generator as it was.
void restore_generator(at::Generator& gen, const TensorSource& file, size_t i, const std::string& source,
                       const std::string& key) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  const at::Tensor want = gen.get_state();
  const std::vector<int64_t> sizes = file.sizes(i);
  if (file.dtype(i) != want.scalar_type() || c10::IntArrayRef(sizes) != want.sizes())
    throw usage_error(source, ": key '", key, "' is ", file.dtype(i), " of shape ", c10::IntArrayRef(sizes),
                      ", expected the ", want.scalar_type(), " of shape ", want.sizes(), " that this ",
                      gen.device().str(), " generator's state takes");
  const at::Tensor state = file.read(i);
  try {
    if (gen.device().is_cpu()) {
      auto scratch = at::make_generator<at::CPUGeneratorImpl>();
      scratch.set_state(state);
      if (!scratch.get<at::CPUGeneratorImpl>()->engine().is_valid())
        throw usage_error(source, ": key '", key, "': not a valid CPU generator state (its Mersenne Twister position is out of range)");
    }
    gen.set_state(state);
  } catch (const c10::Error&) {
    throw usage_error(source, ": key '", key, "': not a valid ", gen.device().str(), " generator state");
  }
}

}  // namespace

bool TrainState::save(CheckpointManager& checkpoints) const {
  const CheckpointContents c = contents();
  if (!checkpoints.save(c.step, c.num_classes, c.backbone, c.train_state, c.shard)) return false;
  log_info("checkpoint saved: ", checkpoints.root(), " step ", c.step);
  return true;
}

CheckpointContents TrainState::contents() const {
  const TrainJob& j = job_;
  const TrainProgress& p = progress_;
  StateDict ts;
  ts.emplace_back("step", scalar_long(p.step));
  ts.emplace_back("world_size", scalar_long(j.dist->world_size()));
  // Where the data stands, in global samples: a resume on another number of ranks or batch
  // size continues the same epoch at the same point.
  ts.emplace_back("data.epoch", scalar_long(p.epoch));
  ts.emplace_back("data.epoch_samples", scalar_long(p.batch_in_epoch * j.cfg.data.batch_size * j.dist->world_size()));
  // The batch and the schedule: a resume on another number of ranks keeps the global batch
  // (so the schedule and every step's learning rate stay the run's); one that changes it on
  // purpose says what changes.
  ts.emplace_back("data.global_batch", scalar_long(j.global_batch()));
  ts.emplace_back("data.batch_size", scalar_long(j.cfg.data.batch_size));
  ts.emplace_back("optim.grad_accumulation", scalar_long(j.micro));
  ts.emplace_back("schedule.total_steps", scalar_long(j.total_steps));
  ts.emplace_back("schedule.warmup_steps", scalar_long(j.warmup_steps));
  ts.emplace_back("schedule.lr", torch::tensor({j.schedule.lr(p.step)}, torch::kDouble));
  // The live tensors, wherever they are: write_state_dict brings each to the host only as
  // it writes it (on a GPU, one tensor's host copy at a time; on the CPU, no copy).
  for (auto& kv : j.opt->state()) ts.emplace_back("opt/" + kv.first, kv.second);
  for (auto& kv : j.scaler->state()) ts.emplace_back("scaler/" + kv.first, kv.second);
  for (auto& kv : p.best_accuracy) ts.emplace_back("best/" + kv.first, torch::tensor({kv.second}, torch::kDouble));
  // The head's state is the same on every rank: rank 0's file holds it.
  for (auto& kv : j.fc->head().state()) ts.emplace_back("head/" + kv.first, kv.second.cpu());
  // Which head that state is of (loss.head), as its name's bytes: a resume under another head
  // is named, in either direction (a head without state leaves no key of its own).
  ts.emplace_back("head.name", name_bytes(j.fc->head().name()));

  StateDict shard;
  shard.emplace_back("rows.start", scalar_long(j.fc->shard().start));
  shard.emplace_back("rows.count", scalar_long(j.fc->shard().count));
  // Rows per class (loss.subcenters): rows/* hold rows.count x K rows, class-major.
  shard.emplace_back("rows.subcenters", scalar_long(j.fc->options().subcenters));
  for (auto& kv : j.fc->state()) shard.emplace_back("rows/" + kv.first, kv.second);
  shard.emplace_back("rng.cpu", at::detail::getDefaultCPUGenerator().get_state());
  if (j.device.is_cuda()) shard.emplace_back("rng.cuda", at::globalContext().defaultGenerator(j.device).get_state());

  CheckpointContents c;
  c.step = p.step;
  c.num_classes = *j.cfg.data.num_classes;
  c.backbone = j.backbone->state_dict();
  c.train_state = std::move(ts);
  c.shard = std::move(shard);
  return c;
}

namespace {

// A field of /proc/self/status in MB (-1 where there is none).
double status_mb(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const size_t n = std::strlen(key);
  while (std::getline(f, line))
    if (line.compare(0, n, key) == 0) return std::atof(line.c_str() + n) / 1024.0;
  return -1;
}

}  // namespace

namespace {

double seconds_since(std::chrono::steady_clock::time_point a) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count();
}

// The backbone's values, each read straight into its parameter or buffer, then checked.
void load_backbone(TrainJob& j, const CheckpointInfo& info, const std::string& dir) {
  j.backbone->load_state_dict(open_checkpoint_file(info, "backbone.pt"), dir + "/backbone.pt");
  // Every value of the backbone finite; BatchNorm's running variances and counts >= 0.
  for (const auto& [key, value] : j.backbone->state_dict()) {
    const bool non_negative = key.size() >= 11 && (key.compare(key.size() - 11, 11, "running_var") == 0 ||
                                                   key.find("num_batches_tracked") != std::string::npos);
    check_checkpoint_values(value, dir + "/backbone.pt", key, non_negative);
  }
}

// train_state.pt's step, the optimiser's and the loss scaler's state, the best accuracies.
void load_train_state(TrainJob& j, TrainProgress& p, const CheckpointInfo& info, const StateDictReader& ts,
                      const std::string& tsrc) {
  p.step = read_checkpoint_int(ts, "step", tsrc);
  if (p.step != info.step)
    throw usage_error(tsrc, ": key 'step' is ", p.step, ", but the checkpoint's COMMITTED marker says step ", info.step);
  if (ts.find("world_size") != TensorSource::npos) {
    const int64_t saved_world = read_checkpoint_int(ts, "world_size", tsrc);
    if (saved_world != info.world_size)
      throw usage_error(tsrc, ": key 'world_size' is ", saved_world, ", but the checkpoint's COMMITTED marker says ",
                        info.world_size);
  }
  j.opt->load_state(PrefixedSource(ts, "opt/"), tsrc);
  for (const auto& [key, value] : j.opt->state())  // AdamW's second moments and step counts are never negative
    check_checkpoint_values(value, tsrc, "opt/" + key, key.rfind("exp_avg_sq.", 0) == 0 || key.rfind("step.", 0) == 0);
  {
    const PrefixedSource scaler(ts, "scaler/");
    StateDict values;
    for (size_t i = 0; i < scaler.size(); ++i) values.emplace_back(scaler.name(i), scaler.read(i));
    j.scaler->load_state(values, tsrc);
  }
  const PrefixedSource best(ts, "best/");
  for (size_t i = 0; i < best.size(); ++i) {
    const double a = read_checkpoint_double(ts, "best/" + best.name(i), tsrc);
    if (!(a >= 0 && a <= 1))
      throw usage_error(tsrc, ": key 'best/", best.name(i), "' is ", a, ", expected an accuracy in [0, 1]");
    p.best_accuracy[best.name(i)] = a;
  }
}

// The margin head's state: each key's name, size and type checked from the file before it is
// read, its values after.
void load_head_state(TrainJob& j, const StateDictReader& ts, const std::string& tsrc) {
  const std::string head_now_name = j.fc->head().name();
  const std::string change = "; a resume continues its run with the run's own head: resume with --set loss.head=";
  if (const size_t i = ts.find("head.name"); i != TensorSource::npos) {
    if (ts.dtype(i) != at::kByte || ts.numel(i) < 1 || ts.numel(i) > 64)
      throw usage_error(tsrc, ": key 'head.name' is not a head's name (", ts.dtype(i), " of ", ts.numel(i), " values)");
    const at::Tensor b = ts.read(i);
    const std::string saved(reinterpret_cast<const char*>(b.data_ptr<uint8_t>()), static_cast<size_t>(b.numel()));
    if (saved != head_now_name)
      throw usage_error(tsrc, ": the checkpoint was trained with loss.head ", detail::printable(saved),
                        ", this run has loss.head ", head_now_name, change, detail::printable(saved),
                        ", or train the ", head_now_name, " head in a new run from this one's backbone (model.init)");
  }
  const PrefixedSource head_state(ts, "head/");
  const auto head_now = j.fc->head().state();
  for (size_t i = 0; i < head_state.size(); ++i) {
    const std::string& key = head_state.name(i);
    auto it = std::find_if(head_now.begin(), head_now.end(), [&](const auto& kv) { return kv.first == key; });
    if (it == head_now.end()) {
      const std::string owners = heads_with_state(key);
      if (!owners.empty())
        throw usage_error(tsrc, ": key 'head/", key, "' is state of the ", owners, " head, not of this run's ",
                          head_now_name, " head (loss.head)", change, owners, ", or train the ", head_now_name,
                          " head in a new run from this one's backbone (model.init)");
      throw usage_error(tsrc, ": key 'head/", key, "' is not state of the ", head_now_name, " head");
    }
    if (head_state.numel(i) != it->second.numel() || !at::isFloatingType(head_state.dtype(i)))
      throw usage_error(tsrc, ": key 'head/", key, "' is ", head_state.dtype(i), " of ", head_state.numel(i),
                        " values, expected ", it->second.numel(), " floating-point values");
    const at::Tensor value = head_state.read(i);
    check_checkpoint_values(value, tsrc, "head/" + key);
    j.fc->head().load_state(key, value.to(j.device), tsrc);
  }

}

struct LoadedRows {
  double rows_gb = 0, rows_s = 0;
};

// The classifier's rows (resharded when the number of ranks differs) and, on the same ranks,
// the RNG streams; the sampling RNG's count of forwards.
LoadedRows load_classifier(TrainJob& j, const TrainProgress& p, const CheckpointInfo& info, const std::string& dir) {
  LoadedRows loaded;
  // The classifier: this rank's class range from the saved shards, resharded when the
  // number of ranks differs, each entry streamed into the shard's own tensor.
  const ReshardedRows rows(info, j.fc->shard().start, j.fc->shard().count, j.fc->options().subcenters);
  const std::string ssrc = "checkpoint '" + dir + "'";
  const ShardRows mine = j.fc->state();
  for (const std::string& name : rows.names())
    if (std::none_of(mine.begin(), mine.end(), [&](const auto& m) { return m.first == name; }))
      throw usage_error(ssrc, ": classifier state '", name, "' does not belong to the '", j.fc->options().optimizer.kind,
                        "' optimiser");
  // Rows saved in another dtype (optim.fc_weight_dtype or fc_state_dtype changed between the
  // runs) are converted as they are read: bf16 -> fp32 is exact, fp32 -> bf16 rounds each
  // value to nearest once.
  for (const auto& m : mine)
    if (rows.has(m.first) && rows.dtype(m.first) != m.second.scalar_type() && m.second.is_floating_point()) {
      const bool weight = m.first == "weight";
      log_info("resume: classifier ", weight ? "centres" : "state", " '", m.first, "' saved as ", rows.dtype(m.first),
               ", converted to ", m.second.scalar_type(), " (", weight ? "optim.fc_weight_dtype " : "optim.fc_state_dtype ",
               weight ? j.cfg.optim.fc_weight_dtype : j.cfg.optim.fc_state_dtype, ")");
    }
  const auto t_rows = std::chrono::steady_clock::now();
  j.fc->fill_state([&](const std::string& name, const at::Tensor& dst) {
    // AdamW's second moments and step counts are never negative.
    rows.read_into(name, dst, name == "opt.exp_avg_sq" || name == "opt.row_steps");
    loaded.rows_gb += static_cast<double>(dst.nbytes()) / 1e9;
  });
  loaded.rows_s = seconds_since(t_rows);
  // The RNG streams continue only on the same ranks (their number decides who draws what).
  if (info.world_size == j.dist->world_size()) {
    const std::string name = "fc_shard_" + std::to_string(j.dist->rank()) + ".pt";
    const StateDictReader own = open_checkpoint_file(info, name);
    const std::string file = dir + "/" + name;
    for (const char* key : {"rng.cpu", "rng.cuda"}) {
      const size_t i = own.find(key);
      if (i == TensorSource::npos || (std::string(key) == "rng.cuda" && !j.device.is_cuda())) continue;
      at::Generator gen = std::string(key) == "rng.cpu" ? at::detail::getDefaultCPUGenerator()
                                                        : at::globalContext().defaultGenerator(j.device);
      restore_generator(gen, own, i, file, key);
    }
  }
  // The sampling RNG counts forwards: micro-batches.
  j.fc->set_forwards(p.step * j.micro);

  return loaded;
}

// Where in its epoch the data continues (train_state.pt's data.* keys, or the step's).
void restore_data_position(TrainJob& j, TrainProgress& p, const StateDictReader& ts, const std::string& tsrc) {
  // The data position: saved in global samples, converted to this job's micro-batches
  // (exact when the ranks and the batch size are those of the saved run).
  const int64_t per_batch = j.cfg.data.batch_size * j.dist->world_size();
  if (ts.find("data.epoch") != TensorSource::npos) {
    p.epoch = read_checkpoint_int(ts, "data.epoch", tsrc);
    const int64_t samples = read_checkpoint_int(ts, "data.epoch_samples", tsrc);
    // A run of `step` steps has begun at most step + 1 epochs.
    if (p.epoch < 0 || p.epoch > p.step + 1)
      throw usage_error(tsrc, ": key 'data.epoch' is ", p.epoch, ", expected an epoch in [0, ", p.step + 1,
                        "] (the saved step + 1)");
    if (samples < 0 || samples > (int64_t(1) << 53))
      throw usage_error(tsrc, ": key 'data.epoch_samples' is ", samples, ", expected a sample count in [0, 2^53]");
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
}

// A global batch other than the checkpoint's (the config changed it on purpose, see
// adapt_batch_to_world): what that changes, in one line, never silently.
void say_batch_change(TrainJob& j, const TrainProgress& p, const StateDictReader& ts, const std::string& tsrc) {
  if (ts.find("data.global_batch") != TensorSource::npos) {
    const int64_t saved = read_checkpoint_int(ts, "data.global_batch", tsrc);
    if (saved < 1 || saved > (int64_t(1) << 40))
      throw usage_error(tsrc, ": key 'data.global_batch' is ", saved, ", expected a batch in [1, 2^40]");
    if (saved != j.global_batch()) {
      auto optional_int = [&](const char* key) -> std::optional<int64_t> {
        if (ts.find(key) == TensorSource::npos) return std::nullopt;
        return read_checkpoint_int(ts, key, tsrc);
      };
      const std::optional<int64_t> total = optional_int("schedule.total_steps"), warmup = optional_int("schedule.warmup_steps");
      std::optional<double> lr;
      if (ts.find("schedule.lr") != TensorSource::npos) lr = read_checkpoint_double(ts, "schedule.lr", tsrc);
      const Config& c = j.cfg;
      const std::string key = c.data.global_batch_size ? "data.global_batch_size" : "data.batch_size";
      const double images = static_cast<double>(c.data.num_images.value_or(static_cast<int64_t>(j.dataset->size())));
      auto epochs = [&](double seen) { return format_sig(seen / std::max(images, 1.0), 3); };
      std::ostringstream line;
      line << "resume: global batch " << saved << " -> " << j.global_batch() << " (" << key << " "
           << (c.data.global_batch_size ? *c.data.global_batch_size : c.data.batch_size) << " from " << c.origin(key)
           << ": " << c.data.batch_size << " per rank x " << j.dist->world_size() << " ranks x " << j.micro
           << " micro-batches): schedule ";
      if (total) line << *total << " -> ";
      line << j.total_steps << " steps (warm-up ";
      if (warmup) line << *warmup << " -> ";
      line << j.warmup_steps << "), learning rate at step " << p.step + 1 << " ";
      if (lr) line << format_sig(*lr, 4) << " -> ";
      line << format_sig(j.schedule.lr(p.step), 4) << "; the step count stays " << p.step;
      if (total && *total >= p.step && j.total_steps >= p.step)
        line << ", so the run sees " << epochs(double(p.step) * saved + double(j.total_steps - p.step) * j.global_batch())
             << " epochs by the schedule's end (" << epochs(double(*total) * saved) << " as it was)";
      log_info(line.str());
    }
  }
}

}  // namespace

void TrainState::load(const std::string& dir) {
  TrainJob& j = job_;
  TrainProgress& p = progress_;
  const auto t0 = std::chrono::steady_clock::now();
  // The load's own memory: the process's peak after it against its resident memory before
  // (the shard's rows are allocated but not yet touched, so the rows read land in this).
  const double rss_before_mb = status_mb("VmRSS:"), anon_before_mb = status_mb("RssAnon:");
  const int64_t cache_before = CpuBlockCache::cached_bytes();
  CheckpointInfo info = read_checkpoint_info(dir);
  if (info.num_classes != *j.cfg.data.num_classes)
    throw usage_error("checkpoint '", dir, "' has ", info.num_classes, " classes but data.num_classes is ",
                      *j.cfg.data.num_classes);
  // Every value is read straight from its file into where it lives (parameters, optimiser
  // state, the classifier's rows, on the job's device): a resume needs no memory beyond the
  // training's own and a staging buffer.
  load_backbone(j, info, dir);
  const std::string tsrc = dir + "/train_state.pt";
  const StateDictReader ts = open_checkpoint_file(info, "train_state.pt");
  load_train_state(j, p, info, ts, tsrc);
  load_head_state(j, ts, tsrc);
  const LoadedRows loaded = load_classifier(j, p, info, dir);
  const double rows_gb = loaded.rows_gb, rows_s = loaded.rows_s;
  restore_data_position(j, p, ts, tsrc);
  say_batch_change(j, p, ts, tsrc);
  log_info("resumed from ", dir, " at step ", p.step,
           info.world_size != j.dist->world_size() ? " (classifier resharded from " + std::to_string(info.world_size) +
                                                         " to " + std::to_string(j.dist->world_size()) + " ranks)"
                                                   : "",
           "; classifier rows ", format_bytes(rows_gb * 1e9), " read in ", format_sig(rows_s), " s (",
           format_bytes(rows_gb * 1e9 / std::max(rows_s, 1e-9)), "/s), whole load ", format_sig(seconds_since(t0)), " s");
  // What the load itself took in this process's memory: its peak over what it held when it
  // ended (a transient: a buffer or a whole file read and dropped), and the private memory it
  // added beyond the rows it read (file pages, e.g. library code first run here, are not
  // the load's memory).
  if (rss_before_mb >= 0 && !j.device.is_cuda())
    log_info("resume memory: resident ", static_cast<int64_t>(rss_before_mb), " MB before the load, ",
             static_cast<int64_t>(status_mb("VmRSS:")), " MB after it, peak ", static_cast<int64_t>(status_mb("VmHWM:")),
             " MB; private memory +", static_cast<int64_t>(status_mb("RssAnon:") - anon_before_mb), " MB for ",
             static_cast<int64_t>(rows_gb * 1e3 / 1.048576), " MB of classifier rows read (the CPU block cache keeps ",
             static_cast<int64_t>((CpuBlockCache::cached_bytes() - cache_before) / 1048576), " MB more freed blocks)");
}

std::optional<CheckpointBatch> read_checkpoint_batch(const std::string& newest, bool walk_back) {
  namespace fs = std::filesystem;
  std::vector<std::string> candidates{newest};
  if (walk_back) {  // the older step folders beside it, newest first
    std::vector<std::string> older;
    std::error_code ec;
    const fs::path parent = fs::path(newest).parent_path(), self = fs::path(newest).filename();
    for (const auto& e : fs::directory_iterator(parent.empty() ? fs::path(".") : parent, ec)) {
      const std::string name = e.path().filename().string();
      if (name.rfind("step_", 0) == 0 && name < self.string() && e.is_directory(ec)) older.push_back(e.path().string());
    }
    std::sort(older.rbegin(), older.rend());
    candidates.insert(candidates.end(), older.begin(), older.end());
  }
  for (const std::string& dir : candidates) {
    try {
      const CheckpointInfo info = read_checkpoint_info(dir);
      const StateDictReader ts = open_checkpoint_file(info, "train_state.pt");
      const std::string src = dir + "/train_state.pt";
      if (ts.find("data.global_batch") == TensorSource::npos) return std::nullopt;  // an older checkpoint: none kept
      CheckpointBatch b;
      b.checkpoint = dir;
      b.global_batch = read_checkpoint_int(ts, "data.global_batch", src);
      b.batch_size = read_checkpoint_int(ts, "data.batch_size", src);
      b.grad_accumulation = read_checkpoint_int(ts, "optim.grad_accumulation", src);
      b.world_size = info.world_size;
      if (b.global_batch < 1 || b.batch_size < 1 || b.grad_accumulation < 1 ||
          b.global_batch != b.batch_size * b.grad_accumulation * b.world_size)
        continue;  // not a batch of this checkpoint: its load names the key
      return b;
    } catch (const Error&) {
      // Not readable here: its verification says why, and a resume walks back past it.
    }
  }
  return std::nullopt;
}

void export_model(const TrainJob& j, int64_t step) {
  if (j.dist->rank() != 0) return;
  const std::string out = j.cfg.output + "/model.pt";
  write_state_dict_durably(j.backbone->state_dict(), out);
  std::ostringstream js;
  js << "{\"backbone\": \"" << j.cfg.model.backbone << "\", \"embedding_size\": " << j.cfg.model.embedding_size
     << ", \"input_size\": [112, 112], \"input\": \"RGB, (x / 255 - 0.5) / 0.5, CHW\", \"step\": " << step
     << ", \"num_classes\": " << *j.cfg.data.num_classes << ", \"precision\": \"" << j.cfg.train.precision << "\"}\n";
  write_text_durably(js.str(), j.cfg.output + "/model.json");
  log_info("exported backbone: ", out, " (+ model.json)");
}

}  // namespace faceshard
