#include "app/train/log_sinks.h"

#include <cmath>
#include <cstdio>
#include <iomanip>
#include <sstream>

#include "app/io/metrics_log.h"
#include "app/io/tensorboard_writer.h"
#include "base/error.h"
#include "base/log.h"

namespace faceshard {

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const int64_t t = static_cast<int64_t>(s);
  std::ostringstream os;
  if (t >= 3600) os << t / 3600 << "h";
  os << std::setw(t >= 3600 ? 2 : 1) << std::setfill('0') << (t % 3600) / 60 << "m" << std::setw(2) << t % 60 << "s";
  return os.str();
}

std::string format_lr(double lr) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", lr);
  return buf;
}

ConsoleSink::ConsoleSink(bool progress_bar) : bar_(progress_bar) {}

void ConsoleSink::progress(int64_t step, int64_t last_step) {
  if (!bar_) return;
  const int width = 30;
  const int filled = static_cast<int>(width * step / std::max<int64_t>(1, last_step));
  std::printf("\r[%s%s] %lld/%lld", std::string(filled, '#').c_str(), std::string(width - filled, ' ').c_str(),
              static_cast<long long>(step), static_cast<long long>(last_step));
  std::fflush(stdout);
}

void ConsoleSink::train(const TrainRecord& r) {
  std::ostringstream os;
  os << std::fixed << "step " << r.step << "/" << r.last_step << "  epoch " << r.epoch << std::setprecision(4)
     << "  loss " << r.loss << "  acc " << r.accuracy << "  lr " << format_lr(r.lr)
     << (r.fc_lr != r.lr ? "  fc_lr " + format_lr(r.fc_lr) : std::string()) << std::setprecision(1)
     << "  " << r.samples_per_sec << " samples/s  ETA " << format_duration(r.eta_s);
  if (r.loss_scale) os << "  loss scale " << *r.loss_scale;
  if (r.memory_gb) os << std::setprecision(2) << "  mem " << *r.memory_gb << " GB";
  if (bar_) std::printf("\r");
  log_info(os.str());
}

void ConsoleSink::validation(const ValidationRecord& r) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(5) << "[" << r.set << "][" << r.step << "] Accuracy-Flip: " << r.accuracy
     << "+-" << r.accuracy_std << "  Accuracy-Highest: " << r.best_accuracy << "  XNorm: ";
  // The embeddings' mean norm: below 1e-3 (an untrained network's) in significant digits,
  // so that it never reads as 0.00000.
  if (r.xnorm != 0 && std::abs(r.xnorm) < 1e-3)
    os << format_sig(r.xnorm, 3);
  else
    os << r.xnorm;
  os << "  threshold: " << r.threshold << " (squared L2 distance)";
  if (r.step == 0) os << "; step 0: the untrained network, the curve's starting point";
  log_info(os.str());
}

MetricsSink::MetricsSink(const std::string& path, bool append) : path_(path), append_(append) {
  try {
    log_ = std::make_unique<MetricsLog>(path, append);
  } catch (const Error& e) {
    lost_ = 1;  // tried again at every line
    log_warn(one_line(e), ": metrics.jsonl is tried again at every line; training goes on");
  }
}
MetricsSink::~MetricsSink() = default;

void MetricsSink::train(const TrainRecord& r) {
  std::vector<std::pair<std::string, double>> f{{"step", static_cast<double>(r.step)},
                                                {"epoch", static_cast<double>(r.epoch)},
                                                {"loss", r.loss},
                                                {"accuracy", r.accuracy},
                                                {"lr", r.lr},
                                                {"fc_lr", r.fc_lr},
                                                {"samples_per_sec", r.samples_per_sec}};
  if (r.loss_scale) f.emplace_back("loss_scale", *r.loss_scale);
  for (const auto& kv : r.head_state) f.push_back(kv);
  write(f, r.step);
}

// A line that cannot be written (a full disk, a quota, an I/O error) costs that line: one
// warning while the failures last, and training goes on; the file keeps its whole lines.
void MetricsSink::write(const std::vector<std::pair<std::string, double>>& fields, int64_t step) {
  try {
    if (!log_) log_ = std::make_unique<MetricsLog>(path_, append_);
    log_->write(fields);
    if (lost_ > 0) log_info(log_->path(), ": writing again from step ", step, " (", lost_, " lines left out)");
    lost_ = 0;
  } catch (const Error& e) {
    if (lost_++ == 0)
      log_warn(one_line(e), ": the line of step ", step, " is left out; training goes on (the next lines are tried)");
  }
}

void MetricsSink::checkpoint(const CheckpointRecord& r) {
  write({{"step", static_cast<double>(r.step)},
         {"checkpoint/wait_s", r.wait_s},
         {"checkpoint/stage_s", r.stage_s},
         {"checkpoint/previous_wait_s", r.previous_s},
         {"checkpoint/write_s", r.write_s},
         {"checkpoint/bytes", r.bytes},
         {"checkpoint/background", r.background ? 1.0 : 0.0},
         {"checkpoint/committed", r.committed ? 1.0 : 0.0}},
        r.step);
}

void MetricsSink::validation(const ValidationRecord& r) {
  write({{"step", static_cast<double>(r.step)},
         {"val/" + r.set + "/accuracy", r.accuracy},
         {"val/" + r.set + "/accuracy_std", r.accuracy_std},
         {"val/" + r.set + "/best_accuracy", r.best_accuracy}},
        r.step);
}

TensorBoardSink::TensorBoardSink(const std::string& dir) : dir_(dir) {
  try {
    tb_ = std::make_unique<TensorBoardWriter>(dir);
  } catch (const Error& e) {
    lost_ = 1;
    log_warn(one_line(e), ": the TensorBoard file is tried again at every record; training goes on");
  }
}
TensorBoardSink::~TensorBoardSink() = default;

void TensorBoardSink::train(const TrainRecord& r) {
  if (!open()) return;
  tb_->add_scalar("loss", r.loss, r.step);
  tb_->add_scalar("accuracy", r.accuracy, r.step);
  tb_->add_scalar("learning_rate", r.lr, r.step);
  tb_->add_scalar("learning_rate/classifier", r.fc_lr, r.step);
  tb_->add_scalar("samples_per_sec", r.samples_per_sec, r.step);
  if (r.loss_scale) tb_->add_scalar("loss_scale", *r.loss_scale, r.step);
  for (const auto& kv : r.head_state) tb_->add_scalar(kv.first, kv.second, r.step);
  flush(r.step);
}

void TensorBoardSink::validation(const ValidationRecord& r) {
  if (!open()) return;
  tb_->add_scalar("val/" + r.set + "/accuracy", r.accuracy, r.step);
  flush(r.step);
}

bool TensorBoardSink::open() {
  if (tb_) return true;
  try {
    tb_ = std::make_unique<TensorBoardWriter>(dir_);
    return true;
  } catch (const Error&) {
    lost_++;  // a step's records left out; the warning was given when it first failed
    return false;
  }
}

// As metrics.jsonl: a step's records that cannot be written are left out, training goes on.
void TensorBoardSink::flush(int64_t step) {
  try {
    tb_->flush();
    if (lost_ > 0) log_info(tb_->path(), ": writing again from step ", step, " (", lost_, " steps' records left out)");
    lost_ = 0;
  } catch (const Error& e) {
    if (lost_++ == 0)
      log_warn(one_line(e), ": the records of step ", step, " are left out; training goes on (the next ones are tried)");
  }
}

}  // namespace faceshard
