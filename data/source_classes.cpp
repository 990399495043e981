#include "data/source_classes.h"

#include <cerrno>
#include <cstdlib>
#include <fstream>

#include "data/source_paths.h"
#include "base/error.h"

namespace faceshard {

namespace {

std::vector<std::string> split(const std::string& l, char sep) {
  std::vector<std::string> cells;
  size_t a = 0;
  for (size_t b; (b = l.find(sep, a)) != std::string::npos; a = b + 1) cells.push_back(l.substr(a, b - a));
  cells.push_back(l.substr(a));
  return cells;
}

bool to_index(const std::string& s, int64_t limit, int64_t& out) {
  if (s.empty() || s[0] < '0' || s[0] > '9') return false;
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (*end != '\0' || errno != 0 || v < 0 || v >= limit) return false;
  out = v;
  return true;
}

}  // namespace

std::optional<std::vector<std::vector<int64_t>>> source_classes_beside(const std::string& rec_path, int64_t classes,
                                                                       int64_t source_classes) {
  const std::string file = labels_path_of(rec_path);
  std::ifstream f(file);
  if (!f) return std::nullopt;
  std::string line;
  if (!std::getline(f, line)) return std::nullopt;
  if (!line.empty() && line.back() == '\r') line.pop_back();
  size_t label_col = SIZE_MAX, source_col = SIZE_MAX;
  const std::vector<std::string> head = split(line, '\t');
  for (size_t i = 0; i < head.size(); ++i) {
    if (head[i] == "label") label_col = i;
    if (head[i] == "source_classes") source_col = i;
  }
  if (source_col == SIZE_MAX) return std::nullopt;
  if (label_col == SIZE_MAX) throw usage_error(file, ":1: no 'label' column beside 'source_classes'");
  std::vector<std::vector<int64_t>> out(static_cast<size_t>(classes));
  std::vector<bool> seen(out.size(), false), used(static_cast<size_t>(source_classes), false);
  int64_t no = 1, listed = 0;
  while (std::getline(f, line)) {
    ++no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    const std::vector<std::string> cells = split(line, '\t');
    const std::string where = file + ":" + std::to_string(no);
    int64_t c = -1;
    if (label_col >= cells.size() || source_col >= cells.size() || !to_index(cells[label_col], classes, c))
      throw usage_error(where, ": not a line 'label<TAB>source_classes' of one of the set's ", classes, " classes");
    if (seen[size_t(c)]) throw usage_error(where, ": class ", c, " is listed twice");
    seen[size_t(c)] = true;
    ++listed;
    for (const std::string& s : split(cells[source_col], ',')) {
      int64_t k = -1;
      if (!to_index(s, source_classes, k))
        throw usage_error(where, ": source class '", s, "' of class ", c, " is not one of the ", source_classes,
                          " classes of the source set");
      if (used[size_t(k)]) throw usage_error(where, ": source class ", k, " is named a second time");
      used[size_t(k)] = true;
      out[size_t(c)].push_back(k);
    }
  }
  if (listed != classes)
    throw usage_error(file, ": lists ", listed, " classes, the set beside it has ", classes);
  return out;
}

}  // namespace faceshard
