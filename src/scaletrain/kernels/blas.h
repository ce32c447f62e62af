#pragma once
// Small matrix products on raw row-major memory, straight to the BLAS that
// libtorch itself calls (the Fortran sgemm_/dgemm_ of libblas.so.3, OpenBLAS
// on our machines).
//
// Note [Direct BLAS calls]
// The kernels multiply many small tiles (64 x 64 x head_dim in attention).
// Through at::mm_out each product first builds tensor views, passes the
// dispatcher and checks shapes and strides: a few microseconds, which at
// T = 128 and head dim 32 is as long as the product itself. Calling the BLAS
// routine ATen would reach anyway removes that overhead and nothing else:
// ATen maps a row-major C = A B to the column-major C^T = B^T A^T call made
// here, so the products are the same calls with the same operands.
//
// Without SCALETRAIN_DIRECT_BLAS (a libtorch that keeps its BLAS to itself,
// as PyTorch's wheels do, and no libblas.so.3 beside it), the same products
// go through at::addmm_ on views of the same memory.
#include <cstdint>

#if !defined(SCALETRAIN_DIRECT_BLAS)
#include <ATen/ATen.h>
#else
extern "C" {
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc);
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc);
}
#endif

namespace scaletrain::kernels::detail {

// C[m, n] = alpha * op(A) op(B) + beta * C, all row-major; op(A) is [m, k]
// (A stored [k, m] when trans_a), op(B) is [k, n] (B stored [n, k] when
// trans_b); lda, ldb, ldc are the row strides. beta = 0 ignores C's contents.
template <typename T>
inline void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
                 const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
#if !defined(SCALETRAIN_DIRECT_BLAS)
  const auto options = at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value);
  auto view = [&](const T* p, int64_t rows, int64_t cols, int64_t ld, bool trans) {
    at::Tensor t = at::from_blob(const_cast<T*>(p), {rows, cols}, {ld, 1}, options);
    return trans ? t.t() : t;
  };
  at::Tensor out = at::from_blob(c, {m, n}, {ldc, 1}, options);
  // beta = 0: addmm ignores out's contents, as the BLAS does.
  out.addmm_(view(a, trans_a ? k : m, trans_a ? m : k, lda, trans_a),
             view(b, trans_b ? n : k, trans_b ? k : n, ldb, trans_b), beta, alpha);
#else
  // Column-major view: C^T [n, m] = op(B)^T op(A)^T.
  const char ta = trans_b ? 'T' : 'N', tb = trans_a ? 'T' : 'N';
  const int M = static_cast<int>(n), N = static_cast<int>(m), K = static_cast<int>(k);
  const int la = static_cast<int>(ldb), lb = static_cast<int>(lda), lc = static_cast<int>(ldc);
  if constexpr (sizeof(T) == sizeof(float))
    sgemm_(&ta, &tb, &M, &N, &K, &alpha, b, &la, a, &lb, &beta, c, &lc);
  else
    dgemm_(&ta, &tb, &M, &N, &K, &alpha, b, &la, a, &lb, &beta, c, &lc);
#endif
}

}  // namespace scaletrain::kernels::detail
