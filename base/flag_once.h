// A command line's single-valued flags, each taken once: every tool's parser hands each
// "--flag value" it reads to take(); the same flag given again is one usage error naming it
// and both values, instead of the last value winning silently (`--model A --model B` once
// evaluated B alone). Flags meant to repeat (--bin, --set) are not handed to it.
#pragma once
#include <map>
#include <string>

#include "base/error.h"

namespace faceshard {

class FlagOnce {
 public:
  // Records `flag`'s value; a usage error when `flag` was taken before.
  const std::string& take(const std::string& flag, const std::string& value) {
    const auto [it, fresh] = seen_.emplace(flag, value);
    if (!fresh)
      throw usage_error(flag, " is given twice ('", detail::printable(it->second), "', then '", detail::printable(value),
                        "'); it takes one value");
    return it->second;
  }

 private:
  std::map<std::string, std::string> seen_;
};

}  // namespace faceshard
