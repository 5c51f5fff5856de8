// The README's tabular example (examples/tabular_csv: the tabular_csv datamodule and tabular_mlp
// model plugins, built with fulgur_add_plugin into their own directory) as the tests drive it: a
// TOML written here, `fulgur` in a real process.
#pragma once

#include "test_support.h"

#include <map>
#include <string>
#include <vector>

namespace fulgur::test::tabular {

inline const fs::path kPlugins = FULGUR_TEST_TABULAR_PLUGIN_DIR;
inline const fs::path kIris = fs::path(FULGUR_TEST_SOURCE_DIR) / "examples/tabular_csv/data/iris.csv";

// The iris run: [trainer] (with `trainer_extra`), [model], [data] whose file is `file` as written
// in the TOML, then `extra` (loggers, callbacks).
inline std::string iris_toml(const std::string& file, int max_epochs = 2, const std::string& trainer_extra = "",
                             const std::string& extra = "") {
  return "[plugins]\npaths = [\"" + kPlugins.string() + "\"]\n\n[trainer]\nmax_epochs = " + std::to_string(max_epochs) +
         "\nseed = 1\nenable_progress_bar = false\nenable_model_summary = false\ndefault_root_dir = \"runs\"\n" +
         trainer_extra +
         "\n[model]\nname = \"tabular_mlp\"\nnum_features = 4\nnum_classes = 3\n\n[data]\nname = \"tabular_csv\"\nfile "
         "= \"" +
         file +
         "\"\nskip_rows = 1\ncolumns = [\"sepal_length\", \"sepal_width\", \"petal_length\", \"petal_width\", "
         "\"target\"]\n\n" +
         extra;
}

inline ProcessRun run_fulgur(const fs::path& cwd, std::vector<std::string> args) {
  args.insert(args.begin(), FULGUR_TEST_FULGUR_BIN);
  return run_process(args, {{"FULGUR_LOG_LEVEL", "info"}, {"FULGUR_PLUGIN_PATH", ""}}, cwd);
}

// Every file under `root` whose name contains `part`.
inline std::vector<fs::path> find_files(const fs::path& root, std::string_view part) {
  std::vector<fs::path> found;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return found;
  for (const auto& entry : fs::recursive_directory_iterator(root, ec))
    if (entry.is_regular_file(ec) && contains(entry.path().filename().string(), part)) found.push_back(entry.path());
  return found;
}

// The last non-empty value of `column` in a logger's metrics.csv.
inline std::string last_value(const fs::path& metrics_csv, const std::string& column) {
  const auto table = read_csv(metrics_csv);
  const auto it = table.find(column);
  REQUIRE_MESSAGE(it != table.end(), "no column " << column << " in " << metrics_csv.string());
  std::string last;
  for (const auto& v : it->second)
    if (!v.empty()) last = v;
  return last;
}

}  // namespace fulgur::test::tabular
