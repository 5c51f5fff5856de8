#include <fulgur/data/image.h>
#include <fulgur/data/image_folder.h>
#include <fulgur/error.h>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <fstream>

namespace fulgur::data {

namespace fs = std::filesystem;

namespace {

bool is_image(const fs::path& p) {
  std::string ext = p.extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return std::tolower(c); });
  return ext == ".jpg" || ext == ".jpeg" || ext == ".png";
}

std::vector<uint8_t> read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary | std::ios::ate);
  if (!in) throw Error(ErrorKind::io, fmt::format("{}: cannot open", p.string()));
  const std::streamsize size = in.tellg();
  std::vector<uint8_t> bytes(static_cast<size_t>(std::max<std::streamsize>(size, 0)));
  in.seekg(0);
  if (!in.read(reinterpret_cast<char*>(bytes.data()), size))
    throw Error(ErrorKind::io, fmt::format("{}: read error", p.string()));
  return bytes;
}

}  // namespace

ImageFolder::ImageFolder(fs::path root, ImageFolderOptions options) : root_(std::move(root)), options_(options) {
  if (options_.channels_ != 1 && options_.channels_ != 3)
    throw Error(ErrorKind::invalid_argument, fmt::format("ImageFolder: channels = {} (1 or 3)", options_.channels_));
  std::error_code ec;
  if (!fs::is_directory(root_, ec))
    throw Error(ErrorKind::io,
                fmt::format("{}: not a directory (an image folder has one sub-directory per class)", root_.string()));
  for (const auto& entry : fs::directory_iterator(root_))
    if (entry.is_directory()) classes_.push_back(entry.path().filename().string());
  std::sort(classes_.begin(), classes_.end());
  if (classes_.empty()) throw Error(ErrorKind::io, fmt::format("{}: no class sub-directories", root_.string()));
  for (size_t c = 0; c < classes_.size(); ++c) {
    std::vector<fs::path> files;
    // Followed like torchvision (os.walk(followlinks=True)): nested folders belong to the class.
    for (const auto& entry :
         fs::recursive_directory_iterator(root_ / classes_[c], fs::directory_options::follow_directory_symlink))
      if (entry.is_regular_file() && is_image(entry.path())) files.push_back(entry.path());
    std::sort(files.begin(), files.end());
    for (auto& f : files) {
      files_.push_back(std::move(f));
      labels_.push_back(static_cast<int64_t>(c));
    }
  }
  if (files_.empty())
    throw Error(ErrorKind::io, fmt::format("{}: no .jpg, .jpeg or .png files in its {} class directories",
                                           root_.string(), classes_.size()));
}

int64_t ImageFolder::size() const { return static_cast<int64_t>(files_.size()); }

Sample ImageFolder::get(int64_t index) const {
  if (index < 0 || index >= size())
    throw Error(ErrorKind::invalid_argument,
                fmt::format("{}: sample {} out of range ({} images)", root_.string(), index, size()));
  const fs::path& file = files_[static_cast<size_t>(index)];
  Sample s;
  try {
    const std::vector<uint8_t> bytes = read_file(file);
    s.input = decode_image(bytes.data(), bytes.size(), options_.channels_,
                           fmt::format("{} (sample {})", file.string(), index));
  } catch (const Error&) {
    if (!options_.skip_corrupt_) throw;
    ++skipped_;
    throw SkipSample();
  }
  s.target = at::scalar_tensor(labels_[static_cast<size_t>(index)], at::kLong);
  return s;
}

}  // namespace fulgur::data
