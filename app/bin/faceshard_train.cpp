// faceshard-train --config FILE [--set key=value ...] [--resume [auto|DIR]] [--overwrite] [--print-config]
#include <cstdio>

#include "app/config/cli.h"
#include "app/train/trainer.h"
#include "base/error.h"

using namespace faceshard;

static const char* kUsage =
    "usage: faceshard-train --config FILE [--set section.key=value ...] [--resume [auto|DIR]] [--overwrite]\n"
    "                       [--print-config]\n"
    "Start several ranks with tools/launch.sh --nproc N, torchrun --no-python, or srun; alone it runs one rank.\n"
    "--resume (or --resume auto, or train.resume: auto) continues from the latest committed checkpoint in\n"
    "<output>/checkpoints, or starts fresh when there is none, and exits 0 when that checkpoint ends the run;\n"
    "--resume DIR continues from a run folder's newest checkpoint, or from that checkpoint. Either works with a\n"
    "different number of ranks.\n"
    "A fresh run into an output folder that holds a run is refused; --overwrite moves that run's files into\n"
    "<output>/replaced-<time>/ (nothing is deleted) and starts afresh. While a run trains it holds\n"
    "<output>/.faceshard-train.lock: a second run into the folder, --resume and --overwrite included, is refused\n"
    "naming the holder's host and pid; a lock left by a killed run is named and taken over.\n"
    "Writes <output>/config.yaml, training.log, metrics.jsonl, checkpoints/, tensorboard/ and model.pt.\n"
    "SIGTERM/SIGINT (Ctrl-C): finish the step, checkpoint, exit 0 (75 under torchrun on a rank whose own agent\n"
    "did not ask: its agent restarts it into the next round); continue with --resume.\n";

int main(int argc, char** argv) {
  return run_main("faceshard-train", [&] {
    ConfigArgs args = parse_config_args(argc, argv);
    if (args.help) {
      std::fputs(kUsage, stdout);
      return 0;
    }
    TrainRequest req;
    for (size_t i = 0; i < args.rest.size(); ++i) {
      const std::string& a = args.rest[i];
      if (a == "--resume") {
        if (req.resume) throw usage_error("--resume is given twice; it takes at most one checkpoint (see --help)");
        req.resume = true;
        if (i + 1 < args.rest.size() && args.rest[i + 1].rfind("--", 0) != 0) {
          const std::string& v = args.rest[++i];
          if (v != "auto") req.resume_from = v;  // "auto": the newest checkpoint, or fresh
        }
      } else if (a == "--overwrite") {
        req.overwrite = true;
      } else {
        throw usage_error("unknown argument '", a, "' (see --help)");
      }
    }
    req.config = load_config_from_args(args);
    if (req.config.train.resume == "auto") req.resume = true;
    req.config_text = config_to_yaml(req.config);
    if (args.print_config) {
      std::fputs(req.config_text.c_str(), stdout);
      return 0;
    }
    req.faults = FaultPlan::from_environment();
    return run_training(req);
  });
}
