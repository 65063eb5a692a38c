// MLX-C declares its float16/bfloat16 accessors only where the compiler has
// native half types (aarch64). mlx-rs calls them on every target, so on other
// targets we provide them over MLX's own half types, passing the raw 16 bits.
#include <cstdint>
#include <cstring>
#include <exception>

#include "mlx/c/array.h"
#include "mlx/c/error.h"
#include "mlx/c/private/array.h"

namespace {
template <typename Half>
int item_bits(uint16_t* res, const mlx_array arr) {
  try {
    Half value = mlx_array_get_(arr).item<Half>();
    std::memcpy(res, &value, sizeof(uint16_t));
    return 0;
  } catch (std::exception& e) {
    mlx_error(e.what());
    return 1;
  }
}

template <typename Half>
const uint16_t* data_bits(const mlx_array arr) {
  try {
    return reinterpret_cast<const uint16_t*>(
        mlx_array_get_(arr).data<Half>());
  } catch (std::exception& e) {
    mlx_error(e.what());
    return nullptr;
  }
}
}  // namespace

extern "C" int mlx_array_item_float16(uint16_t* res, const mlx_array arr) {
  return item_bits<mlx::core::float16_t>(res, arr);
}

extern "C" int mlx_array_item_bfloat16(uint16_t* res, const mlx_array arr) {
  return item_bits<mlx::core::bfloat16_t>(res, arr);
}

extern "C" const uint16_t* mlx_array_data_float16(const mlx_array arr) {
  return data_bits<mlx::core::float16_t>(arr);
}

extern "C" const uint16_t* mlx_array_data_bfloat16(const mlx_array arr) {
  return data_bits<mlx::core::bfloat16_t>(arr);
}

#ifndef __APPLE__
// mlx-rs seeds its default random state from this macOS clock.
#include <time.h>
extern "C" uint64_t mach_approximate_time(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull +
      static_cast<uint64_t>(ts.tv_nsec);
}
#endif
