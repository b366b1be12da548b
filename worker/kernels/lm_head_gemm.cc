#include "worker/kernels/lm_head_gemm.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "oneapi/dnnl/dnnl.hpp"
#include "worker/kernels/simd.h"

namespace logprob::kernels {

using dt = dnnl::memory::data_type;
using tag = dnnl::memory::format_tag;

/// The one matmul shape every Compute runs, whatever M: a tile of
/// kTileRows hidden rows times kTileCols lm_head rows. oneDNN picks its
/// kernel and K blocking per shape, so one shape makes a row's logits
/// bitwise independent of M and of the row's position (batch invariance,
/// tests/lm_head_invariance_test.cc); tiles of 64 x 128 keep the weight
/// tile (128 x H) in cache across the row tiles that reuse it.
constexpr int64_t kTileRows = 64, kTileCols = kLmHeadTileCols;

/// oneDNN state: CPU engine, the tile matmul (user-managed scratchpad, so
/// threads run it concurrently), and the scratch buffer for hidden states
/// not already in compute dtype.
struct LmHeadGemm::Impl {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::matmul tile;  // [kTileRows, H] x [H, kTileCols] -> [kTileRows, kTileCols]
  dnnl::memory::desc src_md, w_md, dst_md, scratch_md;
  std::vector<char> hidden_buf;  // [M, H] of compute dtype
  // Per OpenMP thread: one column tile of weights converted to the
  // operands ([kTileCols, H] of compute dtype), when they are not already.
  std::vector<std::vector<char>> weight_tiles;
  int threads = 0;  // > 0: omp_set_num_threads before use
};

bool Bf16MatmulSupported() {
  static const bool supported = [] {
    try {
      const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
      const dnnl::memory::desc a({1, 16}, dt::bf16, tag::ab), b({16, 16}, dt::bf16, tag::ba),
          c({1, 16}, dt::f32, tag::ab);
      dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), engine);
      return true;
    } catch (const dnnl::error&) {
      return false;
    }
  }();
  return supported;
}

absl::StatusOr<DType> GemmComputeDType(LmHeadPrecision p, LmHeadCpuKernel kernel) {
  if (p != LmHeadPrecision::kBf16 || kernel == LmHeadCpuKernel::kWiden) return v1::F32;
  if (Bf16MatmulSupported()) return v1::BF16;
  if (kernel == LmHeadCpuKernel::kAuto) return v1::F32;
  return absl::FailedPreconditionError(
      "the lm_head CPU kernel 'bf16' (a bf16 x bf16 -> f32 matmul) was chosen for the pool, and this CPU's oneDNN "
      "has none (it needs avx512_core or newer): start the front-end with --lm-head-cpu-kernel widen, which computes "
      "the same bf16 products on every x86 CPU");
}

LmHeadGemm::LmHeadGemm(DType weight_dtype, DType compute_dtype, LmHeadPrecision precision, HostBytes weight,
                       int64_t rows, int64_t hidden_size)
    : weight_dtype_(weight_dtype),
      compute_dtype_(compute_dtype),
      precision_(precision),
      weight_(std::move(weight)),
      rows_(rows),
      hidden_size_(hidden_size) {
  // The last column tile when rows_ is not a whole number of tiles: its
  // rows as operands then zero rows, in a buffer of its own (the weight
  // may be a read-only mapping, and whole tiles are read in place).
  const int64_t full = rows_ / kTileCols * kTileCols;
  if (full < rows_) {
    const size_t row_bytes = static_cast<size_t>(hidden_size_) * DTypeSize(compute_dtype_);
    tail_.assign(static_cast<size_t>(kTileCols) * row_bytes, 0);
    ToOperands(weight_dtype_, weight_.data() + full * hidden_size_ * DTypeSize(weight_dtype_),
               static_cast<size_t>((rows_ - full) * hidden_size_), compute_dtype_, precision_, tail_.data());
  }
}

LmHeadGemm::~LmHeadGemm() = default;

absl::Status CheckLmHeadWeight(DType dtype, size_t weight_bytes, int64_t rows, int64_t hidden_size) {
  if (!IsFloatDType(dtype))
    return absl::InvalidArgumentError(
        absl::StrCat("lm_head weight dtype must be F32, BF16 or F16, got ", DTypeName(dtype)));
  if (rows <= 0 || hidden_size <= 0)
    return absl::InvalidArgumentError(
        absl::StrCat("lm_head slice shape must be positive, got [", rows, ", ", hidden_size, "]"));
  const int64_t esize = static_cast<int64_t>(DTypeSize(dtype));
  if (rows > std::numeric_limits<int64_t>::max() / hidden_size / esize ||
      static_cast<int64_t>(weight_bytes) != rows * hidden_size * esize)
    return absl::InvalidArgumentError(absl::StrCat("lm_head weight has ", weight_bytes, " bytes, expected [", rows,
                                                   ", ", hidden_size, "] x ", esize));
  return absl::OkStatus();
}

namespace {

/// Rounds `n` f32 values, widened exactly from `source`, to the operands
/// of precision `p` on an f32 GEMM: bf16 (as the bf16 matmul would see
/// them) or tf32 (bf16 and f16 values already are); fp32 leaves them.
void RoundToOperands(float* f, size_t n, DType source, LmHeadPrecision p) {
  if (p == LmHeadPrecision::kBf16 && source != v1::BF16)
    for (size_t i = 0; i < n; ++i) f[i] = Bf16ToFloat(FloatToBf16(f[i]));
  if (p == LmHeadPrecision::kTf32 && source == v1::F32)
    for (size_t i = 0; i < n; ++i) f[i] = RoundToTf32(f[i]);
}

}  // namespace

bool IsGemmOperand(DType from, DType compute, LmHeadPrecision p) {
  if (from != compute) return false;
  // f32 values are an f32 GEMM's operands only at fp32 precision (bf16 and
  // tf32 round them first).
  return compute != v1::F32 || (p != LmHeadPrecision::kBf16 && p != LmHeadPrecision::kTf32);
}

void ToOperands(DType from, const void* src, size_t n, DType compute, LmHeadPrecision p, void* dst) {
  if (compute == v1::BF16) {  // f32 -> bf16 RNE; f16 -> f32 (exact) -> bf16 RNE; bf16 copied
    auto* out = static_cast<uint16_t*>(dst);
    float tmp[256];
    for (size_t i = 0; i < n; i += 256) {
      const size_t k = std::min<size_t>(256, n - i);
      ToFloat(from, static_cast<const char*>(src) + i * DTypeSize(from), k, tmp);
      for (size_t j = 0; j < k; ++j) out[i + j] = FloatToBf16(tmp[j]);
    }
    return;
  }
  // f32 compute: widen exactly (in vectors), then round to the precision's operands
  auto* f = static_cast<float*>(dst);
  WidenToFloat(from, src, n, f);
  RoundToOperands(f, n, from, p);
}

absl::StatusOr<std::unique_ptr<LmHeadGemm>> LmHeadGemm::Create(DType dtype, HostBytes weight, int64_t rows,
                                                               int64_t hidden_size, int threads,
                                                               LmHeadPrecision precision, LmHeadCpuKernel kernel) {
  LOGPROB_RETURN_IF_ERROR(CheckLmHeadWeight(dtype, weight.size(), rows, hidden_size));
  const LmHeadPrecision p = ResolveLmHeadPrecision(precision, dtype);
  // The weights stay as given (a mapping stays shared with its file, and a
  // new version allocates nothing); Compute converts each column tile to
  // the operands as it multiplies it (ToOperands), when they differ.
  LOGPROB_ASSIGN_OR_RETURN(const DType compute, GemmComputeDType(p, kernel));
  // oneDNN's OpenMP runtime sizes its parallel regions by the calling
  // thread's omp_get_max_threads(); the cap is set here and again before
  // each Compute (the OpenMP ICV is per thread).
  if (threads > 0) omp_set_num_threads(threads);
  std::unique_ptr<LmHeadGemm> g(new LmHeadGemm(dtype, compute, p, std::move(weight), rows, hidden_size));
  try {
    g->impl_ = std::make_unique<Impl>();
    Impl& im = *g->impl_;
    const dt cdt = compute == v1::BF16 ? dt::bf16 : dt::f32;
    im.src_md = dnnl::memory::desc({kTileRows, hidden_size}, cdt, tag::ab);
    im.w_md = dnnl::memory::desc({hidden_size, kTileCols}, cdt, tag::ba);  // checkpoint [N, H] row-major
    im.dst_md = dnnl::memory::desc({kTileRows, kTileCols}, dt::f32, tag::ab);
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(im.src_md, im.w_md, im.dst_md), attr, im.engine);
    im.scratch_md = pd.scratchpad_desc();
    im.tile = dnnl::matmul(pd);
  } catch (const dnnl::error& e) {
    return absl::InternalError(absl::StrCat("oneDNN matmul [", kTileRows, ", ", hidden_size, "] x [", hidden_size, ", ",
                                            kTileCols, "]: ", e.what()));
  }
  g->impl_->threads = threads;
  return g;
}

absl::Status CheckHiddenStatesDType(DType dtype) {
  if (IsFloatDType(dtype)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("hidden states dtype must be F32, BF16 or F16, got ", DTypeName(dtype)));
}

absl::Status LmHeadGemm::Compute(DType hidden_dtype, const void* hidden, int64_t M, float* out) {
  LOGPROB_RETURN_IF_ERROR(CheckHiddenStatesDType(hidden_dtype));
  if (M < 0) return absl::InvalidArgumentError(absl::StrCat("negative row count ", M));
  if (M == 0) return absl::OkStatus();
  if (hidden == nullptr || out == nullptr) return absl::InvalidArgumentError("null hidden or output buffer");

  const int64_t H = hidden_size_, N = rows_;
  const size_t n = static_cast<size_t>(M * H);
  // Bring the hidden states to the compute operands (no copy when they are).
  const void* src = hidden;
  if (!IsGemmOperand(hidden_dtype, compute_dtype_, precision_)) {
    auto& buf = impl_->hidden_buf;
    buf.resize(n * DTypeSize(compute_dtype_));
    ToOperands(hidden_dtype, hidden, n, compute_dtype_, precision_, buf.data());
    src = buf.data();
  }

  // Column tiles are spread over the OpenMP threads; each runs whole tiles
  // (oneDNN runs sequentially inside a parallel region), over every row
  // tile, so a weight tile is read from memory once per Compute.
  if (impl_->threads > 0) omp_set_num_threads(impl_->threads);
  Impl& im = *impl_;
  const size_t row_bytes = static_cast<size_t>(H) * DTypeSize(compute_dtype_);
  const size_t weight_row_bytes = static_cast<size_t>(H) * DTypeSize(weight_dtype_);
  // Weights not already operands: each thread converts a column tile into
  // its own buffer (kept across calls: no page faults per Compute).
  const bool convert = !IsGemmOperand(weight_dtype_, compute_dtype_, precision_);
  if (convert) {
    im.weight_tiles.resize(std::max<size_t>(im.weight_tiles.size(), static_cast<size_t>(omp_get_max_threads())));
    for (auto& t : im.weight_tiles) t.resize(kTileCols * row_bytes);
  }
  const int64_t col_tiles = (N + kTileCols - 1) / kTileCols, row_tiles = (M + kTileRows - 1) / kTileRows;
  std::string error;
#pragma omp parallel
  {
    std::vector<char> src_pad(kTileRows * row_bytes, 0), scratch(im.scratch_md.get_size());
    std::vector<float> dst(kTileRows * kTileCols);
    // Exceptions stay inside each iteration: none may leave the worksharing loop.
#pragma omp for schedule(static)
    for (int64_t ct = 0; ct < col_tiles; ++ct) {
      try {
        dnnl::stream stream(im.engine);
        dnnl::memory scratch_m(im.scratch_md, im.engine, scratch.data());
        dnnl::memory dst_m(im.dst_md, im.engine, dst.data());
        const int64_t c0 = ct * kTileCols, cols = std::min(kTileCols, N - c0);
        const char* w = tail_.data();
        if (cols == kTileCols && !convert) {
          w = weight_.data() + c0 * row_bytes;
        } else if (cols == kTileCols) {
          char* tile = im.weight_tiles[static_cast<size_t>(omp_get_thread_num())].data();
          ToOperands(weight_dtype_, weight_.data() + c0 * weight_row_bytes, static_cast<size_t>(kTileCols * H),
                     compute_dtype_, precision_, tile);
          w = tile;
        }
        dnnl::memory w_m(im.w_md, im.engine, const_cast<char*>(w));
        for (int64_t rt = 0; rt < row_tiles; ++rt) {
          const int64_t r0 = rt * kTileRows, rows = std::min(kTileRows, M - r0);
          const char* a = static_cast<const char*>(src) + r0 * row_bytes;
          if (rows < kTileRows) {  // the last row tile: zero-padded copy
            std::memcpy(src_pad.data(), a, rows * row_bytes);
            std::memset(src_pad.data() + rows * row_bytes, 0, (kTileRows - rows) * row_bytes);
            a = src_pad.data();
          }
          dnnl::memory src_m(im.src_md, im.engine, const_cast<char*>(a));
          im.tile.execute(stream, {{DNNL_ARG_SRC, src_m},
                                   {DNNL_ARG_WEIGHTS, w_m},
                                   {DNNL_ARG_DST, dst_m},
                                   {DNNL_ARG_SCRATCHPAD, scratch_m}});
          stream.wait();
          for (int64_t i = 0; i < rows; ++i)
            std::memcpy(out + (r0 + i) * N + c0, dst.data() + i * kTileCols, cols * sizeof(float));
        }
      } catch (const dnnl::error& e) {
#pragma omp critical
        error = e.what();
      }
    }
  }
  if (!error.empty())
    return absl::InternalError(absl::StrCat("oneDNN matmul [", M, ", ", H, "] x [", H, ", ", N, "]: ", error));
  return absl::OkStatus();
}

}  // namespace logprob::kernels
