#include <fulgur/data_module.h>
#include <fulgur/error.h>
#include <fulgur/sample_position.h>

#include <fmt/format.h>

#include <mutex>
#include <unordered_map>

namespace fulgur {

BatchLoader::~BatchLoader() = default;
DataModule::~DataModule() = default;
void* DataModule::extension(std::string_view) noexcept { return nullptr; }
SamplePositionLoader::~SamplePositionLoader() = default;

namespace {
// Loaders whose class cannot derive from SamplePositionLoader (data::DataLoader's layout is
// fixed by a header that plugins compile against) register their implementation here.
std::mutex registry_mutex;
std::unordered_map<const BatchLoader*, SamplePositionLoader*>& registry() {
  static std::unordered_map<const BatchLoader*, SamplePositionLoader*> map;
  return map;
}
}  // namespace

SamplePositionLoader* sample_position_of(BatchLoader& loader) {
  if (auto* own = dynamic_cast<SamplePositionLoader*>(&loader)) return own;
  std::lock_guard lock(registry_mutex);
  auto it = registry().find(&loader);
  return it == registry().end() ? nullptr : it->second;
}

void register_sample_position(const BatchLoader& loader, SamplePositionLoader* position) {
  std::lock_guard lock(registry_mutex);
  registry()[&loader] = position;
}

void unregister_sample_position(const BatchLoader& loader) {
  std::lock_guard lock(registry_mutex);
  registry().erase(&loader);
}

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
