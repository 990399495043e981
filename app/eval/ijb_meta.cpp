#include "app/eval/ijb_meta.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>

#include "base/error.h"

namespace faceshard {

namespace {

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\v' || c == '\f'; }

// Walks a file's lines and splits each into whitespace-separated fields, keeping at most
// `want` + 1 of them (enough to tell a wrong count) so a long line costs nothing extra.
class FieldReader {
 public:
  FieldReader(const IjbMetaText& file, size_t want, const char* what) : f_(file), want_(want), what_(what) {}

  // False at the end of the text; blank lines are skipped.
  bool next() {
    while (pos_ < f_.text.size()) {
      const size_t nl = f_.text.find('\n', pos_);
      const size_t end = nl == std::string::npos ? f_.text.size() : nl;
      ++line_;
      fields_.clear();
      size_t count = 0;
      for (size_t i = pos_; i < end;) {
        while (i < end && is_space(f_.text[i])) ++i;
        if (i == end) break;
        const size_t b = i;
        while (i < end && !is_space(f_.text[i])) ++i;
        if (count++ < want_) fields_.emplace_back(f_.text, b, i - b);
      }
      pos_ = end + 1;
      if (count == 0) continue;
      if (count != want_)
        throw usage_error(f_.name, ":", line_, ": expected ", want_, " fields (", what_, "), got ", count);
      ++rows_;
      return true;
    }
    if (rows_ == 0) throw usage_error(f_.name, ": no entries");
    return false;
  }
  const std::string& field(size_t i) const { return fields_[i]; }
  size_t line() const { return line_; }
  const std::string& name() const { return f_.name; }

  double number(size_t i) const {
    const std::string& s = fields_[i];
    char* end = nullptr;
    const double v = std::strtod(s.c_str(), &end);
    if (end != s.c_str() + s.size() || s.empty())
      throw usage_error(f_.name, ":", line_, ": '", detail::printable(s), "' is not a number");
    if (!std::isfinite(v))
      throw usage_error(f_.name, ":", line_, ": '", detail::printable(s), "' is not a finite number");
    return v;
  }
  int64_t id(size_t i) const {
    const std::string& s = fields_[i];
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(s.c_str(), &end, 10);
    if (end != s.c_str() + s.size()) throw usage_error(f_.name, ":", line_, ": '", detail::printable(s), "' is not an integer id");
    if (errno == ERANGE) throw usage_error(f_.name, ":", line_, ": id '", detail::printable(s), "' is out of range");
    return v;
  }

 private:
  const IjbMetaText& f_;
  size_t want_;
  const char* what_;
  size_t pos_ = 0, line_ = 0, rows_ = 0;
  std::vector<std::string> fields_;
};

// An image name stays under loose_crop/: relative, no '..' component, no NUL (which would
// cut the name short when the file is opened).
bool confined(const std::string& name) {
  if (name.empty() || name[0] == '/' || name.find('\0') != std::string::npos) return false;
  for (size_t b = 0; b <= name.size();) {
    size_t e = name.find('/', b);
    if (e == std::string::npos) e = name.size();
    if (name.compare(b, e - b, "..") == 0) return false;
    b = e + 1;
  }
  return true;
}

IjbMetaText read_text(const std::string& path, const char* what) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw usage_error(path, ": cannot open the ", what, " file");
  std::ostringstream ss;
  ss << f.rdbuf();
  if (f.bad()) throw usage_error(path, ": read error");
  return {path, ss.str()};
}

}  // namespace

IjbMeta parse_ijb_meta(const std::string& target, const IjbMetaText& lmk_file, const IjbMetaText& tid_file,
                       const IjbMetaText& pair_file) {
  IjbMeta m;
  m.target = target;
  FieldReader lmk(lmk_file, 12, "name, 10 landmark coordinates, faceness score");
  while (lmk.next()) {
    std::array<float, 10> p{};
    for (size_t k = 0; k < 10; ++k) p[k] = float(lmk.number(k + 1));
    // A faceness of 0 (or less) would weigh the image's features to nothing and leave a
    // template of zeros, whose scores are silently 0.
    const double faceness = lmk.number(11);
    if (!(faceness > 0))
      throw usage_error(lmk.name(), ":", lmk.line(), ": faceness score must be > 0, got '",
                        detail::printable(lmk.field(11)), "'");
    if (!confined(lmk.field(0)))
      throw usage_error(lmk.name(), ":", lmk.line(), ": image '", detail::printable(lmk.field(0)),
                        "' is not a path inside loose_crop/ (absolute, or with a '..' component)");
    m.images.push_back(lmk.field(0));
    m.image_lines.push_back(lmk.line());
    m.landmarks.push_back(p);
    m.faceness.push_back(faceness);
  }
  FieldReader tid(tid_file, 3, "name, template id, media id");
  std::set<int64_t> known;
  size_t i = 0;
  while (tid.next()) {
    if (i >= m.images.size())
      throw usage_error(tid.name(), ":", tid.line(), ": more images than the ", m.images.size(), " of ", lmk_file.name);
    if (tid.field(0) != m.images[i])
      throw usage_error(tid.name(), ":", tid.line(), ": image '", detail::printable(tid.field(0)), "' but ",
                        lmk_file.name, ":", m.image_lines[i], " has '", detail::printable(m.images[i]),
                        "' as the same entry (the files must list the same images in the same order)");
    m.templates.push_back(tid.id(1));
    m.medias.push_back(tid.id(2));
    known.insert(m.templates.back());
    ++i;
  }
  if (i != m.images.size())
    throw usage_error(tid_file.name, ": ", i, " images, but ", lmk_file.name, " lists ", m.images.size());
  // Checked here, not when scoring: on IJB-C a bad pair would otherwise surface only
  // after every image has been embedded.
  FieldReader pairs(pair_file, 3, "template 1, template 2, label");
  while (pairs.next()) {
    const int64_t t1 = pairs.id(0), t2 = pairs.id(1);
    for (const int64_t t : {t1, t2})
      if (!known.count(t))
        throw usage_error(pairs.name(), ":", pairs.line(), ": template ", t, " has no images in ", tid_file.name);
    const int64_t label = pairs.id(2);
    if (label != 0 && label != 1) throw usage_error(pairs.name(), ":", pairs.line(), ": label must be 0 or 1, got ", label);
    m.pair_t1.push_back(t1);
    m.pair_t2.push_back(t2);
    m.pair_label.push_back(int(label));
  }
  return m;
}

IjbMeta read_ijb_meta(const std::string& root, const std::string& target) {
  std::string t = target;
  for (auto& c : t) c = char(std::tolower(static_cast<unsigned char>(c)));
  if (t != "ijbc" && t != "ijbb") throw usage_error("--target must be IJBC or IJBB, got '", target, "'");
  const std::string meta = root + "/meta/" + t;
  IjbMetaText lmk = read_text(meta + "_name_5pts_score.txt", "name, 10 landmark coordinates, faceness score");
  IjbMetaText tid = read_text(meta + "_face_tid_mid.txt", "name, template id, media id");
  IjbMetaText pairs = read_text(meta + "_template_pair_label.txt", "template 1, template 2, label");
  return parse_ijb_meta(t == "ijbc" ? "IJBC" : "IJBB", lmk, tid, pairs);
}

}  // namespace faceshard
