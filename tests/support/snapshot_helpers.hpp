// SPDX-License-Identifier: Apache-2.0
// Helpers of the restore and snapshot tests: a layer's state and packed K/V taken from its view
// (the independent way to describe what a cache holds), random fills, and temporary directories.
#pragma once

#include <unistd.h>

#include <cstddef>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "kvcache/io/snapshot.hpp"
#include "kvcache/kvcache.hpp"
#include "support/cache_helpers.hpp"
#include "support/catch.hpp"
#include "support/rng.hpp"

namespace kvcache::test {

/// A (layer, seq) as its view reports it: state plus K and V packed [heads][held][dim], and for
/// a quantized format the rows' scales packed [heads][held].
template <KVElement T>
struct PackedLayer {
  std::size_t layer = 0, seq = 0;
  position_t length = 0, sink_end = 0, recent_begin = 0;
  std::vector<T> k, v;
  std::vector<scale_type> k_scale, v_scale;

  [[nodiscard]] LayerRestore<T> entry() const {
    LayerRestore<T> e;
    e.layer = layer;
    e.seq = seq;
    e.length = length;
    e.sink_end = sink_end;
    e.recent_begin = recent_begin;
    e.k = k;
    e.v = v;
    if constexpr (scaled_v<T>) {
      e.k_scale = k_scale;
      e.v_scale = v_scale;
    }
    return e;
  }
};

template <class Cache>
PackedLayer<typename Cache::value_type> pack_layer(const Cache& cache, std::size_t layer,
                                                   std::size_t seq) {
  using T = typename Cache::value_type;
  const auto view = cache.view(layer, seq);
  PackedLayer<T> out;
  out.layer = layer;
  out.seq = seq;
  out.length = view.length();
  out.sink_end = view.sink_end();
  out.recent_begin = view.recent_begin();
  for (const bool values : {false, true}) {
    for (std::size_t h = 0; h < view.num_kv_heads(); ++h) {
      for (std::size_t i = 0; i < view.num_segments(); ++i) {
        const auto seg = view.segment(i);
        const T* rows = (values ? seg.v : seg.k) + h * seg.head_stride;
        std::vector<T>& dst = values ? out.v : out.k;
        dst.insert(dst.end(), rows, rows + seg.len * view.head_dim());
        if constexpr (scaled_v<T>) {
          const scale_type* scales =
              (values ? seg.v_scale : seg.k_scale) + h * seg.head_stride / view.head_dim();
          std::vector<scale_type>& sdst = values ? out.v_scale : out.k_scale;
          sdst.insert(sdst.end(), scales, scales + seg.len);
        }
      }
    }
  }
  return out;
}

/// Every (layer, seq) of a cache, packed.
template <class Cache>
std::vector<PackedLayer<typename Cache::value_type>> pack_all(const Cache& cache) {
  std::vector<PackedLayer<typename Cache::value_type>> out;
  for (std::size_t l = 0; l < cache.shape().num_layers; ++l) {
    for (std::size_t s = 0; s < cache.max_batch(); ++s) out.push_back(pack_layer(cache, l, s));
  }
  return out;
}

/// Bit-exact comparison of what two caches hold: every (layer, seq) state and K/V element.
template <class A, class B>
void require_same_contents(const A& a, const B& b) {
  REQUIRE(a.shape() == b.shape());
  REQUIRE(a.max_batch() == b.max_batch());
  for (std::size_t l = 0; l < a.shape().num_layers; ++l) {
    for (std::size_t s = 0; s < a.max_batch(); ++s) {
      const auto pa = pack_layer(a, l, s), pb = pack_layer(b, l, s);
      INFO("layer " << l << " sequence " << s);
      REQUIRE(pa.length == pb.length);
      REQUIRE(pa.sink_end == pb.sink_end);
      REQUIRE(pa.recent_begin == pb.recent_begin);
      REQUIRE(pa.k == pb.k);
      REQUIRE(pa.v == pb.v);
      REQUIRE(pa.k_scale == pb.k_scale);
      REQUIRE(pa.v_scale == pb.v_scale);
    }
  }
}

/// Appends n random tokens to every layer of `seq` in chunks of 1..max_chunk tokens.
template <class Cache>
void append_random(Cache& cache, std::mt19937_64& rng, std::size_t seq, std::size_t n,
                   std::size_t max_chunk) {
  const CacheShape shape = cache.shape();
  for (std::size_t done = 0; done < n;) {
    const std::size_t c = std::min(uniform(rng, 1, max_chunk), n - done);
    const auto kv = random_kv(rng, c, shape.num_kv_heads, shape.head_dim);
    for (std::size_t l = 0; l < shape.num_layers; ++l) {
      cache.append(l, seq, kv.k_block(0, c), kv.v_block(0, c));
    }
    done += c;
  }
}

/// A fresh directory under the system temp dir, removed with its contents on destruction.
class TempDir {
 public:
  explicit TempDir(const std::string& tag) {
    std::random_device rd;
    path_ = std::filesystem::temp_directory_path() /
            ("kvcache-" + tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(rd()));
    std::filesystem::create_directories(path_);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }
  [[nodiscard]] std::filesystem::path operator/(const std::string& name) const {
    return path_ / name;
  }

 private:
  std::filesystem::path path_;
};

}  // namespace kvcache::test
