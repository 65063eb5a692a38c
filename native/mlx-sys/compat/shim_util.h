// What the CUDA glue files share: entry points found at run time (so that
// CPU builds of libmlx link too) and strings handed to Rust.
#pragma once

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <string>

namespace emlx {

// `name` in the process (a CUDA libmlx loads the driver and NVRTC), or null.
template <typename F>
F symbol(const char* name) {
  return reinterpret_cast<F>(dlsym(RTLD_DEFAULT, name));
}

// Sets `f` to `name`'s entry point; whether there is one.
template <typename F>
bool bind(F& f, const char* name) {
  f = symbol<F>(name);
  return f != nullptr;
}

// A malloc'd copy of `s`, for Rust to free with `emlx_cuda_free`.
inline char* copy_out(const std::string& s) {
  char* out = static_cast<char*>(std::malloc(s.size() + 1));
  if (out != nullptr) {
    std::memcpy(out, s.data(), s.size());
    out[s.size()] = '\0';
  }
  return out;
}

} // namespace emlx
