// A run's output folder: what a run leaves there, and the rules that keep two runs apart.
// A fresh run (no --resume) into a folder that holds another run's files is refused before
// anything is written; --overwrite moves that run's files into replaced-<UTC time>/ in the
// same folder (never deletes them). --resume DIR takes a run folder, a checkpoints folder or
// one checkpoint. Before any of this, rank 0 takes the folder's lock (run_lock.h): a run
// that is still alive in the folder refuses every other, --resume and --overwrite included.
#pragma once
#include <string>
#include <vector>

namespace faceshard {

// The entries a training run writes into its output folder.
const std::vector<std::string>& run_file_names();

// `p` as an absolute, normalised path for messages (as given where that fails).
std::string absolute_text(const std::string& p);

// Which of them `dir` holds now (empty when none, or when `dir` does not exist). An empty
// checkpoints/ or tensorboard/ folder holds nothing of a run.
std::vector<std::string> run_files_in(const std::string& dir);

// The fresh-run check, on every rank before the job is built: a usage error naming the
// folder, what it holds and the three ways on, unless it holds no run or `overwrite`.
void check_output_free_for_fresh_run(const std::string& output, bool overwrite);

// --overwrite on rank 0: moves the run's files into <output>/replaced-YYYYmmdd-HHMMSS[-N]/
// and returns that folder ("" when there was nothing to move).
std::string move_previous_run_aside(const std::string& output);

// --resume DIR: the checkpoint to start from. A checkpoint folder is taken as it is (its
// COMMITTED marker is checked when it is read); a run folder gives its newest committed
// checkpoint under checkpoints/, a checkpoints folder its newest. Usage errors name the
// absolute path: "does not exist", "is a file", "holds no committed checkpoint".
std::string resolve_resume_source(const std::string& dir);
// The same for another option that names a run or a checkpoint (`what`, e.g.
// "loss.init_centres", begins its messages).
std::string resolve_checkpoint_source(const std::string& dir, const std::string& what);

}  // namespace faceshard
