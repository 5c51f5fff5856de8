// Logger: where metrics and hyperparameters go (csv, tensorboard, ...).
#pragma once

#include <fulgur/export.h>
#include <fulgur/types.h>

#include <string>

namespace fulgur {

struct LoggerSetup {
  std::string root_dir;  // Trainer's default_root_dir
  int64_t global_rank = 0;
};

class FULGUR_SDK_API Logger {
 public:
  virtual ~Logger();

  // Creates the run directory; a directory that cannot be written fails here, not mid-run.
  virtual void setup(const LoggerSetup& setup) = 0;
  virtual void log_metrics(const MetricMap& metrics, int64_t step) = 0;
  // Flattened hyperparameters, "model.lr" -> "0.001" (values in TOML syntax).
  virtual void log_hyperparams(const std::map<std::string, std::string>& params) = 0;
  virtual void save() = 0;
  virtual void finalize(RunStatus status) = 0;
  virtual std::string log_dir() const = 0;
};

}  // namespace fulgur
