#include "models/torch_save/tensor_source.h"

#include "base/error.h"

namespace faceshard {

at::Tensor TensorSource::read(size_t i) const {
  at::Tensor out = at::empty(sizes(i), at::TensorOptions().dtype(dtype(i)));
  read_into(i, out);
  return out;
}

int64_t TensorSource::numel(size_t i) const {
  int64_t n = 1;
  for (int64_t s : sizes(i)) n *= s;  // checked against the file by its reader
  return n;
}

size_t TensorSource::find(const std::string& key) const {
  for (size_t i = size(); i-- > 0;)
    if (name(i) == key) return i;
  return npos;
}

std::vector<int64_t> TensorListSource::sizes(size_t i) const {
  const at::Tensor& t = tensors_.at(i).second;
  if (!t.defined()) throw usage_error("tensor '", tensors_[i].first, "' is undefined");
  return t.sizes().vec();
}

at::ScalarType TensorListSource::dtype(size_t i) const {
  const at::Tensor& t = tensors_.at(i).second;
  if (!t.defined()) throw usage_error("tensor '", tensors_[i].first, "' is undefined");
  return t.scalar_type();
}

void TensorListSource::read_into(size_t i, const at::Tensor& dst) const {
  at::NoGradGuard no_grad;
  dst.copy_(tensors_.at(i).second);
}

PrefixedSource::PrefixedSource(const TensorSource& base, const std::string& prefix) : base_(base) {
  for (size_t i = 0; i < base.size(); ++i) {
    const std::string& n = base.name(i);
    if (n.compare(0, prefix.size(), prefix) != 0) continue;
    index_.push_back(i);
    names_.push_back(n.substr(prefix.size()));
  }
}

}  // namespace faceshard
