/* The bubblewrap sandbox's launcher, as one process: what sandboxes/bwrap.py's _LAUNCH does
 * through sh, unshare, mount, mkdir, chmod, chown and setpriv (ten programs started in turn),
 * done here with their system calls before bwrap is executed in this same process.
 *
 * Run as root with the environment _LAUNCH reads and bwrap's argv as its own:
 *   1. join the sandbox's cgroups (each file of SWERVE_CGROUP_PROCS, separated by spaces);
 *   2. a private mount namespace (unshare --mount --propagation private);
 *   3. a tmpfs of SWERVE_DISK_MB MiB on $SWERVE_STATE itself, for every write and every file
 *      of the sandbox's own: rw/upper/, rw/work/, rw/tmp/ (mode 1777), rw/upper/ owned by
 *      SWERVE_UID (on the host the folder keeps its owner record alone: no folder or file
 *      made and removed on the host's disk per sandbox, where ext4's inode allocator took
 *      8% of the worker's CPU in mkdir, bench/rollouts.py 2026-12-07);
 *   4. $SWERVE_STATE/merged: the overlay of SWERVE_LOWER on upper/, or SWERVE_LOWER bound as
 *      it is (SWERVE_WRITABLE), or upper/ bound when there is no lower layer;
 *   5. $SWERVE_STATE/passwd and group from SWERVE_PASSWD and SWERVE_GROUP, and resolv.conf
 *      from SWERVE_RESOLV where it is set and not empty;
 *   6. $SWERVE_STATE bound recursively on SWERVE_VIEW, and SWERVE_ETC (the copy of the host's
 *      /etc entries, sandboxes/etc.py) on SWERVE_ETC_VIEW;
 *   7. become SWERVE_UID (real, effective and saved uid and gid), no supplementary groups, no
 *      inheritable or ambient capabilities (setpriv --reuid --regid --clear-groups
 *      --inh-caps=-all), then execute argv[1..] found on PATH.
 * Any failure stops it before bwrap, with a line on stderr naming the step and exit status 1.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/capability.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#define PATH_MAX_LEN 4096

static void die(const char *fmt, ...) {
    int err = errno;
    va_list ap;
    fputs("swerve-launch: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, ": %s\n", strerror(err));
    exit(1);
}

static const char *need(const char *name) {
    const char *value = getenv(name);
    if (value == NULL) {
        errno = EINVAL;
        die("%s is not set", name);
    }
    return value;
}

static void path(char *out, const char *dir, const char *name) {
    if ((size_t)snprintf(out, PATH_MAX_LEN, "%s/%s", dir, name) >= PATH_MAX_LEN) {
        errno = ENAMETOOLONG;
        die("%s/%s", dir, name);
    }
}

static void write_file(const char *file, const char *text) {
    int fd = open(file, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    size_t left = strlen(text);
    if (fd < 0)
        die("open %s", file);
    while (left > 0) {
        ssize_t n = write(fd, text, left);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            die("write %s", file);
        }
        text += n, left -= (size_t)n;
    }
    if (close(fd) < 0)
        die("close %s", file);
}

int main(int argc, char **argv) {
    enum { N = PATH_MAX_LEN };
    char rw[N], upper[N], work[N], tmp[N], merged[N], file[N], options[3 * N + 64];
    const char *state = need("SWERVE_STATE"), *view = need("SWERVE_VIEW");
    const char *etc = need("SWERVE_ETC"), *etc_view = need("SWERVE_ETC_VIEW");
    const char *lower = need("SWERVE_LOWER"), *writable = need("SWERVE_WRITABLE");
    const char *uid_text = need("SWERVE_UID"), *disk_mb = need("SWERVE_DISK_MB");
    char *procs = strdup(need("SWERVE_CGROUP_PROCS")), *end;
    long uid = strtol(uid_text, &end, 10);

    if (argc < 2) {
        errno = EINVAL;
        die("usage: swerve-launch bwrap [arg...]");
    }
    if (*uid_text == '\0' || *end != '\0' || uid <= 0) {
        errno = EINVAL;
        die("SWERVE_UID %s", uid_text);
    }
    for (char *saved, *f = strtok_r(procs, " ", &saved); f != NULL; f = strtok_r(NULL, " ", &saved)) {
        char pid[32];
        snprintf(pid, sizeof pid, "%d\n", getpid());
        write_file(f, pid);
    }
    if (unshare(CLONE_NEWNS) < 0)
        die("unshare the mount namespace");
    if (mount("none", "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
        die("make / private");

    path(rw, state, "rw");
    path(upper, rw, "upper");
    path(work, rw, "work");
    path(tmp, rw, "tmp");
    path(merged, state, "merged");
    snprintf(options, sizeof options, "size=%sm,mode=0755", disk_mb);
    if (mount("swerve", state, "tmpfs", 0, options) < 0)
        die("mount a tmpfs of %s MiB on %s", disk_mb, state);
    mode_t mask = umask(0);
    umask(mask);
    if (mkdir(rw, 0755) < 0 || mkdir(merged, 0755) < 0)
        die("mkdir in %s", state);
    if (mkdir(upper, 0777 & ~mask) < 0 || mkdir(work, 0777 & ~mask) < 0 || mkdir(tmp, 0777 & ~mask) < 0)
        die("mkdir in %s", rw);
    if (chmod(tmp, 01777) < 0)
        die("chmod %s", tmp);
    if (chown(upper, (uid_t)uid, (gid_t)uid) < 0)
        die("chown %s", upper);
    if (*writable != '\0' && *lower != '\0') {
        if (mount(lower, merged, NULL, MS_BIND, NULL) < 0)
            die("bind %s on %s", lower, merged);
    } else if (*lower != '\0') {
        if ((size_t)snprintf(options, sizeof options, "lowerdir=%s,upperdir=%s,workdir=%s", lower, upper,
                             work) >= sizeof options) {
            errno = ENAMETOOLONG;
            die("overlay options");
        }
        if (mount("overlay", merged, "overlay", 0, options) < 0)
            die("mount the overlay of %s on %s", lower, merged);
    } else if (mount(upper, merged, NULL, MS_BIND, NULL) < 0) {
        die("bind %s on %s", upper, merged);
    }
    path(file, state, "passwd");
    write_file(file, need("SWERVE_PASSWD"));
    path(file, state, "group");
    write_file(file, need("SWERVE_GROUP"));
    const char *resolv = getenv("SWERVE_RESOLV");
    if (resolv != NULL && *resolv != '\0') {
        path(file, state, "resolv.conf");
        write_file(file, resolv);
    }
    if (mount(state, view, NULL, MS_BIND | MS_REC, NULL) < 0)
        die("bind %s on %s", state, view);
    if (mount(etc, etc_view, NULL, MS_BIND, NULL) < 0)
        die("bind %s on %s", etc, etc_view);

    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct caps[_LINUX_CAPABILITY_U32S_3];
    if (syscall(SYS_capget, &header, caps) < 0)
        die("capget");
    for (int i = 0; i < _LINUX_CAPABILITY_U32S_3; i++)
        caps[i].inheritable = 0;
    if (syscall(SYS_capset, &header, caps) < 0)
        die("clear the inheritable capabilities");
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0 && errno != EINVAL)
        die("clear the ambient capabilities");
    if (setgroups(0, NULL) < 0)
        die("clear the supplementary groups");
    if (setresgid((gid_t)uid, (gid_t)uid, (gid_t)uid) < 0)
        die("setresgid %ld", uid);
    if (setresuid((uid_t)uid, (uid_t)uid, (uid_t)uid) < 0)
        die("setresuid %ld", uid);
    execvp(argv[1], argv + 1);
    die("execute %s", argv[1]);
}
