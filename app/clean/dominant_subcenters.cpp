#include "app/clean/dominant_subcenters.h"

#include <cstdlib>
#include <filesystem>
#include <optional>

#include "app/clean/report_table.h"
#include "base/error.h"

namespace faceshard {

namespace {

// The number after `key` in `text` ("classes: " in "2000, classes: 100, sub-centres per class: 3").
std::optional<int64_t> number_after(const std::string& text, const std::string& key) {
  const size_t at = text.find(key);
  if (at == std::string::npos) return std::nullopt;
  const char* s = text.c_str() + at + key.size();
  char* end = nullptr;
  const long long v = std::strtoll(s, &end, 10);
  if (end == s) return std::nullopt;
  return v;
}

}  // namespace

DominantSubcenters read_dominant_subcenters(const std::string& folder, int64_t classes, int64_t subcenters) {
  DominantSubcenters d;
  d.file = folder + "/dropped_subcenters.tsv";
  std::error_code ec;
  if (!std::filesystem::is_regular_file(d.file, ec)) {
    if (std::filesystem::is_directory(folder, ec) && std::filesystem::exists(folder + "/mislabeled.tsv", ec))
      throw usage_error(d.file, ": none: this faceshard-clean report was made of a run with one centre per class "
                                "(dropped_subcenters.tsv is written for loss.subcenters > 1 only)");
    throw usage_error(d.file, ": none (give faceshard-clean's --output folder of the run whose centres start this one)");
  }
  // The counts the report was made with: the checkpoint's.
  const std::optional<std::string> counts = report_comment(d.file, "images");
  const std::optional<int64_t> c = counts ? number_after(*counts, "classes: ") : std::nullopt;
  const std::optional<int64_t> k = counts ? number_after(*counts, "sub-centres per class: ") : std::nullopt;
  if (!c || !k)
    throw usage_error(d.file, ": no '# images: N, classes: C, sub-centres per class: K' line (not a faceshard-clean report?)");
  if (*c != classes || *k != subcenters)
    throw usage_error(d.file, ": made of a checkpoint of ", *c, " classes x ", *k, " sub-centres, the centres read are ",
                      classes, " classes x ", subcenters, " sub-centres: the report belongs to another run");
  if (const std::optional<std::string> run = report_comment(d.file, "run"))
    if (const std::optional<int64_t> step = number_after(*run, "(step ")) d.step = *step;
  d.dominant.assign(size_t(classes), -1);
  d.images.assign(size_t(classes), 0);
  read_report(d.file, {"class", "subcenter", "dominant", "dominant_images"},
              [&](const std::vector<std::string>& v, const std::string& where) {
                const int64_t cls = parse_report_index(v[0], where, classes, "class");
                const int64_t sub = parse_report_index(v[1], where, subcenters, "sub-centre");
                const int64_t dom = parse_report_index(v[2], where, subcenters, "dominant sub-centre");
                char* end = nullptr;
                const long long n = std::strtoll(v[3].c_str(), &end, 10);
                if (v[3].empty() || *end != '\0' || n < 0)
                  throw usage_error(where, ": dominant_images '", v[3], "' is not a count of images");
                if (sub == dom) throw usage_error(where, ": class ", cls, "'s dominant sub-centre ", dom, " is listed as dropped");
                int64_t& have = d.dominant[size_t(cls)];
                if (have >= 0 && (have != dom || d.images[size_t(cls)] != n))
                  throw usage_error(where, ": class ", cls, " has dominant sub-centre ", dom, " (", n,
                                    " images) here and ", have, " (", d.images[size_t(cls)], " images) on an earlier line");
                have = dom;
                d.images[size_t(cls)] = n;
              });
  for (int64_t x : d.dominant) d.classes_without_images += x < 0;
  return d;
}

}  // namespace faceshard
