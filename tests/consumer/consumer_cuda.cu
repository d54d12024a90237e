// SPDX-License-Identifier: Apache-2.0
// A CUDA engine's translation unit (tests/consumer/cuda): the CPU API, snapshots and the CUDA
// backend in one .cu, with a device cache instantiated and appended to. Compiled by nvcc with
// -Werror=all-warnings and none of kvcache's own flags; never run.
#include <cstddef>
#include <kvcache/cuda/cuda.cuh>
#include <kvcache/io/snapshot.hpp>
#include <kvcache/kvcache.hpp>
#include <vector>

namespace kc = kvcache::cuda;

/// k, v: device [2][2][128] floats, one new token for each of two sequences.
void append_one_token(const float* k, const float* v, cudaStream_t stream) {
  kc::DeviceCache<kvcache::half> cache({.layout = kc::Layout::paged,
                                        .num_layers = 1,
                                        .num_kv_heads = 2,
                                        .head_dim = 128,
                                        .max_batch = 2,
                                        .max_seq_len = 64,
                                        .block_size = 16,
                                        .num_blocks = 8});
  const std::vector<std::size_t> seqs{0, 1}, ones(2, 1);
  cache.append(0, seqs, ones, k, v, stream);
}

int main() { return 0; }
