#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace sriovd::test {

// A child process started by a test. Its stdout and stderr go to one log
// file. The destructor kills it by PID (SIGKILL) and reaps it, so no test
// leaves a process behind even when an assertion fails.
class Process {
 public:
  // `env` entries ("NAME=value") are added to this process's environment.
  Process(std::vector<std::string> argv, std::string log_path, std::vector<std::string> env = {});
  ~Process();
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  [[nodiscard]] pid_t pid() const { return pid_; }
  void signal(int signo) const;
  // The exit status (as from waitpid) if it ended within the timeout.
  std::optional<int> wait_for(std::chrono::milliseconds timeout);
  [[nodiscard]] bool running();
  [[nodiscard]] std::string log() const;

 private:
  pid_t pid_ = -1;
  std::string log_path_;
  std::optional<int> status_;
};

// Result of running a command to completion.
struct RunResult {
  int exit_code = -1;  // -1: killed by a signal or timed out
  std::string output;  // stdout and stderr
};
RunResult run(const std::vector<std::string>& argv, std::chrono::milliseconds timeout = std::chrono::seconds(30));

// Polls `condition` until it holds or the deadline passes.
bool wait_until(const std::function<bool()>& condition, std::chrono::milliseconds timeout);

}  // namespace sriovd::test
