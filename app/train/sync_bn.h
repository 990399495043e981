// Turns every batch-norm layer of a model into SyncBatchNorm (weights and running
// statistics kept): faceshard's NormLayer gets a synchronising forward, and
// torch::nn::BatchNorm1d/2d inside a torch::nn::Sequential is replaced by SyncBatchNorm.
#pragma once
#include <torch/torch.h>

#include "partial_fc/distributed/distributed.h"

namespace faceshard {

// Returns the number of layers converted. A torch::nn::BatchNorm held anywhere else cannot
// be swapped from outside its parent: that is an error naming the layer.
int convert_sync_batchnorm(torch::nn::Module& root, Distributed& dist);

}  // namespace faceshard
