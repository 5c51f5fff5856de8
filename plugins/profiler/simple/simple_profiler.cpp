// Built-in profiler `simple`: wall-clock time per Trainer action, reported as Lightning's
// SimpleProfiler table (Action | Mean duration (s) | Num calls | Total time (s) | Percentage %).
//
// start/stop run inside the training loop, so they do no allocation once an action has been
// seen: actions live in a small vector found by the address of the action name (the Trainer
// passes string literals), with a comparison of the text as the fallback.
#include <fulgur/checkpoint_io.h>
#include <fulgur/plugin.h>

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <chrono>
#include <filesystem>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// Python's f"{x:.5}": five significant digits, shortest form.
std::string five_digits(double value) { return fmt::format("{:.5}", value); }

class SimpleProfiler final : public fulgur::Profiler {
 public:
  FULGUR_OPTIONS(Options, (string, dirpath, "Directory of the report file; empty means the run's log_dir", ""),
                 (string, filename,
                  "Report file stem: writes <dirpath>/<stage>-<filename>.txt; empty prints the report "
                  "to the log at teardown",
                  ""),
                 (boolean, extended, "Also report call counts and each action's share of the wall time", true));
  explicit SimpleProfiler(const Options& options)
      : dirpath_(options.dirpath), filename_(options.filename), extended_(options.extended) {
    actions_.reserve(32);
  }

  void setup(fulgur::Stage stage, const std::string& log_dir, int64_t global_rank) override {
    stage_ = stage;
    rank_suffix_ = global_rank > 0 ? fmt::format("-rank{}", global_rank) : "";
    log_dir_ = log_dir;
    // Each stage reports its own calls against its own wall time. Open actions stay open.
    for (Action& action : actions_) {
      action.calls = 0;
      action.total = Clock::duration::zero();
    }
    started_at_ = Clock::now();
    finished_at_.reset();
  }

  void start(std::string_view name) override {
    Action& action = find_or_add(name);
    if (action.running)
      throw fulgur::Error(fulgur::ErrorKind::runtime,
                          fmt::format("profiler 'simple': action '{}' was started again before it was stopped", name));
    action.running = true;
    action.started = Clock::now();
  }

  void stop(std::string_view name) override {
    const Clock::time_point now = Clock::now();
    Action* action = find(name);
    // Not an exception: stop() runs in ProfileScope's destructor, where a throw terminates.
    if (action == nullptr || !action->running) {
      fulgur::log::warn(fmt::format("profiler 'simple': action '{}' was stopped without having been started", name));
      return;
    }
    action->running = false;
    action->total += now - action->started;
    ++action->calls;
  }

  std::string summary() const override {
    const double wall = seconds(finished_at_.value_or(Clock::now()) - started_at_);
    std::vector<const Action*> recorded;
    int64_t total_calls = 0;
    for (const Action& action : actions_) {
      if (action.calls == 0) continue;
      recorded.push_back(&action);
      total_calls += action.calls;
    }
    auto mean = [](const Action* a) { return seconds(a->total) / static_cast<double>(a->calls); };

    std::vector<std::vector<std::string>> rows;
    if (extended_) {
      // Lightning sorts by share of the wall time, i.e. by total time.
      std::stable_sort(recorded.begin(), recorded.end(),
                       [](const Action* a, const Action* b) { return a->total > b->total; });
      rows.push_back({"Action", "Mean duration (s)", "Num calls", "Total time (s)", "Percentage %"});
      rows.push_back({"Total", "-", fmt::format("{}", total_calls), five_digits(wall), "100 %"});
      for (const Action* a : recorded)
        rows.push_back({a->name, five_digits(mean(a)), fmt::format("{}", a->calls), five_digits(seconds(a->total)),
                        five_digits(wall > 0 ? 100.0 * seconds(a->total) / wall : 0.0)});
    } else {
      std::stable_sort(recorded.begin(), recorded.end(),
                       [&](const Action* a, const Action* b) { return mean(a) > mean(b); });
      rows.push_back({"Action", "Mean duration (s)", "Total time (s)"});
      for (const Action* a : recorded) rows.push_back({a->name, five_digits(mean(a)), five_digits(seconds(a->total))});
    }
    return title() + render_table(rows, /*separator_after=*/extended_ ? 2 : 1);
  }

  void teardown(fulgur::Stage stage) override {
    finished_at_ = Clock::now();
    stage_ = stage;
    const std::string report = summary();
    if (filename_.empty()) {
      fulgur::log::info(report);
      return;
    }
    const std::filesystem::path directory = !dirpath_.empty() ? dirpath_ : !log_dir_.empty() ? log_dir_ : ".";
    std::error_code error;
    std::filesystem::create_directories(directory, error);
    if (error)
      throw fulgur::Error(fulgur::ErrorKind::io, fmt::format("profiler 'simple': cannot create '{}' for its report: {}",
                                                             directory.string(), error.message()));
    const std::string path =
        (directory / fmt::format("{}-{}{}.txt", fulgur::to_string(stage), filename_, rank_suffix_)).string();
    fulgur::atomic_write_text(path, report);
  }

 private:
  struct Action {
    const char* key = nullptr;  // the caller's string_view, compared by address first
    size_t key_size = 0;
    std::string name;
    bool running = false;
    Clock::time_point started;
    int64_t calls = 0;
    Clock::duration total = Clock::duration::zero();
  };

  Action* find(std::string_view name) {
    // The same literal comes back every time: one pointer comparison per action in the common case.
    for (Action& action : actions_)
      if (action.key == name.data() && action.key_size == name.size()) return &action;
    for (Action& action : actions_)
      if (action.name == name) return &action;
    return nullptr;
  }

  Action& find_or_add(std::string_view name) {
    if (Action* action = find(name)) return *action;
    Action& added = actions_.emplace_back();
    added.key = name.data();
    added.key_size = name.size();
    added.name = std::string(name);
    return added;
  }

  std::string title() const {
    std::string title;
    if (stage_) {
      for (const char* c = fulgur::to_string(*stage_); *c; ++c)
        title += static_cast<char>(std::toupper(static_cast<unsigned char>(*c)));
      title += ' ';
    }
    return title + "Profiler Report\n";
  }

  // |  cell  |  cell  | rows with a dashed line around the header and after `separator_after`
  // rows (the header, plus the Total row in the extended report), and at the end.
  static std::string render_table(const std::vector<std::vector<std::string>>& rows, size_t separator_after) {
    std::vector<size_t> widths(rows.front().size(), 0);
    for (const auto& row : rows)
      for (size_t i = 0; i < row.size(); ++i) widths[i] = std::max(widths[i], row[i].size());
    size_t line_width = 1;
    for (size_t width : widths) line_width += width + 5;
    const std::string rule = std::string(line_width, '-') + "\n";

    std::string out = "\n" + rule;
    for (size_t r = 0; r < rows.size(); ++r) {
      out += '|';
      for (size_t i = 0; i < rows[r].size(); ++i) out += fmt::format("  {:<{}}  |", rows[r][i], widths[i]);
      out += '\n';
      if (r + 1 == 1 || r + 1 == separator_after) out += rule;
    }
    if (rows.size() > separator_after) out += rule;
    return out;
  }

  std::string dirpath_;
  std::string filename_;
  std::string rank_suffix_;
  bool extended_;

  std::vector<Action> actions_;
  std::optional<fulgur::Stage> stage_;
  std::string log_dir_;
  Clock::time_point started_at_ = Clock::now();
  std::optional<Clock::time_point> finished_at_;
};

}  // namespace

FULGUR_PLUGIN(SimpleProfiler, "simple", "0.1.0", "Wall-clock time per Trainer action (Lightning's SimpleProfiler)")
