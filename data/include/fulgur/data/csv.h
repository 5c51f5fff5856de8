// CSV / TSV tables as a map-style dataset: numeric feature columns, categorical columns mapped to
// indices, one target column.
#pragma once

#include <fulgur/data/dataset.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace fulgur::data {

// The dtype of a numeric target column.
enum class CsvTarget {
  automatic,  // int64 when every value is an integer literal (class labels 0, 1, 2), as pandas reads it
  integer,    // int64; a value with a fraction or an exponent is a corrupt row
  floating,   // float32 (a regression target that happens to hold whole numbers)
};

struct CsvOptions {
  // Field separator; 0 (default): tab for *.tsv files, comma otherwise.
  CsvOptions& delimiter(char v) {
    delimiter_ = v;
    return *this;
  }
  // The column that becomes Sample::target ("" for none).
  CsvOptions& target(std::string v) {
    target_ = std::move(v);
    return *this;
  }
  // Columns whose values are names (mapped to indices in order of first appearance, unless the
  // vocabulary is fixed with categories()). Every other column must be numeric.
  CsvOptions& categorical(std::vector<std::string> v) {
    categorical_ = std::move(v);
    return *this;
  }
  // A fixed vocabulary for a categorical column (so that train and validation files map alike); a
  // value outside it is an error for that row.
  CsvOptions& categories(const std::string& column, std::vector<std::string> values) {
    categories_[column] = std::move(values);
    return *this;
  }
  // Only these feature columns, in this order (default: every column but the target).
  CsvOptions& columns(std::vector<std::string> v) {
    columns_ = std::move(v);
    return *this;
  }
  // The file has no header row: these are its columns' names, in file order (pandas'
  // `names=`). With skip_rows(1) they replace a header the file has.
  CsvOptions& column_names(std::vector<std::string> v) {
    column_names_ = std::move(v);
    return *this;
  }
  // Lines to skip at the top of the file before the header row (or, with column_names, before the
  // first data row): a title, a licence, comments (pandas' `skiprows=N`).
  CsvOptions& skip_rows(int64_t v) {
    skip_rows_ = v;
    return *this;
  }
  // The dtype of a numeric target (default: int64 when every value is an integer).
  CsvOptions& target_type(CsvTarget v) {
    target_type_ = v;
    return *this;
  }
  // Leave out rows that do not parse (counted in skipped()) instead of failing.
  CsvOptions& skip_corrupt(bool v) {
    skip_corrupt_ = v;
    return *this;
  }

  char delimiter_ = 0;
  std::string target_;
  std::vector<std::string> categorical_;
  std::map<std::string, std::vector<std::string>> categories_;
  std::vector<std::string> columns_;
  std::vector<std::string> column_names_;
  int64_t skip_rows_ = 0;
  CsvTarget target_type_ = CsvTarget::automatic;
  bool skip_corrupt_ = false;
};

// The whole table is parsed once, at construction (after skip_rows lines, a header row names the
// columns unless column_names() does), into tensors: Sample::input is float32 (numeric features,
// in column order), Sample::extra[0] is int64 (categorical features' indices) when there are
// categorical features, Sample::target is int64 for a categorical target and for a numeric one
// whose values are all integers (target_type), float32 otherwise. Fields may be quoted ("a, b", "" for a
// quote). A malformed row is a fulgur::Error naming file, line, row index and column.
class CsvDataset final : public Dataset {
 public:
  CsvDataset(std::filesystem::path file, CsvOptions options = {});
  int64_t size() const override;
  Sample get(int64_t index) const override;

  // Every column of the file, in file order (the header's, or column_names()).
  const std::vector<std::string>& columns() const { return header_; }
  const std::vector<std::string>& numeric_columns() const { return numeric_; }
  const std::vector<std::string>& categorical_columns() const { return categorical_; }
  // The vocabulary of a categorical column (feature or target): index i is categories(c)[i].
  const std::vector<std::string>& categories(const std::string& column) const;
  // Rows left out with skip_corrupt.
  int64_t skipped() const { return skipped_; }

 private:
  std::filesystem::path file_;
  std::vector<std::string> header_, numeric_, categorical_;
  std::map<std::string, std::vector<std::string>> vocab_;
  at::Tensor numeric_values_, categorical_values_, targets_;
  int64_t rows_ = 0, skipped_ = 0;
};

}  // namespace fulgur::data
