// Protocol Buffers wire format, write side only: the messages faceshard writes itself
// (TensorBoard events, ONNX models) without a protobuf library. Large payloads (weights) are
// referenced, not copied, so a model of any size is written straight from its tensors.
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace faceshard {

// Appends an unsigned varint (a negative int64 goes as its ten-byte two's complement).
void put_varint(std::string& out, uint64_t v);
// The key of a field: (field << 3) | wire type (0 varint, 1 fixed64, 2 length-delimited,
// 5 fixed32).
void put_key(std::string& out, uint32_t field, uint32_t wire_type);
// fixed32/fixed64 values (and TFRecord's framing) are little-endian.
template <typename T>
void put_le(std::string& out, T v) {
  unsigned char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  for (size_t i = 0; i < sizeof(T) / 2; ++i) std::swap(b[i], b[sizeof(T) - 1 - i]);
#endif
  out.append(reinterpret_cast<const char*>(b), sizeof(T));
}

// One message being written: its encoded fields in order. Bytes given by reference
// (add_external_bytes) stay where they are until write_to; the caller keeps them alive.
class ProtoMessage {
 public:
  void add_varint(uint32_t field, uint64_t v);  // int32, int64 (as uint64), enum, bool
  void add_int64(uint32_t field, int64_t v) { add_varint(field, static_cast<uint64_t>(v)); }
  void add_float(uint32_t field, float v);    // wire type 5
  void add_double(uint32_t field, double v);  // wire type 1
  void add_bytes(uint32_t field, const std::string& bytes);  // string, bytes
  void add_message(uint32_t field, const ProtoMessage& message);
  // A bytes field whose n bytes at data are written later, not copied now.
  void add_external_bytes(uint32_t field, const void* data, size_t n);

  // Encoded size in bytes.
  uint64_t size() const;
  // The encoding as one string (for messages that fit in memory twice).
  std::string str() const;
  // Writes the encoding; false when a write fails.
  bool write_to(std::FILE* file) const;

 private:
  struct Piece {
    std::string bytes;              // encoded bytes, or
    const char* external = nullptr;  // n bytes held by the caller
    size_t n = 0;
  };
  std::string& tail();
  std::vector<Piece> pieces_;
};

}  // namespace faceshard
