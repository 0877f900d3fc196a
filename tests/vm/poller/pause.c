/* pause: the pod infra container's process, standing in for catatonit (`catatonit -P`), which
 * Podman builds its local pause image from and which the guest image does not ship.
 * Built static on the host beside gpupoll; the guest installs it where Podman looks for catatonit.
 * Sleeps until SIGTERM or SIGINT, then exits 0; reaps nothing (it runs alone in its namespace).
 */
#include <signal.h>
#include <unistd.h>

static volatile sig_atomic_t stop;

static void on_signal(int sig) { (void)sig; stop = 1; }

int main(void)
{
    signal(SIGTERM, on_signal);
    signal(SIGINT, on_signal);
    while (!stop)
        pause();
    return 0;
}
