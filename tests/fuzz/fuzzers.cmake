# libFuzzer targets (tests/fuzz/CMakeLists.txt, a standalone clang project)
# built from the main build into build/fuzz, and run for a bounded time by
# ctest: fuzz_score_request, fuzz_safetensors, fuzz_chunked,
# fuzz_lm_head_update, fuzz_update_source, fuzz_internal_plane (label "fuzz"). Without clang
# and libFuzzer both tests are reported as skipped. Included from
# tests/CMakeLists.txt.
option(LOGPROB_FUZZ "Build the libFuzzer targets with clang and run them in ctest" ON)
set(LOGPROB_FUZZ_SECONDS 20 CACHE STRING "Seconds each fuzzer runs under ctest")

set(_fuzz_why "")
if(NOT LOGPROB_FUZZ)
  set(_fuzz_why "LOGPROB_FUZZ is OFF")
else()
  find_program(LOGPROB_CLANGXX NAMES clang++ clang++-14)
  if(NOT LOGPROB_CLANGXX)
    set(_fuzz_why "clang++ not found (scripts/install-deps.sh installs clang)")
  elseif(NOT LOGPROB_FUZZ_PROBED STREQUAL LOGPROB_CLANGXX)
    # Can this clang link a fuzzer with ASan and UBSan?
    set(_dir ${CMAKE_CURRENT_BINARY_DIR}/fuzz_probe)
    file(WRITE ${_dir}/probe.cc "#include <cstddef>\n#include <cstdint>\n"
      "extern \"C\" int LLVMFuzzerTestOneInput(const uint8_t*, size_t) { return 0; }\n")
    execute_process(COMMAND ${LOGPROB_CLANGXX} -fsanitize=fuzzer,address,undefined probe.cc -o probe
      WORKING_DIRECTORY ${_dir} RESULT_VARIABLE _rc OUTPUT_QUIET ERROR_QUIET)
    set(LOGPROB_FUZZ_LINKS ${_rc} CACHE INTERNAL "")
    set(LOGPROB_FUZZ_PROBED ${LOGPROB_CLANGXX} CACHE INTERNAL "")
  endif()
  if(LOGPROB_CLANGXX AND NOT LOGPROB_FUZZ_LINKS EQUAL 0)
    set(_fuzz_why "${LOGPROB_CLANGXX} cannot link -fsanitize=fuzzer,address,undefined (libclang-rt-14-dev)")
  endif()
endif()

set(_fuzzers fuzz_score_request fuzz_safetensors fuzz_chunked fuzz_lm_head_update fuzz_update_source
  fuzz_internal_plane)
if(_fuzz_why)
  message(STATUS "logprob: fuzzers skipped: ${_fuzz_why}")
  foreach(t ${_fuzzers})
    add_test(NAME ${t} COMMAND sh -c "echo '${t} skipped: ${_fuzz_why}'; exit 77")
    set_tests_properties(${t} PROPERTIES SKIP_RETURN_CODE 77 LABELS fuzz)
  endforeach()
  return()
endif()

message(STATUS "logprob: fuzzers: ${LOGPROB_CLANGXX}, ${LOGPROB_FUZZ_SECONDS} s each in ctest")
# With CUDA, the thread-safety check covers worker/cuda/cuda_backend.cc too.
set(_fuzz_cuda_includes "")
if(LOGPROB_HAVE_CUDA)
  string(REPLACE ";" "|" _fuzz_cuda_includes "${CUDAToolkit_INCLUDE_DIRS}")
endif()
include(ExternalProject)
set(_fuzz_bin ${CMAKE_BINARY_DIR}/fuzz)
ExternalProject_Add(logprob_fuzzers
  SOURCE_DIR ${CMAKE_CURRENT_LIST_DIR}
  BINARY_DIR ${_fuzz_bin}
  PREFIX ${CMAKE_BINARY_DIR}/fuzz-ep
  CMAKE_ARGS -DCMAKE_CXX_COMPILER=${LOGPROB_CLANGXX} "-DLOGPROB_CUDA_INCLUDE_DIRS=${_fuzz_cuda_includes}"
  INSTALL_COMMAND ""
  BUILD_ALWAYS TRUE
  BUILD_BYPRODUCTS ${_fuzz_bin}/fuzz_score_request ${_fuzz_bin}/fuzz_safetensors ${_fuzz_bin}/fuzz_chunked
    ${_fuzz_bin}/fuzz_lm_head_update ${_fuzz_bin}/fuzz_update_source ${_fuzz_bin}/fuzz_internal_plane)

set(_run bash ${CMAKE_CURRENT_LIST_DIR}/run_fuzzer.sh)
add_test(NAME fuzz_score_request
  COMMAND ${_run} ${_fuzz_bin}/fuzz_score_request ${LOGPROB_FUZZ_SECONDS}
    ${_fuzz_bin}/seeds/score_request ${CMAKE_CURRENT_LIST_DIR}/corpus/score_request)
add_test(NAME fuzz_safetensors
  COMMAND ${_run} ${_fuzz_bin}/fuzz_safetensors ${LOGPROB_FUZZ_SECONDS}
    ${_fuzz_bin}/seeds/safetensors ${CMAKE_CURRENT_LIST_DIR}/corpus/safetensors ${PROJECT_SOURCE_DIR}/tests/data/golden
    -- -dict=${CMAKE_CURRENT_LIST_DIR}/safetensors.dict)
add_test(NAME fuzz_chunked
  COMMAND ${_run} ${_fuzz_bin}/fuzz_chunked ${LOGPROB_FUZZ_SECONDS}
    ${_fuzz_bin}/seeds/chunked ${CMAKE_CURRENT_LIST_DIR}/corpus/chunked)
add_test(NAME fuzz_lm_head_update
  COMMAND ${_run} ${_fuzz_bin}/fuzz_lm_head_update ${LOGPROB_FUZZ_SECONDS} ${CMAKE_CURRENT_LIST_DIR}/corpus/lm_head_update)
# Update file sources beneath a folder (issue 32): indexes, symlinks, FIFOs.
add_test(NAME fuzz_update_source
  COMMAND ${_run} ${_fuzz_bin}/fuzz_update_source ${LOGPROB_FUZZ_SECONDS} ${CMAKE_CURRENT_LIST_DIR}/corpus/update_source)
# The internal plane's messages (docs/security.md "The internal plane").
add_test(NAME fuzz_internal_plane
  COMMAND ${_run} ${_fuzz_bin}/fuzz_internal_plane ${LOGPROB_FUZZ_SECONDS} ${CMAKE_CURRENT_LIST_DIR}/corpus/internal_plane)
math(EXPR _timeout "${LOGPROB_FUZZ_SECONDS} + 120")
set_tests_properties(${_fuzzers} PROPERTIES TIMEOUT ${_timeout} LABELS fuzz)
