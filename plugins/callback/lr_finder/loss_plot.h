// A PNG line plot of the learning-rate sweep: smoothed loss (and the raw losses as dots) against
// the lr on a log (or linear) x-axis, with the suggested lr marked. Drawn into an RGB buffer and
// written with libpng, which the core already links: a plotting library would be a new dependency
// for one small chart.
#pragma once

#include "lr_sweep.h"

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

namespace fulgur::lr_finder {

struct LossPlotOptions {
  LossPlotOptions& width(int v) {
    width_ = v;
    return *this;
  }
  LossPlotOptions& height(int v) {
    height_ = v;
    return *this;
  }
  LossPlotOptions& log_x(bool v) {
    log_x_ = v;
    return *this;
  }
  int width_ = 800;
  int height_ = 500;
  bool log_x_ = true;
};

// Writes the plot to `path` (through a temporary file and a rename, so a reader never sees half a
// file). Throws fulgur::Error(io) naming the path when it cannot be written.
void write_loss_plot(const std::string& path, const std::vector<SweepPoint>& points, std::optional<size_t> marked,
                     const LossPlotOptions& options);

}  // namespace fulgur::lr_finder
