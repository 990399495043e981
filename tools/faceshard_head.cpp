// faceshard-head: one margin head, one process, on a batch given as .npy files: K forward/
// backward passes with the head's state moving as in training and the weights untouched,
// the loss of each, and the last pass's gradients with respect to the raw embeddings and
// the raw centres. What a user porting a head checks faceshard's against.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "app/config/config.h"
#include "app/config/job_settings.h"
#include "app/io/checkpoint.h"
#include "app/io/npy.h"
#include "partial_fc/classifier/partial_fc.h"
#include "partial_fc/distributed/dist_env.h"
#include "partial_fc/distributed/distributed.h"
#include "base/error.h"
#include "base/tool_args.h"

namespace {

const char* kUsage =
    "usage: faceshard-head --head NAME [--set loss.<head>.<param>=V ...] --embeddings E.npy --labels L.npy\n"
    "                      --centres C.npy [--steps K] --out DIR\n"
    "       faceshard-head --list\n"
    "  --list             every margin head: what it is, its parameters (loss.<head>.<param>) with\n"
    "                     their defaults, ranges and meaning\n"
    "  --head NAME        one of the heads --list prints\n"
    "  --set KEY=VALUE    a head parameter (loss.adaface.m=0.5) or loss.margin / loss.scale /\n"
    "                     loss.margin_mode for the combined head; loss.logits (buffer | streamed) and\n"
    "                     optim.fc_weight_dtype (fp32 | bf16: the centres stored as the trainer stores\n"
    "                     them); the config's rules apply\n"
    "  --embeddings E.npy raw (unnormalised) embeddings [N, D], float32\n"
    "  --labels L.npy     class ids [N], int64\n"
    "  --centres C.npy    raw centres [C, D], float32 or float16\n"
    "  --steps K          forward/backward passes on the same batch (default 1); the head's\n"
    "                     state (AdaFace's norm statistics, CurricularFace's t) moves each time\n"
    "  --out DIR          writes grad_embeddings.npy, grad_centres.npy (the last pass's) and state.json\n"
    "Prints 'step k loss X' per pass; the loss holds every term the head trains with.\n";

std::string json_number(double v) {
  std::ostringstream os;
  os.precision(17);
  os << v;
  return os.str();
}

std::string range_of(const faceshard::HeadParam& p) {
  if (p.flag) return "true/false";
  std::ostringstream os;
  const bool lo = std::isfinite(p.min), hi = std::isfinite(p.max);
  if (lo && hi) os << "[" << p.min << ", " << p.max << "]";
  else if (lo) os << (p.min_exclusive ? "> " : ">= ") << p.min;
  else if (hi) os << "<= " << p.max;
  else os << "any";
  return os.str();
}

void print_catalogue() {
  for (const faceshard::HeadInfo& h : faceshard::head_catalogue()) {
    std::printf("%s: %s\n", h.name.c_str(), h.summary.c_str());
    if (h.params.empty()) std::printf("  (no parameters of its own: loss.margin, loss.scale, loss.margin_mode)\n");
    for (const faceshard::HeadParam& p : h.params) {
      std::ostringstream d;
      if (p.flag) d << (p.default_value != 0 ? "true" : "false");
      else d << p.default_value;
      std::printf("  loss.%s.%-12s default %-8s %-12s %s\n", h.name.c_str(), p.name.c_str(), d.str().c_str(),
                  range_of(p).c_str(), p.meaning.c_str());
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  return faceshard::run_main("faceshard-head", [&]() -> int {
    using namespace faceshard;
    std::string head, emb_path, label_path, centre_path, out;
    int64_t steps = 1;
    std::vector<std::string> sets;
    ToolArgs args(argc, argv);
    while (args.next()) {
      const std::string a = args.flag();
      if (a == "--help" || a == "-h") {
        std::fputs(kUsage, stdout);
        return 0;
      }
      if (a == "--list") {
        print_catalogue();
        return 0;
      }
      if (a == "--head") head = args.value();
      else if (a == "--set") sets.push_back(args.repeated_value());
      else if (a == "--embeddings") emb_path = args.value();
      else if (a == "--labels") label_path = args.value();
      else if (a == "--centres") centre_path = args.value();
      else if (a == "--out") out = args.value();
      else if (a == "--steps") {
        steps = args.integer(1);
        if (steps > 1000000) throw usage_error("--steps: expected 1..1000000, got ", steps);
      } else {
        args.unknown();
      }
    }
    if (head.empty() || emb_path.empty() || label_path.empty() || centre_path.empty() || out.empty())
      throw usage_error("--head, --embeddings, --labels, --centres and --out are required (see --help)");
    for (const auto& s : sets)
      if (s.rfind("loss.", 0) != 0 && s.rfind("optim.fc_weight_dtype=", 0) != 0)
        throw usage_error("--set ", s, ": only loss.* keys and optim.fc_weight_dtype apply to a head");
    // The head's keys go through the config's validation (names, types, ranges).
    const Config cfg = load_config_text("data: {num_classes: 1}\nloss: {head: " + head + "}\n", "--head", sets);

    const at::Tensor E = read_npy(emb_path), L = read_npy(label_path), Cn = read_npy(centre_path);
    if (E.dim() != 2 || E.scalar_type() != at::kFloat)
      throw usage_error(emb_path, ": expected float32 embeddings [N, D], got ", E.scalar_type(), " ", E.sizes());
    if (L.dim() != 1 || (L.scalar_type() != at::kLong && L.scalar_type() != at::kInt) || L.size(0) != E.size(0))
      throw usage_error(label_path, ": expected int64 labels [", E.size(0), "], got ", L.scalar_type(), " ", L.sizes());
    if (Cn.dim() != 2 || (Cn.scalar_type() != at::kFloat && Cn.scalar_type() != at::kHalf) || Cn.size(1) != E.size(1) ||
        Cn.size(0) < 1)
      throw usage_error(centre_path, ": expected float32 or float16 centres [C, ", E.size(1), "], got ",
                        Cn.scalar_type(), " ", Cn.sizes());

    auto dist = Distributed::init(DistEnv::from_environment(), DistOptions{});
    if (dist->world_size() != 1) throw usage_error("faceshard-head runs as one process");
    // The head's options on the trainer's road (job_settings.h), for these centres and
    // embeddings: every class takes part, one centre each, fp32 GEMMs, the logits buffered
    // unless loss.logits streamed asks for them streamed.
    JobSettings settings = job_settings(cfg, 1);
    settings.num_classes = Cn.size(0);
    settings.embedding_size = E.size(1);
    settings.batch_per_rank = E.size(0);
    settings.sample_rate = 1.0;
    settings.subcenters = 1;
    settings.precision = "fp32";
    settings.logits = cfg.loss.logits == "streamed" ? "streamed" : "buffer";
    std::vector<std::pair<std::string, std::string>> keys{{"head", "loss.head"}, {"margin", "loss.margin"}};
    if (const HeadInfo* h = find_head_info(cfg.loss.head))
      for (const HeadParam& p : h->params) keys.emplace_back(p.name, "loss." + h->name + "." + p.name);
    auto fc = with_config_keys(cfg, keys, [&] { return std::make_unique<PartialFC>(*dist, classifier_options(settings)); });
    fc->load_state({{"weight", Cn}}, centre_path);

    at::Tensor grad_e, grad_c;
    double loss = 0;
    for (int64_t k = 1; k <= steps; ++k) {
      at::Tensor e = E.clone().requires_grad_(true);
      auto o = fc->forward(e, L.to(at::kLong));
      o.loss.backward();
      loss = o.loss.item<double>();
      std::printf("step %lld loss %.9g\n", static_cast<long long>(k), loss);
      grad_e = e.grad();
      grad_c = fc->gradient().clone();
      fc->zero_grad();
    }
    std::filesystem::create_directories(out);
    write_npy_float32(grad_e, out + "/grad_embeddings.npy");
    write_npy_float32(grad_c, out + "/grad_centres.npy");
    std::ostringstream js;
    js << "{\"head\": \"" << fc->head().name() << "\", \"steps\": " << steps << ", \"loss\": " << json_number(loss)
       << ", \"scale\": " << json_number(fc->head().scale()) << ", \"state\": {";
    bool first = true;
    for (const auto& kv : fc->head().state()) {
      js << (first ? "" : ", ") << "\"" << kv.first << "\": " << json_number(kv.second.item<double>());
      first = false;
    }
    js << "}}\n";
    write_text_durably(js.str(), out + "/state.json");
    dist->shutdown();
    return 0;
  });
}
