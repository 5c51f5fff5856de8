#include <fulgur/registry/crash_report.h>

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <mutex>

namespace fulgur {

namespace detail {
thread_local constinit const CrashFrame* crash_frame __attribute__((tls_model("initial-exec"))) = nullptr;
}  // namespace detail

namespace {

struct FatalSignal {
  int number;
  const char* name;
};
constexpr FatalSignal kFatal[] = {
    {SIGSEGV, "SIGSEGV"}, {SIGBUS, "SIGBUS"}, {SIGFPE, "SIGFPE"}, {SIGILL, "SIGILL"}, {SIGABRT, "SIGABRT"}};
constexpr int kFatalCount = sizeof(kFatal) / sizeof(kFatal[0]);

struct sigaction g_previous[kFatalCount];
// A stack overflow in plugin code must still be reported: the handler runs on its own stack.
alignas(16) char g_alt_stack[64 * 1024];

// An async-signal-safe line builder over a fixed buffer (no malloc, no stdio).
class Line {
 public:
  void add(const char* text) {
    while (text && *text && size_ < sizeof(buffer_) - 1) buffer_[size_++] = *text++;
  }
  void add(int64_t value) {
    char digits[24];
    int n = 0;
    uint64_t magnitude = value < 0 ? 0 - static_cast<uint64_t>(value) : static_cast<uint64_t>(value);
    do {
      digits[n++] = static_cast<char>('0' + magnitude % 10);
      magnitude /= 10;
    } while (magnitude != 0 && n < 20);
    if (value < 0) add("-");
    while (n > 0 && size_ < sizeof(buffer_) - 1) buffer_[size_++] = digits[--n];
  }
  void flush() {
    buffer_[size_++] = '\n';
    const char* p = buffer_;
    size_t left = size_;
    while (left > 0) {
      const ssize_t written = ::write(STDERR_FILENO, p, left);
      if (written < 0 && errno == EINTR) continue;
      if (written <= 0) break;
      p += written;
      left -= static_cast<size_t>(written);
    }
    size_ = 0;
  }

 private:
  char buffer_[1024];
  size_t size_ = 0;
};

void add_frame(Line& line, const CrashFrame& frame) {
  line.add(frame.what);
  if (frame.epoch && frame.global_step) {
    line.add(", at epoch ");
    line.add(*frame.epoch);
    line.add(", global step ");
    line.add(*frame.global_step);
  }
}

void on_fatal_signal(int sig) {
  const int saved_errno = errno;
  int index = 0;
  while (index < kFatalCount && kFatal[index].number != sig) ++index;
  if (const CrashFrame* frame = detail::crash_frame) {
    Line line;
    line.add("fulgur: fatal signal ");
    line.add(static_cast<int64_t>(sig));
    line.add(" (");
    line.add(index < kFatalCount ? kFatal[index].name : "?");
    line.add(") in ");
    add_frame(line, *frame);
    line.flush();
    for (const CrashFrame* outer = frame->outer; outer; outer = outer->outer) {
      line.add("  called from ");
      add_frame(line, *outer);
      line.flush();
    }
  }
  // The signal's previous action (the default: die of it, with its status and core dump). A fault
  // re-executes the faulting instruction on return; a raised signal is delivered on return.
  if (index < kFatalCount) ::sigaction(sig, &g_previous[index], nullptr);
  ::raise(sig);
  errno = saved_errno;
}

}  // namespace

void install_crash_reporter() {
  static std::once_flag once;
  std::call_once(once, [] {
    stack_t alt{};
    alt.ss_sp = g_alt_stack;
    alt.ss_size = sizeof(g_alt_stack);
    stack_t current{};
    // Keep an alternate stack someone else set up for this thread.
    if (::sigaltstack(nullptr, &current) == 0 && (current.ss_flags & SS_DISABLE)) ::sigaltstack(&alt, nullptr);
    for (int i = 0; i < kFatalCount; ++i) {
      struct sigaction action {};
      action.sa_handler = on_fatal_signal;
      sigemptyset(&action.sa_mask);
      action.sa_flags = SA_ONSTACK;
      ::sigaction(kFatal[i].number, &action, &g_previous[i]);
    }
  });
}

}  // namespace fulgur
