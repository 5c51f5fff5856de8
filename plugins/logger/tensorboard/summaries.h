// Serialized TensorBoard Event messages for what the logger writes: scalars, text and the
// hparams plugin's experiment / session records (field numbers of TensorBoard's event.proto,
// summary.proto, tensor.proto and the hparams plugin's protos).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "proto_writer.h"

namespace fulgur::tensorboard {

// Builds events into reused buffers, so logging a step allocates nothing once they have grown.
class EventBuilder {
 public:
  // One event carrying every (tag, value) pair as a scalar summary value.
  const std::string& scalars(double wall_time, int64_t step,
                             const std::vector<std::pair<std::string_view, double>>& values);
  // A text summary (the text dashboard renders it as markdown).
  const std::string& text(double wall_time, int64_t step, std::string_view tag, std::string_view text);

  // The hparams dashboard's records. `hparams` holds TOML value text ("0.1", "true", "\"adam\"").
  const std::string& hparams_experiment(double wall_time, const std::map<std::string, std::string>& hparams,
                                        const std::vector<std::string>& metric_tags);
  const std::string& hparams_session_start(double wall_time, const std::map<std::string, std::string>& hparams);
  // status: 1 success, 2 failure (TensorBoard's hparams Status enum).
  const std::string& hparams_session_end(double wall_time, int status);

 private:
  const std::string& event(double wall_time, int64_t step);
  void plugin_only_value(std::string_view tag, std::string_view plugin, const ProtoWriter& content);

  ProtoWriter event_, summary_, value_, metadata_, plugin_data_, tensor_, scratch_;
};

// How a TOML value text reads as an hparams value: a number, a boolean or a string.
struct HparamValue {
  enum class Kind { number, boolean, string } kind = Kind::string;
  double number = 0;
  bool boolean = false;
  std::string string;
};
HparamValue parse_hparam(const std::string& toml);

}  // namespace fulgur::tensorboard
