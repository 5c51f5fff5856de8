// Feature standardisation for tabular data: sklearn's StandardScaler, fitted on the training split
// and applied to every split.
#pragma once

#include <fulgur/data/dataset.h>
#include <fulgur/data/transforms.h>

#include <vector>

namespace fulgur::data {

// Per-feature statistics of Sample::input (a 1-D feature vector) over a dataset.
struct FeatureStats {
  std::vector<double> mean;
  std::vector<double> std;  // population standard deviation (ddof = 0); a constant feature gets 1
};

// The mean and standard deviation of each feature over every sample of `dataset` (the training
// split, so that validation data does not leak into them): StandardScaler().fit(X)'s mean_ and
// scale_. Throws fulgur::Error(invalid_argument) for an empty dataset or inputs of unequal length.
FeatureStats feature_stats(const Dataset& dataset);

// (x[i] - mean[i]) / std[i] on a 1-D Sample::input, output float32: StandardScaler.transform.
TransformPtr standardize(FeatureStats stats);

}  // namespace fulgur::data
