#include "app/eval/tool_args.h"

#include <cstdio>
#include <cstdlib>

#include "base/error.h"

namespace faceshard {

bool ToolArgs::next() {
  ++i_;
  return i_ < args_.size();
}

std::string ToolArgs::next_value() {
  if (i_ + 1 >= args_.size() || args_[i_ + 1].rfind("--", 0) == 0)
    throw usage_error(args_[i_], " needs a value (see --help)");
  return args_[++i_];
}

std::string ToolArgs::repeated_value() { return next_value(); }

std::string ToolArgs::value() {
  const std::string flag = args_[i_];
  return once_.take(flag, next_value());
}

int64_t ToolArgs::integer(int64_t min_value) {
  const std::string flag = args_[i_];
  const std::string v = value();
  char* end = nullptr;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end || x < min_value)
    throw usage_error(flag, " expects an integer >= ", min_value, ", got '", v, "'");
  return x;
}

double ToolArgs::number() {
  const std::string flag = args_[i_];
  const std::string v = value();
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end) throw usage_error(flag, " expects a number, got '", v, "'");
  return x;
}

void ToolArgs::unknown() const { throw usage_error("unknown argument '", args_[i_], "' (see --help)"); }

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
