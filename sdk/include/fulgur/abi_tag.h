// The ABI facts of the translation unit that includes this header: torch version, standard
// library, C++ interface version. plugin.h stamps them into each plugin's descriptor and ELF note;
// the SDK library stamps them into the host tag. The registry compares the two.
#pragma once

#include <fulgur/abi.h>

#include <torch/headeronly/version.h>

#include <version>  // defines __GLIBCXX__ / _LIBCPP_VERSION

// Tests simulate a plugin built against another libtorch by overriding these two.
#ifndef FULGUR_ABI_TORCH_MAJOR
#define FULGUR_ABI_TORCH_MAJOR TORCH_VERSION_MAJOR
#endif
#ifndef FULGUR_ABI_TORCH_MINOR
#define FULGUR_ABI_TORCH_MINOR TORCH_VERSION_MINOR
#endif
// Set by fulgur_add_plugin() / the SDK build from the CUDA toolkit libtorch was built with.
#ifndef FULGUR_CUDA_VERSION
#define FULGUR_CUDA_VERSION 0
#endif

#if defined(_LIBCPP_VERSION)
#define FULGUR_ABI_STDLIB FULGUR_STDLIB_LIBCXX
#define FULGUR_ABI_CXX11 0xffffffffu
#define FULGUR_ABI_CXX11_TOKEN libcxx
#elif defined(__GLIBCXX__)
#define FULGUR_ABI_STDLIB FULGUR_STDLIB_LIBSTDCXX
#define FULGUR_ABI_CXX11 _GLIBCXX_USE_CXX11_ABI
#if _GLIBCXX_USE_CXX11_ABI
#define FULGUR_ABI_CXX11_TOKEN cxx11abi1
#else
#define FULGUR_ABI_CXX11_TOKEN cxx11abi0
#endif
#else
#error "Fulgur plugins need libstdc++ or libc++"
#endif

#define FULGUR_PP_CAT_(a, b) a##b
#define FULGUR_PP_CAT(a, b) FULGUR_PP_CAT_(a, b)

// Link-time ABI guard (LLVM abi-breaking.h style): the SDK library defines exactly one symbol
// named after the host's ABI; every plugin references the one named after its own. A mismatched
// plugin that bypasses the registry's checks still fails at load with an undefined symbol whose
// name says what differs, e.g. `fulgur_abi_v1_iface1_torch2_10_cxx11abi1`.
#define FULGUR_ABI_GUARD                                                                                         \
  FULGUR_PP_CAT(                                                                                                 \
      FULGUR_PP_CAT(                                                                                             \
          FULGUR_PP_CAT(                                                                                         \
              FULGUR_PP_CAT(                                                                                     \
                  FULGUR_PP_CAT(                                                                                 \
                      FULGUR_PP_CAT(FULGUR_PP_CAT(FULGUR_PP_CAT(fulgur_abi_v, FULGUR_PLUGIN_ABI_MAJOR), _iface), \
                                    FULGUR_CXX_INTERFACE_MAJOR),                                                 \
                      _torch),                                                                                   \
                  FULGUR_ABI_TORCH_MAJOR),                                                                       \
              _),                                                                                                \
          FULGUR_ABI_TORCH_MINOR),                                                                               \
      FULGUR_PP_CAT(_, FULGUR_ABI_CXX11_TOKEN))

namespace fulgur::detail {

constexpr fulgur_abi_tag this_abi_tag() {
  return fulgur_abi_tag{static_cast<uint32_t>(sizeof(fulgur_abi_tag)),
                        FULGUR_CXX_INTERFACE_MAJOR,
                        FULGUR_ABI_TORCH_MAJOR,
                        FULGUR_ABI_TORCH_MINOR,
                        static_cast<uint32_t>(FULGUR_ABI_CXX11),
                        FULGUR_ABI_STDLIB,
                        FULGUR_CUDA_VERSION};
}

}  // namespace fulgur::detail
