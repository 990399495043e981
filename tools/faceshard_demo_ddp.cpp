// faceshard-demo-ddp: the seed experiment on summed versus averaged gradients, on W ranks:
//   tools/launch.sh --nproc 2 -- build/bin/faceshard-demo-ddp
// A Linear(2,3); rank r feeds one sample x_r and the loss (out * onehot(r)).sum(). The
// gradient of weight row r is x_r on rank r and zero elsewhere. DataParallel-style
// reduction SUMS the replicas' gradients (row r = x_r, as one process holding the whole
// batch with one summed loss); DistributedDataParallel AVERAGES them (row r = x_r / W, the
// gradient of the mean of the per-rank losses). Both are printed and checked.
#include <iomanip>
#include <sstream>

#include "partial_fc/data_parallel/ddp.h"
#include "partial_fc/distributed/dist_env.h"
#include "base/error.h"
#include "base/log.h"

using namespace faceshard;

static std::string rows(const at::Tensor& t) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(4);
  for (int64_t i = 0; i < t.size(0); ++i) {
    os << (i ? " " : "") << "[";
    for (int64_t j = 0; j < t.size(1); ++j) os << (j ? ", " : "") << t[i][j].item<float>();
    os << "]";
  }
  return os.str();
}

int main(int, char**) {
  return run_main("faceshard-demo-ddp", [] {
    auto dist = Distributed::init(DistEnv::from_environment());
    const int W = dist->world_size(), r = dist->rank();
    if (W > 3) throw usage_error("Linear(2,3) has 3 outputs: run it on 1 to 3 ranks");
    torch::manual_seed(0);
    torch::nn::Linear model(2, 3);
    torch::manual_seed(100 + r);
    at::Tensor x = torch::rand({1, 2});
    at::Tensor label = torch::zeros({1, 3});
    label[0][r] = 1;
    at::Tensor all_x = dist->all_gather(x);

    // DataParallel-style: per-replica gradients are summed.
    (model(x) * label).sum().backward();
    at::Tensor summed = model->weight.grad().clone();
    dist->all_reduce(summed);
    model->zero_grad();

    // DistributedDataParallel: gradients are averaged.
    DataParallel ddp(model.ptr(), *dist, DdpOptions{});
    at::Tensor loss = (model(x) * label).sum();
    ddp.prepare_for_backward({loss});
    loss.backward();
    at::Tensor averaged = model->weight.grad().clone();

    at::Tensor expect_sum = torch::zeros({3, 2});
    expect_sum.narrow(0, 0, W).copy_(all_x);
    log_info("inputs x_r (one per rank): ", rows(all_x));
    log_info("summed   (DataParallel) weight.grad: ", rows(summed));
    log_info("averaged (DDP)          weight.grad: ", rows(averaged));
    if (!torch::allclose(summed, expect_sum) || !torch::allclose(averaged, expect_sum / W))
      throw runtime_error("gradients differ from the closed form (row r = x_r summed, x_r / W averaged)");
    log_info("checked: summed row r = x_r; averaged row r = x_r / ", W);
    dist->shutdown();
    return 0;
  });
}
