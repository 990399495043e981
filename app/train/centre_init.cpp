#include "app/train/centre_init.h"

#include <algorithm>
#include <numeric>

#include "app/clean/dominant_subcenters.h"
#include "app/io/resharded_rows.h"
#include "app/train/run_folder.h"
#include "data/source_classes.h"
#include "data/source_paths.h"
#include "base/error.h"

namespace faceshard {

namespace {

constexpr const char* kKey = "loss.init_centres";

int64_t saved_subcenters_of(const CheckpointInfo& info) {
  if (info.num_classes < 1) throw usage_error(kKey, " '", info.path, "': the checkpoint has no classes");
  return ReshardedRows(info, 0, 1, 0).subcenters();
}

}  // namespace

CentreInitPlan plan_centre_init(const Config& cfg, int64_t num_classes, int64_t subcenters) {
  CentreInitPlan p;
  p.checkpoint = read_checkpoint_info(resolve_checkpoint_source(*cfg.loss.init_centres, kKey));
  const CheckpointInfo& ck = p.checkpoint;
  p.saved_subcenters = saved_subcenters_of(ck);
  p.subcenters = subcenters;
  const int64_t K = p.saved_subcenters;
  const bool dropping = K > 1 && subcenters == 1;
  if (!dropping && K != subcenters)
    throw usage_error(kKey, " '", ck.path, "': saved with ", K, " sub-centres per class, this run has loss.subcenters ",
                      subcenters, ": a run starts from centres with the same K, or with K = 1 from K > 1 (each class's "
                      "dominant sub-centre kept)");
  // Each class's dominant sub-centre, from the report of this very checkpoint.
  DominantSubcenters dom;
  if (dropping) {
    if (!cfg.loss.init_centres_report)
      throw usage_error(kKey, " '", ck.path, "': saved with ", K, " sub-centres per class, this run has 1: set "
                        "loss.init_centres_report to faceshard-clean's --output folder of that checkpoint (its "
                        "dropped_subcenters.tsv names each class's dominant sub-centre)");
    dom = read_dominant_subcenters(*cfg.loss.init_centres_report, ck.num_classes, K);
    if (dom.step >= 0 && dom.step != ck.step)
      throw usage_error(dom.file, ": made of step ", dom.step, ", ", kKey, " is step ", ck.step, " ('", ck.path,
                        "'): give the checkpoint the report audited, or audit this one");
  } else if (cfg.loss.init_centres_report) {
    throw usage_error("loss.init_centres_report: '", ck.path, "' has ", K, K == 1 ? " centre" : " sub-centres",
                      " per class, as this run: all are kept, there is no dominant one to choose (unset it)");
  }
  // Which class is which.
  const std::string rec = cfg.data.rec + "/train.rec";
  const auto table = source_classes_beside(rec, num_classes, ck.num_classes);
  std::vector<std::vector<int64_t>> sources;
  if (table) {
    sources = *table;
    p.mapping = "classes matched by '" + labels_path_of(rec) + "' (source_classes)";
  } else {
    if (num_classes != ck.num_classes)
      throw usage_error(kKey, " '", ck.path, "': the checkpoint has ", ck.num_classes, " classes, this run's data ",
                        num_classes, ", and nothing says which is which (no faceshard-pack clean labels.tsv with "
                        "source_classes beside '", rec, "')");
    sources.resize(size_t(num_classes));
    for (int64_t c = 0; c < num_classes; ++c) sources[size_t(c)] = {c};
    p.mapping = "the same classes";
  }
  p.source.resize(size_t(num_classes));
  if (dropping) p.subcenter.resize(size_t(num_classes));
  for (int64_t c = 0; c < num_classes; ++c) {
    const std::vector<int64_t>& s = sources[size_t(c)];
    if (s.empty()) throw usage_error(labels_path_of(rec), ": class ", c, " names no source class");
    int64_t best = s.front();
    if (dropping)
      for (int64_t x : s)
        if (dom.images[size_t(x)] > dom.images[size_t(best)]) best = x;
    p.merged += s.size() > 1;
    p.source[size_t(c)] = best;
    if (dropping) {
      const int64_t d = dom.dominant[size_t(best)];
      p.without_images += d < 0;
      p.subcenter[size_t(c)] = std::max<int64_t>(d, 0);
    }
  }
  return p;
}

void init_centres(PartialFC& fc, const CentreInitPlan& p) {
  const int64_t K = p.saved_subcenters, start = fc.shard().start, count = fc.shard().count;
  const int64_t E = fc.options().embedding_size, take = p.subcenter.empty() ? K : 1;
  // This rank's classes by source class: a window of source classes is read at once (64 MB of
  // fp32 rows at most), and the rows of its classes are copied from it.
  std::vector<int64_t> order(static_cast<size_t>(count));
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](int64_t a, int64_t b) { return p.source[size_t(start + a)] < p.source[size_t(start + b)]; });
  const int64_t window = std::max<int64_t>(1, (int64_t(64) << 20) / (K * E * 4));
  fc.fill_state([&](const std::string& name, const at::Tensor& rows) {
    if (name != "weight") {
      rows.zero_();  // the optimiser state of a fresh classifier
      return;
    }
    for (size_t i = 0; i < order.size();) {
      const int64_t a = p.source[size_t(start + order[i])];
      const int64_t n = std::min(window, p.checkpoint.num_classes - a);
      const ReshardedRows saved(p.checkpoint, a, n, K);
      const at::Tensor buf = at::empty({n * K, E}, at::kFloat);
      saved.read_into("weight", buf);
      std::vector<int64_t> from, to;
      for (; i < order.size() && p.source[size_t(start + order[i])] < a + n; ++i) {
        const int64_t c = start + order[i], s = p.source[size_t(c)] - a;
        for (int64_t k = 0; k < take; ++k) {
          from.push_back(s * K + (p.subcenter.empty() ? k : p.subcenter[size_t(c)]));
          to.push_back(order[i] * take + k);
        }
      }
      const at::Tensor picked = buf.index_select(0, torch::tensor(from, at::kLong));
      rows.index_copy_(0, torch::tensor(to, at::kLong).to(rows.device()), picked.to(rows.device(), rows.scalar_type()));
    }
  });
}

std::string describe(const CentreInitPlan& p) {
  std::string s = std::string(kKey) + ": " + std::to_string(p.source.size()) + " classes' centres from '" +
                  p.checkpoint.path + "' (step " + std::to_string(p.checkpoint.step) + ", " + p.mapping;
  if (p.merged) s += ", " + std::to_string(p.merged) + " of them merged from several";
  if (!p.subcenter.empty())
    s += "; of its " + std::to_string(p.saved_subcenters) + " sub-centres per class each keeps its dominant one" +
         (p.without_images ? " (" + std::to_string(p.without_images) +
                                 " classes of which the report saw no image: sub-centre 0)"
                           : std::string());
  else if (p.saved_subcenters > 1)
    s += "; all " + std::to_string(p.saved_subcenters) + " sub-centres per class";
  return s + "); their optimiser state starts at zero";
}

}  // namespace faceshard
