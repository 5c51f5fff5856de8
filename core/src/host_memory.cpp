// Configures glibc malloc for training when libfulgur_core is loaded (see fulgur/host_memory.h for
// the reasons and the opt-outs). Kept out of the Trainer on purpose: the heap is configured once
// per process, before any training allocation, for every program that links the core (users' own
// binaries, tests, benches), and it must not depend on how or whether a Trainer is built.
#include <fulgur/host_memory.h>

#include <malloc.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string_view>

namespace fulgur {

namespace {

// 32 MiB is the largest M_MMAP_THRESHOLD glibc accepts on 64-bit (HEAP_MAX_SIZE / 2) and the value
// its dynamic threshold would climb to anyway; only really large tensors still get their own
// mapping. 1 GiB of trim threshold keeps a whole step's working set cached between steps.
constexpr size_t kMmapThreshold = size_t{32} << 20;
constexpr size_t kTrimThreshold = size_t{1} << 30;

// Whether the user already tuned the same knobs through glibc's own mechanism.
bool tunables_set_malloc_thresholds() {
  const char* t = std::getenv("GLIBC_TUNABLES");
  if (!t) return false;
  const std::string_view s(t);
  return s.find("glibc.malloc.mmap_threshold") != std::string_view::npos ||
         s.find("glibc.malloc.trim_threshold") != std::string_view::npos;
}

// Returns "system", "tuned" or nullptr for an unknown value (reported once on stderr: this runs
// before main, when no logger exists yet).
const char* parse_choice(const char* value, const char* where) {
  if (std::strcmp(value, "system") == 0 || std::strcmp(value, "tuned") == 0) return value;
  std::fprintf(stderr,
               "fulgur: warning: %s = \"%s\" is not understood (use \"system\" or \"tuned\"); using \"tuned\"\n", where,
               value);
  return nullptr;
}

HostMallocPolicy decide_and_apply() {
  HostMallocPolicy p;
  const char* choice = nullptr;
  if (const char* env = std::getenv("FULGUR_HOST_MALLOC"); env && *env) {
    choice = parse_choice(env, "FULGUR_HOST_MALLOC");
    if (choice) p.source = "FULGUR_HOST_MALLOC";
  }
  if (!choice && tunables_set_malloc_thresholds()) {
    p.source = "GLIBC_TUNABLES";
    return p;
  }
  if (!choice && &fulgur_host_malloc != nullptr && fulgur_host_malloc) {
    choice = parse_choice(fulgur_host_malloc, "fulgur_host_malloc (FULGUR_HOST_MALLOC in the program)");
    if (choice) p.source = "program";
  }
  if (!choice) {
    choice = "tuned";
    p.source = "default";
  }
  if (std::strcmp(choice, "system") == 0) return p;
  // mallopt returns 1 on success. The trim threshold first: setting either disables glibc's
  // dynamic adjustment of both, so a failure of the second leaves a consistent pair behind.
  if (mallopt(M_TRIM_THRESHOLD, static_cast<int>(kTrimThreshold)) != 1 ||
      mallopt(M_MMAP_THRESHOLD, static_cast<int>(kMmapThreshold)) != 1) {
    p.source = "mallopt failed";
    return p;
  }
  p.tuned = true;
  p.mmap_threshold = kMmapThreshold;
  p.trim_threshold = kTrimThreshold;
  return p;
}

// Runs when the library is loaded, before the program's main and before any Trainer exists.
const HostMallocPolicy& policy_at_load() {
  static const HostMallocPolicy policy = decide_and_apply();
  return policy;
}
[[maybe_unused]] const HostMallocPolicy& applied_at_load = policy_at_load();

}  // namespace

const HostMallocPolicy& host_malloc_policy() { return policy_at_load(); }

std::string describe(const HostMallocPolicy& p) {
  if (p.tuned)
    return "glibc malloc tuned (mmap_threshold " + std::to_string(p.mmap_threshold >> 20) + " MiB, trim_threshold " +
           std::to_string(p.trim_threshold >> 20) + " MiB; opt out with FULGUR_HOST_MALLOC=system)";
  return "glibc malloc defaults (decided by " + p.source + ")";
}

}  // namespace fulgur
