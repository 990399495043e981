#include "app/io/npy.h"

#include <cstring>
#include <fstream>
#include <regex>

#include "app/io/checkpoint.h"
#include "base/error.h"

namespace faceshard {

void write_npy_float32(const at::Tensor& values, const std::string& path) {
  if (values.dim() != 1 && values.dim() != 2)
    throw runtime_error(path, ": .npy output needs a 1-D or 2-D tensor, got ", values.dim(), "-D");
  const at::Tensor v = values.detach().to(at::kCPU, at::kFloat).contiguous();
  std::string shape = "(" + std::to_string(v.size(0)) + (v.dim() == 1 ? "," : ", " + std::to_string(v.size(1))) + ")";
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': " + shape + ", }";
  // Magic (6) + version (2) + header length (2) + header, padded with spaces so that the
  // data starts at a multiple of 64 bytes, the header ending in a newline.
  const size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header.push_back('\n');
  if (header.size() > 65535) throw runtime_error(path, ": .npy header too long");
  std::string out("\x93NUMPY\x01\x00", 8);
  out.push_back(char(header.size() & 0xff));
  out.push_back(char(header.size() >> 8));
  out += header;
  const size_t bytes = size_t(v.numel()) * sizeof(float);
  const size_t at = out.size();
  out.resize(at + bytes);
  static_assert(sizeof(float) == 4, "float32");
  // Little-endian hosts only (x86-64, aarch64): the float bytes are copied as they are.
  if (bytes) std::memcpy(&out[at], v.data_ptr<float>(), bytes);
  write_text_durably(out, path);
}

at::Tensor read_npy(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) throw usage_error(path, ": cannot open .npy file");
  const std::streamoff size = in.tellg();
  in.seekg(0);
  char head[12];
  if (size < 10 || !in.read(head, 10)) throw runtime_error(path, ": not a .npy file (shorter than its preamble)");
  if (std::memcmp(head, "\x93NUMPY", 6) != 0) throw runtime_error(path, ": not a .npy file (no \\x93NUMPY magic)");
  const int major = static_cast<unsigned char>(head[6]);
  uint64_t header_len = 0, preamble = 10;
  if (major == 1) {
    header_len = static_cast<unsigned char>(head[8]) | (uint64_t(static_cast<unsigned char>(head[9])) << 8);
  } else if (major == 2 || major == 3) {
    if (!in.read(head + 10, 2)) throw runtime_error(path, ": truncated .npy preamble");
    for (int i = 0; i < 4; ++i) header_len |= uint64_t(static_cast<unsigned char>(head[8 + i])) << (8 * i);
    preamble = 12;
  } else {
    throw runtime_error(path, ": .npy format version ", major, " is not 1, 2 or 3");
  }
  if (header_len > 65536 || preamble + header_len > uint64_t(size))
    throw runtime_error(path, ": .npy header of ", header_len, " bytes does not fit the file");
  std::string header(header_len, '\0');
  if (!in.read(header.data(), std::streamsize(header_len))) throw runtime_error(path, ": truncated .npy header");
  std::smatch m;
  const std::regex descr_re("'descr'\\s*:\\s*'([<|=])([fi])([48])'"), order_re("'fortran_order'\\s*:\\s*(True|False)"),
      shape_re("'shape'\\s*:\\s*\\(\\s*([0-9]{1,12})\\s*(?:,\\s*([0-9]{1,12})\\s*)?,?\\s*\\)");
  if (!std::regex_search(header, m, descr_re))
    throw runtime_error(path, ": .npy dtype is not one of '<f4', '<f8', '<i4', '<i8' (header: ",
                        detail::printable(header.substr(0, 80)), ")");
  const char kind = m[2].str()[0];
  const int width = m[3].str()[0] - '0';
  const at::ScalarType dtype = kind == 'f' ? (width == 4 ? at::kFloat : at::kDouble) : (width == 4 ? at::kInt : at::kLong);
  if (!std::regex_search(header, m, order_re) || m[1] != "False")
    throw runtime_error(path, ": .npy array must be in C order (fortran_order False)");
  if (!std::regex_search(header, m, shape_re))
    throw runtime_error(path, ": .npy shape must have 1 or 2 dimensions (header: ", detail::printable(header.substr(0, 80)),
                        ")");
  std::vector<int64_t> shape{std::stoll(m[1].str())};
  if (m[2].matched) shape.push_back(std::stoll(m[2].str()));
  uint64_t count = 1;
  for (int64_t d : shape) {
    if (d > 0 && count > (uint64_t(1) << 40) / uint64_t(d)) throw runtime_error(path, ": .npy shape is too large");
    count *= uint64_t(d);
  }
  const uint64_t bytes = count * uint64_t(width);
  if (uint64_t(size) - preamble - header_len != bytes)
    throw runtime_error(path, ": .npy data is ", uint64_t(size) - preamble - header_len, " bytes, the shape announces ",
                        bytes);
  at::Tensor out = at::empty(shape, at::TensorOptions().dtype(dtype));
  if (bytes && !in.read(static_cast<char*>(out.data_ptr()), std::streamsize(bytes)))
    throw runtime_error(path, ": truncated .npy data");
  return out;
}

}  // namespace faceshard
