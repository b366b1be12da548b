#include "client/request_splitter.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/request_builder.h"
#include "common/dtype.h"

namespace logprob::client {
namespace {

// Upper bound of what a part's id suffix "-<i>" and the id's length prefix
// add to the serialized size.
constexpr int64_t kIdSlackBytes = 32;

const v1::Tensor* FindInput(const v1::ScoreRequest& request, std::string_view name) {
  for (const v1::Tensor& t : request.inputs()) {
    if (t.name() == name) return &t;
  }
  return nullptr;
}

std::string ShapeString(const v1::Tensor& t) { return absl::StrCat("[", absl::StrJoin(t.shape(), ", "), "]"); }

// Checks that `t` has rank >= 1, a known dtype and as many bytes as its
// shape needs.
absl::Status CheckTensor(const v1::Tensor& t) {
  const size_t es = DTypeSize(t.dtype());
  if (es == 0) {
    return absl::InvalidArgumentError(absl::StrCat("input '", t.name(), "' has an unsupported dtype"));
  }
  if (t.shape_size() < 1) {
    return absl::InvalidArgumentError(absl::StrCat("input '", t.name(), "' is a scalar; cannot split it"));
  }
  uint64_t n = es;
  for (int64_t d : t.shape()) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("input '", t.name(), "' has a negative dimension in ", ShapeString(t)));
    }
    if (d != 0 && n > t.data().size()) break;  // too large; caught below
    n *= static_cast<uint64_t>(d);
  }
  if (n != t.data().size()) {
    return absl::InvalidArgumentError(absl::StrCat("input '", t.name(), "' has ", t.data().size(), " bytes; shape ",
                                                   ShapeString(t), " of ", DTypeName(t.dtype()), " needs ", n));
  }
  return absl::OkStatus();
}

int64_t RowBytes(const v1::Tensor& t) {
  return t.shape(0) == 0 ? 0 : static_cast<int64_t>(t.data().size()) / t.shape(0);
}

// Rows [r0, r1) of `t` along its first dimension.
v1::Tensor SliceRows(const v1::Tensor& t, int64_t r0, int64_t r1) {
  v1::Tensor out;
  out.set_name(t.name());
  out.set_dtype(t.dtype());
  *out.mutable_shape() = t.shape();
  out.set_shape(0, r1 - r0);
  const int64_t rb = RowBytes(t);
  out.set_data(t.data().data() + r0 * rb, static_cast<size_t>((r1 - r0) * rb));
  return out;
}

// How a request divides into sequences, and how to make the request of a
// run of consecutive sequences.
struct Plan {
  std::vector<int64_t> seq_bytes;   // tensor bytes each sequence adds
  std::vector<int64_t> seq_tokens;  // token positions of each sequence
  int64_t part_extra_bytes = 0;     // tensor bytes every part adds
  // Inputs of the part holding sequences [s0, s1).
  std::function<void(int64_t s0, int64_t s1, v1::ScoreRequest* part)> fill_inputs;
};

// A 1-D tensor named and typed (I32 / I64) like `like` holding
// values[a..b] - values[a]: a part's cu_seqlens or mask offsets.
v1::Tensor Rebased(const v1::Tensor& like, const std::vector<int64_t>& values, int64_t a, int64_t b) {
  v1::Tensor out;
  out.set_name(like.name());
  out.set_dtype(like.dtype());
  out.add_shape(b - a + 1);
  std::string data;
  for (int64_t i = a; i <= b; ++i) {
    const int64_t v = values[i] - values[a];
    if (like.dtype() == v1::I32) {
      const int32_t v32 = static_cast<int32_t>(v);
      data.append(reinterpret_cast<const char*>(&v32), 4);
    } else {
      data.append(reinterpret_cast<const char*>(&v), 8);
    }
  }
  out.set_data(std::move(data));
  return out;
}

bool IsMaskTensor(const v1::Tensor& t) {
  return t.name() == kSamplingMaskOffsetsName || t.name() == kSamplingMaskIdsName;
}

// Adds the sampling mask (CSR over the output rows; `out_offset` [B + 1]:
// each sequence's first output row) to `plan`: each sequence's bytes, the
// offsets' extra entry per part, and its two tensors in every part
// (offsets rebased to 0) after what `plan.fill_inputs` adds. Nothing
// without a mask.
absl::Status PlanMask(const v1::ScoreRequest& request, const std::vector<int64_t>& out_offset, Plan* plan) {
  const v1::Tensor* off = FindInput(request, kSamplingMaskOffsetsName);
  const v1::Tensor* ids = FindInput(request, kSamplingMaskIdsName);
  if (off == nullptr && ids == nullptr) return absl::OkStatus();
  if (off == nullptr || ids == nullptr)
    return absl::InvalidArgumentError("cannot split: give both 'sampling_mask_offsets' and 'sampling_mask_ids'");
  for (const v1::Tensor* t : {off, ids}) {
    if (absl::Status s = CheckTensor(*t); !s.ok()) return s;
    if (!IsIntDType(t->dtype()) || t->shape_size() != 1)
      return absl::InvalidArgumentError(absl::StrCat("cannot split: '", t->name(), "' must be a 1-D I32/I64 tensor"));
  }
  const int64_t n = out_offset.back();
  if (off->shape(0) != n + 1)
    return absl::InvalidArgumentError(absl::StrCat("cannot split: 'sampling_mask_offsets' ", ShapeString(*off),
                                                   " must have ", n + 1, " entries, one per output row plus one"));
  std::vector<int64_t> offv(static_cast<size_t>(n + 1));
  for (int64_t i = 0; i <= n; ++i) {
    offv[i] = ReadInt(off->dtype(), off->data().data(), i);
    if ((i == 0 && offv[i] != 0) || (i > 0 && offv[i] < offv[i - 1]))
      return absl::InvalidArgumentError("cannot split: 'sampling_mask_offsets' must start at 0 and not decrease");
  }
  if (offv[n] != ids->shape(0))
    return absl::InvalidArgumentError("cannot split: 'sampling_mask_offsets' does not end at the number of ids");
  const int64_t oe = static_cast<int64_t>(DTypeSize(off->dtype())), ie = static_cast<int64_t>(DTypeSize(ids->dtype()));
  for (size_t s = 0; s + 1 < out_offset.size(); ++s)
    plan->seq_bytes[s] +=
        (out_offset[s + 1] - out_offset[s]) * oe + (offv[out_offset[s + 1]] - offv[out_offset[s]]) * ie;
  plan->part_extra_bytes += oe;
  plan->fill_inputs = [rest = std::move(plan->fill_inputs), off, ids, offv = std::move(offv), out_offset](
                          int64_t s0, int64_t s1, v1::ScoreRequest* part) {
    rest(s0, s1, part);
    const int64_t a = out_offset[s0], b = out_offset[s1];
    *part->add_inputs() = Rebased(*off, offv, a, b);
    *part->add_inputs() = SliceRows(*ids, offv[a], offv[b]);
  };
  return absl::OkStatus();
}

absl::StatusOr<Plan> PlanPadded(const v1::ScoreRequest& request, const v1::Tensor& rows) {
  if (rows.shape_size() != 3) {
    return absl::InvalidArgumentError("padded input needs 3-D rows");
  }
  const int64_t B = rows.shape(0);
  const int64_t S = rows.shape(1);
  Plan plan;
  int64_t bytes_per_seq = 0;
  for (const v1::Tensor& t : request.inputs()) {
    if (IsMaskTensor(t)) continue;
    if (t.name() == kCuSeqlensName) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot split: 'cu_seqlens' given with 3-D '", rows.name(), "' ", ShapeString(rows)));
    }
    if (absl::Status s = CheckTensor(t); !s.ok()) return s;
    if (t.shape(0) != B) {
      return absl::InvalidArgumentError(absl::StrCat("cannot split: input '", t.name(), "' ", ShapeString(t),
                                                     " does not have B = ", B, " rows like '", rows.name(), "' ",
                                                     ShapeString(rows)));
    }
    bytes_per_seq += RowBytes(t);
  }
  plan.seq_bytes.assign(B, bytes_per_seq);
  plan.seq_tokens.assign(B, S);
  plan.fill_inputs = [req = &request](int64_t s0, int64_t s1, v1::ScoreRequest* part) {
    for (const v1::Tensor& t : req->inputs()) {
      if (!IsMaskTensor(t)) *part->add_inputs() = SliceRows(t, s0, s1);
    }
  };
  const int64_t s_out = request.options().alignment() == v1::NEXT_TOKEN ? std::max<int64_t>(S - 1, 0) : S;
  std::vector<int64_t> out_offset(B + 1);
  for (int64_t b = 0; b <= B; ++b) out_offset[b] = b * s_out;
  if (absl::Status s = PlanMask(request, out_offset, &plan); !s.ok()) return s;
  return plan;
}

absl::StatusOr<Plan> PlanPacked(const v1::ScoreRequest& request, const v1::Tensor& rows) {
  const int64_t T = rows.shape(0);
  const bool next_token = request.options().alignment() == v1::NEXT_TOKEN;
  const v1::Tensor* ids = FindInput(request, kInputIdsName);
  const v1::Tensor* cu = FindInput(request, kCuSeqlensName);
  const v1::Tensor* gather = FindInput(request, kGatherIndicesName);
  const v1::Tensor* rollout = FindInput(request, kRolloutLogprobsName);
  for (const v1::Tensor& t : request.inputs()) {
    if (&t != &rows && &t != ids && &t != cu && &t != gather && &t != rollout && !IsMaskTensor(t)) {
      return absl::InvalidArgumentError(absl::StrCat("cannot split packed input with input '", t.name(), "'"));
    }
    if (absl::Status s = CheckTensor(t); !s.ok()) return s;
  }
  if (ids == nullptr || ids->shape(0) != T) {
    return absl::InvalidArgumentError(absl::StrCat("cannot split: packed 'input_ids' must have T = ", T, " rows like '",
                                                   rows.name(), "' ", ShapeString(rows)));
  }

  // Sequence boundaries.
  std::vector<int64_t> cuv;
  if (cu == nullptr) {
    cuv = {0, T};
  } else {
    if (!IsIntDType(cu->dtype()) || cu->shape_size() != 1 || cu->shape(0) < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot split: 'cu_seqlens' must be a 1-D I32/I64 tensor [B+1], got ", DTypeName(cu->dtype()),
                       " ", ShapeString(*cu)));
    }
    cuv.resize(cu->shape(0));
    for (size_t i = 0; i < cuv.size(); ++i) {
      cuv[i] = ReadInt(cu->dtype(), cu->data().data(), i);
    }
    if (cuv.front() != 0 || cuv.back() != T) {
      return absl::InvalidArgumentError(absl::StrCat("cannot split: 'cu_seqlens' must start at 0 and end at T = ", T));
    }
    for (size_t i = 1; i < cuv.size(); ++i) {
      if (cuv[i] < cuv[i - 1]) {
        return absl::InvalidArgumentError(absl::StrCat("cannot split: 'cu_seqlens' decreases at index ", i));
      }
    }
  }
  const int64_t B = static_cast<int64_t>(cuv.size()) - 1;

  // Output rows per sequence, and their running offsets.
  std::vector<int64_t> out_offset(B + 1, 0);
  for (int64_t i = 0; i < B; ++i) {
    const int64_t len = cuv[i + 1] - cuv[i];
    out_offset[i + 1] = out_offset[i] + (next_token ? std::max<int64_t>(len - 1, 0) : len);
  }
  // Inputs with one row per output row.
  int64_t out_row_bytes = 0;
  for (const v1::Tensor* t : {gather, rollout}) {
    if (t == nullptr) continue;
    if (t->shape_size() < 1 || t->shape(0) != out_offset[B]) {
      return absl::InvalidArgumentError(absl::StrCat("cannot split: '", t->name(), "' ", ShapeString(*t), " must have ",
                                                     out_offset[B], " rows, one per output row"));
    }
    out_row_bytes += RowBytes(*t);
  }

  Plan plan;
  const int64_t token_bytes = RowBytes(rows) + RowBytes(*ids);
  const int64_t cu_entry = cu == nullptr ? 0 : static_cast<int64_t>(DTypeSize(cu->dtype()));
  plan.part_extra_bytes = cu_entry;  // the leading 0 of each part's cu_seqlens
  for (int64_t i = 0; i < B; ++i) {
    const int64_t len = cuv[i + 1] - cuv[i];
    const int64_t outs = out_offset[i + 1] - out_offset[i];
    plan.seq_bytes.push_back(len * token_bytes + cu_entry + outs * out_row_bytes);
    plan.seq_tokens.push_back(len);
  }
  plan.fill_inputs = [req = &request, rows_t = &rows, ids, cu, gather, rollout, cuv = std::move(cuv), out_offset](
                         int64_t s0, int64_t s1, v1::ScoreRequest* part) {
    for (const v1::Tensor& t : req->inputs()) {
      if (&t == rows_t || &t == ids) {
        *part->add_inputs() = SliceRows(t, cuv[s0], cuv[s1]);
      } else if (&t == gather || &t == rollout) {
        *part->add_inputs() = SliceRows(t, out_offset[s0], out_offset[s1]);
      } else if (&t == cu) {
        *part->add_inputs() = Rebased(t, cuv, s0, s1);
      }
    }
  };
  if (absl::Status s = PlanMask(request, out_offset, &plan); !s.ok()) return s;
  return plan;
}

}  // namespace

absl::StatusOr<std::vector<v1::ScoreRequest>> SplitScoreRequest(const v1::ScoreRequest& request,
                                                                const SplitLimits& limits) {
  if (limits.max_bytes <= 0) {
    return absl::InvalidArgumentError("max_bytes must be > 0");
  }
  const int64_t total_bytes = static_cast<int64_t>(request.ByteSizeLong());
  const int64_t total_tokens = CountInputTokens(request);
  if (total_bytes <= limits.max_bytes && (limits.max_tokens <= 0 || total_tokens <= limits.max_tokens)) {
    return std::vector<v1::ScoreRequest>{request};
  }

  const v1::Tensor* rows = FindInput(request, kLogitsName);
  if (rows == nullptr) rows = FindInput(request, kHiddenStatesName);
  if (rows == nullptr) {
    return absl::InvalidArgumentError("cannot split a request without 'logits' or 'hidden_states'");
  }
  if (absl::Status s = CheckTensor(*rows); !s.ok()) return s;
  absl::StatusOr<Plan> plan;
  if (rows->shape_size() == 3) {
    plan = PlanPadded(request, *rows);
  } else if (rows->shape_size() == 2) {
    plan = PlanPacked(request, *rows);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot split: '", rows->name(), "' ", ShapeString(*rows), " is neither [B, S, X] nor [T, X]"));
  }
  if (!plan.ok()) return plan.status();

  // Everything that is not tensor data (names, shapes, options, length
  // prefixes) shrinks or stays in a part, except the id, which grows.
  int64_t data_bytes = 0;
  for (const v1::Tensor& t : request.inputs()) data_bytes += t.data().size();
  const int64_t overhead = total_bytes - data_bytes + kIdSlackBytes + plan->part_extra_bytes;
  const int64_t budget = limits.max_bytes - overhead;
  if (budget <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("a request of at most ", limits.max_bytes,
                                                   " bytes has no room for tensor data (", overhead,
                                                   " bytes of overhead)"));
  }

  // Greedy grouping of consecutive sequences.
  const int64_t n = static_cast<int64_t>(plan->seq_bytes.size());
  std::vector<std::pair<int64_t, int64_t>> groups;
  int64_t begin = 0, bytes = 0, tokens = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t sb = plan->seq_bytes[i];
    const int64_t st = plan->seq_tokens[i];
    if (sb > budget) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence ", i, " alone needs ", sb, " bytes of tensor data, more than the ", budget,
                       " that fit in a request of at most ", limits.max_bytes,
                       " bytes; it cannot be sent (raise the server's max request size)"));
    }
    if (limits.max_tokens > 0 && st > limits.max_tokens) {
      return absl::InvalidArgumentError(absl::StrCat("sequence ", i, " has ", st, " tokens, more than the ",
                                                     limits.max_tokens, " allowed per request; it cannot be sent"));
    }
    if (i > begin && (bytes + sb > budget || (limits.max_tokens > 0 && tokens + st > limits.max_tokens))) {
      groups.emplace_back(begin, i);
      begin = i;
      bytes = 0;
      tokens = 0;
    }
    bytes += sb;
    tokens += st;
  }
  if (n > begin) groups.emplace_back(begin, n);
  if (groups.size() <= 1) return std::vector<v1::ScoreRequest>{request};

  std::vector<v1::ScoreRequest> parts;
  parts.reserve(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    v1::ScoreRequest part;
    part.set_id(absl::StrCat(request.id(), "-", g + 1));
    *part.mutable_options() = request.options();
    part.set_head(request.head());
    part.set_head_version(request.head_version());
    plan->fill_inputs(groups[g].first, groups[g].second, &part);
    const int64_t size = static_cast<int64_t>(part.ByteSizeLong());
    if (size > limits.max_bytes) {
      return absl::InternalError(
          absl::StrCat("part ", g + 1, " has ", size, " bytes, over the limit of ", limits.max_bytes));
    }
    parts.push_back(std::move(part));
  }
  return parts;
}

namespace {

/// The request's rollout mismatch from its parts': every mean over all
/// compared tokens is the token-weighted mean of the parts' (the server's
/// definition, docs/SPEC.md "Rollout mismatch"); NaN without tokens.
v1::RolloutMismatch JoinRolloutMismatch(const std::vector<v1::ScoreResponse>& parts) {
  int64_t tokens = 0;
  double abs_l = 0, k1 = 0, k3 = 0, band = 0;
  for (const v1::ScoreResponse& p : parts) {
    const v1::RolloutMismatch& m = p.rollout_mismatch();
    if (m.tokens() == 0) continue;
    const double n = static_cast<double>(m.tokens());
    tokens += m.tokens();
    abs_l += m.mean_abs_log_ratio() * n;
    k1 += m.k1() * n;
    k3 += m.k3() * n;
    band += m.outside_band_fraction() * n;
  }
  v1::RolloutMismatch out;
  const double n = static_cast<double>(tokens), nan = std::numeric_limits<double>::quiet_NaN();
  out.set_tokens(tokens);
  out.set_mean_abs_log_ratio(tokens ? abs_l / n : nan);
  out.set_k1(tokens ? k1 / n : nan);
  out.set_k3(tokens ? k3 / n : nan);
  out.set_outside_band_fraction(tokens ? band / n : nan);
  return out;
}

}  // namespace

absl::StatusOr<v1::ScoreResponse> JoinScoreResponses(std::vector<v1::ScoreResponse> parts, const std::string& id) {
  if (parts.empty()) return absl::InvalidArgumentError("no responses to join");
  for (size_t p = 0; p < parts.size(); ++p) {
    if (parts[p].status_code() != 0) {
      return absl::Status(static_cast<absl::StatusCode>(parts[p].status_code()),
                          absl::StrCat("part ", p + 1, "/", parts.size(), ": ", parts[p].status_message()));
    }
  }
  if (parts.size() == 1) {
    v1::ScoreResponse only = std::move(parts[0]);
    only.set_id(id);
    return only;
  }

  v1::ScoreResponse joined;
  joined.set_id(id);
  joined.set_head(parts[0].head());
  joined.set_head_version(parts[0].head_version());
  if (parts[0].has_rollout_mismatch()) *joined.mutable_rollout_mismatch() = JoinRolloutMismatch(parts);
  for (size_t p = 1; p < parts.size(); ++p) {
    if (parts[p].outputs_size() != parts[0].outputs_size()) {
      return absl::InvalidArgumentError(absl::StrCat("part ", p + 1, " has ", parts[p].outputs_size(),
                                                     " outputs, part 1 has ", parts[0].outputs_size()));
    }
  }
  for (const v1::Tensor& first : parts[0].outputs()) {
    if (absl::Status s = CheckTensor(first); !s.ok()) return s;
    v1::Tensor* out = joined.add_outputs();
    out->set_name(first.name());
    out->set_dtype(first.dtype());
    *out->mutable_shape() = first.shape();
    size_t total = 0;
    std::vector<const v1::Tensor*> pieces;
    for (size_t p = 0; p < parts.size(); ++p) {
      const v1::Tensor* piece = nullptr;
      for (const v1::Tensor& t : parts[p].outputs()) {
        if (t.name() == first.name()) piece = &t;
      }
      if (piece == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat("part ", p + 1, " has no output '", first.name(), "'"));
      }
      if (absl::Status s = CheckTensor(*piece); !s.ok()) return s;
      const bool same_tail = piece->shape_size() == first.shape_size() &&
                             std::equal(piece->shape().begin() + 1, piece->shape().end(), first.shape().begin() + 1);
      if (piece->dtype() != first.dtype() || !same_tail) {
        return absl::InvalidArgumentError(
            absl::StrCat("output '", first.name(), "' of part ", p + 1, " is ", DTypeName(piece->dtype()), " ",
                         ShapeString(*piece), ", of part 1 ", DTypeName(first.dtype()), " ", ShapeString(first)));
      }
      pieces.push_back(piece);
      total += piece->data().size();
    }
    int64_t rows_total = 0;
    std::string data;
    data.reserve(total);
    for (const v1::Tensor* piece : pieces) {
      rows_total += piece->shape(0);
      data.append(piece->data());
    }
    out->set_shape(0, rows_total);
    out->set_data(std::move(data));
  }
  return joined;
}

}  // namespace logprob::client
