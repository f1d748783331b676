// Launch storm for the tracer's lost-event check: T threads, each on its own stream, launch
// an empty kernel through the driver API as fast as it takes them for S seconds.
// Protocol: prints READY <pid>, waits for a line on stdin, prints one JSON line.
#include <cuda.h>
#include <cuda_runtime.h>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <unistd.h>
#include <vector>

__global__ void empty(int *p, int v) { if (p && v < 0) *p = v; }

int main(int argc, char **argv) {
  int threads = argc > 1 ? atoi(argv[1]) : 4;
  double seconds = argc > 2 ? atof(argv[2]) : 5.0;
  printf("READY %d\n", getpid());
  fflush(stdout);
  char line[64];
  if (!fgets(line, sizeof line, stdin)) return 1;
  cudaFree(0);
  CUfunction f;
  cudaGetFuncBySymbol(&f, (const void *)empty);
  std::atomic<long> total{0};
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; t++)
    pool.emplace_back([&] {
      cudaSetDevice(0);
      CUstream s;
      cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
      int *p = nullptr, v = 1;
      void *args[] = {&p, &v};
      long n = 0;
      while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < seconds) {
        for (int i = 0; i < 256; i++) cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, s, args, nullptr);
        n += 256;
      }
      cuStreamSynchronize(s);
      total += n;
    });
  for (auto &t : pool) t.join();
  double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  printf("{\"phase\": \"storm\", \"threads\": %d, \"launches\": %ld, \"seconds\": %.3f}\n",
         threads, total.load(), dt);
  fflush(stdout);
  if (!fgets(line, sizeof line, stdin)) return 0;
  return 0;
}
