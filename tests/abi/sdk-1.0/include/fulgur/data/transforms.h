// Composable per-sample transforms. Randomness comes from a SampleRng that the DataLoader derives
// from (seed, epoch, sample index) alone, so a sample is transformed identically whichever worker
// thread handles it, with any number of workers, and again after a resume.
#pragma once

#include <fulgur/data/dataset.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

namespace fulgur::data {

// A small counter-based generator (SplitMix64): cheap to create per sample, statistically sound for
// augmentation, identical on every platform.
class SampleRng {
 public:
  SampleRng(uint64_t seed, int64_t epoch, int64_t index);
  explicit SampleRng(uint64_t state) : state_(state) {}
  uint64_t next_u64();
  double uniform();                            // [0, 1)
  double uniform(double low, double high);     // [low, high)
  int64_t integer(int64_t low, int64_t high);  // [low, high]
  bool bernoulli(double p) { return uniform() < p; }

 private:
  uint64_t state_;
};

class Transform {
 public:
  virtual ~Transform();
  virtual Sample apply(Sample sample, SampleRng& rng) const = 0;
};
using TransformPtr = std::shared_ptr<const Transform>;

// Applies each transform in order (one SampleRng threads through all of them).
TransformPtr compose(std::vector<TransformPtr> transforms);
// Any callable as a transform.
TransformPtr lambda(std::function<Sample(Sample, SampleRng&)> fn);

// The image transforms below act on Sample::input, an image tensor (C, H, W), uint8 (as the image
// readers produce) or floating point. Geometric ones keep the dtype.

// torchvision's ToTensor + Normalize in one pass: a uint8 image is scaled to [0, 1] first, then
// (x - mean[c]) / std[c]; a floating-point image is normalized as is. Output float32.
TransformPtr normalize(std::vector<double> mean, std::vector<double> std);

struct RandomCropOptions {
  RandomCropOptions(int64_t height, int64_t width) : height_(height), width_(width) {}
  explicit RandomCropOptions(int64_t size) : RandomCropOptions(size, size) {}
  // Zero padding added on every side before cropping (torchvision's `padding`).
  RandomCropOptions& padding(int64_t v) {
    padding_ = v;
    return *this;
  }
  int64_t height_, width_;
  int64_t padding_ = 0;
};
// A crop of the given size at a uniformly drawn position (torchvision.transforms.RandomCrop).
TransformPtr random_crop(RandomCropOptions options);

// Mirrors the image left-right with probability p (torchvision.transforms.RandomHorizontalFlip).
TransformPtr random_horizontal_flip(double p = 0.5);

struct RandomResizedCropOptions {
  RandomResizedCropOptions(int64_t height, int64_t width) : height_(height), width_(width) {}
  explicit RandomResizedCropOptions(int64_t size) : RandomResizedCropOptions(size, size) {}
  RandomResizedCropOptions& scale(double low, double high) {
    scale_ = {low, high};
    return *this;
  }
  RandomResizedCropOptions& ratio(double low, double high) {
    ratio_ = {low, high};
    return *this;
  }
  // Antialiased bilinear resize (torchvision's default since 0.17), or plain bilinear.
  RandomResizedCropOptions& antialias(bool v) {
    antialias_ = v;
    return *this;
  }
  int64_t height_, width_;
  std::pair<double, double> scale_{0.08, 1.0};
  std::pair<double, double> ratio_{3.0 / 4.0, 4.0 / 3.0};
  bool antialias_ = true;
};
// torchvision.transforms.RandomResizedCrop: a crop of random area and aspect ratio (same
// parameter search, 10 attempts then a centered fallback), resized to the output size.
TransformPtr random_resized_crop(RandomResizedCropOptions options);

// Deterministic counterparts for evaluation: resize the shorter side to `size` (antialiased
// bilinear), and a centered crop.
TransformPtr resize(int64_t size);
TransformPtr center_crop(int64_t height, int64_t width);

// Decodes Sample::input from encoded JPEG or PNG bytes (a uint8 1-D tensor, as TarShards yields)
// into a (channels, H, W) uint8 image. `skip_corrupt`: an undecodable sample is skipped
// (SkipSample) instead of failing.
TransformPtr decode_image(int64_t channels = 3, bool skip_corrupt = false);

}  // namespace fulgur::data
