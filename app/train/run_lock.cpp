#include "app/train/run_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <sstream>

#include "app/train/run_folder.h"
#include "base/error.h"

namespace faceshard {
namespace fs = std::filesystem;

namespace {

std::string this_host() {
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) != 0) return "unknown";
  return name;
}

std::string utc_now() {
  char stamp[32];
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  std::strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%SZ", &utc);
  return stamp;
}

std::string read_all(int fd) {
  std::string text;
  char buf[1024];
  for (off_t at = 0;;) {
    const ssize_t n = pread(fd, buf, sizeof buf, at);
    if (n <= 0 || text.size() > 64 * 1024) break;
    text.append(buf, static_cast<size_t>(n));
    at += n;
  }
  return text;
}

std::optional<RunLockHolder> parse_holder(const std::string& text) {
  RunLockHolder h;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    const size_t eq = line.find('=');
    if (eq == std::string::npos) continue;
    const std::string key = line.substr(0, eq), value = detail::printable(line.substr(eq + 1), 200);
    if (key == "host") h.host = value;
    else if (key == "pid") h.pid = std::atoll(value.c_str());
    else if (key == "job") h.job = value;
    else if (key == "started") h.started = value;
  }
  if (h.host.empty() && h.pid == 0) return std::nullopt;
  return h;
}

// Seconds since the file's modification time (the holder's last renewal).
double age_s(int fd) {
  struct stat st {};
  if (fstat(fd, &st) != 0) return 0;
  struct timespec now {};
  clock_gettime(CLOCK_REALTIME, &now);
  return static_cast<double>(now.tv_sec - st.st_mtim.tv_sec) + (now.tv_nsec - st.st_mtim.tv_nsec) * 1e-9;
}

// The file at `path` is still the one `fd` has open (a releasing holder unlinks it: a lock
// taken on the unlinked file would be nobody's).
bool still_linked(int fd, const std::string& path) {
  struct stat a {}, b {};
  return fstat(fd, &a) == 0 && stat(path.c_str(), &b) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino;
}

}  // namespace

std::string RunLockHolder::describe() const {
  std::ostringstream os;
  os << "pid " << pid << " on host " << (host.empty() ? "?" : host);
  if (!job.empty()) os << " (" << job << ")";
  if (!started.empty()) os << ", started " << started;
  return os.str();
}

std::string run_lock_path(const std::string& output) { return (fs::path(output) / ".faceshard-train.lock").string(); }

std::string run_lock_job_id() {
  // torchrun's default --rdzv-id is "none": no id that tells two jobs apart.
  if (const char* id = std::getenv("TORCHELASTIC_RUN_ID"); id && *id && std::string(id) != "none")
    return std::string("torchrun run ") + id;
  if (const char* id = std::getenv("SLURM_JOB_ID"); id && *id) return std::string("slurm job ") + id;
  return "";
}

std::optional<RunLockHolder> read_run_lock(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  const std::string text = read_all(fd);
  close(fd);
  return parse_holder(text);
}

std::unique_ptr<RunLock> RunLock::acquire(const std::string& output, const RunLockOptions& options) {
  const std::string host = options.host.empty() ? this_host() : options.host;
  const std::string job = options.job.empty() ? run_lock_job_id() : options.job;
  std::error_code ec;
  if (fs::exists(output, ec) && !fs::is_directory(output, ec))
    throw usage_error("output '", absolute_text(output), "' is a file, not a folder");
  fs::create_directories(output, ec);
  if (ec) throw usage_error("output '", absolute_text(output), "': cannot create the folder: ", ec.message());
  const std::string path = run_lock_path(output);
  const std::string shown = absolute_text(path);
  for (int attempt = 0; attempt < 100; ++attempt) {
    const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) throw usage_error("output '", absolute_text(output), "': cannot open its lock file '", shown, "': ", std::strerror(errno));
    if (options.after_open) options.after_open(attempt);
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      if (err != EWOULDBLOCK) {
        close(fd);
        throw usage_error("output '", absolute_text(output), "': cannot lock '", shown, "': ", std::strerror(err));
      }
      // A live holder. It writes its name right after it takes the lock: wait up to 2 s for it.
      std::optional<RunLockHolder> holder;
      for (int k = 0; k < 100 && !(holder = parse_holder(read_all(fd))); ++k)
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      close(fd);
      throw usage_error("output '", absolute_text(output), "' is in use by another training run (",
                        holder ? holder->describe() : std::string("its holder has not written its name"),
                        "; lock file '", shown, "'): --resume and --overwrite also wait until it has ended; "
                        "or choose another output (--set output=DIR)");
    }
    if (!still_linked(fd, path)) {  // the holder released it as we opened it: take the new file
      close(fd);
      continue;
    }
    // The kernel gave the lock: a holder the file still names ended without removing it,
    // unless it lives on another host whose flock this one cannot see.
    std::optional<RunLockHolder> stale = parse_holder(read_all(fd));
    std::string reason;
    if (stale) {
      if (stale->host == host) {
        reason = "its process ended without releasing it";
      } else if (!job.empty() && stale->job == job) {
        reason = "an earlier round of this job, " + job + ", which its launcher stopped";
      } else {
        const double age = age_s(fd);
        const double limit = std::chrono::duration<double>(options.stale_after).count();
        if (age < limit) {
          close(fd);
          throw usage_error("output '", absolute_text(output), "' is in use by another training run (",
                            stale->describe(), "; lock file '", shown, "' renewed ", static_cast<int64_t>(age),
                            " s ago, from another host whose lock this host cannot see): --resume and --overwrite "
                            "also wait until it has ended (a lock not renewed for ",
                            static_cast<int64_t>(limit), " s is taken over); or choose another output (--set output=DIR)");
        }
        reason = "not renewed for " + std::to_string(static_cast<int64_t>(age)) + " s";
      }
    }
    std::ostringstream content;
    content << "host=" << host << "\npid=" << getpid() << "\njob=" << job << "\nstarted=" << utc_now() << "\n";
    const std::string text = content.str();
    if (ftruncate(fd, 0) != 0 || pwrite(fd, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size())) {
      const int err = errno;
      close(fd);
      throw usage_error("output '", absolute_text(output), "': cannot write its lock file '", shown, "': ", std::strerror(err));
    }
    fsync(fd);
    std::unique_ptr<RunLock> lock(new RunLock(fd, path, options.heartbeat));
    lock->taken_over_ = stale;
    lock->reason_ = reason;
    return lock;
  }
  throw usage_error("output '", absolute_text(output), "': its lock file '", shown, "' keeps being replaced");
}

RunLock::RunLock(int fd, std::string path, std::chrono::milliseconds heartbeat) : fd_(fd), path_(std::move(path)) {
  if (heartbeat.count() > 0) renewer_ = std::thread([this, heartbeat] { renew_loop(heartbeat); });
}

void RunLock::renew_loop(std::chrono::milliseconds every) {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!wake_.wait_for(lock, every, [this] { return stopping_; }))
    futimens(fd_, nullptr);  // the file's time says "still running" to hosts that cannot see the flock
}

RunLock::~RunLock() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (renewer_.joinable()) renewer_.join();
  // Unlinked while still locked: a run that opened the file meanwhile finds it unlinked once
  // it gets the lock, and opens the path again.
  if (still_linked(fd_, path_)) unlink(path_.c_str());
  close(fd_);
}

}  // namespace faceshard
