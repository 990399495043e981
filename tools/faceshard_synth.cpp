// faceshard-synth: writes the embedded synthetic face data set (train.rec/.idx in
// insightface's layout plus a verification .bin of held-out identities) in seconds.
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "data/synthetic_faces.h"
#include "partial_fc/runtime/error.h"

namespace {

const char* kUsage =
    "usage: faceshard-synth --output DIR [options]\n"
    "Writes DIR/train.rec, DIR/train.idx and DIR/<bin-name>.bin: a learnable synthetic face\n"
    "data set (each identity a structured face-like pattern, each image a perturbed view).\n"
    "  --output DIR        output folder (created when missing)\n"
    "  --identities N      training identities (default 100)\n"
    "  --images M          images per identity (default 20)\n"
    "  --holdout K         held-out identities for the verification pairs (default 20)\n"
    "  --pairs P           verification pairs, half same / half different (default 200; 0: no .bin)\n"
    "  --seed S            generator seed (default 0)\n"
    "  --size PX           image size (default 112)\n"
    "  --quality Q         JPEG quality 1-100 (default 90)\n"
    "  --bin-name NAME     verification set name (default synth)\n"
    "  --help              this text\n";

uint64_t parse_count(const std::string& flag, const std::string& v, uint64_t lo, uint64_t hi) {
  char* end = nullptr;
  errno = 0;
  const unsigned long long x = std::strtoull(v.c_str(), &end, 10);
  if (v.empty() || v[0] == '-' || *end != '\0' || errno != 0 || x < lo || x > hi) {
    throw faceshard::usage_error(flag, ": expected an integer in [", lo, ", ", hi, "], got '", v, "'");
  }
  return x;
}

}  // namespace

int main(int argc, char** argv) {
  return faceshard::run_main("faceshard-synth", [&]() -> int {
    faceshard::SynthDatasetSpec spec;
    std::string out;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--help" || a == "-h") {
        std::fputs(kUsage, stdout);
        return 0;
      }
      if (a.rfind("--", 0) != 0) throw faceshard::usage_error("unexpected argument '", a, "' (see --help)");
      if (i + 1 >= argc) throw faceshard::usage_error(a, ": missing value (see --help)");
      const std::string v = argv[++i];
      if (a == "--output") out = v;
      else if (a == "--identities") spec.identities = parse_count(a, v, 1, 1000000);
      else if (a == "--images") spec.images_per_identity = parse_count(a, v, 1, 100000);
      else if (a == "--holdout") spec.holdout_identities = parse_count(a, v, 0, 1000000);
      else if (a == "--pairs") spec.pairs = parse_count(a, v, 0, 10000000);
      else if (a == "--seed") spec.seed = parse_count(a, v, 0, UINT64_MAX);
      else if (a == "--size") spec.face.image_size = int(parse_count(a, v, 16, 1024));
      else if (a == "--quality") spec.face.jpeg_quality = int(parse_count(a, v, 1, 100));
      else if (a == "--bin-name") spec.bin_name = v;
      else throw faceshard::usage_error("unknown option '", a, "' (see --help)");
    }
    if (out.empty()) throw faceshard::usage_error("--output is required (see --help)");
    if (spec.bin_name.empty() || spec.bin_name.find('/') != std::string::npos) {
      throw faceshard::usage_error("--bin-name: expected a plain file name, got '", spec.bin_name, "'");
    }
    const auto t0 = std::chrono::steady_clock::now();
    faceshard::write_synthetic_dataset(out, spec);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("faceshard-synth: %s: %llu identities x %llu images -> train.rec/train.idx", out.c_str(),
                (unsigned long long)spec.identities, (unsigned long long)spec.images_per_identity);
    if (spec.pairs > 0) std::printf(", %llu pairs -> %s.bin", (unsigned long long)spec.pairs, spec.bin_name.c_str());
    std::printf(" (%.2f s)\n", s);
    return 0;
  });
}
