// faceshard-pack: packs an image folder (one sub-folder per identity) or an image list into
// an insightface .rec/.idx, makes verification pairs (.bin), lists or verifies a .rec, and
// rebuilds a lost .idx or a clean .rec from faceshard-clean's reports. Image bytes are
// stored as they are (no re-encoding), so unpacking gives back identical files.
#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <system_error>
#include <string>
#include <vector>

#include "app/clean/clean_pack.h"
#include "data/dataset.h"
#include "data/image_check.h"
#include "data/image_header.h"
#include "data/image_record.h"
#include "data/index_check.h"
#include "data/image_encode.h"
#include "data/image_transform.h"
#include "data/insightface_rec.h"
#include "data/pack_source.h"
#include "data/source_paths.h"
#include "data/pack_transform.h"
#include "data/recordio.h"
#include "data/verification_bin.h"
#include "data/verification_pairs.h"
#include "base/error.h"
#include "base/progress.h"
#include "base/tool_args.h"

namespace {

using faceshard::usage_error;
namespace fs = std::filesystem;

const char* kUsage =
    "usage: faceshard-pack <command> ...\n"
    "  pack SOURCE OUT_PREFIX [--size PX] [--skip-bad] [--decode | --no-check]\n"
    "       [--resize 112 [--fit pad|center|stretch] | --landmarks FILE] [--quality Q]\n"
    "        SOURCE: a folder with one sub-folder per identity (SOURCE/<identity>/<image>), or an image list\n"
    "        (.lst: 'index<TAB>label<TAB>path' or insightface's 'aligned<TAB>path<TAB>label'; paths relative to\n"
    "        the list's folder) -> OUT_PREFIX.rec + OUT_PREFIX.idx (insightface layout: header record 0,\n"
    "        images 1..N with their class, one identity record per class) + OUT_PREFIX.labels.tsv (label,\n"
    "        identity folder, images) + OUT_PREFIX.sources.tsv (index, label, path: the photo each image came\n"
    "        from, which faceshard-clean's reports name). Pack to DIR/train and give data.rec: DIR to faceshard-train.\n"
    "        Every image's header is checked (JPEG, PNG or BMP of PX x PX, default 112, not cut short); every\n"
    "        bad file and empty identity folder is listed and nothing is written, unless --skip-bad leaves\n"
    "        them out. --decode also decodes every image; --no-check packs without looking.\n"
    "        faceshard-train takes 112x112 aligned faces. Photos of another size are made so at pack time\n"
    "        (decoded, changed, stored as JPEG of quality Q, default 95; any size is taken):\n"
    "        --resize 112   crops of another size, e.g. 250x250 or 96x112. --fit pad (default): scaled so that\n"
    "                       the longer side is 112, aspect ratio kept, centred on black (a square is only\n"
    "                       scaled; a 96x112 crop gains 8 black columns a side: the ArcFace layout); center:\n"
    "                       scaled so that the shorter side is 112, aspect ratio kept, the middle 112x112\n"
    "                       kept; stretch: each side scaled to 112 (the aspect ratio changes).\n"
    "        --landmarks FILE  photos aligned to insightface's 112x112 template (norm_crop) from five points\n"
    "                       per image; FILE: one line per image, 'PATH x1 y1 x2 y2 x3 y3 x4 y4 x5 y5' in pixels,\n"
    "                       left eye, right eye, nose, left and right mouth corner (left as seen in the\n"
    "                       image), PATH relative to SOURCE (to the list's folder for a .lst). Every image\n"
    "                       needs a line; every bad line and image is listed and nothing is written.\n"
    "  pairs IMAGE_DIR OUT.bin [--pairs N] [--seed S] [--size PX] [--skip-bad]\n"
    "       [--resize 112 [--fit pad|center|stretch] | --landmarks FILE] [--quality Q]\n"
    "        a verification set in insightface's .bin format (a val target for faceshard-train and\n"
    "        faceshard-verify): N pairs (default 3000), half of one identity, half of two, from IMAGE_DIR's\n"
    "        identities (use identities the training data does not hold); the same seed gives the same pairs.\n"
    "        Loose photos (e.g. LFW's 250x250) are made 112x112 faces as `pack` makes them: --landmarks FILE\n"
    "        (aligned, what the network expects) or --resize 112; --size PX keeps them as they are (the\n"
    "        evaluation then resizes them, unaligned, and says so).\n"
    "  list REC [--idx IDX] [--limit N]\n"
    "        prints key, offset, flag, labels and image size of each record (in .idx order).\n"
    "  verify REC [--idx IDX] [--decode] [--size PX]\n"
    "        scans every record, checks the .idx against the scan and the insightface layout;\n"
    "        --decode also decodes every image and checks its size. Every bad record is listed; exit 1 if any.\n"
    "  index REC [IDX]\n"
    "        rebuilds a missing .idx by scanning the .rec (record i gets key i).\n"
    "  unpack REC OUT_DIR [--idx IDX]\n"
    "        writes every image record to OUT_DIR/<class>/<key>.jpg, bytes as stored.\n"
    "  clean REC OUT_PREFIX (--reports DIR [--merge] [--keep-mislabeled] [--keep-near-duplicates]\n"
    "        [--keep-overlap] | --keep FILE) [--idx IDX] [--warn-above SHARE]\n"
    "        a clean copy of REC (bytes as stored) from faceshard-clean's report folder DIR: the images of\n"
    "        mislabeled.tsv, the second image of each near_duplicates.tsv pair and every image of the classes\n"
    "        of overlap.tsv dropped; --merge also makes each pair of duplicate_identities.tsv one class (and\n"
    "        keeps a mislabeled image whose nearest class merges with its own). Or\n"
    "        --keep FILE: the image indices to keep (white space or lines between). Classes are numbered 0..C'-1 again;\n"
    "        OUT_PREFIX.labels.tsv says which source classes each new one holds (docs/cleaning.md). Prints what\n"
    "        each report removes, names identities merged from more than two classes, and warns when more than\n"
    "        SHARE of the images go (default 0.1).\n"
    "IDX defaults to REC with the extension .idx.\n";

std::string default_idx(const std::string& rec) {
  fs::path p(rec);
  p.replace_extension(".idx");
  return p.string();
}

uint64_t parse_u64(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  errno = 0;
  const unsigned long long x = std::strtoull(v.c_str(), &end, 10);
  if (v.empty() || v[0] == '-' || *end != '\0' || errno != 0) {
    throw usage_error(flag, ": expected a non-negative integer, got '", v, "'");
  }
  return x;
}

struct Args {
  std::vector<std::string> pos;
  std::map<std::string, std::string> opt;  // flags without a value map to ""
};

Args parse(int argc, char** argv, const std::vector<std::string>& with_value, const std::vector<std::string>& flags) {
  Args a;
  faceshard::ToolArgs args(argc - 1, argv + 1);  // after the command
  while (args.next()) {
    const std::string s = args.flag();
    if (s.rfind("--", 0) != 0) {
      a.pos.push_back(s);
    } else if (std::find(with_value.begin(), with_value.end(), s) != with_value.end()) {
      a.opt[s] = args.value();
    } else if (std::find(flags.begin(), flags.end(), s) != flags.end()) {
      a.opt[s] = "";
    } else {
      args.unknown();
    }
  }
  return a;
}

// An image must be size x size and decode without a warning; the size comes from its
// header, so an image of another size (or a decompression bomb) is never decoded.
void check_image(const uint8_t* data, size_t n, int size, const std::string& where) {
  const faceshard::EncodedImageHeader h = faceshard::read_image_header(data, n, where);
  if (h.decoded_width() != size || h.decoded_height() != size) {
    throw faceshard::runtime_error(where, ": image is ", h.decoded_width(), "x", h.decoded_height(), ", expected ", size,
                                   "x", size);
  }
  faceshard::decode_image(data, n, h, where);
}

void need_positional(const Args& a, size_t lo, size_t hi, const char* cmd) {
  if (a.pos.size() < lo || a.pos.size() > hi) {
    throw usage_error(cmd, ": wrong number of arguments (see --help)");
  }
}

// Reads a whole file (small: an aligned face).
bool read_file(const std::string& path, std::vector<uint8_t>& out, std::string& why) {
  return faceshard::read_image_file(path, out, why);  // shared with the trainer's folder check
}

// Every problem of the source, one line each, then what to do: the pack is refused unless
// --skip-bad leaves them out (and says so).
void report_problems(const std::vector<faceshard::PackProblem>& problems, bool skip_bad) {
  if (problems.size() == 1 && !skip_bad)  // one problem: one line
    throw usage_error(problems[0].path, ": ", problems[0].what,
                      "; fix it, or pass --skip-bad to leave it out");
  for (const auto& p : problems) std::fprintf(stderr, "faceshard-pack: %s: %s\n", p.path.c_str(), p.what.c_str());
  if (problems.empty() || skip_bad) return;
  throw usage_error(problems.size(), problems.size() == 1 ? " problem" : " problems",
                    " found (listed above); fix them, or pass --skip-bad to leave those files and folders out");
}

// The source's items that pass the check (all when check is off); bad ones become problems.
std::vector<uint64_t> check_items(const faceshard::PackSource& src, int size, bool decode,
                                  std::vector<faceshard::PackProblem>& problems,
                                  const faceshard::PackTransform& transform = {}) {
  std::vector<uint64_t> bad;
  std::vector<uint8_t> bytes;
  faceshard::Progress progress("checking", src.items.size(), "images");
  for (uint64_t i = 0; i < src.items.size(); ++i) {
    const std::string& path = src.items[i].path;
    std::string why;
    cv::Mat changed;
    // A transform takes any size: the image is decoded, and its landmarks checked against it.
    if (read_file(path, bytes, why))
      why = transform.kind == faceshard::PackTransform::Kind::none ? faceshard::check_image_bytes(bytes, size)
                                                                   : faceshard::transform_image(bytes, path, transform, changed);
    if (why.empty() && decode && transform.kind == faceshard::PackTransform::Kind::none) {
      try {
        check_image(bytes.data(), bytes.size(), size, "");
      } catch (const faceshard::Error& e) {
        why = e.what();
      }
    }
    if (!why.empty()) {
      if (why != "-") problems.push_back({path, why});  // "-": its landmark line is the problem listed
      bad.push_back(i);
    }
    progress.update(i + 1);
  }
  return bad;
}

// --resize N / --landmarks FILE (with --fit, --quality): how `pack` and `pairs` change each
// image into a 112x112 face, stored as JPEG.
struct TransformFlags {
  faceshard::PackTransform transform;
  faceshard::LandmarkList landmarks;
  bool resize = false, align = false;
};

// Reads the flags (refusing the combinations that make no sense) and, with --landmarks, the
// list for `src`'s images (its problems added to `problems`).
void parse_transform_flags(const Args& a, const faceshard::PackSource& src, TransformFlags& t,
                           std::vector<faceshard::PackProblem>& problems) {
  t.resize = a.opt.count("--resize");
  t.align = a.opt.count("--landmarks");
  if (t.resize && t.align) throw usage_error("--resize and --landmarks: give one (--landmarks makes 112x112 faces itself)");
  if (a.opt.count("--fit") && !t.resize) throw usage_error("--fit goes with --resize 112");
  if (a.opt.count("--quality") && !t.resize && !t.align)
    throw usage_error("--quality goes with --resize or --landmarks (otherwise the images are stored as they are)");
  if (!t.resize && !t.align) return;
  if (a.opt.count("--no-check")) throw usage_error("--no-check: --resize and --landmarks decode every image");
  if (a.opt.count("--size")) throw usage_error("--size: with --resize or --landmarks the images may be of any size");
  t.transform.kind = t.resize ? faceshard::PackTransform::Kind::resize : faceshard::PackTransform::Kind::align;
  if (t.resize) {
    const uint64_t n = parse_u64("--resize", a.opt.at("--resize"));
    if (n != 112) throw usage_error("--resize ", n, ": faceshard-train takes 112x112 faces; give --resize 112");
    if (a.opt.count("--fit")) t.transform.fit = faceshard::parse_fit_mode(a.opt.at("--fit"));
  }
  if (a.opt.count("--quality")) {
    const uint64_t q = parse_u64("--quality", a.opt.at("--quality"));
    if (q < 1 || q > 100) throw usage_error("--quality ", q, ": expected a JPEG quality in 1..100");
    t.transform.jpeg_quality = int(q);
  }
  if (t.align) {
    // Relative paths in the list are taken from where the source's own paths are.
    std::error_code ec;
    fs::path base = fs::is_directory(a.pos[0], ec) ? fs::path(a.pos[0]) : fs::path(a.pos[0]).parent_path();
    if (base.empty()) base = ".";
    std::vector<std::string> keys;
    for (const auto& it : src.items) keys.push_back(faceshard::landmark_key(it.path));
    t.landmarks = faceshard::read_landmark_list(a.opt.at("--landmarks"), base.string(), keys);
    problems.insert(problems.end(), t.landmarks.problems.begin(), t.landmarks.problems.end());
    t.transform.landmarks = &t.landmarks;
  }
}

// The bytes a transformed image is stored as (the file's own bytes without a transform).
void transformed_bytes(const std::string& path, const faceshard::PackTransform& transform, std::vector<uint8_t>& bytes) {
  std::string why;
  if (!read_file(path, bytes, why)) throw faceshard::runtime_error(path, ": ", why);
  if (transform.kind == faceshard::PackTransform::Kind::none) return;
  cv::Mat face;
  why = faceshard::transform_image(bytes, path, transform, face);
  if (!why.empty()) throw faceshard::runtime_error(path, ": ", why);
  bytes = faceshard::encode_jpeg(face, transform.jpeg_quality);
}

int cmd_pack(const Args& a) {
  need_positional(a, 2, 2, "pack");
  const bool decode = a.opt.count("--check") || a.opt.count("--decode");
  const bool header_check = !a.opt.count("--no-check");
  const bool skip_bad = a.opt.count("--skip-bad");
  const int size = a.opt.count("--size") ? int(parse_u64("--size", a.opt.at("--size"))) : 112;
  // --resize / --landmarks: every image decoded, changed to 112x112 and stored as JPEG.
  faceshard::PackSource src = faceshard::list_pack_source(a.pos[0]);
  std::vector<faceshard::PackProblem> problems = src.problems;
  TransformFlags tf;
  parse_transform_flags(a, src, tf, problems);
  const faceshard::PackTransform& transform = tf.transform;
  const bool resize = tf.resize, align = tf.align;
  std::vector<uint64_t> bad;
  if (header_check || decode || resize || align) bad = check_items(src, size, decode, problems, transform);
  report_problems(problems, skip_bad);
  const size_t empty_folders = src.problems.size();
  const std::vector<std::string> emptied = faceshard::drop_items(src, bad);
  if (src.items.empty()) throw usage_error("'", a.pos[0], "': no image to pack");
  const std::string rec = a.pos[1] + ".rec", idx = a.pos[1] + ".idx", labels = a.pos[1] + ".labels.tsv";
  const fs::path parent = fs::path(a.pos[1]).parent_path();
  if (!parent.empty()) fs::create_directories(parent);
  faceshard::InsightFaceRecWriter writer(rec, idx);
  std::vector<uint8_t> bytes;
  {
    faceshard::Progress progress("packing", src.items.size(), "images");
    for (uint64_t i = 0; i < src.items.size(); ++i) {
      transformed_bytes(src.items[i].path, transform, bytes);
      writer.add(src.items[i].label, bytes);
      progress.update(i + 1);
    }
  }
  writer.commit(static_cast<int64_t>(src.identities.size()));
  // label <TAB> identity <TAB> images: which folder each class came from.
  {
    std::vector<uint64_t> count(src.identities.size(), 0);
    for (const auto& it : src.items) count[static_cast<size_t>(it.label)]++;
    const std::string tmp = labels + ".tmp";
    std::FILE* f = std::fopen(tmp.c_str(), "wb");
    if (!f) throw faceshard::runtime_error(labels, ": cannot create");
    bool ok = std::fprintf(f, "label\tidentity\timages\n") > 0;
    for (size_t c = 0; c < src.identities.size(); ++c)
      ok = ok && std::fprintf(f, "%zu\t%s\t%llu\n", c, src.identities[c].c_str(), (unsigned long long)count[c]) > 0;
    if (std::fclose(f) != 0 || !ok || std::rename(tmp.c_str(), labels.c_str()) != 0) {
      std::remove(tmp.c_str());
      throw faceshard::runtime_error(labels, ": write failed");
    }
  }
  // index <TAB> label <TAB> path: the photo each image of the set came from (what a report of
  // image i names, data/source_paths.h).
  const std::string sources = faceshard::sources_path_of(rec);
  {
    const std::string tmp = sources + ".tmp";
    std::FILE* f = std::fopen(tmp.c_str(), "wb");
    if (!f) throw faceshard::runtime_error(sources, ": cannot create");
    bool ok = std::fprintf(f, "index\tlabel\tpath\n") > 0;
    for (size_t i = 0; i < src.items.size() && ok; ++i)
      ok = std::fprintf(f, "%zu\t%lld\t%s\n", i, (long long)src.items[i].label, src.items[i].path.c_str()) > 0;
    if (std::fclose(f) != 0 || !ok || std::rename(tmp.c_str(), sources.c_str()) != 0) {
      std::remove(tmp.c_str());
      throw faceshard::runtime_error(sources, ": write failed");
    }
  }
  if (skip_bad && !problems.empty())
    std::printf("faceshard-pack: left out %zu bad files and %zu folders (empty, or inside an identity folder; listed "
                "above)%s\n", bad.size(),
                empty_folders, emptied.empty() ? "" : faceshard::detail::concat("; ", emptied.size(),
                                                                   " identities lost every image and are no class").c_str());
  if (resize)
    std::printf("faceshard-pack: every image resized to 112x112 (--fit %s) and stored as JPEG of quality %d\n",
                faceshard::fit_mode_name(transform.fit), transform.jpeg_quality);
  if (align)
    std::printf("faceshard-pack: every image aligned to the ArcFace 112x112 template from its landmarks and stored as "
                "JPEG of quality %d\n",
                transform.jpeg_quality);
  if (!resize && !align && size != 112)
    std::printf("faceshard-pack: note: faceshard-train takes 112x112 faces and these are %dx%d; --resize 112 or "
                "--landmarks FILE makes them 112x112\n",
                size, size);
  std::printf("faceshard-pack: %llu images of %lld identities -> %s, %s, %s, %s%s\n", (unsigned long long)src.items.size(),
              (long long)src.identities.size(), rec.c_str(), idx.c_str(), labels.c_str(), sources.c_str(),
              src.ignored_files ? faceshard::detail::concat(" (", src.ignored_files,
                                                            " files without an image extension ignored)").c_str()
                                : "");
  return 0;
}

// A verification set in insightface's .bin format from a folder of identities.
int cmd_pairs(const Args& a) {
  need_positional(a, 2, 2, "pairs");
  const uint64_t num_pairs = a.opt.count("--pairs") ? parse_u64("--pairs", a.opt.at("--pairs")) : 3000;
  const uint64_t seed = a.opt.count("--seed") ? parse_u64("--seed", a.opt.at("--seed")) : 0;
  const int size = a.opt.count("--size") ? int(parse_u64("--size", a.opt.at("--size"))) : 112;
  const bool skip_bad = a.opt.count("--skip-bad");
  faceshard::PackSource src = faceshard::list_pack_source(a.pos[0]);
  std::vector<faceshard::PackProblem> problems = src.problems;
  // Loose photos (LFW's 250x250) become 112x112 faces here, as `pack` makes them.
  TransformFlags tf;
  parse_transform_flags(a, src, tf, problems);
  const std::vector<uint64_t> bad = check_items(src, size, false, problems, tf.transform);
  report_problems(problems, skip_bad);
  faceshard::drop_items(src, bad);
  std::vector<int64_t> labels;
  for (const auto& it : src.items) labels.push_back(it.label);
  const std::vector<faceshard::ImagePair> pairs = faceshard::make_verification_pairs(labels, num_pairs, seed);
  faceshard::VerificationSet set;
  std::vector<uint8_t> bytes;
  auto image = [&](uint64_t i) {
    transformed_bytes(src.items[i].path, tf.transform, bytes);
    return faceshard::ImageBytes(bytes);
  };
  for (const auto& p : pairs) {
    set.images.push_back(image(p.a));
    set.images.push_back(image(p.b));
    set.issame.push_back(p.same);
  }
  faceshard::write_verification_bin(a.pos[1], set);
  if (size != 112 && tf.transform.kind == faceshard::PackTransform::Kind::none)
    std::fprintf(stderr,
                 "faceshard-pack: warning: %s holds %dx%d images, not the networks' 112x112: faceshard-train and "
                 "faceshard-verify resize them without aligning, which scores far below aligned faces; "
                 "--landmarks FILE (or --resize 112) makes 112x112 faces\n",
                 a.pos[1].c_str(), size, size);
  std::printf("faceshard-pack: %zu pairs (%zu same identity, %zu different) from %zu images of %zu identities, seed %llu "
              "-> %s\n",
              pairs.size(), pairs.size() / 2, pairs.size() / 2, src.items.size(), src.identities.size(),
              (unsigned long long)seed, a.pos[1].c_str());
  return 0;
}

int cmd_list(const Args& a) {
  need_positional(a, 1, 1, "list");
  const std::string rec = a.pos[0];
  const std::string idx = a.opt.count("--idx") ? a.opt.at("--idx") : default_idx(rec);
  const uint64_t limit = a.opt.count("--limit") ? parse_u64("--limit", a.opt.at("--limit")) : UINT64_MAX;
  const faceshard::IndexedRecordIO r(rec, idx);
  std::vector<uint8_t> buf;
  uint64_t n = 0;
  std::printf("key\toffset\tflag\tlabel\tlabels\timage_bytes\n");
  for (uint64_t i = 0; i < r.num_entries(); ++i) {
    if (n++ >= limit) break;
    const faceshard::IndexEntry e = r.entry(i);
    r.read(e.key, buf);
    const auto v = faceshard::unpack_image_record(buf, faceshard::detail::concat(rec, ": key ", e.key));
    std::string labels;
    for (size_t i = 0; i < v.labels.size(); ++i) labels += (i ? "," : "") + faceshard::detail::concat(v.labels[i]);
    std::printf("%llu\t%llu\t%u\t%g\t%s\t%zu\n", (unsigned long long)e.key, (unsigned long long)e.offset,
                v.header.flag, double(v.header.label), labels.empty() ? "-" : labels.c_str(), v.image_size);
  }
  return 0;
}

int cmd_verify(const Args& a) {
  need_positional(a, 1, 1, "verify");
  const std::string rec = a.pos[0];
  const std::string idx = a.opt.count("--idx") ? a.opt.at("--idx") : default_idx(rec);
  const bool decode = a.opt.count("--decode");
  const int size = a.opt.count("--size") ? int(parse_u64("--size", a.opt.at("--size"))) : 112;
  // 1. The container: every record from the first byte to the last.
  std::vector<uint64_t> starts;  // increasing: the scan goes front to back
  {
    faceshard::RecordIOReader reader(rec);
    std::vector<uint8_t> buf;
    while (true) {
      const uint64_t off = reader.tell();
      if (!reader.next(buf)) break;
      starts.push_back(off);
    }
  }
  const uint64_t records = starts.size();
  // 2. The index points at record starts only.
  const faceshard::IndexedRecordIO r(rec, idx);
  for (uint64_t i = 0; i < r.num_entries(); ++i) {
    const faceshard::IndexEntry e = r.entry(i);
    if (!std::binary_search(starts.begin(), starts.end(), e.offset)) {
      throw faceshard::runtime_error(idx, ": key ", e.key, ": offset ", e.offset, " is not the start of a record");
    }
  }
  // 3. The insightface layout and every image record.
  const faceshard::InsightFaceLayout layout = faceshard::read_insightface_layout(r);
  const int64_t classes = int64_t(layout.num_identities());
  // Identity records list each class's images in class order (what samplers that draw by
  // identity rely on): the ranges must be sorted and disjoint, or an image would belong to
  // two identities. Empty ranges are allowed (classes without images).
  uint64_t prev_end = 1, prev_key = 0;
  for (uint64_t k = layout.identity_begin; k < layout.identity_end; ++k) {
    const auto range = faceshard::read_identity_range(r, layout, k);
    if (range.first < 1 || (layout.has_header && range.second > layout.identity_begin)) {
      throw faceshard::runtime_error(rec, ": key ", k, ": identity range [", range.first, ", ", range.second,
                                     ") is outside the image keys");
    }
    if (range.first < range.second) {
      if (range.first < prev_end) {
        throw faceshard::runtime_error(rec, ": key ", k, ": identity range [", range.first, ", ", range.second,
                                       ") starts before the end (", prev_end, ") of the range of key ", prev_key,
                                       " (expected sorted, non-overlapping ranges)");
      }
      prev_end = range.second;
      prev_key = k;
    }
  }
  // Every record is checked and every bad one listed (the first 1000 by name), not only the first.
  std::vector<uint8_t> buf;
  uint64_t bad = 0;
  std::string first_bad;
  faceshard::Progress progress("verifying", layout.num_images(), "records");
  for (uint64_t i = 0; i < layout.num_images(); ++i) {
    const uint64_t k = layout.image_key(r, i);
    const std::string where = faceshard::detail::concat(rec, ": key ", k, " at offset ", r.offset_of(k));
    // A record that is not the one its key names is a corrupt index, not a bad image: that
    // ends the check at once (every later key is suspect).
    r.read(k, buf);
    faceshard::check_record_id(faceshard::unpack_image_record(buf, where), k, where);
    try {
      const auto v = faceshard::unpack_image_record(buf, where);
      const int64_t label = faceshard::label_to_class(v.class_label(), where);
      if (classes > 0 && label >= classes) {
        throw faceshard::runtime_error(where, ": label ", label, " is out of range [0, ", classes, ")");
      }
      if (decode) check_image(v.image, v.image_size, size, where);
    } catch (const faceshard::Error& e) {
      // The first bad record is held back: when it is the only one, it is the error itself.
      if (bad == 0) first_bad = e.what();
      else if (bad < 1000) {
        if (bad == 1) std::fprintf(stderr, "faceshard-pack: %s\n", first_bad.c_str());
        std::fprintf(stderr, "faceshard-pack: %s\n", e.what());
      }
      bad++;
    }
    progress.update(i + 1);
  }
  progress.finish();
  if (bad == 1) throw faceshard::runtime_error(first_bad);
  if (bad > 0)
    throw faceshard::runtime_error(rec, ": ", bad, " of ", layout.num_images(), " image records are bad",
                                   bad > 1000 ? " (the first 1000 listed above)" : " (listed above)");
  std::printf("faceshard-pack: %s: OK: %llu records, %llu indexed, %llu images, %lld identities%s\n", rec.c_str(),
              (unsigned long long)records, (unsigned long long)r.num_entries(),
              (unsigned long long)layout.num_images(), (long long)classes,
              layout.has_header ? " (insightface header)" : " (no header record)");
  return 0;
}

int cmd_index(const Args& a) {
  need_positional(a, 1, 2, "index");
  const std::string rec = a.pos[0];
  const std::string idx = a.pos.size() > 1 ? a.pos[1] : default_idx(rec);
  if (fs::exists(idx)) throw usage_error(idx, ": already exists (remove it first)");
  faceshard::RecordIOReader reader(rec);
  const std::string tmp = idx + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) throw usage_error(idx, ": cannot create");
  std::vector<uint8_t> buf;
  uint64_t key = 0;
  try {
    while (true) {
      const uint64_t off = reader.tell();
      if (!reader.next(buf)) break;
      std::fprintf(f, "%llu\t%llu\n", (unsigned long long)key++, (unsigned long long)off);
    }
  } catch (...) {
    std::fclose(f);
    std::remove(tmp.c_str());
    throw;
  }
  if (std::fclose(f) != 0 || std::rename(tmp.c_str(), idx.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw faceshard::runtime_error(idx, ": write failed");
  }
  std::printf("faceshard-pack: %s: %llu records indexed\n", idx.c_str(), (unsigned long long)key);
  return 0;
}

int cmd_clean(const Args& a) {
  need_positional(a, 2, 2, "clean");
  if (a.opt.count("--reports") == a.opt.count("--keep")) throw usage_error("clean: give one of --reports DIR, --keep FILE");
  const std::string rec = a.pos[0];
  const std::string idx = a.opt.count("--idx") ? a.opt.at("--idx") : default_idx(rec);
  const faceshard::RecordIODataset ds(rec, idx);
  const int64_t classes = ds.num_classes();
  if (classes < 1) throw usage_error(rec, ": its header declares no classes");
  faceshard::CleanPlan plan;
  // Numbers of images and classes mean the same images only in the set they came from.
  const faceshard::SetIdentity set = faceshard::set_identity(ds);
  if (a.opt.count("--keep")) {
    faceshard::check_keep_list_set(a.opt.at("--keep"), set);
    plan = faceshard::plan_from_keep_list(a.opt.at("--keep"), ds.size(), classes);
  } else {
    faceshard::CleanPackOptions o;
    o.drop_mislabeled = !a.opt.count("--keep-mislabeled");
    o.drop_near_duplicates = !a.opt.count("--keep-near-duplicates");
    o.drop_overlap = !a.opt.count("--keep-overlap");
    o.merge_identities = a.opt.count("--merge") > 0;
    faceshard::check_reports_set(a.opt.at("--reports"), set, o);
    plan = faceshard::plan_from_reports(a.opt.at("--reports"), ds.size(), classes, o);
  }
  double warn_above = 0.10;
  if (a.opt.count("--warn-above")) {
    const std::string& v = a.opt.at("--warn-above");
    char* end = nullptr;
    warn_above = std::strtod(v.c_str(), &end);
    if (v.empty() || *end != '\0' || !(warn_above >= 0 && warn_above <= 1))
      throw usage_error("--warn-above: expected a share of the images in [0, 1], got '", v, "'");
  }
  // The source's identity names and photos, where pack left them beside it: carried over.
  faceshard::CleanPackNames names;
  const faceshard::IdentityNames ids = faceshard::identity_names_beside(rec, classes);
  names.identities = ids.names;
  const std::shared_ptr<const faceshard::SourcePaths> photos = faceshard::SourcePaths::open_beside(rec, ds.size());
  names.sources = photos.get();
  const faceshard::CleanPackResult r = faceshard::write_clean_rec(ds, plan, a.pos[1], names);
  if (!names.identities.empty())
    std::printf("faceshard-pack: %s.labels.tsv names each class's identities (from %s)\n", a.pos[1].c_str(),
                faceshard::labels_path_of(rec).c_str());
  if (photos)
    std::printf("faceshard-pack: %s lists each kept image's photo (from %s)\n",
                faceshard::sources_path_of(a.pos[1] + ".rec").c_str(), photos->file().c_str());
  // What each report removes, before the totals.
  if (a.opt.count("--reports")) {
    const uint64_t by_class = r.dropped - plan.dropped_mislabeled - plan.dropped_near_duplicates;
    std::printf("faceshard-pack: mislabeled.tsv: %llu images dropped", (unsigned long long)plan.dropped_mislabeled);
    if (plan.kept_mislabeled_merged > 0)
      std::printf(", %llu kept (nearest to a class merged with their own: one person under two labels)",
                  (unsigned long long)plan.kept_mislabeled_merged);
    std::printf("%s\n", a.opt.count("--keep-mislabeled") ? " (--keep-mislabeled: not applied)" : "");
    std::printf("faceshard-pack: near_duplicates.tsv: %llu images dropped%s\n",
                (unsigned long long)plan.dropped_near_duplicates,
                a.opt.count("--keep-near-duplicates") ? " (--keep-near-duplicates: not applied)" : "");
    std::printf("faceshard-pack: overlap.tsv: %lld classes dropped with every class merged into them, %llu images%s\n",
                (long long)plan.overlap_classes, (unsigned long long)by_class,
                a.opt.count("--keep-overlap") ? " (--keep-overlap: not applied)" : "");
    if (a.opt.count("--merge"))
      std::printf("faceshard-pack: duplicate_identities.tsv: %lld classes merged into others%s\n",
                  (long long)plan.merged_classes,
                  plan.merge_chains.empty() ? ""
                                            : (", " + std::to_string(plan.merge_chains.size()) +
                                               " of the identities made of more than two classes").c_str());
    const size_t shown = std::min<size_t>(plan.merge_chains.size(), 10);
    for (size_t k = 0; k < shown; ++k) {
      std::string list;
      for (int64_t c : plan.merge_chains[k]) list += (list.empty() ? "" : ", ") + std::to_string(c);
      std::printf("faceshard-pack: warning: classes %s become one identity (%zu classes joined by a chain of "
                  "duplicate_identities.tsv pairs): check that they are one person\n",
                  list.c_str(), plan.merge_chains[k].size());
    }
    if (plan.merge_chains.size() > shown)
      std::printf("faceshard-pack: warning: and %zu more such chains\n", plan.merge_chains.size() - shown);
  }
  std::printf("faceshard-pack: %s.rec: %llu images kept, %llu dropped (%llu mislabeled, %llu duplicates, %lld classes "
              "in test sets), %lld classes (%lld merged)\n",
              a.pos[1].c_str(), (unsigned long long)r.kept, (unsigned long long)r.dropped,
              (unsigned long long)plan.dropped_mislabeled, (unsigned long long)plan.dropped_near_duplicates,
              (long long)plan.overlap_classes, (long long)r.classes, (long long)plan.merged_classes);
  const double share = ds.size() > 0 ? double(r.dropped) / double(ds.size()) : 0.0;
  if (share > warn_above)
    std::printf("faceshard-pack: warning: the cleaning drops %.1f%% of the images, more than %.1f%% (--warn-above): "
                "look at the reports before training on it; thresholds that do not fit this set flag good images "
                "(docs/cleaning.md)\n",
                100.0 * share, 100.0 * warn_above);
  return 0;
}

int cmd_unpack(const Args& a) {
  need_positional(a, 2, 2, "unpack");
  const std::string rec = a.pos[0];
  const std::string idx = a.opt.count("--idx") ? a.opt.at("--idx") : default_idx(rec);
  const faceshard::RecordIODataset ds(rec, idx);
  faceshard::RawSample s;
  for (uint64_t i = 0; i < ds.size(); ++i) {
    ds.read(i, s);
    const fs::path dir = fs::path(a.pos[1]) / std::to_string(s.label);
    fs::create_directories(dir);
    const fs::path out = dir / (std::to_string(ds.key(i)) + ".jpg");
    const std::string tmp = out.string() + ".tmp";
    std::FILE* f = std::fopen(tmp.c_str(), "wb");
    if (!f) throw usage_error(out.string(), ": cannot create");
    const bool ok = std::fwrite(s.bytes.data(), 1, s.bytes.size(), f) == s.bytes.size();
    if ((std::fclose(f) != 0) || !ok || std::rename(tmp.c_str(), out.c_str()) != 0) {
      std::remove(tmp.c_str());
      throw faceshard::runtime_error(out.string(), ": write failed");
    }
  }
  std::printf("faceshard-pack: %llu images -> %s\n", (unsigned long long)ds.size(), a.pos[1].c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return faceshard::run_main("faceshard-pack", [&]() -> int {
    if (argc < 2) throw usage_error("missing command (see --help)");
    const std::string cmd = argv[1];
    for (int i = 1; i < argc; ++i) {
      const std::string s = argv[i];
      if (s == "--help" || s == "-h") {
        std::fputs(kUsage, stdout);
        return 0;
      }
    }
    if (cmd == "pack")
      return cmd_pack(parse(argc, argv, {"--size", "--resize", "--fit", "--landmarks", "--quality"},
                            {"--check", "--decode", "--no-check", "--skip-bad"}));
    if (cmd == "pairs")
      return cmd_pairs(parse(argc, argv, {"--pairs", "--seed", "--size", "--resize", "--fit", "--landmarks", "--quality"},
                             {"--skip-bad"}));
    if (cmd == "list") return cmd_list(parse(argc, argv, {"--idx", "--limit"}, {}));
    if (cmd == "verify") return cmd_verify(parse(argc, argv, {"--idx", "--size"}, {"--decode"}));
    if (cmd == "index") return cmd_index(parse(argc, argv, {}, {}));
    if (cmd == "unpack") return cmd_unpack(parse(argc, argv, {"--idx"}, {}));
    if (cmd == "clean")
      return cmd_clean(parse(argc, argv, {"--idx", "--reports", "--keep", "--warn-above"},
                             {"--merge", "--keep-mislabeled", "--keep-near-duplicates", "--keep-overlap"}));
    throw usage_error("unknown command '", cmd, "' (see --help)");
  });
}
