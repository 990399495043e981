#include "app/clean/clean_pack.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <optional>
#include <sstream>

#include "app/clean/report_table.h"
#include "app/io/checkpoint.h"
#include "data/insightface_rec.h"
#include "base/error.h"
#include "base/progress.h"

namespace faceshard {

namespace fs = std::filesystem;

namespace {

// The set a report or keep-list names on its "# set: " comment line, if any.
std::optional<std::string> named_set(const std::string& path) { return report_comment(path, "set"); }

void check_named_set(const std::string& path, const std::string& named, const SetIdentity& set) {
  const std::optional<SetIdentity> id = parse_set_identity(named);
  if (!id) throw usage_error(path, ": its '# set:' line is not a set identity: '", detail::printable(named), "'");
  if (!id->same_as(set))
    throw usage_error(path, ": made from another set (", id->brief(), ") than this one (", set.brief(),
                      "): its image and class numbers would name other images; run faceshard-clean on this set");
}

int64_t root(std::vector<int64_t>& p, int64_t x) {
  while (p[size_t(x)] != x) x = p[size_t(x)] = p[size_t(p[size_t(x)])];
  return x;
}

}  // namespace

CleanPlan plan_from_reports(const std::string& folder, uint64_t images, int64_t classes, const CleanPackOptions& o) {
  CleanPlan p;
  p.drop.assign(images, false);
  p.merge_into.resize(size_t(classes));
  std::iota(p.merge_into.begin(), p.merge_into.end(), 0);
  const int64_t n = int64_t(images);
  auto drop = [&](int64_t i, uint64_t& count) {
    if (!p.drop[size_t(i)]) p.drop[size_t(i)] = true, ++count;
  };
  // The merges first: a mislabeled row pointing at its own merged identity is not dropped.
  if (o.merge_identities)
    read_report(folder + "/duplicate_identities.tsv", {"class_a", "class_b"},
                [&](const auto& v, const std::string& where) {
                  const int64_t a = root(p.merge_into, parse_report_index(v[0], where, classes, "class"));
                  const int64_t b = root(p.merge_into, parse_report_index(v[1], where, classes, "class"));
                  if (a != b) p.merge_into[size_t(std::max(a, b))] = std::min(a, b), ++p.merged_classes;
                });
  for (int64_t c = 0; c < classes; ++c) p.merge_into[size_t(c)] = root(p.merge_into, c);
  if (o.drop_mislabeled)
    read_report(folder + "/mislabeled.tsv", {"index", "?label", "?suggestion"},
                [&](const auto& v, const std::string& where) {
                  const int64_t i = parse_report_index(v[0], where, n, "image");
                  if (o.merge_identities && !v[1].empty() && v[2].rfind("relabel ", 0) == 0) {
                    const int64_t label = parse_report_index(v[1], where, classes, "class");
                    const int64_t to = parse_report_index(v[2].substr(8), where, classes, "class");
                    if (p.merge_into[size_t(label)] == p.merge_into[size_t(to)]) {
                      ++p.kept_mislabeled_merged;
                      return;
                    }
                  }
                  drop(i, p.dropped_mislabeled);
                });
  if (o.drop_near_duplicates)
    read_report(folder + "/near_duplicates.tsv", {"index_b"}, [&](const auto& v, const std::string& where) {
      drop(parse_report_index(v[0], where, n, "image"), p.dropped_near_duplicates);
    });
  std::vector<bool> drop_class(size_t(classes), false);
  if (o.drop_overlap)
    read_report(folder + "/overlap.tsv", {"class"}, [&](const auto& v, const std::string& where) {
      drop_class[size_t(parse_report_index(v[0], where, classes, "class"))] = true;
    });
  {
    std::map<int64_t, std::vector<int64_t>> groups;
    for (int64_t c = 0; c < classes; ++c)
      if (p.merge_into[size_t(c)] != c || groups.count(c)) groups[p.merge_into[size_t(c)]].push_back(c);
    for (auto& [r, members] : groups) {
      if (members.front() != r) members.insert(members.begin(), r);
      if (members.size() > 2) p.merge_chains.push_back(members);
    }
  }
  // A class in a test set goes with every class merged into it (one person).
  std::vector<bool> drop_root(size_t(classes), false);
  for (int64_t c = 0; c < classes; ++c)
    if (drop_class[size_t(c)]) drop_root[size_t(p.merge_into[size_t(c)])] = true, ++p.overlap_classes;
  for (int64_t c = 0; c < classes; ++c)
    if (drop_root[size_t(p.merge_into[size_t(c)])]) p.merge_into[size_t(c)] = -1;
  return p;
}

void check_reports_set(const std::string& folder, const SetIdentity& set, const CleanPackOptions& o) {
  std::vector<std::string> names;
  if (o.drop_mislabeled) names.push_back("mislabeled.tsv");
  if (o.drop_near_duplicates) names.push_back("near_duplicates.tsv");
  if (o.drop_overlap) names.push_back("overlap.tsv");
  if (o.merge_identities) names.push_back("duplicate_identities.tsv");
  for (const std::string& name : names) {
    const std::string path = folder + "/" + name;
    const std::optional<std::string> named = named_set(path);
    if (!named)
      throw usage_error(path, ": says nothing of the set it was made from (no '# set:' line); run faceshard-clean "
                              "on this set again (", set.brief(), ")");
    check_named_set(path, *named, set);
  }
}

void check_keep_list_set(const std::string& file, const SetIdentity& set) {
  std::ifstream probe(file);
  if (!probe) throw usage_error("--keep: cannot open '", file, "'");
  if (const std::optional<std::string> named = named_set(file)) check_named_set(file, *named, set);
}

CleanPlan plan_from_keep_list(const std::string& file, uint64_t images, int64_t classes) {
  std::ifstream f(file);
  if (!f) throw usage_error("--keep: cannot open '", file, "'");
  CleanPlan p;
  p.drop.assign(images, true);
  p.merge_into.resize(size_t(classes));
  std::iota(p.merge_into.begin(), p.merge_into.end(), 0);
  std::string line;
  int64_t no = 0;
  while (std::getline(f, line)) {
    ++no;
    const size_t hash = line.find('#');
    if (hash != std::string::npos) line.resize(hash);
    std::istringstream words(line);
    std::string word;
    while (words >> word)
      p.drop[size_t(parse_report_index(word, file + ":" + std::to_string(no), int64_t(images), "image"))] = false;
  }
  return p;
}

CleanPackResult write_clean_rec(const Dataset& src, const CleanPlan& plan, const std::string& out_prefix) {
  return write_clean_rec(src, plan, out_prefix, CleanPackNames{});
}

CleanPackResult write_clean_rec(const Dataset& src, const CleanPlan& plan, const std::string& out_prefix,
                                const CleanPackNames& names) {
  const uint64_t n = src.size();
  const int64_t classes = int64_t(plan.merge_into.size());
  if (plan.drop.size() != n) throw runtime_error("clean plan for ", plan.drop.size(), " images, the set has ", n);
  // Pass 1: the labels (headers only would do; the records are read whole, once).
  std::vector<int32_t> label(n);
  std::vector<uint64_t> per_root(size_t(classes), 0);
  RawSample s;
  {
    Progress bar("reading labels", n, "images");
    for (uint64_t i = 0; i < n; ++i) {
      src.read(i, s);
      if (s.label < 0 || s.label >= classes)
        throw usage_error(src.describe(i), ": label ", s.label, " is not one of the reports' ", classes, " classes");
      label[i] = int32_t(s.label);
      const int64_t r = plan.merge_into[size_t(s.label)];
      if (!plan.drop[i] && r >= 0) per_root[size_t(r)]++;
      bar.update(i + 1);
    }
  }
  // New labels: the roots that keep images, in order; images grouped by new label.
  std::vector<int64_t> new_label(size_t(classes), -1);
  std::vector<uint64_t> first(1, 0);
  int64_t next = 0;
  for (int64_t c = 0; c < classes; ++c)
    if (per_root[size_t(c)] > 0) new_label[size_t(c)] = next++, first.push_back(first.back() + per_root[size_t(c)]);
  std::vector<uint64_t> order(first.back());
  std::vector<uint64_t> fill(first.begin(), first.end() - 1);
  for (uint64_t i = 0; i < n; ++i) {
    const int64_t r = plan.merge_into[size_t(label[i])];
    if (plan.drop[i] || r < 0) continue;
    order[fill[size_t(new_label[size_t(r)])]++] = i;
  }
  if (order.empty()) throw usage_error("every image of '", src.describe(0), "' would be dropped: nothing to pack");
  const fs::path parent = fs::path(out_prefix).parent_path();
  if (!parent.empty()) fs::create_directories(parent);
  {
    InsightFaceRecWriter writer(out_prefix + ".rec", out_prefix + ".idx");
    Progress bar("packing", order.size(), "images");
    for (int64_t c = 0; c < next; ++c)
      for (uint64_t j = first[size_t(c)]; j < first[size_t(c) + 1]; ++j) {
        src.read(order[j], s);
        writer.add(c, s.bytes);
        bar.update(j + 1);
      }
    writer.commit(next);
  }
  const bool named = names.identities.size() == size_t(classes);
  std::string table = named ? "label\tsource_classes\timages\tidentities\n" : "label\tsource_classes\timages\n";
  std::vector<std::string> sources(static_cast<size_t>(next)), identities(static_cast<size_t>(next));
  for (int64_t c = 0; c < classes; ++c) {
    const int64_t r = plan.merge_into[size_t(c)];
    if (r < 0 || new_label[size_t(r)] < 0) continue;
    std::string& t = sources[size_t(new_label[size_t(r)])];
    t += (t.empty() ? "" : ",") + std::to_string(c);
    if (named) {
      std::string& n = identities[size_t(new_label[size_t(r)])];
      n += (n.empty() ? "" : ",") + names.identities[size_t(c)];
    }
  }
  for (int64_t c = 0; c < next; ++c)
    table += std::to_string(c) + "\t" + sources[size_t(c)] + "\t" + std::to_string(first[size_t(c) + 1] - first[size_t(c)]) +
             (named ? "\t" + identities[size_t(c)] : std::string()) + "\n";
  write_text_durably(table, out_prefix + ".labels.tsv");
  if (names.sources) {  // streamed: a line per image
    const std::string path = sources_path_of(out_prefix + ".rec"), tmp = path + ".tmp";
    std::FILE* f = std::fopen(tmp.c_str(), "wb");
    if (!f) throw runtime_error(path, ": cannot create: ", std::strerror(errno));
    bool ok = std::fputs("index\tlabel\tpath\n", f) >= 0;
    for (int64_t c = 0; c < next && ok; ++c)
      for (uint64_t j = first[size_t(c)]; j < first[size_t(c) + 1] && ok; ++j)
        ok = std::fprintf(f, "%llu\t%lld\t%s\n", (unsigned long long)j, (long long)c,
                          names.sources->path(order[j]).c_str()) > 0;
    ok = std::fflush(f) == 0 && ok && ::fsync(::fileno(f)) == 0;
    if (std::fclose(f) != 0 || !ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
      std::remove(tmp.c_str());
      throw runtime_error(path, ": write failed");
    }
  }
  CleanPackResult r;
  r.kept = order.size();
  r.dropped = n - r.kept;
  r.classes = next;
  return r;
}

}  // namespace faceshard
