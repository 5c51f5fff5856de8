/// @file
/// The testing kit for plugin authors: a TrainerContext the test drives by hand, so a callback can
/// be tested without a Trainer, a model or data. Fulgur's own built-in callbacks are tested with
/// exactly this header. Header-only; include it only in tests (it pulls in torch::nn).
#pragma once

#include <fulgur/callback.h>
#include <fulgur/error.h>
#include <fulgur/trainer_context.h>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/optimizer.h>

#include <sys/stat.h>

#include <cerrno>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

/// The testing kit for plugin authors (fulgur/testing.h).
namespace fulgur::testing {

/// One row a callback sent through log_metrics, with the name it gave as owner.
struct LoggedRow {
  MetricMap metrics;  ///< the values sent
  std::string owner;  ///< the `owner` argument
  int64_t step;       ///< the FakeTrainer's global_step when it was sent
};

/// A TrainerContext a test drives by hand: one process, rank zero, collectives that answer for
/// this rank alone. Every answer the context gives is a public field: set it before calling a
/// hook, read what the callback did (saves, stop requests, logged rows, collective decisions)
/// after. Single-threaded, like the Trainer it stands for.
///
/// @code
///   fulgur::testing::FakeTrainer trainer("/tmp/run");
///   trainer.start_fit(callback);
///   trainer.run_epoch(callback, {{"val/loss", 0.5}});
///   CHECK(trainer.saves.size() == 1);
/// @endcode
class FakeTrainer : public TrainerContext {
 public:
  /// `root` is default_root_dir() and log_dir(); saves are written below it when a callback asks.
  /// model() is a small Linear-ReLU-Linear network (4 -> 3 -> 2) on the CPU.
  explicit FakeTrainer(std::string root = {})
      : module(torch::nn::Sequential(torch::nn::Linear(4, 3), torch::nn::ReLU(), torch::nn::Linear(3, 2)).ptr()),
        root_dir(std::move(root)) {}

  // ---- what the context answers (set these) ---------------------------------------------------
  Stage stage_value = Stage::fit;  ///< stage()
  bool sanity = false;             ///< sanity_checking()
  int64_t epoch = 0;               ///< current_epoch(); run_epoch advances it
  int64_t step = 0;                ///< global_step(); run_epoch advances it
  int64_t max_epochs_value = 3;    ///< max_epochs()
  int64_t max_steps_value = -1;    ///< max_steps()
  /// num_batches(stage) by stage; -1 for a stage not listed.
  std::map<Stage, int64_t> batches{{Stage::fit, 5}, {Stage::validate, 2}};
  bool last_batch = false;  ///< is_last_batch()
  int64_t accumulate = 1;   ///< accumulate_grad_batches, as a callback set it
  int64_t batch_size = -1;  ///< train_batch_size(), as a callback set it (-1: none offered)
  /// run_batch_size_trial: the largest size that "fits"; a larger one throws
  /// c10::OutOfMemoryError as CUDA's caching allocator would. Unset: every size fits.
  std::optional<int64_t> trial_size_limit;
  /// run_batch_size_trial's batches per epoch: samples / size, rounded up (-1: unknown).
  int64_t train_samples = -1;
  int64_t loader_index = 0;  ///< dataloader_idx()
  MetricMap metrics;         ///< callback_metrics(); run_epoch replaces it
  MetricMap bar_metrics;     ///< progress_bar_metrics()
  bool logging_due = true;   ///< step_logging_due() (also true once a stop was requested)
  /// has_logger(); when false, log_metrics throws fulgur::Error(config) as the Trainer does.
  bool logger_configured = true;
  ClusterInfo cluster_info;                                      ///< cluster()
  c10::Device device_value{c10::DeviceType::CPU};                ///< device()
  MetricMap device_stats_value;                                  ///< device_stats()
  std::string device_name_value = "cpu";                         ///< device_name()
  c10::ScalarType compute_dtype_value = c10::ScalarType::Float;  ///< compute_dtype()
  std::string root_dir;                                          ///< default_root_dir() and log_dir()
  std::shared_ptr<torch::nn::Module> module;                     ///< model()
  std::vector<torch::optim::Optimizer*> optimizer_list;          ///< optimizers() (not owned)
  /// The "other ranks'" answer to agree(); unset: this rank's own decision.
  std::optional<bool> forced_decision;
  /// save_checkpoint throws fulgur::Error(io) when set (a full disk).
  bool fail_saves = false;

  // ---- what the callback did (read these) ------------------------------------------------------
  std::vector<std::string> stop_reasons;            ///< request_stop reasons, in order
  std::vector<std::pair<std::string, bool>> saves;  ///< save_checkpoint calls: (path, weights_only)
  std::vector<LoggedRow> logged;                    ///< log_metrics rows, in order
  std::vector<std::pair<bool, bool>> decisions;     ///< agree(decision, all) calls
  int broadcasts = 0;                               ///< broadcast calls
  std::vector<int64_t> trials;                      ///< run_batch_size_trial sizes, in order
  int device_syncs = 0;                             ///< synchronize_device calls
  mutable int progress_bar_reads = 0;               ///< progress_bar_metrics calls

  // ---- the fit loop's moments, in Lightning's order --------------------------------------------

  /// Fit begins: stage fit, then the callback's setup(fit) and on_fit_start (called directly,
  /// whatever its hooks() says).
  void start_fit(Callback& callback) {
    stage_value = Stage::fit;
    callback.setup(*this, Stage::fit);
    callback.on_fit_start(*this);
  }
  /// One epoch's end: `steps` more optimizer steps, `logged_metrics` as callback_metrics, then
  /// on_validation_start, on_validation_end and on_train_epoch_end; the epoch advances after.
  void run_epoch(Callback& callback, MetricMap logged_metrics, int64_t steps = 10) {
    step += steps;
    metrics = std::move(logged_metrics);
    callback.on_validation_start(*this);
    callback.on_validation_end(*this);
    callback.on_train_epoch_end(*this);
    ++epoch;
  }

  // ---- TrainerContext ---------------------------------------------------------------------------
  Stage stage() const override { return stage_value; }
  bool sanity_checking() const override { return sanity; }
  int64_t current_epoch() const override { return epoch; }
  int64_t global_step() const override { return step; }
  int64_t max_epochs() const override { return max_epochs_value; }
  int64_t max_steps() const override { return max_steps_value; }
  int64_t num_batches(Stage s) const override {
    auto it = batches.find(s);
    return it == batches.end() ? -1 : it->second;
  }
  bool is_last_batch() const override { return last_batch; }
  const MetricMap& callback_metrics() const override { return metrics; }
  const MetricMap& progress_bar_metrics() const override {
    ++progress_bar_reads;
    return bar_metrics;
  }
  bool step_logging_due() const override { return logging_due || !stop_reasons.empty(); }
  void log_metrics(const MetricMap& row, std::string_view owner) override {
    if (!logger_configured) throw Error(ErrorKind::config, std::string(owner) + ": the Trainer has no logger");
    logged.push_back(LoggedRow{row, std::string(owner), step});
  }
  bool has_logger() const override { return logger_configured; }
  const ClusterInfo& cluster() const override { return cluster_info; }
  c10::Device device() const override { return device_value; }
  std::string broadcast(const std::string& value, int64_t) override {
    ++broadcasts;
    return value;
  }
  bool agree(bool decision, bool all) override {
    decisions.emplace_back(decision, all);
    return forced_decision.value_or(decision);
  }
  at::Tensor reduce(const at::Tensor& tensor, ReduceOp) override { return tensor.detach().clone(); }
  std::vector<at::Tensor> all_gather(const at::Tensor& tensor) override { return {tensor.detach().clone()}; }
  void barrier(std::string_view) override {}
  void synchronize_device() override { ++device_syncs; }
  MetricMap device_stats() const override { return device_stats_value; }
  std::string device_name() const override { return device_name_value; }
  c10::ScalarType compute_dtype() const override { return compute_dtype_value; }
  bool should_stop() const override { return !stop_reasons.empty(); }
  void request_stop(std::string_view reason) override { stop_reasons.emplace_back(reason); }
  int64_t accumulate_grad_batches() const override { return accumulate; }
  void set_accumulate_grad_batches(int64_t n) override {
    if (n < 1) throw Error(ErrorKind::config, "accumulate_grad_batches must be >= 1");
    accumulate = n;
  }
  int64_t dataloader_idx() const override { return loader_index; }
  int64_t train_batch_size() const override { return batch_size; }
  void set_train_batch_size(int64_t n) override {
    if (batch_size < 0) throw Error(ErrorKind::config, "the DataModule cannot change its batch size");
    if (n < 1) throw Error(ErrorKind::config, "batch size must be >= 1");
    batch_size = n;
  }
  BatchSizeTrial run_batch_size_trial(int64_t size, int64_t steps) override {
    if (batch_size < 0) throw Error(ErrorKind::config, "the DataModule cannot change its batch size");
    trials.push_back(size);
    if (trial_size_limit && size > *trial_size_limit)
      throw c10::OutOfMemoryError("FakeTrainer: batch size " + std::to_string(size) + " does not fit");
    const int64_t per_epoch = train_samples < 0 ? -1 : (train_samples + size - 1) / size;
    return {per_epoch < 0 ? steps : std::min(steps, per_epoch), per_epoch};
  }
  const std::string& default_root_dir() const override { return root_dir; }
  std::string log_dir() const override { return root_dir; }
  /// Writes a small text file (not a real checkpoint) and records the call in `saves`: callbacks
  /// decide names and times, not content. Creates missing directories; throws fulgur::Error(io)
  /// when fail_saves is set.
  void save_checkpoint(const std::string& path, bool weights_only) override {
    if (fail_saves) throw Error(ErrorKind::io, "disk full (simulated by FakeTrainer::fail_saves)");
    make_parents(path);
    std::ofstream(path) << "checkpoint at step " << step;
    saves.emplace_back(path, weights_only);
  }
  torch::nn::Module& model() override { return *module; }
  std::vector<torch::optim::Optimizer*> optimizers() override { return optimizer_list; }

 private:
  static void make_parents(const std::string& path) {
    for (size_t slash = path.find('/', 1); slash != std::string::npos; slash = path.find('/', slash + 1))
      ::mkdir(path.substr(0, slash).c_str(), 0755);  // EEXIST is fine
  }
};

/// Records every hook it sees, by Lightning's name ("on_train_batch_end"), in order; implements all
/// of them. Add it next to the callback under test to see where in the run something happened.
class RecordingCallback : public Callback {
 public:
  std::vector<std::string> calls;  ///< hook names, in the order they were called

  HookSet hooks() const override { return ~HookSet{0} >> (64 - kHookCount); }
  void setup(TrainerContext&, Stage) override { calls.emplace_back("setup"); }
  void teardown(TrainerContext&, Stage) override { calls.emplace_back("teardown"); }
  void on_fit_start(TrainerContext&) override { calls.emplace_back("on_fit_start"); }
  void on_fit_end(TrainerContext&) override { calls.emplace_back("on_fit_end"); }
  void on_sanity_check_start(TrainerContext&) override { calls.emplace_back("on_sanity_check_start"); }
  void on_sanity_check_end(TrainerContext&) override { calls.emplace_back("on_sanity_check_end"); }
  void on_train_start(TrainerContext&) override { calls.emplace_back("on_train_start"); }
  void on_train_end(TrainerContext&) override { calls.emplace_back("on_train_end"); }
  void on_train_epoch_start(TrainerContext&) override { calls.emplace_back("on_train_epoch_start"); }
  void on_train_epoch_end(TrainerContext&) override { calls.emplace_back("on_train_epoch_end"); }
  void on_train_batch_start(TrainerContext&, const Batch&, int64_t) override {
    calls.emplace_back("on_train_batch_start");
  }
  void on_train_batch_end(TrainerContext&, const StepOutput&, const Batch&, int64_t) override {
    calls.emplace_back("on_train_batch_end");
  }
  void on_validation_start(TrainerContext&) override { calls.emplace_back("on_validation_start"); }
  void on_validation_end(TrainerContext&) override { calls.emplace_back("on_validation_end"); }
  void on_validation_epoch_start(TrainerContext&) override { calls.emplace_back("on_validation_epoch_start"); }
  void on_validation_epoch_end(TrainerContext&) override { calls.emplace_back("on_validation_epoch_end"); }
  void on_validation_batch_start(TrainerContext&, const Batch&, int64_t) override {
    calls.emplace_back("on_validation_batch_start");
  }
  void on_validation_batch_end(TrainerContext&, const StepOutput&, const Batch&, int64_t) override {
    calls.emplace_back("on_validation_batch_end");
  }
  void on_test_start(TrainerContext&) override { calls.emplace_back("on_test_start"); }
  void on_test_end(TrainerContext&) override { calls.emplace_back("on_test_end"); }
  void on_test_epoch_start(TrainerContext&) override { calls.emplace_back("on_test_epoch_start"); }
  void on_test_epoch_end(TrainerContext&) override { calls.emplace_back("on_test_epoch_end"); }
  void on_test_batch_start(TrainerContext&, const Batch&, int64_t) override {
    calls.emplace_back("on_test_batch_start");
  }
  void on_test_batch_end(TrainerContext&, const StepOutput&, const Batch&, int64_t) override {
    calls.emplace_back("on_test_batch_end");
  }
  void on_predict_start(TrainerContext&) override { calls.emplace_back("on_predict_start"); }
  void on_predict_end(TrainerContext&) override { calls.emplace_back("on_predict_end"); }
  void on_predict_epoch_start(TrainerContext&) override { calls.emplace_back("on_predict_epoch_start"); }
  void on_predict_epoch_end(TrainerContext&) override { calls.emplace_back("on_predict_epoch_end"); }
  void on_predict_batch_start(TrainerContext&, const Batch&, int64_t) override {
    calls.emplace_back("on_predict_batch_start");
  }
  void on_predict_batch_end(TrainerContext&, const at::Tensor&, const Batch&, int64_t) override {
    calls.emplace_back("on_predict_batch_end");
  }
  void on_before_backward(TrainerContext&, const at::Tensor&) override { calls.emplace_back("on_before_backward"); }
  void on_after_backward(TrainerContext&) override { calls.emplace_back("on_after_backward"); }
  void on_before_optimizer_step(TrainerContext&, torch::optim::Optimizer&) override {
    calls.emplace_back("on_before_optimizer_step");
  }
  void on_before_zero_grad(TrainerContext&, torch::optim::Optimizer&) override {
    calls.emplace_back("on_before_zero_grad");
  }
  void on_exception(TrainerContext&, const std::exception&) override { calls.emplace_back("on_exception"); }
  void on_save_checkpoint(TrainerContext&, c10::IValue&) override { calls.emplace_back("on_save_checkpoint"); }
  void on_load_checkpoint(TrainerContext&, const c10::IValue&) override { calls.emplace_back("on_load_checkpoint"); }

  /// How often `hook` (Lightning's name) was called.
  size_t count(std::string_view hook) const {
    size_t n = 0;
    for (const auto& c : calls) n += c == hook;
    return n;
  }
};

}  // namespace fulgur::testing
