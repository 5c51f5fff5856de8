// An image folder as a map-style dataset: root/<class>/<image>, JPEG and PNG.
#pragma once

#include <fulgur/data/dataset.h>

#include <atomic>
#include <filesystem>
#include <string>
#include <vector>

namespace fulgur::data {

struct ImageFolderOptions {
  // 3: RGB (grey replicated, alpha dropped); 1: grey.
  ImageFolderOptions& channels(int64_t v) {
    channels_ = v;
    return *this;
  }
  // A file that does not decode is skipped (SkipSample; counted in skipped()) instead of failing.
  ImageFolderOptions& skip_corrupt(bool v) {
    skip_corrupt_ = v;
    return *this;
  }
  int64_t channels_ = 3;
  bool skip_corrupt_ = false;
};

// As torchvision.datasets.ImageFolder: classes are the sub-directories of root in sorted order
// (class index = position), samples their *.jpg / *.jpeg / *.png files (any case) in sorted order.
// Sample::input is the decoded image, uint8 (channels, H, W); Sample::target the class, int64.
// A file that is not a complete JPEG or PNG is a fulgur::Error naming the file and sample index.
class ImageFolder final : public Dataset {
 public:
  ImageFolder(std::filesystem::path root, ImageFolderOptions options = {});
  int64_t size() const override;
  Sample get(int64_t index) const override;

  const std::vector<std::string>& classes() const { return classes_; }
  const std::filesystem::path& path(int64_t index) const { return files_.at(index); }
  int64_t label(int64_t index) const { return labels_.at(index); }
  // Files skipped so far (skip_corrupt); a file skipped in several epochs counts each time.
  int64_t skipped() const { return skipped_.load(); }

 private:
  std::filesystem::path root_;
  ImageFolderOptions options_;
  std::vector<std::string> classes_;
  std::vector<std::filesystem::path> files_;
  std::vector<int64_t> labels_;
  mutable std::atomic<int64_t> skipped_{0};
};

}  // namespace fulgur::data
