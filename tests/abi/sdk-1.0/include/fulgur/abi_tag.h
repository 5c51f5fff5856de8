/// @file
/// The ABI facts of the translation unit that includes this header (torch version, standard
/// library, SDK version, CUDA version) as macros and a constexpr fulgur_abi_tag.
/// fulgur/plugin.h stamps them into each plugin's descriptor and ELF note; the SDK library stamps
/// them into the host tag (fulgur::host_abi_tag). The registry compares the two.
#pragma once

#include <fulgur/abi.h>

#include <torch/headeronly/version.h>

#include <version>  // defines __GLIBCXX__ / _LIBCPP_VERSION

#ifndef FULGUR_ABI_TORCH_MAJOR
/// Torch major version recorded in the tag (TORCH_VERSION_MAJOR unless predefined, as tests do to
/// simulate a plugin built against another libtorch).
#define FULGUR_ABI_TORCH_MAJOR TORCH_VERSION_MAJOR
#endif
#ifndef FULGUR_ABI_TORCH_MINOR
/// Torch minor version recorded in the tag (TORCH_VERSION_MINOR unless predefined).
#define FULGUR_ABI_TORCH_MINOR TORCH_VERSION_MINOR
#endif
#ifndef FULGUR_ABI_SDK_VERSION
/// SDK version recorded in the tag (FULGUR_SDK_VERSION unless predefined, as tests do to simulate
/// a plugin built against another SDK).
#define FULGUR_ABI_SDK_VERSION FULGUR_SDK_VERSION
#endif
#ifndef FULGUR_CUDA_VERSION
/// CUDA version of the libtorch built against (e.g. 13000), 0 for a CPU-only libtorch. Defined on
/// the command line by fulgur_add_plugin() and the SDK build, from the toolkit libtorch was built
/// with; 0 when not.
#define FULGUR_CUDA_VERSION 0
#endif

#if defined(_LIBCPP_VERSION)
/// The standard library of this translation unit (a fulgur_stdlib value).
#define FULGUR_ABI_STDLIB FULGUR_STDLIB_LIBCXX
/// _GLIBCXX_USE_CXX11_ABI of this translation unit; 0xffffffff under libc++.
#define FULGUR_ABI_CXX11 0xffffffffu
/// The standard library and its string ABI as a token of the guard symbol's name.
#define FULGUR_ABI_CXX11_TOKEN libcxx
#elif defined(__GLIBCXX__)
/// The standard library of this translation unit (a fulgur_stdlib value).
#define FULGUR_ABI_STDLIB FULGUR_STDLIB_LIBSTDCXX
/// _GLIBCXX_USE_CXX11_ABI of this translation unit; 0xffffffff under libc++.
#define FULGUR_ABI_CXX11 _GLIBCXX_USE_CXX11_ABI
#if _GLIBCXX_USE_CXX11_ABI
/// The standard library and its string ABI as a token of the guard symbol's name.
#define FULGUR_ABI_CXX11_TOKEN cxx11abi1
#else
/// The standard library and its string ABI as a token of the guard symbol's name.
#define FULGUR_ABI_CXX11_TOKEN cxx11abi0
#endif
#else
#error "Fulgur plugins need libstdc++ or libc++"
#endif

/// Pastes two tokens (without expanding them first); use FULGUR_PP_CAT.
#define FULGUR_PP_CAT_(a, b) a##b
/// Pastes two tokens after expanding macros in them.
#define FULGUR_PP_CAT(a, b) FULGUR_PP_CAT_(a, b)

/// Link-time ABI guard (LLVM abi-breaking.h style): the name of a symbol that spells this
/// translation unit's ABI. The SDK library defines exactly one such symbol, named after the host's
/// ABI; every plugin references the one named after its own (fulgur/plugin.h does). A mismatched
/// plugin that bypasses the registry's checks still fails at load (dlopen with RTLD_NOW) with an
/// undefined symbol whose name says what differs, e.g. `fulgur_abi_v1_sdk1_torch2_10_cxx11abi1`. It
/// names the SDK major, not the minor: a plugin built against SDK 1.N links against every 1.x host
/// (the registry refuses a newer minor from the metadata, before loading).
#define FULGUR_ABI_GUARD                                                                                       \
  FULGUR_PP_CAT(                                                                                               \
      FULGUR_PP_CAT(                                                                                           \
          FULGUR_PP_CAT(                                                                                       \
              FULGUR_PP_CAT(                                                                                   \
                  FULGUR_PP_CAT(                                                                               \
                      FULGUR_PP_CAT(FULGUR_PP_CAT(FULGUR_PP_CAT(fulgur_abi_v, FULGUR_PLUGIN_ABI_MAJOR), _sdk), \
                                    FULGUR_SDK_VERSION_MAJOR),                                                 \
                      _torch),                                                                                 \
                  FULGUR_ABI_TORCH_MAJOR),                                                                     \
              _),                                                                                              \
          FULGUR_ABI_TORCH_MINOR),                                                                             \
      FULGUR_PP_CAT(_, FULGUR_ABI_CXX11_TOKEN))

namespace fulgur::detail {

/// The fulgur_abi_tag of this translation unit, from the macros above.
constexpr fulgur_abi_tag this_abi_tag() {
  fulgur_abi_tag tag{};
  tag.struct_size = static_cast<uint32_t>(sizeof(fulgur_abi_tag));
  tag.sdk_version = FULGUR_ABI_SDK_VERSION;
  tag.torch_major = FULGUR_ABI_TORCH_MAJOR;
  tag.torch_minor = FULGUR_ABI_TORCH_MINOR;
  tag.glibcxx_cxx11_abi = static_cast<uint32_t>(FULGUR_ABI_CXX11);
  tag.stdlib = FULGUR_ABI_STDLIB;
  tag.cuda_version = FULGUR_CUDA_VERSION;
  return tag;
}

}  // namespace fulgur::detail
