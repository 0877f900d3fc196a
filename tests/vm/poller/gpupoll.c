/* gpupoll: what a CUDA program feels, inside a container that has no Python.
 *
 *     gpupoll PATH LOG [INTERVAL_MS [CONTROL]]
 *
 * open(PATH, O_RDWR) every INTERVAL_MS (default 10) and close it again; with CONTROL (a device
 * the runtime granted through the same rules, e.g. /dev/null), open that right after PATH in the
 * same round, so a denial that hits every device of the container shows on both. Appends to LOG
 * (line buffered, CLOCK_REALTIME seconds so the host can line it up with the journal):
 *     START <t> <path>                 once
 *     DENIED <t> <errno name>          each failed open
 *     WINDOW <first denied t> <next ok t> <seconds> <denied opens>
 *                                      when an open succeeds after failed ones
 *     ALIVE <t> <opens> <denied>       once a second
 *     CDENIED, CWINDOW                 the same as DENIED, WINDOW for CONTROL
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

struct probe {
    const char *path, *denied_tag, *window_tag;
    unsigned long denied, run;
    double first_denied;
};

static const char *errname(int e);

/* One open of p->path at about now(); logs a denial and, at the first success after some, the window. */
static void probe(FILE *log, struct probe *p)
{
    int fd = open(p->path, O_RDWR | O_CLOEXEC);
    int err = errno;
    double t = now();
    if (fd >= 0) {
        close(fd);
        if (p->run) {
            fprintf(log, "%s %.6f %.6f %.6f %lu\n", p->window_tag, p->first_denied, t, t - p->first_denied, p->run);
            p->run = 0;
        }
    } else {
        p->denied++;
        if (!p->run++)
            p->first_denied = t;
        fprintf(log, "%s %.6f %s\n", p->denied_tag, t, errname(err));
    }
}

static void close_window(FILE *log, struct probe *p)
{
    if (p->run)
        fprintf(log, "%s %.6f OPEN %.6f %lu\n", p->window_tag, p->first_denied, now() - p->first_denied, p->run);
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
    struct probe gpu = { argv[1], "DENIED", "WINDOW", 0, 0, 0 };
    struct probe control = { argc > 4 ? argv[4] : NULL, "CDENIED", "CWINDOW", 0, 0, 0 };
    unsigned long opens = 0;
    double last_alive = now();
    fprintf(log, "START %.6f %s\n", last_alive, argv[1]);
    if (control.path)
        fprintf(log, "CONTROL %.6f %s\n", last_alive, control.path);
    while (!stop) {
        probe(log, &gpu);
        if (control.path)
            probe(log, &control);
        double t = now();
        opens++;
        if (t - last_alive >= 1.0) {
            fprintf(log, "ALIVE %.6f %lu %lu\n", t, opens, gpu.denied);
            last_alive = t;
        }
        nanosleep(&nap, NULL);
    }
    close_window(log, &gpu);
    if (control.path)
        close_window(log, &control);
    fprintf(log, "ALIVE %.6f %lu %lu\n", now(), opens, gpu.denied);
    return 0;
}
