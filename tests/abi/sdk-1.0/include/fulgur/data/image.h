// JPEG and PNG decoding (libjpeg-turbo and libpng, Debian's libjpeg62-turbo and libpng16).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace fulgur::data {

// Decodes an in-memory JPEG or PNG (recognised by its signature) into a (channels, H, W) uint8
// tensor; channels 1 (grey) or 3 (RGB; grey is replicated, alpha dropped). Throws fulgur::Error
// (io) naming `what` (a file, a tar member) for anything not a complete, valid image: a truncated
// JPEG is an error, not the grey-filled image libjpeg would make of it.
at::Tensor decode_image(const uint8_t* data, size_t size, int64_t channels, const std::string& what);

}  // namespace fulgur::data
