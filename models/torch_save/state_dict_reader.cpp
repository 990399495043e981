#include "models/torch_save/state_dict_reader.h"

#include <algorithm>

#include "base/error.h"

namespace faceshard {

namespace {

std::string shape_str(c10::IntArrayRef s) {
  std::string out = "[";
  for (size_t k = 0; k < s.size(); ++k) out += (k ? "," : "") + std::to_string(s[k]);
  return out + "]";
}

}  // namespace

at::ScalarType to_scalar_type(StorageType t) {
  switch (t) {
    case StorageType::Float: return at::kFloat;
    case StorageType::Double: return at::kDouble;
    case StorageType::Half: return at::kHalf;
    case StorageType::BFloat16: return at::kBFloat16;
    case StorageType::Long: return at::kLong;
    case StorageType::Int: return at::kInt;
    case StorageType::Short: return at::kShort;
    case StorageType::Char: return at::kChar;
    case StorageType::Byte: return at::kByte;
    case StorageType::Bool: return at::kBool;
  }
  return at::kFloat;
}

StateDictReader::StateDictReader(const std::string& path, int64_t staging_bytes)
    : file_(open_torch_save(path)), staging_bytes_(std::max<int64_t>(1, staging_bytes)) {}

at::ScalarType StateDictReader::dtype(size_t i) const {
  return to_scalar_type(file_.dict.storages[file_.dict.tensors.at(i).storage].type);
}

void StateDictReader::read_into(size_t i, const at::Tensor& dst) const {
  const SavedTensor& t = file_.dict.tensors.at(i);
  if (dst.sizes() != c10::IntArrayRef(t.sizes))
    throw runtime_error(path(), ": '", detail::printable(t.name), "' has shape ", shape_str(t.sizes), ", expected ",
                        shape_str(dst.sizes()));
  if (t.sizes.empty()) return copy_rows(t, {1}, 0, dst.unsqueeze(0));
  copy_rows(t, t.sizes, 0, dst);
}

void StateDictReader::read_rows_into(size_t i, int64_t first, const at::Tensor& dst) const {
  const SavedTensor& t = file_.dict.tensors.at(i);
  auto bad = [&](const auto&... what) { return runtime_error(path(), ": '", detail::printable(t.name), "' ", what...); };
  if (t.sizes.empty() || dst.dim() != static_cast<int64_t>(t.sizes.size()) ||
      !std::equal(t.sizes.begin() + 1, t.sizes.end(), dst.sizes().begin() + 1))
    throw bad("has shape ", shape_str(t.sizes), ", expected rows of shape ", shape_str(dst.sizes()));
  if (first < 0 || dst.size(0) > t.sizes[0] - first)
    throw bad("has ", t.sizes[0], " rows; rows [", first, ", ", first + dst.size(0), ") are not among them");
  copy_rows(t, t.sizes, first, dst);
}

at::Tensor StateDictReader::staging(int64_t bytes, bool pinned) const {
  if (!staging_.defined() || staging_.numel() < bytes || staging_pinned_ != pinned) {
    staging_ = at::Tensor();  // the old buffer goes first
    staging_ = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(pinned));
    staging_pinned_ = pinned;
  }
  return staging_;
}

void StateDictReader::copy_rows(const SavedTensor& t, const std::vector<int64_t>& shape, int64_t first,
                                const at::Tensor& dst) const {
  at::NoGradGuard no_grad;
  const int64_t rows = dst.size(0);
  if (dst.numel() == 0) return;
  const SavedStorage& s = file_.dict.storages[t.storage];
  const at::ScalarType type = to_scalar_type(s.type);
  const int64_t es = static_cast<int64_t>(storage_element_size(s.type));
  const int64_t row_elems = dst.numel() / rows;
  if (!is_contiguous(t)) {
    // A strided view (Python saved a slice or a transpose): its rows are no byte range. Its
    // storage is read whole (no larger than its record in the file) and the view copied.
    at::Tensor whole = at::empty({static_cast<int64_t>(s.numel)}, at::TensorOptions().dtype(type));
    file_.read_storage(t.storage, whole.data_ptr());
    dst.copy_(whole.as_strided(t.sizes, t.strides, t.offset).reshape(shape).narrow(0, first, rows));
    return;
  }
  // No overflow: every element of t lies inside its storage, whose bytes fit in the file.
  const uint64_t begin = (static_cast<uint64_t>(t.offset) + static_cast<uint64_t>(first * row_elems)) * es;
  const uint64_t bytes = static_cast<uint64_t>(rows * row_elems * es);
  ZipEntryStream in = file_.open_storage(t.storage, begin, begin + bytes);
  if (dst.device().is_cpu() && dst.scalar_type() == type && dst.is_contiguous()) {
    in.read(dst.data_ptr(), bytes);
    return;
  }
  // Through the staging buffer, chunk by chunk: over the flat elements of a contiguous
  // destination, else over whole rows (at least one row per chunk). copy_ from host memory
  // returns when the copy is done, so the buffer can be refilled at once.
  const bool pinned = dst.device().is_cuda();
  if (dst.is_contiguous()) {
    const at::Tensor flat = dst.view({-1});
    const int64_t per_chunk = std::max<int64_t>(1, staging_bytes_ / es);
    const at::Tensor buf = staging(std::min(per_chunk, flat.numel()) * es, pinned);
    for (int64_t e = 0; e < flat.numel(); e += per_chunk) {
      const int64_t k = std::min(per_chunk, flat.numel() - e);
      in.read(buf.data_ptr(), static_cast<size_t>(k * es));
      flat.narrow(0, e, k).copy_(buf.narrow(0, 0, k * es).view(type));
    }
    return;
  }
  const int64_t per_chunk = std::max<int64_t>(1, staging_bytes_ / (row_elems * es));
  const at::Tensor buf = staging(std::min(per_chunk, rows) * row_elems * es, pinned);
  std::vector<int64_t> chunk_shape = dst.sizes().vec();
  for (int64_t r = 0; r < rows; r += per_chunk) {
    const int64_t k = std::min(per_chunk, rows - r);
    chunk_shape[0] = k;
    in.read(buf.data_ptr(), static_cast<size_t>(k * row_elems * es));
    dst.narrow(0, r, k).copy_(buf.narrow(0, 0, k * row_elems * es).view(type).view(chunk_shape));
  }
}

}  // namespace faceshard
