// Every tool's command line: "--flag value" pairs and switches, with one-line usage errors
// naming the flag. A flag that takes one value takes it once: given twice it is refused with
// both values named (the last one winning silently evaluated only one of two models); flags
// meant to repeat (--bin) read theirs with repeated_value().
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "base/flag_once.h"

namespace faceshard {

class ToolArgs {
 public:
  ToolArgs(int argc, char** argv) : args_(argv + 1, argv + argc) {}
  // The arguments left after another parser's (faceshard-plan's after --config and --set).
  explicit ToolArgs(std::vector<std::string> args) : args_(std::move(args)) {}
  // Advances to the next argument; false at the end.
  bool next();
  const std::string& flag() const { return args_[i_]; }
  bool is(const char* name) const { return args_[i_] == name; }
  // The value after the current flag (usage error when missing, or when the flag was given
  // a value before).
  std::string value();
  // The same for a flag that may be given several times (each value in turn).
  std::string repeated_value();
  int64_t integer(int64_t min_value);
  double number();
  // Usage error for the current argument ("unknown argument '--x' (see --help)").
  [[noreturn]] void unknown() const;

 private:
  std::string next_value();
  std::vector<std::string> args_;
  size_t i_ = size_t(-1);
  FlagOnce once_;  // the single-valued flags read so far
};

}  // namespace faceshard
