#include <cstdio>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <limits>
#include "simd.h"
using namespace sparq_cpu;
// simd.h's int3_minus4 (an int3 K^T block's 16 codes minus 4) against the scalar formula, for the instruction set
// this is compiled for (tests/test_kernels_cpu.py builds it for x86-64, x86-64-v3 and the machine's own).
int main() {
  uint32_t seed = 1;
  int bad = 0;
  for (int t = 0; t < 10000; ++t) {
    seed = seed * 1664525u + 1013904223u; uint32_t low = seed;
    seed = seed * 1664525u + 1013904223u; uint32_t high = seed & 0xFFFF;
    V v = int3_minus4(low, high);
    float out[16]; store(out, v);
    for (int l = 0; l < 16; ++l) {
      float want = (float)((int)(((low >> (2 * l)) & 3) | (((high >> l) & 1) << 2)) - 4);
      if (out[l] != want) ++bad;
    }
  }
  printf("bad %d\n", bad);
  return bad != 0;
}
