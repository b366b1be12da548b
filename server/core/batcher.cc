#include "server/core/batcher.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace logprob {

struct Batcher::Entry {
  // Constant once queued.
  std::shared_ptr<const ScoreJob> job;
  int64_t rows = 0;             // job->num_rows()
  internal::v1::Layout layout;  // the job's alone (ChooseLayout), part of its key
  std::string key;
  RunBounds bounds;
  std::chrono::steady_clock::time_point arrived;
  // Guarded by the batcher's mu_.
  // kRunning: taken into a batch that is being planned (its input bytes
  // may be read); kPlanned: the batch's work items hold copies of them.
  enum class State { kQueued, kRunning, kPlanned, kDone } state = State::kQueued;
  bool left = false;    // Run returned: `bounds` may refer to a finished call
  absl::Status status;  // the batch's error, when not OK
  Outcome outcome;

  bool ended() const { return bounds.ended(); }
  /// The error for a job whose bounds ended, saying where it was.
  absl::Status EndedError(const char* where) const {
    // gRPC's deadline timer may cancel the call a little before the clock
    // reaches ctx->deadline(): a cancel that close to the deadline is the
    // deadline passing, not the client cancelling.
    constexpr auto kDeadlineSlack = std::chrono::milliseconds(50);
    if (std::chrono::system_clock::now() + kDeadlineSlack >= bounds.deadline)
      return absl::DeadlineExceededError(absl::StrCat("the request's deadline passed while ", where));
    return absl::CancelledError(absl::StrCat("the request was cancelled by the client while ", where));
  }
};

ScoreJob ConcatJobs(const std::vector<const ScoreJob*>& jobs) {
  ScoreJob all;
  const ScoreJob& first = *jobs.front();
  all.hidden = first.hidden;
  all.dtype = first.dtype;
  all.vocab_size = first.vocab_size;
  all.hidden_size = first.hidden_size;
  all.row_bytes = first.row_bytes;
  all.gather_k = first.gather_k;
  all.options = first.options;
  all.lm_head = first.lm_head;    // one key: one lm_head version
  all.backward = first.backward;  // one key: all backwards (with grad_entropy or not) or none
  for (const ScoreJob* j : jobs) {
    // Each job's rows keep their sources.
    const int64_t at = all.num_rows();
    for (const auto& s : j->segments) all.segments.push_back({at + s.first_row, s.source});
    all.rows.insert(all.rows.end(), j->rows.begin(), j->rows.end());
    all.targets.insert(all.targets.end(), j->targets.begin(), j->targets.end());
    all.gather_ids.insert(all.gather_ids.end(), j->gather_ids.begin(), j->gather_ids.end());
    all.grad_logprobs.insert(all.grad_logprobs.end(), j->grad_logprobs.begin(), j->grad_logprobs.end());
    all.grad_entropy.insert(all.grad_entropy.end(), j->grad_entropy.begin(), j->grad_entropy.end());
  }
  // Sampling masks: KeyOf keeps masked jobs apart, so all of them have masks or none.
  if (first.has_masks()) {
    all.mask_offsets = {0};
    for (const ScoreJob* j : jobs) {
      const int64_t base = static_cast<int64_t>(all.mask_ids.size());
      all.mask_ids.insert(all.mask_ids.end(), j->mask_ids.begin(), j->mask_ids.end());
      for (int64_t r = 0; r < j->num_rows(); ++r) all.mask_offsets.push_back(base + j->mask_offsets[r + 1]);
    }
  }
  return all;
}

Batcher::Batcher(Options options, Runner run) : options_(std::move(options)), run_(std::move(run)) {}

std::string Batcher::KeyOf(const ScoreJob& job, internal::v1::Layout layout) {
  // A job that may not share a batch (a source the workers read in place)
  // gets a key of its own: the job's address, unique while it is queued.
  const std::string alone = job.batchable() ? "" : absl::StrCat("/alone:", reinterpret_cast<uintptr_t>(&job));
  // Hidden states of one lm_head version only: a batch is scored with one.
  const std::string head = job.lm_head ? absl::StrCat(job.lm_head->head, "@", job.lm_head->version) : "";
  // Masked jobs apart: their rows take the host path on every backend.
  return absl::StrCat(job.hidden, "/", job.dtype, "/", job.vocab_size, "/", job.hidden_size, "/", job.gather_k, "/",
                      job.has_masks() ? "masked/" : "",
                      // Backwards apart, and with dL/dentropy apart (the
                      // options, which hold the gradient step, are below).
                      job.backward ? (job.grad_entropy.empty() ? "backward/" : "backward+entropy/") : "", layout, "/",
                      head.size(), ":", head, "/", job.options.SerializeAsString(), alone);
}

void Batcher::QueueChanged() {
  cv_.SignalAll();
  if (options_.on_queue_change) options_.on_queue_change(static_cast<int64_t>(queue_.size()));
}

bool Batcher::WaitToLead(Entry& e) {
  const auto until = e.arrived + options_.max_queue_delay;
  for (;;) {
    if (e.ended()) return false;
    int64_t tokens = 0;
    for (const auto& q : queue_)
      if (q->key == e.key) tokens += q->rows;
    const auto now = std::chrono::steady_clock::now();
    if (running_ == 0 || tokens >= options_.max_batch_tokens || now >= until) return true;
    const auto wait = std::min<std::chrono::steady_clock::duration>(until - now, std::chrono::milliseconds(20));
    cv_.WaitWithTimeout(&mu_, absl::FromChrono(wait));
  }
}

std::vector<std::shared_ptr<Batcher::Entry>> Batcher::TakeBatch(Entry& e) {
  std::vector<std::shared_ptr<Entry>> batch;
  int64_t tokens = 0;
  for (auto it = queue_.begin(); it != queue_.end();) {
    Entry& q = **it;
    const int64_t n = q.rows;
    if (q.key == e.key && (batch.empty() || tokens + n <= options_.max_batch_tokens)) {
      tokens += n;
      q.state = Entry::State::kRunning;
      batch.push_back(*it);
      it = queue_.erase(it);
    } else {
      ++it;
    }
  }
  ++running_;
  QueueChanged();  // the next oldest job of the key may lead now
  return batch;
}

bool Batcher::AllEnded(const std::vector<std::shared_ptr<Entry>>& batch) {
  // Under mu_: a job that has not left is still inside Run (which sets
  // `left` under mu_ before returning), so its bounds are safe to call.
  absl::MutexLock lock(&mu_);
  return std::all_of(batch.begin(), batch.end(), [](const auto& m) { return m->left || m->ended(); });
}

void Batcher::RunBatch(const std::vector<std::shared_ptr<Entry>>& batch, uint64_t job_id) {
  const auto started = std::chrono::steady_clock::now();
  std::vector<const ScoreJob*> jobs;
  RunBounds bounds;
  bounds.deadline = std::chrono::system_clock::time_point::min();
  int64_t batch_rows = 0;
  for (const auto& m : batch) {
    jobs.push_back(m->job.get());
    bounds.deadline = std::max(bounds.deadline, m->bounds.deadline);
    batch_rows += m->rows;
  }
  // The worker calls stop once no job of the batch wants its rows.
  bounds.cancelled = [this, &batch] { return AllEnded(batch); };
  std::shared_ptr<const Plan> plan;
  {
    ScoreJob concat;
    if (jobs.size() > 1) concat = ConcatJobs(jobs);
    const ScoreJob& job = jobs.size() > 1 ? concat : *jobs.front();
    // The layout each job would get alone (equal within a key).
    const Parallelism layout =
        batch.front()->layout == internal::v1::VOCAB_PARALLEL ? Parallelism::kVocab : Parallelism::kToken;
    plan = std::make_shared<const Plan>(PlanWork(job, options_.workers, layout, job_id, options_.payload_pool));
  }
  {
    // The jobs' input bytes are copied into the plan: a job may leave now.
    absl::MutexLock lock(&mu_);
    for (const auto& m : batch) m->state = Entry::State::kPlanned;
    cv_.SignalAll();
    ++calling_;
    if (options_.on_running_change) options_.on_running_change(calling_);
  }
  auto results = run_(*plan, bounds);
  const double run_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  std::shared_ptr<const std::vector<internal::v1::WorkResult>> shared;
  if (results.ok()) shared = std::make_shared<const std::vector<internal::v1::WorkResult>>(std::move(*results));

  absl::MutexLock lock(&mu_);
  int64_t row = 0;
  for (const auto& m : batch) {
    m->state = Entry::State::kDone;
    m->status = results.status();
    Outcome& o = m->outcome;
    o.plan = plan;
    o.results = shared;
    o.row_begin = row;
    o.queue_seconds = std::chrono::duration<double>(started - m->arrived).count();
    o.run_seconds = run_seconds;
    o.batch_requests = static_cast<int>(batch.size());
    o.batch_tokens = batch_rows;
    row += m->rows;
  }
  if (shared && options_.on_batch) options_.on_batch(batch.front()->outcome, *shared);
  --calling_;
  if (options_.on_running_change) options_.on_running_change(calling_);
  --running_;
  cv_.SignalAll();  // waiting leaders: the workers may be idle now
}

absl::StatusOr<Batcher::Outcome> Batcher::Run(std::shared_ptr<const ScoreJob> job, uint64_t job_id,
                                              const RunBounds& bounds) {
  auto e = std::make_shared<Entry>();
  e->layout = ChooseLayout(*job, options_.workers, options_.parallelism);
  e->key = KeyOf(*job, e->layout);
  e->rows = job->num_rows();
  e->job = std::move(job);
  e->bounds = bounds;
  e->arrived = std::chrono::steady_clock::now();
  absl::MutexLock lock(&mu_);
  queue_.push_back(e);
  QueueChanged();
  absl::StatusOr<Outcome> result = Wait(e, job_id);
  e->left = true;  // the leader no longer calls e->bounds (AllEnded)
  return result;
}

absl::StatusOr<Batcher::Outcome> Batcher::Wait(const std::shared_ptr<Entry>& e, uint64_t job_id) {
  for (;;) {
    if (e->state == Entry::State::kDone) {
      if (!e->status.ok()) return e->status;
      return e->outcome;
    }
    if (e->state == Entry::State::kPlanned) {
      // Abandoned: the batch's leader stops the workers when every job has
      // gone. (While kRunning the leader may still be copying its bytes.)
      if (e->ended()) return e->EndedError("its batch was running");
    } else if (e->state == Entry::State::kQueued) {
      const bool leads = std::none_of(queue_.begin(), std::find(queue_.begin(), queue_.end(), e),
                                      [&](const auto& q) { return q->key == e->key; });
      if (leads && WaitToLead(*e)) {
        const auto batch = TakeBatch(*e);
        mu_.Unlock();
        RunBatch(batch, job_id);
        mu_.Lock();
        if (e->ended()) return e->EndedError("its batch was running");
        continue;
      }
      if (e->ended()) {
        queue_.remove(e);
        QueueChanged();
        return e->EndedError("it was queued");
      }
    }
    cv_.WaitWithTimeout(&mu_, absl::Milliseconds(20));
  }
}

}  // namespace logprob
