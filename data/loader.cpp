#include "data/loader.h"

#include <cmath>
#include <filesystem>

#include "data/seed_mix.h"
#include "base/error.h"
#include "base/log.h"

#ifdef FACESHARD_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace faceshard {

namespace {
// A replacement draw never repeats the failed position; a few tries cover scattered bad
// records, while a run of failures means the data set itself is broken.
constexpr int kReplaceTries = 16;

// What the user runs to list every bad sample of this kind of source at once.
std::string list_bad_samples_hint(const Dataset& d) {
  if (const auto* rec = dynamic_cast<const RecordIODataset*>(&d))
    return "List every bad record with faceshard-pack verify " + rec->records().file().path() +
           " --decode (or repack with pack --skip-bad), or raise data.max_bad_fraction";
  if (const auto* folder = dynamic_cast<const ImageFolderDataset*>(&d)) {
    // root/<identity>/<image>: the image folder is two levels up from any of its files.
    const std::string root = folder->size() ? std::filesystem::path(folder->path(0)).parent_path().parent_path().string()
                                            : std::string("FOLDER");
    return "List every bad image with faceshard-pack pack " + root +
           " OUT --decode (it lists them all and writes nothing while any is bad), then fix or remove them, or "
           "raise data.max_bad_fraction";
  }
  return "Raise data.max_bad_fraction to tolerate them";
}
}  // namespace

DataLoader::DataLoader(std::shared_ptr<const Dataset> dataset, DistributedSampler sampler, LoaderOptions options)
    : dataset_(std::move(dataset)), sampler_(std::move(sampler)), opt_(std::move(options)) {
  if (opt_.batch_size <= 0) throw usage_error("loader: batch_size must be positive, got ", opt_.batch_size);
  if (opt_.num_workers <= 0) throw usage_error("loader: num_workers must be positive, got ", opt_.num_workers);
  if (opt_.prefetch_batches <= 0) opt_.prefetch_batches = 1;
  if (opt_.image_size <= 0) throw usage_error("loader: image_size must be positive");
  if (!(opt_.max_bad_fraction >= 0.0 && opt_.max_bad_fraction <= 1.0)) {
    throw usage_error("loader: max_bad_fraction must be in [0, 1], got ", opt_.max_bad_fraction);
  }
  if (dataset_->raw_pixels() && dataset_->raw_size() != opt_.image_size) {
    throw usage_error("loader: synthetic images are ", dataset_->raw_size(), " px, expected ", opt_.image_size);
  }
  if (opt_.num_classes >= 0 && dataset_->num_classes() > opt_.num_classes) {
    throw usage_error("loader: the data set has ", dataset_->num_classes(), " classes but num_classes is ",
                      opt_.num_classes);
  }
#ifndef FACESHARD_WITH_CUDA
  if (opt_.device.is_cuda()) throw usage_error("loader: a CUDA device was asked for, but faceshard was built without CUDA");
#endif
  if (batches_per_epoch() == 0) {
    throw usage_error("loader: ", sampler_.size(), " samples per rank are fewer than one batch of ", opt_.batch_size);
  }
  for (int i = 0; i < opt_.num_workers; ++i) workers_.emplace_back([this] { worker_loop(); });
}

DataLoader::~DataLoader() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void DataLoader::start_epoch(uint64_t epoch, uint64_t start_batch) {
  if (start_batch > batches_per_epoch()) {
    throw usage_error("loader: resume batch ", start_batch, " is past the epoch's ", batches_per_epoch(), " batches");
  }
  auto order = std::make_shared<const std::vector<uint64_t>>(sampler_.indices(epoch));
  std::unique_lock<std::mutex> lk(mu_);
  // Workers still building a batch of the old epoch finish first; their results are dropped.
  ++generation_;
  ready_cv_.wait(lk, [&] { return in_flight_ == 0; });
  ready_.clear();
  error_ = nullptr;
  epoch_ = epoch;
  order_ = std::move(order);
  end_batch_ = batches_per_epoch();
  next_claim_ = next_out_ = start_batch;
  active_ = true;
  lk.unlock();
  work_cv_.notify_all();
}

int DataLoader::idle_workers() const {
  std::lock_guard<std::mutex> lk(mu_);
  return in_flight_ == 0 ? idle_workers_ : 0;
}

std::optional<Batch> DataLoader::next() {
  std::unique_lock<std::mutex> lk(mu_);
  if (!active_) throw usage_error("loader: next() before start_epoch()");
  if (next_out_ >= end_batch_) return std::nullopt;
  ready_cv_.wait(lk, [&] { return error_ || ready_.count(next_out_) != 0; });
  if (error_) {
    std::exception_ptr e = error_;
    active_ = false;
    ++generation_;
    lk.unlock();
    work_cv_.notify_all();
    std::rethrow_exception(e);
  }
  auto it = ready_.find(next_out_);
  Batch b = std::move(it->second);
  ready_.erase(it);
  ++next_out_;
  lk.unlock();
  work_cv_.notify_all();  // a prefetch slot is free
  return to_device(std::move(b));
}

uint64_t DataLoader::bad_samples() const {
  std::lock_guard<std::mutex> lk(bad_mu_);
  return bad_.size();
}

void DataLoader::worker_loop() {
  while (true) {
    std::unique_lock<std::mutex> lk(mu_);
    while (!(stop_ || (active_ && !error_ && next_claim_ < end_batch_ &&
                       next_claim_ < next_out_ + uint64_t(opt_.prefetch_batches)))) {
      ++idle_workers_;
      work_cv_.wait(lk);
      --idle_workers_;
    }
    if (stop_) return;
    const uint64_t b = next_claim_++;
    const uint64_t gen = generation_;
    const uint64_t epoch = epoch_;
    std::shared_ptr<const std::vector<uint64_t>> order = order_;
    ++in_flight_;
    lk.unlock();

    Batch batch;
    std::exception_ptr err;
    try {
      build_batch(epoch, b, *order, batch);
    } catch (...) {
      err = std::current_exception();
    }

    lk.lock();
    --in_flight_;
    if (gen == generation_) {
      if (err) {
        if (!error_) error_ = err;
      } else {
        ready_.emplace(b, std::move(batch));
      }
    }
    lk.unlock();
    ready_cv_.notify_all();
  }
}

void DataLoader::build_batch(uint64_t epoch, uint64_t b, const std::vector<uint64_t>& order, Batch& out) {
  const int64_t B = opt_.batch_size, S = opt_.image_size;
  auto fopts = torch::TensorOptions().dtype(torch::kFloat32);
  auto lopts = torch::TensorOptions().dtype(torch::kInt64);
  if (opt_.device.is_cuda() && opt_.pin_memory) {
    // Pinned host memory lets the copy to the GPU run asynchronously (DMA).
    fopts = fopts.pinned_memory(true);
    lopts = lopts.pinned_memory(true);
  }
  out.images = torch::empty({B, 3, S, S}, fopts);
  out.labels = torch::empty({B}, lopts);
  out.epoch = epoch;
  out.index = b;
  float* img = out.images.data_ptr<float>();
  int64_t* lab = out.labels.data_ptr<int64_t>();
  const size_t per_image = size_t(3) * S * S;
  for (int64_t i = 0; i < B; ++i) {
    load_sample(epoch, b * uint64_t(B) + uint64_t(i), order, img + size_t(i) * per_image, lab + i);
  }
}

void DataLoader::load_sample(uint64_t epoch, uint64_t pos, const std::vector<uint64_t>& order, float* dst,
                             int64_t* label) {
  std::string error;
  uint64_t index = order[pos];
  if (fill_one(index, epoch, dst, label, &error)) return;
  note_bad(epoch, index, error);
  std::mt19937_64 g(seed_mix(seed_mix(opt_.seed ^ 0x5eed) ^ seed_mix(epoch) ^ index));
  for (int t = 0; t < kReplaceTries; ++t) {
    const uint64_t alt = order[g() % order.size()];
    if (alt == index) continue;
    if (fill_one(alt, epoch, dst, label, &error)) return;
    note_bad(epoch, alt, error);
  }
  throw runtime_error("loader: ", kReplaceTries, " replacement samples in a row failed to load; last: ", error);
}

bool DataLoader::fill_one(uint64_t index, uint64_t epoch, float* dst, int64_t* label,
                          std::string* error) {
  thread_local RawSample sample;
  const int S = opt_.image_size;
  // Augmentation draws depend on (seed, epoch, sample) only, so the batches depend neither
  // on the number of workers or thread timing nor on the rank or the number of ranks.
  std::mt19937_64 rng(seed_mix(seed_mix(opt_.seed) ^ seed_mix(epoch + 0x100000000ull) ^ index));
  const bool flip = opt_.flip && (rng() & 1);
  cv::Mat bgr;
  // Only unreadable or undecodable samples are replaced; a LabelError (a mislabelled data
  // set) propagates and stops the run. Sample names are built on the error path only.
  try {
    dataset_->read(index, sample);
  } catch (const LabelError&) {
    throw;
  } catch (const Error& e) {
    *error = e.what();
    return false;
  } catch (const std::exception& e) {
    *error = detail::concat(dataset_->describe(index), ": ", e.what());
    return false;
  }
  if (!dataset_->raw_pixels()) {
    // The header first: an image over the decoders' limits (a decompression bomb) is a bad
    // record like any that does not decode; one of another size stops the run (below)
    // without being decoded.
    EncodedImageHeader header;
    try {
      header = read_image_header(sample.bytes.data(), sample.bytes.size(), "");  // message starts ": ..."
    } catch (const Error& e) {
      *error = dataset_->describe(index) + e.what();
      return false;
    }
    if (header.decoded_width() != S || header.decoded_height() != S) {
      throw runtime_error(dataset_->describe(index), ": image is ", header.decoded_width(), "x",
                          header.decoded_height(), ", expected ", S, "x", S,
                          " (faces must be aligned and cropped to the network input size)");
    }
    try {
      bgr = decode_image(sample.bytes.data(), sample.bytes.size(), header, "");
    } catch (const Error& e) {
      *error = dataset_->describe(index) + e.what();
      return false;
    } catch (const std::exception& e) {
      *error = detail::concat(dataset_->describe(index), ": ", e.what());
      return false;
    }
  }
  if (opt_.num_classes >= 0 && (sample.label < 0 || sample.label >= opt_.num_classes)) {
    throw runtime_error(dataset_->describe(index), ": label ", sample.label, " is out of range [0, ", opt_.num_classes,
                        ")");
  }
  *label = sample.label;
  if (dataset_->raw_pixels()) {
    rgb_to_normalized_chw(sample.bytes.data(), S, S, flip, dst);
    return true;
  }
  if (opt_.extra.any()) apply_extra_augment(bgr, opt_.extra, rng);
  bgr_to_normalized_chw(bgr, flip, dst);
  return true;
}

void DataLoader::note_bad(uint64_t epoch, uint64_t index, const std::string& error) {
  std::lock_guard<std::mutex> lk(bad_mu_);
  if (epoch != bad_epoch_) {
    bad_epoch_ = epoch;
    epoch_bad_.clear();
  }
  const bool new_in_epoch = epoch_bad_.insert(index).second;
  // This rank reads only its sampler share (1/world of the data set) per epoch, so the
  // limit is a fraction of that share; counting the whole data set would let a rank
  // accept world times too many bad samples.
  const double limit = opt_.max_bad_fraction * double(sampler_.size());
  if (new_in_epoch && double(epoch_bad_.size()) > limit) {
    // The error names this sample: no warning line before it.
    throw runtime_error("loader: ", epoch_bad_.size(), " of this rank's ", sampler_.size(), " samples in epoch ",
                        epoch, " failed to load, more than data.max_bad_fraction = ", opt_.max_bad_fraction,
                        " allows; last: ", error, ". ", list_bad_samples_hint(*dataset_));
  }
  if (bad_.insert(index).second) {  // logged once per record
    log_warn("loader: skipping a bad sample (", error, "); replaced by another sample");
  }
}

Batch DataLoader::to_device(Batch b) {
  if (!opt_.device.is_cuda()) return b;
#ifdef FACESHARD_WITH_CUDA
  // Copy on a side stream so the transfer overlaps with compute queued on the current
  // stream; the current stream then waits for the copy (an event, not a host sync).
  const c10::cuda::CUDAGuard guard(opt_.device);
  const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(opt_.device.index());
  thread_local std::optional<c10::cuda::CUDAStream> side;
  if (!side || side->device_index() != current.device_index()) {
    side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, current.device_index());
  }
  Batch out;
  out.epoch = b.epoch;
  out.index = b.index;
  {
    const c10::cuda::CUDAStreamGuard sg(*side);
    out.images = b.images.to(opt_.device, /*non_blocking=*/true);
  }
  out.labels = b.labels;  // host data: their only reader, the classifier, works on the host
  at::cuda::CUDAEvent done;
  done.record(*side);
  done.block(current);
  // The device memory was allocated on the side stream but is used on the current one.
  c10::cuda::CUDACachingAllocator::recordStream(out.images.storage().data_ptr(), current);
  return out;
#else
  throw usage_error("loader: CUDA device without CUDA support");
#endif
}

}  // namespace faceshard
