// Reading a checkpoint back before it is trusted: every file a committed checkpoint must
// hold (backbone.pt, train_state.pt, fc_shard_<r>.pt of each rank it was saved by), each
// zip's directory and the CRC-32 of every entry, read through once. A save verifies what it
// wrote before it commits; a resume verifies the checkpoint it starts from and walks back
// to the newest one that verifies. The ranks share the files out and agree on the verdict.
#pragma once
#include <string>
#include <vector>

#include "app/io/checkpoint.h"
#include "partial_fc/distributed/distributed.h"

namespace faceshard {

// "" when the file reads back whole (every entry's CRC-32 matches), else one line naming
// the file and what is wrong.
std::string verify_checkpoint_file(const std::string& path);

// The files a committed checkpoint holds.
std::vector<std::string> checkpoint_file_names(const CheckpointInfo& info);

// Collective: "" when every file of the committed checkpoint `dir` verifies (file k read by
// rank k % world), else the first problem found (the same line on every rank).
std::string verify_checkpoint(const std::string& dir, Distributed& d);

// Collective: the same text on every rank, rank 0's unless empty, else the first non-empty
// one of the others ("" when every rank gave "").
std::string agree_on_problem(const std::string& mine, Distributed& d);

// Collective, for a resume: `newest` (a committed step folder) when it verifies; otherwise,
// with walk_back, the newest older committed checkpoint beside it that does, saying on rank
// 0 in one line which ones were passed over and why. Runtime error (a data error, exit
// status 1; the same on every rank) when none verifies.
std::string choose_verified_checkpoint(const std::string& newest, bool walk_back, Distributed& d);

}  // namespace faceshard
