
  // No mask: every token may be taken.
  constexpr bool MASKED = false;
  auto allowed_bits = [](int, int) -> unsigned { return 0xffffffffu; };
