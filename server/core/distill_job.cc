#include "server/core/distill_job.h"

#include <cmath>
#include <cstring>
#include <map>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/partition.h"
#include "common/status_macros.h"
#include "server/core/head_gradients.h"

namespace logprob {
namespace {

absl::Status Invalid(const std::string& what) { return absl::InvalidArgumentError("DistillRequest: " + what); }

/// The input named `name` ([N, H] of a float dtype, or [N] F32): its
/// shape, dtype and bytes checked. `rank2`: a hidden-states tensor.
absl::Status CheckTensor(const v1::Tensor& t, bool rank2) {
  if (t.source_case() != v1::Tensor::kData && t.source_case() != v1::Tensor::SOURCE_NOT_SET)
    return Invalid(absl::StrCat("input ", t.name(),
                                ": its bytes go in `data` (no shared-memory or CUDA IPC "
                                "references for distillation yet)"));
  if (rank2 ? !IsFloatDType(t.dtype()) : t.dtype() != v1::F32)
    return Invalid(absl::StrCat("input ", t.name(), ": dtype ", DTypeName(t.dtype()), ", ",
                                rank2 ? "F32, BF16 or F16" : "F32", " expected"));
  if (t.shape_size() != (rank2 ? 2 : 1))
    return Invalid(
        absl::StrCat("input ", t.name(), ": ", t.shape_size(), " dimensions, ", rank2 ? "[N, H]" : "[N]", " expected"));
  int64_t n = 1;
  for (int64_t d : t.shape()) {
    if (d < 0) return Invalid(absl::StrCat("input ", t.name(), ": negative dimension ", d));
    n *= d;
  }
  if (static_cast<int64_t>(t.data().size()) != n * static_cast<int64_t>(DTypeSize(t.dtype())))
    return Invalid(absl::StrCat("input ", t.name(), ": ", t.data().size(), " bytes of data, ",
                                n * static_cast<int64_t>(DTypeSize(t.dtype())), " for its shape and dtype"));
  return absl::OkStatus();
}

/// The F32 values of `t` ([N]), each finite.
absl::StatusOr<std::vector<float>> FiniteValues(const v1::Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.shape(0)));
  if (!v.empty()) std::memcpy(v.data(), t.data().data(), v.size() * sizeof(float));
  for (size_t i = 0; i < v.size(); ++i)
    if (!std::isfinite(v[i])) return Invalid(absl::StrCat("input ", t.name(), "[", i, "] is not finite"));
  return v;
}

}  // namespace

int64_t DistillJob::working_bytes(int workers) const {
  const int64_t hidden = static_cast<int64_t>(student_bytes.size() + teacher_bytes.size());
  const int64_t grads = static_cast<int64_t>(grad_divergence.size() + grad_cross_entropy.size()) * 4;
  const int64_t outputs = rows * 3 * 4 + (backward ? rows * student_hidden * 4 : 0);
  return 2 * hidden + 2 * grads * workers + 2 * outputs;
}

absl::StatusOr<DistillJob> BuildDistillJob(const v1::DistillRequest& req, const LmHeads* heads,
                                           const RequestLimits& limits) {
  std::map<std::string, const v1::Tensor*> in;
  for (const v1::Tensor& t : req.inputs()) {
    if (t.name() != "student_hidden_states" && t.name() != "teacher_hidden_states" && t.name() != "grad_divergence" &&
        t.name() != "grad_cross_entropy")
      return Invalid(absl::StrCat("unknown input \"", t.name(),
                                  "\" (student_hidden_states, teacher_hidden_states, grad_divergence, "
                                  "grad_cross_entropy)"));
    if (!in.emplace(t.name(), &t).second) return Invalid(absl::StrCat("input ", t.name(), " given twice"));
  }
  for (const char* need : {"student_hidden_states", "teacher_hidden_states"})
    if (!in.count(need)) return Invalid(absl::StrCat("input ", need, " is missing"));
  const v1::Tensor& hs = *in["student_hidden_states"];
  const v1::Tensor& ht = *in["teacher_hidden_states"];
  LOGPROB_RETURN_IF_ERROR(CheckTensor(hs, true));
  LOGPROB_RETURN_IF_ERROR(CheckTensor(ht, true));
  DistillJob job;
  job.rows = hs.shape(0);
  if (ht.shape(0) != job.rows)
    return Invalid(absl::StrCat("teacher_hidden_states has ", ht.shape(0), " rows, student_hidden_states ", job.rows));
  if (job.rows > limits.max_tokens)
    return Invalid(absl::StrCat(job.rows, " rows exceed the server's max_tokens ", limits.max_tokens));
  if (!(req.beta() >= 0.0 && req.beta() <= 1.0))
    return Invalid(absl::StrCat("beta must be in [0, 1], got ", req.beta()));
  job.beta = req.beta();
  job.temperature = req.has_temperature() ? req.temperature() : 1.0f;
  if (!(job.temperature > 0.0f) || !std::isfinite(job.temperature))
    return Invalid(absl::StrCat("temperature must be finite and > 0, got ", job.temperature));
  for (const char* g : {"grad_divergence", "grad_cross_entropy"}) {
    if (!in.count(g)) continue;
    LOGPROB_RETURN_IF_ERROR(CheckTensor(*in[g], false));
    if (in[g]->shape(0) != job.rows)
      return Invalid(absl::StrCat("input ", g, " has ", in[g]->shape(0), " rows, the hidden states ", job.rows));
  }
  if (in.count("grad_cross_entropy") && !in.count("grad_divergence"))
    return Invalid("grad_cross_entropy without grad_divergence (a backward takes grad_divergence)");
  job.backward = in.count("grad_divergence") != 0;
  if (job.backward) {
    LOGPROB_ASSIGN_OR_RETURN(job.grad_divergence, FiniteValues(*in["grad_divergence"]));
    if (in.count("grad_cross_entropy")) {
      LOGPROB_ASSIGN_OR_RETURN(job.grad_cross_entropy, FiniteValues(*in["grad_cross_entropy"]));
    }
  }
  if (!req.gradient_step().empty()) {
    LOGPROB_RETURN_IF_ERROR(CheckGradientStepKey(req.gradient_step(), "DistillRequest.gradient_step"));
    if (!job.backward) return Invalid("gradient_step without grad_divergence (a forward adds no gradients)");
    job.gradient_step = req.gradient_step();
  }
  if (heads == nullptr)
    return absl::FailedPreconditionError("DistillRequest: the server holds no lm_head (start it with --lm-head)");
  LOGPROB_ASSIGN_OR_RETURN(job.student, heads->Bind(req.student_head(), req.student_head_version()));
  LOGPROB_ASSIGN_OR_RETURN(job.teacher, heads->Bind(req.teacher_head(), req.teacher_head_version()));
  const LmHeadSource& s = job.student->source;
  const LmHeadSource& t = job.teacher->source;
  if (s.vocab_size != t.vocab_size)
    return Invalid(absl::StrCat("the student head \"", job.student->head, "\" has a vocabulary of ", s.vocab_size,
                                ", the teacher head \"", job.teacher->head, "\" of ", t.vocab_size));
  if (hs.shape(1) != s.hidden_size)
    return Invalid(absl::StrCat("student_hidden_states has H = ", hs.shape(1), ", the student head \"",
                                job.student->head, "\" ", s.hidden_size));
  if (ht.shape(1) != t.hidden_size)
    return Invalid(absl::StrCat("teacher_hidden_states has H = ", ht.shape(1), ", the teacher head \"",
                                job.teacher->head, "\" ", t.hidden_size));
  job.vocab_size = s.vocab_size;
  job.student_dtype = hs.dtype();
  job.teacher_dtype = ht.dtype();
  job.student_hidden = hs.shape(1);
  job.teacher_hidden = ht.shape(1);
  job.student_bytes = hs.data();
  job.teacher_bytes = ht.data();
  return job;
}

Plan PlanDistillation(const DistillJob& job, int workers, uint64_t job_id) {
  Plan plan;
  plan.layout = internal::v1::HIDDEN_STATES;
  const size_t s_row = static_cast<size_t>(job.student_hidden) * DTypeSize(job.student_dtype);
  const size_t t_row = static_cast<size_t>(job.teacher_hidden) * DTypeSize(job.teacher_dtype);
  for (int w = 0; w < workers; ++w) {
    PlannedItem p;
    p.worker = w;
    internal::v1::WorkItem& item = p.item;
    item.set_job_id(job_id);
    item.set_layout(internal::v1::HIDDEN_STATES);
    item.set_num_rows(job.rows);
    item.set_vocab_size(job.vocab_size);
    item.set_dtype(job.student_dtype);
    item.set_hidden_size(job.student_hidden);
    const auto [vb, ve] = SplitRange(job.vocab_size, workers, w);
    item.set_vocab_begin(vb);
    item.set_vocab_end(ve);
    *item.mutable_lm_head() = job.student->Ref();
    item.mutable_options()->set_temperature(job.temperature);
    if (!job.gradient_step.empty()) item.mutable_options()->set_gradient_step(job.gradient_step);
    item.set_backward(job.backward);
    const auto [rb, re] = SplitRange(job.rows, workers, w);
    item.set_data(job.student_bytes.data() + rb * s_row, (re - rb) * s_row);
    internal::v1::Distillation* d = item.mutable_distillation();
    *d->mutable_teacher() = job.teacher->Ref();
    d->set_teacher_hidden_size(job.teacher_hidden);
    d->set_teacher_dtype(job.teacher_dtype);
    d->set_teacher_data(job.teacher_bytes.data() + rb * t_row, (re - rb) * t_row);
    d->set_beta(job.beta);
    d->mutable_grad_divergence()->Add(job.grad_divergence.begin(), job.grad_divergence.end());
    d->mutable_grad_cross_entropy()->Add(job.grad_cross_entropy.begin(), job.grad_cross_entropy.end());
    plan.items.push_back(std::move(p));
  }
  return plan;
}

absl::StatusOr<v1::DistillResponse> DistillResponseOf(const std::string& id, const DistillJob& job,
                                                      const std::vector<internal::v1::WorkResult>& results) {
  const int64_t N = job.rows, H = job.student_hidden;
  std::vector<float> div(static_cast<size_t>(N)), ce(static_cast<size_t>(N)), ent(static_cast<size_t>(N));
  std::vector<float> dh(static_cast<size_t>(job.backward ? N * H : 0));
  int64_t covered = 0;
  for (const internal::v1::WorkResult& r : results) {
    const int64_t b = r.row_begin(), e = r.row_end(), n = e - b;
    if (b < 0 || e > N || n < 0 || r.divergence_size() != n || r.cross_entropy_size() != n || r.entropy_size() != n ||
        (job.backward && r.grad_hidden_states_size() != n * H))
      return absl::InternalError(
          absl::StrCat("distillation: a worker's result does not cover its rows [", b, ", ", e, ")"));
    std::copy(r.divergence().begin(), r.divergence().end(), div.begin() + b);
    std::copy(r.cross_entropy().begin(), r.cross_entropy().end(), ce.begin() + b);
    std::copy(r.entropy().begin(), r.entropy().end(), ent.begin() + b);
    if (job.backward) std::copy(r.grad_hidden_states().begin(), r.grad_hidden_states().end(), dh.begin() + b * H);
    covered += n;
  }
  if (covered != N)
    return absl::InternalError(absl::StrCat("distillation: the workers answered ", covered, " of ", N, " rows"));
  v1::DistillResponse resp;
  resp.set_id(id);
  resp.set_student_head_version(job.student->version);
  resp.set_teacher_head_version(job.teacher->version);
  auto add = [&](const char* name, const std::vector<float>& v, std::vector<int64_t> shape) {
    v1::Tensor* t = resp.add_outputs();
    t->set_name(name);
    t->set_dtype(v1::F32);
    for (int64_t d : shape) t->add_shape(d);
    t->set_data(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
  };
  add("divergence", div, {N});
  add("cross_entropy", ce, {N});
  add("entropy", ent, {N});
  if (job.backward) add("grad_student_hidden_states", dh, {N, H});
  return resp;
}

}  // namespace logprob
