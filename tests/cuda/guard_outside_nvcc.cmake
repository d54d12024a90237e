# SPDX-License-Identifier: Apache-2.0
# Every CUDA header, included from a plain C++ file by the host compiler, fails first at its
# "compile them with nvcc" #error, not at a CUDA header the host compiler cannot find. Test
# cuda.guard_outside_nvcc (tests/CMakeLists.txt):
#   cmake -DCXX=<c++ compiler> -DINCLUDE_DIR=<include/> -DWORK_DIR=<scratch dir> -P <this file>
file(GLOB headers RELATIVE "${INCLUDE_DIR}" "${INCLUDE_DIR}/kvcache/cuda/*.cuh")
if(NOT headers)
  message(FATAL_ERROR "no CUDA headers under ${INCLUDE_DIR}/kvcache/cuda")
endif()
foreach(header IN LISTS headers)
  file(WRITE "${WORK_DIR}/guard_outside_nvcc.cpp" "#include <${header}>\n")
  execute_process(
    COMMAND "${CXX}" -std=c++20 -fsyntax-only -I "${INCLUDE_DIR}"
            "${WORK_DIR}/guard_outside_nvcc.cpp"
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  string(REGEX MATCH "error:[^\n]*" first_error "${out}")
  if(rc EQUAL 0 OR NOT first_error MATCHES "compile them with nvcc")
    message(SEND_ERROR "<${header}> in a C++ file: the first error is not the nvcc guard's:\n${out}")
  endif()
endforeach()
