// Built-in callback `model_summary`: Lightning's ModelSummary. At fit start, rank zero logs the
// model's layers down to `max_depth` with their parameter counts and train/eval mode, then the
// totals and the parameters' size in MB, in Lightning's table layout:
//
//     | Name | Type       | Params | Mode
//   ---------------------------------------
//   0 | net  | Sequential | 101 K  | train
//   ---------------------------------------
//   101 K     Trainable params
//   ...
#include <fulgur/plugin.h>

#include <fmt/format.h>
#include <torch/nn/module.h>

#include <cmath>
#include <string>
#include <unordered_set>
#include <vector>

namespace {

// Lightning's get_human_readable_count: 999 -> "999  ", 1300 -> "1.3 K", 101000 -> "101 K".
std::string human_readable_count(int64_t number) {
  static constexpr const char* kUnits[] = {" ", "K", "M", "B", "T"};
  int64_t digits = number > 0 ? static_cast<int64_t>(std::floor(std::log10(static_cast<double>(number)))) + 1 : 1;
  int64_t groups = std::min<int64_t>((digits + 2) / 3, 5);  // never abbreviate beyond trillions
  double scaled = static_cast<double>(number) * std::pow(10.0, -3.0 * static_cast<double>(groups - 1));
  int64_t index = groups - 1;
  if (index < 1 || scaled >= 100) return fmt::format("{} {}", static_cast<int64_t>(scaled), kUnits[index]);
  return fmt::format("{:.1f} {}", scaled, kUnits[index]);
}

// "torch::nn::LinearImpl" -> "Linear", "(anonymous namespace)::Net" -> "Net": the class name as
// Python's type(module).__name__ would show it.
std::string type_name(const torch::nn::Module& module) {
  const std::string& full = module.name();
  size_t start = 0;
  int depth = 0;
  for (size_t i = 0; i + 1 < full.size(); ++i) {
    if (full[i] == '<') ++depth;
    if (full[i] == '>') --depth;
    if (depth == 0 && full[i] == ':' && full[i + 1] == ':') start = i + 2;
  }
  std::string name = full.substr(start);
  if (name.size() > 4 && name.ends_with("Impl")) name.resize(name.size() - 4);
  return name;
}

struct ParameterCounts {
  int64_t total = 0;
  int64_t trainable = 0;
  int64_t bytes = 0;
};

// Counts each tensor once even when modules share it (tied weights), as Python's parameters() does.
ParameterCounts count_parameters(const torch::nn::Module& module) {
  ParameterCounts counts;
  std::unordered_set<const void*> seen;
  for (const at::Tensor& p : module.parameters(/*recurse=*/true)) {
    if (!p.defined() || !seen.insert(p.unsafeGetTensorImpl()).second) continue;
    counts.total += p.numel();
    if (p.requires_grad()) counts.trainable += p.numel();
    counts.bytes += p.numel() * static_cast<int64_t>(p.element_size());
  }
  return counts;
}

struct Row {
  std::string name;
  std::string type;
  int64_t params = 0;
  bool training = true;
};

void collect_rows(const torch::nn::Module& module, const std::string& prefix, int64_t depth, int64_t max_depth,
                  std::vector<Row>& rows) {
  for (const auto& child : module.named_children()) {
    std::string name = prefix.empty() ? child.key() : prefix + "." + child.key();
    const torch::nn::Module& submodule = *child.value();
    rows.push_back(Row{name, type_name(submodule), count_parameters(submodule).total, submodule.is_training()});
    if (max_depth < 0 || depth + 1 < max_depth) collect_rows(submodule, name, depth + 1, max_depth, rows);
  }
}

// Lightning's _format_summary_table: columns padded to their widest cell, joined with " | ".
std::string format_table(const std::vector<std::pair<std::string, std::vector<std::string>>>& columns,
                         const ParameterCounts& counts, int64_t modules_in_train, int64_t modules_in_eval) {
  std::vector<size_t> widths;
  size_t total_width = 3;  // Lightning counts one separator more than there are columns
  for (const auto& [header, cells] : columns) {
    size_t width = header.size();
    for (const auto& cell : cells) width = std::max(width, cell.size());
    widths.push_back(width);
    total_width += width + 3;
  }
  auto join_row = [&](auto cell_of) {
    std::string line;
    for (size_t c = 0; c < columns.size(); ++c) {
      if (c > 0) line += " | ";
      line += fmt::format("{:<{}}", cell_of(c), widths[c]);
    }
    return line;
  };
  std::string rule(total_width, '-');
  std::string table = join_row([&](size_t c) { return columns[c].first; }) + "\n" + rule;
  size_t row_count = columns.front().second.size();
  for (size_t r = 0; r < row_count; ++r) table += "\n" + join_row([&](size_t c) { return columns[c].second[r]; });
  table += "\n" + rule;
  auto total_line = [&](const std::string& value, const char* label) {
    table += fmt::format("\n{:<10}{}", value, label);
  };
  total_line(human_readable_count(counts.trainable), "Trainable params");
  total_line(human_readable_count(counts.total - counts.trainable), "Non-trainable params");
  total_line(human_readable_count(counts.total), "Total params");
  total_line(fmt::format("{:.3f}", static_cast<double>(counts.bytes) / 1e6), "Total estimated model params size (MB)");
  total_line(std::to_string(modules_in_train), "Modules in train mode");
  total_line(std::to_string(modules_in_eval), "Modules in eval mode");
  return table;
}

class ModelSummary final : public fulgur::Callback {
 public:
  FULGUR_OPTIONS(Options, (integer, max_depth, "Depth of nested modules to list; -1 all, 0 no summary", 1));
  explicit ModelSummary(const Options& options) : max_depth_(options.max_depth) {
    options.check(max_depth_ >= -1, "max_depth", "must be -1 (all levels), 0 (no summary) or a positive depth");
  }

  fulgur::HookSet hooks() const override {
    return max_depth_ == 0 ? 0 : static_cast<fulgur::HookSet>(fulgur::Hook::fit_start);
  }

  void on_fit_start(fulgur::TrainerContext& trainer) override {
    if (!trainer.is_global_zero()) return;
    fulgur::log::info(fmt::format("\n{}", summarize(trainer.model(), max_depth_)));
  }

  static std::string summarize(const torch::nn::Module& model, int64_t max_depth) {
    std::vector<Row> rows;
    collect_rows(model, "", 0, max_depth, rows);
    ParameterCounts counts = count_parameters(model);

    std::vector<std::string> index, names, types, params, modes;
    int64_t top_level_params = 0;
    for (size_t i = 0; i < rows.size(); ++i) {
      index.push_back(std::to_string(i));
      names.push_back(rows[i].name);
      types.push_back(rows[i].type);
      params.push_back(human_readable_count(rows[i].params));
      modes.push_back(rows[i].training ? "train" : "eval");
      if (rows[i].name.find('.') == std::string::npos) top_level_params += rows[i].params;
    }
    // Parameters registered on the root itself belong to no row; Lightning lists them apart.
    if (int64_t leftover = counts.total - top_level_params; leftover > 0) {
      index.push_back(" ");
      names.push_back("other params");
      types.push_back("n/a");
      params.push_back(human_readable_count(leftover));
      modes.push_back("n/a");
    }
    int64_t modules_in_train = 0, modules_in_eval = 0;
    for (const auto& module : model.modules(/*include_self=*/false))
      ++(module->is_training() ? modules_in_train : modules_in_eval);

    return format_table({{" ", index}, {"Name", names}, {"Type", types}, {"Params", params}, {"Mode", modes}}, counts,
                        modules_in_train, modules_in_eval);
  }

 private:
  int64_t max_depth_;
};

}  // namespace

FULGUR_PLUGIN(ModelSummary, "model_summary", "0.1.0",
              "Logs a table of the model's layers, parameter counts and size when fit starts")
