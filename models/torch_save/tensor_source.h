// Named tensors whose names, shapes and dtypes are known before any value is read, so that
// a loader (a backbone's weights, an optimiser's state) checks everything first and then
// has each value copied straight into its destination: a torch.save file streams its values
// from disk (StateDictReader), tensors in memory are copied (TensorListSource).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "models/torch_save/state_dict_io.h"

namespace faceshard {

class TensorSource {
 public:
  static constexpr size_t npos = SIZE_MAX;
  virtual ~TensorSource() = default;

  virtual size_t size() const = 0;
  virtual const std::string& name(size_t i) const = 0;
  virtual std::vector<int64_t> sizes(size_t i) const = 0;
  virtual at::ScalarType dtype(size_t i) const = 0;
  // Copies entry i into dst, which has its sizes (any dtype, device and memory layout:
  // values convert as copy_ converts them). Writes into parameters that require grad.
  virtual void read_into(size_t i, const at::Tensor& dst) const = 0;

  // Entry i as a new contiguous CPU tensor of its dtype (meant for small entries: counts,
  // scalars; a big one costs its own size, no more).
  at::Tensor read(size_t i) const;
  int64_t numel(size_t i) const;
  // The last entry named `name` (a repeated key's value wins, as in a Python dict), or npos.
  size_t find(const std::string& name) const;
};

// Tensors in memory (the list must outlive the source).
class TensorListSource final : public TensorSource {
 public:
  explicit TensorListSource(const StateDict& tensors) : tensors_(tensors) {}
  size_t size() const override { return tensors_.size(); }
  const std::string& name(size_t i) const override { return tensors_.at(i).first; }
  std::vector<int64_t> sizes(size_t i) const override;
  at::ScalarType dtype(size_t i) const override;
  void read_into(size_t i, const at::Tensor& dst) const override;

 private:
  const StateDict& tensors_;
};

// The entries of `base` whose names start with `prefix`, named without it (base must
// outlive it): "opt/momentum.3" of train_state.pt is "momentum.3" to the optimiser.
class PrefixedSource final : public TensorSource {
 public:
  PrefixedSource(const TensorSource& base, const std::string& prefix);
  size_t size() const override { return index_.size(); }
  const std::string& name(size_t i) const override { return names_.at(i); }
  std::vector<int64_t> sizes(size_t i) const override { return base_.sizes(index_.at(i)); }
  at::ScalarType dtype(size_t i) const override { return base_.dtype(index_.at(i)); }
  void read_into(size_t i, const at::Tensor& dst) const override { base_.read_into(index_.at(i), dst); }

 private:
  const TensorSource& base_;
  std::vector<size_t> index_;
  std::vector<std::string> names_;
};

}  // namespace faceshard
