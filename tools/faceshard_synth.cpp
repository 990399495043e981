// faceshard-synth: writes the embedded synthetic face data set (train.rec/.idx in
// insightface's layout plus a verification .bin of held-out identities) in seconds; with
// --noise-* options, a training set with known label noise and the truth about it, to
// measure faceshard-clean (tools/clean_eval.py).
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "data/dataset.h"
#include "data/insightface_rec.h"
#include "data/seed_mix.h"
#include "data/synthetic_faces.h"
#include "base/error.h"
#include "base/progress.h"
#include "base/tool_args.h"

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
    "Label noise (any of them, with --truth): train.rec holds the noisy set, the truth is\n"
    "written as TSVs named as faceshard-clean's reports (deterministic in --seed):\n"
    "  --noise-mislabel F  this fraction of the images filed under a random other identity\n"
    "  --noise-split F     this fraction of the identities split: half their images under a new\n"
    "                      label (numbered after the identities)\n"
    "  --noise-duplicate F this fraction of the images stored twice (bytes identical, same label)\n"
    "  --noise-overlap N   N training identities and N held-out ones (at most --holdout) in\n"
    "                      DIR/test_identities/ (one sub-folder each; views not in train.rec)\n"
    "  --noise-overlap-images K  images per test identity (default 5)\n"
    "  --truth DIR         the truth: images.tsv, mislabeled.tsv, duplicate_identities.tsv,\n"
    "                      overlap.tsv, near_duplicates.tsv\n"
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

double parse_fraction(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  errno = 0;
  const double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0' || errno != 0 || !(x >= 0 && x <= 1)) {
    throw faceshard::usage_error(flag, ": expected a fraction in [0, 1], got '", v, "'");
  }
  return x;
}

struct NoiseSpec {
  double mislabel = 0, split = 0, duplicate = 0;
  uint64_t overlap = 0, overlap_images = 5;
  std::string truth;
  bool any() const { return mislabel > 0 || split > 0 || duplicate > 0 || overlap > 0; }
};

// The noise's own generator: a splitmix64 stream, so that the same seed gives the same
// noise with any standard library (std::shuffle and the std distributions are not portable).
struct NoiseRng {
  uint64_t s;
  uint64_t next() { return faceshard::seed_mix(s += 0x9e3779b97f4a7c15ull); }
  uint64_t below(uint64_t n) { return next() % n; }
  template <class T>
  void shuffle(std::vector<T>& v) {
    for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[size_t(below(i))]);
  }
};

enum class Noise { clean, mislabeled, split, copy };
const char* noise_name(Noise n) {
  switch (n) {
    case Noise::mislabeled: return "mislabeled";
    case Noise::split: return "split";
    case Noise::copy: return "copy";
    default: return "clean";
  }
}

struct NoisyImage {
  uint64_t identity, view;  // the clean set's image identity * images + view
  int64_t label;            // the label it is stored under
  Noise noise = Noise::clean;
  int64_t copy_of = -1;     // for a copy: the entry it copies
  int64_t index = -1;       // its index in the noisy train.rec
};

std::ofstream open_truth(const std::string& dir, const std::string& name, const std::string& columns,
                         const std::string& what) {
  std::ofstream f(dir + "/" + name);
  if (!f) throw faceshard::usage_error("--truth: cannot write '", dir, "/", name, "'");
  f << "# " << what << "\n" << columns << "\n";
  return f;
}

// Writes the clean set (spec) to a scratch folder, then DIR/train.rec from its images with
// the noise of `noise`, DIR/<bin> (held-out identities, untouched), DIR/test_identities/
// and the truth. Every choice is drawn from the seed.
void write_noisy_dataset(const std::string& out, const faceshard::SynthDatasetSpec& spec, const NoiseSpec& noise) {
  namespace fs = std::filesystem;
  const uint64_t ids = spec.identities, per = spec.images_per_identity, n_img = ids * per;
  const uint64_t n_split = uint64_t(std::llround(noise.split * double(ids)));
  const uint64_t n_mis = uint64_t(std::llround(noise.mislabel * double(n_img)));
  const uint64_t n_dup = uint64_t(std::llround(noise.duplicate * double(n_img)));
  if (n_split + noise.overlap > ids)
    throw faceshard::usage_error("--noise-split and --noise-overlap: ", n_split, " + ", noise.overlap,
                                 " identities, more than the ", ids, " there are");
  if (n_split > 0 && per < 2) throw faceshard::usage_error("--noise-split: needs at least 2 images per identity");
  if (n_mis > 0 && ids < 2) throw faceshard::usage_error("--noise-mislabel: needs at least 2 identities");
  std::error_code ec;
  fs::create_directories(out, ec);
  fs::create_directories(noise.truth, ec);
  if (!fs::is_directory(noise.truth)) throw faceshard::usage_error("--truth: cannot create folder '", noise.truth, "'");
  NoiseRng rng{faceshard::seed_mix(spec.seed ^ 0x6e6f697365ull)};

  // Which identities overlap the test identities and which are split (disjoint).
  std::vector<uint64_t> order(ids);
  for (uint64_t i = 0; i < ids; ++i) order[i] = i;
  rng.shuffle(order);
  const std::vector<uint64_t> overlap_ids(order.begin(), order.begin() + int64_t(noise.overlap));
  const std::vector<uint64_t> split_ids(order.begin() + int64_t(noise.overlap),
                                        order.begin() + int64_t(noise.overlap + n_split));
  std::vector<NoisyImage> img;
  img.reserve(n_img + n_dup);
  for (uint64_t id = 0; id < ids; ++id)
    for (uint64_t v = 0; v < per; ++v) img.push_back({id, v, int64_t(id)});
  std::vector<uint64_t> own(ids, per);  // images each identity keeps under its own label
  for (size_t j = 0; j < split_ids.size(); ++j) {
    std::vector<uint64_t> views(per);
    for (uint64_t v = 0; v < per; ++v) views[v] = v;
    rng.shuffle(views);
    const uint64_t id = split_ids[j];
    for (uint64_t v = 0; v < per / 2; ++v) {
      NoisyImage& m = img[size_t(id * per + views[v])];
      m.label = int64_t(ids + j), m.noise = Noise::split;
    }
    own[id] -= per / 2;
  }
  // Mislabeled: each identity keeps a majority of its own images under its label, so that
  // its label still means it.
  std::vector<uint64_t> cand;
  for (uint64_t i = 0; i < n_img; ++i)
    if (img[i].noise == Noise::clean) cand.push_back(i);
  rng.shuffle(cand);
  std::vector<uint64_t> moved(ids, 0);
  uint64_t mis = 0;
  for (size_t c = 0; c < cand.size() && mis < n_mis; ++c) {
    NoisyImage& m = img[size_t(cand[c])];
    if (2 * (moved[m.identity] + 1) >= own[m.identity]) continue;
    uint64_t to = rng.below(ids - 1);
    if (to >= m.identity) ++to;
    m.label = int64_t(to), m.noise = Noise::mislabeled;
    ++moved[m.identity], ++mis;
  }
  if (mis < n_mis)
    throw faceshard::usage_error("--noise-mislabel: at most ", mis, " of the ", n_img,
                                 " images can be moved while every identity keeps a majority of its own");
  // Copies of images that are not mislabeled (a copy of a mislabeled image is both).
  cand.clear();
  for (uint64_t i = 0; i < n_img; ++i)
    if (img[i].noise != Noise::mislabeled) cand.push_back(i);
  if (n_dup > cand.size())
    throw faceshard::usage_error("--noise-duplicate: ", n_dup, " copies, more than the ", cand.size(),
                                 " images that are not mislabeled");
  rng.shuffle(cand);
  for (uint64_t c = 0; c < n_dup; ++c) {
    NoisyImage copy = img[size_t(cand[c])];
    copy.noise = Noise::copy, copy.copy_of = int64_t(cand[c]);
    img.push_back(copy);
  }
  // Stored class by class (insightface's layout), each class's images in a random order.
  const int64_t classes = int64_t(ids + n_split);
  std::vector<std::vector<int64_t>> by_label(static_cast<size_t>(classes));
  for (size_t i = 0; i < img.size(); ++i) by_label[size_t(img[i].label)].push_back(int64_t(i));
  int64_t next = 0;
  for (auto& members : by_label) {
    rng.shuffle(members);
    for (int64_t i : members) img[size_t(i)].index = next++;
  }

  // The clean set in a scratch folder: its images are read back, bytes as they are.
  const std::string scratch = out + "/.noise-scratch";
  fs::remove_all(scratch, ec);
  struct Cleanup {
    std::string dir;
    ~Cleanup() {
      std::error_code e;
      fs::remove_all(dir, e);
    }
  } cleanup{scratch};
  faceshard::write_synthetic_dataset(scratch, spec);
  if (spec.pairs > 0) {
    fs::rename(scratch + "/" + spec.bin_name + ".bin", out + "/" + spec.bin_name + ".bin", ec);
    if (ec) throw faceshard::usage_error(out, ": cannot move ", spec.bin_name, ".bin into place: ", ec.message());
  }
  {
    const std::shared_ptr<faceshard::Dataset> clean = faceshard::open_dataset(scratch);
    faceshard::InsightFaceRecWriter w(out + "/train.rec", out + "/train.idx");
    faceshard::RawSample r;
    for (int64_t label = 0; label < classes; ++label) {
      for (int64_t i : by_label[size_t(label)]) {
        const NoisyImage& m = img[size_t(i)];
        clean->read(m.identity * per + m.view, r);
        w.add(label, r.bytes);
      }
    }
    w.commit(classes);
  }

  // Test identities: the overlapping training identities and as many held-out ones (not in
  // train.rec), under names that do not tell which is which; views the set never drew.
  const std::string tests = out + "/test_identities";
  fs::remove_all(tests, ec);
  struct TestIdentity {
    uint64_t identity;
    int64_t cls;  // -1: held out
  };
  std::vector<TestIdentity> test;
  for (uint64_t id : overlap_ids) test.push_back({id, int64_t(id)});
  const uint64_t fam = uint64_t(spec.face.family_size), first_held = (ids + fam - 1) / fam * fam;
  for (uint64_t h = 0; h < std::min(noise.overlap, spec.holdout_identities); ++h) test.push_back({first_held + h, -1});
  rng.shuffle(test);
  const faceshard::SyntheticFaces faces(spec.seed, spec.face);
  std::ofstream ov = open_truth(noise.truth, "overlap.tsv", "test_identity\tclass\timages",
                                "test identities of test_identities/ (class -: held out, not in train.rec)");
  for (size_t t = 0; t < test.size(); ++t) {
    char name[32];
    std::snprintf(name, sizeof name, "person_%03zu", t);
    fs::create_directories(tests + "/" + name, ec);
    for (uint64_t k = 0; k < noise.overlap_images; ++k) {
      const std::vector<uint8_t> jpeg = faces.view_jpeg(test[t].identity, 3000000 + k);
      const std::string path = tests + "/" + name + "/" + std::to_string(k) + ".jpg";
      std::ofstream f(path, std::ios::binary);
      if (!f.write(reinterpret_cast<const char*>(jpeg.data()), std::streamsize(jpeg.size())))
        throw faceshard::usage_error(path, ": cannot write");
    }
    ov << name << "\t" << (test[t].cls < 0 ? std::string("-") : std::to_string(test[t].cls)) << "\t"
       << noise.overlap_images << "\n";
  }

  // The truth, named as faceshard-clean's reports.
  std::vector<const NoisyImage*> by_index(img.size());
  for (const NoisyImage& m : img) by_index[size_t(m.index)] = &m;
  std::ofstream all = open_truth(noise.truth, "images.tsv", "index\tlabel\ttrue_label\tview\tnoise\tcopy_of",
                                 "every image of train.rec: the label it is stored under, its identity (true_label)");
  std::ofstream ml = open_truth(noise.truth, "mislabeled.tsv", "index\tlabel\ttrue_label",
                                "images stored under another identity's label");
  std::ofstream nd = open_truth(noise.truth, "near_duplicates.tsv", "index_a\tindex_b",
                                "images stored twice (identical bytes; index_a < index_b)");
  for (const NoisyImage* m : by_index) {
    const int64_t copy_of = m->copy_of < 0 ? -1 : img[size_t(m->copy_of)].index;
    all << m->index << "\t" << m->label << "\t" << m->identity << "\t" << m->view << "\t" << noise_name(m->noise)
        << "\t" << (copy_of < 0 ? std::string("-") : std::to_string(copy_of)) << "\n";
    if (m->noise == Noise::mislabeled) ml << m->index << "\t" << m->label << "\t" << m->identity << "\n";
    if (copy_of >= 0) nd << std::min(copy_of, m->index) << "\t" << std::max(copy_of, m->index) << "\n";
  }
  std::ofstream di = open_truth(noise.truth, "duplicate_identities.tsv", "class_a\tclass_b\timages_b",
                                "identities split: class_b holds some of class_a's images");
  for (size_t j = 0; j < split_ids.size(); ++j) di << split_ids[j] << "\t" << ids + j << "\t" << per / 2 << "\n";
  for (std::ofstream* f : {&ov, &all, &ml, &nd, &di})
    if (!f->flush()) throw faceshard::usage_error("--truth: cannot write to '", noise.truth, "'");
  std::printf("faceshard-synth: noise: %llu mislabeled images, %llu identities split, %llu images stored twice, "
              "%zu test identities (%llu in train.rec); %lld classes, %zu images; truth in %s\n",
              (unsigned long long)mis, (unsigned long long)n_split, (unsigned long long)n_dup, test.size(),
              (unsigned long long)noise.overlap, (long long)classes, img.size(), noise.truth.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  return faceshard::run_main("faceshard-synth", [&]() -> int {
    faceshard::SynthDatasetSpec spec;
    std::string out, scale;
    uint64_t payload_bytes = 1;
    NoiseSpec noise;
    faceshard::ToolArgs args(argc, argv);
    while (args.next()) {
      const std::string a = args.flag();
      if (a == "--help" || a == "-h") {
        std::fputs(kUsage, stdout);
        return 0;
      }
      if (a.rfind("--", 0) != 0) throw faceshard::usage_error("unexpected argument '", a, "' (see --help)");
      const std::string v = args.value();
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
      else if (a == "--noise-mislabel") noise.mislabel = parse_fraction(a, v);
      else if (a == "--noise-split") noise.split = parse_fraction(a, v);
      else if (a == "--noise-duplicate") noise.duplicate = parse_fraction(a, v);
      else if (a == "--noise-overlap") noise.overlap = parse_count(a, v, 0, 1000000);
      else if (a == "--noise-overlap-images") noise.overlap_images = parse_count(a, v, 1, 10000);
      else if (a == "--truth") noise.truth = v;
      else args.unknown();
    }
    if (out.empty()) throw faceshard::usage_error("--output is required (see --help)");
    if (spec.bin_name.empty() || spec.bin_name.find('/') != std::string::npos) {
      throw faceshard::usage_error("--bin-name: expected a plain file name, got '", spec.bin_name, "'");
    }
    if (noise.any() && noise.truth.empty()) throw faceshard::usage_error("--noise-*: --truth DIR is required");
    if (!noise.truth.empty() && !noise.any())
      throw faceshard::usage_error("--truth: no --noise-* option given, nothing to record");
    if (noise.any() && !scale.empty()) throw faceshard::usage_error("--noise-* and --scale: give one of them");
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
    if (noise.any()) write_noisy_dataset(out, spec, noise);
    else faceshard::write_synthetic_dataset(out, spec);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("faceshard-synth: %s: %llu identities x %llu images -> train.rec/train.idx", out.c_str(),
                (unsigned long long)spec.identities, (unsigned long long)spec.images_per_identity);
    if (spec.pairs > 0) std::printf(", %llu pairs -> %s.bin", (unsigned long long)spec.pairs, spec.bin_name.c_str());
    std::printf(" (%.2f s)\n", s);
    return 0;
  });
}
