#include "server/core/planner.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "common/log_line.h"
#include "common/partition.h"

namespace logprob {

absl::StatusOr<Parallelism> ParseParallelism(const std::string& s) {
  if (s == "auto") return Parallelism::kAuto;
  if (s == "token") return Parallelism::kToken;
  if (s == "vocab") return Parallelism::kVocab;
  return absl::InvalidArgumentError("parallelism must be auto, token or vocab, got \"" + s + "\"");
}

namespace {

internal::v1::WorkItem BaseItem(const ScoreJob& job, uint64_t job_id, int64_t begin, int64_t end) {
  internal::v1::WorkItem item;
  item.set_job_id(job_id);
  item.set_num_rows(end - begin);
  item.set_vocab_size(job.vocab_size);
  item.set_dtype(job.dtype);
  item.mutable_targets()->Add(job.targets.begin() + begin, job.targets.begin() + end);
  item.set_gather_k(job.gather_k);
  item.mutable_gather_ids()->Add(job.gather_ids.begin() + begin * job.gather_k,
                                 job.gather_ids.begin() + end * job.gather_k);
  *item.mutable_options() = job.options;
  if (job.backward) {
    item.set_backward(true);
    item.mutable_grad_token_logprobs()->Add(job.grad_logprobs.begin() + begin, job.grad_logprobs.begin() + end);
    if (!job.grad_entropy.empty())
      item.mutable_grad_entropy()->Add(job.grad_entropy.begin() + begin, job.grad_entropy.begin() + end);
  }
  return item;
}

/// Adds the sampling masks of the job's rows [begin, end) to `item`
/// (WorkItem.masked / mask_offsets / mask_ids), with only the ids of the
/// item's vocabulary slice [vb, ve). Nothing for a job without masks.
void AddMasks(const ScoreJob& job, int64_t begin, int64_t end, int64_t vb, int64_t ve, internal::v1::WorkItem* item) {
  if (!job.has_masks()) return;
  item->add_mask_offsets(0);
  for (int64_t r = begin; r < end; ++r) {
    const auto a = job.mask_ids.begin() + job.mask_offsets[r], b = job.mask_ids.begin() + job.mask_offsets[r + 1];
    item->add_masked(a != b);
    const auto lo = std::lower_bound(a, b, vb), hi = std::lower_bound(lo, b, ve);
    item->mutable_mask_ids()->Add(lo, hi);
    item->add_mask_offsets(item->mask_ids_size());
  }
}

/// Where the items' payloads go: their bytes fields, or consecutive
/// ranges of one shared memory region.
class PayloadWriter {
 public:
  PayloadWriter(Plan& plan, size_t total, PayloadPool* pool) {
    if (pool == nullptr) return;
    auto region = pool->Acquire(total);
    if (region.ok()) {
      plan.payload_region = std::move(*region);
      region_ = plan.payload_region.get();
    } else if (!warned_.exchange(true)) {
      LogLine() << "logprob-server: sending payloads inline instead of through shared memory: "
                << region.status().message();
    }
  }
  /// Space for `bytes` bytes of `item`'s payload (WorkItem.payload).
  char* Reserve(internal::v1::WorkItem& item, size_t bytes) {
    if (const SharedRegion* region = region_) {
      internal::v1::SharedMemoryPayload* p = item.mutable_shared_memory();
      p->set_name(region->name());
      p->set_offset(static_cast<int64_t>(at_));
      p->set_byte_size(static_cast<int64_t>(bytes));
      char* data = region->data() + at_;
      at_ += bytes;
      return data;
    }
    std::string* s = item.mutable_data();
    s->resize(bytes);
    return s->data();
  }

 private:
  static inline std::atomic<bool> warned_{false};
  const SharedRegion* region_ = nullptr;  // owned by the plan; null: inline
  size_t at_ = 0;
};

}  // namespace

internal::v1::Layout ChooseLayout(const ScoreJob& job, int workers, Parallelism parallelism) {
  if (job.hidden) return internal::v1::HIDDEN_STATES;
  const bool vocab = parallelism == Parallelism::kVocab ||
                     (parallelism == Parallelism::kAuto && workers > 1 && job.num_rows() < workers);
  return vocab ? internal::v1::VOCAB_PARALLEL : internal::v1::TOKEN_PARALLEL;
}

Plan PlanWork(const ScoreJob& job, int workers, Parallelism parallelism, uint64_t job_id, PayloadPool* payload_pool) {
  const int64_t n = job.num_rows();
  Plan plan;
  plan.layout = ChooseLayout(job, workers, parallelism);
  // Every layout sends each input byte of the rows once (none for a source
  // the workers read themselves: they get a reference to their rows).
  const InputSource* referenced = job.referenced_source();
  PayloadWriter payload(plan, referenced ? 0 : static_cast<size_t>(n) * job.row_bytes,
                        referenced ? nullptr : payload_pool);
  if (plan.layout == internal::v1::HIDDEN_STATES) {
    for (int w = 0; w < workers; ++w) {
      const auto [vb, ve] = SplitRange(job.vocab_size, workers, w);
      const auto [b, e] = SplitRange(n, workers, w);
      PlannedItem p{w, 0, BaseItem(job, job_id, 0, n)};
      p.item.set_layout(internal::v1::HIDDEN_STATES);
      p.item.set_vocab_begin(vb);
      p.item.set_vocab_end(ve);
      p.item.set_hidden_size(job.hidden_size);
      AddMasks(job, 0, n, vb, ve, &p.item);
      if (job.lm_head) *p.item.mutable_lm_head() = job.lm_head->Ref();
      const size_t bytes = static_cast<size_t>(e - b) * job.row_bytes;
      if (referenced) {
        // The job's rows are the source's rows in order (ExpandToInputRows).
        referenced->Refer(b * static_cast<int64_t>(job.row_bytes), static_cast<int64_t>(bytes), &p.item);
      } else {
        CopyRows(job, b, e, payload.Reserve(p.item, bytes));
      }
      plan.items.push_back(std::move(p));
    }
    return plan;
  }
  if (plan.layout == internal::v1::TOKEN_PARALLEL) {
    for (int w = 0; w < workers; ++w) {
      const auto [b, e] = SplitRange(n, workers, w);
      if (b == e) continue;
      PlannedItem p{w, b, BaseItem(job, job_id, b, e)};
      p.item.set_layout(internal::v1::TOKEN_PARALLEL);
      p.item.set_vocab_begin(0);
      p.item.set_vocab_end(job.vocab_size);
      AddMasks(job, b, e, 0, job.vocab_size, &p.item);
      CopyRows(job, b, e, payload.Reserve(p.item, static_cast<size_t>(e - b) * job.row_bytes));
      plan.items.push_back(std::move(p));
    }
    return plan;
  }
  const size_t esize = job.row_bytes / static_cast<size_t>(job.vocab_size);
  for (int w = 0; w < workers; ++w) {
    const auto [vb, ve] = SplitRange(job.vocab_size, workers, w);
    PlannedItem p{w, 0, BaseItem(job, job_id, 0, n)};
    p.item.set_layout(internal::v1::VOCAB_PARALLEL);
    p.item.set_vocab_begin(vb);
    p.item.set_vocab_end(ve);
    AddMasks(job, 0, n, vb, ve, &p.item);
    const size_t slice = static_cast<size_t>(ve - vb) * esize;
    char* data = payload.Reserve(p.item, static_cast<size_t>(n) * slice);
    for (int64_t r = 0; r < n; ++r) CopyRowSlice(job, r, vb * esize, slice, data + r * slice);
    plan.items.push_back(std::move(p));
  }
  return plan;
}

}  // namespace logprob
