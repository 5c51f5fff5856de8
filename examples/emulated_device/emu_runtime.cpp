// The emulated device's runtime, registered with libtorch the way an out-of-tree backend registers
// through PrivateUse1 ("open registration"; PyTorch's own test backend, OpenReg, has the same
// shape):
//
//   allocator        c10::SetAllocator(PrivateUse1): where device tensors' bytes come from
//   device guard     C10_REGISTER_GUARD_IMPL(PrivateUse1): current device, streams, events
//   generator        a device RNG with its own state, made by the hooks' getNewGenerator
//                    (REGISTER_GENERATOR_PRIVATEUSE1 is its deprecated older door)
//   hooks            at::RegisterPrivateUse1HooksInterface: what generic ATen code asks of a
//                    backend (default generator per device, device count, storage resize)
//   backend name     c10::register_privateuse1_backend("emu"): devices print as emu:0
//
// "Device memory" is host memory: every piece is real, only the driver calls are memcpy/aligned
// allocations. A vendor keeps the structure and replaces the bodies marked VENDOR.
#include "emu_runtime.h"

#include <fulgur/error.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/DeviceType.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>

namespace emu {
namespace {

void check_index(c10::DeviceIndex index) {
  TORCH_CHECK(index >= 0 && index < kDeviceCount, "emulated device: no device ", static_cast<int>(index), " (",
              static_cast<int>(kDeviceCount), " devices: ", kBackendName, ":0..", static_cast<int>(kDeviceCount - 1),
              ")");
}

thread_local c10::DeviceIndex t_current_device = 0;

// ---------------------------------------------------------------------------------------------
// Allocator. VENDOR: the driver's device malloc/free; copy_data is a device-to-device copy.
// Host memory, 64-byte aligned (what vectorised CPU kernels like), with per-device counters for
// Accelerator::device_stats and a pointer -> device map for hooks' getDeviceFromPtr.
struct DeviceCounters {
  std::atomic<int64_t> allocated{0};
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> allocations{0};
};
std::array<DeviceCounters, kDeviceCount> g_counters;

struct Allocation {
  c10::DeviceIndex device;
  size_t bytes;
};
std::mutex g_allocations_mutex;
std::unordered_map<void*, Allocation>& allocations() {
  static auto* map = new std::unordered_map<void*, Allocation>();  // outlives static destructors
  return *map;
}

void device_free(void* ptr) {
  if (!ptr) return;
  Allocation a{};
  {
    std::lock_guard<std::mutex> lock(g_allocations_mutex);
    auto it = allocations().find(ptr);
    if (it != allocations().end()) {
      a = it->second;
      allocations().erase(it);
    }
  }
  g_counters[a.device].allocated -= static_cast<int64_t>(a.bytes);
  std::free(ptr);
}

class EmuAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    const c10::DeviceIndex device = t_current_device;
    const c10::Device where(c10::DeviceType::PrivateUse1, device);
    if (nbytes == 0) return {nullptr, nullptr, &device_free, where};
    const size_t rounded = (nbytes + 63) / 64 * 64;
    void* ptr = std::aligned_alloc(64, rounded);
    TORCH_CHECK_WITH(OutOfMemoryError, ptr, "emulated device ", where.str(), ": out of memory allocating ", nbytes,
                     " bytes");
    {
      std::lock_guard<std::mutex> lock(g_allocations_mutex);
      allocations()[ptr] = {device, nbytes};
    }
    auto& c = g_counters[device];
    const int64_t now = c.allocated += static_cast<int64_t>(nbytes);
    int64_t peak = c.peak.load();
    while (now > peak && !c.peak.compare_exchange_weak(peak, now)) {
    }
    ++c.allocations;
    return {ptr, ptr, &device_free, where};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &device_free; }
  void copy_data(void* dest, const void* src, size_t count) const override { std::memcpy(dest, src, count); }
};
EmuAllocator g_allocator;
// Priority 0, as a backend's default allocator.
REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &g_allocator);

// ---------------------------------------------------------------------------------------------
// Device guard. VENDOR: the driver's set/get current device, its streams and events. The emulated
// device runs every kernel synchronously on the calling thread, so it has one stream per device
// and events that are complete as soon as they are recorded.
class EmuGuardImpl final : public c10::impl::DeviceGuardImplInterface {
 public:
  static constexpr c10::DeviceType kType = c10::DeviceType::PrivateUse1;
  c10::DeviceType type() const override { return kType; }
  c10::Device exchangeDevice(c10::Device d) const override {
    const c10::Device old = getDevice();
    if (d.index() >= 0 && d.index() != old.index()) setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return {kType, t_current_device}; }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kType, "emulated device guard: expected a ", kBackendName, " device, got ", d.str());
    if (d.index() < 0) return;
    check_index(d.index());
    t_current_device = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0 && d.index() < kDeviceCount) t_current_device = d.index();
  }
  c10::Stream getStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getDefaultStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream getNewStream(c10::Device d, int) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream exchangeStream(c10::Stream s) const override { return c10::Stream(c10::Stream::DEFAULT, s.device()); }
  c10::DeviceIndex deviceCount() const noexcept override { return kDeviceCount; }
  // Events: the autograd engine records and waits on them between streams. Work is synchronous,
  // so an event is done once recorded; a non-null marker says "recorded".
  void record(void** event, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {
    *event = reinterpret_cast<void*>(1);
  }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, EmuGuardImpl);

// ---------------------------------------------------------------------------------------------
// Generator. VENDOR: the device's own RNG (a Philox seed/offset pair on most accelerators).
// Here each device owns a CPU Mersenne Twister (its "engine"): its state is the device's RNG state,
// separate from the CPU default generator's, and the kernel fallback hands the engine to the CPU
// kernels it runs (they accept CPU generators only). Every method delegates to the engine.
class EmuGeneratorImpl final : public c10::GeneratorImpl {
 public:
  explicit EmuGeneratorImpl(c10::DeviceIndex index, at::Generator engine = {})
      : c10::GeneratorImpl(c10::Device(c10::DeviceType::PrivateUse1, index),
                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        engine_(engine.defined() ? std::move(engine)
                                 : at::make_generator<at::CPUGeneratorImpl>(c10::detail::getNonDeterministicRandom())) {
  }
  static c10::DeviceType device_type() { return c10::DeviceType::PrivateUse1; }

  void set_current_seed(uint64_t seed) override { engine_.set_current_seed(seed); }
  void set_offset(uint64_t offset) override { engine_.set_offset(offset); }
  uint64_t get_offset() const override { return engine_.get_offset(); }
  uint64_t current_seed() const override { return engine_.current_seed(); }
  uint64_t seed() override { return engine_.seed(); }
  void set_state(const c10::TensorImpl& state) override { engine_.unsafeGetGeneratorImpl()->set_state(state); }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    return engine_.unsafeGetGeneratorImpl()->get_state();
  }
  const at::Generator& engine() const { return engine_; }

 private:
  EmuGeneratorImpl* clone_impl() const override { return new EmuGeneratorImpl(device().index(), engine_.clone()); }
  at::Generator engine_;
};

at::Generator make_generator(c10::DeviceIndex index) {
  if (index < 0) index = t_current_device;
  check_index(index);
  return at::make_generator<EmuGeneratorImpl>(index);
}

// ---------------------------------------------------------------------------------------------
// Hooks: what ATen's device-generic code (Context::defaultGenerator, manual_seed, storage
// resizing, the accelerator API) asks of the PrivateUse1 backend.
class EmuHooks final : public at::PrivateUse1HooksInterface {
 public:
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  void init() const override {}
  c10::DeviceIndex deviceCount() const override { return kDeviceCount; }
  c10::DeviceIndex getCurrentDevice() const override { return t_current_device; }
  void setCurrentDevice(c10::DeviceIndex d) const override { set_current_device(d); }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override {
    const c10::DeviceIndex old = t_current_device;
    if (d >= 0) set_current_device(d);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const override { return exchangeDevice(d); }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex index) const override { return default_generator(index); }
  at::Generator getNewGenerator(c10::DeviceIndex index) const override { return make_generator(index); }
  c10::Device getDeviceFromPtr(void* data) const override {
    std::lock_guard<std::mutex> lock(g_allocations_mutex);
    auto it = allocations().find(data);
    TORCH_CHECK(it != allocations().end(), "emulated device: pointer ", data, " is not a device allocation");
    return {c10::DeviceType::PrivateUse1, it->second.device};
  }
  bool isPinnedPtr(const void*) const override { return false; }
  at::Allocator* getPinnedMemoryAllocator() const override { return c10::GetCPUAllocator(); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
    TORCH_CHECK(impl->resizable(), "emulated device: this storage is not resizable");
    const c10::DeviceGuard guard(impl->device());
    c10::DataPtr data = g_allocator.allocate(newsize);
    const size_t keep = std::min(newsize, impl->nbytes());
    if (keep > 0) std::memcpy(data.get(), impl->data(), keep);
    impl->set_data_ptr_noswap(std::move(data));
    impl->set_nbytes(newsize);
  }
};

}  // namespace

c10::DeviceIndex current_device() { return t_current_device; }

void set_current_device(c10::DeviceIndex index) {
  check_index(index);
  t_current_device = index;
}

const at::Generator& default_generator(c10::DeviceIndex index) {
  // Made once, seeded like the CPU default generator (at::manual_seed reseeds every device's).
  static const std::array<at::Generator, kDeviceCount> generators = [] {
    std::array<at::Generator, kDeviceCount> g;
    for (c10::DeviceIndex i = 0; i < kDeviceCount; ++i) {
      g[i] = make_generator(i);
      g[i].set_current_seed(c10::default_rng_seed_val);
    }
    return g;
  }();
  if (index < 0) index = t_current_device;
  check_index(index);
  return generators[index];
}

at::Generator engine_of(const at::Generator& generator) {
  auto* impl = dynamic_cast<EmuGeneratorImpl*>(generator.unsafeGetGeneratorImpl());
  TORCH_CHECK(impl, "emulated device: generator of device ", generator.device().str(),
              " is not an emulated-device generator");
  return impl->engine();
}

MemoryStats memory_stats(c10::DeviceIndex index) {
  check_index(index);
  const auto& c = g_counters[index];
  return {c.allocated.load(), c.peak.load(), c.allocations.load()};
}

void ensure_registered() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (c10::is_privateuse1_backend_registered() && c10::get_privateuse1_backend() != kBackendName)
      throw fulgur::Error(fulgur::ErrorKind::config,
                          "accelerator 'emulated': PrivateUse1 already belongs to backend '" +
                              c10::get_privateuse1_backend() +
                              "' in this process; one out-of-tree device backend per process");
    c10::register_privateuse1_backend(kBackendName);
    static EmuHooks hooks;
    at::RegisterPrivateUse1HooksInterface(&hooks);
  });
}

}  // namespace emu
