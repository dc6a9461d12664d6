#include "meshtrain/backend/cuda/matmul.h"

#include <fmt/format.h>

#include "meshtrain/backend/cuda/cublaslt.h"
#include "meshtrain/backend/cuda/runtime.h"
#include "meshtrain/util/error.h"

namespace meshtrain::cuda {
namespace {

cudaDataType_t data_type(DType d) {
  switch (d) {
    case DType::f32: return CUDA_R_32F;
    case DType::bf16: return CUDA_R_16BF;
    case DType::f16: return CUDA_R_16F;
    case DType::i32: break;
  }
  fail("cublasLt: {} is not a GEMM dtype", dtype_name(d));
}

template <typename T>
void set(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute, const T& value) {
  const CublasLt& lt = cublaslt();
  check(lt.desc_set(desc, attribute, &value, sizeof value),
        "cublasLtMatmulDescSetAttribute");
}

// A column-major rows x cols layout with leading dimension ld, batched.
cublasLtMatrixLayout_t layout(DType d, int64_t rows, int64_t cols, int64_t ld, int64_t batch,
                              int64_t stride) {
  const CublasLt& lt = cublaslt();
  cublasLtMatrixLayout_t out = nullptr;
  check(lt.layout_create(&out, data_type(d), static_cast<uint64_t>(rows),
                                   static_cast<uint64_t>(cols), ld),
        "cublasLtMatrixLayoutCreate");
  if (batch > 1) {
    const auto count = static_cast<int32_t>(batch);
    check(lt.layout_set(out, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count,
                                           sizeof count),
          "cublasLtMatrixLayoutSetAttribute");
    check(lt.layout_set(out, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                           &stride, sizeof stride),
          "cublasLtMatrixLayoutSetAttribute");
  }
  return out;
}

}  // namespace

Gemms::Gemms(cudaStream_t stream, void* workspace) : stream_(stream), workspace_(workspace) {
  check(cublaslt().create(&handle_), "cublasLtCreate");
}

Gemms::~Gemms() {
  const CublasLt& lt = cublaslt();
  for (auto& [key, p] : plans_) {
    lt.layout_destroy(p.a);
    lt.layout_destroy(p.b);
    lt.layout_destroy(p.c);
    lt.desc_destroy(p.op);
  }
  if (handle_ != nullptr) lt.destroy(handle_);
}

// Row-major C[m, n] = A[m, k] B[k, n] is column-major C^T (n x m) = B^T (n x k)
// A^T (k x m): cuBLASLt's first operand is our B, its second our A.
Gemms::Plan& Gemms::plan(const ops::MatmulDims& d, DType ab, DType c_dtype, bool accumulate,
                         bool bias) {
  const CublasLt& lt = cublaslt();
  const Key key{d.batch, d.m, d.n, d.k, d.trans_a, d.trans_b, d.broadcast_b, d.lda, d.ldb, d.ldc,
                ab, c_dtype, accumulate, bias};
  auto found = plans_.find(key);
  if (found != plans_.end()) return found->second;
  MESHTRAIN_CHECK(d.batch >= 1 && d.m > 0 && d.n > 0 && d.k > 0,
                  "cublasLt: bad matmul dims batch={} m={} n={} k={}", d.batch, d.m, d.n, d.k);
  MESHTRAIN_CHECK(!accumulate || c_dtype == DType::f32, "cublasLt: accumulating needs an f32 C");
  Plan p;
  check(lt.desc_create(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  const cublasOperation_t op_first = d.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_second = d.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  set(p.op, CUBLASLT_MATMUL_DESC_TRANSA, op_first);
  set(p.op, CUBLASLT_MATMUL_DESC_TRANSB, op_second);
  if (bias) {
    set(p.op, CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_BIAS);
    set(p.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, CUDA_R_32F);
  }
  const int64_t ldb = d.ldb > 0 ? d.ldb : (d.trans_b ? d.k : d.n);
  const int64_t lda = d.lda > 0 ? d.lda : (d.trans_a ? d.m : d.k);
  const int64_t ldc = d.ldc > 0 ? d.ldc : d.n;
  p.a = d.trans_b ? layout(ab, d.k, d.n, ldb, d.batch, d.broadcast_b ? 0 : d.k * d.n)
                  : layout(ab, d.n, d.k, ldb, d.batch, d.broadcast_b ? 0 : d.k * d.n);
  p.b = d.trans_a ? layout(ab, d.m, d.k, lda, d.batch, d.m * d.k)
                  : layout(ab, d.k, d.m, lda, d.batch, d.m * d.k);
  p.c = layout(c_dtype, d.n, d.m, ldc, d.batch, d.m * d.n);

  cublasLtMatmulPreference_t preference = nullptr;
  check(lt.preference_create(&preference), "cublasLtMatmulPreferenceCreate");
  const size_t bytes = kGemmWorkspace;
  check(lt.preference_set(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                             &bytes, sizeof bytes),
        "cublasLtMatmulPreferenceSetAttribute");
  cublasLtMatmulHeuristicResult_t result{};
  int found_count = 0;
  const cublasStatus_t status = lt.heuristic(
      handle_, p.op, p.a, p.b, p.c, p.c, preference, 1, &result, &found_count);
  lt.preference_destroy(preference);
  if (status != CUBLAS_STATUS_SUCCESS || found_count == 0) {
    lt.layout_destroy(p.a);
    lt.layout_destroy(p.b);
    lt.layout_destroy(p.c);
    lt.desc_destroy(p.op);
    fail_as(ErrorKind::resource,
            "cublasLt: no algorithm for batch {} m {} n {} k {} ({}{} x {}{} -> {}, status {})",
            d.batch, d.m, d.n, d.k, dtype_name(ab), d.trans_a ? "^T" : "", dtype_name(ab),
            d.trans_b ? "^T" : "", dtype_name(c_dtype), static_cast<int>(status));
  }
  p.algo = result.algo;
  return plans_.emplace(key, p).first->second;
}

void Gemms::prepare(const ops::MatmulDims& dims, DType ab, DType c_dtype, bool accumulate,
                    bool bias) {
  plan(dims, ab, c_dtype, accumulate, bias);
}

void Gemms::run(const ops::MatmulDims& dims, DType ab, const void* a, const void* b, DType c_dtype,
                void* c, float alpha, bool accumulate, const float* bias, const void* c_in) {
  const CublasLt& lt = cublaslt();
  Plan& p = plan(dims, ab, c_dtype, accumulate, bias != nullptr);
  if (bias != nullptr) set(p.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias);
  const float beta = accumulate ? 1.0f : 0.0f;
  const void* from = accumulate && c_in != nullptr ? c_in : c;
  check(lt.matmul(handle_, p.op, &alpha, b, p.a, a, p.b, &beta, from, p.c, c, p.c, &p.algo,
                       workspace_, kGemmWorkspace, stream_),
        "cublasLtMatmul");
}

}  // namespace meshtrain::cuda
