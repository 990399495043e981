// The label audit of faceshard-clean (app/clean/clean_audit.h) on a hand-built world whose
// truth is known: identity directions, class centres (K = 1 and K = 3, the dominant
// sub-centre not always the first), image embeddings at known angles, and injected problems
// (10% of images moved to a wrong identity, 2% of identities split under two labels, 10
// identities also among the test identities, 1% of images stored twice). Each report's
// precision and recall are measured against the injected truth; angles against float64.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <tuple>

#include "app/clean/clean_audit.h"
#include "app/clean/clean_pack.h"
#include "app/clean/tail_threshold.h"
#include "base/error.h"
#include "test_files.h"

namespace faceshard {
namespace {

using testing::TempDir;

constexpr int64_t kE = 256, kPersons = 500, kImagesPerPerson = 20, kSplit = 10, kOverlap = 10;
constexpr double kPi = 3.14159265358979323846;

struct World {
  int64_t classes = 0, k = 1;
  at::Tensor centres;                 // [C*K, E] double
  std::vector<int64_t> dom;           // per class
  std::vector<at::Tensor> emb;        // per image [E] double
  std::vector<int64_t> label;         // per image
  std::vector<uint64_t> hash;         // per image
  std::vector<int64_t> person_class;  // the class each image's face belongs to (truth of relabel)
  std::set<int64_t> mislabeled;
  std::set<std::pair<int64_t, int64_t>> split;     // (a, b), a < b
  std::set<int64_t> overlap;                       // classes
  std::set<std::pair<int64_t, int64_t>> copies;    // (original, copy) image indices
  std::vector<TestIdentity> tests;
};

at::Tensor unit(const at::Tensor& v) { return v / v.norm(); }

// A unit vector at `deg` degrees from the unit vector d.
at::Tensor at_angle(const at::Tensor& d, double deg) {
  at::Tensor u = torch::randn({kE}, torch::kDouble);
  u = unit(u - (u * d).sum() * d);
  const double r = deg * kPi / 180;
  return std::cos(r) * d + std::sin(r) * u;
}

World make_world(int64_t k, uint64_t seed) {
  torch::manual_seed(seed);
  std::mt19937_64 rng(seed);
  auto uniform = [&](double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng); };
  World w;
  w.k = k;
  w.classes = kPersons + kSplit;
  const at::Tensor dirs = torch::randn({kPersons, kE}, torch::kDouble);
  std::vector<at::Tensor> d;
  for (int64_t p = 0; p < kPersons; ++p) d.push_back(unit(dirs[p]));
  // Persons 0..kSplit-1 are split: half their images under the extra class kPersons + p,
  // whose centre training has pushed 40 degrees away.
  std::vector<at::Tensor> class_dir(size_t(w.classes));
  for (int64_t p = 0; p < kPersons; ++p) class_dir[size_t(p)] = d[size_t(p)];
  for (int64_t j = 0; j < kSplit; ++j) {
    class_dir[size_t(kPersons + j)] = at_angle(d[size_t(j)], 40);
    w.split.insert({j, kPersons + j});
  }
  w.centres = torch::empty({w.classes * k, kE}, torch::kDouble);
  w.dom.resize(size_t(w.classes));
  for (int64_t c = 0; c < w.classes; ++c) {
    w.dom[size_t(c)] = int64_t(rng() % uint64_t(k));
    for (int64_t s = 0; s < k; ++s)
      w.centres[c * k + s] = s == w.dom[size_t(c)] ? class_dir[size_t(c)] : unit(torch::randn({kE}, torch::kDouble));
  }
  // Images, class by class (a .rec is written so).
  for (int64_t c = 0; c < w.classes; ++c) {
    const int64_t person = c < kPersons ? c : c - kPersons;
    const int64_t n = c < kSplit || c >= kPersons ? kImagesPerPerson / 2 : kImagesPerPerson;
    for (int64_t i = 0; i < n; ++i) {
      const bool wrong = uniform(0, 1) < 0.10;
      at::Tensor e;
      int64_t truth = c;
      if (!wrong) {
        e = at_angle(d[size_t(person)], uniform(20, 55));
      } else if (k > 1 && uniform(0, 1) < 0.5) {
        // Noise that collected at a non-dominant sub-centre of its own class.
        const int64_t s = (w.dom[size_t(c)] + 1 + int64_t(rng() % uint64_t(k - 1))) % k;
        e = at_angle(w.centres[c * k + s], uniform(25, 45));
        truth = -1;
      } else {
        int64_t other = int64_t(rng() % uint64_t(kPersons));
        if (other == person) other = (other + 1) % kPersons;
        e = at_angle(d[size_t(other)], uniform(20, 45));
        truth = other;
      }
      const int64_t index = int64_t(w.emb.size());
      auto push = [&](const at::Tensor& v, uint64_t h) {
        w.emb.push_back(v);
        w.label.push_back(c);
        w.hash.push_back(h);
        w.person_class.push_back(truth);
        if (wrong) w.mislabeled.insert(int64_t(w.emb.size()) - 1);
      };
      push(e, uint64_t(index) * 2 + 1);
      if (uniform(0, 1) < 0.01) {
        // Stored twice: the same bytes, or re-encoded (a slightly different embedding).
        const bool same_bytes = uniform(0, 1) < 0.5;
        push(same_bytes ? e : unit(e + 0.02 / std::sqrt(double(kE)) * torch::randn({kE}, torch::kDouble)),
             same_bytes ? uint64_t(index) * 2 + 1 : uint64_t(index) * 2 + 2);
        w.copies.insert({index, index + 1});
      }
    }
  }
  // Test identities: 10 training persons (not split ones) and 40 others, 3 images each.
  for (int64_t j = 0; j < kOverlap + 40; ++j) {
    const bool in_train = j < kOverlap;
    const int64_t person = kSplit + 7 * j;
    const at::Tensor dir = in_train ? d[size_t(person)] : unit(torch::randn({kE}, torch::kDouble));
    at::Tensor sum = torch::zeros({kE}, torch::kDouble);
    for (int i = 0; i < 3; ++i) sum += at_angle(dir, uniform(20, 55));
    w.tests.push_back({"held_out", "identity " + std::to_string(j), 3, sum.to(torch::kFloat)});
    if (in_train) w.overlap.insert(person);
  }
  return w;
}

struct Table {
  std::vector<std::string> comments;
  std::vector<std::string> columns;
  std::vector<std::map<std::string, std::string>> rows;
};

Table read_tsv(const std::string& path) {
  std::ifstream f(path);
  EXPECT_TRUE(f.good()) << path;
  Table t;
  std::string line;
  auto split = [](const std::string& s) {
    std::vector<std::string> out;
    std::stringstream ss(s);
    std::string x;
    while (std::getline(ss, x, '\t')) out.push_back(x);
    return out;
  };
  while (std::getline(f, line)) {
    if (line.rfind("#", 0) == 0) {
      t.comments.push_back(line);
    } else if (t.columns.empty()) {
      t.columns = split(line);
    } else {
      const auto cells = split(line);
      EXPECT_EQ(cells.size(), t.columns.size()) << path << ": " << line;
      std::map<std::string, std::string> row;
      for (size_t i = 0; i < cells.size() && i < t.columns.size(); ++i) row[t.columns[i]] = cells[i];
      t.rows.push_back(row);
    }
  }
  return t;
}

template <class T>
void expect_precision_recall(const std::set<T>& found, const std::set<T>& truth, const char* what, double goal = 0.95) {
  int64_t hit = 0;
  for (const auto& x : found) hit += truth.count(x);
  const double precision = found.empty() ? 0 : double(hit) / double(found.size());
  const double recall = truth.empty() ? 1 : double(hit) / double(truth.size());
  EXPECT_GE(precision, goal) << what << ": " << hit << " of " << found.size() << " found are injected";
  EXPECT_GE(recall, goal) << what << ": " << hit << " of " << truth.size() << " injected are found";
  std::printf("%s: precision %.4f recall %.4f (%zu found, %zu injected)\n", what, precision, recall, found.size(),
              truth.size());
}

CleanCounts run_audit(const World& w, const std::string& folder, CleanThresholds t = {}, int64_t chunk = 1000) {
  const at::Tensor centres = w.centres.to(torch::kFloat);
  CleanAudit audit(centres, w.classes, w.k, t, torch::kCPU, folder,
                   [](int64_t i) { return "img/" + std::to_string(i) + ".jpg"; }, /*centre_chunk_rows=*/96);
  const int64_t n = int64_t(w.emb.size());
  for (int64_t s = 0; s < n; s += chunk) {
    const int64_t b = std::min(chunk, n - s);
    std::vector<at::Tensor> rows(w.emb.begin() + s, w.emb.begin() + s + b);
    std::vector<int64_t> labels(w.label.begin() + s, w.label.begin() + s + b), idx(static_cast<size_t>(b));
    std::vector<uint64_t> hashes(w.hash.begin() + s, w.hash.begin() + s + b);
    for (int64_t i = 0; i < b; ++i) idx[size_t(i)] = s + i;
    audit.add(torch::stack(rows).to(torch::kFloat), labels, idx, hashes);
  }
  CleanCounts c = audit.write_reports({"run: hand-built"}, w.tests);
  if (w.k > 1) {
    EXPECT_EQ(audit.dominant(), w.dom);
  }
  return c;
}

void check_reports(const World& w, const std::string& folder) {
  const Table mis = read_tsv(folder + "/mislabeled.tsv");
  ASSERT_FALSE(mis.rows.empty());
  bool printed = false;
  for (const auto& c : mis.comments)
    printed |= c.find("# thresholds: --mislabeled-angle ") == 0 &&
               c.find("degrees (from the data: cos ") != std::string::npos &&
               c.find("image-to-other-class cosines") != std::string::npos;
  EXPECT_TRUE(printed) << "mislabeled.tsv's header names its threshold and where it comes from";
  std::set<int64_t> found;
  int64_t relabel_right = 0, relabel_truth = 0;
  for (const auto& r : mis.rows) {
    const int64_t i = std::stoll(r.at("index"));
    found.insert(i);
    EXPECT_EQ(r.at("image"), "img/" + std::to_string(i) + ".jpg");
    EXPECT_EQ(std::stoll(r.at("label")), w.label[size_t(i)]);
    // The angle to the dominant sub-centre, in float64 from the world itself.
    const int64_t c = w.label[size_t(i)];
    const double cos = (w.emb[size_t(i)] * w.centres[c * w.k + w.dom[size_t(c)]]).sum().item<double>();
    EXPECT_NEAR(std::stod(r.at("angle_deg")), std::acos(cos) * 180 / kPi, 0.02) << "image " << i;
    if (w.person_class[size_t(i)] >= 0 && w.mislabeled.count(i)) {
      ++relabel_truth;
      relabel_right += r.at("suggestion") == "relabel " + std::to_string(w.person_class[size_t(i)]) ||
                       // a face of a split person fits either of its two classes
                       (w.person_class[size_t(i)] < kSplit &&
                        r.at("suggestion") == "relabel " + std::to_string(kPersons + w.person_class[size_t(i)]));
    }
  }
  expect_precision_recall(found, w.mislabeled, "mislabeled");
  EXPECT_GE(double(relabel_right), 0.95 * double(relabel_truth)) << "relabel suggestions name the face's class";

  std::set<std::pair<int64_t, int64_t>> pairs;
  for (const auto& r : read_tsv(folder + "/duplicate_identities.tsv").rows)
    pairs.insert({std::stoll(r.at("class_a")), std::stoll(r.at("class_b"))});
  expect_precision_recall(pairs, w.split, "duplicate_identities");

  std::set<int64_t> overlap;
  for (const auto& r : read_tsv(folder + "/overlap.tsv").rows) overlap.insert(std::stoll(r.at("class")));
  expect_precision_recall(overlap, w.overlap, "overlap");

  std::set<std::pair<int64_t, int64_t>> copies;
  int64_t same_bytes = 0;
  for (const auto& r : read_tsv(folder + "/near_duplicates.tsv").rows) {
    const int64_t a = std::stoll(r.at("index_a")), b = std::stoll(r.at("index_b"));
    copies.insert({a, b});
    same_bytes += r.at("identical_bytes") == "yes";
    EXPECT_EQ(r.at("identical_bytes") == "yes", w.hash[size_t(a)] == w.hash[size_t(b)]);
  }
  expect_precision_recall(copies, w.copies, "near_duplicates");
  EXPECT_GT(same_bytes, 0);
}

// The data's thresholds (tail_threshold.h): a standard normal's upper quantiles by their
// definition (erfc), and the identity and overlap cosines of the hand-built world equal to
// mean + z sd of its class pairs' and test-identity-to-class cosines computed here in float64
// from the world itself (z for 0.1 expected false pairs); the mislabeled angle's text says
// its fit; a threshold given as a flag is kept and named as given.
TEST(CleanAudit, DataThresholdsAreTheNormalTailOfTheSetsOwnPairs) {
  for (double p : {0.5, 0.1, 1e-3, 1e-7, 1e-13}) {
    const double z = normal_upper_quantile(p);
    EXPECT_NEAR(0.5 * std::erfc(z / std::sqrt(2.0)) / p, 1.0, 1e-9) << p;
  }
  EXPECT_NEAR(normal_upper_quantile(1e-3), 3.090232306, 1e-8);
  TempDir dir;
  const World w = make_world(1, 11);
  const CleanCounts c = run_audit(w, dir.path);
  // Identity vectors: each class's mean embedding (K = 1: every image of it), normalised.
  std::vector<at::Tensor> sum(size_t(w.classes));
  for (size_t i = 0; i < w.emb.size(); ++i) {
    at::Tensor& t = sum[size_t(w.label[i])];
    t = t.defined() ? t + w.emb[i] : w.emb[i].clone();
  }
  std::vector<at::Tensor> id;
  for (const auto& t : sum)
    if (t.defined()) id.push_back(t / t.norm());
  auto tail = [](const std::vector<double>& x, double pairs) {
    double m = 0, q = 0;
    for (double v : x) m += v;
    m /= double(x.size());
    for (double v : x) q += (v - m) * (v - m);
    const double sd = std::sqrt(q / double(x.size() - 1));
    return m + normal_upper_quantile(0.1 / pairs) * sd;
  };
  std::vector<double> pairs;
  for (size_t a = 0; a < id.size(); ++a)
    for (size_t b = a + 1; b < id.size(); ++b) pairs.push_back((id[a] * id[b]).sum().item<double>());
  EXPECT_NEAR(c.identity_cos, tail(pairs, double(pairs.size())), 2e-4) << c.identity_from;
  EXPECT_NE(c.identity_from.find("the data: cos "), std::string::npos) << c.identity_from;
  std::vector<double> tv;
  for (const TestIdentity& t : w.tests) {
    const at::Tensor v = t.embedding.to(torch::kDouble) / t.embedding.to(torch::kDouble).norm();
    for (const auto& x : id) tv.push_back((v * x).sum().item<double>());
  }
  EXPECT_NEAR(c.overlap_cos, tail(tv, double(tv.size())), 2e-4) << c.overlap_from;
  EXPECT_NE(c.mislabeled_from.find("the data: cos "), std::string::npos) << c.mislabeled_from;
  EXPECT_GT(c.mislabeled_angle, 0);
  EXPECT_LT(c.mislabeled_angle, 180);
  // A tail above the known-same pairs (a rate no fit can resolve: 1e-290 expected false pairs
  // puts it near 1): the threshold comes down to the 5th percentile of the classes' two
  // halves, said so, and every split identity is still found.
  TempDir strict;
  CleanThresholds st;
  st.false_pairs = 1e-290;
  const CleanCounts sc = run_audit(w, strict.path, st);
  EXPECT_NE(sc.identity_from.find("the 5th percentile of "), std::string::npos) << sc.identity_from;
  EXPECT_LT(sc.identity_cos, 0.999) << sc.identity_from;
  std::set<std::pair<int64_t, int64_t>> found;
  for (const auto& r : read_tsv(strict / "duplicate_identities.tsv").rows)
    found.insert({std::stoll(r.at("class_a")), std::stoll(r.at("class_b"))});
  for (const auto& pr : w.split) EXPECT_TRUE(found.count(pr)) << pr.first << "-" << pr.second << " not found";
  // Flags win, and say so.
  TempDir given;
  CleanThresholds t;
  t.mislabeled_angle = 75, t.mislabeled_given = true;
  t.identity_cos = 0.6, t.identity_given = true;
  t.overlap_cos = 0.5, t.overlap_given = true;
  const CleanCounts g = run_audit(w, given.path, t);
  EXPECT_EQ(g.mislabeled_angle, 75);
  EXPECT_EQ(g.identity_cos, 0.6);
  EXPECT_EQ(g.overlap_cos, 0.5);
  EXPECT_EQ(g.identity_from, "--identity-cos");
}

TEST(CleanAudit, InjectedProblemsFoundK1) {
  TempDir dir;
  const World w = make_world(1, 11);
  const CleanCounts c = run_audit(w, dir.path);
  EXPECT_EQ(c.images, int64_t(w.emb.size()));
  EXPECT_EQ(c.classes_seen_after_eviction, 0);
  check_reports(w, dir.path);
  EXPECT_FALSE(std::filesystem::exists(dir / "dropped_subcenters.tsv")) << "K = 1 has no sub-centres to drop";
  for (const auto& e : std::filesystem::directory_iterator(dir.path))
    EXPECT_EQ(e.path().extension(), ".tsv") << "left behind: " << e.path();
}

TEST(CleanAudit, InjectedProblemsFoundK3WithDroppedSubcenters) {
  TempDir dir;
  const World w = make_world(3, 12);
  run_audit(w, dir.path);
  check_reports(w, dir.path);
  std::set<std::pair<int64_t, int64_t>> dropped, truth;
  for (int64_t c = 0; c < w.classes; ++c)
    for (int64_t s = 0; s < w.k; ++s)
      if (s != w.dom[size_t(c)]) truth.insert({c, s});
  for (const auto& r : read_tsv(dir / "dropped_subcenters.tsv").rows) {
    dropped.insert({std::stoll(r.at("class")), std::stoll(r.at("subcenter"))});
    EXPECT_EQ(std::stoll(r.at("dominant")), w.dom[size_t(std::stoll(r.at("class")))]);
  }
  EXPECT_EQ(dropped, truth);
}

// Thresholds given away from the defaults, each cutting through the world's own distribution
// (about half the images' angles; the 300 closest of the 130k class pairs; the 40 closest
// test-identity-to-class pairs): every report flags exactly the set the float64 computation
// from the world flags at that threshold (a value within 1e-5 of it may round either way in
// float32 and is not counted). A threshold read from another field flags another set.
TEST(CleanAudit, GivenThresholdsFlagWhatFloat64FlagsAtThem) {
  TempDir dir;
  const World w = make_world(3, 14);
  const int64_t n = int64_t(w.emb.size()), C = w.classes;
  std::vector<at::Tensor> dom_rows;
  for (int64_t c = 0; c < C; ++c) dom_rows.push_back(w.centres[c * w.k + w.dom[size_t(c)]]);
  const at::Tensor id = torch::stack(dom_rows);  // unit rows, float64
  std::vector<double> angle(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const double cos = (w.emb[size_t(i)] * id[w.label[size_t(i)]]).sum().item<double>();
    angle[size_t(i)] = std::acos(std::clamp(cos, -1.0, 1.0)) * 180 / kPi;
  }
  const at::Tensor pair_cos = at::matmul(id, id.t());
  std::vector<std::tuple<double, int64_t, int64_t>> pairs;
  for (int64_t a = 0; a < C; ++a)
    for (int64_t b = a + 1; b < C; ++b) pairs.emplace_back(pair_cos[a][b].item<double>(), a, b);
  std::vector<at::Tensor> test_rows;
  for (const auto& t : w.tests) test_rows.push_back(unit(t.embedding.to(torch::kDouble)));
  const at::Tensor test_cos = at::matmul(torch::stack(test_rows), id.t());
  std::vector<double> tc(test_cos.data_ptr<double>(), test_cos.data_ptr<double>() + test_cos.numel());
  // Midpoints between neighbours of the sorted values.
  auto cut = [](std::vector<double> v, size_t from_top) {
    std::sort(v.begin(), v.end(), std::greater<double>());
    return 0.5 * (v[from_top - 1] + v[from_top]);
  };
  std::vector<double> pc;
  for (const auto& p : pairs) pc.push_back(std::get<0>(p));
  CleanThresholds t;
  t.mislabeled_angle = cut(angle, size_t(n / 2));
  t.identity_cos = cut(pc, 300);
  t.overlap_cos = cut(tc, 40);
  t.identity_by = "centres";
  t.mislabeled_given = t.identity_given = t.overlap_given = true;
  std::printf("thresholds: angle %.3f, identity cos %.4f, overlap cos %.4f\n", t.mislabeled_angle, t.identity_cos,
              t.overlap_cos);
  run_audit(w, dir.path, t);
  constexpr double kTie = 1e-5;
  // mislabeled.tsv
  std::set<int64_t> got, want, near;
  for (const auto& r : read_tsv(dir / "mislabeled.tsv").rows) got.insert(std::stoll(r.at("index")));
  for (int64_t i = 0; i < n; ++i) {
    const double a = angle[size_t(i)];
    if (std::abs(std::cos(a * kPi / 180) - std::cos(t.mislabeled_angle * kPi / 180)) < kTie) near.insert(i);
    else if (a > t.mislabeled_angle) want.insert(i);
  }
  for (int64_t i : near) got.erase(i);
  EXPECT_EQ(got, want) << "mislabeled.tsv at --mislabeled-angle " << t.mislabeled_angle;
  EXPECT_GT(want.size(), size_t(n / 3));
  // duplicate_identities.tsv
  std::set<std::pair<int64_t, int64_t>> gp, wp, np;
  for (const auto& r : read_tsv(dir / "duplicate_identities.tsv").rows)
    gp.insert({std::stoll(r.at("class_a")), std::stoll(r.at("class_b"))});
  for (const auto& [cos, a, b] : pairs) {
    if (std::abs(cos - t.identity_cos) < kTie) np.insert({a, b});
    else if (cos > t.identity_cos) wp.insert({a, b});
  }
  for (const auto& p : np) gp.erase(p);
  EXPECT_EQ(gp, wp) << "duplicate_identities.tsv at --identity-cos " << t.identity_cos;
  EXPECT_GE(wp.size(), size_t(290));
  // overlap.tsv
  std::set<std::pair<std::string, int64_t>> go, wo, no;
  for (const auto& r : read_tsv(dir / "overlap.tsv").rows) go.insert({r.at("test_identity"), std::stoll(r.at("class"))});
  for (size_t i = 0; i < w.tests.size(); ++i)
    for (int64_t c = 0; c < C; ++c) {
      const double cos = test_cos[int64_t(i)][c].item<double>();
      if (std::abs(cos - t.overlap_cos) < kTie) no.insert({w.tests[i].name, c});
      else if (cos > t.overlap_cos) wo.insert({w.tests[i].name, c});
    }
  for (const auto& p : no) go.erase(p);
  EXPECT_EQ(go, wo) << "overlap.tsv at --overlap-cos " << t.overlap_cos;
  EXPECT_GE(wo.size(), size_t(35));
}

// A near-duplicate buffer far smaller than the set still finds every copy of a set written
// class by class (finished classes are the ones evicted).
TEST(CleanAudit, NearDuplicateBufferBounded) {
  TempDir dir;
  const World w = make_world(1, 13);
  CleanThresholds t;
  t.near_duplicate_memory_mb = 1;  // ~1000 of the ~10000 embeddings
  const CleanCounts c = run_audit(w, dir.path, t);
  EXPECT_EQ(c.classes_seen_after_eviction, 0);
  std::set<std::pair<int64_t, int64_t>> copies;
  for (const auto& r : read_tsv(dir / "near_duplicates.tsv").rows)
    copies.insert({std::stoll(r.at("index_a")), std::stoll(r.at("index_b"))});
  expect_precision_recall(copies, w.copies, "near_duplicates (1 MiB buffer)");
}

// An image with a look-alike before its own copy: the report pairs the copy with the image
// it copies (identical bytes beat a higher cosine, a higher cosine beats the first match),
// still one row per image. Images 0 and 1 of class 0 are look-alikes (cosine 0.97); image 2
// has image 1's bytes but an embedding closer to image 0's (cosine 0.999 to 0, 0.98 to 1):
// the bytes decide.
TEST(CleanAudit, NearDuplicatePairsACopyWithWhatItCopies) {
  TempDir dir;
  const int64_t e = 8;
  const at::Tensor centres = torch::eye(e).narrow(0, 0, 2);
  at::Tensor a = torch::zeros({e}), b = torch::zeros({e}), c = torch::zeros({e}), d = torch::zeros({e});
  a[0] = 1;
  b[0] = 0.97f, b[1] = std::sqrt(1 - 0.97f * 0.97f);
  c[0] = 0.999f, c[1] = std::sqrt(1 - 0.999f * 0.999f);
  // d: image 3, of class 1, a look-alike of nothing.
  d[4] = 1;
  const at::Tensor emb = torch::stack({a, b, c, d});
  {
    CleanAudit audit(centres, 2, 1, {}, torch::kCPU, dir.path, [](int64_t i) { return "img " + std::to_string(i); });
    audit.add(emb, {0, 0, 0, 1}, {0, 1, 2, 3}, {11, 22, 22, 44});
    audit.write_reports({}, {});
  }
  std::set<std::tuple<int64_t, int64_t, std::string>> rows;
  for (const auto& r : read_tsv(dir / "near_duplicates.tsv").rows)
    rows.insert({std::stoll(r.at("index_a")), std::stoll(r.at("index_b")), r.at("identical_bytes")});
  const std::set<std::tuple<int64_t, int64_t, std::string>> want = {{0, 1, "no"}, {1, 2, "yes"}};
  EXPECT_EQ(rows, want);
}

// A failure half-way leaves the reports of an earlier run as they were, and no partial file.
TEST(CleanAudit, FailureKeepsEarlierReports) {
  TempDir dir;
  testing::spit(dir / "mislabeled.tsv", {'o', 'l', 'd'});
  const at::Tensor centres = torch::eye(4).narrow(1, 0, 4);
  try {
    CleanAudit audit(centres, 4, 1, {}, torch::kCPU, dir.path, [](int64_t i) { return "img " + std::to_string(i); });
    audit.add(torch::eye(4).narrow(0, 0, 2), {0, 1}, {0, 1}, {1, 2});
    audit.add(torch::eye(4).narrow(0, 2, 2), {2, 9}, {2, 3}, {3, 4});
    FAIL() << "a label outside the run's classes was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("img 3: label 9 is not one of the run's 4 classes"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(testing::slurp(dir / "mislabeled.tsv"), (std::vector<uint8_t>{'o', 'l', 'd'}));
  int64_t files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path)) ++files, (void)e;
  EXPECT_EQ(files, 1);
}

TEST(CleanAudit, BinIdentitiesJoinGenuinePairsAndIdenticalImages) {
  // pairs: (0,1) same, (2,3) different, (4,5) same, (6,7) different; image 4 is image 0's bytes.
  const std::vector<uint64_t> h = {10, 11, 12, 13, 10, 15, 16, 17};
  const auto groups = bin_identities(h, {true, false, true, false});
  const std::vector<std::vector<int64_t>> expected = {{0, 1, 4, 5}, {2}, {3}, {6}, {7}};
  EXPECT_EQ(groups, expected);
}


// pack clean's plan from hand-written reports (the numbers chosen so that each rule decides
// one row): with --merge, a mislabeled image whose "relabel C" names a class of its own
// merged identity is kept (one person under two labels), any other is dropped; pairs that
// chain into an identity of more than two classes are named.
TEST(CleanPack, MergedTwinsKeepTheirImagesAndChainsAreNamed) {
  TempDir dir;
  auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir.path + "/" + name) << text;
  };
  write("mislabeled.tsv",
        "# hand\nindex\timage\tlabel\tangle_deg\tnearest_class\tsuggestion\n"
        "10\tx\t1\t80\t2\trelabel 2\n"    // twin of 1: kept with --merge
        "11\tx\t1\t80\t3\trelabel 3\n"    // another person: dropped
        "12\tx\t4\t80\t3\trelabel 3\n"    // 3 and 4 merge: kept
        "13\tx\t6\t80\t7\tdrop\n"         // far from every centre: dropped
        "14\tx\t2\t80\t7\trelabel 7\n");  // 2 and 7 in one chain: kept
  write("duplicate_identities.tsv", "# hand\nclass_a\tclass_b\n1\t2\n5\t2\n7\t5\n3\t4\n");
  write("near_duplicates.tsv", "# hand\nindex_a\tindex_b\n0\t1\n");
  write("overlap.tsv", "# hand\nset\tclass\n");
  CleanPackOptions o;
  o.merge_identities = true;
  const CleanPlan merged = plan_from_reports(dir.path, 20, 9, o);
  EXPECT_EQ(merged.kept_mislabeled_merged, 3u);
  EXPECT_EQ(merged.dropped_mislabeled, 2u);
  for (int64_t i : {10, 12, 14}) EXPECT_FALSE(merged.drop[size_t(i)]) << "image " << i;
  for (int64_t i : {11, 13}) EXPECT_TRUE(merged.drop[size_t(i)]) << "image " << i;
  EXPECT_EQ(merged.merged_classes, 4);
  ASSERT_EQ(merged.merge_chains.size(), 1u);
  EXPECT_EQ(merged.merge_chains[0], (std::vector<int64_t>{1, 2, 5, 7}));
  EXPECT_EQ(merged.merge_into[7], 1);
  EXPECT_EQ(merged.merge_into[4], 3);
  // Without --merge every mislabeled row is dropped and nothing is merged.
  const CleanPlan plain = plan_from_reports(dir.path, 20, 9, CleanPackOptions{});
  EXPECT_EQ(plain.kept_mislabeled_merged, 0u);
  EXPECT_EQ(plain.dropped_mislabeled, 5u);
  EXPECT_TRUE(plain.merge_chains.empty());
  // A report without the label and suggestion columns still applies (every row dropped).
  write("mislabeled.tsv", "# hand\nindex\timage\n10\tx\n");
  EXPECT_EQ(plan_from_reports(dir.path, 20, 9, o).dropped_mislabeled, 1u);
}

}  // namespace
}  // namespace faceshard
