// Index math and per-element rules of the GPU encoder (csrc/cuda/encode.cu).
// Plain C++ marked ZS_HD (the SIMT harness runs the encoder on the CPU:
// tests/simt/test_kernels.py::test_encoder_*).
#pragma once

#include <cstdint>

#include "zipserv/format.h"

namespace zipserv {
namespace enc {

constexpr int kThreads = 256;                      // one tile per block
constexpr int kPerThread = kTileElems / kThreads;  // 16 consecutive linear indices q
static_assert(kPerThread == 16, "a thread covers a quarter FT");

// Element i of thread t: linear index q = 16 t + i, FT f = q / 64, position p.
ZS_HD int elem_q(int tid, int i) { return tid * kPerThread + i; }
ZS_HD int elem_row(int q) { return frag_row0(q / kFragElems) + (q % kFragElems) / kFrag; }
ZS_HD int elem_col(int q) { return frag_col0(q / kFragElems) + (q % kFragElems) % kFrag; }
// The thread's 16 elements are bits 16 (t % 4) .. 16 (t % 4) + 15 of FT t / 4.
ZS_HD int thread_ft(int tid) { return tid / 4; }
ZS_HD int thread_bit0(int tid) { return (tid % 4) * kPerThread; }

// Window choice: thread s' (0..248) scores start s = s' + 1; the largest key
// has the largest cover and, on ties, the smallest start (FORMAT.md s.3).
ZS_HD int window_key(int cover, int s_idx) { return cover * 256 + (255 - s_idx); }
ZS_HD int base_of_key(int key) { return 255 - (key & 0xFF); }  // = s - 1

ZS_HD unsigned code_of(uint16_t v, bool valid, int base_exp) {
  if (!valid) return static_cast<unsigned>(kPadCode);
  const int rel = static_cast<int>((v >> 7) & 0xFF) - base_exp;
  return (rel >= 1 && rel <= kWindow) ? static_cast<unsigned>(rel) : 0u;
}
ZS_HD uint8_t sm_byte_of(uint16_t v, bool valid) {
  return valid ? static_cast<uint8_t>(((v >> 8) & 0x80u) | (v & 0x7Fu)) : kPadSm;
}

}  // namespace enc
}  // namespace zipserv
