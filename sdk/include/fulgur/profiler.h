// Profiler: measures named actions of the Trainer ("run_training_batch", "optimizer_step", ...).
#pragma once

#include <fulgur/export.h>
#include <fulgur/types.h>

#include <string>
#include <string_view>

namespace fulgur {

class FULGUR_SDK_API Profiler {
 public:
  virtual ~Profiler();

  // `global_rank` > 0 in a multi-process run: files get a rank suffix so that ranks sharing rank
  // 0's log_dir do not overwrite each other.
  virtual void setup(Stage stage, const std::string& log_dir, int64_t global_rank) = 0;
  // `action` points to a string with static storage duration (the Trainer's action names).
  virtual void start(std::string_view action) = 0;
  virtual void stop(std::string_view action) = 0;
  virtual std::string summary() const = 0;
  virtual void teardown(Stage stage) = 0;
};

// RAII action: `{ ProfileScope scope(profiler, "optimizer_step"); ... }`; null profiler = no-op.
class ProfileScope {
 public:
  ProfileScope(Profiler* profiler, std::string_view action) : profiler_(profiler), action_(action) {
    if (profiler_) profiler_->start(action_);
  }
  ~ProfileScope() {
    if (profiler_) profiler_->stop(action_);
  }
  ProfileScope(const ProfileScope&) = delete;
  ProfileScope& operator=(const ProfileScope&) = delete;

 private:
  Profiler* profiler_;
  std::string_view action_;
};

}  // namespace fulgur
