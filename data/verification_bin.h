// insightface verification sets (.bin: lfw, cfp_fp, agedb_30, ...): a Python pickle of
// (bins, issame_list). Read with a minimal pickle-opcode interpreter that accepts exactly
// that structure and nothing executable; written as a protocol-3 pickle Python can load.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace faceshard {

struct VerificationSet {
  std::vector<std::vector<uint8_t>> images;  // 2 per pair: pair i = images 2i, 2i+1
  std::vector<bool> issame;                  // one per pair
  size_t num_pairs() const { return issame.size(); }
};

// Parses pickle bytes. Accepts protocols 0-5 as far as the opcodes of this structure go:
// a tuple or list of two lists; images as bytes (BINBYTES*, py2 str SHORT_BINSTRING/
// BINSTRING read with encoding='bytes', str/BINUNICODE holding latin-1 text, bytearray,
// and protocol-2 `_codecs.encode(s, 'latin1')` / `bytes()` reductions); labels as bools
// (or the ints 0/1). Anything else, or a malformed stream, throws faceshard::Error
// naming `name` and the byte offset.
VerificationSet parse_verification_bin(const uint8_t* data, size_t size, const std::string& name);
VerificationSet read_verification_bin(const std::string& path);

// Protocol-3 pickle of (bins, issame_list), as pickle.dump((bins, issame), f, protocol=3).
std::vector<uint8_t> encode_verification_bin(const VerificationSet& set);
// Writes to a temporary name, then renames into place.
void write_verification_bin(const std::string& path, const VerificationSet& set);

}  // namespace faceshard
