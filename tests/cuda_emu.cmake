# The CUDA backend's kernels run on the CPU (tests/cuda_emu/emu.h): each .cu
# named here is rewritten at configure time into a C++ file whose launches and
# dynamic shared memory go through the emulator, compiled with the host
# compiler into test_cuda_emu, and checked against the CPU backend. Needs no
# CUDA toolkit: CI runs it on every build.
set(emu_out ${CMAKE_CURRENT_BINARY_DIR}/cuda_emu)
set(emu_sources)
foreach(cu attention.cu)
  set(src ${PROJECT_SOURCE_DIR}/src/meshtrain/backend/cuda/${cu})
  file(READ ${src} text)
  # k<<<grid, block, shared, stream>>>(args) -> EMU_LAUNCH(k, grid, block, shared, stream)(args)
  string(REGEX REPLACE "([A-Za-z_][A-Za-z0-9_]*(<[A-Za-z0-9_]*>)?)<<<([^>]*)>>>" "EMU_LAUNCH(\\1, \\3)"
         text "${text}")
  string(REPLACE "extern __shared__ float smem[];" "float* smem = ::emu::dynamic_shared<float>();"
         text "${text}")
  get_filename_component(name ${cu} NAME_WE)
  set(out ${emu_out}/${name}_emu.cpp)
  # The kernels' namespace becomes meshtrain::cuda_emu, so they link beside a real CUDA backend.
  file(WRITE ${out}.in "// Generated from ${src} by tests/cuda_emu.cmake.\n"
                       "#include \"emu.h\"\n#define cuda cuda_emu\n#line 1 \"${src}\"\n${text}")
  configure_file(${out}.in ${out} COPYONLY)
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${src})
  list(APPEND emu_sources ${out})
endforeach()
add_executable(test_cuda_emu ${emu_sources} ${CMAKE_CURRENT_SOURCE_DIR}/cuda_emu/test_attention_emu.cpp)
target_include_directories(test_cuda_emu BEFORE PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/cuda_emu/include
                                                        ${CMAKE_CURRENT_SOURCE_DIR}/cuda_emu)
target_link_libraries(test_cuda_emu PRIVATE meshtrain_backend GTest::gtest GTest::gtest_main
                                            meshtrain_warnings)
# Its own label, not `unit`: the sanitizers' runs would see its fibers' stack switches.
gtest_discover_tests(test_cuda_emu DISCOVERY_TIMEOUT 60 PROPERTIES LABELS cuda_emu)
