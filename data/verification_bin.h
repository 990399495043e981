// insightface verification sets (.bin: lfw, cfp_fp, agedb_30, ...): a Python pickle of
// (bins, issame_list). Read with a minimal pickle-opcode interpreter that accepts exactly
// that structure and nothing executable; written as a protocol-3 pickle Python can load.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace faceshard {

// One encoded image (JPEG/PNG bytes), shared: a pickle may reference one image object
// many times through its memo, and the references share one buffer instead of copies.
class ImageBytes {
 public:
  ImageBytes() = default;
  ImageBytes(std::vector<uint8_t> bytes)  // NOLINT: a vector of bytes is an image's bytes
      : p_(std::make_shared<const std::vector<uint8_t>>(std::move(bytes))) {}
  explicit ImageBytes(std::shared_ptr<const std::vector<uint8_t>> bytes) : p_(std::move(bytes)) {}

  const std::vector<uint8_t>& bytes() const { return p_ ? *p_ : no_bytes(); }
  const uint8_t* data() const { return bytes().data(); }
  size_t size() const { return bytes().size(); }
  bool empty() const { return size() == 0; }
  std::vector<uint8_t>::const_iterator begin() const { return bytes().begin(); }
  std::vector<uint8_t>::const_iterator end() const { return bytes().end(); }
  // Whether two references share one buffer (the same object in the pickle).
  bool shares(const ImageBytes& o) const { return p_ && p_ == o.p_; }
  bool operator==(const ImageBytes& o) const { return bytes() == o.bytes(); }
  bool operator!=(const ImageBytes& o) const { return !(*this == o); }

 private:
  static const std::vector<uint8_t>& no_bytes() {
    static const std::vector<uint8_t> e;
    return e;
  }
  std::shared_ptr<const std::vector<uint8_t>> p_;
};

struct VerificationSet {
  std::vector<ImageBytes> images;  // 2 per pair: pair i = images 2i, 2i+1
  std::vector<bool> issame;                  // one per pair
  size_t num_pairs() const { return issame.size(); }
};

// Parses pickle bytes. Accepts protocols 0-5 as far as the opcodes of this structure go:
// a tuple or list of two lists; images as bytes (BINBYTES*, py2 str SHORT_BINSTRING/
// BINSTRING read with encoding='bytes', str/BINUNICODE holding latin-1 text, bytearray,
// and protocol-2 `_codecs.encode(s, 'latin1')` / `bytes()` reductions); labels as bools
// (or the ints 0/1). Anything else, or a malformed stream, throws faceshard::Error
// naming `name` and the byte offset.
// Bounds: nothing recurses with the input; containers nest two deep at most; the stack,
// MARKs and memo hold at most 2^20 entries each; an image referenced several times is one
// shared buffer, and the images counted with repeats may hold at most the input's size
// plus kMaxRepeatedImageBytes; references beyond an image's first (repeats) may number at
// most kMaxRepeatsPerImage per distinct image plus kRepeatAllowance (so whoever decodes
// and evaluates them does work proportional to the file). Parsing n bytes allocates at
// most about n (the image bytes) + 48 bytes per stack entry + 80 bytes per memo entry,
// under 250 MB beyond the image bytes.
constexpr uint64_t kMaxRepeatedImageBytes = uint64_t(16) << 20;
constexpr uint64_t kMaxRepeatsPerImage = 2;
constexpr uint64_t kRepeatAllowance = 1024;
VerificationSet parse_verification_bin(const uint8_t* data, size_t size, const std::string& name);
VerificationSet read_verification_bin(const std::string& path);

// Protocol-3 pickle of (bins, issame_list), as pickle.dump((bins, issame), f, protocol=3).
std::vector<uint8_t> encode_verification_bin(const VerificationSet& set);
// Writes to a temporary name, then renames into place.
void write_verification_bin(const std::string& path, const VerificationSet& set);

}  // namespace faceshard
