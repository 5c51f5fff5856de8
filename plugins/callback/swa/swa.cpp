// Built-in callback `swa`: Lightning's StochasticWeightAveraging. From epoch swa_start to the last
// epoch it averages the weights captured at the end of each epoch (the plain mean, as
// AveragedModel's default averaging does), and anneals every parameter group's learning rate to
// its swa_lr over annealing_epochs (SWALR's cos / linear rule, epoch by epoch; during those epochs
// it overrides whatever another scheduler set, as Lightning replaces the schedulers). When
// training ends, the average is copied into the model.
//
// BatchNorm: Lightning recomputes the running statistics of the averaged model with an extra
// forward pass over the training loader. A callback here cannot reach the loader or call the
// model's forward, so a model with running statistics (BatchNorm, InstanceNorm with
// track_running_stats) is refused at fit start with an error saying so, never averaged with stale
// statistics.
#include <fulgur/plugin.h>

#include "../common/callback_conventions.h"
#include "../common/model_weights.h"

#include <fmt/format.h>
#include <torch/optim/optimizer.h>

#include <cmath>
#include <numbers>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace {

namespace support = fulgur::callback_conventions;
namespace weights = fulgur::model_weights;
using fulgur::Error;
using fulgur::ErrorKind;

constexpr char kOwner[] = "callback 'swa'";

class Swa final : public fulgur::CallbackBase<Swa> {
 public:
  FULGUR_OPTIONS(Options,
                 (float_list, swa_lrs, "SWA learning rate, one value for all parameter groups or one per group"),
                 (floating, swa_epoch_start,
                  "Epoch SWA starts at: an integer (1-based epoch) or a fraction of max_epochs", 0.8),
                 (integer, annealing_epochs, "Epochs over which the lr anneals to swa_lrs", 10),
                 (string, annealing_strategy, "\"cos\" or \"linear\" annealing", "cos"),
                 (string, device, "Where the average lives: \"cpu\" or \"\" (the model's device)", "cpu"));

  explicit Swa(const Options& options)
      : swa_lrs_(options.swa_lrs),
        annealing_epochs_(options.annealing_epochs),
        cosine_(parse_strategy(options)),
        device_(options.device) {
    if (swa_lrs_.empty())
      throw Error(ErrorKind::config, fmt::format("{}: swa_lrs is empty; give one learning rate for every parameter "
                                                 "group, or one for all, e.g. swa_lrs = [0.01]",
                                                 kOwner));
    for (double lr : swa_lrs_)
      if (!(lr > 0.0) || !std::isfinite(lr))
        throw Error(ErrorKind::config, fmt::format("{}: swa_lrs holds {}; every SWA learning rate must be a positive "
                                                   "number",
                                                   kOwner, lr));
    // An integer and a float mean different things here: the value as given keeps which it was.
    const fulgur::OptionValue& start = options.given().values().at("swa_epoch_start");
    if (const auto* epoch = std::get_if<int64_t>(&start)) {
      if (*epoch < 1)
        throw Error(ErrorKind::config,
                    fmt::format("{}: swa_epoch_start = {}: an integer is the 1-based epoch SWA starts at and must be "
                                ">= 1; or give a fraction of max_epochs in [0, 1] such as 0.8",
                                kOwner, *epoch));
      start_epoch_ = *epoch;
    } else {
      const double fraction = std::get<double>(start);
      if (!(fraction >= 0.0 && fraction <= 1.0))
        throw Error(ErrorKind::config, fmt::format("{}: swa_epoch_start = {}: a float is a fraction of max_epochs and "
                                                   "must lie in [0, 1]; write an integer (e.g. 3) for an epoch",
                                                   kOwner, fraction));
      start_fraction_ = fraction;
    }
    options.check(annealing_epochs_ >= 0, "annealing_epochs", "must be >= 0");
    if (!device_.empty()) {
      try {
        (void)c10::Device(device_);
      } catch (const std::exception&) {
        options.reject("device", "is not a device; use \"cpu\", \"cuda:0\" or \"\" (where the model is)");
      }
    }
  }

  void on_fit_start(fulgur::TrainerContext& trainer) override {
    const int64_t max_epochs = trainer.max_epochs();
    if (max_epochs < 1)
      throw Error(ErrorKind::config, fmt::format("{}: SWA averages up to the last epoch, so it needs [trainer] "
                                                 "max_epochs; this run has max_epochs = {}",
                                                 kOwner, max_epochs));
    const std::string stats = weights::running_stats_buffer(trainer.model());
    if (!stats.empty())
      throw Error(ErrorKind::config,
                  fmt::format("{}: the model tracks running statistics ('{}': BatchNorm or similar). Averaged weights "
                              "need those statistics recomputed with a pass over the training data, which a callback "
                              "cannot run here; remove the callback, use the `ema` callback (it averages buffers "
                              "too), or use normalization without running statistics (LayerNorm, GroupNorm)",
                              kOwner, stats));
    auto optimizers = trainer.optimizers();
    if (optimizers.size() != 1)
      throw Error(ErrorKind::config, fmt::format("{}: SWA works with one optimizer (as in Lightning); "
                                                 "configure_optimizers() returned {}",
                                                 kOwner, optimizers.size()));
    const size_t groups = optimizers.front()->param_groups().size();
    if (swa_lrs_.size() != 1 && swa_lrs_.size() != groups)
      throw Error(ErrorKind::config, fmt::format("{}: swa_lrs has {} values but the optimizer has {} parameter "
                                                 "groups; give one value, or one per group",
                                                 kOwner, swa_lrs_.size(), groups));
    // Lightning: a fraction becomes int(max_epochs * fraction); swa_start is 0-based.
    const int64_t one_based =
        start_fraction_ ? static_cast<int64_t>(static_cast<double>(max_epochs) * *start_fraction_) : start_epoch_;
    swa_start_ = std::max<int64_t>(one_based - 1, 0);
    swa_end_ = max_epochs - 1;
    if (swa_start_ > swa_end_)
      throw Error(ErrorKind::config, fmt::format("{}: swa_epoch_start puts the start at epoch {} (0-based), after the "
                                                 "last epoch {} (max_epochs = {}): nothing would be averaged",
                                                 kOwner, swa_start_, swa_end_, max_epochs));
    average_.init(trainer.model(), /*with_buffers=*/false, device_);
    latest_update_epoch_ = -1;
    initial_lrs_.clear();
    if (pending_) {
      if (support::get_optional_int(kOwner, *pending_, "n_averaged").value_or(0) > 0)
        average_.from_state(kOwner, *pending_);
      latest_update_epoch_ = support::get_optional_int(kOwner, *pending_, "latest_update_epoch").value_or(-1);
      if (auto lrs = support::find_value(*pending_, "initial_lrs"); lrs && lrs->isDoubleList())
        initial_lrs_ = lrs->toDoubleVector();
      pending_.reset();
    }
  }

  void on_train_epoch_start(fulgur::TrainerContext& trainer) override {
    if (trainer.current_epoch() < swa_start_) return;
    auto& groups = trainer.optimizers().front()->param_groups();
    if (initial_lrs_.size() != groups.size()) {
      initial_lrs_.clear();
      for (auto& group : groups) initial_lrs_.push_back(group.options().get_lr());
    }
    apply_lrs(trainer);
  }

  // A step-interval scheduler of the Module's would move the rate within the epoch: SWALR
  // replaces it in Lightning, so the SWA rate is put back before every step.
  void on_before_optimizer_step(fulgur::TrainerContext& trainer, torch::optim::Optimizer&) override {
    if (trainer.current_epoch() >= swa_start_ && !initial_lrs_.empty()) apply_lrs(trainer);
  }

  // The epoch's weights are final after its last optimizer step: captured there, before the
  // epoch-end validation and the checkpoints it triggers, so a checkpoint written at the end of an
  // epoch holds that epoch in the average (a resumed run does not lose it).
  void on_train_batch_end(fulgur::TrainerContext& trainer, const fulgur::StepOutput&, const fulgur::Batch&,
                          int64_t) override {
    if (trainer.is_last_batch()) capture(trainer);
  }

  // An epoch that ended early (max_steps, a requested stop) is captured here.
  void on_train_epoch_end(fulgur::TrainerContext& trainer) override { capture(trainer); }

  void capture(fulgur::TrainerContext& trainer) {
    const int64_t epoch = trainer.current_epoch();
    if (epoch < swa_start_ || epoch > swa_end_ || epoch == latest_update_epoch_) return;
    average_.update([](int64_t n) { return 1.0 / static_cast<double>(n + 1); });
    latest_update_epoch_ = epoch;
  }

  void on_train_end(fulgur::TrainerContext&) override {
    if (average_.n_averaged() == 0) {
      fulgur::log::warn(fmt::format(
          "{}: training ended before SWA started (epoch {}); the model keeps its trained weights", kOwner, swa_start_));
      return;
    }
    average_.copy_to_model();
    fulgur::log::info(fmt::format("{}: the model now holds the average of the weights of {} epoch(s), from epoch {}",
                                  kOwner, average_.n_averaged(), swa_start_));
  }

  std::string state_key() const override { return "StochasticWeightAveraging"; }
  void state_dict(c10::IValue& out) const override {
    auto state = average_.initialized() ? average_.to_state() : support::new_state_dict();
    if (!average_.initialized()) state.insert("n_averaged", int64_t{0});
    state.insert("latest_update_epoch", latest_update_epoch_);
    state.insert("initial_lrs", c10::List<double>(initial_lrs_));
    out = c10::IValue(state);
  }
  void load_state_dict(const c10::IValue& state) override {
    // Restored before on_fit_start, when the model's tensors are not known yet: kept until then.
    pending_ = support::expect_dict(kOwner, state);
  }

 private:
  static bool parse_strategy(const Options& options) {
    if (options.annealing_strategy == "cos") return true;
    if (options.annealing_strategy == "linear") return false;
    options.reject("annealing_strategy", "is not understood; use \"cos\" or \"linear\"");
  }

  // SWALR: lr = swa_lr * alpha + initial_lr * (1 - alpha), alpha = anneal(min(1, k / annealing_epochs))
  // after k epochs of SWA (alpha = 1 from the start when annealing_epochs = 0).
  void apply_lrs(fulgur::TrainerContext& trainer) {
    const int64_t k = trainer.current_epoch() - swa_start_;
    double t =
        annealing_epochs_ == 0 ? 1.0 : std::min(1.0, static_cast<double>(k) / static_cast<double>(annealing_epochs_));
    const double alpha = cosine_ ? (1.0 - std::cos(std::numbers::pi * t)) / 2.0 : t;
    auto& groups = trainer.optimizers().front()->param_groups();
    for (size_t g = 0; g < groups.size() && g < initial_lrs_.size(); ++g) {
      const double swa_lr = swa_lrs_.size() == 1 ? swa_lrs_.front() : swa_lrs_[g];
      groups[g].options().set_lr(swa_lr * alpha + initial_lrs_[g] * (1.0 - alpha));
    }
  }

  std::vector<double> swa_lrs_;
  int64_t start_epoch_ = 0;
  std::optional<double> start_fraction_;
  int64_t annealing_epochs_;
  bool cosine_;
  std::string device_;
  int64_t swa_start_ = 0;
  int64_t swa_end_ = 0;
  std::vector<double> initial_lrs_;
  weights::AveragedWeights average_;
  int64_t latest_update_epoch_ = -1;
  std::optional<c10::impl::GenericDict> pending_;
};

}  // namespace

FULGUR_PLUGIN(Swa, "swa", "0.1.0",
              "Stochastic Weight Averaging (Lightning's StochasticWeightAveraging): the mean of the weights of the "
              "last epochs, with SWALR learning-rate annealing; refuses models with BatchNorm statistics")
