// The margin heads' catalogue: every head's name, what it is, and its parameters (default,
// range, meaning), as the heads register themselves, each from its own file in heads/
// (register_margin_head, margin_head.h). Plain C++ without LibTorch, so that what reads it
// reads one list: the config's loss.head and loss.<head>.<param> keys (also in the torch-free
// fuzz build, where no head is registered and the config takes no head key), make_margin_head,
// faceshard-head --list, the trainer's start-up line and the tests.
#pragma once
#include <limits>
#include <map>
#include <string>
#include <vector>

namespace faceshard {

// A parameter's range without a bound on that side.
inline constexpr double kUnbounded = std::numeric_limits<double>::infinity();

struct HeadParam {
  std::string name;
  double default_value = 0;
  double min = -kUnbounded;
  double max = kUnbounded;
  bool min_exclusive = false;
  bool flag = false;  // yes/no (0 or 1), written true/false in a config
  std::string meaning;
};

struct HeadInfo {
  std::string name;     // loss.head
  std::string summary;  // one line: the head, its authors, what its target logit is
  std::vector<HeadParam> params;
};

// Every registered head, in name order. The first call registers the heads the build has
// (register_margin_heads(), which the build writes from the files in heads/).
const std::vector<HeadInfo>& head_catalogue();
// The head called `name`, or nullptr.
const HeadInfo* find_head_info(const std::string& name);
// "adaface | arcface | ..." (what an unknown name's error lists).
std::string known_head_names();

// `params` over the head's defaults: every name must be a parameter of the head, every value
// finite, in its range, and 0 or 1 for a flag. Errors are option_error naming the parameter.
std::map<std::string, double> resolve_head_params(const HeadInfo& head, const std::map<std::string, double>& params);

// For the registration (margin_head.h): adds a head to the catalogue. A second head of the
// same name stops the program (two files claim one name).
void add_head_info(HeadInfo info);
// Defined by the build: calls each head file's registration once (heads/*.cpp).
void register_margin_heads();

}  // namespace faceshard
