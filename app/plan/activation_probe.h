// Measures what a backbone's training step takes per image: the peak of the tensor bytes
// allocated during forward + backward (AllocationMeter) at two or more batch sizes, on the
// CPU. The slope between the smallest and the largest batch is the activation memory per
// image (what faceshard-plan multiplies by the batch); the intercept is what does not grow
// with the batch (the weights' gradients, half-precision copies of the weights).
// faceshard-bench --mode activations runs it for every network x precision x
// checkpointing and writes app/plan/activations.json.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "models/backbone.h"

namespace faceshard {

struct ActivationMeasurement {
  std::string network;
  BodyPrecision precision = BodyPrecision::Float32;
  bool checkpointing = false;
  int64_t parameters = 0;            // trainable parameters of the network
  std::vector<int64_t> batches;      // the batch sizes measured, ascending
  std::vector<double> peak_bytes;    // per batch: peak tensor bytes of forward + backward above what lived before
  double bytes_per_image = 0;        // slope of peak_bytes between the first and the last batch
  double fixed_bytes = 0;            // intercept: peak_bytes[0] - bytes_per_image * batches[0]
  double seconds = 0;                // wall time of the measurement
};

// Builds `network` (embedding 512, train mode, the given precision and checkpointing; an
// option_error when the network has no such setting) and measures one forward + backward
// of random 112x112 images at each batch (at least two distinct sizes, each >= 2: BatchNorm
// needs two values per channel) after one warm-up pass. Installs the AllocationMeter.
ActivationMeasurement measure_activations(const std::string& network, BodyPrecision precision, bool checkpointing,
                                          std::vector<int64_t> batches, int64_t embedding_size = 512);

}  // namespace faceshard
