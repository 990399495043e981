// The one error type of faceshard for user-facing failures (bad config, missing file,
// corrupt record, label out of range, a failed rank). Binaries print what() on one line
// and exit with exit_code(): 2 for usage/config errors, 1 for runtime errors.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace faceshard {

enum class ErrorKind { Usage, Runtime };

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& msg) : std::runtime_error(msg), kind_(kind) {}
  ErrorKind kind() const { return kind_; }
  int exit_code() const { return kind_ == ErrorKind::Usage ? 2 : 1; }

 private:
  ErrorKind kind_;
};

namespace detail {
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

// usage_error("config.yaml: key 'optim.lr': expected a number")
template <typename... Args>
Error usage_error(const Args&... args) {
  return Error(ErrorKind::Usage, detail::concat(args...));
}
template <typename... Args>
Error runtime_error(const Args&... args) {
  return Error(ErrorKind::Runtime, detail::concat(args...));
}

// Turns any exception into a single line (LibTorch messages span many lines and carry
// C++ backtraces that mean nothing to a user).
std::string one_line(const std::exception& e);

// Runs a binary's body: prints "<prog>: error: <message>" and returns the exit status.
template <typename F>
int run_main(const char* prog, F&& body);

}  // namespace faceshard

#include "partial_fc/error_inl.h"
