// The validation suite of the speculation: each kernel is one shape the rule must get right,
// or one it cannot see (pointers followed inside the kernel). What each launch writes, and what
// the speculation predicts, is declared in suite.json beside this file; suite.py runs it on the
// GPU with the run-time validator. Every write changes bytes (buffers start at 1.0f), so the
// validator's hashes see it.
#include <cstdint>

struct Pair {           // two pointers: the speculation cannot know `a` is only read
  const float *a;
  float *b;
  long long n;
};

struct Padded {         // a pointer after padding
  int tag;
  float *p;
};

__global__ void fill(float *out, float v, int n) {
  int i = threadIdx.x;
  if (i < n) out[i] = v;
}

__global__ void copy_plus(const float *in, float *out, int n) {
  int i = threadIdx.x;
  if (i < n) out[i] = in[i] + 1.0f;
}

__global__ void interior(float *p, int n) {
  int i = threadIdx.x;
  if (i < n) p[i] = 5.0f;
}

__global__ void pair(Pair p) {
  int i = threadIdx.x;
  if (i < p.n) p.b[i] = p.a[i] + 2.0f;
}

__global__ void padded(Padded m, const float *src) {
  int i = threadIdx.x;
  if (i < 64) m.p[i] = src[i] + (float)m.tag;
}

__global__ void gather_write(float **table, int n) {     // writes through a pointer array
  int i = threadIdx.x;
  if (i < n) {
    table[0][i] = 7.0f;
    table[1][i] = 8.0f;
  }
}

__global__ void gather_const(float *const *table, int n) {
  int i = threadIdx.x;
  if (i < n) table[0][i] = 9.0f;
}

__global__ void hidden_ptr(unsigned long long addr, int n) {   // a pointer disguised as a scalar
  int i = threadIdx.x;
  if (i < n) ((float *)addr)[i] = 11.0f;
}

__global__ void scalar_addr(unsigned long long addr, float *out) {   // the scalar is not used
  int i = threadIdx.x;
  if (i < 64) out[i] = 4.0f + (float)(addr == 0);
}

__global__ void read_only(const float *in, int n, float threshold) {  // writes nothing
  float s = 0;
  for (int i = 0; i < n; i++) s += in[i];
  if (s < threshold) asm volatile("" ::"f"(s));
}

__global__ void maybe_write(float *out, int flag) {      // writes only when flag is set
  if (flag) out[threadIdx.x] = 3.0f;
}
