#include "app/eval/ijb.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <system_error>
#include <sstream>


#include "base/error.h"

namespace faceshard {

at::Tensor ijb_template_features(const at::Tensor& image_features, const IjbMeta& meta,
                                 std::vector<int64_t>* unique_templates, bool use_faceness) {
  const int64_t n = image_features.size(0), e = image_features.size(1);
  if (n != int64_t(meta.templates.size())) throw runtime_error("IJB: ", n, " features for ", meta.templates.size(), " images");
  at::Tensor f = image_features.to(at::kDouble).contiguous();
  if (use_faceness) {
    at::Tensor s = at::from_blob(const_cast<double*>(meta.faceness.data()), {n, 1}, at::kDouble);
    f = f * s;
  }
  // template -> media -> image rows
  std::map<int64_t, std::map<int64_t, std::vector<int64_t>>> groups;
  for (int64_t i = 0; i < n; ++i) groups[meta.templates[size_t(i)]][meta.medias[size_t(i)]].push_back(i);
  at::Tensor out = at::zeros({int64_t(groups.size()), e}, at::kDouble);
  unique_templates->clear();
  int64_t t = 0;
  for (const auto& tg : groups) {
    unique_templates->push_back(tg.first);
    at::Tensor acc = out[t];
    for (const auto& mg : tg.second) {
      at::Tensor rows = at::from_blob(const_cast<int64_t*>(mg.second.data()), {int64_t(mg.second.size())}, at::kLong);
      acc.add_(f.index_select(0, rows).mean(0));
    }
    ++t;
  }
  const at::Tensor norm = out.norm(2, 1, true).clamp_min(1e-12);  // sklearn.preprocessing.normalize
  return out / norm;
}

std::vector<double> ijb_pair_scores(const at::Tensor& template_features, const std::vector<int64_t>& unique_templates,
                                    const IjbMeta& meta) {
  std::map<int64_t, int64_t> row;
  for (size_t i = 0; i < unique_templates.size(); ++i) row[unique_templates[i]] = int64_t(i);
  const size_t p = meta.pair_t1.size();
  std::vector<int64_t> a(p), b(p);
  for (size_t i = 0; i < p; ++i) {
    auto ia = row.find(meta.pair_t1[i]), ib = row.find(meta.pair_t2[i]);
    if (ia == row.end() || ib == row.end())
      throw usage_error("IJB template pair ", i + 1, ": template ", ia == row.end() ? meta.pair_t1[i] : meta.pair_t2[i],
                        " has no images in the image list");
    a[i] = ia->second;
    b[i] = ib->second;
  }
  // In chunks, as insightface does (it takes 100k pairs at a time): IJB-C's 15.7M pairs
  // at once would take two P x E double arrays and their product (~190 GB at E = 512).
  const at::Tensor f = template_features.to(at::kDouble).contiguous();
  std::vector<double> scores(p);
  constexpr int64_t kChunk = 1 << 15;
  for (int64_t s = 0; s < int64_t(p); s += kChunk) {
    const int64_t c = std::min<int64_t>(kChunk, int64_t(p) - s);
    const at::Tensor fa = f.index_select(0, at::from_blob(a.data() + s, {c}, at::kLong));
    const at::Tensor fb = f.index_select(0, at::from_blob(b.data() + s, {c}, at::kLong));
    at::Tensor out = at::from_blob(scores.data() + s, {c}, at::kDouble);
    at::sum_out(out, fa * fb, {1});
  }
  return scores;
}

void check_ijb_images(const IjbMeta& meta, const std::string& crops_dir) {
  const std::string lmk_path = "meta/" + [&] {
    std::string t = meta.target;
    for (auto& c : t) c = char(std::tolower(static_cast<unsigned char>(c)));
    return t;
  }() + "_name_5pts_score.txt";
  for (size_t i = 0; i < meta.images.size(); ++i) {
    const std::filesystem::path path = std::filesystem::path(crops_dir) / meta.images[i];
    std::error_code ec;
    if (!std::filesystem::is_regular_file(path, ec))
      throw usage_error(path.string(), ": cannot open image (", ec ? ec.message() : std::string("not a regular file"),
                        "; listed at ", lmk_path, ":", i < meta.image_lines.size() ? meta.image_lines[i] : i + 1, ")");
  }
}

}  // namespace faceshard
