#include <fulgur/data/standardize.h>
#include <fulgur/error.h>

#include <ATen/ATen.h>
#include <c10/util/StringUtil.h>
#include <fmt/format.h>

#include <cmath>
#include <string>

namespace fulgur::data {

namespace {

class Standardize final : public Transform {
 public:
  explicit Standardize(FeatureStats stats)
      : count_(static_cast<int64_t>(stats.mean.size())),
        mean_(at::tensor(stats.mean, at::kDouble)),
        std_(at::tensor(stats.std, at::kDouble)) {}

  Sample apply(Sample s, SampleRng&) const override {
    if (!s.input.defined() || s.input.dim() != 1 || s.input.size(0) != count_)
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("standardize: fitted on {} features, the sample's input has shape {}", count_,
                              s.input.defined() ? c10::str(s.input.sizes()) : std::string("(none)")));
    // In double, rounded once to float32, as StandardScaler computes in float64.
    s.input = s.input.to(at::kDouble).sub(mean_).div(std_).to(at::kFloat);
    return s;
  }

 private:
  int64_t count_;
  at::Tensor mean_, std_;
};

}  // namespace

FeatureStats feature_stats(const Dataset& dataset) {
  const int64_t n = dataset.size();
  if (n == 0) throw Error(ErrorKind::invalid_argument, "feature_stats: the dataset is empty");
  at::Tensor sum, sum_sq;
  int64_t features = -1;
  // Two passes (mean, then squared deviations), as numpy does: no cancellation for large means.
  for (int pass = 0; pass < 2; ++pass) {
    for (int64_t i = 0; i < n; ++i) {
      const at::Tensor x = dataset.get(i).input.to(at::kDouble);
      if (x.dim() != 1 || (features >= 0 && x.size(0) != features))
        throw Error(ErrorKind::invalid_argument,
                    fmt::format("feature_stats: sample {} has input shape {}; expected a vector of {} features", i,
                                c10::str(x.sizes()), features >= 0 ? features : x.numel()));
      if (pass == 0) {
        if (features < 0) {
          features = x.size(0);
          sum = at::zeros({features}, at::kDouble);
        }
        sum.add_(x);
      } else {
        if (!sum_sq.defined()) sum_sq = at::zeros({features}, at::kDouble);
        const at::Tensor d = x - sum / static_cast<double>(n);
        sum_sq.add_(d * d);
      }
    }
  }
  const at::Tensor mean = sum / static_cast<double>(n);
  const at::Tensor stdev = (sum_sq / static_cast<double>(n)).sqrt();
  FeatureStats stats;
  for (int64_t f = 0; f < features; ++f) {
    stats.mean.push_back(mean[f].item<double>());
    const double s = stdev[f].item<double>();
    stats.std.push_back(s == 0.0 ? 1.0 : s);  // StandardScaler leaves a constant feature at 0
  }
  return stats;
}

TransformPtr standardize(FeatureStats stats) {
  if (stats.mean.empty() || stats.mean.size() != stats.std.size())
    throw Error(ErrorKind::invalid_argument,
                fmt::format("standardize: {} means and {} standard deviations", stats.mean.size(), stats.std.size()));
  for (double d : stats.std)
    if (!(d > 0))
      throw Error(ErrorKind::invalid_argument, fmt::format("standardize: standard deviation {} must be positive", d));
  return std::make_shared<Standardize>(std::move(stats));
}

}  // namespace fulgur::data
