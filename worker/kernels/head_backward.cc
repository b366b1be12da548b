#include "worker/kernels/head_backward.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "oneapi/dnnl/dnnl.hpp"
#include "worker/kernels/lm_head_transform_simd.h"

namespace logprob::kernels {

using dt = dnnl::memory::data_type;
using tag = dnnl::memory::format_tag;

/// The matmul shapes every Run uses, whatever M (as the forward's tile:
/// one shape, so a row's dL/dh is bitwise independent of M and of its
/// position): row tiles of kRows hidden rows, column tiles of kCols
/// vocabulary rows.
constexpr int64_t kRows = 64, kCols = kLmHeadTileCols;
/// Rows per chunk (whole row tiles): Run and RunOnLogits take the rows a
/// chunk at a time, and within a chunk the column tiles are the outer
/// loop (a column tile's weights are converted once per chunk, not once
/// per row tile). It bounds the memory a call holds (the header's Run).
constexpr int64_t kChunkRows = 4 * kRows;

void LogitGradients(const LmHeadTransform& t, float temperature, const BackwardRows& rows, int64_t M,
                    int64_t vocab_begin, int64_t C, float* logits) {
  const double scale = static_cast<float>(t.logit_scale), cap = static_cast<float>(t.softcap);
  const double inv_t = 1.0 / static_cast<double>(temperature);
  for (int64_t i = 0; i < M; ++i) {
    float* z = logits + i * C;
    const bool scored = rows.targets != nullptr && rows.targets[i] >= 0;
    const double g_lp = scored && rows.grad_logprobs ? rows.grad_logprobs[i] : 0.0;
    const double g_ent = rows.grad_entropy ? rows.grad_entropy[i] : 0.0;
    const double lse = rows.lse[i];
    const double ent = g_ent != 0.0 ? static_cast<double>(rows.entropy[i]) : 0.0;
    const int64_t target = scored ? rows.targets[i] - vocab_begin : -1;
    for (int64_t v = 0; v < C; ++v) {
      // x as the forward computed it: z / T in float32.
      const float xf = temperature != 1.0f ? z[v] / temperature : z[v];
      const double x = xf, p = std::exp(x - lse);
      double gx = -g_lp * p - g_ent * p * (x - lse + ent);
      if (v == target) gx += g_lp;
      double gy = gx * inv_t * scale;
      if (cap != 0.0) {
        const double r = static_cast<double>(z[v]) / cap;
        gy *= 1.0 - r * r;
      }
      z[v] = static_cast<float>(gy);
    }
  }
}

/// oneDNN state: the two tile matmuls (user-managed scratchpads, so
/// threads run them concurrently) and the buffers Run reuses.
struct HeadSliceBackward::Impl {
  LmHeadGemm* gemm = nullptr;
  int64_t vocab_begin = 0;
  const float* bias = nullptr;
  LmHeadTransform transform;
  float temperature = 1.0f;
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  // dh: [kRows, kCols] x [kCols, H] -> [kRows, H]
  dnnl::matmul dh;
  dnnl::memory::desc dh_src, dh_w, dh_dst, dh_scratch;
  // dW: [kCols, kRows] x [kRows, H] -> [kCols, H]
  dnnl::matmul dw;
  dnnl::memory::desc dw_src, dw_w, dw_dst, dw_scratch;
  std::vector<float> logits;  // Run: [min(M, kChunkRows), V_slice]: a chunk's logits, then dL/dy
  std::vector<float> hidden;  // [kChunkRows, H]: a chunk's rows as f32 operands, zero-padded to whole row tiles
};

HeadSliceBackward::HeadSliceBackward(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HeadSliceBackward::~HeadSliceBackward() = default;
LmHeadGemm& HeadSliceBackward::gemm() const { return *impl_->gemm; }
const LmHeadTransform& HeadSliceBackward::transform() const { return impl_->transform; }
const float* HeadSliceBackward::bias() const { return impl_->bias; }
int64_t HeadSliceBackward::vocab_begin() const { return impl_->vocab_begin; }
float HeadSliceBackward::temperature() const { return impl_->temperature; }

absl::StatusOr<std::unique_ptr<HeadSliceBackward>> HeadSliceBackward::Create(LmHeadGemm* gemm, int64_t vocab_begin,
                                                                             const float* bias,
                                                                             const LmHeadTransform& t,
                                                                             float temperature) {
  if (gemm == nullptr) return absl::InvalidArgumentError("null lm_head GEMM");
  if (!(temperature > 0.0f))
    return absl::InvalidArgumentError(absl::StrCat("temperature must be > 0, got ", temperature));
  if (t.has_bias && bias == nullptr) return absl::InvalidArgumentError("the head has a bias and none was given");
  auto im = std::make_unique<Impl>();
  im->gemm = gemm;
  im->vocab_begin = vocab_begin;
  im->bias = t.has_bias ? bias : nullptr;
  im->transform = t;
  im->temperature = temperature;
  const int64_t H = gemm->hidden_size();
  try {
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    im->dh_src = dnnl::memory::desc({kRows, kCols}, dt::f32, tag::ab);
    im->dh_w = dnnl::memory::desc({kCols, H}, dt::f32, tag::ab);
    im->dh_dst = dnnl::memory::desc({kRows, H}, dt::f32, tag::ab);
    dnnl::matmul::primitive_desc dh_pd(dnnl::matmul::desc(im->dh_src, im->dh_w, im->dh_dst), attr, im->engine);
    im->dh_scratch = dh_pd.scratchpad_desc();
    im->dh = dnnl::matmul(dh_pd);
    im->dw_src = dnnl::memory::desc({kCols, kRows}, dt::f32, tag::ab);
    im->dw_w = dnnl::memory::desc({kRows, H}, dt::f32, tag::ab);
    im->dw_dst = dnnl::memory::desc({kCols, H}, dt::f32, tag::ab);
    dnnl::matmul::primitive_desc dw_pd(dnnl::matmul::desc(im->dw_src, im->dw_w, im->dw_dst), attr, im->engine);
    im->dw_scratch = dw_pd.scratchpad_desc();
    im->dw = dnnl::matmul(dw_pd);
  } catch (const dnnl::error& e) {
    return absl::InternalError(absl::StrCat("oneDNN backward matmuls (H = ", H, "): ", e.what()));
  }
  return std::unique_ptr<HeadSliceBackward>(new HeadSliceBackward(std::move(im)));
}

absl::Status HeadSliceBackward::CheckRun(DType hidden_dtype, const void* hidden, int64_t M, const BackwardRows& rows,
                                         const float* grad_hidden) const {
  LOGPROB_RETURN_IF_ERROR(CheckHiddenStatesDType(hidden_dtype));
  if (M < 0) return absl::InvalidArgumentError(absl::StrCat("negative row count ", M));
  if (M > 0 && (hidden == nullptr || grad_hidden == nullptr || rows.lse == nullptr))
    return absl::InvalidArgumentError("null hidden states, lse or dL/dh buffer");
  if (rows.grad_entropy != nullptr && rows.entropy == nullptr)
    return absl::InvalidArgumentError("an entropy gradient needs the forward's entropy");
  return absl::OkStatus();
}

absl::Status HeadSliceBackward::Run(DType hidden_dtype, const void* hidden, int64_t M, const BackwardRows& rows,
                                    float* grad_hidden, float* grad_weight, float* grad_bias) {
  LOGPROB_RETURN_IF_ERROR(CheckRun(hidden_dtype, hidden, M, rows, grad_hidden));
  Impl& im = *impl_;
  const int64_t V = im.gemm->rows();
  const size_t hidden_row_bytes = static_cast<size_t>(im.gemm->hidden_size()) * DTypeSize(hidden_dtype);
  if (M > 0) im.logits.resize(static_cast<size_t>(std::min(M, kChunkRows) * V));
  for (int64_t r0 = 0; r0 < M; r0 += kChunkRows) {
    const int64_t m = std::min(kChunkRows, M - r0);
    // The logits of the chunk, as the forward computed them.
    LOGPROB_RETURN_IF_ERROR(
        im.gemm->Compute(hidden_dtype, static_cast<const char*>(hidden) + r0 * hidden_row_bytes, m, im.logits.data()));
    ApplyLmHeadTransformSimd(im.transform, im.bias, m, V, im.logits.data());
    LOGPROB_RETURN_IF_ERROR(
        Chunk(hidden_dtype, hidden, r0, m, &rows, im.logits.data(), grad_hidden, grad_weight, grad_bias));
  }
  return absl::OkStatus();
}

absl::Status HeadSliceBackward::RunOnLogits(DType hidden_dtype, const void* hidden, int64_t M, const BackwardRows& rows,
                                            float* logits, float* grad_hidden, float* grad_weight, float* grad_bias) {
  LOGPROB_RETURN_IF_ERROR(CheckRun(hidden_dtype, hidden, M, rows, grad_hidden));
  if (M > 0 && logits == nullptr) return absl::InvalidArgumentError("null logits");
  const int64_t V = impl_->gemm->rows();
  for (int64_t r0 = 0; r0 < M; r0 += kChunkRows) {
    const int64_t m = std::min(kChunkRows, M - r0);
    LOGPROB_RETURN_IF_ERROR(
        Chunk(hidden_dtype, hidden, r0, m, &rows, logits + r0 * V, grad_hidden, grad_weight, grad_bias));
  }
  return absl::OkStatus();
}

absl::Status HeadSliceBackward::RunOnLogitGradients(DType hidden_dtype, const void* hidden, int64_t M,
                                                    float* logit_grads, float* grad_hidden, float* grad_weight,
                                                    float* grad_bias) {
  LOGPROB_RETURN_IF_ERROR(kernels::CheckHiddenStatesDType(hidden_dtype));
  if (M < 0) return absl::InvalidArgumentError(absl::StrCat("negative row count ", M));
  if (M > 0 && (hidden == nullptr || grad_hidden == nullptr || logit_grads == nullptr))
    return absl::InvalidArgumentError("null hidden states, dL/dy or dL/dh buffer");
  const int64_t V = impl_->gemm->rows();
  for (int64_t r0 = 0; r0 < M; r0 += kChunkRows) {
    const int64_t m = std::min(kChunkRows, M - r0);
    LOGPROB_RETURN_IF_ERROR(
        Chunk(hidden_dtype, hidden, r0, m, nullptr, logit_grads + r0 * V, grad_hidden, grad_weight, grad_bias));
  }
  return absl::OkStatus();
}

absl::Status HeadSliceBackward::Chunk(DType hidden_dtype, const void* hidden, int64_t r0, int64_t m,
                                      const BackwardRows* rows_or_null, float* z, float* grad_hidden,
                                      float* grad_weight, float* grad_bias) {
  Impl& im = *impl_;
  LmHeadGemm& gemm = *im.gemm;
  const int64_t H = gemm.hidden_size(), V = gemm.rows();
  const size_t hidden_row_bytes = static_cast<size_t>(H) * DTypeSize(hidden_dtype);
  const size_t weight_row_bytes = static_cast<size_t>(H) * DTypeSize(gemm.weight_dtype());
  const int64_t col_tiles = (V + kCols - 1) / kCols, row_tiles = (m + kRows - 1) / kRows;
  // The hidden rows as the GEMM's operands saw them (dL/dW's operand), in
  // f32, zero-padded to whole row tiles.
  if (grad_weight != nullptr) {
    im.hidden.resize(static_cast<size_t>(row_tiles * kRows * H));
    ToOperands(hidden_dtype, static_cast<const char*>(hidden) + r0 * hidden_row_bytes, static_cast<size_t>(m * H),
               v1::F32, gemm.precision(), im.hidden.data());
    std::fill(im.hidden.begin() + m * H, im.hidden.begin() + row_tiles * kRows * H, 0.0f);
  }

  // Threads take contiguous runs of column tiles (static schedule) and
  // each takes its tiles in order, every row tile of a column tile before
  // the next column tile (whose weights it converts once): dL/dh sums each
  // thread's tiles in order, then the threads' sums in thread order, so a
  // row's sum is the same whatever the rows beside it; dL/dW and dL/db of
  // a column tile belong to its thread, which adds the row tiles in order.
  // Thread 0 sums into grad_hidden itself, the others into partial[me].
  const int threads = omp_get_max_threads();
  float* const out = grad_hidden + r0 * H;
  std::vector<std::vector<float>> partial(static_cast<size_t>(threads));
  std::string error;
#pragma omp parallel num_threads(threads)
  {
    // dL/dy of the chunk's rows (each element its own: any split of the
    // rows gives the same bits), before any column tile reads them; given
    // already without `rows_or_null`.
#pragma omp for schedule(static)
    for (int64_t i = 0; i < m; ++i) {
      if (rows_or_null == nullptr) continue;
      const BackwardRows& rows = *rows_or_null;
      const int64_t r = r0 + i;
      BackwardRows row = rows;
      row.targets = rows.targets ? rows.targets + r : nullptr;
      row.lse = rows.lse + r;
      row.entropy = rows.entropy ? rows.entropy + r : nullptr;
      row.grad_logprobs = rows.grad_logprobs ? rows.grad_logprobs + r : nullptr;
      row.grad_entropy = rows.grad_entropy ? rows.grad_entropy + r : nullptr;
      LogitGradients(im.transform, im.temperature, row, 1, im.vocab_begin, V, z + i * V);
    }  // (a barrier)
    const int me = omp_get_thread_num();
    float* acc = out;
    if (me == 0) {
      std::fill(out, out + m * H, 0.0f);
    } else {
      partial[static_cast<size_t>(me)].assign(static_cast<size_t>(m * H), 0.0f);
      acc = partial[static_cast<size_t>(me)].data();
    }
    // The thread's tile buffers: gradients [kRows, kCols] and their
    // transpose (zero-padded), a column tile's weights as operands
    // [kCols, H] (zero-padded), the matmuls' outputs and scratchpads.
    std::vector<float> g(kRows * kCols), w(kCols * H), dst_h(kRows * H), gt, dst_w;
    std::vector<char> scratch_h(im.dh_scratch.get_size()), scratch_w;
    if (grad_weight != nullptr) {
      gt.resize(kCols * kRows);
      dst_w.resize(kCols * H);
      scratch_w.resize(im.dw_scratch.get_size());
    }
    dnnl::stream stream;
    dnnl::memory g_mem, w_mem, dst_h_mem, scratch_h_mem, gt_mem, h_mem, dst_w_mem, scratch_w_mem;
    bool ready = false;
    try {
      stream = dnnl::stream(im.engine);
      g_mem = dnnl::memory(im.dh_src, im.engine, g.data());
      w_mem = dnnl::memory(im.dh_w, im.engine, w.data());
      dst_h_mem = dnnl::memory(im.dh_dst, im.engine, dst_h.data());
      scratch_h_mem = dnnl::memory(im.dh_scratch, im.engine, scratch_h.data());
      if (grad_weight != nullptr) {
        gt_mem = dnnl::memory(im.dw_src, im.engine, gt.data());
        h_mem = dnnl::memory(im.dw_w, im.engine, im.hidden.data());
        dst_w_mem = dnnl::memory(im.dw_dst, im.engine, dst_w.data());
        scratch_w_mem = dnnl::memory(im.dw_scratch, im.engine, scratch_w.data());
      }
      ready = true;
    } catch (const dnnl::error& e) {
#pragma omp critical
      error = e.what();
    }
#pragma omp for schedule(static)
    for (int64_t ct = 0; ct < col_tiles; ++ct) {
      if (!ready) continue;
      try {
        const int64_t c0 = ct * kCols, cols = std::min(kCols, V - c0);
        // The tile's weights as the GEMM's operands, in f32, zero-padded.
        std::fill(w.begin() + cols * H, w.end(), 0.0f);
        ToOperands(gemm.weight_dtype(), gemm.weight_data() + c0 * weight_row_bytes, static_cast<size_t>(cols * H),
                   v1::F32, gemm.precision(), w.data());
        for (int64_t rt = 0; rt < row_tiles; ++rt) {
          const int64_t i0 = rt * kRows, mt = std::min(kRows, m - i0);
          // The row tile's gradients of the column tile, zero-padded.
          for (int64_t i = 0; i < mt; ++i) {
            std::memcpy(g.data() + i * kCols, z + (i0 + i) * V + c0, cols * sizeof(float));
            std::fill(g.begin() + i * kCols + cols, g.begin() + (i + 1) * kCols, 0.0f);
          }
          std::fill(g.begin() + mt * kCols, g.end(), 0.0f);
          im.dh.execute(stream, {{DNNL_ARG_SRC, g_mem},
                                 {DNNL_ARG_WEIGHTS, w_mem},
                                 {DNNL_ARG_DST, dst_h_mem},
                                 {DNNL_ARG_SCRATCHPAD, scratch_h_mem}});
          stream.wait();
          float* a = acc + i0 * H;
          for (int64_t k = 0; k < mt * H; ++k) a[k] += dst_h[k];
          if (grad_weight != nullptr) {
            for (int64_t i = 0; i < kRows; ++i)
              for (int64_t c = 0; c < kCols; ++c) gt[c * kRows + i] = g[i * kCols + c];
            h_mem.set_data_handle(im.hidden.data() + i0 * H);
            im.dw.execute(stream, {{DNNL_ARG_SRC, gt_mem},
                                   {DNNL_ARG_WEIGHTS, h_mem},
                                   {DNNL_ARG_DST, dst_w_mem},
                                   {DNNL_ARG_SCRATCHPAD, scratch_w_mem}});
            stream.wait();
            float* dw = grad_weight + c0 * H;
            for (int64_t k = 0; k < cols * H; ++k) dw[k] += dst_w[k];
          }
          if (grad_bias != nullptr)
            for (int64_t c = 0; c < cols; ++c) {
              float s = 0.0f;
              for (int64_t i = 0; i < mt; ++i) s += g[i * kCols + c];
              grad_bias[c0 + c] += s;
            }
        }
      } catch (const dnnl::error& e) {
#pragma omp critical
        error = e.what();
      }
    }
  }
  if (!error.empty()) return absl::InternalError(absl::StrCat("oneDNN backward matmul: ", error));
  for (int q = 1; q < threads; ++q) {
    const std::vector<float>& p = partial[static_cast<size_t>(q)];
    if (p.empty()) continue;  // a smaller team than asked for
    for (int64_t k = 0; k < m * H; ++k) out[k] += p[k];
  }
  return absl::OkStatus();
}

}  // namespace logprob::kernels
