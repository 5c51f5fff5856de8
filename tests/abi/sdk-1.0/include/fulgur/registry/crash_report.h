// Names the culprit of a fatal signal. While plugin code runs (its library loading, its factory,
// a hook), a CrashScope on the stack says what runs; if that code dies of SIGSEGV, SIGBUS, SIGFPE,
// SIGILL or SIGABRT, the handler writes one line to stderr ("fulgur: fatal signal 11 (SIGSEGV) in
// callback 'x' (/path/libx.so), hook on_train_batch_end, at epoch 0, global step 3") and the
// signal then takes its previous action (by default: the process dies of it, core dump and all).
//
// Cost on the hot path: a CrashScope is two thread-local pointer stores; the texts are formatted
// once, when a plugin is added, and must outlive the scopes that name them. The handler only
// reads those texts and formats integers into a stack buffer: no malloc, only write(2).
#pragma once

#include <cstdint>

namespace fulgur {

struct CrashFrame {
  const char* what = nullptr;      // "callback 'x' (/path/libx.so), hook on_fit_start"
  const int64_t* epoch = nullptr;  // null: no run position to report
  const int64_t* global_step = nullptr;
  const CrashFrame* outer = nullptr;
};

namespace detail {
// The innermost frame of this thread. initial-exec: the registry is linked, not dlopen'ed, so the
// access is a plain TLS load (and safe from a signal handler, unlike a lazily allocated TLS block).
extern thread_local constinit const CrashFrame* crash_frame __attribute__((tls_model("initial-exec")));
}  // namespace detail

class CrashScope {
 public:
  explicit CrashScope(const char* what, const int64_t* epoch = nullptr, const int64_t* global_step = nullptr) noexcept
      : frame_{what, epoch, global_step, detail::crash_frame} {
    detail::crash_frame = &frame_;
  }
  ~CrashScope() { detail::crash_frame = frame_.outer; }
  CrashScope(const CrashScope&) = delete;
  CrashScope& operator=(const CrashScope&) = delete;

 private:
  CrashFrame frame_;
};

// Installs the handlers once per process (later calls do nothing; thread-safe). The registry calls
// it before it loads a plugin library, and the Trainer's hook dispatcher when it is built.
void install_crash_reporter();

}  // namespace fulgur
