// How many rows (classes) the classifier's chunked passes take at a time: the update of the
// step's rows, the reads of sampled or bf16 columns, the streamed logits and the head's passes
// over the logits.
//
// Two policies. On the CPU ("cache") a chunk is about 2 MiB of fp32 rows, so that its
// temporaries stay in cache and below glibc's mmap threshold (heap memory is reused instead of
// fresh pages faulted in for every chunk). On a GPU ("budget") the chunk's temporaries are a
// fixed number of bytes (chunk_budget_bytes, default 2 GiB): a chunk costs the same few
// kernel launches whatever its size, so each pass's chunks are as large as the budget allows
// (at d = 512, batch 128: 1,048,576 rows of the SGD update, 466,032 columns of the logits),
// and a step's launches grow by a few per half million classes where chunks of a fixed 8192 rows
// made them ~1,200 chunks of a few dozen launches each at 10M classes. faceshard-plan counts
// the budget as a fixed reserve of the classifier (ChunkSizes::temporary_bytes).
#pragma once
#include <cstdint>
#include <string>

namespace faceshard {

enum class ChunkPolicy {
  Auto,    // budget on a GPU, cache on the CPU
  Cache,   // cache-sized chunks (the CPU's)
  Budget,  // chunks sized from a memory budget (a GPU's; on the CPU for measuring a GPU's launch count)
};

// "auto", "cache", "budget"; anything else is an option error naming "fc_chunking".
ChunkPolicy parse_chunk_policy(const std::string& name);
const char* chunk_policy_name(ChunkPolicy p);

struct ChunkInputs {
  bool cuda = false;               // the shard's device is a GPU
  ChunkPolicy policy = ChunkPolicy::Auto;
  int64_t fixed_rows = 0;          // PartialFCOptions::update_chunk_rows (> 0: every chunk this size)
  int64_t budget_bytes = 0;        // the budget policy's temporaries (0: kDefaultChunkBudget)
  int64_t embedding_size = 512;
  int64_t global_rows = 128;       // the logits' rows: batch per rank x ranks
  // The update runs in one pass per row where the rows live (SGD: the CPU's loop, the GPU's
  // kernel): its only temporary is the chunk's raw gradient. Otherwise (AdamW, the generic
  // path) fp32 copies of the rows and their state come on top.
  bool fused_update = true;
  // The GEMMs run in a reduced precision (PartialFCOptions::gemm_dtype bf16/fp16): each
  // chunk's slice of the logits' gradient G' [global_rows, chunk] is converted for them, a
  // copy of 2 B an element beside the fp32 one.
  bool reduced_gemm = false;
};

struct ChunkSizes {
  int64_t update_rows = 0;     // rows per piece of the step's update
  int64_t logits_columns = 0;  // columns per chunk of the passes over the logits (a multiple of 4)
  // The most the chunk temporaries take at once (from the per-row bytes below): what the
  // memory plan reserves for them.
  double temporary_bytes = 0;
};

constexpr int64_t kDefaultChunkBudget = int64_t(2) << 30;

// The temporaries one row of the update's chunk brings, in bytes: its fp32 raw gradient (4 B
// an element), and without the one-pass update an fp32 copy of the row and of up to two state
// rows and the rounded result (12 B more); with reduced-precision GEMMs the row's column of
// G' converted for dW = G'^T E (2 B for each of the `global_rows` logits rows: at d = 512 an
// eighth more at batch 128, eight times as much at 8,192).
inline double update_row_bytes(int64_t embedding_size, bool fused_update, int64_t global_rows = 0,
                               bool reduced_gemm = false) {
  return (fused_update ? 4.0 : 16.0) * static_cast<double>(embedding_size) +
         (reduced_gemm ? 2.0 * static_cast<double>(global_rows) : 0.0);
}
// The temporaries one column (class) of a pass over the logits brings: the fp32 column read
// from the shard and its reduced-precision copy for the GEMM (6 B an element), and three fp32
// logits of each of the N rows (the chunk's logits and the temporaries of the head's and the
// softmax's arithmetic on them); with reduced-precision GEMMs the column of G' converted for
// the backward's GEMMs as well (2 B for each of the N rows).
inline double column_bytes(int64_t embedding_size, int64_t global_rows, bool reduced_gemm = false) {
  return 6.0 * static_cast<double>(embedding_size) + (reduced_gemm ? 14.0 : 12.0) * static_cast<double>(global_rows);
}
// The bytes of both for `in` (its rows, its GEMMs' precision).
inline double update_row_bytes(const ChunkInputs& in) {
  return update_row_bytes(in.embedding_size, in.fused_update, in.global_rows, in.reduced_gemm);
}
inline double column_bytes(const ChunkInputs& in) {
  return column_bytes(in.embedding_size, in.global_rows, in.reduced_gemm);
}

ChunkSizes chunk_sizes(const ChunkInputs& in);

}  // namespace faceshard
