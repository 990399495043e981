// What train.cuda_graph came to in a training step: asked or not, the backbone's graphs
// captured or not, and why the steps run eagerly. make_backbone_run leaves a reader of it in
// TrainJob::graph_status; faceshard-bench writes it beside its figures, so that a figure
// measured "with CUDA graphs" is counted as one only where the graphs replayed.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace faceshard {

class GraphedBackbone;

struct GraphStatus {
  bool asked = false;       // train.cuda_graph
  bool captured = false;    // the graphs replay (decided at the first step)
  std::string reason;       // why the steps run eagerly; "" when captured or not decided yet
  int64_t eager_calls = 0;  // calls that ran eagerly: a batch of another shape than the captured one
};

// The status as it stands when called: the capture is tried at the first step, so a reader
// made before it says neither captured nor why not.
using GraphStatusReader = std::function<GraphStatus()>;

// Steps that never try a capture: `asked` with the reason they run eagerly anyway (the CPU,
// SyncBatchNorm, ...), or not asked at all (reason "").
GraphStatusReader eager_graph_status(bool asked, std::string reason);

// A GraphedBackbone's status, read from it at each call; once the backbone is gone (its step
// destroyed), "not captured" with a reason saying so.
GraphStatusReader graphed_status(std::weak_ptr<const GraphedBackbone> graphed);

}  // namespace faceshard
