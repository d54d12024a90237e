// SPDX-License-Identifier: Apache-2.0
// The llama2.c checkpoint loader and the synthetic model spec: valid files round-trip; short,
// truncated, oversized, absurd or non-finite files throw a format_error naming the field, the
// numbers and the byte offset, before any payload-sized allocation; stories260K loads as described.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "llama/model.hpp"
#include "support/catch.hpp"
#include "support/stories.hpp"
#include "support/throws.hpp"

using namespace kvcache;
using llama::Checkpoint;
using llama::ModelConfig;

namespace {

// 2 layers, dim 64, 4 heads of 16, 2 KV heads, hidden 96, vocab 97, seq_len 32, separate wcls.
const ModelConfig kSmall{.dim = 64,
                         .hidden_dim = 96,
                         .num_layers = 2,
                         .num_heads = 4,
                         .num_kv_heads = 2,
                         .vocab_size = 97,
                         .seq_len = 32,
                         .shared_classifier = false};

std::vector<unsigned char> small_file() {
  return llama::serialize_llama2c(llama::synthetic_checkpoint(kSmall, 5));
}

void set_i32(std::vector<unsigned char>& b, std::size_t offset, std::int32_t v) {
  const auto u = static_cast<std::uint32_t>(v);
  for (int i = 0; i < 4; ++i) b[offset + i] = static_cast<unsigned char>(u >> (8 * i));
}

std::filesystem::path temp_path(const char* name) {
  return std::filesystem::temp_directory_path() /
         (std::string("kvcache_llama_test_") + std::to_string(std::random_device{}()) + "_" + name);
}

void write_file(const std::filesystem::path& p, const std::vector<unsigned char>& b) {
  std::ofstream out(p, std::ios::binary);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

}  // namespace

TEST_CASE("a serialized checkpoint parses back to the same config and weights") {
  for (bool tied : {false, true}) {
    ModelConfig c = kSmall;
    c.shared_classifier = tied;
    const Checkpoint ckpt = llama::synthetic_checkpoint(c, 9);
    const auto bytes = llama::serialize_llama2c(ckpt);
    // Size by hand: 28 header bytes + 4 * (embedding, 2 layers of weights, rms_final, RoPE
    // tables, wcls when separate).
    const std::size_t per_layer = 64 + 64 * 64 + 2 * 32 * 64 + 64 * 64 + 64 + 3 * 96 * 64;
    const std::size_t floats = 97 * 64 + 2 * per_layer + 64 + 32 * 16 + (tied ? 0 : 97 * 64);
    REQUIRE(bytes.size() == 28 + 4 * floats);
    REQUIRE(bytes[20] == (tied ? 97 : static_cast<unsigned char>(-97 & 0xff)));
    const Checkpoint back = llama::parse_llama2c(bytes);
    REQUIRE(back.config == c);
    REQUIRE(back.data == ckpt.data);
  }
}

TEST_CASE("a file shorter than the header is a format_error") {
  const auto file = small_file();
  const std::vector<unsigned char> bytes(file.begin(), file.begin() + 20);
  test::require_throws<format_error>([&] { (void)llama::parse_llama2c(bytes, "short.bin"); },
                                     "short.bin", "truncated", "20 bytes", "28-byte header");
}

TEST_CASE("every absurd header field is named with its byte offset and value") {
  struct Case {
    std::size_t index;
    std::int32_t value;
    const char* field;
    const char* detail;
  };
  const Case cases[] = {
      {0, 0, "dim", "must be positive"},
      {1, -3, "hidden_dim", "must be positive"},
      {2, 5000, "n_layers", "[1, 1024]"},
      {3, 3, "n_heads", "dim 64 must be a multiple"},
      {3, 32, "n_heads", "even head_dim"},  // with dim 96 (set below): head_dim 3
      {4, 3, "n_kv_heads", "divide n_heads 4"},
      {4, 8, "n_kv_heads", "[1, 4]"},
      {5, 0, "vocab_size", "nonzero"},
      {5, std::numeric_limits<std::int32_t>::min(), "vocab_size", "nonzero"},
      {5, 1 << 23, "vocab_size", "[1, 4194304]"},
      {6, -1, "seq_len", "must be positive"},
      {0, 1 << 30, "dim", "[1, 65536]"},
  };
  for (const Case& c : cases) {
    auto bytes = small_file();
    set_i32(bytes, 4 * c.index, c.value);
    if (c.index == 3 && c.value == 32) set_i32(bytes, 0, 96);  // dim 96 / 32 heads: head_dim 3
    INFO("field " << c.field << " = " << c.value);
    test::require_throws<format_error>(
        [&] { (void)llama::parse_llama2c(bytes, "bad.bin"); }, "bad.bin", "header field", c.field,
        "(byte offset " + std::to_string(4 * c.index) + ")", std::to_string(c.value), c.detail);
  }
}

TEST_CASE("a huge but valid-looking header fails on the size check, not an allocation") {
  auto bytes = small_file();
  set_i32(bytes, 0, 65536);        // dim
  set_i32(bytes, 4, 262144);       // hidden_dim
  set_i32(bytes, 8, 1024);         // n_layers
  set_i32(bytes, 12, 128);         // n_heads (head_dim 512)
  set_i32(bytes, 16, 128);         // n_kv_heads
  set_i32(bytes, 20, -(1 << 22));  // vocab_size, separate classifier
  set_i32(bytes, 24, 1 << 24);     // seq_len
  // ~ 6e13 floats: no allocation of that size may be attempted.
  test::require_throws<format_error>([&] { (void)llama::parse_llama2c(bytes, "huge.bin"); },
                                     "truncated", std::to_string(bytes.size()) + " bytes", "needs ",
                                     "dim 65536", "inside tensor token_embedding");
}

TEST_CASE("a truncated payload names the size it needs and the tensor it stops in") {
  auto bytes = small_file();
  // Offsets of kSmall by hand: embedding 97*64, rms_att 2*64, wq 2*64*64, wk and wv 2*32*64,
  // wo 2*64*64, rms_ffn 2*64, w1 2*96*64, then w2: layer 1 starts 64*96 floats into w2.
  const std::size_t w2 = 97 * 64 + 128 + 8192 + 4096 + 4096 + 8192 + 128 + 12288;
  const std::size_t cut = 28 + 4 * (w2 + 64 * 96 + 10);
  const std::size_t full = bytes.size();
  bytes.erase(bytes.begin() + static_cast<std::ptrdiff_t>(cut), bytes.end());
  test::require_throws<format_error>([&] { (void)llama::parse_llama2c(bytes, "cut.bin"); },
                                     "cut.bin", "truncated", std::to_string(cut) + " bytes",
                                     "needs " + std::to_string(full),
                                     "byte offset " + std::to_string(cut), "tensor w2 layer 1");
}

TEST_CASE("trailing bytes make the size wrong") {
  auto bytes = small_file();
  const std::size_t full = bytes.size();
  bytes.insert(bytes.end(), 8, 0);
  test::require_throws<format_error>([&] { (void)llama::parse_llama2c(bytes); }, "wrong size",
                                     std::to_string(full + 8), "exactly " + std::to_string(full),
                                     "8 unexpected bytes");
}

TEST_CASE("a version-1 export is recognised by its magic") {
  auto bytes = small_file();
  set_i32(bytes, 0, 0x616b3432);
  test::require_throws<format_error>([&] { (void)llama::parse_llama2c(bytes); }, "0x616b3432",
                                     "version 1+", "legacy version-0");
}

TEST_CASE("a non-finite weight is reported with its tensor and byte offset") {
  auto bytes = small_file();
  const std::size_t wo = 97 * 64 + 128 + 8192 + 4096 + 4096;  // wo layer 0 starts here
  const std::size_t offset = 28 + 4 * (wo + 4096 + 3);        // wo layer 1, element 3
  set_i32(bytes, offset, 0x7fc00000);                         // quiet NaN
  test::require_throws<format_error>([&] { (void)llama::parse_llama2c(bytes); },
                                     "byte offset " + std::to_string(offset), "tensor wo layer 1",
                                     "nan");
}

TEST_CASE("load_llama2c reads files and reports bad ones by path") {
  const auto bytes = small_file();
  const auto good = temp_path("good.bin"), cut = temp_path("cut.bin");
  write_file(good, bytes);
  write_file(cut, std::vector<unsigned char>(bytes.begin(), bytes.end() - 100));
  const Checkpoint loaded = llama::load_llama2c(good);
  const Checkpoint parsed = llama::parse_llama2c(bytes);
  REQUIRE(loaded.config == parsed.config);
  REQUIRE(loaded.data == parsed.data);
  test::require_throws<format_error>([&] { (void)llama::load_llama2c(cut); }, cut.string(),
                                     "truncated", std::to_string(bytes.size() - 100) + " bytes",
                                     "tensor wcls");
  test::require_throws<format_error>([&] { (void)llama::load_llama2c(temp_path("missing.bin")); },
                                     "cannot open");
  std::filesystem::remove(good);
  std::filesystem::remove(cut);
}

TEST_CASE("stories260K loads with the shape its README gives") {
  if (!test::have_stories({"stories260K.bin"})) return;
  const std::filesystem::path path = test::kStoriesDir / "stories260K.bin";
  const Checkpoint ckpt = llama::load_llama2c(path);
  REQUIRE(ckpt.config == ModelConfig{.dim = 64,
                                     .hidden_dim = 172,
                                     .num_layers = 5,
                                     .num_heads = 8,
                                     .num_kv_heads = 4,
                                     .vocab_size = 512,
                                     .seq_len = 512,
                                     .shared_classifier = true});
  REQUIRE(llama::Llama2cLayout(ckpt.config).file_bytes() == 1056540);
  REQUIRE(std::filesystem::file_size(path) == 1056540);
}

TEST_CASE("synthetic specs give Llama shapes and reject what cannot run") {
  const ModelConfig c = llama::parse_synthetic_spec("8L-1024d-16h-4kv");
  REQUIRE(c == ModelConfig{.dim = 1024,
                           .hidden_dim = 2816,  // 8/3 * 1024 = 2730.7, next multiple of 256
                           .num_layers = 8,
                           .num_heads = 16,
                           .num_kv_heads = 4,
                           .vocab_size = 512,
                           .seq_len = 2048,
                           .shared_classifier = false});
  const ModelConfig t = llama::parse_synthetic_spec("2L-64d-4h-100v-64ctx-tied");
  REQUIRE(t.num_kv_heads == 4);
  REQUIRE(t.hidden_dim == 192);  // 170 rounded up to a multiple of 32
  REQUIRE(t.vocab_size == 100);
  REQUIRE(t.seq_len == 64);
  REQUIRE(t.shared_classifier);
  REQUIRE(llama::parse_synthetic_spec(llama::synthetic_spec(c)) == c);
  REQUIRE(llama::parse_synthetic_spec(llama::synthetic_spec(t)) == t);

  using llama::usage_error;
  test::require_throws<usage_error>([] { (void)llama::parse_synthetic_spec("8L-1024d"); },
                                    "needs <n>L, <n>d and <n>h");
  test::require_throws<usage_error>([] { (void)llama::parse_synthetic_spec("8L-64d-4h-3kv"); },
                                    "n_kv_heads", "divide n_heads 4");
  test::require_throws<usage_error>([] { (void)llama::parse_synthetic_spec("8L-64d-4x"); },
                                    "item \"4x\"");
  test::require_throws<usage_error>([] { (void)llama::parse_synthetic_spec("8L-1000d-16h"); },
                                    "n_heads", "dim 1000");
  test::require_throws<usage_error>([] { (void)llama::parse_synthetic_spec("2000L-64d-4h"); },
                                    "n_layers", "2000");
}
