// NumPy .npy files (format version 1.0): float32 matrices that Python reads with np.load.
#pragma once
#include <string>

#include <ATen/ATen.h>

namespace faceshard {

// Writes a 1-D or 2-D tensor as little-endian float32 ('<f4', C order). The file appears
// under its name only when complete (temporary file, flush, rename).
void write_npy_float32(const at::Tensor& values, const std::string& path);

}  // namespace faceshard
