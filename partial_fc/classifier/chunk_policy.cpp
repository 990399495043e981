#include "partial_fc/classifier/chunk_policy.h"

#include <algorithm>

#include "base/error.h"

namespace faceshard {

ChunkPolicy parse_chunk_policy(const std::string& name) {
  if (name == "auto") return ChunkPolicy::Auto;
  if (name == "cache") return ChunkPolicy::Cache;
  if (name == "budget") return ChunkPolicy::Budget;
  throw option_error("fc_chunking", "'", name, "' is not a chunking policy (auto, cache, budget)");
}

const char* chunk_policy_name(ChunkPolicy p) {
  switch (p) {
    case ChunkPolicy::Cache: return "cache";
    case ChunkPolicy::Budget: return "budget";
    default: return "auto";
  }
}

ChunkSizes chunk_sizes(const ChunkInputs& in) {
  ChunkInputs sized = in;
  sized.embedding_size = std::max<int64_t>(1, in.embedding_size);
  sized.global_rows = std::max<int64_t>(1, in.global_rows);
  const int64_t d = sized.embedding_size;
  const double row_bytes = update_row_bytes(sized), col_bytes = column_bytes(sized);
  ChunkSizes out;
  if (in.fixed_rows > 0) {
    out.update_rows = in.fixed_rows;
    out.logits_columns = std::max<int64_t>(4, in.fixed_rows / 4 * 4);
  } else if (in.policy == ChunkPolicy::Budget || (in.policy == ChunkPolicy::Auto && in.cuda)) {
    const double budget = static_cast<double>(in.budget_bytes > 0 ? in.budget_bytes : kDefaultChunkBudget);
    out.update_rows = std::max<int64_t>(64, static_cast<int64_t>(budget / row_bytes) / 4 * 4);
    out.logits_columns = std::max<int64_t>(64, static_cast<int64_t>(budget / col_bytes) / 4 * 4);
  } else {
    // About 2 MiB of fp32 rows (1024 at d = 512), for both.
    const int64_t rows = std::max<int64_t>(64, ((int64_t(1) << 21) / (4 * d)) / 4 * 4);
    out.update_rows = rows;
    out.logits_columns = rows;
  }
  out.temporary_bytes = std::max(static_cast<double>(out.update_rows) * row_bytes,
                                 static_cast<double>(out.logits_columns) * col_bytes);
  return out;
}

}  // namespace faceshard
