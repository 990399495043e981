// A learnable synthetic face data set for the demo and the end-to-end tests: each identity
// is a distinct structured face-like drawing, each image a perturbed view of it (shift,
// rotation, brightness, noise, blur), JPEG-encoded, written as .rec/.idx plus a .bin.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <opencv2/core.hpp>

namespace faceshard {

struct SynthFaceOptions {
  int image_size = 112;
  double max_shift = 4.0;        // pixels
  double max_rotation = 8.0;     // degrees
  double max_scale = 0.05;       // relative
  double max_brightness = 0.15;  // relative gain and offset
  double noise_std = 5.0;        // pixel units
  double blur_prob = 0.3;
  int jpeg_quality = 90;
};

class SyntheticFaces {
 public:
  explicit SyntheticFaces(uint64_t seed, SynthFaceOptions options = {});
  // The canonical face of an identity (BGR), a function of (seed, identity) only.
  cv::Mat identity_image(uint64_t identity) const;
  // View `view` of the identity: the canonical face, randomly perturbed (deterministic).
  cv::Mat view(uint64_t identity, uint64_t view) const;
  std::vector<uint8_t> view_jpeg(uint64_t identity, uint64_t view) const;

 private:
  uint64_t seed_;
  SynthFaceOptions opt_;
};

struct SynthDatasetSpec {
  uint64_t identities = 100;          // training classes 0..identities-1
  uint64_t images_per_identity = 20;
  uint64_t holdout_identities = 20;   // used only in the verification pairs
  uint64_t pairs = 200;               // verification pairs (half same, half different)
  uint64_t seed = 0;
  std::string bin_name = "synth";     // <out_dir>/<bin_name>.bin
  SynthFaceOptions face;
};

// Writes <out_dir>/train.rec, train.idx (insightface layout) and <bin_name>.bin; creates
// out_dir when missing. Each file appears under its final name only when complete.
void write_synthetic_dataset(const std::string& out_dir, const SynthDatasetSpec& spec);

}  // namespace faceshard
