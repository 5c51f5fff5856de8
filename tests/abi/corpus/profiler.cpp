// ABI corpus, profiler `corpus_counting`: built against the frozen SDK 1.0 headers. Counts each
// action and sums its wall time; at the end of a stage it writes the table to
// <log_dir>/corpus_profile-<stage>.txt (rank-suffixed beyond rank zero).
#include <fulgur/plugin.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

class CorpusCounting final : public fulgur::Profiler {
 public:
  void setup(fulgur::Stage, const std::string& log_dir, int64_t global_rank) override {
    log_dir_ = log_dir;
    rank_ = global_rank;
  }
  void start(std::string_view action) override { running_.emplace_back(std::string(action), Clock::now()); }
  void stop(std::string_view action) override {
    // The innermost running action of that name (LIFO, as the Trainer nests them).
    for (auto it = running_.rbegin(); it != running_.rend(); ++it) {
      if (it->first != action) continue;
      Totals& totals = totals_[it->first];
      ++totals.count;
      totals.seconds += std::chrono::duration<double>(Clock::now() - it->second).count();
      running_.erase(std::next(it).base());
      return;
    }
  }
  std::string summary() const override {
    std::string out;
    char line[256];
    for (const auto& [action, totals] : totals_) {
      std::snprintf(line, sizeof line, "%-48s %8lld %12.6f\n", action.c_str(), static_cast<long long>(totals.count),
                    totals.seconds);
      out += line;
    }
    return out;
  }
  void teardown(fulgur::Stage stage) override {
    if (log_dir_.empty() || totals_.empty()) return;
    std::string file = log_dir_ + "/corpus_profile-" + fulgur::to_string(stage);
    if (rank_ > 0) file += "-rank" + std::to_string(rank_);
    std::ofstream(file + ".txt") << summary();
  }

 private:
  struct Totals {
    int64_t count = 0;
    double seconds = 0;
  };
  std::string log_dir_;
  int64_t rank_ = 0;
  std::vector<std::pair<std::string, Clock::time_point>> running_;
  std::map<std::string, Totals, std::less<>> totals_;
};

}  // namespace

FULGUR_PLUGIN(CorpusCounting, "corpus_counting", "1.0.0", "ABI corpus: counts and times the Trainer's actions")
