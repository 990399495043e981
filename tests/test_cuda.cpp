// The CUDA paths against the CPU ones. Each test skips without a GPU; tools/gpu_check.sh
// runs every test whose name holds "Cuda" on a GPU machine (NCCL, world 1).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <unistd.h>

#include <cmath>
#include <map>
#include <set>

#ifdef FACESHARD_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#include "app/config/config.h"
#include "app/train/device_readout.h"
#include "app/train/graphed_backbone.h"
#include "app/train/step_recorder.h"
#include "app/train/train_job.h"
#include "app/train/train_step.h"
#include "partial_fc/classifier/partial_fc.h"
#include "partial_fc/classifier/stochastic_round.h"
#include "partial_fc/runtime/distributed.h"
#include "tests/harness.h"

namespace faceshard {
namespace {

bool have_cuda() { return torch::cuda::is_available() && nccl_compiled(); }

// The NCCL backend as Distributed makes it (make_nccl_backend), at world 1: every collective
// the runtime uses gives its input back, on the device, in the input's dtype.
TEST(DistributedCuda, NcclCollectivesAtWorldOne) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto nccl = make_nccl_backend(store, 0, 1, 0, std::chrono::seconds(60));
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16, at::kHalf, at::kLong}) {
    SCOPED_TRACE(c10::toString(dt));
    const at::Tensor x = (torch::randn({5, 7}) * 100).to(dt).to(torch::kCUDA);
    for (c10d::ReduceOp::RedOpType op : {c10d::ReduceOp::SUM, c10d::ReduceOp::MAX, c10d::ReduceOp::MIN}) {
      std::vector<at::Tensor> v{x.clone()};
      c10d::AllreduceOptions o;
      o.reduceOp = op;
      nccl->allreduce(v, o)->wait();
      EXPECT_TRUE(v[0].is_cuda());
      EXPECT_TRUE(torch::equal(v[0].cpu(), x.cpu()));
    }
    {
      std::vector<at::Tensor> v{x.clone()};
      nccl->broadcast(v)->wait();
      EXPECT_TRUE(torch::equal(v[0].cpu(), x.cpu()));
    }
    {
      at::Tensor out = torch::empty_like(x);
      at::Tensor in = x.clone();
      nccl->_allgather_base(out, in)->wait();
      EXPECT_TRUE(torch::equal(out.cpu(), x.cpu()));
    }
    if (dt != at::kLong) {
      at::Tensor out = torch::empty_like(x);
      at::Tensor in = x.clone();
      nccl->_reduce_scatter_base(out, in)->wait();
      EXPECT_TRUE(torch::equal(out.cpu(), x.cpu()));
    }
  }
  nccl->barrier()->wait();
}

// Distributed at world 1 with use_cuda: its store, Gloo and the NCCL communicator come up,
// and every primitive gives CUDA tensors back where they were.
TEST(DistributedCuda, RuntimeAtWorldOneWithNccl) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  DistEnv env;
  env.master_port = 20000 + static_cast<int>(::getpid() % 20000);
  DistOptions o;
  o.use_cuda = true;
  auto dist = Distributed::init(env, o);
  EXPECT_TRUE(dist->has_nccl());
  const at::Tensor x = torch::randn({6, 3}, torch::kCUDA);
  at::Tensor y = x.clone();
  dist->all_reduce(y, ReduceOp::Max);
  dist->broadcast(y);
  EXPECT_TRUE(torch::equal(y, x));
  std::vector<int64_t> counts;
  const at::Tensor g = dist->all_gather(x, &counts);
  EXPECT_TRUE(g.is_cuda());
  EXPECT_EQ(counts, std::vector<int64_t>{6});
  EXPECT_TRUE(torch::equal(g, x));
  EXPECT_TRUE(torch::equal(dist->reduce_scatter(x, {6}), x));
  dist->barrier();
  dist->shutdown();
}

at::Tensor row_of(const ShardRows& rows, const std::string& name) {
  for (const auto& [k, v] : rows)
    if (k == name) return v;
  ADD_FAILURE() << "no '" << name << "' in the shard's state";
  return {};
}

// The sharded classifier on the GPU computes what it computes on the CPU: without sampling,
// loss, embedding gradient, weight gradient and the updated rows agree (fp32 GEMMs to 1e-5,
// bf16 ones to 2e-2), for every head of the catalogue; with sampling (the GPU draws from its own generator), the sampled
// rows hold every positive class, only they move, and the others stay bit-identical.
TEST(PartialFCCuda, MatchesCpu) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  auto dist = Distributed::init(DistEnv{});
  const int64_t C = 1003, D = 64, B = 24;
  const torch::Device cuda(torch::kCUDA, 0);
  for (const HeadInfo& info : head_catalogue()) {
    const std::string head = info.name;
    for (double rate : {1.0, 0.3}) {
      for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
        SCOPED_TRACE(head + " rate " + std::to_string(rate) + " " + c10::toString(dt));
        torch::manual_seed(11);
        PartialFCOptions o;
        o.num_classes = C;
        o.embedding_size = D;
        o.sample_rate = rate;
        o.gemm_dtype = dt;
        o.head.name = head;
        PartialFC cpu(*dist, o), gpu(*dist, o, cuda);
        const ShardRows before = cpu.state();
        gpu.fill_state([&](const std::string& name, const at::Tensor& rows) { rows.copy_(row_of(before, name)); });
        const at::Tensor emb = torch::randn({B, D});
        const at::Tensor labels = torch::randint(0, C, {B}, torch::kLong);
        at::Tensor ec = emb.clone().requires_grad_(), eg = emb.to(cuda).requires_grad_();
        PartialFCOutput oc = cpu.forward(ec, labels), og = gpu.forward(eg, labels);
        oc.loss.backward();
        og.loss.backward();
        ASSERT_TRUE(og.loss.is_cuda());
        ASSERT_TRUE(std::isfinite(og.loss.item<double>()));
        const double tol = dt == at::kFloat ? 1e-5 : 2e-2;
        if (rate == 1.0) {
          EXPECT_LE(testing::relative_error(og.loss.cpu(), oc.loss), tol);
          EXPECT_LE(testing::relative_error(eg.grad().cpu(), ec.grad()), tol);
          EXPECT_LE(testing::relative_error(gpu.gradient().cpu(), cpu.gradient()), tol);
          cpu.step(0.1);
          gpu.step(0.1);
          EXPECT_LE(testing::relative_error(gpu.weight().cpu(), cpu.weight()), tol);
          EXPECT_GT(testing::relative_error(gpu.weight().cpu(), row_of(before, "weight")), 1e-7) << "nothing moved";
          continue;
        }
        const at::Tensor index = gpu.sampled_index().cpu();
        ASSERT_EQ(index.numel(), gpu.num_sample());
        const std::set<int64_t> sampled(index.data_ptr<int64_t>(), index.data_ptr<int64_t>() + index.numel());
        EXPECT_EQ(int64_t(sampled.size()), gpu.num_sample()) << "sampled rows repeat";
        EXPECT_TRUE(torch::equal(index, std::get<0>(index.sort())));
        for (int64_t i = 0; i < B; ++i) EXPECT_TRUE(sampled.count(labels[i].item<int64_t>())) << "positive " << i;
        gpu.step(0.1);
        const at::Tensor w0 = row_of(before, "weight"), w1 = gpu.weight().cpu();
        int64_t moved = 0, still = 0;
        for (int64_t r = 0; r < C; ++r) {
          const bool same = torch::equal(w0[r], w1[r]);
          if (sampled.count(r)) moved += !same;
          else still += same;
        }
        EXPECT_EQ(moved, int64_t(sampled.size()));
        EXPECT_EQ(still, C - int64_t(sampled.size()));
      }
    }
  }
}


// loss.logits streamed on the GPU, with the GEMMs in fp32 and in bf16 (as under autocast):
// the loss, the gradients and the step of the buffered pass on the GPU, for every head, with
// and without sampling; the step the backward applies itself (arm_step) equals the step
// taken after it.
TEST(PartialFCCuda, StreamedEqualsBuffered) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  auto dist = Distributed::init(DistEnv{});
  const int64_t C = 3001, D = 64, B = 48;
  const torch::Device cuda(torch::kCUDA, 0);
  for (const HeadInfo& info : head_catalogue()) {
    for (double rate : {1.0, 0.3}) {
      for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
        SCOPED_TRACE(info.name + " rate " + std::to_string(rate) + " " + c10::toString(dt));
        torch::manual_seed(12);
        PartialFCOptions o;
        o.num_classes = C;
        o.embedding_size = D;
        o.sample_rate = rate;
        o.gemm_dtype = dt;
        o.head.name = info.name;
        o.update_chunk_rows = 512;  // several chunks
        PartialFCOptions os = o;
        os.streamed_logits = true;
        PartialFC buffered(*dist, o, cuda), streamed(*dist, os, cuda), armed(*dist, os, cuda);
        const at::Tensor emb = torch::randn({B, D}).to(cuda);
        const at::Tensor labels = torch::randint(0, C, {B}, torch::kLong);
        at::Tensor eb = emb.clone().requires_grad_(), es = emb.clone().requires_grad_(), ea = emb.clone().requires_grad_();
        armed.arm_step(0.1);
        PartialFCOutput ob = buffered.forward(eb, labels), os_ = streamed.forward(es, labels),
                        oa = armed.forward(ea, labels);
        ob.loss.backward();
        os_.loss.backward();
        oa.loss.backward();
        const double tol = dt == at::kFloat ? 1e-4 : 2e-2;
        EXPECT_LE(testing::relative_error(os_.loss.cpu(), ob.loss.cpu()), dt == at::kFloat ? 1e-5 : 1e-3);
        EXPECT_LE(testing::relative_error(es.grad().cpu(), eb.grad().cpu()), tol);
        EXPECT_LE(testing::relative_error(streamed.gradient().cpu(), buffered.gradient().cpu()), tol);
        buffered.step(0.1);
        streamed.step(0.1);
        armed.step(0.1);
        EXPECT_LE(testing::relative_error(streamed.weight().cpu(), buffered.weight().cpu()), tol);
        EXPECT_LE(testing::relative_error(armed.weight().cpu(), streamed.weight().cpu()), 1e-6);
        EXPECT_TRUE(torch::equal(ea.grad().cpu(), es.grad().cpu()));
      }
    }
  }
}

// bf16 centres on the GPU: the stochastic rounding gives the CPU's bits, and a bf16
// classifier (streamed) steps on the GPU as on the CPU: the same keys round the same fp32
// updates alike, except a rare value whose fp32 update differs by rounding across a threshold.
TEST(StochasticRoundCuda, SameBitsAsTheCpu) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  const torch::Device cuda(torch::kCUDA, 0);
  torch::manual_seed(13);
  const at::Tensor rows = torch::randn({300, 257}) * 0.01;
  const at::Tensor classes = torch::randint(0, int64_t(1) << 40, {300}, torch::kLong);
  const at::Tensor cpu = stochastic_round_bf16(rows, sr_row_keys(5, 77, classes));
  const at::Tensor gpu = stochastic_round_bf16(rows.to(cuda), sr_row_keys(5, 77, classes.to(cuda)));
  EXPECT_TRUE(torch::equal(gpu.cpu(), cpu));
  auto dist = Distributed::init(DistEnv{});
  PartialFCOptions o;
  o.num_classes = 2003;
  o.embedding_size = 64;
  o.weight_dtype = at::kBFloat16;
  o.optimizer.state_dtype = at::kBFloat16;
  o.streamed_logits = true;
  o.update_chunk_rows = 256;
  o.optimizer.fused_cpu_rows = false;  // the CPU takes the GPU's path
  PartialFC c(*dist, o), g(*dist, o, cuda);
  const at::Tensor w0 = c.weight().clone();
  EXPECT_TRUE(torch::equal(g.weight().cpu(), c.weight()));
  for (int step = 0; step < 3; ++step) {
    const at::Tensor emb = torch::randn({32, 64});
    const at::Tensor labels = torch::randint(0, 2003, {32}, torch::kLong);
    c.arm_step(0.5);
    g.arm_step(0.5);
    c.forward(emb, labels).loss.backward();
    g.forward(emb.to(cuda), labels).loss.backward();
    c.step(0.5);
    g.step(0.5);
  }
  EXPECT_EQ(g.weight().scalar_type(), at::kBFloat16);
  EXPECT_GE((g.weight().cpu() == c.weight()).to(at::kDouble).mean().item<double>(), 0.999);
  EXPECT_GE((c.weight() != w0).to(at::kDouble).mean().item<double>(), 0.5) << "the centres hardly moved";
}

// The training step on a GPU never waits for the device: CUDA's synchronising calls are
// made errors (LibTorch's sync debug mode) while steps run after two warm-up steps (cuDNN's
// algorithm search may synchronise), with the loader's batches, and a log readout posted
// and delivered as the loop does. bf16 (auto), with the logits buffered and streamed, with
// and without sampling.
TEST(TrainStepCuda, StepsWithoutHostSynchronisation) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
#ifdef FACESHARD_WITH_CUDA
  DistEnv env;
  env.master_port = 20000 + static_cast<int>((::getpid() + 7) % 20000);
  DistOptions o;
  o.use_cuda = true;
  auto dist = Distributed::init(env, o);
  for (const char* logits : {"buffer", "streamed"}) {
    for (const char* rate : {"1.0", "0.5"}) {
      SCOPED_TRACE(std::string("loss.logits ") + logits + ", sample rate " + rate);
      const std::string yaml = std::string("output: ") + ::testing::TempDir() + "/nosync\nseed: 3\n" +
                               "data:\n  rec: synthetic\n  num_classes: 2000\n  batch_size: 64\n  num_workers: 2\n" +
                               "model:\n  backbone: mbf\n" + "loss:\n  sample_rate: " + rate + "\n  logits: " + logits +
                               "\noptim:\n  total_steps: 100\n" +
                               "train:\n  verify_every: 0\n  tensorboard: false\ndist:\n  device: cuda\n";
      const Config cfg = load_config_text(yaml, "nosync.yaml");
      TrainJob job = build_train_job(cfg, dist);
      ASSERT_EQ(job.cfg.train.precision, device_has_bf16(job.device) ? "bf16" : "fp32");
      ASSERT_FALSE(job.loss_scaling);
      job.backbone->train();
      job.loader->start_epoch(0, 0);
      BatchSource next = [&] { return *job.loader->next(); };
      TrainStep step(job);
      DeviceReadout readout;
      std::vector<double> losses;
      for (int64_t k = 0; k < 2; ++k) step.run(next, k);
      c10::cuda::device_synchronize();
      c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
      try {
        for (int64_t k = 2; k < 6; ++k) {
          StepResult r = step.run(next, k);
          readout.post({r.loss, r.accuracy, step.first_nonfinite_marker()},
                       [&](const std::vector<double>& v) { losses.push_back(v[0]); });
          readout.deliver(/*wait=*/false);
        }
      } catch (const std::exception& e) {
        ADD_FAILURE() << "the step synchronised with the device: " << e.what();
      }
      c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
      readout.deliver(/*wait=*/true);
      ASSERT_EQ(losses.size(), 4u);
      for (double l : losses) EXPECT_TRUE(std::isfinite(l) && l > 0) << l;
    }
  }
  dist->shutdown();
#endif
}

// train.cuda_graph on a GPU: the backbone's forward and backward captured and replayed
// (mbf, bf16, batch 64, sampling), against the eager step of the same job from the same start
// on the same batches: the losses of 6 steps and the parameters after them agree to the
// run-to-run spread of cuDNN's kernels; the replayed steps make no host synchronisation.
TEST(GraphedBackboneCuda, StepsMatchEagerWithoutHostSync) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
#ifdef FACESHARD_WITH_CUDA
  DistEnv env;
  env.master_port = 20000 + static_cast<int>((::getpid() + 11) % 20000);
  DistOptions o;
  o.use_cuda = true;
  auto dist = Distributed::init(env, o);
  const std::string yaml = std::string("output: ") + ::testing::TempDir() + "/graphed\nseed: 3\n" +
                           "data:\n  rec: synthetic\n  num_classes: 2000\n  batch_size: 64\n  num_workers: 2\n" +
                           "model:\n  backbone: mbf\n" + "loss:\n  sample_rate: 0.5\n" +
                           "optim:\n  total_steps: 100\n" +
                           "train:\n  verify_every: 0\n  tensorboard: false\ndist:\n  device: cuda\n";
  const Config cfg = load_config_text(yaml, "graphed.yaml");
  std::vector<Batch> batches;
  {
    TrainJob job = build_train_job(cfg, dist);
    job.loader->start_epoch(0, 0);
    for (int k = 0; k < 6; ++k) {
      Batch b = *job.loader->next();
      b.images = b.images.clone();
      b.labels = b.labels.clone();
      batches.push_back(std::move(b));
    }
  }
  struct Run {
    std::vector<double> losses;
    std::vector<at::Tensor> params;
  };
  auto train = [&](bool graphed, bool check_sync) {
    TrainJob job = build_train_job(cfg, dist);
    job.backbone->train();
    TrainStep step(job);
    std::shared_ptr<GraphedBackbone> g;
    if (graphed) {
      g = std::make_shared<GraphedBackbone>(job.backbone, job.backbone_params, make_cuda_graph_recorder(job.device),
                                            capture_agreement(*dist));
      step.set_backbone_run([g](const at::Tensor& images) { return g->forward(images); });
    }
    size_t next_batch = 0;
    BatchSource next = [&] { return batches.at(next_batch++); };
    std::vector<at::Tensor> losses;
    for (int64_t k = 0; k < 6; ++k) {
      if (k == 2) {
        c10::cuda::device_synchronize();
        if (check_sync) c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
      }
      try {
        losses.push_back(step.run(next, k).loss);
      } catch (const std::exception& e) {
        c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
        ADD_FAILURE() << "step " << k << ": " << e.what();
        return Run{};
      }
    }
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
    if (g) EXPECT_TRUE(g->captured()) << g->eager_reason();
    Run r;
    for (const at::Tensor& l : losses) r.losses.push_back(l.item<double>());
    for (const auto& p : job.backbone->parameters()) r.params.push_back(p.detach().to(torch::kCPU, torch::kDouble));
    return r;
  };
  const Run eager = train(false, false), graphed = train(true, true);
  ASSERT_EQ(eager.losses.size(), 6u);
  ASSERT_EQ(graphed.losses.size(), 6u);
  for (size_t k = 0; k < 6; ++k) EXPECT_NEAR(graphed.losses[k], eager.losses[k], 2e-3 * eager.losses[k]) << "step " << k;
  ASSERT_EQ(graphed.params.size(), eager.params.size());
  double worst = 0;
  for (size_t i = 0; i < eager.params.size(); ++i)
    worst = std::max(worst, testing::relative_error(graphed.params[i], eager.params[i]));
  EXPECT_LT(worst, 2e-2) << "the backbone's parameters after 6 steps";
  dist->shutdown();
#endif
}

}  // namespace
}  // namespace faceshard
