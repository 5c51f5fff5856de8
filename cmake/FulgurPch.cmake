# One precompiled <torch/torch.h> shared by every target that needs the full LibTorch API
# (a TU including it costs ~20 s on 2 cores; with the PCH about half).
add_library(fulgur_pch OBJECT ${CMAKE_CURRENT_LIST_DIR}/pch.cpp)
target_link_libraries(fulgur_pch PRIVATE ${TORCH_LIBRARIES})
target_precompile_headers(fulgur_pch PRIVATE <torch/torch.h>)

function(fulgur_use_pch target)
  target_precompile_headers(${target} REUSE_FROM fulgur_pch)
endfunction()
