/* How fast this machine's cores read memory: the bound on a decode step
 * that reads every weight once. Each repetition sums a 2 GiB buffer with
 * THREADS threads (OpenMP); with --bytes N (one token's reads) it also
 * prints the tokens/s that bandwidth allows.
 *
 *   cc -O3 -march=native -fopenmp bench/membw.c -o /tmp/membw
 *   OMP_NUM_THREADS=2 /tmp/membw [--bytes 2260000000] [--reps 6]
 */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
  double bytes_per_token = 0;
  int reps = 6;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--bytes")) bytes_per_token = atof(argv[i + 1]);
    else if (!strcmp(argv[i], "--reps")) reps = atoi(argv[i + 1]);
  }
  const size_t n = ((size_t)2 << 30) / sizeof(uint64_t);
  uint64_t* buf = aligned_alloc(64, n * sizeof(uint64_t));
  if (!buf) return 1;
#pragma omp parallel for
  for (size_t i = 0; i < n; i++) buf[i] = i * 2654435761u;
  double best = 0;
  for (int rep = 0; rep < reps; rep++) {
    const double t = now();
    uint64_t x = 0;
#pragma omp parallel for reduction(^ : x)
    for (size_t i = 0; i < n; i++) x ^= buf[i];
    const double gbs = n * sizeof(uint64_t) / (now() - t) / 1e9;
    if (gbs > best) best = gbs;
    printf("threads %d, repetition %d: %.1f GB/s (%llu)\n", omp_get_max_threads(), rep, gbs,
           (unsigned long long)(x & 1));
  }
  if (bytes_per_token > 0)
    printf("best %.1f GB/s: at most %.1f tokens/s reading %.0f bytes a token\n", best,
           best * 1e9 / bytes_per_token, bytes_per_token);
  free(buf);
  return 0;
}
