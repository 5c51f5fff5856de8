// Built-in profiler `pytorch`: LibTorch's own profiler (kineto) around the run, on a schedule like
// torch.profiler.schedule: per cycle, `wait` steps off, `warmup` steps prepared (kineto warms up,
// nothing kept), `active` steps recorded; `repeat` cycles (0: until the stage ends). A step is one
// training batch in fit, one validation/test/predict step in the other stages.
//
// The Trainer's actions ("run_training_batch", "training_step", "backward", "optimizer_step",
// "train_dataloader_next", ...) become RecordFunction user scopes, so they sit in the trace next
// to the ATen ops they ran. Each recorded cycle is written as a Chrome trace
// (<dir>/<stage>-<filename>.<cycle>.pt.trace.json: Perfetto, chrome://tracing and TensorBoard's
// profile plugin open it); at teardown a table of the top operators by self CPU time goes to the
// log and to <dir>/<stage>-<filename>.txt.
#include <fulgur/checkpoint_io.h>
#include <fulgur/plugin.h>

#include <ATen/Context.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <fmt/format.h>

#include <array>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <system_error>

#include <fcntl.h>
#include <unistd.h>

#include "../../common/writable_directory.h"
#include "op_table.h"

namespace {

namespace fs = std::filesystem;
namespace kineto = torch::autograd::profiler;
namespace impl = torch::profiler::impl;
using fulgur::Error;
using fulgur::ErrorKind;
using fulgur::Stage;

constexpr char kOwner[] = "profiler 'pytorch'";
// Deeper nesting than the Trainer ever produces; deeper actions are not recorded, not an error.
constexpr size_t kMaxDepth = 32;

enum class Phase { off, warmup, record };

// The action whose end closes one step of the schedule, per stage.
std::string_view step_action(Stage stage) {
  switch (stage) {
    case Stage::fit:
      return "run_training_batch";
    case Stage::test:
      return "test_step";
    case Stage::predict:
      return "predict_step";
    default:
      return "validation_step";
  }
}

class PyTorchProfiler final : public fulgur::Profiler {
 public:
  FULGUR_OPTIONS(Options, (string, dirpath, "Directory of traces and report; empty means the run's log_dir", ""),
                 (string, filename, "File stem: <stage>-<filename>.<cycle>.pt.trace.json and .txt", "profile"),
                 (integer, wait, "Steps per cycle with the profiler off", 1),
                 (integer, warmup, "Steps per cycle of warm-up (prepared, not recorded)", 1),
                 (integer, active, "Steps per cycle that are recorded", 3),
                 (integer, repeat, "Cycles to run; 0 repeats until the stage ends", 1),
                 (string_list, activities, "\"cpu\", \"cuda\"; empty: cpu, plus cuda when a GPU is present", []),
                 (boolean, record_shapes, "Record operator input shapes", false),
                 (boolean, profile_memory, "Record tensor allocations and frees", false),
                 (boolean, with_stack, "Record source locations (C++ stacks where available)", false),
                 (boolean, with_flops, "Estimate FLOPs of matrix multiplications and convolutions", false),
                 (integer, row_limit, "Rows in the summary table (0: all)", 20));
  explicit PyTorchProfiler(const Options& options)
      : dirpath_(options.dirpath),
        filename_(options.filename),
        wait_(options.wait),
        warmup_(options.warmup),
        active_(options.active),
        repeat_(options.repeat),
        row_limit_(options.row_limit),
        config_(impl::ProfilerState::KINETO, options.record_shapes, options.profile_memory, options.with_stack,
                options.with_flops) {
    options.check(wait_ >= 0, "wait", "must be >= 0");
    options.check(warmup_ >= 0, "warmup", "must be >= 0");
    options.check(active_ >= 1, "active", "must be >= 1");
    options.check(repeat_ >= 0, "repeat", "must be >= 0");
    options.check(!filename_.empty() && filename_.find('/') == std::string::npos, "filename",
                  "must be a plain file stem such as \"profile\"");
    activities_.insert(impl::ActivityType::CPU);
    for (const std::string& name : options.activities) {
      std::string lower;
      for (char c : name) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      if (lower == "cuda")
        activities_.insert(impl::ActivityType::CUDA);
      else if (lower != "cpu")
        throw Error(ErrorKind::config,
                    fmt::format("{}: activities holds \"{}\"; use \"cpu\" and/or \"cuda\" (empty: cpu, plus cuda "
                                "when a GPU is present)",
                                kOwner, name));
    }
    if (options.activities.empty() && at::hasCUDA()) activities_.insert(impl::ActivityType::CUDA);
  }

  ~PyTorchProfiler() override {
    try {
      stop_profiler(/*keep=*/false);
    } catch (const std::exception& e) {
      fulgur::log::error(fmt::format("{}: {}", kOwner, e.what()));
    }
  }

  void setup(Stage stage, const std::string& log_dir, int64_t global_rank) override {
    stop_profiler(/*keep=*/false);  // a previous stage that ended without teardown
    rank_suffix_ = global_rank > 0 ? fmt::format("-rank{}", global_rank) : "";
    ready_ = false;
    stage_ = stage;
    step_action_ = step_action(stage);
    dir_ = !dirpath_.empty() ? dirpath_ : !log_dir.empty() ? log_dir : ".";
    fulgur::filesystem_checks::ensure_writable_directory(kOwner, dir_, "the trace directory", "dirpath");
    steps_ = 0;
    cycle_ = 0;
    cycles_written_ = 0;
    table_.clear();
    enter(phase_for(0), /*new_cycle=*/false);
    ready_ = true;
  }

  void start(std::string_view action) override {
    if (depth_ < kMaxDepth) {
      std::optional<at::RecordFunction>& scope = scopes_[depth_];
      scope.emplace(at::RecordScope::USER_SCOPE);
      if (scope->isActive()) scope->before(action, c10::ArrayRef<const c10::IValue>{});
    }
    ++depth_;
  }

  void stop(std::string_view action) override {
    if (depth_ == 0) {
      fulgur::log::warn(fmt::format("{}: action '{}' was stopped without having been started", kOwner, action));
      return;
    }
    --depth_;
    if (depth_ < kMaxDepth) scopes_[depth_].reset();  // ends the RecordFunction
    if (action == step_action_) {
      // stop() runs in a destructor (ProfileScope): a failure to write a trace is logged, not thrown.
      try {
        ++steps_;
        const bool cycle_ends = steps_ % cycle_length() == 0;
        enter(phase_for(steps_), cycle_ends);
      } catch (const std::exception& e) {
        fulgur::log::error(fmt::format("{}: {}", kOwner, e.what()));
      }
    }
  }

  std::string summary() const override {
    if (table_.empty())
      return fmt::format(
          "{}: nothing was recorded in {} ({} step(s) ran; the schedule records steps {}..{} of each "
          "cycle)\n",
          kOwner, stage_ ? fulgur::to_string(*stage_) : "this stage", steps_, wait_ + warmup_ + 1, cycle_length());
    return table_.render(fmt::format("PyTorch profiler: top operators by self CPU time ({}, {} recorded cycle(s))",
                                     stage_ ? fulgur::to_string(*stage_) : "", cycles_written_),
                         row_limit_);
  }

  void teardown(Stage stage) override {
    // After a failed setup there is nothing to report, and the setup's error is the one to see.
    if (!ready_) return;
    ready_ = false;
    stop_profiler(/*keep=*/true);  // a cycle cut short by the end of the stage is still written
    stage_ = stage;
    const std::string report = summary();
    fulgur::log::info(report);
    const std::string path =
        (fs::path(dir_) / fmt::format("{}-{}{}.txt", fulgur::to_string(stage), filename_, rank_suffix_)).string();
    fulgur::atomic_write_text(path, report);
  }

 private:
  int64_t cycle_length() const { return wait_ + warmup_ + active_; }

  Phase phase_for(int64_t step) const {
    if (repeat_ > 0 && step / cycle_length() >= repeat_) return Phase::off;
    const int64_t at = step % cycle_length();
    return at < wait_ ? Phase::off : at < wait_ + warmup_ ? Phase::warmup : Phase::record;
  }

  // Moves the profiler to `phase` at a step boundary; `new_cycle`: the previous step closed a cycle.
  void enter(Phase phase, bool new_cycle) {
    if (phase_ == Phase::record && (phase != Phase::record || new_cycle)) stop_profiler(/*keep=*/true);
    if (new_cycle) ++cycle_;
    if (phase != Phase::off && !prepared_) {
      kineto::prepareProfiler(config_, activities_);
      prepared_ = true;
    }
    if (phase == Phase::record && !recording_) {
      kineto::enableProfiler(config_, activities_);
      recording_ = true;
    }
    phase_ = phase;
  }

  // Ends a warm-up or recording; a recording is kept (trace file + summary) when `keep`.
  void stop_profiler(bool keep) {
    if (!prepared_ && !recording_) return;
    // A prepared-only profiler still holds kineto's warm-up state: start and stop it to release it.
    if (!recording_) kineto::enableProfiler(config_, activities_);
    std::unique_ptr<kineto::ProfilerResult> result = kineto::disableProfiler();
    const bool was_recording = recording_;
    prepared_ = recording_ = false;
    phase_ = Phase::off;
    if (!keep || !was_recording || !result) return;
    table_.add(result->events());
    const std::string path = (fs::path(dir_) / fmt::format("{}-{}{}.{}.pt.trace.json", fulgur::to_string(*stage_),
                                                           filename_, rank_suffix_, cycle_))
                                 .string();
    try {
      result->save(path);
    } catch (const std::exception& e) {
      throw Error(ErrorKind::io, fmt::format("{}: writing the trace '{}' failed: {}", kOwner, path, e.what()));
    }
    ++cycles_written_;
    fulgur::log::info(fmt::format("{}: trace of {} step(s) written to {}", kOwner, active_, path));
  }

  // Fails at setup, not after the first recorded cycle, when the traces could not be written.
  // Options.
  std::string dirpath_;
  std::string filename_;
  std::string rank_suffix_;
  int64_t wait_, warmup_, active_, repeat_, row_limit_;
  impl::ProfilerConfig config_;
  std::set<impl::ActivityType> activities_;

  // State.
  std::optional<Stage> stage_;
  std::string_view step_action_;
  std::string dir_;
  std::array<std::optional<at::RecordFunction>, kMaxDepth> scopes_;
  size_t depth_ = 0;
  int64_t steps_ = 0, cycle_ = 0, cycles_written_ = 0;
  Phase phase_ = Phase::off;
  bool prepared_ = false, recording_ = false;
  bool ready_ = false;  // setup() succeeded for the current stage
  fulgur::pytorch_profiler::OpTable table_;
};

}  // namespace

FULGUR_PLUGIN(PyTorchProfiler, "pytorch", "0.1.0",
              "LibTorch's profiler (kineto): Chrome traces with the Trainer's actions next to the ATen ops, and a "
              "table of the top operators")
