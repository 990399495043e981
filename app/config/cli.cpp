#include "app/config/cli.h"

#include "base/error.h"
#include "base/flag_once.h"

namespace faceshard {

ConfigArgs parse_config_args(int argc, char** argv) {
  ConfigArgs a;
  FlagOnce once;
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    auto value = [&](const std::string& flag) -> std::string {
      if (i + 1 >= argc) throw usage_error(flag, " needs a value");
      return argv[++i];
    };
    if (s == "--config" || s == "-c") a.config = once.take("--config", value(s));
    else if (s.rfind("--config=", 0) == 0) a.config = once.take("--config", s.substr(9));
    else if (s == "--set") {
      const std::string kv = value(s);
      // "--set optim.lr 0.01": the value went to the next word.
      if (kv.find('=') == std::string::npos && i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0)
        throw usage_error("--set ", kv, " ", argv[i + 1], ": write --set ", kv, "=", argv[i + 1],
                          " (key and value in one word, joined by '=')");
      a.overrides.push_back(kv);
    }
    else if (s.rfind("--set=", 0) == 0) a.overrides.push_back(s.substr(6));
    else if (s == "--print-config") a.print_config = true;
    else if (s == "--help" || s == "-h") a.help = true;
    else a.rest.push_back(s);
  }
  // A config file given without --config: the commonest slip of a first run.
  if (a.config.empty() && !a.rest.empty() && a.rest[0].rfind("--", 0) != 0 &&
      (a.rest[0].size() > 5 && (a.rest[0].compare(a.rest[0].size() - 5, 5, ".yaml") == 0 ||
                                a.rest[0].compare(a.rest[0].size() - 4, 4, ".yml") == 0)))
    throw usage_error("unexpected argument '", a.rest[0], "': give the config as --config ", a.rest[0]);
  return a;
}

Config load_config_from_args(const ConfigArgs& args) {
  if (args.config.empty()) throw usage_error("--config FILE is required (see --help)");
  return load_config(args.config, args.overrides);
}

}  // namespace faceshard
