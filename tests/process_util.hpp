#pragma once
// Spawning `duet` node processes from tests: always reaped, even when a check fails.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

namespace duet::testing {

/// A child process killed (TERM, then KILL) and reaped when it goes out of scope.
class child_process {
 public:
  explicit child_process(std::vector<std::string> argv) {
    pid_ = fork();
    if (pid_ == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
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

  /// SIGTERM, wait up to 5 s, then SIGKILL. Returns the exit status (or -1).
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
  [[nodiscard]] bool running() const {
    return pid_ > 0 && waitpid(pid_, nullptr, WNOHANG) == 0;
  }

 private:
  pid_t pid_ = -1;
  int exit_status_ = -1;
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
