#include "partial_fc/distributed/dist_env.h"

#include <cstdlib>
#include <sstream>

#include "base/error.h"

extern char** environ;

namespace faceshard {
namespace {

struct EnvReader {
  const std::map<std::string, std::string>& env;
  bool has(const std::string& k) const { return env.count(k) && !env.at(k).empty(); }
  std::string str(const std::string& k, const std::string& dflt = "") const {
    return has(k) ? env.at(k) : dflt;
  }
  int integer(const std::string& k, int dflt) const {
    if (!has(k)) return dflt;
    const std::string& v = env.at(k);
    char* end = nullptr;
    long x = std::strtol(v.c_str(), &end, 10);
    if (end == v.c_str() || *end != '\0' || x < 0 || x > 1000000000)
      throw usage_error("environment variable ", k, "='", v, "' is not a non-negative integer");
    return static_cast<int>(x);
  }
};

}  // namespace

std::string slurm_first_host(const std::string& nodelist) {
  // Grammar: host[,host...]; a host may carry one bracket range list: prefix[a-b,c]suffix.
  std::string first;
  int depth = 0;
  for (char c : nodelist) {
    if (c == '[') depth++;
    if (c == ']') depth--;
    if (c == ',' && depth == 0) break;
    first.push_back(c);
  }
  auto lb = first.find('[');
  if (lb == std::string::npos) return first;
  auto rb = first.find(']', lb);
  if (rb == std::string::npos) throw usage_error("SLURM_JOB_NODELIST='", nodelist, "' is malformed");
  std::string range = first.substr(lb + 1, rb - lb - 1);
  std::string item = range.substr(0, range.find(','));
  item = item.substr(0, item.find('-'));
  return first.substr(0, lb) + item + first.substr(rb + 1);
}

DistEnv DistEnv::from_map(const std::map<std::string, std::string>& m) {
  EnvReader e{m};
  DistEnv d;
  if (e.has("RANK") || e.has("WORLD_SIZE")) {
    d.source = e.has("TORCHELASTIC_RUN_ID") ? "torchrun" : "launch";
    if (!e.has("RANK") || !e.has("WORLD_SIZE"))
      throw usage_error("environment: RANK and WORLD_SIZE must be set together");
    d.rank = e.integer("RANK", 0);
    d.world_size = e.integer("WORLD_SIZE", 1);
    d.local_rank = e.integer("LOCAL_RANK", d.rank);
    d.local_world_size = e.integer("LOCAL_WORLD_SIZE", e.has("LOCAL_RANK") ? d.world_size : d.world_size);
    d.node_rank = e.integer("GROUP_RANK", e.integer("NODE_RANK", 0));
    d.master_addr = e.str("MASTER_ADDR", "127.0.0.1");
    d.master_port = e.integer("MASTER_PORT", 29500);
    d.agent_store = e.str("TORCHELASTIC_USE_AGENT_STORE") == "True";
    d.restart_count = e.integer("TORCHELASTIC_RESTART_COUNT", 0);
    d.max_restarts = e.integer("TORCHELASTIC_MAX_RESTARTS", 0);
  } else if (e.has("SLURM_PROCID") && e.has("SLURM_NTASKS")) {
    d.source = "slurm";
    d.rank = e.integer("SLURM_PROCID", 0);
    d.world_size = e.integer("SLURM_NTASKS", 1);
    d.local_rank = e.integer("SLURM_LOCALID", 0);
    // SLURM_NTASKS_PER_NODE may read "4(x2)"; the leading number is what matters here.
    std::string per_node = e.str("SLURM_NTASKS_PER_NODE", e.str("SLURM_TASKS_PER_NODE", ""));
    d.local_world_size = per_node.empty() ? d.world_size : std::max(1, std::atoi(per_node.c_str()));
    d.node_rank = e.integer("SLURM_NODEID", 0);
    d.slurm_restart_count = e.integer("SLURM_RESTART_COUNT", 0);
    if (e.has("MASTER_ADDR")) {
      d.master_addr = e.str("MASTER_ADDR");
    } else if (e.has("SLURM_JOB_NODELIST") || e.has("SLURM_NODELIST")) {
      d.master_addr = slurm_first_host(e.str("SLURM_JOB_NODELIST", e.str("SLURM_NODELIST")));
    } else if (d.world_size > 1) {
      throw usage_error("environment: under SLURM set MASTER_ADDR or SLURM_JOB_NODELIST");
    }
    // A port derived from the job id lets several jobs share nodes without configuration.
    d.master_port = e.has("MASTER_PORT") ? e.integer("MASTER_PORT", 29500)
                                         : 20000 + e.integer("SLURM_JOB_ID", 9500) % 20000;
  }
  if (d.world_size < 1) throw usage_error("environment: WORLD_SIZE must be >= 1");
  if (d.rank >= d.world_size)
    throw usage_error("environment: rank ", d.rank, " is not below the world size ", d.world_size);
  if (d.local_world_size < 1 || d.local_rank >= d.local_world_size)
    throw usage_error("environment: local rank ", d.local_rank, " is not below the local world size ",
                      d.local_world_size);
  if (d.master_port < 1 || d.master_port > 65535)
    throw usage_error("environment: MASTER_PORT=", d.master_port, " is not a TCP port");
  return d;
}

DistEnv DistEnv::from_environment() {
  std::map<std::string, std::string> m;
  for (char** p = environ; p && *p; ++p) {
    std::string kv(*p);
    auto eq = kv.find('=');
    if (eq != std::string::npos) m[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return from_map(m);
}

std::string DistEnv::describe() const {
  std::ostringstream os;
  os << "rank " << rank << "/" << world_size << " (local " << local_rank << "/" << local_world_size
     << ", node " << node_rank << ") via " << source;
  // An elastic or requeued job restarts its workers: the log says which start this is.
  if (source == "torchrun") os << " (restart " << restart_count << " of at most " << max_restarts << ")";
  if (source == "slurm" && slurm_restart_count > 0) os << " (requeue " << slurm_restart_count << ")";
  if (world_size > 1) os << ", store " << master_addr << ":" << master_port << (agent_store ? " (agent)" : "");
  return os.str();
}

}  // namespace faceshard
