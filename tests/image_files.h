// Writes small JPEG and PNG files for the data tests (libjpeg-turbo and libpng, as the reader uses).
#pragma once

#include <ATen/ATen.h>

#include <doctest/doctest.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include <jpeglib.h>
#include <png.h>

namespace fulgur::test {

// A (H, W, 3) uint8 image with a pattern that depends on `seed` (so files differ).
inline at::Tensor pattern_image(int64_t h, int64_t w, int64_t seed) {
  at::Tensor y = at::arange(h, at::kLong).view({h, 1, 1});
  at::Tensor x = at::arange(w, at::kLong).view({1, w, 1});
  at::Tensor c = at::arange(3, at::kLong).view({1, 1, 3});
  return ((y * 7 + x * 3 + c * 50 + seed * 31) % 256).to(at::kByte).contiguous();
}

inline void write_png(const std::filesystem::path& file, const at::Tensor& hwc) {
  png_image image{};
  image.version = PNG_IMAGE_VERSION;
  image.width = static_cast<png_uint_32>(hwc.size(1));
  image.height = static_cast<png_uint_32>(hwc.size(0));
  image.format = hwc.size(2) == 1 ? PNG_FORMAT_GRAY : PNG_FORMAT_RGB;
  REQUIRE(png_image_write_to_file(&image, file.c_str(), 0, hwc.data_ptr<uint8_t>(), 0, nullptr));
}

inline void write_jpeg(const std::filesystem::path& file, const at::Tensor& hwc, int quality = 90) {
  std::FILE* f = std::fopen(file.c_str(), "wb");
  REQUIRE(f != nullptr);
  jpeg_compress_struct cinfo{};
  jpeg_error_mgr err{};
  cinfo.err = jpeg_std_error(&err);
  jpeg_create_compress(&cinfo);
  jpeg_stdio_dest(&cinfo, f);
  cinfo.image_width = static_cast<JDIMENSION>(hwc.size(1));
  cinfo.image_height = static_cast<JDIMENSION>(hwc.size(0));
  cinfo.input_components = static_cast<int>(hwc.size(2));
  cinfo.in_color_space = hwc.size(2) == 1 ? JCS_GRAYSCALE : JCS_RGB;
  jpeg_set_defaults(&cinfo);
  jpeg_set_quality(&cinfo, quality, TRUE);
  jpeg_start_compress(&cinfo, TRUE);
  const size_t row = static_cast<size_t>(hwc.size(1) * hwc.size(2));
  while (cinfo.next_scanline < cinfo.image_height) {
    JSAMPROW r = hwc.data_ptr<uint8_t>() + row * cinfo.next_scanline;
    jpeg_write_scanlines(&cinfo, &r, 1);
  }
  jpeg_finish_compress(&cinfo);
  jpeg_destroy_compress(&cinfo);
  std::fclose(f);
}

}  // namespace fulgur::test
