// What a torch.save'd state_dict file says, without LibTorch: the zip container, the
// pickle (data.pkl, read by the bounded pickle machine) and the tensors it describes as
// records (name, storage entry, dtype, offset, sizes, strides), every one checked against
// the file. state_dict_io.cpp turns the records into tensors. Plain C++: it parses
// untrusted files, so it is built into the AddressSanitizer tests and the fuzz targets.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "models/torch_save/zip_archive.h"

namespace faceshard {

// torch.<Type>Storage classes a state_dict's tensors are stored in.
enum class StorageType : uint8_t { Float, Double, Half, BFloat16, Long, Int, Short, Char, Byte, Bool };
size_t storage_element_size(StorageType t);

struct SavedStorage {
  std::string key;  // the record is "<archive>/data/<key>"
  StorageType type = StorageType::Float;
  uint64_t numel = 0;
};

// A tensor: a strided view of a storage. Every element it names lies inside the storage
// and it has no more elements than its storage (or fits in the file when some stride is
// 0), so materialising any tensor costs at most the file's size.
struct SavedTensor {
  std::string name;
  size_t storage = 0;  // index into SavedStateDict::storages
  int64_t offset = 0;
  std::vector<int64_t> sizes, strides;
  uint64_t numel = 0;
};

struct SavedStateDict {
  std::vector<SavedStorage> storages;  // only those the tensors use
  std::vector<SavedTensor> tensors;    // in the dict's order; a repeated key keeps its first place and last value
};

// The state_dict described by data.pkl bytes. `path` names the file in errors;
// `file_size` bounds the elements of a view with zero strides. Throws faceshard::Error
// (runtime) with one line naming the file and the pickle offset or the entry's key.
SavedStateDict parse_state_dict_pickle(const uint8_t* data, size_t size, const std::string& path, uint64_t file_size);

// A torch.save zip file, opened: the state_dict and the zip entry of each storage, whose
// size matches the storage (checked; the bytes are read by read_storage).
struct TorchSaveFile {
  ZipArchive zip;
  SavedStateDict dict;
  std::vector<size_t> storage_entries;  // per storage: index into zip.entries()
  std::string path;

  // Copies storage i's bytes (storages[i].numel * element size) to dst.
  void read_storage(size_t i, void* dst) const;
  // Bytes [begin, end) of storage i, streamed (see ZipEntryStream: the whole storage has its
  // CRC-32 checked as it streams, a part only its bounds). Throws (runtime, naming the file)
  // when the range is not inside the storage.
  ZipEntryStream open_storage(size_t i, uint64_t begin, uint64_t end) const;
};

// True when the tensor's elements are its storage's elements [offset, offset + numel) in
// row-major order (dimensions of size 1 may have any stride): then every run of rows of
// its first dimension is one byte range of the storage.
bool is_contiguous(const SavedTensor& t);

// Opens `path` (pread; storages are not read) or a zip image in memory. Errors name the
// file: not a zip (or a legacy pre-1.6 torch.save file), a corrupt container, a missing
// data.pkl or storage record, a storage record whose size differs from its tensor's
// storage, big-endian data, a malformed pickle or a value that is not a tensor.
TorchSaveFile open_torch_save(const std::string& path);
TorchSaveFile open_torch_save(ZipArchive zip, const std::string& path);

}  // namespace faceshard
