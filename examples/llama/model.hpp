// SPDX-License-Identifier: Apache-2.0
// The Llama model of the example engine: its configuration, the llama2.c legacy (version 0)
// checkpoint layout and a loader that validates every header field and the file size before it
// allocates, seeded synthetic weights of any Llama shape, and the weights packed for the GEMM.
#pragma once

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvcache/attention/cpu.hpp"
#include "kvcache/core/config.hpp"
#include "kvcache/core/error.hpp"
#include "kvcache/core/thread_pool.hpp"
#include "llama/gemm.hpp"

namespace llama {

using kvcache::token_id;

/// Bad input given to the example (command line, synthetic model spec, prompt token ids).
class usage_error : public kvcache::error {
 public:
  using kvcache::error::error;
};

/// Shape of a Llama-architecture transformer (llama2.c's Config).
struct ModelConfig {
  std::size_t dim = 0;            ///< residual stream width (num_heads * head_dim)
  std::size_t hidden_dim = 0;     ///< SwiGLU FFN width
  std::size_t num_layers = 0;     ///< transformer blocks
  std::size_t num_heads = 0;      ///< query heads
  std::size_t num_kv_heads = 0;   ///< key/value heads (GQA when < num_heads)
  std::size_t vocab_size = 0;     ///< tokens
  std::size_t seq_len = 0;        ///< context length the model was trained for
  bool shared_classifier = true;  ///< classifier = token embedding (llama2.c: vocab_size > 0)

  [[nodiscard]] constexpr std::size_t head_dim() const noexcept { return dim / num_heads; }
  [[nodiscard]] constexpr std::size_t kv_dim() const noexcept { return num_kv_heads * head_dim(); }
  friend constexpr bool operator==(const ModelConfig&, const ModelConfig&) = default;
};

/// Largest values the loader accepts for each header field: far beyond any real model, small
/// enough that no product of them overflows 64 bits.
struct ConfigLimits {
  static constexpr std::size_t kMaxDim = 1 << 16;
  static constexpr std::size_t kMaxHidden = 1 << 18;
  static constexpr std::size_t kMaxLayers = 1 << 10;
  static constexpr std::size_t kMaxVocab = 1 << 22;
  static constexpr std::size_t kMaxSeqLen = 1 << 24;
};

/// What is wrong with a configuration: the field, its header index (0..6) and the reason.
struct ConfigProblem {
  const char* field;
  std::size_t index;
  std::string reason;
};

/// The first field of `c` that the engine cannot run, or nullopt when every field is usable:
/// each within ConfigLimits, num_heads dividing dim with an even head_dim (RoPE rotates pairs)
/// of at most kvcache::cpu::kMaxHeadDim, num_kv_heads dividing num_heads.
[[nodiscard]] inline std::optional<ConfigProblem> check_config(const ModelConfig& c) {
  using kvcache::detail::message;
  auto range = [](const char* field, std::size_t index, std::size_t v,
                  std::size_t hi) -> std::optional<ConfigProblem> {
    if (v >= 1 && v <= hi) return std::nullopt;
    return ConfigProblem{field, index, message("is ", v, "; must be in [1, ", hi, "]")};
  };
  if (auto p = range("dim", 0, c.dim, ConfigLimits::kMaxDim)) return p;
  if (auto p = range("hidden_dim", 1, c.hidden_dim, ConfigLimits::kMaxHidden)) return p;
  if (auto p = range("n_layers", 2, c.num_layers, ConfigLimits::kMaxLayers)) return p;
  if (auto p = range("n_heads", 3, c.num_heads, c.dim)) return p;
  if (c.dim % c.num_heads != 0 || c.head_dim() % 2 != 0 ||
      c.head_dim() > kvcache::cpu::kMaxHeadDim) {
    return ConfigProblem{"n_heads", 3,
                         message("is ", c.num_heads, "; dim ", c.dim,
                                 " must be a multiple of it with an even head_dim of at most ",
                                 kvcache::cpu::kMaxHeadDim)};
  }
  if (auto p = range("n_kv_heads", 4, c.num_kv_heads, c.num_heads)) return p;
  if (c.num_heads % c.num_kv_heads != 0) {
    return ConfigProblem{"n_kv_heads", 4,
                         message("is ", c.num_kv_heads, "; it must divide n_heads ", c.num_heads)};
  }
  if (auto p = range("vocab_size", 5, c.vocab_size, ConfigLimits::kMaxVocab)) return p;
  if (auto p = range("seq_len", 6, c.seq_len, ConfigLimits::kMaxSeqLen)) return p;
  return std::nullopt;
}

/// One tensor of the llama2.c payload: `count` floats from float index `offset` (counted after
/// the 28-byte header), stacked over `layers` layers of [rows][cols] each.
struct TensorInfo {
  const char* name = "";
  std::size_t offset = 0;
  std::size_t layers = 1;
  std::size_t rows = 0;
  std::size_t cols = 0;

  [[nodiscard]] std::size_t per_layer() const noexcept { return rows * cols; }
  [[nodiscard]] std::size_t count() const noexcept { return layers * rows * cols; }
  [[nodiscard]] std::size_t end() const noexcept { return offset + count(); }
};

/// The llama2.c legacy payload, in file order: token_embedding [vocab][dim], rms_att [L][dim],
/// wq [L][dim][dim], wk [L][kv_dim][dim], wv [L][kv_dim][dim], wo [L][dim][dim], rms_ffn
/// [L][dim], w1 [L][hidden][dim], w2 [L][dim][hidden], w3 [L][hidden][dim], rms_final [dim],
/// freq_cis_real and freq_cis_imag [seq_len][head_dim / 2] (unused), then wcls [vocab][dim]
/// only when the classifier is not shared.
struct Llama2cLayout {
  static constexpr std::size_t kHeaderBytes = 7 * sizeof(std::int32_t);

  TensorInfo token_embedding, rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3, rms_final, freq_real,
      freq_imag, wcls;
  std::size_t total_floats = 0;

  /// @pre check_config(c) found nothing (so no size overflows).
  explicit Llama2cLayout(const ModelConfig& c) {
    std::size_t at = 0;
    auto next = [&at](const char* name, std::size_t layers, std::size_t rows, std::size_t cols) {
      TensorInfo t{name, at, layers, rows, cols};
      at = t.end();
      return t;
    };
    const std::size_t L = c.num_layers, d = c.dim, kv = c.kv_dim(), h = c.hidden_dim;
    token_embedding = next("token_embedding", 1, c.vocab_size, d);
    rms_att = next("rms_att", L, 1, d);
    wq = next("wq", L, d, d);
    wk = next("wk", L, kv, d);
    wv = next("wv", L, kv, d);
    wo = next("wo", L, d, d);
    rms_ffn = next("rms_ffn", L, 1, d);
    w1 = next("w1", L, h, d);
    w2 = next("w2", L, d, h);
    w3 = next("w3", L, h, d);
    rms_final = next("rms_final", 1, 1, d);
    freq_real = next("freq_cis_real", 1, c.seq_len, c.head_dim() / 2);
    freq_imag = next("freq_cis_imag", 1, c.seq_len, c.head_dim() / 2);
    wcls = c.shared_classifier ? TensorInfo{"wcls", at, 1, 0, 0} : next("wcls", 1, c.vocab_size, d);
    total_floats = at;
  }

  /// Every tensor, in file order (wcls last, empty when shared).
  [[nodiscard]] std::vector<const TensorInfo*> tensors() const {
    return {&token_embedding, &rms_att,   &wq,        &wk,  &wv, &wo, &rms_ffn, &w1, &w2, &w3,
            &rms_final,       &freq_real, &freq_imag, &wcls};
  }
  /// Bytes of a file with this layout: header plus 4 bytes per float.
  [[nodiscard]] std::size_t file_bytes() const noexcept {
    return kHeaderBytes + total_floats * sizeof(float);
  }
  /// "tensor wq layer 2" for the float at payload index i ("" past the end).
  [[nodiscard]] std::string describe(std::size_t i) const {
    for (const TensorInfo* t : tensors()) {
      if (i >= t->offset && i < t->end()) {
        std::string s = std::string("tensor ") + t->name;
        if (t->layers > 1) s += " layer " + std::to_string((i - t->offset) / t->per_layer());
        return s;
      }
    }
    return {};
  }
};

/// A model as stored: its configuration and the llama2.c payload (every float after the header,
/// in file order, see Llama2cLayout).
struct Checkpoint {
  ModelConfig config;
  std::vector<float> data;
};

namespace detail {

inline std::int32_t read_i32_le(const unsigned char* p) noexcept {
  std::uint32_t u = 0;
  for (int i = 3; i >= 0; --i) u = (u << 8) | p[i];
  return static_cast<std::int32_t>(u);
}

inline float read_f32_le(const unsigned char* p) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(read_i32_le(p)));
}

inline void write_i32_le(std::vector<unsigned char>& out, std::int32_t v) {
  const auto u = static_cast<std::uint32_t>(v);
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<unsigned char>(u >> (8 * i)));
}

/// The 28-byte header parsed and validated. @throws kvcache::format_error naming the field, its
/// value and its byte offset.
inline ModelConfig parse_header(const unsigned char* h, std::string_view name) {
  using kvcache::detail::message;
  std::int32_t f[7];
  for (int i = 0; i < 7; ++i) f[i] = read_i32_le(h + 4 * i);
  static constexpr const char* kFields[7] = {"dim",        "hidden_dim", "n_layers", "n_heads",
                                             "n_kv_heads", "vocab_size", "seq_len"};
  if (static_cast<std::uint32_t>(f[0]) == 0x616b3432u) {
    throw kvcache::format_error(
        message(std::string(name),
                ": starts with magic 0x616b3432 (a llama2.c version 1+ export); only "
                "the legacy version-0 format (7 int32 header fields) is supported"));
  }
  for (int i = 0; i < 7; ++i) {
    if (f[i] <= 0 && i != 5) {
      throw kvcache::format_error(message(std::string(name), ": header field ", kFields[i],
                                          " (byte offset ", 4 * i, ") is ", f[i],
                                          "; must be positive"));
    }
  }
  if (f[5] == 0 || f[5] == std::numeric_limits<std::int32_t>::min()) {
    throw kvcache::format_error(message(std::string(name),
                                        ": header field vocab_size (byte offset 20) is ", f[5],
                                        "; must be nonzero (negative = separate classifier)"));
  }
  ModelConfig c{.dim = static_cast<std::size_t>(f[0]),
                .hidden_dim = static_cast<std::size_t>(f[1]),
                .num_layers = static_cast<std::size_t>(f[2]),
                .num_heads = static_cast<std::size_t>(f[3]),
                .num_kv_heads = static_cast<std::size_t>(f[4]),
                .vocab_size = static_cast<std::size_t>(f[5] < 0 ? -f[5] : f[5]),
                .seq_len = static_cast<std::size_t>(f[6]),
                .shared_classifier = f[5] > 0};
  if (const auto p = check_config(c)) {
    throw kvcache::format_error(message(std::string(name), ": header field ", p->field,
                                        " (byte offset ", 4 * p->index, ") ", p->reason));
  }
  return c;
}

inline std::string describe_header(const ModelConfig& c) {
  return kvcache::detail::message(
      "dim ", c.dim, ", hidden_dim ", c.hidden_dim, ", n_layers ", c.num_layers, ", n_heads ",
      c.num_heads, ", n_kv_heads ", c.num_kv_heads, ", vocab_size ", c.vocab_size,
      c.shared_classifier ? " (shared classifier)" : " (separate)", ", seq_len ", c.seq_len);
}

/// @throws kvcache::format_error unless a file of `size` bytes is exactly what `layout` needs.
inline void check_file_size(std::size_t size, const ModelConfig& c, const Llama2cLayout& layout,
                            std::string_view name) {
  using kvcache::detail::message;
  const std::size_t want = layout.file_bytes();
  if (size < want) {
    const std::size_t at = (size - Llama2cLayout::kHeaderBytes) / sizeof(float);
    throw kvcache::format_error(message(std::string(name), ": truncated: ", size,
                                        " bytes, but its header (", describe_header(c), ") needs ",
                                        want, "; the file ends at byte offset ", size, " inside ",
                                        layout.describe(at)));
  }
  if (size > want) {
    throw kvcache::format_error(message(std::string(name), ": wrong size: ", size,
                                        " bytes, but its header (", describe_header(c),
                                        ") needs exactly ", want, " (", size - want,
                                        " unexpected bytes after byte offset ", want, ")"));
  }
}

/// @throws kvcache::format_error naming the first non-finite weight (tensor, byte offset).
inline void check_finite(std::span<const float> data, const Llama2cLayout& layout,
                         std::string_view name) {
  for (std::size_t i = 0; i < data.size(); ++i) {
    if (!std::isfinite(data[i])) {
      throw kvcache::format_error(
          kvcache::detail::message(std::string(name), ": weight at byte offset ",
                                   Llama2cLayout::kHeaderBytes + i * sizeof(float), " (",
                                   layout.describe(i), ") is ", data[i]));
    }
  }
}

}  // namespace detail

/// Parses and validates a llama2.c legacy checkpoint held in memory; `name` prefixes errors.
/// @throws kvcache::format_error (short header, version-1 magic, a header field out of range,
///         wrong or truncated size, non-finite weights), naming the field and the numbers.
[[nodiscard]] inline Checkpoint parse_llama2c(std::span<const unsigned char> bytes,
                                              std::string_view name = "checkpoint") {
  if (bytes.size() < Llama2cLayout::kHeaderBytes) {
    throw kvcache::format_error(kvcache::detail::message(std::string(name),
                                                         ": truncated: ", bytes.size(),
                                                         " bytes, shorter than the 28-byte "
                                                         "header (7 int32 fields)"));
  }
  Checkpoint ckpt{detail::parse_header(bytes.data(), name), {}};
  const Llama2cLayout layout(ckpt.config);
  detail::check_file_size(bytes.size(), ckpt.config, layout, name);
  ckpt.data.resize(layout.total_floats);
  const unsigned char* p = bytes.data() + Llama2cLayout::kHeaderBytes;
  for (std::size_t i = 0; i < ckpt.data.size(); ++i) ckpt.data[i] = detail::read_f32_le(p + 4 * i);
  detail::check_finite(ckpt.data, layout, name);
  return ckpt;
}

/// Loads a llama2.c legacy checkpoint file. The header is read and validated, and the file size
/// checked against it, before the payload is allocated.
/// @throws kvcache::format_error as parse_llama2c, or when the file cannot be read.
[[nodiscard]] inline Checkpoint load_llama2c(const std::filesystem::path& path) {
  using kvcache::detail::message;
  const std::string name = path.string();
  std::ifstream in(path, std::ios::binary);
  const int open_errno = in ? 0 : errno;
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  if (!in || ec) {
    throw kvcache::format_error(message(
        name, ": cannot open the checkpoint: ", ec ? ec.message() : std::strerror(open_errno)));
  }
  unsigned char header[Llama2cLayout::kHeaderBytes];
  if (size < sizeof header || !in.read(reinterpret_cast<char*>(header), sizeof header)) {
    throw kvcache::format_error(message(name, ": truncated: ", static_cast<std::size_t>(size),
                                        " bytes, shorter than the 28-byte header (7 int32 "
                                        "fields)"));
  }
  const ModelConfig config = detail::parse_header(header, name);
  const Llama2cLayout layout(config);
  detail::check_file_size(static_cast<std::size_t>(size), config, layout, name);
  Checkpoint ckpt{config, std::vector<float>(layout.total_floats)};
  std::vector<unsigned char> buf(std::size_t{1} << 20);
  for (std::size_t done = 0; done < ckpt.data.size();) {
    const std::size_t n = std::min(buf.size() / 4, ckpt.data.size() - done);
    if (!in.read(reinterpret_cast<char*>(buf.data()), static_cast<std::streamsize>(4 * n))) {
      throw kvcache::format_error(
          message(name, ": read failed at byte offset ", Llama2cLayout::kHeaderBytes + 4 * done));
    }
    for (std::size_t i = 0; i < n; ++i) ckpt.data[done + i] = detail::read_f32_le(&buf[4 * i]);
    done += n;
  }
  detail::check_finite(ckpt.data, layout, name);
  return ckpt;
}

/// The llama2.c legacy file image of a checkpoint (header, then little-endian floats).
/// @throws kvcache::shape_error when the config is invalid or data has the wrong size.
[[nodiscard]] inline std::vector<unsigned char> serialize_llama2c(const Checkpoint& ckpt) {
  const ModelConfig& c = ckpt.config;
  if (const auto p = check_config(c)) {
    throw kvcache::shape_error(std::string("serialize_llama2c: ") + p->field + " " + p->reason);
  }
  const Llama2cLayout layout(c);
  if (ckpt.data.size() != layout.total_floats) {
    throw kvcache::shape_error(kvcache::detail::message(
        "serialize_llama2c: ", ckpt.data.size(), " floats, layout needs ", layout.total_floats));
  }
  std::vector<unsigned char> out;
  out.reserve(layout.file_bytes());
  const auto vocab = static_cast<std::int32_t>(c.vocab_size);
  for (std::size_t v : {c.dim, c.hidden_dim, c.num_layers, c.num_heads, c.num_kv_heads}) {
    detail::write_i32_le(out, static_cast<std::int32_t>(v));
  }
  detail::write_i32_le(out, c.shared_classifier ? vocab : -vocab);
  detail::write_i32_le(out, static_cast<std::int32_t>(c.seq_len));
  for (float f : ckpt.data) detail::write_i32_le(out, std::bit_cast<std::int32_t>(f));
  return out;
}

// ---------------------------------------------------------------------------------------------
// Synthetic models

/// Parses a synthetic model spec: dash-separated items `<n>L` layers, `<n>d` dim, `<n>h` heads
/// (all three required), `<n>kv` KV heads (default: heads), `<n>ff` hidden_dim (default: Llama's
/// 8/3 * dim rounded up to a multiple of 256, or of 32 below dim 512), `<n>v` vocab (default
/// 512, the size of the stories260K tokenizer), `<n>ctx` seq_len (default 2048), and `tied` for
/// a classifier shared with the embedding (default: separate). Example: "8L-1024d-16h-4kv".
/// @throws usage_error naming the item, or the field check_config rejects.
[[nodiscard]] inline ModelConfig parse_synthetic_spec(std::string_view spec) {
  using kvcache::detail::message;
  ModelConfig c{.vocab_size = 512, .seq_len = 2048, .shared_classifier = false};
  bool kv_given = false, ff_given = false;
  std::size_t start = 0;
  while (start <= spec.size()) {
    const std::size_t dash = std::min(spec.find('-', start), spec.size());
    const std::string_view item = spec.substr(start, dash - start);
    start = dash + 1;
    if (item == "tied") {
      c.shared_classifier = true;
      continue;
    }
    std::size_t digits = 0, value = 0;
    while (digits < item.size() && item[digits] >= '0' && item[digits] <= '9' && digits < 9) {
      value = value * 10 + static_cast<std::size_t>(item[digits] - '0');
      ++digits;
    }
    const std::string_view unit = item.substr(digits);
    if (digits == 0 || (unit != "L" && unit != "l" && unit != "d" && unit != "h" && unit != "kv" &&
                        unit != "ff" && unit != "v" && unit != "ctx")) {
      throw usage_error(message("synthetic spec \"", std::string(spec), "\": item \"",
                                std::string(item),
                                "\" is not <n>L, <n>d, <n>h, <n>kv, <n>ff, <n>v, <n>ctx or tied"));
    }
    if (unit == "L" || unit == "l") c.num_layers = value;
    if (unit == "d") c.dim = value;
    if (unit == "h") c.num_heads = value;
    if (unit == "kv") c.num_kv_heads = value, kv_given = true;
    if (unit == "ff") c.hidden_dim = value, ff_given = true;
    if (unit == "v") c.vocab_size = value;
    if (unit == "ctx") c.seq_len = value;
  }
  if (c.num_layers == 0 || c.dim == 0 || c.num_heads == 0) {
    throw usage_error(message("synthetic spec \"", std::string(spec),
                              "\" needs <n>L, <n>d and <n>h (e.g. 8L-1024d-16h-4kv)"));
  }
  if (!kv_given) c.num_kv_heads = c.num_heads;
  if (!ff_given) {
    const std::size_t multiple = c.dim >= 512 ? 256 : 32;
    c.hidden_dim = (8 * c.dim / 3 + multiple - 1) / multiple * multiple;
  }
  if (const auto p = check_config(c)) {
    throw usage_error(
        message("synthetic spec \"", std::string(spec), "\": ", p->field, " ", p->reason));
  }
  return c;
}

/// The spec string parse_synthetic_spec() reads back as `c`.
[[nodiscard]] inline std::string synthetic_spec(const ModelConfig& c) {
  return kvcache::detail::message(c.num_layers, "L-", c.dim, "d-", c.num_heads, "h-",
                                  c.num_kv_heads, "kv-", c.hidden_dim, "ff-", c.vocab_size, "v-",
                                  c.seq_len, "ctx", c.shared_classifier ? "-tied" : "");
}

/// The synthetic weight at payload index i of `t`: a hash of (seed, i) mapped to a uniform value
/// with the tensor's scale (norm weights 1 +- 0.1, embedding variance 1, matrices variance
/// 1 / fan_in, so activations stay O(1) through the layers). Pure: the same on every machine.
[[nodiscard]] inline float synthetic_weight(const TensorInfo& t, std::size_t i,
                                            std::uint64_t seed) noexcept {
  std::uint64_t z = seed + 0x9E3779B97F4A7C15ull * (i + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  const float u = static_cast<float>(z >> 40) * (1.0f / 8388608.0f) - 1.0f;  // [-1, 1)
  const std::string_view name = t.name;
  if (name.starts_with("rms_")) return 1.0f + 0.1f * u;
  if (name == "freq_cis_real" || name == "freq_cis_imag") return 0.0f;  // unused by the engine
  const float std_dev =
      name == "token_embedding" ? 1.0f : 1.0f / std::sqrt(static_cast<float>(t.cols));
  return u * 1.7320508f * std_dev;  // uniform [-a, a) has variance a^2 / 3
}

/// A synthetic checkpoint held in memory (for tests and for writing small files).
[[nodiscard]] inline Checkpoint synthetic_checkpoint(const ModelConfig& c, std::uint64_t seed) {
  if (const auto p = check_config(c)) {
    throw usage_error(std::string("synthetic_checkpoint: ") + p->field + " " + p->reason);
  }
  const Llama2cLayout layout(c);
  Checkpoint ckpt{c, std::vector<float>(layout.total_floats)};
  for (const TensorInfo* t : layout.tensors()) {
    for (std::size_t i = t->offset; i < t->end(); ++i) {
      ckpt.data[i] = synthetic_weight(*t, i, seed);
    }
  }
  return ckpt;
}

// ---------------------------------------------------------------------------------------------
// The packed model

/// Where a model's weights come from: the value of payload index i, which lies in tensor t.
using WeightSource = std::function<float(const TensorInfo& t, std::size_t i)>;

/// A model ready to run: matrices packed for matmul() (wq/wk/wv fused into one [dim + 2 kv_dim]
/// x [dim] matrix, w1/w3 into one [2 hidden] x [dim]), norm weights as plain vectors. The token
/// embedding is kept only in packed form; a shared classifier reuses it. Move-only.
class Model {
 public:
  struct Layer {
    std::vector<float> rms_att, rms_ffn;  ///< [dim] each
    PackedMatrix wqkv;                    ///< rows: q [dim], k [kv_dim], v [kv_dim]
    PackedMatrix wo;                      ///< [dim][dim]
    PackedMatrix w13;                     ///< rows: w1 [hidden], w3 [hidden]
    PackedMatrix w2;                      ///< [dim][hidden]
  };

  /// Packs the weights of `config` read from `source`, in parallel on `pool` if given.
  /// @throws usage_error when check_config rejects `config`; std::bad_alloc.
  Model(const ModelConfig& config, const WeightSource& source, kvcache::ThreadPool* pool = nullptr)
      : config_(config) {
    if (const auto p = check_config(config)) {
      throw usage_error(std::string("Model: ") + p->field + " " + p->reason);
    }
    const Llama2cLayout lay(config);
    const std::size_t d = config.dim, kv = config.kv_dim(), h = config.hidden_dim;
    auto matrix = [&](const TensorInfo& t, std::size_t layer) {
      const std::size_t base = t.offset + layer * t.per_layer();
      return PackedMatrix(
          t.rows, t.cols,
          [&, base](std::size_t r, std::size_t c) { return source(t, base + r * t.cols + c); },
          pool);
    };
    auto vec = [&](const TensorInfo& t, std::size_t layer) {
      std::vector<float> v(t.cols);
      for (std::size_t i = 0; i < v.size(); ++i) {
        v[i] = source(t, t.offset + layer * t.per_layer() + i);
      }
      return v;
    };
    embedding_ = matrix(lay.token_embedding, 0);
    layers_.reserve(config.num_layers);
    for (std::size_t l = 0; l < config.num_layers; ++l) {
      Layer layer;
      layer.rms_att = vec(lay.rms_att, l);
      layer.rms_ffn = vec(lay.rms_ffn, l);
      auto at = [&](const TensorInfo& t, std::size_t r, std::size_t c) {
        return source(t, t.offset + l * t.per_layer() + r * t.cols + c);
      };
      layer.wqkv = PackedMatrix(
          d + 2 * kv, d,
          [&](std::size_t r, std::size_t c) {
            if (r < d) return at(lay.wq, r, c);
            if (r < d + kv) return at(lay.wk, r - d, c);
            return at(lay.wv, r - d - kv, c);
          },
          pool);
      layer.wo = matrix(lay.wo, l);
      layer.w13 = PackedMatrix(
          2 * h, d,
          [&](std::size_t r, std::size_t c) {
            return r < h ? at(lay.w1, r, c) : at(lay.w3, r - h, c);
          },
          pool);
      layer.w2 = matrix(lay.w2, l);
      layers_.push_back(std::move(layer));
    }
    rms_final_ = vec(lay.rms_final, 0);
    if (!config.shared_classifier) classifier_ = matrix(lay.wcls, 0);
  }

  /// The model of a checkpoint. @throws usage_error if the checkpoint's data has the wrong size.
  [[nodiscard]] static Model from_checkpoint(const Checkpoint& ckpt,
                                             kvcache::ThreadPool* pool = nullptr) {
    if (const auto p = check_config(ckpt.config)) {
      throw usage_error(std::string("Model: ") + p->field + " " + p->reason);
    }
    const Llama2cLayout layout(ckpt.config);
    if (ckpt.data.size() != layout.total_floats) {
      throw usage_error(kvcache::detail::message("Model: checkpoint holds ", ckpt.data.size(),
                                                 " floats, its config needs ",
                                                 layout.total_floats));
    }
    return Model(
        ckpt.config, [&](const TensorInfo&, std::size_t i) { return ckpt.data[i]; }, pool);
  }

  /// A synthetic model (see synthetic_weight), identical to
  /// from_checkpoint(synthetic_checkpoint(config, seed)) without materialising the checkpoint.
  [[nodiscard]] static Model synthetic(const ModelConfig& config, std::uint64_t seed,
                                       kvcache::ThreadPool* pool = nullptr) {
    return Model(
        config, [seed](const TensorInfo& t, std::size_t i) { return synthetic_weight(t, i, seed); },
        pool);
  }

  [[nodiscard]] const ModelConfig& config() const noexcept { return config_; }
  [[nodiscard]] const std::vector<Layer>& layers() const noexcept { return layers_; }
  [[nodiscard]] std::span<const float> rms_final() const noexcept { return rms_final_; }
  /// The classifier [vocab][dim]: the embedding itself when shared.
  [[nodiscard]] const PackedMatrix& classifier() const noexcept {
    return classifier_ ? *classifier_ : embedding_;
  }

  /// Writes the embedding row of `token` (dim floats) to `out`. @pre token < vocab_size.
  void embed(token_id token, float* out) const noexcept {
    const auto t = static_cast<std::size_t>(token);
    const float* panel = embedding_.panel(t / kPanelCols) + t % kPanelCols;
    for (std::size_t k = 0; k < config_.dim; ++k) out[k] = panel[k * kPanelCols];
  }

  /// Bytes of packed weights held.
  [[nodiscard]] std::size_t weight_bytes() const noexcept {
    std::size_t b = embedding_.bytes() + (classifier_ ? classifier_->bytes() : 0);
    for (const Layer& l : layers_) {
      b += l.wqkv.bytes() + l.wo.bytes() + l.w13.bytes() + l.w2.bytes();
      b += (l.rms_att.size() + l.rms_ffn.size()) * sizeof(float);
    }
    return b;
  }

  /// The K/V shape a cache for this model needs (f32 elements by default; V in value_dtype).
  [[nodiscard]] kvcache::CacheShape cache_shape(kvcache::DType dtype = kvcache::DType::f32) const {
    return cache_shape(dtype, dtype);
  }
  [[nodiscard]] kvcache::CacheShape cache_shape(kvcache::DType dtype,
                                                kvcache::DType value_dtype) const {
    return {config_.num_layers, config_.num_kv_heads, config_.head_dim(), dtype, value_dtype};
  }

 private:
  ModelConfig config_;
  PackedMatrix embedding_;
  std::optional<PackedMatrix> classifier_;
  std::vector<Layer> layers_;
  std::vector<float> rms_final_;
};

}  // namespace llama
