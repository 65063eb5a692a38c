
  // This block's (row, choice) pair takes the weights of the expert it was
  // routed to, `wq` `[experts, OUTS, WORDS]` (gate's, then for SwiGLU
  // up's): ids past the stack are clamped to it.
  const size_t expert = (size_t)min(max(experts[blockIdx.y], 0), wq_shape[0] - 1);
  const auto* const gate_w = wq + expert * OUTS * WORDS;
  const auto* const gate_s = scales + expert * OUTS * GROUPS;
  const auto* const gate_b = biases + expert * OUTS * GROUPS;
#define ROW_OF(n, p) (n)
#define W_ROWS(p) gate_w
#define S_ROWS(p) gate_s
#define B_ROWS(p) gate_b
