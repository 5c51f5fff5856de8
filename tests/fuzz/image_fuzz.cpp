// Fuzz target: JPEG and PNG decoding (libjpeg-turbo, libpng and Fulgur's checks around them)
// through the image folder dataset: the input is the one image of a one-class folder. The first
// byte picks grey or RGB output and skip_corrupt.
#include <fulgur/data/image_folder.h>
#include <fulgur/error.h>

#include "fuzz_targets.h"
#include "scratch_dir.h"

namespace fulgur::fuzz {

int image(const uint8_t* data, size_t size) {
  static ScratchDir dir("fulgur-fuzz-image");
  if (size == 0) return 0;
  const bool skip_corrupt = data[0] & 2;
  data::ImageFolderOptions options;
  options.channels((data[0] & 1) ? 1 : 3).skip_corrupt(skip_corrupt);
  // The extension only makes the folder list the file; the decoder goes by the signature.
  dir.write("class/image.png", data + 1, size - 1);
  try {
    data::ImageFolder folder(dir.root(), options);
    for (int64_t i = 0; i < folder.size(); ++i) {
      data::Sample s = folder.get(i);
      (void)s.input.numel();
    }
  } catch (const Error&) {
  } catch (const data::SkipSample&) {
    if (!skip_corrupt) throw;
  }
  return 0;
}

}  // namespace fulgur::fuzz

FULGUR_FUZZ_ENTRY(fulgur::fuzz::image)
