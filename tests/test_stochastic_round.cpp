// bf16 centres with stochastic rounding (optim.fc_weight_dtype bf16): the rounding is
// unbiased, a function of (seed, step, global class, element) only (so the same on any
// number of ranks), the same in tensor operations and in the CPU's one-pass update, and a
// bf16 classifier steps as an fp32 one does, rounded once per step.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "app/config/config.h"
#include "partial_fc/classifier/partial_fc.h"
#include "partial_fc/classifier/stochastic_round.h"
#include "tests/harness.h"
#include "tests/test_errors.h"

namespace faceshard {
namespace {

// The two bf16 neighbours of v (lo <= v < hi), from the bit pattern, independent of the
// rounding under test.
std::pair<double, double> neighbours(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  const uint32_t lo_bits = bits & 0xffff0000U, hi_bits = lo_bits + 0x10000U;
  float lo, hi;
  std::memcpy(&lo, &lo_bits, 4);
  std::memcpy(&hi, &hi_bits, 4);
  return {lo, hi};
}

// The mean of many roundings of one value is the value, within 5 standard errors of a
// Bernoulli draw between its neighbours; round to nearest is not (the control).
TEST(StochasticRound, UnbiasedWithinItsStatisticalBound) {
  const int64_t draws = 200000;
  for (const float v : {0.0123457f, -3.14159e-3f, 1.00301f, 7.77e5f, -2.5e-30f}) {
    const auto [lo, hi] = neighbours(v);  // |lo| <= |v| < |hi|
    ASSERT_LT(std::abs(lo), std::abs(hi));
    const double p = (std::abs(static_cast<double>(v)) - std::abs(lo)) / (std::abs(hi) - std::abs(lo));
    ASSERT_GT(p, 0.01) << v << " lies on a bf16 number: no rounding to test";
    // One value rounded many times: as 512 classes at each of many steps.
    double sum = 0;
    int64_t up = 0;
    for (int64_t step = 0; step < draws; step += 512) {
      const at::Tensor k = sr_row_keys(2048, step, torch::arange(512, torch::kLong));
      const at::Tensor r = stochastic_round_bf16(torch::full({512, 1}, v), k).to(torch::kDouble);
      sum += r.sum().item<double>();
      up += (r.abs() > std::abs(lo)).sum().item<int64_t>();
    }
    const int64_t n = (draws + 511) / 512 * 512;
    const double mean = sum / static_cast<double>(n);
    const double se = (std::abs(hi) - std::abs(lo)) * std::sqrt(p * (1 - p) / static_cast<double>(n));
    EXPECT_LE(std::abs(mean - v), 5 * se) << v << ": mean of " << n << " roundings " << mean << " (bound " << 5 * se << ")";
    EXPECT_NEAR(static_cast<double>(up) / static_cast<double>(n), p, 5 * std::sqrt(p * (1 - p) / static_cast<double>(n)))
        << v;
    // Round to nearest lands on one neighbour every time: its bias is the whole distance.
    const double nearest = static_cast<double>(static_cast<float>(c10::BFloat16(v)));
    EXPECT_GT(std::abs(nearest - v), 20 * se) << v << ": the control would pass the bound";
  }
}

// The tensor operations and the scalar function give the same bits, for every element of
// rows of random values of any sign and size, including values that round up across an
// exponent and non-finite ones (inf to nearest, NaN of either sign to sr_round's 0x7fc0).
TEST(StochasticRound, TensorOperationsEqualTheScalarRounding) {
  torch::manual_seed(3);
  at::Tensor x = torch::randn({37, 129}) * torch::pow(10.0, torch::randint(-20, 20, {37, 1}).to(torch::kFloat));
  x[0][0] = std::nextafter(1.0f, 2.0f) * 1.9999f;
  x[1][1] = INFINITY;
  x[1][2] = -INFINITY;
  x[1][3] = NAN;
  x[1][4] = -NAN;
  const at::Tensor classes = torch::arange(1000, 1037, torch::kLong) * 1000003;  // beyond 2^32 too
  const at::Tensor keys = sr_row_keys(77, 5, classes);
  const at::Tensor got = stochastic_round_bf16(x, keys);
  ASSERT_EQ(got.scalar_type(), at::kBFloat16);
  int64_t differ = 0;
  for (int64_t i = 0; i < x.size(0); ++i) {
    const uint32_t k = sr_row_key(77, 5, classes[i].item<int64_t>());
    EXPECT_EQ(static_cast<uint32_t>(keys[i].item<int64_t>()), k) << "row " << i;
    const at::Tensor row = got[i].contiguous();
    const c10::BFloat16* g = row.data_ptr<c10::BFloat16>();
    for (int64_t e = 0; e < x.size(1); ++e) {
      const float v = x[i][e].item<float>();
      const c10::BFloat16 want = sr_round(v, sr_bits(k, static_cast<uint32_t>(e)));
      differ += g[e].x != want.x;  // NaN too: its bits, not only NaN-ness
    }
  }
  EXPECT_EQ(differ, 0);
  EXPECT_EQ(got[1][1].item<float>(), INFINITY);
  EXPECT_EQ(got[1][2].item<float>(), -INFINITY);
}

// The same global class rounds the same whichever shard holds it: rows of classes [0, 90)
// rounded as one shard, and as three shards of uneven size (each with its own first class),
// are bitwise equal; another step or seed rounds differently.
TEST(StochasticRound, TheSameOnAnyNumberOfRanks) {
  torch::manual_seed(5);
  const at::Tensor rows = torch::randn({90, 64}) * 0.01;
  const RowRounding whole{11, 42, 0};
  const at::Tensor one = whole.round(rows, at::Tensor(), 0, at::kBFloat16);
  for (const std::vector<int64_t>& cuts : {std::vector<int64_t>{0, 31, 61, 90}, std::vector<int64_t>{0, 45, 90}}) {
    std::vector<at::Tensor> parts;
    for (size_t r = 0; r + 1 < cuts.size(); ++r) {
      const RowRounding shard{11, 42, cuts[r]};
      // Sampled rows of the shard through an index, the rest as a range: both key the same.
      const int64_t n = cuts[r + 1] - cuts[r];
      const at::Tensor idx = torch::arange(n, torch::kLong);
      const at::Tensor a = shard.round(rows.narrow(0, cuts[r], n), at::Tensor(), 0, at::kBFloat16);
      const at::Tensor b = shard.round(rows.narrow(0, cuts[r], n), idx, 0, at::kBFloat16);
      EXPECT_TRUE(torch::equal(a, b));
      parts.push_back(a);
    }
    EXPECT_TRUE(torch::equal(torch::cat(parts), one)) << cuts.size() - 1 << " shards";
  }
  EXPECT_FALSE(torch::equal(RowRounding{11, 43, 0}.round(rows, at::Tensor(), 0, at::kBFloat16), one));
  EXPECT_FALSE(torch::equal(RowRounding{12, 42, 0}.round(rows, at::Tensor(), 0, at::kBFloat16), one));
}

// A bf16 classifier's step is the fp32 step of its (bf16) centres, stochastically rounded:
// the SGD update of the rows that took part, computed in fp32 from the same gradient, then
// rounded with the keys of (seed, step, class). Checked for the CPU's one-pass update and
// the generic path (the GPU's), with and without sampling, and bf16 or fp32 momentum: every
// stored value is one of the two bf16 neighbours of the fp32 update, the rows that did not
// take part are untouched, and the two paths agree bit for bit except where their fp32
// updates fall on different sides of a rounding threshold.
TEST(StochasticRound, Bf16ClassifierStepsAsTheRoundedFp32Step) {
  for (const bool onepass : {true, false})
  for (const double rate : {1.0, 0.4})
  for (const at::ScalarType state : {at::kFloat, at::kBFloat16}) {
    auto dist = Distributed::init(DistEnv{});
    const int64_t C = 300, D = 32, B = 12;
    PartialFCOptions o;
    o.num_classes = C;
    o.embedding_size = D;
    o.sample_rate = rate;
    o.update_chunk_rows = 64;
    o.weight_dtype = at::kBFloat16;
    o.optimizer = ShardOptimizerOptions{"sgd", 0.9, 5e-4};
    o.optimizer.state_dtype = state;
    o.optimizer.fused_cpu_rows = onepass;
    PartialFC fc(*dist, o);
    const std::string at = std::string(onepass ? "onepass" : "generic") + " rate " + std::to_string(rate) + " state " +
                           c10::toString(state);
    ASSERT_EQ(fc.weight().scalar_type(), at::kBFloat16) << at;
    // Stored as the fp32 initial rows rounded to nearest.
    EXPECT_TRUE(torch::equal(fc.weight(), PartialFC::initial_rows(0, C, D, o.seed).to(at::kBFloat16))) << at;
    torch::manual_seed(9);
    const at::Tensor emb = torch::randn({B, D});
    const at::Tensor labels = torch::randint(0, C, {B}, torch::kLong);
    for (int step = 0; step < 2; ++step) {
      const at::Tensor w0 = fc.weight().to(at::kFloat);
      const at::Tensor m0 = fc.state()[1].second.to(at::kFloat);
      auto out = fc.forward(emb, labels);
      out.loss.backward();
      const at::Tensor rows = fc.samples() ? fc.sampled_index() : torch::arange(C, torch::kLong);
      const at::Tensor g = fc.gradient();
      const double lr = 0.5;
      // The fp32 update of those rows (torch.optim.SGD's, dampening 0).
      const at::Tensor w = w0.index_select(0, rows);
      const at::Tensor buf = m0.index_select(0, rows) * 0.9 + g + 5e-4 * w;
      const at::Tensor want = w - lr * buf;
      const int64_t key_step = fc.forwards();
      fc.step(lr);
      const at::Tensor got = fc.weight().index_select(0, rows).to(at::kFloat);
      const at::Tensor rounded = RowRounding{o.seed, key_step, 0}.round(want, rows, 0, at::kBFloat16).to(at::kFloat);
      // Every value within one bf16 step of the fp32 update, and (nearly) the keyed rounding.
      const at::Tensor ulp = want.abs() * std::ldexp(1.0, -7) + 1e-30;
      EXPECT_TRUE(((got - want).abs() <= ulp).all().item<bool>()) << at << " step " << step;
      const double same = (got == rounded).to(at::kDouble).mean().item<double>();
      EXPECT_GE(same, 0.995) << at << " step " << step << ": " << same << " of the values are the keyed rounding";
      // Rows that did not take part: bitwise untouched.
      at::Tensor untouched = torch::ones({C}, torch::kBool).index_fill_(0, rows, false);
      EXPECT_TRUE(torch::equal(fc.weight().to(at::kFloat).index_select(0, untouched.nonzero().squeeze(1)),
                               w0.index_select(0, untouched.nonzero().squeeze(1))))
          << at;
      // Some stored values moved.
      EXPECT_GT((got != w).sum().item<int64_t>(), 0) << at;
      // The count of values the update moved whose stored bf16 stayed the same.
      const at::Tensor moved = want != w;
      const double unchanged = (moved & (got == w)).sum().item<double>() / moved.sum().item<double>();
      const auto counted = fc.take_lost_updates();
      EXPECT_EQ(counted.second, moved.sum().item<int64_t>()) << at;
      EXPECT_NEAR(counted.first, unchanged, 0.01) << at;
    }
  }
}

// Resuming with the other centre dtype converts once; a bf16 shard's state round-trips
// through state()/load_state as bf16.
TEST(StochasticRound, StateKeepsTheCentresDtype) {
  auto dist = Distributed::init(DistEnv{});
  PartialFCOptions o;
  o.num_classes = 50;
  o.embedding_size = 8;
  o.weight_dtype = at::kBFloat16;
  PartialFC a(*dist, o);
  EXPECT_EQ(a.state()[0].first, "weight");
  EXPECT_EQ(a.state()[0].second.scalar_type(), at::kBFloat16);
  o.weight_dtype = at::kFloat;
  PartialFC b(*dist, o);
  b.load_state(a.state(), "test");
  EXPECT_TRUE(torch::equal(b.weight(), a.weight().to(at::kFloat)));
  o.weight_dtype = at::kHalf;
  const std::string msg = testing::error_of([&] { PartialFC c(*dist, o); });
  EXPECT_NE(msg.find("fc_weight_dtype"), std::string::npos) << msg;
}


// The config keys of bf16 centres and streamed logits take only what they name (the resume's
// dtype conversion: PartialFCChunkedUpdate.ResumeConvertsTheCentresDtype).
TEST(StochasticRound, ConfigKeysNameTheirValues) {
  for (const char* bad : {"optim: {fc_weight_dtype: fp16}", "optim: {fc_weight_rounding: up}", "loss: {logits: held}"}) {
    const std::string msg = testing::error_of([&] { load_config_text(std::string("data: {num_classes: 10}\n") + bad + "\n", "s.yaml"); });
    const std::string key = std::string(bad).find("logits") != std::string::npos ? "loss.logits"
                            : std::string(bad).find("rounding") != std::string::npos ? "optim.fc_weight_rounding"
                                                                                       : "optim.fc_weight_dtype";
    EXPECT_NE(msg.find("key '" + key + "'"), std::string::npos) << msg;
  }
}

// loss.logits auto: streamed where the buffer would take more than the centres and their
// state (classifier_memory_plan's figures), buffered elsewhere.
TEST(StochasticRound, AutoLogitsFollowTheMemoryPlan) {
  PartialFCOptions o;
  o.num_classes = 2059906;
  o.sample_rate = 0.2;
  EXPECT_TRUE(streamed_logits_pay(o, 64, 128));  // 6,554 B of logits per class against 4,096
  EXPECT_FALSE(streamed_logits_pay(o, 4, 128));  // 410 B
  o.sample_rate = 1.0;
  EXPECT_FALSE(streamed_logits_pay(o, 1, 128));  // 512 B against 4,096
  o.weight_dtype = at::kBFloat16;
  o.optimizer.state_dtype = at::kBFloat16;
  EXPECT_FALSE(streamed_logits_pay(o, 8, 64));  // 2,048 against 2,048: not more
  EXPECT_TRUE(streamed_logits_pay(o, 8, 65));   // 2,080
  o.streamed_logits = true;
  EXPECT_EQ(classifier_memory_plan(o, 8, 0, 64).logits_bytes, 4.0 * classifier_memory_plan(o, 8, 0, 64).sampled_rows);
}

}  // namespace
}  // namespace faceshard
