// One entry per parser of untrusted files: what each libFuzzer target runs on an input,
// and what the AddressSanitizer tests replay on the regression inputs in
// tests/fuzz/regressions/<target>/. An entry returns normally for every input: the data
// parsed (and checked for its invariants), or a faceshard::Error whose message is one line
// naming the input. Anything else (a crash, another exception, a broken invariant, a
// message of several lines or naming nothing) aborts with a description on stderr.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace faceshard::fuzz {

// .rec/.idx pair: bytes 0-1 give the length L (little-endian) of the .idx text that
// follows; the rest is the .rec. Reads the index, the insightface layout, records by key
// and the identity ranges, and scans the .rec sequentially.
void recordio(const uint8_t* data, size_t size);
// A verification .bin (pickle); a parsed set is written back and must read back equal.
void verification_bin(const uint8_t* data, size_t size);
// A torch.save data.pkl alone (the bounded pickle machine and the state_dict records).
void state_dict_pickle(const uint8_t* data, size_t size);
// A whole torch.save zip (CRC checks off, so that mutations reach the pickle), then its
// entries read with CRC checks on.
void state_dict_zip(const uint8_t* data, size_t size);
// YAML config text, optionally followed by a NUL byte and "--set" overrides, one per
// line; a loaded config printed and loaded again must give the same YAML.
void config_yaml(const uint8_t* data, size_t size);
// IJB meta files: name_5pts_score, face_tid_mid and template_pair_label text separated
// by NUL bytes.
void ijb_meta(const uint8_t* data, size_t size);

// An encoded image (JPEG, PNG, BMP): its header read and checked against the limits, then,
// for an image of at most 2^18 pixels, decoded by the strict decoders.
void image_header(const uint8_t* data, size_t size);

struct Target {
  const char* name;
  void (*run)(const uint8_t*, size_t);
};
const std::vector<Target>& targets();

}  // namespace faceshard::fuzz
