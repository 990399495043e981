#include "data/image_header.h"

#include <cstdio>

#include "base/error.h"

namespace faceshard {

namespace {

uint32_t be16(const uint8_t* p) { return uint32_t(p[0]) << 8 | p[1]; }
uint32_t be32(const uint8_t* p) { return uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | p[3]; }
uint32_t le16(const uint8_t* p) { return uint32_t(p[1]) << 8 | p[0]; }
uint32_t le32(const uint8_t* p) { return uint32_t(p[3]) << 24 | uint32_t(p[2]) << 16 | uint32_t(p[1]) << 8 | p[0]; }

std::string hex2(unsigned v) {
  char b[8];
  std::snprintf(b, sizeof b, "0x%02x", v & 0xffu);
  return b;
}

void check_limits(const EncodedImageHeader& h, const std::string& where) {
  const char* f = image_format_name(h.format);
  if (h.width <= 0 || h.height <= 0) {
    throw runtime_error(where, ": ", f, " header declares a ", h.width, "x", h.height, " image (no pixels)");
  }
  if (h.width > kMaxImageSide || h.height > kMaxImageSide || h.width * h.height > kMaxImagePixels) {
    throw runtime_error(where, ": ", f, " header declares a ", h.width, "x", h.height,
                        " image, more than faceshard decodes (at most ", kMaxImageSide, " pixels a side and ",
                        kMaxImagePixels, " pixels in all)");
  }
}

// The EXIF orientation (TIFF tag 0x0112 of IFD0) of an APP1 payload that starts with
// "Exif\0\0"; 1 when there is none or the block is malformed (as OpenCV, which reads the
// tag's first 16-bit value whatever its declared type).
int exif_orientation(const uint8_t* p, size_t n) {
  if (n < 6 + 8 || std::string(reinterpret_cast<const char*>(p), 6) != std::string("Exif\0\0", 6)) return 1;
  const uint8_t* t = p + 6;
  const size_t len = n - 6;
  bool le;
  if (t[0] == 'I' && t[1] == 'I') le = true;
  else if (t[0] == 'M' && t[1] == 'M') le = false;
  else return 1;
  auto u16 = [&](size_t o) { return le ? le16(t + o) : be16(t + o); };
  auto u32 = [&](size_t o) { return le ? le32(t + o) : be32(t + o); };
  if (u16(2) != 42) return 1;
  const uint64_t ifd = u32(4);
  if (ifd + 2 > len) return 1;
  const uint64_t count = u16(size_t(ifd));
  for (uint64_t i = 0; i < count; ++i) {
    const uint64_t e = ifd + 2 + 12 * i;
    if (e + 12 > len) return 1;
    if (u16(size_t(e)) == 0x0112) {
      const uint32_t v = u16(size_t(e + 8));
      return v >= 1 && v <= 8 ? int(v) : 1;
    }
  }
  return 1;
}

EncodedImageHeader read_jpeg(const uint8_t* d, size_t n, const std::string& where) {
  EncodedImageHeader h;
  h.format = ImageFormat::jpeg;
  bool exif_seen = false;
  size_t pos = 2;  // after SOI
  while (true) {
    // A marker: 0xFF, any number of 0xFF fill bytes, the marker code.
    if (pos >= n) throw runtime_error(where, ": JPEG ends at byte ", n, " before its frame header (SOF)");
    if (d[pos] != 0xFF) {
      throw runtime_error(where, ": JPEG byte ", pos, " is ", hex2(d[pos]), " where a marker (0xff) was expected");
    }
    while (pos < n && d[pos] == 0xFF) ++pos;
    if (pos >= n) throw runtime_error(where, ": JPEG ends at byte ", n, " before its frame header (SOF)");
    const unsigned m = d[pos++];
    if (m == 0xD8) throw runtime_error(where, ": JPEG has a second start-of-image marker at byte ", pos - 2);
    if (m == 0xD9) throw runtime_error(where, ": JPEG ends (EOI at byte ", pos - 2, ") before its frame header (SOF)");
    if (m == 0xDA) throw runtime_error(where, ": JPEG has a scan (SOS at byte ", pos - 2, ") before its frame header (SOF)");
    if (m == 0x01 || (m >= 0xD0 && m <= 0xD7)) continue;  // markers without a length
    if (m == 0x00) throw runtime_error(where, ": JPEG has an invalid marker 0xff00 at byte ", pos - 2);
    if (pos + 2 > n) throw runtime_error(where, ": JPEG ends inside the length of marker ", hex2(m), " at byte ", pos - 2);
    const size_t len = be16(d + pos);
    if (len < 2) throw runtime_error(where, ": JPEG marker ", hex2(m), " at byte ", pos - 2, " has a length of ", len);
    if (len > n - pos) {
      throw runtime_error(where, ": JPEG marker ", hex2(m), " at byte ", pos - 2, " declares ", len,
                          " bytes, past the end of the data (", n, " bytes)");
    }
    const uint8_t* seg = d + pos + 2;
    const size_t seg_len = len - 2;
    const bool sof = m >= 0xC0 && m <= 0xCF && m != 0xC4 && m != 0xC8 && m != 0xCC;
    if (m == 0xE1 && !exif_seen && seg_len >= 6 && std::string(reinterpret_cast<const char*>(seg), 6) == std::string("Exif\0\0", 6)) {
      exif_seen = true;
      h.orientation = exif_orientation(seg, seg_len);
    }
    if (!sof) {
      pos += len;
      continue;
    }
    // SOFn: precision, height, width, component count, 3 bytes per component.
    if (seg_len < 6) throw runtime_error(where, ": JPEG frame header (SOF) at byte ", pos - 2, " is cut short");
    const unsigned precision = seg[0], components = seg[5];
    h.height = be16(seg + 1);
    h.width = be16(seg + 3);
    if (seg_len < 6 + 3 * size_t(components)) {
      throw runtime_error(where, ": JPEG frame header (SOF) at byte ", pos - 2, " is shorter than its ", components,
                          " components");
    }
    // Baseline, extended sequential and progressive, Huffman or arithmetic coded: what
    // libjpeg-turbo decodes at 8 bits. Lossless (0xc3) and hierarchical (0xc5-0xc7,
    // 0xcd-0xcf) it does not.
    if (!(m == 0xC0 || m == 0xC1 || m == 0xC2 || m == 0xC9 || m == 0xCA)) {
      throw runtime_error(where, ": JPEG uses a coding process faceshard does not decode (SOF marker ", hex2(m), ")");
    }
    h.progressive = m == 0xC2 || m == 0xCA;
    if (precision != 8) throw runtime_error(where, ": JPEG has ", precision, "-bit samples (only 8-bit JPEG is decoded)");
    if (h.height == 0) {
      throw runtime_error(where, ": JPEG frame header declares height 0 (a height set later by a DNL marker is not supported)");
    }
    if (components != 1 && components != 3) {
      throw runtime_error(where, ": JPEG has ", components, " colour components (only greyscale and YCbCr/RGB are decoded",
                          components == 4 ? ", not CMYK" : "", ")");
    }
    h.channels = int(components);
    h.bit_depth = 8;
    return h;
  }
}

EncodedImageHeader read_png(const uint8_t* d, size_t n, const std::string& where) {
  // Signature (8), then the IHDR chunk: length 13, "IHDR", width, height, bit depth,
  // colour type, compression, filter, interlace, CRC.
  if (n < 8 + 8 + 13) throw runtime_error(where, ": PNG ends at byte ", n, " before its header chunk (IHDR) does");
  if (be32(d + 8) != 13 || std::string(reinterpret_cast<const char*>(d + 12), 4) != "IHDR") {
    throw runtime_error(where, ": PNG does not start with a 13-byte IHDR chunk");
  }
  EncodedImageHeader h;
  h.format = ImageFormat::png;
  const uint8_t* c = d + 16;
  const uint32_t w = be32(c), ht = be32(c + 4);
  // PNG sizes are at most 2^31 - 1; a larger value is not a size.
  if (w > 0x7fffffffu || ht > 0x7fffffffu) {
    throw runtime_error(where, ": PNG header declares an invalid size ", w, "x", ht);
  }
  h.width = w;
  h.height = ht;
  h.bit_depth = c[8];
  const unsigned type = c[9];
  switch (type) {
    case 0: h.channels = 1; break;  // grey
    case 2: h.channels = 3; break;  // RGB
    case 3: h.channels = 1; break;  // palette
    case 4: h.channels = 2; break;  // grey + alpha
    case 6: h.channels = 4; break;  // RGBA
    default: throw runtime_error(where, ": PNG header has an invalid colour type ", type);
  }
  const unsigned bd = unsigned(h.bit_depth);
  const bool depth_ok = type == 0 ? (bd == 1 || bd == 2 || bd == 4 || bd == 8 || bd == 16)
                        : type == 3 ? (bd == 1 || bd == 2 || bd == 4 || bd == 8)
                                    : (bd == 8 || bd == 16);
  if (!depth_ok) throw runtime_error(where, ": PNG header has an invalid bit depth ", bd, " for colour type ", type);
  if (c[10] != 0 || c[11] != 0) throw runtime_error(where, ": PNG header names an unknown compression or filter method");
  if (c[12] > 1) throw runtime_error(where, ": PNG header names an unknown interlace method ", unsigned(c[12]));
  h.progressive = c[12] == 1;
  return h;
}

EncodedImageHeader read_bmp(const uint8_t* d, size_t n, const std::string& where) {
  if (n < 14 + 12) throw runtime_error(where, ": BMP ends at byte ", n, " inside its header");
  EncodedImageHeader h;
  h.format = ImageFormat::bmp;
  h.bmp_pixel_offset = le32(d + 10);
  const uint32_t dib = le32(d + 14);
  uint32_t compression = 0, colors_used = 0;
  int64_t w, ht;
  if (dib == 12) {  // BITMAPCOREHEADER: 16-bit sizes, 3-byte palette entries
    w = le16(d + 18);
    ht = int16_t(le16(d + 20));
    h.bit_depth = int(le16(d + 24));
    h.bmp_palette_entry_size = 3;
  } else if (dib == 40 || dib == 52 || dib == 56 || dib == 64 || dib == 108 || dib == 124) {
    if (n < 14 + 40) throw runtime_error(where, ": BMP ends at byte ", n, " inside its header");
    w = int32_t(le32(d + 18));
    ht = int32_t(le32(d + 22));
    h.bit_depth = int(le16(d + 28));
    compression = le32(d + 30);
    colors_used = le32(d + 46);
  } else {
    throw runtime_error(where, ": BMP has an unknown info header of ", dib, " bytes");
  }
  if (uint64_t(14) + dib > n) throw runtime_error(where, ": BMP ends at byte ", n, " inside its header");
  // Negative height: rows stored top to bottom.
  h.bmp_top_down = ht < 0;
  h.width = w;
  h.height = ht < 0 ? -ht : ht;
  const int bpp = h.bit_depth;
  if (bpp != 1 && bpp != 4 && bpp != 8 && bpp != 24 && bpp != 32) {
    throw runtime_error(where, ": BMP has ", bpp, " bits per pixel (faceshard decodes 1, 4, 8, 24 and 32)");
  }
  // BI_BITFIELDS / BI_ALPHABITFIELDS: uncompressed pixels whose channels are placed by
  // masks (after a 40-byte header, inside larger ones: at byte 54 either way). 32-bit BGRA
  // as OpenCV and Windows write it is the only placement taken.
  if ((compression == 3 || compression == 6) && dib >= 40) {
    if (bpp != 32 || n < 54 + 12) {
      throw runtime_error(where, ": BMP with colour masks at ", bpp, " bits per pixel (faceshard decodes 32-bit BGRA masks only)");
    }
    const uint32_t r = le32(d + 54), g = le32(d + 58), b = le32(d + 62);
    if (r != 0x00FF0000u || g != 0x0000FF00u || b != 0x000000FFu) {
      throw runtime_error(where, ": BMP places its colours by masks other than 8-bit BGR(A) (red ", r, ", green ", g,
                          ", blue ", b, ")");
    }
    compression = 0;
  }
  if (compression != 0) {
    throw runtime_error(where, ": BMP is compressed (method ", compression, "); faceshard decodes uncompressed BMP only");
  }
  h.channels = bpp <= 8 ? 1 : 3;
  check_limits(h, where);
  if (bpp <= 8) {
    const uint32_t full = 1u << bpp;
    if (colors_used > full) throw runtime_error(where, ": BMP declares ", colors_used, " palette colours for ", bpp, "-bit pixels");
    h.bmp_palette_entries = int(colors_used ? colors_used : full);
    h.bmp_palette_offset = 14 + uint64_t(dib);
    const uint64_t end = h.bmp_palette_offset + uint64_t(h.bmp_palette_entries) * uint64_t(h.bmp_palette_entry_size);
    if (end > n) throw runtime_error(where, ": BMP palette ends past the data (", n, " bytes)");
  }
  // Rows are padded to 4 bytes; all of them must be there.
  const uint64_t stride = (uint64_t(h.width) * uint64_t(bpp) + 31) / 32 * 4;
  const uint64_t need = stride * uint64_t(h.height);
  if (h.bmp_pixel_offset > n || need > n - h.bmp_pixel_offset) {
    throw runtime_error(where, ": BMP pixel data (", need, " bytes from byte ", h.bmp_pixel_offset,
                        ") runs past the end of the data (", n, " bytes)");
  }
  return h;
}

}  // namespace

const char* image_format_name(ImageFormat f) {
  switch (f) {
    case ImageFormat::jpeg: return "JPEG";
    case ImageFormat::png: return "PNG";
    case ImageFormat::bmp: return "BMP";
  }
  return "image";
}

uint64_t EncodedImageHeader::decode_bytes() const {
  const uint64_t pixels = uint64_t(width) * uint64_t(height);
  uint64_t work = 0;
  if (format == ImageFormat::jpeg && progressive) work = 2 * pixels * uint64_t(channels);
  return 3 * pixels + work;
}

EncodedImageHeader read_image_header(const uint8_t* data, size_t size, const std::string& where) {
  if (size == 0) throw runtime_error(where, ": empty image (0 bytes)");
  EncodedImageHeader h;
  if (size >= 3 && data[0] == 0xFF && data[1] == 0xD8 && data[2] == 0xFF) {
    h = read_jpeg(data, size, where);
  } else if (size >= 8 && std::string(reinterpret_cast<const char*>(data), 8) == "\x89PNG\r\n\x1a\n") {
    h = read_png(data, size, where);
  } else if (size >= 2 && data[0] == 'B' && data[1] == 'M') {
    return read_bmp(data, size, where);  // checks the limits before the palette and pixel sizes
  } else {
    std::string head;
    for (size_t i = 0; i < size && i < 4; ++i) head += (i ? " " : "") + hex2(data[i]);
    throw runtime_error(where, ": not a JPEG, PNG or BMP image (", size, " bytes starting ", head, ")");
  }
  check_limits(h, where);
  return h;
}

}  // namespace faceshard
