# `cmake --install <build> --prefix P` lays out:
#   P/include/fulgur/...                  SDK, registry and core headers
#   P/lib/libfulgur_{sdk,registry,core}.so
#   P/lib/fulgur/plugins/*.so             built-in plugins (where the registry looks)
#   P/bin/fulgur                          the CLI
#   P/lib/cmake/Fulgur/                   the CMake package: find_package(Fulgur) + fulgur_add_plugin()
# (the install rules of each target live next to it; this file adds the package.)
include(CMakePackageConfigHelpers)

set(FULGUR_CMAKE_INSTALL_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/Fulgur)

install(EXPORT FulgurTargets
  NAMESPACE Fulgur::
  FILE FulgurTargets.cmake
  DESTINATION ${FULGUR_CMAKE_INSTALL_DIR})

configure_package_config_file(
  ${CMAKE_CURRENT_LIST_DIR}/FulgurConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/FulgurConfig.cmake
  INSTALL_DESTINATION ${FULGUR_CMAKE_INSTALL_DIR}
  PATH_VARS FULGUR_PLUGIN_INSTALL_DIR CMAKE_INSTALL_BINDIR)
# SDK 1.x: find_package(Fulgur 1.N) accepts any installed 1.M with M >= N (a plugin built against
# 1.N loads in every later 1.x host; CHANGELOG.md). The plugin ABI is also checked at load time,
# from each plugin's note.
write_basic_package_version_file(
  ${CMAKE_CURRENT_BINARY_DIR}/FulgurConfigVersion.cmake
  VERSION ${PROJECT_VERSION}
  COMPATIBILITY SameMajorVersion)

install(FILES
  ${CMAKE_CURRENT_BINARY_DIR}/FulgurConfig.cmake
  ${CMAKE_CURRENT_BINARY_DIR}/FulgurConfigVersion.cmake
  ${CMAKE_CURRENT_LIST_DIR}/FulgurPlugin.cmake
  DESTINATION ${FULGUR_CMAKE_INSTALL_DIR})
