
  // The tokens row `r` may take (a grammar's): bit `i % 32` of word `i / 32`
  // of `mask` `[rows, ceil(V / 32)]` (uint32). The others are not taken.
  constexpr bool MASKED = true;
  auto allowed_bits = [&](int r, int w) -> unsigned {
    return mask[(size_t)r * mask_shape[1] + w];
  };
