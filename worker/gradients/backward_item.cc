#include "worker/gradients/backward_item.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/error_reason.h"
#include "common/input_kind.h"
#include "common/partition.h"
#include "common/status_macros.h"
#include "worker/gradients/item_gradients.h"
#include "worker/scoring/backward_pass.h"
#include "worker/scoring/hidden_rounds.h"

namespace logprob {
namespace {

using internal::v1::WorkItem;
using internal::v1::WorkResult;

absl::Status Invalid(const std::string& what) { return absl::InvalidArgumentError("backward work item: " + what); }

/// The item is a backward this rank can run: everything checked before
/// any collective, from fields that are the same on every rank (but the
/// payload's size and the slice, which the front-end sizes per rank).
absl::Status CheckItem(const WorkItem& item, const ItemPayload& payload, const Communicator& comm,
                       const LmHeadWeights* lm_head) {
  const auto& o = item.options();
  const int64_t n = item.num_rows();
  if (item.layout() != internal::v1::HIDDEN_STATES) return Invalid("the backward takes hidden states only");
  if (payload.on_device)
    return WithReason(absl::FailedPreconditionError("hidden states passed as a CUDA IPC handle: the lm_head's "
                                                    "backward takes their bytes (docs/gradients.md)"),
                      v1::CUDA_IPC_UNAVAILABLE);
  if (!IsFloatDType(item.dtype())) return Invalid("dtype must be F32, BF16 or F16");
  if (n < 0 || item.vocab_size() <= 0 || item.hidden_size() <= 0)
    return Invalid(
        absl::StrCat("num_rows ", n, ", vocab_size ", item.vocab_size(), ", hidden_size ", item.hidden_size()));
  if (item.targets_size() != n || item.grad_token_logprobs_size() != n ||
      (item.grad_entropy_size() != 0 && item.grad_entropy_size() != n))
    return Invalid("targets, grad_token_logprobs or grad_entropy do not match num_rows");
  if (HasSamplingFilters(o) || item.masked_size() != 0 || o.topk() != 0 || item.gather_k() != 0 ||
      o.log_sum_sq_probs() || o.mean_logits() || o.is_top1())
    return Invalid("a backward has no sampling filters or masks and answers token_logprobs and entropy only");
  if (!lm_head) return NoLmHeadError(item.lm_head().name(), item.lm_head().version());
  const auto [vb, ve] = SplitRange(item.vocab_size(), comm.size(), comm.rank());
  if (vb != item.vocab_begin() || ve != item.vocab_end() || lm_head->rows() != ve - vb ||
      lm_head->hidden_size() != item.hidden_size())
    return Invalid(absl::StrCat("vocab slice [", item.vocab_begin(), ", ", item.vocab_end(), ") of H ",
                                item.hidden_size(), " is not rank ", comm.rank(), "'s lm_head slice [", lm_head->rows(),
                                ", ", lm_head->hidden_size(), "]"));
  const auto [own_begin, own_end] = SplitRange(n, comm.size(), comm.rank());
  if (static_cast<int64_t>(payload.bytes.size()) !=
      (own_end - own_begin) * item.hidden_size() * static_cast<int64_t>(DTypeSize(item.dtype())))
    return Invalid("hidden_states size does not match this rank's rows");
  return absl::OkStatus();
}

/// The rounds: every rank's rows of the item, gathered, backward through
/// this slice, dL/dh shares exchanged to their owners. `grad_weight` /
/// `grad_bias`: the step's sums of this slice, or null.
class Rounds {
 public:
  Rounds(const WorkItem& item, std::string_view own, Communicator& comm, SliceBackward& backward, int64_t chunk_tokens,
         const std::function<bool()>& should_stop, WorkResult* res)
      : item_(item),
        own_(own),
        comm_(comm),
        backward_(backward),
        chunk_tokens_(std::max<int64_t>(1, chunk_tokens)),
        should_stop_(should_stop),
        res_(res) {}

  absl::Status Run(float* grad_weight, float* grad_bias) {
    const int W = comm_.size(), me = comm_.rank();
    const int64_t n = item_.num_rows(), H = item_.hidden_size();
    const size_t hrow = static_cast<size_t>(H) * DTypeSize(item_.dtype());
    const bool entropy_out = item_.options().entropy();
    const bool grad_entropy = item_.grad_entropy_size() != 0;
    std::vector<char> send, gathered;
    std::vector<int64_t> targets;
    std::vector<float> g_lp, g_ent, share, recv, lp, ent;
    for (int64_t l0 = 0; l0 < LargestShare(n, W); l0 += chunk_tokens_) {
      LOGPROB_RETURN_IF_ERROR(AgreeToGoOn(comm_, should_stop_));
      // The round's hidden rows of every rank, packed in rank order.
      LOGPROB_ASSIGN_OR_RETURN(const RoundRows rows,
                               GatherHiddenRound(comm_, own_, hrow, n, l0, chunk_tokens_, &send, &gathered));
      const std::vector<int64_t>& count = rows.count;
      const int64_t packed = rows.total();
      int64_t before_me = 0;
      for (int q = 0; q < me; ++q) before_me += count[q];
      targets.clear();
      g_lp.clear();
      g_ent.clear();
      for (int q = 0; q < W; ++q) {
        for (int64_t i = 0; i < count[q]; ++i) {
          const int r = static_cast<int>(rows.first[q] + i);
          targets.push_back(item_.targets(r));
          g_lp.push_back(item_.grad_token_logprobs(r));
          if (grad_entropy) g_ent.push_back(item_.grad_entropy(r));
        }
      }
      BackwardPassRows in;
      in.hidden_dtype = item_.dtype();
      in.hidden = gathered.data();
      in.rows = packed;
      in.targets = targets.data();
      in.grad_logprobs = g_lp.data();
      in.grad_entropy = grad_entropy ? g_ent.data() : nullptr;
      in.round_rows = std::max<int64_t>(packed, 1);
      share.resize(static_cast<size_t>(packed * H));
      lp.resize(static_cast<size_t>(packed));
      ent.resize(static_cast<size_t>(packed));
      if (grad_weight != nullptr) added_ = true;  // from here the step's sums may change
      LOGPROB_RETURN_IF_ERROR(RunBackwardPass(in, backward_, item_.vocab_size(), comm_, share.data(), grad_weight,
                                              grad_bias, lp.data(), ent.data()));
      // Each owner gets its rows' shares from every slice and sums them in rank order.
      const int64_t mine = count[me];
      LOGPROB_RETURN_IF_ERROR(SumSharesToOwners(comm_, count, H, share.data(), &recv,
                                                res_->mutable_grad_hidden_states()->mutable_data() + l0 * H));
      for (int64_t i = 0; i < mine; ++i) {
        res_->set_token_logprobs(static_cast<int>(l0 + i), lp[static_cast<size_t>(before_me + i)]);
        if (entropy_out) res_->set_entropy(static_cast<int>(l0 + i), ent[static_cast<size_t>(before_me + i)]);
      }
    }
    // What a backend summed where it computes (the GPU's device sums).
    return grad_weight != nullptr ? backward_.Flush(grad_weight, grad_bias) : absl::OkStatus();
  }

  /// True once a round began adding to the step's sums (a failure before
  /// that leaves them as they were).
  bool added() const { return added_; }

 private:
  bool added_ = false;
  const WorkItem& item_;
  const std::string_view own_;
  Communicator& comm_;
  SliceBackward& backward_;
  const int64_t chunk_tokens_;
  const std::function<bool()>& should_stop_;
  WorkResult* res_;
};

}  // namespace

absl::StatusOr<WorkResult> RunBackwardItem(const WorkItem& item, ItemPayload payload, Communicator& comm,
                                           ScoringBackend& backend, int64_t hidden_chunk_tokens,
                                           const std::function<bool()>& should_stop, const LmHeadWeights* lm_head,
                                           HeadGradientSteps& steps) {
  const auto t0 = std::chrono::steady_clock::now();
  LOGPROB_RETURN_IF_ERROR(CheckItem(item, payload, comm, lm_head));
  const auto& o = item.options();
  const int64_t n = item.num_rows(), H = item.hidden_size();
  const auto [own_begin, own_end] = SplitRange(n, comm.size(), comm.rank());
  const int64_t mine = own_end - own_begin;
  WorkResult res;
  res.set_row_begin(own_begin);
  res.set_row_end(own_end);
  res.mutable_token_logprobs()->Resize(static_cast<int>(mine), 0.f);
  if (o.entropy()) res.mutable_entropy()->Resize(static_cast<int>(mine), 0.f);
  res.mutable_grad_hidden_states()->Resize(static_cast<int>(mine * H), 0.f);
  LOGPROB_ASSIGN_OR_RETURN(
      auto backward, backend.HeadBackward(*lm_head, item.vocab_begin(), o.has_temperature() ? o.temperature() : 1.0f));
  Rounds rounds(item, payload.bytes, comm, *backward, hidden_chunk_tokens, should_stop, &res);
  ItemRounds r;
  r.run = [&](float* weight, float* bias) { return rounds.Run(weight, bias); };
  r.added = [&] { return rounds.added(); };
  LOGPROB_RETURN_IF_ERROR(AddToStepAgreed(steps, comm, o.gradient_step(), item.lm_head().name(),
                                          item.lm_head().version(), lm_head->rows(), H, lm_head->transform().has_bias,
                                          n, r));
  res.set_compute_seconds(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return res;
}

}  // namespace logprob
