
typedef unsigned int uint32_t;
typedef decltype(sizeof(0)) size_t;
struct __align__(2) emlx_bf16 {
  unsigned short bits;
  emlx_bf16() = default;
  __device__ explicit emlx_bf16(float f) {
    const unsigned u = __float_as_uint(f);
    bits = f != f ? 0x7fc0 : (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  __device__ operator float() const { return __uint_as_float((unsigned)bits << 16); }
};
struct __align__(2) emlx_f16 {
  unsigned short bits;
  emlx_f16() = default;
  __device__ explicit emlx_f16(float f) { asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(f)); }
  __device__ operator float() const {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(bits));
    return f;
  }
};
