// CUDA graphs for the training step (train.cuda_graph): the backbone's forward and backward,
// where a network of small kernels spends its step launching them (MobileFaceNet launches
// about 1,400 a step), are captured once, at the first step, and replayed every step after.
//
// How: the first batch is copied into a static input; the forward is run a few times on the
// job's training stream, where the capture runs too (warm-up: cuDNN's algorithm search, the
// allocator's first blocks), then captured with autograd on, and the backward captured as the gradient of the static output
// (given a static output gradient) with respect to the trainable parameters, into static
// gradients; both graphs share one memory pool, which holds the activations between them.
// The warm-up's effects on the module are undone (BatchNorm's running statistics and counts
// restored), and nothing of it reaches a parameter's gradient. A step then copies its images
// into the static input and replays the forward; the embeddings it returns are a copy of the
// static output attached to autograd by one node whose backward copies the incoming
// gradient in, replays the backward and hands each parameter its static gradient, which
// autograd accumulates into .grad as an eager backward does: DataParallel's hooks (they fire
// once the replay is done: the all-reduces start after the whole backward instead of
// overlapping it), gradient accumulation, loss scaling and the fused optimiser's flat
// buffers see the same gradients.
//
// The classifier (its labels are gathered and checked on the host, its sampling drawn from a
// host-seeded generator, its learning rate a host number), the optimisers and the
// collectives stay eager: they are a few dozen kernels a step against the backbone's
// hundreds to thousands.
//
// Where capture is impossible the steps run eagerly, with one log line saying why: the CPU;
// SyncBatchNorm (its all-reduces sit inside the forward); dist.find_unused_parameters (it
// walks the autograd graph each step); activation checkpointing (vit_b and larger, r2060,
// model.checkpointing); gradient accumulators made on another stream than the capture's
// (training_stream.h); a capture that fails on any rank (all ranks then run
// eagerly, decided together). A batch of another shape than the captured one (none in
// training: every batch of a run has the same size) runs eagerly for that call.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "app/train/step_recorder.h"
#include "models/backbone.h"
#include "partial_fc/distributed/distributed.h"

namespace faceshard {

struct TrainJob;

class GraphedBackbone {
 public:
  // `agree(ok)`: whether every rank's capture succeeded, given this rank's (a collective; by
  // default this rank's alone). `warm_ups`: forward+backward runs before the capture.
  GraphedBackbone(std::shared_ptr<Backbone> backbone, std::vector<at::Tensor> params,
                  std::unique_ptr<StepRecorder> recorder, std::function<bool(bool)> agree = {}, int warm_ups = 3);
  ~GraphedBackbone();

  // images [B, 3, H, W] -> embeddings [B, E] (fp32), differentiable with respect to the
  // trainable parameters; captures at the first call.
  at::Tensor forward(const at::Tensor& images);

  bool captured() const { return captured_; }
  // Why the steps run eagerly ("" while they replay or before the first call).
  const std::string& eager_reason() const { return eager_reason_; }
  // Calls that ran eagerly because their batch differs from the captured one.
  int64_t eager_calls() const { return eager_calls_; }
  // Forward replays so far (each step's micro-batches replay once each).
  int64_t replays() const { return replays_; }
  // The captured backward's gradients, one per trainable parameter (for inspection).
  const std::vector<at::Tensor>& static_gradients() const { return static_grads_; }

  // Used by the autograd node (graphed_backbone.cpp).
  at::Tensor replay_forward(const at::Tensor& images);
  std::vector<at::Tensor> replay_backward(const at::Tensor& grad_output);

 private:
  void capture(const at::Tensor& images);
  bool matches_capture(const at::Tensor& images) const;

  std::shared_ptr<Backbone> backbone_;
  std::vector<at::Tensor> params_;
  std::unique_ptr<StepRecorder> recorder_;
  std::function<bool(bool)> agree_;
  int warm_ups_;
  bool tried_ = false, captured_ = false;
  std::string eager_reason_;
  int64_t eager_calls_ = 0, replays_ = 0;
  // graph_out_: the captured forward's output, which the captured backward differentiates;
  // static_out_: its values (the same tensor once captured on a GPU).
  at::Tensor static_in_, static_out_, graph_out_, static_grad_out_;
  std::vector<at::Tensor> static_grads_;
};

// The decision on the capture every rank takes together: true when every rank's succeeded
// (one all-reduce of a flag, on the host). Ranks that replay and ranks that run eagerly would
// issue the same collectives, but the steps of a run stay one kind on every rank.
std::function<bool(bool)> capture_agreement(Distributed& dist);

// Why `job`'s backbone cannot be captured on any device ("" where it can): SyncBatchNorm,
// dist.find_unused_parameters, activation checkpointing (the checkpoints' recomputation reads
// the CUDA generator's state, which a capture forbids). Checked before any warm-up.
std::string cuda_graph_obstacle(const TrainJob& job);

// How a training step runs its backbone: `images -> embeddings`, differentiable.
using BackboneRun = std::function<at::Tensor(const at::Tensor& images)>;

// Eagerly (backbone->forward), or through GraphedBackbone with CUDA graphs where
// train.cuda_graph asks and the job allows it (otherwise one log line naming why). Sets
// job.graph_status to a reader of what came of it (graph_status.h).
BackboneRun make_backbone_run(TrainJob& job);

}  // namespace faceshard
