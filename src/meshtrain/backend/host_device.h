// MESHTRAIN_HD marks a function every backend shares: __host__ __device__
// under nvcc (a CUDA kernel calls it), plain inline for the host compilers.
#pragma once

#if defined(__CUDACC__)
#define MESHTRAIN_HD __host__ __device__ __forceinline__
#else
#define MESHTRAIN_HD inline
#endif
