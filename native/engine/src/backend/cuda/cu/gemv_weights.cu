
  // Part p of output n's weight rows is row ROW_OF(n, p) from W_ROWS(p) on:
  // row n, and for SwiGLU the up row n + OUTS.
#define ROW_OF(n, p) ((n) + (p) * OUTS)
#define W_ROWS(p) wq
#define S_ROWS(p) scales
#define B_ROWS(p) biases
