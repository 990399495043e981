#include "app/train/graphed_backbone.h"

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>
#include <sstream>
#include <utility>

#include "app/train/train_job.h"
#include "app/train/training_stream.h"
#include "base/error.h"
#include "base/log.h"

namespace faceshard {
namespace {

// The one autograd node of a replayed backbone: forward replays the forward graph, backward
// the backward graph, and each trainable parameter (an input of the node) gets its gradient.
struct ReplayedBackbone : torch::autograd::Function<ReplayedBackbone> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, GraphedBackbone* self, const at::Tensor& images,
                            at::TensorList params) {
    ctx->saved_data["self"] = static_cast<int64_t>(reinterpret_cast<std::intptr_t>(self));
    return self->replay_forward(images);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* self = reinterpret_cast<GraphedBackbone*>(static_cast<std::intptr_t>(ctx->saved_data["self"].toInt()));
    torch::autograd::variable_list out{at::Tensor(), at::Tensor()};  // self, images
    std::vector<at::Tensor> g = self->replay_backward(grads.at(0));
    out.insert(out.end(), g.begin(), g.end());
    return out;
  }
};

// The autocast cache off for the capture (a cached cast of a weight made inside the graph's
// pool would outlive the region that made it); restored after.
class AutocastCacheOff {
 public:
  AutocastCacheOff() : prev_(at::autocast::is_autocast_cache_enabled()) { at::autocast::set_autocast_cache_enabled(false); }
  ~AutocastCacheOff() { at::autocast::set_autocast_cache_enabled(prev_); }

 private:
  bool prev_;
};

std::string shape_of(const at::Tensor& t) {
  std::ostringstream os;
  os << t.sizes();
  return os.str();
}

}  // namespace

GraphedBackbone::GraphedBackbone(std::shared_ptr<Backbone> backbone, std::vector<at::Tensor> params,
                                 std::unique_ptr<StepRecorder> recorder, std::function<bool(bool)> agree, int warm_ups)
    : backbone_(std::move(backbone)),
      params_(std::move(params)),
      recorder_(std::move(recorder)),
      agree_(std::move(agree)),
      warm_ups_(warm_ups) {}

GraphedBackbone::~GraphedBackbone() = default;

bool GraphedBackbone::matches_capture(const at::Tensor& images) const {
  return images.sizes() == static_in_.sizes() && images.strides() == static_in_.strides() &&
         images.scalar_type() == static_in_.scalar_type() && images.device() == static_in_.device();
}

void GraphedBackbone::capture(const at::Tensor& images) {
  tried_ = true;
  std::string problem;
  // Everything the warm-up and the capture's own runs change in the module (BatchNorm's
  // running statistics and counts) is put back afterwards: the module is as if they never ran.
  std::vector<at::Tensor> buffers, saved;
  {
    torch::NoGradGuard ng;
    for (const at::Tensor& b : backbone_->buffers()) {
      buffers.push_back(b);
      saved.push_back(b.clone());
    }
  }
  try {
    // The backward is captured on the recorder's stream: a gradient accumulator made while
    // another stream was current would join that stream to the capture, which breaks it.
    const std::string mismatch = accumulator_stream_mismatch(params_, recorder_->stream());
    if (!mismatch.empty()) throw runtime_error(mismatch);
    AutocastCacheOff cache_off;
    torch::NoGradGuard ng;
    static_in_ = images.detach().clone(at::MemoryFormat::Preserve);
    // A piece's results are the static tensors: the run that is captured makes them; a
    // replay writes into them again (a graph's replay rewrites the same memory). Where a
    // recorder replays by running the piece again (the CPU's EagerReplay), the piece copies
    // its new results into them, so that the static memory behaves as a GPU's replays leave it.
    auto keep = [](at::Tensor& into, const at::Tensor& value) {
      if (into.defined() && value.defined()) into.copy_(value);
      else into = value;
    };
    auto run_forward = [this, keep] {
      torch::AutoGradMode grad_on(true);
      graph_out_ = backbone_->forward(static_in_);
      torch::NoGradGuard ng;
      keep(static_out_, graph_out_);
    };
    auto run_backward = [this, keep] {
      // The gradient with respect to the parameters only: nothing is accumulated into .grad
      // (and no hook of DataParallel fires) here; the node's backward hands them over.
      std::vector<at::Tensor> g = torch::autograd::grad({graph_out_}, params_, {static_grad_out_},
                                                        /*retain_graph=*/true, /*create_graph=*/false,
                                                        /*allow_unused=*/true);
      static_grads_.resize(g.size());
      for (size_t i = 0; i < g.size(); ++i) keep(static_grads_[i], g[i]);
    };
    recorder_->warm_up(
        [&] {
          torch::AutoGradMode grad_on(true);
          const at::Tensor out = backbone_->forward(static_in_);
          if (!static_grad_out_.defined()) static_grad_out_ = torch::ones_like(out);
          torch::autograd::grad({out}, params_, {static_grad_out_}, /*retain_graph=*/false, /*create_graph=*/false,
                                /*allow_unused=*/true);
        },
        warm_ups_);
    if (!static_grad_out_.defined()) {  // no warm-up: the output's shape from one forward
      torch::AutoGradMode grad_on(true);
      static_grad_out_ = torch::ones_like(backbone_->forward(static_in_));
    }
    recorder_->capture(0, run_forward);
    recorder_->capture(1, run_backward);
    recorder_->settle();
  } catch (const std::exception& e) {
    problem = e.what();
    const size_t nl = problem.find('\n');  // the first line of a CUDA error's report
    if (nl != std::string::npos) problem.resize(nl);
  }
  {
    torch::NoGradGuard ng;
    for (size_t i = 0; i < buffers.size(); ++i) buffers[i].copy_(saved[i]);
  }
  const bool ok = problem.empty();
  const bool all_ok = agree_ ? agree_(ok) : ok;
  if (all_ok) {
    captured_ = true;
    log_info("train.cuda_graph: the backbone's forward and backward captured (", recorder_->describe(), ", batch ",
             shape_of(images), "), replayed every step");
    return;
  }
  eager_reason_ = ok ? "the capture failed on another rank" : "the capture failed: " + problem;
  if (ok) log_info("train.cuda_graph: ", eager_reason_, "; the steps run eagerly");
  else log_warn("train.cuda_graph: ", eager_reason_, "; the steps run eagerly");
  // The tensors (in the graphs' pool) before the graphs and their pool.
  static_in_ = static_out_ = graph_out_ = static_grad_out_ = at::Tensor();
  static_grads_.clear();
  recorder_.reset();
}

at::Tensor GraphedBackbone::forward(const at::Tensor& images) {
  if (!tried_) capture(images);
  if (!captured_) return backbone_->forward(images);
  if (!matches_capture(images)) {
    if (eager_calls_++ == 0)
      log_info("train.cuda_graph: a batch of ", shape_of(images), " (the graphs hold ", shape_of(static_in_),
               ") runs eagerly");
    return backbone_->forward(images);
  }
  return ReplayedBackbone::apply(this, images, at::TensorList(params_));
}

at::Tensor GraphedBackbone::replay_forward(const at::Tensor& images) {
  static_in_.copy_(images);
  recorder_->replay(0);
  ++replays_;
  // A copy: the next replay overwrites the static output, and a caller may keep this one.
  return static_out_.detach().clone();
}

std::vector<at::Tensor> GraphedBackbone::replay_backward(const at::Tensor& grad_output) {
  if (!grad_output.defined()) return std::vector<at::Tensor>(params_.size());
  static_grad_out_.copy_(grad_output);
  recorder_->replay(1);
  // A static gradient is never handed out as a parameter's .grad: autograd adds it into a
  // .grad that exists (the flat buffers), but may adopt the tensor itself as the .grad of a
  // parameter that has none (the per-parameter optimiser drops its gradients each step), and
  // the next replay would then rewrite that .grad under the accumulation. Those get a copy.
  std::vector<at::Tensor> out(static_grads_.size());
  for (size_t i = 0; i < out.size(); ++i)
    if (static_grads_[i].defined()) out[i] = params_[i].grad().defined() ? static_grads_[i] : static_grads_[i].clone();
  return out;
}

std::function<bool(bool)> capture_agreement(Distributed& dist) {
  return [&dist](bool ok) {
    at::Tensor flag = torch::full({1}, ok ? 1.0f : 0.0f);
    dist.all_reduce(flag, ReduceOp::Min);
    return flag.item<float>() > 0;
  };
}

std::string cuda_graph_obstacle(const TrainJob& j) {
  if (j.cfg.model.sync_bn) return "SyncBatchNorm's all-reduces sit inside the backbone's forward";
  if (j.cfg.dist.find_unused_parameters) return "dist.find_unused_parameters walks the autograd graph every step";
  if (j.cfg.optim.freeze_backbone_steps > 0)
    return "optim.freeze_backbone_steps changes which parameters the backward reaches when the backbone thaws";
  if (j.backbone->checkpointing())
    return "activation checkpointing (model.checkpointing, on by default for " + j.cfg.model.backbone +
           "'s size) reads the CUDA generator's state inside the backbone";
  return "";
}

BackboneRun make_backbone_run(TrainJob& j) {
  std::shared_ptr<Backbone> backbone = j.backbone;
  BackboneRun eager = [backbone](const at::Tensor& images) { return backbone->forward(images); };
  j.graph_status = eager_graph_status(j.cfg.train.cuda_graph, "");
  if (!j.cfg.train.cuda_graph) return eager;
  const std::string why = j.device.is_cuda() ? cuda_graph_obstacle(j) : "the CPU has no CUDA graphs";
  if (!why.empty()) {
    log_info("train.cuda_graph: ", why, "; the steps run eagerly");
    j.graph_status = eager_graph_status(true, why);
    return eager;
  }
  auto graphed = std::make_shared<GraphedBackbone>(backbone, j.backbone_params, make_cuda_graph_recorder(j.device),
                                                   capture_agreement(*j.dist));
  j.graph_status = graphed_status(graphed);
  return [graphed](const at::Tensor& images) { return graphed->forward(images); };
}

}  // namespace faceshard
