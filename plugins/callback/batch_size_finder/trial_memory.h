// Measuring a batch-size trial: whether running it stayed within a memory budget and whether it
// ran out of memory.
//
// On CPU the peak is counted, not sampled: while a CpuPeakMemory scope lives, c10's CPU allocator is
// wrapped so that every tensor allocation and free (activations, gradients, optimizer state, data)
// moves a counter, and the peak of (bytes allocated in the scope - bytes freed) is the trial's
// memory. Process RSS would not do: glibc keeps freed memory (M_TRIM_THRESHOLD is 1 GiB in Fulgur)
// and RSS counts the code and the dataset too. Memory a library allocates outside c10 (oneDNN
// scratch buffers, thread stacks) is not counted. The allocator is swapped with c10::SetCPUAllocator,
// which c10 documents as not thread-safe: open the scope while no other thread allocates tensors
// (between epochs, before the loaders start), as the trials of a batch-size search do.
//
// On CUDA a trial fails the way Lightning detects it: c10::OutOfMemoryError from the caching
// allocator (run_trial catches it).
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>

namespace fulgur::batch_size_finder {

class CpuPeakMemory {
 public:
  CpuPeakMemory() : previous_(c10::GetCPUAllocator()) {
    Counting& counting = instance();
    counting.base = previous_;
    counting.current.store(0);
    counting.peak.store(0);
    c10::SetCPUAllocator(&counting, kPriority);
  }
  ~CpuPeakMemory() { c10::SetCPUAllocator(previous_, kPriority); }
  CpuPeakMemory(const CpuPeakMemory&) = delete;
  CpuPeakMemory& operator=(const CpuPeakMemory&) = delete;

  // The largest number of bytes held at once by tensors allocated in this scope.
  int64_t peak_bytes() const { return std::max<int64_t>(0, instance().peak.load()); }

 private:
  // Higher than any allocator Fulgur or libtorch registers by default, so ours wins while it lives.
  static constexpr uint8_t kPriority = 100;

  struct Counting final : c10::Allocator {
    c10::Allocator* base = nullptr;
    std::atomic<int64_t> current{0};
    std::atomic<int64_t> peak{0};

    struct Held {
      c10::DataPtr inner;
      int64_t bytes;
    };
    static void release(void* context) {
      auto* held = static_cast<Held*>(context);
      // Frees of tensors allocated in an earlier scope count against that one's counter only in
      // the sense that `current` may go below zero for this one: the peak ignores that.
      instance().current.fetch_sub(held->bytes);
      delete held;
    }

    c10::DataPtr allocate(size_t n) override {
      c10::DataPtr inner = base->allocate(n);
      void* data = inner.get();
      const c10::Device device = inner.device();
      const int64_t now = current.fetch_add(static_cast<int64_t>(n)) + static_cast<int64_t>(n);
      int64_t seen = peak.load();
      while (now > seen && !peak.compare_exchange_weak(seen, now)) {
      }
      return {data, new Held{std::move(inner), static_cast<int64_t>(n)}, &Counting::release, device};
    }
    void copy_data(void* dest, const void* src, std::size_t count) const override { base->copy_data(dest, src, count); }
  };
  static Counting& instance() {
    static Counting counting;  // outlives every tensor whose deleter points at it
    return counting;
  }

  c10::Allocator* previous_;
};

struct TrialOutcome {
  bool fits = false;
  bool out_of_memory = false;         // c10::OutOfMemoryError (CUDA)
  std::optional<int64_t> peak_bytes;  // CPU: counted as above
};

// Runs `trial` and says whether it fit: no c10::OutOfMemoryError, and with a CPU budget
// (max_memory_bytes > 0) a counted peak of at most that many bytes.
inline TrialOutcome run_trial(const std::function<void()>& trial, int64_t max_memory_bytes) {
  TrialOutcome outcome;
  try {
    if (max_memory_bytes > 0) {
      CpuPeakMemory memory;
      trial();
      outcome.peak_bytes = memory.peak_bytes();
    } else {
      trial();
    }
  } catch (const c10::OutOfMemoryError&) {
    outcome.out_of_memory = true;
    return outcome;
  }
  outcome.fits = !outcome.peak_bytes || *outcome.peak_bytes <= max_memory_bytes;
  return outcome;
}

}  // namespace fulgur::batch_size_finder
