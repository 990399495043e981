// The flags the evaluation tools share, read with the tools' parser (base/tool_args.h): the
// model (--model, --network, --embedding-size, --precision) and the device.
#pragma once
#include <string>

#include <torch/torch.h>

#include "app/eval/inference_model.h"
#include "base/tool_args.h"

namespace faceshard {

// The model flags every evaluation tool shares: --model, --network, --embedding-size,
// --precision. Returns true when the current argument was one of them (value consumed).
bool parse_model_flag(ToolArgs& args, ModelSpec& spec);

// "cpu", "cuda" or "cuda:N" (usage error when CUDA is asked for and not available);
// "auto": the local rank's GPU when there is one, else the CPU.
torch::Device parse_eval_device(const std::string& text, int local_rank);

}  // namespace faceshard
