#include "app/config/config.h"
#include "app/config/limits.h"

#include <yaml-cpp/depthguard.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>

#include "partial_fc/classifier/head_catalogue.h"
#include "base/error.h"
#include "base/near_name.h"

namespace fs = std::filesystem;

namespace faceshard {

struct MergedYaml {
  YAML::Node root = YAML::Node(YAML::NodeType::Map);
  std::map<std::string, std::string> origin;  // key path -> file (or "--set") that set it
  std::map<std::string, int> line;            // key path -> its line in that file (files only)
  std::string top;                            // the file named on the command line
};

namespace {

// "file:line" (or the file alone when the line is unknown, as for --set).
std::string at_line(const std::string& file, int line) {
  return line > 0 ? file + ":" + std::to_string(line) : file;
}

// The file (and line) that set `path`, or set its nearest ancestor section; `top` when
// none did.
std::string nearest_origin(const std::map<std::string, std::string>& origin, const std::map<std::string, int>& lines,
                           const std::string& top, const std::string& path) {
  for (std::string p = path;;) {
    auto it = origin.find(p);
    if (it != origin.end()) {
      auto l = lines.find(p);
      return at_line(it->second, l == lines.end() ? 0 : l->second);
    }
    auto dot = p.rfind('.');
    if (dot == std::string::npos) return top;
    p = p.substr(0, dot);
  }
}

std::string merged_origin(const MergedYaml& m, const std::string& path) {
  return nearest_origin(m.origin, m.line, m.top, path);
}

std::string join(const std::string& a, const std::string& b) { return a.empty() ? b : a + "." + b; }

int line_of(const YAML::Node& n) { return n.Mark().is_null() ? 0 : n.Mark().line + 1; }

// Keys are checked to be scalars when a file is parsed (check_document), so this cannot
// throw yaml-cpp's "bad conversion".
std::string key_of(const YAML::Node& k) { return k.IsScalar() ? k.Scalar() : std::string(); }

// Records who set `path` and everything below it. Iterative: check_document has bounded
// the document's depth and size (aliases expanded), so this walk is bounded too.
// The line a key's value starts on, for files (--set values have no lines).
int line_in(const YAML::Node& n, const std::string& file) { return file == "--set" ? 0 : line_of(n); }

void set_origin(MergedYaml& m, const std::string& path, const std::string& file, const YAML::Node& n) {
  m.origin[path] = file;
  if (const int l = line_in(n, file); l > 0) m.line[path] = l;
  else m.line.erase(path);
}

void record_origins(const YAML::Node& top, const std::string& top_path, const std::string& file, MergedYaml& m) {
  std::vector<std::pair<YAML::Node, std::string>> todo{{top, top_path}};
  while (!todo.empty()) {
    auto [n, path] = std::move(todo.back());
    todo.pop_back();
    if (!path.empty()) set_origin(m, path, file, n);
    if (n.IsMap())
      for (auto it = n.begin(); it != n.end(); ++it) todo.emplace_back(it->second, join(path, key_of(it->first)));
  }
}

// Deep merge: maps merge key by key, anything else replaces.
void merge_into(YAML::Node dst, const YAML::Node& src, const std::string& path, const std::string& file, MergedYaml& m) {
  for (auto it = src.begin(); it != src.end(); ++it) {
    const std::string key = key_of(it->first);
    const std::string p = join(path, key);
    if (it->second.IsMap() && dst[key] && dst[key].IsMap()) {
      merge_into(dst[key], it->second, p, file, m);
      set_origin(m, p, file, it->second);
    } else {
      dst[key] = YAML::Clone(it->second);
      // Forget origins of keys the new value replaced.
      for (auto o = m.origin.lower_bound(p + "."); o != m.origin.end() && o->first.rfind(p + ".", 0) == 0;) {
        m.line.erase(o->first);
        o = m.origin.erase(o);
      }
      record_origins(it->second, p, file, m);
    }
  }
}

// Limits on a config document. A config is a few KB of keys two or three levels deep;
// the limits keep a hostile file (deep nesting, aliases that expand exponentially, a
// huge file) from costing more than a few MB or recursing deeply in yaml-cpp or here.
constexpr size_t kMaxConfigBytes = size_t(256) << 10;
constexpr int kMaxDepth = 32;
constexpr size_t kMaxValues = 100000;  // values visited with aliases expanded
// Limits on a config with its bases. The depth and cycle checks follow one chain of
// includes; a list that names the same file at every level stays within them and still
// loads 10^depth files. So every file loaded counts, a base included twice twice.
constexpr int kMaxBaseDepth = 16;
constexpr size_t kMaxConfigFiles = 64;
constexpr size_t kMaxConfigTotalBytes = size_t(1) << 20;

// The key path of `line` (1-based) in block-style YAML text, from the keys on that line
// and the less-indented lines above it: what a syntax error names besides file and line.
std::string key_path_at_line(const std::string& text, int line) {
  std::vector<std::pair<size_t, std::string>> stack;  // (indent, key)
  size_t pos = 0;
  for (int no = 1; no <= line && pos <= text.size(); ++no) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    const std::string l = text.substr(pos, end - pos);
    pos = end + 1;
    size_t indent = 0;
    while (indent < l.size() && l[indent] == ' ') ++indent;
    if (indent == l.size() || l[indent] == '#') continue;
    size_t b = indent;
    while (b + 1 < l.size() && l[b] == '-' && l[b + 1] == ' ') b += 2;  // "- key: ..."
    size_t colon = std::string::npos;
    const char q = l[b];
    if (q == '"' || q == '\'') {
      const size_t close = l.find(q, b + 1);
      if (close != std::string::npos && close + 1 < l.size() && l[close + 1] == ':') colon = close + 1;
    } else if (q != '[' && q != '{' && q != '-' && q != '?') {
      for (size_t i = b; i < l.size() && l[i] != '#'; ++i)
        if (l[i] == ':' && (i + 1 == l.size() || l[i + 1] == ' ' || l[i + 1] == '\t')) {
          colon = i;
          break;
        }
    }
    while (!stack.empty() && stack.back().first >= indent) stack.pop_back();
    if (colon == std::string::npos) continue;
    std::string key = l.substr(b, colon - b);
    while (!key.empty() && key.back() == ' ') key.pop_back();
    if (key.size() >= 2 && (key[0] == '"' || key[0] == '\'')) key = key.substr(1, key.size() - 2);
    stack.emplace_back(indent, key);
  }
  std::string path;
  for (const auto& [indent, key] : stack) path = join(path, key);
  return path;
}

std::string where(const std::string& name, const YAML::Mark& mark) {
  if (mark.is_null()) return name;
  return name + ":" + std::to_string(mark.line + 1) + ":" + std::to_string(mark.column + 1);
}

std::string key_text(const std::string& path) {
  return path.empty() ? std::string() : "key '" + detail::printable(path) + "': ";
}

// Walks a parsed document once, iteratively, before anything else reads it: every key of
// every mapping must be a plain scalar and appear once, nesting stays under kMaxDepth and
// the values, aliases expanded, number at most kMaxValues. Errors name file, line,
// column and the key path.
void check_document(const YAML::Node& root, const std::string& name) {
  struct Item {
    YAML::Node node;
    std::string path;
    int depth;
  };
  std::vector<Item> todo{{root, "", 0}};
  size_t visited = 0;
  while (!todo.empty()) {
    Item item = std::move(todo.back());
    todo.pop_back();
    if (++visited > kMaxValues)
      throw usage_error(where(name, item.node.Mark()), ": ", key_text(item.path), "more than ", kMaxValues,
                        " values once aliases are expanded (a config holds a few hundred)");
    if (item.depth > kMaxDepth)
      throw usage_error(where(name, item.node.Mark()), ": ", key_text(item.path), "values nested more than ",
                        kMaxDepth, " levels deep");
    if (item.node.IsMap()) {
      std::map<std::string, int> seen;
      for (auto it = item.node.begin(); it != item.node.end(); ++it) {
        const YAML::Node k = it->first;  // a copy: the iterator hands out temporaries
        if (!k.IsScalar()) {
          const std::string got = k.IsNull() ? "an empty key" : k.IsSequence() ? "a list" : "a mapping";
          throw usage_error(where(name, k.Mark()), ": ", key_text(item.path), "expected a key name, got ", got);
        }
        const std::string p = join(item.path, k.Scalar());
        auto [prev, fresh] = seen.emplace(k.Scalar(), line_of(k));
        if (!fresh)
          throw usage_error(where(name, k.Mark()), ": key '", detail::printable(p), "' appears twice in one mapping (first at line ",
                            prev->second, ")");
        todo.push_back({it->second, p, item.depth + 1});
      }
    } else if (item.node.IsSequence()) {
      size_t i = 0;
      for (auto it = item.node.begin(); it != item.node.end(); ++it, ++i)
        todo.push_back({*it, item.path + "[" + std::to_string(i) + "]", item.depth + 1});
    }
  }
}

// Parses one document and checks it (check_document). A syntax error names the file,
// line and column, and the key path that line is under.
YAML::Node parse_yaml(const std::string& text, const std::string& name) {
  if (text.size() > kMaxConfigBytes)
    throw usage_error(name, ": ", text.size(), " bytes; a config file is at most ", kMaxConfigBytes >> 10, " KiB");
  YAML::Node n;
  try {
    n = YAML::Load(text);
  } catch (const YAML::DeepRecursion& e) {
    throw usage_error(where(name, e.mark), ": ", key_text(key_path_at_line(text, e.mark.line + 1)),
                      "values nested too deeply (more than ", kMaxDepth, " levels)");
  } catch (const YAML::Exception& e) {
    throw usage_error(where(name, e.mark), ": ", key_text(key_path_at_line(text, e.mark.line + 1)),
                      "YAML syntax error: ", detail::printable(e.msg, 200));
  }
  if (n.IsNull()) return YAML::Node(YAML::NodeType::Map);
  if (!n.IsMap()) throw usage_error(where(name, n.Mark()), ": expected a mapping of keys at the top level");
  check_document(n, name);
  return n;
}

std::string read_text(const std::string& path, const std::string& referrer) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) {
    if (referrer.empty()) {
      const std::string abs = fs::absolute(path, ec).lexically_normal().string();
      if (fs::is_regular_file(path + ".yaml", ec))
        throw usage_error("config file '", abs, "' not found (did you mean '", path, ".yaml'?)");
      if (fs::is_directory(path, ec)) throw usage_error("config file '", abs, "' is a folder; give a .yaml file");
      throw usage_error("config file '", abs, "' not found");
    }
    throw usage_error(referrer, ": key 'base': base file '", detail::printable(path, 400), "' not found");
  }
  const auto size = fs::file_size(path, ec);
  if (!ec && size > kMaxConfigBytes)
    throw usage_error(path, ": ", size, " bytes; a config file is at most ", kMaxConfigBytes >> 10, " KiB");
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// What a config and its bases have loaded so far (kMaxConfigFiles, kMaxConfigTotalBytes).
struct LoadBudget {
  size_t files = 0;
  size_t bytes = 0;
};

// "a.yaml -> b.yaml -> c.yaml": the chain of bases that leads to a file.
std::string chain_text(const std::vector<std::string>& stack) {
  std::string out;
  for (const auto& s : stack) out += (out.empty() ? "" : " -> ") + detail::printable(s, 200);
  return out;
}

// Counts one more file of `bytes` (stack: the chain that loads it, itself included).
void charge(LoadBudget& budget, size_t bytes, const std::string& at, const std::vector<std::string>& stack) {
  budget.files += 1;
  budget.bytes += bytes;
  if (budget.files > kMaxConfigFiles)
    throw usage_error(at, ": key 'base': a config and its bases load more than ", kMaxConfigFiles,
                      " files (a base counts each time it is included), at ", chain_text(stack));
  if (budget.bytes > kMaxConfigTotalBytes)
    throw usage_error(at, ": key 'base': a config and its bases load more than ", kMaxConfigTotalBytes >> 10,
                      " KiB in all (a base counts each time it is included), at ", chain_text(stack));
}

void load_layer(MergedYaml& m, const std::string& text, const std::string& name, const fs::path& dir,
                std::vector<std::string>& stack, LoadBudget& budget) {
  YAML::Node root = parse_yaml(text, name);
  if (root["base"]) {
    YAML::Node base = root["base"];
    std::vector<std::string> bases;
    const std::string at = at_line(name, line_of(base));
    if (base.IsScalar()) {
      bases.push_back(base.Scalar());
    } else if (base.IsSequence()) {
      for (const auto& b : base) {
        if (!b.IsScalar()) throw usage_error(at, ": key 'base': expected a file name or a list of file names");
        bases.push_back(b.Scalar());
      }
    } else {
      throw usage_error(at, ": key 'base': expected a file name or a list of file names");
    }
    if (stack.size() > kMaxBaseDepth)
      throw usage_error(at, ": key 'base': bases nested more than ", kMaxBaseDepth, " files deep: ", chain_text(stack));
    root.remove("base");
    for (const auto& b : bases) {
      fs::path p = fs::path(b).is_absolute() ? fs::path(b) : dir / b;
      std::string ps = p.lexically_normal().string();
      for (const auto& s : stack)
        if (s == ps)
          throw usage_error(at, ": key 'base': '", detail::printable(b), "' includes itself (cycle): ",
                            chain_text(stack), " -> ", detail::printable(ps, 200));
      std::string sub = read_text(ps, at);
      stack.push_back(ps);
      charge(budget, sub.size(), at, stack);
      load_layer(m, sub, ps, p.parent_path(), stack, budget);
      stack.pop_back();
    }
  }
  merge_into(m.root, root, "", name, m);
}

void apply_override(MergedYaml& m, const std::string& ov) {
  auto eq = ov.find('=');
  if (eq == std::string::npos || eq == 0)
    throw usage_error("--set '", detail::printable(ov), "': expected key.path=value, one word with '=' (e.g. --set ",
                      eq == std::string::npos && !ov.empty() ? detail::printable(ov) : "optim.lr", "=VALUE)");
  std::string path = ov.substr(0, eq);
  std::string value = ov.substr(eq + 1);
  YAML::Node v;
  try {
    v = YAML::Load(value);
  } catch (const YAML::Exception& e) {
    throw usage_error("--set '", detail::printable(ov), "': the value is not valid YAML: ", detail::printable(e.msg, 200));
  }
  check_document(v, "--set '" + detail::printable(ov) + "'");
  if (v.IsNull() && !value.empty() && value != "null" && value != "~") v = YAML::Node(value);
  std::vector<std::string> parts;
  std::stringstream ss(path);
  for (std::string part; std::getline(ss, part, '.');) {
    if (part.empty()) throw usage_error("--set '", detail::printable(ov), "': empty key in '", detail::printable(path), "'");
    parts.push_back(part);
  }
  YAML::Node wrapper(YAML::NodeType::Map);
  YAML::Node cur = wrapper;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    cur[parts[i]] = YAML::Node(YAML::NodeType::Map);
    cur.reset(cur[parts[i]]);
  }
  cur[parts.back()] = v;
  merge_into(m.root, wrapper, "", "--set", m);
}

YAML::Node find(const YAML::Node& root, const std::string& path) {
  YAML::Node cur = root;
  std::stringstream ss(path);
  for (std::string part; std::getline(ss, part, '.');) {
    if (!cur.IsMap()) return YAML::Node(YAML::NodeType::Undefined);
    YAML::Node next = cur[part];
    if (!next.IsDefined()) return YAML::Node(YAML::NodeType::Undefined);
    cur.reset(next);
  }
  return cur;
}

std::string show(const YAML::Node& n) {
  if (n.IsScalar()) return "'" + detail::printable(n.Scalar()) + "'";
  if (n.IsSequence()) return "a list";
  if (n.IsMap()) return "a mapping";
  return "nothing";
}

class Reader : public FieldVisitor {
 public:
  explicit Reader(const MergedYaml& m) : m_(m) {}

  void field(const std::string& p, std::string& v, const FieldSpec& s) override {
    YAML::Node n = get(p, s);
    if (!n) return;
    if (!n.IsScalar()) fail(p, "expected a string, got " + show(n));
    v = n.Scalar();
    if (!s.choices.empty() && std::find(s.choices.begin(), s.choices.end(), v) == s.choices.end()) {
      std::string c;
      for (auto& x : s.choices) c += (c.empty() ? "" : ", ") + x;
      fail(p, "expected one of {" + c + "}, got '" + detail::printable(v) + "'");
    }
  }
  void field(const std::string& p, int64_t& v, const FieldSpec& s) override {
    YAML::Node n = get(p, s);
    if (!n) return;
    const std::string t = n.IsScalar() ? n.Scalar() : "";
    char* end = nullptr;
    errno = 0;
    long long x = n.IsScalar() ? std::strtoll(t.c_str(), &end, 10) : 0;
    if (!n.IsScalar() || t.empty() || *end != '\0' || errno == ERANGE) fail(p, "expected an integer, got " + show(n));
    range(p, static_cast<double>(x), s);
    v = x;
  }
  void field(const std::string& p, double& v, const FieldSpec& s) override {
    YAML::Node n = get(p, s);
    if (!n) return;
    v = number(p, n);
    range(p, v, s);
  }
  void field(const std::string& p, bool& v, const FieldSpec& s) override {
    YAML::Node n = get(p, s);
    if (!n) return;
    const std::string t = n.IsScalar() ? n.Scalar() : "";
    if (t == "true" || t == "True" || t == "yes" || t == "on") v = true;
    else if (t == "false" || t == "False" || t == "no" || t == "off") v = false;
    else fail(p, "expected true or false, got " + show(n));
  }
  void field(const std::string& p, std::vector<std::string>& v, const FieldSpec& s) override {
    YAML::Node n = get(p, s);
    if (!n) return;
    if (n.IsScalar() && n.Scalar().empty()) {
      v.clear();
      return;
    }
    if (!n.IsSequence()) fail(p, "expected a list of strings, got " + show(n) + " (write a list as [a, b], e.g. --set '" + p + "=[a, b]')");
    v.clear();
    for (const auto& e : n) {
      if (!e.IsScalar()) fail(p, "expected a list of strings, found " + show(e) + " in it");
      v.push_back(e.Scalar());
    }
    length(p, v.size(), s);
  }
  void field(const std::string& p, std::vector<double>& v, const FieldSpec& s) override {
    YAML::Node n = get(p, s);
    if (!n) return;
    if (!n.IsSequence()) fail(p, "expected a list of numbers, got " + show(n) + " (write a list as [x, y, z], e.g. --set '" + p + "=[1.0, 0.5, 0.0]')");
    v.clear();
    for (const auto& e : n) v.push_back(number(p, e));
    length(p, v.size(), s);
  }
  void field(const std::string& p, std::optional<std::string>& v, const FieldSpec& s) override { optional(p, v, s); }
  void field(const std::string& p, std::optional<int64_t>& v, const FieldSpec& s) override { optional(p, v, s); }
  void field(const std::string& p, std::optional<double>& v, const FieldSpec& s) override { optional(p, v, s); }
  void field(const std::string& p, std::optional<bool>& v, const FieldSpec& s) override { optional(p, v, s); }

  // Every key in the files must be one the config knows.
  void check_unknown(const YAML::Node& n, const std::string& path) {
    if (!n.IsMap()) return;
    for (auto it = n.begin(); it != n.end(); ++it) {
      const std::string p = join(path, key_of(it->first));
      if (known_.count(p)) continue;
      if (sections_.count(p)) {
        if (!it->second.IsMap() && !it->second.IsNull()) fail(p, "expected a mapping (a section), got " + show(it->second));
        check_unknown(it->second, p);
        continue;
      }
      throw usage_error(merged_origin(m_, p), ": unknown key '", detail::printable(p), "'", suggestion(p));
    }
  }

 private:
  // Absent or null: not set (a later layer's null unsets an earlier value).
  template <typename T>
  void optional(const std::string& p, std::optional<T>& v, const FieldSpec& s) {
    YAML::Node n = get(p, s);
    if (!n) {
      if (find(m_.root, p).IsDefined()) v.reset();
      return;
    }
    T x{};
    field(p, x, s);
    v = x;
  }
  YAML::Node get(const std::string& p, const FieldSpec& s) {
    known_.insert(p);
    for (auto dot = p.find('.'); dot != std::string::npos; dot = p.find('.', dot + 1)) {
      const std::string section = p.substr(0, dot);
      sections_.insert(section);
      YAML::Node sn = find(m_.root, section);
      if (sn.IsDefined() && !sn.IsMap() && !sn.IsNull()) fail(section, "expected a mapping (a section), got " + show(sn));
    }
    YAML::Node n = find(m_.root, p);
    if (!n.IsDefined() || (n.IsNull() && !s.required)) {
      if (s.required) throw usage_error(m_.top, ": missing required key '", p, "'");
      return YAML::Node(YAML::NodeType::Undefined);
    }
    if (n.IsNull()) throw usage_error(merged_origin(m_, p), ": key '", p, "' is required but empty");
    return n;
  }
  double number(const std::string& p, const YAML::Node& n) {
    const std::string t = n.IsScalar() ? n.Scalar() : "";
    char* end = nullptr;
    double x = n.IsScalar() ? std::strtod(t.c_str(), &end) : 0;
    if (!n.IsScalar() || t.empty() || *end != '\0' || !std::isfinite(x)) fail(p, "expected a number, got " + show(n));
    return x;
  }
  void range(const std::string& p, double x, const FieldSpec& s) {
    std::ostringstream os;
    if (s.min && (x < *s.min || (s.min_exclusive && x == *s.min))) {
      os << "must be " << (s.min_exclusive ? "> " : ">= ") << *s.min << ", got " << x;
      fail(p, os.str());
    }
    if (s.max && x > *s.max) {
      os << "must be <= " << *s.max << ", got " << x;
      fail(p, os.str());
    }
  }
  void length(const std::string& p, size_t n, const FieldSpec& s) {
    if (s.list_length >= 0 && static_cast<int>(n) != s.list_length)
      fail(p, "expected a list of " + std::to_string(s.list_length) + " values, got " + std::to_string(n));
  }
  // The known key (or section) a slip most likely meant: arcface_torch's name for it, the
  // same last component in another section (a misplaced key), or the nearest spelling.
  std::string suggestion(const std::string& p) const {
    static const std::map<std::string, std::string> arcface_torch_names = {
        {"network", "model.backbone"},       {"fp16", "train.precision"},        {"num_image", "data.num_images"},
        {"num_epoch", "optim.epochs"},       {"warmup_epoch", "optim.warmup_epochs"},
        {"learning_rate", "optim.lr"},       {"verbose", "train.verify_every"},  {"resume", "train.resume"},
        {"embedding_size", "model.embedding_size"}, {"sample_rate", "loss.sample_rate"},
        {"rec", "data.rec"},                 {"num_classes", "data.num_classes"}, {"batch_size", "data.batch_size"},
        {"val_targets", "data.val_targets"}, {"weight_decay", "optim.weight_decay"}, {"momentum", "optim.momentum"},
        {"lr", "optim.lr"},                  {"optimizer", "optim.optimizer"},    {"margin_list", "loss.margin"}};
    auto mean = [](const std::string& k) { return " (did you mean '" + k + "'?)"; };
    const std::string last = p.substr(p.rfind('.') == std::string::npos ? 0 : p.rfind('.') + 1);
    if (auto it = arcface_torch_names.find(last); it != arcface_torch_names.end() && it->second != p &&
                                                  known_.count(it->second))
      return mean(it->second);
    for (const auto& k : known_)
      if (k.size() >= last.size() && k.compare(k.size() - last.size(), last.size(), last) == 0 &&
          (k.size() == last.size() || k[k.size() - last.size() - 1] == '.'))
        return mean(k);
    // The nearest spelling among keys and sections, if close: at most 2 edits, or a quarter
    // of the name for long ones.
    std::vector<std::string> names(known_.begin(), known_.end());
    names.insert(names.end(), sections_.begin(), sections_.end());
    const std::string best = nearest_name(p, names, std::max<size_t>(2, p.size() / 4));
    return best.empty() ? "" : mean(best);
  }
  [[noreturn]] void fail(const std::string& p, const std::string& what) {
    throw usage_error(merged_origin(m_, p), ": key '", detail::printable(p), "': ", what);
  }

  const MergedYaml& m_;
  std::set<std::string> known_, sections_;
};

// A double as the printed config holds it: the shortest decimal that reads back as the same
// double ("0.9", not yaml-cpp's 17 digits "0.90000000000000002").
YAML::Node number_node(double v) {
  if (!std::isfinite(v)) return YAML::Node(v);
  char buf[32];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof buf, "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return YAML::Node(std::string(buf));
}

class Printer : public FieldVisitor {
 public:
  YAML::Node root = YAML::Node(YAML::NodeType::Map);
  void field(const std::string& p, std::string& v, const FieldSpec&) override { at(p) = v; }
  void field(const std::string& p, int64_t& v, const FieldSpec&) override { at(p) = v; }
  void field(const std::string& p, double& v, const FieldSpec&) override { at(p) = number_node(v); }
  void field(const std::string& p, bool& v, const FieldSpec&) override { at(p) = v; }
  void field(const std::string& p, std::vector<std::string>& v, const FieldSpec&) override { seq(p, v); }
  void field(const std::string& p, std::vector<double>& v, const FieldSpec&) override { seq(p, v); }
  void field(const std::string& p, std::optional<std::string>& v, const FieldSpec&) override { optional(p, v); }
  void field(const std::string& p, std::optional<int64_t>& v, const FieldSpec&) override { optional(p, v); }
  void field(const std::string& p, std::optional<double>& v, const FieldSpec&) override { optional(p, v); }
  void field(const std::string& p, std::optional<bool>& v, const FieldSpec&) override { optional(p, v); }

 private:
  template <typename T>
  void optional(const std::string& p, const std::optional<T>& v) {
    if (v) at(p) = node_of(*v);
    else at(p) = YAML::Node(YAML::NodeType::Null);
  }
  template <typename T>
  void seq(const std::string& p, const std::vector<T>& v) {
    YAML::Node n(YAML::NodeType::Sequence);
    for (const auto& x : v) n.push_back(node_of(x));
    n.SetStyle(YAML::EmitterStyle::Flow);
    at(p) = n;
  }
  template <typename T>
  static YAML::Node node_of(const T& v) { return YAML::Node(v); }
  static YAML::Node node_of(double v) { return number_node(v); }
  YAML::Node at(const std::string& p) {
    YAML::Node cur = root;
    std::stringstream ss(p);
    std::vector<std::string> parts;
    for (std::string s; std::getline(ss, s, '.');) parts.push_back(s);
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      if (!cur[parts[i]]) cur[parts[i]] = YAML::Node(YAML::NodeType::Map);
      cur.reset(cur[parts[i]]);
    }
    return cur[parts.back()];
  }
};

Config read(const MergedYaml& m) {
  Config cfg;
  Reader r(m);
  cfg.visit(r);
  r.check_unknown(m.root, "");
  cfg.origins = m.origin;
  cfg.origin_lines = m.line;
  cfg.top_file = m.top;
  cfg.validate_relations();
  return cfg;
}

}  // namespace

void Config::visit(FieldVisitor& v) {
  auto range = [](double lo, double hi) {
    FieldSpec s;
    s.min = lo;
    s.max = hi;
    return s;
  };
  auto at_least = [](double lo) {
    FieldSpec s;
    s.min = lo;
    return s;
  };
  auto positive = [] {
    FieldSpec s;
    s.min = 0;
    s.min_exclusive = true;
    return s;
  };
  auto choices = [](std::vector<std::string> c) {
    FieldSpec s;
    s.choices = std::move(c);
    return s;
  };
  FieldSpec none;

  v.field("output", output, none);
  v.field("seed", seed, at_least(0));

  v.field("data.rec", data.rec, none);
  v.field("data.num_classes", data.num_classes, at_least(1));
  v.field("data.num_images", data.num_images, at_least(1));
  v.field("data.spare_classes", data.spare_classes, at_least(0));
  v.field("data.batch_size", data.batch_size, at_least(1));
  v.field("data.global_batch_size", data.global_batch_size, at_least(1));
  v.field("data.num_workers", data.num_workers, range(1, 256));  // the loader needs a worker thread
  v.field("data.val_targets", data.val_targets, none);
  v.field("data.val_dir", data.val_dir, none);
  v.field("data.index_cache", data.index_cache, none);
  v.field("data.flip", data.flip, none);
  v.field("data.max_bad_fraction", data.max_bad_fraction, range(0, 1));
  v.field("data.prefetch", data.prefetch, range(1, 64));
  v.field("data.augment.gray_prob", data.augment_gray_prob, range(0, 1));
  v.field("data.augment.blur_prob", data.augment_blur_prob, range(0, 1));
  v.field("data.augment.downscale_prob", data.augment_downscale_prob, range(0, 1));
  v.field("data.skip_bad", data.skip_bad, none);

  v.field("model.backbone", model.backbone, none);
  v.field("model.embedding_size", model.embedding_size, range(1, 65536));
  v.field("model.dropout", model.dropout, range(0, 0.99));
  v.field("model.sync_bn", model.sync_bn, none);
  v.field("model.channels_last", model.channels_last, none);
  v.field("model.prelu_kernel", model.prelu_kernel, none);
  v.field("model.checkpointing", model.checkpointing, none);
  v.field("model.init", model.init, none);

  FieldSpec margin;
  margin.list_length = 3;
  v.field("loss.margin", loss.margin, margin);
  v.field("loss.margin_mode", loss.margin_mode, choices({"exact", "arcface_torch"}));
  v.field("loss.scale", loss.scale, positive());
  v.field("loss.interclass_filtering_threshold", loss.interclass_filtering_threshold, range(0, 1));
  v.field("loss.sample_rate", loss.sample_rate, range(0, 1));
  v.field("loss.subcenters", loss.subcenters, range(1, 255));
  v.field("loss.init_centres", loss.init_centres, none);
  v.field("loss.init_centres_report", loss.init_centres_report, none);
  v.field("loss.logits", loss.logits, choices({"auto", "buffer", "streamed"}));
  // The heads and their parameters: the head catalogue (each head's own file registers it).
  std::vector<std::string> heads;
  for (const HeadInfo& h : head_catalogue()) heads.push_back(h.name);
  v.field("loss.head", loss.head, choices(heads));
  for (const HeadInfo& h : head_catalogue())
    for (const HeadParam& p : h.params) {
      const std::string key = h.name + "." + p.name;
      FieldSpec spec;
      spec.doc = p.meaning;
      if (p.flag) {
        v.field("loss." + key, loss.head_flags[key], spec);
        continue;
      }
      if (std::isfinite(p.min)) spec.min = p.min;
      if (std::isfinite(p.max)) spec.max = p.max;
      spec.min_exclusive = p.min_exclusive;
      v.field("loss." + key, loss.head_params[key], spec);
    }

  v.field("optim.optimizer", optim.optimizer, choices({"sgd", "adamw"}));
  v.field("optim.lr", optim.lr, positive());
  v.field("optim.momentum", optim.momentum, range(0, 1));
  v.field("optim.weight_decay", optim.weight_decay, at_least(0));
  FieldSpec betas;
  betas.list_length = 2;
  v.field("optim.betas", optim.betas, betas);
  v.field("optim.eps", optim.eps, positive());
  v.field("optim.fc_optimizer", optim.fc_optimizer, choices({"sgd", "adamw"}));
  v.field("optim.fc_lr", optim.fc_lr, positive());
  v.field("optim.fc_weight_decay", optim.fc_weight_decay, at_least(0));
  v.field("optim.fc_update", optim.fc_update, choices({"sampled", "all"}));
  v.field("optim.fc_state_dtype", optim.fc_state_dtype, choices({"fp32", "bf16"}));
  v.field("optim.fc_weight_dtype", optim.fc_weight_dtype, choices({"fp32", "bf16"}));
  v.field("optim.fc_weight_rounding", optim.fc_weight_rounding, choices({"stochastic", "nearest"}));
  v.field("optim.fused", optim.fused, none);
  v.field("optim.epochs", optim.epochs, at_least(1));
  v.field("optim.warmup_epochs", optim.warmup_epochs, at_least(0));
  v.field("optim.total_steps", optim.total_steps, at_least(1));
  v.field("optim.warmup_steps", optim.warmup_steps, at_least(0));
  v.field("optim.power", optim.power, positive());
  v.field("optim.grad_clip", optim.grad_clip, at_least(0));
  v.field("optim.freeze_backbone_steps", optim.freeze_backbone_steps, at_least(0));
  v.field("optim.freeze_stages", optim.freeze_stages, at_least(0));
  v.field("optim.thaw_warmup_steps", optim.thaw_warmup_steps, at_least(0));
  v.field("optim.grad_accumulation", optim.grad_accumulation, range(1, 1024));

  v.field("train.precision", train.precision, choices({"auto", "fp32", "bf16", "fp16"}));
  v.field("train.log_every", train.log_every, at_least(1));
  v.field("train.verify_every", train.verify_every, at_least(0));
  v.field("train.checkpoint_every", train.checkpoint_every, at_least(0));
  v.field("train.checkpoint_every_s", train.checkpoint_every_s, at_least(0));
  v.field("train.resume", train.resume, choices({"off", "auto"}));
  v.field("train.keep_checkpoints", train.keep_checkpoints, at_least(1));
  v.field("train.max_failed_checkpoints", train.max_failed_checkpoints, at_least(1));
  v.field("train.checkpoint_async", train.checkpoint_async, choices({"auto", "on", "off"}));
  v.field("train.checkpoint_when_busy", train.checkpoint_when_busy, choices({"wait", "skip"}));
  v.field("train.max_steps", train.max_steps, at_least(1));
  v.field("train.loss_scaling", train.loss_scaling, choices({"auto", "on", "off"}));
  v.field("train.loss_scale_init", train.loss_scale_init, positive());
  v.field("train.loss_scale_growth_interval", train.loss_scale_growth_interval, at_least(1));
  v.field("train.tensorboard", train.tensorboard, none);
  v.field("train.cudnn_benchmark", train.cudnn_benchmark, none);
  v.field("train.cuda_graph", train.cuda_graph, none);
  v.field("train.tf32", train.tf32, none);
  v.field("train.cpu_cache_gb", train.cpu_cache_gb, at_least(0));

  v.field("dist.device", dist.device, choices({"auto", "cpu", "cuda"}));
  v.field("dist.backend", dist.backend, choices({"auto", "nccl", "gloo"}));
  v.field("dist.timeout_s", dist.timeout_s, positive());
  v.field("dist.rendezvous_timeout_s", dist.rendezvous_timeout_s, positive());
  v.field("dist.hang_floor_s", dist.hang_floor_s, positive());
  v.field("dist.straggler_window", dist.straggler_window, at_least(0));
  v.field("dist.bucket_mb", dist.bucket_mb, positive());
  v.field("dist.find_unused_parameters", dist.find_unused_parameters, none);
}

void Config::validate_relations() const {
  // Class ids, shard bounds and tensor sizes are int64: with at most 2^40 classes (and
  // 2^20 ranks, 2^16 dimensions) no product of them overflows. Whether the classifier
  // fits in memory is decided by the run, which knows its ranks and devices.
  if (data.num_classes && *data.num_classes > kMaxNumClasses)
    throw usage_error(origin("data.num_classes"), ": key 'data.num_classes': ", *data.num_classes,
                      " classes is more than the 2^40 = ", kMaxNumClasses, " a classifier can index");
  if (data.spare_classes > kMaxNumClasses)
    throw usage_error(origin("data.spare_classes"), ": key 'data.spare_classes': ", data.spare_classes,
                      " classes is more than the 2^40 = ", kMaxNumClasses, " a classifier can index");
  if (optim.total_steps && optim.warmup_steps && *optim.warmup_steps > *optim.total_steps)
    throw usage_error(origin("optim.warmup_steps"), ": key 'optim.warmup_steps' (", *optim.warmup_steps,
                      ") exceeds 'optim.total_steps' (", *optim.total_steps, ")");
  if (loss.margin[0] <= 0) throw usage_error(origin("loss.margin"), ": key 'loss.margin': m1 must be > 0");
  // (How many stages a network has is checked where the network is known: check_model_config.)
  if (optim.freeze_stages && optim.freeze_backbone_steps == 0)
    throw usage_error(origin("optim.freeze_stages"), ": key 'optim.freeze_stages': freezes nothing while "
                      "optim.freeze_backbone_steps is 0; set optim.freeze_backbone_steps to the number of steps to freeze");
  if (optim.thaw_warmup_steps > 0 && optim.freeze_backbone_steps == 0)
    throw usage_error(origin("optim.thaw_warmup_steps"), ": key 'optim.thaw_warmup_steps': there is no thaw while "
                      "optim.freeze_backbone_steps is 0 (the schedule's own warm-up is optim.warmup_epochs or "
                      "optim.warmup_steps)");
  if (loss.init_centres_report && !loss.init_centres)
    throw usage_error(origin("loss.init_centres_report"), ": key 'loss.init_centres_report': names the report of the "
                      "checkpoint loss.init_centres starts the centres from, which is not set");
  if (dist.backend == "nccl" && dist.device == "cpu")
    throw usage_error(origin("dist.backend"), ": key 'dist.backend': nccl carries CUDA tensors only, but dist.device is cpu");
  // arcface_torch's CombinedMarginLoss has two branches and raises for anything else.
  if (loss.margin_mode == "arcface_torch" && !(loss.margin[2] > 0) && !(loss.margin[0] == 1.0 && loss.margin[2] == 0.0))
    throw usage_error(origin("loss.margin"), ": key 'loss.margin': [", loss.margin[0], ", ", loss.margin[1], ", ",
                      loss.margin[2], "] has no arcface_torch equivalent (loss.margin_mode arcface_torch takes m1 = 1 "
                      "with m3 = 0, ArcFace, or m3 > 0, CosFace); use loss.margin_mode exact");
}

std::map<std::string, double> LossConfig::chosen_head_params() const {
  std::map<std::string, double> out;
  const std::string prefix = head + ".";
  for (const auto& kv : head_params)
    if (kv.second && kv.first.rfind(prefix, 0) == 0) out[kv.first.substr(prefix.size())] = *kv.second;
  for (const auto& kv : head_flags)
    if (kv.second && kv.first.rfind(prefix, 0) == 0) out[kv.first.substr(prefix.size())] = *kv.second ? 1.0 : 0.0;
  return out;
}

std::string Config::origin(const std::string& key) const {
  return nearest_origin(origins, origin_lines, top_file.empty() ? "config" : top_file, key);
}

void throw_config_error(const Config& cfg, const std::string& key, const std::string& what) {
  throw usage_error(cfg.origin(key), ": key '", key, "': ", what);
}

Config load_config_text(const std::string& yaml, const std::string& name, const std::vector<std::string>& overrides) {
  MergedYaml m;
  m.top = name;
  std::vector<std::string> stack{name};
  fs::path dir = fs::path(name).parent_path();
  LoadBudget budget;
  charge(budget, yaml.size(), name, stack);
  load_layer(m, yaml, name, dir, stack, budget);
  for (const auto& o : overrides) apply_override(m, o);
  return read(m);
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::string text = read_text(path, "");
  return load_config_text(text, fs::path(path).lexically_normal().string(), overrides);
}

std::string config_to_yaml(Config cfg) {
  Printer p;
  cfg.visit(p);
  YAML::Emitter out;
  out.SetDoublePrecision(10);
  out << p.root;
  return std::string(out.c_str()) + "\n";
}

}  // namespace faceshard
