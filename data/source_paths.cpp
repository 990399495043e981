#include "data/source_paths.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "base/error.h"

namespace faceshard {

std::string sources_path_of(const std::string& rec_path) {
  std::filesystem::path p(rec_path);
  p.replace_extension(".sources.tsv");
  return p.string();
}

std::string labels_path_of(const std::string& rec_path) {
  std::filesystem::path p(rec_path);
  p.replace_extension(".labels.tsv");
  return p.string();
}

IdentityNames identity_names_beside(const std::string& rec_path, int64_t classes) {
  IdentityNames out;
  const std::string file = labels_path_of(rec_path);
  std::ifstream f(file);
  if (!f) {
    out.problem = file + ": none";
    return out;
  }
  std::vector<std::string> names(static_cast<size_t>(std::max<int64_t>(classes, 0)));
  std::vector<bool> seen(names.size(), false);
  std::string line;
  size_t label_col = SIZE_MAX, name_col = SIZE_MAX;
  int64_t no = 0, named = 0;
  auto split = [](const std::string& l) {
    std::vector<std::string> cells;
    size_t a = 0;
    for (size_t b; (b = l.find('\t', a)) != std::string::npos; a = b + 1) cells.push_back(l.substr(a, b - a));
    cells.push_back(l.substr(a));
    return cells;
  };
  while (std::getline(f, line)) {
    ++no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    const std::vector<std::string> cells = split(line);
    if (no == 1) {
      for (size_t i = 0; i < cells.size(); ++i) {
        if (cells[i] == "label") label_col = i;
        if (cells[i] == "identity" || cells[i] == "identities") name_col = i;
      }
      if (label_col == SIZE_MAX || name_col == SIZE_MAX) {
        out.problem = file + ": no 'label' and 'identity' columns";
        return out;
      }
      continue;
    }
    char* end = nullptr;
    const long long c = label_col < cells.size() ? std::strtoll(cells[label_col].c_str(), &end, 10) : -1;
    if (name_col >= cells.size() || !end || *end != '\0' || c < 0 || c >= classes || seen[size_t(c)]) {
      out.problem = file + ":" + std::to_string(no) + ": not a class of the set's " + std::to_string(classes) + " named once";
      return out;
    }
    seen[size_t(c)] = true;
    names[size_t(c)] = cells[name_col];
    ++named;
  }
  if (named != classes) {
    out.problem = file + ": names " + std::to_string(named) + " classes, the set has " + std::to_string(classes);
    return out;
  }
  out.names = std::move(names);
  return out;
}

std::shared_ptr<const SourcePaths> SourcePaths::open_beside(const std::string& rec_path, uint64_t images) {
  const std::string file = sources_path_of(rec_path);
  std::error_code ec;
  if (!std::filesystem::is_regular_file(file, ec)) return nullptr;
  std::shared_ptr<SourcePaths> owned(new SourcePaths());
  SourcePaths& s = *owned;
  s.file_ = file;
  s.fd_ = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (s.fd_ < 0) throw usage_error(file, ": cannot open: ", std::strerror(errno));
  std::FILE* f = std::fopen(file.c_str(), "rb");
  if (!f) throw usage_error(file, ": cannot open: ", std::strerror(errno));
  s.offsets_.reserve(static_cast<size_t>(images) + 1);
  // One pass: each line's start and its path's offset (after the second tab).
  uint64_t pos = 0, line = 0, tabs = 0, field = 0, index = 0;
  bool header = true, digits = true;
  std::string first;
  for (int c; (c = std::getc(f)) != EOF; ++pos) {
    if (header) {
      if (c == '\n') {
        header = false;
        if (first != "index\tlabel\tpath") {
          std::fclose(f);
          throw usage_error(file, ":1: expected the header 'index<TAB>label<TAB>path' (faceshard-pack's sources list)");
        }
        line = 1;
      } else if (first.size() < 64) {
        first.push_back(static_cast<char>(c));
      }
      continue;
    }
    if (c == '\n') {
      if (tabs < 2) {
        std::fclose(f);
        throw usage_error(file, ":", line + 1, ": expected 'index<TAB>label<TAB>path'");
      }
      ++line, tabs = 0, field = 0, index = 0, digits = true;
      continue;
    }
    if (c == '\t' && tabs < 2) {
      if (tabs == 0 && (!digits || field == 0 || index != line - 1)) {
        std::fclose(f);
        throw usage_error(file, ":", line + 1, ": expected image ", line - 1, " (the set's image order)");
      }
      ++tabs;
      if (tabs == 2) {
        if (s.offsets_.size() >= images) {
          std::fclose(f);
          throw usage_error(file, ": lists more than the set's ", images, " images (made for another set?)");
        }
        s.offsets_.push_back(pos + 1);
      }
      continue;
    }
    if (tabs == 0) {
      ++field;
      if (c < '0' || c > '9' || index > (UINT64_MAX - 9) / 10) digits = false;
      else index = index * 10 + uint64_t(c - '0');
    }
  }
  std::fclose(f);
  if (header || s.offsets_.size() != images)
    throw usage_error(file, ": lists ", s.offsets_.size(), " images, the set has ", images, " (made for another set?)");
  s.offsets_.push_back(pos);  // the end, for the last line
  return owned;
}

SourcePaths::~SourcePaths() {
  if (fd_ >= 0) ::close(fd_);
}

std::string SourcePaths::path(uint64_t index) const {
  if (index + 1 >= offsets_.size()) throw runtime_error(file_, ": no image ", index);
  const uint64_t a = offsets_[index], b = offsets_[index + 1];
  std::string out(static_cast<size_t>(std::min<uint64_t>(b - a, 1 << 16)), '\0');
  const ssize_t n = ::pread(fd_, out.data(), out.size(), static_cast<off_t>(a));
  if (n < 0) throw runtime_error(file_, ": read error: ", std::strerror(errno));
  out.resize(static_cast<size_t>(n));
  const size_t end = out.find('\n');
  if (end != std::string::npos) out.resize(end);
  return out;
}

}  // namespace faceshard
