# fulgur_add_plugin(NAME SOURCES ... [OUTPUT_DIRECTORY dir] [NO_INSTALL])
#
# Builds a Fulgur plugin library with everything it must share with the host:
#   - libtorch's C++ ABI define and the same C++ standard (20),
#   - hidden visibility (only the entry point is exported),
#   - -Wl,--no-undefined so a missing symbol fails at link time, not when a user loads it,
#   - the CUDA version libtorch was built with, stamped into the plugin's ABI tag.
# Used for the built-in plugins and, through find_package(Fulgur), by third parties.
include_guard(GLOBAL)

function(fulgur_torch_cuda_version out_var)
  set(_v 0)
  if(TARGET torch_cuda OR TARGET c10_cuda)
    if(DEFINED CUDAToolkit_VERSION_MAJOR)
      math(EXPR _v "${CUDAToolkit_VERSION_MAJOR} * 1000 + ${CUDAToolkit_VERSION_MINOR} * 10")
    elseif(DEFINED CUDA_VERSION_MAJOR)
      math(EXPR _v "${CUDA_VERSION_MAJOR} * 1000 + ${CUDA_VERSION_MINOR} * 10")
    endif()
  endif()
  set(${out_var} ${_v} PARENT_SCOPE)
endfunction()

function(fulgur_add_plugin name)
  cmake_parse_arguments(ARG "NO_INSTALL" "OUTPUT_DIRECTORY" "SOURCES" ${ARGN})
  if(NOT ARG_SOURCES)
    message(FATAL_ERROR "fulgur_add_plugin(${name}): SOURCES is required")
  endif()
  add_library(${name} MODULE ${ARG_SOURCES})
  if(TARGET Fulgur::sdk)
    target_link_libraries(${name} PRIVATE Fulgur::sdk)
  else()
    target_link_libraries(${name} PRIVATE fulgur_sdk)
  endif()
  if(TARGET fulgur_torch_cpu)
    # Built-ins: libtorch's CPU half only (the cuda plugin adds the rest); see CMakeLists.txt.
    target_link_libraries(${name} PRIVATE fulgur_torch_cpu)
  elseif(TARGET Fulgur::torch_cpu)
    # Third parties (find_package(Fulgur)): the same CPU half, so loading the plugin costs a CPU
    # run nothing more than the built-ins do. A plugin that drives a GPU itself adds
    # target_link_libraries(<name> PRIVATE ${TORCH_LIBRARIES}).
    target_link_libraries(${name} PRIVATE Fulgur::torch_cpu)
  else()
    target_link_libraries(${name} PRIVATE ${TORCH_LIBRARIES})
  endif()
  fulgur_torch_cuda_version(_cuda)
  target_compile_definitions(${name} PRIVATE FULGUR_CUDA_VERSION=${_cuda})
  target_compile_features(${name} PRIVATE cxx_std_20)
  set_target_properties(${name} PROPERTIES
    PREFIX "libfulgur-"
    CXX_VISIBILITY_PRESET hidden
    VISIBILITY_INLINES_HIDDEN ON)
  target_link_options(${name} PRIVATE "LINKER:--no-undefined")
  if(ARG_OUTPUT_DIRECTORY)
    set_target_properties(${name} PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${ARG_OUTPUT_DIRECTORY})
  elseif(DEFINED FULGUR_PLUGIN_OUTPUT_DIR)
    set_target_properties(${name} PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${FULGUR_PLUGIN_OUTPUT_DIR})
  endif()
  if(DEFINED FULGUR_PLUGIN_INSTALL_DIR AND NOT ARG_NO_INSTALL)
    install(TARGETS ${name} LIBRARY DESTINATION ${FULGUR_PLUGIN_INSTALL_DIR})
    # Built-in plugins: the tests and examples that load them by name depend on this list.
    set_property(GLOBAL APPEND PROPERTY FULGUR_BUILTIN_PLUGIN_TARGETS ${name})
  endif()
endfunction()
