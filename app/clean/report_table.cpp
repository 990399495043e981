#include "app/clean/report_table.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "base/error.h"

namespace faceshard {

std::vector<std::string> split_tabs(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string x;
  while (std::getline(ss, x, '\t')) out.push_back(x);
  return out;
}

int64_t parse_report_index(const std::string& text, const std::string& where, int64_t limit, const char* what) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno != 0 || v < 0 || v >= limit)
    throw usage_error(where, ": ", what, " '", text, "' is not one of the set's ", limit);
  return v;
}

void read_report(const std::string& path, const std::vector<std::string>& columns,
                 const std::function<void(const std::vector<std::string>&, const std::string&)>& row) {
  constexpr size_t kAbsent = size_t(-1);
  std::ifstream f(path);
  if (!f) throw usage_error(path, ": cannot open (not a faceshard-clean report folder?)");
  std::string line;
  std::vector<size_t> at;
  int64_t no = 0;
  while (std::getline(f, line)) {
    ++no;
    if (line.empty() || line[0] == '#') continue;
    const std::vector<std::string> cells = split_tabs(line);
    if (at.empty()) {
      for (const auto& c : columns) {
        const bool optional = !c.empty() && c[0] == '?';
        const auto it = std::find(cells.begin(), cells.end(), optional ? c.substr(1) : c);
        if (it == cells.end() && !optional) throw usage_error(path, ":", no, ": no column '", c, "'");
        at.push_back(it == cells.end() ? kAbsent : size_t(it - cells.begin()));
      }
      continue;
    }
    std::vector<std::string> v;
    for (size_t i : at) {
      if (i == kAbsent) {
        v.emplace_back();
        continue;
      }
      if (i >= cells.size()) throw usage_error(path, ":", no, ": ", cells.size(), " cells, expected more");
      v.push_back(cells[i]);
    }
    row(v, path + ":" + std::to_string(no));
  }
  if (at.empty()) throw usage_error(path, ": no column line (not a faceshard-clean report)");
}

std::optional<std::string> report_comment(const std::string& path, const std::string& name) {
  std::ifstream f(path);
  if (!f) throw usage_error(path, ": cannot open (not a faceshard-clean report folder?)");
  const std::string prefix = "# " + name + ": ";
  std::string line;
  for (int n = 0; n < 64 && std::getline(f, line); ++n) {
    if (line.rfind(prefix, 0) == 0) return line.substr(prefix.size());
    if (!line.empty() && line[0] != '#') break;
  }
  return std::nullopt;
}

}  // namespace faceshard
