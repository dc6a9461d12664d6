# llama.cpp's C++ Jinja engine (common/jinja/, MIT), fetched from PyPI's llama-cpp-python
# sdist by scripts/get_llama_jinja.sh (scripts/setup.sh runs it) into third_party/llama-jinja/.
# Built as it ships: its headers are SYSTEM and its warnings are not ours (-w), so the project's
# warning-free rule covers our code only. cmake/llama_jinja/ggml.h stands in for the one
# macro (GGML_ASSERT) its json.cpp takes from ggml.
set(LLAMA_JINJA_DIR ${PROJECT_SOURCE_DIR}/third_party/llama-jinja)
if(NOT EXISTS ${LLAMA_JINJA_DIR}/common/jinja/runtime.cpp)
  message(FATAL_ERROR "${LLAMA_JINJA_DIR} is missing: run scripts/setup.sh (or scripts/get_llama_jinja.sh)")
endif()
file(GLOB llama_jinja_srcs CONFIGURE_DEPENDS ${LLAMA_JINJA_DIR}/common/jinja/*.cpp)
add_library(llama_jinja STATIC ${llama_jinja_srcs} ${LLAMA_JINJA_DIR}/common/json.cpp
            ${LLAMA_JINJA_DIR}/common/unicode.cpp)
target_include_directories(llama_jinja SYSTEM PUBLIC ${LLAMA_JINJA_DIR}/common
                           ${PROJECT_SOURCE_DIR}/cmake/llama_jinja)
target_compile_options(llama_jinja PRIVATE -w)
target_link_libraries(llama_jinja PUBLIC nlohmann_json::nlohmann_json)
