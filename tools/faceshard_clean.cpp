// faceshard-clean: finds the label problems of a training set with the model trained on it.
// Every image is embedded with the run's backbone and compared with the run's classifier
// centres (read from the checkpoint's shards, saved on any number of ranks) and with the
// other images; the findings are TSV reports in one folder (app/clean/clean_audit.h).
#include <cstdio>
#include <string>

#include "app/clean/clean_run.h"
#include "base/tool_args.h"
#include "base/error.h"

using namespace faceshard;

namespace {

const char* kUsage =
    "usage: faceshard-clean --run PATH (--rec DIR | --images DIR) --output DIR [options]\n"
    "Embeds every image of the training set with the run's backbone, compares it with the run's\n"
    "classifier centres and with the other images, and writes to DIR:\n"
    "  mislabeled.tsv            images farther than --mislabeled-angle from their class's dominant centre\n"
    "  duplicate_identities.tsv  pairs of classes that are one person under two labels\n"
    "  overlap.tsv               classes that are identities of the --bin sets / --test-identities\n"
    "  near_duplicates.tsv       images stored more than once\n"
    "  dropped_subcenters.tsv    the non-dominant sub-centres (runs with loss.subcenters > 1)\n"
    "  --run PATH                a run's output folder (its newest committed checkpoint) or a checkpoint\n"
    "                            folder (checkpoints/step_N); saved on any number of ranks\n"
    "  --rec DIR                 DIR/train.rec + train.idx, the set the run trained on\n"
    "  --images DIR              an image folder (one sub-folder per identity) the run trained on\n"
    "  --embeddings FILE         the set's embeddings written by faceshard-extract with this run's model\n"
    "                            (--rec/--images DIR --output PREFIX; FILE: PREFIX.npy), one row per image in\n"
    "                            the set's order: the images are read for their labels and bytes only, not\n"
    "                            embedded (PREFIX.txt, when there, must name them; --no-flip, --batch: the file's)\n"
    "  --output DIR              report folder (created); reports already there are replaced only once\n"
    "                            every new one is written\n"
    "  --bin FILE [FILE...]      verification sets (insightface .bin) to look for in the training set;\n"
    "                            images joined by a genuine pair are one test identity\n"
    "  --test-identities DIR     a folder with one sub-folder per test identity, as --bin\n"
    "  --mislabeled-angle DEG    default: from the data (below); Sub-center ArcFace drops at 75\n"
    "  --identity-cos C          duplicate identities above this cosine (default: from the data)\n"
    "  --identity-by means|centres  a class's identity vector: the mean embedding of its images nearest\n"
    "                            its dominant centre (default), or that centre\n"
    "  --overlap-cos C           test identity vs class above this cosine (default: from the data)\n"
    "  --mislabeled-rate R       the data's mislabeled angle: an image no nearer its own class than R of the\n"
    "                            cosines of images to classes they are not filed under (default 0.001)\n"
    "  --false-pairs N           the data's identity and overlap cosines: N pairs of different people\n"
    "                            expected above each (default 0.1), from a normal fit to the set's cosines\n"
    "                            between classes, and between test identities and classes\n"
    "  --near-duplicate-cos C    images above this cosine (default 0.95) or with identical bytes\n"
    "  --near-duplicate-memory-mb N  embeddings kept for the near-duplicate search (default 1024)\n"
    "  --subcenters K            sub-centres per class (default: the checkpoint's; another K is refused)\n"
    "  --limit N                 the first N images only (a quick look)\n"
    "  --chunk N                 images embedded and searched at a time (default 4096)\n"
    "  --batch N                 images per forward pass (default 64)\n"
    "  --no-flip                 embed the image only (default: image + mirrored image, as evaluation)\n"
    "  --device D                auto | cpu | cuda | cuda:N (default auto: the GPU when there is one)\n"
    "  --precision P             fp32 | bf16 | fp16 (default: the run's)\n";

}  // namespace

int main(int argc, char** argv) {
  return run_main("faceshard-clean", [&] {
    CleanRequest q;
    CleanThresholds& t = q.t;
    bool after_bin = false;
    ToolArgs a(argc, argv);
    while (a.next()) {
      const bool bin_value = after_bin && a.flag().rfind("--", 0) != 0;
      after_bin = false;
      if (bin_value) {
        q.bins.push_back(a.flag());
        after_bin = true;
      } else if (a.is("--help") || a.is("-h")) {
        std::fputs(kUsage, stdout);
        return 0;
      } else if (a.is("--run")) q.run = a.value();
      else if (a.is("--rec")) q.rec = a.value();
      else if (a.is("--images")) q.images = a.value();
      else if (a.is("--embeddings")) q.embeddings = a.value();
      else if (a.is("--output")) q.output = a.value();
      else if (a.is("--bin")) q.bins.push_back(a.repeated_value()), after_bin = true;
      else if (a.is("--test-identities")) q.tests_dir = a.value();
      else if (a.is("--mislabeled-angle")) t.mislabeled_angle = a.number(), t.mislabeled_given = true;
      else if (a.is("--identity-cos")) t.identity_cos = a.number(), t.identity_given = true;
      else if (a.is("--identity-by")) t.identity_by = a.value();
      else if (a.is("--overlap-cos")) t.overlap_cos = a.number(), t.overlap_given = true;
      else if (a.is("--mislabeled-rate")) t.mislabeled_rate = a.number();
      else if (a.is("--false-pairs")) t.false_pairs = a.number();
      else if (a.is("--near-duplicate-cos")) t.near_duplicate_cos = a.number();
      else if (a.is("--near-duplicate-memory-mb")) t.near_duplicate_memory_mb = a.integer(1);
      else if (a.is("--subcenters")) q.subcenters = a.integer(1);
      else if (a.is("--limit")) q.limit = a.integer(1);
      else if (a.is("--chunk")) q.chunk = a.integer(1);
      else if (a.is("--batch")) q.batch = a.integer(1);
      else if (a.is("--no-flip")) q.flip = false;
      else if (a.is("--device")) q.device_name = a.value();
      else if (a.is("--precision")) q.spec.precision = a.value();
      else a.unknown();
    }
    run_clean(q);
    return 0;
  });
}
