// faceshard-config: loads a training config (bases, --set overrides), validates it and
// prints the complete merged result; exit status 2 with a one-line error when it is wrong.
#include <cstdio>
#include <optional>
#include <string>

#include "app/config/cli.h"
#include "app/config/job_settings.h"
#include "app/train/data_counts.h"
#include "app/train/train_job.h"
#include "partial_fc/classifier/partial_fc.h"
#include "base/error.h"

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
    check_model_config(cfg);  // what faceshard-train checks before it starts
    // The classes of data.rec counted as the trainer counts them (data_counts.h).
    std::optional<std::string> counted;
    if (!args.print_config) counted = count_config_data(cfg);
    if (args.print_config) std::fputs(config_to_yaml(cfg).c_str(), stdout);
    else if (!cfg.data.num_classes) {
      std::printf("%s: ok\nclassifier: the identities of '%s' (counted at start-up)%s\n", args.config.c_str(),
                  cfg.data.rec.c_str(),
                  cfg.data.spare_classes ? (" + " + std::to_string(cfg.data.spare_classes) + " spare classes").c_str()
                                         : "");
    } else {
      // The whole classifier's size (one rank's is its share): what data.num_classes asks for.
      if (counted) std::printf("%s\n", counted->c_str());
      // On one rank, the whole classifier: the options on the trainer's road (job_settings.h).
      const JobSettings one_rank = job_settings(cfg, 1);
      const PartialFCOptions po = classifier_options(one_rank);
      const ClassifierMemoryPlan all = classifier_memory_plan(po, 1, 0, one_rank.batch_per_rank);
      std::printf("%s: ok\nclassifier: %lld classes%s x %lld %s: %.0f bytes (%.3g GB) of centres + %.0f bytes (%.3g GB) "
                  "of optimiser state (%s), split over the ranks\n",
                  args.config.c_str(), static_cast<long long>(*cfg.data.num_classes),
                  cfg.loss.subcenters > 1 ? (" x " + std::to_string(cfg.loss.subcenters) + " sub-centres").c_str() : "",
                  static_cast<long long>(cfg.model.embedding_size), cfg.optim.fc_weight_dtype.c_str(), all.weight_bytes,
                  all.weight_bytes / 1e9,
                  all.state_bytes, all.state_bytes / 1e9, cfg.optim.fc_state_dtype.c_str());
      // What a step of one rank takes, as faceshard-plan and the trainer's start-up line say it.
      std::printf("on one rank: %lld classes take part in a step (loss.sample_rate %g), logits %s (batch %lld, %s "
                  "GEMMs)\n",
                  static_cast<long long>(all.sampled_rows), cfg.loss.sample_rate,
                  po.streamed_logits ? "streamed (no buffer)"
                                     : ("buffered: " + std::to_string(static_cast<long long>(all.logits_bytes)) +
                                        " bytes").c_str(),
                  static_cast<long long>(one_rank.batch_per_rank), one_rank.precision.c_str());
    }
    return 0;
  });
}
