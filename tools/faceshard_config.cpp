// faceshard-config: loads a training config (bases, --set overrides), validates it and
// prints the complete merged result; exit status 2 with a one-line error when it is wrong.
#include <cstdio>

#include "app/config/cli.h"
#include "partial_fc/runtime/error.h"

using namespace faceshard;

int main(int argc, char** argv) {
  return run_main("faceshard-config", [&] {
    ConfigArgs args = parse_config_args(argc, argv);
    if (args.help) {
      std::puts("usage: faceshard-config --config FILE [--set key.path=value ...] [--print-config]");
      return 0;
    }
    if (!args.rest.empty()) throw usage_error("unknown argument '", args.rest[0], "' (see --help)");
    Config cfg = load_config_from_args(args);
    if (args.print_config) std::fputs(config_to_yaml(cfg).c_str(), stdout);
    else std::printf("%s: ok\n", args.config.c_str());
    return 0;
  });
}
