  const auto* const up_w = up_wq + expert * OUTS * WORDS;
  const auto* const up_s = up_scales + expert * OUTS * GROUPS;
  const auto* const up_b = up_biases + expert * OUTS * GROUPS;
#undef W_ROWS
#undef S_ROWS
#undef B_ROWS
#define W_ROWS(p) ((p) == 0 ? gate_w : up_w)
#define S_ROWS(p) ((p) == 0 ? gate_s : up_s)
#define B_ROWS(p) ((p) == 0 ? gate_b : up_b)
