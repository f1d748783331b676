// Kernels of the fake-driver tests. They never run (the fake libcuda cannot execute SASS);
// nvcc compiles them at test time so that the tracer parses a real cubin/fatbin and its
// .nv.info parameter layouts. Each shape below is one case the speculation must handle.
#include <cstdint>

struct Pair {          // by-value struct holding device pointers (scanned word by word)
  float *a;
  float *b;
  int n;
};

struct Mixed {         // pointer after padding, to exercise offsets inside the struct
  char tag;
  double *p;
  uint32_t count;
};

__global__ void axpy(float alpha, const float *x, float *y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] += alpha * x[i];
}

__global__ void pair_copy(Pair p, float scale) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < p.n) p.b[i] = p.a[i] * scale;
}

__global__ void mixed(Mixed m, const double *src) {
  if (threadIdx.x < m.count) m.p[threadIdx.x] = src[threadIdx.x] + m.tag;
}

__global__ void scalars(char c, short s, int i, long long l, double d, float *out) {
  out[0] = c + s + i + (float)l + (float)d;
}

struct TensorList {    // ATen's TensorListMetadata<1>: 3 KiB passed by value
  float *addresses[110];
  int64_t numel[110];
  unsigned char block_to_tensor[320];
  int block_to_chunk[320];
  int start;
};

__global__ void tensor_list(TensorList l, float scale) {
  int t = l.block_to_tensor[blockIdx.x];
  if (threadIdx.x < l.numel[t]) l.addresses[t][threadIdx.x] *= scale;
}

template <typename T>
__global__ void fill(T *out, T value, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = value;
}

template __global__ void fill<float>(float *, float, int);
template __global__ void fill<int>(int *, int, int);

extern "C" __global__ void no_params() {}

// more parameters than the tracer's 16 slots (cuBLASLt's splitKreduce has 21)
__global__ void many(float *o, int a0, int a1, int a2, int a3, int a4, int a5, int a6, int a7, int a8, int a9, int a10, int a11, int a12, int a13, int a14, int a15, int a16, int a17, int a18) {
  o[0] = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11 + a12 + a13 + a14 + a15 + a16 + a17 + a18;
}
