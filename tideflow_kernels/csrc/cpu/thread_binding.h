// Pinning the calling thread's OpenMP team: thread i of the team to cpus[i]. The engine thread calls it once
// (engine/runtime/intraop.py says when); the team's threads are the ones every later parallel region of that thread
// reuses, so they stay where they were put. Returns the CPU each thread then runs on.
#pragma once
#include <ATen/ATen.h>
#include <omp.h>
#include <sched.h>

#include <vector>

namespace tideflow {

inline std::vector<int64_t> bind_threads(at::IntArrayRef cpus) {
  const int n = int(cpus.size());
  TORCH_CHECK(n > 0, "bind_threads: no CPUs given");
  for (int64_t cpu : cpus) TORCH_CHECK(cpu >= 0 && cpu < CPU_SETSIZE, "bind_threads: CPU ", cpu, " out of range");
  std::vector<int64_t> on(n, -1);
  std::vector<int> failed(n, 0);
#pragma omp parallel num_threads(n)
  {
    const int t = omp_get_thread_num();
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(int(cpus[t]), &set);
    failed[t] = sched_setaffinity(0, sizeof(set), &set) != 0;
    on[t] = sched_getcpu();
  }
  for (int t = 0; t < n; ++t)
    TORCH_CHECK(!failed[t], "bind_threads: thread ", t, " could not be pinned to CPU ", cpus[t]);
  TORCH_CHECK(omp_get_max_threads() >= n, "bind_threads: the team has ", omp_get_max_threads(), " threads, not ", n);
  return on;
}

}  // namespace tideflow
