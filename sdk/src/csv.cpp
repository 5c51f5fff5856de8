#include <fulgur/csv.h>

namespace fulgur {

bool read_csv_record(std::string_view text, size_t& pos, char delimiter, std::vector<std::string>& fields) {
  fields.clear();
  std::string field;
  bool quoted = false;
  while (pos < text.size()) {
    const char c = text[pos++];
    if (quoted) {
      if (c != '"') {
        field += c;
      } else if (pos < text.size() && text[pos] == '"') {
        field += '"';
        ++pos;
      } else {
        quoted = false;
      }
    } else if (c == '"' && field.empty()) {
      quoted = true;
    } else if (c == delimiter) {
      fields.push_back(std::move(field));
      field.clear();
    } else if (c == '\n') {
      break;
    } else if (c == '\r' && pos < text.size() && text[pos] == '\n') {
      ++pos;
      break;
    } else {
      field += c;
    }
  }
  fields.push_back(std::move(field));
  return !quoted;
}

std::string csv_field(std::string_view field, char delimiter) {
  if (field.find_first_of(std::string{'"', '\n', '\r', delimiter}) == std::string_view::npos) return std::string(field);
  std::string quoted = "\"";
  for (const char c : field) {
    if (c == '"') quoted += '"';
    quoted += c;
  }
  return quoted + '"';
}

}  // namespace fulgur
