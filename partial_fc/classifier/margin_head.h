// A margin head: what turns a row's cosines into logits in the classifier's one buffer
// (margin_softmax.h). Every head lives in its own file in heads/ (the combined margin with
// ArcFace and CosFace, the sample-adaptive heads, SphereFace, ...), registers itself there
// with its catalogue entry (head_catalogue.h) and is built by name (make_margin_head). A head sees the whole global batch on
// every rank (the gathered feature norms, and every row's target cosine when it asks for
// them), so its state and per-row margins are the same on every rank.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "partial_fc/classifier/head_catalogue.h"
#include "partial_fc/classifier/margin.h"

namespace faceshard {

// One forward's inputs to a head, over the N rows of the global batch.
struct HeadInputs {
  int64_t rows = 0;               // N
  at::TensorOptions options;      // fp32 on the buffer's device
  at::Tensor norms;       // [N] feature norms before normalisation, detached (needs_norms())
  at::Tensor target_cos;  // [N] every row's target cosine, detached (needs_target_cosines())
  int64_t forward = 0;    // the classifier's forward count (seeds per-step draws)
  uint64_t seed = 0;
};

// What one forward's rows need from the head, kept for backward.
struct HeadRows {
  at::Tensor a, b;  // per-row parameters [N] or per-step values [1], head-specific
};

class MarginHead {
 public:
  virtual ~MarginHead() = default;
  virtual std::string name() const = 0;
  virtual double scale() const = 0;
  // Non-target cosines above this are set to 0 (arcface_torch's inter-class filter).
  virtual double interclass_filter() const { return 0.0; }
  // The largest loss a row reports (arcface_torch's 1e-30 cap); infinity: none.
  virtual double row_loss_cap() const;
  virtual bool needs_norms() const { return false; }
  // True when the margin's gradient flows into the feature norm (MagFace).
  virtual bool norm_gradient() const { return false; }
  virtual bool needs_target_cosines() const { return false; }

  // Once per forward, with the same inputs on every rank: advances the head's state and
  // returns what this forward's rows need.
  virtual HeadRows begin_forward(const HeadInputs& in) { (void)in; return {}; }
  // The target logit t(c) before scaling and dt/dc, element-wise over the rows' target
  // cosines c [N] (rows whose target another rank owns hold any value; they are masked).
  virtual at::Tensor target(const at::Tensor& c, const HeadRows& rows) const = 0;
  virtual at::Tensor target_grad(const at::Tensor& c, const HeadRows& rows) const = 0;
  // True when dt/dc = 1 everywhere (the backward leaves the target entries as they are).
  virtual bool unit_gradient() const { return false; }
  // dt/da for the row's feature norm a (norm_gradient() heads).
  virtual at::Tensor target_grad_norm(const at::Tensor& c, const HeadRows& rows) const;
  // A term added to the loss from the feature norms (differentiable), e.g. MagFace's
  // lambda_g * mean(g(a)); undefined when none.
  virtual at::Tensor extra_loss(const at::Tensor& norms) const { (void)norms; return {}; }

  // Heads that change non-target logits (CurricularFace's hard negatives). `logits` is a
  // chunk [N, n] of s * cos; the head rewrites it in place and writes one 2-bit code per
  // entry into `codes` ([N, n] uint8, its own choice of codes); backward gets the chunk of
  // the gradient (dL/dlogit, before the target's correction), the same chunk of the
  // forward's final logits recovered from the probabilities, and the codes, and applies
  // d(new)/d(old) in place.
  virtual bool modifies_negatives() const { return false; }
  virtual void negatives_forward(at::Tensor logits, at::Tensor codes, const HeadRows& rows) const;
  virtual void negatives_backward(at::Tensor grad, const at::Tensor& logits, const at::Tensor& codes,
                                  const HeadRows& rows) const;

  // The head's state (the same on every rank): checkpointed, resumed, logged.
  virtual std::vector<std::pair<std::string, at::Tensor>> state() const { return {}; }
  // Replaces a state entry; errors name `source` and the key.
  virtual void load_state(const std::string& key, const at::Tensor& value, const std::string& source);
};

// Which head and its parameters, named as the heads' authors name them (missing ones take
// the authors' defaults: the head's catalogue entry, head_catalogue.h).
struct HeadSpec {
  std::string name = "combined";  // a name in head_catalogue()
  std::map<std::string, double> params;
};

// The head for `spec`; `combined` is built from `margin` (arcface and cosface set up the
// combined margin with their m and s). Unknown names or parameters, and values out of range,
// are option_error naming "head" (with the known heads) or the parameter.
std::unique_ptr<MarginHead> make_margin_head(const HeadSpec& spec, const CombinedMargin& margin);

// "adaface (m 0.4, h 0.333, s 64, t_alpha 0.01)": a head by its resolved parameters (the
// combined head by its margin), as the trainer's start-up line names it.
std::string describe_margin_head(const HeadSpec& spec, const CombinedMargin& margin);

// What a head file registers: its catalogue entry and how to build it from its resolved
// parameters (and the config's combined margin, which only the combined heads read).
using HeadFactory =
    std::function<std::unique_ptr<MarginHead>(const std::map<std::string, double>& params, const CombinedMargin& margin)>;
void register_margin_head(HeadInfo info, HeadFactory make);

// A head file, heads/<file>.cpp, registers its heads in FACESHARD_MARGIN_HEADS(<file>) { ... }
// (inside namespace faceshard): the build lists heads/*.cpp and calls each such function once,
// before anything reads the catalogue. Adding a head is adding its file.
#define FACESHARD_MARGIN_HEADS(file) void register_heads_in_##file()

}  // namespace faceshard
