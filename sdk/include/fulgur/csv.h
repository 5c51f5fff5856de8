/// @file
/// CSV records as RFC 4180 writes them (SDK 1.1): one reader for every CSV Fulgur reads, the csv
/// logger's own metrics.csv when it resumes and the data library's CsvDataset.
#pragma once

#include <fulgur/export.h>

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace fulgur {

/// Reads one record of `text` starting at `pos` into `fields` and moves `pos` past it. Fields are
/// split at `delimiter`; the record ends at "\n", "\r\n" or the end of the text. A field that starts
/// with '"' is quoted: it may hold the delimiter and line breaks, and "" stands for one quote; a
/// quote anywhere else is an ordinary character. Returns false when a quoted field is still open at
/// the end of the text (`fields` then holds what was read). Call it while `pos < text.size()`.
FULGUR_SDK_API bool read_csv_record(std::string_view text, size_t& pos, char delimiter,
                                    std::vector<std::string>& fields);

/// `field` as one CSV field: quoted (with "" for each quote) when it holds the delimiter, a quote or
/// a line break, else as it is.
FULGUR_SDK_API std::string csv_field(std::string_view field, char delimiter = ',');

}  // namespace fulgur
