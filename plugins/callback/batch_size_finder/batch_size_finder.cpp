// Built-in callback `batch_size_finder`: Lightning's BatchSizeFinder. At the start of fit, before
// the loaders exist, it tries training batch sizes from init_val upwards (power: doubling until one
// does not fit; binsearch: then bisecting between the last that fit and the first that did not),
// each trial being steps_per_trial real training steps that the Trainer undoes afterwards
// (TrainerContext::run_batch_size_trial). The fit then trains with the largest size that fit.
//
// "Fits" means: on CUDA, no c10::OutOfMemoryError from the caching allocator (Lightning's test);
// on CPU, where running out of memory kills the process instead of raising, a peak of tensor
// memory within max_memory_mb, counted through c10's CPU allocator (trial_memory.h). Every trial
// goes to batch_size_finder.csv in the log directory; the result is kept in checkpoints, so a
// resumed run trains with the same size without searching again.
//
// What differs from Lightning: the size is the DataModule's (DataModule::batch_size() /
// set_batch_size), so there is no batch_arg_name; one process only (a rank out of memory would
// leave the others in the gradient all-reduce: Lightning refuses distributed runs too).
#include <fulgur/plugin.h>

#include "../common/callback_conventions.h"
#include "batch_size_search.h"
#include "trial_memory.h"

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

namespace {

namespace support = fulgur::callback_conventions;
namespace bsf = fulgur::batch_size_finder;
using fulgur::Error;
using fulgur::ErrorKind;

constexpr char kOwner[] = "callback 'batch_size_finder'";

bsf::SearchMode parse_mode(const fulgur::PluginOptions& o, const std::string& mode) {
  if (mode == "power") return bsf::SearchMode::power;
  if (mode == "binsearch") return bsf::SearchMode::binsearch;
  o.reject("mode",
           "is not understood; use \"power\" (double until a size does not fit) or \"binsearch\" (then bisect "
           "towards the largest that fits)");
}

int64_t positive(const fulgur::PluginOptions& o, const char* key, int64_t value) {
  o.check(value >= 1, key, "must be >= 1");
  return value;
}

struct TrialRecord {
  int64_t batch_size;
  bsf::TrialOutcome outcome;
  int64_t batches_run;
};

class BatchSizeFinder final : public fulgur::CallbackBase<BatchSizeFinder> {
 public:
  FULGUR_OPTIONS(Options,
                 (string, mode, "\"power\" (double until a size does not fit) or \"binsearch\" (then bisect)", "power"),
                 (integer, steps_per_trial, "Training steps run at each size tried", 3),
                 (integer, init_val, "The first batch size tried", 2),
                 (integer, max_trials, "At most this many sizes are tried", 25),
                 (floating, max_memory_mb,
                  "cpu: tensor memory a trial may hold at once, in MiB (required on cpu); "
                  "0 on cuda, where the out-of-memory error decides",
                  0.0));

  explicit BatchSizeFinder(const Options& o)
      : search_options_(bsf::BatchSizeSearchOptions()
                            .mode(parse_mode(o, o.mode))
                            .init_val(positive(o, "init_val", o.init_val))
                            .max_trials(positive(o, "max_trials", o.max_trials))),
        steps_per_trial_(positive(o, "steps_per_trial", o.steps_per_trial)),
        max_memory_bytes_(budget_bytes(o, o.max_memory_mb)) {}

  void on_fit_start(fulgur::TrainerContext& trainer) override {
    if (found_) {  // restored from a checkpoint: that run's search holds
      trainer.set_train_batch_size(*found_);
      fulgur::log::info(fmt::format("{}: batch size {} from the checkpoint (no new search)", kOwner, *found_));
      return;
    }
    if (trainer.train_batch_size() < 0)
      throw Error(ErrorKind::config,
                  fmt::format("{}: the DataModule does not offer its batch size; override "
                              "DataModule::batch_size() and set_batch_size(n), or remove the callback",
                              kOwner));
    const bool on_cpu = trainer.device().is_cpu();
    if (on_cpu && max_memory_bytes_ == 0)
      throw Error(ErrorKind::config,
                  fmt::format("{}: on cpu running out of memory kills the process instead of raising an error, so the "
                              "search needs a budget: set max_memory_mb (tensor memory a trial may hold at once)",
                              kOwner));
    if (!on_cpu && max_memory_bytes_ > 0)
      throw Error(ErrorKind::config,
                  fmt::format("{}: max_memory_mb counts cpu tensor memory, but the model trains on {}; there the "
                              "search stops at the device's out-of-memory error: set max_memory_mb = 0",
                              kOwner, trainer.device().str()));
    const int64_t configured = trainer.train_batch_size();
    bsf::BatchSizeSearch search(search_options_);
    std::vector<TrialRecord> trials;
    while (!search.done()) {
      const int64_t size = search.next();
      fulgur::BatchSizeTrial ran;
      const bsf::TrialOutcome outcome = bsf::run_trial(
          [&] { ran = trainer.run_batch_size_trial(size, steps_per_trial_); }, on_cpu ? max_memory_bytes_ : 0);
      trials.push_back({size, outcome, ran.batches_run});
      fulgur::log::info(fmt::format("{}: batch size {} {}{}", kOwner, size, outcome.fits ? "fits" : "does not fit",
                                    describe(outcome)));
      search.report(outcome.fits, outcome.fits && ran.batches_per_epoch == 1);
    }
    if (trainer.is_global_zero()) write_trials(trainer, trials);
    if (!search.result())
      throw Error(ErrorKind::runtime,
                  fmt::format("{}: no batch size fits, down to {}{}; raise max_memory_mb or shrink the model", kOwner,
                              trials.back().batch_size, describe(trials.back().outcome)));
    found_ = *search.result();
    trainer.set_train_batch_size(*found_);
    fulgur::log::info(
        fmt::format("{}: training with batch size {} (configured {}; {} trials, see batch_size_finder.csv)", kOwner,
                    *found_, configured, trials.size()));
    if (trainer.has_logger())
      trainer.log_metrics({{"batch_size_finder/batch_size", static_cast<double>(*found_)}}, kOwner);
  }

  std::string state_key() const override { return "BatchSizeFinder"; }
  void state_dict(c10::IValue& out) const override {
    auto state = support::new_state_dict();
    state.insert("optimal_batch_size", found_.value_or(-1));
    out = c10::IValue(state);
  }
  void load_state_dict(const c10::IValue& state) override {
    auto dict = support::expect_dict(kOwner, state);
    auto size = support::find_value(dict, "optimal_batch_size");
    if (size && size->isInt() && size->toInt() > 0) found_ = size->toInt();
  }

 private:
  static int64_t budget_bytes(const Options& o, double megabytes) {
    o.check(megabytes >= 0, "max_memory_mb", "must be >= 0 (0: no budget, on cuda)");
    return static_cast<int64_t>(megabytes * 1024.0 * 1024.0);
  }

  std::string describe(const bsf::TrialOutcome& outcome) const {
    if (outcome.out_of_memory) return " (out of memory)";
    if (outcome.peak_bytes)
      return fmt::format(" (peak {:.1f} MiB of {:.1f} MiB)", static_cast<double>(*outcome.peak_bytes) / (1 << 20),
                         static_cast<double>(max_memory_bytes_) / (1 << 20));
    return "";
  }

  void write_trials(fulgur::TrainerContext& trainer, const std::vector<TrialRecord>& trials) const {
    const std::filesystem::path dir = trainer.log_dir();
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    const std::filesystem::path csv = dir / "batch_size_finder.csv";
    std::ofstream out(csv);
    out << "trial,batch_size,fits,out_of_memory,peak_bytes,batches_run\n";
    for (size_t i = 0; i < trials.size(); ++i) {
      const auto& t = trials[i];
      out << fmt::format("{},{},{},{},{},{}\n", i, t.batch_size, t.outcome.fits ? 1 : 0,
                         t.outcome.out_of_memory ? 1 : 0, t.outcome.peak_bytes.value_or(-1), t.batches_run);
    }
    if (!out)
      throw Error(ErrorKind::io,
                  fmt::format("{}: cannot write {}; check that the log directory is writable", kOwner, csv.string()));
  }

  bsf::BatchSizeSearchOptions search_options_;
  int64_t steps_per_trial_;
  int64_t max_memory_bytes_;
  std::optional<int64_t> found_;
};

}  // namespace

FULGUR_PLUGIN(BatchSizeFinder, "batch_size_finder", "0.1.0",
              "Largest training batch size that fits, found before fit trains (Lightning's BatchSizeFinder): "
              "trial steps per size, undone after; writes batch_size_finder.csv")
