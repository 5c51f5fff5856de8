// Tabular data from the user's side (issue #42 items 3, 4 and 5): a CSV file without a header row,
// named from a TOML in another directory than the one `fulgur` runs in (path options), the model's
// sizes linked to the datamodule's, the README's example as written, and the data library's pieces
// (CSV reader, random_split, standardize) against pandas / torch / scikit-learn.
#include "tabular_example.h"

#include <fulgur/checkpoint_io.h>
#include <fulgur/data/csv.h>
#include <fulgur/data/standardize.h>
#include <fulgur/data/subset.h>
#include <fulgur/error.h>

#include <ATen/ATen.h>
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <fstream>

namespace {

using namespace fulgur::test;
using namespace fulgur::test::tabular;
namespace d = fulgur::data;

// `text` with every `from` replaced by `to`.
std::string replaced(std::string text, const std::string& from, const std::string& to) {
  for (size_t at = text.find(from); at != std::string::npos; at = text.find(from, at + to.size()))
    text.replace(at, from.size(), to);
  return text;
}

std::string saved_config(const fs::path& runs) {
  const auto saved = find_files(runs, "config.toml");
  REQUIRE_MESSAGE(saved.size() == 1, "expected one config.toml under " << runs.string());
  return read_bytes(saved[0]);
}

}  // namespace

TEST_CASE("a path option resolves against the TOML that gave it and is saved absolute, from any directory") {
  TempDir dir;
  // project/conf/iris.toml names ../data/iris.csv; fulgur runs in an unrelated directory.
  const fs::path data = dir.subdir("project/data"), conf = dir.subdir("project/conf"), elsewhere = dir.subdir("cwd");
  fs::copy_file(kIris, data / "iris.csv");
  write_bytes(conf / "iris.toml", iris_toml("../data/iris.csv"));
  const ProcessRun run = run_fulgur(elsewhere, {"fit", "--config", (conf / "iris.toml").string()});
  REQUIRE_MESSAGE(run.exit_code == 0, run.output);
  // default_root_dir = "runs" is relative to the TOML too (Fulgur's own paths always were).
  const std::string saved = saved_config(conf / "runs");
  FULGUR_CHECK_CONTAINS(saved, "file = \"" + (data / "iris.csv").string() + "\"");

  // The saved config reruns from yet another directory: its path is absolute.
  write_bytes(dir / "saved.toml", saved);
  const ProcessRun again = run_fulgur(dir.subdir("other"), {"config", "check", (dir / "saved.toml").string()});
  CHECK_MESSAGE(again.exit_code == 0, again.output);

  // A command-line override is relative to the working directory, as a shell user means it.
  const ProcessRun flag =
      run_fulgur(dir.path() / "project", {"fit", "--config", (conf / "iris.toml").string(), "--data.file=data/iris.csv",
                                          "--trainer.default_root_dir=" + (dir / "flag_runs").string()});
  REQUIRE_MESSAGE(flag.exit_code == 0, flag.output);
  FULGUR_CHECK_CONTAINS(saved_config(dir / "flag_runs"), "file = \"" + (data / "iris.csv").string() + "\"");

  // A file that is not there is named absolute, with the TOML line that gave it.
  write_bytes(conf / "missing.toml", iris_toml("../data/missing.csv"));
  const ProcessRun missing = run_fulgur(elsewhere, {"fit", "--config", (conf / "missing.toml").string()});
  CHECK(missing.exit_code != 0);
  FULGUR_CHECK_CONTAINS(missing.output, (data / "missing.csv").string());
}

TEST_CASE("the README's tabular example trains on Iris from its header-less CSV") {
  TempDir dir;
  const fs::path toml = fs::path(FULGUR_TEST_SOURCE_DIR) / "examples/tabular_csv/iris.toml";
  // As the README runs it (FULGUR_PLUGIN_PATH naming the example's build directory); the runs land
  // here, not in the source tree.
  const ProcessRun run =
      run_process({FULGUR_TEST_FULGUR_BIN, "fit", "--config", toml.string(),
                   "--trainer.default_root_dir=" + (dir / "runs").string()},
                  {{"FULGUR_LOG_LEVEL", "info"}, {"FULGUR_PLUGIN_PATH", kPlugins.string()}}, dir.path());
  REQUIRE_MESSAGE(run.exit_code == 0, run.output);
  const auto metrics = find_files(dir / "runs", "metrics.csv");
  REQUIRE(metrics.size() == 1);
  const double accuracy = std::stod(last_value(metrics[0], "val/acc"));
  CHECK_MESSAGE(accuracy >= 0.9, "val/acc " << accuracy);
}

TEST_CASE("[links] hands the datamodule's sizes to the model: features and classes written once") {
  TempDir dir;
  // 6 features, 4 classes: not the model's iris sizes, so a model built without the links fails.
  std::string table;
  for (int i = 0; i < 80; ++i) {
    const int label = i % 4;
    for (int f = 0; f < 6; ++f) table += fmt::format("{},", (f == label ? 3.0 : 0.0) + 0.1 * ((i * 7 + f) % 5));
    table += std::to_string(label) + "\n";
  }
  write_bytes(dir / "six.csv", table);
  const std::string links =
      "[links]\nmodel.num_features = \"data.num_features\"\nmodel.num_classes = \"data.num_classes\"\n";
  std::string toml = iris_toml("six.csv", 2, "", links);
  toml = replaced(toml, "num_features = 4\nnum_classes = 3\n", "");
  toml = replaced(
      toml,
      "skip_rows = 1\ncolumns = [\"sepal_length\", \"sepal_width\", \"petal_length\", \"petal_width\", \"target\"]",
      "columns = [\"a\", \"b\", \"c\", \"d\", \"e\", \"f\", \"target\"]");
  write_bytes(dir / "six.toml", toml);
  const ProcessRun check = run_fulgur(dir.path(), {"config", "check", (dir / "six.toml").string()});
  CHECK_MESSAGE(check.exit_code == 0, check.output);
  const ProcessRun run = run_fulgur(dir.path(), {"fit", "--config", (dir / "six.toml").string()});
  REQUIRE_MESSAGE(run.exit_code == 0, run.output);
  // The model's hyperparameters as logged hold the linked values; the saved config keeps the links.
  const auto checkpoints = find_files(dir / "runs", ".ckpt");
  REQUIRE(!checkpoints.empty());
  const auto hp =
      fulgur::read_checkpoint_file(checkpoints[0].string()).toGenericDict().at("hyper_parameters").toGenericDict();
  CHECK(hp.at("num_features").toInt() == 6);
  CHECK(hp.at("num_classes").toInt() == 4);
  const std::string saved = saved_config(dir / "runs");
  FULGUR_CHECK_CONTAINS(saved, "\n[links]\n");
  FULGUR_CHECK_CONTAINS(saved, "\n\"model.num_features\" = \"data.num_features\"\n");
  FULGUR_CHECK_CONTAINS(saved, "\n\"model.num_classes\" = \"data.num_classes\"\n");
  write_bytes(dir / "saved.toml", saved);
  const ProcessRun again = run_fulgur(dir.path(), {"config", "check", (dir / "saved.toml").string()});
  CHECK_MESSAGE(again.exit_code == 0, again.output);

  // A name the datamodule does not offer is named with what it does offer; a key given twice too.
  std::string typo = toml;
  typo = replaced(typo, "\"data.num_classes\"", "\"data.classes\"");
  write_bytes(dir / "typo.toml", typo);
  const ProcessRun wrong = run_fulgur(dir.path(), {"config", "check", (dir / "typo.toml").string()});
  CHECK(wrong.exit_code != 0);
  FULGUR_CHECK_CONTAINS(wrong.output, "has no value 'classes': it offers num_features, num_classes");
  std::string twice = toml;
  twice = replaced(twice, "name = \"tabular_mlp\"\n", "name = \"tabular_mlp\"\nnum_classes = 4\n");
  write_bytes(dir / "twice.toml", twice);
  const ProcessRun both = run_fulgur(dir.path(), {"config", "check", (dir / "twice.toml").string()});
  CHECK(both.exit_code != 0);
  FULGUR_CHECK_CONTAINS(both.output, "'num_classes' is also linked from num_classes");
}

TEST_CASE("data: a header-less CSV with given column names or skipped lines, integer targets kept int64") {
  TempDir dir;
  write_bytes(dir / "plain.csv", "1.5,2,0\n3,4.25,2\n-1,0,1\n");
  d::CsvDataset plain(dir / "plain.csv", d::CsvOptions().column_names({"a", "b", "y"}).target("y"));
  REQUIRE(plain.size() == 3);  // the first line is data, not a header
  CHECK((plain.columns() == std::vector<std::string>{"a", "b", "y"}));
  CHECK(plain.get(0).input.equal(at::tensor(std::vector<float>{1.5f, 2.0f})));
  CHECK((plain.get(1).target.scalar_type() == at::kLong));  // class labels, as pandas reads them
  CHECK(plain.get(1).target.item<int64_t>() == 2);

  // skip_rows: a title line, then the header.
  write_bytes(dir / "titled.csv", "exported 2026-12-05\nx,y\n0.5,1\n2,3.5\n");
  d::CsvDataset titled(dir / "titled.csv", d::CsvOptions().skip_rows(1).target("y"));
  REQUIRE(titled.size() == 2);
  CHECK((titled.get(0).target.scalar_type() == at::kFloat));  // 3.5: a regression target
  CHECK(titled.get(1).target.item<float>() == 3.5f);
  d::CsvDataset floats(dir / "plain.csv",
                       d::CsvOptions().column_names({"a", "b", "y"}).target("y").target_type(d::CsvTarget::floating));
  CHECK((floats.get(1).target.scalar_type() == at::kFloat));

  // Iris as scikit-learn ships it: a first line that is not a header, integer classes. pandas
  // with the same arguments reads the same values.
  const std::vector<std::string> names{"sl", "sw", "pl", "pw", "target"};
  d::CsvDataset iris(kIris, d::CsvOptions().skip_rows(1).column_names(names).target("target"));
  REQUIRE(iris.size() == 150);
  CHECK(iris.get(149).target.item<int64_t>() == 2);
  CHECK(iris.get(0).input.equal(at::tensor(std::vector<float>{5.1f, 3.5f, 1.4f, 0.2f})));
  const auto [status, output] =
      run_command(fmt::format("{} -c \"import pandas as pd; df = pd.read_csv('{}', skiprows=1, header=None); "
                              "print(df.shape[0], df[4].dtype, df[4].sum())\"",
                              FULGUR_TEST_PYTHON, kIris.string()));
  REQUIRE_MESSAGE(status == 0, output);
  int64_t sum = 0;
  for (int64_t i = 0; i < iris.size(); ++i) sum += iris.get(i).target.item<int64_t>();
  FULGUR_CHECK_CONTAINS(output, fmt::format("150 int64 {}", sum));

  // Too few lines to skip, and a header-less file without names, say what to do.
  FULGUR_CHECK_CONTAINS(error_from([&] { d::CsvDataset(dir / "plain.csv", d::CsvOptions().skip_rows(9)); }).what(),
                        "fewer than skip_rows = 9");
  write_bytes(dir / "empty.csv", "");
  FULGUR_CHECK_CONTAINS(error_from([&] { d::CsvDataset(dir / "empty.csv", d::CsvOptions()); }).what(),
                        "give the names with column_names");
}

TEST_CASE("data: random_split gives torch.utils.data.random_split's subsets, standardize StandardScaler's") {
  TempDir dir;
  const std::vector<std::string> names{"sl", "sw", "pl", "pw", "target"};
  auto iris = std::make_shared<d::CsvDataset>(kIris, d::CsvOptions().skip_rows(1).column_names(names).target("target"));
  const auto by_fraction = d::random_split(iris, {0.8, 0.2}, 42);
  const auto by_count = d::random_split(iris, {100, 30, 20}, 7);
  REQUIRE(by_fraction.size() == 2);
  CHECK(by_fraction[0]->size() == 120);
  CHECK(by_fraction[1]->size() == 30);
  CHECK(by_count[2]->size() == 20);
  // The subsets' first rows are the table's rows at those indices.
  CHECK(by_fraction[1]->get(0).input.equal(iris->get(by_fraction[1]->indices()[0]).input));

  const d::FeatureStats stats = d::feature_stats(*by_fraction[0]);
  const d::TransformPtr standardize = d::standardize(stats);
  d::SampleRng rng(0);
  const at::Tensor first = standardize->apply(by_fraction[1]->get(0), rng).input;
  CHECK((first.scalar_type() == at::kFloat));

  const std::string script = fmt::format(R"(
import numpy as np, torch
from torch.utils.data import random_split
from sklearn.preprocessing import StandardScaler
X = np.loadtxt("{}", delimiter=",", skiprows=1, dtype=np.float32)[:, :4]
a, b = random_split(range(150), [0.8, 0.2], generator=torch.Generator().manual_seed(42))
c = random_split(range(150), [100, 30, 20], generator=torch.Generator().manual_seed(7))
print("frac", " ".join(map(str, b.indices)))
print("count", " ".join(map(str, c[2].indices)))
s = StandardScaler().fit(X[a.indices].astype(np.float64))
print("mean", " ".join(repr(float(v)) for v in s.mean_))
print("scale", " ".join(repr(float(v)) for v in s.scale_))
print("first", " ".join(repr(float(v)) for v in s.transform(X[b.indices[:1]].astype(np.float64)).astype(np.float32)[0]))
)",
                                         kIris.string());
  std::ofstream(dir / "split.py") << script;
  const auto [status, output] = run_command(fmt::format("{} {}", FULGUR_TEST_PYTHON, (dir / "split.py").string()));
  REQUIRE_MESSAGE(status == 0, output);
  auto line = [&](const std::string& key) {
    const size_t at = output.find(key + " ");
    REQUIRE_MESSAGE(at != std::string::npos, output);
    const size_t start = at + key.size() + 1;
    std::vector<double> values;
    std::stringstream in(output.substr(start, output.find('\n', start) - start));
    for (double v; in >> v;) values.push_back(v);
    return values;
  };
  auto as_doubles = [](const std::vector<int64_t>& v) { return std::vector<double>(v.begin(), v.end()); };
  CHECK(as_doubles(by_fraction[1]->indices()) == line("frac"));
  CHECK(as_doubles(by_count[2]->indices()) == line("count"));
  const auto mean = line("mean"), scale = line("scale"), expected_first = line("first");
  REQUIRE(mean.size() == 4);
  for (size_t i = 0; i < 4; ++i) {
    CHECK(stats.mean[i] == doctest::Approx(mean[i]).epsilon(1e-12));
    CHECK(stats.std[i] == doctest::Approx(scale[i]).epsilon(1e-12));
    CHECK(first[static_cast<int64_t>(i)].item<float>() == doctest::Approx(expected_first[i]).epsilon(1e-6));
  }

  FULGUR_CHECK_CONTAINS(error_from([&] { d::random_split(iris, {100, 10}, 0); }).what(), "add up to 110 samples");
}
