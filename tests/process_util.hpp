#pragma once
// Spawning `duet` node processes from tests: always reaped, even when a check fails.
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace duet::testing {

/// What a child gets besides its arguments.
struct child_options {
  std::vector<std::pair<std::string, std::string>> env;  // set in the child only
  std::string log;  // when set, the child's stdout and stderr are appended to this file
};

/// A child process killed (TERM, then KILL) and reaped when it goes out of scope.
class child_process {
 public:
  explicit child_process(std::vector<std::string> argv, const child_options& options = {}) {
    pid_ = fork();
    if (pid_ == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      for (const auto& [name, value] : options.env) setenv(name.c_str(), value.c_str(), 1);
      if (!options.log.empty()) {
        const int fd = open(options.log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
        if (fd >= 0) {
          dup2(fd, STDOUT_FILENO);
          dup2(fd, STDERR_FILENO);
        }
      }
      std::vector<char*> args;
      for (auto& a : argv) args.push_back(a.data());
      args.push_back(nullptr);
      execv(args[0], args.data());
      std::perror("execv");
      _exit(127);
    }
  }
  child_process(const child_process&) = delete;
  child_process& operator=(const child_process&) = delete;
  ~child_process() { stop(); }

  /// SIGTERM, wait up to 5 s, then SIGKILL. Returns the wait status (or -1 when it never ran),
  /// also when running() already reaped the child.
  int stop() {
    if (pid_ <= 0) return exit_status_;
    kill(pid_, SIGTERM);
    int status = 0;
    for (int i = 0; i < 250; ++i) {
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        exit_status_ = status;
        return status;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    kill(pid_, SIGKILL);
    waitpid(pid_, &status, 0);
    pid_ = -1;
    exit_status_ = status;
    return status;
  }
  void kill9() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    waitpid(pid_, &exit_status_, 0);
    pid_ = -1;
  }
  /// False once the child has exited; the first call that sees it reaps it and keeps its
  /// status for stop().
  [[nodiscard]] bool running() const {
    if (pid_ <= 0) return false;
    int status = 0;
    const pid_t got = waitpid(pid_, &status, WNOHANG);
    if (got == 0) return true;
    if (got == pid_) exit_status_ = status;
    pid_ = -1;
    return false;
  }
  [[nodiscard]] pid_t pid() const { return pid_; }

 private:
  mutable pid_t pid_ = -1;
  mutable int exit_status_ = -1;
};

/// A file removed when it goes out of scope.
struct temp_file {
  std::filesystem::path path;
  temp_file(const std::string& name, const std::string& text)
      : path(std::filesystem::temp_directory_path() / name) {
    std::ofstream(path) << text;
  }
  ~temp_file() { std::filesystem::remove(path); }
};

inline std::string duet_binary() { return std::string(DUET_BINARY_DIR) + "/duet"; }

}  // namespace duet::testing
