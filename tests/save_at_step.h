// A test callback shared by the Trainer tests that resume mid-epoch.
#pragma once

#include <fulgur/callback.h>
#include <fulgur/trainer_context.h>

#include <cstdint>
#include <string>
#include <utility>

namespace fulgur::test {

// Writes a full checkpoint from inside the loop when global_step reaches `step` (what
// model_checkpoint's every_n_train_steps does), so it records the mid-epoch position.
struct SaveAtStep : fulgur::Callback {
  SaveAtStep(int64_t step, std::string path) : step(step), path(std::move(path)) {}
  fulgur::HookSet hooks() const override { return static_cast<fulgur::HookSet>(fulgur::Hook::train_batch_end); }
  void on_train_batch_end(fulgur::TrainerContext& t, const fulgur::StepOutput&, const fulgur::Batch&,
                          int64_t) override {
    if (t.global_step() == step) t.save_checkpoint(path, false);
  }
  int64_t step;
  std::string path;
};

}  // namespace fulgur::test
