// A launch-bound driver-API workload for the tracer's cost and lost-event measurements.
// Each `loop`/`storm` phase loads its own copy of the kernel's module (argv[1], a cubin of this
// file) and looks the kernel up, so that a tracer attached before the phase sees the lookup
// and knows the kernel's parameter layout -- the path every launch takes in a traced job.
// Protocol (workloads/harness.py Job): READY <pid>, then one JSON line per command:
//   init            cuInit and the primary context
//   loop N          N launches from one thread; seconds per launch
//   storm T S       T threads, each on its own stream, launching for S seconds
//   storm T S late  the same, launching right after the lookup, before a tracer can have
//                   pushed the kernel's layout: its first launches go without one
#include <cuda.h>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

extern "C" __global__ void empty(int *p, int v) { if (p && v < 0) *p = v; }

#define CHECK(call) do { CUresult r_ = (call); if (r_ != CUDA_SUCCESS) { \
  fprintf(stderr, "%s failed: %d\n", #call, (int)r_); exit(1); } } while (0)

static std::string image;

static CUfunction fresh_function(bool wait = true) {
  CUmodule m;
  CUfunction f;
  CHECK(cuModuleLoadData(&m, image.data()));
  CHECK(cuModuleGetFunction(&f, m, "empty"));
  if (wait) usleep(200000);  // a tracer pushes the layout on its next drain (20 ms)
  return f;
}

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int main(int argc, char **argv) {
  if (argc < 2) { fprintf(stderr, "usage: launch_storm KERNEL.cubin\n"); return 2; }
  std::ifstream in(argv[1], std::ios::binary);
  image.assign(std::istreambuf_iterator<char>(in), {});
  printf("READY %d\n", getpid());
  fflush(stdout);
  char line[128];
  CUcontext ctx;
  while (fgets(line, sizeof line, stdin)) {
    char cmd[32] = "", opt[16] = "";
    long a = 0;
    double b = 0;
    sscanf(line, "%31s %ld %lf %15s", cmd, &a, &b, opt);
    if (!strcmp(cmd, "init")) {
      CUdevice dev;
      CHECK(cuInit(0));
      CHECK(cuDeviceGet(&dev, 0));
      CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
      CHECK(cuCtxSetCurrent(ctx));
      printf("{\"phase\": \"init\"}\n");
    } else if (!strcmp(cmd, "loop")) {
      CUfunction f = fresh_function();
      int *p = nullptr, v = 1;
      void *args[] = {&p, &v};
      double t = now();
      for (long i = 0; i < a; i++) CHECK(cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, 0, args, nullptr));
      CHECK(cuCtxSynchronize());
      printf("{\"phase\": \"loop\", \"n\": %ld, \"s_per_launch\": %.9f}\n", a, (now() - t) / a);
    } else if (!strcmp(cmd, "storm")) {
      CUfunction f = fresh_function(strcmp(opt, "late") != 0);
      std::atomic<long> total{0};
      double t0 = now();
      std::vector<std::thread> pool;
      for (long t = 0; t < a; t++)
        pool.emplace_back([&] {
          CHECK(cuCtxSetCurrent(ctx));
          CUstream s;
          CHECK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
          int *p = nullptr, v = 1;
          void *args[] = {&p, &v};
          long n = 0;
          while (now() - t0 < b) {
            for (int i = 0; i < 256; i++) cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, s, args, nullptr);
            n += 256;
          }
          CHECK(cuStreamSynchronize(s));
          total += n;
        });
      for (auto &t : pool) t.join();
      printf("{\"phase\": \"storm\", \"threads\": %ld, \"launches\": %ld, \"seconds\": %.3f}\n", a,
             total.load(), now() - t0);
    } else if (!strcmp(cmd, "exit")) {
      break;
    }
    fflush(stdout);
  }
  return 0;
}
