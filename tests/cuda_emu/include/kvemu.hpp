// SPDX-License-Identifier: Apache-2.0
// kvemu: runs kvcache's CUDA kernels on the CPU, so that CI checks their logic where no GPU is.
// Each block's threads are fibers that switch only at barriers (__syncthreads, __syncwarp, warp
// shuffles); blocks run one after another. Dynamic shared memory is poisoned with NaNs per block,
// device memory per allocation; cp.async copies land at random either early (at commit) or as
// late as the wait allows; wmma products and stores come from the warp's last lane (mma.h).
// Launch limits and the shared-memory opt-in are checked as CUDA does. What this cannot check:
// timing, real concurrency, the GPU memory model, wmma fragment layouts (warp_mma.cuh's ldmatrix
// and mma.sync are emulated with the layouts the PTX ISA documents).
#pragma once

#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <new>
#include <random>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "support/sanitizers.hpp"  // KVCACHE_TEST_ASAN, KVCACHE_TEST_TSAN

// ---- the CUDA dialect, as host C++ -------------------------------------------------------------
#define __global__ inline
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__
#define __align__(n) __attribute__((aligned(n)))

struct uint3 {
  unsigned x = 0, y = 0, z = 0;
};
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) noexcept
      : x(x_), y(y_), z(z_) {}
};
struct alignas(8) float2 {
  float x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
inline float2 make_float2(float x, float y) { return {x, y}; }

enum cudaError {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorNoDevice = 100,
};
using cudaError_t = cudaError;
enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };
struct CUstream_st;
using cudaStream_t = CUstream_st*;

#if KVCACHE_TEST_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

#if defined(__x86_64__) && !KVCACHE_TEST_TSAN
#define KVEMU_FAST_SWITCH 1
// kvemu_switch_stack(save, to): pushes the callee-saved registers, stores the stack pointer in
// *save, switches to `to` and pops that context's registers. Weak: one copy per program.
asm(R"(
  .text
  .weak kvemu_switch_stack
  .type kvemu_switch_stack, @function
kvemu_switch_stack:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size kvemu_switch_stack, .-kvemu_switch_stack
)");
extern "C" void kvemu_switch_stack(std::uintptr_t** save, std::uintptr_t* to);
#else
#define KVEMU_FAST_SWITCH 0
#endif

namespace kvemu {

/// The emulated device: an H100/H200 (132 SMs, 227 KiB of opt-in shared memory per block).
inline constexpr int kNumSms = 132;
inline constexpr std::size_t kSharedBytes = 227 * 1024;
inline constexpr std::size_t kDefaultSharedBytes = 48 * 1024;
inline constexpr std::size_t kSmBytes = 228 * 1024;
inline constexpr std::size_t kCanaryBytes = 4096;  // checked after each block: overflow writes
inline constexpr std::size_t kStackBytes = 256 * 1024;
inline constexpr unsigned char kPoison = 0xff;  // NaN as float, half and bfloat16
inline constexpr unsigned char kCanary = 0xa5;

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "kvemu: %s\n", what);
  std::fflush(stderr);
  std::abort();
}

struct Barrier {
  unsigned expected = 0;
  unsigned arrived = 0;
  std::uint64_t generation = 0;
};

struct Copy {
  void* dst;
  const void* src;
  std::size_t bytes;  // copied from src; the rest of `size` is zero-filled
  std::size_t size;
};

inline void land(const Copy& c) {
  if (c.bytes != 0) std::memcpy(c.dst, c.src, c.bytes);
  std::memset(static_cast<char*>(c.dst) + c.bytes, 0, c.size - c.bytes);
}

/// A fiber's stack: mmap'd, its lowest page a guard, so that an overflow faults instead of
/// overwriting another fiber's stack.
class Stack {
 public:
  static constexpr std::size_t kGuardBytes = 4096;
  Stack() {
    void* p = mmap(nullptr, kStackBytes + kGuardBytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) fail("mmap of a fiber stack failed");
    base_ = static_cast<char*>(p);
    if (mprotect(base_, kGuardBytes, PROT_NONE) != 0) fail("mprotect of a stack guard failed");
  }
  Stack(const Stack&) = delete;
  Stack& operator=(const Stack&) = delete;
  ~Stack() { munmap(base_, kStackBytes + kGuardBytes); }
  [[nodiscard]] char* bottom() const noexcept { return base_ + kGuardBytes; }
  [[nodiscard]] char* top() const noexcept { return bottom() + kStackBytes; }

 private:
  char* base_ = nullptr;
};

/// Where a fiber (or the scheduler) resumes. On x86-64 a saved stack pointer and a switch that
/// saves only the callee-saved registers (glibc's swapcontext also makes a sigprocmask system
/// call per switch: ten times slower); elsewhere, and under ThreadSanitizer, ucontext. Under
/// AddressSanitizer every switch is announced to it (__sanitizer_start_switch_fiber).
struct Context {
#if KVEMU_FAST_SWITCH
  std::uintptr_t* sp = nullptr;
#else
  ucontext_t uc{};
#endif
  const void* stack_bottom = nullptr;  // for AddressSanitizer
  std::size_t stack_size = 0;
};

inline void switch_context(Context& from, Context& to, bool from_finished = false) {
#if KVCACHE_TEST_ASAN
  void* fake_stack = nullptr;
  __sanitizer_start_switch_fiber(from_finished ? nullptr : &fake_stack, to.stack_bottom,
                                 to.stack_size);
#else
  (void)from_finished;
#endif
#if KVEMU_FAST_SWITCH
  kvemu_switch_stack(&from.sp, to.sp);
#else
  swapcontext(&from.uc, &to.uc);
#endif
#if KVCACHE_TEST_ASAN
  __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#endif
}

struct Fiber {
  Context context;
  std::unique_ptr<Stack> stack;
  uint3 thread_idx{};
  unsigned linear = 0;
  bool done = false;
  Barrier* waiting = nullptr;
  std::uint64_t wait_generation = 0;
  std::vector<Copy> pending;                 // cp.async copies not yet committed
  std::vector<std::vector<Copy>> in_flight;  // committed groups, oldest first
};

/// The block being run (one at a time) and its threads.
struct Block {
  dim3 grid, block;
  uint3 block_idx{};
  std::vector<Fiber> fibers;  // [num_threads] in use; more kept from wider launches
  unsigned num_threads = 0;
  unsigned current = 0;
  Barrier block_barrier;
  std::vector<Barrier> warp_barriers;
  std::vector<std::array<std::uint64_t, 32>> exchange;  // shuffle values per warp
  std::vector<std::vector<unsigned char>> gathered;     // warp_gather values per warp
  Context scheduler;
  std::function<void()> body;
};

// Emulator state: one kernel runs at a time, as on a single stream.
inline Block* g_block = nullptr;
inline cudaError_t g_last_error = cudaSuccess;
inline std::mt19937_64 g_rng{20261203};
inline std::map<void (*)(), std::size_t> g_smem_limit;  // opted-in dynamic shared memory

/// The one block the emulator runs at a time (its fibers' stacks are allocated once).
inline Block& block_storage() {
  static Block b;
  return b;
}

inline Block& block() {
  if (g_block == nullptr) fail("device code called outside a kernel launch");
  return *g_block;
}
inline Fiber& fiber() { return block().fibers[block().current]; }

/// Arrives at `bar`; the last arrival releases the others, every other one switches out.
inline void wait(Barrier& bar) {
  Block& b = block();
  if (++bar.arrived == bar.expected) {
    bar.arrived = 0;
    ++bar.generation;
    return;
  }
  Fiber& f = b.fibers[b.current];
  f.waiting = &bar;
  f.wait_generation = bar.generation;
  switch_context(f.context, b.scheduler);
}

inline unsigned warp_of(const Fiber& f) { return f.linear / 32; }
inline unsigned lane_of(const Fiber& f) { return f.linear % 32; }

/// A thread's life: the kernel, its outstanding cp.async copies, back to the scheduler.
[[noreturn]] inline void fiber_main() {
  Block& b = block();
#if KVCACHE_TEST_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &b.scheduler.stack_bottom, &b.scheduler.stack_size);
#endif
  b.body();
  Fiber& f = b.fibers[b.current];
  for (const auto& group : f.in_flight)
    for (const Copy& c : group) land(c);
  for (const Copy& c : f.pending) land(c);
  f.in_flight.clear();
  f.pending.clear();
  f.done = true;
  switch_context(f.context, b.scheduler, /*from_finished=*/true);
  fail("a finished thread was resumed");
}

/// Makes `f` start at fiber_main on its own stack. Apart from the launch loop because
/// getcontext returns twice (as setjmp does).
[[gnu::noinline]] inline void start_fiber(Fiber& f) {
  f.done = false;
  f.waiting = nullptr;
  f.context.stack_bottom = f.stack->bottom();
  f.context.stack_size = kStackBytes;
#if KVEMU_FAST_SWITCH
  // kvemu_switch_stack pops six registers and returns into fiber_main, which then finds the
  // stack as a call leaves it (16-byte aligned + 8, a return address that is never used).
  auto* sp = reinterpret_cast<std::uintptr_t*>(f.stack->top());
  *--sp = 0;
  *--sp = reinterpret_cast<std::uintptr_t>(&fiber_main);
  for (int r = 0; r < 6; ++r) *--sp = 0;
  f.context.sp = sp;
#else
  getcontext(&f.context.uc);
  f.context.uc.uc_stack.ss_sp = f.stack->bottom();
  f.context.uc.uc_stack.ss_size = kStackBytes;
  f.context.uc.uc_link = nullptr;
  makecontext(&f.context.uc, fiber_main, 0);
#endif
}

/// Runs every thread of the current block to completion; aborts on a deadlock (a barrier that
/// some threads never reach).
inline void run_block(Block& b) {
  for (;;) {
    bool progress = false, all_done = true;
    for (unsigned i = 0; i < b.num_threads; ++i) {
      Fiber& f = b.fibers[i];
      if (f.done) continue;
      all_done = false;
      if (f.waiting != nullptr && f.waiting->generation == f.wait_generation) continue;
      f.waiting = nullptr;
      b.current = i;
      switch_context(b.scheduler, f.context);
      progress = true;
    }
    if (all_done) return;
    if (!progress) fail("deadlock: some threads of a block wait at a barrier others never reach");
  }
}

struct LaunchConfig {
  dim3 grid, block;
  std::size_t shared_bytes = 0;
};

template <class... A>
struct PendingLaunch {
  LaunchConfig config;
  std::tuple<A...> args;
};

/// `kernel<<<grid, block, smem, stream>>>(args)` reads, after the test build's rewrite,
/// `kernel % ::kvemu::Launch(grid, block, smem, stream)(args)`.
struct Launch {
  LaunchConfig config;
  Launch(dim3 grid, dim3 block, std::size_t shared_bytes = 0, cudaStream_t = nullptr)
      : config{grid, block, shared_bytes} {}
  template <class... A>
  PendingLaunch<std::decay_t<A>...> operator()(A&&... args) const {
    return {config, std::tuple<std::decay_t<A>...>(std::forward<A>(args)...)};
  }
};

inline std::size_t smem_limit(void (*kernel)()) {
  const auto it = g_smem_limit.find(kernel);
  return it == g_smem_limit.end() ? kDefaultSharedBytes : it->second;
}

}  // namespace kvemu

namespace kvcache::cuda::detail {
/// The dynamic shared memory the kernels declare (extern __shared__ smem[]), plus a canary.
alignas(1024) inline unsigned char smem[kvemu::kSharedBytes + kvemu::kCanaryBytes];
}  // namespace kvcache::cuda::detail

namespace kvemu {

template <class... P, class... A>
void operator%(void (*kernel)(P...), PendingLaunch<A...>&& launch) {
  const LaunchConfig& c = launch.config;
  const unsigned threads = c.block.x * c.block.y * c.block.z;
  if (threads == 0 || threads > 1024 || c.block.z > 64 || c.grid.x == 0 || c.grid.y == 0 ||
      c.grid.z == 0 || c.grid.y > 65535 || c.grid.z > 65535) {
    g_last_error = cudaErrorInvalidConfiguration;
    return;
  }
  if (c.shared_bytes > smem_limit(reinterpret_cast<void (*)()>(kernel))) {
    g_last_error = cudaErrorInvalidValue;  // what CUDA reports for too much shared memory
    return;
  }
  Block& b = block_storage();
  b.num_threads = threads;
  b.grid = c.grid;
  b.block = c.block;
  if (b.fibers.size() < threads) b.fibers.resize(threads);
  for (Fiber& f : b.fibers) {
    if (!f.stack) f.stack = std::make_unique<Stack>();
  }
  const unsigned num_warps = (threads + 31) / 32;
  b.warp_barriers.assign(num_warps, Barrier{});
  b.exchange.assign(num_warps, {});
  b.gathered.assign(num_warps, {});
  for (unsigned w = 0; w < num_warps; ++w)
    b.warp_barriers[w].expected = std::min(32u, threads - 32 * w);
  b.block_barrier = Barrier{threads};
  b.body = [&] { std::apply([&](auto&... a) { kernel(a...); }, launch.args); };
  unsigned char* const smem = kvcache::cuda::detail::smem;
  g_block = &b;
  for (unsigned z = 0; z < c.grid.z; ++z) {
    for (unsigned y = 0; y < c.grid.y; ++y) {
      for (unsigned x = 0; x < c.grid.x; ++x) {
        b.block_idx = {x, y, z};
        std::memset(smem, kPoison, c.shared_bytes);
        std::memset(smem + c.shared_bytes, kCanary, kCanaryBytes);
        for (unsigned t = 0; t < threads; ++t) {
          Fiber& f = b.fibers[t];
          f.linear = t;
          f.thread_idx = {t % c.block.x, t / c.block.x % c.block.y, t / (c.block.x * c.block.y)};
          start_fiber(f);
        }
        run_block(b);
        for (std::size_t i = 0; i < kCanaryBytes; ++i) {
          if (smem[c.shared_bytes + i] != kCanary) {
            g_block = nullptr;
            fail("a kernel wrote past the dynamic shared memory its launch requested");
          }
        }
      }
    }
  }
  g_block = nullptr;
}

}  // namespace kvemu

// ---- built-in variables and device functions --------------------------------------------------
#define threadIdx (::kvemu::fiber().thread_idx)
#define blockIdx (::kvemu::block().block_idx)
#define blockDim (::kvemu::block().block)
#define gridDim (::kvemu::block().grid)

inline void __syncthreads() { kvemu::wait(kvemu::block().block_barrier); }
inline void __syncwarp(unsigned = 0xffffffffu) {
  kvemu::wait(kvemu::block().warp_barriers[kvemu::warp_of(kvemu::fiber())]);
}

namespace kvemu {
/// Every lane of the calling warp publishes `value`; returns the value lane `source(lane)`
/// published. Full warps only, as kvcache's kernels use them.
template <class T, class Source>
T shuffle(unsigned mask, T value, int width, Source source) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);
  Block& b = block();
  const Fiber& f = fiber();
  const unsigned warp = warp_of(f), lane = lane_of(f);
  if (mask != 0xffffffffu || width != 32 || b.warp_barriers[warp].expected != 32) {
    fail("shuffle: only full-warp shuffles are emulated");
  }
  std::uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  b.exchange[warp][lane] = bits;
  wait(b.warp_barriers[warp]);
  bits = b.exchange[warp][source(lane) % 32];
  wait(b.warp_barriers[warp]);  // everybody has read before the next shuffle writes
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

/// Every lane of the calling warp publishes `value`; returns all 32 lanes' values, by lane (the
/// operands of a warp-wide instruction: ldmatrix's row addresses, mma's fragments).
template <class T>
std::array<T, 32> warp_gather(const T& value) {
  static_assert(std::is_trivially_copyable_v<T>);
  Block& b = block();
  const Fiber& f = fiber();
  const unsigned warp = warp_of(f), lane = lane_of(f);
  if (b.warp_barriers[warp].expected != 32) fail("warp_gather: only full warps are emulated");
  std::vector<unsigned char>& buf = b.gathered[warp];
  if (buf.size() < 32 * sizeof(T)) buf.resize(32 * sizeof(T));
  std::memcpy(buf.data() + lane * sizeof(T), &value, sizeof(T));
  wait(b.warp_barriers[warp]);
  std::array<T, 32> out;
  std::memcpy(out.data(), buf.data(), 32 * sizeof(T));
  wait(b.warp_barriers[warp]);  // everybody has read before the next gather writes
  return out;
}
}  // namespace kvemu

template <class T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
  return kvemu::shuffle(mask, value, width,
                        [&](unsigned lane) { return lane ^ static_cast<unsigned>(lane_mask); });
}
template <class T>
T __shfl_sync(unsigned mask, T value, int src_lane, int width = 32) {
  return kvemu::shuffle(mask, value, width,
                        [&](unsigned) { return static_cast<unsigned>(src_lane); });
}

template <class T>
T min(T a, T b) {
  return b < a ? b : a;
}
template <class T>
T max(T a, T b) {
  return a < b ? b : a;
}
inline float __expf(float x) { return std::exp(x); }
inline float __uint_as_float(unsigned x) { return std::bit_cast<float>(x); }
inline unsigned __float_as_uint(float x) { return std::bit_cast<unsigned>(x); }

// ---- runtime API ------------------------------------------------------------------------------
namespace kvemu {
struct ErrorText {
  const char* name;
  const char* text;
};
/// CUDA's name and message of each error the emulator reports.
inline ErrorText error_text(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return {"cudaSuccess", "no error"};
    case cudaErrorInvalidValue:
      return {"cudaErrorInvalidValue", "invalid argument"};
    case cudaErrorMemoryAllocation:
      return {"cudaErrorMemoryAllocation", "out of memory"};
    case cudaErrorInvalidConfiguration:
      return {"cudaErrorInvalidConfiguration", "invalid configuration argument"};
    case cudaErrorNoDevice:
      return {"cudaErrorNoDevice", "no CUDA-capable device is detected"};
  }
  return {"cudaErrorUnknown", "unknown error"};
}
}  // namespace kvemu
inline const char* cudaGetErrorName(cudaError_t e) { return kvemu::error_text(e).name; }
inline const char* cudaGetErrorString(cudaError_t e) { return kvemu::error_text(e).text; }
inline cudaError_t cudaGetLastError() { return std::exchange(kvemu::g_last_error, cudaSuccess); }
inline cudaError_t cudaGetDeviceCount(int* n) {
  *n = 1;
  return cudaSuccess;
}
inline cudaError_t cudaGetDevice(int* d) {
  *d = 0;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int) {
  if (attr != cudaDevAttrMultiProcessorCount) return cudaErrorInvalidValue;
  *value = kvemu::kNumSms;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaMalloc(void** p, std::size_t bytes) {
  *p = ::operator new (bytes == 0 ? 1 : bytes, std::align_val_t{256}, std::nothrow);
  if (*p == nullptr) return cudaErrorMemoryAllocation;
  std::memset(*p, kvemu::kPoison, bytes);  // cudaMalloc'd memory is not initialised
  return cudaSuccess;
}
inline cudaError_t cudaFree(void* p) {
  ::operator delete (p, std::align_val_t{256});
  return cudaSuccess;
}
inline cudaError_t cudaMemset(void* p, int value, std::size_t bytes) {
  std::memset(p, value, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void* p, int value, std::size_t bytes, cudaStream_t = nullptr) {
  return cudaMemset(p, value, bytes);
}
inline cudaError_t cudaMemcpy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind) {
  if (bytes != 0) std::memmove(dst, src, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t bytes,
                                   cudaMemcpyKind kind, cudaStream_t = nullptr) {
  return cudaMemcpy(dst, src, bytes, kind);
}
template <class R, class... P>
cudaError_t cudaFuncSetAttribute(R (*kernel)(P...), cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 ||
      static_cast<std::size_t>(value) > kvemu::kSharedBytes) {
    return cudaErrorInvalidValue;
  }
  kvemu::g_smem_limit[reinterpret_cast<void (*)()>(kernel)] = static_cast<std::size_t>(value);
  return cudaSuccess;
}
template <class R, class... P>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* n, R (*)(P...), int threads,
                                                          std::size_t shared_bytes) {
  const std::size_t by_smem = kvemu::kSmBytes / (shared_bytes + 1024);
  *n = static_cast<int>(
      std::min<std::size_t>({by_smem, 32, 2048 / static_cast<std::size_t>(threads)}));
  return cudaSuccess;
}
