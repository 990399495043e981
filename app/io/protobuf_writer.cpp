#include "app/io/protobuf_writer.h"

namespace faceshard {

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

void put_key(std::string& out, uint32_t field, uint32_t wire_type) { put_varint(out, (field << 3) | wire_type); }

std::string& ProtoMessage::tail() {
  if (pieces_.empty() || pieces_.back().external) pieces_.emplace_back();
  return pieces_.back().bytes;
}

void ProtoMessage::add_varint(uint32_t field, uint64_t v) {
  std::string& out = tail();
  put_key(out, field, 0);
  put_varint(out, v);
}

void ProtoMessage::add_float(uint32_t field, float v) {
  std::string& out = tail();
  put_key(out, field, 5);
  put_le<float>(out, v);
}

void ProtoMessage::add_double(uint32_t field, double v) {
  std::string& out = tail();
  put_key(out, field, 1);
  put_le<double>(out, v);
}

void ProtoMessage::add_bytes(uint32_t field, const std::string& bytes) {
  std::string& out = tail();
  put_key(out, field, 2);
  put_varint(out, bytes.size());
  out += bytes;
}

void ProtoMessage::add_message(uint32_t field, const ProtoMessage& message) {
  std::string& out = tail();
  put_key(out, field, 2);
  put_varint(out, message.size());
  for (const Piece& p : message.pieces_) {
    if (p.external) pieces_.push_back(p);
    else tail() += p.bytes;
  }
}

void ProtoMessage::add_external_bytes(uint32_t field, const void* data, size_t n) {
  std::string& out = tail();
  put_key(out, field, 2);
  put_varint(out, n);
  Piece p;
  p.external = static_cast<const char*>(data);
  p.n = n;
  pieces_.push_back(std::move(p));
}

uint64_t ProtoMessage::size() const {
  uint64_t n = 0;
  for (const Piece& p : pieces_) n += p.external ? p.n : p.bytes.size();
  return n;
}

std::string ProtoMessage::str() const {
  std::string out;
  out.reserve(size());
  for (const Piece& p : pieces_) {
    if (p.external) out.append(p.external, p.n);
    else out += p.bytes;
  }
  return out;
}

bool ProtoMessage::write_to(std::FILE* file) const {
  for (const Piece& p : pieces_) {
    const char* data = p.external ? p.external : p.bytes.data();
    const size_t n = p.external ? p.n : p.bytes.size();
    if (n > 0 && std::fwrite(data, 1, n, file) != n) return false;
  }
  return true;
}

}  // namespace faceshard
