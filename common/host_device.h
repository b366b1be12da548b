// LOGPROB_HOST_DEVICE: marks a function that both host code and CUDA device
// code call (__host__ __device__ under nvcc, nothing otherwise), for the
// plain headers that g++, clang and nvcc all include
// (worker/kernels/partial_record.h, common/lm_head_logit.h).
#pragma once

#if defined(__CUDACC__)
#define LOGPROB_HOST_DEVICE __host__ __device__
#else
#define LOGPROB_HOST_DEVICE
#endif
