// Rows routed to experts, grouped by expert, and the threading of their
// products: what the gathered product and the decode layer's routed
// experts share.
#pragma once

#include <stdint.h>

#include <functional>
#include <vector>

namespace emlx {

struct ExpertRows {
  std::vector<int> start;  // [E + 1]: expert e's rows are order[start[e]..start[e + 1])
  std::vector<int> order;  // row indices, each expert's in row order
  std::vector<int> used;  // the experts with a row, ascending
};

// Rows 0..n-1 grouped by expert ids[r] (a counting sort). Rows whose id is
// E or more are left out.
ExpertRows rows_by_expert(const uint32_t* ids, long n, int E);

// f(e, threads) for each expert of `used`. With at least an expert a
// thread, each thread takes whole experts (threads 1): a token's few small
// products, each split over the threads, spent their time starting and
// joining. With fewer, one after the other, each over the whole pool
// (threads 0).
void for_each_expert(const std::vector<int>& used, const std::function<void(int, int)>& f);

}  // namespace emlx
