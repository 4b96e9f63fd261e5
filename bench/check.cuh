// check.cuh — CHECK(call): the standalone nvcc bench programs' CUDA runtime error check (prints
// the call, its file and line and the error, then exits 1). Included as "check.cuh" beside them.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

#define CHECK(x)                                                                             \
    do {                                                                                     \
        cudaError_t e = (x);                                                                 \
        if (e != cudaSuccess) {                                                              \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
            exit(1);                                                                         \
        }                                                                                    \
    } while (0)
