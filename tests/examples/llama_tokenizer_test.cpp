// SPDX-License-Identifier: Apache-2.0
// The llama2.c tokenizer: merges by best score (leftmost on ties, as run.c), byte fallback for
// code points outside the vocabulary, decode of <0xNN> pieces and of the space after BOS, typed
// errors for malformed files, and round trips through the real tok512.bin.
#include <bit>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "llama/tokenizer.hpp"
#include "support/catch.hpp"
#include "support/stories.hpp"
#include "support/throws.hpp"

using namespace kvcache;
using llama::token_id;
using llama::Tokenizer;

namespace {

void put_i32(std::vector<unsigned char>& b, std::int32_t v) {
  for (int i = 0; i < 4; ++i)
    b.push_back(static_cast<unsigned char>(static_cast<std::uint32_t>(v) >> (8 * i)));
}

struct Piece {
  std::string text;
  float score;
};

/// A llama2.c tokenizer file: <unk> <s> </s>, the 256 byte tokens, then `extra`.
std::vector<unsigned char> tokenizer_file(const std::vector<Piece>& extra, int max_len = 8) {
  std::vector<Piece> all{{"<unk>", 0}, {"<s>", 0}, {"</s>", 0}};
  for (int b = 0; b < 256; ++b) {
    char hex[8];
    std::snprintf(hex, sizeof hex, "<0x%02X>", b);
    all.push_back({hex, 0});
  }
  all.insert(all.end(), extra.begin(), extra.end());
  std::vector<unsigned char> out;
  put_i32(out, max_len);
  for (const Piece& p : all) {
    put_i32(out, std::bit_cast<std::int32_t>(p.score));
    put_i32(out, static_cast<std::int32_t>(p.text.size()));
    out.insert(out.end(), p.text.begin(), p.text.end());
  }
  return out;
}

constexpr token_id kFirstExtra = 259;

}  // namespace

TEST_CASE("encode merges the best-scoring pair first, not left to right") {
  // ids: 259 " ", 260 "a", 261 "b", 262 "ab" (5), 263 "ba" (10), 264 " a" (1)
  const Tokenizer tok = Tokenizer::parse(
      tokenizer_file({{" ", 0}, {"a", 0}, {"b", 0}, {"ab", 5}, {"ba", 10}, {" a", 1}}));
  // " a b a": "ba" (10) merges first, then " a" (1); "ab" never gets its chance.
  REQUIRE(tok.encode("aba") == std::vector<token_id>{1, 264, 263});
  REQUIRE(tok.encode("aba", false, true) == std::vector<token_id>{264, 263, 2});
  REQUIRE(tok.encode("") == std::vector<token_id>{1});  // no dummy prefix for empty text
}

TEST_CASE("encode breaks score ties by the leftmost pair") {
  const Tokenizer tok =
      Tokenizer::parse(tokenizer_file({{" ", 0}, {"a", 0}, {"b", 0}, {"ab", 5}, {"ba", 5}}));
  REQUIRE(tok.encode("aba", false) == std::vector<token_id>{kFirstExtra, 262, 260});
}

TEST_CASE("code points outside the vocabulary fall back to byte tokens and decode back") {
  const Tokenizer tok = Tokenizer::parse(tokenizer_file({{" ", 0}, {"a", 0}, {"\xC3\xA9", 0}}));
  // U+00E9 is a piece; U+00E8 is not and becomes bytes 0xC3 0xA8 (ids 3 + byte).
  const auto ids = tok.encode("a\xC3\xA8\xC3\xA9", false);
  REQUIRE(ids == std::vector<token_id>{kFirstExtra, 260, 3 + 0xC3, 3 + 0xA8, 261});
  REQUIRE(tok.decode(ids, 0) == " a\xC3\xA8\xC3\xA9");
}

TEST_CASE("decode drops the space after BOS and turns <0xNN> into bytes") {
  const Tokenizer tok = Tokenizer::parse(tokenizer_file({{" Once", 0}, {" upon", 0}}));
  REQUIRE(tok.decode(std::vector<token_id>{259, 260}) == "Once upon");
  REQUIRE(tok.decode(std::vector<token_id>{259, 260}, 259) == " Once upon");
  REQUIRE(tok.decode(259, 3 + 0x0A) == "\n");
  REQUIRE(Tokenizer::printable(std::string("a\x01"
                                           "b\n",
                                           4)) == "ab\n");
  test::require_throws<llama::usage_error>([&] { (void)tok.piece(261); }, "token id 261",
                                           "vocab_size 261");
}

TEST_CASE("malformed tokenizer files are format_errors naming the token and offset") {
  const auto good = tokenizer_file({{"hello", 1}});
  REQUIRE(Tokenizer::parse(good, 260).vocab_size() == 260);

  const std::vector<unsigned char> cut(good.begin(), good.end() - 3);
  test::require_throws<format_error>([&] { (void)Tokenizer::parse(cut, 260, "tok.bin"); },
                                     "tok.bin", "token 259", "length 5");
  test::require_throws<format_error>([&] { (void)Tokenizer::parse(good, 261); }, "truncated",
                                     "token 260 of 261");
  test::require_throws<format_error>([&] { (void)Tokenizer::parse(good, 259); }, "unexpected bytes",
                                     "259 tokens");
  auto zero = good;
  zero[0] = 0;
  test::require_throws<format_error>([&] { (void)Tokenizer::parse(zero); }, "max_token_length",
                                     "is 0");
  auto negative = good;
  const std::size_t len_at = 4 + 4;  // token 0's length field
  for (int i = 0; i < 4; ++i) negative[len_at + i] = 0xff;
  test::require_throws<format_error>([&] { (void)Tokenizer::parse(negative); }, "token 0",
                                     "byte offset 8", "length -1");
  const auto long_piece = tokenizer_file({{"abcdefghij", 1}}, 8);
  test::require_throws<format_error>([&] { (void)Tokenizer::parse(long_piece); }, "token 259",
                                     "length 10", "[0, 8]");
}

TEST_CASE("tok512.bin round-trips text and encodes the stories260K prompt") {
  if (!test::have_stories({"tok512.bin"})) return;
  const Tokenizer tok = Tokenizer::load(test::kStoriesDir / "tok512.bin", 512);
  REQUIRE(tok.vocab_size() == 512);
  REQUIRE(tok.piece(1) == "\n<s>\n");  // llama2.c exports BOS and EOS wrapped in newlines
  REQUIRE(tok.piece(3) == "<0x00>");
  const auto ids = tok.encode("Once upon a time, there was a little girl named Lily.");
  REQUIRE(ids.size() > 3);
  // The ids llama2.c's run.c gives this prompt: BOS, " Once", " upon".
  REQUIRE(ids[0] == 1);
  REQUIRE(tok.piece(ids[1]) == " Once");
  REQUIRE(tok.piece(ids[2]) == " upon");
  for (const std::string text : {"Once upon a time, there was a little girl named Lily.",
                                 "Tom said: \"No!\"\nThe end.", "caf\xC3\xA9 \xE2\x9C\x93 42"}) {
    INFO(text);
    const auto enc = tok.encode(text);
    REQUIRE(tok.decode(std::span<const token_id>(enc).subspan(1)) == text);
  }
}
