#include "partial_fc/classifier/head_catalogue.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <mutex>

#include "base/error.h"

namespace faceshard {
namespace {

std::vector<HeadInfo>& entries() {
  static std::vector<HeadInfo> e;
  return e;
}

void ensure_registered() {
  static std::once_flag once;
  std::call_once(once, [] {
    register_margin_heads();
    std::sort(entries().begin(), entries().end(), [](const HeadInfo& a, const HeadInfo& b) { return a.name < b.name; });
  });
}

}  // namespace

void add_head_info(HeadInfo info) {
  for (const HeadInfo& h : entries())
    if (h.name == info.name) {
      std::fprintf(stderr, "faceshard: two margin heads are called '%s'\n", info.name.c_str());
      std::abort();
    }
  entries().push_back(std::move(info));
}

const std::vector<HeadInfo>& head_catalogue() {
  ensure_registered();
  return entries();
}

const HeadInfo* find_head_info(const std::string& name) {
  for (const HeadInfo& h : head_catalogue())
    if (h.name == name) return &h;
  return nullptr;
}

std::string known_head_names() {
  std::string out;
  for (const HeadInfo& h : head_catalogue()) out += (out.empty() ? "" : " | ") + h.name;
  return out;
}

std::map<std::string, double> resolve_head_params(const HeadInfo& head, const std::map<std::string, double>& params) {
  std::map<std::string, double> out;
  for (const HeadParam& p : head.params) out[p.name] = p.default_value;
  for (const auto& kv : params) {
    const std::string& name = kv.first;
    const double value = kv.second;
    const auto it = std::find_if(head.params.begin(), head.params.end(), [&](const HeadParam& p) { return p.name == name; });
    if (it == head.params.end()) {
      std::string known;
      for (const HeadParam& p : head.params) known += (known.empty() ? "" : ", ") + p.name;
      throw option_error(name, "is not a parameter of the ", head.name, " head (",
                         known.empty() ? std::string("it has none") : known, ")");
    }
    if (!std::isfinite(value)) throw option_error(name, "must be finite, got ", value);
    if (it->flag && value != 0 && value != 1) throw option_error(name, "is a yes/no flag (1 or 0), got ", value);
    if (value < it->min || (it->min_exclusive && value == it->min))
      throw option_error(name, "must be ", it->min_exclusive ? "> " : ">= ", it->min, ", got ", value);
    if (value > it->max) throw option_error(name, "must be <= ", it->max, ", got ", value);
    out[name] = value;
  }
  return out;
}

}  // namespace faceshard
