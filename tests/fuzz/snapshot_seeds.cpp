// SPDX-License-Identifier: Apache-2.0
// Writes the snapshot fuzzer's seed corpus into a directory: valid snapshots of each of the
// fuzzer's destination caches (full, selected sequences, empty), plus a few damaged ones.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "fuzz_caches.hpp"
#include "kvcache/io/snapshot.hpp"
#include "kvcache/kvcache.hpp"
#include "support/snapshot_edit.hpp"

namespace {

using namespace kvcache;

template <class Cache>
void fill(Cache& cache, std::mt19937& rng, std::size_t seq, std::size_t n, std::size_t chunk) {
  const CacheShape shape = cache.shape();
  std::normal_distribution<float> dist;
  for (std::size_t done = 0; done < n; done += chunk) {
    const std::size_t c = std::min(chunk, n - done);
    std::vector<float> k(c * shape.token_elems()), v(k.size());
    for (auto& x : k) x = dist(rng);
    for (auto& x : v) x = dist(rng);
    for (std::size_t l = 0; l < shape.num_layers; ++l) {
      cache.append(l, seq, TokenBlock<const float>{k, c, shape.num_kv_heads, shape.head_dim},
                   TokenBlock<const float>{v, c, shape.num_kv_heads, shape.head_dim});
    }
  }
}

void write(const std::filesystem::path& dir, const std::string& name,
           const std::vector<std::byte>& bytes) {
  std::ofstream(dir / name, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()),
             static_cast<std::streamsize>(bytes.size()));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <corpus directory>\n", argv[0]);
    return 2;
  }
  const std::filesystem::path dir = argv[1];
  std::filesystem::create_directories(dir);
  std::mt19937 rng(2024);
  std::vector<std::vector<std::byte>> seeds;

  auto st = fuzz::make_static();
  seeds.push_back(snapshot_to_bytes(st, fuzz::kModel));  // empty
  fill(st, rng, 0, 11, 4);
  fill(st, rng, 1, 3, 3);
  seeds.push_back(snapshot_to_bytes(st, fuzz::kModel));
  seeds.push_back(snapshot_to_bytes(st, fuzz::kModel, std::vector<std::size_t>{1}));

  auto sw = fuzz::make_sliding();
  fill(sw, rng, 0, 23, 2);  // wrapped ring, sinks, evicted gap
  fill(sw, rng, 1, 1, 1);   // inside the sinks
  seeds.push_back(snapshot_to_bytes(sw, fuzz::kModel));

  auto dy = fuzz::make_dynamic();
  fill(dy, rng, 1, 7, 3);
  seeds.push_back(snapshot_to_bytes(dy, fuzz::kModel));

  auto tr = fuzz::make_tracked();
  fill(tr, rng, 0, 5, 5);
  tr.commit(0, std::vector<token_id>{1, 2, 3, 4, 5});
  seeds.push_back(snapshot_to_bytes(tr, fuzz::kModel));

  // Paged: a prompt sharing the destination's cached prefix (1, 2, 3, 4), a second sequence
  // sharing the first's blocks with ids ahead of its K/V, and a block size other than the
  // destination's.
  auto pg = fuzz::make_paged();
  const std::vector<token_id> prompt{1, 2, 3, 4, 9, 8, 7};
  const std::size_t cached0 = pg.admit(0, prompt);  // 4: the cached prefix
  fill(pg, rng, 0, prompt.size() - cached0, 2);
  const std::vector<token_id> second{1, 2, 3, 4, 9, 6};
  const std::size_t cached1 = pg.admit(1, second);  // 4 again
  fill(pg, rng, 1, 5 - cached1, 1);                 // 6 ids, 5 positions
  seeds.push_back(snapshot_to_bytes(pg, fuzz::kModel));
  seeds.push_back(snapshot_to_bytes(pg, fuzz::kModel, std::vector<std::size_t>{1}));
  PagedCache<half> pg3({.num_layers = 2,
                        .num_kv_heads = 2,
                        .head_dim = 4,
                        .num_blocks = 6,
                        .block_size = 3,
                        .max_batch = 2});
  (void)load_snapshot_bytes(seeds.back(), pg3, fuzz::kModel);
  seeds.push_back(snapshot_to_bytes(pg3, fuzz::kModel));

  const std::size_t valid = seeds.size();
  for (std::size_t i = 0; i < valid; ++i) {
    auto flipped = seeds[i];
    flipped[flipped.size() / 2] ^= std::byte{0x40};
    seeds.push_back(flipped);
    auto fixed = flipped;  // damaged, checksums recomputed: reaches the semantic checks
    kvcache::test::fix_checksums(fixed);
    seeds.push_back(fixed);
    seeds.push_back(
        std::vector<std::byte>(seeds[i].begin(), seeds[i].begin() + seeds[i].size() / 3));
  }
  for (std::size_t i = 0; i < seeds.size(); ++i) {
    write(dir, "seed-" + std::to_string(i) + ".kvs", seeds[i]);
  }
  std::printf("wrote %zu seeds (%zu valid) to %s\n", seeds.size(), valid, dir.c_str());
  return 0;
}
