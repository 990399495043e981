#include "app/clean/clean_audit.h"

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <regex>

#include <sys/stat.h>
#include <unistd.h>

#include "app/clean/tail_threshold.h"
#include "app/io/checkpoint.h"
#include "base/error.h"
#include "base/log.h"

namespace faceshard {

namespace fs = std::filesystem;

namespace {

constexpr double kPi = 3.14159265358979323846;

double degrees(double cosine) { return std::acos(std::clamp(cosine, -1.0, 1.0)) * 180.0 / kPi; }

// A 64-bit mix (splitmix64's finaliser): the sample's choices as a function of the image.
uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Up to `cap` cosines of distinct pairs of rows of `v` ([n, E], the rows in `live`): every
// pair when there are few, else pairs drawn by a fixed sequence (the same on every run).
std::vector<float> pair_cosines(const at::Tensor& v, const std::vector<int64_t>& live, size_t cap) {
  std::vector<float> out;
  const int64_t n = int64_t(live.size());
  if (n < 2) return out;
  const at::Tensor idx = torch::tensor(live, torch::kLong).to(v.device());
  const at::Tensor x = v.index_select(0, idx);
  const double pairs = double(n) * double(n - 1) / 2;
  if (pairs <= double(cap)) {
    const int64_t chunk = std::max<int64_t>(1, (int64_t(16) << 20) / n);
    for (int64_t r0 = 0; r0 < n; r0 += chunk) {
      const int64_t nr = std::min(chunk, n - r0);
      const at::Tensor s = at::matmul(x.narrow(0, r0, nr), x.t()).cpu().contiguous();
      const float* p = s.data_ptr<float>();
      for (int64_t i = 0; i < nr; ++i)
        for (int64_t j = r0 + i + 1; j < n; ++j) out.push_back(p[i * n + j]);
    }
    return out;
  }
  std::vector<int64_t> a(cap), b(cap);
  for (size_t i = 0; i < cap; ++i) {
    const uint64_t h = mix64(0x7061697273ull ^ i);
    a[i] = int64_t(h % uint64_t(n));
    b[i] = int64_t(mix64(h) % uint64_t(n - 1));
    if (b[i] >= a[i]) ++b[i];
  }
  const at::Tensor ta = torch::tensor(a, torch::kLong).to(v.device()), tb = torch::tensor(b, torch::kLong).to(v.device());
  const at::Tensor c = (x.index_select(0, ta) * x.index_select(0, tb)).sum(1).cpu().contiguous();
  out.assign(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
  return out;
}

// A path in a TSV cell: tabs and line breaks would break the row.
std::string cell(std::string s) {
  for (char& c : s)
    if (c == '\t' || c == '\n' || c == '\r') c = ' ';
  return s;
}

void put(std::FILE* f, const std::string& s, const std::string& file) {
  if (std::fwrite(s.data(), 1, s.size(), f) != s.size())
    throw runtime_error("cannot write '", file, "': ", std::strerror(errno));
}

std::string fmt(double v, int digits = 4) {
  char b[64];
  std::snprintf(b, sizeof b, "%.*f", digits, v);
  return b;
}

// One image's result of the nearest-centre search, as the scratch file holds it: index,
// label, nearest other class, its cosine, then the cosines to the K sub-centres of the label.
struct ScratchHead {
  int64_t index, label, other;
  float other_cos;
};

}  // namespace

uint64_t bytes_hash(const uint8_t* data, size_t size) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < size; ++i) {
    h ^= data[i];
    h *= 1099511628211ull;
  }
  return h ? h : 1;
}

EmbeddingFile::EmbeddingFile(const std::string& path) : path_(path) {
  f_ = std::fopen(path.c_str(), "rb");
  if (!f_) throw usage_error(path, ": cannot open embeddings file: ", std::strerror(errno));
  struct stat st {};
  if (::fstat(::fileno(f_), &st) != 0) throw usage_error(path, ": cannot stat embeddings file: ", std::strerror(errno));
  const uint64_t size = uint64_t(st.st_size);
  unsigned char pre[12];
  if (size < 10 || std::fread(pre, 1, 10, f_) != 10 || std::memcmp(pre, "\x93NUMPY", 6) != 0)
    throw usage_error(path, ": not a .npy file (faceshard-extract writes PREFIX.npy)");
  uint64_t header_len = 0, preamble = 10;
  if (pre[6] == 1) {
    header_len = pre[8] | (uint64_t(pre[9]) << 8);
  } else if (pre[6] == 2 || pre[6] == 3) {
    if (std::fread(pre + 10, 1, 2, f_) != 2) throw usage_error(path, ": truncated .npy preamble");
    for (int i = 0; i < 4; ++i) header_len |= uint64_t(pre[8 + i]) << (8 * i);
    preamble = 12;
  } else {
    throw usage_error(path, ": .npy format version ", int(pre[6]), " is not 1, 2 or 3");
  }
  if (header_len > 65536 || preamble + header_len > size)
    throw usage_error(path, ": .npy header of ", header_len, " bytes does not fit the file");
  std::string header(header_len, '\0');
  if (std::fread(header.data(), 1, header_len, f_) != header_len) throw usage_error(path, ": truncated .npy header");
  std::smatch m;
  static const std::regex descr_re("'descr'\\s*:\\s*'<f4'"), order_re("'fortran_order'\\s*:\\s*False"),
      shape_re("'shape'\\s*:\\s*\\(\\s*([0-9]{1,12})\\s*,\\s*([0-9]{1,12})\\s*,?\\s*\\)");
  if (!std::regex_search(header, descr_re) || !std::regex_search(header, order_re) ||
      !std::regex_search(header, m, shape_re))
    throw usage_error(path, ": expected a C-order float32 (N, E) matrix as faceshard-extract writes, header: ",
                      detail::printable(header.substr(0, 80)));
  rows_ = std::stoll(m[1].str());
  cols_ = std::stoll(m[2].str());
  data_at_ = preamble + header_len;
  if (cols_ > 0 && rows_ > (int64_t(1) << 40) / cols_) throw usage_error(path, ": .npy shape is too large");
  const uint64_t want = uint64_t(rows_) * uint64_t(cols_) * 4;
  if (size - data_at_ != want)
    throw usage_error(path, ": holds ", size - data_at_, " bytes of rows, its shape (", rows_, ", ", cols_,
                      ") announces ", want, " (a truncated or damaged copy)");
}

EmbeddingFile::~EmbeddingFile() {
  if (f_) std::fclose(f_);
}

at::Tensor EmbeddingFile::read(int64_t first, int64_t n) const {
  if (first < 0 || n < 0 || first + n > rows_)
    throw runtime_error(path_, ": rows [", first, ", ", first + n, ") of ", rows_);
  at::Tensor out = at::empty({n, cols_}, at::kFloat);
  const size_t bytes = size_t(n) * size_t(cols_) * 4;
  // Little-endian hosts only (x86-64, aarch64), as write_npy_float32.
  if (bytes && (::fseeko(f_, off_t(data_at_ + uint64_t(first) * uint64_t(cols_) * 4), SEEK_SET) != 0 ||
                std::fread(out.data_ptr<float>(), 1, bytes, f_) != bytes))
    throw runtime_error(path_, ": cannot read rows ", first, "..", first + n - 1, ": ",
                        std::ferror(f_) ? std::strerror(errno) : "the file ends before them (changed while read?)");
  return out;
}

std::vector<std::vector<int64_t>> bin_identities(const std::vector<uint64_t>& image_hashes,
                                                 const std::vector<bool>& issame) {
  const int64_t n = int64_t(image_hashes.size());
  std::vector<int64_t> parent(static_cast<size_t>(n));
  std::iota(parent.begin(), parent.end(), 0);
  auto find = [&](int64_t x) {
    while (parent[size_t(x)] != x) x = parent[size_t(x)] = parent[size_t(parent[size_t(x)])];
    return x;
  };
  auto join = [&](int64_t a, int64_t b) {
    a = find(a), b = find(b);
    if (a != b) parent[size_t(std::max(a, b))] = std::min(a, b);
  };
  for (size_t p = 0; p < issame.size() && int64_t(2 * p + 1) < n; ++p)
    if (issame[p]) join(int64_t(2 * p), int64_t(2 * p + 1));
  std::unordered_map<uint64_t, int64_t> first;
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t h = image_hashes[size_t(i)];
    if (h == 0) continue;
    auto it = first.emplace(h, i).first;
    join(it->second, i);
  }
  std::unordered_map<int64_t, size_t> slot;
  std::vector<std::vector<int64_t>> out;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = find(i);
    auto it = slot.find(r);
    if (it == slot.end()) {
      it = slot.emplace(r, out.size()).first;
      out.emplace_back();
    }
    out[it->second].push_back(i);
  }
  return out;
}

CleanAudit::CleanAudit(const at::Tensor& centres, int64_t num_classes, int64_t subcenters, CleanThresholds thresholds,
                       torch::Device device, std::string folder, std::function<std::string(int64_t)> describe,
                       int64_t centre_chunk_rows)
    : c_(num_classes),
      k_(subcenters),
      e_(centres.dim() == 2 ? centres.size(1) : 0),
      t_(std::move(thresholds)),
      device_(device),
      folder_(std::move(folder)),
      describe_(std::move(describe)),
      chunk_rows_(std::max<int64_t>(centre_chunk_rows, subcenters)),
      evicted_(size_t(std::max<int64_t>(num_classes, 0)), false) {
  if (c_ < 1 || k_ < 1 || centres.dim() != 2 || centres.size(0) != c_ * k_)
    throw usage_error("classifier centres of shape ", centres.sizes(), " do not hold ", c_, " classes x ", k_,
                      " sub-centres");
  if (t_.identity_by != "means" && t_.identity_by != "centres")
    throw usage_error("--identity-by: expected means or centres, got '", t_.identity_by, "'");
  const at::Tensor w = centres.to(device_, torch::kFloat);
  centres_ = w / w.norm(2, {1}, true).clamp_min(1e-12);
  sums_ = torch::zeros({c_ * k_, e_}, torch::TensorOptions().dtype(torch::kFloat).device(device_));
  counts_.assign(size_t(c_ * k_), 0);
  scratch_ = open_partial(".scratch");
  near_ = open_partial(".near_rows");
}

CleanAudit::~CleanAudit() {
  try {
    abandon();
  } catch (...) {
  }
}

std::FILE* CleanAudit::open_partial(const std::string& name) {
  const std::string path = folder_ + "/" + name + ".partial";
  std::FILE* f = std::fopen(path.c_str(), "w+b");
  if (!f) throw runtime_error("cannot write '", path, "': ", std::strerror(errno));
  partial_.push_back(name);
  return f;
}

// Closes and removes every .partial file (reports renamed already are no longer listed).
void CleanAudit::abandon() {
  for (std::FILE** f : {&scratch_, &near_})
    if (*f) std::fclose(*f), *f = nullptr;
  std::error_code ec;
  for (const auto& name : partial_) fs::remove(folder_ + "/" + name + ".partial", ec);
  partial_.clear();
}

void CleanAudit::add(const at::Tensor& embeddings, const std::vector<int64_t>& labels,
                     const std::vector<int64_t>& indices, const std::vector<uint64_t>& hashes) {
  torch::NoGradGuard ng;
  const int64_t b = embeddings.size(0);
  if (embeddings.dim() != 2 || embeddings.size(1) != e_)
    throw usage_error("embeddings of shape ", embeddings.sizes(), " for centres of ", e_, " dimensions");
  if (int64_t(labels.size()) != b || int64_t(indices.size()) != b || int64_t(hashes.size()) != b)
    throw runtime_error("CleanAudit::add: ", b, " embeddings with ", labels.size(), " labels, ", indices.size(),
                        " indices, ", hashes.size(), " hashes");
  if (b == 0) return;
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  for (int64_t i = 0; i < b; ++i) {
    const int64_t l = labels[size_t(i)];
    if (l < 0 || l >= c_)
      throw usage_error(describe_(indices[size_t(i)]), ": label ", l, " is not one of the run's ", c_, " classes");
    if (indices[size_t(i)] <= last_index_) throw runtime_error("CleanAudit::add: image indices must increase");
    last_index_ = indices[size_t(i)];
  }
  const auto opt = torch::TensorOptions().dtype(torch::kLong);
  const at::Tensor lab = torch::from_blob(const_cast<int64_t*>(labels.data()), {b}, opt).clone().to(device_);
  const at::Tensor e = embeddings.to(device_, torch::kFloat);
  // The cosines to the label's own K sub-centres: rows label*K + k.
  const at::Tensor rows = (lab.unsqueeze(1) * k_ + torch::arange(k_, lab.options()).unsqueeze(0)).reshape({-1});
  const at::Tensor own = at::bmm(centres_.index_select(0, rows).view({b, k_, e_}), e.unsqueeze(2)).squeeze(2);
  // The nearest other class: a class's cosine is its best sub-centre's (the logit of
  // sub-center ArcFace), the label's own class left out; chunks of centre rows bound the
  // [b, rows] product.
  at::Tensor best = torch::full({b}, -2.0f, e.options());
  at::Tensor best_class = torch::full({b}, -1, lab.options());
  // At most 64 Mi cosines (256 MiB) at once, whatever the chunk of images.
  const int64_t rows_per_chunk = std::min(chunk_rows_, std::max<int64_t>((int64_t(64) << 20) / b, k_));
  const int64_t classes_per_chunk = std::max<int64_t>(rows_per_chunk / k_, 1);
  for (int64_t c0 = 0; c0 < c_; c0 += classes_per_chunk) {
    const int64_t nc = std::min(classes_per_chunk, c_ - c0);
    at::Tensor s = at::matmul(e, centres_.narrow(0, c0 * k_, nc * k_).t()).view({b, nc, k_}).amax(2);
    const at::Tensor mine = (lab >= c0) & (lab < c0 + nc);
    const at::Tensor col = (lab - c0).clamp(0, nc - 1).unsqueeze(1);
    s.scatter_(1, col, torch::where(mine.unsqueeze(1), torch::full_like(col, -2, s.options()), s.gather(1, col)));
    const auto mx = s.max(1);
    const at::Tensor better = std::get<0>(mx) > best;
    best = torch::where(better, std::get<0>(mx), best);
    best_class = torch::where(better, std::get<1>(mx) + c0, best_class);
  }
  // One class each image is not filed under, picked by a hash of its index: its cosine to
  // that class (the class's best sub-centre), a sample for the mislabeled threshold.
  if (c_ > 1) {
    std::vector<int64_t> other(static_cast<size_t>(b));
    for (int64_t i = 0; i < b; ++i) {
      int64_t o = int64_t(mix64(uint64_t(indices[size_t(i)])) % uint64_t(c_ - 1));
      if (o >= labels[size_t(i)]) ++o;
      other[size_t(i)] = o;
    }
    const at::Tensor ot = torch::tensor(other, torch::kLong).to(device_);
    const at::Tensor orows = (ot.unsqueeze(1) * k_ + torch::arange(k_, ot.options()).unsqueeze(0)).reshape({-1});
    const at::Tensor sc = at::bmm(centres_.index_select(0, orows).view({b, k_, e_}), e.unsqueeze(2)).squeeze(2).amax(1);
    const at::Tensor scc = sc.cpu().contiguous();
    const float* sp = scc.data_ptr<float>();
    for (int64_t i = 0; i < b; ++i, ++stranger_seen_) {
      if (stranger_.size() < kStrangerSample) {
        stranger_.push_back(sp[i]);
        continue;
      }
      // A reservoir: the sample stays uniform over the images seen.
      const uint64_t j = mix64(uint64_t(indices[size_t(i)]) ^ 0x5eedull) % uint64_t(stranger_seen_ + 1);
      if (j < kStrangerSample) stranger_[size_t(j)] = sp[i];
    }
  }
  // The sub-centre each image is nearest to among its label's: dominance counts and sums.
  const at::Tensor nearest_k = own.argmax(1);
  sums_.index_add_(0, lab * k_ + nearest_k, e);
  const at::Tensor own_c = own.cpu().contiguous(), best_c = best.cpu(), other_c = best_class.cpu(),
                   k_c = nearest_k.cpu();
  const at::Tensor e_c = e.cpu().contiguous();
  const float* ow = own_c.data_ptr<float>();
  const float* bw = best_c.data_ptr<float>();
  const int64_t* oc = other_c.data_ptr<int64_t>();
  const int64_t* kc = k_c.data_ptr<int64_t>();
  const float* ep = e_c.data_ptr<float>();
  // The two halves of the sampled classes (known-same pairs for the identity threshold).
  {
    for (int64_t i = 0; i < b; ++i) {
      const int64_t l = labels[size_t(i)];
      if (!half_class(l)) continue;
      auto it = half_slot_.find(l);
      if (it == half_slot_.end()) {
        it = half_slot_.emplace(l, half_slot_.size()).first;
        half_sums_.resize(half_slot_.size() * 2 * size_t(e_), 0.0);
        half_counts_.resize(half_slot_.size() * 2, 0);
      }
      const size_t h = size_t(mix64(uint64_t(indices[size_t(i)]) ^ 0x68616c66ull) & 1);
      double* dst = half_sums_.data() + (it->second * 2 + h) * size_t(e_);
      for (int64_t d = 0; d < e_; ++d) dst[d] += ep[i * e_ + d];
      half_counts_[it->second * 2 + h]++;
    }
  }
  std::vector<char> rec(sizeof(ScratchHead) + size_t(k_) * sizeof(float));
  for (int64_t i = 0; i < b; ++i) {
    const int64_t l = labels[size_t(i)];
    counts_[size_t(l * k_ + kc[i])]++;
    const ScratchHead h{indices[size_t(i)], l, oc[i], bw[i]};
    std::memcpy(rec.data(), &h, sizeof h);
    std::memcpy(rec.data() + sizeof h, ow + i * k_, size_t(k_) * sizeof(float));
    if (std::fwrite(rec.data(), 1, rec.size(), scratch_) != rec.size())
      throw runtime_error("cannot write '", folder_, "/.scratch.partial': ", std::strerror(errno));
  }
  const auto t1 = clock::now();
  for (int64_t i = 0; i < b; ++i) near_duplicates(ep + i * e_, indices[size_t(i)], labels[size_t(i)], oc[i], hashes[size_t(i)]);
  centre_s_ += std::chrono::duration<double>(t1 - t0).count();
  near_s_ += std::chrono::duration<double>(clock::now() - t1).count();
  images_ += b;
}

void CleanAudit::best_match(const Buffer& buf, const float* e, uint64_t hash, NearMatch& best) const {
  const size_t n = buf.index.size();
  for (size_t j = 0; j < n; ++j) {
    const float* o = buf.emb.data() + j * size_t(e_);
    float acc[4] = {0, 0, 0, 0};
    int64_t d = 0;
    for (; d + 4 <= e_; d += 4)
      for (int u = 0; u < 4; ++u) acc[u] += e[d + u] * o[d + u];
    for (; d < e_; ++d) acc[0] += e[d] * o[d];
    const double cos = double(acc[0]) + acc[1] + acc[2] + acc[3];
    const bool same_bytes = hash != 0 && buf.hash[j] == hash;
    if (cos < t_.near_duplicate_cos && !same_bytes) continue;
    // Identical bytes first, then the closest embedding: the image's own copy, not a
    // look-alike that happened to come first.
    if (best.buf && (best.same > same_bytes || (best.same == same_bytes && best.cos >= cos))) continue;
    best = NearMatch{&buf, j, cos, same_bytes};
  }
}

// The image against the images kept for its label and for the class it is otherwise
// nearest to (a copy stored under another label lands there), then kept itself.
void CleanAudit::near_duplicates(const float* e, int64_t index, int64_t label, int64_t other, uint64_t hash) {
  auto it = buffers_.find(label);
  NearMatch best;
  if (it != buffers_.end()) best_match(it->second, e, hash, best);
  if (!best.same && other >= 0 && other != label) {
    auto jt = buffers_.find(other);
    if (jt != buffers_.end()) best_match(jt->second, e, hash, best);
  }
  if (best.buf) {
    // One row per image at most (its best match): an image stored k times gives k - 1 rows,
    // and a model whose embeddings collapse cannot make the report quadratic.
    const int64_t a = best.buf->index[best.j];
    const std::string row = std::to_string(a) + "\t" + cell(describe_(a)) + "\t" + std::to_string(best.buf->label[best.j]) +
                            "\t" + std::to_string(index) + "\t" + cell(describe_(index)) + "\t" + std::to_string(label) +
                            "\t" + fmt(best.cos, 6) + "\t" + (best.same ? "yes" : "no") + "\tdrop " +
                            std::to_string(index) + "\n";
    put(near_, row, folder_ + "/.near_rows.partial");
    ++near_rows_;
  }
  if (it == buffers_.end()) {
    if (evicted_[size_t(label)]) {
      ++seen_after_eviction_;
      evicted_[size_t(label)] = false;  // counted once per return
    }
    it = buffers_.emplace(label, Buffer{}).first;
    lru_.push_front(label);
    it->second.lru = lru_.begin();
  } else if (it->second.lru != lru_.begin()) {
    lru_.splice(lru_.begin(), lru_, it->second.lru);
  }
  Buffer& buf = it->second;
  buf.emb.insert(buf.emb.end(), e, e + e_);
  buf.index.push_back(index);
  buf.label.push_back(label);
  buf.hash.push_back(hash);
  buffer_bytes_ += e_ * int64_t(sizeof(float)) + 24;
  const int64_t budget = t_.near_duplicate_memory_mb << 20;
  // The least recently used classes go first: in a .rec written class by class they are
  // the finished ones, so nothing is missed.
  while (buffer_bytes_ > budget && lru_.size() > 1) {
    const int64_t victim = lru_.back();
    lru_.pop_back();
    auto v = buffers_.find(victim);
    buffer_bytes_ -= int64_t(v->second.index.size()) * (e_ * int64_t(sizeof(float)) + 24);
    buffers_.erase(v);
    evicted_[size_t(victim)] = true;
  }
}

bool CleanAudit::half_class(int64_t c) const {
  return c_ <= kHalfClasses || mix64(uint64_t(c) ^ 0x636c617373ull) % uint64_t(c_) < uint64_t(kHalfClasses);
}

std::vector<int64_t> CleanAudit::dominant() const {
  std::vector<int64_t> dom(size_t(c_), 0);
  for (int64_t c = 0; c < c_; ++c)
    for (int64_t k = 1; k < k_; ++k)
      if (counts_[size_t(c * k_ + k)] > counts_[size_t(c * k_ + dom[size_t(c)])]) dom[size_t(c)] = k;
  return dom;
}

// [C, E] normalised identity vectors (zero rows for classes without images).
at::Tensor CleanAudit::identity_vectors(const std::vector<int64_t>& dom) const {
  std::vector<int64_t> rows(static_cast<size_t>(c_));
  std::vector<float> has(static_cast<size_t>(c_));
  for (int64_t c = 0; c < c_; ++c) {
    rows[size_t(c)] = c * k_ + dom[size_t(c)];
    int64_t n = 0;
    for (int64_t k = 0; k < k_; ++k) n += counts_[size_t(c * k_ + k)];
    has[size_t(c)] = n > 0 ? 1.0f : 0.0f;
  }
  const at::Tensor r = torch::tensor(rows, torch::kLong).to(device_);
  const at::Tensor mask = torch::tensor(has, torch::kFloat).to(device_).unsqueeze(1);
  at::Tensor v = (t_.identity_by == "means" ? sums_ : centres_).index_select(0, r);
  return v / v.norm(2, {1}, true).clamp_min(1e-12) * mask;
}

void CleanAudit::fit_mislabeled_threshold(CleanCounts& n) {
  n.mislabeled_from = t_.mislabeled_given ? "--mislabeled-angle" : "the published 75 degrees (too few images to fit)";
  if (!t_.mislabeled_given && stranger_.size() >= 2) {
    const TailThreshold tt = normal_tail(stranger_, t_.mislabeled_rate, images_ * (c_ - 1));
    t_.mislabeled_angle = degrees(tt.value);
    n.mislabeled_from = "the data: " + tt.describe("image-to-other-class cosines") +
                        " (an image no nearer its own class; --mislabeled-angle sets it)";
  }
}

void CleanAudit::fit_identity_threshold(CleanCounts& n, const at::Tensor& id, const std::vector<int64_t>& live) {
  n.identity_from = t_.identity_given ? "--identity-cos" : "the fixed 0.6 (too few classes to fit)";
  if (!t_.identity_given) {
    const std::vector<float> pc = pair_cosines(id, live, kStrangerSample);
    if (pc.size() >= 2) {
      const double pairs = double(live.size()) * double(live.size() - 1) / 2;
      const TailThreshold tt = normal_tail(pc, std::min(0.5, t_.false_pairs / pairs), int64_t(pairs));
      t_.identity_cos = tt.value;
      n.identity_from = "the data: " + tt.describe("class-pair cosines") + " (--identity-cos sets it)";
      // Known-same pairs: the two halves of a class (means, as --identity-by means compares
      // classes). A person under two labels is two such halves: where the different pairs'
      // tail lies above most of them, the threshold comes down to their 5th percentile, so
      // that a duplicate scoring like one class's halves is found.
      std::vector<double> same;
      if (t_.identity_by == "means")
        for (const auto& [c, slot] : half_slot_) {
          if (half_counts_[slot * 2] < 1 || half_counts_[slot * 2 + 1] < 1) continue;
          const double* a = half_sums_.data() + slot * 2 * size_t(e_);
          const double* bb = a + e_;
          double ab = 0, aa = 0, b2 = 0;
          for (int64_t d = 0; d < e_; ++d) ab += a[d] * bb[d], aa += a[d] * a[d], b2 += bb[d] * bb[d];
          if (aa > 0 && b2 > 0) same.push_back(ab / std::sqrt(aa * b2));
        }
      if (same.size() >= 20) {
        std::sort(same.begin(), same.end());
        const double p5 = same[size_t(0.05 * double(same.size() - 1))];
        if (p5 < t_.identity_cos && p5 > tt.mean) {
          t_.identity_cos = p5;
          const double expected = 0.5 * std::erfc((p5 - tt.mean) / (tt.sd * std::sqrt(2.0))) * pairs;
          char b[256];
          std::snprintf(b, sizeof b,
                        "the data: cos %.4f, the 5th percentile of %zu classes' two halves (known-same pairs), below the "
                        "class pairs' tail (",
                        p5, same.size());
          n.identity_from = std::string(b) + tt.describe("class-pair cosines") + "); at it the fit expects " +
                            format_sig(expected, 3) + " different pairs (--identity-cos sets it)";
        }
      }
    }
  }
}

void CleanAudit::fit_overlap_threshold(CleanCounts& n, const at::Tensor& id, const std::vector<int64_t>& live,
                                       const std::vector<TestIdentity>& tests) {
  n.overlap_from = t_.overlap_given ? "--overlap-cos" : "the fixed 0.5 (no test identities to fit)";
  if (!t_.overlap_given && !tests.empty() && !live.empty()) {
    // Every test identity against every class with images (a sample when there are many).
    std::vector<at::Tensor> rows;
    for (const TestIdentity& ti : tests) {
      const at::Tensor v = ti.embedding.to(device_, torch::kFloat).reshape({-1});
      if (v.size(0) == e_) rows.push_back(v / v.norm().clamp_min(1e-12));
    }
    if (!rows.empty()) {
      const at::Tensor tv = torch::stack(rows);
      const at::Tensor lv = id.index_select(0, torch::tensor(live, torch::kLong).to(device_));
      const double pairs = double(tv.size(0)) * double(lv.size(0));
      std::vector<float> oc;
      if (pairs <= double(kStrangerSample)) {
        const at::Tensor s = at::matmul(tv, lv.t()).cpu().contiguous();
        oc.assign(s.data_ptr<float>(), s.data_ptr<float>() + s.numel());
      } else {
        std::vector<int64_t> a(kStrangerSample), bb(kStrangerSample);
        for (size_t i = 0; i < kStrangerSample; ++i) {
          const uint64_t h = mix64(0x6f7665726c6170ull ^ i);
          a[i] = int64_t(h % uint64_t(tv.size(0)));
          bb[i] = int64_t(mix64(h) % uint64_t(lv.size(0)));
        }
        const at::Tensor c = (tv.index_select(0, torch::tensor(a, torch::kLong).to(device_)) *
                              lv.index_select(0, torch::tensor(bb, torch::kLong).to(device_)))
                                 .sum(1)
                                 .cpu()
                                 .contiguous();
        oc.assign(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
      }
      if (oc.size() >= 2) {
        const TailThreshold tt = normal_tail(oc, std::min(0.5, t_.false_pairs / pairs), int64_t(pairs));
        t_.overlap_cos = tt.value;
        n.overlap_from = "the data: " + tt.describe("test-identity-to-class cosines") + " (--overlap-cos sets it)";
      }
    }
  }
}

std::FILE* CleanAudit::begin_report(const std::string& head, const std::string& name, const std::string& what,
                                  const std::string& thresholds, const std::string& columns) {
  std::FILE* f = open_partial(name);
  const std::string path = folder_ + "/" + name + ".partial";
  put(f, "# faceshard-clean " + name + ": " + what + "\n" + head + "# thresholds: " + thresholds + "\n" + columns + "\n",
      path);
  if (name == "near_duplicates.tsv") {
    // Its rows were written during the pass: they follow the header, copied a block at a time.
    if (std::fflush(near_) != 0) throw runtime_error("cannot write '", folder_, "/.near_rows.partial'");
    std::rewind(near_);
    char buf[1 << 16];
    size_t got;
    while ((got = std::fread(buf, 1, sizeof buf, near_)) > 0)
      if (std::fwrite(buf, 1, got, f) != got) throw runtime_error("cannot write '", path, "': ", std::strerror(errno));
    std::fclose(near_);
    near_ = nullptr;
  }
  return f;
}

void CleanAudit::end_report(std::FILE*& f, const std::string& name) {
  if (std::fflush(f) != 0 || ::fsync(::fileno(f)) != 0 || std::fclose(f) != 0) {
    f = nullptr;
    throw runtime_error("cannot write '", folder_, "/", name, ".partial': ", std::strerror(errno));
  }
  f = nullptr;
}

// mislabeled.tsv: the scratch records read back once, now that the dominant sub-centres are known.
void CleanAudit::write_mislabeled(const ReportPass& rp, CleanCounts& n) {
  std::FILE* f = begin_report(rp.head, "mislabeled.tsv",
                       "images farther from their class's dominant centre than the threshold, with the class they "
                       "are nearest to",
                       "--mislabeled-angle " + fmt(t_.mislabeled_angle, 2) + " degrees (from " + n.mislabeled_from +
                           "; Sub-center ArcFace drops at 75)",
                       "index\timage\tlabel\tangle_deg\tcos\tnearest_class\tnearest_cos\tnearest_angle_deg\tsuggestion");
  if (std::fflush(scratch_) != 0) throw runtime_error("cannot write '", folder_, "/.scratch.partial'");
  std::rewind(scratch_);
  std::vector<char> rec(sizeof(ScratchHead) + size_t(k_) * sizeof(float));
  for (int64_t i = 0; i < images_; ++i) {
    if (std::fread(rec.data(), 1, rec.size(), scratch_) != rec.size())
      throw runtime_error("cannot read back '", folder_, "/.scratch.partial'");
    ScratchHead h;
    std::memcpy(&h, rec.data(), sizeof h);
    float cos;
    std::memcpy(&cos, rec.data() + sizeof h + size_t(rp.dom[size_t(h.label)]) * sizeof(float), sizeof cos);
    const double angle = degrees(cos);
    if (angle <= t_.mislabeled_angle) continue;
    const double other_angle = degrees(h.other_cos);
    const std::string suggestion =
        h.other >= 0 && other_angle <= t_.mislabeled_angle ? "relabel " + std::to_string(h.other) : "drop";
    put(f,
        std::to_string(h.index) + "\t" + cell(describe_(h.index)) + "\t" + std::to_string(h.label) + "\t" +
            fmt(angle, 2) + "\t" + fmt(cos) + "\t" + std::to_string(h.other) + "\t" + fmt(h.other_cos) + "\t" +
            fmt(other_angle, 2) + "\t" + suggestion + "\n",
        folder_ + "/mislabeled.tsv.partial");
    ++n.mislabeled;
  }
  end_report(f, "mislabeled.tsv");
  std::fclose(scratch_);
  scratch_ = nullptr;
}

// dropped_subcenters.tsv: the non-dominant sub-centres (K > 1 only).
void CleanAudit::write_dropped_subcenters(const ReportPass& rp, CleanCounts& n) {
  if (k_ <= 1) return;
  std::FILE* f = begin_report(rp.head, "dropped_subcenters.tsv",
                       "the non-dominant sub-centres of each class (the fewest of the class's images nearest them)",
                       "none (dominant: the sub-centre with the most of the class's images)",
                       "class\tsubcenter\timages\tdominant\tdominant_images\tangle_to_dominant_deg");
  const at::Tensor w = centres_.cpu();
  for (int64_t c = 0; c < c_; ++c) {
    if (rp.class_images[size_t(c)] == 0) continue;
    const int64_t d = rp.dom[size_t(c)];
    for (int64_t k = 0; k < k_; ++k) {
      if (k == d) continue;
      const double cos = (w[c * k_ + k] * w[c * k_ + d]).sum().item<double>();
      put(f,
          std::to_string(c) + "\t" + std::to_string(k) + "\t" + std::to_string(counts_[size_t(c * k_ + k)]) + "\t" +
              std::to_string(d) + "\t" + std::to_string(counts_[size_t(c * k_ + d)]) + "\t" + fmt(degrees(cos), 2) +
              "\n",
          folder_ + "/dropped_subcenters.tsv.partial");
      ++n.dropped_subcenters;
    }
  }
  end_report(f, "dropped_subcenters.tsv");
}

// duplicate_identities.tsv: every pair of classes above the threshold, a chunk of rows at
// a time against all classes ([rows, C] at most).
void CleanAudit::write_duplicate_identities(const ReportPass& rp, CleanCounts& n) {
  std::FILE* f = begin_report(rp.head,
      "duplicate_identities.tsv", "pairs of classes that look like one person under two labels",
      "--identity-cos " + fmt(t_.identity_cos, 3) + " (cosine of the classes' " +
          (t_.identity_by == "means" ? std::string("mean embeddings of the images nearest the dominant centre")
                                     : std::string("dominant centres")) +
          ", --identity-by " + t_.identity_by + "; from " + n.identity_from + ")",
      "class_a\tclass_b\tcos\tangle_deg\tcentre_cos\tmean_cos\timages_a\timages_b\tsuggestion");
  std::vector<int64_t> rows(static_cast<size_t>(c_));
  for (int64_t c = 0; c < c_; ++c) rows[size_t(c)] = c * k_ + rp.dom[size_t(c)];
  const at::Tensor r = torch::tensor(rows, torch::kLong).to(device_);
  const at::Tensor dom_centres = centres_.index_select(0, r);
  at::Tensor means = sums_.index_select(0, r);
  means = means / means.norm(2, {1}, true).clamp_min(1e-12);
  const int64_t chunk = std::max<int64_t>(1, (int64_t(64) << 20) / std::max<int64_t>(c_, 1) / 4);
  for (int64_t r0 = 0; r0 < c_; r0 += chunk) {
    const int64_t nr = std::min(chunk, c_ - r0);
    // Cosines of unit vectors (float32 rounding may pass 1 by an ulp: clamped).
    at::Tensor s = at::matmul(rp.id.narrow(0, r0, nr), rp.id.t()).clamp_(-1, 1);
    // Each pair once: only columns after the row's class.
    const at::Tensor col = torch::arange(c_, torch::TensorOptions().dtype(torch::kLong).device(device_)).unsqueeze(0);
    const at::Tensor row = torch::arange(r0, r0 + nr, col.options()).unsqueeze(1);
    s.masked_fill_(col <= row, -2.0f);
    const at::Tensor hits = (s > t_.identity_cos).nonzero().cpu();
    if (hits.size(0) == 0) continue;
    const at::Tensor a = hits.select(1, 0) + r0, bcol = hits.select(1, 1);
    const at::Tensor ad = a.to(device_), bd = bcol.to(device_);
    const at::Tensor cs = s.index({hits.select(1, 0).to(device_), bd}).cpu();
    const at::Tensor cc = (dom_centres.index_select(0, ad) * dom_centres.index_select(0, bd)).sum(1).cpu();
    const at::Tensor mc = (means.index_select(0, ad) * means.index_select(0, bd)).sum(1).cpu();
    for (int64_t h = 0; h < hits.size(0); ++h) {
      const int64_t ca = a[h].item<int64_t>(), cb = bcol[h].item<int64_t>();
      const double cos = cs[h].item<double>();
      const int64_t na = rp.class_images[size_t(ca)], nb = rp.class_images[size_t(cb)];
      const int64_t into = na >= nb ? ca : cb, from = na >= nb ? cb : ca;
      put(f,
          std::to_string(ca) + "\t" + std::to_string(cb) + "\t" + fmt(cos) + "\t" + fmt(degrees(cos), 2) + "\t" +
              fmt(cc[h].item<double>()) + "\t" + fmt(mc[h].item<double>()) + "\t" + std::to_string(na) + "\t" +
              std::to_string(nb) + "\tmerge " + std::to_string(from) + " into " + std::to_string(into) + "\n",
          folder_ + "/duplicate_identities.tsv.partial");
      ++n.duplicate_identities;
    }
  }
  end_report(f, "duplicate_identities.tsv");
}

// overlap.tsv: every test identity against every class.
void CleanAudit::write_overlap(const ReportPass& rp, const std::vector<TestIdentity>& tests, CleanCounts& n) {
  std::FILE* f = begin_report(rp.head, "overlap.tsv", "training classes that are identities of the given test sets",
                       "--overlap-cos " + fmt(t_.overlap_cos, 3) + " (cosine of the test identity's mean embedding " +
                           "and the class's identity vector, --identity-by " + t_.identity_by + "; from " +
                           n.overlap_from + ")",
                       "set\ttest_identity\ttest_images\tclass\tcos\tangle_deg\tclass_images\tsuggestion");
  const int64_t chunk = 1024;
  for (size_t t0 = 0; t0 < tests.size(); t0 += size_t(chunk)) {
    const size_t nt = std::min(tests.size() - t0, size_t(chunk));
    std::vector<at::Tensor> rows;
    for (size_t i = 0; i < nt; ++i) {
      const at::Tensor v = tests[t0 + i].embedding.to(device_, torch::kFloat).reshape({-1});
      if (v.size(0) != e_)
        throw usage_error("test identity '", tests[t0 + i].name, "' of ", tests[t0 + i].set, " has ", v.size(0),
                          " dimensions, the run's embeddings ", e_);
      rows.push_back(v / v.norm().clamp_min(1e-12));
    }
    const at::Tensor s = at::matmul(torch::stack(rows), rp.id.t()).clamp_(-1, 1);
    const at::Tensor hits = (s > t_.overlap_cos).nonzero().cpu();
    const at::Tensor sc = s.cpu();
    for (int64_t h = 0; h < hits.size(0); ++h) {
      const int64_t ti = hits[h][0].item<int64_t>(), c = hits[h][1].item<int64_t>();
      const double cos = sc[ti][c].item<double>();
      const TestIdentity& t = tests[t0 + size_t(ti)];
      put(f,
          cell(t.set) + "\t" + cell(t.name) + "\t" + std::to_string(t.images) + "\t" + std::to_string(c) + "\t" +
              fmt(cos) + "\t" + fmt(degrees(cos), 2) + "\t" + std::to_string(rp.class_images[size_t(c)]) +
              "\tdrop class " + std::to_string(c) + "\n",
          folder_ + "/overlap.tsv.partial");
      ++n.overlap;
    }
  }
  end_report(f, "overlap.tsv");
}

void CleanAudit::write_near_duplicates(const ReportPass& rp) {
  std::string evicted;
  if (seen_after_eviction_ > 0)
    evicted = "; " + std::to_string(seen_after_eviction_) +
              " classes came back after their buffer was evicted (images not grouped by class; raise "
              "--near-duplicate-memory-mb)";
  std::FILE* f = begin_report(rp.head, "near_duplicates.tsv",
                       "images stored more than once (compared within their label and with the class they are "
                       "otherwise nearest to)" + evicted,
                       "--near-duplicate-cos " + fmt(t_.near_duplicate_cos, 3) +
                           " (embedding cosine), or identical bytes; --near-duplicate-memory-mb " +
                           std::to_string(t_.near_duplicate_memory_mb),
                       "index_a\timage_a\tlabel_a\tindex_b\timage_b\tlabel_b\tcos\tidentical_bytes\tsuggestion");
  end_report(f, "near_duplicates.tsv");
}

// Everything is written: the reports take their names together, the scratch goes.
void CleanAudit::commit_reports() {
  std::error_code ec;
  for (const auto& name : partial_) {
    if (name[0] == '.') {
      fs::remove(folder_ + "/" + name + ".partial", ec);
      continue;
    }
    fs::rename(folder_ + "/" + name + ".partial", folder_ + "/" + name, ec);
    if (ec) throw runtime_error("cannot rename '", folder_, "/", name, ".partial': ", ec.message());
  }
  partial_.clear();
}

CleanCounts CleanAudit::write_reports(const std::vector<std::string>& header, const std::vector<TestIdentity>& tests) {
  torch::NoGradGuard ng;
  const auto t0 = std::chrono::steady_clock::now();
  CleanCounts n;
  n.images = images_;
  n.centre_s = centre_s_;
  n.near_duplicate_s = near_s_;
  n.classes_seen_after_eviction = seen_after_eviction_;
  n.near_duplicates = near_rows_;
  ReportPass rp;
  rp.dom = dominant();
  rp.class_images.assign(size_t(c_), 0);
  for (int64_t c = 0; c < c_; ++c)
    for (int64_t k = 0; k < k_; ++k) rp.class_images[size_t(c)] += counts_[size_t(c * k_ + k)];
  // The thresholds not given, from the set's own known-different pairs (tail_threshold.h).
  fit_mislabeled_threshold(n);
  std::vector<int64_t> live;  // classes with images: an identity vector each
  for (int64_t c = 0; c < c_; ++c)
    if (rp.class_images[size_t(c)] > 0) live.push_back(c);
  rp.id = identity_vectors(rp.dom);
  fit_identity_threshold(n, rp.id, live);
  fit_overlap_threshold(n, rp.id, live, tests);
  n.mislabeled_angle = t_.mislabeled_angle;
  n.identity_cos = t_.identity_cos;
  n.overlap_cos = t_.overlap_cos;
  for (const auto& h : header) rp.head += "# " + h + "\n";
  rp.head += "# images: " + std::to_string(images_) + ", classes: " + std::to_string(c_) +
             ", sub-centres per class: " + std::to_string(k_) + "\n";
  write_mislabeled(rp, n);
  write_dropped_subcenters(rp, n);
  write_duplicate_identities(rp, n);
  write_overlap(rp, tests, n);
  write_near_duplicates(rp);
  commit_reports();
  n.reports_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return n;
}

}  // namespace faceshard
