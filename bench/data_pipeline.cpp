// bench_data_pipeline: images/s through Fulgur's image-folder pipeline (decode, random resized
// crop 224, horizontal flip, normalize, batches of 64), the C++ side of bench/data_pipeline.sh.
//
//   bench_data_pipeline --dir IMAGE_FOLDER [--workers 2] [--epochs 2] [--batch-size 64] [--size 224]
//
// Prints one JSON line: images/s over each epoch after its first batch (steady state, as the Python
// side measures) and over the whole epoch.
#include <fulgur/data/data_loader.h>
#include <fulgur/data/image_folder.h>
#include <fulgur/data/transforms.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace d = fulgur::data;
using Clock = std::chrono::steady_clock;

int main(int argc, char** argv) {
  std::string dir;
  int64_t workers = 2, epochs = 2, batch = 64, size = 224;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string key = argv[i];
    const char* value = argv[i + 1];
    if (key == "--dir")
      dir = value;
    else if (key == "--workers")
      workers = std::atoll(value);
    else if (key == "--epochs")
      epochs = std::atoll(value);
    else if (key == "--batch-size")
      batch = std::atoll(value);
    else if (key == "--size")
      size = std::atoll(value);
    else {
      std::fprintf(stderr, "unknown argument %s\n", key.c_str());
      return 2;
    }
  }
  if (dir.empty()) {
    std::fprintf(stderr, "usage: bench_data_pipeline --dir IMAGE_FOLDER [--workers N] [--epochs N]\n");
    return 2;
  }
  auto folder = std::make_shared<d::ImageFolder>(dir);
  auto transform = d::compose({d::random_resized_crop(d::RandomResizedCropOptions(size)), d::random_horizontal_flip(),
                               d::normalize({0.485, 0.456, 0.406}, {0.229, 0.224, 0.225})});
  d::DataLoader loader(
      folder, d::DataLoaderOptions().batch_size(batch).shuffle(true).seed(0).num_workers(workers).transform(transform));
  double steady_images = 0, steady_seconds = 0, all_images = 0, all_seconds = 0;
  for (int64_t e = 0; e < epochs; ++e) {
    const auto start = Clock::now();
    loader.start_epoch(e);
    Clock::time_point first;
    int64_t images = 0, after_first = 0;
    bool got_first = false;
    while (auto b = loader.next()) {
      images += b->size();
      if (!got_first) {
        got_first = true;
        first = Clock::now();
      } else {
        after_first += b->size();
      }
    }
    const auto end = Clock::now();
    steady_images += static_cast<double>(after_first);
    steady_seconds += std::chrono::duration<double>(end - first).count();
    all_images += static_cast<double>(images);
    all_seconds += std::chrono::duration<double>(end - start).count();
  }
  std::printf("{\"images_per_s\": %.3f, \"images_per_s_whole_epoch\": %.3f, \"images\": %.0f}\n",
              steady_images / steady_seconds, all_images / all_seconds, all_images);
  return 0;
}
