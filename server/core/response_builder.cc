#include "server/core/response_builder.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/untrusted_text.h"

namespace logprob {

absl::StatusOr<v1::ScoreResponse> BuildResponse(const ScoreJob& job, const Plan& plan,
                                                const std::vector<internal::v1::WorkResult>& results,
                                                int64_t row_begin) {
  if (results.size() != plan.items.size()) return absl::InternalError("worker results do not match the plan");
  const int64_t n_out = job.num_outputs();
  const int K = job.options.topk(), G = job.gather_k;
  v1::ScoreResponse resp;
  float* lp = AddOutput<float>(&resp, "token_logprobs", v1::F32, job.out_shape, -1, n_out);
  float* ent = job.options.entropy() ? AddOutput<float>(&resp, "entropy", v1::F32, job.out_shape, -1, n_out) : nullptr;
  float* lss = job.options.log_sum_sq_probs()
                   ? AddOutput<float>(&resp, "log_sum_sq_probs", v1::F32, job.out_shape, -1, n_out)
                   : nullptr;
  float* mlg =
      job.options.mean_logits() ? AddOutput<float>(&resp, "mean_logits", v1::F32, job.out_shape, -1, n_out) : nullptr;
  int32_t* top1 =
      job.options.is_top1() ? AddOutput<int32_t>(&resp, "is_top1", v1::I32, job.out_shape, -1, n_out) : nullptr;
  float* tkl = K ? AddOutput<float>(&resp, "topk_logprobs", v1::F32, job.out_shape, K, n_out) : nullptr;
  int64_t* tki = K ? AddOutput<int64_t>(&resp, "topk_indices", v1::I64, job.out_shape, K, n_out) : nullptr;
  float* gat = G ? AddOutput<float>(&resp, "gathered_logprobs", v1::F32, job.out_shape, G, n_out) : nullptr;
  // The backward's dL/dh, shaped like the hidden states: each row at its input row.
  const int64_t H = job.hidden_size;
  int64_t input_rows = 1;
  for (int64_t d : job.input_shape) input_rows *= d;
  float* gh =
      job.backward ? AddOutput<float>(&resp, "grad_hidden_states", v1::F32, job.input_shape, H, input_rows) : nullptr;

  int64_t covered = 0;
  for (size_t i = 0; i < results.size(); ++i) {
    const auto& r = results[i];
    const int64_t rows = r.row_end() - r.row_begin();
    if (rows < 0 || r.token_logprobs_size() != rows || (ent && r.entropy_size() != rows) ||
        (lss && r.log_sum_sq_probs_size() != rows) || (mlg && r.mean_logits_size() != rows) ||
        (top1 && r.is_top1_size() != rows) || r.topk_logprobs_size() != rows * K || r.topk_indices_size() != rows * K ||
        r.gathered_logprobs_size() != rows * G || (gh && r.grad_hidden_states_size() != rows * H))
      return absl::InternalError(absl::StrCat("worker ", plan.items[i].worker, " returned malformed results"));
    for (int64_t j = 0; j < rows; ++j) {
      const int64_t row = plan.items[i].row_offset + r.row_begin() + j - row_begin;
      if (row < 0 || row >= job.num_rows()) continue;  // another job of the batch
      const int64_t o = job.out_pos[row];
      ++covered;
      if (gh) {
        const int64_t in_row = job.rows[row];
        if (in_row < 0 || in_row >= input_rows)
          return absl::InternalError(absl::StrCat("row ", row, " has input row ", in_row, " of ", input_rows));
        std::copy_n(r.grad_hidden_states().data() + j * H, H, gh + in_row * H);
      }
      if (o < 0) continue;  // an unscored row of a CUDA IPC job (ScoreJob::cuda_ipc)
      lp[o] = r.token_logprobs(static_cast<int>(j));
      if (ent) ent[o] = r.entropy(static_cast<int>(j));
      if (lss) lss[o] = r.log_sum_sq_probs(static_cast<int>(j));
      if (mlg) mlg[o] = r.mean_logits(static_cast<int>(j));
      if (top1) top1[o] = r.is_top1(static_cast<int>(j));
      for (int k = 0; k < K; ++k) {
        tkl[o * K + k] = r.topk_logprobs(static_cast<int>(j * K + k));
        tki[o * K + k] = r.topk_indices(static_cast<int>(j * K + k));
      }
      for (int g = 0; g < G; ++g) gat[o * G + g] = r.gathered_logprobs(static_cast<int>(j * G + g));
    }
  }
  if (covered != job.num_rows())
    return absl::InternalError(absl::StrCat("workers returned ", covered, " rows of ", job.num_rows()));
  return resp;
}

absl::Status CheckFiniteHiddenOutputs(const v1::ScoreResponse& resp, const std::vector<int64_t>& out_shape,
                                      const LmHeadVersion& head) {
  for (const v1::Tensor& t : resp.outputs()) {
    if (t.name() != "token_logprobs" && t.name() != "entropy") continue;
    const size_t n = t.data().size() / sizeof(float);
    for (size_t i = 0; i < n; ++i) {
      float v;
      std::memcpy(&v, t.data().data() + i * sizeof(float), sizeof v);
      // -inf is a token logprob the sampling filters excluded; never an entropy.
      if (std::isfinite(v) || (t.name() == "token_logprobs" && v == -INFINITY)) continue;
      // The token's index in the output's shape.
      std::vector<int64_t> index(out_shape.size());
      int64_t rest = static_cast<int64_t>(i);
      for (size_t d = out_shape.size(); d-- > 0;) {
        index[d] = out_shape[d] > 0 ? rest % out_shape[d] : 0;
        rest = out_shape[d] > 0 ? rest / out_shape[d] : rest;
      }
      return absl::FailedPreconditionError(absl::StrCat(
          "lm_head ", Printable(head.head), " version ", Printable(head.version), ": the logits of token [",
          absl::StrJoin(index, ", "), "] overflow float32 (", t.name(), " is ", std::isnan(v) ? "nan" : "infinite",
          "): the head's weights, bias or logit scale are too large to score"));
    }
  }
  return absl::OkStatus();
}

}  // namespace logprob
