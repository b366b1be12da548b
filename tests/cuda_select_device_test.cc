// SelectDevice (worker/cuda/select_device.h), the device selection of
// CudaLmHead's destructor, on the CPU: a fake CUDA runtime with a
// per-thread current device and last error, so nothing here needs a GPU.
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "worker/cuda/select_device.h"

namespace logprob::cuda {
namespace {

// The runtime's device selection: 4 devices, a per-thread current device
// (0 until the thread sets one, as cudaGetDevice reports), the last error
// as in cuda_error.h, and the SetDevice calls made (each one initialises
// that device's context in the real runtime).
struct FakeDevices {
  static constexpr int kCount = 4;
  static thread_local int current;
  static thread_local cudaError_t last;
  static thread_local std::vector<int> sets;
  static thread_local bool get_fails;
  static cudaError_t GetDevice(int* device) {
    if (get_fails) return Fail(cudaErrorNoDevice);
    *device = current;
    return cudaSuccess;
  }
  static cudaError_t SetDevice(int device) {
    if (device < 0 || device >= kCount) return Fail(cudaErrorInvalidDevice);
    sets.push_back(device);
    current = device;
    return cudaSuccess;
  }
  static cudaError_t GetLastError() {
    const cudaError_t e = last;
    last = cudaSuccess;
    return e;
  }
  static cudaError_t Fail(cudaError_t e) {
    last = e;
    return e;
  }
};
thread_local int FakeDevices::current = 0;
thread_local cudaError_t FakeDevices::last = cudaSuccess;
thread_local std::vector<int> FakeDevices::sets;
thread_local bool FakeDevices::get_fails = false;

TEST(CudaSelectDevice, AThreadThatNeverSelectedADeviceGetsTheOwnersDevice) {
  // A gRPC thread dropping the last reference to rank 1's lm_head.
  bool ok = false;
  int after = -1;
  std::vector<int> sets;
  std::thread t([&] {
    ok = SelectDevice<FakeDevices>(1);
    after = FakeDevices::current;
    sets = FakeDevices::sets;
  });
  t.join();
  EXPECT_TRUE(ok);
  EXPECT_EQ(after, 1);
  EXPECT_EQ(sets, (std::vector<int>{1}));  // device 0 is never selected (no stray context)
}

TEST(CudaSelectDevice, TheCurrentDeviceIsNotSelectedAgain) {
  std::thread t([] {
    FakeDevices::current = 3;
    EXPECT_TRUE(SelectDevice<FakeDevices>(3));
    EXPECT_TRUE(FakeDevices::sets.empty());
    EXPECT_TRUE(SelectDevice<FakeDevices>(0));
    EXPECT_EQ(FakeDevices::sets, (std::vector<int>{0}));
  });
  t.join();
}

TEST(CudaSelectDevice, FailuresAreReportedAndCleared) {
  std::thread t([] {
    EXPECT_FALSE(SelectDevice<FakeDevices>(7));  // no such device
    EXPECT_EQ(FakeDevices::last, cudaSuccess);   // not left for the next kernel launch
    EXPECT_EQ(FakeDevices::current, 0);
    FakeDevices::get_fails = true;  // cudaGetDevice failing: select anyway
    EXPECT_TRUE(SelectDevice<FakeDevices>(2));
    EXPECT_EQ(FakeDevices::last, cudaSuccess);
    EXPECT_EQ(FakeDevices::current, 2);
  });
  t.join();
}

}  // namespace
}  // namespace logprob::cuda
