// DataParallel and SyncBatchNorm against one process that sees the whole batch:
// W ranks x B samples must train exactly like 1 process x W*B samples. The GlooCuda cases run
// the same bodies at world 2 with both ranks on cuda:0 over Gloo (SyncBatchNorm's CUDA path,
// DDP's buckets and flat buffers on the GPU) against the same CPU references.
#include <gtest/gtest.h>

#include "app/train/backbone_optimizer.h"
#include "app/train/sync_bn.h"
#include "models/norm_layer.h"
#include "partial_fc/data_parallel/ddp.h"
#include "partial_fc/data_parallel/sync_batch_norm.h"
#include "tests/harness.h"

namespace faceshard {
namespace {

namespace nn = torch::nn;

// A small conv net with batch norm in 2-d and 1-d form.
struct NetImpl : nn::Module {
  nn::Conv2d c1{nullptr}, c2{nullptr};
  NormLayer n1{nullptr}, n2{nullptr}, n3{nullptr};
  nn::Linear fc{nullptr};
  NetImpl() {
    c1 = register_module("c1", nn::Conv2d(nn::Conv2dOptions(3, 6, 3).padding(1).bias(false)));
    n1 = register_module("n1", NormLayer(6));
    c2 = register_module("c2", nn::Conv2d(nn::Conv2dOptions(6, 8, 3).stride(2).padding(1)));
    n2 = register_module("n2", NormLayer(8));
    fc = register_module("fc", nn::Linear(8 * 4 * 4, 5));
    n3 = register_module("n3", NormLayer(5));
  }
  at::Tensor forward(at::Tensor x) {
    x = torch::relu(n1(c1(x)));
    x = torch::relu(n2(c2(x)));
    return n3(fc(x.flatten(1)));
  }
};
TORCH_MODULE(Net);

// Step k's batch of rank r (the same on every process that asks).
std::pair<at::Tensor, at::Tensor> batch(int k, int r, int64_t rows) {
  torch::manual_seed(1000 * k + r);
  return {torch::randn({rows, 3, 8, 8}), torch::randint(0, 5, {rows}, torch::kLong)};
}

// The device of a case: cuda:0 for every rank of a GlooCuda case (one GPU shared), else the CPU.
torch::Device device_of(bool cuda) { return cuda ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU); }

// fp32 on a GPU means fp32: TF32 would round the convolutions' and GEMMs' inputs to 10 bits.
void fp32_on_gpu(bool cuda) {
  if (!cuda) return;
  at::globalContext().setAllowTF32CuBLAS(false);
  at::globalContext().setAllowTF32CuDNN(false);
}

// Tolerance of a GPU case against the CPU references: fp32 against the CPU's float64
// SyncBatchNorm and other summation orders (cuDNN, cuBLAS, ATen's Welford statistics), which
// BatchNorm's backward amplifies (docs/distributed.md: fp32 SyncBatchNorm alone puts 1e-5
// between ranks counts) and five SGD steps with momentum carry on. A wrong reduction, a
// missing synchronisation or gradient averaging by the wrong W is off by 1e-2 or more.
constexpr double kCudaTolerance = 1e-4;

torch::optim::SGD make_sgd(nn::Module& m) {
  return torch::optim::SGD(m.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(5e-4));
}

// Batch index of micro-batch `part` of step k (of `parts`).
int batch_index(int k, int part, int parts) { return parts == 1 ? k : 10 * k + part; }

// The reference: one process on the whole batch, K steps of torch's SGD; step k's batch is
// every rank's micro-batches concatenated.
template <typename M>
void train_whole_batch(M& ref, int W, int K, int parts, int64_t B) {
  auto ref_opt = make_sgd(ref);
  for (int k = 0; k < K; ++k) {
    std::vector<at::Tensor> xs, ys;
    for (int q = 0; q < W; ++q)
      for (int part = 0; part < parts; ++part) {
        auto [x, y] = batch(batch_index(k, part, parts), q, B);
        xs.push_back(x);
        ys.push_back(y);
      }
    ref_opt.zero_grad();
    torch::nn::functional::cross_entropy(ref.forward(torch::cat(xs)), torch::cat(ys)).backward();
    ref_opt.step();
  }
}

struct DdpCase {
  int world;
  bool cuda = false;
};

class DdpEquivalence : public ::testing::TestWithParam<DdpCase> {};

TEST_P(DdpEquivalence, FiveSgdStepsWithSyncBatchNormMatchOneProcess) {
  const int W = GetParam().world;
  const bool cuda = GetParam().cuda;
  if (cuda && !torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const int64_t B = 4;
  const int K = 5;
  const double tol = cuda ? kCudaTolerance : 1e-5;
  testing::run_ranks(W, [&](Distributed& d) {
    const torch::Device dev = device_of(cuda);
    fp32_on_gpu(cuda);
    // Reference: one process, the concatenated batches, plain batch norm.
    torch::manual_seed(7);
    Net ref;
    train_whole_batch(*ref, W, K, /*parts=*/1, B);
    // Distributed: every rank starts from a different init (rank 0's is broadcast).
    torch::manual_seed(d.rank() == 0 ? 7 : 99 + d.rank());
    Net net;
    EXPECT_EQ(convert_sync_batchnorm(*net, d), 3);
    net->to(dev);
    DataParallel ddp(net.ptr(), d, DdpOptions{0.001});
    EXPECT_GT(ddp.num_buckets(), 1);
    auto opt = make_sgd(*net);
    for (int k = 0; k < K; ++k) {
      auto [x, y] = batch(k, d.rank(), B);
      opt.zero_grad();
      at::Tensor out = net(x.to(dev));
      at::Tensor loss = torch::nn::functional::cross_entropy(out, y.to(dev));  // per-rank mean
      ddp.prepare_for_backward({loss});
      loss.backward();
      opt.step();
    }
    auto rp = ref->named_parameters();
    for (auto& p : net->named_parameters()) {
      EXPECT_EQ(p.value().device(), dev) << p.key();
      EXPECT_LE(testing::relative_error(p.value().cpu(), rp[p.key()]), tol) << p.key();
    }
    auto rb = ref->named_buffers();
    for (auto& b : net->named_buffers()) {
      if (b.value().scalar_type() == torch::kLong) {
        EXPECT_TRUE(torch::equal(b.value().cpu(), rb[b.key()])) << b.key();
      } else {
        EXPECT_LE(testing::relative_error(b.value().cpu(), rb[b.key()]), tol) << b.key();
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(World, DdpEquivalence, ::testing::Values(DdpCase{1}, DdpCase{2}, DdpCase{3}),
                         [](const auto& info) { return "W" + std::to_string(info.param.world); });
INSTANTIATE_TEST_SUITE_P(GlooCuda, DdpEquivalence, ::testing::Values(DdpCase{2, true}),
                         [](const auto& info) { return "W" + std::to_string(info.param.world); });

// Without batch norm: a linear model, to test accumulation in isolation.
struct MlpImpl : nn::Module {
  nn::Linear a{nullptr}, b{nullptr}, unused{nullptr};
  bool use_unused = false;
  MlpImpl() {
    a = register_module("a", nn::Linear(6, 16));
    b = register_module("b", nn::Linear(16, 3));
    unused = register_module("unused", nn::Linear(16, 3));
  }
  at::Tensor forward(at::Tensor x) {
    at::Tensor h = torch::tanh(a(x));
    return use_unused ? unused(h) : b(h);
  }
};
TORCH_MODULE(Mlp);

TEST(DdpAccumulation, TwoMicroBatchesEqualOneDoubleBatch) {
  for (int W : {2, 3}) {
    testing::run_ranks(W, [](Distributed& d) {
      const int W = d.world_size();
      auto data = [](int r, int part) {
        torch::manual_seed(50 + 10 * r + part);
        return std::make_pair(torch::randn({3, 6}), torch::randn({3, 3}));
      };
      torch::manual_seed(3);
      Mlp ref;
      auto ref_opt = make_sgd(*ref);
      std::vector<at::Tensor> xs, ys;
      for (int q = 0; q < W; ++q)
        for (int part = 0; part < 2; ++part) {
          xs.push_back(data(q, part).first);
          ys.push_back(data(q, part).second);
        }
      torch::nn::functional::mse_loss(ref(torch::cat(xs)), torch::cat(ys)).backward();
      ref_opt.step();

      torch::manual_seed(3);
      Mlp net;
      DataParallel ddp(net.ptr(), d, DdpOptions{0.0001, true});
      auto opt = make_sgd(*net);
      for (int part = 0; part < 2; ++part) {
        auto [x, y] = data(d.rank(), part);
        at::Tensor loss = torch::nn::functional::mse_loss(net(x), y) / 2;  // mean over the 2 micro-batches
        ddp.prepare_for_backward({loss});
        if (part == 0) {
          auto guard = ddp.no_sync();
          loss.backward();
        } else {
          loss.backward();
        }
      }
      opt.step();
      auto rp = ref->named_parameters();
      for (auto& p : net->named_parameters()) EXPECT_LE(testing::relative_error(p.value(), rp[p.key()]), 1e-5) << p.key();
    });
  }
}

// A conv and a linear layer, no batch statistics (micro-batches then sum to the batch).
struct ConvFcImpl : nn::Module {
  nn::Conv2d c1{nullptr};
  nn::Linear fc{nullptr};
  ConvFcImpl() {
    c1 = register_module("c1", nn::Conv2d(nn::Conv2dOptions(3, 6, 3).padding(1)));
    fc = register_module("fc", nn::Linear(6 * 8 * 8, 5));
  }
  at::Tensor forward(at::Tensor x) { return fc(torch::relu(c1(x)).flatten(1)); }
};
TORCH_MODULE(ConvFc);

// Over flat buffers: the buckets are DataParallel's own, ranges of the gradient buffer that
// are all-reduced in place; with the fused optimiser and two micro-batches a step trains as
// one process on the whole batch does with torch's SGD.
void flat_buckets_train_as_one_process(int world, bool cuda) {
  testing::run_ranks(world, [cuda](Distributed& d) {
    const torch::Device dev = device_of(cuda);
    fp32_on_gpu(cuda);
    const double tol = cuda ? kCudaTolerance : 1e-5;
    const int W = d.world_size();
    const int64_t B = 4;
    const int K = 3;
    torch::manual_seed(7);
    ConvFc ref;
    train_whole_batch(*ref, W, K, /*parts=*/2, B);
    // Every rank starts from a different init (rank 0's is broadcast); the conv weight is
    // channels-last, as a backbone's are on a GPU.
    torch::manual_seed(d.rank() == 0 ? 7 : 99 + d.rank());
    ConvFc net;
    net->to(dev);
    net->c1->weight.set_data(net->c1->weight.detach().contiguous(at::MemoryFormat::ChannelsLast));
    std::vector<at::Tensor> params;
    for (auto& p : net->parameters()) params.push_back(p);
    FlatParameters flat(params, 0.0005);
    DdpOptions o{0.0005};
    o.flat = &flat;
    DataParallel ddp(net.ptr(), d, o);
    {
      ConvFc other;
      other->to(dev);
      DataParallel plain(other.ptr(), d, DdpOptions{0.0005});
      EXPECT_EQ(ddp.bucket_assignment(), plain.bucket_assignment());
    }
    EXPECT_GT(ddp.num_buckets(), 1);
    BackboneOptimizerOptions bo;
    bo.momentum = 0.9;
    bo.weight_decay = 5e-4;
    BackboneOptimizer opt(flat, bo);
    const void* grads = flat.groups().at(0).grads.data_ptr();
    for (int k = 0; k < K; ++k) {
      for (int part = 0; part < 2; ++part) {
        auto [x, y] = batch(batch_index(k, part, 2), d.rank(), B);
        at::Tensor loss = torch::nn::functional::cross_entropy(net(x.to(dev)), y.to(dev)) / 2;
        ddp.prepare_for_backward({loss});
        if (part == 0) {
          auto local_only = ddp.no_sync();
          loss.backward();
        } else {
          loss.backward();
        }
      }
      // The averaged gradients are where the buckets were all-reduced.
      for (auto& p : net->parameters()) EXPECT_EQ(p.grad().storage().data_ptr().get(), grads);
      opt.step(0.1);
      opt.zero_grad();
    }
    EXPECT_TRUE(net->c1->weight.is_contiguous(at::MemoryFormat::ChannelsLast));
    auto rp = ref->named_parameters();
    for (auto& p : net->named_parameters()) {
      EXPECT_EQ(p.value().device(), dev) << p.key();
      EXPECT_LE(testing::relative_error(p.value().cpu(), rp[p.key()]), tol) << p.key();
    }
    // ...and they moved from where they started.
    torch::manual_seed(7);
    ConvFc start;
    for (auto& p : start->named_parameters())
      EXPECT_GT(testing::relative_error(p.value(), rp[p.key()]), 1e-3) << p.key();
  });
}

TEST(DdpFlat, BucketsAreRangesOfTheGradientBufferAndTrainAsOneProcess) {
  for (int W : {2, 3}) flat_buckets_train_as_one_process(W, false);
}

TEST(DdpFlatGlooCuda, BucketsAreRangesOfTheGradientBufferAndTrainAsOneProcess) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  flat_buckets_train_as_one_process(2, true);
}

// Moving a module out of its flat buffers after they are made is caught at the next step,
// not trained on silently.
TEST(DdpFlat, AModuleMovedOutOfItsBuffersIsCaught) {
  ConvFc net;
  std::vector<at::Tensor> params;
  for (auto& p : net->parameters()) params.push_back(p);
  FlatParameters flat(params, 25);
  BackboneOptimizer opt(flat, BackboneOptimizerOptions{});
  opt.step(0.1);
  net->to(torch::kDouble);
  try {
    opt.step(0.1);
    ADD_FAILURE() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("flat buffer"), std::string::npos) << e.what();
  }
  // A gradient replaced by another tensor is put back as the buffer's view by zero_grad().
  ConvFc net2;
  std::vector<at::Tensor> p2;
  for (auto& p : net2->parameters()) p2.push_back(p);
  FlatParameters flat2(p2, 25);
  net2->fc->weight.mutable_grad() = torch::ones_like(net2->fc->weight);
  flat2.zero_grad();
  EXPECT_EQ(net2->fc->weight.grad().storage().data_ptr().get(), flat2.groups()[0].grads.storage().data_ptr().get());
  EXPECT_EQ(net2->fc->weight.grad().abs().sum().item<float>(), 0.0f);
}

TEST(DdpUnusedParameters, FoundWithTheOptionAndNamedWithoutIt) {
  testing::run_ranks(2, [](Distributed& d) {
    Mlp net;
    {
      DataParallel ddp(net.ptr(), d, DdpOptions{0.0001, true});
      at::Tensor loss = net(torch::randn({2, 6})).sum();
      ddp.prepare_for_backward({loss});
      loss.backward();  // must not hang
      EXPECT_TRUE(net->b->weight.grad().defined());
      EXPECT_FALSE(net->unused->weight.grad().defined());
    }
    net->zero_grad();
    {
      DataParallel ddp(net.ptr(), d, DdpOptions{0.0001, false});
      at::Tensor loss = net(torch::randn({2, 6})).sum();
      ddp.prepare_for_backward({loss});
      try {
        loss.backward();
        ADD_FAILURE() << "expected an error for the unused parameter";
      } catch (const std::exception& e) {
        std::string msg = e.what();
        EXPECT_NE(msg.find("'unused."), std::string::npos) << msg;
        EXPECT_NE(msg.find("find_unused_parameters"), std::string::npos) << msg;
      }
    }
  });
}

TEST(DdpOverlap, BucketsLaunchBeforeBackwardEnds) {
  testing::run_ranks(2, [](Distributed& d) {
    torch::manual_seed(1);
    nn::Sequential net;
    for (int i = 0; i < 8; ++i) {
      net->push_back(nn::Linear(128, 128));
      net->push_back(nn::Functional(torch::tanh));
    }
    DataParallel ddp(net.ptr(), d, DdpOptions{0.1});  // ~1.5 layers per bucket
    EXPECT_GE(ddp.num_buckets(), 4);
    // Bucket 0 holds the last layer's parameters: backward produces them first.
    EXPECT_EQ(ddp.bucket_assignment()[0][0], static_cast<int>(net->parameters().size()) - 1);
    at::Tensor loss = net->forward(torch::randn({64, 128})).pow(2).mean();
    ddp.prepare_for_backward({loss});
    loss.backward();
    const auto& st = ddp.last_step();
    EXPECT_EQ(static_cast<int>(st.launch_ms.size()), ddp.num_buckets());
    EXPECT_GE(st.launched_during_backward, ddp.num_buckets() - 1) << "buckets should start while backward runs";
  });
}

// SyncBatchNorm alone: forward, input and weight gradients and running statistics equal
// BatchNorm on the concatenated batch; uneven batches and a rank with zero rows.
struct BnCase {
  int world;
  int mode;  // 0 equal, 1 uneven, 2 rank 1 empty
  bool two_d;
  bool cuda = false;  // ATen's CUDA kernels, every rank on cuda:0
};

class SyncBatchNormCase : public ::testing::TestWithParam<BnCase> {};

int64_t bn_rows(const BnCase& c, int q) {
  if (c.mode == 0) return 4;
  if (c.mode == 2 && q == 1) return 0;
  return q + 2;
}

TEST_P(SyncBatchNormCase, MatchesBatchNormOnConcatenatedBatch) {
  const BnCase c = GetParam();
  if (c.cuda && !torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  testing::run_ranks(c.world, [c](Distributed& d) {
    const torch::Device dev = device_of(c.cuda);
    // fp32 kernels on the GPU against the fp32 reference on the CPU: both round, in other
    // orders; the CPU path computes in float64.
    const double rtol = c.cuda ? kCudaTolerance : 1e-5, atol = c.cuda ? kCudaTolerance : 1e-5;
    const int W = d.world_size();
    const int64_t C = 3;
    auto shape = [&](int64_t n) { return c.two_d ? std::vector<int64_t>{n, C, 5, 4} : std::vector<int64_t>{n, C}; };
    std::vector<at::Tensor> xs, gs;
    for (int q = 0; q < W; ++q) {
      torch::manual_seed(10 + q);
      xs.push_back(torch::randn(shape(bn_rows(c, q))) * 2 + 1);
      gs.push_back(torch::randn(shape(bn_rows(c, q))));  // d loss / d output
    }
    torch::manual_seed(5);
    at::Tensor w0 = torch::rand({C}) + 0.5, b0 = torch::randn({C});
    // Reference
    at::Tensor X = torch::cat(xs).requires_grad_();
    at::Tensor rw = w0.clone().requires_grad_(), rb = b0.clone().requires_grad_();
    at::Tensor rm = torch::zeros({C}), rv = torch::ones({C});
    at::Tensor Y = torch::batch_norm(X, rw, rb, rm, rv, true, 0.1, 1e-5, false);
    (Y * torch::cat(gs)).sum().backward();
    // Distributed
    SyncBatchNorm sbn(C, d);
    {
      torch::NoGradGuard ng;
      sbn->weight.copy_(w0);
      sbn->bias.copy_(b0);
    }
    sbn->to(dev);
    at::Tensor x = xs[d.rank()].clone().to(dev).requires_grad_();
    at::Tensor y = sbn(x);
    EXPECT_EQ(y.device(), dev);
    (y * gs[d.rank()].to(dev)).sum().backward();
    int64_t off = 0;
    for (int q = 0; q < d.rank(); ++q) off += bn_rows(c, q);
    const int64_t n = bn_rows(c, d.rank());
    EXPECT_TRUE(torch::allclose(y.cpu(), Y.narrow(0, off, n), rtol, atol));
    EXPECT_TRUE(torch::allclose(x.grad().cpu(), X.grad().narrow(0, off, n), rtol, atol));
    at::Tensor gw = sbn->weight.grad().clone(), gb = sbn->bias.grad().clone();
    d.all_reduce(gw);  // what DDP sums (and then divides by W)
    d.all_reduce(gb);
    EXPECT_TRUE(torch::allclose(gw.cpu(), rw.grad(), c.cuda ? kCudaTolerance : 1e-4, atol)) << gw << rw.grad();
    EXPECT_TRUE(torch::allclose(gb.cpu(), rb.grad(), c.cuda ? kCudaTolerance : 1e-4, atol));
    EXPECT_TRUE(torch::allclose(sbn->running_mean.cpu(), rm, rtol, c.cuda ? kCudaTolerance : 1e-6));
    EXPECT_TRUE(torch::allclose(sbn->running_var.cpu(), rv, rtol, c.cuda ? kCudaTolerance : 1e-6));
    EXPECT_EQ(sbn->num_batches_tracked.item<int64_t>(), 1);
    // Eval: running statistics, local only (a collective here would hang the rank with zero rows? no:
    // each rank evaluates independently, so ranks may even call it a different number of times).
    sbn->eval();
    if (d.rank() == 0) {
      at::Tensor e = sbn(xs[0].to(dev));
      at::Tensor ref_e = torch::batch_norm(xs[0], w0, b0, rm, rv, false, 0.1, 1e-5, false);
      EXPECT_TRUE(torch::allclose(e.cpu(), ref_e, rtol, atol));
    }
  });
}

std::string bn_case_name(const BnCase& c) {
  const char* rows[] = {"equal_rows", "uneven_rows", "rank1_empty"};
  return "W" + std::to_string(c.world) + "_" + rows[c.mode] + (c.two_d ? "_4d" : "_2d");
}

INSTANTIATE_TEST_SUITE_P(Cases, SyncBatchNormCase,
                         ::testing::Values(BnCase{1, 0, true}, BnCase{2, 0, true}, BnCase{3, 0, true}, BnCase{2, 1, true},
                                           BnCase{3, 1, false}, BnCase{3, 2, true}, BnCase{2, 2, false}),
                         [](const auto& info) { return bn_case_name(info.param); });
INSTANTIATE_TEST_SUITE_P(GlooCuda, SyncBatchNormCase,
                         ::testing::Values(BnCase{2, 0, true, true}, BnCase{2, 1, true, true},
                                           BnCase{2, 2, false, true}, BnCase{2, 2, true, true}),
                         [](const auto& info) { return bn_case_name(info.param); });

}  // namespace
}  // namespace faceshard
