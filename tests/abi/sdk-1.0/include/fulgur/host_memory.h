// Host (CPU) memory: how Fulgur configures the C heap of every program that links libfulgur_core.
//
// A CPU training step allocates and frees the same activation and gradient buffers (hundreds of
// KiB to a few MiB each) at every step. With glibc's default settings malloc serves many of them
// with fresh mmap()s or returns the freed top of the heap to the kernel, so the next step faults
// every page in again: on the Fashion-MNIST CNN that was ~3000 page faults per training step, 2.9 M
// in one epoch against 0.18 M with the settings below, and 9x the system time (issue #16). When libfulgur_core is
// loaded (before main), Fulgur therefore sets two glibc malloc parameters with mallopt():
//
//   M_MMAP_THRESHOLD = 32 MiB   blocks below this come from the heap and are reused, not unmapped
//   M_TRIM_THRESHOLD = 1 GiB    freed memory at the top of a heap is kept for the next step
//
// The cost is that the heap stays at its high-water mark (peak RSS is unchanged; RSS after a
// burst does not shrink back until 1 GiB is free), which is what every caching allocator does.
//
// Opting out (glibc's own defaults, exactly as without Fulgur), in order of precedence:
//   - environment: FULGUR_HOST_MALLOC=system (FULGUR_HOST_MALLOC=tuned forces the settings on);
//   - GLIBC_TUNABLES that set glibc.malloc.mmap_threshold or glibc.malloc.trim_threshold: the
//     user's own malloc tuning is left alone;
//   - in the program, at namespace scope of one source file: FULGUR_HOST_MALLOC("system");
// Programs that preload or link another allocator (jemalloc, tcmalloc, mimalloc) are unaffected:
// mallopt() only configures glibc's malloc.
#pragma once

#include <cstddef>
#include <string>

// Read by libfulgur_core when it is loaded; define it with FULGUR_HOST_MALLOC(...) (weak: most
// programs do not define it). Values: "system" or "tuned".
extern "C" {
extern const char* const fulgur_host_malloc __attribute__((weak));
}

#define FULGUR_HOST_MALLOC(value) extern "C" const char* const fulgur_host_malloc = value

namespace fulgur {

struct HostMallocPolicy {
  bool tuned = false;         // the two mallopt() settings are in effect
  size_t mmap_threshold = 0;  // bytes; 0 when not tuned (glibc's dynamic default)
  size_t trim_threshold = 0;
  std::string source;  // what decided: "default", "FULGUR_HOST_MALLOC", "GLIBC_TUNABLES", "program", "mallopt failed"
};

// What was decided and applied when libfulgur_core was loaded.
const HostMallocPolicy& host_malloc_policy();

// One line for diagnostics, e.g. "glibc malloc tuned (mmap_threshold 32 MiB, trim_threshold 1024 MiB)".
std::string describe(const HostMallocPolicy& policy);

}  // namespace fulgur
