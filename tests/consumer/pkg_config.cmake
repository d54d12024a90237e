# SPDX-License-Identifier: Apache-2.0
# Test consumer.pkg_config, on the tree consumer.install installed: the LICENSE, kvcache.pc and
# kvcache::kernels' source are there, and (with pkg-config) kvcache.pc gives the headers' version
# and the flags with which a plain compiler command line builds the consumer, which then runs.
#   cmake -DPREFIX=<install prefix> -DDATAROOTDIR=share -DPKG_CONFIG=<pkg-config or empty>
#         -DCXX=<c++ compiler> -DSOURCE=<consumer_main.cpp> -DVERSION=<x.y.z> -DWORK_DIR=<dir>
#         -P pkg_config.cmake
foreach(file "${DATAROOTDIR}/doc/kvcache/LICENSE" "${DATAROOTDIR}/pkgconfig/kvcache.pc"
             "${DATAROOTDIR}/kvcache/src/kernels.cpp")
  if(NOT EXISTS "${PREFIX}/${file}")
    message(FATAL_ERROR "not installed: ${PREFIX}/${file}")
  endif()
endforeach()
if(NOT PKG_CONFIG)
  message(WARNING "pkg-config not found: kvcache.pc installed but not tried")
  return()
endif()

set(ENV{PKG_CONFIG_PATH} "${PREFIX}/${DATAROOTDIR}/pkgconfig")
execute_process(COMMAND "${PKG_CONFIG}" --modversion kvcache OUTPUT_VARIABLE version
                OUTPUT_STRIP_TRAILING_WHITESPACE COMMAND_ERROR_IS_FATAL ANY)
if(NOT version STREQUAL VERSION)
  message(FATAL_ERROR "kvcache.pc says version '${version}', the build ${VERSION}")
endif()
execute_process(COMMAND "${PKG_CONFIG}" --cflags --libs kvcache OUTPUT_VARIABLE flags
                OUTPUT_STRIP_TRAILING_WHITESPACE COMMAND_ERROR_IS_FATAL ANY)
message(STATUS "pkg-config --cflags --libs kvcache: ${flags}")
separate_arguments(flags UNIX_COMMAND "${flags}")
file(MAKE_DIRECTORY "${WORK_DIR}")
# consumer_main checks KVCACHE_VERSION_STRING (the installed version.hpp) against the package's.
execute_process(COMMAND "${CXX}" -std=c++20 -O1 "-DKVCACHE_PACKAGE_VERSION=\"${version}\""
                        "${SOURCE}" ${flags} -o "${WORK_DIR}/consumer"
                COMMAND_ECHO STDOUT COMMAND_ERROR_IS_FATAL ANY)
execute_process(COMMAND "${WORK_DIR}/consumer" COMMAND_ERROR_IS_FATAL ANY)
