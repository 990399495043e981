#include "data/pack_source.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>

#include "data/image_header.h"
#include "base/error.h"

namespace faceshard {
namespace fs = std::filesystem;

namespace {

bool has_image_extension(const fs::path& p) {
  std::string ext = p.extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  return ext == ".jpg" || ext == ".jpeg" || ext == ".png" || ext == ".bmp";
}

std::string absolute_text(const fs::path& p) {
  std::error_code ec;
  const fs::path a = fs::absolute(p, ec);
  return ec ? p.string() : a.lexically_normal().string();
}

std::vector<std::string> split_tabs(const std::string& line) {
  std::vector<std::string> out;
  size_t at = 0;
  while (true) {
    const size_t t = line.find('\t', at);
    std::string f = line.substr(at, t == std::string::npos ? std::string::npos : t - at);
    while (!f.empty() && (f.back() == '\r' || f.back() == ' ')) f.pop_back();
    while (!f.empty() && f.front() == ' ') f.erase(f.begin());
    out.push_back(f);
    if (t == std::string::npos) return out;
    at = t + 1;
  }
}

// A whole number >= 0, also written as a float ("3", "3.0", "3.000000").
bool parse_label(const std::string& s, int64_t& out) {
  if (s.empty()) return false;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (*end != '\0' || !(v >= 0) || v > 9.007199254740992e15 || v != static_cast<double>(static_cast<int64_t>(v)))
    return false;
  out = static_cast<int64_t>(v);
  return true;
}

// An identity folder that holds folders: identities are the source's own sub-folders, so
// images one level further down are never read. Names the folders and counts their images.
std::string nested_folders_problem(std::vector<fs::path> subdirs, bool no_image) {
  std::sort(subdirs.begin(), subdirs.end());
  uint64_t images = 0;
  std::error_code ec;
  for (const fs::path& d : subdirs)
    for (const auto& e : fs::directory_iterator(d, ec))
      if (e.is_regular_file(ec) && has_image_extension(e.path())) images++;
  std::string names;
  for (size_t k = 0; k < subdirs.size() && k < 3; ++k) names += (k ? ", '" : "'") + subdirs[k].filename().string() + "'";
  if (subdirs.size() > 3) names += detail::concat(" and ", subdirs.size() - 3, " more");
  const std::string what = detail::concat(subdirs.size() == 1 ? "sub-folder " : "sub-folders ", names, " (", images,
                                          images == 1 ? " image" : " images", " in them)");
  if (no_image)
    return "identity folder holds no image, only the " + what +
           ": identities are the folders directly under the source (is the source one level too high?)";
  return "identity folder holds the " + what +
         ": identities are the folders directly under the source, so these are not read; move the images up into "
         "this folder or make each sub-folder an identity of its own";
}

PackSource list_folder(const fs::path& root) {
  PackSource s;
  std::vector<fs::path> dirs;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    if (e.is_directory(ec)) dirs.push_back(e.path());
    else s.ignored_files++;  // files beside the identity folders
  }
  if (ec) throw usage_error("'", absolute_text(root), "': cannot list: ", ec.message());
  std::sort(dirs.begin(), dirs.end());
  for (const fs::path& d : dirs) {
    std::vector<fs::path> imgs, subdirs;
    for (const auto& e : fs::directory_iterator(d, ec)) {
      if (e.is_directory(ec)) subdirs.push_back(e.path());
      else if (e.is_regular_file(ec) && has_image_extension(e.path())) imgs.push_back(e.path());
      else s.ignored_files++;
    }
    if (!subdirs.empty()) s.problems.push_back({d.string(), nested_folders_problem(subdirs, imgs.empty())});
    if (imgs.empty()) {
      if (subdirs.empty()) s.problems.push_back({d.string(), "empty identity folder (no .jpg, .jpeg, .png or .bmp file)"});
      continue;
    }
    std::sort(imgs.begin(), imgs.end());
    const int64_t label = static_cast<int64_t>(s.identities.size());
    s.identities.push_back(d.filename().string());
    for (const fs::path& f : imgs) s.items.push_back({f.string(), label});
  }
  return s;
}

PackSource list_file(const fs::path& list) {
  std::ifstream in(list);
  if (!in) throw usage_error("'", absolute_text(list), "': cannot open the image list");
  PackSource s;
  const fs::path base = list.parent_path();
  std::vector<std::pair<int64_t, std::string>> entries;  // (label as listed, path)
  std::string line;
  for (uint64_t n = 1; std::getline(in, line); ++n) {
    if (line.empty() || line == "\r") continue;
    const std::vector<std::string> f = split_tabs(line);
    const std::string where = list.string() + ":" + std::to_string(n);
    int64_t label = 0;
    std::string path;
    if (f.size() >= 3 && parse_label(f[1], label) && !f.back().empty()) path = f.back();  // idx, label, path
    else if (f.size() >= 3 && parse_label(f[2], label) && !f[1].empty()) path = f[1];    // aligned, path, label
    else {
      s.problems.push_back({where, "expected 'index<TAB>label<TAB>path' or 'aligned<TAB>path<TAB>label'"});
      continue;
    }
    const fs::path p = fs::path(path).is_absolute() ? fs::path(path) : base / path;
    entries.emplace_back(label, p.string());
  }
  // Labels renumbered 0..C-1 in increasing order; the images of a label keep list order.
  std::map<int64_t, std::vector<std::string>> by_label;
  for (auto& e : entries) by_label[e.first].push_back(std::move(e.second));
  for (auto& [listed, paths] : by_label) {
    const int64_t label = static_cast<int64_t>(s.identities.size());
    s.identities.push_back(fs::path(paths.front()).parent_path().filename().string());
    for (auto& p : paths) s.items.push_back({std::move(p), label});
  }
  return s;
}

bool ends_jpeg(const std::vector<uint8_t>& b) {
  // The EOI marker (FF D9), allowing a little padding after it as some writers leave.
  const size_t from = b.size() > 64 ? b.size() - 64 : 0;
  for (size_t i = b.size(); i-- > from + 1;)
    if (b[i - 1] == 0xFF && b[i] == 0xD9) return true;
  return false;
}

bool ends_png(const std::vector<uint8_t>& b) {
  static const uint8_t iend[] = {'I', 'E', 'N', 'D'};
  return b.size() >= 12 && std::equal(iend, iend + 4, b.end() - 8);
}

}  // namespace

PackSource list_pack_source(const std::string& source) {
  std::error_code ec;
  const fs::path p(source);
  if (!fs::exists(p, ec)) throw usage_error("'", absolute_text(p), "': does not exist");
  if (fs::is_directory(p, ec)) return list_folder(p);
  if (p.extension() == ".lst") return list_file(p);
  throw usage_error("'", absolute_text(p),
                    "': is a file; give a folder with one sub-folder per identity or an image list (.lst)");
}

std::string check_image_bytes(const std::vector<uint8_t>& bytes, int size) {
  EncodedImageHeader h;
  try {
    h = read_image_header(bytes.data(), bytes.size(), "");
  } catch (const Error& e) {
    std::string what = e.detail().empty() ? e.what() : e.detail();
    while (!what.empty() && (what.front() == ':' || what.front() == ' ')) what.erase(what.begin());
    return what.empty() ? "not a JPEG, PNG or BMP image" : what;
  }
  if (h.decoded_width() != size || h.decoded_height() != size)
    return detail::concat("image is ", h.decoded_width(), "x", h.decoded_height(), ", expected ", size, "x", size,
                          " (faceshard-pack --resize 112 resizes crops,"
                          " --landmarks FILE aligns photos)");
  if (h.format == ImageFormat::jpeg && !ends_jpeg(bytes)) return "cut short (no JPEG end marker)";
  if (h.format == ImageFormat::png && !ends_png(bytes)) return "cut short (no PNG IEND chunk)";
  if (h.format == ImageFormat::bmp) {
    const uint64_t row = (static_cast<uint64_t>(h.width) * static_cast<uint64_t>(h.bit_depth) + 31) / 32 * 4;
    if (bytes.size() < h.bmp_pixel_offset + row * static_cast<uint64_t>(h.height)) return "cut short (BMP rows missing)";
  }
  return "";
}

std::vector<std::string> drop_items(PackSource& source, const std::vector<uint64_t>& bad) {
  std::vector<PackItem> kept;
  std::vector<int64_t> count(source.identities.size(), 0);
  size_t b = 0;
  for (uint64_t i = 0; i < source.items.size(); ++i) {
    if (b < bad.size() && bad[b] == i) {
      ++b;
      continue;
    }
    count[static_cast<size_t>(source.items[i].label)]++;
    kept.push_back(std::move(source.items[i]));
  }
  std::vector<int64_t> renumber(source.identities.size(), -1);
  std::vector<std::string> names, emptied;
  for (size_t c = 0; c < count.size(); ++c) {
    if (count[c] == 0) {
      emptied.push_back(source.identities[c]);
      continue;
    }
    renumber[c] = static_cast<int64_t>(names.size());
    names.push_back(source.identities[c]);
  }
  for (PackItem& it : kept) it.label = renumber[static_cast<size_t>(it.label)];
  source.items = std::move(kept);
  source.identities = std::move(names);
  return emptied;
}

}  // namespace faceshard
