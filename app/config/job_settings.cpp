#include "app/config/job_settings.h"

#include "app/config/config.h"
#include "base/error.h"

namespace faceshard {

int64_t batch_per_rank(const Config& cfg, int world_size) {
  if (!cfg.data.global_batch_size) return cfg.data.batch_size;
  const int64_t g = *cfg.data.global_batch_size, parts = int64_t(world_size) * cfg.optim.grad_accumulation;
  if (g % parts != 0)
    throw_config_error(cfg, "data.global_batch_size",
                       detail::concat(g, " cannot be split evenly over ", world_size, " ranks x ",
                                      cfg.optim.grad_accumulation, " micro-batches (optim.grad_accumulation)"));
  return g / parts;
}

JobSettings job_settings(const Config& cfg, int world_size) {
  JobSettings s;
  s.network = cfg.model.backbone;
  s.batch_per_rank = batch_per_rank(cfg, world_size);
  // Sized for a GPU: auto is bf16 there (resolve_precision).
  s.precision = cfg.train.precision == "auto" ? "bf16" : cfg.train.precision;
  s.precision_auto = cfg.train.precision == "auto";
  s.head = cfg.loss.head;
  s.head_params = cfg.loss.chosen_head_params();
  s.checkpointing = cfg.model.checkpointing;
  s.num_classes = cfg.data.num_classes.value_or(0);  // 0: counted from the data at start-up
  s.world_size = world_size;
  s.sample_rate = cfg.loss.sample_rate;
  s.subcenters = cfg.loss.subcenters;
  s.optimizer = cfg.optim.optimizer;
  s.fc_optimizer = cfg.optim.classifier_optimizer();
  s.momentum = cfg.optim.momentum;
  s.fc_weight_decay = cfg.optim.classifier_weight_decay();
  s.beta1 = cfg.optim.betas[0];
  s.beta2 = cfg.optim.betas[1];
  s.eps = cfg.optim.eps;
  s.fc_update_all = cfg.optim.fc_update == "all";
  s.fc_state_dtype = cfg.optim.fc_state_dtype;
  s.fc_weight_dtype = cfg.optim.fc_weight_dtype;
  s.fc_weight_rounding = cfg.optim.fc_weight_rounding;
  s.logits = cfg.loss.logits;
  s.grad_accumulation = cfg.optim.grad_accumulation;
  s.cuda_graph = cfg.train.cuda_graph;
  s.embedding_size = cfg.model.embedding_size;
  s.margin = CombinedMargin{cfg.loss.margin[0], cfg.loss.margin[1], cfg.loss.margin[2], cfg.loss.scale,
                            cfg.loss.interclass_filtering_threshold, parse_margin_mode(cfg.loss.margin_mode)};
  s.seed = static_cast<uint64_t>(cfg.seed);
  return s;
}

at::ScalarType classifier_dtype(const std::string& name, const char* option) {
  if (name == "fp32") return at::kFloat;
  if (name == "bf16") return at::kBFloat16;
  throw option_error(option, "must be fp32 or bf16, got '", detail::printable(name), "'");
}

PartialFCOptions classifier_options(const JobSettings& s) {
  const std::string fc_opt = s.fc_optimizer.empty() ? s.optimizer : s.fc_optimizer;
  if (fc_opt != "sgd" && fc_opt != "adamw")
    throw option_error("optimizer", "must be sgd or adamw, got '", detail::printable(fc_opt), "'");
  if (s.logits != "auto" && s.logits != "buffer" && s.logits != "streamed")
    throw option_error("logits", "must be auto, buffer or streamed, got '", detail::printable(s.logits), "'");
  if (s.fc_weight_rounding != "stochastic" && s.fc_weight_rounding != "nearest")
    throw option_error("fc_weight_rounding", "must be stochastic or nearest, got '",
                       detail::printable(s.fc_weight_rounding), "'");
  if (s.grad_accumulation < 1) throw option_error("grad_accumulation", "must be at least 1, got ", s.grad_accumulation);
  PartialFCOptions po;
  po.num_classes = s.num_classes;
  po.embedding_size = s.embedding_size;
  po.sample_rate = s.sample_rate;
  po.subcenters = s.subcenters;
  po.margin = s.margin;
  po.head.name = s.head;
  po.head.params = s.head_params;
  po.seed = s.seed;
  po.optimizer.kind = fc_opt;
  po.optimizer.momentum = s.momentum;
  po.optimizer.weight_decay = s.fc_weight_decay;
  po.optimizer.beta1 = s.beta1;
  po.optimizer.beta2 = s.beta2;
  po.optimizer.eps = s.eps;
  po.optimizer.state_dtype = classifier_dtype(s.fc_state_dtype, "fc_state_dtype");
  po.weight_dtype = classifier_dtype(s.fc_weight_dtype, "fc_weight_dtype");
  po.weight_round_nearest = s.fc_weight_rounding == "nearest";
  po.step_all_rows = s.fc_update_all;
  po.grad_accumulation = s.grad_accumulation;
  // The big GEMMs in the body's precision, as arcface_torch runs its classifier under autocast.
  if (s.precision == "bf16") po.gemm_dtype = at::kBFloat16;
  else if (s.precision == "fp16") po.gemm_dtype = at::kHalf;
  else if (s.precision == "fp32") po.gemm_dtype = at::kFloat;
  else throw option_error("precision", "must be fp32, bf16 or fp16, got '", detail::printable(s.precision), "'");
  po.streamed_logits =
      s.logits == "streamed" || (s.logits == "auto" && streamed_logits_pay(po, s.world_size, s.batch_per_rank));
  return po;
}

}  // namespace faceshard
