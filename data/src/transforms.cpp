#include <fulgur/data/image.h>
#include <fulgur/data/transforms.h>
#include <fulgur/error.h>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace fulgur::data {

namespace {

uint64_t mix(uint64_t z) {  // SplitMix64's finalizer
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Python's round(): halves go to the even neighbour (std::lround takes 12.5 to 13, Python to 12).
// torchvision's parameter code rounds with it; so must ours, to pick the same pixels.
int64_t round_half_even(double x) { return static_cast<int64_t>(std::nearbyint(x)); }

void require(bool ok, const std::string& message) {
  if (!ok) throw Error(ErrorKind::invalid_argument, message);
}

void require_image(const Sample& s, const char* who) {
  if (!s.input.defined() || s.input.dim() != 3)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("{}: expects an image (C, H, W) in Sample::input, got {}", who,
                            s.input.defined() ? fmt::format("{} dimensions", s.input.dim()) : "none"));
}

class Compose final : public Transform {
 public:
  explicit Compose(std::vector<TransformPtr> t) : transforms_(std::move(t)) {}
  Sample apply(Sample s, SampleRng& rng) const override {
    for (const auto& t : transforms_) s = t->apply(std::move(s), rng);
    return s;
  }

 private:
  std::vector<TransformPtr> transforms_;
};

class Lambda final : public Transform {
 public:
  explicit Lambda(std::function<Sample(Sample, SampleRng&)> fn) : fn_(std::move(fn)) {}
  Sample apply(Sample s, SampleRng& rng) const override { return fn_(std::move(s), rng); }

 private:
  std::function<Sample(Sample, SampleRng&)> fn_;
};

class Normalize final : public Transform {
 public:
  Normalize(std::vector<double> mean, std::vector<double> std) : mean_(std::move(mean)), std_(std::move(std)) {}
  Sample apply(Sample s, SampleRng&) const override {
    require_image(s, "normalize");
    const int64_t c = s.input.size(0);
    require(static_cast<int64_t>(mean_.size()) == c || mean_.size() == 1,
            fmt::format("normalize: {} means for an image of {} channels", mean_.size(), c));
    // torchvision's operations in its order, each rounded to float32 as there, so the values are
    // its values to the bit: ToDtype(float32, scale=True) multiplies by 1/255, Normalize
    // subtracts the mean, then divides by the std. (A fused x * a + b, one pass fewer, was off by
    // up to 7e-7.)
    at::Tensor mean = at::empty({c, 1, 1}, at::kFloat), stdev = at::empty({c, 1, 1}, at::kFloat);
    for (int64_t i = 0; i < c; ++i) {
      mean.data_ptr<float>()[i] = static_cast<float>(mean_[mean_.size() == 1 ? 0 : i]);
      stdev.data_ptr<float>()[i] = static_cast<float>(std_[std_.size() == 1 ? 0 : i]);
    }
    at::Tensor out = at::empty(s.input.sizes(), at::kFloat);
    out.copy_(s.input);
    if (s.input.scalar_type() == at::kByte) out.mul_(1.0 / 255.0);
    out.sub_(mean).div_(stdev);
    s.input = std::move(out);
    return s;
  }

 private:
  std::vector<double> mean_, std_;
};

// Resizes a (C, H, W) image as torchvision.transforms.v2.functional.resize does (bilinear,
// align_corners=False, antialiased unless told otherwise): uint8 images go through ATen's uint8
// kernel (channels-last, the layout decoded images already have), which torchvision also uses on
// AVX2 / AVX-512 hosts (elsewhere it resizes in float32 and rounds: up to 1 level apart, mean
// about 0.15 on noise); other integer images are resized in float32, rounded and cast back.
at::Tensor resize_image(const at::Tensor& image, int64_t h, int64_t w, bool antialias) {
  at::Tensor x = image.unsqueeze(0);
  const bool byte = image.scalar_type() == at::kByte, cast = !byte && !image.is_floating_point();
  if (byte)
    x = x.contiguous(at::MemoryFormat::ChannelsLast);
  else if (cast)
    x = x.to(at::kFloat);
  at::Tensor y = antialias ? at::_upsample_bilinear2d_aa(x, {h, w}, /*align_corners=*/false)
                           : at::upsample_bilinear2d(x, {h, w}, /*align_corners=*/false);
  if (cast) y = y.round_().to(image.scalar_type());
  return y.squeeze(0);
}

class RandomCrop final : public Transform {
 public:
  explicit RandomCrop(RandomCropOptions o) : o_(o) {}
  Sample apply(Sample s, SampleRng& rng) const override {
    require_image(s, "random_crop");
    at::Tensor x = s.input;
    if (o_.padding_ > 0) x = at::constant_pad_nd(x, {o_.padding_, o_.padding_, o_.padding_, o_.padding_}, 0);
    const int64_t h = x.size(1), w = x.size(2);
    require(
        h >= o_.height_ && w >= o_.width_,
        fmt::format("random_crop: crop {}x{} is larger than the (padded) image {}x{}", o_.height_, o_.width_, h, w));
    const int64_t top = rng.integer(0, h - o_.height_), left = rng.integer(0, w - o_.width_);
    s.input = x.narrow(1, top, o_.height_).narrow(2, left, o_.width_);
    return s;
  }

 private:
  RandomCropOptions o_;
};

class RandomHorizontalFlip final : public Transform {
 public:
  explicit RandomHorizontalFlip(double p) : p_(p) {}
  Sample apply(Sample s, SampleRng& rng) const override {
    require_image(s, "random_horizontal_flip");
    if (rng.bernoulli(p_)) s.input = s.input.flip(-1);
    return s;
  }

 private:
  double p_;
};

class RandomResizedCrop final : public Transform {
 public:
  explicit RandomResizedCrop(RandomResizedCropOptions o) : o_(o) {}
  Sample apply(Sample s, SampleRng& rng) const override {
    require_image(s, "random_resized_crop");
    const int64_t height = s.input.size(1), width = s.input.size(2);
    auto [top, left, h, w] = params(height, width, rng);
    s.input = resize_image(s.input.narrow(1, top, h).narrow(2, left, w), o_.height_, o_.width_, o_.antialias_);
    return s;
  }

 private:
  struct Box {
    int64_t top, left, h, w;
  };
  // torchvision.transforms.RandomResizedCrop.get_params, step for step.
  Box params(int64_t height, int64_t width, SampleRng& rng) const {
    const double area = static_cast<double>(height * width);
    const double log_lo = std::log(o_.ratio_.first), log_hi = std::log(o_.ratio_.second);
    for (int attempt = 0; attempt < 10; ++attempt) {
      const double target_area = area * rng.uniform(o_.scale_.first, o_.scale_.second);
      const double aspect = std::exp(rng.uniform(log_lo, log_hi));
      const int64_t w = round_half_even(std::sqrt(target_area * aspect));
      const int64_t h = round_half_even(std::sqrt(target_area / aspect));
      if (0 < w && w <= width && 0 < h && h <= height)
        return {rng.integer(0, height - h), rng.integer(0, width - w), h, w};
    }
    const double in_ratio = static_cast<double>(width) / static_cast<double>(height);
    int64_t w = width, h = height;
    if (in_ratio < std::min(o_.ratio_.first, o_.ratio_.second)) {
      h = round_half_even(static_cast<double>(w) / std::min(o_.ratio_.first, o_.ratio_.second));
    } else if (in_ratio > std::max(o_.ratio_.first, o_.ratio_.second)) {
      w = round_half_even(static_cast<double>(h) * std::max(o_.ratio_.first, o_.ratio_.second));
    }
    return {(height - h) / 2, (width - w) / 2, h, w};
  }
  RandomResizedCropOptions o_;
};

class Resize final : public Transform {
 public:
  explicit Resize(int64_t size) : size_(size) {}
  Sample apply(Sample s, SampleRng&) const override {
    require_image(s, "resize");
    const int64_t h = s.input.size(1), w = s.input.size(2);
    // The shorter side becomes `size`, the other keeps the aspect ratio (torchvision truncates).
    const int64_t nh = h <= w ? size_ : static_cast<int64_t>(static_cast<double>(size_) * h / w);
    const int64_t nw = h <= w ? static_cast<int64_t>(static_cast<double>(size_) * w / h) : size_;
    s.input = resize_image(s.input, nh, nw, true);
    return s;
  }

 private:
  int64_t size_;
};

// torchvision.transforms.v2.functional.center_crop: the margin is halved with Python's round()
// (a margin of 3 leaves 2 above, not 1), and an image smaller than the crop is first padded with
// zeros (the odd pixel of padding goes to the bottom / right).
class CenterCrop final : public Transform {
 public:
  CenterCrop(int64_t h, int64_t w) : h_(h), w_(w) {}
  Sample apply(Sample s, SampleRng&) const override {
    require_image(s, "center_crop");
    at::Tensor x = s.input;
    if (h_ > x.size(1) || w_ > x.size(2)) {
      const int64_t ph = std::max<int64_t>(h_ - x.size(1), 0), pw = std::max<int64_t>(w_ - x.size(2), 0);
      x = at::constant_pad_nd(x, {pw / 2, (pw + 1) / 2, ph / 2, (ph + 1) / 2}, 0);
    }
    const int64_t top = round_half_even(static_cast<double>(x.size(1) - h_) / 2);
    const int64_t left = round_half_even(static_cast<double>(x.size(2) - w_) / 2);
    s.input = x.narrow(1, top, h_).narrow(2, left, w_);
    return s;
  }

 private:
  int64_t h_, w_;
};

class DecodeImage final : public Transform {
 public:
  DecodeImage(int64_t channels, bool skip) : channels_(channels), skip_(skip) {}
  Sample apply(Sample s, SampleRng&) const override {
    if (!s.input.defined() || s.input.scalar_type() != at::kByte || s.input.dim() != 1)
      throw Error(ErrorKind::invalid_argument, "decode_image: expects encoded bytes (uint8, 1-D) in Sample::input");
    at::Tensor bytes = s.input.contiguous();
    try {
      s.input = decode_image(bytes.data_ptr<uint8_t>(), static_cast<size_t>(bytes.numel()), channels_, "image");
    } catch (const Error&) {
      if (skip_) throw SkipSample();
      throw;
    }
    return s;
  }

 private:
  int64_t channels_;
  bool skip_;
};

}  // namespace

SampleRng::SampleRng(uint64_t seed, int64_t epoch, int64_t index)
    : state_(mix(mix(mix(seed) ^ static_cast<uint64_t>(epoch)) ^ static_cast<uint64_t>(index))) {}

uint64_t SampleRng::next_u64() { return mix(state_ += 0x9e3779b97f4a7c15ULL); }

double SampleRng::uniform() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }

double SampleRng::uniform(double low, double high) { return low + (high - low) * uniform(); }

int64_t SampleRng::integer(int64_t low, int64_t high) {
  if (high <= low) return low;
  const auto span = static_cast<uint64_t>(high - low) + 1;
  // Lemire's multiply-shift: unbiased enough for spans far below 2^64 (image sizes, indices).
  return low + static_cast<int64_t>((static_cast<unsigned __int128>(next_u64()) * span) >> 64);
}

Transform::~Transform() = default;

TransformPtr compose(std::vector<TransformPtr> transforms) {
  for (const auto& t : transforms) require(t != nullptr, "compose: a transform is null");
  return std::make_shared<Compose>(std::move(transforms));
}

TransformPtr lambda(std::function<Sample(Sample, SampleRng&)> fn) {
  require(static_cast<bool>(fn), "lambda: empty function");
  return std::make_shared<Lambda>(std::move(fn));
}

TransformPtr normalize(std::vector<double> mean, std::vector<double> std) {
  require(!mean.empty() && mean.size() == std.size(),
          fmt::format("normalize: {} means and {} standard deviations", mean.size(), std.size()));
  for (double d : std) require(d > 0, fmt::format("normalize: standard deviation {} must be positive", d));
  return std::make_shared<Normalize>(std::move(mean), std::move(std));
}

TransformPtr random_crop(RandomCropOptions options) {
  require(options.height_ > 0 && options.width_ > 0 && options.padding_ >= 0,
          fmt::format("random_crop: size {}x{}, padding {}", options.height_, options.width_, options.padding_));
  return std::make_shared<RandomCrop>(options);
}

TransformPtr random_horizontal_flip(double p) {
  require(p >= 0 && p <= 1, fmt::format("random_horizontal_flip: p = {} must be in [0, 1]", p));
  return std::make_shared<RandomHorizontalFlip>(p);
}

TransformPtr random_resized_crop(RandomResizedCropOptions options) {
  require(options.height_ > 0 && options.width_ > 0,
          fmt::format("random_resized_crop: size {}x{}", options.height_, options.width_));
  require(0 < options.scale_.first && options.scale_.first <= options.scale_.second && options.scale_.second <= 1,
          "random_resized_crop: scale must satisfy 0 < low <= high <= 1");
  require(0 < options.ratio_.first && options.ratio_.first <= options.ratio_.second,
          "random_resized_crop: ratio must satisfy 0 < low <= high");
  return std::make_shared<RandomResizedCrop>(options);
}

TransformPtr resize(int64_t size) {
  require(size > 0, fmt::format("resize: size {} must be positive", size));
  return std::make_shared<Resize>(size);
}

TransformPtr center_crop(int64_t height, int64_t width) {
  require(height > 0 && width > 0, fmt::format("center_crop: size {}x{}", height, width));
  return std::make_shared<CenterCrop>(height, width);
}

TransformPtr decode_image(int64_t channels, bool skip_corrupt) {
  require(channels == 1 || channels == 3, fmt::format("decode_image: channels = {} (1 or 3)", channels));
  return std::make_shared<DecodeImage>(channels, skip_corrupt);
}

}  // namespace fulgur::data
