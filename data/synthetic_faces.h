// A learnable synthetic face data set for the demo and the end-to-end tests: each identity
// is a distinct structured face-like drawing, each image a perturbed view of it (shift,
// rotation, scale, brightness and colour cast, noise, blur) in front of a background of its
// own, JPEG-encoded, written as .rec/.idx plus a .bin.
//
// The data set is made so that raw pixels do not solve verification: identities come in
// families that share skin, hair, eye and lip colours and differ only in the geometry of
// the face (shape, eyes, brows, glasses, nose, mouth, beard, marks, hair line); every view has its own
// random background; and the different-identity pairs of the .bin are siblings of one
// family. An untrained network therefore scores near chance on the pairs, and a trained
// one must have learnt the face geometry.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <opencv2/core.hpp>

namespace faceshard {

struct SynthFaceOptions {
  int image_size = 112;
  double max_shift = 4.0;        // pixels (at 112 px)
  double max_rotation = 8.0;     // degrees
  double max_scale = 0.06;       // relative
  double max_brightness = 0.2;   // relative gain and offset
  double max_color_cast = 0.12;  // relative per-channel gain
  double noise_std = 5.0;        // pixel units
  double blur_prob = 0.3;
  int family_size = 4;           // identities per colour family (1: every identity its own)
  int jpeg_quality = 90;
};

class SyntheticFaces {
 public:
  explicit SyntheticFaces(uint64_t seed, SynthFaceOptions options = {});
  // The canonical face of an identity (BGR) on a plain grey background, a function of
  // (seed, identity) only. Identities i and j are siblings when i / family_size ==
  // j / family_size.
  cv::Mat identity_image(uint64_t identity) const;
  // View `view` of the identity: the canonical face in front of a random background,
  // randomly perturbed (deterministic in (seed, identity, view)).
  cv::Mat view(uint64_t identity, uint64_t view) const;
  std::vector<uint8_t> view_jpeg(uint64_t identity, uint64_t view) const;

 private:
  // Draws the face of `identity` onto a 112x112 image.
  void draw_face(uint64_t identity, cv::Mat& img) const;

  uint64_t seed_;
  SynthFaceOptions opt_;
};

struct SynthDatasetSpec {
  uint64_t identities = 100;          // training classes 0..identities-1
  uint64_t images_per_identity = 20;
  uint64_t holdout_identities = 20;   // used only in the verification pairs
  uint64_t pairs = 200;               // verification pairs (half same, half different siblings)
  uint64_t seed = 0;
  std::string bin_name = "synth";     // <out_dir>/<bin_name>.bin
  SynthFaceOptions face;
};

// Writes <out_dir>/train.rec, train.idx (insightface layout) and <bin_name>.bin; creates
// out_dir when missing. Each file appears under its final name only when complete.
void write_synthetic_dataset(const std::string& out_dir, const SynthDatasetSpec& spec);

}  // namespace faceshard
