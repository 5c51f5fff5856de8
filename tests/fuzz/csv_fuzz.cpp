// Fuzz target: CSV. The SDK's record reader (read_csv_record) on the raw text, checked against
// its writer: every complete record, written back with csv_field, must read as the same fields.
// Then the data library's CsvDataset on the same text (header, numeric and categorical columns,
// target) and every row it yields. The first byte picks the delimiter and the options.
#include <fulgur/csv.h>
#include <fulgur/data/csv.h>
#include <fulgur/error.h>

#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_targets.h"
#include "memory_file.h"

namespace fulgur::fuzz {

namespace {

void check_round_trip(std::string_view text, char delimiter) {
  std::vector<std::string> fields, again;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t before = pos;
    const bool complete = read_csv_record(text, pos, delimiter, fields);
    if (pos <= before || pos > text.size()) throw std::logic_error("read_csv_record did not advance");
    if (!complete) continue;
    std::string line;
    for (size_t i = 0; i < fields.size(); ++i) {
      if (i) line += delimiter;
      line += csv_field(fields[i], delimiter);
    }
    line += '\n';
    size_t p = 0;
    if (!read_csv_record(line, p, delimiter, again) || again != fields || p != line.size())
      throw std::logic_error("csv_field + read_csv_record do not round-trip a record");
  }
}

}  // namespace

int csv(const uint8_t* data, size_t size) {
  static MemoryFile file("fulgur-fuzz-csv");
  if (size == 0) return 0;
  static constexpr char kDelimiters[] = {',', '\t', ';', '|'};
  const char delimiter = kDelimiters[data[0] & 3];
  const bool skip_corrupt = data[0] & 4;
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  check_round_trip(text, delimiter);

  data::CsvOptions options;
  options.delimiter(delimiter).skip_corrupt(skip_corrupt).categorical({"c", "label"});
  if (data[0] & 8) options.target("label");
  if (data[0] & 16) options.categories("c", {"a", "b"});
  if (data[0] & 32) options.columns({"x", "c"});
  try {
    data::CsvDataset dataset(file.set(data + 1, size - 1), options);
    for (int64_t i = 0; i < dataset.size(); ++i) {
      data::Sample s = dataset.get(i);
      (void)s.input.numel();
    }
  } catch (const Error&) {
  }
  return 0;
}

}  // namespace fulgur::fuzz

FULGUR_FUZZ_ENTRY(fulgur::fuzz::csv)
