/* gpupoll: what a CUDA program feels, inside a container that has no Python.
 *
 *     gpupoll PATH LOG [INTERVAL_MS]
 *
 * open(PATH, O_RDWR) every INTERVAL_MS (default 10) and close it again. Appends to LOG (line
 * buffered, CLOCK_REALTIME seconds so the host can line it up with the journal):
 *     START <t> <path>                 once
 *     DENIED <t> <errno name>          each failed open
 *     WINDOW <first denied t> <next ok t> <seconds> <denied opens>
 *                                      when an open succeeds after failed ones
 *     ALIVE <t> <opens> <denied>       once a second
 * Built static on the host (gcc -static): the container image is busybox only.
 * SIGTERM/SIGINT: a last ALIVE line (with an open WINDOW closed as "OPEN"), then exit 0.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static volatile sig_atomic_t stop;

static void on_signal(int sig) { (void)sig; stop = 1; }

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static const char *errname(int e)
{
    switch (e) {
    case EPERM: return "EPERM";
    case EACCES: return "EACCES";
    case ENOENT: return "ENOENT";
    case ENXIO: return "ENXIO";
    case ENODEV: return "ENODEV";
    default: return "EOTHER";
    }
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: gpupoll PATH LOG [INTERVAL_MS]\n");
        return 2;
    }
    long interval_ms = argc > 3 ? atol(argv[3]) : 10;
    FILE *log = fopen(argv[2], "a");
    if (!log) {
        perror(argv[2]);
        return 2;
    }
    setvbuf(log, NULL, _IOLBF, 0);
    signal(SIGTERM, on_signal);
    signal(SIGINT, on_signal);
    struct timespec nap = { interval_ms / 1000, (interval_ms % 1000) * 1000000L };
    unsigned long opens = 0, denied = 0, run = 0;
    double first_denied = 0, last_alive = now();
    fprintf(log, "START %.6f %s\n", last_alive, argv[1]);
    while (!stop) {
        int fd = open(argv[1], O_RDWR | O_CLOEXEC);
        int err = errno;
        double t = now();
        opens++;
        if (fd >= 0) {
            close(fd);
            if (run) {
                fprintf(log, "WINDOW %.6f %.6f %.6f %lu\n", first_denied, t, t - first_denied, run);
                run = 0;
            }
        } else {
            denied++;
            if (!run++)
                first_denied = t;
            fprintf(log, "DENIED %.6f %s\n", t, errname(err));
        }
        if (t - last_alive >= 1.0) {
            fprintf(log, "ALIVE %.6f %lu %lu\n", t, opens, denied);
            last_alive = t;
        }
        nanosleep(&nap, NULL);
    }
    if (run)
        fprintf(log, "WINDOW %.6f OPEN %.6f %lu\n", first_denied, now() - first_denied, run);
    fprintf(log, "ALIVE %.6f %lu %lu\n", now(), opens, denied);
    return 0;
}
