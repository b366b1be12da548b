// ThreadSanitizer builds only (-DLOGPROB_SANITIZE=thread, CMakeLists.txt).
//
// Debian's Abseil is not built with TSan, so TSan cannot see absl::Mutex
// and absl::CondVar synchronise anything, and would report every member
// guarded by one as a data race. The linker wraps the entry points the
// project calls (ld --wrap=SYMBOL sends our calls to __wrap_SYMBOL, which
// calls the library's __real_SYMBOL), and each wrapper tells TSan about
// the acquire or release through its mutex annotations
// (<sanitizer/tsan_interface.h>). Calls inside libabsl itself are not
// wrapped; only the project's own code is checked.
//
// LOGPROB_ABSL_NS is the mangled inline namespace of the installed Abseil
// (e.g. 7debian3), read from absl/base/options.h by CMake.
#include <sanitizer/tsan_interface.h>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

#define LOGPROB_CAT2(a, b) a##b
#define LOGPROB_CAT(a, b) LOGPROB_CAT2(a, b)
// _ZN4absl<ns>5Mutex<name>Ev and _ZN4absl<ns>7CondVar<name>...
#define MUTEX_SYM(prefix, name) LOGPROB_CAT(prefix, LOGPROB_CAT(_ZN4absl, LOGPROB_CAT(LOGPROB_ABSL_NS, name)))

using absl::CondVar;
using absl::Mutex;

extern "C" {

void MUTEX_SYM(__real_, 5Mutex4LockEv)(Mutex* mu);
void MUTEX_SYM(__real_, 5Mutex6UnlockEv)(Mutex* mu);
bool MUTEX_SYM(__real_, 5Mutex7TryLockEv)(Mutex* mu);
void MUTEX_SYM(__real_, 5MutexD1Ev)(Mutex* mu);
void MUTEX_SYM(__real_, 7CondVar4WaitEPNS0_5MutexE)(CondVar* cv, Mutex* mu);
bool MUTEX_SYM(__real_, 7CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE)(CondVar* cv, Mutex* mu,
                                                                              absl::Duration timeout);
bool MUTEX_SYM(__real_, 7CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE)(CondVar* cv, Mutex* mu, absl::Time deadline);

void MUTEX_SYM(__wrap_, 5Mutex4LockEv)(Mutex* mu) {
  __tsan_mutex_pre_lock(mu, 0);
  MUTEX_SYM(__real_, 5Mutex4LockEv)(mu);
  __tsan_mutex_post_lock(mu, 0, 0);
}

void MUTEX_SYM(__wrap_, 5Mutex6UnlockEv)(Mutex* mu) {
  __tsan_mutex_pre_unlock(mu, 0);
  MUTEX_SYM(__real_, 5Mutex6UnlockEv)(mu);
  __tsan_mutex_post_unlock(mu, 0);
}

bool MUTEX_SYM(__wrap_, 5Mutex7TryLockEv)(Mutex* mu) {
  __tsan_mutex_pre_lock(mu, __tsan_mutex_try_lock);
  const bool locked = MUTEX_SYM(__real_, 5Mutex7TryLockEv)(mu);
  __tsan_mutex_post_lock(mu, locked ? __tsan_mutex_try_lock : __tsan_mutex_try_lock_failed, 0);
  return locked;
}

void MUTEX_SYM(__wrap_, 5MutexD1Ev)(Mutex* mu) {
  __tsan_mutex_destroy(mu, 0);
  MUTEX_SYM(__real_, 5MutexD1Ev)(mu);
}

}  // extern "C"

namespace {

/// A CondVar wait releases `mu` and takes it again before returning.
template <typename Fn>
auto AroundWait(Mutex* mu, Fn&& wait) {
  __tsan_mutex_pre_unlock(mu, 0);
  __tsan_mutex_post_unlock(mu, 0);
  auto result = wait();
  __tsan_mutex_pre_lock(mu, 0);
  __tsan_mutex_post_lock(mu, 0, 0);
  return result;
}

}  // namespace

extern "C" {

void MUTEX_SYM(__wrap_, 7CondVar4WaitEPNS0_5MutexE)(CondVar* cv, Mutex* mu) {
  AroundWait(mu, [&] {
    MUTEX_SYM(__real_, 7CondVar4WaitEPNS0_5MutexE)(cv, mu);
    return 0;
  });
}

bool MUTEX_SYM(__wrap_, 7CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE)(CondVar* cv, Mutex* mu,
                                                                              absl::Duration timeout) {
  return AroundWait(
      mu, [&] { return MUTEX_SYM(__real_, 7CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE)(cv, mu, timeout); });
}

bool MUTEX_SYM(__wrap_, 7CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE)(CondVar* cv, Mutex* mu,
                                                                           absl::Time deadline) {
  return AroundWait(
      mu, [&] { return MUTEX_SYM(__real_, 7CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE)(cv, mu, deadline); });
}

}  // extern "C"
