#include "app/eval/eval_flags.h"

#include "base/error.h"

namespace faceshard {

bool parse_model_flag(ToolArgs& a, ModelSpec& spec) {
  if (a.is("--model")) spec.path = a.value();
  else if (a.is("--network")) spec.network = a.value();
  else if (a.is("--embedding-size")) spec.embedding_size = a.integer(1);
  else if (a.is("--precision")) spec.precision = a.value();
  else return false;
  return true;
}

torch::Device parse_eval_device(const std::string& text, int local_rank) {
  const bool have_cuda = torch::cuda::is_available();
  if (text == "auto")
    return have_cuda ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(local_rank)) : torch::Device(torch::kCPU);
  if (text == "cpu") return torch::kCPU;
  if (text == "cuda" || text.rfind("cuda:", 0) == 0) {
    if (!have_cuda) throw usage_error("--device ", text, ": no CUDA device is available in this build or machine");
    if (text == "cuda") return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
    return torch::Device(text);
  }
  throw usage_error("--device must be auto, cpu, cuda or cuda:N, got '", text, "'");
}

}  // namespace faceshard
