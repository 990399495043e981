// Command-line handling shared by the binaries that take a config:
// --config FILE, repeatable --set key.path=value, --print-config.
#pragma once
#include <string>
#include <vector>

#include "app/config/config.h"

namespace faceshard {

struct ConfigArgs {
  std::string config;
  std::vector<std::string> overrides;
  bool print_config = false;
  bool help = false;
  std::vector<std::string> rest;  // arguments this parser does not own, in order
};

// Parses the shared flags; other "--flag [value]" arguments are passed through in `rest`.
ConfigArgs parse_config_args(int argc, char** argv);

// Loads the config named by the arguments (usage error when --config is missing).
Config load_config_from_args(const ConfigArgs& args);

}  // namespace faceshard
