#include "app/config/config.h"

#include <yaml-cpp/yaml.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>

#include "partial_fc/runtime/error.h"

namespace fs = std::filesystem;

namespace faceshard {

struct MergedYaml {
  YAML::Node root = YAML::Node(YAML::NodeType::Map);
  std::map<std::string, std::string> origin;  // key path -> file (or "--set") that set it
  std::string top;                            // the file named on the command line
};

namespace {

// The file that set `path`, or its nearest ancestor section; `top` when none did.
std::string nearest_origin(const std::map<std::string, std::string>& origin, const std::string& top,
                           const std::string& path) {
  for (std::string p = path;;) {
    auto it = origin.find(p);
    if (it != origin.end()) return it->second;
    auto dot = p.rfind('.');
    if (dot == std::string::npos) return top;
    p = p.substr(0, dot);
  }
}

std::string merged_origin(const MergedYaml& m, const std::string& path) { return nearest_origin(m.origin, m.top, path); }

std::string join(const std::string& a, const std::string& b) { return a.empty() ? b : a + "." + b; }

void record_origins(const YAML::Node& n, const std::string& path, const std::string& file,
                    std::map<std::string, std::string>& origin) {
  if (!path.empty()) origin[path] = file;
  if (n.IsMap())
    for (auto it = n.begin(); it != n.end(); ++it)
      record_origins(it->second, join(path, it->first.as<std::string>()), file, origin);
}

// Deep merge: maps merge key by key, anything else replaces.
void merge_into(YAML::Node dst, const YAML::Node& src, const std::string& path, const std::string& file,
                std::map<std::string, std::string>& origin) {
  for (auto it = src.begin(); it != src.end(); ++it) {
    const std::string key = it->first.as<std::string>();
    const std::string p = join(path, key);
    if (it->second.IsMap() && dst[key] && dst[key].IsMap()) {
      merge_into(dst[key], it->second, p, file, origin);
      origin[p] = file;
    } else {
      dst[key] = YAML::Clone(it->second);
      // Forget origins of keys the new value replaced.
      for (auto o = origin.lower_bound(p + "."); o != origin.end() && o->first.rfind(p + ".", 0) == 0;)
        o = origin.erase(o);
      record_origins(it->second, p, file, origin);
    }
  }
}

YAML::Node parse_yaml(const std::string& text, const std::string& name) {
  try {
    YAML::Node n = YAML::Load(text);
    if (n.IsNull()) return YAML::Node(YAML::NodeType::Map);
    if (!n.IsMap()) throw usage_error(name, ": expected a mapping of keys at the top level");
    return n;
  } catch (const YAML::Exception& e) {
    throw usage_error(name, ":", e.mark.line + 1, ":", e.mark.column + 1, ": YAML syntax error: ", e.msg);
  }
}

std::string read_text(const std::string& path, const std::string& referrer) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) {
    if (referrer.empty()) throw usage_error("config file '", path, "' not found");
    throw usage_error(referrer, ": key 'base': base file '", path, "' not found");
  }
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void load_layer(MergedYaml& m, const std::string& text, const std::string& name, const fs::path& dir,
                std::vector<std::string>& stack) {
  YAML::Node root = parse_yaml(text, name);
  if (root["base"]) {
    YAML::Node base = root["base"];
    std::vector<std::string> bases;
    if (base.IsScalar()) {
      bases.push_back(base.as<std::string>());
    } else if (base.IsSequence()) {
      for (const auto& b : base) {
        if (!b.IsScalar()) throw usage_error(name, ": key 'base': expected a file name or a list of file names");
        bases.push_back(b.as<std::string>());
      }
    } else {
      throw usage_error(name, ": key 'base': expected a file name or a list of file names");
    }
    root.remove("base");
    for (const auto& b : bases) {
      fs::path p = fs::path(b).is_absolute() ? fs::path(b) : dir / b;
      std::string ps = p.lexically_normal().string();
      for (const auto& s : stack)
        if (s == ps) throw usage_error(name, ": key 'base': '", b, "' includes itself (cycle)");
      std::string sub = read_text(ps, name);
      stack.push_back(ps);
      load_layer(m, sub, ps, p.parent_path(), stack);
      stack.pop_back();
    }
  }
  merge_into(m.root, root, "", name, m.origin);
}

void apply_override(MergedYaml& m, const std::string& ov) {
  auto eq = ov.find('=');
  if (eq == std::string::npos || eq == 0) throw usage_error("--set '", ov, "': expected key.path=value");
  std::string path = ov.substr(0, eq);
  std::string value = ov.substr(eq + 1);
  YAML::Node v;
  try {
    v = YAML::Load(value);
  } catch (const YAML::Exception& e) {
    throw usage_error("--set '", ov, "': the value is not valid YAML: ", e.msg);
  }
  if (v.IsNull() && !value.empty() && value != "null" && value != "~") v = YAML::Node(value);
  std::vector<std::string> parts;
  std::stringstream ss(path);
  for (std::string part; std::getline(ss, part, '.');) {
    if (part.empty()) throw usage_error("--set '", ov, "': empty key in '", path, "'");
    parts.push_back(part);
  }
  YAML::Node wrapper(YAML::NodeType::Map);
  YAML::Node cur = wrapper;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    cur[parts[i]] = YAML::Node(YAML::NodeType::Map);
    cur.reset(cur[parts[i]]);
  }
  cur[parts.back()] = v;
  merge_into(m.root, wrapper, "", "--set", m.origin);
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
  if (n.IsScalar()) return "'" + n.Scalar() + "'";
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
      fail(p, "expected one of {" + c + "}, got '" + v + "'");
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
    if (!n.IsSequence()) fail(p, "expected a list of strings, got " + show(n));
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
    if (!n.IsSequence()) fail(p, "expected a list of numbers, got " + show(n));
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
      const std::string p = join(path, it->first.as<std::string>());
      if (known_.count(p)) continue;
      if (sections_.count(p)) {
        if (!it->second.IsMap() && !it->second.IsNull()) fail(p, "expected a mapping (a section), got " + show(it->second));
        check_unknown(it->second, p);
        continue;
      }
      throw usage_error(merged_origin(m_, p), ": unknown key '", p, "'", suggestion(p));
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
  std::string suggestion(const std::string& p) const {
    // The known key with the same last component, if any: a misplaced key is a common slip.
    std::string last = p.substr(p.rfind('.') == std::string::npos ? 0 : p.rfind('.') + 1);
    for (const auto& k : known_)
      if (k.size() >= last.size() && k.compare(k.size() - last.size(), last.size(), last) == 0 &&
          (k.size() == last.size() || k[k.size() - last.size() - 1] == '.'))
        return " (did you mean '" + k + "'?)";
    return "";
  }
  [[noreturn]] void fail(const std::string& p, const std::string& what) {
    throw usage_error(merged_origin(m_, p), ": key '", p, "': ", what);
  }

  const MergedYaml& m_;
  std::set<std::string> known_, sections_;
};

class Printer : public FieldVisitor {
 public:
  YAML::Node root = YAML::Node(YAML::NodeType::Map);
  void field(const std::string& p, std::string& v, const FieldSpec&) override { at(p) = v; }
  void field(const std::string& p, int64_t& v, const FieldSpec&) override { at(p) = v; }
  void field(const std::string& p, double& v, const FieldSpec&) override { at(p) = v; }
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
    if (v) at(p) = *v;
    else at(p) = YAML::Node(YAML::NodeType::Null);
  }
  template <typename T>
  void seq(const std::string& p, const std::vector<T>& v) {
    YAML::Node n(YAML::NodeType::Sequence);
    for (const auto& x : v) n.push_back(x);
    n.SetStyle(YAML::EmitterStyle::Flow);
    at(p) = n;
  }
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
  FieldSpec required_pos;
  required_pos.required = true;
  required_pos.min = 1;

  v.field("output", output, none);
  v.field("seed", seed, at_least(0));

  v.field("data.rec", data.rec, none);
  v.field("data.num_classes", data.num_classes, required_pos);
  v.field("data.num_images", data.num_images, at_least(1));
  v.field("data.batch_size", data.batch_size, at_least(1));
  v.field("data.num_workers", data.num_workers, range(1, 256));  // the loader needs a worker thread
  v.field("data.val_targets", data.val_targets, none);
  v.field("data.val_dir", data.val_dir, none);
  v.field("data.flip", data.flip, none);
  v.field("data.max_bad_fraction", data.max_bad_fraction, range(0, 1));
  v.field("data.prefetch", data.prefetch, range(1, 64));
  v.field("data.augment.gray_prob", data.augment_gray_prob, range(0, 1));
  v.field("data.augment.blur_prob", data.augment_blur_prob, range(0, 1));
  v.field("data.augment.downscale_prob", data.augment_downscale_prob, range(0, 1));

  v.field("model.backbone", model.backbone, none);
  v.field("model.embedding_size", model.embedding_size, range(1, 65536));
  v.field("model.dropout", model.dropout, range(0, 0.99));
  v.field("model.sync_bn", model.sync_bn, none);
  v.field("model.channels_last", model.channels_last, none);
  v.field("model.checkpointing", model.checkpointing, none);
  v.field("model.init", model.init, none);

  FieldSpec margin;
  margin.list_length = 3;
  v.field("loss.margin", loss.margin, margin);
  v.field("loss.margin_mode", loss.margin_mode, choices({"exact", "arcface_torch"}));
  v.field("loss.scale", loss.scale, positive());
  v.field("loss.interclass_filtering_threshold", loss.interclass_filtering_threshold, range(0, 1));
  v.field("loss.sample_rate", loss.sample_rate, range(0, 1));

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
  v.field("optim.epochs", optim.epochs, at_least(1));
  v.field("optim.warmup_epochs", optim.warmup_epochs, at_least(0));
  v.field("optim.total_steps", optim.total_steps, at_least(1));
  v.field("optim.warmup_steps", optim.warmup_steps, at_least(0));
  v.field("optim.power", optim.power, positive());
  v.field("optim.grad_clip", optim.grad_clip, at_least(0));
  v.field("optim.grad_accumulation", optim.grad_accumulation, range(1, 1024));

  v.field("train.precision", train.precision, choices({"fp32", "bf16", "fp16"}));
  v.field("train.log_every", train.log_every, at_least(1));
  v.field("train.verify_every", train.verify_every, at_least(0));
  v.field("train.checkpoint_every", train.checkpoint_every, at_least(0));
  v.field("train.keep_checkpoints", train.keep_checkpoints, at_least(1));
  v.field("train.max_steps", train.max_steps, at_least(1));
  v.field("train.loss_scaling", train.loss_scaling, choices({"auto", "on", "off"}));
  v.field("train.loss_scale_init", train.loss_scale_init, positive());
  v.field("train.loss_scale_growth_interval", train.loss_scale_growth_interval, at_least(1));
  v.field("train.tensorboard", train.tensorboard, none);
  v.field("train.cudnn_benchmark", train.cudnn_benchmark, none);

  v.field("dist.device", dist.device, choices({"auto", "cpu", "cuda"}));
  v.field("dist.timeout_s", dist.timeout_s, positive());
  v.field("dist.rendezvous_timeout_s", dist.rendezvous_timeout_s, positive());
  v.field("dist.bucket_mb", dist.bucket_mb, positive());
  v.field("dist.find_unused_parameters", dist.find_unused_parameters, none);
}

void Config::validate_relations() const {
  if (optim.total_steps && optim.warmup_steps && *optim.warmup_steps > *optim.total_steps)
    throw usage_error(origin("optim.warmup_steps"), ": key 'optim.warmup_steps' (", *optim.warmup_steps,
                      ") exceeds 'optim.total_steps' (", *optim.total_steps, ")");
  if (loss.margin[0] <= 0) throw usage_error(origin("loss.margin"), ": key 'loss.margin': m1 must be > 0");
  // arcface_torch's CombinedMarginLoss has two branches and raises for anything else.
  if (loss.margin_mode == "arcface_torch" && !(loss.margin[2] > 0) && !(loss.margin[0] == 1.0 && loss.margin[2] == 0.0))
    throw usage_error(origin("loss.margin"), ": key 'loss.margin': [", loss.margin[0], ", ", loss.margin[1], ", ",
                      loss.margin[2], "] has no arcface_torch equivalent (loss.margin_mode arcface_torch takes m1 = 1 "
                      "with m3 = 0, ArcFace, or m3 > 0, CosFace); use loss.margin_mode exact");
}

std::string Config::origin(const std::string& key) const {
  return nearest_origin(origins, top_file.empty() ? "config" : top_file, key);
}

void throw_config_error(const Config& cfg, const std::string& key, const std::string& what) {
  throw usage_error(cfg.origin(key), ": key '", key, "': ", what);
}

Config load_config_text(const std::string& yaml, const std::string& name, const std::vector<std::string>& overrides) {
  MergedYaml m;
  m.top = name;
  std::vector<std::string> stack{name};
  fs::path dir = fs::path(name).parent_path();
  load_layer(m, yaml, name, dir, stack);
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
