// A torch.save state_dict read straight into tensors that already exist (a model's
// parameters, a classifier shard's rows): each value streams from the file into its
// destination, so loading costs the destination's memory and no copy of the file. A CPU
// destination of the saved dtype is read into directly; a conversion, a strided
// destination (channels-last) or a GPU goes through one staging buffer of at most
// kStagingBytes (pinned for a GPU, so the host-to-device copy is a DMA). A contiguous
// tensor's rows are one byte range of its storage: a rank reads only the rows it owns.
// Every value read is checked against the file (torch_save_format.h); a whole storage has
// its CRC-32 checked as it streams, a part of one only its bounds (the CRC covers the
// whole entry). Errors name the file and the key.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "models/torch_save/tensor_source.h"
#include "models/torch_save/torch_save_format.h"

namespace faceshard {

at::ScalarType to_scalar_type(StorageType t);

class StateDictReader final : public TensorSource {
 public:
  static constexpr int64_t kStagingBytes = int64_t(32) << 20;

  // Opens and parses the file (its directory and data.pkl); reads no storage yet.
  // staging_bytes bounds the staging buffer (tests make it small to exercise chunking).
  explicit StateDictReader(const std::string& path, int64_t staging_bytes = kStagingBytes);

  const std::string& path() const { return file_.path; }
  size_t size() const override { return file_.dict.tensors.size(); }
  const std::string& name(size_t i) const override { return file_.dict.tensors.at(i).name; }
  std::vector<int64_t> sizes(size_t i) const override { return file_.dict.tensors.at(i).sizes; }
  at::ScalarType dtype(size_t i) const override;

  // Entry i into dst (dst has its sizes; any dtype, device, layout).
  void read_into(size_t i, const at::Tensor& dst) const override;
  // Rows [first, first + dst.size(0)) of entry i (1 or more dimensions) into dst, whose
  // other dimensions are the entry's. Reads only those rows' bytes.
  void read_rows_into(size_t i, int64_t first, const at::Tensor& dst) const;

 private:
  // rows [first, first + dst.size(0)) of t seen as `shape` ([1] for a 0-dim tensor).
  void copy_rows(const SavedTensor& t, const std::vector<int64_t>& shape, int64_t first, const at::Tensor& dst) const;
  at::Tensor staging(int64_t bytes, bool pinned) const;

  TorchSaveFile file_;
  int64_t staging_bytes_;
  mutable at::Tensor staging_;  // reused across reads, grown up to what one chunk needs
  mutable bool staging_pinned_ = false;
};

}  // namespace faceshard
