#include "app/train/graph_status.h"

#include <utility>

#include "app/train/graphed_backbone.h"

namespace faceshard {

GraphStatusReader eager_graph_status(bool asked, std::string reason) {
  GraphStatus s;
  s.asked = asked;
  s.reason = std::move(reason);
  return [s] { return s; };
}

GraphStatusReader graphed_status(std::weak_ptr<const GraphedBackbone> graphed) {
  return [graphed] {
    GraphStatus s;
    s.asked = true;
    const std::shared_ptr<const GraphedBackbone> g = graphed.lock();
    if (!g) {
      s.reason = "the step that held the graphs is gone";
      return s;
    }
    s.captured = g->captured();
    s.reason = g->eager_reason();
    s.eager_calls = g->eager_calls();
    return s;
  };
}

}  // namespace faceshard
