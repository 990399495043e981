// Sub-centre classes (loss.subcenters K, Sub-center ArcFace: Deng et al., ECCV 2020): each
// class has K centres, and a sample's cosine to the class is the best of its K cosines; the
// head's margin then applies to that class cosine, as to a single centre's. The shard stores
// them class-major: local class c's sub-centre k is row c * K + k of the weight (and of every
// optimiser state), so a class's K rows are one contiguous run on the class's rank, a sampled
// class brings all of them, and a checkpoint's rows reshard K at a time.
// The margin softmax passes (margin_softmax.h, streamed_softmax.h) call these for K > 1
// only; with K = 1 nothing here runs. The max routes the gradient to the arg-max sub-centre
// alone (as autograd's max does): a class column's dL/dcos goes to the row of the sub-centre
// that gave the row its cosine, the other K - 1 rows of that class get nothing from it.
#pragma once
#include <cstdint>

#include <torch/torch.h>

#include "partial_fc/classifier/margin_softmax.h"

namespace faceshard::subcenter {

// The rows of sorted local classes [n] (any integer tensor): [n * K] int64, c * K + k.
at::Tensor class_rows(const at::Tensor& classes, int64_t K);

// cos [N, n * K] (the cosines of n classes' rows, class-major) -> out [N, n] the best of
// each class's K, and arg [N, n] (uint8) which sub-centre it was (the first of equals).
void reduce_max(const at::Tensor& cos, int64_t K, at::Tensor out, at::Tensor arg);

// g [N, n] per class and arg [N, n] -> [N, n * K]: g at the arg-max sub-centre's row, 0 at
// the class's other rows.
at::Tensor spread(const at::Tensor& g, const at::Tensor& arg, int64_t K);

// The buffered pass: the scaled class cosines s * max_k cos of every (sampled) class into
// buf [N, S] (S classes, S * K rows of `w`, through o.rows when sampled), arg [N, S] uint8
// and 1 / max(||w_r||, eps) of each row [S * K]. Reads o.chunk_classes rows at a time.
at::Tensor class_cosines(const at::Tensor& e, const at::Tensor& w, const MarginSoftmaxOptions& o, double s,
                         at::Tensor& buf, at::Tensor& arg);

// The buffered pass's backward from g [N, S] = dL/dcos per class (the head's gradient and
// the loss's scalar applied): dL/dE = sum over classes of g spread to its rows times
// W_r / ||w_r||, and the deferred weight gradient (DeferredWeightGrad's G' for any run of
// rows, recomputed from g, arg and inv_norm: no [N, S * K] buffer exists). With `deferred`
// unset the weight's gradient [S * K, d] is returned as well.
std::pair<at::Tensor, at::Tensor> backward(const at::Tensor& g, const at::Tensor& arg, const at::Tensor& e,
                                           const at::Tensor& w, const at::Tensor& inv_norm,
                                           const MarginSoftmaxOptions& o);

// Columns [first, first + n) of G' in rows (K per class) made from a function of classes
// `classes(c, m)` -> [N, m * K] (rows c * K .. (c + m) * K): the classes that cover the rows,
// narrowed to them.
template <typename ClassColumns>
at::Tensor row_columns(int64_t first, int64_t n, int64_t K, const ClassColumns& classes) {
  const int64_t c0 = first / K, c1 = (first + n - 1) / K + 1;
  at::Tensor g = classes(c0, c1 - c0);
  return g.narrow(1, first - c0 * K, n);
}

}  // namespace faceshard::subcenter
