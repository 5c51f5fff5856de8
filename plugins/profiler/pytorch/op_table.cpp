#include "op_table.h"

#include <torch/csrc/autograd/profiler_kineto.h>

#include <fmt/format.h>

#include <algorithm>
#include <tuple>

namespace fulgur::pytorch_profiler {

namespace {

struct Span {
  uint64_t thread, start, end;
  size_t index;
  uint64_t children = 0;
};

std::string duration(uint64_t ns) {
  if (ns >= 1'000'000'000) return fmt::format("{:.3f}s", ns / 1e9);
  if (ns >= 1'000'000) return fmt::format("{:.3f}ms", ns / 1e6);
  return fmt::format("{:.3f}us", ns / 1e3);
}

}  // namespace

void OpTable::add(const std::vector<torch::autograd::profiler::KinetoEvent>& events) {
  // Self time: an event's duration minus that of its direct children on the same thread. Sorting
  // by (thread, start, longest first) puts every parent right before its children.
  std::vector<Span> host;
  for (size_t i = 0; i < events.size(); ++i) {
    const auto& e = events[i];
    if (e.deviceType() != c10::DeviceType::CPU) {
      ops_[e.name()].device_ns += e.durationNs();
      continue;
    }
    host.push_back({e.startThreadId(), e.startNs(), e.endNs(), i});
  }
  std::sort(host.begin(), host.end(), [](const Span& a, const Span& b) {
    return std::tie(a.thread, a.start, b.end) < std::tie(b.thread, b.start, a.end);
  });
  std::vector<Span*> open;
  for (Span& span : host) {
    while (!open.empty() && (open.back()->thread != span.thread || open.back()->end <= span.start)) open.pop_back();
    if (!open.empty()) open.back()->children += span.end - span.start;
    open.push_back(&span);
  }
  for (const Span& span : host) {
    OpStats& stats = ops_[events[span.index].name()];
    const uint64_t total = span.end - span.start;
    ++stats.calls;
    stats.total_ns += total;
    stats.self_ns += total > span.children ? total - span.children : 0;
  }
}

std::string OpTable::render(const std::string& title, int64_t row_limit) const {
  std::vector<std::pair<std::string, OpStats>> rows(ops_.begin(), ops_.end());
  std::stable_sort(rows.begin(), rows.end(),
                   [](const auto& a, const auto& b) { return a.second.self_ns > b.second.self_ns; });
  if (row_limit > 0 && static_cast<int64_t>(rows.size()) > row_limit) rows.resize(row_limit);
  uint64_t self_sum = 0;
  bool any_device = false;
  for (const auto& [name, stats] : ops_) {
    self_sum += stats.self_ns;
    any_device = any_device || stats.device_ns > 0;
  }

  std::vector<std::vector<std::string>> cells;
  cells.push_back({"Name", "Self CPU %", "Self CPU", "CPU total", "# of Calls"});
  if (any_device) cells.back().push_back("Device total");
  for (const auto& [name, stats] : rows) {
    cells.push_back({name, fmt::format("{:.2f}%", self_sum ? 100.0 * stats.self_ns / self_sum : 0.0),
                     duration(stats.self_ns), duration(stats.total_ns), fmt::format("{}", stats.calls)});
    if (any_device) cells.back().push_back(duration(stats.device_ns));
  }
  std::vector<size_t> widths(cells.front().size(), 0);
  for (const auto& row : cells)
    for (size_t i = 0; i < row.size(); ++i) widths[i] = std::max(widths[i], row[i].size());
  std::string rule;
  for (size_t w : widths) rule += std::string(w, '-') + "  ";
  rule += '\n';
  std::string out = title + "\n" + rule;
  for (size_t r = 0; r < cells.size(); ++r) {
    for (size_t i = 0; i < cells[r].size(); ++i)
      out += i == 0 ? fmt::format("{:<{}}  ", cells[r][i], widths[i]) : fmt::format("{:>{}}  ", cells[r][i], widths[i]);
    out += '\n';
    if (r == 0) out += rule;
  }
  out += rule;
  out += fmt::format("Self CPU time total: {}\n", duration(self_sum));
  return out;
}

}  // namespace fulgur::pytorch_profiler
