// One run per output folder (app/train/run_lock.h): a held lock refuses a second holder,
// naming its host and pid; a clean end removes the file; a lock its holder left behind is
// taken over and named when the kernel's lock is free and the holder was on this host, was an
// earlier round of the same job, or (another host, whose flock this one may not see) has
// not been renewed for stale_after; the holder renews the file's time while it lives.
// (Processes killed with SIGKILL: tests/e2e/run_lock.sh.)
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "app/train/run_lock.h"
#include "tests/test_errors.h"
#include "tests/test_files.h"

namespace faceshard {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::TempDir;

std::string hostname() {
  char name[256] = {};
  gethostname(name, sizeof name - 1);
  return name;
}

void write_lock(const std::string& path, const std::string& host, int64_t pid, const std::string& job = "") {
  std::ofstream(path) << "host=" << host << "\npid=" << pid << "\njob=" << job << "\nstarted=2025-01-31T10:00:00Z\n";
}

// Sets the file's modification time `age_s` seconds into the past.
void age_file(const std::string& path, int64_t age_s) {
  struct timespec times[2];
  clock_gettime(CLOCK_REALTIME, &times[0]);
  times[0].tv_sec -= age_s;
  times[1] = times[0];
  ASSERT_EQ(utimensat(AT_FDCWD, path.c_str(), times, 0), 0);
}

double mtime_age_s(const std::string& path) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) return -1;
  struct timespec now {};
  clock_gettime(CLOCK_REALTIME, &now);
  return static_cast<double>(now.tv_sec - st.st_mtim.tv_sec) + (now.tv_nsec - st.st_mtim.tv_nsec) * 1e-9;
}

TEST(RunLock, SecondHolderIsRefusedNamingTheFirstAndACleanEndRemovesTheFile) {
  TempDir d;
  const std::string out = d / "run";  // missing: created
  auto first = RunLock::acquire(out);
  EXPECT_FALSE(first->taken_over());
  const std::string path = run_lock_path(out);
  EXPECT_EQ(first->path(), path);
  const auto holder = read_run_lock(path);
  ASSERT_TRUE(holder);
  EXPECT_EQ(holder->pid, getpid());
  EXPECT_EQ(holder->host, hostname());
  // Another open of the same file in this process is another holder for flock(2).
  const std::string e = error_of([&] { RunLock::acquire(out); });
  EXPECT_NE(e.find("output '" + fs::absolute(out).lexically_normal().string() + "' is in use by another training run (pid " +
                   std::to_string(getpid()) + " on host " + hostname() + ", started "),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("--resume and --overwrite also wait until it has ended"), std::string::npos) << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  // The refusal changed nothing: the first still holds it, under its own name.
  EXPECT_EQ(read_run_lock(path)->pid, getpid());
  first.reset();
  EXPECT_FALSE(fs::exists(path));
  auto second = RunLock::acquire(out);
  EXPECT_FALSE(second->taken_over());  // a clean end leaves nothing stale
}

// The holder ends (unlinking its file, then unlocking it) just as a contender has opened the
// file and before it locks it: the contender's flock succeeds, but on a file no longer in the
// folder. It must open the folder's lock file again and hold that one, so that a third run is
// refused; a contender that kept the unlinked file would leave the folder free for it.
TEST(RunLock, AHolderThatEndsBetweenTheContendersOpenAndFlockIsNotTakenTwice) {
  TempDir d;
  const std::string out = d / "run";
  auto first = RunLock::acquire(out);
  const std::string path = run_lock_path(out);
  RunLockOptions o;
  std::vector<int> attempts;
  o.after_open = [&](int attempt) {
    attempts.push_back(attempt);
    if (attempt == 0) first.reset();  // the holder's clean end, between the open and the flock
  };
  auto second = RunLock::acquire(out, o);
  EXPECT_EQ(attempts.size(), 2u) << "the contender did not open the lock file again";
  EXPECT_FALSE(second->taken_over());
  ASSERT_TRUE(fs::exists(path)) << "the folder has no lock file while the second run holds it";
  EXPECT_EQ(read_run_lock(path)->pid, getpid());
  // The only holder: a third run is refused.
  const std::string e = error_of([&] { RunLock::acquire(out); });
  EXPECT_NE(e.find("is in use by another training run"), std::string::npos) << e;
}

TEST(RunLock, OutputThatIsAFileIsRefused) {
  TempDir d;
  std::ofstream(d / "file") << "x";
  const std::string e = error_of([&] { RunLock::acquire(d / "file"); });
  EXPECT_NE(e.find("is a file, not a folder"), std::string::npos) << e;
}

TEST(RunLock, StaleLockOfThisHostIsTakenOverAndNamed) {
  TempDir d;
  fs::create_directories(d / "run");
  const std::string path = run_lock_path(d / "run");
  write_lock(path, hostname(), 999999999);  // no process holds its flock
  auto lock = RunLock::acquire(d / "run");
  ASSERT_TRUE(lock->taken_over());
  EXPECT_EQ(lock->taken_over()->pid, 999999999);
  EXPECT_EQ(lock->taken_over()->describe(), "pid 999999999 on host " + hostname() + ", started 2025-01-31T10:00:00Z");
  EXPECT_EQ(lock->taken_over_reason(), "its process ended without releasing it");
  EXPECT_EQ(read_run_lock(path)->pid, getpid());  // now this run's name
}

TEST(RunLock, AnotherHostsLockCountsUntilItsRenewalIsOlderThanStaleAfter) {
  TempDir d;
  fs::create_directories(d / "run");
  const std::string path = run_lock_path(d / "run");
  RunLockOptions o;
  o.host = "here.example";
  o.job = "slurm job 12";
  o.stale_after = std::chrono::seconds(60);
  write_lock(path, "elsewhere.example", 4242, "slurm job 7");
  age_file(path, 20);
  std::string e = error_of([&] { RunLock::acquire(d / "run", o); });
  EXPECT_NE(e.find("in use by another training run (pid 4242 on host elsewhere.example (slurm job 7), started "),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("renewed 20 s ago, from another host whose lock this host cannot see"), std::string::npos) << e;
  EXPECT_EQ(read_run_lock(path)->pid, 4242);  // untouched
  age_file(path, 75);
  auto lock = RunLock::acquire(d / "run", o);
  ASSERT_TRUE(lock->taken_over());
  EXPECT_EQ(lock->taken_over()->host, "elsewhere.example");
  EXPECT_EQ(lock->taken_over_reason(), "not renewed for 75 s");
  const auto now = read_run_lock(path);
  EXPECT_EQ(now->host, "here.example");
  EXPECT_EQ(now->job, "slurm job 12");
}

TEST(RunLock, AnEarlierRoundOfTheSameJobOnAnotherHostIsTakenOver) {
  TempDir d;
  fs::create_directories(d / "run");
  const std::string path = run_lock_path(d / "run");
  write_lock(path, "elsewhere.example", 4242, "torchrun run abc");  // renewed just now
  RunLockOptions o;
  o.host = "here.example";
  o.job = "torchrun run abc";
  auto lock = RunLock::acquire(d / "run", o);
  ASSERT_TRUE(lock->taken_over());
  EXPECT_EQ(lock->taken_over_reason(), "an earlier round of this job, torchrun run abc, which its launcher stopped");
  lock.reset();
  // Another job's fresh lock is not.
  write_lock(path, "elsewhere.example", 4242, "torchrun run other");
  EXPECT_NE(error_of([&] { RunLock::acquire(d / "run", o); }).find("pid 4242 on host elsewhere.example"), std::string::npos);
}

TEST(RunLock, TheHolderRenewsTheFilesTime) {
  TempDir d;
  RunLockOptions o;
  o.heartbeat = std::chrono::milliseconds(20);
  auto lock = RunLock::acquire(d / "run", o);
  age_file(lock->path(), 1000);
  ASSERT_GT(mtime_age_s(lock->path()), 900);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (mtime_age_s(lock->path()) > 900 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_LT(mtime_age_s(lock->path()), 60);
}

}  // namespace
}  // namespace faceshard
