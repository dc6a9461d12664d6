// How every meshtrain executable ends: a command's exception becomes one line
// "meshtrain: <message>" on stderr and the exit code of its kind
// (docs/errors.md); 2 for usage errors, 1 for anything that is not an Error.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>
#include <optional>
#include <string>

#include "meshtrain/util/error.h"

namespace meshtrain {

// Signals a command-line usage problem (exit code 2).
struct UsageError : Error {
  using Error::Error;
};

// Errors are single lines: joins anything multi-line a library might produce.
inline std::string one_line(std::string message) {
  for (char& c : message) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return message;
}

// Parses the command line: nothing when the command should run, else its exit
// code (0 after --help; 2 after a usage error, said in one line).
inline std::optional<int> parse_command_line(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "meshtrain: %s (see --help)\n", one_line(e.what()).c_str());
    return 2;
  }
  return std::nullopt;
}

// run() under that rule: its return value, or the exit code of what it threw.
template <typename Run>
int run_guarded(Run&& run) {
  auto report = [](const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "meshtrain: %s\n", one_line(e.what()).c_str());
  };
  try {
    return run();
  } catch (const UsageError& e) {
    report(e);
    return 2;
  } catch (const Error& e) {
    report(e);
    return exit_code(e.kind());
  } catch (const std::exception& e) {
    report(e);
    return 1;
  }
}

}  // namespace meshtrain
