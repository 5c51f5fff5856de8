// libfulgur_bench_caching_allocator.so: the "caching CPU allocator at the LibTorch level" candidate
// of issue #16, for measurement only (bench/python/real.py --sides fulgur-caching preloads it).
// When loaded it installs, through c10::SetCPUAllocator, an allocator that keeps freed tensor
// storage in per-size free lists and hands it out again, so a training step's activations and
// gradients reuse the previous step's pages. It caches forever and only tensor storage (not the
// rest of the heap): enough to compare page faults and RSS with the mallopt settings, not a product.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

class CachingCpuAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    const size_t size = round(n);
    void* p = nullptr;
    {
      std::lock_guard lock(mutex_);
      auto it = free_.find(size);
      if (it != free_.end() && !it->second.empty()) {
        p = it->second.back();
        it->second.pop_back();
      }
    }
    if (!p && posix_memalign(&p, 64, size == 0 ? 64 : size) != 0) throw std::bad_alloc();
    {
      std::lock_guard lock(mutex_);
      sizes_[p] = size;
    }
    return {p, p, &deleter, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &deleter; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }

 private:
  // 4 KiB granularity above 64 KiB, so shapes that differ slightly (a short last batch) still reuse.
  static size_t round(size_t n) { return n < (64 << 10) ? (n + 63) / 64 * 64 : (n + 4095) / 4096 * 4096; }
  static void deleter(void* p);

  std::mutex mutex_;
  std::unordered_map<size_t, std::vector<void*>> free_;
  std::unordered_map<void*, size_t> sizes_;
  friend struct Installer;
};

CachingCpuAllocator* instance() {
  static auto* a = new CachingCpuAllocator();  // never destroyed: tensors may outlive static teardown
  return a;
}

void CachingCpuAllocator::deleter(void* p) {
  if (!p) return;
  CachingCpuAllocator* a = instance();
  std::lock_guard lock(a->mutex_);
  auto it = a->sizes_.find(p);
  if (it == a->sizes_.end()) return std::free(p);
  a->free_[it->second].push_back(p);
  a->sizes_.erase(it);
}

struct Installer {
  Installer() { c10::SetCPUAllocator(instance(), /*priority=*/100); }
} installer;

}  // namespace
