// faceshard-synth: writes the embedded synthetic face data set (train.rec/.idx in
// insightface's layout plus a verification .bin of held-out identities) in seconds.
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "data/insightface_rec.h"
#include "data/synthetic_faces.h"
#include "partial_fc/runtime/error.h"
#include "partial_fc/runtime/progress.h"

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
    "  --scale N:C         instead: only train.rec/.idx of N images over C identities in\n"
    "                      insightface's layout (image i has class i*C/N), each image a\n"
    "                      --payload-bytes placeholder: data sets of real size (Glint360K:\n"
    "                      17091657:360232, WebFace42M: 42474558:2059906) to measure opening\n"
    "  --payload-bytes B   placeholder size with --scale (default 1)\n"
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
    std::string out, scale;
    uint64_t payload_bytes = 1;
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
      else if (a == "--scale") scale = v;
      else if (a == "--payload-bytes") payload_bytes = parse_count(a, v, 1, 1 << 20);
      else throw faceshard::usage_error("unknown option '", a, "' (see --help)");
    }
    if (out.empty()) throw faceshard::usage_error("--output is required (see --help)");
    if (spec.bin_name.empty() || spec.bin_name.find('/') != std::string::npos) {
      throw faceshard::usage_error("--bin-name: expected a plain file name, got '", spec.bin_name, "'");
    }
    const auto t0 = std::chrono::steady_clock::now();
    if (!scale.empty()) {
      const size_t colon = scale.find(':');
      if (colon == std::string::npos) throw faceshard::usage_error("--scale: expected N:C, got '", scale, "'");
      const uint64_t n = parse_count("--scale images", scale.substr(0, colon), 1, uint64_t(1) << 36);
      const uint64_t c = parse_count("--scale identities", scale.substr(colon + 1), 1, (uint64_t(1) << 24) - 1);
      std::error_code ec;
      std::filesystem::create_directories(out, ec);
      faceshard::InsightFaceRecWriter w(out + "/train.rec", out + "/train.idx");
      const std::vector<uint8_t> payload(payload_bytes, 0xd8);
      {
        faceshard::Progress progress("writing", n, "images");
        for (uint64_t i = 0; i < n; ++i) {
          w.add(int64_t(static_cast<unsigned __int128>(i) * c / n), payload);
          if ((i & 4095) == 4095 || i + 1 == n) progress.update(i + 1);
        }
      }
      w.commit(int64_t(c));
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::printf("faceshard-synth: %s: %llu images of %llu identities (%llu-byte placeholders) -> train.rec/train.idx "
                  "(%.1f s)\n", out.c_str(), (unsigned long long)n, (unsigned long long)c,
                  (unsigned long long)payload_bytes, s);
      return 0;
    }
    faceshard::write_synthetic_dataset(out, spec);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("faceshard-synth: %s: %llu identities x %llu images -> train.rec/train.idx", out.c_str(),
                (unsigned long long)spec.identities, (unsigned long long)spec.images_per_identity);
    if (spec.pairs > 0) std::printf(", %llu pairs -> %s.bin", (unsigned long long)spec.pairs, spec.bin_name.c_str());
    std::printf(" (%.2f s)\n", s);
    return 0;
  });
}
