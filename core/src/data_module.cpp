#include <fulgur/data_module.h>
#include <fulgur/error.h>

#include <fmt/format.h>

namespace fulgur {

BatchLoader::~BatchLoader() = default;
DataModule::~DataModule() = default;
void* DataModule::extension(std::string_view) noexcept { return nullptr; }

void DataModule::set_batch_size(int64_t n) {
  throw Error(ErrorKind::config,
              fmt::format("the DataModule cannot change its batch size (asked for {}): override "
                          "DataModule::batch_size() and set_batch_size(n) so that train_loader() uses n",
                          n));
}

std::vector<std::unique_ptr<BatchLoader>> DataModule::val_loaders() {
  std::vector<std::unique_ptr<BatchLoader>> loaders;
  if (auto loader = val_loader()) loaders.push_back(std::move(loader));
  return loaders;
}

std::vector<std::unique_ptr<BatchLoader>> DataModule::test_loaders() {
  std::vector<std::unique_ptr<BatchLoader>> loaders;
  if (auto loader = test_loader()) loaders.push_back(std::move(loader));
  return loaders;
}

}  // namespace fulgur
