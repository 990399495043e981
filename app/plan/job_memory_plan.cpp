#include "app/plan/job_memory_plan.h"

#include <algorithm>
#include <sstream>

#include "app/config/config.h"
#include "app/config/limits.h"
#include "models/backbone_registry.h"
#include "base/error.h"

namespace faceshard {

std::string plan_number(double v) {
  std::ostringstream os;
  os.precision(12);
  os << v;
  return os.str();
}
namespace {

std::string num(double v) { return plan_number(v); }


}  // namespace

double JobMemoryPlan::total_bytes() const {
  double t = 0;
  for (const auto& p : parts) t += p.bytes;
  return t;
}

double JobMemoryPlan::group_bytes(const std::string& group) const {
  double t = 0;
  for (const auto& p : parts)
    if (p.group == group) t += p.bytes;
  return t;
}

JobMemoryPlan plan_job_memory(const JobSettings& in, const ActivationTable& table) {
  if (in.precision != "fp32" && in.precision != "bf16" && in.precision != "fp16")
    throw option_error("precision", "must be fp32, bf16 or fp16, got '", detail::printable(in.precision), "'");
  if (in.batch_per_rank < 2)
    throw option_error("batch", "must be at least 2 images per rank (BatchNorm in training), got ", in.batch_per_rank);
  if (in.world_size < 1) throw option_error("ranks", "must be at least 1, got ", in.world_size);
  if (in.num_classes < in.world_size || in.num_classes > kMaxNumClasses)
    throw option_error("classes", "must be in [ranks = ", in.world_size, ", 2^40], got ", in.num_classes);
  if (in.optimizer != "sgd" && in.optimizer != "adamw")
    throw option_error("optimizer", "must be sgd or adamw, got '", detail::printable(in.optimizer), "'");
  // The classifier's settings checked (and loss.logits auto resolved) on the one road.
  const PartialFCOptions po = classifier_options(in);
  const std::string& fc_opt = po.optimizer.kind;
  if (in.image_size != 112) throw option_error("image_size", "the activation table is measured at 112x112 images");
  if (in.embedding_size != 512)
    throw option_error("embedding_size", "the backbones' parameter counts and activations are measured with "
                                         "embedding 512, got ", in.embedding_size);

  JobMemoryPlan p;
  p.inputs = in;
  const BackboneTraits& traits = backbone_traits(in.network);
  p.checkpointing = in.checkpointing.value_or(traits.default_checkpointing);
  if (p.checkpointing && !traits.supports_checkpointing)
    throw option_error("checkpointing", "of backbone '", in.network, "': ", traits.no_checkpointing_reason);
  const ActivationEntry& act = table.at(in.network, in.precision, p.checkpointing);
  p.parameters = act.parameters;
  p.activation_bytes_per_image = act.bytes_per_image;
  const double P = static_cast<double>(act.parameters), B = static_cast<double>(in.batch_per_rank);
  const double W = static_cast<double>(in.world_size), d = static_cast<double>(in.embedding_size);
  const bool mixed = in.precision != "fp32";
  const std::string params = num(P) + " parameters";

  auto add = [&](const char* group, const std::string& name, double bytes, const std::string& how) {
    p.parts.push_back({group, name, bytes, how});
  };
  add("backbone", "parameters", 4 * P, params + " x 4 B (fp32)");
  add("backbone", "gradients", 4 * P, params + " x 4 B (fp32, allocated in backward)");
  if (in.optimizer == "adamw")
    add("backbone", "optimiser state", 8 * P, params + " x 8 B (AdamW: two fp32 moments)");
  else
    add("backbone", "optimiser state", in.momentum != 0 ? 4 * P : 0.0,
        in.momentum != 0 ? params + " x 4 B (SGD momentum)" : "none (SGD without momentum)");
  if (mixed)
    add("backbone", "weight copies (" + in.precision + ")", 2 * P,
        params + " x 2 B (autocast's copies of the weights, kept for backward)");
  add("backbone", "activations", act.bytes_per_image * B,
      num(B) + " images x " + num(act.bytes_per_image) + " B (measured: " + in.network + ", " + in.precision +
          ", checkpointing " + (p.checkpointing ? "on" : "off") + ")");
  const double image = 3.0 * static_cast<double>(in.image_size * in.image_size) * 4;
  add("backbone", "input batch", B * image, num(B) + " x 3 x " + std::to_string(in.image_size) + " x " +
                                                std::to_string(in.image_size) + " x 4 B");
  // train.cuda_graph (graphed_backbone.h): the graphs' pool holds a second copy of the
  // gradients (the captured backward's, added into .grad after each replay), the static input
  // and the static output with its gradient, besides the activations counted above (which the
  // pool keeps between steps). The warm-up runs on the training stream and its cached blocks
  // are given back after the capture (StepRecorder::settle), so nothing else stays.
  if (in.cuda_graph)
    add("backbone", "CUDA graphs' static tensors", 4 * P + B * image + 2 * B * d * 4,
        params + " x 4 B (the captured gradients) + the static input batch + " + num(B) + " x " + num(d) +
            " x 4 B x 2 (output and its gradient)");

  // Rank 0 holds the largest shard (the first C % W ranks hold one class more).
  p.classifier = classifier_memory_plan(po, in.world_size, 0, in.batch_per_rank);
  const ClassifierMemoryPlan& c = p.classifier;
  // With sub-centres K rows per class.
  const std::string rows = c.subcenters > 1
                               ? num(double(c.rows * c.subcenters)) + " rows (" + num(double(c.rows)) + " classes x " +
                                     num(double(c.subcenters)) + " sub-centres)"
                               : num(double(c.rows)) + " rows";
  add("classifier", "rows (centres)", c.weight_bytes,
      rows + " x " + num(d) + (in.fc_weight_dtype == "bf16" ? " x 2 B (bf16)" : " x 4 B (fp32)"));
  add("classifier", "optimiser state", c.state_bytes, rows + ", " + fc_opt + ", " + in.fc_state_dtype);
  add("classifier", "gradient", c.gradient_bytes,
      c.gradient_bytes == 0 ? "none materialised whole (classifier_memory_plan)"
                            : num(double(c.sampled_rows)) + " of " + rows + " take part" +
                                  (in.grad_accumulation > 1 ? ", " + num(double(in.grad_accumulation)) +
                                                                   " micro-batches set aside"
                                                             : std::string()) +
                                  (in.fc_update_all ? ", optim.fc_update all" : ""));
  if (po.streamed_logits)
    add("classifier", "logits (streamed)", c.logits_bytes,
        num(double(c.sampled_rows * c.subcenters)) + " x 4 B (1 / ||w||; the logits are never held" +
            (in.logits == "auto" ? ": loss.logits auto)" : ")"));
  else
    add("classifier", "logits buffer", c.logits_bytes,
        num(double(c.global_batch)) + " x " + num(double(c.sampled_rows)) +
            (c.subcenters > 1 ? " x (4 B fp32 + 1 B arg-max sub-centre" : " x (4 B fp32") +
            (c.head_codes ? " + 2 bits: " + in.head + "'s codes of the negatives it changes)" : ")"));

  add("classifier", "chunk temporaries", c.chunk_bytes,
      "the larger of the update's chunk (rows x " + num(d) + " x " + (fc_opt == "sgd" ? "4" : "16") +
          " B) and the logits passes' (columns x (6 x " + num(d) + " + 12 x " + num(double(c.global_batch)) +
          ") B), each at most " + num(double(kDefaultChunkBudget >> 20)) + " MiB (chunk_policy.h)");
  add("communication", "DDP gradient buckets", 4 * P, params + " x 4 B (flat all-reduce buckets)");
  add("communication", "embedding all-gather", 4 * B * W * d * 4 + (mixed ? B * W * d * 2 : 0.0),
      num(B * W) + " x " + num(d) + ": gathered, normalised and their two gradients x 4 B" +
          (mixed ? std::string(", a ") + in.precision + " copy" : std::string()));
  return p;
}

int64_t max_classes_that_fit(JobSettings in, const ActivationTable& table, double budget_bytes) {
  auto fits = [&](int64_t classes) {
    in.num_classes = classes;
    return plan_job_memory(in, table).total_bytes() <= budget_bytes;
  };
  int64_t lo = in.world_size;
  if (!fits(lo)) return 0;
  int64_t hi = lo;
  while (true) {  // doubling to a class count that does not fit (or the limit)
    if (hi >= kMaxNumClasses) return kMaxNumClasses;
    hi = std::min(hi * 2, kMaxNumClasses);
    if (!fits(hi)) break;
    lo = hi;
  }
  while (hi - lo > 1) {  // fits(lo), !fits(hi): the plan grows with the class count
    const int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

namespace {

constexpr int64_t kMaxPlanBatch = int64_t(1) << 24;

// The largest batch in [lo, hi] that fits, where fitting is monotone (true then false);
// lo - 1 when lo does not fit.
template <typename Fits>
int64_t largest_fitting(int64_t lo, int64_t hi, const Fits& fits) {
  if (lo > hi || !fits(lo)) return lo - 1;
  int64_t good = lo, probe = lo;
  while (true) {  // doubling to a batch that does not fit (or hi)
    if (probe >= hi) return hi;
    probe = std::min(hi, probe * 2);
    if (!fits(probe)) break;
    good = probe;
  }
  int64_t bad = probe;
  while (bad - good > 1) {
    const int64_t mid = good + (bad - good) / 2;
    (fits(mid) ? good : bad) = mid;
  }
  return good;
}

}  // namespace

int64_t max_batch_that_fits(JobSettings in, const ActivationTable& table, double budget_bytes) {
  auto fits_with = [&](const std::string& logits) {
    return [&, logits](int64_t batch) {
      JobSettings b = in;
      b.batch_per_rank = batch;
      b.logits = logits;
      return plan_job_memory(b, table).total_bytes() <= budget_bytes;
    };
  };
  plan_job_memory(in, table);  // the settings' errors, as for any plan
  auto none_below_two = [](int64_t b) { return b < 2 ? int64_t(0) : b; };
  if (in.logits != "auto") return none_below_two(largest_fitting(2, kMaxPlanBatch, fits_with(in.logits)));
  // auto: buffered below the first batch where streamed logits pay, streamed from it on.
  auto streamed_pays = [&](int64_t batch) {
    JobSettings b = in;
    b.batch_per_rank = batch;
    b.logits = "auto";
    return classifier_options(b).streamed_logits;
  };
  // The first batch where they pay (kMaxPlanBatch + 1 when none): monotone in the batch.
  const int64_t switch_at = largest_fitting(2, kMaxPlanBatch, [&](int64_t b) { return !streamed_pays(b); }) + 1;
  const int64_t streamed = largest_fitting(std::min(switch_at, kMaxPlanBatch + 1), kMaxPlanBatch, fits_with("streamed"));
  if (streamed >= switch_at) return streamed;
  return none_below_two(largest_fitting(2, switch_at - 1, fits_with("buffer")));
}

}  // namespace faceshard
