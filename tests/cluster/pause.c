/* The test node's Pod sandbox process (containerd's sandbox_image): holds the Pod's namespaces,
 * reaps zombies, exits on SIGINT/SIGTERM. Built static by node.sh (there is no registry to pull
 * registry.k8s.io/pause from). */
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

static void reap(int sig) {
  (void)sig;
  while (waitpid(-1, 0, WNOHANG) > 0) {
  }
}

static void stop(int sig) {
  (void)sig;
  _exit(0);
}

int main(void) {
  signal(SIGINT, stop);
  signal(SIGTERM, stop);
  signal(SIGCHLD, reap);
  for (;;) pause();
}
