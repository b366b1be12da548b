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

namespace logprob::kernels {

using dt = dnnl::memory::data_type;
using tag = dnnl::memory::format_tag;

/// The one matmul shape every Compute runs, whatever M: a tile of
/// kTileRows hidden rows times kTileCols lm_head rows. oneDNN picks its
/// kernel and K blocking per shape, so one shape makes a row's logits
/// bitwise independent of M and of the row's position (batch invariance,
/// tests/lm_head_invariance_test.cc); tiles of 64 x 128 keep the weight
/// tile (128 x H) in cache across the row tiles that reuse it.
constexpr int64_t kTileRows = 64, kTileCols = 128;

/// oneDNN state: CPU engine, the tile matmul (user-managed scratchpad, so
/// threads run it concurrently), and the scratch buffer for hidden states
/// not already in compute dtype.
struct LmHeadGemm::Impl {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::matmul tile;  // [kTileRows, H] x [H, kTileCols] -> [kTileRows, kTileCols]
  dnnl::memory::desc src_md, w_md, dst_md, scratch_md;
  std::vector<char> hidden_buf;  // [M, H] of compute dtype
  int threads = 0;               // > 0: omp_set_num_threads before use
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

LmHeadGemm::LmHeadGemm(DType compute_dtype, HostBytes weight, int64_t rows, int64_t hidden_size)
    : compute_dtype_(compute_dtype), weight_(std::move(weight)), rows_(rows), hidden_size_(hidden_size) {
  // The last column tile when rows_ is not a whole number of tiles: its
  // rows then zero rows, in a buffer of its own (the weight may be a
  // read-only mapping, and whole tiles are read in place).
  const int64_t full = rows_ / kTileCols * kTileCols;
  if (full < rows_) {
    const size_t row_bytes = static_cast<size_t>(hidden_size_) * DTypeSize(compute_dtype_);
    tail_.assign(static_cast<size_t>(kTileCols) * row_bytes, 0);
    std::memcpy(tail_.data(), weight_.data() + full * row_bytes, static_cast<size_t>(rows_ - full) * row_bytes);
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

/// `n` elements of float dtype `dtype` widened exactly to f32 bytes.
std::vector<char> WidenToF32(DType dtype, const char* src, size_t n) {
  std::vector<char> wide(n * sizeof(float));
  ToFloat(dtype, src, n, reinterpret_cast<float*>(wide.data()));
  return wide;
}

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

absl::StatusOr<std::unique_ptr<LmHeadGemm>> LmHeadGemm::Create(DType dtype, HostBytes weight, int64_t rows,
                                                               int64_t hidden_size, int threads,
                                                               LmHeadPrecision precision) {
  LOGPROB_RETURN_IF_ERROR(CheckLmHeadWeight(dtype, weight.size(), rows, hidden_size));
  const LmHeadPrecision p = ResolveLmHeadPrecision(precision, dtype);
  const size_t n = static_cast<size_t>(rows * hidden_size);
  // Convert the weights once (the checkpoint-dtype bytes are let go on
  // return); weights already in compute dtype are used as given.
  DType compute = v1::F32;
  LmHeadPrecision hidden_rounding = LmHeadPrecision::kFp32;
  if (p == LmHeadPrecision::kBf16 && Bf16MatmulSupported()) {
    compute = v1::BF16;
    if (dtype != v1::BF16) {  // F32 / F16 -> bf16, round to nearest even
      const std::vector<char> wide = WidenToF32(dtype, weight.data(), n);
      const auto* f = reinterpret_cast<const float*>(wide.data());
      std::vector<char> narrow(n * sizeof(uint16_t));
      auto* b = reinterpret_cast<uint16_t*>(narrow.data());
      for (size_t i = 0; i < n; ++i) b[i] = FloatToBf16(f[i]);
      weight = HostBytes(std::move(narrow));
    }
  } else if (dtype != v1::F32 || p != LmHeadPrecision::kFp32) {
    // f32 compute: widen exactly, then round to the precision's operands
    std::vector<char> wide = WidenToF32(dtype, weight.data(), n);
    RoundToOperands(reinterpret_cast<float*>(wide.data()), n, dtype, p);
    if (p != LmHeadPrecision::kFp32) hidden_rounding = p;
    weight = HostBytes(std::move(wide));
  }
  // oneDNN's OpenMP runtime sizes its parallel regions by the calling
  // thread's omp_get_max_threads(); the cap is set here and again before
  // each Compute (the OpenMP ICV is per thread).
  if (threads > 0) omp_set_num_threads(threads);
  std::unique_ptr<LmHeadGemm> g(new LmHeadGemm(compute, std::move(weight), rows, hidden_size));
  g->precision_ = p;
  g->hidden_rounding_ = hidden_rounding;
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
  // Bring the hidden states to the compute dtype (no copy when they match).
  const void* src = hidden;
  if (hidden_dtype != compute_dtype_ || hidden_rounding_ != LmHeadPrecision::kFp32) {
    auto& buf = impl_->hidden_buf;
    if (compute_dtype_ == v1::BF16) {  // f32 -> bf16 RNE; f16 -> f32 (exact) -> bf16 RNE
      buf.resize(n * sizeof(uint16_t));
      auto* dst = reinterpret_cast<uint16_t*>(buf.data());
      float tmp[256];
      for (size_t i = 0; i < n; i += 256) {
        const size_t k = std::min<size_t>(256, n - i);
        const float* f;
        if (hidden_dtype == v1::F32) {
          f = static_cast<const float*>(hidden) + i;
        } else {
          ToFloat(hidden_dtype, static_cast<const char*>(hidden) + i * 2, k, tmp);
          f = tmp;
        }
        for (size_t j = 0; j < k; ++j) dst[i + j] = FloatToBf16(f[j]);
      }
    } else {  // compute F32: widen exactly, then round to the precision's operands
      buf.resize(n * sizeof(float));
      auto* f = reinterpret_cast<float*>(buf.data());
      ToFloat(hidden_dtype, hidden, n, f);
      RoundToOperands(f, n, hidden_dtype, hidden_rounding_);
    }
    src = buf.data();
  }

  // Column tiles are spread over the OpenMP threads; each runs whole tiles
  // (oneDNN runs sequentially inside a parallel region), over every row
  // tile, so a weight tile is read from memory once per Compute.
  if (impl_->threads > 0) omp_set_num_threads(impl_->threads);
  const Impl& im = *impl_;
  const size_t row_bytes = static_cast<size_t>(H) * DTypeSize(compute_dtype_);
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
        const char* w = cols == kTileCols ? weight_.data() + c0 * row_bytes : tail_.data();
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
