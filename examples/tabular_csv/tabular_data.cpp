// A datamodule plugin for a CSV table (README, "Tabular data"): the file's path resolves against
// the TOML that names it, a header-less file gets its column names from the TOML, a random
// train/validation split with a seed (torch's random_split), features standardised with the
// training split's statistics. It offers num_features and num_classes (fulgur::DataValues), which
// [links] hands to the model.
#include <fulgur/data.h>
#include <fulgur/data/csv.h>
#include <fulgur/data/data_loader.h>
#include <fulgur/data/standardize.h>
#include <fulgur/data/subset.h>
#include <fulgur/data_values.h>
#include <fulgur/plugin.h>

#include <algorithm>

namespace d = fulgur::data;

class TabularCsv : public fulgur::WithExtensions<fulgur::DataModule, fulgur::DataValues> {
 public:
  FULGUR_OPTIONS(Options, (path, file, "The CSV file (relative to the TOML that names it)"),
                 (string_list, columns, "Column names of a file without a header row ([]: the file's header)", []),
                 (integer, skip_rows, "Lines to skip at the top of the file", 0),
                 (string, target, "The target column (integer class labels)", "target"),
                 (floating, val_fraction, "Share of the rows held out for validation", 0.2),
                 (integer, split_seed, "Seed of the train/validation split", 42),
                 (boolean, standardize, "Standardise features with the training split's mean and std", true),
                 (integer, batch_size, "Rows per batch", 16));

  explicit TabularCsv(const Options& o) : batch_size_(o.batch_size) {
    o.check(o.val_fraction > 0 && o.val_fraction < 1, "val_fraction", "must be in (0, 1)");
    auto table = std::make_shared<d::CsvDataset>(
        o.file, d::CsvOptions().column_names(o.columns).skip_rows(o.skip_rows).target(o.target));
    auto splits = d::random_split(table, {1 - o.val_fraction, o.val_fraction}, static_cast<uint64_t>(o.split_seed));
    train_ = splits[0];
    val_ = splits[1];
    if (o.standardize) transform_ = d::standardize(d::feature_stats(*train_));
    num_features_ = static_cast<int64_t>(table->numeric_columns().size());
    for (int64_t i = 0; i < table->size(); ++i)
      num_classes_ = std::max(num_classes_, table->get(i).target.item<int64_t>() + 1);
  }
  // What [links] can hand to the model: `model.num_features = "data.num_features"`.
  std::optional<fulgur::OptionValue> data_value(std::string_view name) const override {
    if (name == "num_features") return fulgur::OptionValue{num_features_};
    if (name == "num_classes") return fulgur::OptionValue{num_classes_};
    return std::nullopt;
  }
  std::vector<std::string> data_value_names() const override { return {"num_features", "num_classes"}; }
  std::unique_ptr<fulgur::BatchLoader> train_loader() override { return loader(train_, /*shuffle=*/true); }
  std::unique_ptr<fulgur::BatchLoader> val_loader() override { return loader(val_, /*shuffle=*/false); }

 private:
  std::unique_ptr<fulgur::BatchLoader> loader(std::shared_ptr<const d::Dataset> rows, bool shuffle) const {
    return d::make_data_loader(std::move(rows),
                               d::DataLoaderOptions().batch_size(batch_size_).shuffle(shuffle).transform(transform_));
  }
  int64_t batch_size_, num_features_ = 0, num_classes_ = 0;
  std::shared_ptr<const d::Dataset> train_, val_;
  d::TransformPtr transform_;
};

FULGUR_PLUGIN(TabularCsv, "tabular_csv", "1.0.0", "A CSV table split into train and validation sets")
