#include "experts.h"

#include "pool.h"

namespace emlx {

ExpertRows rows_by_expert(const uint32_t* ids, long n, int E) {
  ExpertRows g;
  g.start.assign(E + 1, 0);
  for (long r = 0; r < n; ++r)
    if (ids[r] < (uint32_t)E) ++g.start[ids[r] + 1];
  for (int e = 0; e < E; ++e) g.start[e + 1] += g.start[e];
  g.order.resize(g.start[E]);
  std::vector<int> fill(g.start.begin(), g.start.end() - 1);
  for (long r = 0; r < n; ++r)
    if (ids[r] < (uint32_t)E) g.order[fill[ids[r]]++] = (int)r;
  for (int e = 0; e < E; ++e)
    if (g.start[e + 1] > g.start[e]) g.used.push_back(e);
  return g;
}

void for_each_expert(const std::vector<int>& used, const std::function<void(int, int)>& f) {
  Pool& pool = Pool::shared();
  if ((int)used.size() >= pool.size() && pool.size() > 1) {
    pool.run((int)used.size(), [&](int i) { f(used[i], 1); });
  } else {
    for (int e : used) f(e, 0);
  }
}

}  // namespace emlx
