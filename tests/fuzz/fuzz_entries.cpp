#include "tests/fuzz/fuzz_entries.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <set>

#include "app/config/config.h"
#include "app/eval/ijb_meta.h"
#include "data/image_codec.h"
#include "data/image_header.h"
#include "data/image_record.h"
#include "data/insightface_rec.h"
#include "data/recordio.h"
#include "data/verification_bin.h"
#include "models/torch_save/torch_save_format.h"
#include "base/error.h"

namespace faceshard::fuzz {

namespace {

[[noreturn]] void violated(const std::string& what) {
  std::fprintf(stderr, "faceshard fuzz: invariant violated: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

// A user-facing error: one line that starts with one of the input's names, exit status 1 or 2.
void check_error(const Error& e, std::initializer_list<std::string> names) {
  const std::string m = e.what();
  if (m.empty() || m.find('\n') != std::string::npos || m.find('\r') != std::string::npos)
    violated("error message is not one line: '" + m + "'");
  if (e.exit_code() != 1 && e.exit_code() != 2) violated("exit code " + std::to_string(e.exit_code()) + ": " + m);
  for (const std::string& n : names)
    if (m.compare(0, n.size(), n) == 0) return;
  violated("error message names none of the inputs: '" + m + "'");
}

// An in-memory file with a path (/proc/self/fd/N), so that the readers that open paths
// run their real open/fstat/pread code on fuzz inputs without touching the disk.
class MemFile {
 public:
  explicit MemFile(const char* name) : fd_(::memfd_create(name, MFD_CLOEXEC)) {
    if (fd_ < 0) violated("memfd_create failed");
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  void set(const uint8_t* data, size_t size) {
    if (::ftruncate(fd_, 0) != 0) violated("ftruncate failed");
    size_t done = 0;
    while (done < size) {
      const ssize_t w = ::pwrite(fd_, data + done, size - done, off_t(done));
      if (w <= 0) violated("pwrite failed");
      done += size_t(w);
    }
  }
  const std::string& path() const { return path_; }

 private:
  int fd_;
  std::string path_;
};

}  // namespace

void recordio(const uint8_t* data, size_t size) {
  static MemFile rec("fuzz.rec"), idx("fuzz.idx");
  size_t idx_len = size >= 2 ? size_t(data[0] | (data[1] << 8)) : 0;
  const uint8_t* p = data + std::min<size_t>(size, 2);
  size_t left = size - std::min<size_t>(size, 2);
  idx_len = std::min(idx_len, left);
  idx.set(p, idx_len);
  rec.set(p + idx_len, left - idx_len);
  const uint64_t rec_size = left - idx_len;
  const auto names = {rec.path(), idx.path()};

  try {
    const std::string text(reinterpret_cast<const char*>(p), idx_len);
    const auto entries = parse_index(text, idx.path(), rec_size);
    for (const IndexEntry& e : entries)
      if (e.offset % 4 != 0 || e.offset > rec_size || rec_size - e.offset < 8) violated("index entry past the .rec");
  } catch (const Error& e) {
    check_error(e, names);
  }
  std::vector<uint8_t> buf;
  try {
    const IndexedRecordIO r(rec.path(), idx.path());
    const InsightFaceLayout layout = read_insightface_layout(r);
    size_t n = 0;
    for (uint64_t i = 0; i < layout.num_images(); ++i) {
      if (++n > 64) break;
      const uint64_t key = layout.image_key(r, i);
      try {
        r.read(key, buf);
        const ImageRecordView v = unpack_image_record(buf, rec.path());
        if (v.image_size > buf.size() || v.image < buf.data() || v.image + v.image_size > buf.data() + buf.size())
          violated("image outside its record");
        label_to_class(v.class_label(), rec.path());
      } catch (const Error& e) {
        check_error(e, names);
      }
    }
    for (uint64_t key = layout.identity_begin; key < layout.identity_end && key < layout.identity_begin + 64; ++key) {
      try {
        const auto range = read_identity_range(r, layout, key);
        if (range.second < range.first) violated("inverted identity range");
      } catch (const Error& e) {
        check_error(e, names);
      }
    }
  } catch (const Error& e) {
    check_error(e, names);
  }
  try {
    RecordIOReader seq(rec.path());
    for (int n = 0; n < 256 && seq.next(buf); ++n)
      if (seq.tell() > rec_size) violated("sequential reader past the end");
  } catch (const Error& e) {
    check_error(e, names);
  }
}

void verification_bin(const uint8_t* data, size_t size) {
  VerificationSet set;
  try {
    set = parse_verification_bin(data, size, "fuzz.bin");
  } catch (const Error& e) {
    check_error(e, {"fuzz.bin"});
    return;
  }
  if (set.images.size() != 2 * set.issame.size()) violated("images are not two per pair");
  uint64_t referenced = 0;
  std::set<const void*> distinct;
  for (const ImageBytes& b : set.images) {
    referenced += b.size();
    distinct.insert(&b.bytes());
  }
  if (referenced > size + kMaxRepeatedImageBytes) violated("images hold more than the bound");
  if (set.images.size() - distinct.size() > kMaxRepeatsPerImage * distinct.size() + kRepeatAllowance)
    violated("more repeated references than the bound");
  if (referenced > 4 * uint64_t(size) + 4096) return;  // the writer would expand the repeats: slow, not wrong
  const std::vector<uint8_t> again = encode_verification_bin(set);
  const VerificationSet back = parse_verification_bin(again.data(), again.size(), "fuzz-rewritten.bin");
  if (back.images != set.images || back.issame != set.issame) violated("written set reads back different");
}

namespace {

void check_state_dict(const SavedStateDict& d) {
  std::set<std::string> names;
  for (const SavedTensor& t : d.tensors) {
    if (!names.insert(t.name).second) violated("repeated state_dict name");
    if (t.storage >= d.storages.size()) violated("tensor names no storage");
    if (t.sizes.size() != t.strides.size()) violated("sizes and strides differ in length");
    const SavedStorage& s = d.storages[t.storage];
    unsigned __int128 numel = 1, last = uint64_t(t.offset);
    for (size_t k = 0; k < t.sizes.size(); ++k) {
      if (t.sizes[k] < 0 || t.strides[k] < 0) violated("negative size or stride");
      numel *= uint64_t(t.sizes[k]);
    }
    if (numel != t.numel) violated("element count differs");
    if (numel > 0) {
      for (size_t k = 0; k < t.sizes.size(); ++k) last += (unsigned __int128)(t.sizes[k] - 1) * uint64_t(t.strides[k]);
      if (last >= s.numel) violated("view past its storage");
    }
  }
}

}  // namespace

void state_dict_pickle(const uint8_t* data, size_t size) {
  try {
    check_state_dict(parse_state_dict_pickle(data, size, "fuzz.pkl", uint64_t(size) + (1u << 20)));
  } catch (const Error& e) {
    check_error(e, {"fuzz.pkl"});
  }
}

void state_dict_zip(const uint8_t* data, size_t size) {
  try {
    ZipArchive zip = ZipArchive::from_memory(data, size, "fuzz.pt: cannot read torch.save file");
    zip.set_verify_crc(false);
    const TorchSaveFile f = open_torch_save(std::move(zip), "fuzz.pt");
    check_state_dict(f.dict);
    for (size_t i = 0; i < f.dict.storages.size(); ++i) {
      const SavedStorage& s = f.dict.storages[i];
      const uint64_t bytes = s.numel * storage_element_size(s.type);
      if (bytes > size) violated("storage larger than the file");
      std::vector<uint8_t> buf(bytes);
      f.read_storage(i, buf.data());
      // The middle third as a range, in two pieces: the bytes the whole read gave.
      std::vector<uint8_t> part(bytes);
      ZipEntryStream part_stream = f.open_storage(i, bytes / 3, bytes - bytes / 3);
      const size_t n = size_t(part_stream.remaining()), half = n / 2;
      part_stream.read(part.data(), half);
      part_stream.read(part.data() + half, n - half);
      if (part_stream.remaining() != 0 || (n && std::memcmp(part.data(), buf.data() + bytes / 3, n) != 0))
        violated("a ranged read differs from the whole read");
    }
  } catch (const Error& e) {
    check_error(e, {"fuzz.pt"});
  }
  try {
    const ZipArchive zip = ZipArchive::from_memory(data, size, "fuzz.pt: cannot read torch.save file");
    size_t n = 0;
    for (const auto& entry : zip.entries()) {
      if (++n > 32) break;
      try {
        if (zip.read(entry).size() != entry.size) violated("entry read with another size");
      } catch (const Error& e) {
        check_error(e, {"fuzz.pt"});
      }
    }
  } catch (const Error& e) {
    check_error(e, {"fuzz.pt"});
  }
}

void config_yaml(const uint8_t* data, size_t size) {
  const char* p = reinterpret_cast<const char*>(data);
  const char* nul = static_cast<const char*>(std::memchr(p, 0, size));
  const std::string text(p, nul ? size_t(nul - p) : size);
  std::vector<std::string> overrides;
  if (nul) {
    const std::string rest(nul + 1, size - size_t(nul - p) - 1);
    size_t b = 0;
    while (b <= rest.size() && overrides.size() < 8) {
      size_t e = rest.find('\n', b);
      if (e == std::string::npos) e = rest.size();
      overrides.push_back(rest.substr(b, e - b));
      b = e + 1;
    }
  }
  // Relative bases resolve under a folder that does not exist: the target reads no files.
  const std::string name = "/nonexistent-faceshard-fuzz/fuzz.yaml";
  Config c;
  try {
    c = load_config_text(text, name, overrides);
  } catch (const Error& e) {
    check_error(e, {"/", "--set", "config file '"});
    return;
  }
  const std::string printed = config_to_yaml(c);
  Config back;
  try {
    back = load_config_text(printed, "printed.yaml");
  } catch (const Error& e) {
    violated(std::string("a printed config does not load: ") + e.what() + "\n" + printed);
  }
  if (config_to_yaml(back) != printed) violated("a printed config loads back different:\n" + printed);
}

void ijb_meta(const uint8_t* data, size_t size) {
  std::string parts[3];
  size_t k = 0;
  for (size_t i = 0; i < size; ++i) {
    if (data[i] == 0 && k < 2) ++k;
    else parts[k].push_back(char(data[i]));
  }
  try {
    const IjbMeta m = parse_ijb_meta("IJBC", {"lmk.txt", parts[0]}, {"tid.txt", parts[1]}, {"pairs.txt", parts[2]});
    const size_t n = m.images.size();
    if (m.image_lines.size() != n || m.landmarks.size() != n || m.faceness.size() != n || m.templates.size() != n ||
        m.medias.size() != n)
      violated("per-image arrays differ in length");
    if (m.pair_t1.size() != m.pair_t2.size() || m.pair_label.size() != m.pair_t1.size())
      violated("per-pair arrays differ in length");
    for (size_t i = 0; i < n; ++i) {
      if (!(m.faceness[i] > 0) || !std::isfinite(m.faceness[i])) violated("a faceness score that is not finite and > 0");
      const std::string& name = m.images[i];
      if (name.empty() || name[0] == '/' || name.find('\0') != std::string::npos || name == ".." ||
          name.rfind("../", 0) == 0 || name.find("/../") != std::string::npos ||
          (name.size() >= 3 && name.compare(name.size() - 3, 3, "/..") == 0))
        violated("an image name outside loose_crop/: '" + name + "'");
    }
    const std::set<int64_t> known(m.templates.begin(), m.templates.end());
    for (size_t i = 0; i < m.pair_t1.size(); ++i)
      if (!known.count(m.pair_t1[i]) || !known.count(m.pair_t2[i])) violated("pair names an unknown template");
  } catch (const Error& e) {
    check_error(e, {"lmk.txt", "tid.txt", "pairs.txt"});
  }
}

void image_header(const uint8_t* data, size_t size) {
  EncodedImageHeader h;
  try {
    h = read_image_header(data, size, "fuzz.img");
  } catch (const Error& e) {
    check_error(e, {"fuzz.img"});
    return;
  }
  if (h.width <= 0 || h.height <= 0 || h.width > kMaxImageSide || h.height > kMaxImageSide ||
      h.width * h.height > kMaxImagePixels)
    violated("header outside the limits: " + std::to_string(h.width) + "x" + std::to_string(h.height));
  if (h.orientation < 1 || h.orientation > 8) violated("orientation " + std::to_string(h.orientation));
  if (h.channels < 1 || h.channels > 4) violated("channels " + std::to_string(h.channels));
  if (h.format == ImageFormat::bmp) {
    const uint64_t stride = (uint64_t(h.width) * uint64_t(h.bit_depth) + 31) / 32 * 4;
    if (h.bmp_pixel_offset > size || stride * uint64_t(h.height) > size - h.bmp_pixel_offset)
      violated("BMP pixels past the data");
    if (h.bmp_palette_entries < 0 || h.bmp_palette_entries > 256 ||
        h.bmp_palette_offset + uint64_t(h.bmp_palette_entries) * uint64_t(h.bmp_palette_entry_size) > size)
      violated("BMP palette past the data");
  }
  if (h.width * h.height > (int64_t(1) << 18)) return;  // larger decodes: slow, not different
  std::vector<uint8_t> bgr(size_t(h.width * h.height * 3));
  try {
    decode_to_bgr(data, size, h, bgr.data(), size_t(h.width) * 3, "fuzz.img");
  } catch (const Error& e) {
    check_error(e, {"fuzz.img"});
  }
}

const std::vector<Target>& targets() {
  static const std::vector<Target> t = {{"recordio", recordio},         {"verification_bin", verification_bin},
                                        {"state_dict_pickle", state_dict_pickle}, {"state_dict_zip", state_dict_zip},
                                        {"config_yaml", config_yaml},   {"ijb_meta", ijb_meta},
                                        {"image_header", image_header}};
  return t;
}

}  // namespace faceshard::fuzz
