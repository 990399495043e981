#include "base/error.h"

#include <c10/util/Exception.h>

#include <cstdio>
#include <cstdlib>

#include "base/log.h"

namespace faceshard {

std::string one_line(const std::exception& e) {
  std::string msg;
  if (auto* ce = dynamic_cast<const c10::Error*>(&e)) {
    msg = ce->msg();  // without the C++ backtrace
  } else {
    msg = e.what();
  }
  // Keep the first meaningful line: LibTorch appends "Exception raised from ..." lines.
  std::string out;
  for (char c : msg) {
    if (c == '\n') {
      if (!out.empty()) break;
      continue;
    }
    out.push_back(c);
  }
  while (!out.empty() && (out.back() == ' ' || out.back() == '\r')) out.pop_back();
  return out.empty() ? std::string("unknown error") : out;
}

namespace {
void (*g_fatal_hook)(const std::string&) = nullptr;
const char* g_program = "faceshard";
}  // namespace

void set_program_name(const char* prog) { g_program = prog; }

void exit_fatal(const std::string& line) {
  report_fatal(g_program, line);
  std::fflush(stdout);
  std::_Exit(1);
}

void set_fatal_hook(void (*hook)(const std::string& line)) { g_fatal_hook = hook; }

void report_fatal(const char* prog, const std::string& line) {
  std::fprintf(stderr, "%s%s: error: %s\n", log_prefix().c_str(), prog, line.c_str());
  std::fflush(stderr);
  append_to_log_file(log_prefix() + prog + ": error: " + line);
  if (g_fatal_hook) g_fatal_hook(line);
}

}  // namespace faceshard
