// The training data loader: a pool of worker threads that read, decode, augment and
// normalise whole batches (into pinned memory when the target is a GPU), a bounded
// prefetch queue that hands batches out in order, and the copy to the GPU on a side stream.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <vector>

#include <torch/torch.h>

#include "data/dataset.h"
#include "data/image_transform.h"
#include "data/sampler.h"

namespace faceshard {

struct LoaderOptions {
  int64_t batch_size = 128;      // per rank
  int num_workers = 2;           // decoding threads
  int prefetch_batches = 4;      // bound on batches decoded ahead of the consumer
  int image_size = 112;          // every image must be image_size x image_size
  bool flip = true;              // random horizontal flip, p = 0.5
  ExtraAugment extra;            // off by default
  uint64_t seed = 0;             // flips and extras are a function of (seed, epoch, sample index)
  double max_bad_fraction = 0.01;  // stop when more than this fraction of the rank's epoch share is bad
  int64_t num_classes = -1;      // labels must lie in [0, num_classes) when >= 0
  torch::Device device = torch::kCPU;
  bool pin_memory = true;        // pinned host batches (only used for a CUDA device)
};

struct Batch {
  torch::Tensor images;  // [B, 3, H, W] float32, normalised RGB, on the loader's device
  torch::Tensor labels;  // [B] int64 class ids, on the CPU (the classifier reads them on the host)
  uint64_t epoch = 0;
  uint64_t index = 0;    // batch index within the epoch
};

class DataLoader {
 public:
  DataLoader(std::shared_ptr<const Dataset> dataset, DistributedSampler sampler, LoaderOptions options);
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  // Full batches per epoch on this rank (the last partial batch is dropped).
  uint64_t batches_per_epoch() const { return sampler_.size() / uint64_t(opt_.batch_size); }
  // Starts epoch `epoch` at batch `start_batch` (resume); abandons any unfinished epoch.
  void start_epoch(uint64_t epoch, uint64_t start_batch = 0);
  // The next batch of the current epoch in order, or nullopt when the epoch is done.
  // Rethrows the first error of a worker (a faceshard::Error naming the sample).
  std::optional<Batch> next();

  // Samples that failed to read or decode and were replaced (distinct data-set indices).
  uint64_t bad_samples() const;
  // Workers blocked for want of a batch they may build (0 while any batch is being built):
  // when it equals num_workers, nothing more is read until next() frees a prefetch slot.
  int idle_workers() const;
  const LoaderOptions& options() const { return opt_; }
  const Dataset& dataset() const { return *dataset_; }

 private:
  void worker_loop();
  void build_batch(uint64_t epoch, uint64_t b, const std::vector<uint64_t>& order, Batch& out);
  void load_sample(uint64_t epoch, uint64_t pos, const std::vector<uint64_t>& order, float* dst, int64_t* label);
  bool fill_one(uint64_t index, uint64_t epoch, float* dst, int64_t* label, std::string* error);
  void note_bad(uint64_t epoch, uint64_t index, const std::string& error);
  Batch to_device(Batch b);

  std::shared_ptr<const Dataset> dataset_;
  DistributedSampler sampler_;
  LoaderOptions opt_;

  mutable std::mutex mu_;
  std::condition_variable work_cv_;   // workers wait for claimable batches
  std::condition_variable ready_cv_;  // the consumer waits for the next batch
  std::vector<std::thread> workers_;
  bool stop_ = false;
  bool active_ = false;
  uint64_t generation_ = 0;  // bumped per epoch start; stale results are dropped
  uint64_t epoch_ = 0;
  std::shared_ptr<const std::vector<uint64_t>> order_;  // this rank's indices for the epoch
  uint64_t end_batch_ = 0;
  uint64_t next_claim_ = 0;   // next batch a worker will build
  uint64_t next_out_ = 0;     // next batch next() returns
  int in_flight_ = 0;
  int idle_workers_ = 0;
  std::map<uint64_t, Batch> ready_;
  std::exception_ptr error_;

  mutable std::mutex bad_mu_;
  std::set<uint64_t> bad_;        // every distinct bad index seen (reported)
  std::set<uint64_t> epoch_bad_;  // distinct bad indices of epoch bad_epoch_ (the limit)
  uint64_t bad_epoch_ = 0;
};

}  // namespace faceshard
