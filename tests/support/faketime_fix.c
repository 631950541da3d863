/* Preloaded before libfaketime by tests/unit/ota/test_update_clock.py.

   libfaketime 0.9.10 with FAKETIME_DONT_FAKE_MONOTONIC=1 fails every
   clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, ...) with EINVAL, and that is how Python's
   time.sleep() sleeps. Sleeps on any clock but CLOCK_REALTIME go straight to the kernel here;
   the rest is libfaketime's. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

int clock_nanosleep(clockid_t clock, int flags, const struct timespec *req, struct timespec *rem) {
    if (clock != CLOCK_REALTIME) {
        return syscall(SYS_clock_nanosleep, clock, flags, req, rem) == 0 ? 0 : errno;
    }
    static int (*next)(clockid_t, int, const struct timespec *, struct timespec *);
    if (next == NULL) {
        next = (int (*)(clockid_t, int, const struct timespec *, struct timespec *))dlsym(
            RTLD_NEXT, "clock_nanosleep");
    }
    return next(clock, flags, req, rem);
}
