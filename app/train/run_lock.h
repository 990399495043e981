// One run per output folder: rank 0 of a training job holds <output>/.faceshard-train.lock
// for the life of the run; the job's other ranks are tied to it through the rendezvous
// (they write into the folder only after rank 0 has it). A second run into the folder, also
// with --resume or --overwrite, is refused in one line naming the holder's host and pid.
//
// The lock is flock(2) on the file, which the kernel releases when the process ends however
// it ends (SIGKILL, the OOM killer), and the file's content names the holder (host, pid,
// job, start time). A clean end removes the file; a file found unlocked but with content is
// a dead run's stale lock: named in one line and taken over. Content alone is never trusted:
//  - holder on this host: the kernel's lock is the proof (a freed lock means the process ended);
//  - holder on another host (a shared network file system): where flock reaches across hosts
//    (NFSv4, NFSv3 with lockd) the same holds; where it is local to each host (mounted with
//    local_lock=flock or nolock) it proves nothing, so the holder renews the file's time
//    every few seconds, and a lock from another host counts as stale only when that time
//    is older than `stale_after` (the hosts' clocks must agree to well within it), or when
//    it names an earlier round of this same job (torchrun's run id, SLURM's job id: its
//    launcher stopped that round before starting this one).
#pragma once
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

namespace faceshard {

// What a lock file says about its holder.
struct RunLockHolder {
  std::string host;
  int64_t pid = 0;
  std::string job;      // "" when the job has no id of its own
  std::string started;  // UTC, ISO 8601
  // "pid 1234 on host gpu07 (torchrun run 42), started 2025-01-31T10:00:00Z"
  std::string describe() const;
};

struct RunLockOptions {
  std::string host;  // this host's name (empty: gethostname)
  std::string job;   // this job's id (empty: run_lock_job_id())
  std::chrono::milliseconds heartbeat{10000};
  std::chrono::milliseconds stale_after{60000};
  // Tests: called on each attempt between the lock file's open and its flock (where a holder
  // may release, and unlink, the file the contender has just opened).
  std::function<void(int attempt)> after_open;
};

class RunLock {
 public:
  // Creates `output` when missing and takes its lock. Usage error (one line) when a live run
  // holds it, naming its host, pid, job and start, and the lock file.
  static std::unique_ptr<RunLock> acquire(const std::string& output, const RunLockOptions& options = {});
  // Removes the lock file and releases the lock.
  ~RunLock();
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;

  const std::string& path() const { return path_; }
  // The dead run whose stale lock this one took over, and why it counts as dead.
  const std::optional<RunLockHolder>& taken_over() const { return taken_over_; }
  const std::string& taken_over_reason() const { return reason_; }

 private:
  RunLock(int fd, std::string path, std::chrono::milliseconds heartbeat);
  void renew_loop(std::chrono::milliseconds every);

  int fd_ = -1;
  std::string path_;
  std::optional<RunLockHolder> taken_over_;
  std::string reason_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::thread renewer_;
};

// The lock file of an output folder.
std::string run_lock_path(const std::string& output);
// The launcher's id of this job, the same on every host and in every restart of it:
// "torchrun run <TORCHELASTIC_RUN_ID>", "slurm job <SLURM_JOB_ID>", or "" (launch.sh, alone).
std::string run_lock_job_id();
// The holder a lock file names (nothing when it names none: empty or unreadable).
std::optional<RunLockHolder> read_run_lock(const std::string& path);

}  // namespace faceshard
