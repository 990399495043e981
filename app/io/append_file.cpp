#include "app/io/append_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "base/error.h"
#include "base/log.h"

namespace faceshard {

AppendFile::AppendFile(const std::string& path, bool append) : path_(path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | (append ? 0 : O_TRUNC), 0644);
  if (fd_ < 0) throw runtime_error("cannot open '", path, "' for writing: ", std::strerror(errno));
  struct stat st {};
  size_ = ::fstat(fd_, &st) == 0 ? static_cast<long long>(st.st_size) : 0;
}

AppendFile::~AppendFile() {
  // The file system may report a failed write only now (a full disk under NFS, a quota):
  // one line says the last pieces may not have reached the disk.
  if (fd_ >= 0 && ::close(fd_) != 0 && errno != EINTR)
    log_warn("cannot close '", path_, "': ", std::strerror(errno), ": its last lines may not be on disk");
}

void AppendFile::append(const std::string& bytes) {
  int error = 0;
  size_t done = 0;
  if (::lseek(fd_, static_cast<off_t>(size_), SEEK_SET) < 0) error = errno;
  while (done < bytes.size() && error == 0) {
    const ssize_t w = ::write(fd_, bytes.data() + done, bytes.size() - done);
    if (w > 0) done += static_cast<size_t>(w);
    else if (!(w < 0 && errno == EINTR)) error = w < 0 ? errno : EIO;
  }
  if (error) {
    if (done > 0) (void)::ftruncate(fd_, static_cast<off_t>(size_));  // no half piece stays
    throw runtime_error("cannot write to '", path_, "': ", std::strerror(error));
  }
  size_ += static_cast<long long>(bytes.size());
}

}  // namespace faceshard
