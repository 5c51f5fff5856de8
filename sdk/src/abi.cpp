// The host side of the ABI: the guard symbol plugins link against and the tag they must match.
#include <fulgur/abi_tag.h>
#include <fulgur/export.h>
#include <fulgur/host.h>

// Declared and defined in one go (a second declaration would drop the visibility attribute).
extern "C" FULGUR_SDK_API const int FULGUR_ABI_GUARD;
extern "C" const int FULGUR_ABI_GUARD = 1;

namespace fulgur {

const fulgur_abi_tag& host_abi_tag() {
  static constexpr fulgur_abi_tag tag = detail::this_abi_tag();
  return tag;
}

const char* host_abi_guard_symbol() {
#define FULGUR_STR_(x) #x
#define FULGUR_STR(x) FULGUR_STR_(x)
  return FULGUR_STR(FULGUR_ABI_GUARD);
}

}  // namespace fulgur
