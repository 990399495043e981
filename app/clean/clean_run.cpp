#include "app/clean/clean_run.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <opencv2/imgproc.hpp>

#include "app/eval/embedding_cache.h"
#include "app/eval/evaluation.h"
#include "app/eval/eval_flags.h"
#include "app/io/checkpoint.h"
#include "app/io/resharded_rows.h"
#include "base/error.h"
#include "base/log.h"
#include "base/progress.h"
#include "data/dataset.h"
#include "data/image_transform.h"
#include "data/set_identity.h"
#include "data/source_paths.h"

namespace faceshard {
namespace fs = std::filesystem;
namespace {

double since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// The checkpoint folder of --run: the folder itself, or the newest committed one of a run.
std::string checkpoint_dir(const std::string& run) {
  if (!fs::exists(run)) throw usage_error("--run: '", run, "' does not exist");
  if (fs::exists(fs::path(run) / "COMMITTED") || fs::exists(fs::path(run) / "backbone.pt")) return run;
  if (fs::is_directory(fs::path(run) / "checkpoints")) {
    const std::string newest = latest_checkpoint((fs::path(run) / "checkpoints").string());
    if (newest.empty()) throw usage_error("--run: '", run, "' has no committed checkpoint");
    return newest;
  }
  throw usage_error("--run: '", run, "' is neither a run folder (with checkpoints/) nor a checkpoint folder");
}

// The classifier centres of every class, [C * K, E], class-major (row = class * K + k), from
// shards saved on any number of ranks. K is the checkpoint's (rows.subcenters); `k` > 0 is
// the caller's, which must agree with it.
at::Tensor read_centres(const CheckpointInfo& ck, int64_t& k, int64_t embedding_size) {
  ReshardedRows rows(ck, 0, ck.num_classes, /*subcenters: the checkpoint's*/ 0);
  if (!rows.has("weight"))
    throw usage_error("checkpoint '", ck.path, "' holds no classifier centres (rows/weight in its fc_shard files)");
  if (k > 0 && k != rows.subcenters())
    throw usage_error("--subcenters ", k, ": checkpoint '", ck.path, "' holds ", rows.subcenters(),
                      " centres per class (loss.subcenters)");
  k = rows.subcenters();
  StateDictReader first(ck.path + "/fc_shard_0.pt");
  std::vector<int64_t> shape = first.sizes(first.find("rows/weight"));
  if (shape.size() != 2)
    throw usage_error(ck.path, ": rows/weight has rows of ", shape.size() - 1, " dimensions, expected 1");
  shape[0] = ck.num_classes * k;
  at::Tensor w = torch::empty(shape, torch::kFloat);
  rows.read_into("weight", w);
  if (w.size(1) != embedding_size)
    throw usage_error(ck.path, ": centres of ", w.size(1), " dimensions, the backbone's embeddings have ",
                      embedding_size);
  return w;
}

std::string image_list(const std::vector<int64_t>& idx) {
  std::string s = "images ";
  for (size_t i = 0; i < idx.size() && i < 8; ++i) s += (i ? "," : "") + std::to_string(idx[i]);
  if (idx.size() > 8) s += ",...";
  return s;
}

at::Tensor mean_of(const at::Tensor& emb, const std::vector<int64_t>& rows) {
  return emb.index_select(0, torch::tensor(rows, torch::kLong)).sum(0);
}

// One pass of faceshard-clean: the request's values, and what each part leaves for the next.
struct CleanPass : CleanRequest {
  explicit CleanPass(CleanRequest r) : CleanRequest(std::move(r)) {}
  // The run, the data, the test sets and the report folder: everything that can be refused,
  // checked before the long pass; then the model and the centres.
  void open();
  // The run's centres are its classes: its data_set.txt against the data given.
  void check_trained_on();
  void open_embedding_file();
  void make_audit();
  // Every image: its label, bytes and embedding into the audit (from the file, or embedded).
  void audit_from_file();
  void audit_by_embedding();
  // The test identities of the --bin sets and --test-identities.
  void embed_tests();
  CleanCounts write_reports();

  std::string step_dir, data;
  CheckpointInfo ck;
  int64_t k = 0, emb_size = 0, n = 0;
  std::vector<VerificationData> sets;
  std::unique_ptr<ImageFolderDataset> tests_ds;
  torch::Device device = torch::kCPU;
  InferenceModel model;
  at::Tensor centres;
  std::shared_ptr<Dataset> ds;
  SetIdentity data_set;
  std::unique_ptr<EmbeddingFile> emb_file;
  std::ifstream names;
  std::string names_path;
  std::unique_ptr<CleanAudit> audit;
  int64_t unreadable = 0;
  // Seconds spent reading the images (with --embeddings: their records and rows) or
  // reading, decoding and embedding them (the backbone); embedding the test sets.
  double input_s = 0, tests_s = 0;
  std::vector<TestIdentity> tests;
};

void CleanPass::open() {
  // Everything that can be refused is checked before the long pass: the run, the data,
  // the test sets and the report folder.
  step_dir = checkpoint_dir(run);
  ck = read_checkpoint_info(step_dir);
  k = subcenters;  // 0: the checkpoint's (read_centres)
  data = rec.empty() ? images : rec;
  if (!rec.empty() && !fs::exists(fs::path(rec) / "train.rec")) throw usage_error("--rec: '", rec, "' has no train.rec");
  if (!images.empty() && !fs::is_directory(images)) throw usage_error("--images: '", images, "' is not a folder");
  for (const auto& b : bins) {
    if (!fs::is_regular_file(b)) throw usage_error("--bin: '", b, "' does not exist");
    sets.push_back(load_verification_data(b));
  }
  if (!tests_dir.empty()) {
    if (!fs::is_directory(tests_dir)) throw usage_error("--test-identities: '", tests_dir, "' is not a folder");
    tests_ds = std::make_unique<ImageFolderDataset>(tests_dir);
  }
  std::error_code ec;
  fs::create_directories(output, ec);
  if (!fs::is_directory(output)) throw usage_error("--output: cannot create folder '", output, "'");
  {
    const std::string probe = output + "/.faceshard-clean.probe";
    std::ofstream f(probe);
    if (!f || !(f << "x") || !(f.flush())) throw usage_error("--output: folder '", output, "' is not writable");
    f.close();
    fs::remove(probe, ec);
  }

  device = parse_eval_device(device_name, 0);
  spec.path = step_dir;
  model = load_inference_model(spec, device);
  emb_size = model.backbone->embedding_size();
  centres = read_centres(ck, k, emb_size);
  ds = open_dataset(data);
  // The set's identity goes into every report (faceshard-pack clean applies them to it only).
  data_set = set_identity(*ds);
  check_trained_on();
  if (ds->num_classes() > ck.num_classes)
    throw usage_error(data, " has ", ds->num_classes(), " classes, the run ", ck.num_classes,
                      ": its labels are not the run's classes");
  n = limit > 0 ? std::min<int64_t>(limit, int64_t(ds->size())) : int64_t(ds->size());
  log_info("run: ", step_dir, " (step ", ck.step, ", ", ck.num_classes, " classes x ", k,
           " sub-centres, saved on ", ck.world_size, " ranks); model: ", model.description, " on ", device.str(),
           "; data: ", data, " (", n, " images)");
}

void CleanPass::check_trained_on() {
  // The run's centres are its classes: the audit means something only on the data it
  // trained on (its run folder's data_set.txt, written by faceshard-train), and labels
  // past its classes are refused now, not after the pass.
  const fs::path run_set = fs::path(step_dir).parent_path().parent_path() / "data_set.txt";
  if (fs::is_regular_file(run_set)) {
    std::ifstream f(run_set);
    std::string line;
    std::getline(f, line);
    const std::optional<SetIdentity> trained = parse_set_identity(line);
    if (!trained) throw usage_error(run_set.string(), ": not a set identity: '", faceshard::detail::printable(line), "'");
    if (trained->kind != data_set.kind) {
      // The same images in another form (a folder of the .rec it trained on) cannot be
      // compared image by image: its classes must be the run's.
      if (trained->classes != data_set.classes)
        throw usage_error(data, " has ", data_set.classes, " classes, the data the run trained on ", trained->classes,
                          " (", run_set.string(), ": ", trained->brief(), "): its labels are not the run's classes");
      log_info("the run trained on a ", trained->kind, ", ", data, " is a ", data_set.kind,
               ": taken to hold the same images (", data_set.brief(), "; the run's: ", trained->brief(), ")");
    } else if (!trained->same_as(data_set))
      throw usage_error(data, " is not the data the run trained on (", run_set.string(), ": ", trained->brief(),
                        "; ", data, ": ", data_set.brief(), "): its reports would judge other images by the run's "
                        "classes; clean a run with the data it trained on");
  } else {
    log_info("the run does not record its data (no ", run_set.string(), "): ", data,
             " is taken to be the data it trained on");
  }
}

// Embeddings from a file: checked against the set and the model before the pass.
void CleanPass::open_embedding_file() {
  if (embeddings.empty()) return;
  if (!fs::is_regular_file(embeddings) && fs::is_regular_file(embeddings + ".npy")) embeddings += ".npy";
  emb_file = std::make_unique<EmbeddingFile>(embeddings);
  if (emb_file->rows() != int64_t(ds->size()))
    throw usage_error("--embeddings: '", embeddings, "' has ", emb_file->rows(), " rows, ", data, " has ",
                      ds->size(), " images");
  if (emb_file->cols() != emb_size)
    throw usage_error("--embeddings: '", embeddings, "' has rows of ", emb_file->cols(),
                      " dimensions, the run's embeddings have ", emb_size);
  names_path = embeddings.size() > 4 && embeddings.compare(embeddings.size() - 4, 4, ".npy") == 0
                   ? embeddings.substr(0, embeddings.size() - 4) + ".txt"
                   : embeddings + ".txt";
  if (fs::is_regular_file(names_path)) {
    std::ifstream count(names_path);
    int64_t lines = 0;
    for (std::string l; std::getline(count, l);) ++lines;
    if (lines != emb_file->rows())
      throw usage_error("--embeddings: '", names_path, "' names ", lines, " images, '", embeddings, "' has ",
                        emb_file->rows(), " rows");
    names.open(names_path);
  } else {
    names_path.clear();
  }
}

void CleanPass::make_audit() {
  // A packed set names each image by the photo it was packed from, where pack's sources
  // list is beside the .rec (data/source_paths.h); otherwise by its record.
  std::shared_ptr<const SourcePaths> sources;
  if (const auto* rec = dynamic_cast<const RecordIODataset*>(ds.get()))
    if ((sources = SourcePaths::open_beside(rec->records().file().path(), ds->size()))) {
      log_info("the reports name each image by the photo it was packed from (", sources->file(), ")");
    }
  audit = std::make_unique<CleanAudit>(centres, ck.num_classes, k, t, device, output, [ds = ds, sources](int64_t i) {
    return sources ? sources->path(uint64_t(i)) : ds->describe(uint64_t(i));
  });
}

void CleanPass::audit_from_file() {
  // The file's row i is image i: its label and bytes from the set, its embedding from the
  // row (unit length as faceshard-extract writes it; rows of --no-normalize files are
  // normalised here, unit rows are used as they are so that the reports are those of
  // the images embedded here).
  Progress bar("cleaning", uint64_t(n), "images");
  for (int64_t s = 0; s < n; s += chunk) {
    const int64_t nb = std::min(chunk, n - s);
    std::vector<int64_t> labels, idx;
    std::vector<uint64_t> hashes;
    std::vector<int64_t> keep;
    const auto t_in = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < nb; ++i) {
      std::string line;
      if (!names_path.empty()) {
        std::getline(names, line);
        if (!line.empty() && line.back() == '\r') line.pop_back();
      }
      RawSample r;
      try {
        ds->read(uint64_t(s + i), r);
      } catch (const LabelError&) {
        throw;
      } catch (const std::exception& e) {
        if (unreadable++ < 10) log_warn("left out: ", e.what());
        continue;
      }
      if (!names_path.empty()) {
        const std::string d = ds->describe(uint64_t(s + i));
        const std::string want = rec.empty() ? d : std::to_string(s + i) + " " + std::to_string(r.label);
        // faceshard-extract names a .rec's rows "<index> <label>" and a folder's images by
        // their path under the folder.
        const bool same = rec.empty() ? line.size() < d.size() && d[d.size() - line.size() - 1] == '/' &&
                                            d.compare(d.size() - line.size(), line.size(), line) == 0
                                      : line == want;
        if (!same)
          throw usage_error("--embeddings: '", names_path, "' line ", s + i + 1, " is '", faceshard::detail::printable(line),
                            "', image ", s + i, " of ", data, " is '", want, "' (embeddings of another set or order)");
      }
      keep.push_back(i);
      labels.push_back(r.label);
      idx.push_back(s + i);
      hashes.push_back(bytes_hash(r.bytes.data(), r.bytes.size()));
    }
    if (keep.empty()) {
      bar.update(uint64_t(s + nb));
      continue;
    }
    at::Tensor emb = emb_file->read(s, nb);
    // The file is untrusted: a row of NaN or inf would make every cosine of its image NaN.
    if (const at::Tensor bad = (~torch::isfinite(emb)).any(1).nonzero(); bad.numel() > 0)
      throw usage_error("--embeddings: '", embeddings, "' row ", s + bad[0][0].item<int64_t>(),
                        " holds a value that is not finite");
    if (int64_t(keep.size()) != nb) emb = emb.index_select(0, torch::tensor(keep, torch::kLong));
    const at::Tensor norm = emb.norm(2, {1}, true);
    if ((norm - 1).abs().max().item<float>() > 1e-4f) emb = emb / norm.clamp_min(1e-12);
    input_s += since(t_in);
    audit->add(emb, labels, idx, hashes);
    bar.update(uint64_t(s + nb));
  }
}

void CleanPass::audit_by_embedding() {
  Progress bar("cleaning", uint64_t(n), "images");
  for (int64_t s = 0; s < n; s += chunk) {
    const int64_t nb = std::min(chunk, n - s);
    std::vector<int64_t> labels(size_t(nb), -1), idx(static_cast<size_t>(nb));
    std::vector<uint64_t> hashes(size_t(nb), 0);
    std::vector<std::string> bad(static_cast<size_t>(nb));
    // An image that cannot be read or decoded is left out (and named), not the whole pass.
    const ImageSource load = [&](int64_t i) {
      try {
        RawSample r;
        ds->read(uint64_t(s + i), r);
        labels[size_t(i)] = r.label;
        hashes[size_t(i)] = bytes_hash(r.bytes.data(), r.bytes.size());
        if (ds->raw_pixels()) {
          cv::Mat rgb(ds->raw_size(), ds->raw_size(), CV_8UC3, r.bytes.data()), bgr;
          cv::cvtColor(rgb, bgr, cv::COLOR_RGB2BGR);
          return bgr;
        }
        return decode_image(r.bytes.data(), r.bytes.size(), ds->describe(uint64_t(s + i)));
      } catch (const LabelError&) {
        throw;
      } catch (const std::exception& e) {
        bad[size_t(i)] = e.what();
        return cv::Mat(112, 112, CV_8UC3, cv::Scalar(0, 0, 0));
      }
    };
    const auto t_in = std::chrono::steady_clock::now();
    at::Tensor emb = embed_images(*model.backbone, nb, load, batch, device, flip, true, false);
    input_s += since(t_in);
    std::vector<int64_t> keep;
    for (int64_t i = 0; i < nb; ++i) {
      idx[size_t(i)] = s + i;
      if (bad[size_t(i)].empty()) {
        keep.push_back(i);
      } else if (unreadable++ < 10) {
        log_warn("left out: ", bad[size_t(i)]);
      }
    }
    if (int64_t(keep.size()) != nb) {
      std::vector<int64_t> l2, i2;
      std::vector<uint64_t> h2;
      for (int64_t i : keep) l2.push_back(labels[size_t(i)]), i2.push_back(idx[size_t(i)]), h2.push_back(hashes[size_t(i)]);
      emb = emb.index_select(0, torch::tensor(keep, torch::kLong));
      labels = l2, idx = i2, hashes = h2;
    }
    audit->add(emb, labels, idx, hashes);
    bar.update(uint64_t(s + nb));
  }
}

void CleanPass::embed_tests() {
  const auto t_tests = std::chrono::steady_clock::now();
  // A test set's embeddings are the same on every pass over one run (the calibration
  // recipe's): kept in the embedding cache (app/eval/embedding_cache.h).
  const EmbeddingCache cache(EmbeddingCache::default_dir());
  std::string committed;
  {
    std::ifstream c(step_dir + "/COMMITTED");
    committed.assign(std::istreambuf_iterator<char>(c), std::istreambuf_iterator<char>());
  }
  for (const VerificationData& set : sets) {
    const std::string stamp = EmbeddingCache::file_stamp(set.path);
    const std::string key =
        EmbeddingCache::key({"faceshard-clean test set", fs::absolute(step_dir).lexically_normal().string(), committed,
                             stamp, "flip", spec.precision, device.is_cuda() ? "cuda" : "cpu"});
    at::Tensor emb;
    const auto t_set = std::chrono::steady_clock::now();
    if (std::optional<at::Tensor> hit =
            stamp.empty() ? std::nullopt : cache.find(key, int64_t(set.images.size()), emb_size)) {
      emb = *hit;
      log_info("test set ", set.name, ": embeddings from the cache, made on an earlier pass with this run and file (",
               EmbeddingCache::default_dir(), "; FACESHARD_EMBEDDING_CACHE=off embeds again)");
    } else {
      emb = embed_with_flip(*model.backbone, set, batch, device).cpu();
      std::string problem;
      if (!stamp.empty() && cache.enabled() && !cache.put(key, emb, &problem))
        log_warn("test set ", set.name, ": its embeddings are not kept for the next pass (", problem, ")");
      log_info("test set ", set.name, ": ", set.images.size(), " images embedded in ", format_sig(since(t_set)), " s",
               cache.enabled() && !stamp.empty() ? " (kept for the next pass)" : "");
    }
    std::vector<uint64_t> hashes;
    for (const auto& img : set.images) hashes.push_back(bytes_hash(img.data(), img.size()));
    for (const auto& group : bin_identities(hashes, set.issame))
      tests.push_back({set.name, image_list(group), int64_t(group.size()), mean_of(emb, group)});
  }
  if (tests_ds) {
    const ImageFolderDataset& td = *tests_ds;
    const at::Tensor emb = embed_images(
        *model.backbone, int64_t(td.size()),
        [&td](int64_t i) {
          RawSample r;
          td.read(uint64_t(i), r);
          return decode_image(r.bytes.data(), r.bytes.size(), td.describe(uint64_t(i)));
        },
        batch, device, flip, true, false);
    std::vector<std::vector<int64_t>> groups(td.class_names().size());
    for (uint64_t i = 0; i < td.size(); ++i) groups[size_t(td.label(i))].push_back(int64_t(i));
    for (size_t c = 0; c < groups.size(); ++c)
      if (!groups[c].empty()) tests.push_back({tests_dir, td.class_names()[c], int64_t(groups[c].size()), mean_of(emb, groups[c])});
  }
  tests_s = since(t_tests);
}

CleanCounts CleanPass::write_reports() {
  std::vector<std::string> header = {
      "run: " + step_dir + " (step " + std::to_string(ck.step) + ", saved on " + std::to_string(ck.world_size) +
          " ranks)",
      "model: " + model.description,
      "data: " + data + (unreadable ? " (" + std::to_string(unreadable) + " unreadable images left out)" : ""),
      "set: " + data_set.text()};
  if (emb_file) header.push_back("embeddings: " + embeddings);
  for (const auto& set : sets) header.push_back("test set: " + set.path);
  if (tests_ds) header.push_back("test identities: " + tests_dir);
  const CleanCounts c = audit->write_reports(header, tests);
  log_info("thresholds: --mislabeled-angle ", format_sig(c.mislabeled_angle, 4), " degrees from ", c.mislabeled_from);
  log_info("thresholds: --identity-cos ", format_sig(c.identity_cos, 4), " from ", c.identity_from);
  log_info("thresholds: --overlap-cos ", format_sig(c.overlap_cos, 4), " from ", c.overlap_from);
  log_info("wrote ", output, ": ", c.mislabeled, " mislabeled images, ", c.duplicate_identities,
           " duplicate identity pairs, ", c.overlap, " overlapping identities, ", c.near_duplicates,
           " near-duplicate pairs", k > 1 ? ", " + std::to_string(c.dropped_subcenters) + " dropped sub-centres" : "",
           " (", c.images, " images)");
  log_info("time: ", emb_file ? "reading the images and embeddings " : "reading and embedding the images ",
           format_sig(input_s), " s, ",
           sets.empty() && !tests_ds ? std::string() : "embedding the test sets " + format_sig(tests_s) + " s, ",
           "nearest centres ", format_sig(c.centre_s), " s, near duplicates ", format_sig(c.near_duplicate_s),
           " s, reports ", format_sig(c.reports_s), " s");
  return c;
}

}  // namespace

void check_clean_request(const CleanRequest& r) {
  const CleanThresholds& t = r.t;
  const std::string &run = r.run, &rec = r.rec, &images = r.images, &output = r.output;
  if (run.empty()) throw usage_error("--run is required (see --help)");
  if (rec.empty() == images.empty()) throw usage_error("give exactly one of --rec, --images (see --help)");
  if (output.empty()) throw usage_error("--output DIR is required (see --help)");
  if (t.mislabeled_angle <= 0 || t.mislabeled_angle >= 180)
    throw usage_error("--mislabeled-angle: expected degrees in (0, 180), got ", t.mislabeled_angle);
  for (const auto& [flag, v] : {std::pair<const char*, double>{"--identity-cos", t.identity_cos},
                                {"--overlap-cos", t.overlap_cos}, {"--near-duplicate-cos", t.near_duplicate_cos}})
    if (!(v > -1 && v <= 1)) throw usage_error(flag, ": expected a cosine in (-1, 1], got ", v);
  if (!(t.mislabeled_rate > 0 && t.mislabeled_rate < 0.5))
    throw usage_error("--mislabeled-rate: expected a rate in (0, 0.5), got ", t.mislabeled_rate);
  if (!(t.false_pairs > 0 && std::isfinite(t.false_pairs)))
    throw usage_error("--false-pairs: expected a positive number of pairs, got ", t.false_pairs);
  if (t.identity_by != "means" && t.identity_by != "centres")
    throw usage_error("--identity-by: expected means or centres, got '", t.identity_by, "'");
}

CleanCounts run_clean(const CleanRequest& request) {
  check_clean_request(request);
  CleanPass pass(request);
  pass.open();
  pass.open_embedding_file();
  pass.make_audit();
  if (pass.emb_file) pass.audit_from_file();
  else pass.audit_by_embedding();
  pass.embed_tests();
  return pass.write_reports();
}

}  // namespace faceshard
