// loss.logits: streamed against buffered. The streamed pass (streamed_softmax.h) never
// holds the [N, S] logits; it must compute what the buffered one does (margin_softmax.h,
// itself checked against float64 references in test_partial_fc and test_margin_heads): the
// loss, the accuracy, dL/dE, dL/dW and the step, for every head, on 1 to 4 ranks with uneven
// batches and shards, with and without sampling, in both arcface_torch compatibility modes,
// with several chunks per pass; and the step the backward applies itself (arm_step) equals
// the step taken afterwards.
#include <gtest/gtest.h>

#include <algorithm>
#include <iostream>
#include <sstream>

#include "app/plan/allocation_meter.h"
#include "partial_fc/classifier/head_catalogue.h"
#include "partial_fc/classifier/partial_fc.h"
#include "tests/classifier_batches.h"
#include "tests/harness.h"

namespace faceshard {
namespace {

namespace F = torch::nn::functional;

int64_t rows_of(int r) { return 5 + (r % 3); }  // uneven batches across ranks

using Batch = testing::ClassBatch;
Batch make_batch(int W, int r, int64_t C, int64_t D, int salt) {
  return testing::class_batch(W, r, C, D, PartialFC::initial_rows(0, C, D, PartialFCOptions{}.seed), 4100 + 37 * salt,
                              rows_of, -0.7, 2.4);
}

double max_abs(const at::Tensor& a, const at::Tensor& b) { return (a - b).abs().max().item<double>(); }

struct Case {
  std::string head;  // a catalogue name, or "arcface_torch" / "arcface_torch_all" (combined)
  int world;
  double rate;
  bool bf16 = false;  // bf16 centres in both
};

class StreamedSoftmax : public ::testing::TestWithParam<Case> {};

TEST_P(StreamedSoftmax, EqualsTheBufferedPass) {
  const Case c = GetParam();
  const auto results = testing::spawn_ranks(c.world, [c](Distributed& d) {
    const int64_t C = 1003, D = 16;
    PartialFCOptions o;
    o.num_classes = C;
    o.embedding_size = D;
    o.sample_rate = c.rate;
    o.update_chunk_rows = 96;  // several chunks per shard, the last one short
    o.optimizer = ShardOptimizerOptions{"sgd", 0.9, 5e-4};
    if (c.bf16) o.weight_dtype = at::kBFloat16;
    if (c.head.rfind("arcface_torch", 0) == 0) {
      o.margin = CombinedMargin{1.0, 0.5, 0.0};
      o.margin.mode = MarginMode::ArcfaceTorch;
      o.margin.interclass_filter = 0.1;
      o.step_all_rows = c.head == "arcface_torch_all";
    } else {
      o.head.name = c.head;
      const HeadInfo* info = find_head_info(c.head);
      ASSERT_NE(info, nullptr) << c.head;
      for (const HeadParam& p : info->params)
        if (p.name == "plus") o.head.params["plus"] = 1;  // the target cosines' all-reduce
    }
    PartialFCOptions os = o;
    os.streamed_logits = true;
    PartialFC buffered(d, o), streamed(d, os), armed(d, os);
    double worst_loss = 0, worst_emb = 0, worst_w = 0, worst_step = 0, worst_armed = 0;
    for (int k = 0; k < 3; ++k) {
      const Batch b = make_batch(d.world_size(), d.rank(), C, D, k);
      const at::Tensor labels = b.labels.narrow(0, b.offset, b.rows);
      at::Tensor eb = b.emb.narrow(0, b.offset, b.rows).clone().requires_grad_();
      at::Tensor es = eb.detach().clone().requires_grad_(), ea = eb.detach().clone().requires_grad_();
      const double lr = 0.3;
      armed.arm_step(lr);
      auto ob = buffered.forward(eb, labels), os_ = streamed.forward(es, labels), oa = armed.forward(ea, labels);
      ob.loss.backward();
      os_.loss.backward();
      oa.loss.backward();
      const std::string at = c.head + " W" + std::to_string(d.world_size()) + " rate " + std::to_string(c.rate) +
                             " forward " + std::to_string(k);
      // The gradients to 1e-4: a row whose target probability is near 1 has the gradient
      // p - 1 there, which carries fp32's rounding of the softmax denominator (the streamed
      // pass sums it chunk by chunk, rescaled to the growing max) amplified by 1 / (1 - p):
      // 7e-5 in the arcface_torch case below. Each pass against float64 is checked to
      // 1e-5-5e-5 in test_partial_fc and test_margin_heads.
      const double gtol = 1e-4;
      EXPECT_LE(testing::relative_error(os_.loss, ob.loss), 1e-5) << at;
      EXPECT_EQ(os_.accuracy.item<double>(), ob.accuracy.item<double>()) << at;
      EXPECT_LE(testing::relative_error(es.grad(), eb.grad()), gtol) << at;
      EXPECT_TRUE(torch::equal(oa.loss, os_.loss) && torch::equal(ea.grad(), es.grad())) << at;
      if (buffered.samples()) {
        EXPECT_TRUE(torch::equal(buffered.sampled_index(), streamed.sampled_index())) << at;
      }
      const at::Tensor gb = buffered.gradient(), gs = streamed.gradient();
      EXPECT_LE(testing::relative_error(gs, gb), gtol) << at;
      worst_loss = std::max(worst_loss, max_abs(os_.loss, ob.loss));
      worst_emb = std::max(worst_emb, max_abs(es.grad(), eb.grad()));
      worst_w = std::max(worst_w, max_abs(gs, gb));
      buffered.step(lr);
      streamed.step(lr);
      armed.step(lr);
      // bf16 centres: the steps' fp32 values differ by rounding, and a value that lands on
      // the other side of its rounding threshold differs by one bf16 step.
      const double tol = c.bf16 ? 1e-2 : gtol;
      EXPECT_LE(testing::relative_error(streamed.weight().to(at::kFloat), buffered.weight().to(at::kFloat)), tol) << at;
      EXPECT_LE(testing::relative_error(armed.weight().to(at::kFloat), streamed.weight().to(at::kFloat)), tol) << at;
      if (c.bf16) {
        EXPECT_GE((streamed.weight() == buffered.weight()).to(at::kDouble).mean().item<double>(), 0.999) << at;
      }
      worst_step = std::max(worst_step, max_abs(streamed.weight().to(at::kFloat), buffered.weight().to(at::kFloat)));
      worst_armed = std::max(worst_armed, max_abs(armed.weight().to(at::kFloat), streamed.weight().to(at::kFloat)));
      // The head's state advances alike.
      for (size_t i = 0; i < buffered.head().state().size(); ++i)
        EXPECT_LE(testing::relative_error(streamed.head().state()[i].second, buffered.head().state()[i].second), 1e-5)
            << at << " " << buffered.head().state()[i].first;
    }
    if (d.rank() == 0)
      std::cout << "streamed vs buffered, " << c.head << (c.bf16 ? " (bf16 centres)" : "") << ", W" << d.world_size()
                << ", rate " << c.rate << ": largest |difference| loss " << worst_loss << ", dL/dE " << worst_emb
                << ", dL/dW " << worst_w << ", weights after the step " << worst_step << ", armed step vs step "
                << worst_armed << "\n";
  });
  for (const std::string& f : testing::rank_failures(results)) ADD_FAILURE() << f;
  // Rank 0's largest differences, for the record.
  std::istringstream lines(results.at(0).output);
  for (std::string line; std::getline(lines, line);)
    if (line.rfind("streamed vs", 0) == 0) std::cout << line << "\n";
}

std::vector<Case> cases() {
  std::vector<Case> out;
  int i = 0;
  for (const HeadInfo& h : head_catalogue()) {
    // Every head on 1..4 ranks (each head on two rank counts, in turn), with and without
    // sampling.
    out.push_back({h.name, 1 + (i % 4), 1.0});
    out.push_back({h.name, 1 + ((i + 2) % 4), 0.35});
    ++i;
  }
  // ArcFace on every rank count, both ways (those not made above).
  for (int w : {1, 2, 3, 4})
    for (double rate : {1.0, 0.35})
      if (std::none_of(out.begin(), out.end(), [&](const Case& k) { return k.head == "arcface" && k.world == w && k.rate == rate; }))
        out.push_back({"arcface", w, rate});
  out.push_back({"arcface_torch", 2, 1.0});

  out.push_back({"arcface_torch_all", 3, 0.35});
  out.push_back({"arcface", 3, 0.35, true});
  out.push_back({"curricularface", 2, 1.0, true});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Heads, StreamedSoftmax, ::testing::ValuesIn(cases()), [](const auto& info) {
  std::string rate = info.param.rate < 1 ? "sampled" : "full";
  return info.param.head + "_W" + std::to_string(info.param.world) + "_" + rate + (info.param.bf16 ? "_bf16" : "");
});

// The streamed pass keeps no per-pair memory: the classifier's tensors at its peak grow by
// less than one fp32 logit per (row, class) when the global batch grows 8-fold, where the
// buffered pass's grow by the whole buffer.
TEST(StreamedSoftmax, MemoryDoesNotGrowWithTheGlobalBatch) {
  auto dist = Distributed::init(DistEnv{});
  const int64_t C = 20000, D = 64;
  auto peak_of = [&](bool streamed, int64_t batch) {
    PartialFCOptions o;
    o.num_classes = C;
    o.embedding_size = D;
    o.streamed_logits = streamed;
    o.update_chunk_rows = 512;
    PartialFC fc(*dist, o);
    torch::manual_seed(1);
    at::Tensor emb = torch::randn({batch, D}).requires_grad_();
    const at::Tensor labels = torch::randint(0, C, {batch}, torch::kLong);
    AllocationMeter::install();
    AllocationMeter::reset_peak();
    const int64_t before = AllocationMeter::current_bytes();
    fc.arm_step(0.1);
    fc.forward(emb, labels).loss.backward();
    fc.step(0.1);
    return AllocationMeter::peak_bytes() - before;
  };
  const double grow_buffered = static_cast<double>(peak_of(false, 512) - peak_of(false, 64));
  const double grow_streamed = static_cast<double>(peak_of(true, 512) - peak_of(true, 64));
  const double logits = static_cast<double>(512 - 64) * C * 4;
  EXPECT_GE(grow_buffered, logits) << "the buffered pass holds the logits";
  EXPECT_LE(grow_streamed, 0.15 * logits) << "streamed: " << grow_streamed << " bytes more for 8x the batch";
}

}  // namespace
}  // namespace faceshard
