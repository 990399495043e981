// faceshard-demo-gather: the seed experiment on gathering with gradients, on 2 ranks:
//   tools/launch.sh --nproc 2 -- build/bin/faceshard-demo-gather
// x = ones(2,2) on rank 0, zeros(2,2) on rank 1; y = x + 2; z = y*y; gather z;
// r = z_0 * z_1; out = mean(r); backward. Prints y.grad for both backward modes, and what
// happens with a plain gather that carries no gradient.
#include <sstream>

#include "partial_fc/data_parallel/all_gather.h"
#include "partial_fc/distributed/dist_env.h"
#include "base/error.h"
#include "base/log.h"

using namespace faceshard;

static std::string show(const at::Tensor& t) {
  std::ostringstream os;
  auto a = t.contiguous();
  os << "[[" << a[0][0].item<float>() << ", " << a[0][1].item<float>() << "], [" << a[1][0].item<float>() << ", "
     << a[1][1].item<float>() << "]]";
  return os.str();
}

int main(int, char**) {
  return run_main("faceshard-demo-gather", [] {
    setenv("FACESHARD_LOG_ALL_RANKS", "1", 0);
    auto dist = Distributed::init(DistEnv::from_environment());
    if (dist->world_size() != 2) throw usage_error("run it on 2 ranks: tools/launch.sh --nproc 2 -- ", "faceshard-demo-gather");
    const int r = dist->rank();
    for (auto mode : {GatherGrad::OwnSlice, GatherGrad::ReduceScatterSum}) {
      at::Tensor x = (r == 0 ? torch::ones({2, 2}) : torch::zeros({2, 2})).requires_grad_();
      at::Tensor y = x + 2;
      y.retain_grad();
      at::Tensor z = y * y;
      at::Tensor g = all_gather_with_grad(*dist, z, mode);
      at::Tensor out = (g.narrow(0, 0, 2) * g.narrow(0, 2, 2)).mean();
      out.backward();
      log_info(mode == GatherGrad::OwnSlice ? "own-slice backward     " : "reduce-scatter backward", ": y.grad = ",
               show(y.grad()), "  (seed: ", mode == GatherGrad::OwnSlice ? (r == 0 ? "6" : "9") : (r == 0 ? "12" : "18"),
               ")");
      dist->barrier();
    }
    // A plain all_gather returns values only: nothing connects `out` to y.
    at::Tensor y = (r == 0 ? torch::ones({2, 2}) : torch::zeros({2, 2})).requires_grad_() + 2;
    at::Tensor g = dist->all_gather((y * y).detach());
    at::Tensor out = (g.narrow(0, 0, 2) * g.narrow(0, 2, 2)).mean();
    if (!out.requires_grad())
      log_info("plain all_gather: out has no gradient path to y (out.requires_grad() == false), so backward has "
               "nothing to differentiate; all_gather_with_grad provides that path");
    dist->shutdown();
    return 0;
  });
}
