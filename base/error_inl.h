// run_main: the single place where binaries turn exceptions into one-line errors.
#pragma once
#include <cstdio>
#include <exception>

namespace faceshard {

void report_fatal(const char* prog, const std::string& line);
// Called by report_fatal after printing (the distributed runtime publishes the error to
// the other ranks through it).
void set_fatal_hook(void (*hook)(const std::string& line));

// For fatal errors found outside the main thread's control flow (a rendezvous watchdog):
// prints the line as run_main would, under the program name run_main recorded, and ends the
// process with status 1 at once.
void set_program_name(const char* prog);
[[noreturn]] void exit_fatal(const std::string& line);

template <typename F>
int run_main(const char* prog, F&& body) {
  set_program_name(prog);
  try {
    return body();
  } catch (const Error& e) {
    report_fatal(prog, one_line(e));
    return e.exit_code();
  } catch (const std::exception& e) {
    report_fatal(prog, one_line(e));
    return 1;
  }
}

}  // namespace faceshard
