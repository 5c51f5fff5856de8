// Crash-isolated plugin checks. The parent has libtorch loaded, so it never forks to run plugin
// code: it posix_spawn()s its own executable (/proc/self/exe) with a hidden subcommand, in a new
// process group, and reads two pipes: the child's stdout+stderr (kept for the report) and a
// progress channel on fd 3 ("phase load", "phase create", ..., "ok" or "error MESSAGE"). The
// verdict comes from the wait status and the last phase reached; a child past its deadline is
// killed with its whole process group.
#include "plugin_check.h"

#include <fulgur/error.h>
#include <fulgur/registry/verdicts.h>

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <exception>
#include <iostream>
#include <string_view>
#include <vector>

extern char** environ;

namespace fulgur::cli {

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr int kChildErrorStatus = 3;  // the child caught an error and reported it on fd 3
constexpr int kProgressFd = 3;
constexpr size_t kOutputKeep = 16 * 1024;

// ---- child -----------------------------------------------------------------------------------

int progress_fd = -1;

void report(std::string_view line) {
  std::string text(line);
  for (char& c : text)
    if (c == '\n' || c == '\r') c = ' ';
  text += '\n';
  const int fd = progress_fd >= 0 ? progress_fd : STDOUT_FILENO;
  const char* p = text.data();
  size_t left = text.size();
  while (left > 0) {
    const ssize_t n = ::write(fd, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    p += n;
    left -= static_cast<size_t>(n);
  }
}

// An exception nobody catches (for instance from a static initializer during dlopen) ends in
// std::terminate: say which one before the abort the parent will see.
[[noreturn]] void report_terminate() {
  std::string what = "std::terminate called";
  if (std::exception_ptr e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& ex) {
      what = fmt::format("uncaught exception: {}", ex.what());
    } catch (...) {
      what = "uncaught exception of a type not derived from std::exception";
    }
  }
  report("terminate " + what);
  std::abort();
}

// ---- parent ----------------------------------------------------------------------------------

struct Subject {
  const PluginCandidate* candidate = nullptr;
};

struct ChildOutcome {
  Verdict verdict = Verdict::ok;
  std::string reason;
};

std::string phase_text(std::string_view phase) {
  if (phase == "load") return "loading (dlopen and static initializers)";
  if (phase == "create") return "creating its object with default options";
  if (phase == "destroy") return "destroying its object";
  if (phase == "exit") return "exiting (static destructors)";
  return "starting the check process";
}

std::string signal_text(int sig) {
  const char* abbrev = ::sigabbrev_np(sig);
  const char* description = ::strsignal(sig);
  return fmt::format("SIG{} ({})", abbrev ? abbrev : std::to_string(sig).c_str(),
                     description ? description : "unknown signal");
}

std::string last_line(const std::string& output) {
  size_t end = output.find_last_not_of(" \n\r\t");
  if (end == std::string::npos) return {};
  size_t start = output.find_last_of('\n', end);
  start = start == std::string::npos ? 0 : start + 1;
  std::string line = output.substr(start, end - start + 1);
  if (line.size() > 300) line = line.substr(0, 300) + "...";
  return line;
}

fs::path self_executable() {
  std::error_code ec;
  fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (ec) throw Error(ErrorKind::runtime, fmt::format("cannot find this executable: {}", ec.message()));
  return self;
}

void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

ChildOutcome run_child(const fs::path& self, const PluginCandidate& c, double timeout_s) {
  int progress[2] = {-1, -1};
  int output[2] = {-1, -1};
  if (::pipe2(progress, O_CLOEXEC) != 0 || ::pipe2(output, O_CLOEXEC) != 0)
    throw Error(ErrorKind::runtime, fmt::format("cannot create a pipe: {}", std::strerror(errno)));

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&actions, output[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, output[1], STDERR_FILENO);
  posix_spawn_file_actions_adddup2(&actions, progress[1], kProgressFd);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t defaults, empty;
  sigfillset(&defaults);
  sigemptyset(&empty);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  posix_spawnattr_setsigmask(&attr, &empty);
  posix_spawnattr_setpgroup(&attr, 0);  // its own group: a timeout kills whatever it started too
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETPGROUP);

  const std::string self_s = self.string(), file_s = c.file.string(), kind_s(to_string(c.metadata.kind));
  std::vector<char*> argv = {const_cast<char*>(self_s.c_str()),          const_cast<char*>(kCheckChildCommand),
                             const_cast<char*>(file_s.c_str()),          const_cast<char*>(kind_s.c_str()),
                             const_cast<char*>(c.metadata.name.c_str()), nullptr};
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, self_s.c_str(), &actions, &attr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  close_fd(progress[1]);
  close_fd(output[1]);
  if (rc != 0) {
    close_fd(progress[0]);
    close_fd(output[0]);
    throw Error(ErrorKind::runtime, fmt::format("cannot start {}: {}", self_s, std::strerror(rc)));
  }

  // Read both pipes until both close or the deadline passes.
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  std::string progress_text, output_text;
  bool timed_out = false;
  while (progress[0] >= 0 || output[0] >= 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) {
      timed_out = true;
      break;
    }
    pollfd fds[2] = {{progress[0], POLLIN, 0}, {output[0], POLLIN, 0}};
    const int n = ::poll(fds, 2, static_cast<int>(std::min<long long>(left, 1000)));
    if (n < 0 && errno != EINTR) break;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      char buffer[4096];
      const ssize_t got = ::read(fds[i].fd, buffer, sizeof(buffer));
      if (got > 0) {
        std::string& sink = i == 0 ? progress_text : output_text;
        sink.append(buffer, static_cast<size_t>(got));
        if (sink.size() > 2 * kOutputKeep) sink.erase(0, sink.size() - kOutputKeep);
      } else if (got == 0 || errno != EINTR) {
        close_fd(i == 0 ? progress[0] : output[0]);
      }
    }
  }
  // Pipes closed: the child is exiting (or closed them itself and went on); wait for it until the
  // same deadline.
  int status = 0;
  bool reaped = false;
  while (!timed_out) {
    const pid_t w = ::waitpid(pid, &status, WNOHANG);
    if (w == pid) {
      reaped = true;
      break;
    }
    if (w < 0 && errno != EINTR) break;
    if (Clock::now() >= deadline) {
      timed_out = true;
      break;
    }
    ::usleep(10 * 1000);
  }
  if (!reaped) {
    ::kill(-pid, SIGKILL);
    ::kill(pid, SIGKILL);
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
  }
  close_fd(progress[0]);
  close_fd(output[0]);

  // What the child said on its progress channel.
  std::string phase, error, terminate_text, note;
  bool ok = false;
  size_t start = 0;
  while (start < progress_text.size()) {
    size_t end = progress_text.find('\n', start);
    if (end == std::string::npos) end = progress_text.size();
    std::string_view line(progress_text.data() + start, end - start);
    if (line.starts_with("phase ")) phase = line.substr(6);
    if (line.starts_with("error ")) error = line.substr(6);
    if (line.starts_with("terminate ")) terminate_text = line.substr(10);
    if (line.starts_with("note ")) note = line.substr(5);
    if (line == "ok") ok = true;
    start = end + 1;
  }
  const std::string where = phase_text(phase);
  const std::string tail = last_line(output_text);

  ChildOutcome out;
  if (timed_out) {
    out.verdict = Verdict::hang;
    out.reason = fmt::format("hung: no result within {:g} s while {} (killed; raise --timeout if it is only slow)",
                             timeout_s, where);
  } else if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    out.verdict = sig == SIGABRT ? Verdict::abort : Verdict::crash;
    out.reason = fmt::format("{} with {} while {}", sig == SIGABRT ? "aborted" : "crashed", signal_text(sig), where);
    if (!terminate_text.empty())
      out.reason += ": " + terminate_text;
    else if (!tail.empty())
      out.reason += fmt::format(" (last output: {})", tail);
  } else if (WIFEXITED(status) && WEXITSTATUS(status) == 0 && ok) {
    out.verdict = Verdict::ok;
    out.reason = note.empty() ? "loaded, created with default options and destroyed" : note;
  } else if (WIFEXITED(status) && WEXITSTATUS(status) == kChildErrorStatus && !error.empty()) {
    out.verdict = Verdict::error;
    out.reason = error;
  } else {
    // exit() or _exit() from plugin code ends a run just as surely as a signal.
    out.verdict = Verdict::crash;
    out.reason = fmt::format("ended the process with exit status {} while {}",
                             WIFEXITED(status) ? WEXITSTATUS(status) : -1, where);
    if (!tail.empty()) out.reason += fmt::format(" (last output: {})", tail);
  }
  return out;
}

std::string_view label(Verdict v) {
  switch (v) {
    case Verdict::ok:
      return "ok";
    case Verdict::error:
      return "ERROR";
    case Verdict::crash:
      return "CRASH";
    case Verdict::abort:
      return "ABORT";
    case Verdict::hang:
      return "HANG";
  }
  return "?";
}

}  // namespace

int check_plugins(const PluginRegistry& registry, const CheckRequest& request) {
  std::vector<const PluginCandidate*> subjects;
  for (const PluginCandidate& c : registry.candidates()) {
    if (request.name && c.metadata.name != *request.name) continue;
    if (request.kind && c.metadata.kind != *request.kind) continue;
    subjects.push_back(&c);
  }
  if (request.name && subjects.empty()) {
    registry.resolve(request.kind.value_or(PluginKind::callback), *request.name);  // throws, with "did you mean"
    throw Error(ErrorKind::plugin_not_found, fmt::format("no plugin named '{}'", *request.name));
  }

  const fs::path cache = verdict_cache_path();
  const std::vector<VerdictRecord> cached = load_verdicts(cache);
  const fs::path self = self_executable();
  std::vector<VerdictRecord> updates;
  int ok = 0, refused = 0, errors = 0, skipped = 0;

  for (const PluginCandidate* c : subjects) {
    const std::string who =
        fmt::format("{} '{}' ({})", to_string(c->metadata.kind), c->metadata.name, c->file.string());
    if (c->status == CandidateStatus::rejected) {  // refused from its metadata: its code never runs
      std::cout << fmt::format("{:<6} {}: refused before loading: {}\n", "SKIP", who, c->reason);
      ++skipped;
      continue;
    }
    std::optional<VerdictRecord> subject = verdict_subject(c->file, c->metadata);
    const VerdictRecord* previous = subject && !request.force ? find_verdict(cached, *subject) : nullptr;
    VerdictRecord record = subject.value_or(VerdictRecord{});
    if (previous) {
      record = *previous;
    } else {
      ChildOutcome outcome = run_child(self, *c, request.timeout_s);
      record.verdict = outcome.verdict;
      record.reason = outcome.reason;
      record.checked_at = static_cast<int64_t>(std::time(nullptr));
      if (subject) updates.push_back(record);
    }
    std::cout << fmt::format("{:<6} {}: {}{}\n", label(record.verdict), who, record.reason,
                             previous ? " (cached; --force rechecks)" : "");
    if (record.verdict == Verdict::ok)
      ++ok;
    else if (verdict_refuses(record.verdict))
      ++refused;
    else
      ++errors;
  }
  if (request.name == std::nullopt)
    for (const FileProblem& p : registry.problems())
      if (p.is_plugin_error) {
        std::cout << fmt::format("{:<6} {}: refused before loading: {}\n", "SKIP", p.file.string(), p.reason);
        ++skipped;
      }

  if (!updates.empty()) {
    try {
      store_verdicts(cache, updates);
    } catch (const Error& e) {
      std::cerr << "fulgur: warning: verdicts not recorded: " << e.what() << "\n";
    }
  }
  std::cout << fmt::format(
      "\n{} checked: {} ok, {} crash/abort/hang (refused by runs until rechecked), {} with errors, {} refused "
      "before loading. Verdicts: {}\n",
      ok + refused + errors, ok, refused, errors, skipped, cache.string());
  return refused + errors + skipped == 0 ? 0 : 1;
}

int check_child_main(int argc, char** argv) {
  // No core files from the plugins we expect to crash.
  rlimit no_core{0, 0};
  ::setrlimit(RLIMIT_CORE, &no_core);
  if (::fcntl(kProgressFd, F_GETFD) != -1) progress_fd = kProgressFd;
  std::set_terminate(report_terminate);
  if (argc != 5) {
    report("error usage: fulgur __plugin-check-child FILE KIND NAME");
    return kChildErrorStatus;
  }
  const fs::path file = argv[2];
  try {
    const std::optional<PluginKind> kind = parse_plugin_kind(argv[3]);
    const std::string name = argv[4];
    NoteReadResult notes = read_plugin_notes(file);
    PluginCandidate candidate;
    candidate.file = file;
    bool found = false;
    for (PluginMetadata& m : notes.plugins)
      if (kind && m.kind == *kind && m.name == name) {
        candidate.metadata = std::move(m);
        found = true;
      }
    if (!found) {
      report(fmt::format("error {} no longer declares {} '{}'", file.string(), argv[3], name));
      return kChildErrorStatus;
    }
    RegistryOptions options;
    options.use_verdict_cache = false;
    PluginRegistry registry({}, options);

    report("phase load");
    registry.load(candidate);
    Options defaults;
    try {
      defaults = default_options(candidate.metadata);
    } catch (const Error& e) {
      report(fmt::format("note loaded; not created: {}", e.what()));
      report("phase exit");
      report("ok");
      return 0;
    }
    report("phase create");
    PluginObject object = registry.create(candidate, defaults);
    report("phase destroy");
    object.reset();
    report("phase exit");
    report("ok");
    return 0;
  } catch (const std::exception& e) {
    report(fmt::format("error {}", e.what()));
    return kChildErrorStatus;
  }
}

}  // namespace fulgur::cli
