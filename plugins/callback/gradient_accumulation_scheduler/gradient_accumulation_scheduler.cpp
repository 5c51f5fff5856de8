// Built-in callback `gradient_accumulation_scheduler` (Lightning's GradientAccumulationScheduler):
// the number of batches per optimizer step changes with the epoch. `scheduling` lists
// "EPOCH:FACTOR" entries: from epoch EPOCH (0-based) on, FACTOR batches make one step; epochs
// before the first entry accumulate 1. The factor is set through the TrainerContext at the start
// of every training epoch (so a resumed run gets its epoch's factor too) and the run's own value
// is restored when fit ends. Like Lightning, it needs [trainer] accumulate_grad_batches = 1 and
// automatic optimization.
#include <fulgur/plugin.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <charconv>
#include <map>
#include <string>
#include <vector>

namespace {

using fulgur::Error;
using fulgur::ErrorKind;

constexpr char kOwner[] = "callback 'gradient_accumulation_scheduler'";

std::map<int64_t, int64_t> parse_scheduling(const std::vector<std::string>& entries) {
  if (entries.empty())
    throw Error(
        ErrorKind::config,
        fmt::format("{}: scheduling is empty; give entries such as scheduling = [\"0:8\", \"4:4\", \"8:1\"]", kOwner));
  std::map<int64_t, int64_t> out;
  for (const std::string& text : entries) {
    const size_t colon = text.find(':');
    int64_t epoch = -1, factor = 0;
    bool ok = colon != std::string::npos && colon > 0 && colon + 1 < text.size();
    if (ok) {
      auto [p1, e1] = std::from_chars(text.data(), text.data() + colon, epoch);
      auto [p2, e2] = std::from_chars(text.data() + colon + 1, text.data() + text.size(), factor);
      ok = e1 == std::errc() && p1 == text.data() + colon && e2 == std::errc() && p2 == text.data() + text.size() &&
           epoch >= 0 && factor >= 1;
    }
    if (!ok)
      throw Error(ErrorKind::config, fmt::format("{}: scheduling entry \"{}\" is not EPOCH:FACTOR with EPOCH >= 0 and "
                                                 "FACTOR >= 1, e.g. \"4:2\" (accumulate 2 batches from epoch 4 on)",
                                                 kOwner, text));
    if (!out.emplace(epoch, factor).second)
      throw Error(ErrorKind::config, fmt::format("{}: epoch {} appears twice in scheduling", kOwner, epoch));
  }
  return out;
}

class GradientAccumulationScheduler final : public fulgur::CallbackBase<GradientAccumulationScheduler> {
 public:
  FULGUR_OPTIONS(Options, (string_list, scheduling,
                           "Entries \"EPOCH:FACTOR\": from epoch EPOCH (0-based) on, FACTOR batches per "
                           "optimizer step; 1 before the first entry"));
  explicit GradientAccumulationScheduler(const Options& options) : scheduling_(parse_scheduling(options.scheduling)) {}

  void on_fit_start(fulgur::TrainerContext& trainer) override {
    original_ = trainer.accumulate_grad_batches();
    if (original_ != 1)
      throw Error(ErrorKind::config,
                  fmt::format("{}: [trainer] accumulate_grad_batches = {}; the scheduler sets the factor itself, so "
                              "leave accumulate_grad_batches at 1 (Lightning refuses both together too)",
                              kOwner, original_));
  }

  void on_train_epoch_start(fulgur::TrainerContext& trainer) override {
    trainer.set_accumulate_grad_batches(factor_for(trainer.current_epoch()));
  }

  void on_fit_end(fulgur::TrainerContext& trainer) override { trainer.set_accumulate_grad_batches(original_); }

  // The factor of `epoch`: that of the latest entry at or before it, else 1.
  int64_t factor_for(int64_t epoch) const {
    auto it = scheduling_.upper_bound(epoch);
    return it == scheduling_.begin() ? 1 : std::prev(it)->second;
  }

 private:
  std::map<int64_t, int64_t> scheduling_;
  int64_t original_ = 1;
};

}  // namespace

FULGUR_PLUGIN(GradientAccumulationScheduler, "gradient_accumulation_scheduler", "0.1.0",
              "Changes accumulate_grad_batches by epoch (Lightning's GradientAccumulationScheduler)")
