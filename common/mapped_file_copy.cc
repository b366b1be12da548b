#include "common/mapped_file_copy.h"

#include <setjmp.h>
#include <signal.h>

#include <atomic>
#include <cstring>
#include <mutex>

namespace logprob {
namespace {

struct Guard {
  sigjmp_buf env;
  const char* begin;
  const char* end;
};

thread_local Guard* volatile tl_guard = nullptr;
struct sigaction previous_action;

void OnSigbus(int sig, siginfo_t* info, void* context) {
  Guard* const g = tl_guard;
  const char* const at = static_cast<const char*>(info->si_addr);
  if (g != nullptr && at >= g->begin && at < g->end) siglongjmp(g->env, 1);
  // Not ours: as if this handler were not installed.
  if ((previous_action.sa_flags & SA_SIGINFO) != 0 && previous_action.sa_sigaction != nullptr) {
    previous_action.sa_sigaction(sig, info, context);
  } else if (previous_action.sa_handler != SIG_DFL && previous_action.sa_handler != SIG_IGN) {
    previous_action.sa_handler(sig);
  } else {
    // Returning re-runs the faulting access, which now gets the default
    // action (a fault SIGBUS cannot be ignored).
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(SIGBUS, &dfl, nullptr);
  }
}

void InstallOnce() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction action {};
    action.sa_sigaction = OnSigbus;
    action.sa_flags = SA_SIGINFO | SA_NODEFER;  // siglongjmp restores the mask itself
    sigemptyset(&action.sa_mask);
    sigaction(SIGBUS, &action, &previous_action);
  });
}

}  // namespace

bool CopyFromMappedFile(char* dst, const char* src, size_t n) {
  if (n == 0) return true;
  InstallOnce();
  Guard guard;
  guard.begin = src;
  guard.end = src + n;
  // savemask 1: the jump restores this thread's signal mask.
  if (sigsetjmp(guard.env, 1) != 0) {
    tl_guard = nullptr;
    return false;
  }
  tl_guard = &guard;
  // The copy stays between the two stores (the handler reads tl_guard).
  std::atomic_signal_fence(std::memory_order_seq_cst);
  std::memcpy(dst, src, n);
  std::atomic_signal_fence(std::memory_order_seq_cst);
  tl_guard = nullptr;
  return true;
}

}  // namespace logprob
