// Force-included into every MLX-C translation unit.
//
// MLX-C's private/io.h calls std::format, which GCC 12's libstdc++ lacks. This
// supplies the one form MLX-C uses ("{}" placeholders only) where <format> is
// missing, so the sources can be compiled unmodified.
#pragma once
#ifdef __cplusplus
#if __has_include(<format>)
#include <format>
#else
#include <initializer_list>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

namespace std {
template <class... Args>
inline string format(string_view fmt, Args&&... args) {
  vector<string> parts;
  (
      [&](auto&& arg) {
        ostringstream os;
        os << arg;
        parts.push_back(os.str());
      }(args),
      ...);
  string out;
  size_t next = 0;
  for (size_t i = 0; i < fmt.size(); ++i) {
    if (fmt[i] == '{' && i + 1 < fmt.size() && fmt[i + 1] == '}') {
      if (next < parts.size()) out += parts[next++];
      ++i;
    } else {
      out += fmt[i];
    }
  }
  return out;
}
}  // namespace std
#endif
#endif
