// SPDX-License-Identifier: Apache-2.0
// CacheConcept and KVView accept every policy and reject types that miss a requirement.
#include <concepts>

#include "kvcache/kvcache.hpp"
#include "support/catch.hpp"

using namespace kvcache;

namespace {

// Everything CacheConcept asks for, so that each incomplete variant below differs by one item.
template <bool kHasCrop, bool kSizeReturns>
struct FakeCache {
  using value_type = float;
  using view_type = SegmentView<float, 1>;
  void append(std::size_t, std::size_t, TokenBlock<const float>, TokenBlock<const float>) {}
  view_type view(std::size_t, std::size_t) const { return {}; }
  std::size_t layer_length(std::size_t, std::size_t) const { return 0; }
  std::size_t seq_length(std::size_t) const { return 0; }
  std::size_t capacity() const { return 0; }
  std::size_t max_batch() const { return 1; }
  bool can_crop(std::size_t, std::size_t) const { return true; }
  void crop(std::size_t, std::size_t) requires kHasCrop {}
  void reset(std::size_t) {}
  auto memory_bytes() const {
    if constexpr (kSizeReturns) {
      return std::size_t{0};
    } else {
      return;
    }
  }
  CacheShape shape() const { return {}; }
};

struct NoSegmentsView {
  using value_type = float;
  std::size_t num_kv_heads() const { return 0; }
  std::size_t head_dim() const { return 0; }
  position_t length() const { return 0; }
  position_t sink_end() const { return 0; }
  position_t recent_begin() const { return 0; }
};

}  // namespace

TEMPLATE_TEST_CASE("every policy models CacheConcept in every storage format, its view KVView",
                   "[concept]", float, half, bfloat16, qint8, fp8_e4m3) {
  STATIC_REQUIRE(CacheConcept<StaticCache<TestType>>);
  STATIC_REQUIRE(CacheConcept<DynamicCache<TestType>>);
  STATIC_REQUIRE(CacheConcept<SlidingWindowCache<TestType>>);
  STATIC_REQUIRE(CacheConcept<TokenTrackedCache<StaticCache<TestType>>>);
  STATIC_REQUIRE(CacheConcept<TokenTrackedCache<SlidingWindowCache<TestType>>>);
  STATIC_REQUIRE(CacheConcept<PagedCache<TestType>>);
  STATIC_REQUIRE(PrefixCacheConcept<PagedCache<TestType>>);
  STATIC_REQUIRE(KVView<PagedView<TestType>>);
  STATIC_REQUIRE(KVView<SegmentView<TestType, 3>>);
  STATIC_REQUIRE(KVView<ChunkedView<TestType>>);
}

TEST_CASE("types missing a requirement are rejected") {
  STATIC_REQUIRE(CacheConcept<FakeCache<true, true>>);    // the complete fake is accepted
  STATIC_REQUIRE(!CacheConcept<FakeCache<false, true>>);  // no crop
  STATIC_REQUIRE(!CacheConcept<FakeCache<true, false>>);  // memory_bytes returns void
  STATIC_REQUIRE(!CacheConcept<int>);
  STATIC_REQUIRE(!KVView<NoSegmentsView>);
  STATIC_REQUIRE(!KVView<StaticCache<float>>);  // a cache is not a view: attend() takes views
}

namespace {

// A CacheConcept cache with everything PrefixCacheConcept adds, except fork when kHasFork is false.
template <bool kHasFork>
struct FakePrefixCache : FakeCache<true, true> {
  std::size_t admit(std::size_t, std::span<const token_id>) { return 0; }
  std::size_t match_prefix(std::span<const token_id>) const { return 0; }
  void add_tokens(std::size_t, std::span<const token_id>) {}
  std::span<const token_id> tokens(std::size_t) const { return {}; }
  void fork(std::size_t, std::size_t) requires kHasFork {}
  void release(std::size_t) {}
  PrefixCacheStats stats() const { return {}; }
};

}  // namespace

TEST_CASE("PrefixCacheConcept adds prefix caching to CacheConcept and rejects what lacks it") {
  STATIC_REQUIRE(PrefixCacheConcept<FakePrefixCache<true>>);
  STATIC_REQUIRE(!PrefixCacheConcept<FakePrefixCache<false>>);  // no fork
  STATIC_REQUIRE(!PrefixCacheConcept<StaticCache<float>>);      // no prefix caching at all
  STATIC_REQUIRE(!PrefixCacheConcept<TokenTrackedCache<StaticCache<float>>>);
}

TEST_CASE("KVFormat: one format for K and V, or a KVFormats pair; views of a pair are KVViews") {
  STATIC_REQUIRE(KVFormat<float>);
  STATIC_REQUIRE(KVFormat<qint8>);
  STATIC_REQUIRE(KVFormat<KVFormats<half, fp8_e4m3>>);
  STATIC_REQUIRE(!KVFormat<int>);
  STATIC_REQUIRE(!KVFormat<double>);
  STATIC_REQUIRE(std::same_as<key_format_t<bfloat16>, bfloat16>);
  STATIC_REQUIRE(std::same_as<value_format_t<bfloat16>, bfloat16>);
  STATIC_REQUIRE(std::same_as<key_format_t<KVFormats<qint8, half>>, qint8>);
  STATIC_REQUIRE(std::same_as<value_format_t<KVFormats<qint8, half>>, half>);
  using Mixed = KVFormats<half, qint8>;
  STATIC_REQUIRE(std::same_as<decltype(KVSegment<Mixed>{}.k), const half*>);
  STATIC_REQUIRE(std::same_as<decltype(KVSegment<Mixed>{}.v), const qint8*>);
  STATIC_REQUIRE(KVView<SegmentView<Mixed, 4>>);
}
