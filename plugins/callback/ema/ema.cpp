// Built-in callback `ema`: Lightning 2.6's EMAWeightAveraging (a WeightAveraging with
// torch.optim.swa_utils' EMA rule). After optimizer steps it updates an exponential moving average
// of the model's weights, ema = decay * ema + (1 - decay) * weights (the first update copies the
// weights, as AveragedModel does). Validation and test run on the averaged weights, swapped in at
// the start and the training weights put back at the end; at the end of training the average is
// copied into the model (Lightning always does; copy_average_at_end = false keeps the trained
// weights). The average is saved in checkpoints under callbacks["EMAWeightAveraging"] and restored
// on resume; the checkpoint's state_dict holds the training weights.
#include <fulgur/plugin.h>

#include "../common/callback_conventions.h"
#include "../common/model_weights.h"

#include <fmt/format.h>

#include <optional>
#include <string>

namespace {

namespace support = fulgur::callback_conventions;
namespace weights = fulgur::model_weights;
using fulgur::Error;
using fulgur::ErrorKind;

constexpr char kOwner[] = "callback 'ema'";

std::string checked_device(const fulgur::PluginOptions& options, const std::string& device) {
  if (device.empty()) return device;
  try {
    (void)c10::Device(device);
  } catch (const std::exception&) {
    options.reject("device", "is not a device; use \"\" (where the model is), \"cpu\" or \"cuda:0\"");
  }
  return device;
}

class Ema final : public fulgur::CallbackBase<Ema> {
 public:
  FULGUR_OPTIONS(Options, (floating, decay, "EMA decay: ema = decay * ema + (1 - decay) * weights", 0.999),
                 (integer, update_every_n_steps, "Update after every n-th optimizer step", 1),
                 (integer, update_starting_at_step,
                  "First optimizer step (0-based) that updates the average; -1: no condition", -1),
                 (integer, update_starting_at_epoch,
                  "First epoch (0-based) whose steps update the average; -1: no condition", -1),
                 (boolean, use_buffers,
                  "Average the buffers (BatchNorm statistics) too; false: only parameters are averaged and "
                  "swapped, buffers stay the model's",
                  true),
                 (string, device, "Where the average lives: \"\" = the model's device, or \"cpu\"", ""),
                 (boolean, copy_average_at_end,
                  "Copy the average into the model when training ends (Lightning always does)", true));

  explicit Ema(const Options& options)
      : decay_(options.decay),
        every_n_steps_(options.update_every_n_steps),
        start_step_(options.update_starting_at_step),
        start_epoch_(options.update_starting_at_epoch),
        use_buffers_(options.use_buffers),
        device_(checked_device(options, options.device)),
        copy_at_end_(options.copy_average_at_end) {
    options.check(decay_ >= 0.0 && decay_ <= 1.0, "decay", "must lie in [0, 1] (typical: 0.999)");
    options.check(every_n_steps_ >= 1, "update_every_n_steps", "must be >= 1 (1: after every optimizer step)");
    options.check(start_step_ >= -1, "update_starting_at_step", "must be >= 0, or -1 for no condition");
    options.check(start_epoch_ >= -1, "update_starting_at_epoch", "must be >= 0, or -1 for no condition");
  }

  void on_fit_start(fulgur::TrainerContext& trainer) override {
    average_.init(trainer.model(), use_buffers_, device_);
    latest_update_step_ = 0;
    if (pending_) {
      average_.from_state(kOwner, *pending_);
      latest_update_step_ = support::get_optional_int(kOwner, *pending_, "latest_update_step").value_or(0);
      pending_.reset();
    }
  }

  void on_train_batch_end(fulgur::TrainerContext& trainer, const fulgur::StepOutput&, const fulgur::Batch&,
                          int64_t) override {
    const int64_t step = trainer.global_step();
    if (step <= latest_update_step_) return;  // an accumulation micro-batch: no optimizer step yet
    if (!should_update(step - 1, trainer.current_epoch())) return;
    const double w = 1.0 - decay_;
    average_.update([w](int64_t) { return w; });
    latest_update_step_ = step;
  }

  void on_validation_start(fulgur::TrainerContext& trainer) override { swap_in(trainer); }
  void on_validation_end(fulgur::TrainerContext&) override { average_.swap_out(); }
  void on_test_start(fulgur::TrainerContext& trainer) override { swap_in(trainer); }
  void on_test_end(fulgur::TrainerContext&) override { average_.swap_out(); }
  void on_exception(fulgur::TrainerContext&, const std::exception&) override { average_.swap_out(); }

  void on_train_end(fulgur::TrainerContext&) override {
    if (!copy_at_end_ || average_.n_averaged() == 0) return;
    average_.copy_to_model();
    fulgur::log::info(fmt::format("{}: copied the exponential moving average ({} updates) into the model", kOwner,
                                  average_.n_averaged()));
  }

  std::string state_key() const override { return "EMAWeightAveraging"; }
  void state_dict(c10::IValue& out) const override {
    if (!average_.initialized()) {
      auto state = support::new_state_dict();
      state.insert("n_averaged", int64_t{0});
      state.insert("latest_update_step", latest_update_step_);
      out = c10::IValue(state);
      return;
    }
    auto state = average_.to_state();
    state.insert("latest_update_step", latest_update_step_);
    out = c10::IValue(state);
  }
  // Restored before on_fit_start, when the model's tensors are not known yet: kept until then.
  void load_state_dict(const c10::IValue& state) override {
    auto dict = support::expect_dict(kOwner, state);
    if (support::get_optional_int(kOwner, dict, "n_averaged").value_or(0) == 0) return;
    pending_ = dict;
  }

 private:
  bool should_update(int64_t step_idx, int64_t epoch) const {
    if (start_step_ >= 0 && step_idx < start_step_) return false;
    if (start_epoch_ >= 0 && epoch < start_epoch_) return false;
    return step_idx % every_n_steps_ == 0;
  }

  void swap_in(fulgur::TrainerContext& trainer) {
    // Before the first update (the sanity check, an early validation) there is no average yet.
    if (trainer.sanity_checking() || average_.n_averaged() == 0) return;
    average_.swap_in();
  }

  double decay_;
  int64_t every_n_steps_;
  int64_t start_step_;
  int64_t start_epoch_;
  bool use_buffers_;
  std::string device_;
  bool copy_at_end_;
  weights::AveragedWeights average_;
  int64_t latest_update_step_ = 0;
  std::optional<c10::impl::GenericDict> pending_;
};

}  // namespace

FULGUR_PLUGIN(Ema, "ema", "0.1.0",
              "Exponential moving average of the weights (Lightning's EMAWeightAveraging), used for validation and "
              "test and copied into the model at the end")
