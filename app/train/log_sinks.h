// Where a training run reports: the loop hands each logged step and each verification
// result to every sink as one record. Sinks: the console (the log line and, on a
// terminal, a progress bar between log lines), metrics.jsonl and TensorBoard.
#pragma once
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace faceshard {

class MetricsLog;
class TensorBoardWriter;

// One logged training step: averages since the previous log line.
struct TrainRecord {
  int64_t step = 0, last_step = 0, epoch = 0;
  double loss = 0, accuracy = 0, lr = 0, samples_per_sec = 0;
  double fc_lr = 0;  // the classifier's (optim.fc_lr's schedule; the backbone's when unset)
  double eta_s = 0;
  std::optional<double> loss_scale;  // fp16 runs
  std::optional<double> memory_gb;   // GPU runs: the allocator's peak
  // The margin head's state ("head/adaface/batch_mean", "head/curricularface/t"...).
  std::vector<std::pair<std::string, double>> head_state;
};

// One verification set evaluated at a step.
struct ValidationRecord {
  int64_t step = 0;
  std::string set;
  double accuracy = 0, accuracy_std = 0, best_accuracy = 0, xnorm = 0, threshold = 0;
};

// One checkpoint: how long the training stopped for it beside how long its write took.
struct CheckpointRecord {
  int64_t step = 0;
  double wait_s = 0, stage_s = 0, previous_s = 0, write_s = 0, bytes = 0;
  bool background = false, committed = false;
};

class LogSink {
 public:
  virtual ~LogSink() = default;
  virtual void progress(int64_t step, int64_t last_step) {}
  virtual void train(const TrainRecord& r) {}
  virtual void validation(const ValidationRecord& r) {}
  virtual void checkpoint(const CheckpointRecord& r) {}
};

// A learning rate as the log line prints it: 4 significant digits, in exponent form when
// small ("0.1", "0.05925", "2.5e-06"), so that a fine-tuning rate never reads as 0.
std::string format_lr(double lr);

// The log line (and the progress bar when stdout is a terminal).
class ConsoleSink : public LogSink {
 public:
  explicit ConsoleSink(bool progress_bar);
  void progress(int64_t step, int64_t last_step) override;
  void train(const TrainRecord& r) override;
  void validation(const ValidationRecord& r) override;

 private:
  bool bar_;
};

// <output>/metrics.jsonl: one JSON object per record (step, epoch, loss, accuracy, lr,
// samples_per_sec, loss_scale under fp16, the head's state, val/<set>/... from verification).
class MetricsSink : public LogSink {
 public:
  MetricsSink(const std::string& path, bool append);
  ~MetricsSink() override;
  void train(const TrainRecord& r) override;
  void validation(const ValidationRecord& r) override;
  void checkpoint(const CheckpointRecord& r) override;

 private:
  void write(const std::vector<std::pair<std::string, double>>& fields, int64_t step);
  std::string path_;
  bool append_;
  std::unique_ptr<MetricsLog> log_;  // null while the file cannot be opened
  int64_t lost_ = 0;  // lines left out since the last one written
};

// <output>/tensorboard: scalars flushed after every record.
class TensorBoardSink : public LogSink {
 public:
  explicit TensorBoardSink(const std::string& dir);
  ~TensorBoardSink() override;
  void train(const TrainRecord& r) override;
  void validation(const ValidationRecord& r) override;

 private:
  void flush(int64_t step);
  bool open();  // the writer, made now if it could not be before
  std::string dir_;
  std::unique_ptr<TensorBoardWriter> tb_;  // null while the file cannot be made
  int64_t lost_ = 0;
};

class LogSinks {
 public:
  void add(std::unique_ptr<LogSink> sink) { sinks_.push_back(std::move(sink)); }
  void progress(int64_t step, int64_t last_step) {
    for (auto& s : sinks_) s->progress(step, last_step);
  }
  void train(const TrainRecord& r) {
    for (auto& s : sinks_) s->train(r);
  }
  void validation(const ValidationRecord& r) {
    for (auto& s : sinks_) s->validation(r);
  }
  void checkpoint(const CheckpointRecord& r) {
    for (auto& s : sinks_) s->checkpoint(r);
  }

 private:
  std::vector<std::unique_ptr<LogSink>> sinks_;
};

// "1h02m03s", "4m05s", "?" for a negative or infinite duration.
std::string format_duration(double seconds);

}  // namespace faceshard
