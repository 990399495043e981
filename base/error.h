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
  // An invalid option of a library component: `option` names it in the component's own
  // terms ("sample_rate"), `detail` says what is wrong ("must be in [0, 1], got 2").
  Error(ErrorKind kind, const std::string& option, const std::string& detail)
      : std::runtime_error(option + " " + detail), kind_(kind), option_(option), detail_(detail) {}
  ErrorKind kind() const { return kind_; }
  int exit_code() const { return kind_ == ErrorKind::Usage ? 2 : 1; }
  // Set for option errors only (empty otherwise); the applications map the option to the
  // key of their config that set it (app/config/option_keys.h).
  const std::string& option() const { return option_; }
  const std::string& detail() const { return detail_; }

 private:
  ErrorKind kind_;
  std::string option_, detail_;
};

namespace detail {
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
// Text from an untrusted file (a key, an entry name) made safe for a one-line message:
// control and non-ASCII bytes as \xNN, and at most `max` characters ("..." after).
inline std::string printable(const std::string& s, size_t max = 120) {
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (out.size() >= max) return out + "...";
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out.push_back(char(c));
    } else {
      out += "\\x";
      out.push_back(hex[c >> 4]);
      out.push_back(hex[c & 15]);
    }
  }
  return out;
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
// option_error("sample_rate", "must be in [0, 1], got ", 2.0): a usage error about one
// option of a component, in the component's terms.
template <typename... Args>
Error option_error(const std::string& option, const Args&... args) {
  return Error(ErrorKind::Usage, option, detail::concat(args...));
}

// Turns any exception into a single line (LibTorch messages span many lines and carry
// C++ backtraces that mean nothing to a user).
std::string one_line(const std::exception& e);

// Runs a binary's body: prints "<prog>: error: <message>" and returns the exit status.
template <typename F>
int run_main(const char* prog, F&& body);

}  // namespace faceshard

#include "base/error_inl.h"
