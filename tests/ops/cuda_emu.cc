// The fiber scheduler behind tests/ops/cuda_emu.h: one ucontext per CUDA thread of the
// block being run, switched at barriers, with deadlock and configuration checks.
#include "tests/ops/cuda_emu.h"

#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <array>
#include <map>
#include <string>
#include <vector>

namespace isthmus::emu {
namespace {

constexpr size_t kStackBytes = 256 * 1024;
constexpr size_t kDefaultSmemLimit = 48 * 1024;
constexpr size_t kMaxSmem = 227 * 1024;  // sm_90 opt-in maximum per block
constexpr int kMaxThreads = 1024;

enum class State { kRunnable, kAtBlockBarrier, kAtWarpBarrier, kDone };

struct Fiber {
  ucontext_t ctx;
  ThreadState thread;
  State state = State::kRunnable;
  void* stack = nullptr;
};

struct Emulator {
  std::vector<Fiber> fibers;
  ucontext_t scheduler;
  int current = -1;
  dim3 block_idx, block_dim, grid_dim;
  std::vector<unsigned char> smem;
  std::vector<std::array<uint64_t, 4>> warp_slots;  // 32 per warp, 32 bytes each
  const std::function<void()>* body = nullptr;
  cudaError_t last_error = cudaSuccess;
  std::map<const void*, size_t> allowed_smem;
  Stats stats;
  bool running = false;
};

Emulator& E() {
  static Emulator* e = new Emulator();  // never destroyed: fibers may outlive statics
  return *e;
}

[[noreturn]] void Die(const std::string& what) {
  const Emulator& e = E();
  std::fprintf(stderr, "cuda_emu: %s (block (%u,%u,%u) of grid (%u,%u,%u), blockDim (%u,%u,%u))\n",
               what.c_str(), e.block_idx.x, e.block_idx.y, e.block_idx.z, e.grid_dim.x,
               e.grid_dim.y, e.grid_dim.z, e.block_dim.x, e.block_dim.y, e.block_dim.z);
  std::abort();
}

void Trampoline() {
  Emulator& e = E();
  (*e.body)();
  e.fibers[e.current].state = State::kDone;
  // Returning switches to uc_link (the scheduler).
}

void Yield(State s) {
  Emulator& e = E();
  Fiber& f = e.fibers[e.current];
  f.state = s;
  swapcontext(&f.ctx, &e.scheduler);
}

void* NewStack() {
  void* p = mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
  if (p == MAP_FAILED) Die("cannot map a fiber stack");
  return p;
}

std::string Where(const Fiber& f) {
  return "thread (" + std::to_string(f.thread.idx.x) + "," + std::to_string(f.thread.idx.y) + "," +
         std::to_string(f.thread.idx.z) + ")";
}

// Runs every fiber of the block to completion, opening barriers as they fill.
void RunBlock(int n, bool reverse) {
  Emulator& e = E();
  const int warps = (n + 31) / 32;
  for (;;) {
    for (int k = 0; k < n; ++k) {
      const int i = reverse ? n - 1 - k : k;
      Fiber& f = e.fibers[i];
      if (f.state != State::kRunnable) continue;
      e.current = i;
      swapcontext(&e.scheduler, &f.ctx);
      e.current = -1;
    }
    int done = 0, at_block = 0;
    for (int i = 0; i < n; ++i) {
      done += e.fibers[i].state == State::kDone;
      at_block += e.fibers[i].state == State::kAtBlockBarrier;
    }
    if (done == n) return;
    bool released = false;
    for (int w = 0; w < warps; ++w) {
      const int lo = w * 32, hi = std::min(n, lo + 32);
      bool all = true;
      for (int i = lo; i < hi; ++i) all = all && e.fibers[i].state == State::kAtWarpBarrier;
      if (all) {
        for (int i = lo; i < hi; ++i) e.fibers[i].state = State::kRunnable;
        released = true;
      }
    }
    if (!released && at_block > 0) {
      if (at_block + done == n && done == 0) {
        for (int i = 0; i < n; ++i) e.fibers[i].state = State::kRunnable;
        released = true;
      } else if (at_block + done == n) {
        for (int i = 0; i < n; ++i) {
          if (e.fibers[i].state == State::kDone) {
            Die("__syncthreads reached by some threads while " + Where(e.fibers[i]) +
                " had returned (divergent barrier)");
          }
        }
      }
    }
    if (!released) {
      std::string states;
      for (int w = 0; w < warps; ++w) {
        const int lo = w * 32, hi = std::min(n, lo + 32);
        int b = 0, wb = 0, d = 0;
        for (int i = lo; i < hi; ++i) {
          b += e.fibers[i].state == State::kAtBlockBarrier;
          wb += e.fibers[i].state == State::kAtWarpBarrier;
          d += e.fibers[i].state == State::kDone;
        }
        states += " warp " + std::to_string(w) + ": " + std::to_string(b) + " at __syncthreads, " +
                  std::to_string(wb) + " at a warp barrier/shuffle, " + std::to_string(d) +
                  " returned;";
      }
      Die("deadlock:" + states);
    }
  }
}

}  // namespace

ThreadState& Current() {
  Emulator& e = E();
  if (e.current < 0) Die("threadIdx used outside a kernel");
  return e.fibers[e.current].thread;
}
const dim3& BlockIdx() { return E().block_idx; }
const dim3& BlockDim() { return E().block_dim; }
const dim3& GridDim() { return E().grid_dim; }

void SyncThreads() { Yield(State::kAtBlockBarrier); }

void SyncWarp(unsigned mask) {
  if (mask != 0xffffffffu) Die("only full-warp masks are emulated");
  Yield(State::kAtWarpBarrier);
}

void* WarpSlot(int lane) {
  Emulator& e = E();
  return e.warp_slots[static_cast<size_t>(Current().warp) * 32 + lane].data();
}

void* DynamicShared() { return E().smem.data(); }

void AllowSmem(const void* kernel, size_t bytes) { E().allowed_smem[kernel] = bytes; }

Stats& GetStats() { return E().stats; }

void RunGrid(const void* kernel, dim3 grid, dim3 block, size_t smem,
             const std::function<void()>& body) {
  Emulator& e = E();
  if (e.running) Die("a kernel launched another kernel (not emulated)");
  const int64_t n = static_cast<int64_t>(block.x) * block.y * block.z;
  if (n <= 0 || n > kMaxThreads || grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 ||
      grid.z > 65535 || block.z > 64) {
    e.last_error = cudaErrorInvalidConfiguration;
    return;
  }
  auto allowed = e.allowed_smem.find(kernel);
  const size_t limit = allowed == e.allowed_smem.end() ? kDefaultSmemLimit : allowed->second;
  if (smem > limit || smem > kMaxSmem) {
    e.last_error = cudaErrorInvalidValue;
    return;
  }
  e.running = true;
  e.body = &body;
  e.grid_dim = grid;
  e.block_dim = block;
  e.smem.assign(smem + 16, 0xFF);  // all-ones bytes read as NaN floats / -1 ints
  e.warp_slots.assign(static_cast<size_t>((n + 31) / 32) * 32, {});
  while (static_cast<int64_t>(e.fibers.size()) < n) {
    e.fibers.emplace_back();
    e.fibers.back().stack = NewStack();
  }
  ++e.stats.launches;
  int64_t block_number = 0;
  for (unsigned bz = 0; bz < grid.z; ++bz) {
    for (unsigned by = 0; by < grid.y; ++by) {
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        e.block_idx = dim3(bx, by, bz);
        std::memset(e.smem.data(), 0xFF, e.smem.size());
        for (int i = 0; i < n; ++i) {
          Fiber& f = e.fibers[i];
          f.thread.linear = i;
          f.thread.idx = dim3(i % block.x, (i / block.x) % block.y, i / (block.x * block.y));
          f.thread.lane = i % 32;
          f.thread.warp = i / 32;
          f.state = State::kRunnable;
          getcontext(&f.ctx);
          f.ctx.uc_stack.ss_sp = f.stack;
          f.ctx.uc_stack.ss_size = kStackBytes;
          f.ctx.uc_link = &e.scheduler;
          makecontext(&f.ctx, &Trampoline, 0);
        }
        RunBlock(static_cast<int>(n), (block_number & 1) != 0);
        ++block_number;
        e.stats.threads += n;
      }
    }
  }
  e.stats.blocks += block_number;
  e.body = nullptr;
  e.running = false;
}

cudaError_t TakeLastError(bool clear) {
  Emulator& e = E();
  const cudaError_t err = e.last_error;
  if (clear) e.last_error = cudaSuccess;
  return err;
}

}  // namespace isthmus::emu

namespace isthmus::emu {
namespace {

float Bf16Half(uint32_t reg, int half) {
  return __bfloat162float(__nv_bfloat16{static_cast<uint16_t>(reg >> (16 * half))});
}

}  // namespace

void MmaM16N8K16Bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  const int lane = Current().lane;
  uint32_t mine[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
  std::memcpy(WarpSlot(lane), mine, sizeof mine);
  SyncWarp(0xffffffffu);
  // The whole A (16x16) and B (16x8) from every lane's registers.
  float am[16][16], bm[16][8];
  for (int l = 0; l < 32; ++l) {
    uint32_t r[6];
    std::memcpy(r, WarpSlot(l), sizeof r);
    const int g = l / 4, t = l % 4;
    for (int i = 0; i < 4; ++i) {
      const int row = g + 8 * (i % 2), col = 2 * t + 8 * (i / 2);
      am[row][col] = Bf16Half(r[i], 0);
      am[row][col + 1] = Bf16Half(r[i], 1);
    }
    for (int i = 0; i < 2; ++i) {
      const int k = 2 * t + 8 * i;
      bm[k][g] = Bf16Half(r[4 + i], 0);
      bm[k + 1][g] = Bf16Half(r[4 + i], 1);
    }
  }
  SyncWarp(0xffffffffu);
  const int g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i / 2), col = 2 * t + i % 2;
    float s = d[i];
    for (int k = 0; k < 16; ++k) s += am[row][k] * bm[k][col];
    d[i] = s;
  }
}

void LdMatrixX4(uint32_t (&r)[4], const void* row, bool trans) {
  Emulator& e = E();
  const auto* p = static_cast<const unsigned char*>(row);
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0)
    Die("ldmatrix: a row address is not 16-byte aligned");
  if (p < e.smem.data() || p + 16 > e.smem.data() + e.smem.size()) {
    Die("ldmatrix: a row address is outside the block's dynamic shared memory");
  }
  const int lane = Current().lane;
  std::memcpy(WarpSlot(lane), &p, sizeof p);
  SyncWarp(0xffffffffu);
  auto element = [](int source_lane, int col) {
    const unsigned char* q;
    std::memcpy(&q, WarpSlot(source_lane), sizeof q);
    uint16_t v;
    std::memcpy(&v, q + 2 * col, sizeof v);
    return static_cast<uint32_t>(v);
  };
  const int g = lane / 4, t = lane % 4;
  uint32_t out[4];
  for (int i = 0; i < 4; ++i) {
    // Matrix i's rows come from lanes 8i..8i+7. This lane gets row g, columns 2t and 2t + 1,
    // or transposed: rows 2t and 2t + 1 of column g.
    out[i] = trans ? element(8 * i + 2 * t, g) | element(8 * i + 2 * t + 1, g) << 16
                   : element(8 * i + g, 2 * t) | element(8 * i + g, 2 * t + 1) << 16;
  }
  SyncWarp(0xffffffffu);
  for (int i = 0; i < 4; ++i) r[i] = out[i];
}

}  // namespace isthmus::emu

const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
  }
  return "unknown error";
}

cudaError_t cudaGetLastError() { return isthmus::emu::TakeLastError(true); }
cudaError_t cudaPeekAtLastError() { return isthmus::emu::TakeLastError(false); }
