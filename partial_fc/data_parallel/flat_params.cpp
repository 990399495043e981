#include "partial_fc/data_parallel/flat_params.h"

#include <map>
#include <set>
#include <tuple>

#include <c10/core/GradMode.h>

#include "base/error.h"

namespace faceshard {

FlatParameters::FlatParameters(std::vector<at::Tensor> params, double bucket_mb, const std::vector<int>& partition)
    : params_(std::move(params)) {
  const int n = static_cast<int>(params_.size());
  if (!partition.empty() && partition.size() != params_.size())
    throw runtime_error("flat parameters: a partition of ", partition.size(), " entries for ", n, " params");
  group_of_.assign(n, -1);
  offset_of_.assign(n, 0);
  std::set<const void*> seen;
  for (int i = 0; i < n; ++i) {
    const at::Tensor& p = params_[i];
    if (!p.defined()) throw usage_error("flat parameters: param ", i, " is undefined");
    if (!seen.insert(p.unsafeGetTensorImpl()).second) throw usage_error("flat parameters: param ", i, " is listed twice");
    if (!p.is_non_overlapping_and_dense())
      throw usage_error("flat parameters: param ", i, " of shape ", p.sizes(), " and strides ", p.strides(),
                        " is not dense");
  }
  // DataParallel's buckets: reverse registration order, one device and dtype each, at most
  // the cap (a parameter larger than the cap has a bucket of its own).
  const int64_t cap = static_cast<int64_t>(bucket_mb * 1024 * 1024);
  std::map<std::tuple<std::string, at::ScalarType, int>, int> group_index;
  std::vector<int64_t> group_size;
  int64_t bytes = 0;
  for (int i = n - 1; i >= 0; --i) {
    const at::Tensor& p = params_[i];
    const auto key = std::make_tuple(p.device().str(), p.scalar_type(), partition.empty() ? 0 : partition[i]);
    auto it = group_index.find(key);
    if (it == group_index.end()) {
      it = group_index.emplace(key, static_cast<int>(groups_.size())).first;
      groups_.emplace_back();
      group_size.push_back(0);
    }
    const int g = it->second;
    const int64_t nb = p.numel() * static_cast<int64_t>(p.element_size());
    const bool fresh = buckets_.empty() || bytes + nb > cap || buckets_.back().group != g;
    if (fresh) {
      buckets_.emplace_back();
      buckets_.back().group = g;
      buckets_.back().offset = group_size[g];
      bytes = 0;
    }
    Bucket& b = buckets_.back();
    group_of_[i] = g;
    offset_of_[i] = group_size[g];
    b.offsets.push_back(group_size[g] - b.offset);
    b.params.push_back(i);
    b.numel += p.numel();
    groups_[g].params.push_back(i);
    group_size[g] += p.numel();
    bytes += nb;
  }
  at::NoGradGuard no_grad;
  for (size_t g = 0; g < groups_.size(); ++g) {
    const at::Tensor& first = params_[groups_[g].params.front()];
    const at::TensorOptions o = first.options().requires_grad(false);
    groups_[g].values = at::empty({group_size[g]}, o);
    groups_[g].grads = at::zeros({group_size[g]}, o);
  }
  for (int i = 0; i < n; ++i) {
    at::Tensor& p = params_[i];
    const Group& g = groups_[group_of_[i]];
    at::Tensor v = view(i, g.values);
    v.copy_(p.detach());
    p.set_data(v);
    p.mutable_grad() = view(i, g.grads);
  }
}

at::Tensor FlatParameters::view(int i, const at::Tensor& flat) const {
  const at::Tensor& p = params_[i];
  return flat.as_strided(p.sizes(), p.strides(), flat.storage_offset() + offset_of_[i]);
}

void FlatParameters::zero_grad() {
  at::NoGradGuard no_grad;
  for (Group& g : groups_) g.grads.zero_();
  for (int i = 0; i < static_cast<int>(params_.size()); ++i) {
    at::Tensor& p = params_[i];
    const at::Tensor& grad = p.grad();
    const Group& g = groups_[group_of_[i]];
    const void* expected = static_cast<const char*>(g.grads.data_ptr()) + offset_of_[i] * g.grads.element_size();
    if (!grad.defined() || grad.data_ptr() != expected || grad.strides() != p.strides()) p.mutable_grad() = view(i, g.grads);
  }
}

void FlatParameters::check_intact(const char* who) const {
  for (int i = 0; i < static_cast<int>(params_.size()); ++i) {
    const Group& g = groups_[group_of_[i]];
    const void* expected = static_cast<const char*>(g.values.data_ptr()) + offset_of_[i] * g.values.element_size();
    if (params_[i].data_ptr() != expected)
      throw runtime_error(who, ": parameter ", i, " no longer lives in its flat buffer (the module was moved or its "
                          "data replaced after the buffers were made)");
  }
}

}  // namespace faceshard
