// Internal: one pass of validation or test over a loader (Lightning's _EvaluationLoop).
#pragma once

#include <fulgur/data.h>
#include <fulgur/trainer.h>
#include <fulgur/types.h>

#include <ATen/core/ivalue.h>

#include <string>

namespace fulgur {

class EvaluationLoop {
 public:
  // `stage` is Stage::validate or Stage::test.
  EvaluationLoop(Trainer::Impl& trainer, Stage stage) : trainer_(trainer), stage_(stage) {}

  // Runs the stage's hooks and steps over at most `limit` batches of `loader` (-1: until it is
  // exhausted) and returns every epoch-level value. A sanity pass logs nothing anywhere.
  MetricMap run(BatchLoader& loader, int64_t limit, bool sanity);

  // Batches of this stage per pass, as TrainerContext::num_batches reports them (-1: unknown).
  int64_t num_batches() const { return num_batches_; }
  void set_num_batches(int64_t n) { num_batches_ = n; }

  // Progress, as Lightning keeps it for its evaluation loops: batches of the current (or last)
  // pass and completed passes. A run resumed mid-validation starts that validation again.
  c10::IValue state_dict() const;
  void load_state_dict(const c10::IValue& state, const std::string& path);

 private:
  Trainer::Impl& trainer_;
  Stage stage_;
  int64_t num_batches_ = -1;
  int64_t batches_done_ = 0;
  int64_t completed_passes_ = 0;
};

}  // namespace fulgur
