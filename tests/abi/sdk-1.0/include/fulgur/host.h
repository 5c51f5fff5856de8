/// @file
/// Facts about the host build that the registry checks plugins against.
#pragma once

#include <fulgur/abi.h>
#include <fulgur/export.h>

namespace fulgur {

/// ABI tag of the libtorch / standard library / interface version this SDK library was built
/// with: what every plugin's fulgur_plugin_desc::abi_tag must equal. A reference to static data.
FULGUR_SDK_API const fulgur_abi_tag& host_abi_tag();
/// Name of the link-time guard symbol the SDK library defines (FULGUR_ABI_GUARD), for messages and
/// tests. Points to static storage.
FULGUR_SDK_API const char* host_abi_guard_symbol();

}  // namespace fulgur
