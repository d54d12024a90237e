// SPDX-License-Identifier: Apache-2.0
// CRC32C and XXH64: published test vectors, every implementation (bitwise, slicing-by-8, SSE4.2
// three-way) equal on random data of any length and alignment, streaming equal to one-shot, and
// model_id_of_file() over a real file.
#include <fstream>
#include <random>
#include <string_view>
#include <vector>

#include "kvcache/io/snapshot.hpp"
#include "kvcache/kvcache.hpp"
#include "support/catch.hpp"
#include "support/rng.hpp"
#include "support/snapshot_helpers.hpp"

using namespace kvcache;

namespace {

std::span<const std::byte> bytes_of(std::string_view s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

std::vector<std::byte> random_bytes(std::mt19937_64& rng, std::size_t n) {
  std::vector<std::byte> out(n);
  for (auto& b : out) b = static_cast<std::byte>(rng() & 0xff);
  return out;
}

}  // namespace

TEST_CASE("crc32c matches the published check value and the RFC 3720 vectors") {
  REQUIRE(crc32c(bytes_of("123456789")) == 0xE3069283u);
  REQUIRE(crc32c({}) == 0u);
  std::vector<std::byte> buf(32);
  REQUIRE(crc32c(buf) == 0x8A9136AAu);  // 32 zero bytes
  for (auto& b : buf) b = std::byte{0xff};
  REQUIRE(crc32c(buf) == 0x62A8AB43u);
  for (std::size_t i = 0; i < 32; ++i) buf[i] = static_cast<std::byte>(i);
  REQUIRE(crc32c(buf) == 0x46DD794Eu);
  for (std::size_t i = 0; i < 32; ++i) buf[i] = static_cast<std::byte>(31 - i);
  REQUIRE(crc32c(buf) == 0x113FDB5Cu);
}

TEST_CASE("every crc32c implementation agrees on random data, lengths and alignments") {
  auto rng = kvcache::test::make_rng("crc32c-impls");
  const auto data = random_bytes(rng, 200000);
  const std::vector<std::size_t> lengths{0,    1,     7,     8,     9,     63,    64,
                                         4095, 24575, 24576, 24577, 49152, 73735, 199990};
  for (std::size_t len : lengths) {
    for (std::size_t offset : {0, 1, 3, 5, 8}) {
      if (offset + len > data.size()) continue;
      const std::byte* p = data.data() + offset;
      const std::uint32_t seed = static_cast<std::uint32_t>(rng());
      const std::uint32_t expect = detail::crc32c_raw_bitwise(seed, p, len);
      INFO("length " << len << " offset " << offset);
      REQUIRE(detail::crc32c_raw_sliced(seed, p, len) == expect);
#if KVCACHE_CRC32C_X86
      if (detail::cpu_has_sse42()) REQUIRE(detail::crc32c_raw_sse42(seed, p, len) == expect);
#endif
      REQUIRE(detail::crc32c_raw(seed, p, len) == expect);
    }
  }
}

TEST_CASE("crc32c_extend and crc32c_combine equal the CRC of the concatenation") {
  auto rng = kvcache::test::make_rng("crc32c-extend");
  const auto data = random_bytes(rng, 100000);
  for (int trial = 0; trial < 50; ++trial) {
    const std::size_t cut = kvcache::test::uniform(rng, 0, data.size());
    const std::span<const std::byte> all(data), a = all.first(cut), b = all.subspan(cut);
    REQUIRE(crc32c_extend(crc32c(a), b) == crc32c(all));
    REQUIRE(crc32c_combine(crc32c(a), crc32c(b), b.size()) == crc32c(all));
  }
}

TEST_CASE("a single flipped bit always changes the crc32c") {
  auto rng = kvcache::test::make_rng("crc32c-bitflip");
  auto data = random_bytes(rng, 30000);
  const std::uint32_t base = crc32c(data);
  for (int trial = 0; trial < 2000; ++trial) {
    const std::size_t i = kvcache::test::uniform(rng, 0, data.size() - 1);
    const auto bit = static_cast<std::byte>(1u << kvcache::test::uniform(rng, 0, 7));
    data[i] ^= bit;
    REQUIRE(crc32c(data) != base);
    data[i] ^= bit;
  }
}

TEST_CASE("xxhash64 matches the reference implementation (xxhsum -H64)") {
  REQUIRE(xxhash64(bytes_of("")) == 0xEF46DB3751D8E999ull);
  REQUIRE(xxhash64(bytes_of("a")) == 0xD24EC4F1A98C6E5Bull);
  REQUIRE(xxhash64(bytes_of("abc")) == 0x44BC2CF5AD770999ull);
  REQUIRE(xxhash64(bytes_of("The quick brown fox jumps over the lazy dog")) ==
          0x0B242D361FDA71BCull);
  std::vector<std::byte> pattern(1000);  // byte i = (7i + 3) mod 256: every code path
  for (std::size_t i = 0; i < pattern.size(); ++i) {
    pattern[i] = static_cast<std::byte>((i * 7 + 3) % 256);
  }
  REQUIRE(xxhash64(pattern) == 0x5F235FA033F1A3FBull);
}

TEST_CASE("streaming xxhash64 equals one-shot for any split") {
  auto rng = kvcache::test::make_rng("xxhash64-stream");
  const auto data = random_bytes(rng, 5000);
  for (int trial = 0; trial < 200; ++trial) {
    const std::size_t len = kvcache::test::uniform(rng, 0, data.size());
    const std::span<const std::byte> all = std::span<const std::byte>(data).first(len);
    XxHash64 h(trial);
    for (std::size_t done = 0; done < len;) {
      const std::size_t n = std::min(kvcache::test::uniform(rng, 0, 70), len - done);
      h.update(all.subspan(done, n));
      done += n;
    }
    REQUIRE(h.value() == xxhash64(all, static_cast<std::uint64_t>(trial)));
  }
}

TEST_CASE("model_id_of_file is the size and XXH64 of the file, and sees one changed byte") {
  auto rng = kvcache::test::make_rng("model-id-file");
  kvcache::test::TempDir dir("model-id");
  auto data = random_bytes(rng, 3 * (1 << 20) + 17);  // several 1 MiB read pieces
  auto write = [&] {
    std::ofstream(dir / "weights.bin", std::ios::binary)
        .write(reinterpret_cast<const char*>(data.data()),
               static_cast<std::streamsize>(data.size()));
  };
  write();
  const ModelId id = model_id_of_file(dir / "weights.bin");
  REQUIRE(id.size() == 16);
  std::uint64_t size = 0, hash = 0;
  for (int i = 7; i >= 0; --i) {
    size = (size << 8) | static_cast<std::uint64_t>(id.bytes()[i]);
    hash = (hash << 8) | static_cast<std::uint64_t>(id.bytes()[8 + i]);
  }
  REQUIRE(size == data.size());
  REQUIRE(hash == xxhash64(data));
  data[2 * (1 << 20) + 5] ^= std::byte{1};
  write();
  REQUIRE(!(model_id_of_file(dir / "weights.bin") == id));
  REQUIRE_THROWS_AS(model_id_of_file(dir / "missing.bin"), io_error);
  REQUIRE_THROWS_AS(model_id_of_file(dir.path()), format_error);  // a directory
}

TEST_CASE("ModelId holds up to 64 bytes and compares by content") {
  REQUIRE(ModelId::from_u64(0x0123456789abcdefull).hex() == "efcdab8967452301");
  REQUIRE(ModelId("llama") == ModelId("llama"));
  REQUIRE(!(ModelId("llama") == ModelId("llama2")));
  REQUIRE(ModelId().size() == 0);
  REQUIRE(ModelId(std::string(64, 'x')).size() == 64);
  REQUIRE_THROWS_AS(ModelId(std::string(65, 'x')), shape_error);
}
