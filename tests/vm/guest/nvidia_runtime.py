"""nvidia-container-runtime's legacy mode, for the guest: a runc wrapper that adds the prestart
hook (/usr/bin/nvidia-container-runtime-hook prestart) to the bundle's config.json on `create`
(and `run`), then execs runc with the same arguments. Docker's `--runtime=nvidia` (daemon.json
`runtimes`) and containerd's `ctr run --runc-binary` call it exactly like runc.
"""
import json
import os
import sys

RUNC = "/usr/sbin/runc"
HOOK = "/usr/bin/nvidia-container-runtime-hook"
# runc's global options that take a value (everything before the subcommand)
GLOBAL_WITH_VALUE = {"--root", "--log", "--log-format", "--criu", "--rootless"}


def subcommand(args):
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("-"):
            i += 2 if a in GLOBAL_WITH_VALUE else 1
            continue
        return i
    return None


def bundle_of(args):
    for i, a in enumerate(args):
        if a in ("--bundle", "-b") and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--bundle="):
            return a.split("=", 1)[1]
    return os.getcwd()


def add_hook(bundle):
    path = os.path.join(bundle, "config.json")
    with open(path) as f:
        spec = json.load(f)
    prestart = spec.setdefault("hooks", {}).setdefault("prestart", [])
    if not any(h.get("path") == HOOK for h in prestart):
        prestart.append({"path": HOOK, "args": [os.path.basename(HOOK), "prestart"]})
        with open(path + ".tmp", "w") as f:
            json.dump(spec, f)
        os.rename(path + ".tmp", path)


def main():
    args = sys.argv[1:]
    i = subcommand(args)
    if i is not None and args[i] in ("create", "run"):
        add_hook(bundle_of(args[i + 1:]))
    os.execv(RUNC, [RUNC] + args)


if __name__ == "__main__":
    main()
