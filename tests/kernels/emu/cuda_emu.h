// A host emulator for the CUDA features the voltllm SM80 attention kernels use, so that their exact
// source runs on a CPU under pytest (tests/kernels/test_kernels_emulated.py).
//
// Every thread of a block is a fiber (ucontext) on one OS thread; fibers switch only at collective
// operations (__syncthreads, warp shuffles and votes, mma, ldmatrix), which makes a run deterministic
// for a given seed while the seed still varies the order in which threads and blocks run. Blocks run
// one after another in a seeded random order, so "which block finishes last" varies too.
//
// What is checked on the way, beyond the results: a warp collective with an exited lane, a
// __syncthreads deadlock, and reads of cp.async destinations before the matching wait (copies land
// only when a thread waits for them, so early reads see stale data and the results go wrong).
//
// mma.m16n8k16 and ldmatrix follow the fragment layouts of the PTX ISA ("Matrix Fragments for
// mma.m16n8k16 with floating point type", "Warp-level matrix load instruction: ldmatrix").
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cuda_emu_types.h"

#define VOLTLLM_EMULATE 1

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace emu {

constexpr size_t kStackBytes = 256 * 1024;

struct Barrier {
  int arrived = 0;
  unsigned gen = 0;
};

struct CopyGroup {
  std::vector<std::pair<void*, const void*>> copies;  // 16-byte copies: (shared dst, global src)
};

struct Thread {
  ucontext_t ctx;
  std::vector<char> stack;
  dim3 tid;
  int lane = 0;
  int warp = 0;
  bool done = false;
  Barrier* wait_bar = nullptr;
  unsigned wait_gen = 0;
  CopyGroup open;
  std::vector<CopyGroup> groups;
};

struct Warp {
  Barrier bar;
  alignas(16) unsigned char slots[32][128];  // 128: mma_sync at 16 operand elements per lane publishes 96
};

struct Block {
  dim3 bid, bdim, gdim;
  std::vector<Thread> threads;
  std::vector<Warp> warps;
  Barrier cta;
  std::vector<unsigned char> smem;
  const std::function<void()>* body = nullptr;
  ucontext_t sched;
  int cur = -1;
  int alive = 0;
  std::mt19937 rng;
};

inline Block*& current_block() {
  static Block* b = nullptr;
  return b;
}
inline Block& blk() { return *current_block(); }
inline Thread& self() { return blk().threads[blk().cur]; }

[[noreturn]] inline void fail(const std::string& what) {
  std::fprintf(stderr, "cuda_emu: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

inline void yield() { swapcontext(&self().ctx, &blk().sched); }

inline void release_if_complete(Barrier& b, int participants) {
  if (b.arrived > 0 && b.arrived >= participants) {
    b.arrived = 0;
    ++b.gen;
  }
}

inline void arrive_and_wait(Barrier& b, int participants) {
  const unsigned gen = b.gen;
  ++b.arrived;
  release_if_complete(b, participants);
  if (b.gen != gen) return;
  Thread& t = self();
  t.wait_bar = &b;
  t.wait_gen = gen;
  yield();
  t.wait_bar = nullptr;
}

inline void flush_copies(Thread& t, size_t keep) {
  while (t.groups.size() > keep) {
    for (auto& c : t.groups.front().copies) std::memcpy(c.first, c.second, 16);
    t.groups.erase(t.groups.begin());
  }
}

inline void thread_entry() {
  Block& b = blk();
  (*b.body)();
  Thread& t = self();
  t.open.copies.clear();
  flush_copies(t, 0);
  t.done = true;
  --b.alive;
  // Threads that exit count as arrived at __syncthreads (whole exited warps do not block a barrier).
  release_if_complete(b.cta, b.alive);
}

inline void run_block(Block& b) {
  const int n = static_cast<int>(b.threads.size());
  for (int i = 0; i < n; ++i) {
    Thread& t = b.threads[i];
    t.stack.resize(kStackBytes);
    getcontext(&t.ctx);
    t.ctx.uc_stack.ss_sp = t.stack.data();
    t.ctx.uc_stack.ss_size = t.stack.size();
    t.ctx.uc_link = &b.sched;
    makecontext(&t.ctx, thread_entry, 0);
  }
  b.alive = n;
  std::vector<int> order(n);
  for (int i = 0; i < n; ++i) order[i] = i;
  while (b.alive > 0) {
    std::shuffle(order.begin(), order.end(), b.rng);
    bool progress = false;
    for (int i : order) {
      Thread& t = b.threads[i];
      if (t.done || (t.wait_bar != nullptr && t.wait_bar->gen == t.wait_gen)) continue;
      b.cur = i;
      swapcontext(&b.sched, &t.ctx);
      progress = true;
    }
    if (!progress) fail("deadlock: every live thread waits at a barrier that cannot complete");
  }
}

// Runs `body` for every thread of every block of the grid. Blocks run one at a time, in an order
// shuffled by `seed`; `smem_bytes` of dynamic shared memory start filled with garbage (0xA5).
inline void launch(dim3 grid, dim3 block, size_t smem_bytes, const std::function<void()>& body, unsigned seed) {
  std::vector<dim3> blocks;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) blocks.emplace_back(x, y, z);
  std::mt19937 rng(seed);
  std::shuffle(blocks.begin(), blocks.end(), rng);
  const unsigned nthreads = block.x * block.y * block.z;
  if (block.y != 1 || block.z != 1 || nthreads % 32 != 0) fail("only 1-D blocks of whole warps are emulated");
  for (const dim3& id : blocks) {
    Block b;
    b.bid = id;
    b.bdim = block;
    b.gdim = grid;
    b.body = &body;
    b.rng.seed(rng());
    b.smem.assign(smem_bytes + 128, 0xA5);  // room to align the base as a GPU does
    b.threads.resize(nthreads);
    b.warps.resize(nthreads / 32);
    for (unsigned i = 0; i < nthreads; ++i) {
      b.threads[i].tid = dim3(i, 0, 0);
      b.threads[i].lane = static_cast<int>(i % 32);
      b.threads[i].warp = static_cast<int>(i / 32);
    }
    current_block() = &b;
    run_block(b);
    current_block() = nullptr;
  }
}

// The block's dynamic shared memory, 128-byte aligned (WMMA wants 32-byte aligned tiles).
inline unsigned char* dynamic_smem() {
  unsigned char* base = blk().smem.data();
  return base + (128 - reinterpret_cast<uintptr_t>(base) % 128) % 128;
}

// ---------------------------------------------------------------- warp collectives

inline void warp_barrier() {
  Block& b = blk();
  const int w = self().warp;
  for (int l = 0; l < 32; ++l) {
    if (b.threads[w * 32 + l].done) fail("warp collective with an exited lane");
  }
  arrive_and_wait(b.warps[w].bar, 32);
}

// Every lane publishes `mine`; `f(all)` runs on each lane once all 32 have published.
template <typename In, typename F>
auto exchange(const In& mine, F f) {
  static_assert(sizeof(In) <= sizeof(Warp::slots[0]), "payload too large");
  Warp& w = blk().warps[self().warp];
  std::memcpy(w.slots[self().lane], &mine, sizeof(In));
  warp_barrier();
  In all[32];
  for (int l = 0; l < 32; ++l) std::memcpy(&all[l], w.slots[l], sizeof(In));
  auto result = f(all);
  warp_barrier();
  return result;
}

inline void check_full(unsigned mask) {
  if (mask != 0xffffffffu) fail("only full-warp masks are emulated");
}

template <typename V>
V shfl(unsigned mask, V v, int src_lane) {
  check_full(mask);
  return exchange(v, [&](const V* all) { return all[src_lane & 31]; });
}

inline float half_bits_to_float(uint16_t bits, bool bf16) {
  if (bf16) {
    const uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  _Float16 h;
  std::memcpy(&h, &bits, 2);
  return static_cast<float>(h);
}

// D = A(16x16) * B(16x8) + C, fp32 accumulate; `d` holds C on entry.
inline void mma16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], bool bf16) {
  struct In {
    uint32_t a[4], b[2];
  } in;
  std::memcpy(in.a, a, sizeof(in.a));
  std::memcpy(in.b, b, sizeof(in.b));
  float A[16][16], B[16][8];
  exchange(in, [&](const In* all) {
    for (int l = 0; l < 32; ++l) {
      const int g = l / 4, q = l % 4;
      auto lo = [&](uint32_t r) { return half_bits_to_float(static_cast<uint16_t>(r & 0xffffu), bf16); };
      auto hi = [&](uint32_t r) { return half_bits_to_float(static_cast<uint16_t>(r >> 16), bf16); };
      A[g][2 * q] = lo(all[l].a[0]);
      A[g][2 * q + 1] = hi(all[l].a[0]);
      A[g + 8][2 * q] = lo(all[l].a[1]);
      A[g + 8][2 * q + 1] = hi(all[l].a[1]);
      A[g][2 * q + 8] = lo(all[l].a[2]);
      A[g][2 * q + 9] = hi(all[l].a[2]);
      A[g + 8][2 * q + 8] = lo(all[l].a[3]);
      A[g + 8][2 * q + 9] = hi(all[l].a[3]);
      B[2 * q][g] = lo(all[l].b[0]);
      B[2 * q + 1][g] = hi(all[l].b[0]);
      B[2 * q + 8][g] = lo(all[l].b[1]);
      B[2 * q + 9][g] = hi(all[l].b[1]);
    }
    return 0;
  });
  const int lane = self().lane, g = lane / 4, q = lane % 4;
  const int rows[4] = {g, g, g + 8, g + 8};
  const int cols[4] = {2 * q, 2 * q + 1, 2 * q, 2 * q + 1};
  for (int i = 0; i < 4; ++i) {
    float acc = d[i];
    for (int k = 0; k < 16; ++k) acc += A[rows[i]][k] * B[k][cols[i]];
    d[i] = acc;
  }
}

// ldmatrix.sync.aligned.m8n8.x{1,2,4}{.trans}.shared.b16: lanes 8i..8i+7 give the row addresses of
// matrix i; lane L receives (row L/4, cols 2(L%4), 2(L%4)+1) of each matrix (of its transpose with .trans).
template <int N>
inline void ldmatrix(uint32_t (&r)[N], const void* row_addr, bool trans) {
  const uintptr_t mine = reinterpret_cast<uintptr_t>(row_addr);
  if (mine % 16 != 0) fail("ldmatrix row address not 16-byte aligned");
  const int lane = self().lane;
  exchange(mine, [&](const uintptr_t* all) {
    for (int m = 0; m < N; ++m) {
      uint16_t e[2];
      for (int j = 0; j < 2; ++j) {
        const int row = trans ? 2 * (lane % 4) + j : lane / 4;
        const int col = trans ? lane / 4 : 2 * (lane % 4) + j;
        std::memcpy(&e[j], reinterpret_cast<const unsigned char*>(all[8 * m + row]) + 2 * col, 2);
      }
      r[m] = static_cast<uint32_t>(e[0]) | (static_cast<uint32_t>(e[1]) << 16);
    }
    return 0;
  });
}

inline void cp_async16(void* smem_dst, const void* gmem_src) {
  if (reinterpret_cast<uintptr_t>(smem_dst) % 16 || reinterpret_cast<uintptr_t>(gmem_src) % 16) {
    fail("cp.async with a misaligned address");
  }
  self().open.copies.emplace_back(smem_dst, gmem_src);
}
inline void cp_async_commit() {
  Thread& t = self();
  t.groups.push_back(std::move(t.open));
  t.open = CopyGroup{};
}
inline void cp_async_wait(int pending) { flush_copies(self(), static_cast<size_t>(pending)); }

}  // namespace emu

// ---------------------------------------------------------------- CUDA names

#define threadIdx (::emu::self().tid)
#define blockIdx (::emu::blk().bid)
#define blockDim (::emu::blk().bdim)
#define gridDim (::emu::blk().gdim)

inline void __syncthreads() {
  emu::Block& b = emu::blk();
  emu::arrive_and_wait(b.cta, b.alive);
}
// Blocks run one after another, each to its end: every write of an earlier block is already visible.
inline void __threadfence() {}
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  emu::check_full(mask);
  emu::warp_barrier();
}
template <typename V>
V __shfl_sync(unsigned mask, V v, int src) {
  return emu::shfl(mask, v, src);
}
template <typename V>
V __shfl_xor_sync(unsigned mask, V v, int m) {
  return emu::shfl(mask, v, emu::self().lane ^ m);
}
template <typename V>
V __shfl_up_sync(unsigned mask, V v, unsigned d) {
  const int lane = emu::self().lane;
  const V mine = v;
  const V got = emu::shfl(mask, v, lane >= static_cast<int>(d) ? lane - static_cast<int>(d) : lane);
  return lane >= static_cast<int>(d) ? got : mine;
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  emu::check_full(mask);
  const int mine = pred ? 1 : 0;
  return emu::exchange(mine, [](const int* all) {
    unsigned r = 0;
    for (int l = 0; l < 32; ++l) r |= all[l] ? (1u << l) : 0u;
    return r;
  });
}
inline unsigned __match_any_sync(unsigned mask, unsigned v) {
  emu::check_full(mask);
  return emu::exchange(v, [&](const unsigned* all) {
    unsigned r = 0;
    for (int l = 0; l < 32; ++l) r |= all[l] == v ? (1u << l) : 0u;
    return r;
  });
}
inline int __ffs(unsigned v) { return __builtin_ffs(static_cast<int>(v)); }
inline int __all_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) == 0xffffffffu; }
inline int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0u; }
[[noreturn]] inline void __trap() { emu::fail("__trap()"); }

inline float __int_as_float(int v) {
  float f;
  std::memcpy(&f, &v, 4);
  return f;
}
inline int __float_as_int(float v) {
  int i;
  std::memcpy(&i, &v, 4);
  return i;
}
inline float __uint_as_float(unsigned v) {
  float f;
  std::memcpy(&f, &v, 4);
  return f;
}
inline unsigned __float_as_uint(float v) {
  unsigned i;
  std::memcpy(&i, &v, 4);
  return i;
}
// Atomics: fibers switch only at collectives, so a read-modify-write is never interleaved.
template <typename V>
V atomicAdd(V* address, V v) {
  const V old = *address;
  *address = old + v;
  return old;
}
template <typename V>
V atomicExch(V* address, V v) {
  const V old = *address;
  *address = v;
  return old;
}
// Loads that bypass L1 on a GPU; memory is coherent here.
template <typename V>
V __ldcg(const V* address) {
  return *address;
}
inline float __uint2float_rn(unsigned v) { return static_cast<float>(v); }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int min(int a, int b) { return a < b ? a : b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
// A product that is never contracted into an FMA (the host compiler does not contract without -mfma).
inline float __fmul_rn(float a, float b) { return a * b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }

// Byte i of the result is byte (s >> 4i) & 7 of the 8 bytes {y, x} (x: bytes 0..3, y: 4..7).
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const unsigned long long both = (static_cast<unsigned long long>(y) << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<unsigned>((both >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
}
// Threads of a block run one at a time between collectives, so a plain add is atomic here.
inline float atomicAdd(float* address, float value) {
  const float old = *address;
  *address = old + value;
  return old;
}
