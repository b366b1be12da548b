#include "server/core/score_job.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/error_reason.h"
#include "common/input_kind.h"
#include "common/status_macros.h"
#include "server/core/head_gradients.h"
#include "server/core/rollout_mismatch.h"

namespace logprob {
namespace {

absl::Status Invalid(const std::string& msg) { return absl::InvalidArgumentError(msg); }

std::string ShapeStr(const v1::Tensor& t) { return absl::StrCat("[", absl::StrJoin(t.shape(), ", "), "]"); }

/// The bytes of each input's source: the integer tensors' (which
/// validation reads) in memory, read into `owned` when their source is not.
class InputBytes {
 public:
  InputBytes(const v1::ScoreRequest& req, const RequestInputs& inputs) : req_(req), inputs_(inputs) {}
  const std::shared_ptr<const InputSource>& source(const v1::Tensor* t) const { return inputs_.sources[IndexOf(t)]; }
  /// The bytes of `t`, read if they are not in memory (FAILED_PRECONDITION
  /// with the source's error if they cannot be read).
  absl::StatusOr<std::string_view> operator()(const v1::Tensor* t) {
    const InputSource& src = *source(t);
    if (auto m = src.memory()) return *m;
    auto copy = std::make_unique<std::string>(static_cast<size_t>(src.byte_size()), '\0');
    if (!src.Read(0, copy->size(), copy->data()))
      return WithReason(absl::FailedPreconditionError(
                            absl::StrCat("inputs[", IndexOf(t), "] \"", t->name(), "\": ", src.status().message())),
                        ReasonOf(src.status()));
    owned_.push_back(std::move(copy));
    return std::string_view(*owned_.back());
  }

 private:
  int IndexOf(const v1::Tensor* t) const {
    for (int i = 0; i < req_.inputs_size(); ++i)
      if (&req_.inputs(i) == t) return i;
    return -1;
  }
  const v1::ScoreRequest& req_;
  const RequestInputs& inputs_;
  std::vector<std::unique_ptr<std::string>> owned_;
};

/// Checks the byte size of every tensor and indexes them by name.
absl::StatusOr<std::map<std::string, const v1::Tensor*>> IndexInputs(const v1::ScoreRequest& req,
                                                                     const InputBytes& bytes) {
  static const char* const kKnown[] = {"logits",
                                       "hidden_states",
                                       "input_ids",
                                       "seq_lens",
                                       "cu_seqlens",
                                       "gather_indices",
                                       "rollout_logprobs",
                                       "sampling_mask_offsets",
                                       "sampling_mask_ids",
                                       "grad_token_logprobs",
                                       "grad_entropy"};
  std::map<std::string, const v1::Tensor*> by_name;
  for (int i = 0; i < req.inputs_size(); ++i) {
    const v1::Tensor& t = req.inputs(i);
    bool known = false;
    for (const char* k : kKnown) known |= t.name() == k;
    if (!known)
      return Invalid(absl::StrCat(
          "inputs[", i, "]: unknown tensor \"", t.name(),
          "\" (expected logits, hidden_states, input_ids, seq_lens, cu_seqlens, gather_indices, ",
          "rollout_logprobs, sampling_mask_offsets, sampling_mask_ids, grad_token_logprobs, ", "grad_entropy)"));
    if (by_name.count(t.name())) return Invalid(absl::StrCat("inputs[", i, "]: tensor \"", t.name(), "\" given twice"));
    const size_t esize = DTypeSize(t.dtype());
    if (esize == 0) return Invalid(absl::StrCat("inputs[", i, "] \"", t.name(), "\": dtype is unspecified"));
    // The product of the non-zero dims is bounded too: an empty tensor must
    // not carry a huge V (row bytes would overflow) or B (per-sequence work).
    uint64_t numel = 1, extent = 1;
    for (int64_t d : t.shape()) {
      if (d < 0) return Invalid(absl::StrCat("\"", t.name(), "\": negative dimension in shape ", ShapeStr(t)));
      if (d == 0) {
        numel = 0;
        continue;
      }
      if (extent > (uint64_t{1} << 50) / static_cast<uint64_t>(d))
        return Invalid(absl::StrCat("\"", t.name(), "\": shape ", ShapeStr(t), " is too large"));
      extent *= static_cast<uint64_t>(d);
    }
    if (numel != 0) numel = extent;
    const InputSource& src = *bytes.source(&t);
    if (static_cast<uint64_t>(src.byte_size()) != numel * esize)
      return Invalid(absl::StrCat(
          "\"", t.name(),
          "\": ", src.kind() == InputKind::kBytes ? "data is " : absl::StrCat(src.rules().name, " reference is "),
          src.byte_size(), " bytes but shape ", ShapeStr(t), " of ", DTypeName(t.dtype()), " needs ", numel * esize));
    by_name[t.name()] = &t;
  }
  return by_name;
}

absl::Status CheckIntTensor(const v1::Tensor& t) {
  if (!IsIntDType(t.dtype()))
    return Invalid(absl::StrCat("\"", t.name(), "\": dtype ", DTypeName(t.dtype()), " is not I32 or I64"));
  return absl::OkStatus();
}

absl::Status CheckShape(const v1::Tensor& t, const std::vector<int64_t>& want, const std::string& what) {
  if (std::vector<int64_t>(t.shape().begin(), t.shape().end()) != want)
    return Invalid(absl::StrCat("\"", t.name(), "\": shape ", ShapeStr(t), " does not match ", what, " [",
                                absl::StrJoin(want, ", "), "]"));
  return absl::OkStatus();
}

/// Fills options defaults and checks their ranges.
absl::Status NormaliseOptions(const v1::ScoreOptions& in, int64_t V, const RequestLimits& limits,
                              v1::ScoreOptions* out) {
  *out = in;
  if (!in.has_temperature()) out->set_temperature(1.0f);
  if (!in.has_sampling_top_p()) out->set_sampling_top_p(1.0f);
  if (!in.has_ignore_index()) out->set_ignore_index(-100);
  const float t = out->temperature();
  if (!(t > 0.f) || !std::isfinite(t))
    return Invalid(absl::StrCat("options.temperature must be > 0 and finite, got ", t));
  const float p = out->sampling_top_p();
  if (!(p > 0.f && p <= 1.f)) return Invalid(absl::StrCat("options.sampling_top_p must be in (0, 1], got ", p));
  if (in.sampling_top_k() < 0)
    return Invalid(absl::StrCat("options.sampling_top_k must be >= 0, got ", in.sampling_top_k()));
  if (in.topk() < 0 || in.topk() > V)
    return Invalid(absl::StrCat("options.topk must be in [0, V = ", V, "], got ", in.topk()));
  if (in.topk() > limits.max_topk)
    return Invalid(absl::StrCat("options.topk ", in.topk(), " exceeds the server's max_topk ", limits.max_topk));
  if (in.alignment() != v1::NEXT_TOKEN && in.alignment() != v1::SAME_POSITION)
    return Invalid(absl::StrCat("options.alignment ", static_cast<int>(in.alignment()), " is unknown"));
  return absl::OkStatus();
}

/// The backward's inputs (grad_token_logprobs, optional grad_entropy) and
/// what may come with them: hidden states, F32 gradients shaped like the
/// output, no sampling filters, masks, rollout logprobs or outputs besides
/// token_logprobs and entropy, a well-formed options.gradient_step.
absl::Status CheckBackward(const v1::Tensor& input, const v1::Tensor* grad_lp, const v1::Tensor* grad_ent,
                           const v1::ScoreOptions& o, int gather_k, bool rollout, bool masks,
                           const std::vector<int64_t>& out_shape) {
  if (input.name() != "hidden_states")
    return Invalid("\"grad_token_logprobs\": the lm_head's backward takes \"hidden_states\", not logits");
  for (const v1::Tensor* t : {grad_lp, grad_ent}) {
    if (t == nullptr) continue;
    if (t->dtype() != v1::F32)
      return Invalid(absl::StrCat("\"", t->name(), "\": dtype ", DTypeName(t->dtype()), " is not F32"));
    LOGPROB_RETURN_IF_ERROR(CheckShape(*t, out_shape, "the output shape"));
  }
  if (HasSamplingFilters(o) || masks)
    return Invalid(
        "the lm_head's backward has no sampling filters or masks (sampling_top_k, sampling_top_p, "
        "sampling_mask_ids)");
  if (o.topk() != 0 || gather_k != 0 || o.log_sum_sq_probs() || o.mean_logits() || o.is_top1() || rollout)
    return Invalid(
        "the lm_head's backward answers token_logprobs, entropy and grad_hidden_states only: drop "
        "options.topk, log_sum_sq_probs, mean_logits, is_top1, gather_indices and rollout_logprobs");
  if (o.gradient_step().empty()) return absl::OkStatus();
  return CheckGradientStepKey(o.gradient_step(), "options.gradient_step");
}

}  // namespace

int64_t ScoreJob::mask_working_bytes(int workers) const {
  if (!has_masks()) return 0;
  const int64_t ids = static_cast<int64_t>(mask_ids.size()), per_worker = num_rows() + 1;
  const int64_t job_copy = 4 * ids + 8 * per_worker;
  const int64_t items = 4 * ids + int64_t{workers} * 9 * per_worker;
  const int64_t serialized = 5 * ids + int64_t{workers} * 11 * per_worker;
  return job_copy + items + serialized;
}

int64_t ScoreJob::backward_working_bytes() const {
  if (!backward) return 0;
  int64_t input_rows = 1;
  for (int64_t d : input_shape) input_rows *= d;
  return 4 * hidden_size * (2 * num_rows() + 2 * input_rows);
}

int64_t ScoreJob::num_outputs() const {
  int64_t n = 1;
  for (int64_t d : out_shape) n *= d;
  return n;
}

absl::StatusOr<ScoreJob> BuildScoreJob(const v1::ScoreRequest& req, const RequestLimits& limits,
                                       const LmHeadShape& lm_head, const RequestInputs* inputs) {
  RequestInputs inline_inputs;
  if (inputs == nullptr) {
    inline_inputs = InlineInputs(req);
    inputs = &inline_inputs;
  }
  if (static_cast<int>(inputs->sources.size()) != req.inputs_size())
    return absl::InternalError("BuildScoreJob: one source per input expected");
  InputBytes bytes(req, *inputs);
  LOGPROB_ASSIGN_OR_RETURN(const auto in, IndexInputs(req, bytes));
  auto get = [&](const char* n) -> const v1::Tensor* {
    auto it = in.find(n);
    return it == in.end() ? nullptr : it->second;
  };
  const v1::Tensor* hidden = get("hidden_states");
  const v1::Tensor* input = hidden ? hidden : get("logits");  // one row per position
  if (hidden && get("logits")) return Invalid("give either \"logits\" or \"hidden_states\", not both");
  if (!input) return Invalid("missing tensor \"logits\" (or \"hidden_states\")");
  if (hidden && lm_head.hidden_size == 0)
    return WithReason(absl::FailedPreconditionError(
                          "hidden_states given but this server has no lm_head loaded (start it with --lm-head)"),
                      v1::NO_LM_HEAD);
  const std::string name = input->name();
  const char* last_dim = hidden ? "H" : "V";
  const v1::Tensor* ids = get("input_ids");
  if (!ids) return Invalid("missing tensor \"input_ids\"");
  if (!IsFloatDType(input->dtype()))
    return Invalid(absl::StrCat("\"", name, "\": dtype ", DTypeName(input->dtype()), " is not F32, BF16 or F16"));
  LOGPROB_RETURN_IF_ERROR(CheckIntTensor(*ids));
  const v1::Tensor* cu = get("cu_seqlens");
  const v1::Tensor* lens = get("seq_lens");
  const v1::Tensor* gather = get("gather_indices");
  const v1::Tensor* rollout = get("rollout_logprobs");
  const v1::Tensor* mask_offsets = get("sampling_mask_offsets");
  const v1::Tensor* mask_ids = get("sampling_mask_ids");
  const v1::Tensor* grad_lp = get("grad_token_logprobs");
  const v1::Tensor* grad_ent = get("grad_entropy");
  // The integer tensors', rollout logprobs' and upstream gradients' bytes
  // (read here when they are not in memory).
  std::string_view id_bytes, cu_bytes, lens_bytes, gather_bytes, rollout_bytes, mask_offsets_bytes, mask_ids_bytes,
      grad_lp_bytes, grad_ent_bytes;
  for (const auto& [t, out] : {std::pair{ids, &id_bytes}, std::pair{cu, &cu_bytes}, std::pair{lens, &lens_bytes},
                               std::pair{gather, &gather_bytes}, std::pair{rollout, &rollout_bytes},
                               std::pair{mask_offsets, &mask_offsets_bytes}, std::pair{mask_ids, &mask_ids_bytes},
                               std::pair{grad_lp, &grad_lp_bytes}, std::pair{grad_ent, &grad_ent_bytes}}) {
    if (t == nullptr) continue;
    LOGPROB_ASSIGN_OR_RETURN(*out, bytes(t));
  }
  const bool packed = input->shape_size() == 2;
  if (input->shape_size() != 3 && !packed)
    return Invalid(absl::StrCat("\"", name, "\": shape ", ShapeStr(*input), " is neither [B, S, ", last_dim,
                                "] nor packed [T, ", last_dim, "]"));
  if (packed && !cu)
    return Invalid(absl::StrCat("\"", name, "\" is packed [T, ", last_dim, "] but \"cu_seqlens\" is missing"));
  if (!packed && cu)
    return Invalid(absl::StrCat("\"cu_seqlens\" given but \"", name, "\" is padded [B, S, ", last_dim,
                                "], not packed [T, ", last_dim, "]"));
  if (packed && lens) return Invalid("\"seq_lens\" applies to padded batches; packed batches use \"cu_seqlens\"");

  ScoreJob job;
  const int64_t last = input->shape(input->shape_size() - 1);
  if (hidden && last != lm_head.hidden_size)
    return Invalid(absl::StrCat("\"hidden_states\": H = ", last, " (shape ", ShapeStr(*input),
                                ") does not match the lm_head's H = ", lm_head.hidden_size));
  const int64_t V = hidden ? lm_head.vocab_size : last;
  if (V <= 0) return Invalid("\"logits\": vocabulary dimension is 0");
  job.hidden = hidden != nullptr;
  job.hidden_size = hidden ? last : 0;
  job.dtype = input->dtype();
  job.vocab_size = V;
  job.row_bytes = static_cast<size_t>(last) * DTypeSize(job.dtype);
  LOGPROB_RETURN_IF_ERROR(NormaliseOptions(req.options(), V, limits, &job.options));
  const bool next = job.options.alignment() == v1::NEXT_TOKEN;
  const int64_t ignore = job.options.ignore_index();

  // Sequences as (first input row, length, first output position).
  struct Seq {
    int64_t row0, len, out0;
  };
  std::vector<Seq> seqs;
  if (packed) {
    const int64_t T = input->shape(0);
    LOGPROB_RETURN_IF_ERROR(CheckShape(*ids, {T}, name + "' [T]"));
    LOGPROB_RETURN_IF_ERROR(CheckIntTensor(*cu));
    if (cu->shape_size() != 1 || cu->shape(0) < 2)
      return Invalid(absl::StrCat("\"cu_seqlens\": shape ", ShapeStr(*cu), " is not [B + 1] with B >= 1"));
    const int64_t B = cu->shape(0) - 1;
    if (ReadInt(cu->dtype(), cu_bytes.data(), 0) != 0) return Invalid("\"cu_seqlens\"[0] must be 0");
    for (int64_t i = 0; i < B; ++i) {
      const int64_t a = ReadInt(cu->dtype(), cu_bytes.data(), i), b = ReadInt(cu->dtype(), cu_bytes.data(), i + 1);
      if (b < a) return Invalid(absl::StrCat("\"cu_seqlens\" decreases at index ", i + 1, " (", a, " -> ", b, ")"));
      if (next && b == a)
        return Invalid(absl::StrCat("\"cu_seqlens\": sequence ", i, " is empty (next_token needs length >= 1)"));
      seqs.push_back({a, b - a, next ? a - i : a});
    }
    const int64_t end = ReadInt(cu->dtype(), cu_bytes.data(), B);
    if (end != T)
      return Invalid(absl::StrCat("\"cu_seqlens\"[", B, "] = ", end, " but \"", name, "\" has T = ", T, " rows"));
    job.out_shape = {next ? T - B : T};
  } else {
    const int64_t B = input->shape(0), S = input->shape(1);
    LOGPROB_RETURN_IF_ERROR(CheckShape(*ids, {B, S}, name + "' [B, S]"));
    if (next && S < 1) return Invalid(absl::StrCat("\"", name, "\": S must be >= 1"));
    if (lens) {
      LOGPROB_RETURN_IF_ERROR(CheckIntTensor(*lens));
      LOGPROB_RETURN_IF_ERROR(CheckShape(*lens, {B}, name + "' [B]"));
    }
    // With S = 0 the tensors are empty whatever B is: bound the per-sequence
    // work before it.
    if (B > limits.max_tokens)
      return Invalid(absl::StrCat("\"", name, "\": B = ", B, " sequences, over the server's max_tokens_per_request ",
                                  limits.max_tokens));
    const int64_t S_out = next ? S - 1 : S;
    for (int64_t b = 0; b < B; ++b) {
      int64_t L = S;
      if (lens) {
        L = ReadInt(lens->dtype(), lens_bytes.data(), b);
        if (L < 0 || L > S) return Invalid(absl::StrCat("\"seq_lens\"[", b, "] = ", L, " is outside [0, S = ", S, "]"));
      }
      seqs.push_back({b * S, L, b * S_out});
    }
    job.out_shape = {B, S_out};
  }
  const int64_t total_rows = packed ? input->shape(0) : input->shape(0) * input->shape(1);
  if (total_rows > limits.max_tokens)
    return Invalid(absl::StrCat("request has ", total_rows, " tokens, over the server's max_tokens_per_request ",
                                limits.max_tokens));

  if (gather) {
    LOGPROB_RETURN_IF_ERROR(CheckIntTensor(*gather));
    std::vector<int64_t> want = job.out_shape;
    if (gather->shape_size() != static_cast<int>(want.size()) + 1)
      return Invalid(absl::StrCat("\"gather_indices\": shape ", ShapeStr(*gather), " is not the output shape [",
                                  absl::StrJoin(want, ", "), "] plus [K]"));
    want.push_back(gather->shape(gather->shape_size() - 1));
    LOGPROB_RETURN_IF_ERROR(CheckShape(*gather, want, "the output shape plus K"));
    if (want.back() > limits.max_topk)
      return Invalid(
          absl::StrCat("\"gather_indices\": K = ", want.back(), " exceeds the server's max_topk ", limits.max_topk));
    job.gather_k = static_cast<int>(want.back());
  }
  std::shared_ptr<RolloutInput> rollout_in;
  if (rollout) {
    if (rollout->dtype() != v1::F32)
      return Invalid(absl::StrCat("\"rollout_logprobs\": dtype ", DTypeName(rollout->dtype()), " is not F32"));
    LOGPROB_RETURN_IF_ERROR(CheckShape(*rollout, job.out_shape, "the output shape"));
    rollout_in = std::make_shared<RolloutInput>();
    LOGPROB_RETURN_IF_ERROR(ParseRolloutOptions(job.options, rollout_in.get()));
    rollout_in->logprobs.resize(static_cast<size_t>(job.num_outputs()));
    if (!rollout_in->logprobs.empty())
      std::memcpy(rollout_in->logprobs.data(), rollout_bytes.data(), rollout_in->logprobs.size() * sizeof(float));
    // Sequence s's outputs: [out0, out0 + S') padded, [out0, next out0) packed.
    const int64_t seq_span = packed ? 0 : job.out_shape[1];
    for (size_t s = 0; s < seqs.size(); ++s) rollout_in->seq_out.push_back(seqs[s].out0);
    rollout_in->seq_out.push_back(packed ? job.out_shape[0] : static_cast<int64_t>(seqs.size()) * seq_span);
  }
  ClearRolloutOptions(&job.options);
  if ((mask_offsets == nullptr) != (mask_ids == nullptr))
    return Invalid("give both \"sampling_mask_offsets\" and \"sampling_mask_ids\", or neither");
  const int64_t nnz = mask_ids ? (mask_ids->shape_size() == 1 ? mask_ids->shape(0) : -1) : 0;
  if (mask_offsets) {
    LOGPROB_RETURN_IF_ERROR(CheckIntTensor(*mask_offsets));
    LOGPROB_RETURN_IF_ERROR(CheckIntTensor(*mask_ids));
    LOGPROB_RETURN_IF_ERROR(CheckShape(*mask_offsets, {job.num_outputs() + 1}, "the outputs plus one"));
    if (nnz < 0) return Invalid(absl::StrCat("\"sampling_mask_ids\": shape ", ShapeStr(*mask_ids), " is not [nnz]"));
    if (HasSamplingFilters(job.options))
      return Invalid("a sampling mask replaces options.sampling_top_k / sampling_top_p: give one or the other");
    if (job.options.is_top1())
      return Invalid("options.is_top1 is the argmax over the whole vocabulary; it is not defined with a sampling mask");
    int64_t prev = 0;
    for (int64_t o = 0; o <= job.num_outputs(); ++o) {
      const int64_t v = ReadInt(mask_offsets->dtype(), mask_offsets_bytes.data(), o);
      if ((o == 0 && v != 0) || v < prev || v > nnz)
        return Invalid(absl::StrCat("\"sampling_mask_offsets\"[", o, "] = ", v, ": offsets must start at 0, ",
                                    "not decrease and end at nnz = ", nnz));
      prev = v;
    }
    if (prev != nnz)
      return Invalid(
          absl::StrCat("\"sampling_mask_offsets\" ends at ", prev, " but \"sampling_mask_ids\" has ", nnz, " ids"));
    job.mask_offsets.push_back(0);
  }

  if (!grad_lp && !job.options.gradient_step().empty())
    return Invalid("options.gradient_step is for the lm_head's backward: give \"grad_token_logprobs\" too");
  if (grad_ent && !grad_lp) return Invalid("\"grad_entropy\" needs \"grad_token_logprobs\" (the lm_head's backward)");
  if (grad_lp) {
    LOGPROB_RETURN_IF_ERROR(CheckBackward(*input, grad_lp, grad_ent, job.options, job.gather_k, rollout != nullptr,
                                          mask_offsets != nullptr, job.out_shape));
    job.backward = true;
    job.input_shape.assign(input->shape().begin(), input->shape().end() - 1);
  }

  // Scored rows: in sequence s, position t scores input_ids[t + shift].
  const int64_t shift = next ? 1 : 0;
  const char* id_data = id_bytes.data();
  const char* gather_data = gather_bytes.data();
  for (size_t s = 0; s < seqs.size(); ++s) {
    const Seq& q = seqs[s];
    for (int64_t t = 0; t + shift < q.len; ++t) {
      const int64_t target = ReadInt(ids->dtype(), id_data, q.row0 + t + shift);
      if (target != ignore && (target < 0 || target >= V))
        return Invalid(absl::StrCat("\"input_ids\": target ", target, " of sequence ", s, " at position ", t + shift,
                                    " is outside [0, V = ", V, ") and is not ignore_index ", ignore));
      const int64_t out = q.out0 + t;
      job.rows.push_back(q.row0 + t);
      job.targets.push_back(target == ignore ? -1 : target);
      job.out_pos.push_back(out);
      if (grad_lp) {
        // Upstream gradients: finite where they count (dL/dlogprob at a
        // scored target, dL/dentropy at every output position).
        float g = 0.0f, e = 0.0f;
        if (target != ignore) std::memcpy(&g, grad_lp_bytes.data() + out * sizeof(float), sizeof g);
        if (!std::isfinite(g))
          return Invalid(
              absl::StrCat("\"grad_token_logprobs\": ", g, " at sequence ", s, " position ", t, " is not finite"));
        job.grad_logprobs.push_back(g);
        if (grad_ent) {
          std::memcpy(&e, grad_ent_bytes.data() + out * sizeof(float), sizeof e);
          if (!std::isfinite(e))
            return Invalid(
                absl::StrCat("\"grad_entropy\": ", e, " at sequence ", s, " position ", t, " is not finite"));
          job.grad_entropy.push_back(e);
        }
      }
      if (rollout_in && target != ignore)
        LOGPROB_RETURN_IF_ERROR(CheckRolloutLogprob(rollout_in->logprobs[out], static_cast<int64_t>(s), t));
      if (mask_offsets) {
        const int64_t a = ReadInt(mask_offsets->dtype(), mask_offsets_bytes.data(), out),
                      b = ReadInt(mask_offsets->dtype(), mask_offsets_bytes.data(), out + 1);
        for (int64_t j = a; j < b; ++j) {
          const int64_t id = ReadInt(mask_ids->dtype(), mask_ids_bytes.data(), j);
          if (id < 0 || id >= V)
            return Invalid(absl::StrCat("\"sampling_mask_ids\": id ", id, " of sequence ", s, " at position ", t,
                                        " (entry ", j - a, ") is outside [0, V = ", V, ")"));
          if (j > a && id <= job.mask_ids.back())
            return Invalid(absl::StrCat("\"sampling_mask_ids\": the ids of sequence ", s, " at position ", t,
                                        " are not strictly ascending (entry ", j - a, ": ", id, " after ",
                                        job.mask_ids.back(), ")"));
          job.mask_ids.push_back(static_cast<int32_t>(id));
        }
        job.mask_offsets.push_back(static_cast<int64_t>(job.mask_ids.size()));
      }
      for (int j = 0; j < job.gather_k; ++j) {
        const int64_t g = ReadInt(gather->dtype(), gather_data, out * job.gather_k + j);
        if (g < 0 || g >= V)
          return Invalid(absl::StrCat("\"gather_indices\": id ", g, " of sequence ", s, " at position ", t, " (entry ",
                                      j, ") is outside [0, V = ", V, ")"));
        job.gather_ids.push_back(g);
      }
    }
  }
  const std::shared_ptr<const InputSource>& source = bytes.source(input);
  job.rollout = std::move(rollout_in);
  job.segments.push_back({0, source});
  if (source->rules().every_input_row) ExpandToInputRows(total_rows, &job);
  return job;
}

bool ScoreJob::batchable() const {
  for (const Segment& s : segments)
    if (!s.source->rules().batchable) return false;
  return true;
}

const InputSource* ScoreJob::referenced_source() const {
  if (segments.size() != 1 || segments.front().source->rules().readable_here) return nullptr;
  return segments.front().source.get();
}

absl::Status ScoreJob::ReadStatus() const {
  for (const Segment& s : segments) LOGPROB_RETURN_IF_ERROR(s.source->status());
  return absl::OkStatus();
}

void ExpandToInputRows(int64_t input_rows, ScoreJob* job) {
  const int64_t n = input_rows;
  const int k = job->gather_k;
  std::vector<int64_t> rows(static_cast<size_t>(n));
  std::vector<int64_t> targets(static_cast<size_t>(n), -1), out_pos(static_cast<size_t>(n), -1);
  std::vector<int64_t> gather_ids(static_cast<size_t>(n) * k, 0);
  for (int64_t r = 0; r < n; ++r) rows[r] = r;
  for (int64_t j = 0; j < job->num_rows(); ++j) {
    const int64_t r = job->rows[j];
    targets[r] = job->targets[j];
    out_pos[r] = job->out_pos[j];
    std::copy_n(job->gather_ids.begin() + j * k, k, gather_ids.begin() + r * k);
  }
  if (job->has_masks()) {  // unscored rows: no mask
    std::vector<int64_t> first(static_cast<size_t>(n), 0), count(static_cast<size_t>(n), 0);
    for (int64_t j = 0; j < job->num_rows(); ++j) {
      first[job->rows[j]] = job->mask_offsets[j];
      count[job->rows[j]] = job->mask_offsets[j + 1] - job->mask_offsets[j];
    }
    std::vector<int64_t> offsets = {0};
    std::vector<int32_t> ids;
    for (int64_t r = 0; r < n; ++r) {
      ids.insert(ids.end(), job->mask_ids.begin() + first[r], job->mask_ids.begin() + first[r] + count[r]);
      offsets.push_back(static_cast<int64_t>(ids.size()));
    }
    job->mask_offsets = std::move(offsets);
    job->mask_ids = std::move(ids);
  }
  if (job->backward) {  // unscored rows: no gradient
    std::vector<float> g_lp(static_cast<size_t>(n), 0.0f), g_ent;
    if (!job->grad_entropy.empty()) g_ent.assign(static_cast<size_t>(n), 0.0f);
    for (int64_t j = 0; j < job->num_rows(); ++j) {
      g_lp[job->rows[j]] = job->grad_logprobs[j];
      if (!g_ent.empty()) g_ent[job->rows[j]] = job->grad_entropy[j];
    }
    job->grad_logprobs = std::move(g_lp);
    job->grad_entropy = std::move(g_ent);
  }
  job->rows = std::move(rows);
  job->targets = std::move(targets);
  job->out_pos = std::move(out_pos);
  job->gather_ids = std::move(gather_ids);
}

namespace {

/// The source of row `row` and the first row after its segment.
std::pair<const InputSource*, int64_t> SourceOf(const ScoreJob& job, int64_t row) {
  auto it = std::upper_bound(job.segments.begin(), job.segments.end(), row,
                             [](int64_t r, const ScoreJob::Segment& s) { return r < s.first_row; });
  const int64_t segment_end = it == job.segments.end() ? job.num_rows() : it->first_row;
  return {std::prev(it)->source.get(), segment_end};
}

}  // namespace

bool CopyRows(const ScoreJob& job, int64_t begin, int64_t end, char* out) {
  bool ok = true;
  const auto row_bytes = static_cast<int64_t>(job.row_bytes);
  for (int64_t r = begin; r < end;) {
    const auto [source, segment_end] = SourceOf(job, r);
    const int64_t limit = std::min(end, segment_end);
    int64_t run = 1;
    while (r + run < limit && job.rows[r + run] == job.rows[r] + run) ++run;
    ok &= source->Read(job.rows[r] * row_bytes, static_cast<size_t>(run * row_bytes), out);
    out += run * row_bytes;
    r += run;
  }
  return ok;
}

bool CopyRowSlice(const ScoreJob& job, int64_t row, size_t offset, size_t n, char* dst) {
  return SourceOf(job, row).first->Read(
      job.rows[row] * static_cast<int64_t>(job.row_bytes) + static_cast<int64_t>(offset), n, dst);
}

}  // namespace logprob
