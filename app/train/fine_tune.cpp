#include "app/train/fine_tune.h"

#include <map>
#include <sstream>

#include "models/backbone_registry.h"
#include "base/error.h"
#include "base/log.h"

namespace faceshard {
namespace {

// The prefixes of the stem and stages 1..stages.
std::vector<std::string> frozen_prefixes(const std::string& network, int64_t stages) {
  const std::vector<std::vector<std::string>> parts = backbone_stage_prefixes(network);
  std::vector<std::string> out;
  for (int64_t s = 0; s <= stages && s < static_cast<int64_t>(parts.size()); ++s)
    out.insert(out.end(), parts[s].begin(), parts[s].end());
  return out;
}

std::string number(double v) { return format_sig(v, 6); }

}  // namespace

void check_freeze_config(const Config& cfg) {
  if (!cfg.optim.freeze_stages) return;
  const int64_t stages = static_cast<int64_t>(backbone_stage_prefixes(cfg.model.backbone).size()) - 1;
  if (*cfg.optim.freeze_stages > stages)
    throw_config_error(cfg, "optim.freeze_stages",
                       detail::concat(*cfg.optim.freeze_stages, " but ", cfg.model.backbone, " has ", stages,
                                      " " + backbone_traits(cfg.model.backbone).stage_word,
                                      "; leave optim.freeze_stages out to freeze the whole backbone"));
}

BackboneFreeze::BackboneFreeze(Backbone& backbone, const std::vector<at::Tensor>& params, int64_t steps,
                               std::optional<int64_t> stages)
    : backbone_(&backbone), params_(params), partition_(params.size(), 0), steps_(steps) {
  if (steps_ <= 0) return;
  const std::string& network = backbone.options().name;
  std::vector<std::string> prefixes;
  if (stages) {
    const int64_t have = static_cast<int64_t>(backbone_stage_prefixes(network).size()) - 1;
    if (*stages > have)
      throw option_error("freeze_stages", *stages, " but ", network, " has ", have, " stages");
    prefixes = frozen_prefixes(network, *stages);
    what_ = *stages == 0   ? "the stem of " + network
            : *stages == 1 ? "the stem and stage 1 of " + network
                           : detail::concat("the stem and stages 1-", *stages, " of ", network);
  } else {
    what_ = "the whole backbone " + network + " (its embedding head included)";
  }
  auto covers = [&](const std::string& name) { return !stages || under_prefix(name, prefixes); };
  std::map<const void*, size_t> index;
  for (size_t i = 0; i < params_.size(); ++i) index[params_[i].unsafeGetTensorImpl()] = i;
  for (const auto& np : backbone.named_parameters()) {
    auto it = index.find(np.value().unsafeGetTensorImpl());
    if (it == index.end() || !covers(np.key())) continue;
    partition_[it->second] = 1;
    covered_++;
  }
  // eval() reaches a module's children: the outermost frozen modules are enough.
  if (!stages) {
    modules_.push_back(&backbone);
  } else {
    for (const auto& nm : backbone.named_modules("", /*include_self=*/false)) {
      const std::string& name = nm.key();
      const size_t dot = name.rfind('.');
      const bool parent_covered = dot != std::string::npos && covers(name.substr(0, dot));
      if (covers(name) && !parent_covered) modules_.push_back(nm.value().get());
    }
  }
}

void BackboneFreeze::apply(int64_t step) {
  if (steps_ <= 0) return;
  const bool freeze = step < steps_;
  if (freeze && !frozen_) {
    for (size_t i = 0; i < params_.size(); ++i)
      if (partition_[i]) params_[i].set_requires_grad(false);
    frozen_ = true;
    log_info("fine-tuning: ", describe(), " frozen until step ", steps_,
             step > 0 ? detail::concat(" (resumed at step ", step, ")") : std::string(),
             ": no update, and its BatchNorm statistics stay as loaded (eval mode); optim.freeze_backbone_steps");
  } else if (!freeze && frozen_) {
    for (size_t i = 0; i < params_.size(); ++i)
      if (partition_[i]) params_[i].set_requires_grad(true);
    for (torch::nn::Module* m : modules_) m->train(true);
    frozen_ = false;
    log_info("fine-tuning: after ", steps_, " frozen steps the whole backbone trains from step ", steps_ + 1, " (all ",
             params_.size(), " tensors)");
  }
  if (frozen_)
    for (torch::nn::Module* m : modules_)
      if (m->is_training()) m->eval();
}

std::string BackboneFreeze::describe() const {
  return detail::concat(what_, " (", covered_, " of ", params_.size(), " tensors)");
}

std::string describe_learning_rates(const OptimConfig& o) {
  auto one = [](const std::string& kind, double lr, double momentum, double wd) {
    std::ostringstream os;
    os << number(lr) << " (" << kind;
    if (kind == "sgd") os << ", momentum " << number(momentum);
    os << ", weight decay " << number(wd) << ")";
    return os.str();
  };
  std::ostringstream os;
  os << "learning rates: backbone " << one(o.optimizer, o.lr, o.momentum, o.weight_decay) << ", classifier "
     << one(o.classifier_optimizer(), o.classifier_lr(), o.momentum, o.classifier_weight_decay());
  os << (o.fc_lr ? "; optim.fc_lr sets the classifier's" : "; the classifier's is optim.lr (optim.fc_lr unset)");
  if (o.freeze_backbone_steps > 0)
    os << "; the frozen part of the backbone takes no step for the first " << o.freeze_backbone_steps << " steps";
  if (o.thaw_warmup_steps > 0)
    os << ", then the backbone's rate rises from 1/" << o.thaw_warmup_steps << " to all of it over "
       << o.thaw_warmup_steps << " steps (optim.thaw_warmup_steps)";
  return os.str();
}

double thaw_warmup_factor(const OptimConfig& o, int64_t step) {
  const int64_t s = o.freeze_backbone_steps, n = o.thaw_warmup_steps;
  if (n <= 0 || s <= 0 || step < s || step >= s + n) return 1.0;
  return static_cast<double>(step - s + 1) / static_cast<double>(n);
}

}  // namespace faceshard
