// The stale-error helpers of the CUDA backend (worker/cuda/cuda_error.h)
// and GrowingBuffer::Reserve's failure path, on the CPU: a fake CUDA
// runtime keeps the per-thread "last error" the way cudaGetLastError()
// does (reset on read unless sticky), so nothing here needs a device.
#include "worker/cuda/cuda_error.h"

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

#include "worker/cuda/device_buffers.h"
#include "worker/cuda/lt_status.h"
#include "worker/cuda/nccl_poll.h"

namespace logprob::cuda {
namespace {

// The runtime's per-thread last error, as the real one behaves: a failing
// call records its error; GetLastError returns it and resets it to
// cudaSuccess unless it is sticky.
struct FakeRuntime {
  static cudaError_t last;
  static bool sticky;
  static int reads;
  static void Reset() {
    last = cudaSuccess;
    sticky = false;
    reads = 0;
  }
  // A runtime call that returns `e` (and records it when it is an error).
  static cudaError_t Call(cudaError_t e) {
    if (e != cudaSuccess && !sticky) last = e;
    return e;
  }
  // A kernel launch (<<<...>>>): returns nothing, records its error.
  static void Launch(cudaError_t e) { Call(e); }
  static void MakeSticky(cudaError_t e) {
    last = e;
    sticky = true;
  }
  static cudaError_t GetLastError() {
    ++reads;
    const cudaError_t e = last;
    if (!sticky) last = cudaSuccess;
    return e;
  }
};
cudaError_t FakeRuntime::last = cudaSuccess;
bool FakeRuntime::sticky = false;
int FakeRuntime::reads = 0;

class CudaErrors : public ::testing::Test {
 protected:
  void SetUp() override { FakeRuntime::Reset(); }
};

// A launcher as worker/cuda/*.cu writes it.
cudaError_t Launcher(cudaError_t launch_error) {
  const LaunchCheck<FakeRuntime> check;
  FakeRuntime::Launch(launch_error);
  return check.Result();
}

// The launcher before the fix: `return cudaGetLastError()` after the launch
// (what worker/cuda/lm_head_transform.cu still did before issue 50).
cudaError_t OldLauncher(cudaError_t launch_error) {
  FakeRuntime::Launch(launch_error);
  return FakeRuntime::GetLastError();
}

TEST_F(CudaErrors, AQueryThatIsNotReadyLeavesNothingForTheNextLaunch) {
  // The NCCL poll: not ready twice, then done.
  EXPECT_EQ(ClearedError<FakeRuntime>(FakeRuntime::Call(cudaErrorNotReady)), cudaErrorNotReady);
  EXPECT_EQ(FakeRuntime::last, cudaSuccess);
  EXPECT_EQ(ClearedError<FakeRuntime>(FakeRuntime::Call(cudaErrorNotReady)), cudaErrorNotReady);
  EXPECT_EQ(ClearedError<FakeRuntime>(FakeRuntime::Call(cudaSuccess)), cudaSuccess);
  EXPECT_EQ(FakeRuntime::reads, 2);  // success reads nothing
  // Even the launcher of old would now see its own (absent) error.
  EXPECT_EQ(OldLauncher(cudaSuccess), cudaSuccess);
}

TEST_F(CudaErrors, WithoutClearingTheOldLauncherReportsTheStaleNotReady) {
  // What issue 35 item 1 describes, so the test above means something.
  FakeRuntime::Call(cudaErrorNotReady);
  EXPECT_EQ(OldLauncher(cudaSuccess), cudaErrorNotReady);
}

TEST_F(CudaErrors, ALaunchCheckReportsItsOwnErrorNotAStaleOne) {
  FakeRuntime::Call(cudaErrorNotReady);  // left by a query nobody cleared
  EXPECT_EQ(Launcher(cudaSuccess), cudaSuccess);
  EXPECT_EQ(FakeRuntime::last, cudaSuccess);

  FakeRuntime::Call(cudaErrorMemoryAllocation);  // a stale failed allocation
  EXPECT_EQ(Launcher(cudaErrorInvalidConfiguration), cudaErrorInvalidConfiguration);
  EXPECT_EQ(FakeRuntime::last, cudaSuccess);  // the launch's error is read, not left behind
  EXPECT_EQ(Launcher(cudaSuccess), cudaSuccess);
}

TEST_F(CudaErrors, AStickyErrorIsStillReported) {
  FakeRuntime::MakeSticky(cudaErrorIllegalAddress);
  EXPECT_EQ(Launcher(cudaSuccess), cudaErrorIllegalAddress);
  EXPECT_EQ(ClearedError<FakeRuntime>(FakeRuntime::Call(cudaErrorNotReady)), cudaErrorNotReady);
  EXPECT_EQ(Launcher(cudaSuccess), cudaErrorIllegalAddress);
}

// An allocator whose next allocation fails (as cudaMalloc does: the error
// is returned and recorded as the thread's last error).
struct FailingAlloc {
  static constexpr const char* kName = "cudaMalloc";
  static bool fail;
  static int live;
  static char storage[64];
  static cudaError_t Allocate(void** p, size_t n) {
    if (fail || n > sizeof storage) {
      *p = nullptr;
      return FakeRuntime::Call(cudaErrorMemoryAllocation);
    }
    *p = storage;
    ++live;
    return FakeRuntime::Call(cudaSuccess);
  }
  static void Free(void* p) {
    if (p != nullptr) --live;
  }
};
bool FailingAlloc::fail = false;
int FailingAlloc::live = 0;
char FailingAlloc::storage[64];

TEST_F(CudaErrors, AFailedReserveIsReturnedAndNotLeftBehind) {
  FailingAlloc::fail = false;
  FailingAlloc::live = 0;
  {
    GrowingBuffer<FailingAlloc, FakeRuntime> buffer;
    ASSERT_TRUE(buffer.Reserve(16).ok());
    EXPECT_EQ(buffer.size(), 16u);
    EXPECT_EQ(FailingAlloc::live, 1);

    FailingAlloc::fail = true;
    const absl::Status s = buffer.Reserve(32);
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
    EXPECT_EQ(std::string(s.message()).rfind("CUDA cudaMalloc: cudaErrorMemoryAllocation", 0), 0u) << s;
    EXPECT_EQ(buffer.size(), 0u);  // the old block was freed before the try
    EXPECT_EQ(buffer.get(), nullptr);
    EXPECT_EQ(FailingAlloc::live, 0);
    EXPECT_EQ(FakeRuntime::last, cudaSuccess);
    EXPECT_EQ(OldLauncher(cudaSuccess), cudaSuccess);

    FailingAlloc::fail = false;
    ASSERT_TRUE(buffer.Reserve(32).ok());
    EXPECT_EQ(buffer.size(), 32u);
    EXPECT_TRUE(buffer.Reserve(8).ok());  // no growth needed
    EXPECT_EQ(buffer.size(), 32u);
  }
  EXPECT_EQ(FailingAlloc::live, 0);
}

// Issue 35 item 2: the errors that break the context for good are told
// apart from the ones a caller handles, and map to UNAVAILABLE (the pool
// re-forms with a fresh worker process) instead of INTERNAL.
TEST_F(CudaErrors, KnownStickyErrorsAreStickyWithoutAsking) {
  for (const cudaError_t e :
       {cudaErrorIllegalAddress, cudaErrorLaunchFailure, cudaErrorIllegalInstruction, cudaErrorAssert,
        cudaErrorECCUncorrectable, cudaErrorHardwareStackError, cudaErrorMisalignedAddress, cudaErrorLaunchTimeout}) {
    SCOPED_TRACE(cudaGetErrorName(e));
    FakeRuntime::Reset();
    EXPECT_TRUE(IsStickyError<FakeRuntime>(e));
  }
}

TEST_F(CudaErrors, HandledErrorsAreNotStickyAndAreCleared) {
  for (const cudaError_t e :
       {cudaErrorNotReady, cudaErrorMemoryAllocation, cudaErrorInvalidValue, cudaErrorInvalidResourceHandle}) {
    SCOPED_TRACE(cudaGetErrorName(e));
    FakeRuntime::Reset();
    FakeRuntime::Call(e);
    EXPECT_FALSE(IsStickyError<FakeRuntime>(e));
    EXPECT_EQ(FakeRuntime::last, cudaSuccess);  // not left behind for the next launch
  }
  EXPECT_FALSE(IsStickyError<FakeRuntime>(cudaSuccess));
  EXPECT_EQ(FakeRuntime::reads, 2);  // the last error read, cleared, read again: nothing
}

TEST_F(CudaErrors, AnUnlistedErrorThatDoesNotClearIsSticky) {
  // e.g. cudaErrorUnknown after a device fell off the bus: every call of
  // the context reports it, so the last error never clears.
  FakeRuntime::MakeSticky(cudaErrorUnknown);
  EXPECT_TRUE(IsStickyError<FakeRuntime>(cudaErrorUnknown));
  FakeRuntime::Reset();
  FakeRuntime::Call(cudaErrorUnknown);
  EXPECT_FALSE(IsStickyError<FakeRuntime>(cudaErrorUnknown));
}

TEST_F(CudaErrors, NoUsableDeviceIsNotADeviceFault) {
  // The runtime repeats an initialisation failure (no driver, no device)
  // like a sticky error; it is a configuration error all the same.
  for (const cudaError_t e : {cudaErrorInsufficientDriver, cudaErrorNoDevice, cudaErrorInitializationError}) {
    SCOPED_TRACE(cudaGetErrorName(e));
    FakeRuntime::Reset();
    FakeRuntime::MakeSticky(e);
    EXPECT_FALSE(IsStickyError<FakeRuntime>(e));
    EXPECT_EQ(CudaStatusOf<FakeRuntime>(e, "cudaMalloc").code(), absl::StatusCode::kInternal);
  }
}

TEST_F(CudaErrors, StickyErrorsAreUnavailableOthersInternal) {
  StickyErrorSeen().store(false);
  EXPECT_TRUE(CudaStatusOf<FakeRuntime>(cudaSuccess, "event").ok());
  FakeRuntime::Call(cudaErrorNotReady);
  absl::Status s = CudaStatusOf<FakeRuntime>(cudaErrorNotReady, "event");
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(std::string(s.message()), "CUDA event: cudaErrorNotReady (device not ready)");
  EXPECT_FALSE(StickyErrorSeen().load());

  FakeRuntime::MakeSticky(cudaErrorIllegalAddress);
  s = CudaStatusOf<FakeRuntime>(cudaErrorIllegalAddress, "device work");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(std::string(s.message()).rfind("CUDA device fault in device work: cudaErrorIllegalAddress", 0), 0u) << s;
  EXPECT_TRUE(StickyErrorSeen().load());
  StickyErrorSeen().store(false);
}

// Issue 50: the head transform's launcher (the kernel after every GEMM of a
// head with a bias, scale or softcap) with a stale error on the thread, as
// a handled cudaHostUnregister or cudaMemGetInfo failure left it: the
// launcher of old reported it as the transformed GEMM's failure.
TEST_F(CudaErrors, AStaleErrorBeforeATransformedGemmIsNotItsFailure) {
  for (const cudaError_t stale : {cudaErrorHostMemoryNotRegistered, cudaErrorInvalidValue, cudaErrorNotReady}) {
    SCOPED_TRACE(cudaGetErrorName(stale));
    FakeRuntime::Reset();
    FakeRuntime::Call(stale);
    EXPECT_EQ(OldLauncher(cudaSuccess), stale);  // the bug, so the check below means something
    FakeRuntime::Call(stale);
    EXPECT_EQ(Launcher(cudaSuccess), cudaSuccess);
    // The handled call, cleared where it happens (UnregisterHostMemory,
    // device_memory_bytes now do): even the old launcher is clean.
    EXPECT_EQ(ClearedError<FakeRuntime>(FakeRuntime::Call(stale)), stale);
    EXPECT_EQ(OldLauncher(cudaSuccess), cudaSuccess);
  }
}

// Issue 50: cuBLASLt's CUBLAS_STATUS_EXECUTION_FAILED after a device fault
// is the sticky CUDA error's UNAVAILABLE (the pool re-forms), not INTERNAL.
TEST_F(CudaErrors, AnExecutionFailureOverAStickyFaultIsUnavailable) {
  StickyErrorSeen().store(false);
  FakeRuntime::MakeSticky(cudaErrorIllegalAddress);
  int asked = 0;
  auto context = [&asked] {
    ++asked;
    return FakeRuntime::Call(cudaErrorIllegalAddress);  // every call of a broken context reports it
  };
  const absl::Status s = LtStatusOf<FakeRuntime>(CUBLAS_STATUS_EXECUTION_FAILED, "matmul", context);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_EQ(std::string(s.message()).rfind("CUDA device fault in matmul: cudaErrorIllegalAddress", 0), 0u) << s;
  EXPECT_EQ(asked, 1);
  EXPECT_TRUE(StickyErrorSeen().load());
  StickyErrorSeen().store(false);
}

TEST_F(CudaErrors, AnExecutionFailureOfAWorkingContextIsInternalAndLeavesNothing) {
  StickyErrorSeen().store(false);
  // The GEMM's kernel failed to launch (a non-sticky launch error left on
  // the thread); the stream is still busy with earlier work.
  FakeRuntime::Call(cudaErrorLaunchOutOfResources);
  absl::Status s = LtStatusOf<FakeRuntime>(CUBLAS_STATUS_EXECUTION_FAILED, "matmul",
                                           [] { return FakeRuntime::Call(cudaErrorNotReady); });
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_EQ(std::string(s.message()),
            "cuBLASLt matmul: CUBLAS_STATUS_EXECUTION_FAILED (the function failed to launch on the GPU); CUDA: "
            "cudaErrorLaunchOutOfResources")
      << s;
  EXPECT_EQ(FakeRuntime::last, cudaSuccess);  // neither the launch error nor the query's not-ready is left
  EXPECT_FALSE(StickyErrorSeen().load());
  // Any other status is INTERNAL and asks nothing.
  int asked = 0;
  s = LtStatusOf<FakeRuntime>(CUBLAS_STATUS_NOT_SUPPORTED, "heuristic", [&asked] {
    ++asked;
    return cudaSuccess;
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(std::string(s.message()).rfind("cuBLASLt heuristic: CUBLAS_STATUS_NOT_SUPPORTED", 0), 0u) << s;
  EXPECT_EQ(asked, 0);
  EXPECT_TRUE(LtStatusOf<FakeRuntime>(CUBLAS_STATUS_SUCCESS, "matmul", [] { return cudaSuccess; }).ok());
}

// A clock the test moves: PollNccl's deadline without waiting for it.
struct FakeClock {
  using duration = std::chrono::steady_clock::duration;
  using time_point = std::chrono::steady_clock::time_point;
  static time_point t;
  static time_point now() { return t; }
};
FakeClock::time_point FakeClock::t{};

// Issue 50: ncclCommInitRankConfig without blocking, polled with a deadline.
TEST(NcclPoll, ReadyInProgressThenDoneAndAnErrorEndThePoll) {
  std::vector<ncclResult_t> answers = {ncclInProgress, ncclInProgress, ncclSuccess};
  size_t polls = 0;
  FakeClock::t = {};
  const auto deadline = FakeClock::t + std::chrono::seconds(5);
  auto next = [&] { return answers[polls++]; };
  EXPECT_EQ(PollNccl<FakeClock>(next, deadline, std::chrono::microseconds(0)), ncclSuccess);
  EXPECT_EQ(polls, 3u);
  answers = {ncclInProgress, ncclRemoteError};
  polls = 0;
  EXPECT_EQ(PollNccl<FakeClock>(next, deadline, std::chrono::microseconds(0)), ncclRemoteError);
  EXPECT_EQ(polls, 2u);
}

TEST(NcclPoll, APeerThatNeverJoinsEndsAtTheDeadline) {
  FakeClock::t = {};
  const auto deadline = FakeClock::t + std::chrono::seconds(60);
  size_t polls = 0;
  auto never = [&] {
    ++polls;
    FakeClock::t += std::chrono::seconds(1);  // each poll, a second later
    return ncclInProgress;
  };
  EXPECT_EQ(PollNccl<FakeClock>(never, deadline, std::chrono::microseconds(0)), ncclInProgress);
  EXPECT_EQ(polls, 60u);
  // Past the deadline already: asked once all the same.
  polls = 0;
  EXPECT_EQ(PollNccl<FakeClock>(never, deadline, std::chrono::microseconds(0)), ncclInProgress);
  EXPECT_EQ(polls, 1u);
}

}  // namespace
}  // namespace logprob::cuda
