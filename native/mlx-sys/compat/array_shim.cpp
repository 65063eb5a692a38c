// An MLX array whose buffer is allocated but not yet written, for a loader
// that fills it from the host: MLX-C creates arrays only by copying from
// one pointer, which would take a second copy of tensors read in parts.
#include <exception>

#include "mlx/allocator.h"
#include "mlx/c/error.h"
#include "mlx/c/private/array.h"
#include "mlx/c/private/enums.h"

extern "C" int emlx_array_new_uninit(
    mlx_array* res,
    void** data,
    const int* shape,
    int dim,
    mlx_dtype dtype) {
  try {
    mlx::core::Shape cpp_shape(shape, shape + dim);
    mlx::core::Dtype cpp_dtype = mlx_dtype_to_cpp(dtype);
    size_t bytes = mlx::core::size_of(cpp_dtype);
    for (int d : cpp_shape) {
      bytes *= static_cast<size_t>(d);
    }
    mlx::core::array a(mlx::core::allocator::malloc(bytes), cpp_shape, cpp_dtype);
    *data = a.data<unsigned char>();
    mlx_array_set_(*res, std::move(a));
    return 0;
  } catch (std::exception& e) {
    mlx_error(e.what());
    return 1;
  }
}
