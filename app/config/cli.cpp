#include "app/config/cli.h"

#include "partial_fc/runtime/error.h"

namespace faceshard {

ConfigArgs parse_config_args(int argc, char** argv) {
  ConfigArgs a;
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    auto value = [&](const std::string& flag) -> std::string {
      if (i + 1 >= argc) throw usage_error(flag, " needs a value");
      return argv[++i];
    };
    if (s == "--config" || s == "-c") a.config = value(s);
    else if (s.rfind("--config=", 0) == 0) a.config = s.substr(9);
    else if (s == "--set") a.overrides.push_back(value(s));
    else if (s.rfind("--set=", 0) == 0) a.overrides.push_back(s.substr(6));
    else if (s == "--print-config") a.print_config = true;
    else if (s == "--help" || s == "-h") a.help = true;
    else a.rest.push_back(s);
  }
  return a;
}

Config load_config_from_args(const ConfigArgs& args) {
  if (args.config.empty()) throw usage_error("--config FILE is required (see --help)");
  return load_config(args.config, args.overrides);
}

}  // namespace faceshard
