# spdlog 1.10 + fmt 9 from Debian, visible ahead of the fmt 12 headers that the torch wheel ships
# in its own include directory (torch's include dirs come first otherwise, and fmt 9's library
# would be linked against fmt 12's headers). A directory of links to the Debian headers, added
# with -I, is searched before torch's -isystem directories.
set(_fulgur_sys_first ${CMAKE_BINARY_DIR}/system-first)
file(MAKE_DIRECTORY ${_fulgur_sys_first})
foreach(_lib fmt spdlog)
  if(NOT EXISTS ${_fulgur_sys_first}/${_lib})
    file(CREATE_LINK /usr/include/${_lib} ${_fulgur_sys_first}/${_lib} SYMBOLIC)
  endif()
endforeach()
# fulgur_fmt: fmt alone, for code that formats text but logs through the SDK's facade
# (fulgur/log.h): the built-in plugins. fulgur_logging adds spdlog, for the host side only.
add_library(fulgur_fmt INTERFACE)
target_include_directories(fulgur_fmt BEFORE INTERFACE $<BUILD_INTERFACE:${_fulgur_sys_first}>)
target_link_libraries(fulgur_fmt INTERFACE fmt::fmt)
add_library(fulgur_logging INTERFACE)
target_link_libraries(fulgur_logging INTERFACE fulgur_fmt spdlog::spdlog)
