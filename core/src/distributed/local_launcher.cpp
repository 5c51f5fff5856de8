#include "distributed/local_launcher.h"

#include "distributed/process_group.h"

#include <fulgur/error.h>

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <spdlog/spdlog.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace fulgur::detail {
namespace {

// How long rank 0 may take to notice a dead child by itself (its next collective fails at once
// when the peer's sockets close) before the launcher ends it.
constexpr auto kFailureGrace = std::chrono::seconds(10);

struct Child {
  int64_t rank;
  pid_t pid;
  bool done = false;
  int status = 0;
};

std::string describe_status(int status) {
  if (WIFSIGNALED(status))
    return fmt::format("was killed by signal {} ({})", WTERMSIG(status), strsignal(WTERMSIG(status)));
  return fmt::format("exited with status {}", WEXITSTATUS(status));
}

class Launcher {
 public:
  static Launcher& instance() {
    static Launcher* launcher = new Launcher();  // never destroyed: the monitor may outlive main
    return *launcher;
  }

  void start(int64_t count) {
    std::lock_guard lock(mutex_);
    if (started_) return;
    started_ = true;
    const std::string addr = env_or("MASTER_ADDR", "127.0.0.1");
    const std::string port = std::getenv("MASTER_PORT") ? std::getenv("MASTER_PORT") : std::to_string(free_port());
    const std::vector<std::string> args = command_line();

    for (int64_t rank = 1; rank < count; ++rank) {
      std::vector<std::string> env = environment_for(rank, count, addr, port);
      std::vector<char*> argv, envp;
      for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      for (const auto& e : env) envp.push_back(const_cast<char*>(e.c_str()));
      envp.push_back(nullptr);
      const pid_t parent = getpid();
      const pid_t pid = fork();
      if (pid < 0)
        throw Error(ErrorKind::distributed,
                    fmt::format("cannot start rank {}: fork failed: {}", rank, strerror(errno)));
      if (pid == 0) {
        // Only async-signal-safe calls between fork and exec. A child never outlives rank 0.
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (getppid() != parent) _exit(1);
        execve("/proc/self/exe", argv.data(), envp.data());
        _exit(127);
      }
      children_.push_back({rank, pid});
    }
    for (const auto& [key, value] : rank_variables(0, count, addr, port)) setenv(key.c_str(), value.c_str(), 1);
    spdlog::info("Fulgur launcher: started {} processes on this node (rank 0 is this one), rendezvous {}:{}", count,
                 addr, port);

    install_signal_forwarding();
    set_peer_failure_reporter([this] { return failure_report(std::chrono::seconds(2)); });
    monitor_ = std::thread([this] { monitor(); });
    monitor_.detach();
    std::atexit([] { Launcher::instance().at_exit(); });
  }

  void note_failed() { run_failed_ = true; }
  // A signal stopped the run on every rank: ranks exiting with `code` did what was asked.
  void note_interrupted(int code) { interrupted_code_ = code; }

 private:
  static std::string env_or(const char* name, const char* fallback) {
    const char* v = std::getenv(name);
    return v && *v ? v : fallback;
  }

  static int free_port() {
    // The kernel picks a free port; the tiny window before rank 0 binds it again is accepted
    // (torchrun does the same).
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    socklen_t len = sizeof(addr);
    if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      if (fd >= 0) close(fd);
      throw Error(ErrorKind::distributed, "Fulgur launcher: cannot find a free TCP port on 127.0.0.1; set MASTER_PORT");
    }
    close(fd);
    return ntohs(addr.sin_port);
  }

  static std::vector<std::string> command_line() {
    std::ifstream in("/proc/self/cmdline", std::ios::binary);
    const std::string raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::vector<std::string> args;
    for (size_t start = 0; start < raw.size();) {
      const size_t end = raw.find('\0', start);
      args.push_back(raw.substr(start, end - start));
      if (end == std::string::npos) break;
      start = end + 1;
    }
    if (args.empty()) throw Error(ErrorKind::distributed, "Fulgur launcher: cannot read /proc/self/cmdline");
    return args;
  }

  // torchrun's variables, plus FULGUR_LAUNCHER so that the children do not launch again.
  static std::vector<std::pair<std::string, std::string>> rank_variables(int64_t rank, int64_t count,
                                                                         const std::string& addr,
                                                                         const std::string& port) {
    return {{"RANK", std::to_string(rank)},
            {"LOCAL_RANK", std::to_string(rank)},
            {"WORLD_SIZE", std::to_string(count)},
            {"LOCAL_WORLD_SIZE", std::to_string(count)},
            {"GROUP_RANK", "0"},
            {"GROUP_WORLD_SIZE", "1"},
            {"ROLE_RANK", std::to_string(rank)},
            {"ROLE_WORLD_SIZE", std::to_string(count)},
            {"MASTER_ADDR", addr},
            {"MASTER_PORT", port},
            {"FULGUR_LAUNCHER", "1"}};
  }

  static std::vector<std::string> environment_for(int64_t rank, int64_t count, const std::string& addr,
                                                  const std::string& port) {
    const auto vars = rank_variables(rank, count, addr, port);
    std::vector<std::string> env;
    for (char** e = environ; *e; ++e) {
      const std::string_view entry(*e);
      const std::string_view key = entry.substr(0, entry.find('='));
      bool replaced = false;
      for (const auto& [k, v] : vars) replaced = replaced || key == k;
      if (!replaced) env.emplace_back(entry);
    }
    for (const auto& [k, v] : vars) env.push_back(k + "=" + v);
    return env;
  }

  static void forward_signal(int sig) {
    // Async-signal-safe: kill() on a fixed array, then die of the same signal.
    for (size_t i = 0; i < forward_count; ++i) kill(forward_pids[i], sig);
    std::signal(sig, SIG_DFL);
    raise(sig);
  }

  void install_signal_forwarding() {
    forward_count = 0;
    for (const auto& c : children_)
      if (forward_count < std::size(forward_pids)) forward_pids[forward_count++] = c.pid;
    std::signal(SIGTERM, forward_signal);
    std::signal(SIGINT, forward_signal);
  }

  void monitor() {
    for (;;) {
      bool all_done = true;
      std::string failure;
      {
        std::lock_guard lock(mutex_);
        for (auto& c : children_) {
          if (c.done) continue;
          int status = 0;
          const pid_t r = waitpid(c.pid, &status, WNOHANG);
          if (r == c.pid) {
            c.done = true;
            c.status = status;
            if (!expected_exit(status) && failure_.empty()) {
              failure_ = fmt::format("rank {} (pid {}) {}", c.rank, c.pid, describe_status(status));
              failed_cv_.notify_all();
            }
          } else if (r < 0) {
            c.done = true;  // reaped elsewhere
          }
          all_done = all_done && c.done;
        }
        failure = failure_;
      }
      if (!failure.empty() && !handled_ && !exiting_) {
        handled_ = true;
        std::fprintf(stderr, "[fulgur launcher] %s; stopping the other ranks\n", failure.c_str());
        std::fflush(stderr);
        stop_children(SIGTERM);
        failed_at_ = std::chrono::steady_clock::now();
      }
      if (handled_ && std::chrono::steady_clock::now() - failed_at_ > kFailureGrace && !exiting_) {
        std::fprintf(stderr, "[fulgur launcher] rank 0 did not stop within %lld s after %s; exiting\n",
                     static_cast<long long>(kFailureGrace.count()), failure.c_str());
        std::fflush(stderr);
        std::fflush(nullptr);  // _Exit skips stdio: keep what rank 0 printed
        std::_Exit(1);
      }
      if (all_done && (failure.empty() || exiting_)) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }

  void stop_children(int sig) {
    std::lock_guard lock(mutex_);
    for (const auto& c : children_)
      if (!c.done) kill(c.pid, sig);
  }

  std::string failure_report(std::chrono::milliseconds wait) {
    std::unique_lock lock(mutex_);
    failed_cv_.wait_for(lock, wait, [this] { return !failure_.empty(); });
    return failure_;
  }

  void at_exit() {
    exiting_ = true;
    if (run_failed_) stop_children(SIGTERM);
    // Wait for every child; their exit status decides ours when this process succeeded.
    std::string failure;
    for (;;) {
      bool all_done = true;
      {
        std::lock_guard lock(mutex_);
        for (auto& c : children_) {
          if (!c.done) {
            int status = 0;
            if (waitpid(c.pid, &status, WNOHANG) == c.pid) {
              c.done = true;
              c.status = status;
              if (!expected_exit(status) && failure_.empty())
                failure_ = fmt::format("rank {} (pid {}) {}", c.rank, c.pid, describe_status(status));
            }
          }
          all_done = all_done && c.done;
        }
        failure = failure_;
      }
      if (all_done) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (!failure.empty() && !run_failed_) {
      std::fprintf(stderr, "[fulgur launcher] %s\n", failure.c_str());
      std::fflush(stderr);
      std::fflush(nullptr);  // _Exit skips stdio: keep what rank 0 printed
      std::_Exit(1);
    }
  }

  bool expected_exit(int status) const {
    if (!WIFEXITED(status)) return false;
    const int code = WEXITSTATUS(status);
    return code == 0 || (interrupted_code_ != 0 && code == interrupted_code_);
  }

  static inline pid_t forward_pids[256];
  static inline size_t forward_count = 0;

  std::mutex mutex_;
  std::condition_variable failed_cv_;
  std::vector<Child> children_;
  std::thread monitor_;
  std::string failure_;
  bool started_ = false;
  bool handled_ = false;
  std::chrono::steady_clock::time_point failed_at_;
  std::atomic<bool> exiting_{false};
  std::atomic<bool> run_failed_{false};
  std::atomic<int> interrupted_code_{0};
};

}  // namespace

std::atomic<bool> run_failed_in_this_process{false};

void launch_local_processes(int64_t process_count) { Launcher::instance().start(process_count); }
void note_local_run_failed() {
  run_failed_in_this_process = true;
  Launcher::instance().note_failed();
}
bool local_run_failed() { return run_failed_in_this_process; }
void note_local_run_interrupted(int exit_code) { Launcher::instance().note_interrupted(exit_code); }

}  // namespace fulgur::detail
