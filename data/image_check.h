// The check of image files before they are used, shared by faceshard-pack (before it packs)
// and the trainer's image-folder source (before it trains): each file read whole and its
// header and end checked (check_image_bytes: a JPEG, PNG or BMP of the expected size, not
// cut short), no pixel decoded. Every problem is found in one pass, not one at a time.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "data/pack_source.h"

namespace faceshard {

// Reads a whole file of at most 64 MiB (an aligned face is a few KB). False with `why`
// ("cannot open: ...", "read error", "larger than 64 MiB ...") when it cannot.
bool read_image_file(const std::string& path, std::vector<uint8_t>& out, std::string& why);

// "" when the file is a size x size image that is not cut short, else what is wrong.
// `buffer` holds the file's bytes afterwards (reused between calls).
std::string check_image_file(const std::string& path, int size, std::vector<uint8_t>& buffer);

// Checks every item of `source` on `threads` threads; appends a problem for each bad one
// (in item order) and returns their indexes, sorted (drop_items' input).
std::vector<uint64_t> check_source_images(const PackSource& source, int size, int threads,
                                          std::vector<PackProblem>& problems);

}  // namespace faceshard
