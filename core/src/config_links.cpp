// [links]: [model] keys whose values come from the datamodule (LightningCLI's link_arguments).
#include <fulgur/config.h>
#include <fulgur/data_module.h>
#include <fulgur/data_values.h>
#include <fulgur/error.h>
#include <fulgur/extension.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <type_traits>
#include <variant>

namespace fulgur {

namespace {

// `value` as an option of `type`, or nullopt when it is another kind of value. An integer fits a
// float key (as in TOML); nothing else converts.
std::optional<OptionValue> as_type(const OptionValue& value, OptionType type) {
  return std::visit(
      [&](const auto& v) -> std::optional<OptionValue> {
        using V = std::decay_t<decltype(v)>;
        switch (type) {
          case OptionType::boolean:
            if constexpr (std::is_same_v<V, bool>) return v;
            break;
          case OptionType::integer:
            if constexpr (std::is_same_v<V, int64_t>) return v;
            break;
          case OptionType::floating:
            if constexpr (std::is_same_v<V, double>) return v;
            if constexpr (std::is_same_v<V, int64_t>) return static_cast<double>(v);
            break;
          case OptionType::string:
          case OptionType::path:
            if constexpr (std::is_same_v<V, std::string>) return v;
            break;
          case OptionType::string_list:
            if constexpr (std::is_same_v<V, std::vector<std::string>>) return v;
            break;
          case OptionType::float_list:
            if constexpr (std::is_same_v<V, std::vector<double>>) return v;
            break;
        }
        return std::nullopt;
      },
      value);
}

}  // namespace

void apply_links(Config& config, DataModule& data) {
  if (config.links.empty()) return;
  DataValues* values = find_extension<DataValues>(data);
  const std::string data_name = config.data_plugin.name.empty()
                                    ? std::string("the datamodule")
                                    : fmt::format("datamodule '{}'", config.data_plugin.name);
  for (const ConfigLink& link : config.links) {
    const std::string what =
        fmt::format("{}: [links] model.{} = \"data.{}\"", link.where.str(), link.target, link.source);
    std::optional<OptionValue> value;
    if (values) value = values->data_value(link.source);
    // LightningCLI's apply_on="parse": a [data] option of that name.
    if (!value && config.data.contains(link.source)) value = config.data.values().at(link.source);
    if (!value) {
      std::string offers =
          values ? fmt::format("it offers {}", values->data_value_names().empty()
                                                   ? std::string("none")
                                                   : fmt::format("{}", fmt::join(values->data_value_names(), ", ")))
                 : "it offers no values (a DataModule offers them through fulgur::DataValues, "
                   "fulgur/data_values.h)";
      std::vector<std::string> options;
      for (const auto& [key, v] : config.data.values()) options.push_back(key);
      throw Error(ErrorKind::config,
                  fmt::format("{}: {} has no value '{}': {}; [data] options: {}", what, data_name, link.source, offers,
                              options.empty() ? std::string("none") : fmt::format("{}", fmt::join(options, ", "))));
    }
    std::optional<OptionValue> typed = as_type(*value, link.type);
    if (!typed)
      throw Error(ErrorKind::config, fmt::format("{}: the model's '{}' is {}, {} gives {}", what, link.target,
                                                 to_string(link.type), data_name, format_option_value(*value)));
    config.model.set(link.target, *typed);
    if (!config.model_plugin.name.empty()) config.model_plugin.options.set(link.target, *typed);
  }
}

}  // namespace fulgur
