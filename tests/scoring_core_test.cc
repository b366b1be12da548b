// The scoring core (server/core/scoring_core.h) without a server or processes:
// its Runner scores each plan item in this process with the worker's own
// code (PayloadRegions for shared-memory payloads, ScoreWorkItem on the CPU
// backend, W ranks as threads over InProcessCommunicator). Every logits
// golden case must match its expected outputs through 1 and 2 workers, in
// both layouts, with payloads inline and through shared memory; errors
// carry their machine-readable reasons; a cancelled call ends.
#include "server/core/scoring_core.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "common/error_reason.h"
#include "server/heads/lm_heads.h"
#include "tests/in_process_communicator.h"
#include "tests/test_support.h"
#include "worker/comm/communicator.h"
#include "worker/scoring/cpu_backend.h"
#include "worker/scoring/payload_regions.h"
#include "worker/scoring/scorer.h"

namespace logprob::testing {
namespace {

using internal::v1::WorkResult;

/// Runs a plan's items like the worker pool does, in this process: token-
/// parallel items alone, the others as the W ranks of one in-process group.
class InProcessWorkers {
 public:
  explicit InProcessWorkers(int workers) : workers_(workers) {}

  CoreWorkers workers(bool same_host) {
    return CoreWorkers{workers_, same_host, [this](const Plan& plan, const RunBounds& bounds) {
                         ++runs_;
                         return Run(plan, bounds);
                       }};
  }
  int runs() const { return runs_; }

 private:
  absl::StatusOr<std::vector<WorkResult>> Run(const Plan& plan, const RunBounds& bounds) {
    InProcessGroup group(workers_);
    std::vector<absl::StatusOr<WorkResult>> results(plan.items.size(), absl::UnknownError("not run"));
    std::vector<std::thread> threads;
    const std::function<bool()> stop = [&bounds] { return bounds.ended(); };
    for (size_t i = 0; i < plan.items.size(); ++i)
      threads.emplace_back([&, i] {
        const internal::v1::WorkItem& item = plan.items[i].item;
        std::shared_ptr<SharedRegion> hold;
        auto payload = regions_.Payload(item, &hold);
        if (!payload.ok()) {
          results[i] = payload.status();
          return;
        }
        CpuBackend backend;
        if (item.layout() == internal::v1::TOKEN_PARALLEL) {
          SelfCommunicator self;
          results[i] = ScoreWorkItem(item, ItemPayload(*payload), self, backend, kDefaultHiddenChunkTokens, stop);
        } else {
          InProcessCommunicator comm(group, plan.items[i].worker);
          results[i] = ScoreWorkItem(item, ItemPayload(*payload), comm, backend, kDefaultHiddenChunkTokens, stop);
        }
      });
    for (auto& t : threads) t.join();
    std::vector<WorkResult> out;
    for (auto& r : results) {
      if (!r.ok()) return r.status();
      out.push_back(*std::move(r));
    }
    return out;
  }

  const int workers_;
  PayloadRegions regions_;
  std::atomic<int> runs_{0};
};

ServiceConfig Config(const std::string& parallelism, bool shared_memory) {
  ServiceConfig c;
  c.parallelism = parallelism == "vocab" ? Parallelism::kVocab : Parallelism::kToken;
  c.parallelism_name = parallelism;
  c.shared_memory = shared_memory;
  c.max_queue_delay = std::chrono::microseconds(0);
  return c;
}

/// The resolver of a core on `workers` workers of `backend` on this host.
std::unique_ptr<InputResolver> Inputs(int workers, const std::string& backend = "cpu",
                                      bool shared_memory_inputs = true) {
  InputResolverOptions o;
  o.shared_memory_inputs = shared_memory_inputs;
  o.cuda_ipc = CudaIpcAvailabilityOf(/*flag=*/true, backend, "gloo", workers, /*same_host=*/true);
  return std::make_unique<InputResolver>(std::move(o));
}

class ScoringCoreGolden : public ::testing::TestWithParam<std::tuple<int, std::string, bool>> {};

TEST_P(ScoringCoreGolden, EveryLogitsCaseMatchesItsExpectedOutputs) {
  const auto [workers, parallelism, shared_memory] = GetParam();
  InProcessWorkers pool(workers);
  const auto inputs = Inputs(workers);
  ScoringCore core(pool.workers(/*same_host=*/true), Config(parallelism, shared_memory), *inputs);
  for (const std::string& name : LogitsGoldenNames()) {
    SCOPED_TRACE(name);
    const GoldenCase c = LoadGolden(name);
    RequestStats stats;
    auto resp = core.Score(GoldenRequest(c), CallContext{}, &stats);
    ASSERT_TRUE(resp.ok()) << resp.status();
    EXPECT_EQ(resp->id(), name);
    EXPECT_GT(stats.rows, 0);
    EXPECT_EQ(stats.batch_requests, 1);
    const std::vector<v1::Tensor> got(resp->outputs().begin(), resp->outputs().end());
    EXPECT_EQ(CompareOutputs(c.expected.tensors, got), "");
  }
  EXPECT_EQ(pool.runs(), static_cast<int>(LogitsGoldenNames().size()));
  EXPECT_EQ(core.admission().requests(), 0) << "every request's admission ends with it";
}

INSTANTIATE_TEST_SUITE_P(Workers, ScoringCoreGolden,
                         ::testing::Combine(::testing::Values(1, 2), ::testing::Values("token", "vocab"),
                                            ::testing::Bool()));

TEST(ScoringCore, InfoReportsTheConfigurationAndVersion) {
  InProcessWorkers pool(2);
  const auto inputs = Inputs(2);
  ScoringCore core(pool.workers(true), Config("token", true), *inputs);
  const v1::ServerInfo info = core.Info();
  EXPECT_EQ(info.version(), LOGPROB_VERSION);
  EXPECT_EQ(info.workers(), 2);
  EXPECT_EQ(info.parallelism(), "token");
  EXPECT_TRUE(info.shared_memory_inputs());
  EXPECT_FALSE(info.cuda_ipc_inputs()) << "CPU workers";
}

TEST(ScoringCore, RefusalsCarryTheirReasons) {
  InProcessWorkers pool(1);
  ServiceConfig config = Config("token", false);
  const auto inputs = Inputs(1, "cpu", /*shared_memory_inputs=*/false);
  ScoringCore core(pool.workers(true), config, *inputs);
  const GoldenCase c = LoadGolden(LogitsGoldenNames().front());

  // A CUDA IPC reference on CPU workers: the client should send bytes.
  v1::ScoreRequest ipc = GoldenRequest(c);
  v1::Tensor* rows = ipc.mutable_inputs(0);
  for (auto& t : *ipc.mutable_inputs())
    if (t.name() == "logits") rows = &t;
  rows->set_name("hidden_states");
  const auto bytes = static_cast<int64_t>(rows->data().size());
  rows->mutable_cuda_ipc()->set_handle(std::string(64, 'h'));
  rows->mutable_cuda_ipc()->set_byte_size(bytes);
  CallContext local;
  local.caller.peer = "ipv4:127.0.0.1:1";
  auto r = core.Score(ipc, local);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_EQ(ReasonOf(r.status()), v1::CUDA_IPC_UNAVAILABLE) << r.status();

  // A shared-memory reference with shared-memory inputs off.
  v1::ScoreRequest shm = GoldenRequest(c);
  shm.mutable_inputs(0)->mutable_shared_memory()->set_region("r");
  r = core.Score(shm, local);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_EQ(ReasonOf(r.status()), v1::SHARED_MEMORY_UNAVAILABLE) << r.status();
  EXPECT_EQ(inputs->SharedMemoryEnabled().code(), absl::StatusCode::kFailedPrecondition);

  // Hidden states without an lm_head.
  v1::ScoreRequest hidden = GoldenRequest(c);
  for (auto& t : *hidden.mutable_inputs())
    if (t.name() == "logits") t.set_name("hidden_states");
  r = core.Score(hidden, local);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_EQ(ReasonOf(r.status()), v1::NO_LM_HEAD) << r.status();

  // A malformed request has no reason to act on.
  v1::ScoreRequest bad = GoldenRequest(c);
  bad.mutable_inputs(0)->set_dtype(v1::DTYPE_UNSPECIFIED);
  r = core.Score(bad, local);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_EQ(ReasonOf(r.status()), v1::ERROR_REASON_UNSPECIFIED);
  EXPECT_EQ(pool.runs(), 0) << "nothing refused reaches the workers";
}

// The rows of an lm_head update by CUDA IPC resolve (through the resolver
// the scoring core shares) where scoring inputs by CUDA IPC are offered
// (CUDA workers on this host, a local peer) into a source the workers read
// (it refers to them); elsewhere the refusal tells the client to send the
// rows as bytes.
TEST(ScoringCore, UpdateRowsByCudaIpcResolveWhereCudaIpcInputsAreOffered) {
  v1::Tensor rows;
  rows.set_name("rows");
  rows.set_dtype(v1::F32);
  rows.add_shape(3);
  rows.add_shape(4);
  rows.mutable_cuda_ipc()->set_handle(std::string(64, 'h'));
  rows.mutable_cuda_ipc()->set_offset(256);
  rows.mutable_cuda_ipc()->set_byte_size(3 * 4 * 4);
  InputCaller local;
  local.peer = "ipv4:127.0.0.1:1";
  InputCaller remote;
  remote.peer = "ipv4:10.0.0.2:1";

  InProcessWorkers pool(2);
  const auto cpu_inputs = Inputs(2, "cpu");
  auto r = cpu_inputs->ResolveTensor(rows, "rows", local);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_EQ(ReasonOf(r.status()), v1::CUDA_IPC_UNAVAILABLE) << r.status();
  EXPECT_NE(r.status().message().find("rows: "), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find("send the rows as bytes"), std::string::npos) << r.status();

  ServiceConfig cuda = Config("token", false);
  cuda.backend = "cuda";
  const auto cuda_inputs = Inputs(2, "cuda");
  ScoringCore cuda_core(pool.workers(true), cuda, *cuda_inputs);
  ASSERT_TRUE(cuda_core.Info().cuda_ipc_inputs());
  r = cuda_inputs->ResolveTensor(rows, "rows", local);
  ASSERT_TRUE(r.ok()) << r.status();
  const InputSource& src = **r;
  EXPECT_EQ(src.kind(), InputKind::kCudaIpc);
  EXPECT_FALSE(src.rules().readable_here);
  EXPECT_EQ(src.byte_size(), 48);
  internal::v1::WorkItem item;
  ASSERT_TRUE(src.Refer(16, 32, &item));
  EXPECT_EQ(item.cuda_ipc().handle(), std::string(64, 'h'));
  EXPECT_EQ(item.cuda_ipc().offset(), 256 + 16);
  EXPECT_EQ(item.cuda_ipc().byte_size(), 32);

  // A client on another host; a malformed reference (named, no reason).
  r = cuda_inputs->ResolveTensor(rows, "rows", remote);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_EQ(ReasonOf(r.status()), v1::CUDA_IPC_UNAVAILABLE) << r.status();
  rows.mutable_cuda_ipc()->set_byte_size(47);
  r = cuda_inputs->ResolveTensor(rows, "rows", local);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_EQ(ReasonOf(r.status()), v1::ERROR_REASON_UNSPECIFIED) << r.status();
  EXPECT_EQ(pool.runs(), 0);
}

// Issue 31 item 7: a worker's error reaches the caller with the worker's
// own reason. A CUDA IPC job whose worker lacks the head
// (FAILED_PRECONDITION, LM_HEAD_VERSION_UNAVAILABLE) is not relabelled
// CUDA_IPC_UNAVAILABLE (the client would re-send it as bytes, to fail again);
// only a worker that could not open the handle says CUDA_IPC_UNAVAILABLE.
TEST(ScoringCore, AWorkersErrorKeepsItsReasonForACudaIpcJob) {
  constexpr int64_t kT = 6, kH = 8, kV = 16;
  LmHeads heads{LmHeads::Options{}};
  LmHeadVersion v;
  v.head = "default";
  v.version = "v1";
  v.source.dtype = v1::BF16;
  v.source.vocab_size = kV;
  v.source.hidden_size = kH;
  v.sha256 = KnownSha256("ab12");
  ASSERT_TRUE(heads.Add(v).ok());
  ServiceConfig config = Config("token", false);
  config.backend = "cuda";
  config.lm_heads = &heads;
  absl::Status worker_error;
  int runs = 0;
  CoreWorkers workers{1, /*same_host=*/true,
                      [&](const Plan& plan, const RunBounds&) -> absl::StatusOr<std::vector<WorkResult>> {
                        ++runs;
                        EXPECT_TRUE(plan.items.at(0).item.has_cuda_ipc());
                        return worker_error;
                      }};
  const auto inputs = Inputs(1, "cuda");
  ScoringCore core(workers, config, *inputs);
  ASSERT_TRUE(core.Info().cuda_ipc_inputs());
  v1::ScoreRequest req = RandomHiddenRequest(kT, kH, kV, 7);
  for (auto& t : *req.mutable_inputs())
    if (t.name() == "hidden_states") {
      t.mutable_cuda_ipc()->set_handle(std::string(64, 'h'));
      t.mutable_cuda_ipc()->set_byte_size(kT * kH * 2);
    }
  CallContext local;
  local.caller.peer = "ipv4:127.0.0.1:1";

  worker_error = WithReason(absl::FailedPreconditionError("worker 0: this worker holds no lm_head 'default'"),
                            v1::LM_HEAD_VERSION_UNAVAILABLE);
  auto r = core.Score(req, local);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_EQ(ReasonOf(r.status()), v1::LM_HEAD_VERSION_UNAVAILABLE) << r.status();

  // A FAILED_PRECONDITION without a reason stays without one.
  worker_error = absl::FailedPreconditionError("worker 0: something else");
  r = core.Score(req, local);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_EQ(ReasonOf(r.status()), v1::ERROR_REASON_UNSPECIFIED) << r.status();

  // The worker that could not open the handle: the client sends bytes.
  worker_error =
      WithReason(absl::FailedPreconditionError("worker 0: cudaIpcOpenMemHandle failed"), v1::CUDA_IPC_UNAVAILABLE);
  r = core.Score(req, local);
  EXPECT_EQ(ReasonOf(r.status()), v1::CUDA_IPC_UNAVAILABLE) << r.status();
  EXPECT_EQ(runs, 3);
}

TEST(ScoringCore, ACallThatIsAlreadyCancelledOrPastItsDeadlineEnds) {
  InProcessWorkers pool(1);
  const auto inputs = Inputs(1);
  ScoringCore core(pool.workers(true), Config("token", false), *inputs);
  const GoldenCase c = LoadGolden(LogitsGoldenNames().front());
  CallContext cancelled;
  cancelled.cancelled = [] { return true; };
  auto r = core.Score(GoldenRequest(c), cancelled);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kCancelled) << r.status();
  CallContext late;
  late.deadline = std::chrono::system_clock::now() - std::chrono::seconds(1);
  r = core.Score(GoldenRequest(c), late);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  EXPECT_EQ(core.admission().requests(), 0);
}

TEST(ScoringCore, SamplingMasksCountTheirCopiesInTheAdmission) {
  constexpr int kWorkers = 2;
  constexpr int64_t T = 6, V = 50;
  InProcessWorkers pool(kWorkers);
  const auto inputs = Inputs(kWorkers);
  ScoringCore core(pool.workers(true), Config("vocab", false), *inputs);
  v1::ScoreRequest req = RandomPackedRequest("logits", T, V, V, 7);
  // Without a mask the request holds its message's bytes.
  auto plain_ticket = core.admission().Admit(0, 0);
  ASSERT_TRUE(plain_ticket.ok()) << plain_ticket.status();
  CallContext call;
  call.received = &*plain_ticket;
  auto plain = core.Score(req, call);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain_ticket->bytes(), static_cast<int64_t>(req.ByteSizeLong()));
  const v1::Tensor* lp = FindOutput(*plain, "token_logprobs");
  ASSERT_NE(lp, nullptr);
  const int64_t n = static_cast<int64_t>(Floats(*lp).size());
  // Every position keeps 40 of the 50 ids.
  std::vector<int64_t> offsets{0}, ids;
  for (int64_t o = 0; o < n; ++o) {
    for (int64_t v = 0; v < 40; ++v) ids.push_back(v);
    offsets.push_back(static_cast<int64_t>(ids.size()));
  }
  auto add = [&](const char* name, std::vector<int64_t>& data) {
    v1::Tensor* t = req.add_inputs();
    t->set_name(name);
    t->set_dtype(v1::I64);
    t->add_shape(static_cast<int64_t>(data.size()));
    t->set_data(data.data(), data.size() * sizeof(int64_t));
  };
  add("sampling_mask_offsets", offsets);
  add("sampling_mask_ids", ids);
  auto masked_ticket = core.admission().Admit(0, 0);
  ASSERT_TRUE(masked_ticket.ok()) << masked_ticket.status();
  call.received = &*masked_ticket;
  auto masked = core.Score(req, call);
  ASSERT_TRUE(masked.ok()) << masked.status();
  // The front-end's copies: its job's (4 B per id), the workers' items'
  // (4) and their serialized form (up to 5).
  const int64_t nnz = static_cast<int64_t>(ids.size());
  EXPECT_GE(masked_ticket->bytes(), static_cast<int64_t>(req.ByteSizeLong()) + 13 * nnz);
  EXPECT_EQ(core.admission().bytes(), plain_ticket->bytes() + masked_ticket->bytes())
      << "the tickets hold their shares until released";
}

}  // namespace
}  // namespace logprob::testing
