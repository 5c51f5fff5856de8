// Built-in callback `progress_bar`: Lightning's TQDMProgressBar. On a terminal, one live bar per
// stage redrawn in place:
//   Epoch 3/9:  45%|███████▏        | 421/938 [00:12<00:14, 35.10it/s, loss=0.312, val/acc=0.91]
// Elsewhere (logs, CI, SLURM output files) plain lines every `log_interval` batches and one per
// epoch or stage end, so that a log file stays readable.
//
// The per-batch hooks run in the training loop: a batch that is not printed costs two stores and
// a compare. The clock, the metrics and all formatting are touched only when a line is due.
#include <fulgur/plugin.h>

#include <fmt/format.h>

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <string_view>

namespace {

using fulgur::Error;
using fulgur::ErrorKind;
using Clock = std::chrono::steady_clock;

constexpr char kOwner[] = "callback 'progress_bar'";
constexpr int64_t kNever = std::numeric_limits<int64_t>::max();
// Like tqdm's mininterval: redrawing faster than the eye can follow only costs time.
constexpr double kMinRedrawSeconds = 0.1;
constexpr size_t kDefaultColumns = 100;
constexpr size_t kMinBarWidth = 10;

// tqdm's format_interval: "MM:SS", or "H:MM:SS" from one hour on.
std::string format_interval(double seconds) {
  auto total = static_cast<int64_t>(std::max(0.0, seconds));
  int64_t h = total / 3600, m = total / 60 % 60, s = total % 60;
  return h > 0 ? fmt::format("{:d}:{:02d}:{:02d}", h, m, s) : fmt::format("{:02d}:{:02d}", m, s);
}

// tqdm's format_num: 3 significant digits unless the plain repr is shorter ("0.312", "1e-5").
std::string format_metric(double value) {
  std::string g = fmt::format("{:.3g}", value);
  for (auto [from, to] : {std::pair<std::string_view, std::string_view>{"e+0", "e+"}, {"e-0", "e-"}})
    if (auto pos = g.find(from); pos != std::string::npos) g.replace(pos, from.size(), to);
  std::string plain = fmt::format("{}", value);
  return g.size() < plain.size() ? g : plain;
}

size_t terminal_columns() {
  winsize size{};
  if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &size) == 0 && size.ws_col > 0) return size.ws_col;
  if (const char* columns = std::getenv("COLUMNS")) {
    long n = std::strtol(columns, nullptr, 10);
    if (n > 0) return static_cast<size_t>(n);
  }
  return kDefaultColumns;
}

// One stage's progress. Only `n` and `seen` change per batch.
struct Progress {
  std::string description;
  int64_t total = -1;           // batches in the stage; -1 when the loader does not know
  int64_t n = 0;                // batch_idx + 1 of the latest batch (resumed epochs start late)
  int64_t seen = 0;             // batches since the stage started here, for the rate
  int64_t next_print = kNever;  // the `n` at which a line or redraw is due
  bool active = false;
  Clock::time_point start;
  Clock::time_point last_draw;
};

class ProgressBar final : public fulgur::Callback {
 public:
  FULGUR_OPTIONS(Options,
                 (string, style,
                  "\"auto\": a live bar when stdout is a terminal, plain lines otherwise; \"bar\"; "
                  "\"plain\"",
                  "auto"),
                 (integer, refresh_rate, "Live bar: redraw every N batches (at most 10 times a second); 0 disables it",
                  1),
                 (integer, log_interval,
                  "Plain lines: print one every N batches (0: only at the end of each epoch or stage)", 50),
                 (boolean, leave, "Live bar: keep each finished epoch's bar instead of redrawing one line", false));
  explicit ProgressBar(const Options& options)
      : refresh_rate_(options.refresh_rate), log_interval_(options.log_interval), leave_(options.leave) {
    const std::string& style = options.style;
    if (style == "auto")
      live_ = isatty(fileno(stdout)) != 0;
    else if (style == "bar" || style == "plain")
      live_ = style == "bar";
    else
      options.reject("style",
                     "is not understood; use \"auto\" (a live bar on a terminal, plain lines otherwise), \"bar\" or "
                     "\"plain\"");
    if (refresh_rate_ < 0 || log_interval_ < 0)
      throw Error(ErrorKind::config, fmt::format("{}: refresh_rate = {} and log_interval = {} must be >= 0", kOwner,
                                                 refresh_rate_, log_interval_));
    interval_ = live_ ? refresh_rate_ : log_interval_;
  }

  fulgur::HookSet hooks() const override {
    using fulgur::Hook;
    if (live_ && refresh_rate_ == 0) return 0;  // Lightning: refresh_rate = 0 disables the bar
    return Hook::train_epoch_start | Hook::train_batch_end | Hook::train_epoch_end | Hook::train_end |
           Hook::validation_start | Hook::validation_batch_end | Hook::validation_end | Hook::test_start |
           Hook::test_batch_end | Hook::test_end | Hook::predict_start | Hook::predict_batch_end | Hook::predict_end |
           Hook::exception;
  }

  void on_train_epoch_start(fulgur::TrainerContext& trainer) override {
    int64_t last_epoch = trainer.max_epochs() - 1;
    std::string description = trainer.max_epochs() > 0 ? fmt::format("Epoch {}/{}", trainer.current_epoch(), last_epoch)
                                                       : fmt::format("Epoch {}", trainer.current_epoch());
    begin(train_, trainer, std::move(description), trainer.num_batches(fulgur::Stage::fit));
  }

  void on_train_batch_end(fulgur::TrainerContext& trainer, const fulgur::StepOutput&, const fulgur::Batch&,
                          int64_t batch_idx) override {
    train_.n = batch_idx + 1;
    ++train_.seen;
    if (train_.n < train_.next_print) return;
    due(trainer, train_, /*with_metrics=*/true);
  }

  void on_train_epoch_end(fulgur::TrainerContext& trainer) override {
    if (!train_.active) return;
    // Validation has run by now, so this line carries the epoch's validation metrics too.
    if (live_) {
      draw(trainer, train_, true);
      if (leave_) newline();  // keep this epoch's bar; the next one starts on a new line
    } else {
      print_line(trainer, train_, true);
    }
  }

  void on_train_end(fulgur::TrainerContext&) override {
    stop(train_);
    if (line_open_) newline();
  }

  void on_validation_start(fulgur::TrainerContext& trainer) override {
    in_fit_ = trainer.stage() == fulgur::Stage::fit;
    // During fit the validation bar lives on the line under the training bar and is removed at
    // the end, as Lightning's is. (The sanity check gets no bar: begin() leaves it inactive.)
    if (live_ && in_fit_ && line_open_ && !trainer.sanity_checking()) newline();
    begin(validation_, trainer, "Validation", trainer.num_batches(fulgur::Stage::validate));
  }

  void on_validation_batch_end(fulgur::TrainerContext& trainer, const fulgur::StepOutput&, const fulgur::Batch&,
                               int64_t batch_idx) override {
    validation_.n = batch_idx + 1;
    ++validation_.seen;
    if (validation_.n < validation_.next_print) return;
    due(trainer, validation_, false);
  }

  void on_validation_end(fulgur::TrainerContext& trainer) override {
    if (!validation_.active) return;
    if (!in_fit_) {
      finish(trainer, validation_);
      return;
    }
    stop(validation_);
    if (live_) {
      write("\r\033[K");  // remove the validation bar
      line_open_ = false;
      if (train_.active) {
        write("\033[A");  // back up to the training bar and show the new validation metrics
        draw(trainer, train_, true);
      }
    }
  }

  void on_test_start(fulgur::TrainerContext& trainer) override {
    begin(test_, trainer, "Testing", trainer.num_batches(fulgur::Stage::test));
  }
  void on_test_batch_end(fulgur::TrainerContext& trainer, const fulgur::StepOutput&, const fulgur::Batch&,
                         int64_t batch_idx) override {
    test_.n = batch_idx + 1;
    ++test_.seen;
    if (test_.n < test_.next_print) return;
    due(trainer, test_, false);
  }
  void on_test_end(fulgur::TrainerContext& trainer) override { finish(trainer, test_); }

  void on_predict_start(fulgur::TrainerContext& trainer) override {
    begin(predict_, trainer, "Predicting", trainer.num_batches(fulgur::Stage::predict));
  }
  void on_predict_batch_end(fulgur::TrainerContext& trainer, const at::Tensor&, const fulgur::Batch&,
                            int64_t batch_idx) override {
    predict_.n = batch_idx + 1;
    ++predict_.seen;
    if (predict_.n < predict_.next_print) return;
    due(trainer, predict_, false);
  }
  void on_predict_end(fulgur::TrainerContext& trainer) override { finish(trainer, predict_); }

  // An error message should not be glued to the end of a half-drawn bar.
  void on_exception(fulgur::TrainerContext&, const std::exception&) override {
    if (line_open_) newline();
  }

 private:
  void begin(Progress& progress, fulgur::TrainerContext& trainer, std::string description, int64_t total) {
    progress.description = std::move(description);
    progress.total = total;
    progress.n = 0;
    progress.seen = 0;
    // Only rank zero shows progress; the other ranks keep counting but never reach a print point.
    progress.active = trainer.is_global_zero() && !trainer.sanity_checking();
    progress.next_print = progress.active && interval_ > 0 ? interval_ : kNever;
    progress.start = Clock::now();
    progress.last_draw = Clock::time_point{};
    if (progress.active && live_) {
      columns_ = terminal_columns();
      draw(trainer, progress, &progress == &train_);
    }
  }

  static void stop(Progress& progress) {
    progress.active = false;
    progress.next_print = kNever;
  }

  // The slow path of the per-batch hooks: a redraw or a line is due.
  void due(fulgur::TrainerContext& trainer, Progress& progress, bool with_metrics) {
    progress.next_print = (progress.n / interval_ + 1) * interval_;
    bool last = progress.n == progress.total;
    if (live_) {
      auto now = Clock::now();
      if (!last && std::chrono::duration<double>(now - progress.last_draw).count() < kMinRedrawSeconds) return;
      draw(trainer, progress, with_metrics);
    } else if (!last) {  // the end-of-epoch/stage line reports the last batch
      print_line(trainer, progress, with_metrics);
    }
  }

  void finish(fulgur::TrainerContext& trainer, Progress& progress) {
    if (!progress.active) return;
    stop(progress);
    if (live_) {
      draw(trainer, progress, false);
      newline();  // evaluation bars stay on screen, as Lightning's do
    } else {
      print_line(trainer, progress, false);
    }
  }

  std::string postfix(fulgur::TrainerContext& trainer, bool with_metrics) const {
    std::string text;
    if (!with_metrics) return text;
    for (const auto& [name, value] : trainer.progress_bar_metrics())
      text += fmt::format(", {}={}", name, format_metric(value));
    return text;
  }

  // "[00:12<00:14, 35.10it/s" (the caller closes the bracket after the metrics).
  static std::string timing(const Progress& progress) {
    double elapsed = std::chrono::duration<double>(Clock::now() - progress.start).count();
    double rate = elapsed > 0 && progress.seen > 0 ? static_cast<double>(progress.seen) / elapsed : 0.0;
    std::string rate_text = rate <= 0  ? "?it/s"
                            : rate < 1 ? fmt::format("{:.2f}s/it", 1.0 / rate)
                                       : fmt::format("{:.2f}it/s", rate);
    if (progress.total < 0) return fmt::format("[{}, {}", format_interval(elapsed), rate_text);
    std::string remaining =
        rate > 0 ? format_interval(static_cast<double>(std::max<int64_t>(progress.total - progress.n, 0)) / rate) : "?";
    return fmt::format("[{}<{}, {}", format_interval(elapsed), remaining, rate_text);
  }

  static int percent(const Progress& progress) {
    if (progress.total <= 0) return progress.total == 0 ? 100 : 0;
    return static_cast<int>(100 * std::min(progress.n, progress.total) / progress.total);
  }

  // tqdm's bar: full blocks plus one partial block in eighths.
  static std::string bar(const Progress& progress, size_t width) {
    static constexpr std::string_view kPartial[] = {"", "▏", "▎", "▍", "▌", "▋", "▊", "▉"};
    double fraction = progress.total > 0 ? std::min(1.0, static_cast<double>(progress.n) / progress.total) : 0.0;
    auto eighths = static_cast<size_t>(fraction * static_cast<double>(width) * 8);
    size_t full = eighths / 8, partial = eighths % 8;
    std::string out;
    for (size_t i = 0; i < full; ++i) out += "█";
    size_t used = full;
    if (partial > 0 && used < width) {
      out += kPartial[partial];
      ++used;
    }
    out.append(width - used, ' ');
    return out;
  }

  void draw(fulgur::TrainerContext& trainer, Progress& progress, bool with_metrics) {
    progress.last_draw = Clock::now();
    std::string tail = timing(progress) + postfix(trainer, with_metrics) + "]";
    std::string line;
    if (progress.total < 0) {
      line = fmt::format("{}: {}it {}", progress.description, progress.n, tail);
    } else {
      std::string left = fmt::format("{}: {:3d}%|", progress.description, percent(progress));
      std::string right = fmt::format("| {}/{} {}", progress.n, progress.total, tail);
      // Keep the line one column short of the terminal: a wrapped line cannot be redrawn with \r.
      size_t budget = columns_ > 1 ? columns_ - 1 : kDefaultColumns;
      size_t width =
          budget > left.size() + right.size() + kMinBarWidth ? budget - left.size() - right.size() : kMinBarWidth;
      if (left.size() + width + right.size() > budget && budget > left.size() + width)
        right.resize(budget - left.size() - width);
      line = left + bar(progress, width) + right;
    }
    write("\r" + line + "\033[K");
    line_open_ = true;
  }

  void print_line(fulgur::TrainerContext& trainer, const Progress& progress, bool with_metrics) {
    std::string position = progress.total < 0
                               ? fmt::format("{}it", progress.n)
                               : fmt::format("{:3d}% {}/{}", percent(progress), progress.n, progress.total);
    write(fmt::format("{}: {} {}{}]\n", progress.description, position, timing(progress),
                      postfix(trainer, with_metrics)));
  }

  void newline() {
    write("\n");
    line_open_ = false;
  }

  static void write(const std::string& text) {
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);
  }

  // Options.
  int64_t refresh_rate_;
  int64_t log_interval_;
  bool leave_;
  bool live_ = false;     // a bar redrawn in place, or plain lines
  int64_t interval_ = 0;  // batches between redraws (live) or lines (plain); 0: only at the end

  // State.
  Progress train_, validation_, test_, predict_;
  bool in_fit_ = false;
  bool line_open_ = false;  // the cursor sits at the end of a drawn bar
  size_t columns_ = kDefaultColumns;
};

}  // namespace

FULGUR_PLUGIN(ProgressBar, "progress_bar", "0.1.0",
              "Shows progress: a live bar per stage on a terminal, plain lines in log files")
