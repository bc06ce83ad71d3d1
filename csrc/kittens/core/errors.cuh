// Host-side error checks. Device code reports shape contracts at compile time (static_assert).
#pragma once
#include <cuda_runtime.h>
#include <stdexcept>
#include <string>

namespace kittens {

inline void check_cuda(cudaError_t err, const char* what, const char* file, int line) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(what) + " failed at " + file + ":" + std::to_string(line) +
                             ": " + cudaGetErrorString(err));
  }
}

}  // namespace kittens

#define TK_CUDA_CHECK(expr) ::kittens::check_cuda((expr), #expr, __FILE__, __LINE__)
#define TK_LAUNCH_CHECK() ::kittens::check_cuda(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)
