// Internal: one pass of validation or test over a loader (Lightning's _EvaluationLoop).
#pragma once

#include <fulgur/data_module.h>
#include <fulgur/trainer.h>
#include <fulgur/types.h>

#include <ATen/core/ivalue.h>

#include <string>
#include <vector>

namespace fulgur {

class EvaluationLoop {
 public:
  // `stage` is Stage::validate or Stage::test.
  EvaluationLoop(TrainerEngine& trainer, Stage stage) : trainer_(trainer), stage_(stage) {}

  // The loaders of a pass and their batch limits (-1: until the loader is exhausted).
  void set_loaders(std::vector<BatchLoader*> loaders, std::vector<int64_t> limits);
  bool has_batches() const;

  // Runs the stage's hooks once and the steps over every loader in turn (at most `max_batches`
  // of each when >= 0, as the sanity check asks) and returns every epoch-level value. A sanity
  // pass logs nothing anywhere.
  MetricMap run(bool sanity, int64_t max_batches = -1);

  // Batches of the current loader, as TrainerContext::num_batches reports them (-1: unknown).
  int64_t num_batches() const;
  int64_t dataloader_idx() const { return dataloader_idx_; }

  // Progress, as Lightning keeps it for its evaluation loops: batches of the current (or last)
  // pass and completed passes. A run resumed mid-validation starts that validation again.
  c10::IValue state_dict() const;
  void load_state_dict(const c10::IValue& state, const std::string& path);

 private:
  TrainerEngine& trainer_;
  Stage stage_;
  std::vector<BatchLoader*> loaders_;
  std::vector<int64_t> limits_;
  int64_t dataloader_idx_ = 0;
  int64_t batches_done_ = 0;
  int64_t completed_passes_ = 0;
};

}  // namespace fulgur
