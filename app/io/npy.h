// NumPy .npy files: float32 matrices that Python reads with np.load (written as format
// 1.0), and the reader for what users hand the tools (float32 / float64 / int64 arrays).
#pragma once
#include <string>

#include <ATen/ATen.h>

namespace faceshard {

// Writes a 1-D or 2-D tensor as little-endian float32 ('<f4', C order). The file appears
// under its name only when complete (temporary file, flush, rename).
void write_npy_float32(const at::Tensor& values, const std::string& path);

// Reads a C-order, little-endian array of 1 or 2 dimensions, format 1.0 to 3.0, whose
// descr is '<f4', '<f8' or '<i8' (also '<i4'), into a CPU tensor of that type. The header
// (at most 64 KiB) is parsed as the literal dict numpy writes; the data must be exactly
// the bytes the shape announces. Anything else: a runtime error naming the file.
at::Tensor read_npy(const std::string& path);

}  // namespace faceshard
