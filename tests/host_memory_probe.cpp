// Prints the host malloc policy that libfulgur_core applied when it was loaded (host_memory_test
// runs it under different environments). Built twice: as is, and with FULGUR_PROBE_OPT_OUT, where
// the program opts out the documented way, at namespace scope.
#include <fulgur/host_memory.h>

#include <cstdio>

#ifdef FULGUR_PROBE_OPT_OUT
FULGUR_HOST_MALLOC("system");
#endif

int main() {
  const fulgur::HostMallocPolicy& p = fulgur::host_malloc_policy();
  std::printf("tuned=%d source=%s\n%s\n", p.tuned ? 1 : 0, p.source.c_str(), fulgur::describe(p).c_str());
  return 0;
}
