// SPDX-License-Identifier: Apache-2.0
// require_throws<E>(f, "piece", ...): f must throw exactly a kvcache error of type E whose message
// contains every piece (the numbers an error promises to name).
#pragma once

#include <string>
#include <typeinfo>

#include "kvcache/core/error.hpp"
#include "support/catch.hpp"

namespace kvcache::test {

template <class E, class F, class... Pieces>
std::string require_throws(F&& f, const Pieces&... pieces) {
  std::string what;
  bool thrown = false;
  try {
    f();
  } catch (const E& e) {
    thrown = true;
    what = e.what();
  }
  INFO("expected " << typeid(E).name() << " was " << (thrown ? "thrown" : "not thrown"));
  REQUIRE(thrown);
  INFO("message: " << what);
  const auto contains = [&](const auto& piece) {
    INFO("missing piece: " << piece);
    REQUIRE(what.find(piece) != std::string::npos);
  };
  (contains(pieces), ...);
  return what;
}

}  // namespace kvcache::test
