// Values a DataModule knows once it exists (number of features, classes, vocabulary size) and
// offers by name, so that the config can link them to model hyperparameters instead of writing
// them twice: LightningCLI's link_arguments(..., apply_on="instantiate").
//
//   [links]
//   model.num_features = "data.num_features"   # [model] num_features := the datamodule's value
//
//   class TabularCsv : public fulgur::WithExtensions<fulgur::DataModule, fulgur::DataValues> {
//     std::optional<fulgur::OptionValue> data_value(std::string_view name) const override {
//       if (name == "num_features") return fulgur::OptionValue{features_};
//       return std::nullopt;
//     }
//     std::vector<std::string> data_value_names() const override { return {"num_features"}; }
//   };
#pragma once

#include <fulgur/options.h>

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace fulgur {

/// An extension of fulgur::DataModule (fulgur/extension.h). The host asks after the DataModule's
/// constructor and before the model is created; a value the DataModule derives from its files
/// must therefore be known by then (read them in the constructor, or from a small index).
class DataValues {
 public:
  /// The extension's id for DataModule::extension().
  static constexpr std::string_view kExtensionId = "fulgur.datamodule.values/1";
  /// The value called `name` (an integer for sizes), or nullopt when there is none by that name.
  virtual std::optional<OptionValue> data_value(std::string_view name) const = 0;
  /// Every name data_value answers, for messages.
  virtual std::vector<std::string> data_value_names() const = 0;

 protected:
  ~DataValues() = default;
};

}  // namespace fulgur
