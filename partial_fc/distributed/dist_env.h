// Where this process sits in a job: rank, world size, local rank and the rendezvous
// address, read from the variables torchrun, SLURM's srun or tools/launch.sh set (or a
// single process when none is set).
#pragma once
#include <map>
#include <string>

namespace faceshard {

struct DistEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  // torchrun's agent already hosts the TCPStore at master_addr:master_port: every rank
  // connects as a client under the prefix "/worker/attempt_<restart_count>".
  bool agent_store = false;
  int restart_count = 0;
  int max_restarts = 0;            // TORCHELASTIC_MAX_RESTARTS (logged with the restart count)
  // SLURM: the job's requeue count (SLURM_RESTART_COUNT), logged so that a requeued job's log
  // says which run it is.
  int slurm_restart_count = 0;
  std::string source = "single";  // "torchrun", "slurm", "launch", "single"

  // Reads the process environment; throws a usage Error naming the variable when the
  // variables are inconsistent (rank >= world size, non-numeric values, ...).
  static DistEnv from_environment();
  // The same from an explicit map (tests).
  static DistEnv from_map(const std::map<std::string, std::string>& env);
  std::string describe() const;
};

// First host of a SLURM node list: "gpu[03-05,7],cpu1" -> "gpu03".
std::string slurm_first_host(const std::string& nodelist);

}  // namespace faceshard
