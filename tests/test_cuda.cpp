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
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "app/config/config.h"
#include "app/train/device_readout.h"
#include "app/train/graphed_backbone.h"
#include "app/train/step_recorder.h"
#include "app/train/train_job.h"
#include "app/train/train_step.h"
#include "app/train/training_stream.h"
#include "partial_fc/classifier/partial_fc.h"
#include "partial_fc/classifier/stochastic_round.h"
#include "base/designed_host_sync.h"
#include "partial_fc/distributed/distributed.h"
#include "tests/harness.h"
#include "tests/head_references.h"

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
// bf16 ones to 2e-2), for every head of the catalogue; with sampling (the GPU draws from its
// own generator), the sampled rows hold every positive class, only they move, and the others
// stay bit-identical; with fp32 GEMMs the loss, the embeddings' gradient, the sampled centres'
// gradient and their update are those of the float64 reference (tests/head_references.h, plain
// ops on the CPU) over the columns the GPU sampled, read back from the classifier.
TEST(PartialFCCuda, MatchesCpu) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  auto dist = Distributed::init(DistEnv{});
  const int64_t C = 1003, D = 64, B = 24;
  const torch::Device cuda(torch::kCUDA, 0);
  // Full fp32 GEMMs (no TF32: a train job may have left it on) for the comparison with
  // float64; restored however the test ends.
  struct NoTf32 {
    bool was = at::globalContext().allowTF32CuBLAS();
    NoTf32() { at::globalContext().setAllowTF32CuBLAS(false); }
    ~NoTf32() { at::globalContext().setAllowTF32CuBLAS(was); }
  } no_tf32;
  int referenced = 0;
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
        at::Tensor ref_grad;  // [sampled, d] float64: dL/dW of the sampled rows
        if (dt == at::kFloat) {
          testing::HeadReference ref;
          ref.head = head;
          ref.params = testing::reference_params(head, o.head.params);
          ref.seed = o.seed;  // ElasticFace's draws: the run's seed, forward 0
          const at::Tensor E = emb.to(torch::kDouble).requires_grad_();
          const at::Tensor Wt = row_of(before, "weight").to(torch::kDouble).requires_grad_();
          const at::Tensor rl = ref.loss(E, Wt, labels, index);
          rl.backward();
          ref_grad = Wt.grad().index_select(0, index);
          EXPECT_LE(testing::relative_error(og.loss.cpu().to(torch::kDouble), rl.detach()), 1e-5) << "loss";
          EXPECT_LE(testing::relative_error(eg.grad().cpu().to(torch::kDouble), E.grad()), 5e-5) << "dL/d embeddings";
          EXPECT_LE(testing::relative_error(gpu.gradient().cpu().to(torch::kDouble), ref_grad), 5e-5) << "dL/d centres";
          ++referenced;
        }
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
        if (ref_grad.defined()) {
          // SGD's first step (momentum buffer = d): w -= lr (g + weight_decay w), on the
          // sampled rows; the difference taken in float64 from the fp32 rows.
          const at::Tensor r0 = w0.index_select(0, index).to(torch::kDouble);
          const at::Tensor step = w1.index_select(0, index).to(torch::kDouble) - r0;
          EXPECT_LE(testing::relative_error(step, -0.1 * (ref_grad + o.optimizer.weight_decay * r0)), 1e-4) << "update";
        }
      }
    }
  }
  EXPECT_EQ(referenced, static_cast<int>(head_catalogue().size()));
}

// The classifier on the GPU never waits for the host from its first forward on (no warm-up:
// a head's state made where its rows are, not copied there at its first use): every head of
// the catalogue, buffered and streamed, with and without sampling, two steps of forward,
// backward and the optimiser under LibTorch's sync debug mode as an error.
TEST(PartialFCCuda, FirstStepsWithoutHostSynchronisation) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
#ifdef FACESHARD_WITH_CUDA
  auto dist = Distributed::init(DistEnv{});
  const torch::Device cuda(torch::kCUDA, 0);
  int runs = 0;
  for (const HeadInfo& info : head_catalogue()) {
    for (const bool streamed : {false, true}) {
      for (double rate : {1.0, 0.3}) {
        SCOPED_TRACE(info.name + (streamed ? " streamed" : " buffered") + " rate " + std::to_string(rate));
        PartialFCOptions o;
        o.num_classes = 3001;
        o.embedding_size = 64;
        o.sample_rate = rate;
        o.streamed_logits = streamed;
        o.head.name = info.name;
        for (const HeadParam& p : info.params)
          if (p.flag && rate < 1.0) o.head.params[p.name] = p.default_value != 0 ? 0.0 : 1.0;
        PartialFC fc(*dist, o, cuda);
        torch::manual_seed(14);
        std::vector<at::Tensor> embs, labels;
        for (int k = 0; k < 2; ++k) {
          embs.push_back((torch::randn({48, 64}) * 20).to(cuda).requires_grad_());
          labels.push_back(torch::randint(0, o.num_classes, {48}, torch::kLong));
        }
        std::vector<at::Tensor> losses;
        c10::cuda::device_synchronize();
        c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
        try {
          for (int k = 0; k < 2; ++k) {
            PartialFCOutput out = fc.forward(embs[k], labels[k]);
            out.loss.backward();
            fc.step(0.1);
            losses.push_back(out.loss.detach());
          }
        } catch (const std::exception& e) {
          ADD_FAILURE() << "the classifier synchronised with the device: " << e.what();
        }
        c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
        ASSERT_EQ(losses.size(), 2u);
        for (const at::Tensor& l : losses) EXPECT_TRUE(std::isfinite(l.item<double>()) && l.item<double>() > 0);
        for (const auto& kv : fc.head().state()) EXPECT_TRUE(kv.second.is_cuda()) << kv.first;
        ++runs;
      }
    }
  }
  EXPECT_EQ(runs, 4 + 2 * (static_cast<int>(head_catalogue().size()) - 1));
#endif
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

// bf16 centres on the GPU: the stochastic rounding gives the CPU's bits (NaN of either sign
// and any payload as 0x7fc0, +-inf, values that round up to inf past bf16's largest), and a
// bf16 classifier (streamed) steps on the GPU as on the CPU: the same keys round the same fp32
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
  {
    // fp32 bit patterns: NaNs (quiet, signalling, largest payload; both signs), +-inf,
    // bf16's largest finite (0x7f7f), values above it that round to it or to inf (halfway,
    // fp32's largest), just below it, +-0, subnormals. Each of 40 rows holds them at another
    // offset, so that every value meets many random draws. Compared as bits (a NaN is not
    // equal to itself) against the scalar rounding (sr_round, c10::BFloat16's conversion).
    const std::vector<uint32_t> specials = {
        0x7fc00000U, 0xffc00000U, 0x7f800001U, 0xff800001U, 0x7fffffffU, 0xffffffffU, 0x7fa00000U, 0xffa00000U,
        0x7f800000U, 0xff800000U, 0x7f7f0000U, 0xff7f0000U, 0x7f7f8000U, 0xff7f8000U, 0x7f7fffffU, 0xff7fffffU,
        0x7f7effffU, 0xff7effffU, 0x7f7f0001U, 0x00000000U, 0x80000000U, 0x00000001U, 0x807fffffU, 0x3f800000U};
    const int64_t n = 40, d = static_cast<int64_t>(specials.size());
    at::Tensor bits = torch::empty({n, d}, torch::kInt);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t e = 0; e < d; ++e)
        bits.data_ptr<int32_t>()[i * d + e] = static_cast<int32_t>(specials[static_cast<size_t>((e + i) % d)]);
    const at::Tensor x = bits.view(torch::kFloat);
    const float* xv = x.data_ptr<float>();
    const at::Tensor cls = torch::arange(n, torch::kLong) * 7919 + (int64_t(1) << 35);
    const at::Tensor on_cpu = stochastic_round_bf16(x, sr_row_keys(9, 4, cls)).view(torch::kShort);
    const at::Tensor on_gpu = stochastic_round_bf16(x.to(cuda), sr_row_keys(9, 4, cls.to(cuda))).cpu().view(torch::kShort);
    EXPECT_TRUE(torch::equal(on_gpu, on_cpu));
    int64_t differ = 0, nan = 0, to_inf = 0, to_max = 0;
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t key = sr_row_key(9, 4, cls[i].item<int64_t>());
      for (int64_t e = 0; e < d; ++e) {
        const uint32_t b = specials[static_cast<size_t>((e + i) % d)];
        const float v = xv[i * d + e];
        const uint16_t want = sr_round(v, sr_bits(key, static_cast<uint32_t>(e))).x;
        const auto got = static_cast<uint16_t>(on_gpu[i][e].item<int16_t>());
        differ += got != want;
        if (std::isnan(v)) nan += got == 0x7fc0;
        if (b == 0x7f7f8000U) {
          to_inf += got == 0x7f80;
          to_max += got == 0x7f7f;
        }
      }
    }
    EXPECT_EQ(differ, 0) << "elements whose bits differ from sr_round's";
    EXPECT_EQ(nan, n * 8) << "NaNs not rounded to 0x7fc0";
    // Halfway between bf16's largest and inf: each side with probability 1/2.
    EXPECT_GT(to_inf, 0);
    EXPECT_GT(to_max, 0);
    EXPECT_EQ(to_inf + to_max, n);
  }
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
// and delivered as the loop does. bf16 (auto), for every head of the catalogue (the sampled
// runs with the head's yes/no parameters turned over: ElasticFace+, MagFace's margin
// everywhere), with the logits buffered and streamed, with and without sampling.
TEST(TrainStepCuda, StepsWithoutHostSynchronisation) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
#ifdef FACESHARD_WITH_CUDA
  DistEnv env;
  env.master_port = 20000 + static_cast<int>((::getpid() + 7) % 20000);
  DistOptions o;
  o.use_cuda = true;
  auto dist = Distributed::init(env, o);
  ASSERT_GE(head_catalogue().size(), 9u);
  int runs = 0;
  for (const HeadInfo& info : head_catalogue()) {
    for (const char* logits : {"buffer", "streamed"}) {
      for (const char* rate : {"1.0", "0.5"}) {
        // Every combination for the first head; for the others, buffered at rate 1.0 with
        // their default flags and streamed at 0.5 with their flags turned over (the check's
        // first call has about 200 s for every GPU test).
        const bool first = &info == &head_catalogue().front();
        if (!first && (std::string(logits) == "buffer") != (std::string(rate) == "1.0")) continue;
        const bool flip = std::string(rate) != "1.0";
        std::string head_yaml = "\n  head: " + info.name, flags;
        for (const HeadParam& p : info.params)
          if (p.flag) flags += "\n    " + p.name + ": " + ((p.default_value != 0) != flip ? "true" : "false");
        if (!flags.empty()) head_yaml += "\n  " + info.name + ":" + flags;
        SCOPED_TRACE("head " + info.name + (flip && !flags.empty() ? " (flags turned over)" : "") + ", loss.logits " +
                     logits + ", sample rate " + rate);
        const std::string yaml = std::string("output: ") + ::testing::TempDir() + "/nosync\nseed: 3\n" +
                                 "data:\n  rec: synthetic\n  num_classes: 2000\n  batch_size: 64\n  num_workers: 2\n" +
                                 "model:\n  backbone: mbf\n" + "loss:\n  sample_rate: " + rate + "\n  logits: " + logits +
                                 head_yaml + "\noptim:\n  total_steps: 100\n" +
                                 "train:\n  verify_every: 0\n  tensorboard: false\ndist:\n  device: cuda\n";
        const Config cfg = load_config_text(yaml, "nosync.yaml");
        TrainJob job = build_train_job(cfg, dist);
        ASSERT_EQ(job.fc->head().name(), info.name);
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
        EXPECT_EQ(losses.size(), 4u);
        for (double l : losses) EXPECT_TRUE(std::isfinite(l) && l > 0) << l;
        ++runs;
      }
    }
  }
  EXPECT_EQ(runs, 4 + 2 * (static_cast<int>(head_catalogue().size()) - 1));
  dist->shutdown();
#endif
}

#ifdef FACESHARD_WITH_CUDA
// cuDNN deterministic and its benchmark off for a test's life: the eager steps and the
// replayed ones then choose the same algorithms, and an eager rerun measures what is left of
// the run-to-run spread (the atomics of scatter_add and index_add).
class DeterministicCudnn {
 public:
  DeterministicCudnn()
      : det_(at::globalContext().deterministicCuDNN()), bench_(at::globalContext().benchmarkCuDNN()) {
    at::globalContext().setDeterministicCuDNN(true);
    at::globalContext().setBenchmarkCuDNN(false);
  }
  ~DeterministicCudnn() {
    at::globalContext().setDeterministicCuDNN(det_);
    at::globalContext().setBenchmarkCuDNN(bench_);
  }

 private:
  bool det_, bench_;
};

// `optim` and `train`: more keys of those sections, each line "  key: value\n".
std::string graphed_yaml(const std::string& name, const std::string& optim = "", const std::string& train = "") {
  return std::string("output: ") + ::testing::TempDir() + "/" + name + "\nseed: 3\n" +
         "data:\n  rec: synthetic\n  num_classes: 2000\n  batch_size: 64\n  num_workers: 2\n" +
         "model:\n  backbone: mbf\n" + "loss:\n  sample_rate: 0.5\n" + "optim:\n  total_steps: 100\n" + optim +
         "train:\n  verify_every: 0\n  tensorboard: false\n  cudnn_benchmark: false\n" + train +
         "dist:\n  device: cuda\n";
}

// Wraps a recorder; its capture of piece `broken` makes a host synchronisation inside the
// capture (an .item()), which invalidates it, as a network with a hidden sync would.
class SyncInCapture : public StepRecorder {
 public:
  SyncInCapture(std::unique_ptr<StepRecorder> inner, int broken) : inner_(std::move(inner)), broken_(broken) {}
  void warm_up(const std::function<void()>& work, int times) override { inner_->warm_up(work, times); }
  void capture(int k, const std::function<void()>& work) override {
    if (k != broken_) return inner_->capture(k, work);
    inner_->capture(k, [&] {
      work();
      (void)torch::ones({1}, torch::kCUDA).item<float>();
    });
  }
  void replay(int k) override { inner_->replay(k); }
  void settle() override { inner_->settle(); }
  c10::Stream stream() const override { return inner_->stream(); }
  std::string describe() const override { return inner_->describe(); }

 private:
  std::unique_ptr<StepRecorder> inner_;
  int broken_;
};

int64_t reserved_bytes(torch::Device device) {
  return c10::cuda::CUDACachingAllocator::getDeviceStats(device.index())
      .reserved_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)]
      .current;
}
#endif

// train.cuda_graph on a GPU: the backbone's forward and backward captured and replayed (mbf,
// batch 64, sampling 0.5), against the eager step of the same job from the same start on the
// same batches, in bf16 (fp32 where the card has no bf16), in fp16 with loss scaling, and with
// gradient accumulation 2. The graphs replayed every micro-batch (no eager call); the job's
// gradient accumulators run on its training stream, a non-default one; the replayed steps
// make no host synchronisation; the losses agree, and each parameter tensor's update over 6
// steps agrees with the eager update within 4 times what separates two eager runs (plus 1e-3).
TEST(GraphedBackboneCuda, StepsMatchEagerWithoutHostSync) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
#ifdef FACESHARD_WITH_CUDA
  DeterministicCudnn deterministic;
  DistEnv env;
  env.master_port = 20000 + static_cast<int>((::getpid() + 11) % 20000);
  DistOptions o;
  o.use_cuda = true;
  auto dist = Distributed::init(env, o);
  // Each variant's designed host synchronisations (designed_host_sync.h), once a step each:
  // exempt from the sync-debug mode's error, and the whole list -- a new one fails here.
  const std::set<std::string> scaler = {"loss scaler: found_inf to the host, for the ranks' one skip decision",
                                        "loss scaler: the skip decision and the new scale"};
  const struct {
    const char* name;
    const char* optim;
    const char* train;
    int micro;
    std::set<std::string> designed_syncs;
  } variants[] = {
      {"auto precision", "", "", 1, {}},
      {"fp16, loss scaling", "", "  precision: fp16\n  loss_scaling: 'on'\n", 1, scaler},
      {"gradient accumulation 2", "  grad_accumulation: 2\n", "", 2,
       {"classifier: the distinct rows of the accumulated micro-batches"}},
  };
  for (const auto& v : variants) {
    SCOPED_TRACE(v.name);
    const std::string yaml = graphed_yaml("graphed", v.optim, v.train);
    const Config cfg = load_config_text(yaml, "graphed.yaml");
    const int steps = 6;
    std::vector<Batch> batches;
    {
      TrainJob job = build_train_job(cfg, dist);
      job.loader->start_epoch(0, 0);
      for (int k = 0; k < steps * v.micro; ++k) {
        Batch b = *job.loader->next();
        b.images = b.images.clone();
        b.labels = b.labels.clone();
        batches.push_back(std::move(b));
      }
    }
    struct Run {
      std::vector<double> losses;
      std::vector<at::Tensor> updates;
    };
    auto train = [&](bool graphed, bool check_sync) {
      TrainJob job = build_train_job(cfg, dist);
      EXPECT_NE(c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED, job.stream->stream()),
                c10::cuda::getDefaultCUDAStream(job.device.index()))
          << "the job runs on the default stream";
      EXPECT_EQ(accumulator_stream_mismatch(job.backbone_params, job.stream->stream()), "");
      job.backbone->train();
      std::vector<at::Tensor> before;
      for (const auto& p : job.backbone->parameters()) before.push_back(p.detach().to(torch::kCPU, torch::kDouble));
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
      for (int64_t k = 0; k < steps; ++k) {
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
      if (g) {
        EXPECT_TRUE(g->captured()) << g->eager_reason();
        EXPECT_EQ(g->replays(), steps * v.micro) << "forward replays";
        EXPECT_EQ(g->eager_calls(), 0);
      }
      Run r;
      for (const at::Tensor& l : losses) r.losses.push_back(l.item<double>());
      size_t i = 0;
      for (const auto& p : job.backbone->parameters())
        r.updates.push_back(p.detach().to(torch::kCPU, torch::kDouble) - before.at(i++));
      return r;
    };
    const Run eager = train(false, false), rerun = train(false, false);
    reset_designed_host_syncs();
    const Run graphed = train(true, true);
    std::set<std::string> passed;
    for (const auto& [what, count] : designed_host_syncs()) {
      passed.insert(what);
      EXPECT_EQ(count, steps) << what;
    }
    EXPECT_EQ(passed, v.designed_syncs) << "the step's host synchronisations made on purpose";
    ASSERT_EQ(eager.losses.size(), size_t(steps));
    ASSERT_EQ(rerun.losses.size(), size_t(steps));
    ASSERT_EQ(graphed.losses.size(), size_t(steps));
    for (int k = 0; k < steps; ++k)
      EXPECT_NEAR(graphed.losses[k], eager.losses[k], 1e-3 * eager.losses[k] + 4 * std::abs(rerun.losses[k] - eager.losses[k]))
          << "step " << k;
    ASSERT_EQ(graphed.updates.size(), eager.updates.size());
    for (size_t i = 0; i < eager.updates.size(); ++i) {
      if (eager.updates[i].abs().max().item<double>() == 0) continue;  // a parameter that did not move
      const double spread = testing::relative_error(rerun.updates[i], eager.updates[i]);
      EXPECT_LE(testing::relative_error(graphed.updates[i], eager.updates[i]), 4 * spread + 1e-3)
          << "parameter tensor " << i << "'s update over " << steps << " steps (eager rerun: " << spread << ")";
    }
  }
  dist->shutdown();
#endif
}

// A capture broken by a host synchronisation (in the forward's capture, and in the backward's)
// leaves the steps eager, with the reason, and the device memory flat: the caching allocator
// does not go on believing a capture is under way (which would defer the release of every
// batch the loader recorded on the training stream), and the graphs' pool is given back. The
// memory reserved after 30 eager steps with the loader's batches is within two batches of
// what it was after 5.
TEST(GraphedBackboneCuda, FailedCaptureKeepsMemoryFlat) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
#ifdef FACESHARD_WITH_CUDA
  DistEnv env;
  env.master_port = 20000 + static_cast<int>((::getpid() + 13) % 20000);
  DistOptions o;
  o.use_cuda = true;
  auto dist = Distributed::init(env, o);
  const Config cfg = load_config_text(graphed_yaml("graphed_fail"), "graphed_fail.yaml");
  for (int broken : {0, 1}) {
    SCOPED_TRACE(broken == 0 ? "the forward's capture broken" : "the backward's capture broken");
    TrainJob job = build_train_job(cfg, dist);
    job.backbone->train();
    job.loader->start_epoch(0, 0);
    TrainStep step(job);
    auto g = std::make_shared<GraphedBackbone>(
        job.backbone, job.backbone_params,
        std::make_unique<SyncInCapture>(make_cuda_graph_recorder(job.device), broken), capture_agreement(*dist));
    step.set_backbone_run([g](const at::Tensor& images) { return g->forward(images); });
    BatchSource next = [&] { return *job.loader->next(); };
    int64_t after5 = 0;
    const int64_t batch_bytes = 64 * 3 * 112 * 112 * 4;
    for (int64_t k = 0; k < 30; ++k) {
      step.run(next, k);
      if (k == 4) {
        c10::cuda::device_synchronize();
        after5 = reserved_bytes(job.device);
      }
    }
    c10::cuda::device_synchronize();
    const int64_t after30 = reserved_bytes(job.device);
    EXPECT_FALSE(g->captured());
    EXPECT_EQ(g->eager_reason().rfind("the capture failed: ", 0), 0u) << g->eager_reason();
    EXPECT_EQ(g->replays(), 0);
    EXPECT_LE(after30 - after5, 2 * batch_bytes)
        << "reserved after 5 steps " << after5 << " B, after 30 " << after30 << " B";
  }
  dist->shutdown();
#endif
}

}  // namespace
}  // namespace faceshard
