// Stochastic rounding of fp32 classifier rows to bf16 storage (optim.fc_weight_dtype bf16).
// A value v between two neighbouring bf16 numbers lo < v < hi is stored as hi with
// probability (v - lo) / (hi - lo) and as lo otherwise, so that E[stored] = v: an update far
// smaller than a bf16 ulp of its centre still moves the centre on average, where round to
// nearest would drop it every time. Implemented on the bit pattern: a uniform 16-bit number
// is added to the fp32 bits and the low 16 bits are cut (bf16 is the upper half of fp32).
//
// The random bits come from a counter-based hash keyed by (seed, step, global class id,
// element), never from a generator's stream: a class's rounding is the same whichever rank
// holds it and however many ranks there are (the elastic invariance), and a resumed run
// rounds as the uninterrupted one. The same hash runs in tensor operations (any device) and
// in the CPU's one-pass row update (row_update_cpu.h); both give the same bits.
#pragma once
#include <cstdint>
#include <cstring>

#include <c10/util/BFloat16.h>
#include <torch/torch.h>

#include "partial_fc/classifier/sr_hash.h"

namespace faceshard {

// The key of one row's rounding at one step.
inline uint32_t sr_row_key(uint64_t seed, int64_t step, int64_t global_class) {
  return sr_detail::row_key(seed, step, global_class);
}

// The 16 random bits of element `element` of a row keyed `row_key`.
inline uint32_t sr_bits(uint32_t row_key, uint32_t element) { return sr_detail::element_bits(row_key, element); }

// v rounded to bf16 with the random bits r (0..65535); inf and NaN round to nearest.
inline c10::BFloat16 sr_round(float v, uint32_t r) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  if ((bits & 0x7f800000U) == 0x7f800000U) return c10::BFloat16(v);
  bits = (bits + r) & 0xffff0000U;
  return c10::BFloat16(static_cast<uint16_t>(bits >> 16), c10::BFloat16::from_bits());
}

// Row keys [n] (int64 holding uint32 values) of global classes `classes` [n] (int64, any
// device) at `step`: sr_row_key in tensor operations.
at::Tensor sr_row_keys(uint64_t seed, int64_t step, const at::Tensor& classes);

// rows [n, d] fp32 stochastically rounded to bf16 with the keys of sr_row_keys: element k
// of row i uses sr_bits(keys[i], k). On the rows' device, no host synchronisation.
at::Tensor stochastic_round_bf16(const at::Tensor& rows, const at::Tensor& keys);

// How a classifier's bf16 rows are written back after an update: the keys' seed and step,
// and the global class of local row 0 (the shard's first class).
struct RowRounding {
  uint64_t seed = 0;
  int64_t step = 0;
  int64_t class_start = 0;
  // Round to nearest instead (optim.fc_weight_rounding nearest: the control that loses every
  // update smaller than half a bf16 step).
  bool nearest = false;
  // Where set: [2] int64 on the rows' device, += (values whose fp32 update moved them but
  // whose stored bf16 did not change, values whose fp32 update moved them).
  at::Tensor lost = {};
  // rows [n, d] fp32 of local rows `index` [n] (or, undefined, [first, first + n)) rounded
  // for storage in `dtype`: stochastically (or to nearest) for bf16, unchanged for fp32.
  at::Tensor round(const at::Tensor& rows, const at::Tensor& index, int64_t first, at::ScalarType dtype) const;
  // Counts into `lost` what storing `stored` (bf16) over `old` (bf16, the rows before the
  // update) for the updated fp32 `rows` did; nothing without `lost`.
  void count(const at::Tensor& old, const at::Tensor& rows, const at::Tensor& stored) const;
};

}  // namespace faceshard
