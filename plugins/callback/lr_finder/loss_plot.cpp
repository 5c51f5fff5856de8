#include "loss_plot.h"

#include <fulgur/error.h>

#include <fmt/format.h>
#include <png.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <system_error>

namespace fulgur::lr_finder {
namespace {

struct Rgb {
  uint8_t r, g, b;
};
constexpr Rgb kWhite{255, 255, 255};
constexpr Rgb kBlack{0, 0, 0};
constexpr Rgb kGrid{225, 225, 225};
constexpr Rgb kRaw{170, 190, 230};
constexpr Rgb kCurve{31, 90, 180};
constexpr Rgb kMark{210, 30, 30};

// A 3x5 pixel font for tick labels and captions: only the characters the plot writes.
const std::map<char, std::array<const char*, 5>>& glyphs() {
  static const std::map<char, std::array<const char*, 5>> font = {
      {'0', {"111", "101", "101", "101", "111"}}, {'1', {"010", "110", "010", "010", "111"}},
      {'2', {"111", "001", "111", "100", "111"}}, {'3', {"111", "001", "111", "001", "111"}},
      {'4', {"101", "101", "111", "001", "001"}}, {'5', {"111", "100", "111", "001", "111"}},
      {'6', {"111", "100", "111", "101", "111"}}, {'7', {"111", "001", "001", "001", "001"}},
      {'8', {"111", "101", "111", "101", "111"}}, {'9', {"111", "101", "111", "001", "111"}},
      {'.', {"000", "000", "000", "000", "010"}}, {'-', {"000", "000", "111", "000", "000"}},
      {'+', {"000", "010", "111", "010", "000"}}, {'e', {"000", "111", "111", "100", "111"}},
      {'l', {"110", "010", "010", "010", "111"}}, {'r', {"000", "101", "110", "100", "100"}},
      {'o', {"000", "111", "101", "101", "111"}}, {'s', {"000", "111", "110", "011", "111"}},
      {'u', {"000", "101", "101", "101", "111"}}, {'g', {"111", "101", "111", "001", "110"}},
      {'t', {"010", "111", "010", "010", "011"}}, {'i', {"010", "000", "010", "010", "010"}},
      {'n', {"000", "110", "101", "101", "101"}}, {'a', {"000", "011", "101", "101", "011"}},
      {'d', {"001", "011", "101", "101", "011"}}, {'m', {"000", "111", "111", "101", "101"}},
      {'h', {"100", "110", "101", "101", "101"}}, {'(', {"010", "100", "100", "100", "010"}},
      {')', {"010", "001", "001", "001", "010"}}, {':', {"000", "010", "000", "010", "000"}},
      {'=', {"000", "111", "000", "111", "000"}}, {',', {"000", "000", "000", "010", "100"}},
      {' ', {"000", "000", "000", "000", "000"}},
  };
  return font;
}

class Canvas {
 public:
  Canvas(int width, int height) : w_(width), h_(height), pixels_(static_cast<size_t>(width * height * 3), 255) {}

  int width() const { return w_; }
  int height() const { return h_; }
  const uint8_t* row(int y) const { return pixels_.data() + static_cast<size_t>(y * w_ * 3); }

  void set(int x, int y, Rgb c) {
    if (x < 0 || y < 0 || x >= w_ || y >= h_) return;
    uint8_t* p = pixels_.data() + static_cast<size_t>((y * w_ + x) * 3);
    p[0] = c.r;
    p[1] = c.g;
    p[2] = c.b;
  }
  void fill_rect(int x0, int y0, int x1, int y1, Rgb c) {
    for (int y = std::min(y0, y1); y <= std::max(y0, y1); ++y)
      for (int x = std::min(x0, x1); x <= std::max(x0, x1); ++x) set(x, y, c);
  }
  // Bresenham, `thick` pixels wide; `dash` > 0 draws dash pixels on, dash off.
  void line(int x0, int y0, int x1, int y1, Rgb c, int thick = 1, int dash = 0) {
    const int dx = std::abs(x1 - x0), sx = x0 < x1 ? 1 : -1;
    const int dy = -std::abs(y1 - y0), sy = y0 < y1 ? 1 : -1;
    int err = dx + dy;
    for (int n = 0;; ++n) {
      if (dash == 0 || (n / dash) % 2 == 0)
        fill_rect(x0 - thick / 2, y0 - thick / 2, x0 + (thick - 1) / 2, y0 + (thick - 1) / 2, c);
      if (x0 == x1 && y0 == y1) break;
      const int e2 = 2 * err;
      if (e2 >= dy) {
        err += dy;
        x0 += sx;
      }
      if (e2 <= dx) {
        err += dx;
        y0 += sy;
      }
    }
  }
  void disc(int cx, int cy, int radius, Rgb c) {
    for (int y = -radius; y <= radius; ++y)
      for (int x = -radius; x <= radius; ++x)
        if (x * x + y * y <= radius * radius) set(cx + x, cy + y, c);
  }
  // Text at (x, y) = its top-left corner, each font pixel `scale` pixels wide.
  void text(int x, int y, const std::string& s, Rgb c, int scale = 2) {
    for (char ch : s) {
      auto it = glyphs().find(ch);
      if (it != glyphs().end())
        for (int row = 0; row < 5; ++row)
          for (int col = 0; col < 3; ++col)
            if (it->second[static_cast<size_t>(row)][col] == '1')
              fill_rect(x + col * scale, y + row * scale, x + (col + 1) * scale - 1, y + (row + 1) * scale - 1, c);
      x += 4 * scale;
    }
  }
  static int text_width(const std::string& s, int scale = 2) { return static_cast<int>(s.size()) * 4 * scale - scale; }

 private:
  int w_, h_;
  std::vector<uint8_t> pixels_;
};

// "1e-4" for a decade, "3.2e-3" otherwise: what fits under a tick.
std::string short_number(double v, int digits = 2) {
  if (v == 0) return "0";
  std::string s = fmt::format("{:.{}g}", v, digits);
  // fmt writes "1e-04"; drop the exponent's padding zeros and plus sign.
  if (auto e = s.find('e'); e != std::string::npos) {
    std::string mantissa = s.substr(0, e), exponent = s.substr(e + 1);
    const bool negative = !exponent.empty() && exponent[0] == '-';
    if (!exponent.empty() && (exponent[0] == '-' || exponent[0] == '+')) exponent.erase(0, 1);
    exponent.erase(0, std::min(exponent.find_first_not_of('0'), exponent.size() - 1));
    s = mantissa + "e" + (negative ? "-" : "") + exponent;
  }
  return s;
}

void write_png(const std::string& path, const Canvas& canvas) {
  const std::filesystem::path target(path);
  const std::filesystem::path temporary = target.parent_path() / ("." + target.filename().string() + ".tmp");
  FILE* file = std::fopen(temporary.c_str(), "wb");
  if (!file)
    throw Error(ErrorKind::io,
                fmt::format("cannot write the lr finder plot {}: {}", temporary.string(), std::strerror(errno)));
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  png_infop info = png ? png_create_info_struct(png) : nullptr;
  if (!png || !info || setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, &info);
    std::fclose(file);
    std::filesystem::remove(temporary);
    throw Error(ErrorKind::io, fmt::format("libpng failed to write the lr finder plot {}", path));
  }
  png_init_io(png, file);
  png_set_IHDR(png, info, static_cast<png_uint_32>(canvas.width()), static_cast<png_uint_32>(canvas.height()), 8,
               PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  png_write_info(png, info);
  for (int y = 0; y < canvas.height(); ++y) png_write_row(png, const_cast<png_bytep>(canvas.row(y)));
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  const bool closed = std::fclose(file) == 0;
  std::error_code ec;
  if (closed) std::filesystem::rename(temporary, target, ec);
  if (!closed || ec) {
    std::filesystem::remove(temporary, ec);
    throw Error(ErrorKind::io, fmt::format("cannot write the lr finder plot {}", path));
  }
}

}  // namespace

void write_loss_plot(const std::string& path, const std::vector<SweepPoint>& points, std::optional<size_t> marked,
                     const LossPlotOptions& options) {
  Canvas canvas(options.width_, options.height_);
  const int left = 90, right = options.width_ - 30, top = 50, bottom = options.height_ - 60;
  auto xv = [&](double lr) { return options.log_x_ ? std::log10(lr) : lr; };

  // Ranges: x over the lrs swept, y over the finite smoothed losses (5% headroom).
  double x_lo = INFINITY, x_hi = -INFINITY, y_lo = INFINITY, y_hi = -INFINITY;
  for (const auto& p : points) {
    if (p.lr > 0 || !options.log_x_) {
      x_lo = std::min(x_lo, xv(p.lr));
      x_hi = std::max(x_hi, xv(p.lr));
    }
    if (std::isfinite(p.smoothed_loss)) {
      y_lo = std::min(y_lo, p.smoothed_loss);
      y_hi = std::max(y_hi, p.smoothed_loss);
    }
  }
  if (!std::isfinite(x_lo)) x_lo = 0, x_hi = 1;
  if (x_hi <= x_lo) x_hi = x_lo + 1;
  if (!std::isfinite(y_lo)) y_lo = 0, y_hi = 1;
  if (y_hi <= y_lo) {
    const double pad = std::max(std::abs(y_lo) * 0.1, 1e-12);
    y_lo -= pad;
    y_hi += pad;
  }
  const double y_pad = (y_hi - y_lo) * 0.05;
  y_lo -= y_pad;
  y_hi += y_pad;
  auto px = [&](double x) { return left + static_cast<int>(std::lround((x - x_lo) / (x_hi - x_lo) * (right - left))); };
  auto py = [&](double y) {
    return bottom - static_cast<int>(std::lround((y - y_lo) / (y_hi - y_lo) * (bottom - top)));
  };

  // Grid and tick labels: every decade on a log axis (or five even steps), five steps of loss.
  std::vector<double> x_ticks;
  if (options.log_x_ && std::floor(x_hi) - std::ceil(x_lo) >= 1) {
    const double stride = std::max(1.0, std::ceil((std::floor(x_hi) - std::ceil(x_lo)) / 10.0));
    for (double d = std::ceil(x_lo); d <= x_hi + 1e-9; d += stride) x_ticks.push_back(d);
  } else {
    for (int i = 0; i <= 4; ++i) x_ticks.push_back(x_lo + (x_hi - x_lo) * i / 4.0);
  }
  for (double t : x_ticks) {
    canvas.line(px(t), top, px(t), bottom, kGrid);
    canvas.line(px(t), bottom, px(t), bottom + 5, kBlack);
    const std::string label = short_number(options.log_x_ ? std::pow(10.0, t) : t);
    canvas.text(px(t) - Canvas::text_width(label) / 2, bottom + 10, label, kBlack);
  }
  for (int i = 0; i <= 4; ++i) {
    const double v = y_lo + (y_hi - y_lo) * i / 4.0;
    canvas.line(left, py(v), right, py(v), kGrid);
    canvas.line(left - 5, py(v), left, py(v), kBlack);
    const std::string label = short_number(v);
    canvas.text(left - 10 - Canvas::text_width(label), py(v) - 5, label, kBlack);
  }
  canvas.line(left, top, left, bottom, kBlack, 2);
  canvas.line(left, bottom, right, bottom, kBlack, 2);
  const std::string x_caption = options.log_x_ ? "lr (log)" : "lr";
  canvas.text((left + right - Canvas::text_width(x_caption)) / 2, options.height_ - 25, x_caption, kBlack);
  canvas.text(10, top - 30, "loss", kBlack);

  // Raw losses as dots (clipped to the plot), then the smoothed curve over them.
  auto inside = [&](int x, int y) { return x >= left && x <= right && y >= top && y <= bottom; };
  for (const auto& p : points)
    if (std::isfinite(p.loss) && (p.lr > 0 || !options.log_x_) && inside(px(xv(p.lr)), py(p.loss)))
      canvas.disc(px(xv(p.lr)), py(p.loss), 2, kRaw);
  std::optional<std::pair<int, int>> previous;
  for (const auto& p : points) {
    if (!std::isfinite(p.smoothed_loss) || (options.log_x_ && p.lr <= 0)) {
      previous.reset();
      continue;
    }
    const std::pair<int, int> here{px(xv(p.lr)), py(p.smoothed_loss)};
    if (previous) canvas.line(previous->first, previous->second, here.first, here.second, kCurve, 2);
    previous = here;
  }

  // The suggestion: a dashed vertical line, a red disc on the curve and its value as the title.
  if (marked && *marked < points.size() && std::isfinite(points[*marked].smoothed_loss)) {
    const auto& p = points[*marked];
    canvas.line(px(xv(p.lr)), top, px(xv(p.lr)), bottom, kMark, 1, 4);
    canvas.disc(px(xv(p.lr)), py(p.smoothed_loss), 6, kMark);
    const std::string title = "suggestion: lr = " + short_number(p.lr, 3);
    canvas.text((left + right - Canvas::text_width(title)) / 2, 15, title, kMark);
  } else {
    const std::string title = "no suggestion";
    canvas.text((left + right - Canvas::text_width(title)) / 2, 15, title, kBlack);
  }
  write_png(path, canvas);
}

}  // namespace fulgur::lr_finder
