// Reading and writing PyTorch state_dicts in torch.save's zip format, without Python. The
// reader is a thin layer over torch_save_format.h (zip container and bounded pickle machine,
// no LibTorch) that turns its checked records into tensors; the writer emits the pickle
// torch.save writes for a dict of tensors. (torch::pickle_load turns an OrderedDict into
// None, and torch::pickle_save output needs torch.load(weights_only=False).)
#pragma once
#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

namespace faceshard {

// name -> tensor, in file/module order (PyTorch state_dicts are ordered).
using StateDict = std::vector<std::pair<std::string, torch::Tensor>>;

// Reads a file written by Python's torch.save(state_dict, path) (zip format, PyTorch >=
// 1.6): a dict or OrderedDict whose values are tensors (or Parameters). Tensors come back
// on the CPU with the saved dtype, sizes and strides. Throws faceshard::Error naming the
// file on anything else (missing file, legacy format, corrupt archive, non-tensor value).
// Memory: the storages (at most the file's size) plus the pickle's objects (see
// pickle_graph.h); nothing recurses with the input's nesting.
StateDict read_state_dict(const std::string& path);

// Writes `weights` so that Python's torch.load(path) (weights_only=True, the default)
// returns an OrderedDict of CPU tensors with the same names, dtypes, sizes and values.
// Non-contiguous and device tensors are saved as contiguous CPU copies.
void write_state_dict(const StateDict& weights, const std::string& path);

}  // namespace faceshard
