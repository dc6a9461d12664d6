# The CUDA backend on the CPU (tests/cuda_emu/emu.h): every .cu of
# backend/cuda/ is rewritten at configure time into a C++ file whose launches
# and dynamic shared memory go through the emulator, and compiled with the
# host compiler together with the backend's host code (cuda_backend.cpp,
# runtime.cpp, kind.cpp) against the emulated runtime, its namespace renamed
# meshtrain::cuda_emu so that it links beside a real CUDA backend. The GEMMs
# are the CPU backend's (cuda_emu/gemms_emu.cpp). test_cuda_emu runs the ops
# suite and training runs through it against the CPU backend. Needs no CUDA
# toolkit: every build runs it.
set(emu_out ${CMAKE_CURRENT_BINARY_DIR}/cuda_emu)
set(emu_sources)
set(cuda_dir ${PROJECT_SOURCE_DIR}/src/meshtrain/backend/cuda)
file(GLOB emu_cu CONFIGURE_DEPENDS ${cuda_dir}/*.cu)
foreach(src ${emu_cu})
  file(READ ${src} text)
  # k<<<grid, block, shared, stream>>>(args) -> EMU_LAUNCH((k), grid, block, shared, stream)(args)
  string(REGEX REPLACE "([A-Za-z_][A-Za-z0-9_]*(<[A-Za-z0-9_:, ]*>)?)<<<([^;{}]*)>>>" "EMU_LAUNCH((\\1), \\3)"
         text "${text}")
  string(REGEX REPLACE "extern __shared__ float ([A-Za-z_]+)\\[\\];"
         "float* \\1 = ::emu::dynamic_shared<float>();" text "${text}")
  get_filename_component(name ${src} NAME_WE)
  set(out ${emu_out}/${name}_emu.cpp)
  file(WRITE ${out}.in "// Generated from ${src} by tests/cuda_emu.cmake.\n"
                       "#include \"emu.h\"\n#define cuda cuda_emu\n#line 1 \"${src}\"\n${text}")
  configure_file(${out}.in ${out} COPYONLY)
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${src})
  list(APPEND emu_sources ${out})
endforeach()
# cuDNN's fused attention is cuda_emu/sdpa_emu.cpp's stand-in (the runner's contract on the host).
foreach(name cuda_backend runtime kind)
  set(out ${emu_out}/${name}_host_emu.cpp)
  file(WRITE ${out}.in "// ${name}.cpp against the emulated runtime (tests/cuda_emu.cmake).\n"
                       "#include \"emu.h\"\n#define cuda cuda_emu\n"
                       "#include \"${cuda_dir}/${name}.cpp\"\n")
  configure_file(${out}.in ${out} COPYONLY)
  list(APPEND emu_sources ${out})
endforeach()
file(GLOB emu_tests CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/cuda_emu/*.cpp)
add_executable(test_cuda_emu ${emu_sources} ${emu_tests})
target_include_directories(test_cuda_emu BEFORE PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/cuda_emu/include
                                                        ${CMAKE_CURRENT_SOURCE_DIR}/cuda_emu
                                                        ${CMAKE_CURRENT_SOURCE_DIR})
target_compile_definitions(test_cuda_emu PRIVATE MESHTRAIN_SOURCE_DIR="${PROJECT_SOURCE_DIR}"
                                                 MESHTRAIN_BINARY_DIR="${PROJECT_BINARY_DIR}")
# Products and sums rounded one by one, as __fmul_rn / __fadd_rn promise.
target_compile_options(test_cuda_emu PRIVATE -ffp-contract=off)
# kind.cpp's cuda_backend_kind() (the registry's "cuda") is the emulated
# backend's here: the archive's own is not linked, so the trainer and the
# memory plan reach the emulated device by name.
target_link_libraries(test_cuda_emu PRIVATE meshtrain_train meshtrain_optim meshtrain_model
                                            meshtrain_backend GTest::gtest GTest::gtest_main
                                            meshtrain_warnings)
# Its own label, not `unit`: the sanitizers' runs would see its fibers' stack switches.
gtest_discover_tests(test_cuda_emu DISCOVERY_TIMEOUT 60 PROPERTIES LABELS cuda_emu)
