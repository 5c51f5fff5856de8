#include <fulgur/registry/metadata.h>
#include <fulgur/registry/toml_options.h>

namespace fulgur {

std::string toml_type_name(const toml::node& node) {
  switch (node.type()) {
    case toml::node_type::table:
      return "table";
    case toml::node_type::array:
      return "array";
    case toml::node_type::string:
      return "string";
    case toml::node_type::integer:
      return "integer";
    case toml::node_type::floating_point:
      return "float";
    case toml::node_type::boolean:
      return "boolean";
    case toml::node_type::date:
      return "date";
    case toml::node_type::time:
      return "time";
    case toml::node_type::date_time:
      return "date-time";
    default:
      return "nothing";
  }
}

std::optional<OptionValue> toml_to_option(const toml::node& node, OptionType type, std::string& found) {
  found = toml_type_name(node);
  switch (type) {
    case OptionType::boolean:
      if (auto v = node.value_exact<bool>()) return OptionValue{*v};
      return std::nullopt;
    case OptionType::integer:
      if (auto v = node.value_exact<int64_t>()) return OptionValue{*v};
      return std::nullopt;
    case OptionType::floating:
      if (node.is_floating_point()) return OptionValue{*node.value<double>()};
      if (node.is_integer()) return OptionValue{static_cast<double>(*node.value<int64_t>())};
      return std::nullopt;
    case OptionType::string:
    case OptionType::path:  // made absolute by the config, which knows the file that gave it
      if (auto v = node.value_exact<std::string>()) return OptionValue{*v};
      return std::nullopt;
    case OptionType::string_list: {
      const toml::array* array = node.as_array();
      if (!array) return std::nullopt;
      std::vector<std::string> out;
      for (const toml::node& element : *array) {
        auto v = element.value_exact<std::string>();
        if (!v) {
          found = "array containing " + toml_type_name(element);
          return std::nullopt;
        }
        out.push_back(*v);
      }
      return OptionValue{std::move(out)};
    }
    case OptionType::float_list: {
      const toml::array* array = node.as_array();
      if (!array) return std::nullopt;
      std::vector<double> out;
      for (const toml::node& element : *array) {
        if (!element.is_number()) {
          found = "array containing " + toml_type_name(element);
          return std::nullopt;
        }
        out.push_back(*element.value<double>());
      }
      return OptionValue{std::move(out)};
    }
  }
  return std::nullopt;
}

std::optional<OptionValue> parse_option_default(OptionType type, std::string_view toml_text) {
  std::string document = "v = ";
  document.append(toml_text);
  toml::table parsed;
  try {
    parsed = toml::parse(document);
  } catch (const toml::parse_error&) {
    return std::nullopt;
  }
  const toml::node* node = parsed.get("v");
  if (!node) return std::nullopt;
  std::string found;
  return toml_to_option(*node, type, found);
}

}  // namespace fulgur
