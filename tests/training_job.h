// Helpers for the tests that drive the shipped fashion_mnist program from TOML files in real
// processes and look at the checkpoints it leaves (signal_test.cpp, kill_resume_test.cpp).
#pragma once

#include "test_support.h"

#include <fulgur/checkpoint_io.h>
#include <fulgur/distributed_checkpoint.h>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <ATen/ATen.h>
#include <dirent.h>
#include <signal.h>
#include <sys/wait.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <initializer_list>
#include <map>
#include <string>
#include <vector>

namespace fulgur::test::job {

// The fixtures a test needs, copied into a private plugin directory.
inline fs::path plugin_dir(const TempDir& dir, std::initializer_list<const char*> fixtures) {
  const fs::path plugins = dir.subdir("plugins");
  for (const char* name : fixtures) {
    const std::string file = std::string("libfulgur-fixture-") + name + ".so";
    copy_library(fixture(file), plugins / file);
  }
  return plugins;
}

// A small, quick configuration of the example: the MLP, `batches` training batches of 32 per
// epoch, data loaded by two worker threads; `trainer_extra` goes into [trainer], `extra` after.
inline std::string toml(const fs::path& root, const fs::path& plugins, int max_epochs, int batches,
                        const std::string& trainer_extra, const std::string& extra) {
  return "[trainer]\nmax_epochs = " + std::to_string(max_epochs) +
         "\nseed = 7\nlimit_train_batches = " + std::to_string(batches) +
         "\nlimit_val_batches = 3\nlimit_test_batches = 2\nlog_every_n_steps = 5\nenable_progress_bar = false\n"
         "default_root_dir = \"" +
         (root / "runs").string() + "\"\n" + trainer_extra + "[model]\narch = \"mlp\"\n[data]\nbatch_size = 32\n" +
         "num_workers = 2\n[plugins]\npaths = [\"" + plugins.string() + "\"]\n" + extra;
}

inline std::string checkpointing(const fs::path& dir, int every_n_train_steps, int save_top_k = 0) {
  return "[[callbacks]]\nname = \"model_checkpoint\"\ndirpath = \"" + dir.string() +
         "\"\nevery_n_train_steps = " + std::to_string(every_n_train_steps) +
         "\nsave_top_k = " + std::to_string(save_top_k) + "\nsave_last = true\n";
}

inline ProcessRun run_example(const fs::path& toml_file, const fs::path& dir,
                              std::map<std::string, std::string> env = {}) {
  env.emplace("FULGUR_LOG_LEVEL", "info");
  return run_process({FULGUR_TEST_FASHION_MNIST, "--config", toml_file.string()}, env, dir);
}

// A checkpoint file, or a distributed checkpoint directory (fsdp's sharded state), read whole.
inline c10::impl::GenericDict checkpoint_dict(const fs::path& path) {
  c10::IValue value =
      fs::is_directory(path) ? fulgur::dcp::Reader(path.string()).read_all() : read_checkpoint_file(path.string());
  REQUIRE(value.isGenericDict());
  return value.toGenericDict();
}

// True when both checkpoints hold the same model tensors, bit for bit. Otherwise the test's log
// says where they part: a missing key, or a tensor's largest difference and how many elements
// differ (a rounding-sized difference in every tensor reads differently from a wrong step).
inline bool same_weights(const fs::path& a, const fs::path& b) {
  const auto wa = checkpoint_dict(a).at("state_dict").toGenericDict();
  const auto wb = checkpoint_dict(b).at("state_dict").toGenericDict();
  if (wa.size() != wb.size()) {
    MESSAGE(a.string() << " holds " << wa.size() << " tensors, " << b.string() << " " << wb.size());
    return false;
  }
  bool same = true;
  for (const auto& entry : wa) {
    auto other = wb.find(entry.key());
    if (other == wb.end()) {
      MESSAGE(entry.key().toStringRef() << " is missing from " << b.string());
      return false;
    }
    const at::Tensor ta = entry.value().toTensor(), tb = other->value().toTensor();
    if (at::equal(ta, tb)) continue;
    same = false;
    if (ta.sizes() != tb.sizes() || ta.scalar_type() != tb.scalar_type()) {
      MESSAGE(entry.key().toStringRef() << ": " << ta.sizes() << " " << ta.scalar_type() << " against " << tb.sizes()
                                        << " " << tb.scalar_type());
      continue;
    }
    const at::Tensor difference = (ta.to(at::kDouble) - tb.to(at::kDouble)).abs();
    MESSAGE(entry.key().toStringRef() << ": " << difference.ne(0).sum().item<int64_t>() << " of " << ta.numel()
                                      << " elements differ, by at most " << difference.max().item<double>()
                                      << " (largest magnitude " << ta.abs().max().item<double>() << ")");
  }
  return same;
}

inline std::vector<std::string> files_in(const fs::path& dir) {
  std::vector<std::string> names;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d))
      if (std::string_view(e->d_name) != "." && std::string_view(e->d_name) != "..") names.emplace_back(e->d_name);
    ::closedir(d);
  }
  std::sort(names.begin(), names.end());
  return names;
}

// A program started in the background (stdout and stderr into `dir`/output.txt), for tests that
// signal it from outside.
class BackgroundProcess {
 public:
  BackgroundProcess(const std::vector<std::string>& args, const std::map<std::string, std::string>& env,
                    const fs::path& dir)
      : log_(dir / "output.txt"), pid_(fulgur::test::spawn_process(args, env, dir, log_)) {}
  ~BackgroundProcess() {
    if (pid_ > 0 && !reaped_) {
      ::kill(pid_, SIGKILL);
      int status = 0;
      ::waitpid(pid_, &status, 0);
    }
  }
  BackgroundProcess(const BackgroundProcess&) = delete;
  BackgroundProcess& operator=(const BackgroundProcess&) = delete;

  pid_t pid() const { return pid_; }

  // Waits (up to `limit`, a safety net, not a measurement) for `file` to exist; false if the
  // process ended first or the limit passed.
  bool wait_for_file(const fs::path& file, std::chrono::seconds limit = std::chrono::seconds(120)) {
    const auto until = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < until) {
      struct stat info {};
      if (::stat(file.c_str(), &info) == 0) return true;
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        reaped_ = true;
        status_ = status;
        return false;
      }
      timespec pause{0, 10'000'000};
      ::nanosleep(&pause, nullptr);
    }
    return false;
  }

  ProcessRun wait() {
    if (!reaped_) {
      REQUIRE(::waitpid(pid_, &status_, 0) == pid_);
      reaped_ = true;
    }
    ProcessRun r;
    r.exit_code = WIFEXITED(status_) ? WEXITSTATUS(status_) : -WTERMSIG(status_);
    std::ifstream in(log_);
    std::stringstream text;
    text << in.rdbuf();
    r.output = text.str();
    return r;
  }

 private:
  fs::path log_;
  pid_t pid_ = -1;
  bool reaped_ = false;
  int status_ = 0;
};

}  // namespace fulgur::test::job
