// Counts the ATen operators that would launch a kernel on a GPU, dispatched while it lives on
// any thread (a RecordFunction observer): the CPU's stand-in for a GPU's kernel launches. A
// classifier step whose count does not grow with the class count launches a bounded number
// of kernels on a GPU (faceshard-bench --mode classifier reports it as ops_per_step; a test
// keeps it flat).
//
// What counts: an operator at the outermost level of counted ones (the operators a composite
// one dispatches are its implementation, not more launches), that is neither a view (its
// schema returns an alias of an input that it does not write: narrow, t, select, a no-op to()
// ...) nor an allocation without a kernel (empty, empty_strided, resize_ ...); where a view or
// a no-op composite dispatches a copy, the copy counts. A user scope (RECORD_USER_SCOPE: a
// fused loop of the project's own, one kernel on a GPU) counts as one. One counter at a time.
#pragma once
#include <cstdint>
#include <string>

namespace faceshard {

class OpCounter {
 public:
  OpCounter();
  ~OpCounter();
  OpCounter(const OpCounter&) = delete;
  OpCounter& operator=(const OpCounter&) = delete;
  // The operators counted so far, and every dispatcher call seen (views and nested ones too).
  int64_t count() const;
  int64_t dispatched() const;

 private:
  uint64_t handle_ = 0;
  bool was_enabled_ = true;
};

// Whether an operator counts as a launch, by its name and overload ("aten::slice.Tensor";
// cached; exposed for tests).
bool op_counts_as_launch(const std::string& name);

}  // namespace faceshard
