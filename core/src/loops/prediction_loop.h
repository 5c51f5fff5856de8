// Internal: one pass of predict_step over a loader (Lightning's _PredictionLoop).
#pragma once

#include <fulgur/data_module.h>
#include <fulgur/trainer.h>

#include <ATen/core/ivalue.h>

#include <string>
#include <vector>

namespace fulgur {

class PredictionLoop {
 public:
  explicit PredictionLoop(TrainerEngine& trainer) : trainer_(trainer) {}

  // predict_step over at most num_batches() batches of `loader` (-1: until it is exhausted).
  std::vector<at::Tensor> run(BatchLoader& loader);

  int64_t num_batches() const { return num_batches_; }
  void set_num_batches(int64_t n) { num_batches_ = n; }

  c10::IValue state_dict() const;
  void load_state_dict(const c10::IValue& state, const std::string& path);

 private:
  TrainerEngine& trainer_;
  int64_t num_batches_ = -1;
  int64_t batches_done_ = 0;
  int64_t completed_passes_ = 0;
};

}  // namespace fulgur
