
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
// Eight consecutive values of a row as one load takes them (16 bytes of a
// 2-byte type, 32 of float32), and their float32 values.
template <typename T>
struct emlx_row8 {
  uint4 r;
  __device__ void load(const T* p) { r = *reinterpret_cast<const uint4*>(p); }
  __device__ void unpack(float (&f)[8]) const {
    const unsigned w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int c = 0; c < 4; c++) {
      T lo, hi;
      lo.bits = (unsigned short)(w[c] & 0xffffu);
      hi.bits = (unsigned short)(w[c] >> 16);
      f[2 * c] = static_cast<float>(lo);
      f[2 * c + 1] = static_cast<float>(hi);
    }
  }
};
template <>
struct emlx_row8<float> {
  uint4 r[2];
  __device__ void load(const float* p) {
    r[0] = reinterpret_cast<const uint4*>(p)[0];
    r[1] = reinterpret_cast<const uint4*>(p)[1];
  }
  __device__ void unpack(float (&f)[8]) const {
#pragma unroll
    for (int i = 0; i < 2; i++) {
      f[4 * i] = __uint_as_float(r[i].x);
      f[4 * i + 1] = __uint_as_float(r[i].y);
      f[4 * i + 2] = __uint_as_float(r[i].z);
      f[4 * i + 3] = __uint_as_float(r[i].w);
    }
  }
};
