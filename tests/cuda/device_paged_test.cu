// SPDX-License-Identifier: Apache-2.0
// The paged DeviceCache runs PagedCache's BlockManager: the same random admits (with cache
// salts), batched appends with ids, add_tokens, forks, reorders, crops, releases and evictions,
// done on a DeviceCache and on a host PagedCache, must leave the same block tables, ids, lengths,
// statistics and errors, the device's block table and lengths must mirror its bookkeeping, and
// the device pool must hold every sequence's rows bit for bit (copy-on-write copies included).
// Batched appends (several sequences in one call, which a host PagedCache does not take) are
// checked the same way without the host. Also export_csr(), snapshots and context_shift() of
// device caches.
// Skips with a message when no CUDA device is present.
#include <map>
#include <optional>
#include <random>
#include <string>
#include <typeinfo>
#include <vector>

#include "device_support.cuh"
#include "kvcache/cuda/context_shift.cuh"
#include "kvcache/cuda/cuda.cuh"
#include "kvcache/cuda/snapshot.cuh"
#include "kvcache/kvcache.hpp"
#include "support/catch.hpp"
#include "support/prefix_helpers.hpp"
#include "support/rng.hpp"
#include "support/snapshot_helpers.hpp"

// No `using namespace kvcache`: CUDA's headers declare a global `half` and namespace `cuda`.
namespace kcuda = kvcache::cuda;
using kvcache::token_id;
using kvcache::test::download;
using kvcache::test::have_device;
using kvcache::test::upload;

namespace {

constexpr std::size_t kLayers = 2, kHeads = 2, kDim = 8, kBlock = 4, kBatch = 4, kMaxLen = 32;
const kvcache::test::SyntheticModel kSynth{kLayers, kHeads, kDim};

// The values of a stored row of kDim elements: its elements, or codes x scale (int8, fp8).
template <kvcache::KVElement T>
std::vector<float> row_values(const T* row, const kvcache::scale_type* scale) {
  std::vector<float> out(kDim);
  kvcache::dequantize_row(row, scale, kDim, out.data());
  return out;
}

// The values a cache of T stores for a row of kDim floats (rounded, or quantized).
template <kvcache::KVElement T>
std::vector<float> stored_values(const float* in) {
  std::vector<T> codes(kDim);
  kvcache::scale_type scale;
  kvcache::quantize_row(in, kDim, codes.data(), &scale);
  return row_values(codes.data(), &scale);
}

template <kvcache::KVFormat T>
struct Pair {
  std::size_t num_blocks;
  bool twin = true;
  kvcache::PagedCache<T> host;
  kcuda::DeviceCache<T> dev;

  Pair(std::size_t blocks, bool evict)
      : num_blocks(blocks),
        host({.num_layers = kLayers,
              .num_kv_heads = kHeads,
              .head_dim = kDim,
              .num_blocks = blocks,
              .block_size = kBlock,
              .max_batch = kBatch,
              .max_seq_len = kMaxLen,
              .evict_when_full = evict}),
        dev({.layout = kcuda::Layout::paged,
             .num_layers = kLayers,
             .num_kv_heads = kHeads,
             .head_dim = kDim,
             .max_batch = kBatch,
             .max_seq_len = kMaxLen,
             .block_size = kBlock,
             .num_blocks = blocks,
             .evict_when_full = evict}) {}

  // Runs an operation on the device and, when the host follows it, on the host: both must
  // throw the same type or neither.
  template <class Host, class Dev>
  void both(Host&& on_host, Dev&& on_dev) {
    std::string host_error, dev_error;
    try {
      if (twin) on_host();
    } catch (const kvcache::error& e) {
      host_error = typeid(e).name();
    }
    try {
      on_dev();
    } catch (const kvcache::error& e) {
      dev_error = typeid(e).name();
    }
    if (twin) REQUIRE(dev_error == host_error);
  }

  // The device mirrors its bookkeeping; with the host following, both bookkeepings are equal
  // (the same BlockManager, given the same operations).
  void check_state() const {
    const auto& m = dev.paged();
    REQUIRE(dev.check_device_mirror(nullptr) == "");
    for (std::size_t q = 0; q < kBatch; ++q) {
      INFO("sequence " << q);
      for (std::size_t l = 0; l < kLayers; ++l) {
        REQUIRE(dev.layer_length(l, q) == m.layer_length(l, q));
      }
      if (!twin) continue;
      REQUIRE(std::ranges::equal(m.block_table(q), host.block_table(q)));
      REQUIRE(std::ranges::equal(m.tokens(q), host.tokens(q)));
      REQUIRE(m.extra_key(q) == host.extra_key(q));
      for (std::size_t l = 0; l < kLayers; ++l) {
        REQUIRE(m.layer_length(l, q) == host.layer_length(l, q));
      }
    }
    if (twin) REQUIRE(m.stats() == host.stats());
  }

  // Every row every sequence holds on the device, read through the device's block table, is
  // the K/V of its ids (every append here carries ids), as T stores it (a pair: K in its K
  // format, V in its V format); for int8 and fp8 the scales too, which copy-on-write copies with
  // the codes.
  void check_rows() const {
    using K = kvcache::key_format_t<T>;
    using V = kvcache::value_format_t<T>;
    const auto& m = dev.paged();
    for (std::size_t l = 0; l < kLayers; ++l) {
      const auto v = dev.view(l);
      // one side's rows of every block (a one-format pool interleaves K and V in each block:
      // its V side ends half a block before the pool)
      const std::size_t elems =
          static_cast<std::size_t>(v.block_stride) * (num_blocks - 1) + kHeads * kBlock * kDim;
      const auto side = [&](const auto* rows, const kvcache::scale_type* scale_ptr) {
        using S = std::remove_cvref_t<decltype(*rows)>;
        auto pool = std::make_shared<std::vector<S>>(download(rows, elems));
        auto scales = std::make_shared<std::vector<kvcache::scale_type>>();
        if constexpr (kvcache::scaled_v<S>) *scales = download(scale_ptr, elems / kDim);
        return [pool, scales](std::size_t row) {
          return row_values(pool->data() + row,
                            scales->empty() ? nullptr : scales->data() + row / kDim);
        };
      };
      const auto k_at = side(v.k, v.k_scale);
      const auto v_at = side(v.v, v.v_scale);
      for (std::size_t q = 0; q < kBatch; ++q) {
        const std::size_t len = m.layer_length(l, q);
        if (len == 0) continue;
        const auto expect = kSynth.kv(l, m.tokens(q).first(len), 0, len);
        for (std::size_t pos = 0; pos < len; ++pos) {
          const std::size_t base = m.block_table(q)[pos / kBlock] * v.block_stride;
          for (std::size_t h = 0; h < kHeads; ++h) {
            const std::size_t row = base + h * kBlock * kDim + (pos % kBlock) * kDim;
            const std::size_t want = (pos * kHeads + h) * kDim;
            INFO("layer " << l << " sequence " << q << " position " << pos << " head " << h);
            REQUIRE(k_at(row) == stored_values<K>(expect.k.data() + want));
            REQUIRE(v_at(row) == stored_values<V>(expect.v.data() + want));
          }
        }
      }
    }
  }
};

// `twin`: the host PagedCache follows every operation (appends to one sequence at a time, as it
// takes them); otherwise appends go to batches of sequences, which take blocks all at once (and
// may copy a block the host would have copied for one sequence only).
template <kvcache::KVFormat T>
void run(std::mt19937_64& rng, bool evict, bool twin, int steps) {
  Pair<T> p(40, evict);
  p.twin = twin;
  const auto pick = [&](std::size_t n) {
    return std::uniform_int_distribution<std::size_t>(0, n - 1)(rng);
  };
  const auto some_ids = [&](std::size_t n) {
    std::vector<token_id> ids(n);
    for (auto& t : ids) t = static_cast<token_id>(1 + pick(3));
    return ids;
  };
  int appended = 0, refused = 0;
  const auto copies = [&] { return p.dev.paged().stats().cow_copies; };
  for (int step = 0; step < steps; ++step) {
    INFO("step " << step);
    const std::size_t seq = pick(kBatch), other = pick(kBatch);
    switch (pick(8)) {
      case 0:
        if (p.dev.paged().tokens(seq).empty() && p.dev.seq_length(seq) == 0) {
          const auto prompt = some_ids(1 + pick(14));
          const std::uint64_t salt = pick(3) == 0 ? 99 : 0;
          std::size_t a = 0, b = 0;
          p.both([&] { a = p.host.admit(seq, prompt, salt); },
                 [&] { b = p.dev.admit(seq, prompt, salt, nullptr); });
          if (twin) REQUIRE(a == b);
        }
        break;
      case 1:
      case 2:
      case 3: {  // a forward pass: each layer appends n tokens with ids to a batch of sequences
        std::vector<std::size_t> chosen, sizes;
        for (std::size_t q = 0; q < kBatch; ++q) {
          const auto& m = p.dev.paged();
          if ((q != seq && (twin || pick(2) == 0)) || (m.tokens(q).empty() && m.seq_length(q) != 0))
            continue;
          chosen.push_back(q);
          sizes.push_back(1 + pick(5));
        }
        for (std::size_t l = 0; l < kLayers; ++l) {
          std::vector<std::size_t> seqs, counts;
          std::vector<token_id> ids;
          std::vector<float> k, v;
          for (std::size_t c = 0; c < chosen.size(); ++c) {
            const auto& m = p.dev.paged();
            const std::size_t q = chosen[c], n = sizes[c], len = m.layer_length(l, q);
            if (len + n > kMaxLen) continue;
            // the ids registered where the layer is behind them, fresh ones past them
            std::vector<token_id> all(m.tokens(q).begin(), m.tokens(q).end());
            all.resize(std::max(all.size(), len + n));
            const std::size_t registered = m.tokens(q).size();
            for (std::size_t pos = std::max(len, registered); pos < len + n; ++pos) {
              all[pos] = some_ids(1)[0];
            }
            all.resize(len + n);
            const auto kv = kSynth.kv(l, all, len, n);
            seqs.push_back(q);
            counts.push_back(n);
            ids.insert(ids.end(), all.begin() + static_cast<std::ptrdiff_t>(len), all.end());
            k.insert(k.end(), kv.k.begin(), kv.k.end());
            v.insert(v.end(), kv.v.begin(), kv.v.end());
          }
          if (seqs.empty()) continue;
          auto dk = upload(k), dv = upload(v);
          // The device's batch is all or nothing; the host appends one sequence at a time, so
          // it follows only a batch the device took (check_state() then shows that a refused
          // batch changed nothing).
          try {
            p.dev.append(l, seqs, counts, ids, dk.data(), dv.data(), nullptr);
          } catch (const kvcache::capacity_error&) {
            ++refused;
            break;
          }
          ++appended;
          if (!twin) continue;
          for (std::size_t i = 0, t = 0; i < seqs.size(); t += counts[i++]) {
            const std::size_t n = counts[i] * kHeads * kDim, at = t * kHeads * kDim;
            p.host.append(l, seqs[i], std::span<const token_id>(ids).subspan(t, counts[i]),
                          kvcache::TokenBlock<const float>{std::span<const float>(k).subspan(at, n),
                                                           counts[i], kHeads, kDim},
                          kvcache::TokenBlock<const float>{std::span<const float>(v).subspan(at, n),
                                                           counts[i], kHeads, kDim});
          }
        }
        break;
      }
      case 4:
        if (seq != other) {
          p.both([&] { p.host.release(other); }, [&] { p.dev.release(other, nullptr); });
          p.both([&] { p.host.fork(seq, other); }, [&] { p.dev.fork(seq, other, nullptr); });
        }
        break;
      case 5: {
        const std::vector<std::size_t> dst{seq, other == seq ? (seq + 1) % kBatch : other},
            src{dst[1], dst[0]};
        p.both([&] { p.host.reorder(dst, src); }, [&] { p.dev.reorder(dst, src, nullptr); });
        break;
      }
      case 6: {
        const std::size_t n = pick(p.dev.seq_length(seq) + 1);
        p.both([&] { p.host.crop(seq, n); }, [&] { p.dev.crop(seq, n, nullptr); });
        break;
      }
      case 7:
        if (pick(2) == 0) {
          p.both([&] { p.host.release(seq); }, [&] { p.dev.reset(seq, nullptr); });
        } else {
          const auto ids = some_ids(1);
          p.both([&] { p.host.add_tokens(seq, ids); },
                 [&] { p.dev.add_tokens(seq, ids, nullptr); });
          const std::size_t evicted = p.dev.evict_cached(1);
          if (twin) REQUIRE(p.host.evict_cached(1) == evicted);
        }
        break;
    }
    p.check_state();
    if (step % 16 == 0) p.check_rows();
  }
  p.check_rows();
  INFO("layer batches " << appended << " (" << refused << " refused), copy-on-write copies "
                        << copies());
  REQUIRE(appended > steps / 8);
  REQUIRE(copies() > 0);
}

}  // namespace

TEMPLATE_TEST_CASE(
    "a paged DeviceCache keeps PagedCache's bookkeeping and rows, operation for operation",
    "[cuda]", float, kvcache::qint8, kvcache::fp8_e4m3,
    (kvcache::KVFormats<kvcache::half, kvcache::qint8>)) {
  if (!have_device()) return;
  auto rng = kvcache::test::make_rng("device_paged_twin");
  for (bool evict : {false, true}) {
    INFO("evict_when_full " << evict);
    for (int seed = 0; seed < 3; ++seed) {
      run<TestType>(rng, evict, true, 300);
      run<TestType>(rng, evict, false, 300);
    }
  }
}

TEST_CASE("a paged DeviceCache shares a cached prompt and refuses what PagedCache refuses",
          "[cuda]") {
  if (!have_device()) return;
  Pair<float> p(8, false);
  const auto prompt = kvcache::test::iota_ids(9, 40);
  REQUIRE(p.dev.admit(0, prompt, 0, nullptr) == 0);
  REQUIRE(p.host.admit(0, prompt) == 0);
  for (std::size_t l = 0; l < kLayers; ++l) {
    const auto kv = kSynth.kv(l, prompt, 0, prompt.size());
    auto dk = upload(kv.k), dv = upload(kv.v);
    const std::vector<std::size_t> seqs{0}, counts{prompt.size()};
    p.dev.append(l, seqs, counts, dk.data(), dv.data(), nullptr);
    p.host.append(l, 0, kv.k_block(0, prompt.size()), kv.v_block(0, prompt.size()));
  }
  p.dev.release(0, nullptr);
  p.host.release(0);
  REQUIRE(p.dev.match_prefix(prompt) == 8);
  REQUIRE(p.dev.match_prefix(prompt, 5) == 0);
  REQUIRE(p.dev.admit(1, prompt, 0, nullptr) == 8);
  REQUIRE(p.host.admit(1, prompt) == 8);
  p.check_state();
  p.check_rows();
  // appending ids that differ from the registered ones is refused, unchanged
  kcuda::DeviceBuffer<float> one(kHeads * kDim);
  const std::vector<std::size_t> seqs{1}, counts{1};
  const std::vector<token_id> wrong{7};
  REQUIRE_THROWS_AS(p.dev.append(0, seqs, counts, wrong, one.data(), one.data(), nullptr),
                    kvcache::position_error);
  p.check_state();
  // the other layouts have no ids
  kcuda::DeviceCache<float> flat(
      {.num_layers = 1, .num_kv_heads = 1, .head_dim = 8, .max_seq_len = 8});
  REQUIRE_THROWS_AS(flat.admit(0, prompt, 0, nullptr), kvcache::shape_error);
}

TEST_CASE("export_csr of a paged DeviceCache writes on the device what the host form computes",
          "[cuda]") {
  if (!have_device()) return;
  Pair<float> p(40, false);
  p.twin = false;
  for (std::size_t q = 0; q < 3; ++q) {  // prompts of 1 .. 17 tokens, one forked
    const auto prompt = kvcache::test::iota_ids(1 + 8 * q, static_cast<token_id>(10 * q));
    (void)p.dev.admit(q, prompt, 0, nullptr);
    for (std::size_t l = 0; l < kLayers; ++l) {
      const std::size_t n = prompt.size() - (l == 1 && q == 2 ? 3 : 0);  // layer 1 of 2 behind
      const auto kv = kSynth.kv(l, prompt, 0, n);
      auto dk = upload(kv.k), dv = upload(kv.v);
      const std::vector<std::size_t> seqs{q}, counts{n};
      p.dev.append(l, seqs, counts, dk.data(), dv.data(), nullptr);
    }
  }
  p.dev.fork(2, 3, nullptr);
  const std::vector<std::size_t> seqs{3, 0, 2, 1};
  for (std::size_t l = 0; l < kLayers; ++l) {
    const auto sizes = kvcache::csr_sizes(p.dev.paged(), l, seqs);
    std::vector<std::int32_t> indptr(sizes.indptr), indices(sizes.indices),
        last(sizes.last_page_len);
    kvcache::export_csr(p.dev.paged(), l, seqs, indptr, indices, last);
    kcuda::DeviceBuffer<std::int32_t> d_indptr(indptr.size()), d_indices(indices.size()),
        d_last(last.size());
    const kcuda::DeviceCsr out{d_indptr.data(), d_indices.data(), d_last.data(),
                               indptr.size(),   indices.size(),   last.size()};
    REQUIRE(kcuda::export_csr(p.dev, l, seqs, out, nullptr).indices == indices.size());
    INFO("layer " << l);
    REQUIRE(download(d_indptr.data(), d_indptr.size()) == indptr);
    REQUIRE(download(d_indices.data(), d_indices.size()) == indices);
    REQUIRE(download(d_last.data(), d_last.size()) == last);
    const kcuda::DeviceCsr small{d_indptr.data(), d_indices.data(),   d_last.data(),
                                 indptr.size(),   indices.size() - 1, last.size()};
    REQUIRE_THROWS_AS(kcuda::export_csr(p.dev, l, seqs, small, nullptr), kvcache::shape_error);
  }
  // no sequences: indptr = {0}
  kcuda::DeviceBuffer<std::int32_t> one(1);
  kcuda::check(cudaMemset(one.data(), 0xff, one.bytes()), "poison");
  (void)kcuda::export_csr(p.dev, 0, {}, kcuda::DeviceCsr{one.data(), nullptr, nullptr, 1, 0, 0},
                          nullptr);
  REQUIRE(download(one.data(), 1) == std::vector<std::int32_t>{0});
}

namespace {

// Appends the K/V of ids[len .. len + n) to `layer` of `seq` (with the ids).
template <kvcache::KVFormat T>
void device_append(kcuda::DeviceCache<T>& dev, std::size_t layer, std::size_t seq,
                   const std::vector<token_id>& ids, std::size_t len, std::size_t n) {
  const auto kv = kSynth.kv(layer, ids, len, n);
  auto dk = upload(kv.k), dv = upload(kv.v);
  const std::vector<std::size_t> seqs{seq}, counts{n};
  dev.append(layer, seqs, counts, std::span<const token_id>(ids).subspan(len, n), dk.data(),
             dv.data(), nullptr);
}

// The rows of one (layer, seq), packed [heads][held][kDim], and (int8, fp8 sides) their scales.
template <kvcache::KVFormat T>
struct Packed {
  std::vector<kvcache::key_format_t<T>> k;
  std::vector<kvcache::value_format_t<T>> v;
  std::vector<kvcache::scale_type> k_scale, v_scale;
  explicit Packed(std::size_t held)
      : k(held * kHeads * kDim),
        v(k.size()),
        k_scale(kvcache::scaled_v<kvcache::key_format_t<T>> ? held * kHeads : 0),
        v_scale(kvcache::scaled_v<kvcache::value_format_t<T>> ? held * kHeads : 0) {}
  bool operator==(const Packed&) const = default;
};

template <kvcache::KVFormat T>
Packed<T> device_rows(const kcuda::DeviceCache<T>& dev, std::size_t l, std::size_t q) {
  Packed<T> out(dev.layer_length(l, q));
  dev.read_rows(l, q, out.k, out.v, out.k_scale, out.v_scale, nullptr);
  return out;
}

template <kvcache::KVView V>
Packed<typename V::value_type> host_rows(const V& view) {
  Packed<typename V::value_type> out(kvcache::view_num_tokens(view));
  kvcache::detail::pack_view_rows(view, out.k.data(), out.v.data(), out.k_scale.data(),
                                  out.v_scale.data());
  return out;
}

// Every (layer, seq) of two paged device caches holds the same positions, rows, ids and key.
template <kvcache::KVFormat T>
void require_same(const kcuda::DeviceCache<T>& a, const kcuda::DeviceCache<T>& b) {
  for (std::size_t q = 0; q < kBatch; ++q) {
    INFO("sequence " << q);
    REQUIRE(std::ranges::equal(a.paged().tokens(q), b.paged().tokens(q)));
    REQUIRE(a.paged().extra_key(q) == b.paged().extra_key(q));
    for (std::size_t l = 0; l < kLayers; ++l) {
      REQUIRE(b.layer_length(l, q) == a.layer_length(l, q));
      REQUIRE(device_rows(a, l, q) == device_rows(b, l, q));
    }
  }
}

}  // namespace

TEMPLATE_TEST_CASE("snapshots of a paged DeviceCache round-trip, and share the host caches' format",
                   "[cuda]", float, kvcache::qint8,
                   (kvcache::KVFormats<kvcache::fp8_e4m3, kvcache::bfloat16>)) {
  if (!have_device()) return;
  const kvcache::test::TempDir dir("device-snapshot");
  const kvcache::ModelId model("device-snapshot-test");
  Pair<TestType> p(40, false);
  const auto prompt = kvcache::test::iota_ids(13, 5);
  (void)p.dev.admit(0, prompt, 77, nullptr);  // under a cache salt
  for (std::size_t l = 0; l < kLayers; ++l) device_append(p.dev, l, 0, prompt, 0, 13);
  p.dev.fork(0, 1, nullptr);
  auto longer = prompt;
  longer.push_back(3);
  longer.push_back(4);
  p.dev.add_tokens(1, std::span<const token_id>(longer).subspan(13), nullptr);
  for (std::size_t l = 0; l < kLayers; ++l) device_append(p.dev, l, 1, longer, 13, 2);
  const auto other = kvcache::test::iota_ids(7, 200);  // layers of unequal length, no salt
  (void)p.dev.admit(2, other, 0, nullptr);
  device_append(p.dev, 0, 2, other, 0, 7);
  device_append(p.dev, 1, 2, other, 0, 5);
  const auto file = dir.path() / "device.kvc";
  kcuda::save_snapshot(file, p.dev, model);

  // into another device cache: the same sequences, and the prefix index rebuilt
  Pair<TestType> q(40, false);
  (void)kcuda::load_snapshot(file, q.dev, model);
  require_same(p.dev, q.dev);
  REQUIRE(q.dev.check_device_mirror(nullptr) == "");
  CHECK(std::ranges::equal(q.dev.paged().block_table(0).first(3),
                           q.dev.paged().block_table(1).first(3)));  // shared again
  q.dev.release(0, nullptr);
  q.dev.release(1, nullptr);
  CHECK(q.dev.match_prefix(prompt, 77) == 12);
  CHECK(q.dev.match_prefix(prompt) == 0);

  // into a host PagedCache: the same format
  kvcache::PagedCache<TestType> host({.num_layers = kLayers,
                                      .num_kv_heads = kHeads,
                                      .head_dim = kDim,
                                      .num_blocks = 40,
                                      .block_size = 8,  // another block size: rows move by position
                                      .max_batch = kBatch,
                                      .max_seq_len = kMaxLen});
  (void)kvcache::load_snapshot(file, host, model);
  for (std::size_t s = 0; s < 3; ++s) {
    REQUIRE(host.extra_key(s) == p.dev.paged().extra_key(s));
    for (std::size_t l = 0; l < kLayers; ++l) {
      REQUIRE(host_rows(host.view(l, s)) == device_rows(p.dev, l, s));
    }
  }
  // and back from the host, into other slots of a device cache
  const auto host_file = dir.path() / "host.kvc";
  kvcache::save_snapshot(host_file, host, model, std::vector<std::size_t>{0, 2});
  Pair<TestType> r(40, false);
  const std::vector<std::size_t> to{3, 1};
  (void)kcuda::load_snapshot(host_file, r.dev, model, {.dest_seqs = to});
  REQUIRE(r.dev.layer_length(0, 3) == 13);
  REQUIRE(r.dev.layer_length(1, 1) == 5);
  REQUIRE(r.dev.paged().extra_key(3) == 77);
  REQUIRE(r.dev.check_device_mirror(nullptr) == "");

  // a pool too small refuses the load and changes nothing
  Pair<TestType> small(3, false);
  (void)small.dev.admit(0, kvcache::test::iota_ids(5, 1), 0, nullptr);
  const auto before = small.dev.paged().stats();
  REQUIRE_THROWS_AS(kcuda::load_snapshot(file, small.dev, model), kvcache::pool_exhausted_error);
  REQUIRE(small.dev.paged().stats() == before);
  REQUIRE(small.dev.paged().tokens(0).size() == 5);
  REQUIRE(small.dev.check_device_mirror(nullptr) == "");
  // a device cache of another layout has no snapshots of this kind
  kcuda::DeviceCache<TestType> flat(
      {.num_layers = kLayers, .num_kv_heads = kHeads, .head_dim = kDim, .max_seq_len = 8});
  REQUIRE_THROWS_AS(kcuda::save_snapshot(file, flat, model), kvcache::shape_error);
}

TEMPLATE_TEST_CASE(
    "context_shift of a paged DeviceCache does what it does to a PagedCache, bit for bit", "[cuda]",
    float, (kvcache::KVFormats<kvcache::qint8, kvcache::half>)) {
  if (!have_device()) return;
  Pair<TestType> p(24, false);
  const kvcache::Rope rope({.base = 10000.0f}, kDim);
  // sequences 0 and 1 share a prompt's first blocks; 0 generates further; 2 has no ids
  const auto prompt = kvcache::test::iota_ids(13, 50);
  auto longer = prompt;
  for (token_id t = 90; t < 96; ++t) longer.push_back(t);
  for (std::size_t q : {0u, 1u}) {
    REQUIRE(p.dev.admit(q, prompt, 0, nullptr) == p.host.admit(q, prompt));
  }
  p.dev.add_tokens(0, std::span<const token_id>(longer).subspan(prompt.size()), nullptr);
  p.host.add_tokens(0, std::span<const token_id>(longer).subspan(prompt.size()));
  for (std::size_t l = 0; l < kLayers; ++l) {
    for (std::size_t q : {0u, 1u}) {
      const auto& ids = q == 0 ? longer : prompt;
      const std::size_t len = p.host.layer_length(l, q);
      const auto kv = kSynth.kv(l, ids, len, ids.size() - len);
      device_append(p.dev, l, q, ids, len, ids.size() - len);
      p.host.append(l, q, std::span<const token_id>(ids).subspan(len),
                    kv.k_block(0, ids.size() - len), kv.v_block(0, ids.size() - len));
    }
    const auto kv = kSynth.kv(l, longer, 0, 11);
    auto dk = upload(kv.k), dv = upload(kv.v);
    const std::vector<std::size_t> seqs{2}, counts{11};
    p.dev.append(l, seqs, counts, dk.data(), dv.data(), nullptr);
    p.host.append(l, 2, kv.k_block(0, 11), kv.v_block(0, 11));
  }
  p.check_state();

  // The rows of every (layer, seq) equal on the device and on the host.
  const auto same_rows = [&] {
    for (std::size_t q = 0; q < kBatch; ++q) {
      for (std::size_t l = 0; l < kLayers; ++l) {
        INFO("sequence " << q << " layer " << l);
        REQUIRE(device_rows(p.dev, l, q) == host_rows(p.host.view(l, q)));
      }
    }
  };
  // refused alike, nothing changed: past the length; a RoPE of another head_dim
  p.both([&] { kvcache::context_shift(p.host, 1, 10, 4, rope); },
         [&] { kcuda::context_shift(p.dev, 1, 10, 4, rope, nullptr); });
  const kvcache::Rope wide({}, 2 * kDim);
  p.both([&] { kvcache::context_shift(p.host, 0, 2, 3, wide); },
         [&] { kcuda::context_shift(p.dev, 0, 2, 3, wide, nullptr); });
  p.check_state();
  same_rows();

  // sequence 0 keeps 5 and drops 6 (across block boundaries), 2 (no ids) keeps 1 and drops 7
  kvcache::context_shift(p.host, 0, 5, 6, rope);
  kcuda::context_shift(p.dev, 0, 5, 6, rope, nullptr);
  kvcache::context_shift(p.host, 2, 1, 7, rope);
  kcuda::context_shift(p.dev, 2, 1, 7, rope, nullptr);
  REQUIRE(p.dev.seq_length(0) == longer.size() - 6);
  REQUIRE(p.dev.paged().exact_prefix(0) <= 5);
  p.check_state();
  same_rows();
  // moved keys are turned: not the rows the shifted ids would have at their new positions
  if constexpr (std::is_same_v<TestType, float>) {
    std::vector<float> k(p.dev.seq_length(0) * kHeads * kDim), v(k.size());
    p.dev.read_rows(1, 0, k, v, nullptr);
    const auto fresh = kSynth.kv(1, p.dev.paged().tokens(0), 0, p.dev.seq_length(0));
    REQUIRE(k != fresh.k);
  }

  // both go on alike: one more token, then a prompt with the old ids shares only what the
  // shift left shareable
  const std::vector<token_id> next{7};
  p.dev.add_tokens(0, next, nullptr);
  p.host.add_tokens(0, next);
  for (std::size_t l = 0; l < kLayers; ++l) {
    const auto ids =
        std::vector<token_id>(p.dev.paged().tokens(0).begin(), p.dev.paged().tokens(0).end());
    const std::size_t len = p.host.layer_length(l, 0);
    const auto kv = kSynth.kv(l, ids, len, 1);
    device_append(p.dev, l, 0, ids, len, 1);
    p.host.append(l, 0, std::span<const token_id>(ids).subspan(len, 1), kv.k_block(0, 1),
                  kv.v_block(0, 1));
  }
  std::size_t a = 0, b = 0;
  p.both([&] { a = p.host.admit(3, longer); }, [&] { b = p.dev.admit(3, longer, 0, nullptr); });
  REQUIRE(a == b);
  p.check_state();
  same_rows();
}
