// The combined margin (margin.h) as heads: `combined` takes the config's loss.margin (m1, m2,
// m3), loss.scale and loss.margin_mode, as arcface_torch's CombinedMarginLoss; `arcface`
// (Deng et al., CVPR 2019) and `cosface` (Wang et al., CVPR 2018) are its (1, m, 0) and
// (1, 0, m) with their own m and s.
#include <map>
#include <memory>
#include <string>

#include "partial_fc/classifier/margin_head.h"

namespace faceshard {
namespace {

class CombinedHead : public MarginHead {
 public:
  CombinedHead(CombinedMargin m, std::string name) : m_(m), name_(std::move(name)) { m_.validate(); }
  std::string name() const override { return name_; }
  double scale() const override { return m_.scale; }
  double interclass_filter() const override { return m_.interclass_filter; }
  double row_loss_cap() const override { return m_.row_loss_cap(); }
  at::Tensor target(const at::Tensor& c, const HeadRows&) const override { return m_.target(c); }
  at::Tensor target_grad(const at::Tensor& c, const HeadRows&) const override { return m_.target_grad(c); }
  bool unit_gradient() const override { return m_.unit_gradient(); }

 private:
  CombinedMargin m_;
  std::string name_;
};

}  // namespace

FACESHARD_MARGIN_HEADS(combined) {
  register_margin_head({"combined",
                        "s (cos(m1 theta + m2) - m3) from loss.margin, loss.scale and loss.margin_mode (arcface_torch's "
                        "CombinedMarginLoss)",
                        {}},
                       [](const std::map<std::string, double>&, const CombinedMargin& margin) {
                         return std::make_unique<CombinedHead>(margin, "combined");
                       });
  for (const bool arc : {true, false})
    register_margin_head(
        {arc ? "arcface" : "cosface",
         arc ? "ArcFace (Deng et al., CVPR 2019): s cos(theta + m), the combined margin (1, m, 0)"
             : "CosFace (Wang et al., CVPR 2018): s (cos(theta) - m), the combined margin (1, 0, m)",
         {{"m", arc ? 0.5 : 0.4, 0, kUnbounded, false, false, arc ? "the angular margin" : "the additive cosine margin"},
          {"s", 64.0, 0, kUnbounded, true, false, "the logits' scale"}}},
        [arc](const std::map<std::string, double>& p, const CombinedMargin& margin) {
          CombinedMargin m = margin;
          m.m1 = 1.0;
          m.m2 = arc ? p.at("m") : 0.0;
          m.m3 = arc ? 0.0 : p.at("m");
          m.scale = p.at("s");
          return std::make_unique<CombinedHead>(m, arc ? "arcface" : "cosface");
        });
}

}  // namespace faceshard
