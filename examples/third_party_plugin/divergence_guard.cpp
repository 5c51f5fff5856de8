// A third-party Fulgur callback: stops training when a monitored metric becomes NaN or exceeds a
// limit. It reads only epoch-level metrics, so it adds no device sync to the training steps.
#include <fulgur/plugin.h>

namespace {

// CallbackBase<T> reads the hooks from the overrides: the Trainer calls only on_train_epoch_end.
class DivergenceGuard final : public fulgur::CallbackBase<DivergenceGuard> {
 public:
  // The options, declared once: FULGUR_PLUGIN takes their schema, the constructor gets them typed.
  FULGUR_OPTIONS(Options, (string, monitor, "Epoch-level metric to watch", "train_loss"),
                 (floating, limit, "Stop when the metric exceeds this value"));  // no default: required

  explicit DivergenceGuard(const Options& options) : monitor_(options.monitor), limit_(options.limit) {
    if (!(limit_ > 0)) throw fulgur::Error(fulgur::ErrorKind::config, "divergence_guard: limit must be positive");
  }

  void on_train_epoch_end(fulgur::TrainerContext& trainer) override {
    const auto& metrics = trainer.callback_metrics();
    const auto it = metrics.find(monitor_);
    if (it == metrics.end() || it->second <= limit_) return;  // NaN compares false: it stops too
    trainer.request_stop(monitor_ + " = " + std::to_string(it->second) + " is above the limit " +
                         std::to_string(limit_));
  }

 private:
  std::string monitor_;
  double limit_;
};

}  // namespace

// No option list: the schema is DivergenceGuard::Options::schema.
FULGUR_PLUGIN(DivergenceGuard, "divergence_guard", "1.0.0", "Stops training when a metric is NaN or above a limit")
