
extern "C" __global__ void emlx_axon_advance(
    const unsigned* tokens, unsigned* ids, int* positions, unsigned* ring,
    unsigned* counter, int rows, int slots) {
  const unsigned slot = *counter % (unsigned)slots;
  for (int r = threadIdx.x; r < rows; r += blockDim.x) {
    const unsigned t = tokens[r];
    ids[r] = t;
    positions[r] += 1;
    ring[slot * rows + r] = t;
  }
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) *counter = *counter + 1;
}
