// faceshard-pack: packs an image folder (one sub-folder per identity) into an insightface
// .rec/.idx, lists or verifies a .rec, and rebuilds a lost .idx. Image bytes are stored
// as they are (no re-encoding), so unpacking gives back identical files.
#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "data/dataset.h"
#include "data/image_header.h"
#include "data/image_record.h"
#include "data/index_check.h"
#include "data/image_transform.h"
#include "data/insightface_rec.h"
#include "data/recordio.h"
#include "partial_fc/runtime/error.h"

namespace {

using faceshard::usage_error;
namespace fs = std::filesystem;

const char* kUsage =
    "usage: faceshard-pack <command> ...\n"
    "  pack IMAGE_DIR OUT_PREFIX [--check] [--size PX]\n"
    "        IMAGE_DIR/<identity>/<image> -> OUT_PREFIX.rec + OUT_PREFIX.idx (insightface layout:\n"
    "        header record 0, images 1..N with their class, one identity record per class).\n"
    "        --check decodes every image and requires PX x PX (default 112).\n"
    "  list REC [--idx IDX] [--limit N]\n"
    "        prints key, offset, flag, labels and image size of each record (in .idx order).\n"
    "  verify REC [--idx IDX] [--decode] [--size PX]\n"
    "        scans every record, checks the .idx against the scan and the insightface layout;\n"
    "        --decode also decodes every image and checks its size. Exit 1 on the first problem.\n"
    "  index REC [IDX]\n"
    "        rebuilds a missing .idx by scanning the .rec (record i gets key i).\n"
    "  unpack REC OUT_DIR [--idx IDX]\n"
    "        writes every image record to OUT_DIR/<class>/<key>.jpg, bytes as stored.\n"
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
  for (int i = 2; i < argc; ++i) {
    const std::string s = argv[i];
    if (s.rfind("--", 0) != 0) {
      a.pos.push_back(s);
      continue;
    }
    bool known = false;
    for (const auto& f : with_value) {
      if (s == f) {
        if (i + 1 >= argc) throw usage_error(s, ": missing value (see --help)");
        a.opt[s] = argv[++i];
        known = true;
      }
    }
    for (const auto& f : flags) {
      if (s == f) {
        a.opt[s] = "";
        known = true;
      }
    }
    if (!known) throw usage_error("unknown option '", s, "' (see --help)");
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

int cmd_pack(const Args& a) {
  need_positional(a, 2, 2, "pack");
  const bool check = a.opt.count("--check");
  const int size = a.opt.count("--size") ? int(parse_u64("--size", a.opt.at("--size"))) : 112;
  const faceshard::ImageFolderDataset folder(a.pos[0]);
  const std::string rec = a.pos[1] + ".rec", idx = a.pos[1] + ".idx";
  faceshard::InsightFaceRecWriter writer(rec, idx);
  faceshard::RawSample s;
  for (uint64_t i = 0; i < folder.size(); ++i) {
    folder.read(i, s);
    if (check) check_image(s.bytes.data(), s.bytes.size(), size, folder.path(i));
    writer.add(s.label, s.bytes);
  }
  writer.commit(folder.num_classes());
  std::printf("faceshard-pack: %llu images of %lld identities -> %s, %s\n", (unsigned long long)folder.size(),
              (long long)folder.num_classes(), rec.c_str(), idx.c_str());
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
  std::vector<uint8_t> buf;
  for (uint64_t i = 0; i < layout.num_images(); ++i) {
    const uint64_t k = layout.image_key(r, i);
    r.read(k, buf);
    const std::string where = faceshard::detail::concat(rec, ": key ", k, " at offset ", r.offset_of(k));
    const auto v = faceshard::unpack_image_record(buf, where);
    faceshard::check_record_id(v, k, where);
    const int64_t label = faceshard::label_to_class(v.class_label(), where);
    if (classes > 0 && label >= classes) {
      throw faceshard::runtime_error(where, ": label ", label, " is out of range [0, ", classes, ")");
    }
    if (decode) check_image(v.image, v.image_size, size, where);
  }
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
    if (cmd == "pack") return cmd_pack(parse(argc, argv, {"--size"}, {"--check"}));
    if (cmd == "list") return cmd_list(parse(argc, argv, {"--idx", "--limit"}, {}));
    if (cmd == "verify") return cmd_verify(parse(argc, argv, {"--idx", "--size"}, {"--decode"}));
    if (cmd == "index") return cmd_index(parse(argc, argv, {}, {}));
    if (cmd == "unpack") return cmd_unpack(parse(argc, argv, {"--idx"}, {}));
    throw usage_error("unknown command '", cmd, "' (see --help)");
  });
}
