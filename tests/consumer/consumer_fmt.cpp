// SPDX-License-Identifier: Apache-2.0
// Linked against kvcache::fmt alone by the add_subdirectory and find_package consumers (where fmt
// is found): the optional formatters (kvcache/fmt.hpp) compile and link with no other setup.
// Built, not run.
#include <kvcache/fmt.hpp>
#include <kvcache/kvcache.hpp>
#include <string>

int main() {
  const std::string text = fmt::format("{}", kvcache::CacheShape{32, 8, 128, kvcache::DType::f16});
  return text.empty() ? 1 : 0;
}
