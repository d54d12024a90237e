# SPDX-License-Identifier: Apache-2.0
# kvcache_dependency(<package> <git-repository> <git-tag> [REQUIRED]): the package from the system
# (find_package) if it is there, else fetched with FetchContent — unless
# KVCACHE_FETCH_DEPENDENCIES is OFF (offline machines), where only find_package is tried and
# <package>_FOUND tells the caller (REQUIRED makes a miss fatal). <package>_VERSION is the found
# package's version, and is left unset where the package was fetched (it is then <git-tag>'s).
include(FetchContent)
function(kvcache_dependency package repository tag)
  cmake_parse_arguments(arg "REQUIRED" "" "" ${ARGN})
  if(NOT KVCACHE_FETCH_DEPENDENCIES)
    if(arg_REQUIRED)
      find_package(${package} REQUIRED)
    else()
      find_package(${package} QUIET)
    endif()
    set(${package}_FOUND ${${package}_FOUND} PARENT_SCOPE)
    set(${package}_VERSION ${${package}_VERSION} PARENT_SCOPE)
    return()
  endif()
  FetchContent_Declare(${package} GIT_REPOSITORY "${repository}" GIT_TAG "${tag}" GIT_SHALLOW TRUE
                       FIND_PACKAGE_ARGS)
  FetchContent_MakeAvailable(${package})
  set(${package}_FOUND TRUE PARENT_SCOPE)
  set(${package}_VERSION ${${package}_VERSION} PARENT_SCOPE)  # unset where fetched
endfunction()
