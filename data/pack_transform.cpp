#include "data/pack_transform.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <system_error>

#include <opencv2/imgproc.hpp>

#include "data/face_align.h"
#include "data/image_transform.h"
#include "base/error.h"

namespace faceshard {

namespace fs = std::filesystem;

FitMode parse_fit_mode(const std::string& text) {
  if (text == "pad") return FitMode::pad;
  if (text == "center" || text == "centre") return FitMode::center;
  if (text == "stretch") return FitMode::stretch;
  throw usage_error("--fit '", detail::printable(text), "': expected pad, center or stretch");
}

const char* fit_mode_name(FitMode mode) {
  return mode == FitMode::pad ? "pad" : mode == FitMode::center ? "center" : "stretch";
}

namespace {

cv::Mat scaled(const cv::Mat& bgr, int width, int height) {
  if (width == bgr.cols && height == bgr.rows) return bgr;
  cv::Mat out;
  // Area averaging when shrinking (no aliasing), bilinear when enlarging.
  const bool shrink = width <= bgr.cols && height <= bgr.rows;
  cv::resize(bgr, out, cv::Size(width, height), 0, 0, shrink ? cv::INTER_AREA : cv::INTER_LINEAR);
  return out;
}

int side(double length) { return std::max(1, static_cast<int>(std::lround(length))); }

}  // namespace

cv::Mat fit_to_square(const cv::Mat& bgr, int size, FitMode mode) {
  if (bgr.empty() || size < 1) throw runtime_error("fit_to_square: empty image or size < 1");
  if (mode == FitMode::stretch) return scaled(bgr, size, size).clone();
  const double w = bgr.cols, h = bgr.rows;
  if (mode == FitMode::center) {
    const double s = double(size) / std::min(w, h);
    const cv::Mat r = scaled(bgr, std::max(size, side(w * s)), std::max(size, side(h * s)));
    return r(cv::Rect((r.cols - size) / 2, (r.rows - size) / 2, size, size)).clone();
  }
  const double s = double(size) / std::max(w, h);
  const cv::Mat r = scaled(bgr, std::min(size, side(w * s)), std::min(size, side(h * s)));
  cv::Mat out(size, size, bgr.type(), cv::Scalar::all(0));
  r.copyTo(out(cv::Rect((size - r.cols) / 2, (size - r.rows) / 2, r.cols, r.rows)));
  return out;
}

std::string landmark_key(const std::string& path) {
  std::error_code ec;
  fs::path p = fs::absolute(fs::path(path), ec);
  if (ec) p = fs::path(path);
  return p.lexically_normal().string();
}

namespace {

std::string trim(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t\r\n");
  if (a == std::string::npos) return "";
  const size_t b = s.find_last_not_of(" \t\r\n");
  return s.substr(a, b - a + 1);
}

// The whole field as a finite number, or false.
bool parse_float(const std::string& field, float& out) {
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(field.c_str(), &end);
  if (field.empty() || *end != '\0' || errno == ERANGE || !std::isfinite(v)) return false;
  out = static_cast<float>(v);
  return true;
}

}  // namespace

LandmarkList read_landmark_list(const std::string& file, const std::string& base,
                                const std::vector<std::string>& images) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw usage_error("--landmarks '", detail::printable(file), "': cannot open");
  const std::set<std::string> known(images.begin(), images.end());
  LandmarkList list;
  std::map<std::string, int64_t> first_line;
  std::string line;
  int64_t n = 0;
  while (std::getline(in, line)) {
    ++n;
    const std::string where = detail::concat(file, ":", n);
    const std::string text = trim(line);
    if (text.empty() || text[0] == '#') continue;
    // Fields from the end: the last ten are the numbers, what stands before them the path.
    std::vector<std::string> fields;
    std::istringstream ss(text);
    for (std::string f; ss >> f;) fields.push_back(f);
    // The image a bad line meant, as far as it can be told: its first field.
    std::string meant = fields.empty() ? "" : fields[0];
    auto problem = [&](const std::string& what) {
      list.problems.push_back({where, what});
      if (!meant.empty())
        list.reported.insert(landmark_key((fs::path(meant).is_absolute() ? fs::path(meant) : fs::path(base) / meant).string()));
    };
    // The numbers at the end of the line; what stands before them is the path.
    size_t numbers = 0;
    float value = 0;
    while (numbers < fields.size() && parse_float(fields[fields.size() - 1 - numbers], value)) ++numbers;
    if (numbers != 10 || fields.size() == 10) {
      const std::string before = numbers < fields.size() ? fields[fields.size() - 1 - numbers] : "";
      if (numbers == 10) problem("no image path before the 10 numbers");
      else if (numbers < 10 && numbers + 1 < fields.size())  // a path, then something that is no number
        problem(detail::concat("expected 10 numbers after the image path, found ", numbers, " after '",
                               detail::printable(before), "', which is not a number"));
      else
        problem(detail::concat("expected 10 numbers after the image path (x y of the left eye, right eye, nose, left "
                               "and right mouth corner), found ", numbers));
      continue;
    }
    std::array<float, 10> lm{};
    for (size_t k = 0; k < 10; ++k) parse_float(fields[fields.size() - 10 + k], lm[k]);
    // The path: the line up to where the ten numbers begin (it may hold spaces).
    size_t cut = text.size();
    for (size_t k = 0; k < 10; ++k) {
      cut = text.find_last_not_of(" \t", cut - 1);
      cut = text.find_last_of(" \t", cut);
    }
    const std::string path = trim(text.substr(0, cut));
    meant = path;
    const fs::path p = fs::path(path).is_absolute() ? fs::path(path) : fs::path(base) / path;
    const std::string key = landmark_key(p.string());
    std::error_code ec;
    if (!fs::exists(p, ec)) {
      problem(detail::concat("'", detail::printable(path), "': no such image (relative paths are taken from '", base, "')"));
      continue;
    }
    if (!known.count(key)) {
      problem(detail::concat("'", detail::printable(path), "': not one of the images being packed"));
      continue;
    }
    const auto seen = first_line.emplace(key, n);
    if (!seen.second) {
      meant.clear();  // its first line stands
      problem(detail::concat("'", detail::printable(path), "': listed twice (first on line ", seen.first->second, ")"));
      continue;
    }
    if (const std::string why = landmark_problem(lm); !why.empty()) {
      problem(detail::concat("'", detail::printable(path), "': ", why));
      continue;
    }
    list.by_path[key] = lm;
  }
  if (in.bad()) throw usage_error("--landmarks '", detail::printable(file), "': read error");
  return list;
}

std::string transform_image(const std::vector<uint8_t>& bytes, const std::string& path, const PackTransform& t,
                            cv::Mat& out) {
  const std::array<float, 10>* lm = nullptr;
  if (t.kind == PackTransform::Kind::align) {
    const auto it = t.landmarks->by_path.find(landmark_key(path));
    if (it == t.landmarks->by_path.end())
      return t.landmarks->reported.count(landmark_key(path)) ? "-" : "no landmarks for this image in the --landmarks file";
    lm = &it->second;
  }
  cv::Mat bgr;
  try {
    bgr = decode_image(bytes.data(), bytes.size(), "");
  } catch (const Error& e) {
    std::string what = e.detail().empty() ? e.what() : e.detail();
    while (!what.empty() && (what.front() == ':' || what.front() == ' ')) what.erase(what.begin());
    return what.empty() ? "does not decode" : what;
  }
  if (t.kind == PackTransform::Kind::resize) {
    out = fit_to_square(bgr, t.size, t.fit);
    return "";
  }
  if (t.kind == PackTransform::Kind::align) {
    if (const std::string why = landmark_problem(*lm, bgr.cols, bgr.rows); !why.empty()) return why;
    out = align_face(bgr, *lm);
    return "";
  }
  out = bgr;
  return "";
}

}  // namespace faceshard
