// JPEG through libjpeg-turbo (Debian's libjpeg62-turbo: the SIMD decoder Pillow and torchvision
// use too, kept by Debian's security team) and PNG through libpng's simplified API (libpng16,
// which does its own error recovery and converts every PNG colour type to RGB or grey for us).
#include <fulgur/data/image.h>
#include <fulgur/error.h>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <csetjmp>
#include <cstdio>
#include <cstring>

#include <jpeglib.h>
#include <png.h>

namespace fulgur::data {

namespace {

// libjpeg reports errors through error_exit, which must not return: we longjmp back. The
// functions that call setjmp hold no C++ objects with destructors (a longjmp would skip them):
// the header is read in one such function, the tensor is allocated in ordinary C++, and the
// pixels are decoded into it in another.
struct JpegError {
  jpeg_error_mgr mgr;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
  bool warned;
};

void jpeg_on_error(j_common_ptr cinfo) {
  auto* err = reinterpret_cast<JpegError*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, err->message);
  std::longjmp(err->jump, 1);
}

// libjpeg only warns about corrupt data (a truncated file decodes to grey-filled rows with
// "Premature end of JPEG file"): for a training set that is an error.
void jpeg_on_message(j_common_ptr cinfo, int level) {
  auto* err = reinterpret_cast<JpegError*>(cinfo->err);
  if (level < 0 && !err->warned) {
    err->warned = true;
    (*cinfo->err->format_message)(cinfo, err->message);
  }
}

// The most pixels decoded: twice Pillow's decompression-bomb threshold (Image.MAX_IMAGE_PIXELS,
// 89478485), where Pillow refuses too. The header's dimensions size the output tensor before any
// pixel is read, so a 100-byte file declaring 60000 x 60000 would otherwise allocate 10 GB.
constexpr uint64_t kMaxPixels = 2 * 89478485ULL;

struct Jpeg {
  jpeg_decompress_struct cinfo;
  JpegError err;
};

bool jpeg_read_header_safe(Jpeg& j, const uint8_t* data, size_t size, int channels) {
  j.cinfo.err = jpeg_std_error(&j.err.mgr);
  j.err.mgr.error_exit = jpeg_on_error;
  j.err.mgr.emit_message = jpeg_on_message;
  j.err.warned = false;
  j.err.message[0] = 0;
  jpeg_create_decompress(&j.cinfo);
  if (setjmp(j.err.jump)) return false;
  jpeg_mem_src(&j.cinfo, data, static_cast<unsigned long>(size));
  jpeg_read_header(&j.cinfo, TRUE);
  // Before jpeg_start_decompress, which allocates (and clears) buffers for the whole image when
  // it is progressive or multi-scan: a 652-byte JPEG declaring 60000 x 60000 took it 28 s.
  if (uint64_t{j.cinfo.image_width} * j.cinfo.image_height > kMaxPixels) {
    std::snprintf(j.err.message, sizeof j.err.message,
                  "%u x %u = %llu pixels, more than the %llu decoded (a corrupt "
                  "header or a decompression bomb; Pillow refuses it too)",
                  j.cinfo.image_width, j.cinfo.image_height,
                  static_cast<unsigned long long>(uint64_t{j.cinfo.image_width} * j.cinfo.image_height),
                  static_cast<unsigned long long>(kMaxPixels));
    return false;
  }
  j.cinfo.out_color_space = channels == 1 ? JCS_GRAYSCALE : JCS_RGB;
  jpeg_start_decompress(&j.cinfo);
  return !j.err.warned;
}

bool jpeg_decode_safe(Jpeg& j, uint8_t* out) {
  if (setjmp(j.err.jump)) return false;
  const size_t row = static_cast<size_t>(j.cinfo.output_width) * static_cast<size_t>(j.cinfo.output_components);
  // Stops at the first warning: the rest of a truncated file would only be grey fill.
  while (j.cinfo.output_scanline < j.cinfo.output_height && !j.err.warned) {
    JSAMPROW rows[1] = {out + row * j.cinfo.output_scanline};
    jpeg_read_scanlines(&j.cinfo, rows, 1);
  }
  if (j.err.warned) return false;
  jpeg_finish_decompress(&j.cinfo);
  return !j.err.warned;
}

[[noreturn]] void corrupt(const std::string& what, const std::string& why) {
  throw Error(ErrorKind::io, fmt::format("{}: not a valid image: {}", what, why));
}

void check_dimensions(uint64_t width, uint64_t height, const std::string& what, const char* format) {
  if (width * height > kMaxPixels)
    corrupt(what, fmt::format("{}: {} x {} = {} pixels, more than the {} decoded (a corrupt header or a "
                              "decompression bomb; Pillow refuses it too)",
                              format, width, height, width * height, kMaxPixels));
}

at::Tensor decode_jpeg(const uint8_t* data, size_t size, int64_t channels, const std::string& what) {
  Jpeg j{};
  struct Destroy {
    Jpeg& j;
    ~Destroy() { jpeg_destroy_decompress(&j.cinfo); }
  } destroy{j};
  if (!jpeg_read_header_safe(j, data, size, static_cast<int>(channels)))
    corrupt(what, fmt::format("JPEG: {}", j.err.message));
  check_dimensions(j.cinfo.output_width, j.cinfo.output_height, what, "JPEG");
  // HWC, the order libjpeg writes; the (C, H, W) view below is channels-last in memory, the layout
  // ATen's fast uint8 resize kernels take.
  at::Tensor hwc = at::empty({j.cinfo.output_height, j.cinfo.output_width, j.cinfo.output_components}, at::kByte);
  if (!jpeg_decode_safe(j, hwc.data_ptr<uint8_t>())) corrupt(what, fmt::format("JPEG: {}", j.err.message));
  return hwc.permute({2, 0, 1});
}

at::Tensor decode_png(const uint8_t* data, size_t size, int64_t channels, const std::string& what) {
  png_image image;
  std::memset(&image, 0, sizeof image);
  image.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_memory(&image, data, size)) corrupt(what, fmt::format("PNG: {}", image.message));
  // Alpha is removed the way libpng's simplified API does with no background given (composited
  // over black); Pillow's convert("RGB") discards it instead, so semi-transparent pixels differ.
  image.format = channels == 1 ? PNG_FORMAT_GRAY : PNG_FORMAT_RGB;
  if (image.width * uint64_t{image.height} > kMaxPixels) png_image_free(&image);
  check_dimensions(image.width, image.height, what, "PNG");
  at::Tensor hwc = at::empty({image.height, image.width, channels}, at::kByte);
  if (!png_image_finish_read(&image, nullptr, hwc.data_ptr<uint8_t>(), 0, nullptr)) {
    std::string message = image.message;
    png_image_free(&image);
    corrupt(what, fmt::format("PNG: {}", message));
  }
  return hwc.permute({2, 0, 1});
}

}  // namespace

at::Tensor decode_image(const uint8_t* data, size_t size, int64_t channels, const std::string& what) {
  if (channels != 1 && channels != 3)
    throw Error(ErrorKind::invalid_argument, fmt::format("decode_image: channels = {} (1 or 3)", channels));
  static constexpr uint8_t kPng[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  if (size >= 3 && data[0] == 0xff && data[1] == 0xd8 && data[2] == 0xff)
    return decode_jpeg(data, size, channels, what);
  if (size >= 8 && std::memcmp(data, kPng, 8) == 0) return decode_png(data, size, channels, what);
  corrupt(what, size == 0 ? "empty" : "neither a JPEG nor a PNG signature");
}

}  // namespace fulgur::data
