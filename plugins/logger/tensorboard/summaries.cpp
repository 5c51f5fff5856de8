#include "summaries.h"

#include <charconv>
#include <cmath>
#include <limits>

namespace fulgur::tensorboard {

namespace {

// Event fields.
constexpr uint32_t kEventWallTime = 1, kEventStep = 2, kEventSummary = 5;
// Summary / Summary.Value / SummaryMetadata / PluginData fields.
constexpr uint32_t kSummaryValue = 1;
constexpr uint32_t kValueTag = 1, kValueSimpleValue = 2, kValueTensor = 8, kValueMetadata = 9;
constexpr uint32_t kMetadataPluginData = 1, kMetadataDataClass = 4;
constexpr uint32_t kPluginName = 1, kPluginContent = 2;
constexpr uint64_t kDataClassTensor = 2;
// TensorProto fields; DT_STRING.
constexpr uint32_t kTensorDtype = 1, kTensorShape = 2, kTensorStringVal = 8;
constexpr uint64_t kDtString = 7;
// hparams plugin: HParamsPluginData, Experiment, HParamInfo, MetricInfo, MetricName,
// SessionStartInfo, SessionEndInfo, google.protobuf.Value.
constexpr uint32_t kPluginDataVersion = 1, kPluginDataExperiment = 2, kPluginDataSessionStart = 3,
                   kPluginDataSessionEnd = 4;
constexpr uint32_t kExperimentTimeCreated = 3, kExperimentHparamInfos = 4, kExperimentMetricInfos = 5;
constexpr uint32_t kHparamInfoName = 1, kHparamInfoType = 4;
constexpr uint64_t kHparamTypeString = 1, kHparamTypeBool = 2, kHparamTypeFloat64 = 3;
constexpr uint32_t kMetricInfoName = 1, kMetricNameTag = 2;
constexpr uint32_t kSessionStartHparams = 1, kSessionStartTime = 5;
constexpr uint32_t kSessionEndStatus = 1, kSessionEndTime = 2;
constexpr uint32_t kMapKey = 1, kMapValue = 2;
constexpr uint32_t kValueNumber = 2, kValueString = 3, kValueBool = 4;

// TOML basic-string escapes that hyperparameter values may hold.
std::string unescape_basic(std::string_view body) {
  std::string out;
  for (size_t i = 0; i < body.size(); ++i) {
    if (body[i] != '\\' || i + 1 == body.size()) {
      out += body[i];
      continue;
    }
    switch (char c = body[++i]) {
      case 'n':
        out += '\n';
        break;
      case 't':
        out += '\t';
        break;
      case 'r':
        out += '\r';
        break;
      case '"':
        out += '"';
        break;
      case '\\':
        out += '\\';
        break;
      default:
        out += '\\';
        out += c;
    }
  }
  return out;
}

void encode_value(ProtoWriter& out, const HparamValue& v) {
  switch (v.kind) {
    case HparamValue::Kind::number:
      out.double_field(kValueNumber, v.number);
      break;
    case HparamValue::Kind::boolean:
      out.bool_field(kValueBool, v.boolean);
      break;
    case HparamValue::Kind::string:
      out.bytes_field(kValueString, v.string);
      break;
  }
}

}  // namespace

HparamValue parse_hparam(const std::string& toml) {
  HparamValue v;
  if (toml == "true" || toml == "false") {
    v.kind = HparamValue::Kind::boolean;
    v.boolean = toml == "true";
    return v;
  }
  if (toml == "inf" || toml == "+inf" || toml == "-inf" || toml == "nan" || toml == "+nan" || toml == "-nan") {
    v.kind = HparamValue::Kind::number;
    v.number = toml.find("nan") != std::string::npos ? std::numeric_limits<double>::quiet_NaN()
               : toml.front() == '-'                 ? -std::numeric_limits<double>::infinity()
                                                     : std::numeric_limits<double>::infinity();
    return v;
  }
  std::string digits;
  for (char c : toml)
    if (c != '_') digits += c;  // TOML allows 1_000
  const char* first = digits.data() + (!digits.empty() && digits.front() == '+' ? 1 : 0);
  double number = 0;
  auto [end, error] = std::from_chars(first, digits.data() + digits.size(), number);
  if (error == std::errc() && end == digits.data() + digits.size() && !digits.empty()) {
    v.kind = HparamValue::Kind::number;
    v.number = number;
    return v;
  }
  if (toml.size() >= 2 && toml.front() == '"' && toml.back() == '"') {
    v.string = unescape_basic(std::string_view(toml).substr(1, toml.size() - 2));
  } else if (toml.size() >= 2 && toml.front() == '\'' && toml.back() == '\'') {
    v.string = toml.substr(1, toml.size() - 2);
  } else {
    v.string = toml;  // arrays, inline tables, dates: shown as written
  }
  return v;
}

const std::string& EventBuilder::event(double wall_time, int64_t step) {
  event_.clear();
  event_.double_field(kEventWallTime, wall_time);
  event_.int64_field(kEventStep, step);
  event_.message_field(kEventSummary, summary_);
  return event_.bytes();
}

const std::string& EventBuilder::scalars(double wall_time, int64_t step,
                                         const std::vector<std::pair<std::string_view, double>>& values) {
  summary_.clear();
  for (const auto& [tag, value] : values) {
    value_.clear();
    value_.bytes_field(kValueTag, tag);
    value_.float_field(kValueSimpleValue, static_cast<float>(value));  // TensorBoard scalars are float32
    summary_.message_field(kSummaryValue, value_);
  }
  return event(wall_time, step);
}

const std::string& EventBuilder::text(double wall_time, int64_t step, std::string_view tag, std::string_view text) {
  plugin_data_.clear();
  plugin_data_.bytes_field(kPluginName, "text");
  metadata_.clear();
  metadata_.message_field(kMetadataPluginData, plugin_data_);
  metadata_.varint_field(kMetadataDataClass, kDataClassTensor);
  scratch_.clear();  // TensorShapeProto of a scalar: no dims
  tensor_.clear();
  tensor_.varint_field(kTensorDtype, kDtString);
  tensor_.message_field(kTensorShape, scratch_);
  tensor_.bytes_field(kTensorStringVal, text);
  value_.clear();
  value_.bytes_field(kValueTag, tag);
  value_.message_field(kValueMetadata, metadata_);
  value_.message_field(kValueTensor, tensor_);
  summary_.clear();
  summary_.message_field(kSummaryValue, value_);
  return event(wall_time, step);
}

void EventBuilder::plugin_only_value(std::string_view tag, std::string_view plugin, const ProtoWriter& content) {
  plugin_data_.clear();
  plugin_data_.bytes_field(kPluginName, plugin);
  plugin_data_.bytes_field(kPluginContent, content.bytes());
  metadata_.clear();
  metadata_.message_field(kMetadataPluginData, plugin_data_);
  value_.clear();
  value_.bytes_field(kValueTag, tag);
  value_.message_field(kValueMetadata, metadata_);
  summary_.clear();
  summary_.message_field(kSummaryValue, value_);
}

const std::string& EventBuilder::hparams_experiment(double wall_time, const std::map<std::string, std::string>& hparams,
                                                    const std::vector<std::string>& metric_tags) {
  ProtoWriter experiment, item, name;
  experiment.double_field(kExperimentTimeCreated, wall_time);
  for (const auto& [key, text] : hparams) {
    const HparamValue v = parse_hparam(text);
    item.clear();
    item.bytes_field(kHparamInfoName, key);
    item.varint_field(kHparamInfoType, v.kind == HparamValue::Kind::number    ? kHparamTypeFloat64
                                       : v.kind == HparamValue::Kind::boolean ? kHparamTypeBool
                                                                              : kHparamTypeString);
    experiment.message_field(kExperimentHparamInfos, item);
  }
  for (const std::string& tag : metric_tags) {
    name.clear();
    name.bytes_field(kMetricNameTag, tag);
    item.clear();
    item.message_field(kMetricInfoName, name);
    experiment.message_field(kExperimentMetricInfos, item);
  }
  ProtoWriter content;
  content.varint_field(kPluginDataVersion, 0);
  content.message_field(kPluginDataExperiment, experiment);
  plugin_only_value("_hparams_/experiment", "hparams", content);
  return event(wall_time, 0);
}

const std::string& EventBuilder::hparams_session_start(double wall_time,
                                                       const std::map<std::string, std::string>& hparams) {
  ProtoWriter session, entry, value;
  for (const auto& [key, text] : hparams) {
    value.clear();
    encode_value(value, parse_hparam(text));
    entry.clear();
    entry.bytes_field(kMapKey, key);
    entry.message_field(kMapValue, value);
    session.message_field(kSessionStartHparams, entry);
  }
  session.double_field(kSessionStartTime, wall_time);
  ProtoWriter content;
  content.varint_field(kPluginDataVersion, 0);
  content.message_field(kPluginDataSessionStart, session);
  plugin_only_value("_hparams_/session_start_info", "hparams", content);
  return event(wall_time, 0);
}

const std::string& EventBuilder::hparams_session_end(double wall_time, int status) {
  ProtoWriter session;
  session.varint_field(kSessionEndStatus, static_cast<uint64_t>(status));
  session.double_field(kSessionEndTime, wall_time);
  ProtoWriter content;
  content.varint_field(kPluginDataVersion, 0);
  content.message_field(kPluginDataSessionEnd, session);
  plugin_only_value("_hparams_/session_end_info", "hparams", content);
  return event(wall_time, 0);
}

}  // namespace fulgur::tensorboard
