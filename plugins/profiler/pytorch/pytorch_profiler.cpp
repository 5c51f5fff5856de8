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

void check_count(const fulgur::Options& options, const char* key, int64_t minimum) {
  const int64_t value = options.get_int(key);
  if (value < minimum)
    throw Error(ErrorKind::config, fmt::format("{}: {} = {} must be >= {}", kOwner, key, value, minimum));
}

class PyTorchProfiler final : public fulgur::Profiler {
 public:
  explicit PyTorchProfiler(const fulgur::Options& options)
      : dirpath_(options.get_string("dirpath")),
        filename_(options.get_string("filename")),
        wait_(options.get_int("wait")),
        warmup_(options.get_int("warmup")),
        active_(options.get_int("active")),
        repeat_(options.get_int("repeat")),
        row_limit_(options.get_int("row_limit")),
        config_(impl::ProfilerState::KINETO, options.get_bool("record_shapes"), options.get_bool("profile_memory"),
                options.get_bool("with_stack"), options.get_bool("with_flops")) {
    check_count(options, "wait", 0);
    check_count(options, "warmup", 0);
    check_count(options, "active", 1);
    check_count(options, "repeat", 0);
    if (filename_.empty() || filename_.find('/') != std::string::npos)
      throw Error(ErrorKind::config, fmt::format("{}: filename = \"{}\" must be a plain file stem such as "
                                                 "\"profile\"",
                                                 kOwner, filename_));
    activities_.insert(impl::ActivityType::CPU);
    for (const std::string& name : options.get_string_list("activities")) {
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
    if (options.get_string_list("activities").empty() && at::hasCUDA()) activities_.insert(impl::ActivityType::CUDA);
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
              "table of the top operators",
              FULGUR_OPTION(string, dirpath, "Directory of traces and report; empty means the run's log_dir", ""),
              FULGUR_OPTION(string, filename, "File stem: <stage>-<filename>.<cycle>.pt.trace.json and .txt",
                            "profile"),
              FULGUR_OPTION(integer, wait, "Steps per cycle with the profiler off", 1),
              FULGUR_OPTION(integer, warmup, "Steps per cycle of warm-up (prepared, not recorded)", 1),
              FULGUR_OPTION(integer, active, "Steps per cycle that are recorded", 3),
              FULGUR_OPTION(integer, repeat, "Cycles to run; 0 repeats until the stage ends", 1),
              FULGUR_OPTION(string_list, activities, "\"cpu\", \"cuda\"; empty: cpu, plus cuda when a GPU is present",
                            []),
              FULGUR_OPTION(boolean, record_shapes, "Record operator input shapes", false),
              FULGUR_OPTION(boolean, profile_memory, "Record tensor allocations and frees", false),
              FULGUR_OPTION(boolean, with_stack, "Record source locations (C++ stacks where available)", false),
              FULGUR_OPTION(boolean, with_flops, "Estimate FLOPs of matrix multiplications and convolutions", false),
              FULGUR_OPTION(integer, row_limit, "Rows in the summary table (0: all)", 20))
