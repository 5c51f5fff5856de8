#include <fulgur/csv.h>
#include <fulgur/data/csv.h>
#include <fulgur/error.h>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <unordered_map>

namespace fulgur::data {

namespace {

// One record of one line (fulgur::read_csv_record: RFC 4180 quoting within the line); false for an
// unterminated quote, which makes that row corrupt rather than swallowing the lines after it.
bool split_record(const std::string& line, char delim, std::vector<std::string>& fields) {
  size_t pos = 0;
  return fulgur::read_csv_record(line, pos, delim, fields);
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\r") - b + 1);
}

// An integer literal ("3", "-12", "+7"): what pandas reads as int64.
bool parse_integer(const std::string& text, int64_t& out) {
  const std::string t = trim(text);
  if (t.empty()) return false;
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(t.c_str(), &end, 10);
  if (end != t.c_str() + t.size() || errno == ERANGE) return false;
  out = v;
  return true;
}

bool parse_number(const std::string& text, float& out) {
  const std::string t = trim(text);
  if (t.empty()) return false;
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(t.c_str(), &end);
  if (end != t.c_str() + t.size() || errno == ERANGE) return false;
  out = static_cast<float>(v);
  return true;
}

}  // namespace

CsvDataset::CsvDataset(std::filesystem::path file, CsvOptions options) : file_(std::move(file)) {
  std::ifstream in(file_, std::ios::binary);
  if (!in) throw Error(ErrorKind::io, fmt::format("{}: cannot open the CSV file", file_.string()));
  const char delim = options.delimiter_ != 0 ? options.delimiter_ : (file_.extension() == ".tsv" ? '\t' : ',');
  const std::string where = file_.string();

  if (options.skip_rows_ < 0)
    throw Error(ErrorKind::invalid_argument, fmt::format("{}: skip_rows = {} must be >= 0", where, options.skip_rows_));
  std::string line;
  std::vector<std::string> header, fields;
  int64_t line_no = 0;
  for (; line_no < options.skip_rows_; ++line_no)
    if (!std::getline(in, line))
      throw Error(ErrorKind::io,
                  fmt::format("{}: has {} lines, fewer than skip_rows = {}", where, line_no, options.skip_rows_));
  if (!options.column_names_.empty()) {
    header = options.column_names_;
  } else {
    ++line_no;
    if (!std::getline(in, line) || !split_record(line, delim, header))
      throw Error(ErrorKind::io,
                  fmt::format("{}:{}: no header row (this line must name the columns; for a file without one, "
                              "give the names with column_names)",
                              where, line_no));
  }
  const std::string header_at =
      options.column_names_.empty() ? fmt::format("{}:{}", where, line_no) : fmt::format("{} column_names", where);
  for (auto& h : header) h = trim(h);
  std::unordered_map<std::string, size_t> column;
  for (size_t i = 0; i < header.size(); ++i) {
    if (header[i].empty()) throw Error(ErrorKind::io, fmt::format("{}: column {} has no name", header_at, i + 1));
    if (!column.emplace(header[i], i).second)
      throw Error(ErrorKind::io, fmt::format("{}: column '{}' appears twice", header_at, header[i]));
  }
  auto index_of = [&](const std::string& name, const char* what) {
    auto it = column.find(name);
    if (it == column.end())
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("{}: no {} column '{}' (columns: {})", where, what, name, fmt::join(header, ", ")));
    return it->second;
  };
  const bool has_target = !options.target_.empty();
  const size_t target_col = has_target ? index_of(options.target_, "target") : 0;
  const bool target_categorical = has_target && std::find(options.categorical_.begin(), options.categorical_.end(),
                                                          options.target_) != options.categorical_.end();
  std::vector<std::string> features = options.columns_;
  if (features.empty())
    for (const auto& h : header)
      if (!has_target || h != options.target_) features.push_back(h);
  std::vector<size_t> num_cols, cat_cols;
  for (const auto& f : features) {
    const size_t c = index_of(f, "feature");
    const bool cat =
        std::find(options.categorical_.begin(), options.categorical_.end(), f) != options.categorical_.end();
    (cat ? cat_cols : num_cols).push_back(c);
    (cat ? categorical_ : numeric_).push_back(f);
  }
  for (const auto& c : options.categorical_) index_of(c, "categorical");

  // Vocabularies: fixed ones from the options, the others grow in order of first appearance.
  std::vector<std::unordered_map<std::string, int64_t>> lookup(header.size());
  std::vector<bool> fixed(header.size(), false);
  for (const auto& [name, values] : options.categories_) {
    const size_t c = index_of(name, "categorical");
    fixed[c] = true;
    for (const auto& v : values) lookup[c].emplace(v, static_cast<int64_t>(lookup[c].size()));
    vocab_[name] = values;
  }
  auto category = [&](size_t c, const std::string& raw, int64_t& out) {
    const std::string v = trim(raw);
    auto it = lookup[c].find(v);
    if (it != lookup[c].end()) {
      out = it->second;
      return true;
    }
    if (fixed[c]) return false;
    out = static_cast<int64_t>(lookup[c].size());
    lookup[c].emplace(v, out);
    vocab_[header[c]].push_back(v);
    return true;
  };

  std::vector<float> nums;
  std::vector<int64_t> cats, cat_targets, int_targets;
  std::vector<float> num_targets;
  // A numeric target stays integral while every value is an integer (CsvTarget::automatic).
  bool integral_target = options.target_type_ != CsvTarget::floating;
  std::vector<float> row_nums(num_cols.size());
  std::vector<int64_t> row_cats(cat_cols.size());
  while (std::getline(in, line)) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (trim(line).empty()) continue;
    // Everything about a row is checked before any of it is kept, so a skipped row leaves nothing.
    std::string problem;
    int64_t cat_target = 0, int_target = 0;
    float num_target = 0;
    bool row_integral = false;
    if (!split_record(line, delim, fields)) {
      problem = "unterminated quote";
    } else if (fields.size() != header.size()) {
      problem = fmt::format("{} fields, the header has {}", fields.size(), header.size());
    } else {
      for (size_t k = 0; k < num_cols.size() && problem.empty(); ++k)
        if (!parse_number(fields[num_cols[k]], row_nums[k]))
          problem = fmt::format("column '{}': '{}' is not a number", header[num_cols[k]], fields[num_cols[k]]);
      for (size_t k = 0; k < cat_cols.size() && problem.empty(); ++k)
        if (!category(cat_cols[k], fields[cat_cols[k]], row_cats[k]))
          problem = fmt::format("column '{}': '{}' is not one of its categories", header[cat_cols[k]],
                                trim(fields[cat_cols[k]]));
      if (has_target && problem.empty()) {
        if (!target_categorical) row_integral = parse_integer(fields[target_col], int_target);
        if (target_categorical ? !category(target_col, fields[target_col], cat_target)
                               : !parse_number(fields[target_col], num_target))
          problem = fmt::format("target column '{}': '{}' is {}", options.target_, fields[target_col],
                                target_categorical ? "not one of its categories" : "not a number");
        else if (!target_categorical && !row_integral && options.target_type_ == CsvTarget::integer)
          problem = fmt::format("target column '{}': '{}' is not an integer (target_type integer)", options.target_,
                                trim(fields[target_col]));
      }
    }
    if (!problem.empty()) {
      if (options.skip_corrupt_) {
        ++skipped_;
        continue;
      }
      throw Error(ErrorKind::io, fmt::format("{}:{}: row {}: {}", where, line_no, rows_ + skipped_, problem));
    }
    nums.insert(nums.end(), row_nums.begin(), row_nums.end());
    cats.insert(cats.end(), row_cats.begin(), row_cats.end());
    if (has_target && target_categorical) cat_targets.push_back(cat_target);
    if (has_target && !target_categorical) {
      num_targets.push_back(num_target);
      int_targets.push_back(int_target);
      integral_target = integral_target && row_integral;
    }
    ++rows_;
  }
  if (in.bad()) throw Error(ErrorKind::io, fmt::format("{}: read error after line {}", where, line_no));

  numeric_values_ = at::tensor(nums, at::kFloat).reshape({rows_, static_cast<int64_t>(num_cols.size())});
  if (!cat_cols.empty())
    categorical_values_ = at::tensor(cats, at::kLong).reshape({rows_, static_cast<int64_t>(cat_cols.size())});
  if (has_target)
    targets_ = target_categorical ? at::tensor(cat_targets, at::kLong)
               : integral_target  ? at::tensor(int_targets, at::kLong)
                                  : at::tensor(num_targets, at::kFloat);
  header_ = std::move(header);
}

int64_t CsvDataset::size() const { return rows_; }

Sample CsvDataset::get(int64_t index) const {
  if (index < 0 || index >= rows_)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("{}: row {} out of range ({} rows)", file_.string(), index, rows_));
  Sample s;
  s.input = numeric_values_[index];
  if (categorical_values_.defined()) s.extra.push_back(categorical_values_[index]);
  if (targets_.defined()) s.target = targets_[index];
  return s;
}

const std::vector<std::string>& CsvDataset::categories(const std::string& column) const {
  auto it = vocab_.find(column);
  if (it == vocab_.end())
    throw Error(ErrorKind::invalid_argument,
                fmt::format("{}: '{}' is not a categorical column", file_.string(), column));
  return it->second;
}

}  // namespace fulgur::data
