# One precompiled <torch/torch.h> shared by every target that needs the full LibTorch API
# (a TU including it costs ~20 s on 2 cores; with the PCH about half).
add_library(fulgur_pch OBJECT ${CMAKE_CURRENT_LIST_DIR}/pch.cpp)
target_link_libraries(fulgur_pch PRIVATE fulgur_torch_cpu)
target_precompile_headers(fulgur_pch PRIVATE <torch/torch.h>)
set_target_properties(fulgur_pch PROPERTIES POSITION_INDEPENDENT_CODE ON)

function(fulgur_use_pch target)
  target_precompile_headers(${target} REUSE_FROM fulgur_pch)
  get_target_property(type ${target} TYPE)
  if(type STREQUAL "EXECUTABLE")
    # The PCH is compiled as PIC (for the libraries). An executable compiled as PIE rejects it
    # (-Winvalid-pch: "different settings of -fpie") and parses <torch/torch.h> in every TU
    # again; PIC objects link into a PIE executable just as well.
    target_compile_options(${target} PRIVATE -fPIC)
  endif()
endfunction()
