#include "partial_fc/distributed/job_token.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "base/error.h"

namespace faceshard {
namespace {

constexpr size_t kMaxToken = 4096;

bool set(const char* v) { return v && *v; }

std::string read_token_file(const std::string& path) {
  const std::string what = "FACESHARD_JOB_TOKEN_FILE " + path;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) throw usage_error(what, ": cannot open: ", std::strerror(errno));
  struct stat st {};
  std::string text;
  try {
    if (::fstat(fd, &st) != 0) throw usage_error(what, ": cannot stat: ", std::strerror(errno));
    if (!S_ISREG(st.st_mode)) throw usage_error(what, ": not a regular file");
    if (st.st_uid != ::geteuid())
      throw usage_error(what, ": belongs to uid ", st.st_uid, ", not to this user (uid ", ::geteuid(), ")");
    if (st.st_mode & 077) {
      char mode[8];
      std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
      throw usage_error(what, ": readable by others (mode ", mode, "): make it private with chmod 600");
    }
    if (st.st_size > static_cast<off_t>(kMaxToken)) throw usage_error(what, ": larger than 4 KiB: not a token");
    char buf[kMaxToken + 1];
    ssize_t n = 0, got = 0;
    while ((n = ::read(fd, buf + got, sizeof(buf) - static_cast<size_t>(got))) > 0) got += n;
    if (n < 0) throw usage_error(what, ": cannot read: ", std::strerror(errno));
    if (got > static_cast<ssize_t>(kMaxToken)) throw usage_error(what, ": larger than 4 KiB: not a token");
    text.assign(buf, static_cast<size_t>(got));
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  while (!text.empty() && std::strchr(" \t\r\n", text.back())) text.pop_back();
  if (text.empty()) throw usage_error(what, ": empty");
  return text;
}

}  // namespace

JobToken read_job_token(const char* value, const char* file) {
  if (set(value) && set(file))
    throw usage_error("FACESHARD_JOB_TOKEN and FACESHARD_JOB_TOKEN_FILE are both set: keep one");
  JobToken t;
  if (set(value)) {
    t.secret = value;
    if (t.secret.size() > kMaxToken) throw usage_error("FACESHARD_JOB_TOKEN: longer than 4 KiB");
    t.source = "FACESHARD_JOB_TOKEN";
  } else if (set(file)) {
    t.secret = read_token_file(file);
    t.source = std::string("FACESHARD_JOB_TOKEN_FILE (") + file + ")";
  }
  return t;
}

const JobToken& job_token() {
  static std::once_flag once;
  static JobToken token;
  static std::string error;
  std::call_once(once, [] {
    try {
      token = read_job_token(std::getenv("FACESHARD_JOB_TOKEN"), std::getenv("FACESHARD_JOB_TOKEN_FILE"));
    } catch (const Error& e) {
      error = e.what();
    }
  });
  if (!error.empty()) throw usage_error(error);
  return token;
}

}  // namespace faceshard
