#include "partial_fc/classifier/margin_head.h"

#include <cmath>
#include <sstream>

#include "base/error.h"

namespace faceshard {

double MarginHead::row_loss_cap() const { return INFINITY; }

at::Tensor MarginHead::target_grad_norm(const at::Tensor& c, const HeadRows&) const { return torch::zeros_like(c); }

void MarginHead::negatives_forward(at::Tensor, at::Tensor, const HeadRows&) const {}
void MarginHead::negatives_backward(at::Tensor, const at::Tensor&, const at::Tensor&, const HeadRows&) const {}

void MarginHead::load_state(const std::string& key, const at::Tensor& value, const std::string& source) {
  for (auto& kv : state()) {
    if (kv.first != key) continue;
    if (value.numel() != kv.second.numel() || !value.is_floating_point())
      throw usage_error(source, ": key 'head/", key, "' of the ", name(), " head has ", value.numel(),
                        " values, expected ", kv.second.numel(), " floating-point values");
    torch::NoGradGuard ng;
    kv.second.copy_(value.reshape(kv.second.sizes()));
    return;
  }
  throw usage_error(source, ": key 'head/", key, "' is not state of the ", name(), " head");
}

namespace {

std::map<std::string, HeadFactory>& factories() {
  static std::map<std::string, HeadFactory> f;
  return f;
}

std::string number(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

}  // namespace

void register_margin_head(HeadInfo info, HeadFactory make) {
  const std::string name = info.name;
  add_head_info(std::move(info));
  factories()[name] = std::move(make);
}

std::unique_ptr<MarginHead> make_margin_head(const HeadSpec& spec, const CombinedMargin& margin) {
  const HeadInfo* info = find_head_info(spec.name);
  if (!info) throw option_error("head", "'", spec.name, "' is not a head (", known_head_names(), ")");
  return factories().at(spec.name)(resolve_head_params(*info, spec.params), margin);
}

std::string describe_margin_head(const HeadSpec& spec, const CombinedMargin& margin) {
  const HeadInfo* info = find_head_info(spec.name);
  if (!info) return spec.name;
  if (info->params.empty())  // the combined head: its margin is the config's
    return spec.name + " (margin (" + number(margin.m1) + ", " + number(margin.m2) + ", " + number(margin.m3) +
           "), s " + number(margin.scale) + ", " + to_string(margin.mode) + " mode)";
  const std::map<std::string, double> p = resolve_head_params(*info, spec.params);
  std::string out = spec.name + " (";
  for (size_t i = 0; i < info->params.size(); ++i) {
    const HeadParam& hp = info->params[i];
    out += (i ? ", " : "") + hp.name + " " + (hp.flag ? (p.at(hp.name) != 0 ? "true" : "false") : number(p.at(hp.name)));
  }
  return out + ")";
}

}  // namespace faceshard
