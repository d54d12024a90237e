// SPDX-License-Identifier: Apache-2.0
// The llama2.c tokenizer (tokenizer.bin / tok512.bin): a vocabulary of byte pieces with merge
// scores. Encoding splits text into UTF-8 code points (unknown ones fall back to <0xNN> byte
// tokens) and greedily merges the adjacent pair with the best score, as llama2.c's run.c does.
#pragma once

#include <array>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kvcache/core/error.hpp"
#include "llama/model.hpp"

namespace llama {

/// Token ids with a fixed meaning in llama2.c vocabularies.
inline constexpr token_id kBos = 1;
inline constexpr token_id kEos = 2;

/// A llama2.c tokenizer. Immutable after loading; encode/decode are thread-safe.
class Tokenizer {
 public:
  /// Reads the llama2.c tokenizer format: int32 max_token_length, then per token {float32 score,
  /// int32 length, length bytes}. With expected_vocab > 0 exactly that many tokens must follow
  /// (the model's vocab_size); with 0 tokens are read to the end of the file.
  /// @throws kvcache::format_error naming the token index and byte offset of a bad record.
  [[nodiscard]] static Tokenizer load(const std::filesystem::path& path,
                                      std::size_t expected_vocab = 0) {
    std::ifstream in(path, std::ios::binary);
    if (!in) {
      throw kvcache::format_error(path.string() +
                                  ": cannot open the tokenizer: " + std::strerror(errno));
    }
    const std::vector<unsigned char> bytes((std::istreambuf_iterator<char>(in)),
                                           std::istreambuf_iterator<char>());
    return parse(bytes, expected_vocab, path.string());
  }

  /// As load(), from bytes in memory; `name` prefixes errors.
  [[nodiscard]] static Tokenizer parse(std::span<const unsigned char> bytes,
                                       std::size_t expected_vocab = 0,
                                       std::string_view name = "tokenizer") {
    using kvcache::detail::message;
    const std::string nm(name);
    if (bytes.size() < 4) {
      throw kvcache::format_error(message(nm, ": truncated: ", bytes.size(),
                                          " bytes, shorter than the int32 max_token_length"));
    }
    const std::int32_t max_len = detail::read_i32_le(bytes.data());
    if (max_len < 1 || max_len > 1024) {
      throw kvcache::format_error(
          message(nm, ": max_token_length (byte offset 0) is ", max_len, "; must be in [1, 1024]"));
    }
    Tokenizer tok;
    tok.max_token_length_ = static_cast<std::size_t>(max_len);
    std::size_t at = 4;
    while (expected_vocab == 0 ? at < bytes.size() : tok.pieces_.size() < expected_vocab) {
      const std::size_t id = tok.pieces_.size();
      if (id >= ConfigLimits::kMaxVocab) {
        throw kvcache::format_error(
            message(nm, ": more than ", ConfigLimits::kMaxVocab, " tokens"));
      }
      if (bytes.size() - at < 8) {
        throw kvcache::format_error(message(
            nm, ": truncated at byte offset ", bytes.size(), " inside the record of token ", id,
            expected_vocab ? " of " : "", expected_vocab ? std::to_string(expected_vocab) : ""));
      }
      const float score = detail::read_f32_le(bytes.data() + at);
      const std::int32_t len = detail::read_i32_le(bytes.data() + at + 4);
      if (len < 0 || static_cast<std::size_t>(len) > tok.max_token_length_ ||
          static_cast<std::size_t>(len) > bytes.size() - at - 8) {
        throw kvcache::format_error(message(
            nm, ": token ", id, " (byte offset ", at + 4, ") has length ", len, "; must be in [0, ",
            tok.max_token_length_, "] and fit in the ", bytes.size() - at - 8, " bytes left"));
      }
      if (!std::isfinite(score)) {
        throw kvcache::format_error(
            message(nm, ": token ", id, " (byte offset ", at, ") has score ", score));
      }
      tok.scores_.push_back(score);
      tok.pieces_.emplace_back(reinterpret_cast<const char*>(bytes.data() + at + 8),
                               static_cast<std::size_t>(len));
      at += 8 + static_cast<std::size_t>(len);
    }
    if (at != bytes.size()) {
      throw kvcache::format_error(message(nm, ": ", bytes.size() - at,
                                          " unexpected bytes after the last of ",
                                          tok.pieces_.size(), " tokens (byte offset ", at, ")"));
    }
    if (tok.pieces_.size() <= static_cast<std::size_t>(kEos)) {
      throw kvcache::format_error(
          message(nm, ": only ", tok.pieces_.size(), " tokens; needs <unk>, <s>, </s> at least"));
    }
    tok.index();
    return tok;
  }

  [[nodiscard]] std::size_t vocab_size() const noexcept { return pieces_.size(); }
  [[nodiscard]] std::string_view piece(token_id id) const { return pieces_.at(checked(id)); }
  [[nodiscard]] float score(token_id id) const { return scores_.at(checked(id)); }

  /// Token ids of `text`: optional BOS; a leading " " token when the text is non-empty (the
  /// SentencePiece dummy prefix); one token per UTF-8 code point found in the vocabulary, else
  /// one <0xNN> byte token per byte; then repeated merges of the adjacent pair whose
  /// concatenation is a token with the highest score (leftmost on ties); optional EOS.
  /// O(n^2) in the number of code points.
  /// @throws usage_error when a byte has no token and no byte fallback exists.
  [[nodiscard]] std::vector<token_id> encode(std::string_view text, bool bos = true,
                                             bool eos = false) const {
    std::vector<token_id> ids;
    if (bos) ids.push_back(kBos);
    if (!text.empty()) {
      if (const auto space = find(" ")) ids.push_back(*space);
    }
    for (std::size_t i = 0; i < text.size();) {
      std::size_t n = 1;  // bytes of this code point: a lead byte plus continuation bytes
      while (i + n < text.size() && n < 4 &&
             (static_cast<unsigned char>(text[i + n]) & 0xC0) == 0x80) {
        ++n;
      }
      if (const auto id = find(text.substr(i, n))) {
        ids.push_back(*id);
      } else {
        for (std::size_t b = 0; b < n; ++b) {
          const auto byte = static_cast<unsigned char>(text[i + b]);
          if (byte_token_[byte] < 0) {
            throw usage_error(kvcache::detail::message("tokenizer: byte ", static_cast<int>(byte),
                                                       " has no token and no <0xNN> fallback"));
          }
          ids.push_back(byte_token_[byte]);
        }
      }
      i += n;
    }
    for (;;) {
      float best_score = 0;
      std::size_t best_at = 0;
      token_id best_id = -1;
      std::string pair;
      for (std::size_t i = 0; i + 1 < ids.size(); ++i) {
        pair.assign(pieces_[static_cast<std::size_t>(ids[i])]);
        pair.append(pieces_[static_cast<std::size_t>(ids[i + 1])]);
        const auto id = find(pair);
        if (id && (best_id < 0 || scores_[static_cast<std::size_t>(*id)] > best_score)) {
          best_score = scores_[static_cast<std::size_t>(*id)];
          best_at = i;
          best_id = *id;
        }
      }
      if (best_id < 0) break;
      ids[best_at] = best_id;
      ids.erase(ids.begin() + static_cast<std::ptrdiff_t>(best_at) + 1);
    }
    if (eos) ids.push_back(kEos);
    return ids;
  }

  /// The bytes token `id` stands for when it follows `prev`: <0xNN> pieces are that byte, and
  /// the leading space of a piece right after BOS is dropped (llama2.c's decode).
  [[nodiscard]] std::string decode(token_id prev, token_id id) const {
    std::string_view p = piece(id);
    if (prev == kBos && !p.empty() && p.front() == ' ') p.remove_prefix(1);
    if (const int byte = byte_value(p); byte >= 0) return std::string(1, static_cast<char>(byte));
    return std::string(p);
  }

  /// The text of `ids` (each decoded after its predecessor, the first after `prev`).
  [[nodiscard]] std::string decode(std::span<const token_id> ids, token_id prev = kBos) const {
    std::string out;
    for (token_id id : ids) {
      out += decode(prev, id);
      prev = id;
    }
    return out;
  }

  /// `s` with control bytes other than whitespace dropped (as llama2.c's safe_printf does for
  /// single-byte pieces), for printing.
  [[nodiscard]] static std::string printable(std::string_view s) {
    std::string out;
    for (char ch : s) {
      const auto c = static_cast<unsigned char>(ch);
      if (c >= 0x20 || c == '\n' || c == '\t' || c == '\r' || c >= 0x80) out += ch;
    }
    return out;
  }

 private:
  Tokenizer() = default;

  [[nodiscard]] std::size_t checked(token_id id) const {
    if (id < 0 || static_cast<std::size_t>(id) >= pieces_.size()) {
      throw usage_error(kvcache::detail::message(
          "tokenizer: token id ", id, " out of range (vocab_size ", pieces_.size(), ")"));
    }
    return static_cast<std::size_t>(id);
  }

  /// 0..255 for a "<0xNN>" piece (hex digits in either case), else -1.
  [[nodiscard]] static int byte_value(std::string_view p) noexcept {
    if (p.size() != 6 || p.substr(0, 3) != "<0x" || p[5] != '>') return -1;
    int v = 0;
    for (char c : p.substr(3, 2)) {
      v *= 16;
      if (c >= '0' && c <= '9') {
        v += c - '0';
      } else if (c >= 'A' && c <= 'F') {
        v += c - 'A' + 10;
      } else if (c >= 'a' && c <= 'f') {
        v += c - 'a' + 10;
      } else {
        return -1;
      }
    }
    return v;
  }

  [[nodiscard]] std::optional<token_id> find(std::string_view s) const {
    const auto it = lookup_.find(std::string(s));
    if (it == lookup_.end()) return std::nullopt;
    return it->second;
  }

  void index() {
    byte_token_.fill(-1);
    for (std::size_t i = 0; i < pieces_.size(); ++i) {
      const auto id = static_cast<token_id>(i);
      lookup_.emplace(pieces_[i], id);  // the first of duplicate pieces wins
      if (const int b = byte_value(pieces_[i]); b >= 0 && byte_token_[b] < 0) byte_token_[b] = id;
    }
  }

  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::unordered_map<std::string, token_id> lookup_;
  std::array<token_id, 256> byte_token_{};
  std::size_t max_token_length_ = 0;
};

}  // namespace llama
