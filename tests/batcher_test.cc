// The dynamic batcher (server/core/batcher.h) with a fake Runner instead of a
// worker pool: batch keys, the token budget, deadlines and cancellation of
// queued and running jobs, errors. The fake runner records each batch and
// holds it until the test releases it; the test waits on the batcher's own
// queue/running callbacks (condition variables), never on time, so every
// interleaving below is forced, not hoped for.
#include "server/core/batcher.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <future>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/buffer_pool.h"
#include "server/inputs/client_regions.h"
#include "server/inputs/input_source.h"
#include "server/inputs/shared_inputs.h"

namespace logprob {
namespace {

using internal::v1::WorkResult;
using Result = absl::StatusOr<Batcher::Outcome>;
constexpr auto kTimeout = std::chrono::seconds(60);  // only prevents hangs
constexpr int64_t kV = 64;

/// A Runner that records every batch (the targets of its rows, in order)
/// and blocks it until Release(); it answers each row with its target as
/// token_logprob, so a job can check it got its own rows. A batch holding
/// a row with target kFailTag fails with INTERNAL. A blocked batch whose
/// bounds say cancelled returns CANCELLED once Notify() is called.
class FakeRunner {
 public:
  static constexpr int64_t kFailTag = 63;

  Batcher::Runner runner() {
    return [this](const Plan& plan, const RunBounds& bounds) { return Run(plan, bounds); };
  }
  /// Lets every batch, held or future, return.
  void Release() {
    std::lock_guard<std::mutex> lock(mu_);
    released_ = true;
    cv_.notify_all();
  }
  /// Wakes held batches to look at their bounds again.
  void Notify() { cv_.notify_all(); }
  /// Waits until the runner has been called `n` times.
  ::testing::AssertionResult WaitCalls(size_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    if (cv_.wait_for(lock, kTimeout, [&] { return calls_.size() >= n; })) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "the runner was called " << calls_.size() << " times, not " << n;
  }
  std::vector<std::vector<int64_t>> calls() {
    std::lock_guard<std::mutex> lock(mu_);
    return calls_;
  }

 private:
  absl::StatusOr<std::vector<WorkResult>> Run(const Plan& plan, const RunBounds& bounds) {
    std::vector<int64_t> targets;
    for (const PlannedItem& p : plan.items) {
      targets.insert(targets.end(), p.item.targets().begin(), p.item.targets().end());
      // Every row's logits are its job's tag (Jobs::Make).
      const std::string& logits = p.item.data();
      if (logits.size() != static_cast<size_t>(p.item.num_rows() * kV) * sizeof(float))
        return absl::InternalError("the plan's payload has the wrong size");
      for (int64_t r = 0; r < p.item.num_rows(); ++r)
        for (int64_t v = 0; v < kV; ++v) {
          float x;
          std::memcpy(&x, logits.data() + (r * kV + v) * sizeof(float), sizeof(float));
          if (x != static_cast<float>(p.item.targets(static_cast<int>(r))))
            return absl::InternalError(absl::StrCat("row ", r, " of the plan carries another request's bytes"));
        }
    }
    std::unique_lock<std::mutex> lock(mu_);
    calls_.push_back(targets);
    cv_.notify_all();
    if (!cv_.wait_for(lock, kTimeout, [&] { return released_ || bounds.cancelled_now(); }))
      return absl::DeadlineExceededError("the test never released the batch");
    if (!released_) return absl::CancelledError("every job of the batch went away");
    for (int64_t t : targets)
      if (t == kFailTag) return absl::InternalError("worker 0: injected failure");
    std::vector<WorkResult> results;
    for (const PlannedItem& p : plan.items) {
      WorkResult r;
      r.set_row_begin(0);
      r.set_row_end(p.item.num_rows());
      for (int64_t t : p.item.targets()) r.add_token_logprobs(static_cast<float>(t));
      results.push_back(std::move(r));
    }
    return results;
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::vector<int64_t>> calls_;
  bool released_ = false;
};

/// The batcher's queue length and running batches, as its callbacks report
/// them, for the test to wait on.
class Observed {
 public:
  void Attach(Batcher::Options& o) {
    o.on_queue_change = [this](int64_t n) { Set(&queued_, n); };
    o.on_running_change = [this](int64_t n) { Set(&running_, n); };
  }
  ::testing::AssertionResult WaitQueued(int64_t n) { return Wait(&queued_, n, "queued jobs"); }
  ::testing::AssertionResult WaitRunning(int64_t n) { return Wait(&running_, n, "running batches"); }

 private:
  void Set(int64_t* what, int64_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    *what = n;
    cv_.notify_all();
  }
  ::testing::AssertionResult Wait(int64_t* what, int64_t n, const char* name) {
    std::unique_lock<std::mutex> lock(mu_);
    if (cv_.wait_for(lock, kTimeout, [&] { return *what == n; })) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << name << ": " << *what << ", never " << n;
  }
  std::mutex mu_;
  std::condition_variable cv_;
  int64_t queued_ = 0, running_ = 0;
};

/// A logits job of `rows` rows of kV f32 columns, rows 0.. of `source`,
/// every target `tag`; `topk` decides its batch key.
std::shared_ptr<ScoreJob> TaggedJob(int64_t tag, int64_t rows, int topk, std::shared_ptr<const InputSource> source) {
  auto job = std::make_shared<ScoreJob>();
  job->dtype = v1::F32;
  job->vocab_size = kV;
  job->row_bytes = kV * 4;
  for (int64_t r = 0; r < rows; ++r) job->rows.push_back(r);
  job->targets.assign(rows, tag);
  job->out_pos.resize(rows);
  job->out_shape = {rows};
  job->options.set_topk(topk);
  job->options.set_temperature(1.f);
  job->segments.push_back({0, std::move(source)});
  return job;
}

/// Logits jobs of kV f32 columns: a job of `rows` rows has every target
/// and every logit equal to its `tag` (the fake runner checks each row's
/// payload against its target, so a batch that copied another request's
/// bytes fails), and `topk` decides its batch key. Each job's logits live
/// in a buffer of a BufferPool, as ScoreChunked requests' do, which the
/// test may hand back and reuse once the job's Run has returned.
class Jobs {
 public:
  std::shared_ptr<const ScoreJob> Make(int64_t tag, int64_t rows, int topk = 0) {
    std::string bytes = pool_.Acquire(static_cast<size_t>(rows * kV) * sizeof(float));
    const float value = static_cast<float>(tag);
    for (int64_t i = 0; i < rows * kV; ++i) std::memcpy(bytes.data() + i * sizeof(float), &value, sizeof(float));
    auto job = TaggedJob(tag, rows, topk, MemorySource(bytes));
    std::lock_guard<std::mutex> lock(mu_);
    bytes_[job.get()] = std::move(bytes);
    return job;
  }
  /// Gives `job`'s logits back to the pool and hands the buffer to a new
  /// request that overwrites it (what ScoreChunked does once ScoreOne
  /// returns): a batch still reading the old job's bytes sees -1s.
  void Recycle(const ScoreJob* job) {
    std::string bytes;
    {
      std::lock_guard<std::mutex> lock(mu_);
      bytes = std::move(bytes_.at(job));
      bytes_.erase(job);
    }
    const size_t n = bytes.size();
    pool_.Release(std::move(bytes));
    std::string next = pool_.Acquire(n);
    std::fill(next.begin(), next.end(), '\xff');
    std::lock_guard<std::mutex> lock(mu_);
    recycled_.push_back(std::move(next));
  }

 private:
  BufferPool pool_{int64_t{1} << 30};
  std::mutex mu_;
  std::map<const ScoreJob*, std::string> bytes_;
  std::vector<std::string> recycled_;
};

/// Rows of `tag` repeated `n` times.
std::vector<int64_t> Rows(std::initializer_list<std::pair<int64_t, int64_t>> tag_counts) {
  std::vector<int64_t> out;
  for (auto [tag, n] : tag_counts) out.insert(out.end(), n, tag);
  return out;
}

/// The result of a job run on its own thread, failing (not hanging) if it
/// does not come.
Result Get(std::future<Result>& f) {
  if (f.wait_for(kTimeout) != std::future_status::ready) return absl::DeadlineExceededError("the job never returned");
  return f.get();
}

/// Checks that `r` is OK and holds the job's own rows (tag as token_logprob).
void ExpectOwnRows(const Result& r, int64_t tag, int64_t rows, int batch_requests) {
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->batch_requests, batch_requests) << "tag " << tag;
  const WorkResult& res = r->results->front();
  for (int64_t i = 0; i < rows; ++i) EXPECT_EQ(res.token_logprobs(static_cast<int>(r->row_begin + i)), tag);
}

class BatcherTest : public ::testing::Test {
 protected:
  /// A batcher on the fake runner; the queue delay is an hour, so a queued
  /// job leaves the queue only for the reasons each test forces.
  void Make(int64_t max_batch_tokens = 8192) {
    Batcher::Options o;
    o.max_queue_delay = std::chrono::hours(1);
    o.max_batch_tokens = max_batch_tokens;
    o.workers = 1;
    observed_.Attach(o);
    batcher_ = std::make_unique<Batcher>(o, runner_.runner());
  }
  /// Runs `job` on its own thread.
  std::future<Result> Start(std::shared_ptr<const ScoreJob> job, RunBounds bounds = {}) {
    return std::async(std::launch::async,
                      [this, job = std::move(job), bounds] { return batcher_->Run(job, ++next_id_, bounds); });
  }
  /// Starts `job` and waits until the queue holds `queued` jobs: the
  /// arrival order of the jobs is then fixed.
  std::future<Result> Queue(std::shared_ptr<const ScoreJob> job, int64_t queued, RunBounds bounds = {}) {
    auto f = Start(std::move(job), bounds);
    EXPECT_TRUE(observed_.WaitQueued(queued));
    return f;
  }
  /// Starts a job of key topk=0 whose batch holds the pool until Release().
  std::future<Result> Occupy(std::shared_ptr<const ScoreJob> job, RunBounds bounds = {}) {
    auto f = Start(std::move(job), bounds);
    EXPECT_TRUE(runner_.WaitCalls(1));
    EXPECT_TRUE(observed_.WaitRunning(1));
    return f;
  }
  /// Releases every batch (TearDown does too: no thread is left waiting).
  void TearDown() override { runner_.Release(); }

  FakeRunner runner_;
  Observed observed_;
  Jobs jobs_;
  std::unique_ptr<Batcher> batcher_;
  std::atomic<uint64_t> next_id_{0};
};

TEST_F(BatcherTest, AnIdlePoolRunsAJobAtOnce) {
  Make();
  runner_.Release();
  auto job = jobs_.Make(5, 3);
  auto f = Start(job);
  const Result r = Get(f);
  ExpectOwnRows(r, 5, 3, 1);
  EXPECT_EQ(r->row_begin, 0);
  EXPECT_EQ(r->batch_tokens, 3);
  EXPECT_EQ(runner_.calls(), std::vector<std::vector<int64_t>>{Rows({{5, 3}})});
  EXPECT_TRUE(observed_.WaitRunning(0));
}

TEST_F(BatcherTest, QueuedJobsShareABatchPerKeyInArrivalOrder) {
  Make();
  auto busy = Occupy(jobs_.Make(1, 1));
  // Key topk=2: tags 10, 12, 13; key topk=3: tags 11, 14.
  auto a1 = Queue(jobs_.Make(10, 2, 2), 1);
  auto b1 = Queue(jobs_.Make(11, 3, 3), 2);
  auto a2 = Queue(jobs_.Make(12, 1, 2), 3);
  auto a3 = Queue(jobs_.Make(13, 4, 2), 4);
  auto b2 = Queue(jobs_.Make(14, 2, 3), 5);
  EXPECT_EQ(runner_.calls().size(), 1u) << "nothing may start while the pool is busy and the budget not full";
  runner_.Release();
  ExpectOwnRows(Get(busy), 1, 1, 1);
  const Result ra1 = Get(a1), ra2 = Get(a2), ra3 = Get(a3), rb1 = Get(b1), rb2 = Get(b2);
  ExpectOwnRows(ra1, 10, 2, 3);
  ExpectOwnRows(ra2, 12, 1, 3);
  ExpectOwnRows(ra3, 13, 4, 3);
  ExpectOwnRows(rb1, 11, 3, 2);
  ExpectOwnRows(rb2, 14, 2, 2);
  ASSERT_TRUE(ra1.ok() && ra2.ok() && ra3.ok());
  EXPECT_EQ(ra1->row_begin, 0);
  EXPECT_EQ(ra2->row_begin, 2);
  EXPECT_EQ(ra3->row_begin, 3);
  EXPECT_EQ(ra3->batch_tokens, 7);
  EXPECT_EQ(ra1->plan, ra3->plan) << "one plan for the whole batch";
  const auto calls = runner_.calls();
  ASSERT_EQ(calls.size(), 3u);
  const std::vector<int64_t> a = Rows({{10, 2}, {12, 1}, {13, 4}}), b = Rows({{11, 3}, {14, 2}});
  EXPECT_TRUE((calls[1] == a && calls[2] == b) || (calls[1] == b && calls[2] == a))
      << "one batch per key, rows in arrival order";
  EXPECT_TRUE(observed_.WaitQueued(0));
}

TEST_F(BatcherTest, TheTokenBudgetStartsFullBatchesAndKeepsOthersApart) {
  Make(/*max_batch_tokens=*/8);
  auto busy = Occupy(jobs_.Make(1, 1));
  // 5 + 3 rows fill the budget: that batch starts although the pool is busy.
  auto j5 = Queue(jobs_.Make(20, 5), 1);
  auto j3 = Start(jobs_.Make(21, 3));
  ASSERT_TRUE(runner_.WaitCalls(2));
  EXPECT_EQ(runner_.calls()[1], Rows({{20, 5}, {21, 3}}));
  // 4 + 6 rows exceed it: the oldest job runs alone, the other waits.
  auto j4 = Queue(jobs_.Make(22, 4), 1);
  auto j6 = Start(jobs_.Make(23, 6));
  ASSERT_TRUE(runner_.WaitCalls(3));
  EXPECT_EQ(runner_.calls()[2], Rows({{22, 4}}));
  EXPECT_TRUE(observed_.WaitQueued(1));
  // A job over the budget: the queued 6 rows plus its 10 fill the budget;
  // the 6 rows run alone, and so do the 10 (either may reach the runner
  // first).
  auto j10 = Start(jobs_.Make(24, 10));
  ASSERT_TRUE(runner_.WaitCalls(5));
  const auto calls = runner_.calls();
  const std::vector<int64_t> six = Rows({{23, 6}}), ten = Rows({{24, 10}});
  EXPECT_TRUE((calls[3] == six && calls[4] == ten) || (calls[3] == ten && calls[4] == six));
  runner_.Release();
  ExpectOwnRows(Get(j5), 20, 5, 2);
  ExpectOwnRows(Get(j3), 21, 3, 2);
  ExpectOwnRows(Get(j4), 22, 4, 1);
  ExpectOwnRows(Get(j6), 23, 6, 1);
  ExpectOwnRows(Get(j10), 24, 10, 1);
  ExpectOwnRows(Get(busy), 1, 1, 1);
  EXPECT_EQ(runner_.calls().size(), 5u);
}

TEST_F(BatcherTest, AQueuedJobLeavesTheQueueAtItsDeadlineOrWhenCancelled) {
  Make();
  auto busy = Occupy(jobs_.Make(1, 1));
  RunBounds soon;
  soon.deadline = std::chrono::system_clock::now() + std::chrono::milliseconds(50);
  auto expired = Start(jobs_.Make(30, 2), soon);
  const Result re = Get(expired);  // while the pool is still busy
  EXPECT_EQ(re.status().code(), absl::StatusCode::kDeadlineExceeded) << re.status();
  EXPECT_NE(re.status().message().find("while it was queued"), std::string::npos) << re.status();
  EXPECT_TRUE(observed_.WaitQueued(0));

  std::atomic<bool> gone{false};
  RunBounds cancellable;
  cancellable.cancelled = [&gone] { return gone.load(); };
  auto cancelled = Queue(jobs_.Make(31, 2), 1, cancellable);
  gone = true;
  const Result rc = Get(cancelled);
  EXPECT_EQ(rc.status().code(), absl::StatusCode::kCancelled) << rc.status();
  EXPECT_NE(rc.status().message().find("while it was queued"), std::string::npos) << rc.status();
  EXPECT_TRUE(observed_.WaitQueued(0));

  runner_.Release();
  ExpectOwnRows(Get(busy), 1, 1, 1);
  EXPECT_EQ(runner_.calls().size(), 1u) << "neither job may reach the workers";
}

TEST_F(BatcherTest, AJobLeavingARunningBatchLeavesTheOthersTheirRows) {
  Make(/*max_batch_tokens=*/4);
  auto busy = Occupy(jobs_.Make(1, 1));
  // x leads the batch {x, y} (it runs it on its thread); y follows and leaves.
  std::atomic<bool> y_gone{false};
  RunBounds y_bounds;
  y_bounds.cancelled = [&y_gone] { return y_gone.load(); };
  auto x = Queue(jobs_.Make(40, 2), 1);
  auto y = Start(jobs_.Make(41, 2), y_bounds);  // fills the budget: {x, y} runs
  ASSERT_TRUE(runner_.WaitCalls(2));
  ASSERT_TRUE(observed_.WaitRunning(2));
  y_gone = true;
  runner_.Notify();
  const Result ry = Get(y);  // while its batch is still held
  EXPECT_EQ(ry.status().code(), absl::StatusCode::kCancelled) << ry.status();
  EXPECT_NE(ry.status().message().find("its batch was running"), std::string::npos) << ry.status();
  EXPECT_TRUE(observed_.WaitRunning(2)) << "x still wants its rows: the batch goes on";
  runner_.Release();
  ExpectOwnRows(Get(x), 40, 2, 2);
  ExpectOwnRows(Get(busy), 1, 1, 1);
  EXPECT_TRUE(observed_.WaitRunning(0));
}

// Regression (heap-use-after-free under ASan): the leader used to read a
// job that had left its running batch, and whose caller had freed it, when
// it set the row offsets of the jobs after it. Now the batch owns its jobs,
// and the bytes of a job that left may be reused at once.
TEST_F(BatcherTest, AJobThatLeftARunningBatchMayBeFreedAndItsBytesReused) {
  Make(/*max_batch_tokens=*/6);
  auto busy = Occupy(jobs_.Make(1, 1));
  std::atomic<bool> y_gone{false};
  RunBounds y_bounds;
  y_bounds.cancelled = [&y_gone] { return y_gone.load(); };
  auto x = Queue(jobs_.Make(40, 2), 1);
  auto y_job = jobs_.Make(41, 2);
  const ScoreJob* y_ptr = y_job.get();
  auto y = Queue(std::move(y_job), 2, y_bounds);
  auto z = Start(jobs_.Make(42, 2));  // fills the budget: {x, y, z} runs
  ASSERT_TRUE(runner_.WaitCalls(2));
  EXPECT_EQ(runner_.calls()[1], Rows({{40, 2}, {41, 2}, {42, 2}}));
  y_gone = true;
  runner_.Notify();
  const Result ry = Get(y);
  EXPECT_EQ(ry.status().code(), absl::StatusCode::kCancelled) << ry.status();
  y = std::future<Result>();  // y's caller drops its job ...
  jobs_.Recycle(y_ptr);       // ... and its bytes go to the next request
  EXPECT_TRUE(observed_.WaitRunning(2)) << "x and z still want their rows";
  runner_.Release();
  const Result rx = Get(x), rz = Get(z);
  ExpectOwnRows(rx, 40, 2, 3);
  ExpectOwnRows(rz, 42, 2, 3);
  ASSERT_TRUE(rz.ok());
  EXPECT_EQ(rz->row_begin, 4) << "z's rows follow y's, which left";
  EXPECT_EQ(rz->batch_tokens, 6);
  ExpectOwnRows(Get(busy), 1, 1, 1);
}

/// A client's shared-memory object holding `rows` rows of kV f32 logits,
/// all equal to `tag`, registered as a ClientRegion.
class ShmRows {
 public:
  ShmRows(int64_t tag, int64_t rows) : name_(absl::StrCat("/logprob-batcher-test-", getpid(), "-", tag)) {
    const size_t bytes = static_cast<size_t>(rows * kV) * sizeof(float);
    const int fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    EXPECT_GE(fd, 0) << name_;
    // The object holds the rows and the proof of write access after them.
    EXPECT_EQ(ftruncate(fd, static_cast<off_t>(bytes + kProofBytes)), 0);
    std::vector<float> values(rows * kV, static_cast<float>(tag));
    EXPECT_EQ(pwrite(fd, values.data(), bytes, 0), static_cast<ssize_t>(bytes));
    fd_ = fd;
    auto region = ClientRegion::Open("rows", name_, static_cast<int64_t>(bytes));
    EXPECT_TRUE(region.ok()) << region.status();
    if (region.ok()) region_ = *std::move(region);
  }
  ~ShmRows() { Remove(); }
  /// A job whose rows are read from the region.
  std::shared_ptr<const ScoreJob> Job(int64_t tag, int64_t rows) const {
    return TaggedJob(tag, rows, /*topk=*/0, RegionSource(region_, 0, region_->byte_size()));
  }
  /// What a client may do once its call returned: unregister, shrink and
  /// unlink the object.
  void Remove() {
    region_.reset();
    if (fd_ >= 0) {
      EXPECT_EQ(ftruncate(fd_, 0), 0);
      close(fd_);
      shm_unlink(name_.c_str());
    }
    fd_ = -1;
  }

 private:
  std::string name_;
  int fd_ = -1;
  std::shared_ptr<const ClientRegion> region_;
};

TEST_F(BatcherTest, AJobFromSharedMemoryThatLeftARunningBatchMayRemoveItsRegion) {
  Make(/*max_batch_tokens=*/6);
  auto busy = Occupy(jobs_.Make(1, 1));
  ShmRows x_rows(50, 2), y_rows(51, 2);
  std::atomic<bool> y_gone{false};
  RunBounds y_bounds;
  y_bounds.cancelled = [&y_gone] { return y_gone.load(); };
  auto x = Queue(x_rows.Job(50, 2), 1);
  auto y = Queue(y_rows.Job(51, 2), 2, y_bounds);
  auto z = Start(jobs_.Make(52, 2));
  ASSERT_TRUE(runner_.WaitCalls(2));
  y_gone = true;
  runner_.Notify();
  const Result ry = Get(y);
  EXPECT_EQ(ry.status().code(), absl::StatusCode::kCancelled) << ry.status();
  y = std::future<Result>();
  y_rows.Remove();
  runner_.Release();
  ExpectOwnRows(Get(x), 50, 2, 3);
  const Result rz = Get(z);
  ExpectOwnRows(rz, 52, 2, 3);
  ASSERT_TRUE(rz.ok());
  EXPECT_EQ(rz->row_begin, 4);
  ExpectOwnRows(Get(busy), 1, 1, 1);
}

TEST_F(BatcherTest, ABatchWhoseJobsAllLeftStopsItsWorkerCalls) {
  Make();
  std::atomic<bool> gone{false};
  RunBounds bounds;
  bounds.cancelled = [&gone] { return gone.load(); };
  auto f = Occupy(jobs_.Make(1, 3), bounds);
  gone = true;
  runner_.Notify();  // the held batch sees bounds.cancelled() and returns
  const Result r = Get(f);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kCancelled) << r.status();
  EXPECT_TRUE(observed_.WaitRunning(0)) << "the runner call must end, not run to completion";
}

TEST_F(BatcherTest, ABatchErrorReachesEveryJobOfTheBatchOnly) {
  Make();
  auto busy = Occupy(jobs_.Make(1, 1));
  auto bad = Queue(jobs_.Make(FakeRunner::kFailTag, 1, 2), 1);
  auto with_bad = Queue(jobs_.Make(50, 2, 2), 2);
  auto other_key = Queue(jobs_.Make(51, 2, 3), 3);
  runner_.Release();
  const Result r1 = Get(bad), r2 = Get(with_bad);
  EXPECT_EQ(r1.status().code(), absl::StatusCode::kInternal) << r1.status();
  EXPECT_EQ(r2.status().code(), absl::StatusCode::kInternal) << r2.status();
  EXPECT_NE(r2.status().message().find("injected failure"), std::string::npos) << r2.status();
  ExpectOwnRows(Get(other_key), 51, 2, 1);
  ExpectOwnRows(Get(busy), 1, 1, 1);
}

}  // namespace
}  // namespace logprob
