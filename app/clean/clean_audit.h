// The label audit behind faceshard-clean: the embeddings of a training set's images, fed a
// chunk at a time, are compared with the trained classifier's centres (K sub-centres per
// class) and with each other, and turned into TSV reports: mislabeled images, duplicate
// identities, overlap with test identities, near-duplicate images, non-dominant sub-centres.
// Memory does not grow with the number of images: what is kept is per class (the centres,
// one embedding sum and one count per sub-centre) plus a near-duplicate buffer of bounded
// size; per-image results go to a scratch file in the report folder and are read back once.
#pragma once
#include <cstdint>
#include <cstdio>
#include <functional>
#include <list>
#include <string>
#include <unordered_map>
#include <vector>

#include <torch/torch.h>

namespace faceshard {

struct CleanThresholds {
  // Sub-center ArcFace (Deng et al., ECCV 2020) drops the samples farther than 75 degrees
  // from their class's dominant sub-centre.
  double mislabeled_angle = 75;
  // Two classes are one person under two labels when their identity vectors (see
  // identity_by) have a cosine above this.
  double identity_cos = 0.6;
  // A test identity (its images' mean embedding) is in the training set when its cosine
  // with a class's identity vector is above this.
  double overlap_cos = 0.5;
  // Two images are the same picture stored twice when their embeddings' cosine is above
  // this (or their bytes are identical).
  double near_duplicate_cos = 0.95;
  // "means": a class's identity vector is the mean embedding of the images nearest its
  // dominant sub-centre; "centres": the dominant sub-centre itself.
  std::string identity_by = "means";
  // Bound on the embeddings kept for the near-duplicate search (MiB).
  int64_t near_duplicate_memory_mb = 1024;
  // The defaults of the three above come from the set (tail_threshold.h) unless given: the
  // mislabeled angle from the cosines of images to classes they are not filed under (an
  // image no nearer its own class's dominant centre than `mislabeled_rate` of those reach),
  // the identity and overlap cosines from the cosines between classes, and between test
  // identities and classes, so that `false_pairs` pairs of different people are expected
  // above each. The fixed values above are the ones given (or, where the set has too few
  // pairs to fit, the published ones).
  bool mislabeled_given = false, identity_given = false, overlap_given = false;
  double mislabeled_rate = 1e-3;
  double false_pairs = 0.1;
};

// A test identity for the overlap report: its images' mean embedding, L2-normalised.
struct TestIdentity {
  std::string set;     // "lfw", or the folder of test identities
  std::string name;    // "images 0,1,5" or the identity's folder name
  int64_t images = 0;
  at::Tensor embedding;  // [E] float
};

struct CleanCounts {
  int64_t images = 0, mislabeled = 0, duplicate_identities = 0, overlap = 0, near_duplicates = 0,
          dropped_subcenters = 0;
  // Classes whose near-duplicate buffer was evicted and whose images came back later (their
  // images before and after the eviction were not compared).
  int64_t classes_seen_after_eviction = 0;
  // Where the time went (seconds): the nearest-centre search with the sums and the scratch
  // records, the near-duplicate search, and write_reports (pairs of classes, overlap, files).
  double centre_s = 0, near_duplicate_s = 0, reports_s = 0;
  // The thresholds used, each with where it came from (a flag, or the data: tail_threshold.h).
  double mislabeled_angle = 0, identity_cos = 0, overlap_cos = 0;
  std::string mislabeled_from, identity_from, overlap_from;
};

class CleanAudit {
 public:
  // centres: [num_classes * subcenters, E], class-major (row = class * K + k), any dtype,
  // normalised here and kept on `device`. folder: the report folder (must exist and be
  // writable); reports are written as <name>.partial and renamed only by write_reports.
  // describe(index) names an image in the reports (its path, or "<rec> key N").
  CleanAudit(const at::Tensor& centres, int64_t num_classes, int64_t subcenters, CleanThresholds thresholds,
             torch::Device device, std::string folder, std::function<std::string(int64_t)> describe,
             int64_t centre_chunk_rows = int64_t(1) << 16);
  ~CleanAudit();
  CleanAudit(const CleanAudit&) = delete;
  CleanAudit& operator=(const CleanAudit&) = delete;

  // One chunk of images: L2-normalised embeddings [b, E] (float, any device), their labels,
  // their indices in the data set (increasing over the calls) and a hash of their bytes
  // (0: unknown). A label outside [0, num_classes) is a usage error naming the image.
  void add(const at::Tensor& embeddings, const std::vector<int64_t>& labels, const std::vector<int64_t>& indices,
           const std::vector<uint64_t>& hashes);

  // Writes every report (each header: `header` lines, then the report's thresholds), then
  // renames them all into place; on failure nothing is renamed and the .partial files go.
  CleanCounts write_reports(const std::vector<std::string>& header, const std::vector<TestIdentity>& tests);

  // The dominant sub-centre of each class (valid after write_reports or dominant()).
  std::vector<int64_t> dominant() const;
  int64_t subcenters() const { return k_; }

 private:
  struct Buffer {
    std::vector<float> emb;
    std::vector<int64_t> index, label;
    std::vector<uint64_t> hash;
    std::list<int64_t>::iterator lru;
  };
  void near_duplicates(const float* e, int64_t index, int64_t label, int64_t other, uint64_t hash);
  // The image's best match among a buffer's images, kept in `best` when better than it:
  // identical bytes first, then the highest cosine at or above the threshold.
  struct NearMatch {
    const Buffer* buf = nullptr;
    size_t j = 0;
    double cos = -2;
    bool same = false;
  };
  void best_match(const Buffer& buf, const float* e, uint64_t hash, NearMatch& best) const;
  at::Tensor identity_vectors(const std::vector<int64_t>& dom) const;
  std::FILE* open_partial(const std::string& name);
  // write_reports' parts: the thresholds not given, fitted from the data; then one function
  // per report, each written to its .partial file; then the names taken together.
  struct ReportPass {
    std::string head;                  // the reports' shared header lines
    std::vector<int64_t> dom;          // per class, its dominant sub-centre
    std::vector<int64_t> class_images; // per class, its images
    at::Tensor id;                     // [C, E] identity vectors (identity_vectors)
  };
  void fit_mislabeled_threshold(CleanCounts& n);
  void fit_identity_threshold(CleanCounts& n, const at::Tensor& id, const std::vector<int64_t>& live);
  void fit_overlap_threshold(CleanCounts& n, const at::Tensor& id, const std::vector<int64_t>& live,
                             const std::vector<TestIdentity>& tests);
  std::FILE* begin_report(const std::string& head, const std::string& name, const std::string& what,
                          const std::string& thresholds, const std::string& columns);
  void end_report(std::FILE*& f, const std::string& name);
  void write_mislabeled(const ReportPass& rp, CleanCounts& n);
  void write_dropped_subcenters(const ReportPass& rp, CleanCounts& n);
  void write_duplicate_identities(const ReportPass& rp, CleanCounts& n);
  void write_overlap(const ReportPass& rp, const std::vector<TestIdentity>& tests, CleanCounts& n);
  void write_near_duplicates(const ReportPass& rp);
  void commit_reports();
  void abandon();

  at::Tensor centres_;  // [C*K, E] normalised, on device_
  at::Tensor sums_;     // [C*K, E] float: sum of the embeddings nearest each sub-centre
  std::vector<int64_t> counts_;  // [C*K]: images nearest each sub-centre of their class
  int64_t c_, k_, e_;
  CleanThresholds t_;
  torch::Device device_;
  std::string folder_;
  std::function<std::string(int64_t)> describe_;
  int64_t chunk_rows_;
  int64_t images_ = 0, last_index_ = -1;
  double centre_s_ = 0, near_s_ = 0;
  std::FILE* scratch_ = nullptr;
  std::FILE* near_ = nullptr;
  std::vector<std::string> partial_;  // report names with a .partial file
  int64_t near_rows_ = 0;
  // Near-duplicate buffers by class, least recently used at the back.
  std::unordered_map<int64_t, Buffer> buffers_;
  std::list<int64_t> lru_;
  int64_t buffer_bytes_ = 0;
  std::vector<bool> evicted_;
  int64_t seen_after_eviction_ = 0;
  // A sample (a reservoir of at most kStrangerSample) of the cosines of images to one class
  // each that they are not filed under: the mislabeled threshold's known-different pairs.
  static constexpr size_t kStrangerSample = size_t(1) << 20;
  std::vector<float> stranger_;
  int64_t stranger_seen_ = 0;
  // Known-same pairs for the identity threshold: for a sample of classes (at most
  // kHalfClasses), the embedding sums of each class's two halves (its images split by a
  // hash of their index): two halves of one person score as a duplicate identity would.
  static constexpr int64_t kHalfClasses = 4096;
  std::unordered_map<int64_t, size_t> half_slot_;  // class -> slot
  std::vector<double> half_sums_;                  // [slot][2][E]
  std::vector<int64_t> half_counts_;               // [slot][2]
  bool half_class(int64_t c) const;
};

// The rows of a float32 N x E .npy matrix, as faceshard-extract writes them, read a chunk
// at a time so that memory does not grow with N (a whole WebFace42M file is 87 GB). The
// constructor refuses, with a usage error naming the file, anything but a C-order '<f4'
// 2-D array whose data is exactly the bytes its shape announces (a truncated copy).
class EmbeddingFile {
 public:
  explicit EmbeddingFile(const std::string& path);
  ~EmbeddingFile();
  EmbeddingFile(const EmbeddingFile&) = delete;
  EmbeddingFile& operator=(const EmbeddingFile&) = delete;
  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  const std::string& path() const { return path_; }
  // Rows [first, first + n) as a [n, E] float CPU tensor.
  at::Tensor read(int64_t first, int64_t n) const;

 private:
  std::string path_;
  std::FILE* f_ = nullptr;
  int64_t rows_ = 0, cols_ = 0;
  uint64_t data_at_ = 0;
};

// The identities of an insightface .bin (image 2i and 2i+1 form pair i): images joined by a
// genuine pair (issame) or by identical bytes (equal hashes) are one identity. Returns, per
// identity, its image indices (ascending), identities ordered by their first image.
std::vector<std::vector<int64_t>> bin_identities(const std::vector<uint64_t>& image_hashes,
                                                 const std::vector<bool>& issame);

// 64-bit FNV-1a of the bytes (never 0, which means "unknown").
uint64_t bytes_hash(const uint8_t* data, size_t size);

}  // namespace faceshard
