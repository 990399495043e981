// faceshard-flops: parameter counts and multiply-accumulates of the registered backbones,
// measured on the built models (one 112x112 forward each on the CPU; the ViTs' MACs include
// the attention products). vit_h and r2060 take a few GB and seconds each.
// Usage: faceshard-flops [--embedding N] [name ...]   (default: every registered backbone)
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "models/backbone_registry.h"
#include "models/model_stats.h"
#include "base/error.h"
#include "base/tool_args.h"

int main(int argc, char** argv) {
  return faceshard::run_main("faceshard-flops", [&] {
    int64_t embedding = 512;
    std::vector<std::string> names;
    faceshard::ToolArgs args(argc, argv);
    while (args.next()) {
      const std::string arg = args.flag();
      if (arg == "--embedding") {
        embedding = args.integer(1);
      } else if (arg == "-h" || arg == "--help") {
        std::printf("usage: faceshard-flops [--embedding N] [name ...]\n");
        return 0;
      } else if (arg.rfind("--", 0) == 0) {
        args.unknown();
      } else {
        names.push_back(arg);
      }
    }
    const auto known = faceshard::backbone_names();
    if (names.empty()) names = known;
    for (const auto& name : names) {  // fail before printing anything
      faceshard::BackboneOptions probe;
      probe.name = name;
      if (std::find(known.begin(), known.end(), name) == known.end()) faceshard::make_backbone(probe);
    }
    std::printf("%-22s %14s %10s %14s %8s\n", "backbone", "parameters", "M", "MACs@112", "G");
    for (const auto& name : names) {
      faceshard::BackboneOptions options;
      options.name = name;
      options.embedding_size = embedding;
      auto model = faceshard::make_backbone(options);
      const auto params = faceshard::count_parameters(*model);
      const int64_t macs = faceshard::count_macs(*model);
      std::printf("%-22s %14lld %10.2f %14lld %8.3f\n", name.c_str(), static_cast<long long>(params.total),
                  params.total / 1e6, static_cast<long long>(macs), macs / 1e9);
    }
    return 0;
  });
}
