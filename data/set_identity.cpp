#include "data/set_identity.h"

#include <cstring>
#include <regex>

#include "data/insightface_rec.h"
#include "base/sha256.h"

namespace faceshard {
namespace {

void put_u64(Sha256& h, uint64_t v) {
  uint8_t b[8];
  for (int i = 0; i < 8; ++i) b[i] = uint8_t(v >> (8 * i));
  h.update(b, 8);
}

std::string finish_hex(Sha256& h) {
  const Digest256 d = h.finish();
  return to_hex(d.data(), d.size());
}

}  // namespace

std::string SetIdentity::text() const {
  return "sha256:" + (digest.empty() ? std::string("none") : digest) + " (" + kind + ": " + std::to_string(images) +
         " images, " + std::to_string(classes) + " classes)";
}

std::string SetIdentity::brief() const {
  return kind + ", " + std::to_string(images) + " images, " + std::to_string(classes) + " classes, sha256 " +
         (digest.empty() ? std::string("none") : digest.substr(0, 12));
}

SetIdentity set_identity(const Dataset& ds) {
  SetIdentity id;
  id.images = ds.size();
  id.classes = ds.num_classes();
  if (const auto* rec = dynamic_cast<const RecordIODataset*>(&ds)) {
    id.kind = "rec";
    Sha256 h;
    h.update(std::string("faceshard set identity 1: insightface rec\n"));
    const IndexedRecordIO& r = rec->records();
    for (uint64_t i = 0; i < ds.size(); ++i) {
      const uint64_t key = rec->key(i);
      put_u64(h, key);
      put_u64(h, r.offset_of(key));
    }
    const InsightFaceLayout& layout = rec->layout();
    for (uint64_t key = layout.identity_begin; key < layout.identity_end; ++key) {
      const auto [first, end] = read_identity_range(r, layout, key);
      put_u64(h, first);
      put_u64(h, end);
    }
    id.digest = finish_hex(h);
  } else if (const auto* folder = dynamic_cast<const ImageFolderDataset*>(&ds)) {
    id.kind = "folder";
    Sha256 h;
    h.update(std::string("faceshard set identity 1: image folder\n"));
    // Paths relative to the folder: the same folder elsewhere is the same set.
    size_t root = std::string::npos;
    for (uint64_t i = 0; i < ds.size(); ++i) {
      const std::string& p = folder->path(i);
      const std::string& name = folder->class_names().at(size_t(folder->label(i)));
      if (root == std::string::npos) {
        const size_t at = p.rfind("/" + name + "/");
        root = at == std::string::npos ? 0 : at + 1;
      }
      const std::string rel = p.size() > root ? p.substr(root) : p;
      h.update(rel);
      h.update("\0", 1);
      put_u64(h, uint64_t(folder->label(i)));
    }
    id.digest = finish_hex(h);
  }
  return id;
}

std::optional<SetIdentity> parse_set_identity(const std::string& text) {
  static const std::regex re(R"(^\s*sha256:([0-9a-f]{64}|none) \((rec|folder|other): (\d+) images, (-?\d+) classes\)\s*$)");
  std::smatch m;
  if (!std::regex_match(text, m, re)) return std::nullopt;
  SetIdentity id;
  if (m[1] != "none") id.digest = m[1];
  id.kind = m[2];
  try {
    id.images = std::stoull(m[3]);
    id.classes = std::stoll(m[4]);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  return id;
}

}  // namespace faceshard
