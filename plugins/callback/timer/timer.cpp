// Built-in callback `timer`: Lightning's Timer. Stops training once the fit has run for
// `duration` ("DD:HH:MM:SS", fewer fields counting from the right, or plain seconds), checked after
// every training batch or every epoch. The time spent in each stage is kept, and the training
// time so far travels in the checkpoint (callbacks["Timer"]["time_elapsed"]), so a resumed run
// stops at the same total. [trainer] max_time is this callback too, as in Lightning: a non-empty
// max_time adds it with duration = max_time (TRAINER_SHORTHAND in plugins/CMakeLists.txt).
#include <fulgur/plugin.h>

#include <fmt/format.h>

#include <array>
#include <chrono>
#include <optional>
#include <string>

#include "../common/callback_conventions.h"

namespace {

namespace support = fulgur::callback_conventions;
using fulgur::Stage;
using Clock = std::chrono::steady_clock;

constexpr char kOwner[] = "callback 'timer'";
constexpr std::array<Stage, 4> kStages = {Stage::fit, Stage::validate, Stage::test, Stage::predict};

// "DD:HH:MM:SS" (or "HH:MM:SS", "MM:SS") or a number of seconds ("3600", "90.5"), in seconds.
// "00:00:00:00" stops after the first batch, as Lightning's Trainer(max_time="00:00:00:00") does; a
// plain 0 is refused: it reads as "no limit" in many tools.
// `options` words the errors.
double duration_seconds(const fulgur::PluginOptions& options, const std::string& text) {
  const std::optional<double> seconds = fulgur::parse_duration(text);
  if (!seconds)
    options.reject("duration",
                   "is not understood; write \"DD:HH:MM:SS\" (e.g. \"00:12:00:00\" for twelve hours) or seconds "
                   "(e.g. \"3600\")");
  options.check(*seconds != 0 || text.find(':') != std::string::npos, "duration",
                "is ambiguous: a plain 0 means \"no limit\" in many tools; leave the limit out for none, or write "
                "\"00:00:00:00\" (DD:HH:MM:SS) to stop after the first batch");
  return *seconds;
}

// Python's str(timedelta) for whole seconds: "0:05:03", "1 day, 2:00:00".
std::string timedelta_text(double seconds) {
  auto s = static_cast<int64_t>(seconds);
  const int64_t days = s / 86400;
  s %= 86400;
  std::string hms = fmt::format("{}:{:02}:{:02}", s / 3600, (s / 60) % 60, s % 60);
  if (days == 0) return hms;
  return fmt::format("{} day{}, {}", days, days == 1 ? "" : "s", hms);
}

class Timer final : public fulgur::Callback {
 public:
  FULGUR_OPTIONS(Options,
                 (string, duration,
                  "Training time limit: \"DD:HH:MM:SS\" (e.g. \"00:12:00:00\") or seconds "
                  "(\"3600\")"),
                 (string, interval, "Check after every training \"step\" or every \"epoch\"", "step"),
                 (boolean, verbose, "Log the reason when the limit stops training", true));
  explicit Timer(const Options& options)
      : duration_(duration_seconds(options, options.duration)), interval_(options.interval), verbose_(options.verbose) {
    options.check(interval_ == "step" || interval_ == "epoch", "interval",
                  "is not understood; use \"step\" or \"epoch\"");
  }

  fulgur::HookSet hooks() const override {
    using fulgur::Hook;
    return Hook::train_start | Hook::train_end | Hook::validation_start | Hook::validation_end | Hook::test_start |
           Hook::test_end | Hook::predict_start | Hook::predict_end | Hook::train_batch_end | Hook::train_epoch_end;
  }

  void on_train_start(fulgur::TrainerContext&) override { begin(Stage::fit); }
  void on_train_end(fulgur::TrainerContext&) override { finish(Stage::fit); }
  // Validation inside fit is part of the training time (Lightning counts it there too).
  void on_validation_start(fulgur::TrainerContext& t) override {
    if (t.stage() != Stage::fit) begin(Stage::validate);
  }
  void on_validation_end(fulgur::TrainerContext& t) override {
    if (t.stage() != Stage::fit) finish(Stage::validate);
  }
  void on_test_start(fulgur::TrainerContext&) override { begin(Stage::test); }
  void on_test_end(fulgur::TrainerContext&) override { finish(Stage::test); }
  void on_predict_start(fulgur::TrainerContext&) override { begin(Stage::predict); }
  void on_predict_end(fulgur::TrainerContext&) override { finish(Stage::predict); }

  void on_train_batch_end(fulgur::TrainerContext& trainer, const fulgur::StepOutput&, const fulgur::Batch&,
                          int64_t) override {
    if (interval_ == "step") check(trainer);
  }
  void on_train_epoch_end(fulgur::TrainerContext& trainer) override {
    if (interval_ == "epoch") check(trainer);
  }

  // Seconds spent in `stage` (the fit includes the time before a resume).
  double time_elapsed(Stage stage) const {
    const Span& span = spans_[index(stage)];
    double elapsed = stage == Stage::fit ? offset_ : 0.0;
    if (span.start) elapsed += std::chrono::duration<double>(span.end.value_or(Clock::now()) - *span.start).count();
    return elapsed;
  }

  std::string state_key() const override { return "Timer"; }

  void state_dict(c10::IValue& out) const override {
    auto elapsed = support::new_state_dict();
    for (Stage stage : kStages) elapsed.insert(fulgur::to_string(stage), time_elapsed(stage));
    auto state = support::new_state_dict();
    state.insert("time_elapsed", elapsed);
    out = c10::IValue(state);
  }

  void load_state_dict(const c10::IValue& state) override {
    const auto dict = support::expect_dict(kOwner, state);
    auto elapsed = support::find_value(dict, "time_elapsed");
    if (!elapsed) return;
    const auto stages = support::expect_dict(kOwner, *elapsed);
    offset_ = support::get_optional_double(kOwner, stages, "fit").value_or(0.0);
  }

 private:
  struct Span {
    std::optional<Clock::time_point> start, end;
  };

  static size_t index(Stage stage) {
    for (size_t i = 0; i < kStages.size(); ++i)
      if (kStages[i] == stage) return i;
    return 0;
  }
  void begin(Stage stage) { spans_[index(stage)] = Span{Clock::now(), std::nullopt}; }
  void finish(Stage stage) { spans_[index(stage)].end = Clock::now(); }

  void check(fulgur::TrainerContext& trainer) {
    if (trainer.stage() != Stage::fit || trainer.sanity_checking()) return;
    bool stop = time_elapsed(Stage::fit) >= duration_;
    // Every process must leave the loop on the same step; one collective only when there are several.
    stop = trainer.agree(stop, /*all=*/false);
    if (!stop || trainer.should_stop()) return;
    trainer.request_stop(verbose_ ? fmt::format("Time limit reached. Elapsed time is {}. Signaling Trainer to stop.",
                                                timedelta_text(time_elapsed(Stage::fit)))
                                  : std::string());
  }

  double duration_;
  std::string interval_;
  bool verbose_;
  std::array<Span, kStages.size()> spans_{};
  double offset_ = 0;  // training seconds before a resume
};

}  // namespace

FULGUR_PLUGIN(Timer, "timer", "0.1.0", "Stops training after a time limit, kept across resume (Lightning's Timer)")
