#include "worker/gradients/distillation_item.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/error_reason.h"
#include "common/input_kind.h"
#include "common/partition.h"
#include "common/status_macros.h"
#include "worker/gradients/item_gradients.h"
#include "worker/scoring/divergence_pass.h"
#include "worker/scoring/hidden_rounds.h"

namespace logprob {
namespace {

using internal::v1::WorkItem;
using internal::v1::WorkResult;

absl::Status Invalid(const std::string& what) { return absl::InvalidArgumentError("distillation work item: " + what); }

/// Finite values, or INVALID_ARGUMENT naming the field and the row.
absl::Status CheckFinite(const google::protobuf::RepeatedField<float>& v, const char* field) {
  for (int i = 0; i < v.size(); ++i)
    if (!std::isfinite(v[i])) return Invalid(absl::StrCat(field, "[", i, "] is not finite"));
  return absl::OkStatus();
}

/// The item is a distillation this rank can run: everything checked before
/// any collective, from fields that are the same on every rank (but the
/// payloads' sizes and the slices, which the front-end sizes per rank).
absl::Status CheckItem(const WorkItem& item, const ItemPayload& payload, const Communicator& comm,
                       const LmHeadWeights* student, const LmHeadWeights* teacher) {
  const auto& o = item.options();
  const auto& d = item.distillation();
  const int64_t n = item.num_rows();
  if (item.layout() != internal::v1::HIDDEN_STATES) return Invalid("distillation takes hidden states only");
  if (payload.on_device)
    return WithReason(absl::FailedPreconditionError("hidden states passed as a CUDA IPC handle: distillation takes "
                                                    "their bytes (docs/distillation.md)"),
                      v1::CUDA_IPC_UNAVAILABLE);
  if (!IsFloatDType(item.dtype()) || !IsFloatDType(d.teacher_dtype()))
    return Invalid("the student's and the teacher's dtypes must be F32, BF16 or F16");
  if (n < 0 || item.vocab_size() <= 0 || item.hidden_size() <= 0 || d.teacher_hidden_size() <= 0)
    return Invalid(absl::StrCat("num_rows ", n, ", vocab_size ", item.vocab_size(), ", hidden_size ",
                                item.hidden_size(), ", teacher_hidden_size ", d.teacher_hidden_size()));
  if (!(d.beta() >= 0.0 && d.beta() <= 1.0)) return Invalid(absl::StrCat("beta must be in [0, 1], got ", d.beta()));
  if ((d.grad_divergence_size() != 0 && d.grad_divergence_size() != n) ||
      (d.grad_cross_entropy_size() != 0 && d.grad_cross_entropy_size() != n))
    return Invalid("grad_divergence or grad_cross_entropy do not match num_rows");
  if (!item.backward() && (d.grad_divergence_size() != 0 || d.grad_cross_entropy_size() != 0))
    return Invalid("upstream gradients without a backward");
  LOGPROB_RETURN_IF_ERROR(CheckFinite(d.grad_divergence(), "grad_divergence"));
  LOGPROB_RETURN_IF_ERROR(CheckFinite(d.grad_cross_entropy(), "grad_cross_entropy"));
  if (HasSamplingFilters(o) || item.masked_size() != 0 || o.topk() != 0 || item.gather_k() != 0 ||
      o.log_sum_sq_probs() || o.mean_logits() || o.is_top1() || item.grad_token_logprobs_size() != 0 ||
      item.grad_entropy_size() != 0)
    return Invalid("a distillation has no sampling filters, masks or logprob outputs");
  if (!student) return NoLmHeadError(item.lm_head().name(), item.lm_head().version());
  if (!teacher) return NoLmHeadError(d.teacher().name(), d.teacher().version());
  const auto [vb, ve] = SplitRange(item.vocab_size(), comm.size(), comm.rank());
  if (vb != item.vocab_begin() || ve != item.vocab_end() || student->rows() != ve - vb || teacher->rows() != ve - vb)
    return Invalid(absl::StrCat("vocab slice [", item.vocab_begin(), ", ", item.vocab_end(), ") is not rank ",
                                comm.rank(), "'s slices of ", student->rows(), " / ", teacher->rows(), " rows"));
  if (student->hidden_size() != item.hidden_size())
    return Invalid(
        absl::StrCat("hidden_size ", item.hidden_size(), " is not the student head's ", student->hidden_size()));
  if (teacher->hidden_size() != d.teacher_hidden_size())
    return Invalid(absl::StrCat("teacher_hidden_size ", d.teacher_hidden_size(), " is not the teacher head's ",
                                teacher->hidden_size()));
  const auto [own_begin, own_end] = SplitRange(n, comm.size(), comm.rank());
  const int64_t own = own_end - own_begin;
  const int64_t s_want = own * item.hidden_size() * static_cast<int64_t>(DTypeSize(item.dtype()));
  const int64_t t_want = own * d.teacher_hidden_size() * static_cast<int64_t>(DTypeSize(d.teacher_dtype()));
  if (static_cast<int64_t>(payload.bytes.size()) != s_want)
    return Invalid(absl::StrCat("the student's hidden states hold ", payload.bytes.size(), " bytes, this rank's ", own,
                                " rows ", s_want));
  if (static_cast<int64_t>(d.teacher_data().size()) != t_want)
    return Invalid(
        absl::StrCat("teacher_data holds ", d.teacher_data().size(), " bytes, this rank's ", own, " rows ", t_want));
  return absl::OkStatus();
}

/// The rounds: every rank's rows of both models, gathered, through this
/// slice; with a backward, the student's dL/dh shares exchanged to their
/// owners.
class Rounds {
 public:
  Rounds(const WorkItem& item, std::string_view student_rows, Communicator& comm, SliceDistillation& slice,
         int64_t chunk_tokens, const std::function<bool()>& should_stop, WorkResult* res)
      : item_(item),
        student_rows_(student_rows),
        comm_(comm),
        slice_(slice),
        chunk_tokens_(std::max<int64_t>(1, chunk_tokens)),
        should_stop_(should_stop),
        res_(res) {}

  absl::Status Run(float* grad_weight, float* grad_bias) {
    const int W = comm_.size(), me = comm_.rank();
    const auto& d = item_.distillation();
    const int64_t n = item_.num_rows(), Hs = item_.hidden_size(), Ht = d.teacher_hidden_size();
    const size_t s_row = static_cast<size_t>(Hs) * DTypeSize(item_.dtype());
    const size_t t_row = static_cast<size_t>(Ht) * DTypeSize(d.teacher_dtype());
    const bool backward = item_.backward();
    std::vector<char> send, student, teacher;
    std::vector<float> g_d, g_ce, share, recv, div, ce, ent;
    for (int64_t l0 = 0; l0 < LargestShare(n, W); l0 += chunk_tokens_) {
      LOGPROB_RETURN_IF_ERROR(AgreeToGoOn(comm_, should_stop_));
      // The round's rows of both models of every rank, packed in rank order.
      LOGPROB_ASSIGN_OR_RETURN(const RoundRows rows,
                               GatherHiddenRound(comm_, student_rows_, s_row, n, l0, chunk_tokens_, &send, &student));
      LOGPROB_ASSIGN_OR_RETURN(const RoundRows rows_t, GatherHiddenRound(comm_, d.teacher_data(), t_row, n, l0,
                                                                         chunk_tokens_, &send, &teacher));
      (void)rows_t;  // the same rows: SplitRange of the same n
      const std::vector<int64_t>& count = rows.count;
      const int64_t packed = rows.total();
      int64_t before_me = 0;
      for (int q = 0; q < me; ++q) before_me += count[q];
      g_d.clear();
      g_ce.clear();
      for (int q = 0; q < W; ++q)
        for (int64_t i = 0; i < count[q]; ++i) {
          const int r = static_cast<int>(rows.first[q] + i);
          if (d.grad_divergence_size() != 0) g_d.push_back(d.grad_divergence(r));
          if (d.grad_cross_entropy_size() != 0) g_ce.push_back(d.grad_cross_entropy(r));
        }
      DivergencePassRows in;
      in.student_dtype = item_.dtype();
      in.student_hidden = student.data();
      in.teacher_dtype = d.teacher_dtype();
      in.teacher_hidden = teacher.data();
      in.rows = packed;
      in.beta = d.beta();
      in.temperature = item_.options().has_temperature() ? item_.options().temperature() : 1.0f;
      in.grad_divergence = g_d.empty() ? nullptr : g_d.data();
      in.grad_cross_entropy = g_ce.empty() ? nullptr : g_ce.data();
      in.backward = backward;
      in.round_rows = std::max<int64_t>(packed, 1);
      div.resize(static_cast<size_t>(packed));
      ce.resize(static_cast<size_t>(packed));
      ent.resize(static_cast<size_t>(packed));
      share.resize(static_cast<size_t>(backward ? packed * Hs : 0));
      if (backward && grad_weight != nullptr) added_ = true;  // from here the step's sums may change
      LOGPROB_RETURN_IF_ERROR(RunDivergencePass(in, slice_, comm_,
                                                DivergencePassOutputs{div.data(), ce.data(), ent.data()},
                                                backward ? share.data() : nullptr, grad_weight, grad_bias));
      const int64_t mine = count[me];
      if (backward)
        LOGPROB_RETURN_IF_ERROR(SumSharesToOwners(comm_, count, Hs, share.data(), &recv,
                                                  res_->mutable_grad_hidden_states()->mutable_data() + l0 * Hs));
      for (int64_t i = 0; i < mine; ++i) {
        const size_t k = static_cast<size_t>(before_me + i);
        res_->set_divergence(static_cast<int>(l0 + i), div[k]);
        res_->set_cross_entropy(static_cast<int>(l0 + i), ce[k]);
        res_->set_entropy(static_cast<int>(l0 + i), ent[k]);
      }
    }
    // What a backend summed where it computes.
    return grad_weight != nullptr ? slice_.Flush(grad_weight, grad_bias) : absl::OkStatus();
  }

  /// True once a round began adding to the step's sums.
  bool added() const { return added_; }

 private:
  bool added_ = false;
  const WorkItem& item_;
  const std::string_view student_rows_;
  Communicator& comm_;
  SliceDistillation& slice_;
  const int64_t chunk_tokens_;
  const std::function<bool()>& should_stop_;
  WorkResult* res_;
};

}  // namespace

absl::StatusOr<WorkResult> RunDistillationItem(const WorkItem& item, ItemPayload payload, Communicator& comm,
                                               ScoringBackend& backend, int64_t hidden_chunk_tokens,
                                               const std::function<bool()>& should_stop, const LmHeadWeights* student,
                                               const LmHeadWeights* teacher, HeadGradientSteps& steps) {
  const auto t0 = std::chrono::steady_clock::now();
  LOGPROB_RETURN_IF_ERROR(CheckItem(item, payload, comm, student, teacher));
  const auto& o = item.options();
  const int64_t n = item.num_rows(), H = item.hidden_size();
  const auto [own_begin, own_end] = SplitRange(n, comm.size(), comm.rank());
  const int64_t mine = own_end - own_begin;
  WorkResult res;
  res.set_row_begin(own_begin);
  res.set_row_end(own_end);
  res.mutable_divergence()->Resize(static_cast<int>(mine), 0.f);
  res.mutable_cross_entropy()->Resize(static_cast<int>(mine), 0.f);
  res.mutable_entropy()->Resize(static_cast<int>(mine), 0.f);
  if (item.backward()) res.mutable_grad_hidden_states()->Resize(static_cast<int>(mine * H), 0.f);
  LOGPROB_ASSIGN_OR_RETURN(auto slice, backend.HeadDistillation(*student, *teacher, item.vocab_begin(),
                                                                o.has_temperature() ? o.temperature() : 1.0f));
  Rounds rounds(item, payload.bytes, comm, *slice, hidden_chunk_tokens, should_stop, &res);
  ItemRounds r;
  r.run = [&](float* weight, float* bias) { return rounds.Run(weight, bias); };
  r.added = [&] { return rounds.added(); };
  // A forward adds nothing, whatever step it names.
  LOGPROB_RETURN_IF_ERROR(AddToStepAgreed(steps, comm, item.backward() ? o.gradient_step() : std::string(),
                                          item.lm_head().name(), item.lm_head().version(), student->rows(), H,
                                          student->transform().has_bias, n, r));
  res.set_compute_seconds(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return res;
}

}  // namespace logprob
