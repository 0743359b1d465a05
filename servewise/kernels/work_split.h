// Items cut into one run a thread with about equal work each, not an equal count: in a batch of mixed
// lengths an equal count leaves one thread idle while another finishes the long items.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace servewise {

// work: the items' work before each item (work[0] = 0; one entry more than there are items). Returns
// nt + 1 cuts: thread t takes items cut[t] .. cut[t + 1] - 1, cut[t] the first item with at least t / nt
// of the whole work before it.
inline std::vector<int64_t> cut_by_work(const std::vector<int64_t>& work, int64_t nt) {
  const int64_t items = static_cast<int64_t>(work.size()) - 1, total = work.back();
  std::vector<int64_t> cut(nt + 1, items);
  for (int64_t t = 0; t < nt; ++t)
    cut[t] = std::partition_point(work.begin(), work.end(), [&](int64_t w) { return w * nt < total * t; }) -
             work.begin();
  return cut;
}

}  // namespace servewise
