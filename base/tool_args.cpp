#include "base/tool_args.h"

#include <cstdlib>

#include "base/error.h"

namespace faceshard {

bool ToolArgs::next() {
  ++i_;
  return i_ < args_.size();
}

std::string ToolArgs::next_value() {
  if (i_ + 1 >= args_.size() || args_[i_ + 1].rfind("--", 0) == 0)
    throw usage_error(args_[i_], " needs a value (see --help)");
  return args_[++i_];
}

std::string ToolArgs::repeated_value() { return next_value(); }

std::string ToolArgs::value() {
  const std::string flag = args_[i_];
  return once_.take(flag, next_value());
}

int64_t ToolArgs::integer(int64_t min_value) {
  const std::string flag = args_[i_];
  const std::string v = value();
  char* end = nullptr;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end || x < min_value)
    throw usage_error(flag, " expects an integer >= ", min_value, ", got '", v, "'");
  return x;
}

double ToolArgs::number() {
  const std::string flag = args_[i_];
  const std::string v = value();
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end) throw usage_error(flag, " expects a number, got '", v, "'");
  return x;
}

void ToolArgs::unknown() const {
  throw usage_error("unknown argument '", detail::printable(args_[i_]), "' (see --help)");
}

}  // namespace faceshard
